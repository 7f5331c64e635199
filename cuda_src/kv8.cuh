// The KV cache's layout, per layer: keys (and, in their own buffer, values) as
//   bf16 (QW_KV8 = 0): [kv_head][capacity][head_dim] bf16;
//   int8 (QW_KV8 = 1): [kv_head][capacity][head_dim] int8 codes, then [kv_head][capacity]
//        float scales: a row (one head, one token) is code x scale, scale = max |x| / 127,
//        code = rint(x / scale), as qwenchat/model/kv_cache.py makes them.
#pragma once
#include "common.cuh"
#include "qwen3.cuh"

#ifndef QW_KV8
#define QW_KV8 0
#endif

namespace qw {
constexpr bool kv8 = QW_KV8 != 0;
}

// The scales of a layer's int8 key (or value) buffer: after its codes.
__device__ __forceinline__ const float* kv8_scales(const void* cache, int capacity) {
    return reinterpret_cast<const float*>(static_cast<const signed char*>(cache) +
                                          static_cast<long long>(qw::kv_heads) * capacity *
                                              qw::head_dim);
}

// The int8 code of x with this row's scale (0 for an all-zero row): the reference's
// rint(x / scale) clipped to +-127, with IEEE division.
__device__ __forceinline__ int kv8_code(float x, float scale) {
    if (!(scale > 0.f)) return 0;
    return max(-127, min(127, __float2int_rn(__fdiv_rn(x, scale))));
}

// Four int8 codes (a word, lowest byte first) as floats, exactly and without the conversion
// unit (I2F runs at a quarter of the FMA rate and shares its pipe with exp2): code + 128 goes
// into the low byte of the float 2^23 (bits 0x4B000000), which is then 2^23 + 128 + code.
__device__ __forceinline__ void kv8x4_floats(unsigned w, float* out) {
    const unsigned biased = w ^ 0x80808080u;
#pragma unroll
    for (int b = 0; b < 4; ++b)
        out[b] = __int_as_float(__byte_perm(biased, 0x4B000000u, 0x7650u | b)) - 8388736.f;
}

// Eight int8 codes (8 bytes, lowest first) as floats.
__device__ __forceinline__ void kv8_floats(uint2 w, float (&out)[8]) {
    kv8x4_floats(w.x, out);
    kv8x4_floats(w.y, out + 4);
}
