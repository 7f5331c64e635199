// The decode megakernel: whole decode steps, many per launch, in one cooperative grid.
//
// Each step runs every layer (RMSNorm + Q/K/V, QK-norm + RoPE + KV append + flash-decoding
// attention, o_proj + residual, RMSNorm + gate/up + SwiGLU, down + residual), the final norm and
// LM head, then samples on the GPU, streams the token to a host-mapped ring buffer and checks the
// stop conditions (EOS ids, step budget, capacity, a host-written cancel flag). Sampling
// parameters are read from host-mapped memory every step, so a change applies to the next token.
// The host never sits in the per-token loop.
//
// Weights never wait. Every block owns a fixed slice of every weight matrix (and, for
// attention, a fixed set of key/value chunks), so the whole sequence of bytes a block will read
// is known in advance: a ring of shared-memory stages is refilled by bulk asynchronous copies
// (TMA on sm_90, cp.async before) as soon as a stage is consumed, running ahead across phases,
// layers and steps. The dependent chain of a phase is then only its input vector (a few KB from
// L2), the math on shared memory, and the wait for the values it reads.
//
// There is no grid-wide barrier. The phases are Q/K/V | attention | o_proj | gate/up | down,
// five a layer, plus the blocks' best logits and the chosen token a step; every value another
// block reads carries the number of the phase that wrote it (see "tagged" below), and a
// consumer waits only for the values it reads. Attention: the block whose chunk holds the new
// position computes that key and value itself, each warp keeps an online softmax over its keys
// of every stage, and the last block to finish a key/value head merges its chunks.
// Sampling: each block offers its own top-k logits as candidates (top-k <= CAND), block 0
// samples among them; otherwise block 0 samples over the whole vocabulary.
//
// QW_MK_SKIP leaves parts out, for timing only (the results are then wrong): 1 weight copies,
// 2 attention, 4 the waits for other blocks' values, 8 sampling, 16 every copy and the
// producer's reckoning of its source (it only arrives on the stage's barrier), 32 the proxy
// fence before a copy of weights (sm_90).
// QW_MK_TIMELINE records when each phase's input and weights arrived in every block
// (mk_timeline.cuh).
//
// Where the parts are (each header includes the one before it):
//   mk_layout.cuh     geometry constants, MegaArgs and MegaLayer (mirrored by the host)
//   mk_tagged.cuh     tagged values: put, take, take_all
//   mk_pipe.cuh       the stage pipeline: each block's ranges, the tile order, issue/wait/release
//   mk_matvec.cuh     matrix-vector phases: input vectors, row dot products, rows_phase
//   mk_attention.cuh  QK-norm + RoPE + KV append, flash-decoding chunks, the merge
//   mk_sample.cuh     host parameters, candidates, block 0's choice
//   this file         the step loop: which phase runs when, with which tags
// docs/megakernel.md draws a step's dependency graph: which phase waits for which values.
#include "mk_sample.cuh"

