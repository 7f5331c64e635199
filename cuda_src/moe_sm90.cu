// A mixture of experts' grouped prefill products on Hopper (sm_90a, bf16 experts): moe.cu's
// moe_gemm with wgmma, for the tiles moe_place listed (an expert's run of at most 128 routed
// pairs, in the grouped order: {expert, its first pair, its pairs, the tile's first of them}).
//
// The block is gemm_sm90.cu's: a producer warpgroup fills a ring of STAGES 64-deep steps, two
// consumer warpgroups (64 rows each) multiply them, m64n256k16 with fp32 accumulators. What
// differs is A: a tile's rows are its pairs' token rows, scattered over the chunk (gate/up:
// xn gathered through the pairs' tokens; the TMA cannot gather rows on sm_90), so each of the
// producer's 128 threads copies its own row of each step with cp.async, writing the 128-byte
// swizzle the TMA would have; B (the expert's weights, one row a feature) comes by the TMA as
// in gemm_sm90.cu. A stage is full once the TMA's bytes have landed and each producer thread
// has seen its copies land (cp.async.wait_group, LAG steps behind its issue so that several
// steps stay in flight) and fenced them for the tensor cores (the async proxy).
//
// moe90_gate_up: act[pair] = bf16(silu(gate) * up), the tile's 128 gate rows and the 128 up
// rows of the same features, as gemm90_swiglu: no fp32 gate/up rows, no moe_swiglu.
// moe90_down: y[pair] = act[pair] . down^T (fp32), A's rows in the grouped order already.
// Rows past a tile's pairs are zeros in shared memory and never stored; columns past K are
// zeros, past N never stored (B's rows past an expert's are another's or the TMA's zeros).
#include "common.cuh"
#include "sm90.cuh"

namespace {
constexpr int BM = 128, BK = 64, BN = 256, BOX_ROWS = 128;
constexpr int CONSUMERS = 2, THREADS = 128 * (1 + CONSUMERS);
constexpr int A_BYTES = BM * BK * 2, BOX_BYTES = BOX_ROWS * BK * 2;  // 16 KiB each
constexpr int STAGE_BYTES = A_BYTES + 2 * BOX_BYTES;
constexpr int STAGES = 4;
constexpr int SHARED_BYTES = STAGES * STAGE_BYTES + 1024;  // + the slack to align to 1 KiB
static_assert(SHARED_BYTES == 193 * 1024, "GEMM90_SHARED in prefill.py mirrors this");
constexpr int LAG = 2;  // steps a producer thread's copies may still be in flight behind it

enum Epilogue { STORE_F32 = 0, SWIGLU_BF16 = 2 };

// c = the tile's products: A's rows `a` (K wide; through a_rows when given, else the grouped
// order's rows themselves), B the map of every expert's rows (rows_per_expert each).
// SWIGLU_BF16: B's first up_row rows of an expert are gate, the next up_row up; N = up_row.
template <int EPI>
__device__ __forceinline__ void moe_tile(const bf16_t* __restrict__ a,
                                         const int* __restrict__ a_rows, const TensorMap& map_b,
                                         void* __restrict__ c, const int4* __restrict__ tiles,
                                         const int* __restrict__ n_tiles, int N, int K,
                                         int rows_per_expert, int up_row) {
    if (static_cast<int>(blockIdx.y) >= *n_tiles) return;
    extern __shared__ unsigned char moe_shared[];
    __shared__ __align__(8) unsigned long long full[STAGES], empty[STAGES];
    const unsigned ring = (smem_addr(moe_shared) + 1023) & ~1023u;
    const int4 t = tiles[blockIdx.y];
    const int rows = min(BM, t.z - t.w);  // this tile's pairs
    const int first = t.y + t.w;          // the first one's row in the grouped order
    const int tile_n = blockIdx.x;
    const int steps = (K + BK - 1) / BK;
    const int warpgroup = threadIdx.x >> 7;

    if (threadIdx.x == 0) {
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(smem_addr(&full[s]), 1 + 128);  // the TMA's bytes, each A row's copies
            mbar_init(smem_addr(&empty[s]), CONSUMERS * 4);
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();

    if (warpgroup == 0) {  // the producer: thread r copies A's row r; thread 0 also issues B
        const int r = threadIdx.x;
        const bool mine = r < rows;
        const bf16_t* src =
            mine ? a + static_cast<long long>(a_rows != nullptr ? a_rows[first + r] : first + r) * K
                 : a;
        if (r == 0)
            asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<unsigned long long>(&map_b))
                         : "memory");
        for (int step = 0; step < steps; ++step) {
            const int s = step % STAGES;
            if (step >= STAGES) mbar_wait(smem_addr(&empty[s]), (step / STAGES - 1) & 1);
            const unsigned a_dst = ring + s * STAGE_BYTES, b_dst = a_dst + A_BYTES;
            if (r == 0) {
                const unsigned bar = smem_addr(&full[s]);
                mbar_expect_tx(bar, 2 * BOX_BYTES);
#pragma unroll
                for (int box = 0; box < 2; ++box) {
                    const int row = t.x * rows_per_expert +
                                    (EPI == SWIGLU_BF16 ? box * up_row + tile_n * BOX_ROWS
                                                        : tile_n * BN + box * BOX_ROWS);
                    tma_load(b_dst + box * BOX_BYTES, map_b, step * BK, row, bar);
                }
            }
#pragma unroll
            for (int chunk = 0; chunk < BK / 8; ++chunk) {  // 16 bytes: 8 columns
                const int col = step * BK + chunk * 8;
                const bool ok = mine && col < K;
                cp_async_16_shared(a_dst + r * 128 + ((chunk ^ (r & 7)) << 4), ok ? src + col : a,
                               ok ? 16 : 0);
            }
            cp_async_commit();
            if (step >= LAG) {  // step - LAG's copies have landed: hand that stage over
                cp_async_wait<LAG>();
                asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
                mbar_arrive(smem_addr(&full[(step - LAG) % STAGES]));
            }
        }
        cp_async_wait<0>();
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
        for (int step = max(0, steps - LAG); step < steps; ++step)
            mbar_arrive(smem_addr(&full[step % STAGES]));
        return;
    }

