// Causal prefill attention on Hopper (sm_90a): attn_prefill's job (attention.cu) with wgmma
// and TMA. One block takes 128 queries of one head: two consumer warpgroups of 64 queries and
// one producer warp. The producer copies the block's Q once and then each 128-key tile of K and
// V through three shared-memory stages (TMA, 128-byte swizzle, full/empty mbarriers). Per tile a
// consumer warpgroup computes S = Q K^T with Q and K from shared memory, runs the online
// softmax on S in registers, and adds P V with P as register fragments and V read as an
// MN-major operand, straight from the cache's layout. Only tiles that reach past a warp's
// first query are masked; keys past the block's last query are never loaded.
//
// q: [n][heads][HD] bf16 for the n new tokens at positions start..start+n-1; their keys and
// values are already in the cache ([kv_head][capacity][HD] bf16). out: [n][heads][HD] bf16.
// The tensor maps (qwenchat/engine/cuda/prefill.py) cover q as rows of heads * HD values and
// each cache as kv_heads * capacity rows of HD; boxes are 64 values x 128 rows. Cache rows the
// prefill has not written must hold finite values (the engine zeroes the cache once): masked
// keys get a weight of zero, and 0 times NaN would not be zero. head_dim 64 or 128.
// Dynamic shared memory: SHARED_BYTES (attention90_shared() mirrors it).
//
// An int8 cache (QW_KV8, kv8.cuh) takes the cache buffers themselves instead of K's and V's
// tensor maps, and a producer warpgroup of four warps instead of one: they load each tile's
// codes and row scales with ordinary loads (the tile after next while the ring is full) and
// write code x scale as bf16, in the layout the TMA would have written, into the same stages
// (as attention.cu's int8 tiles are made); the consumers are unchanged. Rows past the cache's
// capacity read as zeros.
#include "common.cuh"
#include "kv8.cuh"
#include "qwen3.cuh"
#include "sm90.cuh"

namespace {
constexpr int HD = qw::head_dim;
constexpr bool SUPPORTED = HD == 64 || HD == 128;
constexpr int PANELS = SUPPORTED ? HD / 64 : 1;  // 64-wide slices of head_dim, 128 bytes a row
constexpr int BQ = 128, BKV = 128, STAGES = 3;
constexpr int PANEL_BYTES = 128 * 128;  // 128 rows (queries or keys) of one slice
constexpr int Q_BYTES = PANELS * PANEL_BYTES, KV_BYTES = PANELS * PANEL_BYTES;
constexpr int STAGE_BYTES = 2 * KV_BYTES;  // a K tile, then a V tile
constexpr int SHARED_BYTES = Q_BYTES + STAGES * STAGE_BYTES + 1024;  // + slack for alignment
static_assert(SHARED_BYTES <= 227 * 1024, "one block's shared memory on an H100");
// FlashAttention-3's ping-pong schedule (below) for a bf16 cache; an int8 cache's converters
// would spill in the registers it leaves them, so it keeps the plain one. (QW_ATTN_PINGPONG=0
// builds the plain one for bf16 too: comparisons.)
#ifndef QW_ATTN_PINGPONG
#define QW_ATTN_PINGPONG 1
#endif
#define QW_PINGPONG (QW_ATTN_PINGPONG && !QW_KV8)
// The int8 tiles' converters, or the TMA thread's warp (a whole warpgroup with the ping-pong
// schedule: it gives its registers to the consumers, and setmaxnreg works on warpgroups).
constexpr int PRODUCERS = qw::kv8 || QW_PINGPONG ? 128 : 32;
constexpr int THREADS = 2 * 128 + PRODUCERS;
// Registers a thread with the ping-pong schedule: the TMA's warpgroup and the consumers (S, O
// and the last tile's P); 128 x 40 + 256 x 232 <= 65,536.
constexpr int PRODUCER_REGS = 40, CONSUMER_REGS = 232;
constexpr float LOG2E = 1.4426950408889634f;

#if QW_KV8
using KvSource = const void*;  // the layer's int8 cache buffer: codes, then scales
#else
using KvSource = TensorMap;
#endif

// An int8 tile of 128 cache rows from key0 on, as bf16 code x scale in a stage's K or V half
// (`dst`: 64-wide panels of 128 rows, 128 bytes a row, the 128-byte swizzle: a row's 16-byte
// chunk c lies at chunk c ^ (row % 8)). Thread `c` (0..127) of the converters takes 16
// codes of a row in each pass. load() brings this thread's codes and scales into registers
// (zeros past the capacity); store() writes them.
template <int D>
struct Int8Tile {
    static constexpr int PIECES = D / 16;                 // 16-code pieces a row
    static constexpr int PASSES = BKV * PIECES / 128;     // rows each converter takes
    static constexpr int ROWS_A_PASS = 128 / PIECES;
    uint4 codes[2][PASSES];  // K's, V's
    float scales[2][PASSES];

