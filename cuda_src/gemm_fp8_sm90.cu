// Prefill matrix products with FP8 weights on Hopper's FP8 tensor cores (issue 25).
// C[M, N] = A[M, K] . B[N, K]^T where
//   A: activations as e4m3 codes (M rows of K bytes) with a float scale a row and 128
//      columns (a_scales[M][K / 128]), made by quantize_rows_e4m3 below or by the SwiGLU
//      product's epilogue: Qwen's "dynamic" scheme, the reference engine's fp8_activations
//      (fp8.quantize_activations);
//   B: the FP8 weights' packed rows (weights.cuh: K codes, then a float scale a 128 columns;
//      the rows of one 128 x 128 block share it).
// One block computes a 128 x BN tile (BN 128 or 256): warpgroup 0's first thread copies each
// 128-deep K block of A and B (one scale block of both: boxes of 128 rows of 128 bytes,
// 128-byte swizzle) into a ring of stages; warpgroups 1 and 2 (64 rows each) run, for each box
// of B, four m64n128k32 e4m3 wgmmas into fresh fp32 partial sums, then promote them on the
// CUDA cores: C += partial x a_scale(row, block) x b_scale(block) (DeepGEMM's scheme: the
// tensor cores' own accumulation of e4m3 products keeps fewer bits than fp32). Tails: the
// tensor maps' bounds fill with zeros. The host (prefill.py) encodes A's map as M rows of K
// bytes and B's as N rows of its codes (row_bytes apart).
#include "common.cuh"
#include "sm90.cuh"
#include "weights.cuh"

namespace {
constexpr int BM = 128, BK = 128;  // BK: one scale block of A and of B
constexpr int BOX_BYTES = 128 * BK;  // 128 rows of 128 e4m3 codes: one TMA box
constexpr int RING_BYTES = 192 * 1024;
constexpr int SHARED_BYTES = RING_BYTES + 1024;  // + the slack to align to 1 KiB
constexpr int THREADS = 3 * 128;
// Registers a thread, given back by the producer warpgroup and taken by the consumers (one
// block an SM: 128 x 40 + 256 x 232 <= 65,536).
constexpr int PRODUCER_REGS = 40, CONSUMER_REGS = 232;

enum Epilogue { STORE_F32 = 0, ADD_F32 = 1, SWIGLU_E4M3 = 2 };

// A tile: 128 rows of A by BN rows of B (BN / 128 boxes; SwiGLU: 128 gate rows, then the up
// rows of the same 128 features), a stage each 128-deep K block.
template <int BN>
struct Tiles {
    static constexpr int STAGE_BYTES = BOX_BYTES * (1 + BN / 128);
    static constexpr int STAGES = RING_BYTES / STAGE_BYTES;
};

template <int EPI, int BN>
__device__ __forceinline__ void gemm_fp8_tile(const TensorMap& map_a, const TensorMap& map_b,
                                              const float* __restrict__ a_scales,
                                              const unsigned char* __restrict__ b_rows,
                                              void* __restrict__ c, float* __restrict__ c_scales,
                                              int M, int N, int K, int ldc, int up_row) {
    static_assert(EPI != SWIGLU_E4M3 || BN == 256, "SwiGLU takes a gate box and an up box");
    constexpr int STAGE_BYTES = Tiles<BN>::STAGE_BYTES, STAGES = Tiles<BN>::STAGES;
    constexpr int BOXES = BN / 128;
    extern __shared__ unsigned char gemm_shared[];
    __shared__ __align__(8) unsigned long long full[STAGES], empty[STAGES];
    const unsigned ring = (smem_addr(gemm_shared) + 1023) & ~1023u;
    const int m0 = blockIdx.x * BM, tile_n = blockIdx.y;
    const int steps = (K + BK - 1) / BK;
    const int warpgroup = threadIdx.x >> 7;
    // B's first row of each box: the tile's BN rows, or (SwiGLU) its features' gate and up rows
    const int b_row0 = tile_n * (EPI == SWIGLU_E4M3 ? 128 : BN);
    const auto box_row = [&](int box) {
        return EPI == SWIGLU_E4M3 && box == 1 ? up_row + b_row0 : b_row0 + 128 * box;
    };

    if (threadIdx.x == 0) {
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(smem_addr(&full[s]), 1);
            mbar_init(smem_addr(&empty[s]), 2 * 4);  // every consumer warp
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();

    if (warpgroup == 0) {
        asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(PRODUCER_REGS));
        if (threadIdx.x == 0) {
            for (int step = 0; step < steps; ++step) {
                const int s = step % STAGES;
                if (step >= STAGES) mbar_wait(smem_addr(&empty[s]), (step / STAGES - 1) & 1);
                const unsigned bar = smem_addr(&full[s]), dst = ring + s * STAGE_BYTES;
                mbar_expect_tx(bar, STAGE_BYTES);
                tma_load(dst, map_a, step * BK, m0, bar);
#pragma unroll
                for (int box = 0; box < BOXES; ++box)
                    tma_load(dst + (1 + box) * BOX_BYTES, map_b, step * BK, box_row(box), bar);
            }
        }
        return;
    }
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(CONSUMER_REGS));