    // The consumers: warpgroup 1 takes rows 0-63 of the tile, warpgroup 2 rows 64-127.
    const int half = warpgroup - 1;
    float d[BN / 2];
    wgmma_consume<BN, STAGES, STAGE_BYTES, A_BYTES>(d, ring, half, full, empty, steps);

    // d[j * 4 + e]: row (warp % 4) * 16 + lane / 4 (+ 8 for e >= 2), column j * 8 + (lane % 4)
    // * 2 (+ 1 for odd e) of this warpgroup's 64 x 256 part (sm90.cuh).
    const int lane = threadIdx.x & 31, w = (threadIdx.x >> 5) & 3;
    const int row0 = half * 64 + w * 16 + (lane >> 2);  // within the tile
    const int col0 = (lane & 3) * 2;
    if constexpr (EPI == SWIGLU_BF16) {
        store_swiglu(d, static_cast<bf16_t*>(c) + static_cast<long long>(first) * N, row0,
                     tile_n * BOX_ROWS + col0, rows, N, N);
    } else {
        store_accumulators<false>(d, static_cast<float*>(c) + static_cast<long long>(first) * N,
                                  row0, tile_n * BN + col0, rows, N, N);
    }
}
}  // namespace

// QW_PART 0 / 1: one product a program (ptxas takes each wgmma instantiation on its own).
#if QW_IN_PART(0)
// act (bf16, inter a pair) = SwiGLU of the pairs' xn rows (gathered through `token`, the
// grouped order's tokens) through their experts' gate/up rows (map_b: every expert's 2 inter
// rows of hidden).
extern "C" __global__ void __launch_bounds__(THREADS, 1)
    moe90_gate_up(const bf16_t* xn, const int* __restrict__ token,
                  const __grid_constant__ TensorMap map_b, bf16_t* act,
                  const int4* __restrict__ tiles, const int* __restrict__ n_tiles, int inter,
                  int hidden) {
    moe_tile<SWIGLU_BF16>(xn, token, map_b, act, tiles, n_tiles, inter, hidden, 2 * inter, inter);
}
#endif
#if QW_IN_PART(1)
// y (fp32, hidden a pair) = the pairs' act rows (grouped order) through their experts' down
// rows (map_b: every expert's hidden rows of inter).
extern "C" __global__ void __launch_bounds__(THREADS, 1)
    moe90_down(const bf16_t* act, const __grid_constant__ TensorMap map_b, float* y,
               const int4* __restrict__ tiles, const int* __restrict__ n_tiles, int hidden,
               int inter) {
    moe_tile<STORE_F32>(act, nullptr, map_b, y, tiles, n_tiles, hidden, inter, hidden, 0);
}
#endif