    __device__ __forceinline__ void load(const signed char* k, const signed char* v,
                                         const float* ks, const float* vs, int key0,
                                         int capacity, int c) {
        const int piece = c % PIECES, r0 = c / PIECES;
#pragma unroll
        for (int i = 0; i < PASSES; ++i) {
            const int key = key0 + r0 + i * ROWS_A_PASS;
            const bool in = key < capacity;
            const long long at = static_cast<long long>(key) * D + piece * 16;
            codes[0][i] = in ? __ldg(reinterpret_cast<const uint4*>(k + at)) : make_uint4(0, 0, 0, 0);
            codes[1][i] = in ? __ldg(reinterpret_cast<const uint4*>(v + at)) : make_uint4(0, 0, 0, 0);
            scales[0][i] = in ? __ldg(ks + key) : 0.f;
            scales[1][i] = in ? __ldg(vs + key) : 0.f;
        }
    }

    __device__ __forceinline__ void store(unsigned dst, int c) const {
        const int piece = c % PIECES, r0 = c / PIECES;
        const int panel = piece * 16 / 64, chunk = piece * 16 % 64 / 8;  // two chunks a piece
#pragma unroll
        for (int kv = 0; kv < 2; ++kv) {
#pragma unroll
            for (int i = 0; i < PASSES; ++i) {
                const int r = r0 + i * ROWS_A_PASS;
                const unsigned row = dst + kv * KV_BYTES + panel * PANEL_BYTES + r * 128;
                unsigned packed[8];
                codes_to_bf16(codes[kv][i], scales[kv][i], packed,
                              [](unsigned w, float* f) { kv8x4_floats(w, f); });
                st_swizzled_pair(row, chunk, r, packed, panel & 1);  // (panel 1: other banks)
            }
        }
    }
};

// 2^x by the MUFU alone: results below 2^-126 (weights 1e-38 of the row's largest) flush to
// zero, which exp2f's extra instructions for subnormal results would keep.
__device__ __forceinline__ float exp2_ftz(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

template <int D>
__device__ __forceinline__ void attention_tile(const TensorMap& map_q, const KvSource& src_k,
                                               const KvSource& src_v, int start, int n,
                                               int capacity, float scale,
                                               bf16_t* __restrict__ out) {
    extern __shared__ unsigned char attn_shared[];
    __shared__ __align__(8) unsigned long long q_full, full[STAGES], empty[STAGES];
    const unsigned q_smem = (smem_addr(attn_shared) + 1023) & ~1023u;
    const unsigned ring = q_smem + Q_BYTES;
    const int head = blockIdx.x, kvh = head / qw::group;
    // The last query tiles have the most keys: they go first (every head's, as blocks start in
    // the order of x, then y), so none is left alone at the end.
    const int q0 = (gridDim.y - 1 - blockIdx.y) * BQ;
    const int kv_len = start + min(n, q0 + BQ);
    const int tiles = (kv_len + BKV - 1) / BKV;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;

    if (threadIdx.x == 0) {
        mbar_init(smem_addr(&q_full), 1);
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(smem_addr(&full[s]), qw::kv8 ? PRODUCERS : 1);  // each converter, or TMA
            mbar_init(smem_addr(&empty[s]), 8);  // every consumer warp
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();

    if (warp >= 8) {  // the producers
#if QW_PINGPONG
        asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(PRODUCER_REGS));
#endif
#if QW_KV8
        const int c = threadIdx.x - 256;
        if (c == 0) {
            const unsigned qbar = smem_addr(&q_full);
            mbar_expect_tx(qbar, Q_BYTES);
            for (int p = 0; p < PANELS; ++p)
                tma_load(q_smem + p * PANEL_BYTES, map_q, head * D + p * 64, q0, qbar);
        }
        const long long row0 = static_cast<long long>(kvh) * capacity;
        const signed char* k = static_cast<const signed char*>(src_k) + row0 * D;
        const signed char* v = static_cast<const signed char*>(src_v) + row0 * D;
        const float* ks = kv8_scales(src_k, capacity) + row0;
        const float* vs = kv8_scales(src_v, capacity) + row0;
        Int8Tile<D> tile;
        tile.load(k, v, ks, vs, 0, capacity, c);
        for (int j = 0; j < tiles; ++j) {
            const int s = j % STAGES;
            if (j >= STAGES) mbar_wait(smem_addr(&empty[s]), (j / STAGES - 1) & 1);
            tile.store(ring + s * STAGE_BYTES, c);
            // The tensor cores read what ordinary stores wrote: order them first.
            asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
            mbar_arrive(smem_addr(&full[s]));
            if (j + 1 < tiles) tile.load(k, v, ks, vs, (j + 1) * BKV, capacity, c);
        }
#else
        if (threadIdx.x == 256) {
            const unsigned qbar = smem_addr(&q_full);
            mbar_expect_tx(qbar, Q_BYTES);
            for (int p = 0; p < PANELS; ++p)
                tma_load(q_smem + p * PANEL_BYTES, map_q, head * D + p * 64, q0, qbar);
            for (int j = 0; j < tiles; ++j) {
                const int s = j % STAGES;
                if (j >= STAGES) mbar_wait(smem_addr(&empty[s]), (j / STAGES - 1) & 1);
                const unsigned bar = smem_addr(&full[s]), k_dst = ring + s * STAGE_BYTES;
                mbar_expect_tx(bar, STAGE_BYTES);
                const int row = kvh * capacity + j * BKV;
                for (int p = 0; p < PANELS; ++p) {
                    tma_load(k_dst + p * PANEL_BYTES, src_k, p * 64, row, bar);
                    tma_load(k_dst + KV_BYTES + p * PANEL_BYTES, src_v, p * 64, row, bar);
                }
            }
        }
#endif
        return;
    }

    // Consumer warpgroup wg: queries q0 + wg * 64 ..; this warp's 16 of them from row0.
    const int wg = warp >> 2, g = lane >> 2, t = lane & 3;
    const int row0 = q0 + wg * 64 + (warp & 3) * 16;
    const int pos_row[2] = {start + row0 + g, start + row0 + g + 8};
    const float qk_scale = scale * LOG2E;  // softmax in base 2
    float o[D / 2], s[BKV / 2];
#pragma unroll
    for (int i = 0; i < D / 2; ++i) asm volatile("" : "=f"(o[i]));
    float m_row[2] = {QW_NEG_INF, QW_NEG_INF}, l_row[2] = {0.f, 0.f};
    mbar_wait(smem_addr(&q_full), 0);

    unsigned pk[BKV / 16][4];  // P of a tile as bf16 A fragments, for its P V
    float alpha[2];
    // S = Q K^T of tile j into s (issued and committed, not waited for).
    const auto issue_qk = [&](int j) {
        const int st = j % STAGES;
        mbar_wait(smem_addr(&full[st]), (j / STAGES) & 1);
        const unsigned k_tile = ring + st * STAGE_BYTES;
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
            const unsigned slice = (kk / 4) * PANEL_BYTES + (kk % 4) * 32;
            Wgmma<BKV>::mma(s, smem_desc(q_smem + slice + wg * 64 * 128),
                            smem_desc(k_tile + slice), kk > 0);
        }
        wgmma_commit();
    };
    // The online softmax of tile j's scores in s (now probabilities); alpha: how far the
    // running sums so far shrink. The maxima are of the raw scores (the scale is positive), and
    // each exponent is one FMA: s x scale - max x scale, as FlashAttention-3 computes it.
    const auto softmax = [&](int j) {
        fence_operands(s);
        const bool diagonal = j * BKV + BKV - 1 > start + row0;
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            float mx = QW_NEG_INF;
#pragma unroll
            for (int c = 0; c < BKV / 8; ++c) {
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int key = j * BKV + c * 8 + t * 2 + e;
                    float& v = s[c * 4 + half * 2 + e];
                    if (diagonal && key > pos_row[half]) v = QW_NEG_INF;
                    mx = fmaxf(mx, v);
                }
            }
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
            const float m_new = fmaxf(m_row[half], mx);
            const float m_use = m_new == QW_NEG_INF ? 0.f : m_new * qk_scale;
            alpha[half] = exp2_ftz(fmaf(m_row[half], qk_scale, -m_use));
            float sum = 0.f;
#pragma unroll
            for (int c = 0; c < BKV / 8; ++c) {
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const float p = exp2_ftz(fmaf(s[c * 4 + half * 2 + e], qk_scale, -m_use));
                    s[c * 4 + half * 2 + e] = p;
                    sum += p;
                }
            }
            l_row[half] = l_row[half] * alpha[half] + sum;
            m_row[half] = m_new;
        }
    };
    const auto pack = [&] {
#pragma unroll
        for (int kk = 0; kk < BKV / 16; ++kk) {
            pk[kk][0] = pack_bf16x2(s[8 * kk], s[8 * kk + 1]);
            pk[kk][1] = pack_bf16x2(s[8 * kk + 2], s[8 * kk + 3]);
            pk[kk][2] = pack_bf16x2(s[8 * kk + 4], s[8 * kk + 5]);
            pk[kk][3] = pack_bf16x2(s[8 * kk + 6], s[8 * kk + 7]);
        }
    };
    // o *= alpha: the sums so far moved to this tile's maximum.
    const auto rescale = [&] {
#pragma unroll
        for (int d = 0; d < D / 8; ++d) {
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                o[d * 4 + half * 2] *= alpha[half];
                o[d * 4 + half * 2 + 1] *= alpha[half];
            }
        }
    };
    // O += P V of tile j (issued and committed): P's fragments from pk; V's 16 keys a step
    // are 16 rows of 128 bytes further on, its 64-wide slices PANEL_BYTES apart. The first
    // tile's products overwrite o.
    const auto issue_pv = [&](int j) {
        const unsigned v_tile = ring + (j % STAGES) * STAGE_BYTES + KV_BYTES;
#pragma unroll
        for (int kk = 0; kk < BKV / 16; ++kk)
            WgmmaRegA<D>::mma(o, pk[kk], smem_desc(v_tile + kk * 16 * 128, PANEL_BYTES),
                              j > 0 || kk > 0);
        wgmma_commit();
    };
    const auto release = [&](int j) {  // this warp is done with tile j's stage
        __syncwarp();
        if (lane == 0) mbar_arrive(smem_addr(&empty[j % STAGES]));
    };
