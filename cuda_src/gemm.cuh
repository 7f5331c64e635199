// The prefill GEMM's tile loop (gemm.cu's products, moe.cu's grouped ones): see gemm.cu.
#pragma once
#include "common.cuh"
#include "weights.cuh"

namespace {
constexpr int BM = 128, BN = 128, BK = 32;
constexpr int LDS = BK + 8;  // padded row: ldmatrix's eight row addresses hit distinct banks
constexpr int THREADS = 256;
constexpr int STAGES = 4;
// bf16 B: STAGES stages of A and B tiles. FP8 B: STAGES stages of A tiles and of B's codes,
// and one bf16 B tile that each step's codes are converted into.
constexpr int A_STAGE = BM * LDS, B_STAGE = BN * LDS, CODES_STAGE = BN * BK;
constexpr int SHARED_BYTES = qw::fp8 ? STAGES * A_STAGE * 2 + B_STAGE * 2 + STAGES * CODES_STAGE
                                     : STAGES * (A_STAGE + B_STAGE) * 2;

enum Epilogue { STORE_F32 = 0, ADD_F32 = 1, STORE_BF16 = 2 };  // C float, or bf16 (STORE_BF16)

__device__ __forceinline__ void load_tile(bf16_t (*dst)[LDS], const bf16_t* __restrict__ src,
                                          int rows, int K, int row0, int k0) {
    // 128 rows x 32 columns = 512 chunks of 16 bytes, two per thread.
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const int chunk = threadIdx.x + i * THREADS;
        const int r = chunk >> 2, c = (chunk & 3) * 8;
        const int gr = row0 + r, gc = k0 + c;
        const bool ok = gr < rows && gc < K;
        const bf16_t* p = ok ? src + static_cast<long long>(gr) * K + gc : src;
        cp_async_16(&dst[r][c], p, ok ? 16 : 0);
    }
}

// FP8 weight tile: 128 rows x 32 codes = 256 pieces of 16 bytes, one a thread, plus the scale
// of the 128-column block the tile lies in (BK divides 128), returned for the conversion.
__device__ __forceinline__ float load_tile_fp8(unsigned char (*dst)[BK], const unsigned char* src,
                                               int rows, int K, int row0, int k0) {
    const int r = threadIdx.x >> 1, c = (threadIdx.x & 1) * 16;
    const int gr = row0 + r;
    const bool ok = gr < rows && k0 + c < K;
    const unsigned char* row = src + gr * row_bytes<qw::FP8>(K);
    cp_async_16(&dst[r][c], ok ? row + k0 + c : src, ok ? 16 : 0);
    return ok ? reinterpret_cast<const float*>(row + K)[k0 / qw::FP8_BLOCK] : 0.f;
}

// This thread's 16 codes of the tile (its own copy, already waited for) as bf16 weights.
__device__ __forceinline__ void convert_tile_fp8(bf16_t (*dst)[LDS],
                                                 const unsigned char (*src)[BK], float scale) {
    const int r = threadIdx.x >> 1, c = (threadIdx.x & 1) * 16;
    unsigned packed[8];
    codes_to_bf16(*reinterpret_cast<const uint4*>(&src[r][c]), FP8_UNSCALE * scale, packed,
                  [](unsigned w, float* v) { e4m3x4(w, v); });
    *reinterpret_cast<uint4*>(&dst[r][c]) = make_uint4(packed[0], packed[1], packed[2], packed[3]);
    *reinterpret_cast<uint4*>(&dst[r][c + 8]) = make_uint4(packed[4], packed[5], packed[6], packed[7]);
}

// int4 weight tile (moe.cu's grouped products): 128 rows x 32 columns = 16 bytes of codes a
// row, one 16-byte piece a thread of the first 128, plus the record of the 128-column group
// the tile lies in (BK divides 128), returned for the conversion (0 for the other threads).
__device__ __forceinline__ unsigned load_tile_int4(unsigned char (*dst)[BK], const unsigned char* src,
                                                   int rows, int K, int row0, int k0) {
    const int r = threadIdx.x;
    if (r >= BN) return 0u;
    const int gr = row0 + r;
    const bool ok = gr < rows && k0 < K;
    const unsigned char* row = src + static_cast<long long>(gr) * row_bytes<qw::INT4>(K);
    cp_async_16(&dst[r][0], ok ? row + k0 / 2 : src, ok ? 16 : 0);
    return ok ? reinterpret_cast<const unsigned*>(row + K / 2)[k0 / qw::FP8_BLOCK] : 0u;
}