#if QW_MK_MOE
namespace {
// A mixture of experts: every block routes for itself, from the router's logits (tag `tag`),
// on its producer warp (moe.cuh, route_warp), which then issues the experts' stages it held
// until now (mk_pipe.cuh, issue_held): the warp that reads the routing to issue stages is the
// one that writes it, so no other warp's writes can race with its reads. `key`: routing_key
// of the layer. The consumers read the weights after a block barrier (route_block's, or
// megakernel's while they stage gate/up's input meanwhile: ROUTE_OVERLAP).
__device__ __forceinline__ void route_producer(const MegaArgs& a, const tagged_t* logits,
                                               unsigned tag, int key) {
    constexpr int PER = qwm::PER_LANE;
    const int lane = threadIdx.x & 31;
    {
        const tagged_t* at[PER];
        float got[PER];
#pragma unroll
        for (int j = 0; j < PER; ++j) at[j] = logits + min(lane + 32 * j, qwm::EXPERTS - 1);
        take_all(at, tag, got);
#pragma unroll
        for (int j = 0; j < PER; ++j)
            if (lane + 32 * j < qwm::EXPERTS) routing.logits[lane + 32 * j] = got[j];
        __syncwarp();
        qwm::route_warp(routing.logits, routing.weights, routing.ids);
        if (lane == 0) routing.routed = key;
        __syncwarp();
        issue_held(a);
    }
}

__device__ __forceinline__ void route_block(const MegaArgs& a, const tagged_t* logits,
                                           unsigned tag, int key) {
    if (threadIdx.x >> 5 == PRODUCER) route_producer(a, logits, tag, key);
    __syncthreads();
}

// Narrow rows on the tensor cores (their input in shared memory, stage_f16): the consumer
// warps stage gate/up's input while the producer warp routes (QW_MK_OVERLAP 1, the default; 0:
// after it). Measured +4-5% on 30B-A3B FP8 and int4 at position 1 (H100, docs/perf.md).
// racecheck reports hazards in the later whole-block stagings of a build with it on: its model
// of the block barrier breaks after a named barrier over part of the block, as
// tests/racecheck_probe.py shows on a kernel race-free by construction (docs/perf.md, sixth
// session); memcheck and synccheck check it, and racecheck the build with it off.
#ifndef QW_MK_OVERLAP
#define QW_MK_OVERLAP 1
#endif
constexpr bool ROUTE_OVERLAP = NARROW_MMA && QW_MK_OVERLAP != 0;

// Routes the block (route_producer) and, ROUTE_OVERLAP, stages gate/up's input meanwhile:
// returns what its dot products are multiplied by (stage_f16; the consumer warps').
__device__ __forceinline__ float route_and_stage(const MegaArgs& a, const tagged_t* logits,
                                                 unsigned tag, int key, const bf16_t* norm) {
    if constexpr (!ROUTE_OVERLAP) {
        route_block(a, logits, tag, key);
        return 0.f;
    } else {
        float scale = 0.f;
        // The consumers overwrite the router's input vector only after every warp has read it
        // (the producer too: its copy in registers); then they stage gate/up's behind barrier 1
        // (stage_f16's, the consumer warps alone) while the producer routes.
        __syncthreads();
        if (threadIdx.x >> 5 == PRODUCER)
            route_producer(a, logits, tag, key);
        else
            scale = stage_f16<qw::hidden, 0, 0, CWARPS * 32>(a.x, nullptr, tag - 1u, norm, a.eps);
        __syncthreads();  // the routing, and gate/up's input
        return scale;
    }
}

// The experts' down rows (one phase, mk_layout.cuh): each virtual row's sum (expert slot k's
// share of hidden row r) goes to its slot here, and the one that completes a row's TOPK adds
// them in slot order, so the sum never depends on which warp finished first. Written and read
// with integer atomics, relaxed, ordered by the fences and the count (as rows_phase_whole's
// stage sums).
__shared__ float expert_sums[qwm::TOPK][DOWN_ROWS];
__shared__ unsigned expert_counts[DOWN_ROWS];

// Virtual row v's sum s, of a block with n hidden rows; returns whether row v % n is complete,
// with its total.
__device__ __forceinline__ bool expert_row_done(int v, int n, float s, float& total) {
    const int k = v / n, r = v - k * n;
    unsigned* sums = reinterpret_cast<unsigned*>(&expert_sums[0][0]);
    atomicExch(sums + k * DOWN_ROWS + r, __float_as_uint(s));
    __threadfence_block();  // the sum before its count
    if (atomicAdd(&expert_counts[r], 1u) + 1u != qwm::TOPK) return false;
    expert_counts[r] = 0u;
    __threadfence_block();  // the other sums after their counts
    total = 0.f;
#pragma unroll
    for (int j = 0; j < qwm::TOPK; ++j) total += __uint_as_float(atomicOr(sums + j * DOWN_ROWS + r, 0u));
    return true;
}
}  // namespace
#endif

