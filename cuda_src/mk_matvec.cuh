// Matrix-vector phases, in one of two ways (mk_layout.cuh, SPLIT): whole rows, each warp holding
// a segment of the input vector in registers (rows_phase_whole); or runs of 256-column items
// whatever the rows, the input vector in shared memory (rows_phase_items).
//
// The timeline's probe points of a matrix phase (QW_TL_MV; tests/step_timeline.py --mv-probes
// records a step at each): 0 (the default) its first stage ready, 1 its input's first block
// barrier passed, 2 warp 0's share of the input taken, 3 the block barrier after the input's
// sums passed, 5 warp 0 done with the phase's first stage, 6 warp 0 done with the phase, 7 the
// producer warp done with the phase's refills. All but 7 as warp 0 sees them.
#pragma once
#include "mk_pipe.cuh"
#include "mk_timeline.cuh"

namespace {
using namespace mk;

template <int K>
struct Vec {
    float v[cpl(K)][8];
};

// (SPLIT: the vector stays in shared memory.)
struct NoVec {};
// What a phase's `load` takes: Vec<K>, or NoVec with SPLIT. (Not a generic lambda: some NVRTC
// versions take those for host functions.)
template <bool S, int K>
struct VecPick {
    using type = Vec<K>;
};
template <int K>
struct VecPick<true, K> {
    using type = NoVec;
};
template <int K>
using VecArg = typename VecPick<SPLIT, K>::type;

// The block's warps sum their squares here (the vector itself goes to vec_buf()).
__shared__ float warp_sums[WARPS];

// A barrier of the threads that take part in staging a vector: every thread of the block, or
// (NT = CWARPS x 32) the consumer warps alone, while the producer warp does something else.
template <int NT>
__device__ __forceinline__ void sync_threads() {
    static_assert(NT == THREADS || NT == CWARPS * 32, "the block, or its consumer warps");
    if constexpr (NT == THREADS) __syncthreads();
    else asm volatile("bar.sync 1, %0;" ::"n"(NT) : "memory");
}

__device__ __forceinline__ void ld_tagged2(const tagged_t* p, tagged_t& a, tagged_t& b,
                                           bool strong) {
    if (strong)
        asm volatile("ld.relaxed.gpu.global.v2.u64 {%0,%1}, [%2];"
                     : "=l"(a), "=l"(b) : "l"(p) : "memory");
    else
        asm volatile("ld.global.cg.v2.u64 {%0,%1}, [%2];" : "=l"(a), "=l"(b) : "l"(p) : "memory");
}

// Pair i of a K-vector that other blocks are writing with `tag` (or of a bf16 embedding row).
// One pair in flight a thread: polling more pairs of a thread at once was slower for short
// vectors (docs/perf.md, 2026-11-25); long ones take them in batches (take_pairs).
__device__ __forceinline__ float2 take_pair(const tagged_t* src, const bf16_t* row, int i,
                                            unsigned tag, bool wait) {
    if (row) {
        const unsigned r = *reinterpret_cast<const unsigned*>(row + 2 * i);
        return make_float2(bf16_lo(r), bf16_hi(r));
    }
    tagged_t w0, w1;
    for (bool strong = false;; strong = true) {
        if (strong) back_off();
        ld_tagged2(src + 2 * i, w0, w1, strong);
        if ((QW_MK_SKIP & 4) || !wait || (tag_of(w0) == tag && tag_of(w1) == tag)) break;
    }
    return make_float2(value_of(w0), value_of(w1));
}

// How many of a thread's pairs are loaded at once (all issued before any is checked, so that
// taking them costs a round trip to L2 a batch instead of one a pair). The bf16 consumers'
// vectors (stage_vector): up to three pairs a thread all at once (0.6B's and 1.7B's
// projections' inputs, 4B's hidden-wide ones), longer ones a pair at a time (batches of four
// lost 6% on 8B, 1-3% on 14B and 32B). The narrow consumers' (stage_f16): up to six pairs a
// thread at once, and from QW_MK_POLL_MIN pairs a thread QW_MK_POLL at a time (H100: 8B FP8
// +3.4%, 32B +5%, down's inputs of 12 and 25 pairs a thread). docs/perf.md, 2026-11-26 and
// 2026-11-27. The defines are for experiments.
#ifndef QW_MK_POLL
#define QW_MK_POLL 4
#endif
#ifndef QW_MK_POLL_MIN
#define QW_MK_POLL_MIN 8
#endif
__host__ __device__ constexpr int pairs_per_thread(int K) { return (K / 2 + THREADS - 1) / THREADS; }
__host__ __device__ constexpr int short_batch(int K, int most) {
    return pairs_per_thread(K) <= most ? pairs_per_thread(K) : 1;
}
__host__ __device__ constexpr int vector_batch(int K) { return short_batch(K, 3); }  // stage_vector
__host__ __device__ constexpr int poll_batch(int K) {  // stage_f16
    return pairs_per_thread(K) >= QW_MK_POLL_MIN ? QW_MK_POLL : short_batch(K, 6);
}

// Pairs threadIdx.x + (q0 + b) NT, b < B, of a K-vector (those below K / 2): every first
// (weak) load is issued before any is checked; a stale one is then polled alone (strong loads).
// NT: the threads that take the vector (sync_threads).
template <int K, int B, int NT = THREADS>
__device__ __forceinline__ void take_pairs(const tagged_t* src, const bf16_t* row, int q0,
                                           unsigned tag, bool wait, float2 (&e)[B]) {
    static_assert(B > 1, "one pair at a time is take_pair");
    tagged_t w[B][2];
#pragma unroll
    for (int b = 0; b < B; ++b) {
        const int i = threadIdx.x + (q0 + b) * NT;
        w[b][0] = w[b][1] = 0ull;
        if (i < K / 2 && !row) ld_tagged2(src + 2 * i, w[b][0], w[b][1], false);
    }
#pragma unroll
    for (int b = 0; b < B; ++b) {
        const int i = threadIdx.x + (q0 + b) * NT;
        e[b] = make_float2(0.f, 0.f);
        if (i >= K / 2) continue;
        if (row) {
            e[b] = take_pair(src, row, i, tag, wait);
            continue;
        }
        while (!(QW_MK_SKIP & 4) && wait && !(tag_of(w[b][0]) == tag && tag_of(w[b][1]) == tag)) {
            back_off();
            ld_tagged2(src + 2 * i, w[b][0], w[b][1], true);
        }
        e[b] = make_float2(value_of(w[b][0]), value_of(w[b][1]));
    }
}

// f(q, i, pair) for each of the thread's pairs i = threadIdx.x + q NT (i < K / 2) of a
// K-vector that other blocks are writing with `tag` (or of a bf16 embedding row), taken one
// at a time (B = 1) or B at a time (take_pairs); NT threads take part (take_pairs).
template <int K, int B, int NT = THREADS, typename F>
__device__ __forceinline__ void for_pairs(const tagged_t* src, const bf16_t* row, unsigned tag,
                                          bool wait, F f) {
    constexpr int NQ = (K / 2 + NT - 1) / NT;
    if constexpr (B == 1) {
#pragma unroll
        for (int q = 0; q < NQ; ++q) {
            const int i = threadIdx.x + q * NT;
            if (i < K / 2) f(q, i, take_pair(src, row, i, tag, wait));
        }
    } else {
#pragma unroll
        for (int q0 = 0; q0 < NQ; q0 += B) {
            float2 got[B];
            take_pairs<K, B, NT>(src, row, q0, tag, wait, got);
#pragma unroll
            for (int b = 0; b < B; ++b) {
                const int q = q0 + b, i = threadIdx.x + q * NT;
                if (q < NQ && i < K / 2) f(q, i, got[b]);
            }
        }
    }
}

// Loads a K-vector that other blocks are writing with `tag` (or, with `row`, a bf16 embedding
// row) into vec_buf() as floats with the whole block, returning the sum of squares when asked.
// NORM: each value times its norm weight from `norm` (SPLIT's normed vectors: the 1/rms comes
// at the end, Σ w·(x·g)/rms = (1/rms)·Σ w·(x·g)); the weights are loaded before the wait,
// since they do not depend on it.
template <int K, bool NORM = false>
__device__ __forceinline__ float stage_vector(const tagged_t* src, const bf16_t* row, unsigned tag,
                                              bool squares, bool wait = true,
                                              const bf16_t* norm = nullptr) {
    constexpr int NQ = (K / 2 + THREADS - 1) / THREADS;
    unsigned g[NORM ? NQ : 1];
    if constexpr (NORM) {
#pragma unroll
        for (int q = 0; q < NQ; ++q) {
            const int i = threadIdx.x + q * THREADS;
            g[q] = i < K / 2 ? __ldg(reinterpret_cast<const unsigned*>(norm) + i) : 0u;
        }
    }
    float* buf = vec_buf();
    float ss = 0.f;
    // Warps leave a phase one by one (no barrier between its stages): the slowest may still be
    // reading the last phase's vector here, or its squares.
    __syncthreads();
    QW_TL_MV(1);  // (the timeline's probe points of a matrix phase: this file's head)
    // Thread t takes pairs t, t + THREADS, ...: a warp's 16-byte loads are contiguous (whole
    // 128-byte lines).
    if constexpr (NORM) {
        for_pairs<K, vector_batch(K)>(src, row, tag, wait, [&](int q, int i, float2 e) {
            ss += e.x * e.x + e.y * e.y;
            *reinterpret_cast<float2*>(buf + 2 * i) =
                make_float2(e.x * bf16_lo(g[q]), e.y * bf16_hi(g[q]));
        });
    } else if constexpr (vector_batch(K) > 1) {
        for_pairs<K, vector_batch(K)>(src, row, tag, wait, [&](int, int i, float2 e) {
            *reinterpret_cast<float2*>(buf + 2 * i) = e;
            ss += e.x * e.x + e.y * e.y;
        });
    } else {  // (a pair at a time: the loop as before, the code that was measured)
        for (int i = threadIdx.x; i < K / 2; i += THREADS) {
            const float2 e = take_pair(src, row, i, tag, wait);
            *reinterpret_cast<float2*>(buf + 2 * i) = e;
            ss += e.x * e.x + e.y * e.y;
        }
    }
    QW_TL_MV(2);
    if (squares) {
        ss = warp_sum(ss);
        if ((threadIdx.x & 31) == 0) warp_sums[threadIdx.x >> 5] = ss;
    }
    __syncthreads();
    QW_TL_MV(3);
    float total = 0.f;
    if (squares) {
#pragma unroll
        for (int w = 0; w < WARPS; ++w) total += warp_sums[w];
    }
    return total;
}

__shared__ float warp_maxes[WARPS];

// int4 rows (int4_pair_dot): the sums of the staged f16 vector's 64-column windows, after it
// in the union region, window w at [w].
__device__ __forceinline__ float* window_sums() {
    return reinterpret_cast<float*>(reinterpret_cast<unsigned char*>(vec_buf()) + VEC_F16_BYTES);
}

// Where stage_f16 puts f16 pair i (columns 2i, 2i + 1) for int4_pair_dot, in 32-bit words:
// step j's 1,024 bytes hold, for lanes 0-31 in turn, each lane's first 8 columns (16 bytes),
// then each lane's last 8, so that a warp's two 16-byte loads of a step are each 512
// contiguous bytes (columns in plain order, a lane's 16 bytes 32 apart, would meet two lanes
// in every bank: twice the wavefronts).
__device__ __forceinline__ int int4_slot(int i) {
    const int c = 2 * i, j = c >> 9, lane = (c & 511) >> 4, half = (c >> 3) & 1;
    return 256 * j + 128 * half + 4 * lane + ((c & 7) >> 1);
}

// Lane (g, t)'s 16 f16 vector values of a 512-column step j (columns 512 j + 64 g + 16 t ..),
// zeros past K: int4_pair_dot's B operands. (xstep: the staged vector's step j + xstep.)
template <int K>
__device__ __forceinline__ void int4_vector(int j, uint4& xa, uint4& xb, int xstep = 0) {
    const int lane = threadIdx.x & 31, col = 512 * j + 64 * (lane >> 2) + 16 * (lane & 3);
    xa = xb = make_uint4(0u, 0u, 0u, 0u);
    if (K % 512 == 0 || col < K) {
        const uint4* x = reinterpret_cast<const uint4*>(reinterpret_cast<const unsigned char*>(vec_buf()) +
                                                        1024 * (j + xstep));
        xa = x[lane];
        xb = x[32 + lane];
    }
}

// The window sums, on the tensor cores: with A all ones, D[r][n] of int4_pair_dot's four mma
// (B: the vector's windows, as there) is window n's sum for every r. A warp a step at a time.
template <int K, int NT = THREADS>
__device__ __forceinline__ void stage_window_sums() {
    constexpr int S512 = (K + 511) / 512;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const unsigned ones[4] = {0x3c003c00u, 0x3c003c00u, 0x3c003c00u, 0x3c003c00u};
    for (int j = warp; j < S512; j += NT / 32) {
        uint4 xa, xb;
        int4_vector<K>(j, xa, xb);
        const unsigned b[4][2] = {{xa.x, xa.y}, {xa.z, xa.w}, {xb.x, xb.y}, {xb.z, xb.w}};
        float d[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
        for (int m = 0; m < 4; ++m) mma_f16_16816(d, ones, b[m]);
        if (lane < 4) {  // lane (0, t) holds D[0][2t] and D[0][2t + 1]
            window_sums()[8 * j + 2 * lane] = d[0];
            window_sums()[8 * j + 2 * lane + 1] = d[1];
        }
    }
}

// The FP8 tensor-core consumer's input: the K-vector (times the norm weights `norm`, if given)
// as f16 in vec_buf(), scaled by a power of two S that puts its largest value just under 2^15
// (f16 holds up to 65,504), zero from K to the end of the last 256-column step. Returns what a
// row's dot product with it is multiplied by: 1/S, and 1/rms of the vector for a norm
// (Σ w·(x·g)/rms = (1/rms)·Σ w·(x·g), so the norm needs only one scalar at the end).
// SEG > 0: the vector is K / SEG parts of SEG values (the experts' parts of h), part p staged
// from column p PSEG, zeros between.
// NT: the threads that stage it, the block's or its consumer warps' (sync_threads).
template <int K, int SEG = 0, int PSEG = 0, int NT = THREADS>
__device__ __forceinline__ float stage_f16(const tagged_t* src, const bf16_t* row, unsigned tag,
                                           const bf16_t* norm, float eps, bool wait = true) {
    constexpr int NQ = (K / 2 + NT - 1) / NT;
    static_assert(SEG == 0 || (K % SEG == 0 && SEG % 2 == 0 && PSEG >= SEG), "whole parts");
    constexpr int KS = SEG ? K / SEG * PSEG : K;  // the staged columns
    const auto at = [](int i) {  // where pair i goes, in pairs
        return SEG ? 2 * i / SEG * (PSEG / 2) + 2 * i % SEG / 2 : i;
    };
    unsigned* buf = reinterpret_cast<unsigned*>(vec_buf());  // f16 pairs
    unsigned g[NQ];
#pragma unroll
    for (int q = 0; q < NQ; ++q) {  // the norm weights before the wait: they do not depend on it
        const int i = threadIdx.x + q * NT;
        g[q] = norm && i < K / 2 ? __ldg(reinterpret_cast<const unsigned*>(norm) + i) : 0x3f803f80u;
    }
    // (as in stage_vector: the last phase's vector may still be in use; written out for the
    // block, where sync_threads made ptxas schedule the norm weights' loads otherwise)
    if constexpr (NT == THREADS) __syncthreads();
    else sync_threads<NT>();
    QW_TL_MV(1);
    float2 v[NQ];
    float ss = 0.f, most = 0.f;
#pragma unroll
    for (int q = 0; q < NQ; ++q) v[q] = make_float2(0.f, 0.f);
    for_pairs<K, poll_batch(K), NT>(src, row, tag, wait, [&](int q, int, float2 e) {
        ss += e.x * e.x + e.y * e.y;
        v[q] = make_float2(e.x * bf16_lo(g[q]), e.y * bf16_hi(g[q]));
        most = fmaxf(most, fmaxf(fabsf(v[q].x), fabsf(v[q].y)));
    });
    QW_TL_MV(2);
    ss = warp_sum(ss);
    most = warp_max(most);
    if ((threadIdx.x & 31) == 0) {
        warp_sums[threadIdx.x >> 5] = ss;
        warp_maxes[threadIdx.x >> 5] = most;
    }
    sync_threads<NT>();
    QW_TL_MV(3);
    float total = 0.f;
    most = 0.f;
#pragma unroll
    for (int w = 0; w < NT / 32; ++w) {
        total += warp_sums[w];
        most = fmaxf(most, warp_maxes[w]);
    }
    int e;
    frexpf(most, &e);  // most < 2^e (e = 0 for 0)
    const float s = ldexpf(1.f, 15 - e);
#pragma unroll
    for (int q = 0; q < NQ; ++q) {
        const int i = threadIdx.x + q * NT;
        if (i < K / 2) {
            unsigned h;
            asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(h) : "f"(v[q].y * s), "f"(v[q].x * s));
            buf[INT4_PAIRS ? int4_slot(at(i)) : at(i)] = h;
        }
    }
    if constexpr (SEG > 0 && PSEG > SEG) {  // the zeros between the parts
        constexpr int GAP = (PSEG - SEG) / 2;
        for (int i = threadIdx.x; i < K / SEG * GAP; i += NT) {
            const int p = i / GAP * (PSEG / 2) + SEG / 2 + i % GAP;
            buf[INT4_PAIRS ? int4_slot(p) : p] = 0u;
        }
    }
    if constexpr (INT4_PAIRS) {  // (int4_vector reads no column past K) the windows' sums
        sync_threads<NT>();
        stage_window_sums<KS, NT>();
    } else {
        for (int i = KS / 2 + threadIdx.x; i < steps(KS) * 128; i += NT) buf[i] = 0u;
    }
    sync_threads<NT>();
    return (norm ? rsqrtf(total / K + eps) : 1.f) / s;
}

// The input vector's 8-value chunk that this lane holds as its q-th: its warp's segment, the
// lanes interleaved (past chunks(K) for the last segment's spare lanes).
template <int K>
__device__ __forceinline__ int lane_chunk(int q) {
    const int lane = threadIdx.x & 31, seg = (threadIdx.x >> 5) % nseg(K);
    return seg * cpl(K) * 32 + lane + 32 * q;
}

// Each of the warp's 8-value chunks c of the staged vector (vec_buf, or a part of it at buf) as
// out.v[q] = f(q, c, e).
template <int K, typename F>
__device__ __forceinline__ void from_staged(Vec<K>& out, F f, const float* buf = vec_buf()) {
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
// L2 overlaps the wait instead of following it. MMA (the FP8 tensor-core consumer): the vector
// goes to shared memory as f16 instead (stage_f16). Returns the factor of each row's dot product.
template <int K, bool MMA = NARROW_MMA>
__device__ __forceinline__ float load_normed(Vec<K>& out, const tagged_t* src, const bf16_t* row,
                                             unsigned tag, const bf16_t* w, float eps) {
    if constexpr (MMA) {
        return stage_f16<K>(src, row, tag, w, eps);
    } else {
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
        return 1.f;
    }
}

// The warp's segment of a float vector other blocks are writing with `tag` (MMA: as f16 in
// shared memory). Returns the factor of each row's dot product.
template <int K, bool MMA = NARROW_MMA>
__device__ __forceinline__ float load_plain(Vec<K>& out, const tagged_t* src, unsigned tag,
                                            bool wait = true) {
    if constexpr (MMA) {
        return stage_f16<K>(src, nullptr, tag, nullptr, 0.f, wait);
    } else {
        stage_vector<K>(src, nullptr, tag, false, wait);
        from_staged<K>(out, [](int, int, const float (&e)[8], float (&o)[8]) {
#pragma unroll
            for (int j = 0; j < 8; ++j) o[j] = e[j];
        });
        return 1.f;
    }
}

// The warp's partial dot product of one weight row in shared memory with its vector segment:
// 8 values a chunk, 16 bytes of bf16 or 8 FP8 codes times their block's scale.
template <int K, int WF>
__device__ __forceinline__ float row_dot(const unsigned char* row, const Vec<K>& v) {
    static_assert(WF != qw::INT4, "int4 rows take the tensor cores (narrow_pair_dot)");
    float acc = 0.f;
#pragma unroll
    for (int q = 0; q < cpl(K); ++q) {
        const int c = lane_chunk<K>(q);
        if (c < chunks(K)) {
            if constexpr (WF == qw::FP8) {
                const float scale = reinterpret_cast<const float*>(row + K)[c * 8 / qw::FP8_BLOCK];
                acc += dot8_e4m3(reinterpret_cast<const uint2*>(row)[c], v.v[q]) * FP8_UNSCALE * scale;
            } else {
                acc += dot8(reinterpret_cast<const uint4*>(row)[c], v.v[q]);
            }
        }
    }
    return warp_sum(acc);
}

// row_dot with the vector's columns at x in shared memory (the experts' down rows: each row's
// expert has its own part of h), not in the warp's registers.
template <int K, int WF>
__device__ __forceinline__ float row_dot_at(const unsigned char* row, const float* x) {
    Vec<K> v;
    from_staged<K>(v, [](int, int, const float (&e)[8], float (&o)[8]) {
#pragma unroll
        for (int j = 0; j < 8; ++j) o[j] = e[j];
    }, x);
    return row_dot<K, WF>(row, v);
}

// FP8 rows on the tensor cores (int4 rows: int4_pair_dot, below): mma m16n8k16 (f16 in, f32
// out) dots two rows with the vector at once, each in eight windows of 32 columns. A's rows
// 0-7 are row0's windows g = 0..7 of a 256-column step, rows 8-15 row1's; B's column g is the
// vector's window g; the result's diagonal (D[g][g] and D[g + 8][g]) holds the eight windows'
// dot products of each row, the rest is unused. Lane (g, t) takes the 8 codes at column
// 32g + 8t of both rows (a 256-column step is one contiguous 256-byte line of each row, so no
// two lanes of a load meet in a bank) and the 8 f16 values of the vector there, makes f16 pairs
// of them (narrow_pairs: cvt e4m3x2 -> f16x2, exact), and the two mma take columns 0-3 and 4-7
// (the order of the columns inside a window is the same in A and B, so any order adds up the
// same products). A window lies in one 128-column block, so its sum is multiplied by that
// block's scale once. Returns the lane's share of each row's dot product over steps [j0, j1)
// (diagonal lanes only; the others return 0): a warp_sum completes it.

// Lane (g, t)'s 8 weights of a row at column `col` as four f16 pairs (columns 0-1, 2-3, 4-5,
// 6-7 of the 8) without their scale, and the scale of its window: FP8 codes, or int4 codes
// less their group's zero (item_dot's runs of items); `row` is the row's column 0, `sc` its
// scales. Zeros where `in` is false.
template <int WF>
__device__ __forceinline__ float narrow_pairs(const unsigned char* row, const unsigned char* sc,
                                              int col, bool in, unsigned (&p)[4]) {
    if constexpr (WF == qw::FP8) {
        uint2 w = make_uint2(0u, 0u);
        if (in) w = *reinterpret_cast<const uint2*>(row + col);
        p[0] = e4m3x2_f16x2(w.x);
        p[1] = e4m3x2_f16x2(w.x >> 16);
        p[2] = e4m3x2_f16x2(w.y);
        p[3] = e4m3x2_f16x2(w.y >> 16);
        return in ? reinterpret_cast<const float*>(sc)[col / qw::FP8_BLOCK] : 0.f;
    } else {
        static_assert(WF == qw::INT4, "narrow rows are FP8 or int4");
        unsigned w = 0u, rec = 0u;
        if (in) {
            w = *reinterpret_cast<const unsigned*>(row + col / 2);
            rec = reinterpret_cast<const unsigned*>(sc)[col / qw::FP8_BLOCK];
        }
        int4x8_f16x2(w, in ? int4_zero2(rec) : 0x64006400u, p);
        return int4_scale(rec);
    }
}

template <int K, int WF>
__device__ __forceinline__ float2 narrow_pair_dot(const unsigned char* row0, const unsigned char* row1,
                                                  bool has1, int j0, int j1, int xoff = 0) {
    static_assert(WF == qw::FP8, "int4 rows take int4_pair_dot");
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const unsigned char* xh = reinterpret_cast<const unsigned char*>(vec_buf());
    float tot[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll 2
    for (int j = j0; j < j1; ++j) {
        const int col = 256 * j + 32 * g + 8 * t;
        const bool in = K % 256 == 0 || col < K;
        unsigned p0[4], p1[4];
        const float sc0 = narrow_pairs<WF>(row0, row0 + code_bytes<WF>(K), col, in, p0);
        const float sc1 = narrow_pairs<WF>(row1, row1 + code_bytes<WF>(K), col, in && has1, p1);
        const uint4 x = *reinterpret_cast<const uint4*>(xh + 2 * (col + xoff));
        const unsigned b0[2] = {x.x, x.y}, b1[2] = {x.z, x.w};
        const unsigned a0[4] = {p0[0], p1[0], p0[1], p1[1]};
        const unsigned a1[4] = {p0[2], p1[2], p0[3], p1[3]};
        float d[4] = {0.f, 0.f, 0.f, 0.f};
        mma_f16_16816(d, a0, b0);
        mma_f16_16816(d, a1, b1);
        tot[0] += d[0] * sc0;
        tot[1] += d[1] * sc0;
        tot[2] += d[2] * sc1;
        tot[3] += d[3] * sc1;
    }
    if (t != g >> 1) return make_float2(0.f, 0.f);
    return (g & 1) ? make_float2(tot[1], tot[3]) : make_float2(tot[0], tot[2]);
}

// int4 rows on the tensor cores, two at once as narrow_pair_dot, in 512-column steps: lane
// (g, t) takes 16 columns of each row (8 bytes) at 512 j + 64 g + 16 t, so A's row g is a
// row's 64-column window g and B's column g the vector's. The codes go to the tensor cores
// biased (1024 + code, int4x8_biased: no subtraction), so D[g][g] of a row is
// Σ (1024 + code) x over window g, and the window's dot product is that less (1024 + zero)
// times the window's sum of x (stage_window_sums), times the group's scale (a window lies in
// one group). About 1.6 times fewer instructions a weight than narrow_pair_dot's 8 columns a
// lane with the zero taken off every pair (docs/perf.md). Returns the lane's share of each
// row's dot product over steps [j0, j1) (diagonal lanes only; a warp_sum completes it).
// (xstep, and narrow_pair_dot's xoff: where the row's column 0 is in the staged vector, in
// steps or columns.)
template <int K>
__device__ __forceinline__ float2 int4_pair_dot(const unsigned char* row0, const unsigned char* row1,
                                                bool has1, int j0, int j1, int xstep = 0) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const bool odd = g & 1;
    const unsigned* rec0 = reinterpret_cast<const unsigned*>(row0 + K / 2);
    const unsigned* rec1 = reinterpret_cast<const unsigned*>(row1 + K / 2);
    const float* sums = window_sums();
    float tot0 = 0.f, tot1 = 0.f;
#pragma unroll 2
    for (int j = j0; j < j1; ++j) {
        const int col = 512 * j + 64 * g + 16 * t;
        const bool in = K % 512 == 0 || col < K;
        uint2 w0 = make_uint2(0u, 0u), w1 = make_uint2(0u, 0u);
        unsigned r0 = 0u, r1 = 0u;
        if (in) {
            w0 = *reinterpret_cast<const uint2*>(row0 + col / 2);
            r0 = rec0[col / qw::FP8_BLOCK];
            if (has1) {
                w1 = *reinterpret_cast<const uint2*>(row1 + col / 2);
                r1 = rec1[col / qw::FP8_BLOCK];
            }
        }
        uint4 xa, xb;
        int4_vector<K>(j, xa, xb, xstep);
        const float S = sums[8 * (j + xstep) + g];
        unsigned p0[4], q0[4], p1[4], q1[4];
        int4x8_biased(w0.x, p0);
        int4x8_biased(w0.y, q0);
        int4x8_biased(w1.x, p1);
        int4x8_biased(w1.y, q1);
        float d[4] = {0.f, 0.f, 0.f, 0.f}, e[4] = {0.f, 0.f, 0.f, 0.f};  // (two chains)
        {
            const unsigned a[4] = {p0[0], p1[0], p0[1], p1[1]}, b[2] = {xa.x, xa.y};
            mma_f16_16816(d, a, b);
        }
        {
            const unsigned a[4] = {p0[2], p1[2], p0[3], p1[3]}, b[2] = {xa.z, xa.w};
            mma_f16_16816(e, a, b);
        }
        {
            const unsigned a[4] = {q0[0], q1[0], q0[1], q1[1]}, b[2] = {xb.x, xb.y};
            mma_f16_16816(d, a, b);
        }
        {
            const unsigned a[4] = {q0[2], q1[2], q0[3], q1[3]}, b[2] = {xb.z, xb.w};
            mma_f16_16816(e, a, b);
        }
        const float v0 = odd ? d[1] + e[1] : d[0] + e[0];
        const float v1 = odd ? d[3] + e[3] : d[2] + e[2];
        const float2 sz0 = f16x2_floats(r0), sz1 = f16x2_floats(r1);  // (scale, 1024 + zero)
        tot0 += sz0.x * (v0 - sz0.y * S);
        tot1 += sz1.x * (v1 - sz1.y * S);
    }
    if (t != g >> 1) return make_float2(0.f, 0.f);
    return make_float2(tot0, tot1);
}

// (SPLIT) rmsnorm(src) * w as the phase's input vector, src a float vector or (layer 0) a bf16 row:
// floats, or for the FP8 tensor-core consumer (MMA) f16 (stage_f16). Returns the factor of each
// row's dot product.
template <int K, bool MMA = NARROW_MMA>
__device__ __forceinline__ float load_normed(NoVec, const tagged_t* src, const bf16_t* row,
                                             unsigned tag, const bf16_t* w, float eps) {
    if constexpr (MMA) return stage_f16<K>(src, row, tag, w, eps);
    else return rsqrtf(stage_vector<K, true>(src, row, tag, true, true, w) / K + eps);
}

// (SPLIT) A float vector other blocks are writing with `tag` as the phase's input vector. Returns the
// factor of each row's dot product.
template <int K, bool MMA = NARROW_MMA>
__device__ __forceinline__ float load_plain(NoVec, const tagged_t* src, unsigned tag,
                                            bool wait = true) {
    if constexpr (MMA) return stage_f16<K>(src, nullptr, tag, nullptr, 0.f, wait);
    stage_vector<K>(src, nullptr, tag, false, wait);
    return 1.f;
}

// The lane's share of the dot product of item j (columns STEP j ..) of a row with the input
// vector: the row's column 0 is at stage offset `at` (the item's own bytes are in the stage),
// its scales (narrow rows) at `sc`. A warp_sum completes it.
//   bf16 and FP8 on the CUDA cores: lane l takes 8 columns at STEP j + 8 l (16 bytes of bf16,
//   or 8 codes times their block's scale) and the 8 floats of the vector there.
//   Narrow rows on the tensor cores (MMA): mma m16n8k16 (f16 in, f32 out) with A's rows 0-7 the
//   item's eight 32-column windows g and B's column g the vector's window g (f16, vec_buf);
//   the result's diagonal D[g][g] holds the windows' dot products (A's rows 8-15 are zero: a
//   second row would need the same columns, which a run of items seldom has). Lane (g, t)
//   takes the 8 columns at 32 g + 8 t (narrow_pairs) and the 8 vector values there; the two
//   mma take columns 0-3 and 4-7 (the columns of a window are in the same order in A and B,
//   so any order adds the same products). A window lies in one 128-column block or group, so
//   its sum is multiplied by that scale once.
template <int K, int WF, bool MMA>
__device__ __forceinline__ float item_dot(const unsigned char* tile, int at, const unsigned char* sc,
                                          int j) {
    const int lane = threadIdx.x & 31;
    if constexpr (MMA) {
        const int g = lane >> 2, t = lane & 3, col = STEP * j + 32 * g + 8 * t;
        const bool in = K % STEP == 0 || col < K;
        unsigned p[4];
        const float scale = narrow_pairs<WF>(tile + at, sc, col, in, p);
        const uint4 x = *reinterpret_cast<const uint4*>(reinterpret_cast<const unsigned char*>(vec_buf()) + 2 * col);
        const unsigned a0[4] = {p[0], 0u, p[1], 0u};
        const unsigned a1[4] = {p[2], 0u, p[3], 0u};
        const unsigned b0[2] = {x.x, x.y}, b1[2] = {x.z, x.w};
        float d0[4] = {0.f, 0.f, 0.f, 0.f}, d1[4] = {0.f, 0.f, 0.f, 0.f};  // (two chains)
        mma_f16_16816(d0, a0, b0);
        mma_f16_16816(d1, a1, b1);
        if (t != g >> 1 || !in) return 0.f;
        return ((g & 1) ? d0[1] + d1[1] : d0[0] + d1[0]) * scale;
    } else {
        static_assert(WF != qw::INT4, "int4 items take the tensor cores");
        const int col = STEP * j + 8 * lane;
        if (K % STEP != 0 && col >= K) return 0.f;
        const float4 lo = *reinterpret_cast<const float4*>(vec_buf() + col);
        const float4 hi = *reinterpret_cast<const float4*>(vec_buf() + col + 4);
        const float x[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
        if constexpr (WF == qw::FP8) {
            return dot8_e4m3(*reinterpret_cast<const uint2*>(tile + at + col), x) * FP8_UNSCALE *
                   reinterpret_cast<const float*>(sc)[col / qw::FP8_BLOCK];
        } else {
            return dot8(*reinterpret_cast<const uint4*>(tile + at + 2 * col), x);
        }
    }
}

// The stages' partial sums (a row's segments from several warps) and, per output of a stage,
// how many of them have arrived. Slot = the stage's place in the ring, so a slot is reused
// only after every warp has released the stage.
__shared__ float stage_parts[STAGES][SPLIT ? 1 : STAGE_PARTS];
__shared__ unsigned stage_arrivals[STAGES][SPLIT ? 1 : STAGE_OUTS];

// Rows [lo, hi) of this block's slice, stage by stage. `load(v)` first fills the warp's vector
// segment. Each consumer warp then goes through the stages on its own (no block barrier), while
// the producer warp refills them: a stage's rows are split among the consumer warps (NSEG warps
// a row, one segment each), and the warp whose
// segment completes a row adds the segments in order 0, 1, ... and calls `emit(row, sum, up,
// pre)` from its lane 0, where `pre` is what `pre(row)` returned when that lane started the row
// (loads the emit will need). With PAIRS a stage holds gate rows and then (at PAIRS_PER_STAGE
// rows) the matching up rows, and `up` is the up row's sum. WF: the rows' format (qw::wfmt, or
// qw::BF16: the LM head). Not inlined: each phase gets all the registers.
// EXPERTS: a mixture of experts' down rows as one phase (mk_layout.cuh, DOWN_PAD; n_rows is
// hidden): the rows are the virtual rows v = k n + r of the block's n hidden rows (expert slot
// k's row lo + r, expert_down_source), `load` stages all of h in shared memory (each slot's
// part from column k DOWN_PAD), each row is dotted with its slot's part, and `emit` gets v.
template <int K, bool PAIRS, int WF = qw::wfmt, bool EXPERTS = false, typename Load, typename Pre,
          typename Emit>
__device__ __noinline__ void rows_phase_whole(const MegaArgs& a, unsigned& consumed, int n_rows,
                                              Load load, Pre pre, Emit emit) {
    static_assert(!EXPERTS || (MOE && !PAIRS && K == MINTER), "the experts' down rows");
    constexpr bool MMA = mma_rows<WF>();  // two rows a warp on the tensor cores
    constexpr int NSEG = nseg<WF>(K), GROUPS = CWARPS / NSEG;
    constexpr int PER = PAIRS ? PAIRS_PER_STAGE : rows_per_stage<WF>(K);
    constexpr int ARRIVALS = NSEG * (PAIRS ? 2 : 1);  // the pieces of one output
    constexpr long long RB = row_bytes<WF>(K);
    static_assert(PER <= STAGE_OUTS && (PAIRS ? 2 : 1) * PER * NSEG <= STAGE_PARTS,
                  "a stage holds more rows than its partial sums");
    static_assert(!MMA || K % 8 == 0, "the tensor-core consumer takes 8 columns a lane");
    // (in an order that tells the phases apart in the tiny test shapes too, where widths meet)
    QW_TL_ENTER(PAIRS ? mk_timeline::GATE_UP
                : MOE && n_rows == qwm::EXPERTS ? mk_timeline::ROUTER
                : n_rows == qw::vocab ? mk_timeline::LM_HEAD
                : n_rows == QKV_ROWS ? mk_timeline::QKV
                : EXPERTS || (!MOE && K == qw::intermediate) ? mk_timeline::DOWN
                : mk_timeline::O_PROJ);
    Vec<K> v;
    const float scale = load(v);  // what each dot product is multiplied by
    QW_TL_MARK(INPUT);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int seg = warp % NSEG, group = warp / NSEG;
    int lo, hi;
    block_range(n_rows, lo, hi);
    int per = PER;  // rows a stage
    const int nb = hi - lo;  // (EXPERTS) the block's rows of each expert
    if constexpr (EXPERTS) {
        per = expert_down_per(nb);
        lo = 0;
        hi = qwm::TOPK * nb;
    }
    // The producer refills the phase's stages as the consumers release them. (It takes part in
    // the input: left out of it, so that it could refill meanwhile, the step measured 6-14%
    // slower, docs/perf.md 2026-11-27.)
    if (warp == PRODUCER) {
        pipe_produce_phase(a, consumed, lo, hi, per);
        QW_TL_MV_PRODUCER(7);
        return;
    }
    // The MMA consumer's share of the columns: steps [j0, j1) of the segment (256 columns, or
    // 512 for int4 rows: int4_pair_dot).
    constexpr int STEPS = WF == qw::INT4 ? (K + 511) / 512 : steps(K);
    const int j0 = seg * STEPS / NSEG, j1 = (seg + 1) * STEPS / NSEG;
    for (int r0 = lo; r0 < hi; r0 += per) {
        const int n = min(per, hi - r0);
        const int slot = consumed % STAGES;
        const unsigned char* tile = pipe_wait(consumed);
        QW_TL_MARK_IF(r0 == lo && QW_MK_TL_MV == 0, WEIGHTS);
        // Row r of the stage (PAIRS: gate rows, then up rows from PER) has its dot product d
        // (lane 0): emit it, or add it to the stage's partial sums and emit with the last one.
        auto finish = [&](int r, float d, int extra) {
            const int out = PAIRS ? r % PER : r;
            if constexpr (ARRIVALS == 1) {
                emit(r0 + out, d * scale, 0.f, extra);
                return;
            }
            // (The pieces are written and read with integer atomics, relaxed, as the row
            // table's are: the fences and the count order them, and no plain access races.)
            unsigned* parts = reinterpret_cast<unsigned*>(stage_parts[slot]);
            atomicExch(parts + r * NSEG + seg, __float_as_uint(d));
            __threadfence_block();  // the piece before its count
            if (atomicAdd(&stage_arrivals[slot][out], 1u) + 1u != ARRIVALS) return;
            stage_arrivals[slot][out] = 0u;
            __threadfence_block();  // the other pieces after their counts
            float total = 0.f, up = 0.f;
#pragma unroll
            for (int s = 0; s < NSEG; ++s) total += __uint_as_float(atomicOr(parts + out * NSEG + s, 0u));
            if (PAIRS) {
#pragma unroll
                for (int s = 0; s < NSEG; ++s)
                    up += __uint_as_float(atomicOr(parts + (PER + out) * NSEG + s, 0u));
            }
            emit(r0 + out, total * scale, up * scale, extra);
        };
        const int span = PAIRS ? 2 * PER : n;  // the stage's rows (PAIRS: r % PER >= n unused)
        if (group < GROUPS) {
            if constexpr (MMA) {
                // Pair p of the stage goes to row group (p + t x pairs) % GROUPS: the groups
                // take turns at the first pairs, so that where a stage holds fewer pairs than
                // there are groups (long segments: few groups, rows of many bytes), every
                // group still gets its share of the phase.
                const int pairs = (span + 1) / 2, t = (r0 - lo) / per;
                const int first = (group + GROUPS - (t * pairs) % GROUPS) % GROUPS;
                for (int r = 2 * first; r < span; r += 2 * GROUPS) {
                    const bool use0 = !PAIRS || r % PER < n;
                    const bool use1 = r + 1 < span && (!PAIRS || (r + 1) % PER < n);
                    if (!use0 && !use1) continue;
                    // Two rows with one vector: the tensor cores dot both with the same
                    // columns. (EXPERTS: rows of two experts, each with its own part of h,
                    // are dotted one at a time.)
                    const auto dot2 = [&](int ra, bool two, int k) {
                        constexpr int UNIT = WF == qw::INT4 ? 512 : 1;  // xstep's or xoff's
                        const int x = EXPERTS ? k * DOWN_PAD / UNIT : 0;
                        if constexpr (WF == qw::INT4)
                            return int4_pair_dot<K>(tile + ra * RB, tile + (ra + 1) * RB, two, j0, j1, x);
                        else
                            return narrow_pair_dot<K, WF>(tile + ra * RB, tile + (ra + 1) * RB, two, j0,
                                                          j1, x);
                    };
                    float2 d;
                    const int k0 = EXPERTS ? (r0 + r) / nb : 0, k1 = EXPERTS ? (r0 + r + 1) / nb : 0;
                    if (EXPERTS && use1 && k1 != k0) {
                        d = make_float2(dot2(r, false, k0).x, dot2(r + 1, false, k1).x);
                    } else {
                        d = dot2(r, use1, k0);
                    }
                    const float d0 = warp_sum(d.x), d1 = warp_sum(d.y);
                    if (lane != 0) continue;
                    if (use0) finish(r, d0, pre(r0 + (PAIRS ? r % PER : r)));
                    if (use1) finish(r + 1, d1, pre(r0 + (PAIRS ? (r + 1) % PER : r + 1)));
                }
            } else {
                for (int r = group; r < span; r += GROUPS) {
                    if (PAIRS && r % PER >= n) continue;
                    const int extra = lane == 0 ? pre(r0 + (PAIRS ? r % PER : r)) : 0;
                    const float d = EXPERTS ? row_dot_at<K, WF>(tile + r * RB,
                                                                vec_buf() + (r0 + r) / nb * DOWN_PAD)
                                            : row_dot<K, WF>(tile + r * RB, v);
                    if (lane == 0) finish(r, d, extra);
                }
            }
        }
        if (r0 == lo) QW_TL_MV(5);
        pipe_release(consumed);
    }
    QW_TL_MV(6);
    QW_TL_MARK(END);
}
// The row table (mk_layout.cuh, ring_rows): rows cut between warps or stages, summed from their
// pieces in a fixed order. And the gate/up pairs: the half done first leaves its sum in
// pair_half (which holds PAIR_EMPTY between pairs: a NaN that no arithmetic produces), the
// second takes it and emits.
__shared__ float row_parts[SPLIT ? RING_FLOATS : 1];
__shared__ unsigned row_counts[SPLIT ? RING_ROWS : 1];
__shared__ float pair_half[SPLIT ? PAIR_ROWS : 1];
constexpr unsigned PAIR_EMPTY = 0xffffffffu;

__device__ void init_stage_sums() {
    if constexpr (SPLIT) {
        for (int i = threadIdx.x; i < RING_ROWS; i += THREADS) row_counts[i] = 0u;
        for (int i = threadIdx.x; i < PAIR_ROWS; i += THREADS)
            pair_half[i] = __uint_as_float(PAIR_EMPTY);
    } else {
        for (int i = threadIdx.x; i < STAGES * STAGE_OUTS; i += THREADS)
            (&stage_arrivals[0][0])[i] = 0u;
    }
}

// Rows [lo, hi) of this block's slice of an n_rows-row matrix of K columns, stage by stage.
// `load(NoVec&)` first stages the input vector and returns the factor of every dot product. The
// producer warp refills the stages; each consumer warp goes through them on its own (no block
// barrier) and takes its fixed share of each stage's items (mk_layout.cuh: items of STEP
// columns, whole rows or not). A warp adds up its items of one row in its lanes, then a warp
// sum: a row that lies wholly in the warp's share is done; a cut row's piece goes to the row
// table, and the warp whose piece completes the row adds the row's entries in order. A done
// row calls `emit(row, sum, up, pre(row))` from lane 0, where `pre` loads what the emit needs.
// With PAIRS the stream is the gate rows, then the up rows, and a gate/up pair is emitted
// (`up`: the up row's sum) when its second half is done. WF: the rows' format (qw::wfmt, or
// qw::BF16: the LM head). Not inlined: each phase gets all the registers.
template <int K, bool PAIRS, int WF = qw::wfmt, typename Load, typename Pre, typename Emit>
__device__ __noinline__ void rows_phase_items(const MegaArgs& a, unsigned& consumed, int n_rows,
                                              Load load, Pre pre, Emit emit) {
    constexpr bool MMA = mma_rows<WF>();  // narrow items on the tensor cores
    constexpr int S = steps(K), IPS = items_per_stage<WF>(K), RR = ring_rows<WF>(K);
    constexpr int RB = static_cast<int>(row_bytes<WF>(K)), CB = static_cast<int>(code_bytes<WF>(K));
    static_assert(RR * S <= RING_FLOATS && RR <= RING_ROWS, "the row table is too small");
    QW_TL_ENTER(n_rows == qw::vocab ? mk_timeline::LM_HEAD
                : PAIRS ? mk_timeline::GATE_UP
                : K == qw::intermediate ? mk_timeline::DOWN
                : n_rows == QKV_ROWS ? mk_timeline::QKV : mk_timeline::O_PROJ);
    NoVec none;
    const float scale = load(none);  // what each dot product is multiplied by
    QW_TL_MARK(INPUT);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int lo, hi;
    block_range(n_rows, lo, hi);
    const int n = hi - lo, total = n * S * (PAIRS ? 2 : 1);
    const int tiles = (total + IPS - 1) / IPS;
    if (warp == PRODUCER) {  // refills the phase's stages as the consumers release them
        pipe_produce_phase(a, consumed, 0, tiles, 1);
        QW_TL_MV_PRODUCER(7);
        return;
    }
    // Stream row R's sum is complete (lane 0).
    auto row_done = [&](int R, float sum) {
        if constexpr (PAIRS) {
            const int r = R < n ? R : R - n;
            const float other = atomicExch(&pair_half[r], sum);
            if (__float_as_uint(other) == PAIR_EMPTY) return;  // the first half
            pair_half[r] = __uint_as_float(PAIR_EMPTY);
            const float gate = R < n ? sum : other, up = R < n ? other : sum;
            emit(lo + r, gate * scale, up * scale, pre(lo + r));
        } else {
            emit(lo + R, sum * scale, 0.f, pre(lo + R));
        }
    };
    // The warp's items [s, e) of stream row R, its lanes' sums in acc. The row table's
    // entries are written and read with (integer) atomics, relaxed: the fences and the count
    // order them; so no plain access to them races another, which is what compute-sanitizer's
    // racecheck can check (it does not follow a hand-over by fence and count).
    auto piece = [&](int R, int s, int e, float acc) {
        const float d = warp_sum(acc);
        if (e - s == S) {
            if (lane == 0) row_done(R, d);
            return;
        }
        unsigned* parts = reinterpret_cast<unsigned*>(row_parts) + (R % RR) * S;
        for (int q = lane; q < e - s; q += 32)
            atomicExch(parts + s - R * S + q, __float_as_uint(q == 0 ? d : 0.f));
        __syncwarp();
        unsigned last = 0u;
        if (lane == 0) {
            __threadfence_block();  // the piece before its count
            last = atomicAdd(&row_counts[R % RR], static_cast<unsigned>(e - s)) + (e - s) == S;
            if (last) row_counts[R % RR] = 0u;
        }
        last = __shfl_sync(0xffffffffu, last, 0);
        if (!last) return;
        __threadfence_block();  // the other pieces after their counts
        float sum = 0.f;
        for (int q = lane; q < S; q += 32) sum += __uint_as_float(atomicOr(parts + q, 0u));
        sum = warp_sum(sum);
        if (lane == 0) row_done(R, sum);
    };
    for (int t = 0; t < tiles; ++t) {
        const int i0 = t * IPS, i1 = min(total, i0 + IPS), m = i1 - i0;
        const unsigned char* tile = pipe_wait(consumed);
        QW_TL_MARK_IF(t == 0 && QW_MK_TL_MV == 0, WEIGHTS);
        int dst = 0;
        const StagePart p0 = stage_part<K, WF>(i0, i1, 0, n, dst);
        const StagePart p1 = PAIRS ? stage_part<K, WF>(i0, i1, 1, n, dst) : p0;
        const int b0 = i0 + warp * m / CWARPS, b1 = i0 + (warp + 1) * m / CWARPS;
        for (int s = b0; s < b1;) {  // the warp's items of one row at a time
            const int R = s / S, e = min(b1, (R + 1) * S);
            const bool up = PAIRS && R >= n;
            const int r = up ? R - n : R;
            const int at = (up ? p1.base : p0.base) + (r - (up ? p1.first : p0.first)) * RB;
            const bool cut = r == (up ? p1.last_cut : p0.last_cut);
            const unsigned char* sc = tile + (cut ? (up ? p1.tail : p0.tail) : at + CB);
            float acc = 0.f;
#pragma unroll 4
            for (int j = s - R * S; j < e - R * S; ++j) acc += item_dot<K, WF, MMA>(tile, at, sc, j);
            piece(R, s, e, acc);
            s = e;
        }
        if (t == 0) QW_TL_MV(5);
        pipe_release(consumed);
    }
    QW_TL_MV(6);
    QW_TL_MARK(END);
}

// A matrix-vector phase over rows [lo, hi) of this block's slice (rows_phase_whole or
// rows_phase_items, as the build's layout says); `load(v)` stages its input vector (v: the
// warp's registers, Vec<K>, or NoVec) and returns the factor of every dot product.
template <int K, bool PAIRS, int WF = qw::wfmt, typename Load, typename Pre, typename Emit>
__device__ __forceinline__ void rows_phase(const MegaArgs& a, unsigned& consumed, int n_rows,
                                           Load load, Pre pre, Emit emit) {
    if constexpr (SPLIT) rows_phase_items<K, PAIRS, WF>(a, consumed, n_rows, load, pre, emit);
    else rows_phase_whole<K, PAIRS, WF>(a, consumed, n_rows, load, pre, emit);
}
}  // namespace
