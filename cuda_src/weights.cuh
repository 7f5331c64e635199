// How the linear layers' weights sit in GPU memory, and one 16-byte piece of a weight row
// dotted with its activations. Three formats, chosen per model when the kernels are compiled
// (qw::wfmt):
//   bf16 (qw::BF16): a row is K bf16 values.
//   FP8  (qw::FP8, QW_FP8 = 1, Qwen's fine-grained layout): a row is its K e4m3 codes, then one
//        float scale per 128 columns (the scale of the row's 128 x 128 block), padded to 16
//        bytes; a weight is code x scale.
//   int4 (qw::INT4, QW_INT4 = 1, AWQ's groups): a row is its K 4-bit codes, eight a 32-bit
//        word (nibble i holds the word's column ORDER[i] = 0, 2, 4, 6, 1, 3, 5, 7, AWQ's own
//        order, so that (word >> 4k) & 0x000f000f holds columns 2k and 2k + 1), then one
//        record per group of 128 columns: the f16 scale in the low half, the f16 value
//        1024 + zero in the high half; padded to 16 bytes. A weight is (code - zero) x scale.
// The scales ride with the row, so whatever streams rows (a warp's loads, a shared-memory
// stage) brings them along at 1/32 (FP8) or 1/16 (int4) of the bytes.
// The embedding and the LM head stay bf16 in every format (Qwen's FP8 and AWQ checkpoints keep
// them unquantized).
#pragma once
#include "common.cuh"

#ifndef QW_FP8
#define QW_FP8 0
#endif
#ifndef QW_INT4
#define QW_INT4 0
#endif

namespace qw {
enum : int { BF16 = 0, FP8 = 1, INT4 = 2 };
constexpr int wfmt = QW_INT4 ? INT4 : QW_FP8 ? FP8 : BF16;
constexpr bool fp8 = wfmt == FP8;
constexpr bool int4 = wfmt == INT4;
constexpr int FP8_BLOCK = 128;  // columns of an FP8 block or an int4 group
}  // namespace qw

// Values in one 16-byte piece of a row.
template <int WF>
__host__ __device__ constexpr int piece_values() {
    return WF == qw::INT4 ? 32 : WF == qw::FP8 ? 16 : 8;
}

// Bytes of K columns' weights (without their scales).
template <int WF>
__host__ __device__ constexpr long long code_bytes(long long k) {
    return WF == qw::INT4 ? k / 2 : WF == qw::FP8 ? k : 2 * k;
}

