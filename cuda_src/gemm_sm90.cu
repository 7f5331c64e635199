// Prefill matrix products on Hopper (sm_90a): C[M, N] = A[M, K] . B[N, K]^T with wgmma, the
// tiles brought in by the tensor-memory accelerator (TMA). A holds bf16 activations (one row per
// token), B a bf16 weight matrix in its checkpoint layout (one row per output feature); both are
// K-contiguous, so both are "K-major" operands of wgmma.
//
// One block computes a 128 x BN tile (BN = 128 or 256) with three warpgroups: warpgroup 0 is
// the producer (one thread issues the TMA copies of each 64-deep K step into a ring of STAGES
// shared-memory stages), warpgroups 1 and 2 are the consumers (64 rows each, all BN columns,
// m64nBNk16 products with fp32 accumulators in registers). Each stage has a "full" barrier
// (the copies' bytes have landed) and an "empty" one (every consumer warp is done with it).
// The TMA writes each 64-element (128-byte) row with the 128-byte swizzle, which is the
// layout the wgmma descriptors below describe. Tails need no code: the tensor maps' bounds
// make the TMA fill rows past M or N and columns past K with zeros, and the epilogue stores
// only rows < M and columns < N.
//
// FP8 weights (weights.cuh, QW_FP8): the TMA copies B's codes into the stage instead, and the
// producer warpgroup's other three warps turn them into the bf16 tile (code x block scale,
// rounded, as gemm.cu does), fence them for the tensor cores and arrive on the full barrier.
//
// The host encodes the tensor maps (qwenchat/engine/cuda/prefill.py): A's box is 64 x 128,
// B's 64 x 128 (a BN = 256 tile takes two). Dynamic shared memory: SHARED_BYTES, mirrored
// by GEMM90_SHARED there.
#include "common.cuh"
#include "sm90_fp8.cuh"