#if QW_PINGPONG
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(CONSUMER_REGS));
    // FlashAttention-3's schedule. Within the warpgroup, tile j's S = Q K^T is issued with
    // tile j - 1's O += P V, and j's softmax runs while that P V finishes; between the two
    // warpgroups, named barriers 1 and 2 hand the tensor cores over in turn, so one's
    // softmax runs under the other's products. (o is rescaled once P V(j - 1) is done.)
    const auto handover_wait = [&] {
        asm volatile("bar.sync %0, 256;" ::"r"(1 + wg) : "memory");
    };
    const auto handover_give = [&] {
        asm volatile("bar.arrive %0, 256;" ::"r"(2 - wg) : "memory");
    };
    if (wg == 1) handover_give();  // warpgroup 0 goes first
    // Tile 0: its scores alone (o is first written by its P V, in the next round).
    handover_wait();
    issue_qk(0);
    if (tiles > 1 || wg == 0) handover_give();
    wgmma_wait<0>();
    softmax(0);
    pack();
    for (int j = 1; j < tiles; ++j) {
        handover_wait();
        issue_qk(j);
        fence_operands(o);
        issue_pv(j - 1);
        if (!(wg == 1 && j == tiles - 1)) handover_give();  // (the last one nobody waits for)
        wgmma_wait<1>();  // the scores are in; P V(j - 1) may still run
        softmax(j);
        wgmma_wait<0>();  // P V(j - 1) done: its stage goes back, o moves to this maximum
        fence_operands(o);
#pragma unroll
        for (int kk = 0; kk < BKV / 16; ++kk)
#pragma unroll
            for (int i = 0; i < 4; ++i) asm volatile("" : "+r"(pk[kk][i])::"memory");
        release(j - 1);
        rescale();
        pack();
    }
    fence_operands(o);  // the last tile's P V
    wgmma_fence();
    issue_pv(tiles - 1);
    wgmma_wait<0>();
    fence_operands(o);
    release(tiles - 1);
