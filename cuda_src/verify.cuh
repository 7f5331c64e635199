// A few rows of activations times a layer's weights, every weight read once for all of them, on the
// tensor cores: a speculative pass's linear layers (the fed token and up to 7 proposals, n <= 8
// rows; verify.cu) and its chosen experts' (moe.cu). The prefill's GEMMs tile 128 tokens, so with 8
// tokens only the weight columns give them blocks (16-32 of 132 SMs on an 8B's o_proj and down);
// here a block takes 16 or 32 output rows and its 8 warps split K, so even o_proj gets 128-256
// blocks, and a pass reads the weights at about the rate a decode step does.
//
// mma m16n8k16 (bf16 in, f32 out): A is 16 weight rows (lane (g, t) of a warp holds rows g and g +
// 8), B is the 8 tokens' activations (lane (g, t) holds token g's), D[row][token]. Lane (g, t)
// loads 16-byte pieces of its two rows at the columns of its own and the same columns of token g's
// activations; the two mma of a piece take its values 0-3 and 4-7 (a lane's k-slots hold other
// columns than the mma's nominal ones, but the same in A and B, so every product is one weight
// times its own activation). A step is 4 lanes x 32 bytes of a row: 64 bf16 columns, or 128 FP8
// codes, whose block scale (weights.cuh) is then one float a row; or 4 lanes x 16 bytes, 128 int4
// codes, one group (its scale and zero one record a row). FP8 codes become bf16 weights (code x
// scale, rounded); int4 codes go to the tensor cores as code - zero (exact in bf16), the group's
// scale multiplying the step's sums. The warps' sums of a row are added in warp order through
// shared memory: no atomics, the same sums each run.
#pragma once
#include "common.cuh"
#include "qwen3.cuh"
#include "weights.cuh"

namespace {
constexpr int VT_THREADS = 256, VT_WARPS = VT_THREADS / 32, VT_TOKENS = 8;

// 16 bytes of weights that no other kernel of the pass reads: streamed past L1.
__device__ __forceinline__ uint4 ld_stream(const unsigned char* p) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}

// What a product's activation rows hold: bf16 values, floats (o_proj's input), or a row of
// 2K floats [gate | up] whose K activations are SwiGLU's, silu(gate) x up (an expert's down
// input, moe.cu), each rounded to bf16 as moe_swiglu rounds it; or (A_SCALED) the bf16 rows
// x times an RMSNorm's weights that the product before wrote (PassNorm), each token's sums
// then multiplied by its 1/rms.
enum ActRows { A_BF16, A_F32, A_SWIGLU, A_SCALED };

// RMSNorm across a pass's products, with no kernel of its own. The product that adds to the
// residual stream x (o_proj, down) also writes, for the norm that comes next, xg = bf16(x x
// its weights) and each block's sum of x^2 over its rows (sq[token][block]); the product after
// the norm takes xg (A_SCALED) and multiplies each token's sums by rsqrt(sum of the parts / K
// + eps), the parts added in block order, so the bits repeat. (Σ w (x g)/rms = (1/rms) Σ w x g:
// the megakernel's load_normed takes 1/rms at the end the same way.)
struct PassNorm {
    const float* sq_in = nullptr;  // A_SCALED: parts floats a token, in its activations' order
    int parts = 0;
    float eps = 0.f;
    const bf16_t* next = nullptr;  // with ADD: the next norm's weights, and where xg and the
    bf16_t* xg = nullptr;          // block's sums of squares go (sq_out[token][blockIdx.x])
    float* sq_out = nullptr;

    // A product after the norm: its input's `parts` sums of squares a token in sq.
    __device__ static PassNorm scaled(const float* sq, int parts, float eps) {
        PassNorm norm;
        norm.sq_in = sq;
        norm.parts = parts;
        norm.eps = eps;
        return norm;
    }
    // A product that adds to x: the next norm's weights, and where its input goes.
    __device__ static PassNorm writing(const bf16_t* next, bf16_t* xg, float* sq) {
        PassNorm norm;
        norm.next = next;
        norm.xg = xg;
        norm.sq_out = sq;
        return norm;
    }
};

