// A few tokens' rows through the per-token steps of a layer, as one block's (or one warp's) item:
// the embedding, RMSNorm, and QK-norm + RoPE + the KV-cache append. layers.cu launches each as
// a kernel of its own (prefill, the per-op speculative pass); a persistent kernel can run them
// as phases, a block taking items blockIdx.x, blockIdx.x + gridDim.x, ... (docs/perf.md,
// fourteenth session). So nothing here reads blockIdx: the item comes in as an argument.
#pragma once
#include "common.cuh"
#include "kv8.cuh"
#include "qwen3.cuh"

namespace {
// x[row, :] = embed[ids[row], :] (any block size).
__device__ __forceinline__ void embed_row(const int* ids, int row, const bf16_t* embed,
                                          float* x) {
    const bf16_t* src = embed + static_cast<long long>(ids[row]) * qw::hidden;
    for (int j = threadIdx.x; j < qw::hidden; j += blockDim.x)
        x[static_cast<long long>(row) * qw::hidden + j] = bf16_to_f32(src[j]);
}

// out[row, :] = bf16(rmsnorm(x[row, :]) * w), by a block of 256 threads or more. A thread's
// columns (blockDim.x apart) are loaded at once and kept in registers for the second pass; its
// sum adds them in the same order as a loop over them would (the columns past the row add 0).
// `scratch`: 32 floats of shared memory (block_sum's).
__device__ __forceinline__ void rmsnorm_row(const float* x, const bf16_t* w, int row, float eps,
                                            bf16_t* out, float* scratch) {
    constexpr int MOST = (qw::hidden + 255) / 256;  // a thread's columns at most
    const float* xr = x + static_cast<long long>(row) * qw::hidden;
    float v[MOST];
#pragma unroll
    for (int i = 0; i < MOST; ++i) {
        const int j = threadIdx.x + i * blockDim.x;
        v[i] = j < qw::hidden ? xr[j] : 0.f;
    }
    float ss = 0.f;
#pragma unroll
    for (int i = 0; i < MOST; ++i) ss += v[i] * v[i];
    const float rstd = rsqrtf(block_sum(ss, scratch) / qw::hidden + eps);
#pragma unroll
    for (int i = 0; i < MOST; ++i) {
        const int j = threadIdx.x + i * blockDim.x;
        if (j < qw::hidden)
            out[static_cast<long long>(row) * qw::hidden + j] = f32_to_bf16(v[i] * rstd * bf16_to_f32(w[j]));
    }
}

// For token t and head h (q heads then kv heads), one warp an item (item = t x heads + h):
// RMSNorm over head_dim with q_norm / k_norm, rotate-half RoPE at position pos0 + t, then write
// q (bf16) or append k and v to the layer's cache (kv8.cuh: bf16 rows, or int8 rows and their
// scales, the row's largest value found by the warp). pos0 is *pos_ptr where pos_ptr is set (a
// captured graph follows the cache position), else pos_arg. Lane l rotates the pairs (i, i +
// head_dim / 2) for i = l, l + 32, ...; the sum of squares adds each run of 32 pairs' warp sum
// in turn, as a block of one thread a pair did (so the bits are the megakernel's). Items past
// the n tokens do nothing (a whole warp).
__device__ __forceinline__ void qk_norm_rope_item(int item, const float* qkv, int n,
                                                  const int* pos_ptr, int pos_arg,
                                                  const bf16_t* q_norm, const bf16_t* k_norm,
                                                  const float* inv_freq, float eps, int capacity,
                                                  bf16_t* q_out, void* k_cache, void* v_cache) {
    constexpr int HD = qw::head_dim, HALF = HD / 2, PER = (HALF + 31) / 32;
    constexpr int HEADS = qw::heads + qw::kv_heads;
    const int lane = threadIdx.x & 31;
    const int t = item / HEADS, h = item % HEADS;
    if (t >= n) return;
    const int pos = (pos_ptr ? *pos_ptr : pos_arg) + t;
    const float* row = qkv + static_cast<long long>(t) * (qw::q_size + 2 * qw::kv_size);
    const bool is_q = h < qw::heads;
    const int kvh = h - qw::heads;
    const float* src = is_q ? row + h * HD : row + qw::q_size + kvh * HD;
    float a[PER], b[PER];
    float total = 0.f;
#pragma unroll
    for (int j = 0; j < PER; ++j) {
        const int i = lane + 32 * j;
        const bool active = i < HALF;
        a[j] = active ? src[i] : 0.f;
        b[j] = active ? src[i + HALF] : 0.f;
        total += warp_sum(a[j] * a[j] + b[j] * b[j]);
    }
    const float rstd = rsqrtf(total / HD + eps);
    const bf16_t* nw = is_q ? q_norm : k_norm;
    float ra[PER], rb[PER];
#pragma unroll
    for (int j = 0; j < PER; ++j) {
        const int i = lane + 32 * j;
        ra[j] = rb[j] = 0.f;
        if (i < HALF) {
            const float x = a[j] * (rstd * bf16_to_f32(nw[i]));
            const float y = b[j] * (rstd * bf16_to_f32(nw[i + HALF]));
            float s, c;
            sincosf(static_cast<float>(pos) * inv_freq[i], &s, &c);
            ra[j] = x * c - y * s;
            rb[j] = y * c + x * s;
        }
    }
    if (is_q) {
        bf16_t* dst = q_out + static_cast<long long>(t) * qw::q_size + h * HD;
#pragma unroll
        for (int j = 0; j < PER; ++j) {
            const int i = lane + 32 * j;
            if (i >= HALF) continue;
            dst[i] = f32_to_bf16(ra[j]);
            dst[i + HALF] = f32_to_bf16(rb[j]);
        }
        return;
    }
    const float* v = row + qw::q_size + qw::kv_size + kvh * HD;
    float va[PER], vb[PER];
#pragma unroll
    for (int j = 0; j < PER; ++j) {
        const int i = lane + 32 * j;
        va[j] = i < HALF ? v[i] : 0.f;
        vb[j] = i < HALF ? v[i + HALF] : 0.f;
    }
    const long long at = (static_cast<long long>(kvh) * capacity + pos) * HD;
    if constexpr (qw::kv8) {
        float k_big = 0.f, v_big = 0.f;
#pragma unroll
        for (int j = 0; j < PER; ++j) {
            k_big = fmaxf(k_big, fmaxf(fabsf(ra[j]), fabsf(rb[j])));
            v_big = fmaxf(v_big, fmaxf(fabsf(va[j]), fabsf(vb[j])));
        }
        const float ks = __fdiv_rn(warp_max(k_big), 127.f);
        const float vs = __fdiv_rn(warp_max(v_big), 127.f);
        signed char* kc = static_cast<signed char*>(k_cache);
        signed char* vc = static_cast<signed char*>(v_cache);
#pragma unroll
        for (int j = 0; j < PER; ++j) {
            const int i = lane + 32 * j;
            if (i >= HALF) continue;
            kc[at + i] = static_cast<signed char>(kv8_code(ra[j], ks));
            kc[at + i + HALF] = static_cast<signed char>(kv8_code(rb[j], ks));
            vc[at + i] = static_cast<signed char>(kv8_code(va[j], vs));
            vc[at + i + HALF] = static_cast<signed char>(kv8_code(vb[j], vs));
        }
        if (lane == 0) {
            const long long r = static_cast<long long>(kvh) * capacity + pos;
            const_cast<float*>(kv8_scales(k_cache, capacity))[r] = ks;
            const_cast<float*>(kv8_scales(v_cache, capacity))[r] = vs;
        }
    } else {
        bf16_t* kc = static_cast<bf16_t*>(k_cache);
        bf16_t* vc = static_cast<bf16_t*>(v_cache);
#pragma unroll
        for (int j = 0; j < PER; ++j) {
            const int i = lane + 32 * j;
            if (i >= HALF) continue;
            kc[at + i] = f32_to_bf16(ra[j]);
            kc[at + i + HALF] = f32_to_bf16(rb[j]);
            vc[at + i] = f32_to_bf16(va[j]);
            vc[at + i + HALF] = f32_to_bf16(vb[j]);
        }
    }
}
}  // namespace