// This thread's row of the tile (its own copy, already waited for) as bf16 weights:
// (code - zero) x scale, rounded as dequant_int4_rows rounds them.
__device__ __forceinline__ void convert_tile_int4(bf16_t (*dst)[LDS],
                                                  const unsigned char (*src)[BK], unsigned rec) {
    const int r = threadIdx.x;
    if (r >= BN) return;
    const uint4 codes = *reinterpret_cast<const uint4*>(&src[r][0]);
    const unsigned words[4] = {codes.x, codes.y, codes.z, codes.w};
#pragma unroll
    for (int j = 0; j < 4; ++j)  // columns 8j .. 8j + 7
        *reinterpret_cast<uint4*>(&dst[r][8 * j]) = int4x8_bf16(words[j], rec);
}

// A tile of A's rows gathered through an index: row r of the tile is A's row a_rows[m0 + r]
// (M rows listed). This thread's two 16-byte pieces a step lie in two fixed rows (r and
// r + 64), found once: src[i] is that row's start (A itself for a row past M, copied as zeros).
struct GatherRows {
    const bf16_t* src[2];
    bool ok[2];
};

__device__ __forceinline__ GatherRows gather_rows(const bf16_t* __restrict__ A,
                                                  const int* __restrict__ a_rows, int M, int K,
                                                  int m0) {
    GatherRows g;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const int r = (threadIdx.x + i * THREADS) >> 2;
        g.ok[i] = m0 + r < M;
        g.src[i] = g.ok[i] ? A + static_cast<long long>(a_rows[m0 + r]) * K : A;
    }
    return g;
}

__device__ __forceinline__ void load_tile_gathered(bf16_t (*dst)[LDS], const GatherRows& g, int K,
                                                   int k0) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const int chunk = threadIdx.x + i * THREADS;
        const int r = chunk >> 2, c = (chunk & 3) * 8;
        const bool ok = g.ok[i] && k0 + c < K;
        cp_async_16(&dst[r][c], ok ? g.src[i] + k0 + c : g.src[i], ok ? 16 : 0);
    }
}

// The block's tile: rows m0.. of C, columns blockIdx.x * BN...
// B (format WF) is a bf16 matrix, or the FP8 or int4 rows of weights.cuh: their codes are
// staged as the activations are and converted into a single bf16 tile before each step's
// products (int4: moe.cu's grouped products only; gemm.cu's int4 prefill dequantizes slices).
// With a_rows (moe.cu's gate/up products), A's rows are gathered through it (GatherRows).
template <int EPI, int WF>
__device__ void gemm_bf16(const bf16_t* __restrict__ A, const void* __restrict__ Bv,
                          void* __restrict__ Cv, int M, int N, int K, int ldc, int m0,
                          const int* __restrict__ a_rows = nullptr) {
    extern __shared__ __align__(16) unsigned char gemm_shared[];
    typedef bf16_t Tile[LDS];
    typedef unsigned char CodeTile[BK];
    // As[stage][row][col]; Bs[stage or 0][row][col]; B8[stage][row][code]
    Tile* As = reinterpret_cast<Tile*>(gemm_shared);
    Tile* Bs = As + STAGES * BM;
    constexpr bool NARROW = WF != qw::BF16;  // B's codes converted into one bf16 tile
    CodeTile* B8 = reinterpret_cast<CodeTile*>(Bs + (NARROW ? 1 : STAGES) * BN);
    const bf16_t* B = static_cast<const bf16_t*>(Bv);
    const unsigned char* B_codes = static_cast<const unsigned char*>(Bv);
    const int n0 = blockIdx.x * BN;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int wm = (warp >> 1) * 32, wn = (warp & 1) * 64;
    const int g = lane >> 2, t = lane & 3;

    float acc[2][8][4];
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int j = 0; j < 8; ++j)
#pragma unroll
            for (int k = 0; k < 4; ++k) acc[i][j][k] = 0.f;

    const int tiles = (K + BK - 1) / BK;
    // FP8: the block scale of each stage's tile, int4: the group's record (a thread's own rows:
    // it converts its own codes)
    float scales[STAGES];
    unsigned records[STAGES];
