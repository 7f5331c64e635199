// Prefill matrix products on the tensor cores: C[M, N] = A[M, K] . B[N, K]^T, where A holds
// bf16 activations (one row per token) and B a bf16 weight matrix in its checkpoint layout
// (one row per output feature), so both operands are K-contiguous. 128x128 tiles, 8 warps of
// 32x64, K steps of 32 staged through shared memory with cp.async double buffering, mma.sync
// m16n8k16 with fp32 accumulators. K must be a multiple of 8 (16-byte rows); M and N are free.
#include "common.cuh"

namespace {
constexpr int BM = 128, BN = 128, BK = 32;
constexpr int LDS = BK + 8;  // padded row: fragment loads of the 8 row groups hit distinct banks
constexpr int THREADS = 256;

enum Epilogue { STORE_F32 = 0, ADD_F32 = 1 };

__device__ __forceinline__ void load_tile(bf16_t (*dst)[LDS], const bf16_t* __restrict__ src,
                                          int rows, int K, int row0, int k0) {
    // 128 rows x 32 columns = 512 chunks of 16 bytes, two per thread.
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const int chunk = threadIdx.x + i * THREADS;
        const int r = chunk >> 2, c = (chunk & 3) * 8;
        const int gr = row0 + r, gc = k0 + c;
        const bool ok = gr < rows && gc < K;
        const bf16_t* p = ok ? src + static_cast<long long>(gr) * K + gc : src;
        cp_async_16(&dst[r][c], p, ok ? 16 : 0);
    }
}

template <int EPI>
__device__ void gemm_bf16(const bf16_t* __restrict__ A, const bf16_t* __restrict__ B,
                          float* __restrict__ C, int M, int N, int K) {
    __shared__ __align__(16) bf16_t As[2][BM][LDS];
    __shared__ __align__(16) bf16_t Bs[2][BN][LDS];
    const int m0 = blockIdx.y * BM, n0 = blockIdx.x * BN;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int wm = (warp >> 1) * 32, wn = (warp & 1) * 64;
    const int g = lane >> 2, t = lane & 3;

    float acc[2][8][4];
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int j = 0; j < 8; ++j)
#pragma unroll
            for (int k = 0; k < 4; ++k) acc[i][j][k] = 0.f;

    const int tiles = (K + BK - 1) / BK;
    load_tile(As[0], A, M, K, m0, 0);
    load_tile(Bs[0], B, N, K, n0, 0);
    cp_async_commit();
    for (int kt = 0; kt < tiles; ++kt) {
        const int s = kt & 1;
        if (kt + 1 < tiles) {
            load_tile(As[s ^ 1], A, M, K, m0, (kt + 1) * BK);
            load_tile(Bs[s ^ 1], B, N, K, n0, (kt + 1) * BK);
        }
        cp_async_commit();
        cp_async_wait<1>();
        __syncthreads();
#pragma unroll
        for (int k16 = 0; k16 < BK; k16 += 16) {
            unsigned a[2][4], b[8][2];
#pragma unroll
            for (int i = 0; i < 2; ++i) {
                const int r = wm + i * 16 + g;
                a[i][0] = ld_u32(&As[s][r][k16 + t * 2]);
                a[i][1] = ld_u32(&As[s][r + 8][k16 + t * 2]);
                a[i][2] = ld_u32(&As[s][r][k16 + 8 + t * 2]);
                a[i][3] = ld_u32(&As[s][r + 8][k16 + 8 + t * 2]);
            }
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                const int n = wn + j * 8 + g;
                b[j][0] = ld_u32(&Bs[s][n][k16 + t * 2]);
                b[j][1] = ld_u32(&Bs[s][n][k16 + 8 + t * 2]);
            }
#pragma unroll
            for (int i = 0; i < 2; ++i)
#pragma unroll
                for (int j = 0; j < 8; ++j) mma_bf16_16816(acc[i][j], a[i], b[j]);
        }
        __syncthreads();
    }

#pragma unroll
    for (int i = 0; i < 2; ++i) {
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            const int col = n0 + wn + j * 8 + t * 2;
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const int row = m0 + wm + i * 16 + g + half * 8;
                if (row >= M) continue;
                float* out = C + static_cast<long long>(row) * N + col;
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    if (col + e >= N) continue;
                    const float v = acc[i][j][half * 2 + e];
                    if (EPI == ADD_F32) out[e] += v;
                    else out[e] = v;
                }
            }
        }
    }
}
}  // namespace

// C = A . B^T (fp32 out): Q/K/V and gate/up projections.
extern "C" __global__ void __launch_bounds__(THREADS)
    gemm_store(const bf16_t* A, const bf16_t* B, float* C, int M, int N, int K) {
    gemm_bf16<STORE_F32>(A, B, C, M, N, K);
}

// C += A . B^T (fp32 residual stream): o_proj and down_proj.
extern "C" __global__ void __launch_bounds__(THREADS)
    gemm_add(const bf16_t* A, const bf16_t* B, float* C, int M, int N, int K) {
    gemm_bf16<ADD_F32>(A, B, C, M, N, K);
}
