// Routing a prefill's tokens to their experts (moe.cuh): one warp a token, `tokens` rows of
// QW_EXPERTS float32 router logits in, QW_TOPK (weight, expert) pairs a token out.
#include "moe.cuh"

extern "C" __global__ void moe_route(const float* __restrict__ logits, int tokens,
                                     float* __restrict__ weights, int* __restrict__ experts) {
    const int token = (blockIdx.x * blockDim.x + threadIdx.x) / 32;
    if (token >= tokens) return;  // (a whole warp: blockDim.x is a multiple of 32)
    qwm::route_warp(logits + static_cast<long long>(token) * qwm::EXPERTS,
                    weights + token * qwm::TOPK, experts + token * qwm::TOPK);
}
