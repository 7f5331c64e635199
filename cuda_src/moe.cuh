// A mixture-of-experts layer's router (Qwen3MoeTopKRouter), one warp a token: the softmax of
// the token's QW_EXPERTS router logits in float32, its QW_TOPK largest (largest first, equal
// ones to the lower expert), and their weights, divided by their sum when QW_NORM_TOPK
// (config.json's norm_topk_prob). moe.cu's moe_route routes the per-op path's tokens, the
// decode megakernel's route_block its one token in every block.
//
// The experts are chosen on the logits, not on the rounded probabilities: the softmax keeps
// their order, so the choice is the reference's (qwenchat/engine/reference.py, route) except
// where two different logits round to one float32 probability, which the reference then
// orders by expert number.
#pragma once
#include "common.cuh"

// Dense models have no router; their builds of this file (the compile matrix's) take this
// placeholder shape. A mixture of experts' builds get the config's (kernel_defines): the
// experts, the top-k, norm_topk_prob and moe_intermediate_size.
#ifndef QW_EXPERTS
#define QW_EXPERTS 8
#define QW_TOPK 2
#define QW_NORM_TOPK 1
#define QW_MOE_INTER 256
#endif

namespace qwm {
constexpr int EXPERTS = QW_EXPERTS, TOPK = QW_TOPK;
constexpr int PER_LANE = (EXPERTS + 31) / 32;  // logits a lane holds: experts lane + 32 j
static_assert(TOPK >= 1 && TOPK <= EXPERTS && TOPK <= 32, "top-k of the experts, at most 32");

// Routes one token: `logits` its EXPERTS router logits, `weights` and `experts` its TOPK
// weights and expert numbers (written by lane 0). Every lane of the warp calls it.
__device__ __forceinline__ void route_warp(const float* logits, float* weights, int* experts) {
    const int lane = threadIdx.x & 31;
    float l[PER_LANE];
    float most = QW_NEG_INF;
#pragma unroll
    for (int j = 0; j < PER_LANE; ++j) {
        const int e = lane + 32 * j;
        l[j] = e < EXPERTS ? logits[e] : QW_NEG_INF;
        most = fmaxf(most, l[j]);
    }
    most = warp_max(most);
    float total = 0.f;
#pragma unroll
    for (int j = 0; j < PER_LANE; ++j) total += lane + 32 * j < EXPERTS ? expf(l[j] - most) : 0.f;
    total = warp_sum(total);
    // TOPK rounds of a warp argmax over (logit, expert), the lower expert on equal logits;
    // each round's winner is struck from its lane.
    unsigned taken = 0u;  // the lane's struck logits, bit j
    float w[TOPK];
    int id[TOPK];
#pragma unroll
    for (int k = 0; k < TOPK; ++k) {
        float best = QW_NEG_INF;
        int best_e = 0x7fffffff;
#pragma unroll
        for (int j = 0; j < PER_LANE; ++j) {
            const int e = lane + 32 * j;
            if (e < EXPERTS && !(taken >> j & 1u) && (l[j] > best || (l[j] == best && e < best_e))) {
                best = l[j];
                best_e = e;
            }
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            const float ob = __shfl_xor_sync(0xffffffffu, best, o);
            const int oe = __shfl_xor_sync(0xffffffffu, best_e, o);
            if (ob > best || (ob == best && oe < best_e)) {
                best = ob;
                best_e = oe;
            }
        }
        if ((best_e & 31) == lane) taken |= 1u << (best_e >> 5);
        w[k] = expf(best - most) / total;  // its softmax probability, as the reference's
        id[k] = best_e;
    }
    if (QW_NORM_TOPK) {
        float sum = 0.f;
#pragma unroll
        for (int k = 0; k < TOPK; ++k) sum += w[k];
#pragma unroll
        for (int k = 0; k < TOPK; ++k) w[k] /= sum;
    }
    if (lane == 0) {
#pragma unroll
        for (int k = 0; k < TOPK; ++k) {
            weights[k] = w[k];
            experts[k] = id[k];
        }
    }
}
}  // namespace qwm
