// FP8 weights on Hopper's bf16 wgmma (gemm_sm90.cu, moe_sm90.cu): the producer warpgroup's
// converters widen a step's codes, which the TMA brought, into the bf16 tile the consumers read.
#pragma once
#include "sm90.cuh"
#include "weights.cuh"

// B's codes for one 64-deep step (BN rows, plain rows of 64 bytes at `codes`) into bf16 weights
// (code x the row's block scale, rounded) at `tile`, in the 128-byte-swizzled layout the TMA gives
// bf16 tiles. row_of(r): the row of b_rows (codes then block scales, row_bytes<FP8>(K) apart) that
// tile row r holds; rows at or past `rows` get scale 0 (the TMA's codes there are zeros). The
// converters are the producer warpgroup's threads from 32 on, CONVERTERS of them; each takes 16
// codes (a quarter row) at a time: a warp's reads are 512 contiguous bytes and its writes fill
// every bank once per 8 rows.
template <int BN, int CONVERTERS, class RowOf>
__device__ __forceinline__ void convert_codes_step(unsigned tile, const unsigned char* codes,
                                                   const unsigned char* __restrict__ b_rows,
                                                   int rows, int K, int step, RowOf row_of) {
    constexpr int ITEMS = (BN * 4 + CONVERTERS - 1) / CONVERTERS;  // per converter
    const long long row_stride = row_bytes<qw::FP8>(K);
    // Every scale this converter needs first, all loads in flight together: one at a time,
    // each global load's latency would be paid ITEMS times a step.
    float scale[ITEMS];
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
        const int item = threadIdx.x - 32 + i * CONVERTERS, row = row_of(item >> 2);
        scale[i] = item < BN * 4 && row < rows
            ? __ldg(reinterpret_cast<const float*>(b_rows + row * row_stride + K) +
                    step * 64 / qw::FP8_BLOCK)
            : 0.f;
    }
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
        const int item = threadIdx.x - 32 + i * CONVERTERS;
        if (item >= BN * 4) break;
        const int r = item >> 2, quarter = item & 3;
        unsigned packed[8];
        codes_to_bf16(*reinterpret_cast<const uint4*>(codes + r * 64 + quarter * 16), scale[i],
                      packed, [](unsigned w, float* v) { e4m3x4_values(w, v); });
        st_swizzled_pair(tile + r * 128, 2 * quarter, r, packed);
    }
}
