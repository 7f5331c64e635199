// Matrix-vector phases: a warp's segment of the input vector in registers, dotted with the
// weight rows of each stage.
#pragma once
#include "mk_pipe.cuh"
#include "mk_timeline.cuh"

namespace {
using namespace mk;

__device__ __forceinline__ float silu(float g) { return g / (1.f + __expf(-g)); }

template <int K>
struct Vec {
    float v[cpl(K)][8];
};

// The block's warps sum their squares here (the vector itself goes to vec_buf()).
__shared__ float warp_sums[WARPS];

__device__ __forceinline__ void ld_tagged2(const tagged_t* p, tagged_t& a, tagged_t& b,
                                           bool strong) {
    if (strong)
        asm volatile("ld.relaxed.gpu.global.v2.u64 {%0,%1}, [%2];"
                     : "=l"(a), "=l"(b) : "l"(p) : "memory");
    else
        asm volatile("ld.global.cg.v2.u64 {%0,%1}, [%2];" : "=l"(a), "=l"(b) : "l"(p) : "memory");
}

// Loads a K-vector that other blocks are writing with `tag` (or, with `row`, a bf16 embedding
// row) into vec_buf() with the whole block, returning the sum of squares when asked.
template <int K>
__device__ __forceinline__ float stage_vector(const tagged_t* src, const bf16_t* row, unsigned tag,
                                              bool squares, bool wait = true) {
    float* buf = vec_buf();
    float ss = 0.f;
    // Warps leave a phase one by one (no barrier between its stages): the slowest may still be
    // reading the last phase's vector here, or its squares.
    __syncthreads();
    // Thread t takes pairs t, t + THREADS, ...: a warp's 16-byte loads are contiguous (whole
    // 128-byte lines), and a thread polls one pair at a time. (Polling more pairs of a thread
    // at once was slower: docs/perf.md, 2026-11-25.)
    for (int i = threadIdx.x; i < K / 2; i += THREADS) {
        float2 e;
        if (row) {
            const unsigned r = *reinterpret_cast<const unsigned*>(row + 2 * i);
            e = make_float2(bf16_lo(r), bf16_hi(r));
        } else {
            tagged_t w0, w1;
            for (bool strong = false;; strong = true) {
                if (strong) back_off();
                ld_tagged2(src + 2 * i, w0, w1, strong);
                if ((QW_MK_SKIP & 4) || !wait || (tag_of(w0) == tag && tag_of(w1) == tag)) break;
            }
            e = make_float2(value_of(w0), value_of(w1));
        }
        *reinterpret_cast<float2*>(buf + 2 * i) = e;
        ss += e.x * e.x + e.y * e.y;
    }
    if (squares) {
        ss = warp_sum(ss);
        if ((threadIdx.x & 31) == 0) warp_sums[threadIdx.x >> 5] = ss;
    }
    __syncthreads();
    float total = 0.f;
    if (squares) {
#pragma unroll
        for (int w = 0; w < WARPS; ++w) total += warp_sums[w];
    }
    return total;
}

// The input vector's 8-value chunk that this lane holds as its q-th: its warp's segment, the
// lanes interleaved (past chunks(K) for the last segment's spare lanes).
template <int K>
__device__ __forceinline__ int lane_chunk(int q) {
    const int lane = threadIdx.x & 31, seg = (threadIdx.x >> 5) % nseg(K);
    return seg * cpl(K) * 32 + lane + 32 * q;
}

// Each of the warp's 8-value chunks c of the staged vector (vec_buf) as out.v[q] = f(q, c, e).
template <int K, typename F>
__device__ __forceinline__ void from_staged(Vec<K>& out, F f) {
    const float* buf = vec_buf();
#pragma unroll
    for (int q = 0; q < cpl(K); ++q) {
        const int c = lane_chunk<K>(q);
        if (c < chunks(K)) {
            const float4 lo = *reinterpret_cast<const float4*>(buf + c * 8);
            const float4 hi = *reinterpret_cast<const float4*>(buf + c * 8 + 4);
            const float e[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
            f(q, c, e, out.v[q]);
        }
    }
}

// The warp's segment of rmsnorm(src) * w, src a float vector or (layer 0) a bf16 row. The norm
// weights are loaded before the wait for src: they do not depend on it, so their round trip to
// L2 overlaps the wait instead of following it.
template <int K>
__device__ __forceinline__ void load_normed(Vec<K>& out, const tagged_t* src, const bf16_t* row,
                                            unsigned tag, const bf16_t* w, float eps) {
    uint4 g[cpl(K)];
#pragma unroll
    for (int q = 0; q < cpl(K); ++q) {
        const int c = lane_chunk<K>(q);
        g[q] = c < chunks(K) ? __ldg(reinterpret_cast<const uint4*>(w) + c) : make_uint4(0, 0, 0, 0);
    }
    const float rstd = rsqrtf(stage_vector<K>(src, row, tag, true) / K + eps);
    from_staged<K>(out, [&](int q, int, const float (&e)[8], float (&o)[8]) {
        const float gw[8] = {bf16_lo(g[q].x), bf16_hi(g[q].x), bf16_lo(g[q].y), bf16_hi(g[q].y),
                             bf16_lo(g[q].z), bf16_hi(g[q].z), bf16_lo(g[q].w), bf16_hi(g[q].w)};
#pragma unroll
        for (int j = 0; j < 8; ++j) o[j] = e[j] * rstd * gw[j];
    });
}

// The warp's segment of a float vector other blocks are writing with `tag`.
template <int K>
__device__ __forceinline__ void load_plain(Vec<K>& out, const tagged_t* src, unsigned tag,
                                           bool wait = true) {
    stage_vector<K>(src, nullptr, tag, false, wait);
    from_staged<K>(out, [](int, int, const float (&e)[8], float (&o)[8]) {
#pragma unroll
        for (int j = 0; j < 8; ++j) o[j] = e[j];
    });
}

// The warp's partial dot product of one weight row in shared memory with its vector segment:
// 8 values a chunk, 16 bytes of bf16 or 8 FP8 codes times their block's scale.
template <int K, bool F8>
__device__ __forceinline__ float row_dot(const unsigned char* row, const Vec<K>& v) {
    float acc = 0.f;
#pragma unroll
    for (int q = 0; q < cpl(K); ++q) {
        const int c = lane_chunk<K>(q);
        if (c < chunks(K)) {
            if constexpr (F8) {
                const float scale = reinterpret_cast<const float*>(row + K)[c * 8 / qw::FP8_BLOCK];
                acc += dot8_e4m3(reinterpret_cast<const uint2*>(row)[c], v.v[q]) * FP8_UNSCALE * scale;
            } else {
                acc += dot8(reinterpret_cast<const uint4*>(row)[c], v.v[q]);
            }
        }
    }
    return warp_sum(acc);
}

// The stages' partial sums (a row's segments from several warps) and, per output of a stage,
// how many of them have arrived. Slot = the stage's place in the ring, so a slot is reused
// only after every warp has released the stage.
__shared__ float stage_parts[STAGES][STAGE_PARTS];
__shared__ unsigned stage_arrivals[STAGES][STAGE_OUTS];

__device__ void init_stage_sums() {
    for (int i = threadIdx.x; i < STAGES * STAGE_OUTS; i += THREADS)
        (&stage_arrivals[0][0])[i] = 0u;
}

// Rows [lo, hi) of this block's slice, stage by stage. `load(v)` first fills the warp's vector
// segment. Each consumer warp then goes through the stages on its own (no block barrier), while
// the producer warp refills them: a stage's rows are split among the consumer warps (NSEG warps
// a row, one segment each), and the warp whose
// segment completes a row adds the segments in order 0, 1, ... and calls `emit(row, sum, up,
// pre)` from its lane 0, where `pre` is what `pre(row)` returned when that lane started the row
// (loads the emit will need). With PAIRS a stage holds gate rows and then (at PAIRS_PER_STAGE
// rows) the matching up rows, and `up` is the up row's sum. F8: the rows are in the model's
// weight format (false: bf16, the LM head). Not inlined: each phase gets all the registers.
template <int K, bool PAIRS, bool F8 = qw::fp8, typename Load, typename Pre, typename Emit>
__device__ __noinline__ void rows_phase(const MegaArgs& a, unsigned& consumed, int n_rows,
                                        Load load, Pre pre, Emit emit) {
    constexpr int NSEG = nseg(K), GROUPS = CWARPS / NSEG;
    constexpr int PER = PAIRS ? PAIRS_PER_STAGE : rows_per_stage<F8>(K);
    constexpr int ARRIVALS = NSEG * (PAIRS ? 2 : 1);  // the pieces of one output
    constexpr long long RB = row_bytes<F8>(K);
    static_assert(PER <= STAGE_OUTS && (PAIRS ? 2 : 1) * PER * NSEG <= STAGE_PARTS,
                  "a stage holds more rows than its partial sums");
    QW_TL_ENTER(n_rows == qw::vocab ? mk_timeline::LM_HEAD
                : PAIRS ? mk_timeline::GATE_UP
                : K == qw::intermediate ? mk_timeline::DOWN
                : n_rows == QKV_ROWS ? mk_timeline::QKV : mk_timeline::O_PROJ);
    Vec<K> v;
    load(v);
    QW_TL_MARK(INPUT);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int seg = warp % NSEG, group = warp / NSEG;
    int lo, hi;
    block_range(n_rows, lo, hi);
    if (warp == PRODUCER) {  // refills the phase's stages as the consumers release them
        for (int r0 = lo; r0 < hi; r0 += PER) pipe_produce(a, consumed);
        return;
    }
    for (int r0 = lo; r0 < hi; r0 += PER) {
        const int n = min(PER, hi - r0);
        const int slot = consumed % STAGES;
        const unsigned char* tile = pipe_wait(consumed);
        QW_TL_MARK_IF(r0 == lo, WEIGHTS);
        if (group < GROUPS) {
            for (int r = group; r < (PAIRS ? 2 * PER : n); r += GROUPS) {
                if (PAIRS && r % PER >= n) continue;
                const int out = PAIRS ? r % PER : r;
                const int extra = lane == 0 ? pre(r0 + out) : 0;
                const float d = row_dot<K, F8>(tile + r * RB, v);
                if (lane != 0) continue;
                if constexpr (ARRIVALS == 1) {
                    emit(r0 + out, d, 0.f, extra);
                    continue;
                }
                volatile float* parts = stage_parts[slot];
                parts[r * NSEG + seg] = d;
                __threadfence_block();  // the piece before its count
                if (atomicAdd(&stage_arrivals[slot][out], 1u) + 1u != ARRIVALS) continue;
                stage_arrivals[slot][out] = 0u;
                __threadfence_block();  // the other pieces after their counts
                float total = 0.f, up = 0.f;
#pragma unroll
                for (int s = 0; s < NSEG; ++s) total += parts[out * NSEG + s];
                if (PAIRS) {
#pragma unroll
                    for (int s = 0; s < NSEG; ++s) up += parts[(PER + out) * NSEG + s];
                }
                emit(r0 + out, total, up, extra);
            }
        }
        pipe_release(consumed);
    }
    QW_TL_MARK(END);
}
}  // namespace
