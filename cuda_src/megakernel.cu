// The decode megakernel: whole decode steps, many per launch, in one cooperative grid.
// Each step runs every layer (RMSNorm + Q/K/V, QK-norm + RoPE + KV append + flash-decoding
// attention, o_proj + residual, RMSNorm + gate/up, SwiGLU + down + residual), the final norm and
// LM head, then samples on the GPU, streams the token to a host-mapped ring buffer and checks the
// stop conditions (EOS ids, step budget, capacity, a host-written cancel flag). Sampling
// parameters are read from host-mapped memory every step, so a change applies to the next token.
// The host never sits in the per-token loop.
//
// Phases are separated by a grid-wide barrier (all blocks are resident: cooperative launch).
// Attention needs none of its own: the block whose chunk holds the new position computes that
// key and value itself, and the last block to finish a key/value head merges its chunks
// (an atomic counter per head), so a layer costs five barriers.
#include "sampling.cuh"

namespace {
constexpr int THREADS = 512;
constexpr int WARPS = THREADS / 32;
constexpr int HD = qw::head_dim;
constexpr int MAX_CHUNK = 256;
constexpr int LANES_PER_KEY = HD / 8;
constexpr int KEYS_PER_PASS = THREADS / LANES_PER_KEY;
}  // namespace

struct MegaLayer {
    const bf16_t* input_norm;
    const bf16_t* qkv;
    const bf16_t* q_norm;
    const bf16_t* k_norm;
    const bf16_t* o;
    const bf16_t* post_norm;
    const bf16_t* gate_up;
    const bf16_t* down;
    bf16_t* k_cache;
    bf16_t* v_cache;
};

struct MegaArgs {
    const MegaLayer* layers;
    const bf16_t* embed;
    const bf16_t* final_norm;
    const bf16_t* lm_head;
    const float* inv_freq;
    float* x;
    float* qkv;
    float* attn;
    float* gu;
    float* logits;
    float* work;
    float* part_o;
    float* part_ml;
    unsigned* merge_count;  // [kv_heads], zero between layers
    float* partial_val;
    int* partial_idx;
    unsigned char* seen;
    int* counts;
    int* token;  // the token to feed next (in), the last token sampled (out)
    int* pos;    // cache length (in/out)
    int* stop;   // block 0 tells the others
    const int* eos;
    const SampleParams* params;  // host-mapped
    const int* cancel;           // host-mapped
    int* ring;                   // host-mapped: [0] tokens written by this launch, then the ids
    unsigned* barrier;           // [0] arrivals, [1] generation
    float eps;
    float scale;
    int num_layers;
    int capacity;
    int splits;  // the most chunks per kv head (the partial buffers' size)
    int n_eos;
    int max_steps;
    int feed_first;
    int first_step;
};