namespace {
constexpr int BM = 128, BK = 64, BOX_ROWS = 128;
constexpr int CONSUMERS = 2, THREADS = 128 * (1 + CONSUMERS);
constexpr int A_BYTES = BM * BK * 2, BOX_BYTES = BOX_ROWS * BK * 2;  // 16 KiB each
constexpr int RING_BYTES = 192 * 1024;
constexpr int SHARED_BYTES = RING_BYTES + 1024;  // + the slack to align the ring to 1 KiB
static_assert(SHARED_BYTES == 193 * 1024, "GEMM90_SHARED in prefill.py mirrors this");

enum Epilogue { STORE_F32 = 0, ADD_F32 = 1, SWIGLU_BF16 = 2 };

// A stage: A's tile, B's bf16 tile, and with FP8 weights the codes B's tile is made from.
template <int BN>
struct Tiles {
    static constexpr int CODES_BYTES = qw::fp8 ? BN * BK : 0;
    static constexpr int STAGE_BYTES = A_BYTES + BN * BK * 2 + CODES_BYTES;
    // bf16: 4 at BN = 256, 6 at 128; FP8: 3 and 4.
    static constexpr int STAGES = RING_BYTES / STAGE_BYTES;
};
constexpr int CONVERTERS = 96;  // FP8: warps 1-3 of the producer warpgroup

// FP8: B's codes for one step into its bf16 tile (sm90_fp8.cuh's convert_codes_step): the
// tile's rows are gate/up's (SWIGLU_BF16: box 0 gate, box 1 up) or BN consecutive outputs.
template <int BN, int EPI>
__device__ __forceinline__ void convert_codes(unsigned tile, const unsigned char* codes,
                                              const unsigned char* __restrict__ b_rows, int N,
                                              int K, int step, int tile_n, int up_row) {
    convert_codes_step<BN, CONVERTERS>(
        tile, codes, b_rows, N + (EPI == SWIGLU_BF16 ? up_row : 0), K, step, [&](int r) {
            const int box = r / BOX_ROWS;
            return (EPI == SWIGLU_BF16 ? box * up_row + tile_n * BOX_ROWS
                                       : tile_n * BN + box * BOX_ROWS) + r % BOX_ROWS;
        });
}

// C (row stride ldc) = or += A . B^T for the tile (blockIdx.x, blockIdx.y): 128 rows of A
// from row blockIdx.x * 128 (the fast index, so the blocks running together share B's tile and
// B streams from memory about once), BN columns from blockIdx.y * BN. SWIGLU_BF16: B is
// [gate; up] with `up_row` rows of gate; the tile takes 128 gate rows and the 128 up rows of
// the same features, and writes bf16(silu(gate) * up) into 128 columns of C (bf16, ldc).
template <int BN, int EPI>
__device__ __forceinline__ void gemm_tile(const TensorMap& map_a, const TensorMap& map_b,
                                          const unsigned char* __restrict__ b_rows,
                                          void* __restrict__ c, int M, int N, int K, int up_row,
                                          int ldc) {
    constexpr int STAGE_BYTES = Tiles<BN>::STAGE_BYTES, STAGES = Tiles<BN>::STAGES;
    static_assert(EPI != SWIGLU_BF16 || BN == 256, "SwiGLU tiles pair 128 gate and 128 up rows");
    extern __shared__ unsigned char gemm_shared[];
    __shared__ __align__(8) unsigned long long full[STAGES], empty[STAGES], codes_full[STAGES];
    const unsigned ring = (smem_addr(gemm_shared) + 1023) & ~1023u;
    const int m0 = blockIdx.x * BM, tile_n = blockIdx.y;
    // Split K (gridDim.z > 1, STORE_F32 only): this block's run of steps from `first`, its
    // partial product into C's slice blockIdx.z (splitk_sum / splitk_swiglu add them up).
    const int all_steps = (K + BK - 1) / BK, per_split = (all_steps + gridDim.z - 1) / gridDim.z;
    const int first = blockIdx.z * per_split;
    const int steps = min(per_split, all_steps - first);  // >= 1: the host sees to it
    const int warpgroup = threadIdx.x >> 7;

    if (threadIdx.x == 0) {
        for (int s = 0; s < STAGES; ++s) {
            // FP8: the A copy's arrival and every converter's, once its part of B is written
            mbar_init(smem_addr(&full[s]), qw::fp8 ? 1 + CONVERTERS : 1);
            mbar_init(smem_addr(&empty[s]), CONSUMERS * 4);
            mbar_init(smem_addr(&codes_full[s]), 1);
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();

    if (warpgroup == 0) {  // the producer: one thread walks K, STAGES - 1 steps ahead at most
        if (threadIdx.x == 0) {
            asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<unsigned long long>(&map_a))
                         : "memory");
            asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<unsigned long long>(&map_b))
                         : "memory");
            for (int step = 0; step < steps; ++step) {
                const int s = step % STAGES;
                if (step >= STAGES) mbar_wait(smem_addr(&empty[s]), (step / STAGES - 1) & 1);
                const unsigned bar = smem_addr(&full[s]);
                const unsigned a_dst = ring + s * STAGE_BYTES, b_dst = a_dst + A_BYTES;
                if constexpr (qw::fp8) {  // the codes go to the converters, not the consumers
                    mbar_expect_tx(bar, A_BYTES);
                    tma_load(a_dst, map_a, (first + step) * BK, m0, bar);
                    const unsigned codes_bar = smem_addr(&codes_full[s]);
                    mbar_expect_tx(codes_bar, Tiles<BN>::CODES_BYTES);
#pragma unroll
                    for (int box = 0; box < BN / BOX_ROWS; ++box) {
                        const int row = EPI == SWIGLU_BF16 ? box * up_row + tile_n * BOX_ROWS
                                                           : tile_n * BN + box * BOX_ROWS;
                        tma_load(b_dst + BN * BK * 2 + box * BOX_ROWS * BK, map_b,
                                 (first + step) * BK, row, codes_bar);
                    }
                    continue;
                }
                mbar_expect_tx(bar, STAGE_BYTES);
                tma_load(a_dst, map_a, (first + step) * BK, m0, bar);
                // STORE/ADD with up_row > 0: B's depth, A's K a multiple of it: A's columns walk
                // B's again (eval's LM head: each row's two bf16 parts against one set of rows)
                const int b_col = EPI != SWIGLU_BF16 && up_row > 0 ? (first + step) * BK % up_row
                                                                  : (first + step) * BK;
#pragma unroll
                for (int box = 0; box < BN / BOX_ROWS; ++box) {
                    const int row = EPI == SWIGLU_BF16 ? box * up_row + tile_n * BOX_ROWS
                                                       : tile_n * BN + box * BOX_ROWS;
                    tma_load(b_dst + box * BOX_BYTES, map_b, b_col, row, bar);
                }
            }
        } else if (qw::fp8 && threadIdx.x >= 32) {  // the converters, in step with the copies
            for (int step = 0; step < steps; ++step) {
                const int s = step % STAGES;
                mbar_wait(smem_addr(&codes_full[s]), (step / STAGES) & 1);
                const unsigned b_dst = ring + s * STAGE_BYTES + A_BYTES;
                convert_codes<BN, EPI>(b_dst, gemm_shared + (b_dst + BN * BK * 2 - smem_addr(gemm_shared)),
                                       b_rows, N, K, first + step, tile_n, up_row);
                // The tensor cores read what ordinary stores wrote: order them first.
                asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
                mbar_arrive(smem_addr(&full[s]));
            }
        }
        return;
    }

    // The consumers: warpgroup 1 takes rows 0-63 of the tile, warpgroup 2 rows 64-127.
    const int half = warpgroup - 1;
    float d[BN / 2];
    wgmma_consume<BN, STAGES, STAGE_BYTES, A_BYTES>(d, ring, half, full, empty, steps);

    // d[j * 4 + e]: row (warp % 4) * 16 + lane / 4 (+ 8 for e >= 2), column j * 8 + (lane % 4) * 2
    // (+ 1 for odd e) of this warpgroup's 64 x BN part.
    const int lane = threadIdx.x & 31, w = (threadIdx.x >> 5) & 3;
    const int row0 = m0 + half * 64 + w * 16 + (lane >> 2);
    const int col0 = (lane & 3) * 2;
    if constexpr (EPI == SWIGLU_BF16) {
        store_swiglu(d, static_cast<bf16_t*>(c), row0, tile_n * BOX_ROWS + col0, M, N, ldc);
    } else {
        store_accumulators<EPI == ADD_F32>(
            d, static_cast<float*>(c) + static_cast<long long>(blockIdx.z) * M * ldc, row0,
            tile_n * BN + col0, M, N, ldc);
    }
}
}  // namespace

