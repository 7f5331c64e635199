// A mixture of experts' grouped prefill products on Hopper (sm_90a, bf16 and FP8 experts):
// moe.cu's moe_gemm with wgmma, for the tiles moe_place listed (an expert's run of at most 128 routed
// pairs, in the grouped order: {expert, its first pair, its pairs, the tile's first of them}).
//
// The block is gemm_sm90.cu's: a producer warpgroup fills a ring of STAGES 64-deep steps, two
// consumer warpgroups (64 rows each) multiply them, m64n256k16 with fp32 accumulators. What
// differs is A: a tile's rows are its pairs' token rows, scattered over the chunk (gate/up:
// xn gathered through the pairs' tokens; the TMA cannot gather rows on sm_90), so each of the
// producer's 128 threads copies its own row of each step with cp.async, writing the 128-byte
// swizzle the TMA would have; B (the expert's weights, one row a feature) comes by the TMA as
// in gemm_sm90.cu. A stage is full once the TMA's bytes have landed and each producer thread's
// copies have: each thread's cp.async.mbarrier.arrive arrives on the stage's barrier when its
// copies land, so no producer thread waits for its own copies and every stage of the ring can
// be in flight; the consumers fence the async proxy after the barrier, before their wgmma read
// the copied rows.
//
// moe90_gate_up: act[pair] = bf16(silu(gate) * up), the tile's 128 gate rows and the 128 up
// rows of the same features, as gemm90_swiglu: no fp32 gate/up rows, no moe_swiglu.
// moe90_down: y[pair] = act[pair] . down^T rounded to bf16 (as transformers' experts give it),
// A's rows in the grouped order already.
// Rows past a tile's pairs are zeros in shared memory and never stored; columns past K are
// zeros, past N never stored (B's rows past an expert's are another's or the TMA's zeros).
#include "common.cuh"
#include "sm90_fp8.cuh"