#else
    // One tile after the other: S = Q K^T, its softmax, O += P V, each waited for.
    for (int j = 0; j < tiles; ++j) {
        issue_qk(j);
        wgmma_wait<0>();
        softmax(j);
        if (j > 0) rescale();
        pack();
        fence_operands(o);
        wgmma_fence();
        issue_pv(j);
        wgmma_wait<0>();
        fence_operands(o);
        release(j);
    }
#endif

#pragma unroll
    for (int half = 0; half < 2; ++half) {
        float l = l_row[half];
        l += __shfl_xor_sync(0xffffffffu, l, 1);
        l += __shfl_xor_sync(0xffffffffu, l, 2);
        const int r = row0 + g + half * 8;
        if (r >= n) continue;
        const float inv = 1.f / l;
        bf16_t* dst = out + (static_cast<long long>(r) * qw::heads + head) * D;
#pragma unroll
        for (int d = 0; d < D / 8; ++d)
            *reinterpret_cast<unsigned*>(dst + d * 8 + t * 2) =
                pack_bf16x2(o[d * 4 + half * 2] * inv, o[d * 4 + half * 2 + 1] * inv);
    }
}
}  // namespace

// Grid: (heads, ceil(n / 128)); THREADS threads; SHARED_BYTES of dynamic shared memory.
extern "C" __global__ void __launch_bounds__(THREADS, 1)
    attn_prefill90(const __grid_constant__ TensorMap map_q, const __grid_constant__ KvSource map_k,
                   const __grid_constant__ KvSource map_v, int start, int n, int capacity,
                   float scale, bf16_t* out) {
    if constexpr (SUPPORTED) {
        attention_tile<HD>(map_q, map_k, map_v, start, n, capacity, scale, out);
    } else {
        __trap();  // the engine uses attention.cu for other head sizes
    }
}
