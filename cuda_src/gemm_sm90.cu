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
// The host encodes the tensor maps (qwenchat/engine/cuda/prefill.py): A's box is 64 x 128,
// B's 64 x 128 (a BN = 256 tile takes two). Dynamic shared memory: SHARED_BYTES, mirrored
// by GEMM90_SHARED there.
#include "common.cuh"

namespace {
constexpr int BM = 128, BK = 64, BOX_ROWS = 128;
constexpr int CONSUMERS = 2, THREADS = 128 * (1 + CONSUMERS);
constexpr int A_BYTES = BM * BK * 2, BOX_BYTES = BOX_ROWS * BK * 2;  // 16 KiB each
constexpr int RING_BYTES = 192 * 1024;
constexpr int SHARED_BYTES = RING_BYTES + 1024;  // + the slack to align the ring to 1 KiB
static_assert(SHARED_BYTES == 193 * 1024, "GEMM90_SHARED in prefill.py mirrors this");

template <int BN>
struct Tiles {
    static constexpr int STAGE_BYTES = A_BYTES + BN * BK * 2;
    static constexpr int STAGES = RING_BYTES / STAGE_BYTES;  // 4 at BN = 256, 6 at 128
};

enum Epilogue { STORE_F32 = 0, ADD_F32 = 1, SWIGLU_BF16 = 2 };

// A CUtensorMap, passed by value as a __grid_constant__ parameter (opaque to the kernel).
struct __align__(64) TensorMap {
    unsigned long long opaque[16];
};

__device__ __forceinline__ unsigned smem_addr(const void* p) {
    return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void mbar_init(unsigned bar, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}

__device__ __forceinline__ void mbar_expect_tx(unsigned bar, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes)
                 : "memory");
}

__device__ __forceinline__ void mbar_arrive(unsigned bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}

__device__ __forceinline__ void mbar_wait(unsigned bar, unsigned parity) {
    asm volatile(
        "{\n.reg .pred done;\n"
        "WAIT_%=:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        "@!done bra WAIT_%=;\n}\n" ::"r"(bar), "r"(parity)
        : "memory");
}

// A box_rows x 64 tile at (column k, row `row`) of the map's matrix into shared memory `dst`,
// counted on barrier `bar`.
__device__ __forceinline__ void tma_load(unsigned dst, const TensorMap& map, int k, int row,
                                         unsigned bar) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
        " [%0], [%1, {%2, %3}], [%4];" ::"r"(dst), "l"(reinterpret_cast<unsigned long long>(&map)),
        "r"(k), "r"(row), "r"(bar)
        : "memory");
}

// wgmma's shared-memory matrix descriptor for a K-major tile written with the 128-byte
// swizzle: rows of 128 bytes, groups of 8 rows 1024 bytes apart (the stride offset); the
// leading offset is unused in this mode. The start address moves 32 bytes per 16-deep step.
__device__ __forceinline__ unsigned long long smem_desc(unsigned addr) {
    return static_cast<unsigned long long>((addr & 0x3ffff) >> 4) | (1ull << 16) |
           (static_cast<unsigned long long>(1024 >> 4) << 32) | (1ull << 62);
}

