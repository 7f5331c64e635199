// Prefill matrix products on the tensor cores: C[M, N] = A[M, K] . B[N, K]^T, where A holds
// bf16 activations (one row per token) and B a bf16 weight matrix in its checkpoint layout
// (one row per output feature), so both operands are K-contiguous. 128x128 tiles, 8 warps of
// 32x64, K steps of 32 staged through STAGES shared-memory stages with cp.async (STAGES - 1
// steps in flight while one is used), fragments by ldmatrix, mma.sync m16n8k16 with fp32
// accumulators. K must be a multiple of 8 (16-byte rows); M and N are free. Dynamic shared
// memory: SHARED_BYTES (mirrored by gemm_shared_bytes in qwenchat/engine/cuda/prefill.py).
// FP8 weights (weights.cuh) are copied as codes and turned into bf16 tiles (code x block scale,
// rounded) in shared memory before the same tensor-core loop; K is then a multiple of 16.
#include "gemm.cuh"

// C (row stride ldc) = A . B^T (fp32 out): Q/K/V and gate/up projections (B in the model's
// weight format; int4 weights come as the bf16 slices prefill.py dequantizes).
extern "C" __global__ void __launch_bounds__(THREADS)
    gemm_store(const bf16_t* A, const void* B, float* C, int M, int N, int K, int ldc) {
    gemm_bf16<STORE_F32, qw::fp8 ? qw::FP8 : qw::BF16>(A, B, C, M, N, K, ldc, blockIdx.y * BM);
}

// C += A . B^T (fp32 residual stream): o_proj and down_proj.
extern "C" __global__ void __launch_bounds__(THREADS)
    gemm_add(const bf16_t* A, const void* B, float* C, int M, int N, int K, int ldc) {
    gemm_bf16<ADD_F32, qw::fp8 ? qw::FP8 : qw::BF16>(A, B, C, M, N, K, ldc, blockIdx.y * BM);
}