// Token tok's 8 activations at column col (a row of K) as bf16 pairs, zero where !ok.
template <int K, int AIN>
__device__ __forceinline__ uint4 act8(const void* a, int tok, int col, bool ok) {
    if (!ok) return make_uint4(0u, 0u, 0u, 0u);
    const long long at = static_cast<long long>(tok) * K + col;
    if constexpr (AIN == A_F32) {
        const float4 lo = *reinterpret_cast<const float4*>(static_cast<const float*>(a) + at);
        const float4 hi = *reinterpret_cast<const float4*>(static_cast<const float*>(a) + at + 4);
        return make_uint4(pack_bf16x2(lo.x, lo.y), pack_bf16x2(lo.z, lo.w), pack_bf16x2(hi.x, hi.y),
                          pack_bf16x2(hi.z, hi.w));
    } else if constexpr (AIN == A_SWIGLU) {
        static_assert(K % 4 == 0, "the up half of a row starts on 16 bytes");
        const float* g = static_cast<const float*>(a) + static_cast<long long>(tok) * 2 * K + col;
        float v[8];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const float4 gate = *reinterpret_cast<const float4*>(g + 4 * h);
            const float4 up = *reinterpret_cast<const float4*>(g + K + 4 * h);
            v[4 * h] = silu(gate.x) * up.x;
            v[4 * h + 1] = silu(gate.y) * up.y;
            v[4 * h + 2] = silu(gate.z) * up.z;
            v[4 * h + 3] = silu(gate.w) * up.w;
        }
        return make_uint4(pack_bf16x2(v[0], v[1]), pack_bf16x2(v[2], v[3]),
                          pack_bf16x2(v[4], v[5]), pack_bf16x2(v[6], v[7]));
    } else {
        return *reinterpret_cast<const uint4*>(static_cast<const bf16_t*>(a) + at);
    }
}

// d += rows (w0: row g, w1: row g + 8) . token g's activations x, over one 8-column piece.
__device__ __forceinline__ void mma_piece(float (&d)[4], uint4 w0, uint4 w1, uint4 x) {
    const unsigned a0[4] = {w0.x, w1.x, w0.y, w1.y}, b0[2] = {x.x, x.y};
    const unsigned a1[4] = {w0.z, w1.z, w0.w, w1.w}, b1[2] = {x.z, x.w};
    mma_bf16_16816(d, a0, b0);
    mma_bf16_16816(d, a1, b1);
}

// Four e4m3 codes (a word, lowest byte first) as floats: exact by the hardware's conversion,
// else x 2^-120 (e4m3x4); codes_unit() is what the block scale is multiplied by to match.
__device__ __forceinline__ void codes4(unsigned w, float* v) {
#if __CUDA_ARCH__ >= 890
    e4m3x4_values(w, v);
#else
    e4m3x4(w, v);
#endif
}

__device__ __forceinline__ float codes_unit() {
#if __CUDA_ARCH__ >= 890
    return 1.f;
#else
    return FP8_UNSCALE;
#endif
}

// Eight int4 weights (a word, weights.cuh's order) as bf16 pairs in column order without their
// scale: code - zero, exact (small integers). A code ORed into the mantissa of 128.0 (0x4300) is
// the bf16 value 128 + code; one FMA a pair takes 128 + zero off (`neg_zero2`: the bf16 pair
// -(128 + zero)), on every architecture from sm_80 (bf16 subtraction itself is sm_90's).
__device__ __forceinline__ uint4 int4_bf16(unsigned w, unsigned neg_zero2) {
    const unsigned one = 0x3f803f80u;
    unsigned p[4];
    int4x8_biased(w, p, 0x43004300u);
#pragma unroll
    for (int k = 0; k < 4; ++k)
        asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(p[k]) : "r"(p[k]), "r"(one), "r"(neg_zero2));
    return make_uint4(p[0], p[1], p[2], p[3]);
}