namespace {
__device__ __forceinline__ float silu(float g) { return g / (1.f + __expf(-g)); }

__device__ __forceinline__ int ld_volatile_int(const int* p) {
    return *reinterpret_cast<const volatile int*>(p);
}

// Sense-reversing grid barrier over all (co-resident) blocks.
__device__ void grid_barrier(unsigned* bar) {
    __syncthreads();
    if (threadIdx.x == 0) {
        volatile unsigned* generation = bar + 1;
        const unsigned gen = *generation;
        __threadfence();
        if (atomicAdd(bar, 1u) == gridDim.x - 1) {
            bar[0] = 0;
            __threadfence();
            atomicAdd(bar + 1, 1u);
        } else {
            while (*generation == gen) {
            }
        }
        __threadfence();
    }
    __syncthreads();
}

// out[r] (= or +=) W[r, :] . v over rows striped across every warp of the grid, R rows per warp
// at a time so that R x (K / 256) 16-byte loads per lane are in flight together. `make_vector`
// fills vs[0..K) in shared memory (ending with __syncthreads); each lane's first weight loads
// are issued before it, so they overlap the vector's preparation.
template <int K, int R, bool ADD, typename MakeVector>
__device__ void grid_gemv(const bf16_t* __restrict__ W, int rows, float* out, float* vs,
                          MakeVector make_vector) {
    constexpr int STEPS = K / 8;
    constexpr int PER_LANE = (STEPS + 31) / 32;
    constexpr int PRE = PER_LANE * R <= 16 ? PER_LANE : 16 / R;  // prefetched chunks per row
    const int lane = threadIdx.x & 31;
    const int warp_id = blockIdx.x * WARPS + (threadIdx.x >> 5);
    const int stride = gridDim.x * WARPS * R;
    auto load = [&](int row, int c) {
        return (row < rows && c < STEPS)
                   ? reinterpret_cast<const uint4*>(W + static_cast<long long>(row) * K)[c]
                   : make_uint4(0, 0, 0, 0);
    };
    uint4 w[R][PRE];
    int row0 = warp_id * R;
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
        for (int p = 0; p < PRE; ++p) w[r][p] = load(row0 + r, lane + p * 32);
    make_vector();
    for (; row0 < rows; row0 += stride) {
        float acc[R];
#pragma unroll
        for (int r = 0; r < R; ++r) {
            acc[r] = 0.f;
#pragma unroll
            for (int p = 0; p < PRE; ++p) {
                const int c = lane + p * 32;
                if (c < STEPS) acc[r] += dot8(w[r][p], vs + c * 8);
            }
        }
        for (int c = lane + PRE * 32; c < STEPS; c += 32) {
#pragma unroll
            for (int r = 0; r < R; ++r) acc[r] += dot8(load(row0 + r, c), vs + c * 8);
        }
        // The next rows' first loads go out before this row's reductions.
#pragma unroll
        for (int r = 0; r < R; ++r)
#pragma unroll
            for (int p = 0; p < PRE; ++p) w[r][p] = load(row0 + stride + r, lane + p * 32);
#pragma unroll
        for (int r = 0; r < R; ++r) {
            const float total = warp_sum(acc[r]);
            const int row = row0 + r;
            if (lane == 0 && row < rows) out[row] = ADD ? ld_cg(out + row) + total : total;
        }
    }
}

// vs = rmsnorm(v) * w over the hidden size; v is a float vector or (layer 0) an embedding row.
__device__ void make_normed(const float* v, const bf16_t* embed_row, const bf16_t* w, float eps,
                            float* vs, float* scratch) {
    float ss = 0.f;
    for (int j = threadIdx.x; j < qw::hidden; j += THREADS) {
        const float e = embed_row ? bf16_to_f32(embed_row[j]) : ld_cg(v + j);
        vs[j] = e;
        ss += e * e;
    }
    const float rstd = rsqrtf(block_sum(ss, scratch) / qw::hidden + eps);
    for (int j = threadIdx.x; j < qw::hidden; j += THREADS) vs[j] *= rstd * bf16_to_f32(w[j]);
    __syncthreads();
}

// RMSNorm over head_dim with weight w, then rotate-half RoPE at `pos`, of src (float) into dst.
__device__ void norm_rope_head(const float* src, const bf16_t* w, const float* inv_freq, int pos,
                               float eps, float* dst, float* scratch) {
    const int i = threadIdx.x;
    float a = 0.f, b = 0.f;
    if (i < HD / 2) {
        a = ld_cg(src + i);
        b = ld_cg(src + i + HD / 2);
    }
    const float rstd = rsqrtf(block_sum(a * a + b * b, scratch) / HD + eps);
    if (i < HD / 2) {
        a *= rstd * bf16_to_f32(w[i]);
        b *= rstd * bf16_to_f32(w[i + HD / 2]);
        float s, c;
        sincosf(static_cast<float>(pos) * inv_freq[i], &s, &c);
        dst[i] = a * c - b * s;
        dst[i + HD / 2] = b * c + a * s;
    }
    __syncthreads();
}

struct AttnShared {
    float q[qw::group][HD];
    float new_k[HD];
    float new_v[HD];
    float p[qw::group][MAX_CHUNK];
    float scratch[32];
    int last;
};

// One (kv head, chunk) item of flash-decoding at position pos; the block holding the new
// position also appends its key and value to the cache. Returns after writing the partial.
__device__ void attention_item(const MegaArgs& a, const MegaLayer& L, int kvh, int split, int pos,
                               int splits, AttnShared& sh) {
    const int len = pos + 1;
    const int chunk = max(16, (len + splits - 1) / splits);
    const int k_begin = split * chunk, k_end = min(len, k_begin + chunk);
    const int count = k_end - k_begin;
    const float* qkv = a.qkv;
    if (count <= 0) {
        for (int i = threadIdx.x; i < qw::group * HD; i += THREADS) {
            const int head = kvh * qw::group + i / HD;
            a.part_o[(static_cast<long long>(head) * splits + split) * HD + i % HD] = 0.f;
        }
        if (threadIdx.x < qw::group) {
            const int head = kvh * qw::group + threadIdx.x;
            a.part_ml[(head * splits + split) * 2] = QW_NEG_INF;
            a.part_ml[(head * splits + split) * 2 + 1] = 0.f;
        }
        return;
    }
    for (int gh = 0; gh < qw::group; ++gh)
        norm_rope_head(qkv + (kvh * qw::group + gh) * HD, L.q_norm, a.inv_freq, pos, a.eps,
                       sh.q[gh], sh.scratch);
    const bool has_new = k_begin <= pos && pos < k_end;
    bf16_t* kc = L.k_cache + static_cast<long long>(kvh) * a.capacity * HD;
    bf16_t* vc = L.v_cache + static_cast<long long>(kvh) * a.capacity * HD;
    if (has_new) {
        norm_rope_head(qkv + qw::q_size + kvh * HD, L.k_norm, a.inv_freq, pos, a.eps, sh.new_k,
                       sh.scratch);
        for (int d = threadIdx.x; d < HD; d += THREADS) {
            sh.new_v[d] = ld_cg(qkv + qw::q_size + qw::kv_size + kvh * HD + d);
            kc[static_cast<long long>(pos) * HD + d] = f32_to_bf16(sh.new_k[d]);
            vc[static_cast<long long>(pos) * HD + d] = f32_to_bf16(sh.new_v[d]);
        }
        __syncthreads();
    }
    // Scores: LANES_PER_KEY lanes per key, 16 bytes each; the new key comes from shared memory
    // (rounded to bf16 like the cached ones, so every chunk sees the same key).
    const int sub = threadIdx.x / LANES_PER_KEY, part = threadIdx.x % LANES_PER_KEY;
    for (int base = 0; base < count; base += KEYS_PER_PASS) {
        const int kidx = base + sub;
        const int key = k_begin + kidx;
        uint4 kv = make_uint4(0, 0, 0, 0);
        if (kidx < count) {
            if (key == pos) {
                const float* nk = sh.new_k + part * 8;
                kv = make_uint4(pack_bf16x2(nk[0], nk[1]), pack_bf16x2(nk[2], nk[3]),
                                pack_bf16x2(nk[4], nk[5]), pack_bf16x2(nk[6], nk[7]));
            } else {
                kv = ld_cg_u4(kc + static_cast<long long>(key) * HD + part * 8);
            }
        }
#pragma unroll
        for (int gh = 0; gh < qw::group; ++gh) {
            float dot = dot8(kv, &sh.q[gh][part * 8]);
#pragma unroll
            for (int o = LANES_PER_KEY / 2; o > 0; o >>= 1)
                dot += __shfl_xor_sync(0xffffffffu, dot, o);
            if (part == 0 && kidx < count) sh.p[gh][kidx] = dot * a.scale;
        }
    }
    __syncthreads();
    float m[qw::group], l[qw::group];
#pragma unroll
    for (int gh = 0; gh < qw::group; ++gh) {
        float mx = QW_NEG_INF;
        for (int i = threadIdx.x; i < count; i += THREADS) mx = fmaxf(mx, sh.p[gh][i]);
        m[gh] = block_max(mx, sh.scratch);
        float sum = 0.f;
        for (int i = threadIdx.x; i < count; i += THREADS) {
            const float e = __expf(sh.p[gh][i] - m[gh]);
            sh.p[gh][i] = e;
            sum += e;
        }
        l[gh] = block_sum(sum, sh.scratch);
    }
    __syncthreads();
    // P . V with 16-byte value loads: LANES_PER_KEY threads cover a key, KEYS_PER_PASS keys at
    // a time; the passes' partial sums are then added in shared memory (p is free by then).
    const int slot = threadIdx.x / LANES_PER_KEY, dim0 = (threadIdx.x % LANES_PER_KEY) * 8;
    float acc[qw::group][8];
#pragma unroll
    for (int gh = 0; gh < qw::group; ++gh)
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[gh][e] = 0.f;
    for (int i = slot; i < count; i += KEYS_PER_PASS) {
        const int key = k_begin + i;
        float vf[8];
        if (key == pos) {
#pragma unroll
            for (int e = 0; e < 8; ++e) vf[e] = bf16_to_f32(f32_to_bf16(sh.new_v[dim0 + e]));
        } else {
            const uint4 v = ld_cg_u4(vc + static_cast<long long>(key) * HD + dim0);
            vf[0] = bf16_lo(v.x); vf[1] = bf16_hi(v.x); vf[2] = bf16_lo(v.y); vf[3] = bf16_hi(v.y);
            vf[4] = bf16_lo(v.z); vf[5] = bf16_hi(v.z); vf[6] = bf16_lo(v.w); vf[7] = bf16_hi(v.w);
        }
#pragma unroll
        for (int gh = 0; gh < qw::group; ++gh) {
            const float pw = sh.p[gh][i];
#pragma unroll
            for (int e = 0; e < 8; ++e) acc[gh][e] += pw * vf[e];
        }
    }
    __syncthreads();
    float* sums = &sh.p[0][0];  // [group][HD], added slot by slot in a fixed order
    for (int s = 0; s < KEYS_PER_PASS; ++s) {
        if (slot == s) {
#pragma unroll
            for (int gh = 0; gh < qw::group; ++gh)
#pragma unroll
                for (int e = 0; e < 8; ++e) {
                    float* dst = sums + gh * HD + dim0 + e;
                    *dst = s == 0 ? acc[gh][e] : *dst + acc[gh][e];
                }
        }
        __syncthreads();
    }
    for (int i = threadIdx.x; i < qw::group * HD; i += THREADS) {
        const int head = kvh * qw::group + i / HD;
        a.part_o[(static_cast<long long>(head) * splits + split) * HD + i % HD] = sums[i];
    }
    if (threadIdx.x < qw::group) {
        const int head = kvh * qw::group + threadIdx.x;
        a.part_ml[(head * splits + split) * 2] = m[threadIdx.x];
        a.part_ml[(head * splits + split) * 2 + 1] = l[threadIdx.x];
    }
}

// Chunks per kv head for a context of `len` keys: at most 256 keys a chunk, and about two
// items per block once the context is long enough to fill the grid (fewer for short contexts,
// where a chunk of at least 32 keys keeps the merge small).
__device__ __forceinline__ int splits_for(int len, int most) {
    const int fill = (2 * gridDim.x + qw::kv_heads - 1) / qw::kv_heads;
    const int wanted = max((len + 255) / 256, min((len + 31) / 32, fill));
    return min(most, max(1, wanted));
}

// The last block to finish a kv head's chunks merges them into attn (its group's heads).
__device__ void merge_if_last(const MegaArgs& a, int kvh, int splits, AttnShared& sh) {
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0)
        sh.last = atomicAdd(&a.merge_count[kvh], 1u) == static_cast<unsigned>(splits) - 1u;
    __syncthreads();
    if (!sh.last) return;
    __threadfence();
    for (int i = threadIdx.x; i < qw::group * HD; i += THREADS) {
        const int head = kvh * qw::group + i / HD, d = i % HD;
        float mx = QW_NEG_INF;
        for (int s = 0; s < splits; ++s)
            mx = fmaxf(mx, ld_cg(a.part_ml + (head * splits + s) * 2));
        float acc = 0.f, total = 0.f;
        for (int s = 0; s < splits; ++s) {
            const float l = ld_cg(a.part_ml + (head * splits + s) * 2 + 1);
            if (l == 0.f) continue;
            const float w = __expf(ld_cg(a.part_ml + (head * splits + s) * 2) - mx);
            acc += w * ld_cg(a.part_o + (static_cast<long long>(head) * splits + s) * HD + d);
            total += w * l;
        }
        a.attn[head * HD + d] = acc / total;
    }
    if (threadIdx.x == 0) a.merge_count[kvh] = 0;
}
}  // namespace