namespace {
constexpr int BM = 128, BK = 64, BN = 256, BOX_ROWS = 128;
constexpr int CONSUMERS = 2, THREADS = 128 * (1 + CONSUMERS);
constexpr int A_BYTES = BM * BK * 2, BOX_BYTES = BOX_ROWS * BK * 2;  // 16 KiB each
// FP8 experts (QW_FP8): a stage also holds B's codes, which the TMA brings and the producer's
// warps 1-3 (CONVERTERS) turn into the bf16 tile (code x block scale, rounded, as gemm_sm90.cu's
// FP8 path does), CLAG steps behind the copies' issue so that the codes' arrival is not waited
// for at once.
constexpr int CODES_BYTES = qw::fp8 ? BN * BK : 0;
constexpr int STAGE_BYTES = A_BYTES + 2 * BOX_BYTES + CODES_BYTES;
constexpr int RING_BYTES = 192 * 1024;
constexpr int STAGES = RING_BYTES / STAGE_BYTES;  // bf16 4, FP8 3
constexpr int SHARED_BYTES = RING_BYTES + 1024;   // + the slack to align the ring to 1 KiB
static_assert(SHARED_BYTES == 193 * 1024, "GEMM90_SHARED in prefill.py mirrors this");
// The converters' lag behind the copies' issue. The consumers release a step's stage only once
// they hold the next step's, so the producer's wait for step s - STAGES's stage needs step
// s - STAGES + 1 handed over before it: CLAG at most STAGES - 2 (a lag of 2 on FP8's three
// stages deadlocked).
constexpr int CONVERTERS = 96, CLAG = 1;
static_assert(CLAG <= STAGES - 2,
              "a stage is handed over before the producer waits for the one it refills");

enum Epilogue { STORE_BF16 = 0, SWIGLU_BF16 = 2 };

// c = the tile's products: A's rows `a` (K wide; through a_rows when given, else the grouped
// order's rows themselves), B the map of every expert's rows (rows_per_expert each; FP8: of
// their codes, b_codes the rows themselves with their scales, total_rows of them).
// SWIGLU_BF16: B's first up_row rows of an expert are gate, the next up_row up; N = up_row.
// STORE_BF16: the tile's columns are B's rows b_row0 + n of the expert (one part of the
// outputs, N wide, c's bf16 rows N apart).
template <int EPI>
__device__ __forceinline__ void moe_tile(const bf16_t* __restrict__ a,
                                         const int* __restrict__ a_rows, const TensorMap& map_b,
                                         const unsigned char* __restrict__ b_codes,
                                         int total_rows, void* __restrict__ c,
                                         const int4* __restrict__ tiles,
                                         const int* __restrict__ n_tiles, int N, int K,
                                         int rows_per_expert, int up_row, int b_row0) {
    if (static_cast<int>(blockIdx.y) >= *n_tiles) return;
    extern __shared__ unsigned char moe_shared[];
    __shared__ __align__(8) unsigned long long full[STAGES], empty[STAGES], codes_full[STAGES];
    const unsigned ring = (smem_addr(moe_shared) + 1023) & ~1023u;
    const int4 t = tiles[blockIdx.y];
    const int rows = min(BM, t.z - t.w);  // this tile's pairs
    const int first = t.y + t.w;          // the first one's row in the grouped order
    const int tile_n = blockIdx.x;
    const int steps = (K + BK - 1) / BK;
    const int warpgroup = threadIdx.x >> 7;
    // The matrix row of B's tile row r (box r / 128: SwiGLU's gate and up, or two of outputs).
    const auto b_row = [&](int r) {
        const int box = r / BOX_ROWS;
        return t.x * rows_per_expert + r % BOX_ROWS +
               (EPI == SWIGLU_BF16 ? box * up_row + tile_n * BOX_ROWS
                                   : b_row0 + tile_n * BN + box * BOX_ROWS);
    };

    if (threadIdx.x == 0) {
        for (int s = 0; s < STAGES; ++s) {
            // bf16: the TMA's bytes of B and each A row's copies; FP8: each A row's copies and
            // each converter's part of B (the codes' bytes land on codes_full)
            mbar_init(smem_addr(&full[s]), qw::fp8 ? 128 + CONVERTERS : 1 + 128);
            mbar_init(smem_addr(&empty[s]), CONSUMERS * 4);
            mbar_init(smem_addr(&codes_full[s]), 1);
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
        // FP8, the converters: step `st`'s codes, once landed, into its bf16 tile, fenced for
        // the tensor cores, then this thread's arrival on the stage.
        const auto convert = [&](int st) {
            const int s = st % STAGES;
            mbar_wait(smem_addr(&codes_full[s]), (st / STAGES) & 1);
            const unsigned b_dst = ring + s * STAGE_BYTES + A_BYTES;
            convert_codes_step<BN, CONVERTERS>(
                b_dst, moe_shared + (b_dst + 2 * BOX_BYTES - smem_addr(moe_shared)), b_codes,
                total_rows, K, st, b_row);
            asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
            mbar_arrive(smem_addr(&full[s]));
        };
        for (int step = 0; step < steps; ++step) {
            const int s = step % STAGES;
            if (step >= STAGES) mbar_wait(smem_addr(&empty[s]), (step / STAGES - 1) & 1);
            const unsigned a_dst = ring + s * STAGE_BYTES, b_dst = a_dst + A_BYTES;
            if (r == 0) {
                const unsigned bar = smem_addr(qw::fp8 ? &codes_full[s] : &full[s]);
                mbar_expect_tx(bar, qw::fp8 ? CODES_BYTES : 2 * BOX_BYTES);
#pragma unroll
                for (int box = 0; box < 2; ++box) {
                    if constexpr (qw::fp8)
                        tma_load(b_dst + 2 * BOX_BYTES + box * BOX_ROWS * BK, map_b, step * BK,
                                 b_row(box * BOX_ROWS), bar);
                    else
                        tma_load(b_dst + box * BOX_BYTES, map_b, step * BK, b_row(box * BOX_ROWS),
                                 bar);
                }
            }
#pragma unroll
            for (int chunk = 0; chunk < BK / 8; ++chunk) {  // 16 bytes: 8 columns
                const int col = step * BK + chunk * 8;
                const bool ok = mine && col < K;
                cp_async_16_shared(a_dst + r * 128 + ((chunk ^ (r & 7)) << 4), ok ? src + col : a,
                               ok ? 16 : 0);
            }
            mbar_arrive_on_copies(smem_addr(&full[s]));  // (once they have landed)
            if (qw::fp8 && r >= 32 && step >= CLAG) convert(step - CLAG);
        }
        if (qw::fp8 && r >= 32)
            for (int step = max(0, steps - CLAG); step < steps; ++step) convert(step);
        asm volatile("cp.async.wait_all;" ::: "memory");  // (no thread leaves copies in flight)
        return;
    }

    // The consumers: warpgroup 1 takes rows 0-63 of the tile, warpgroup 2 rows 64-127.
    const int half = warpgroup - 1;
    float d[BN / 2];
    wgmma_consume<BN, STAGES, STAGE_BYTES, A_BYTES, true>(d, ring, half, full, empty, steps);

    // d[j * 4 + e]: row (warp % 4) * 16 + lane / 4 (+ 8 for e >= 2), column j * 8 + (lane % 4)
    // * 2 (+ 1 for odd e) of this warpgroup's 64 x 256 part (sm90.cuh).
    const int lane = threadIdx.x & 31, w = (threadIdx.x >> 5) & 3;
    const int row0 = half * 64 + w * 16 + (lane >> 2);  // within the tile
    const int col0 = (lane & 3) * 2;
    if constexpr (EPI == SWIGLU_BF16) {
        store_swiglu(d, static_cast<bf16_t*>(c) + static_cast<long long>(first) * N, row0,
                     tile_n * BOX_ROWS + col0, rows, N, N);
    } else {
        store_accumulators<false>(d, static_cast<bf16_t*>(c) + static_cast<long long>(first) * N,
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
                  const __grid_constant__ TensorMap map_b, const unsigned char* b_codes,
                  int total_rows, bf16_t* act, const int4* __restrict__ tiles,
                  const int* __restrict__ n_tiles, int inter, int hidden) {
    moe_tile<SWIGLU_BF16>(xn, token, map_b, b_codes, total_rows, act, tiles, n_tiles, inter, hidden,
                          2 * inter, inter, 0);
}
#endif
#if QW_IN_PART(1)
// y (bf16, width a pair) = the pairs' act rows (grouped order) through their experts' down
// rows col0 .. col0 + width (map_b: every expert's hidden rows of inter): one part of the
// outputs (moe.py's moe_down_parts).
extern "C" __global__ void __launch_bounds__(THREADS, 1)
    moe90_down(const bf16_t* act, const __grid_constant__ TensorMap map_b,
               const unsigned char* b_codes, int total_rows, bf16_t* y,
               const int4* __restrict__ tiles, const int* __restrict__ n_tiles, int hidden,
               int inter, int col0, int width) {
    moe_tile<STORE_BF16>(act, nullptr, map_b, b_codes, total_rows, y, tiles, n_tiles, width, inter,
                        hidden, 0, col0);
}
#endif
