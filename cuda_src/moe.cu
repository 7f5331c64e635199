// A mixture of experts' layer on the per-op path (issue 43): the router's top-k (moe.cuh), the
// chosen experts' matrix-vector products for one token (decode), and for a prefill's tokens the
// grouping by expert (stable: a token's rows keep the tokens' order, so every run lays them out
// alike), the gather, the grouped tensor-core products (gemm.cuh) and the weighted sum back.
// Experts' weights lie one after another in the model's format (weights.cuh): gate_up
// [experts][2 x QW_MOE_INTER rows of hidden], down [experts][hidden rows of QW_MOE_INTER].
#include "moe.cuh"
#include "gemm.cuh"
#include "gemv.cuh"
#include "verify.cuh"

namespace qwm {
constexpr int INTER = QW_MOE_INTER;
constexpr long long GATE_UP_BYTES = 2LL * INTER * row_bytes<qw::wfmt>(qw::hidden);
constexpr long long DOWN_BYTES = static_cast<long long>(qw::hidden) * row_bytes<qw::wfmt>(INTER);
static_assert(INTER <= 12288, "an expert's SwiGLU output is staged whole in shared memory");
}  // namespace qwm

extern "C" __global__ void moe_route(const float* __restrict__ logits, int tokens,
                                     float* __restrict__ weights, int* __restrict__ experts) {
    const int token = (blockIdx.x * blockDim.x + threadIdx.x) / 32;
    if (token >= tokens) return;  // (a whole warp: blockDim.x is a multiple of 32)
    qwm::route_warp(logits + static_cast<long long>(token) * qwm::EXPERTS,
                    weights + token * qwm::TOPK, experts + token * qwm::TOPK);
}

// Decode: gu[k] = expert experts[k]'s gate/up rows . rmsnorm(x) * norm_w, for the token's TOPK
// experts (blockIdx.y = k; blockIdx.x: 2 x GEMV_WARPS rows).
extern "C" __global__ void __launch_bounds__(GEMV_THREADS)
    moe_gate_up(const float* x, const bf16_t* norm_w, const unsigned char* W,
                const int* __restrict__ experts, float eps, float* gu) {
    const int k = blockIdx.y;
    rmsnorm_gemv<2, qw::wfmt>(x, norm_w, W + experts[k] * qwm::GATE_UP_BYTES, 2 * qwm::INTER, eps,
                              gu + k * 2 * qwm::INTER);
}

// Decode: x[r] += sum over k (in order) of weights[k] x expert experts[k]'s down row r .
// silu(gate_k) * up_k, gu as moe_gate_up wrote it. One row a warp: its TOPK experts' rows are
// loaded together (the first pieces before the vectors are staged), against the TOPK SwiGLU
// vectors staged once (where they fit in 48 KB; one expert at a time otherwise).
extern "C" __global__ void __launch_bounds__(GEMV_THREADS)
    moe_down(const float* __restrict__ gu, const unsigned char* W, const int* __restrict__ experts,
             const float* __restrict__ weights, float* __restrict__ x) {
    constexpr int I = qwm::INTER, K = qwm::TOPK, WF = qw::wfmt;
    constexpr bool ALL = K * I <= 12288;  // every expert's vector staged at once
    __shared__ __align__(16) float vs[ALL ? K * I : I];
    const int row = blockIdx.x * GEMV_WARPS + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    const auto swiglu = [&](int k, float* into) {
        const float* g = gu + k * 2 * I;
        for (int j = threadIdx.x; j < I; j += blockDim.x) into[j] = silu(g[j]) * g[I + j];
    };
    float total = 0.f;
    if constexpr (ALL) {
        constexpr int PER = piece_values<WF>(), STEPS = I / PER;
        constexpr long long RB = row_bytes<WF>(I);
        const unsigned char* rows[K];
#pragma unroll
        for (int k = 0; k < K; ++k) rows[k] = W + experts[k] * qwm::DOWN_BYTES + row * RB;
        const bool mine = row < qw::hidden;
        WeightPiece first[K];
#pragma unroll
        for (int k = 0; k < K; ++k)
            first[k] = mine && lane < STEPS ? load_piece<WF, I>(rows[k], lane) : no_piece();
        for (int k = 0; k < K; ++k) swiglu(k, vs + k * I);
        __syncthreads();
        float acc[K];
#pragma unroll
        for (int k = 0; k < K; ++k) acc[k] = lane < STEPS ? piece_dot<WF>(first[k], vs + k * I + lane * PER) : 0.f;
        for (int c = lane + 32; c < STEPS; c += 32) {
            WeightPiece w[K];
#pragma unroll
            for (int k = 0; k < K; ++k) w[k] = mine ? load_piece<WF, I>(rows[k], c) : no_piece();
#pragma unroll
            for (int k = 0; k < K; ++k) acc[k] += piece_dot<WF>(w[k], vs + k * I + c * PER);
        }
#pragma unroll
        for (int k = 0; k < K; ++k) total += weights[k] * warp_sum(acc[k]);
    } else {
        for (int k = 0; k < K; ++k) {
            float result[1];
            warp_rows_dot<I, 1, WF>(W + experts[k] * qwm::DOWN_BYTES, qw::hidden, row, vs, [&] {
                if (k > 0) __syncthreads();  // every warp is done with expert k - 1's vector
                swiglu(k, vs);
                __syncthreads();
            }, result);
            total += weights[k] * result[0];
        }
    }
    if (lane == 0 && row < qw::hidden) x[row] += total;
}