__device__ __forceinline__ void wgmma_fence() {
    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
}
__device__ __forceinline__ void wgmma_commit() {
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}
template <int N>
__device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}
// Pins the accumulators: no ordinary instruction may be moved across this point, so none
// touches them while products are in flight (ptxas would otherwise serialize the wgmmas).
template <int R>
__device__ __forceinline__ void fence_operands(float (&d)[R]) {
#pragma unroll
    for (int i = 0; i < R; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// D (64 x N, fp32, this thread's N / 2 values) += A (64 x 16) . B (N x 16)^T, both from
// shared memory; accumulate = 0 overwrites D instead.
template <int N>
struct Wgmma;
template <> struct Wgmma<128> {
    static __device__ __forceinline__ void mma(float (&d)[64], unsigned long long a,
                                               unsigned long long b, int accumulate) {
        asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15,\n"
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31,\n"
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47,\n"
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
        "%64, %65, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "l"(a), "l"(b), "r"(accumulate));
    }
};
template <> struct Wgmma<256> {
    static __device__ __forceinline__ void mma(float (&d)[128], unsigned long long a,
                                               unsigned long long b, int accumulate) {
        asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15,\n"
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31,\n"
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47,\n"
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63,\n"
        "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79,\n"
        "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95,\n"
        "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111,\n"
        "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, "
        "%128, %129, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]),
          "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]),
          "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]),
          "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]),
          "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]),
          "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]),
          "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]),
          "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]),
          "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
        : "l"(a), "l"(b), "r"(accumulate));
    }
};
__device__ __forceinline__ float silu(float g) { return g / (1.f + __expf(-g)); }

// C (row stride ldc) = or += A . B^T for the tile (blockIdx.x, blockIdx.y): 128 rows of A
// from row blockIdx.x * 128 (the fast index, so the blocks running together share B's tile and
// B streams from memory about once), BN columns from blockIdx.y * BN. SWIGLU_BF16: B is
// [gate; up] with `up_row` rows of gate; the tile takes 128 gate rows and the 128 up rows of
// the same features, and writes bf16(silu(gate) * up) into 128 columns of C (bf16, ldc).
template <int BN, int EPI>
__device__ __forceinline__ void gemm_tile(const TensorMap& map_a, const TensorMap& map_b,
                                          void* __restrict__ c, int M, int N, int K, int up_row) {
    constexpr int STAGE_BYTES = Tiles<BN>::STAGE_BYTES, STAGES = Tiles<BN>::STAGES;
    static_assert(EPI != SWIGLU_BF16 || BN == 256, "SwiGLU tiles pair 128 gate and 128 up rows");
    extern __shared__ unsigned char gemm_shared[];
    __shared__ __align__(8) unsigned long long full[STAGES], empty[STAGES];
    const unsigned ring = (smem_addr(gemm_shared) + 1023) & ~1023u;
    const int m0 = blockIdx.x * BM, tile_n = blockIdx.y;
    const int steps = (K + BK - 1) / BK;
    const int warpgroup = threadIdx.x >> 7;

    if (threadIdx.x == 0) {
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(smem_addr(&full[s]), 1);
            mbar_init(smem_addr(&empty[s]), CONSUMERS * 4);
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
                mbar_expect_tx(bar, STAGE_BYTES);
                tma_load(a_dst, map_a, step * BK, m0, bar);
#pragma unroll
                for (int box = 0; box < BN / BOX_ROWS; ++box) {
                    const int row = EPI == SWIGLU_BF16 ? box * up_row + tile_n * BOX_ROWS
                                                       : tile_n * BN + box * BOX_ROWS;
                    tma_load(b_dst + box * BOX_BYTES, map_b, step * BK, row, bar);
                }
            }
        }
        return;
    }

    // The consumers: warpgroup 1 takes rows 0-63 of the tile, warpgroup 2 rows 64-127.
    const int half = warpgroup - 1;
    // The first step overwrites the accumulators (accumulate = 0): zeroing them with ordinary
    // instructions instead would make ptxas serialize the wgmmas (its warning C7515).
    float d[BN / 2];
