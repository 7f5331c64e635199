// DRAFT (issue 25, written without a GPU, never run): prefill matrix products with FP8
// weights on Hopper's FP8 tensor cores. C[M, N] = A[M, K] . B[N, K]^T where
//   A: activations as e4m3 codes (M rows of K bytes) with a float scale a row and 128
//      columns (a_scales[M][K / 128]), made by quantize_rows_e4m3 below: Qwen's "dynamic"
//      scheme, the reference engine's fp8_activations (fp8.quantize_activations);
//   B: the FP8 weights' packed rows (weights.cuh: K codes, then a float scale a 128 columns;
//      the rows of one 128 x 128 block share it).
// One block computes a 128 x 128 tile: warpgroup 0's first thread copies each 128-deep K block
// of A and B (one scale block of both: 128 rows of 128 bytes each, 128-byte swizzle) into a
// ring of STAGES stages; warpgroups 1 and 2 (64 rows each) run four m64n128k32 e4m3 wgmmas
// a block into fresh fp32 partial sums, then promote them on the CUDA cores: C += partial x
// a_scale(row, block) x b_scale(block). Tails: the tensor maps' bounds fill with zeros.
// The host (to write: prefill.py) encodes A's map as M rows of K bytes and B's as N rows of
// its codes (row_bytes apart), boxes of 128 x 128 bytes, 128-byte swizzle.
#include "common.cuh"
#include "sm90.cuh"
#include "weights.cuh"

namespace {
constexpr int BM = 128, BN = 128, BK = 128;  // BK: one scale block of A and of B
constexpr int TILE_BYTES = 128 * BK;         // 128 rows of 128 e4m3 codes
constexpr int STAGE_BYTES = 2 * TILE_BYTES;  // A's tile, then B's
constexpr int STAGES = 6;
constexpr int SHARED_BYTES = STAGES * STAGE_BYTES + 1024;  // + the slack to align to 1 KiB
static_assert(SHARED_BYTES <= 227 * 1024, "one block's shared memory on an H100");
constexpr int THREADS = 3 * 128;

enum Epilogue { STORE_F32 = 0, ADD_F32 = 1 };

template <int EPI>
__device__ __forceinline__ void gemm_fp8_tile(const TensorMap& map_a, const TensorMap& map_b,
                                              const float* __restrict__ a_scales,
                                              const unsigned char* __restrict__ b_rows,
                                              float* __restrict__ c, int M, int N, int K,
                                              int ldc) {
    extern __shared__ unsigned char gemm_shared[];
    __shared__ __align__(8) unsigned long long full[STAGES], empty[STAGES];
    const unsigned ring = (smem_addr(gemm_shared) + 1023) & ~1023u;
    const int m0 = blockIdx.x * BM, tile_n = blockIdx.y;
    const int steps = (K + BK - 1) / BK;
    const int warpgroup = threadIdx.x >> 7;

    if (threadIdx.x == 0) {
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(smem_addr(&full[s]), 1);
            mbar_init(smem_addr(&empty[s]), 2 * 4);  // every consumer warp
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();

    if (warpgroup == 0) {
        if (threadIdx.x == 0) {
            for (int step = 0; step < steps; ++step) {
                const int s = step % STAGES;
                if (step >= STAGES) mbar_wait(smem_addr(&empty[s]), (step / STAGES - 1) & 1);
                const unsigned bar = smem_addr(&full[s]), a_dst = ring + s * STAGE_BYTES;
                mbar_expect_tx(bar, STAGE_BYTES);
                tma_load(a_dst, map_a, step * BK, m0, bar);
                tma_load(a_dst + TILE_BYTES, map_b, step * BK, tile_n * BN, bar);
            }
        }
        return;
    }

    const int half = warpgroup - 1, lane = threadIdx.x & 31, w = (threadIdx.x >> 5) & 3;
    const int row0 = m0 + half * 64 + w * 16 + (lane >> 2);  // this thread's rows: +0, +8
    const int blocks = (K + 127) / 128;
    // The tile's B rows share their blocks' scales (one 128 x 128 block a K block).
    const float* b_scale = reinterpret_cast<const float*>(
        b_rows + static_cast<long long>(min(tile_n * BN, N - 1)) * row_bytes<qw::FP8>(K) + K);
    const auto a_scale = [&](int row, int step) {
        return row < M ? __ldg(a_scales + static_cast<long long>(row) * blocks + step) : 0.f;
    };
    float d[BN / 2], p[BN / 2];
#pragma unroll
    for (int i = 0; i < BN / 2; ++i) d[i] = 0.f;
    float sa0 = a_scale(row0, 0), sa1 = a_scale(row0 + 8, 0), sb = __ldg(b_scale);
    for (int step = 0; step < steps; ++step) {
        const int s = step % STAGES;
        mbar_wait(smem_addr(&full[s]), (step / STAGES) & 1);
        const unsigned a = ring + s * STAGE_BYTES + half * 64 * 128, b = ring + s * STAGE_BYTES + TILE_BYTES;
        fence_operands(p);
        wgmma_fence();
#pragma unroll
        for (int k = 0; k < BK / 32; ++k)  // 32 codes (bytes) a step along the swizzled rows
            WgmmaE4m3::mma(p, smem_desc(a + k * 32), smem_desc(b + k * 32), k > 0);
        wgmma_commit();
        // the next block's scales while the products run
        const bool more = step + 1 < steps;
        const float na0 = more ? a_scale(row0, step + 1) : 0.f;
        const float na1 = more ? a_scale(row0 + 8, step + 1) : 0.f;
        const float nb = more ? __ldg(b_scale + step + 1) : 0.f;
        wgmma_wait<0>();
        fence_operands(p);
        if (lane == 0) mbar_arrive(smem_addr(&empty[s]));  // the stage is read
        const float s0 = sa0 * sb, s1 = sa1 * sb;
#pragma unroll
        for (int j = 0; j < BN / 8; ++j) {  // promotion: p[j * 4 + e], rows +0 (e < 2), +8
            d[j * 4] += p[j * 4] * s0;
            d[j * 4 + 1] += p[j * 4 + 1] * s0;
            d[j * 4 + 2] += p[j * 4 + 2] * s1;
            d[j * 4 + 3] += p[j * 4 + 3] * s1;
        }
        sa0 = na0;
        sa1 = na1;
        sb = nb;
    }

    // d[j * 4 + e]: row row0 (+ 8 for e >= 2), column tile_n * BN + j * 8 + (lane % 4) * 2
    // (+ 1 for odd e)
    const int col0 = (lane & 3) * 2;
#pragma unroll
    for (int j = 0; j < BN / 8; ++j) {
        const int col = tile_n * BN + j * 8 + col0;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int row = row0 + h * 8;
            if (row >= M || col >= N) continue;
            float* o = c + static_cast<long long>(row) * ldc + col;
            const float v0 = d[j * 4 + h * 2], v1 = d[j * 4 + h * 2 + 1];
            o[0] = EPI == ADD_F32 ? o[0] + v0 : v0;
            if (col + 1 < N) o[1] = EPI == ADD_F32 ? o[1] + v1 : v1;
        }
    }
}
}  // namespace