// Decode: the router's logits, out[e] = router row e . rmsnorm(x) * norm_w (bf16 rows in
// every format), a row a warp: 128 experts take 16 blocks (rmsnorm_gemv4's 4 rows a warp
// left 128 rows on 4 blocks).
extern "C" __global__ void __launch_bounds__(GEMV_THREADS)
    moe_router(const float* x, const bf16_t* norm_w, const bf16_t* W, float eps, float* out) {
    rmsnorm_gemv<1, qw::BF16>(x, norm_w, W, qwm::EXPERTS, eps, out);
}

// Prefill, grouping the pairs p = token x TOPK + k by expert: counts[e] = the pairs routed to
// expert e (blockIdx.x).
extern "C" __global__ void moe_count(const int* __restrict__ experts, int pairs,
                                     int* __restrict__ counts) {
    __shared__ int total;
    if (threadIdx.x == 0) total = 0;
    __syncthreads();
    int mine = 0;
    for (int p = threadIdx.x; p < pairs; p += blockDim.x) mine += experts[p] == blockIdx.x;
    if (mine) atomicAdd(&total, mine);
    __syncthreads();
    if (threadIdx.x == 0) counts[blockIdx.x] = total;
}

// Prefill: expert e's (blockIdx.x) pairs take the rows offset(e).. of the grouped order, in the
// pairs' order (offset: the counts of the experts before it): slot[p] is p's row, token[row]
// its token. Expert e's tiles of the grouped products (BM rows each) follow the earlier
// experts' in `tiles`: (expert, offset, count, first row of the tile in the group); block 0
// writes their number. blockDim.x: a multiple of 32, at most 1024. Each warp takes one
// contiguous segment of the pairs, counts its expert's pairs there, and after one block
// barrier places them from where the earlier warps' end (so the order is the pairs').
__device__ __forceinline__ int warp_sum_int(int v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

extern "C" __global__ void moe_place(const int* __restrict__ experts, int pairs,
                                     const int* __restrict__ counts, int* __restrict__ slot,
                                     int* __restrict__ token, int4* __restrict__ tiles,
                                     int* __restrict__ n_tiles) {
    __shared__ int offset, tile0, all_tiles, warp_count[32];
    const int e = blockIdx.x, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int warps = blockDim.x >> 5;
    if (threadIdx.x == 0) offset = tile0 = all_tiles = 0;
    __syncthreads();
    // the rows and tiles of the experts before e, and (block 0) every expert's tiles
    int rows = 0, before_tiles = 0, every_tile = 0;
    for (int f = threadIdx.x; f < qwm::EXPERTS; f += blockDim.x) {
        const int c = counts[f], t = (c + BM - 1) / BM;
        if (f < e) {
            rows += c;
            before_tiles += t;
        }
        every_tile += t;
    }
    rows = warp_sum_int(rows);
    before_tiles = warp_sum_int(before_tiles);
    every_tile = warp_sum_int(every_tile);
    // the pairs of this warp's segment that chose e
    const int seg = (pairs + warps - 1) / warps, lo = min(pairs, warp * seg),
              hi = min(pairs, lo + seg);
    int n_mine = 0;
#pragma unroll 8
    for (int p0 = lo; p0 < hi; p0 += 32) {
        const int p = p0 + lane;
        n_mine += __popc(__ballot_sync(0xffffffffu, p < hi && experts[p] == e));
    }
    if (lane == 0) {
        warp_count[warp] = n_mine;
        atomicAdd(&offset, rows);
        atomicAdd(&tile0, before_tiles);
        atomicAdd(&all_tiles, every_tile);
    }
    __syncthreads();
    if (e == 0 && threadIdx.x == 0) *n_tiles = all_tiles;
    const int count = counts[e];
    for (int t = threadIdx.x; t * BM < count; t += blockDim.x)
        tiles[tile0 + t] = make_int4(e, offset, count, t * BM);
    int row = offset;
    for (int w = 0; w < warp; ++w) row += warp_count[w];
#pragma unroll 8
    for (int p0 = lo; p0 < hi; p0 += 32) {
        const int p = p0 + lane;
        const bool mine = p < hi && experts[p] == e;
        const unsigned ballot = __ballot_sync(0xffffffffu, mine);
        if (mine) {
            const int r = row + __popc(ballot & ((1u << lane) - 1u));
            slot[p] = r;
            token[r] = p / qwm::TOPK;
        }
        row += __popc(ballot);
    }
}

// Prefill: C[rows of a tile's group] = A[those rows] . (its expert's rows of B)^T, N columns, K
// deep, for the tiles moe_place listed (blockIdx.y; those past n_tiles return at once);
// expert_bytes apart in B. blockIdx.x: BN columns. With a_rows (gate/up: the pairs' tokens in
// the grouped order), a group's row r is A's row a_rows[its first + r], read where it lies
// (no gathered copy), and C is fp32; without, A's rows are in the grouped order already (down:
// SwiGLU's), and C is bf16 (moe_combine sums the rows).
extern "C" __global__ void __launch_bounds__(THREADS)
    moe_gemm(const bf16_t* A, const int* __restrict__ a_rows, const unsigned char* B,
             long long expert_bytes, void* C, const int4* __restrict__ tiles,
             const int* __restrict__ n_tiles, int N, int K) {
    if (static_cast<int>(blockIdx.y) >= *n_tiles) return;
    const int4 t = tiles[blockIdx.y];
    const unsigned char* b = B + t.x * expert_bytes;
    const long long first = static_cast<long long>(t.y) * N;
    if (a_rows != nullptr)
        gemm_bf16<STORE_F32, qw::wfmt>(A, b, static_cast<float*>(C) + first, t.z, N, K, N, t.w,
                                       a_rows + t.y);
    else
        gemm_bf16<STORE_BF16, qw::wfmt>(A + static_cast<long long>(t.y) * K, b,
                                        static_cast<bf16_t*>(C) + first, t.z, N, K, N, t.w);
}

// A pass of at most VT_TOKENS tokens (a speculative pass; moe.py's moe_few_rows) runs its
// sparse MLP in five launches: the router's logits, the routing and grouping in one block, the
// experts' gate/up and down rows on verify.cuh's product (each chosen expert's rows read once
// for all of its pairs, 16 rows of one expert a block, where moe_gemm's 128-row tiles would be
// a few rows full), and moe_combine. A token routes to an expert once, so an expert's pairs
// are at most the tokens: one tile (tiles[blockIdx.y]: expert, first row, count; those past
// n_tiles return at once).

// The post-attention RMSNorm comes as o_proj (or verify_norm_rows) left it (verify.cuh's
// PassNorm): xg, x times the norm's weights in bf16, and `parts` sums of squares a token in sq.

// logits[token][e] = router row e . the normed x[token] (bf16 rows in every format),
// n <= VT_TOKENS.
extern "C" __global__ void __launch_bounds__(VT_THREADS, 2)
    moe_few_router(const bf16_t* __restrict__ xg, int n, const bf16_t* W,
                   float* __restrict__ logits, const float* __restrict__ sq, int parts,
                   float eps) {
    dependent_start();
    verify_product<qw::hidden, qw::BF16, A_SCALED, false, 1>(
        xg, nullptr, n, reinterpret_cast<const unsigned char*>(W), qwm::EXPERTS, logits,
        PassNorm::scaled(sq, parts, eps));
}

// One block of VT_THREADS: warp t routes token t (route_warp), then the pairs p = token x TOPK
// + k are grouped by expert as moe_count and moe_place group them (stable: the pairs' order
// within an expert), each pair's row counted directly (the pairs before it in that order).
// *read counts the experts listed, over every call (bench: the bytes a pass reads).
extern "C" __global__ void __launch_bounds__(VT_THREADS)
    moe_few_route(const float* __restrict__ logits, int n, float* __restrict__ weights,
                  int* __restrict__ experts, int* __restrict__ counts, int* __restrict__ slot,
                  int* __restrict__ token, int4* __restrict__ tiles, int* __restrict__ n_tiles,
                  unsigned long long* __restrict__ read) {
    dependent_start();
    constexpr int MOST = VT_TOKENS * qwm::TOPK;
    static_assert(MOST <= VT_THREADS, "a thread a pair");
    __shared__ int ex[MOST];
    __shared__ bool first[MOST];
    const int warp = threadIdx.x >> 5, pairs = n * qwm::TOPK, p = threadIdx.x;
    if (warp < n)
        qwm::route_warp(logits + warp * qwm::EXPERTS, weights + warp * qwm::TOPK,
                        experts + warp * qwm::TOPK);
    __syncthreads();  // (the block's global writes are visible to it after the barrier)
    if (p < pairs) ex[p] = experts[p];
    __syncthreads();
    int e = -1, below = 0, before = 0, same = 0;  // this pair's expert and the pairs' counts
    if (p < pairs) {
        e = ex[p];
        for (int q = 0; q < pairs; ++q) {
            below += ex[q] < e;           // pairs of lower experts
            same += ex[q] == e;           // of this expert
            before += ex[q] == e && q < p;  // of this expert, before this pair
        }
        first[p] = before == 0;
    }
    __syncthreads();
    if (p < pairs) {
        const int row = below + before;
        slot[p] = row;
        token[row] = p / qwm::TOPK;
        if (before == 0) {  // the expert's tile: after those of the lower experts
            int tile = 0;
            for (int q = 0; q < pairs; ++q) tile += first[q] && ex[q] < e;
            tiles[tile] = make_int4(e, below, same, 0);
        }
    }
    const int listed = __syncthreads_count(p < pairs && before == 0);
    if (threadIdx.x == 0) {
        *n_tiles = listed;
        *read += static_cast<unsigned long long>(listed);  // (one block, one thread)
    }
    for (int f = threadIdx.x; f < qwm::EXPERTS; f += VT_THREADS) {
        int c = 0;
        for (int q = 0; q < pairs; ++q) c += ex[q] == f;
        counts[f] = c;
    }
}

// gate/up: gu[its rows of the grouped order] = the gate/up rows . the normed x[token of the
// pair] (fp32).
extern "C" __global__ void __launch_bounds__(VT_THREADS, 2)
    moe_few_gate_up(const bf16_t* __restrict__ xg, const int* __restrict__ token,
                    const unsigned char* W, float* __restrict__ gu,
                    const int4* __restrict__ tiles, const int* __restrict__ n_tiles,
                    const float* __restrict__ sq, int parts, float eps) {
    dependent_start();
    if (static_cast<int>(blockIdx.y) >= *n_tiles) return;
    const int4 t = tiles[blockIdx.y];
    verify_product<qw::hidden, qw::wfmt, A_SCALED, false, 1>(
        xg, token + t.y, t.z, W + t.x * qwm::GATE_UP_BYTES, 2 * qwm::INTER,
        gu + static_cast<long long>(t.y) * 2 * qwm::INTER, PassNorm::scaled(sq, parts, eps));
}

// down: y[its rows of the grouped order] = the down rows . SwiGLU of gu's rows (bf16, for
// moe_combine).
extern "C" __global__ void __launch_bounds__(VT_THREADS, 2)
    moe_few_down(const float* __restrict__ gu, const unsigned char* W, bf16_t* __restrict__ y,
                 const int4* __restrict__ tiles, const int* __restrict__ n_tiles) {
    dependent_start();
    if (static_cast<int>(blockIdx.y) >= *n_tiles) return;
    const int4 t = tiles[blockIdx.y];
    verify_product<qwm::INTER, qw::wfmt, A_SWIGLU, false, 1, true>(
        gu + static_cast<long long>(t.y) * 2 * qwm::INTER, nullptr, t.z,
        W + t.x * qwm::DOWN_BYTES, qw::hidden, y + static_cast<long long>(t.y) * qw::hidden);
}

// Prefill: C = A . B^T with bf16 B in every weight format (the router's logits).
extern "C" __global__ void __launch_bounds__(THREADS)
    moe_router_gemm(const bf16_t* A, const bf16_t* B, float* C, int M, int N, int K) {
    gemm_bf16<STORE_F32, qw::BF16>(A, B, C, M, N, K, N, blockIdx.y * BM);
}

// Prefill: act[row] = bf16(silu(gate) * up) of gu[row] = [gate | up] (QW_MOE_INTER each).
extern "C" __global__ void moe_swiglu(const float* __restrict__ gu, int rows,
                                      bf16_t* __restrict__ act) {
    swiglu_rows_of<qwm::INTER>(gu, rows, act);
}

// Prefill: x[t][col0 + j] += sum over k (in order) of weights[t][k] x y[slot[t x TOPK + k]][j]
// for j < width (the grouped down products' bf16 rows of one part of the columns, width
// apart: moe.py's moe_down_parts), one block a token, eight columns a thread at a time. With
// `norm` set (a speculative pass's whole rows: col0 0, width hidden), also the next RMSNorm's
// input as verify.cuh's PassNorm has it: xg = bf16(x x norm's weights) and the token's sum of
// x^2 in sq[t] (one part).
extern "C" __global__ void moe_combine(const bf16_t* __restrict__ y, const int* __restrict__ slot,
                                       const float* __restrict__ weights, int tokens,
                                       float* __restrict__ x, int col0, int width,
                                       const bf16_t* __restrict__ norm, bf16_t* __restrict__ xg,
                                       float* __restrict__ sq) {
    dependent_start();
    __shared__ const bf16_t* rows[qwm::TOPK];
    __shared__ float w[qwm::TOPK];
    __shared__ float scratch[32];
    float squares = 0.f;
    const int t = blockIdx.x;
    if (t >= tokens) return;
    for (int k = threadIdx.x; k < qwm::TOPK; k += blockDim.x) {
        rows[k] = y + static_cast<long long>(slot[t * qwm::TOPK + k]) * width;
        w[k] = weights[t * qwm::TOPK + k];
    }
    __syncthreads();
    // (col0 and width are multiples of 8: the host checks)
    float4* out = reinterpret_cast<float4*>(x + static_cast<long long>(t) * qw::hidden + col0);
    for (int j = threadIdx.x; j < width / 8; j += blockDim.x) {
        float total[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
#pragma unroll
        for (int k = 0; k < qwm::TOPK; ++k) {  // (each column's sum in rank order, as before)
            const uint4 v = reinterpret_cast<const uint4*>(rows[k])[j];
            const unsigned words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                total[2 * i] += w[k] * bf16_lo(words[i]);
                total[2 * i + 1] += w[k] * bf16_hi(words[i]);
            }
        }
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            float4 o = out[2 * j + half];
            o.x += total[4 * half];
            o.y += total[4 * half + 1];
            o.z += total[4 * half + 2];
            o.w += total[4 * half + 3];
            out[2 * j + half] = o;
            if (norm != nullptr) {
                const int c = 8 * j + 4 * half;  // (col0 is 0)
                const uint2 g = *reinterpret_cast<const uint2*>(norm + c);
                *reinterpret_cast<uint2*>(xg + static_cast<long long>(t) * qw::hidden + c) =
                    make_uint2(pack_bf16x2(o.x * bf16_lo(g.x), o.y * bf16_hi(g.x)),
                               pack_bf16x2(o.z * bf16_lo(g.y), o.w * bf16_hi(g.y)));
                squares += o.x * o.x + o.y * o.y + o.z * o.z + o.w * o.w;
            }
        }
    }
    if (norm != nullptr) {
        squares = block_sum(squares, scratch);
        if (threadIdx.x == 0) sq[t] = squares;
    }
}
