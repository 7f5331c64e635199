// Hopper (sm_90a) building blocks shared by gemm_sm90.cu and attention_sm90.cu: tensor maps
// and TMA copies that complete on mbarriers, wgmma with its shared-memory matrix descriptors
// and its fences. Inline PTX, like common.cuh, so NVRTC needs no CUDA header.
#pragma once

// A source whose kernels compile as several programs (QW_PART n: the n-th part alone, so that
// ptxas takes them on several threads; engine.py SM90_PARTS) or as one (no QW_PART: all).
#ifndef QW_PART
#define QW_PART -1
#endif
#define QW_IN_PART(n) (QW_PART < 0 || QW_PART == (n))

// A CUtensorMap, passed by value as a __grid_constant__ parameter (opaque to the kernel).
struct __align__(64) TensorMap {
    unsigned long long opaque[16];
};

__device__ __forceinline__ unsigned smem_addr(const void* p) {
    return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// 16 bf16 values (8 words) as 16-byte chunks `chunk` and `chunk` + 1 of row r of a tile
// written with the 128-byte swizzle (row_addr: the row's start; chunk c lies at c ^ (r % 8)),
// as the TMA would have written them. `odd_first` stores chunk + 1 first: threads that write
// the same chunks of two tiles 16 KB apart (the same banks) then meet in different banks.
__device__ __forceinline__ void st_swizzled_pair(unsigned row_addr, int chunk, int r,
                                                 const unsigned (&packed)[8],
                                                 bool odd_first = false) {
    const unsigned at[2] = {row_addr + ((chunk ^ (r & 7)) << 4),
                            row_addr + (((chunk + 1) ^ (r & 7)) << 4)};
#pragma unroll
    for (int i = 0; i < 2; ++i) {  // (selects, not indices: the registers stay registers)
        const unsigned addr = odd_first ? at[1 - i] : at[i];
        unsigned v[4];
#pragma unroll
        for (int k = 0; k < 4; ++k) v[k] = odd_first ? packed[4 * (1 - i) + k] : packed[4 * i + k];
        asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};" ::"r"(addr), "r"(v[0]), "r"(v[1]),
                     "r"(v[2]), "r"(v[3]) : "memory");
    }
}