// Bytes from one row to the next for K columns.
template <int WF>
__host__ __device__ constexpr long long row_bytes(long long k) {
    return code_bytes<WF>(k) +
           (WF == qw::BF16 ? 0 : ((k + qw::FP8_BLOCK - 1) / qw::FP8_BLOCK * 4 + 15) / 16 * 16);
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

// The eight 4-bit codes of a word (weights.cuh's order) as four 16-bit float pairs biased by
// `bias`: pair k holds columns 2k (low half) and 2k + 1. One LOP3 (and a shift) a pair, on every
// architecture: a code ORed into the mantissa of 1024.0 (f16 0x6400, the default) is f16
// 1024 + code exactly, into that of 128.0 (bf16 0x4300) bf16 128 + code.
__device__ __forceinline__ void int4x8_biased(unsigned w, unsigned (&p)[4],
                                              unsigned bias = 0x64006400u) {
    // (As one LOP3 with the mask as an immediate and the exponent bits in a register: written
    // in C the compiler makes an AND and an OR of two immediates.)
#pragma unroll
    for (int k = 0; k < 4; ++k)
        asm("lop3.b32 %0, %1, %2, %3, 0xea;" : "=r"(p[k]) : "r"(w >> (4 * k)), "n"(0x000f000f), "r"(bias));
}

// a - b on f16 pairs (exact for the biased codes and their zero: small integers).
__device__ __forceinline__ unsigned hsub2(unsigned a, unsigned b) {
    unsigned r;
    asm("sub.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
    return r;
}

// An int4 group's record (weights.cuh): its scale as a float and its zero as the f16 pair
// (1024 + zero, 1024 + zero), which hsub2 takes off biased codes.
__device__ __forceinline__ float int4_scale(unsigned rec) {
    float s;
    asm("{\n.reg .b16 lo, hi;\nmov.b32 {lo, hi}, %1;\ncvt.f32.f16 %0, lo;\n}" : "=f"(s) : "r"(rec));
    return s;
}
__device__ __forceinline__ unsigned int4_zero2(unsigned rec) { return __byte_perm(rec, 0u, 0x3232); }

// The eight weights of a word as four f16 pairs (code - zero), exact: the tensor cores' A.
__device__ __forceinline__ void int4x8_f16x2(unsigned w, unsigned zero2, unsigned (&p)[4]) {
    int4x8_biased(w, p);
#pragma unroll
    for (int k = 0; k < 4; ++k) p[k] = hsub2(p[k], zero2);
}

// An f16 pair as two floats.
__device__ __forceinline__ float2 f16x2_floats(unsigned h) {
    float lo, hi;
    asm("{\n.reg .b16 l, h;\nmov.b32 {l, h}, %2;\ncvt.f32.f16 %0, l;\ncvt.f32.f16 %1, h;\n}"
        : "=f"(lo), "=f"(hi) : "r"(h));
    return make_float2(lo, hi);
}

// The eight weights of a word, (code - zero) x scale of their group's record, as four bf16
// pairs (columns in order): dequantized rows (layers.cu) and the grouped products' tiles
// (gemm.cuh).
__device__ __forceinline__ uint4 int4x8_bf16(unsigned w, unsigned rec) {
    unsigned p[4], o[4];
    int4x8_f16x2(w, int4_zero2(rec), p);
    const float s = int4_scale(rec);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        const float2 v = f16x2_floats(p[k]);
        o[k] = pack_bf16x2(v.x * s, v.y * s);
    }
    return make_uint4(o[0], o[1], o[2], o[3]);
}

// Dot product of 8 int4 weights (one word, code - zero) with 8 floats (columns in order).
__device__ __forceinline__ float dot8_int4(unsigned w, unsigned zero2, const float* x) {
    unsigned p[4];
    int4x8_f16x2(w, zero2, p);
    float acc = 0.f;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        const float2 v = f16x2_floats(p[k]);
        acc += v.x * x[2 * k] + v.y * x[2 * k + 1];
    }
    return acc;
}

// Piece c of a row with K columns, and (FP8, int4) the scale of the block or group it lies
// in and (int4) the group's zero pair.
struct WeightPiece {
    uint4 w;
    float scale;
    unsigned zero2;
};

template <int WF, int K>
__device__ __forceinline__ WeightPiece load_piece(const unsigned char* row, int c) {
    WeightPiece p;
    p.w = reinterpret_cast<const uint4*>(row)[c];
    p.zero2 = 0u;
    if constexpr (WF == qw::FP8) {
        p.scale = reinterpret_cast<const float*>(row + K)[c * 16 / qw::FP8_BLOCK];
    } else if constexpr (WF == qw::INT4) {
        const unsigned rec = reinterpret_cast<const unsigned*>(row + K / 2)[c * 32 / qw::FP8_BLOCK];
        p.scale = int4_scale(rec);
        p.zero2 = int4_zero2(rec);
    } else {
        p.scale = 1.f;
    }
    return p;
}

__device__ __forceinline__ WeightPiece no_piece() { return {make_uint4(0, 0, 0, 0), 0.f, 0u}; }

// The piece's weights dotted with x[0 .. piece_values).
template <int WF>
__device__ __forceinline__ float piece_dot(const WeightPiece& p, const float* x) {
    if constexpr (WF == qw::FP8) {
        return dot16_e4m3(p.w, x) * FP8_UNSCALE * p.scale;
    } else if constexpr (WF == qw::INT4) {
        return (dot8_int4(p.w.x, p.zero2, x) + dot8_int4(p.w.y, p.zero2, x + 8) +
                dot8_int4(p.w.z, p.zero2, x + 16) + dot8_int4(p.w.w, p.zero2, x + 24)) * p.scale;
    } else {
        return dot8(p.w, x);
    }
}