#pragma unroll
    for (int i = 0; i < BN / 2; ++i) asm volatile("" : "=f"(d[i]));
    for (int step = 0; step < steps; ++step) {
        const int s = step % STAGES;
        mbar_wait(smem_addr(&full[s]), (step / STAGES) & 1);
        const unsigned a = ring + s * STAGE_BYTES + half * 64 * 128, b = ring + s * STAGE_BYTES + A_BYTES;
        fence_operands(d);
        wgmma_fence();
#pragma unroll
        for (int k = 0; k < BK / 16; ++k)
            Wgmma<BN>::mma(d, smem_desc(a + k * 32), smem_desc(b + k * 32), step > 0 || k > 0);
        wgmma_commit();
        fence_operands(d);
        wgmma_wait<1>();  // the previous step's products are done: release its stage
        if (step > 0 && (threadIdx.x & 31) == 0) mbar_arrive(smem_addr(&empty[(step - 1) % STAGES]));
    }
    wgmma_wait<0>();
    fence_operands(d);

    // d[j * 4 + e]: row (warp % 4) * 16 + lane / 4 (+ 8 for e >= 2), column j * 8 + (lane % 4) * 2
    // (+ 1 for odd e) of this warpgroup's 64 x BN part.
    const int lane = threadIdx.x & 31, w = (threadIdx.x >> 5) & 3;
    const int row0 = m0 + half * 64 + w * 16 + (lane >> 2);
    const int col0 = (lane & 3) * 2;
    if constexpr (EPI == SWIGLU_BF16) {
        bf16_t* out = static_cast<bf16_t*>(c);
#pragma unroll
        for (int j = 0; j < 16; ++j) {
            const int col = tile_n * BOX_ROWS + j * 8 + col0;
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int row = row0 + h * 8;
                if (row >= M || col >= N) continue;
                const float g0 = d[j * 4 + h * 2], g1 = d[j * 4 + h * 2 + 1];
                const float u0 = d[(j + 16) * 4 + h * 2], u1 = d[(j + 16) * 4 + h * 2 + 1];
                bf16_t* o = out + static_cast<long long>(row) * N + col;
                if (col + 1 < N && (N & 1) == 0) {  // one 4-byte store (col is even)
                    *reinterpret_cast<unsigned*>(o) = pack_bf16x2(silu(g0) * u0, silu(g1) * u1);
                } else {
                    o[0] = f32_to_bf16(silu(g0) * u0);
                    if (col + 1 < N) o[1] = f32_to_bf16(silu(g1) * u1);
                }
            }
        }
    } else {
        float* out = static_cast<float*>(c);
#pragma unroll
        for (int j = 0; j < BN / 8; ++j) {
            const int col = tile_n * BN + j * 8 + col0;
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int row = row0 + h * 8;
                if (row >= M || col >= N) continue;
                float* o = out + static_cast<long long>(row) * N + col;
                const float v0 = d[j * 4 + h * 2], v1 = d[j * 4 + h * 2 + 1];
                if (col + 1 < N && (N & 1) == 0) {  // one 8-byte access (col is even)
                    float2* o2 = reinterpret_cast<float2*>(o);
                    float2 v = make_float2(v0, v1);
                    if (EPI == ADD_F32) {
                        const float2 old = *o2;
                        v.x += old.x;
                        v.y += old.y;
                    }
                    *o2 = v;
                    continue;
                }
                o[0] = EPI == ADD_F32 ? o[0] + v0 : v0;
                if (col + 1 < N) o[1] = EPI == ADD_F32 ? o[1] + v1 : v1;
            }
        }
    }
}
}  // namespace

#define GEMM90(name, BN, EPI)                                                                   \
    extern "C" __global__ void __launch_bounds__(THREADS, 1)                                   \
        name(const __grid_constant__ TensorMap map_a, const __grid_constant__ TensorMap map_b, \
             void* c, int M, int N, int K, int up_row) {                                       \
        gemm_tile<BN, EPI>(map_a, map_b, c, M, N, K, up_row);                                  \
    }

GEMM90(gemm90_store_128, 128, STORE_F32)  // Q/K/V (fp32 out)
GEMM90(gemm90_store_256, 256, STORE_F32)
GEMM90(gemm90_add_128, 128, ADD_F32)  // o_proj, down_proj into the fp32 residual stream
GEMM90(gemm90_add_256, 256, ADD_F32)
GEMM90(gemm90_swiglu, 256, SWIGLU_BF16)  // gate/up, SwiGLU applied: down_proj's bf16 input