extern "C" __global__ void __launch_bounds__(THREADS, 1) decode_megakernel(const MegaArgs* args) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    __shared__ float scratch[32];
    __shared__ qws::SampleShared<THREADS> sample_sh;
    __shared__ SampleParams step_params;
    const MegaArgs a = *args;
    float* vs = reinterpret_cast<float*>(smem_raw);
    AttnShared& attn_sh = *reinterpret_cast<AttnShared*>(smem_raw);
    unsigned long long* warp_hist = reinterpret_cast<unsigned long long*>(smem_raw);
    int pos = *a.pos;
    int written = 0;

    for (int i = 0; i < a.max_steps; ++i) {
        if (i > 0 || a.feed_first) {
            const int token = ld_cg_int(a.token);
            const int splits = splits_for(pos + 1, a.splits);
            const bf16_t* embed_row = a.embed + static_cast<long long>(token) * qw::hidden;
            for (int layer = 0; layer < a.num_layers; ++layer) {
                const MegaLayer L = a.layers[layer];
                // Q, K, V from the normed residual (layer 0 reads the embedding row directly,
                // and block 0 writes it as the residual stream).
                grid_gemv<qw::hidden, 2, false>(L.qkv, qw::q_size + 2 * qw::kv_size, a.qkv, vs, [&] {
                    make_normed(a.x, layer == 0 ? embed_row : nullptr, L.input_norm, a.eps, vs,
                                scratch);
                    if (layer == 0 && blockIdx.x == 0)
                        for (int j = threadIdx.x; j < qw::hidden; j += THREADS)
                            a.x[j] = bf16_to_f32(embed_row[j]);
                });
                grid_barrier(a.barrier);
                for (int item = blockIdx.x; item < qw::kv_heads * splits; item += gridDim.x) {
                    attention_item(a, L, item / splits, item % splits, pos, splits, attn_sh);
                    merge_if_last(a, item / splits, splits, attn_sh);
                }
                grid_barrier(a.barrier);
                grid_gemv<qw::q_size, 1, true>(L.o, qw::hidden, a.x, vs, [&] {
                    for (int j = threadIdx.x; j < qw::q_size; j += THREADS)
                        vs[j] = ld_cg(a.attn + j);
                    __syncthreads();
                });
                grid_barrier(a.barrier);
                grid_gemv<qw::hidden, 2, false>(L.gate_up, 2 * qw::intermediate, a.gu, vs, [&] {
                    make_normed(a.x, nullptr, L.post_norm, a.eps, vs, scratch);
                });
                grid_barrier(a.barrier);
                grid_gemv<qw::intermediate, 1, true>(L.down, qw::hidden, a.x, vs, [&] {
                    for (int j = threadIdx.x; j < qw::intermediate; j += THREADS)
                        vs[j] = silu(ld_cg(a.gu + j)) * ld_cg(a.gu + qw::intermediate + j);
                    __syncthreads();
                });
                grid_barrier(a.barrier);
            }
            grid_gemv<qw::hidden, 4, false>(a.lm_head, qw::vocab, a.logits, vs, [&] {
                make_normed(a.x, nullptr, a.final_norm, a.eps, vs, scratch);
            });
            ++pos;
            grid_barrier(a.barrier);
        }

        // Sampling: penalties and partial maxima over the grid, then block 0 chooses. The
        // parameters live in host memory (each read crosses PCIe): one thread per block reads
        // them, the block shares them.
        if (threadIdx.x == 0) {
            const volatile SampleParams* hp = a.params;
            step_params.temperature = hp->temperature;
            step_params.top_p = hp->top_p;
            step_params.min_p = hp->min_p;
            step_params.repetition_penalty = hp->repetition_penalty;
            step_params.presence_penalty = hp->presence_penalty;
            step_params.frequency_penalty = hp->frequency_penalty;
            step_params.top_k = hp->top_k;
            step_params.step = a.first_step + i;
            step_params.seed = hp->seed;
        }
        __syncthreads();
        const SampleParams p = step_params;
        float best = QW_NEG_INF;
        int best_i = 0x7fffffff;
        for (int v = blockIdx.x * THREADS + threadIdx.x; v < qw::vocab; v += gridDim.x * THREADS) {
            const float l = qws::penalized(ld_cg(a.logits + v), p, ld_cg_u8(a.seen + v),
                                           ld_cg_int(a.counts + v));
            a.work[v] = l;
            qws::argmax_merge(best, best_i, l, v);
        }
        qws::argmax_warp(best, best_i);
        if ((threadIdx.x & 31) == 0) {
            sample_sh.best_val[threadIdx.x >> 5] = best;
            sample_sh.best_idx[threadIdx.x >> 5] = best_i;
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            for (int w = 1; w < WARPS; ++w)
                qws::argmax_merge(best, best_i, sample_sh.best_val[w], sample_sh.best_idx[w]);
            a.partial_val[blockIdx.x] = best;
            a.partial_idx[blockIdx.x] = best_i;
        }
        grid_barrier(a.barrier);
        if (blockIdx.x == 0) {
            best = QW_NEG_INF;
            best_i = 0x7fffffff;
            for (int b = threadIdx.x; b < gridDim.x; b += THREADS)
                qws::argmax_merge(best, best_i, ld_cg(a.partial_val + b),
                                  ld_cg_int(a.partial_idx + b));
            qws::argmax_warp(best, best_i);
            __syncthreads();
            if ((threadIdx.x & 31) == 0) {
                sample_sh.best_val[threadIdx.x >> 5] = best;
                sample_sh.best_idx[threadIdx.x >> 5] = best_i;
            }
            __syncthreads();
            if (threadIdx.x == 0) {
                for (int w = 1; w < WARPS; ++w)
                    qws::argmax_merge(best, best_i, sample_sh.best_val[w], sample_sh.best_idx[w]);
                sample_sh.best_val[0] = best;
                sample_sh.best_idx[0] = best_i;
            }
            __syncthreads();
            const int token = qws::choose_token<THREADS>(a.work, p, sample_sh.best_val[0],
                                                         sample_sh.best_idx[0], p.step, sample_sh,
                                                         warp_hist);
            if (threadIdx.x == 0) {
                a.counts[token] += 1;
                a.seen[token] = 1;
                *a.token = token;
                a.ring[1 + written] = token;
                __threadfence_system();
                reinterpret_cast<volatile int*>(a.ring)[0] = written + 1;
                bool stop = i + 1 >= a.max_steps || pos >= a.capacity ||
                            ld_volatile_int(a.cancel) != 0;
                for (int e = 0; e < a.n_eos; ++e) stop = stop || token == a.eos[e];
                *a.stop = stop;
            }
        }
        ++written;
        grid_barrier(a.barrier);
        if (ld_cg_int(a.stop)) break;
    }
    if (blockIdx.x == 0 && threadIdx.x == 0) *a.pos = pos;
}
