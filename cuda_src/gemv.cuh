// Matrix-vector products for one token (decode's per-op path): each warp dots weight rows
// (bf16, FP8 or int4: weights.cuh) with a vector staged in shared memory. layers.cu's kernels
// and moe.cu's experts use them.
#pragma once
#include "common.cuh"
#include "qwen3.cuh"
#include "weights.cuh"

constexpr int GEMV_THREADS = 256;
constexpr int GEMV_WARPS = GEMV_THREADS / 32;

// Each warp computes ROWS dot products of W rows (format WF, weights.cuh) with a K-vector in
// shared memory. The weights do not depend on the vector, so a lane's first loads for all its
// rows are issued before the block prepares the vector (`prepare`, which ends with
// __syncthreads): the memory latency of the weight stream overlaps the vector's preparation
// instead of following it.
template <int K, int ROWS, int WF, typename Prepare>
__device__ __forceinline__ void warp_rows_dot(const unsigned char* __restrict__ W, int rows,
                                              int row0, const float* xs, Prepare prepare,
                                              float* result) {
    const int lane = threadIdx.x & 31;
    constexpr int PER = piece_values<WF>();
    constexpr long long RB = row_bytes<WF>(K);
    static_assert(K % PER == 0, "rows are whole 16-byte pieces");
    constexpr int STEPS = K / PER;  // 16-byte pieces per row
    constexpr int PER_LANE = (STEPS + 31) / 32;
    constexpr int PRE = PER_LANE < 16 / ROWS ? PER_LANE : 16 / ROWS;  // <= 16 loads in flight
    WeightPiece first[PRE][ROWS];
#pragma unroll
    for (int p = 0; p < PRE; ++p)
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
            const int c = lane + p * 32, row = row0 + r;
            first[p][r] = (row < rows && c < STEPS) ? load_piece<WF, K>(W + row * RB, c)
                                                    : no_piece();
        }
    prepare();
    float acc[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; ++r) acc[r] = 0.f;
#pragma unroll
    for (int p = 0; p < PRE; ++p) {
        const int c = lane + p * 32;
        if (c < STEPS) {
#pragma unroll
            for (int r = 0; r < ROWS; ++r) acc[r] += piece_dot<WF>(first[p][r], xs + c * PER);
        }
    }
    for (int c = lane + PRE * 32; c < STEPS; c += 32) {
        WeightPiece w[ROWS];
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
            const int row = row0 + r;
            w[r] = row < rows ? load_piece<WF, K>(W + row * RB, c) : no_piece();
        }
#pragma unroll
        for (int r = 0; r < ROWS; ++r) acc[r] += piece_dot<WF>(w[r], xs + c * PER);
    }
#pragma unroll
    for (int r = 0; r < ROWS; ++r) result[r] = warp_sum(acc[r]);
}

// out[r] = W[r, :] . (rmsnorm(x) * norm_w): fused norm + GEMV for Q/K/V, gate/up and the LM head.
// Each block recomputes the norm of the K-vector (a few KB, from L2) instead of a separate kernel.
template <int ROWS, int WF>
__device__ void rmsnorm_gemv(const float* __restrict__ x, const bf16_t* __restrict__ norm_w,
                             const void* __restrict__ W, int rows, float eps,
                             float* __restrict__ out) {
    __shared__ __align__(16) float xs[qw::hidden];
    __shared__ float scratch[32];
    const int warp = threadIdx.x >> 5;
    const int row0 = (blockIdx.x * GEMV_WARPS + warp) * ROWS;
    float result[ROWS];
    warp_rows_dot<qw::hidden, ROWS, WF>(static_cast<const unsigned char*>(W), rows, row0, xs, [&] {
        float ss = 0.f;
        for (int j = threadIdx.x; j < qw::hidden; j += blockDim.x) ss += x[j] * x[j];
        const float rstd = rsqrtf(block_sum(ss, scratch) / qw::hidden + eps);
        for (int j = threadIdx.x; j < qw::hidden; j += blockDim.x)
            xs[j] = x[j] * rstd * bf16_to_f32(norm_w[j]);
        __syncthreads();
    }, result);
    if ((threadIdx.x & 31) == 0) {
#pragma unroll
        for (int r = 0; r < ROWS; ++r)
            if (row0 + r < rows) out[row0 + r] = result[r];
    }
}