    const int half = warpgroup - 1, lane = threadIdx.x & 31, w = (threadIdx.x >> 5) & 3;
    const int row0 = m0 + half * 64 + w * 16 + (lane >> 2);  // this thread's rows: +0, +8
    const int blocks = (K + 127) / 128;
    // Each 128 x 128 block of B shares one scale: a box's first row's (rows past B: its last's).
    const int b_rows_total = EPI == SWIGLU_E4M3 ? up_row + N : N;
    const float* b_scale[BOXES];
#pragma unroll
    for (int box = 0; box < BOXES; ++box)
        b_scale[box] = reinterpret_cast<const float*>(
            b_rows + static_cast<long long>(min(box_row(box), b_rows_total - 1)) *
                         row_bytes<qw::FP8>(K) + K);
    const float* a_row0 = a_scales + static_cast<long long>(min(row0, M - 1)) * blocks;
    const float* a_row1 = a_scales + static_cast<long long>(min(row0 + 8, M - 1)) * blocks;

    // One K block's products of B's box `box` into fresh partial sums p (issued, not waited).
    const auto issue = [&](float (&p)[64], int step, int box) {
        const int s = step % STAGES;
        if (box == 0) mbar_wait(smem_addr(&full[s]), (step / STAGES) & 1);
        const unsigned a = ring + s * STAGE_BYTES + half * 64 * BK;
        const unsigned b = ring + s * STAGE_BYTES + (1 + box) * BOX_BYTES;
        fence_operands(p);
        wgmma_fence();
#pragma unroll
        for (int k = 0; k < BK / 32; ++k)  // 32 codes (bytes) a step along the swizzled rows
            WgmmaE4m3::mma(p, smem_desc(a + k * 32), smem_desc(b + k * 32), k > 0);
        wgmma_commit();
    };
    // d[box * 64 ..] += p x (A's row scale x B's block scale) (s0, s1: this thread's rows'),
    // once p's products are done.
    float d[BN / 2];
#pragma unroll
    for (int i = 0; i < BN / 2; ++i) d[i] = 0.f;
    const auto promote = [&](float (&p)[64], int box, float s0, float s1) {
        fence_operands(p);
#pragma unroll
        for (int j = 0; j < 16; ++j) {  // p[j * 4 + e]: rows +0 (e < 2), +8
            d[box * 64 + j * 4] += p[j * 4] * s0;
            d[box * 64 + j * 4 + 1] += p[j * 4 + 1] * s0;
            d[box * 64 + j * 4 + 2] += p[j * 4 + 2] * s1;
            d[box * 64 + j * 4 + 3] += p[j * 4 + 3] * s1;
        }
    };
    // Each box's products into p, then promoted. (Two sets of partial sums in turn, one
    // block's products under the other's promotion, made ptxas serialize the wgmmas: slower,
    // docs/perf.md.) The other consumer warpgroup's products run under this one's promotion.
    float p[64];
    for (int step = 0; step < steps; ++step) {
#pragma unroll
        for (int box = 0; box < BOXES; ++box) {
            issue(p, step, box);
            const float sb = __ldg(b_scale[box] + step);  // (loaded while the products run)
            const float s0 = __ldg(a_row0 + step) * sb, s1 = __ldg(a_row1 + step) * sb;
            wgmma_wait<0>();
            if (box == BOXES - 1 && lane == 0) mbar_arrive(smem_addr(&empty[step % STAGES]));
            promote(p, box, s0, s1);
        }
    }