// Two floats as e4m3 codes (rounded to nearest even, saturated to +-448), lo in the low byte:
// pack_bf16x2's counterpart for the e4m3 wgmma's operands (sm_89+).
__device__ __forceinline__ unsigned short pack_e4m3x2(float lo, float hi) {
    unsigned short r;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
    return r;
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

// One arrival on `bar` once every cp.async this thread has issued so far has landed (counted
// among the barrier's expected arrivals: .noinc), without waiting for them here.
__device__ __forceinline__ void mbar_arrive_on_copies(unsigned bar) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(bar) : "memory");
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
// For an MN-major tile (B = V in attention: 64 elements of N per 128-byte row, rows along K),
// `leading` is the byte distance between two such 64-wide slices of N; 8 rows of K are again
// 1024 bytes apart.
__device__ __forceinline__ unsigned long long smem_desc(unsigned addr, unsigned leading = 16) {
    return static_cast<unsigned long long>((addr & 0x3ffff) >> 4) |
           (static_cast<unsigned long long>(leading >> 4) << 16) |
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

// The accumulators as inline-asm operands: their names, 16 to a group (QW_REGSg names %16g to
// %16g + 15), and their "+f" constraints on this thread's d[], 8 or 32 at a time.
#define QW_REGS0 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15"
#define QW_REGS1 "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define QW_REGS2 "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47"
#define QW_REGS3 "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define QW_REGS4 "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79"
#define QW_REGS5 "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95"
#define QW_REGS6 "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111"
#define QW_REGS7 "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
#define QW_ACC8(i) "+f"(d[(i)]), "+f"(d[(i) + 1]), "+f"(d[(i) + 2]), "+f"(d[(i) + 3]), \
    "+f"(d[(i) + 4]), "+f"(d[(i) + 5]), "+f"(d[(i) + 6]), "+f"(d[(i) + 7])
#define QW_ACC32(i) QW_ACC8(i), QW_ACC8((i) + 8), QW_ACC8((i) + 16), QW_ACC8((i) + 24)

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
        QW_REGS0 ",\n"
        QW_REGS1 ",\n"
        QW_REGS2 ",\n"
        QW_REGS3 "}, "
        "%64, %65, p, 1, 1, 0, 0;\n}\n"
        : QW_ACC32(0), QW_ACC32(32)
        : "l"(a), "l"(b), "r"(accumulate));
    }
};
template <> struct Wgmma<256> {
    static __device__ __forceinline__ void mma(float (&d)[128], unsigned long long a,
                                               unsigned long long b, int accumulate) {
        asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {"
        QW_REGS0 ",\n"
        QW_REGS1 ",\n"
        QW_REGS2 ",\n"
        QW_REGS3 ",\n"
        QW_REGS4 ",\n"
        QW_REGS5 ",\n"
        QW_REGS6 ",\n"
        QW_REGS7 "}, "
        "%128, %129, p, 1, 1, 0, 0;\n}\n"
        : QW_ACC32(0), QW_ACC32(32), QW_ACC32(64), QW_ACC32(96)
        : "l"(a), "l"(b), "r"(accumulate));
    }
};
// D (64 x 128, fp32) += A (64 x 32 e4m3) . B (128 x 32 e4m3)^T, both K-major from shared
// memory (8-bit wgmma takes no transposes); accumulate = 0 overwrites D. (Issue 25's FP8
// GEMM, gemm_fp8_sm90.cu: a draft not yet run.)
struct WgmmaE4m3 {
    static __device__ __forceinline__ void mma(float (&d)[64], unsigned long long a,
                                               unsigned long long b, int accumulate) {
        asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 {"
        QW_REGS0 ",\n"
        QW_REGS1 ",\n"
        QW_REGS2 ",\n"
        QW_REGS3 "}, "
        "%64, %65, p, 1, 1;\n}\n"
        : QW_ACC32(0), QW_ACC32(32)
        : "l"(a), "l"(b), "r"(accumulate));
    }
};
// A consumer warpgroup's fp32 accumulators into C (rows ldc apart), stored (ADD false) or
// added; C fp32, or bf16 (rounded; stored only): d[j * 4 + e] is row row0 (+ 8 for e >= 2),
// column col0 + j * 8 (+ 1 for odd e), the layout of wgmma's m64nN accumulators (row0: this
// thread's first row, col0: its first column). Rows past M and columns past N are left alone.
template <bool ADD, int R, class T>
__device__ __forceinline__ void store_accumulators(const float (&d)[R], T* out, int row0,
                                                   int col0, int M, int N, int ldc) {
    constexpr bool BF16_OUT = sizeof(T) == sizeof(bf16_t);
    static_assert(sizeof(T) == sizeof(float) || (BF16_OUT && !ADD), "fp32, or bf16 stored");
#pragma unroll
    for (int j = 0; j < R / 4; ++j) {
        const int col = col0 + j * 8;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int row = row0 + h * 8;
            if (row >= M || col >= N) continue;
            T* o = out + static_cast<long long>(row) * ldc + col;
            const float v0 = d[j * 4 + h * 2], v1 = d[j * 4 + h * 2 + 1];
            if constexpr (BF16_OUT) {
                if (col + 1 < N && (ldc & 1) == 0) {  // one 4-byte store (col is even)
                    *reinterpret_cast<unsigned*>(o) = pack_bf16x2(v0, v1);
                } else {
                    o[0] = f32_to_bf16(v0);
                    if (col + 1 < N) o[1] = f32_to_bf16(v1);
                }
                continue;
            } else {
                if (col + 1 < N && (ldc & 1) == 0) {  // one 8-byte access (col is even)
                    float2* o2 = reinterpret_cast<float2*>(o);
                    float2 v = make_float2(v0, v1);
                    if (ADD) {
                        const float2 old = *o2;
                        v.x += old.x;
                        v.y += old.y;
                    }
                    *o2 = v;
                    continue;
                }
                o[0] = ADD ? o[0] + v0 : v0;
                if (col + 1 < N) o[1] = ADD ? o[1] + v1 : v1;
            }
        }
    }
}