// The arguments come by value, so the host can queue the next launch while this one runs.
extern "C" __global__ void __launch_bounds__(mk::THREADS, 1) decode_megakernel(const MegaArgs args) {
    __shared__ float red[2 * RED];
    __shared__ AttnShared attn_sh;
    __shared__ qws::SampleShared<THREADS> sample_sh;
    __shared__ SampleParams step_params;
    __shared__ MegaArgs args_sh;    // read from shared memory: no registers held for it
    __shared__ float resid[RESID];  // the residual rows this block owns, by thread
    __shared__ int chosen_sh;
    if (threadIdx.x == 0) args_sh = args;
    init_ranges();
    init_stage_sums();
#if QW_MK_MOE
    for (int i = threadIdx.x; i < DOWN_ROWS; i += THREADS) expert_counts[i] = 0u;
#endif
    QW_TL_INIT();
    __syncthreads();
    const MegaArgs& a = args_sh;
    // Written only by earlier launches, so every block reads the same value and all leave.
    if (*a.stopped) return;
    for (int i = threadIdx.x; i < a.num_layers * static_cast<int>(sizeof(MegaLayer) / 8); i += THREADS)
        reinterpret_cast<unsigned long long*>(layer_table())[i] =
            reinterpret_cast<const unsigned long long*>(a.layers)[i];
    __syncthreads();
    const int hid_lo = row_ranges[1].x;
    // The block's LM-head logits, kept in shared memory for its sampling candidates.
    const int lm_lo = row_ranges[3].x, lm_n = row_ranges[3].y - lm_lo;
    const bool lm_fits = lm_n <= LM_ROWS;
    float* lm_vals = vec_buf() + qw::hidden;  // (after the LM head's input vector)
    unsigned* scratch = reinterpret_cast<unsigned*>(red);
    const NoPre no_pre;
    const int pos0 = *a.pos;
    int pos = pos0;
    int token = *a.token;
    unsigned merge_base = 0;
    // Tags: step i's phases are numbered from i * per_step + 1: five per layer (six with a
    // router), then the blocks' best logits and the chosen token.
    const unsigned per_step = LAYER_TAGS * a.num_layers + 3u;
    const int forwards = min(a.max_steps - (a.feed_first ? 0 : 1), a.capacity - pos0);
    unsigned consumed = 0;  // stages of the stream used so far
    int fwd = 0;            // forwards run so far (the stream's steps: mk_pipe.cuh, Cursor f)
    pipe_start(a, pos0, forwards);
    if (a.feed_first && blockIdx.x == gridDim.x - 1 && threadIdx.x == 0) {
        a.params[0] = read_host_params(a, a.first_step);  // the first step's parameters
        __threadfence();  // before this block's outputs, which every LM head depends on
    }

    for (int i = 0; i < a.max_steps; ++i) {
        const unsigned base = (static_cast<unsigned>(a.epoch & 0xfff) << 20) +
                              static_cast<unsigned>(i) * per_step + 1u;
        const unsigned best_tag = base + LAYER_TAGS * a.num_layers, chosen_tag = best_tag + 1u;
        float best = QW_NEG_INF;
        int best_i = 0x7fffffff;
        if (i > 0 || a.feed_first) {
            token = min(max(token, 0), qw::vocab - 1);
            const AttnGeom geom = attn_geom(pos + 1, a.splits);  // the same in every layer
            const bf16_t* embed_row = a.embed + static_cast<long long>(token) * qw::hidden;
            for (int layer = 0; layer < a.num_layers; ++layer) {
                const MegaLayer& L = layer_table()[layer];
                const unsigned t = base + LAYER_TAGS * layer;  // this layer's Q/K/V tag
                {  // Q, K, V from the normed residual (layer 0: the embedding row, whose rows
                   // each block also takes as its part of the residual stream)
                    if (layer == 0 && threadIdx.x < row_ranges[1].y - hid_lo)
                        resid[threadIdx.x] = bf16_to_f32(embed_row[hid_lo + threadIdx.x]);
                    const bf16_t* row = layer == 0 ? embed_row : nullptr;
                    rows_phase<qw::hidden, false>(
                        a, consumed, QKV_ROWS,
                        [&](VecArg<qw::hidden>& v) {
                            return load_normed<qw::hidden>(v, a.x, row, t - 1u, L.input_norm, a.eps);
                        },
                        no_pre, [&](int r, float s, float, int) { put(a.qkv + r, s, t); });
                }
                if (!(QW_MK_SKIP & 2))
                    attention_phase(a, consumed, L, pos, geom, t, merge_base, attn_sh);
                // The counters count only chunks that are merged (more than one a head).
                if (geom.splits > 1) merge_base += geom.splits;
                rows_phase<qw::q_size, false>(
                    a, consumed, qw::hidden,
                    [&](VecArg<qw::q_size>& v) {
                        return load_plain<qw::q_size>(v, a.attn, t + 1u, !(QW_MK_SKIP & 2));
                    },
                    no_pre, [&](int r, float s, float, int) { put(a.x + r, resid[r - hid_lo] += s, t + 2u); });
#if QW_MK_MOE
                {
                    // The router's logits (bf16 rows, RMSNorm as gate/up's), tag t + 3, after h.
                    tagged_t* logits = a.h + H_LEN;
                    rows_phase<qw::hidden, false, qw::BF16>(
                        a, consumed, qwm::EXPERTS,
                        [&](VecArg<qw::hidden>& v) {
                            return load_normed<qw::hidden, false>(v, a.x, nullptr, t + 2u,
                                                                  L.post_norm, a.eps);
                        },
                        no_pre, [&](int r, float s, float, int) { put(logits + r, s, t + 3u); });
#if QW_MK_OVERLAP
                    const float gu_scale = route_and_stage(a, logits, t + 3u,
                                                           routing_key(a, fwd, layer), L.post_norm);
#else  // (QW_MK_OVERLAP 0, the build racecheck checks: no variable, no capture)
                    route_block(a, logits, t + 3u, routing_key(a, fwd, layer));
#endif
                    // The chosen experts' SwiGLU outputs, each times its routing weight, tag t + 4.
                    rows_phase<qw::hidden, true>(
                        a, consumed, KI,
                        [&](VecArg<qw::hidden>& v) {
#if QW_MK_OVERLAP
                            if constexpr (ROUTE_OVERLAP) return gu_scale;
#endif
                            return load_normed<qw::hidden>(v, a.x, nullptr, t + 2u, L.post_norm, a.eps);
                        },
                        no_pre, [&](int r, float g, float u, int) {
                            put(a.h + r, routing.weights[r / MINTER] * (silu(g) * u), t + 4u);
                        });
                    // Their down rows as one phase (every slot's part of h staged, the rows of
                    // a hidden row's experts summed in slot order), the layer's output, tag t + 5.
                    // (Eight phases, one an expert, were 21-30% slower: docs/perf.md.)
                    const int nb = row_ranges[1].y - hid_lo;
                    rows_phase_whole<MINTER, false, qw::wfmt, true>(
                        a, consumed, qw::hidden,
                        [&](Vec<MINTER>&) {
                            if constexpr (NARROW_MMA) {
                                return stage_f16<KI, MINTER, DOWN_PAD>(a.h, nullptr, t + 4u,
                                                                       nullptr, 0.f);
                            } else {
                                stage_vector<KI>(a.h, nullptr, t + 4u, false);
                                return 1.f;
                            }
                        },
                        no_pre, [&](int v, float s, float, int) {
                            float total;
                            if (expert_row_done(v, nb, s, total))
                                put(a.x + hid_lo + v % nb, resid[v % nb] += total, t + 5u);
                        });
                    continue;
                }
#endif
                rows_phase<qw::hidden, true>(
                    a, consumed, qw::intermediate,
                    [&](VecArg<qw::hidden>& v) {
                        return load_normed<qw::hidden>(v, a.x, nullptr, t + 2u, L.post_norm, a.eps);
                    },
                    no_pre, [&](int r, float g, float u, int) { put(a.h + r, silu(g) * u, t + 3u); });
                rows_phase<qw::intermediate, false>(
                    a, consumed, qw::hidden,
                    [&](VecArg<qw::intermediate>& v) {
                        return load_plain<qw::intermediate>(v, a.h, t + 3u);
                    },
                    no_pre, [&](int r, float s, float, int) { put(a.x + r, resid[r - hid_lo] += s, t + 4u); });
            }
            // Final norm and LM head, with the penalties and each block's argmax on the way.
            // (The last block wrote this step's parameters before any output of its that the
            // x below depends on.)
            load_params(&step_params, a.params + (i & 1));
            rows_phase<qw::hidden, false, qw::BF16>(
                a, consumed, qw::vocab,
                [&](VecArg<qw::hidden>& v) {
                    return load_normed<qw::hidden, false>(v, a.x, nullptr, best_tag - 1u, a.final_norm,
                                                          a.eps);
                },
                [&](int r) {  // the penalties' inputs
                    // (strong loads: block 0 updated them during this launch)
                    if (!penalties_on(step_params)) return 0;
                    int count;
                    unsigned seen;
                    asm volatile("ld.relaxed.gpu.global.s32 %0, [%1];" : "=r"(count) : "l"(a.counts + r));
                    asm volatile("ld.relaxed.gpu.global.u8 %0, [%1];" : "=r"(seen) : "l"(a.seen + r));
                    return count * 2 + static_cast<int>(seen & 1u);
                },
                [&](int r, float s, float, int seen_count) {
                    a.logits[r] = s;
                    if (!(QW_MK_SKIP & 8)) {
                        const float l = qws::penalized(s, step_params, seen_count & 1, seen_count >> 1);
                        a.work[r] = l;
                        if (lm_fits) lm_vals[r - lm_lo] = l;
                        qws::argmax_merge(best, best_i, l, r);
                    }
                });
            ++pos;
            ++fwd;
        } else {
            // No token to feed: choose from the logits already there (left by prefill). Every
            // block reads the parameters from the host itself (once a launch at most).
            if (threadIdx.x == 0) step_params = read_host_params(a, a.first_step + i);
            __syncthreads();
            int lo, hi;
            block_range(qw::vocab, lo, hi);
            for (int r = lo + threadIdx.x; r < hi; r += THREADS) {
                const float l = qws::penalized(ld_cg(a.logits + r), step_params,
                                               ld_cg_u8(a.seen + r), ld_cg_int(a.counts + r));
                a.work[r] = l;
                if (lm_fits) lm_vals[r - lm_lo] = l;
                qws::argmax_merge(best, best_i, l, r);
            }
        }

        __syncthreads();  // every warp's logits are in lm_vals (warps leave a phase one by one)
        QW_TL_ENTER(mk_timeline::SAMPLE);
        // Sampling: each block's best logit and (sampling with a small top-k) its candidates,
        // after its logits; then block 0 chooses.
        const int k = step_params.top_k;
        const bool offer = !(QW_MK_SKIP & 8) && lm_fits && step_params.temperature > 0.f &&
                           k > 0 && k <= CAND;
        unsigned kth = 0;
        const int offered = offer ? block_candidates(a, lm_vals, lm_lo, lm_n, k, scratch, kth) : 0;
        qws::argmax_block<THREADS>(best, best_i, sample_sh.best_val, sample_sh.best_idx);
        if (threadIdx.x == 0) {
            __threadfence();  // this block's logits and candidates before its best
            put(a.best + 4 * blockIdx.x, best, best_tag);
            put(a.best + 4 * blockIdx.x + 1, __int_as_float(best_i), best_tag);
            // What the candidates are: the k they are the top of, and how many (-1: none).
            put(a.best + 4 * blockIdx.x + 2,
                __int_as_float(offer ? (k << 16) | min(offered, 0xffff) : -1), best_tag);
            put(a.best + 4 * blockIdx.x + 3, __uint_as_float(kth), best_tag);
            // While block 0 chooses, the last block fetches the next step's parameters from
            // the host (so a change applies to the next token), into the other slot.
            if (blockIdx.x == gridDim.x - 1 && i + 1 < a.max_steps) {
                a.params[(i + 1) & 1] = read_host_params(a, a.first_step + i + 1);
                __threadfence();
            }
        }
        if (blockIdx.x == 0) {
            const int chosen = block0_choose(a, step_params, offer, best_tag, red, sample_sh, token);
            if (threadIdx.x == 0) {
                a.counts[chosen] += 1;
                a.seen[chosen] = 1;
                *a.token = chosen;
                // One 8-byte store: the host sees the token and its sequence number together.
                const int n = a.first_step + i;
                asm volatile("st.volatile.global.v2.s32 [%0], {%1, %2};"
                             ::"l"(a.ring + 2 * (n % a.ring_len)), "r"(chosen), "r"(n + 1)
                             : "memory");
                // The cancel flag is read last, so a cancel seen by the host before this token
                // was stops the launch here.
                const int cancel = *reinterpret_cast<const volatile int*>(a.host + 10);
                bool ended = pos >= a.capacity || cancel != 0;
                for (int e = 0; e < a.n_eos; ++e) ended = ended || chosen == a.eos[e];
                if (ended) *a.stopped = 1;
                const bool stop = ended || i + 1 >= a.max_steps;
                __threadfence();  // the counts before the token that the others wait for
                put(a.chosen, __int_as_float(chosen | (stop ? static_cast<int>(0x80000000u) : 0)),
                    chosen_tag);
            }
        }
        if (threadIdx.x == 0) {
            chosen_sh = __float_as_int(take(a.chosen, chosen_tag));
            __threadfence();  // acquire: what block 0 wrote before (counts, the KV rows before)
        }
        __syncthreads();
        QW_TL_MARK(END);
        const int word = chosen_sh;
        token = word & 0x7fffffff;
        if (word & 0x80000000) break;
    }
    if (threadIdx.x >> 5 == PRODUCER) pipe_settle(a, consumed);  // (QW_MK_OWE)
    pipe_drain(consumed);
    if (blockIdx.x == 0 && threadIdx.x == 0) *a.pos = pos;
}
