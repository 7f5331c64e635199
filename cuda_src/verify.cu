// A speculative pass's linear layers (verify.cuh's product): the fed token and up to 7
// proposals times a layer's weights, every weight read once for all of them.
#include "verify.cuh"

// Grid: ceil(N / (16 R)) blocks. a: n rows of K activations (bf16, or float for o_proj's
// input); out: n rows of N floats, stored (qkv, gate/up) or added to (the residual stream).
// (FP8's two-tile blocks need more than half an SM's registers a thread: one block an SM.)
#define VERIFY_KERNEL(name, K, AIN, ADD, R)                                                       \
    extern "C" __global__ void __launch_bounds__(VT_THREADS, qw::fp8 && R == 2 ? 1 : 2)           \
        name(const void* __restrict__ a, int n, const void* __restrict__ W, int N,                \
             float* __restrict__ out) {                                                           \
        dependent_start();                                                                        \
        verify_product<K, qw::wfmt, AIN, ADD, R>(                                                 \
            a, nullptr, n, static_cast<const unsigned char*>(W), N, out);                         \
    }

// One tile a block measured faster everywhere on the H100 but at o_proj with FP8 weights, whose
// float activations (4 bytes a value against a code's 1) are the larger stream: two tiles
// there (8B FP8 15.4 -> 14.1 us, 32B FP8 49 -> 37 us; docs/perf.md).
VERIFY_KERNEL(verify_xn, qw::hidden, A_BF16, false, 1)
VERIFY_KERNEL(verify_attn, qw::q_size, A_F32, true, 1)
VERIFY_KERNEL(verify_attn_r2, qw::q_size, A_F32, true, 2)
VERIFY_KERNEL(verify_act, qw::intermediate, A_BF16, true, 1)

// The LM head (bf16 in every format) of the n rows' normed activations: logits stored.
#define VERIFY_HEAD(name, R)                                                                      \
    extern "C" __global__ void __launch_bounds__(VT_THREADS, 2)                                   \
        name(const void* __restrict__ a, int n, const void* __restrict__ W, int N,                \
             float* __restrict__ out) {                                                           \
        dependent_start();                                                                        \
        verify_product<qw::hidden, qw::BF16, A_BF16, false, R>(                                   \
            a, nullptr, n, static_cast<const unsigned char*>(W), N, out);                         \
    }

VERIFY_HEAD(verify_head, 1)
