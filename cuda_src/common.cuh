// Helpers shared by every kernel: bf16 as raw bits, warp/block reductions, tensor-core mma,
// asynchronous copies. The sources include no CUDA headers at all, so NVRTC needs no include
// path: bf16 conversions and the matrix instructions are written as inline PTX (sm_80+).
#pragma once

typedef unsigned short bf16_t;

#define QW_NEG_INF (-__int_as_float(0x7f800000))

__device__ __forceinline__ float bf16_to_f32(bf16_t x) {
    return __uint_as_float(static_cast<unsigned>(x) << 16);
}

__device__ __forceinline__ bf16_t f32_to_bf16(float x) {
    bf16_t r;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(x));
    return r;
}

// Programmatic dependent launch (Hopper): a kernel launched as a dependent (runtime.py's
// launch, dependent=True) may start while the kernel before it on the stream is still ending.
// Here it waits until that kernel has finished and its writes are visible, then lets the next
// kernel on the stream start likewise (its blocks wait for this one's end in SM slots this one
// leaves free). First thing in a kernel that may be launched so; a no-op in a plain launch
// and before sm_90.
__device__ __forceinline__ void dependent_start() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// SwiGLU's gate activation, x . sigmoid(x).
__device__ __forceinline__ float silu(float g) { return g / (1.f + __expf(-g)); }

// act[i, j] = bf16(silu(gu[i, j]) * gu[i, I + j]) for n rows of gu = [gate | up], I columns
// each, over the whole grid: a prefill's down-projection input (dense, or an expert's).
template <int I>
__device__ __forceinline__ void swiglu_rows_of(const float* __restrict__ gu, int n,
                                               bf16_t* __restrict__ act) {
    const long long total = static_cast<long long>(n) * I;
    for (long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; i < total;
         i += static_cast<long long>(gridDim.x) * blockDim.x) {
        const long long row = i / I, col = i % I;
        const float* g = gu + row * 2 * I;
        act[i] = f32_to_bf16(silu(g[col]) * g[I + col]);
    }
}

// Two floats to one 32-bit register holding (lo, hi) as bf16, lo in the low half.
__device__ __forceinline__ unsigned pack_bf16x2(float lo, float hi) {
    unsigned r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

__device__ __forceinline__ float bf16_lo(unsigned v) { return __uint_as_float(v << 16); }
__device__ __forceinline__ float bf16_hi(unsigned v) { return __uint_as_float(v & 0xffff0000u); }

// A 16-byte piece of codes as 8 words of bf16 pairs, lowest code first: decode(word, v) puts a
// word's four codes in v as floats, each is multiplied by s and rounded. The Hopper prefill
// makes its bf16 tiles of FP8 weights (gemm_sm90.cu) and int8 KV rows (attention_sm90.cu) with it.
template <typename Decode>
__device__ __forceinline__ void codes_to_bf16(const uint4 codes, float s, unsigned (&packed)[8],
                                              Decode decode) {
    const unsigned words[4] = {codes.x, codes.y, codes.z, codes.w};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        float v[4];
        decode(words[k], v);
        packed[2 * k] = pack_bf16x2(v[0] * s, v[1] * s);
        packed[2 * k + 1] = pack_bf16x2(v[2] * s, v[3] * s);
    }
}

// Dot product of 8 bf16 weights (one 16-byte load) with 8 floats.
__device__ __forceinline__ float dot8(const uint4 w, const float* x) {
    return bf16_lo(w.x) * x[0] + bf16_hi(w.x) * x[1] + bf16_lo(w.y) * x[2] +
           bf16_hi(w.y) * x[3] + bf16_lo(w.z) * x[4] + bf16_hi(w.z) * x[5] +
           bf16_lo(w.w) * x[6] + bf16_hi(w.w) * x[7];
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Running total over the warp's lanes, lane 0 first (inclusive).
template <typename T>
__device__ __forceinline__ T warp_inclusive_scan(T v) {
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const T n = __shfl_up_sync(0xffffffffu, v, o);
        if ((threadIdx.x & 31) >= o) v += n;
    }
    return v;
}

// Each thread's `mine` summed over the threads before it (thread order), and the block's total
// in `total`. warp_totals: one T per warp of shared memory. Every thread of the block calls it.
template <int NT, typename T>
__device__ __forceinline__ T block_exclusive_scan(T mine, T* warp_totals, T& total) {
    const T incl = warp_inclusive_scan(mine);
    __syncthreads();  // the previous use of warp_totals is over
    if ((threadIdx.x & 31) == 31) warp_totals[threadIdx.x >> 5] = incl;
    __syncthreads();
    T before = 0;
    total = 0;
    for (int w = 0; w < NT / 32; ++w) {
        if (w < static_cast<int>(threadIdx.x >> 5)) before += warp_totals[w];
        total += warp_totals[w];
    }
    return before + incl - mine;
}

// Sum over the block; `scratch` holds one float per warp. Every thread gets the result.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int warps = (blockDim.x + 31) >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    float total = 0.f;
    for (int w = 0; w < warps; ++w) total += scratch[w];
    return total;
}

__device__ __forceinline__ float block_max(float v, float* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int warps = (blockDim.x + 31) >> 5;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    float best = QW_NEG_INF;
    for (int w = 0; w < warps; ++w) best = fmaxf(best, scratch[w]);
    return best;
}

// D = A(16x16, row) * B(16x8, col) + D on the tensor cores, bf16 inputs, fp32 accumulators.
__device__ __forceinline__ void mma_bf16_16816(float* d, const unsigned* a, const unsigned* b) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// The same with f16 inputs.
__device__ __forceinline__ void mma_f16_16816(float* d, const unsigned* a, const unsigned* b) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// Four 8x8 bf16 matrices from shared memory into mma fragments: lane l gives the address of
// row l % 8 of matrix l / 8, and receives (row l / 4, columns 2 (l % 4) and + 1) of each.
__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], const void* p) {
    const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(p));
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
}

// The same, each matrix transposed (lane l receives rows 2 (l % 4) and + 1 of column l / 4).
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned (&r)[4], const void* p) {
    const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(p));
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
}

// 16-byte global->shared copy that bypasses registers; src_bytes = 0 writes zeros instead.
// `dst`: a shared-memory address (as the TMA and wgmma take them).
__device__ __forceinline__ void cp_async_16_shared(unsigned dst, const void* gmem, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem),
                 "r"(src_bytes));
}

__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem, int src_bytes) {
    cp_async_16_shared(static_cast<unsigned>(__cvta_generic_to_shared(smem)), gmem, src_bytes);
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n"); }

template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

__device__ __forceinline__ unsigned ld_u32(const bf16_t* p) {
    return *reinterpret_cast<const unsigned*>(p);
}

// Loads served by L2 (".cg"), never by a possibly stale L1 line: for data that other blocks of
// the same launch wrote (the decode megakernel reads such data after its grid barriers).
__device__ __forceinline__ float ld_cg(const float* p) {
    float v;
    asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(v) : "l"(p));
    return v;
}

__device__ __forceinline__ int ld_cg_int(const int* p) {
    int v;
    asm volatile("ld.global.cg.s32 %0, [%1];" : "=r"(v) : "l"(p));
    return v;
}

__device__ __forceinline__ unsigned char ld_cg_u8(const unsigned char* p) {
    unsigned short v;
    asm volatile("ld.global.cg.u8 %0, [%1];" : "=h"(v) : "l"(p));
    return static_cast<unsigned char>(v);
}