    // d[box * 64 + j * 4 + e]: row row0 (+ 8 for e >= 2), column box * 128 + j * 8 + (lane % 4)
    // * 2 (+ 1 for odd e) of the tile (SwiGLU: box 0 the features' gate, box 1 their up)
    const int col0 = (lane & 3) * 2;
    if constexpr (EPI == SWIGLU_E4M3) {
        // act = silu(gate) x up of 128 features: one group of the e4m3 activations the down
        // product reads. Its scale: max |act| / 448 over the row's 128 (this thread's 32 and
        // its quad's), as fp8.quantize_activations.
        float amax[2] = {0.f, 0.f};
#pragma unroll
        for (int i = 0; i < 64; ++i) {  // (features past N: the gate box's rows past the gate
            const bool inside = b_row0 + (i >> 2) * 8 + col0 + (i & 1) < N;  // rows are not)
            d[i] = inside ? silu(d[i]) * d[64 + i] : 0.f;
            amax[(i >> 1) & 1] = fmaxf(amax[(i >> 1) & 1], fabsf(d[i]));
        }
        unsigned char* codes = static_cast<unsigned char*>(c);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            amax[h] = fmaxf(amax[h], __shfl_xor_sync(0xffffffffu, amax[h], 1));
            amax[h] = fmaxf(amax[h], __shfl_xor_sync(0xffffffffu, amax[h], 2));
            const int row = row0 + h * 8;
            if (row >= M) continue;
            const float scale = __fdiv_rn(amax[h], 448.f);
            // (a multiply by the reciprocal, not quantize_rows_e4m3's IEEE division: 64
            // divisions a thread cost this product 15%; the codes differ only where x / scale
            // lies within an ulp of a rounding boundary)
            const float inverse = scale > 0.f ? 1.f / scale : 1.f;
            unsigned char* out = codes + static_cast<long long>(row) * ldc + b_row0;
#pragma unroll
            for (int j = 0; j < 16; ++j) {
                const unsigned short pair =
                    pack_e4m3x2(d[j * 4 + h * 2] * inverse, d[j * 4 + h * 2 + 1] * inverse);
                if (b_row0 + j * 8 + col0 < N)
                    *reinterpret_cast<unsigned short*>(out + j * 8 + col0) = pair;
            }
            if ((lane & 3) == 0) c_scales[static_cast<long long>(row) * ((N + 127) / 128) + tile_n] = scale;
        }
    } else {
        store_accumulators<EPI == ADD_F32>(d, static_cast<float*>(c), row0, b_row0 + col0, M, N,
                                           ldc);
    }
}
}  // namespace

// map_a: A's codes (M rows of K bytes), map_b: B's codes in its packed rows, both in boxes of
// 128 rows of 128 bytes with the 128-byte swizzle; a_scales: A's (M x ceil(K / 128)); b_rows:
// B itself (its rows' scales). C: fp32 (N columns, rows ldc apart), or for SwiGLU the e4m3
// codes of silu(gate) x up for N features (rows ldc bytes apart) and their scales (c_scales,
// M x N / 128); gate row f's up row is up_row + f (N and up_row multiples of 128 there).
#define GEMM_FP8(name, EPI, BN)                                                       \
    extern "C" __global__ void __launch_bounds__(THREADS, 1)                                   \
        name(const __grid_constant__ TensorMap map_a, const __grid_constant__ TensorMap map_b, \
             const float* a_scales, const unsigned char* b_rows, void* c, float* c_scales,     \
             int M, int N, int K, int up_row, int ldc) {                                       \
        gemm_fp8_tile<EPI, BN>(map_a, map_b, a_scales, b_rows, c, c_scales, M, N, K, ldc,       \
                               up_row);                                                        \
    }