#define GEMM_FP8(name, EPI)                                                                    \
    extern "C" __global__ void __launch_bounds__(THREADS, 1)                                   \
        name(const __grid_constant__ TensorMap map_a, const __grid_constant__ TensorMap map_b, \
             const float* a_scales, const unsigned char* b_rows, float* c, int M, int N,       \
             int K, int ldc) {                                                                  \
        gemm_fp8_tile<EPI>(map_a, map_b, a_scales, b_rows, c, M, N, K, ldc);                   \
    }

GEMM_FP8(gemm_fp8_store, STORE_F32)  // Q/K/V
GEMM_FP8(gemm_fp8_add, ADD_F32)      // o_proj, down_proj into the residual stream

// rows (M x K bf16, ld apart) -> e4m3 codes (M x K bytes) and a float scale a row and 128
// columns (scales[M][ceil(K / 128)]): scale = max |x| / 448, code = e4m3(x / scale) rounded to
// nearest even (IEEE division, as fp8.quantize_activations). Grid: (ceil(K / 128), M); 32
// threads, 4 columns each.
extern "C" __global__ void __launch_bounds__(32)
    quantize_rows_e4m3(const bf16_t* __restrict__ rows, int M, int K, int ld,
                       unsigned char* __restrict__ codes, float* __restrict__ scales) {
    const int group = blockIdx.x, row = blockIdx.y, lane = threadIdx.x;
    const int c0 = group * 128 + lane * 4;
    float v[4];
#pragma unroll
    for (int e = 0; e < 4; ++e)
        v[e] = c0 + e < K ? bf16_to_f32(rows[static_cast<long long>(row) * ld + c0 + e]) : 0.f;
    float mx = fmaxf(fmaxf(fabsf(v[0]), fabsf(v[1])), fmaxf(fabsf(v[2]), fabsf(v[3])));
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    const float scale = __fdiv_rn(mx, 448.f);
    const float safe = scale > 0.f ? scale : 1.f;
    unsigned short pair[2];
#pragma unroll
    for (int e = 0; e < 2; ++e)  // cvt takes (hi, lo): the lower column in the low byte
        asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;"
            : "=h"(pair[e])
            : "f"(__fdiv_rn(v[2 * e + 1], safe)), "f"(__fdiv_rn(v[2 * e], safe)));
    unsigned char* out = codes + static_cast<long long>(row) * K + c0;
    if (c0 + 3 < K && (K & 3) == 0) {
        *reinterpret_cast<unsigned*>(out) = pair[0] | (static_cast<unsigned>(pair[1]) << 16);
    } else {
#pragma unroll
        for (int e = 0; e < 4; ++e)
            if (c0 + e < K) out[e] = static_cast<unsigned char>(pair[e / 2] >> (8 * (e % 2)));
    }
    if (lane == 0) scales[static_cast<long long>(row) * gridDim.x + group] = scale;
}