// out[tok][row] (= or +=) Σ_k W[row][k] a[a_row(tok)][k] for tok < n <= VT_TOKENS and the
// block's 16 R rows, where a_row(tok) is a_rows[tok] or, with a_rows null, tok itself; a's
// rows as AIN says (ActRows). out is float, or with OUT_BF16 bf16 (stored, rounded; not with
// ADD).
// `norm`: A_SCALED's 1/rms, and with ADD and norm.next set the next norm's xg and sums of
// squares (PassNorm).
template <int K, int WF, int AIN, bool ADD, int R, bool OUT_BF16 = false>
__device__ __forceinline__ void verify_product(const void* __restrict__ a,
                                               const int* __restrict__ a_rows, int n,
                                               const unsigned char* __restrict__ W, int N,
                                               void* __restrict__ out, PassNorm norm = {}) {
    static_assert(!(OUT_BF16 && ADD), "a bf16 output is stored, not added to");
    static_assert(16 * R * VT_TOKENS <= VT_THREADS, "a thread an output at most");
    constexpr bool F8 = WF == qw::FP8, I4 = WF == qw::INT4;
    constexpr long long RB = row_bytes<WF>(K);
    constexpr int COLS = WF == qw::BF16 ? 64 : 128;  // a step's columns
    constexpr int STEPS = (K + COLS - 1) / COLS;
    constexpr int PIECES = COLS / 32;  // 8-column pieces a lane takes a step: 2 or 4
    __shared__ float sums[VT_WARPS][16 * R][VT_TOKENS + 1];
    __shared__ float rstd[VT_TOKENS];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int row0 = blockIdx.x * 16 * R;
    if constexpr (AIN == A_SCALED) {  // warp w: token w's 1/rms (its loads out before the weights')
        static_assert(VT_WARPS == VT_TOKENS, "a warp a token");
        if (warp < n) {
            const float* sq = norm.sq_in + (a_rows != nullptr ? a_rows[warp] : warp) * norm.parts;
            float total = 0.f;
            for (int p = lane; p < norm.parts; p += 32) total += sq[p];
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) total += __shfl_xor_sync(0xffffffffu, total, o);
            if (lane == 0) rstd[warp] = rsqrtf(total / K + norm.eps);
        }
    }
    const unsigned char* rows[R][2];
    bool has[R][2];
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int row = row0 + 16 * r + 8 * h + g;
            has[r][h] = row < N;
            rows[r][h] = W + static_cast<long long>(has[r][h] ? row : 0) * RB;
        }
    const bool tok = g < n;
    const int a_row = tok && a_rows != nullptr ? a_rows[g] : g;  // token g's activations
    float acc[R][2][4];
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
        for (int p = 0; p < 2; ++p)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[r][p][e] = 0.f;

    // A step's loads: the weights of its rows (and their scales), token g's activations.
    constexpr int LOADS = I4 ? 1 : 2;  // 16-byte loads a row
    struct Loads {
        uint4 raw[R][2][LOADS];  // [tile][row g, g + 8][16-byte load]
        float scale[R][2];
        unsigned zero2[R][2];
        uint4 x[PIECES];
    };
    const auto load = [&](int s, Loads& l) {
        const int c0 = s * COLS + (COLS / 4) * t;  // the lane's first column
#pragma unroll
        for (int r = 0; r < R; ++r)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
#pragma unroll
                for (int q = 0; q < LOADS; ++q) {
                    const int col = c0 + q * (F8 ? 16 : 8);
                    const bool in = has[r][h] && (K % COLS == 0 || col < K);
                    l.raw[r][h][q] = in ? ld_stream(rows[r][h] + code_bytes<WF>(col))
                                        : make_uint4(0u, 0u, 0u, 0u);
                }
                l.scale[r][h] = 0.f;
                l.zero2[r][h] = 0xc300c300u;  // (int4: codes 0 less 128 + 0: zeros)
                const bool in = has[r][h] && (K % COLS == 0 || c0 < K);
                if constexpr (F8) {
                    if (in) l.scale[r][h] = reinterpret_cast<const float*>(rows[r][h] + K)[s] * codes_unit();
                } else if constexpr (I4) {
                    if (in) {  // the record's zero: f16 1024 + zero in its high half
                        const unsigned rec = reinterpret_cast<const unsigned*>(rows[r][h] + K / 2)[s];
                        const unsigned neg = 0xc300u + (rec >> 16) - 0x6400u;  // bf16 -(128 + z)
                        l.scale[r][h] = int4_scale(rec);
                        l.zero2[r][h] = neg | (neg << 16);
                    }
                }
            }
