// How the linear layers' weights sit in GPU memory, and one 16-byte piece of a weight row
// dotted with its activations. Two formats, chosen per model when the kernels are compiled:
//   bf16 (QW_FP8 = 0): a row is K bf16 values.
//   FP8  (QW_FP8 = 1, Qwen's fine-grained layout): a row is its K e4m3 codes, then one float
//        scale per 128 columns (the scale of the row's 128 x 128 block), padded to 16 bytes;
//        a weight is code x scale. The scales ride with the row, so whatever streams rows
//        (a warp's loads, a shared-memory stage) brings them along at 1/32 of the bytes.
// The embedding and the LM head stay bf16 in both (Qwen's FP8 checkpoints keep them so).
#pragma once
#include "common.cuh"

#ifndef QW_FP8
#define QW_FP8 0
#endif

namespace qw {
constexpr bool fp8 = QW_FP8 != 0;
constexpr int FP8_BLOCK = 128;
}  // namespace qw

// Values in one 16-byte piece of a row.
template <bool F8>
__host__ __device__ constexpr int piece_values() {
    return F8 ? 16 : 8;
}

// Bytes from one row to the next for K columns.
template <bool F8>
__host__ __device__ constexpr long long row_bytes(long long k) {
    return F8 ? k + ((k + qw::FP8_BLOCK - 1) / qw::FP8_BLOCK * 4 + 15) / 16 * 16 : 2 * k;
}

// 2^120: an e4m3 code moved bit for bit into float32's fields (below) is its value times 2^-120.
constexpr float FP8_UNSCALE = 1.329227995784916e36f;

// The e4m3 code in the top byte of v as a float equal to its value x 2^-120: sign, exponent
// and mantissa keep their bits, only their places change, so subnormal codes stay exact too.
// Two integer instructions a value, on every architecture (sm_80 has no FP8 conversion).
__device__ __forceinline__ float e4m3_top(unsigned v) {
    return __uint_as_float((v & 0x80000000u) | ((v >> 4) & 0x07f00000u));
}

// The four codes of a word, lowest byte first, each x 2^-120.
__device__ __forceinline__ void e4m3x4(unsigned w, float* out) {
    out[0] = e4m3_top(w << 24);
    out[1] = e4m3_top(w << 16);
    out[2] = e4m3_top(w << 8);
    out[3] = e4m3_top(w);
}

// The two e4m3 codes in the low 16 bits of `codes` as an f16 pair (exact; the low code in the
// low half), by the hardware's conversion: sm_89 and later only.
__device__ __forceinline__ unsigned e4m3x2_f16x2(unsigned codes) {
    unsigned r;
    const unsigned short c = static_cast<unsigned short>(codes);
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(r) : "h"(c));
    return r;
}

#if __CUDA_ARCH__ >= 890
// The four e4m3 codes of a word (lowest byte first) as floats, by the hardware's conversion
// (two codes an instruction): the same values as e4m3x4 (above) times 2^120, so
// bf16(value x scale) is the weight gemm.cu makes, in about half the instructions.
// sm_89 and later (gemm_sm90.cu, verify.cu).
__device__ __forceinline__ void e4m3x4_values(unsigned w, float* out) {
    asm("{\n.reg .b16 c0, c1, h0, h1, h2, h3;\n.reg .b32 p0, p1;\n"
        "mov.b32 {c0, c1}, %4;\n"
        "cvt.rn.f16x2.e4m3x2 p0, c0;\ncvt.rn.f16x2.e4m3x2 p1, c1;\n"
        "mov.b32 {h0, h1}, p0;\nmov.b32 {h2, h3}, p1;\n"
        "cvt.f32.f16 %0, h0;\ncvt.f32.f16 %1, h1;\ncvt.f32.f16 %2, h2;\ncvt.f32.f16 %3, h3;\n}"
        : "=f"(out[0]), "=f"(out[1]), "=f"(out[2]), "=f"(out[3])
        : "r"(w));
}
#endif

// A 16-byte piece of codes as 8 words of bf16 pairs, lowest code first: decode(word, v) puts a
// word's four codes in v as floats, each is multiplied by s and rounded. The prefill GEMMs
// make their bf16 weight tiles with it (decode: e4m3x4, or the hardware's conversion on sm_90).
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

// Dot product of 8 FP8 codes (an 8-byte load) with 8 floats, x 2^-120.
__device__ __forceinline__ float dot8_e4m3(const uint2 w, const float* x) {
    float lo[4], hi[4];
    e4m3x4(w.x, lo);
    e4m3x4(w.y, hi);
    return lo[0] * x[0] + lo[1] * x[1] + lo[2] * x[2] + lo[3] * x[3] + hi[0] * x[4] +
           hi[1] * x[5] + hi[2] * x[6] + hi[3] * x[7];
}

// Dot product of 16 FP8 codes (one 16-byte load) with 16 floats, x 2^-120.
__device__ __forceinline__ float dot16_e4m3(const uint4 w, const float* x) {
    return dot8_e4m3(make_uint2(w.x, w.y), x) + dot8_e4m3(make_uint2(w.z, w.w), x + 8);
}

// Piece c of a row with K columns, and (FP8) the scale of the block it lies in.
struct WeightPiece {
    uint4 w;
    float scale;
};

template <bool F8, int K>
__device__ __forceinline__ WeightPiece load_piece(const unsigned char* row, int c) {
    WeightPiece p;
    p.w = reinterpret_cast<const uint4*>(row)[c];
    p.scale = F8 ? reinterpret_cast<const float*>(row + K)[c * 16 / qw::FP8_BLOCK] : 1.f;
    return p;
}

__device__ __forceinline__ WeightPiece no_piece() { return {make_uint4(0, 0, 0, 0), 0.f}; }

// The piece's weights dotted with x[0 .. piece_values).
template <bool F8>
__device__ __forceinline__ float piece_dot(const WeightPiece& p, const float* x) {
    if constexpr (F8) return dot16_e4m3(p.w, x) * FP8_UNSCALE * p.scale;
    else return dot8(p.w, x);
}