// b_rows: B itself, for FP8 weights' scales (the map covers their codes); unused for bf16.
// ldc: C's row stride (N, or more where C's columns are written a slice of B at a time).
#define GEMM90(name, BN, EPI)                                                                   \
    extern "C" __global__ void __launch_bounds__(THREADS, 1)                                   \
        name(const __grid_constant__ TensorMap map_a, const __grid_constant__ TensorMap map_b, \
             const unsigned char* b_rows, void* c, int M, int N, int K, int up_row, int ldc) { \
        gemm_tile<BN, EPI>(map_a, map_b, b_rows, c, M, N, K, up_row, ldc);                     \
    }

// QW_PART n (0-4) builds one of the five products alone, 5 the split-K sums: the host compiles
// them as six programs on six threads, since ptxas takes each wgmma instantiation on its own
// (and the sums beside the SwiGLU product cost more than their own compile: 1.32 s together,
// 1.12 + 0.24 apart, NVRTC on a 2-core host); without it, all of them (engine.py SM90_PARTS).
#if QW_IN_PART(0)
GEMM90(gemm90_swiglu, 256, SWIGLU_BF16)  // gate/up, SwiGLU applied: down_proj's bf16 input
#endif
#if QW_IN_PART(1)
GEMM90(gemm90_store_128, 128, STORE_F32)  // Q/K/V (fp32 out)
#endif
#if QW_IN_PART(2)
GEMM90(gemm90_store_256, 256, STORE_F32)
#endif
#if QW_IN_PART(3)
GEMM90(gemm90_add_128, 128, ADD_F32)  // o_proj, down_proj into the fp32 residual stream
#endif
#if QW_IN_PART(4)
GEMM90(gemm90_add_256, 256, ADD_F32)
#endif
#if QW_IN_PART(5)

// Split K's sums: C (rows ldc apart) = or += (add) the `splits` partial products parts[z]
// (M x N each, in the order of z: the same bits run after run). Grid-stride over M x N.
extern "C" __global__ void __launch_bounds__(256)
    splitk_sum(const float* __restrict__ parts, int splits, int M, int N, float* __restrict__ c,
               int ldc, int add) {
    const long long total = static_cast<long long>(M) * N;
    for (long long i = blockIdx.x * 256ll + threadIdx.x; i < total; i += gridDim.x * 256ll) {
        float sum = 0.f;
        for (int z = 0; z < splits; ++z) sum += parts[z * total + i];
        float* o = c + (i / N) * ldc + i % N;
        *o = add ? *o + sum : sum;
    }
}

// Split K's SwiGLU: act[m][f] = bf16(silu(gate) * up) with gate and up the sums of the partial
// products of gate/up's rows f and inter + f (parts[z]: M x 2 inter), as gemm90_swiglu's;
// act's rows are ldc apart (inter, or more for a slice of the features).
extern "C" __global__ void __launch_bounds__(256)
    splitk_swiglu(const float* __restrict__ parts, int splits, int M, int inter,
                  bf16_t* __restrict__ act, int ldc) {
    const long long total = static_cast<long long>(M) * inter, part = 2 * total;
    for (long long i = blockIdx.x * 256ll + threadIdx.x; i < total; i += gridDim.x * 256ll) {
        const long long m = i / inter, f = i % inter;
        float gate = 0.f, up = 0.f;
        for (int z = 0; z < splits; ++z) {
            gate += parts[z * part + m * 2 * inter + f];
            up += parts[z * part + m * 2 * inter + inter + f];
        }
        act[m * ldc + f] = f32_to_bf16(silu(gate) * up);
    }
}
#endif  // QW_IN_PART(5)