#pragma unroll
    for (int i = 0; i < STAGES; ++i) {
        scales[i] = 0.f;
        records[i] = 0u;
    }
    GatherRows gathered{};
    if (a_rows != nullptr) gathered = gather_rows(A, a_rows, M, K, m0);
    auto issue = [&](int kt) {  // step kt's tiles into stage kt % STAGES
        const int st = kt % STAGES;
        if (a_rows != nullptr) load_tile_gathered(As + st * BM, gathered, K, kt * BK);
        else load_tile(As + st * BM, A, M, K, m0, kt * BK);
        if constexpr (WF == qw::FP8) scales[st] = load_tile_fp8(B8 + st * BN, B_codes, N, K, n0, kt * BK);
        else if constexpr (WF == qw::INT4) records[st] = load_tile_int4(B8 + st * BN, B_codes, N, K, n0, kt * BK);
        else load_tile(Bs + st * BN, B, N, K, n0, kt * BK);
    };
#pragma unroll
    for (int kt = 0; kt < STAGES - 1; ++kt) {
        if (kt < tiles) issue(kt);
        cp_async_commit();
    }
    for (int kt = 0; kt < tiles; ++kt) {
        const int s = kt % STAGES;
        cp_async_wait<STAGES - 2>();  // this thread's copies of step kt have landed
        if constexpr (WF == qw::FP8) convert_tile_fp8(Bs, B8 + s * BN, scales[s]);
        if constexpr (WF == qw::INT4) convert_tile_int4(Bs, B8 + s * BN, records[s]);
        __syncthreads();  // ... and every thread's; every warp is done with step kt - 1
        // The step STAGES - 1 ahead goes into the stage step kt - 1 used.
        if (kt + STAGES - 1 < tiles) issue(kt + STAGES - 1);
        cp_async_commit();
        const Tile* Ast = As + s * BM;
        const Tile* Bst = Bs + (NARROW ? 0 : s * BN);
#pragma unroll
        for (int k16 = 0; k16 < BK; k16 += 16) {
            // Fragments by ldmatrix: lane l gives row l % 8 of 8x8 matrix l / 8. A: matrices
            // (rows +0 | +8) x (k +0 | +8) = a0..a3; B: (n +0 | +8 of a pair of tiles) x (k +0 | +8).
            unsigned a[2][4], b[8][2];
            const int lr = lane & 7, lm = lane >> 3;
#pragma unroll
            for (int i = 0; i < 2; ++i)
                ldmatrix_x4(a[i], &Ast[wm + i * 16 + lr + (lm & 1) * 8][k16 + (lm >> 1) * 8]);
#pragma unroll
            for (int j = 0; j < 8; j += 2) {
                unsigned r[4];
                ldmatrix_x4(r, &Bst[wn + j * 8 + lr + (lm >> 1) * 8][k16 + (lm & 1) * 8]);
                b[j][0] = r[0];
                b[j][1] = r[1];
                b[j + 1][0] = r[2];
                b[j + 1][1] = r[3];
            }
#pragma unroll
            for (int i = 0; i < 2; ++i)
#pragma unroll
                for (int j = 0; j < 8; ++j) mma_bf16_16816(acc[i][j], a[i], b[j]);
        }
        if constexpr (NARROW) __syncthreads();  // the one bf16 B tile is converted again next step
    }
    cp_async_wait<0>();

#pragma unroll
    for (int i = 0; i < 2; ++i) {
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            const int col = n0 + wn + j * 8 + t * 2;
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const int row = m0 + wm + i * 16 + g + half * 8;
                if (row >= M) continue;
                const float v0 = acc[i][j][half * 2], v1 = acc[i][j][half * 2 + 1];
                if constexpr (EPI == STORE_BF16) {
                    if (col >= N) continue;
                    bf16_t* out = static_cast<bf16_t*>(Cv) + static_cast<long long>(row) * ldc + col;
                    if (col + 1 < N && (ldc & 1) == 0) {  // one 4-byte store (col is even)
                        *reinterpret_cast<unsigned*>(out) = pack_bf16x2(v0, v1);
                    } else {
                        out[0] = f32_to_bf16(v0);
                        if (col + 1 < N) out[1] = f32_to_bf16(v1);
                    }
                    continue;
                }
                float* out = static_cast<float*>(Cv) + static_cast<long long>(row) * ldc + col;
                if (col + 1 < N && (ldc & 1) == 0) {  // one 8-byte access (col is even)
                    float2* o2 = reinterpret_cast<float2*>(out);
                    if (EPI == ADD_F32) {
                        const float2 old = *o2;
                        *o2 = make_float2(old.x + v0, old.y + v1);
                    } else {
                        *o2 = make_float2(v0, v1);
                    }
                    continue;
                }
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    if (col + e >= N) continue;
                    const float v = e ? v1 : v0;
                    if (EPI == ADD_F32) out[e] += v;
                    else out[e] = v;
                }
            }
        }
    }
}
}  // namespace