#pragma unroll
        for (int p = 0; p < PIECES; ++p) {
            const int col = c0 + 8 * p;
            l.x[p] = act8<K, AIN>(a, a_row, col, tok && (K % COLS == 0 || col < K));
        }
    };
    const auto multiply = [&](const Loads& l) {
#pragma unroll
        for (int r = 0; r < R; ++r) {
            if constexpr (I4) {  // word j of the load: 8 columns, token g's piece j
                // The weights without their scale (exact) on the tensor cores, the group's
                // scale (one a row for the step's 128 columns) on the step's sums.
                const unsigned words[4] = {l.raw[r][0][0].x, l.raw[r][0][0].y, l.raw[r][0][0].z,
                                           l.raw[r][0][0].w};
                const unsigned words1[4] = {l.raw[r][1][0].x, l.raw[r][1][0].y, l.raw[r][1][0].z,
                                            l.raw[r][1][0].w};
                float d[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};  // (two chains)
#pragma unroll
                for (int j = 0; j < 4; ++j)
                    mma_piece(d[j & 1], int4_bf16(words[j], l.zero2[r][0]),
                              int4_bf16(words1[j], l.zero2[r][1]), l.x[j]);
#pragma unroll
                for (int e = 0; e < 4; ++e)  // d[.][e]: row g (e < 2) or g + 8
                    acc[r][0][e] += (d[0][e] + d[1][e]) * l.scale[r][e >> 1];
            } else if constexpr (F8) {
#pragma unroll
                for (int q = 0; q < 2; ++q) {
                    unsigned w0[8], w1[8];
                    codes_to_bf16(l.raw[r][0][q], l.scale[r][0], w0, codes4);
                    codes_to_bf16(l.raw[r][1][q], l.scale[r][1], w1, codes4);
                    mma_piece(acc[r][0], make_uint4(w0[0], w0[1], w0[2], w0[3]),
                              make_uint4(w1[0], w1[1], w1[2], w1[3]), l.x[2 * q]);
                    mma_piece(acc[r][1], make_uint4(w0[4], w0[5], w0[6], w0[7]),
                              make_uint4(w1[4], w1[5], w1[6], w1[7]), l.x[2 * q + 1]);
                }
            } else {
#pragma unroll
                for (int p = 0; p < 2; ++p)
                    mma_piece(acc[r][p], l.raw[r][0][p], l.raw[r][1][p], l.x[p]);
            }
        }
    };
    // The warp's steps warp, warp + 8, ...: the next step's loads go out before this one's
    // products, so a warp keeps a step of loads in flight while it multiplies.
    Loads cur, next;
    if (warp < STEPS) load(warp, cur);
    for (int s = warp; s < STEPS; s += VT_WARPS) {
        if (s + VT_WARPS < STEPS) load(s + VT_WARPS, next);
        multiply(cur);
        cur = next;
    }
    // D[row][token]: lane (g, t) holds rows g and g + 8, tokens 2t and 2t + 1.
#pragma unroll
    for (int r = 0; r < R; ++r) {
        sums[warp][16 * r + g][2 * t] = acc[r][0][0] + acc[r][1][0];
        sums[warp][16 * r + g][2 * t + 1] = acc[r][0][1] + acc[r][1][1];
        sums[warp][16 * r + g + 8][2 * t] = acc[r][0][2] + acc[r][1][2];
        sums[warp][16 * r + g + 8][2 * t + 1] = acc[r][0][3] + acc[r][1][3];
    }
    __syncthreads();
    // Thread i: output (token i / 16R, row i % 16R).
    const int token = threadIdx.x / (16 * R), rr = threadIdx.x % (16 * R), row = row0 + rr;
    float square = 0.f;  // (of the new x, for the next norm)
    if (threadIdx.x < 16 * R * VT_TOKENS && token < n && row < N) {
        float v = 0.f;
#pragma unroll
        for (int w = 0; w < VT_WARPS; ++w) v += sums[w][rr][token];
        if constexpr (AIN == A_SCALED) v *= rstd[token];
        const long long at = static_cast<long long>(token) * N + row;
        if constexpr (OUT_BF16) {
            static_cast<bf16_t*>(out)[at] = f32_to_bf16(v);
        } else {
            float* dst = static_cast<float*>(out) + at;
            const float x = ADD ? *dst + v : v;
            *dst = x;
            if (ADD && norm.next != nullptr) {
                norm.xg[at] = f32_to_bf16(x * bf16_to_f32(norm.next[row]));
                square = x * x;
            }
        }
    }
    if (ADD && norm.next != nullptr) {  // the block's sum a token: its 16R lanes, a fixed tree
#pragma unroll
        for (int o = 8 * R; o > 0; o >>= 1) square += __shfl_xor_sync(0xffffffffu, square, o);
        if (rr == 0 && token < n && threadIdx.x < 16 * R * VT_TOKENS)
            norm.sq_out[token * gridDim.x + blockIdx.x] = square;
    }
}
}  // namespace