// QW_PART n (0-4): one product alone, 5 the quantizer, as for gemm_sm90.cu.
#if QW_IN_PART(0)
GEMM_FP8(gemm_fp8_swiglu, SWIGLU_E4M3, 256)  // gate/up: act for down_proj, in e4m3
#endif
#if QW_IN_PART(1)
GEMM_FP8(gemm_fp8_store_128, STORE_F32, 128)  // Q/K/V
#endif
#if QW_IN_PART(2)
GEMM_FP8(gemm_fp8_store_256, STORE_F32, 256)
#endif
#if QW_IN_PART(3)
GEMM_FP8(gemm_fp8_add_128, ADD_F32, 128)  // o_proj, down_proj into the residual stream
#endif
#if QW_IN_PART(4)
GEMM_FP8(gemm_fp8_add_256, ADD_F32, 256)
#endif
#if QW_IN_PART(5)

// rows (M x K bf16, ld apart) -> e4m3 codes (M x K bytes) and a float scale a row and 128
// columns (scales[M][ceil(K / 128)]): scale = max |x| / 448, code = e4m3(x / scale) rounded to
// nearest even (IEEE division, as fp8.quantize_activations). A warp a group of 128 columns of
// a row (4 columns a lane), 8 warps a block: grid ceil(M x ceil(K / 128) / 8).
extern "C" __global__ void __launch_bounds__(256)
    quantize_rows_e4m3(const bf16_t* __restrict__ rows, int M, int K, int ld,
                       unsigned char* __restrict__ codes, float* __restrict__ scales) {
    const int groups = (K + 127) / 128, lane = threadIdx.x & 31;
    const long long item = static_cast<long long>(blockIdx.x) * 8 + (threadIdx.x >> 5);
    if (item >= static_cast<long long>(M) * groups) return;
    const int row = static_cast<int>(item / groups), group = static_cast<int>(item % groups);
    const int c0 = group * 128 + lane * 4;
    const bf16_t* in = rows + static_cast<long long>(row) * ld + c0;
    const bool whole = c0 + 3 < K && (ld & 3) == 0 && (K & 3) == 0;
    float v[4];
    if (whole) {  // one 8-byte load
        const uint2 packed = *reinterpret_cast<const uint2*>(in);
        v[0] = bf16_lo(packed.x);
        v[1] = bf16_hi(packed.x);
        v[2] = bf16_lo(packed.y);
        v[3] = bf16_hi(packed.y);
    } else {
#pragma unroll
        for (int e = 0; e < 4; ++e) v[e] = c0 + e < K ? bf16_to_f32(in[e]) : 0.f;
    }
    float mx = fmaxf(fmaxf(fabsf(v[0]), fabsf(v[1])), fmaxf(fabsf(v[2]), fabsf(v[3])));
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    const float scale = __fdiv_rn(mx, 448.f);
    const float safe = scale > 0.f ? scale : 1.f;
    unsigned short pair[2];
#pragma unroll
    for (int e = 0; e < 2; ++e)
        pair[e] = pack_e4m3x2(__fdiv_rn(v[2 * e], safe), __fdiv_rn(v[2 * e + 1], safe));
    unsigned char* out = codes + static_cast<long long>(row) * K + c0;
    if (whole) {
        *reinterpret_cast<unsigned*>(out) = pair[0] | (static_cast<unsigned>(pair[1]) << 16);
    } else {
#pragma unroll
        for (int e = 0; e < 4; ++e)
            if (c0 + e < K) out[e] = static_cast<unsigned char>(pair[e / 2] >> (8 * (e % 2)));
    }
    if (lane == 0) scales[static_cast<long long>(row) * groups + group] = scale;
}
#endif  // QW_IN_PART(5)