// A consumer warpgroup's part of a ring-fed product (gemm_sm90.cu, moe_sm90.cu): for each of
// `steps` 64-deep steps, wait for stage step % STAGES to be full, multiply this warpgroup's 64
// rows of its A tile (A_BYTES from the stage's start, rows of 128 bytes, `half` picking rows
// 0-63 or 64-127) by its B tile (BN rows after A) into d, and once the step after it is issued
// release the stage (one arrival a warp on `empty`). The first step overwrites d (accumulate =
// 0): zeroing it with ordinary instructions instead would make ptxas serialize the wgmmas
// (its warning C7515).
// COPIED: some of the stage came by cp.async (generic-proxy writes, seen through the barrier),
// so the consumer fences the async proxy before its wgmma read them.
template <int BN, int STAGES, int STAGE_BYTES, int A_BYTES, bool COPIED = false>
__device__ __forceinline__ void wgmma_consume(float (&d)[BN / 2], unsigned ring, int half,
                                              unsigned long long* full,
                                              unsigned long long* empty, int steps) {
#pragma unroll
    for (int i = 0; i < BN / 2; ++i) asm volatile("" : "=f"(d[i]));
    for (int step = 0; step < steps; ++step) {
        const int s = step % STAGES;
        mbar_wait(smem_addr(&full[s]), (step / STAGES) & 1);
        if constexpr (COPIED) asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
        const unsigned a = ring + s * STAGE_BYTES + half * 64 * 128, b = ring + s * STAGE_BYTES + A_BYTES;
        fence_operands(d);
        wgmma_fence();
#pragma unroll
        for (int k = 0; k < 64 / 16; ++k)
            Wgmma<BN>::mma(d, smem_desc(a + k * 32), smem_desc(b + k * 32), step > 0 || k > 0);
        wgmma_commit();
        fence_operands(d);
        wgmma_wait<1>();  // the previous step's products are done: release its stage
        if (step > 0 && (threadIdx.x & 31) == 0) mbar_arrive(smem_addr(&empty[(step - 1) % STAGES]));
    }
    wgmma_wait<0>();
    fence_operands(d);
}

// A consumer warpgroup's m64n256 accumulators of a SwiGLU tile (columns 0-127 gate, 128-255
// the up rows of the same features) as bf16(silu(gate) x up) into `out` (rows ldc apart):
// row row0 (+ 8), feature col0 + j * 8 (+ 1), as store_accumulators lays them out; rows past
// M and features past N are left alone.
__device__ __forceinline__ void store_swiglu(const float (&d)[128], bf16_t* out, int row0,
                                             int col0, int M, int N, int ldc) {
#pragma unroll
    for (int j = 0; j < 16; ++j) {
        const int col = col0 + j * 8;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int row = row0 + h * 8;
            if (row >= M || col >= N) continue;
            const float g0 = d[j * 4 + h * 2], g1 = d[j * 4 + h * 2 + 1];
            const float u0 = d[(j + 16) * 4 + h * 2], u1 = d[(j + 16) * 4 + h * 2 + 1];
            bf16_t* o = out + static_cast<long long>(row) * ldc + col;
            if (col + 1 < N && (ldc & 1) == 0) {  // one 4-byte store (col is even)
                *reinterpret_cast<unsigned*>(o) = pack_bf16x2(silu(g0) * u0, silu(g1) * u1);
            } else {
                o[0] = f32_to_bf16(silu(g0) * u0);
                if (col + 1 < N) o[1] = f32_to_bf16(silu(g1) * u1);
            }
        }
    }
}

// D (64 x N) += A (64 x 16, bf16 fragments in registers, the layout of mma.sync's A) .
// B (16 x N) from shared memory, MN-major (imm-trans-b = 1): attention's P . V;
// accumulate = 0 overwrites D.
template <int N>
struct WgmmaRegA;
template <> struct WgmmaRegA<64> {
    static __device__ __forceinline__ void mma(float (&d)[32], const unsigned (&a)[4],
                                               unsigned long long b, int accumulate) {
        asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {"
        QW_REGS0 ",\n"
        QW_REGS1 "}, "
        "{%32, %33, %34, %35}, %36, p, 1, 1, 1;\n}\n"
        : QW_ACC32(0)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(accumulate));
    }
};
template <> struct WgmmaRegA<128> {
    static __device__ __forceinline__ void mma(float (&d)[64], const unsigned (&a)[4],
                                               unsigned long long b, int accumulate) {
        asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {"
        QW_REGS0 ",\n"
        QW_REGS1 ",\n"
        QW_REGS2 ",\n"
        QW_REGS3 "}, "
        "{%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"
        : QW_ACC32(0), QW_ACC32(32)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(accumulate));
    }
};
