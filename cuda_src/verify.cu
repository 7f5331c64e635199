// A speculative pass's linear layers (verify.cuh's product): the fed token and up to 7
// proposals times a layer's weights, every weight read once for all of them.
#include "verify.cuh"

// Grid: ceil(N / (16 R)) blocks. a: n rows of K activations: verify_xn's (Q/K/V, gate/up) the
// bf16 rows xg of an RMSNorm's input times its weights, with sq's `parts` sums of squares a
// token (verify.cuh, PassNorm); o_proj's floats; down's bf16. out: n rows of N floats, stored
// (qkv, gate/up) or added to (the residual stream), where o_proj and down also write the next
// norm's xg and sq (its weights `next`; parts: their grid's blocks).
// (FP8's two-tile blocks need more than half an SM's registers a thread: one block an SM.)
#define VERIFY_KERNEL(name, K, AIN, R)                                                            \
    extern "C" __global__ void __launch_bounds__(VT_THREADS, qw::fp8 && R == 2 ? 1 : 2)           \
        name(const void* __restrict__ a, int n, const void* __restrict__ W, int N,                \
             float* __restrict__ out, const bf16_t* __restrict__ next, bf16_t* __restrict__ xg,   \
             float* __restrict__ sq) {                                                            \
        dependent_start();                                                                        \
        verify_product<K, qw::wfmt, AIN, true, R>(a, nullptr, n,                                  \
                                                  static_cast<const unsigned char*>(W), N, out,   \
                                                  PassNorm::writing(next, xg, sq));               \
    }

// The product after an RMSNorm (Q/K/V, gate/up in the layer's format; the LM head in bf16).
#define VERIFY_NORMED(name, WF)                                                                   \
    extern "C" __global__ void __launch_bounds__(VT_THREADS, 2)                                   \
        name(const bf16_t* __restrict__ xg, int n, const void* __restrict__ W, int N,             \
             float* __restrict__ out, const float* __restrict__ sq, int parts, float eps) {       \
        dependent_start();                                                                        \
        verify_product<qw::hidden, WF, A_SCALED, false, 1>(                                       \
            xg, nullptr, n, static_cast<const unsigned char*>(W), N, out,                         \
            PassNorm::scaled(sq, parts, eps));                                                    \
    }

// One tile a block measured faster everywhere on the H100 but at o_proj with FP8 weights, whose
// float activations (4 bytes a value against a code's 1) are the larger stream: two tiles
// there (8B FP8 15.4 -> 14.1 us, 32B FP8 49 -> 37 us; docs/perf.md).
VERIFY_KERNEL(verify_attn, qw::q_size, A_F32, 1)
VERIFY_KERNEL(verify_attn_r2, qw::q_size, A_F32, 2)
VERIFY_KERNEL(verify_act, qw::intermediate, A_BF16, 1)
// o_proj after the prefill attention kernel (bf16 rows, as prefill rounds them).
VERIFY_KERNEL(verify_attn_bf16, qw::q_size, A_BF16, 1)
VERIFY_NORMED(verify_xn, qw::wfmt)
VERIFY_NORMED(verify_head, qw::BF16)

// A norm's inputs where no product wrote them (the embedding rows, a mixture of experts'
// layer output): xg = bf16(x x norm's weights) and one sum of squares a token (parts 1), a
// block of 1,024 threads a row (its loads in fewer rounds).
extern "C" __global__ void __launch_bounds__(1024)
    verify_norm_rows(const float* __restrict__ x, int n, const bf16_t* __restrict__ norm,
                     bf16_t* __restrict__ xg, float* __restrict__ sq) {
    dependent_start();
    __shared__ float scratch[32];
    const int row = blockIdx.x;
    if (row >= n) return;
    const float* xr = x + static_cast<long long>(row) * qw::hidden;
    float ss = 0.f;
    for (int j = threadIdx.x; j < qw::hidden; j += blockDim.x) {
        const float v = xr[j];
        ss += v * v;
        xg[static_cast<long long>(row) * qw::hidden + j] = f32_to_bf16(v * bf16_to_f32(norm[j]));
    }
    ss = block_sum(ss, scratch);
    if (threadIdx.x == 0) sq[row] = ss;
}
