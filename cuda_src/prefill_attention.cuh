// The prefill attention's body (flash attention on the tensor cores over the KV cache),
// shared by attention.cu's attn_prefill and attention_pass.cu's attn_pass_packed: two
// programs, so that a first answer's compiles do not wait for the pass's.
#pragma once
#include "common.cuh"
#include "kv8.cuh"
#include "qwen3.cuh"

namespace {
constexpr int HD = qw::head_dim;
constexpr float LOG2E = 1.4426950408889634f;
}  // namespace

// ---------------------------------------------------------------------------------------------
// Prefill. q: [n][heads][HD] bf16 for the n new tokens at positions start..start+n-1, whose keys
// and values are already in the cache. out: [n][heads][HD] bf16. With gridDim.z > 1 (splits of
// the keys, for n <= PF_Q), the block writes part_o [n][heads][splits][HD] (unnormalised) and
// part_ml [n][heads][splits][2] (running max in base 2, sum) instead of out.
//
// FlashAttention-2's shape: each warp keeps 16 query rows' Q fragments, output and softmax state
// in registers; key and value tiles stream through two shared-memory stages with cp.async (the
// next tile loads while this one is used); ldmatrix loads K as the B operand of Q.K^T and,
// transposed, V as the B operand of P.V, so V is stored as it is in the cache. Only the tile
// on the diagonal is masked; tiles past a block's last query are never loaded. Dynamic shared
// memory: two stages of a K and a V tile (prefill_attention_shared() in
// qwenchat/engine/cuda/prefill.py mirrors it).
namespace {
constexpr int PF_Q = 64;                     // queries per block (4 warps x 16 rows)
constexpr int PF_KV = HD <= 128 ? 64 : 32;   // keys per shared-memory tile
constexpr int PF_THREADS = 128;
constexpr int LDS = HD + 8;  // padded rows: ldmatrix's eight row addresses hit distinct banks
constexpr int PF_TILE = PF_KV * LDS;  // bf16 values of one K (or V) tile
static_assert(PF_KV % 16 == 0 && HD % 16 == 0, "whole mma tiles");

// Keys [j0, j0 + PF_KV) of K and V into stage `dst` (K tile, then V tile), zeros past k_end:
// bf16 rows by cp.async; int8 rows (kv8.cuh) loaded and turned into bf16 (code x scale,
// rounded) as they are stored, the row's scale at ks[key] / vs[key].
__device__ __forceinline__ void load_kv_tile(bf16_t* dst, const unsigned char* kc,
                                             const unsigned char* vc, const float* ks,
                                             const float* vs, int j0, int k_end) {
    constexpr int CHUNKS = PF_KV * HD / 8;  // pieces of 8 values of one tile
    for (int chunk = threadIdx.x; chunk < CHUNKS; chunk += PF_THREADS) {
        const int r = chunk / (HD / 8), c = (chunk % (HD / 8)) * 8;
        const int key = j0 + r;
        const bool in = key < k_end;
        const long long at = static_cast<long long>(in ? key : 0) * HD + c;
        if constexpr (qw::kv8) {
            const uint2 kw = in ? *reinterpret_cast<const uint2*>(kc + at) : make_uint2(0u, 0u);
            const uint2 vw = in ? *reinterpret_cast<const uint2*>(vc + at) : make_uint2(0u, 0u);
            const float ksc = in ? ks[key] : 0.f, vsc = in ? vs[key] : 0.f;
            float kf[8], vf[8];
            kv8_floats(kw, kf);
            kv8_floats(vw, vf);
            *reinterpret_cast<uint4*>(dst + r * LDS + c) =
                make_uint4(pack_bf16x2(kf[0] * ksc, kf[1] * ksc), pack_bf16x2(kf[2] * ksc, kf[3] * ksc),
                           pack_bf16x2(kf[4] * ksc, kf[5] * ksc), pack_bf16x2(kf[6] * ksc, kf[7] * ksc));
            *reinterpret_cast<uint4*>(dst + PF_TILE + r * LDS + c) =
                make_uint4(pack_bf16x2(vf[0] * vsc, vf[1] * vsc), pack_bf16x2(vf[2] * vsc, vf[3] * vsc),
                           pack_bf16x2(vf[4] * vsc, vf[5] * vsc), pack_bf16x2(vf[6] * vsc, vf[7] * vsc));
        } else {
            cp_async_16(dst + r * LDS + c, reinterpret_cast<const bf16_t*>(kc) + at, in ? 16 : 0);
            cp_async_16(dst + PF_TILE + r * LDS + c, reinterpret_cast<const bf16_t*>(vc) + at,
                        in ? 16 : 0);
        }
    }
}

// A kv head's rows in a layer's cache (bytes) and, for int8 rows, their scales.
constexpr int KV_BYTES = qw::kv8 ? 1 : 2;
struct KvHead {
    const unsigned char* k;
    const unsigned char* v;
    const float* ks;
    const float* vs;
};
__device__ __forceinline__ KvHead kv_head(const void* k_cache, const void* v_cache, int kvh,
                                          int capacity) {
    const long long row0 = static_cast<long long>(kvh) * capacity;
    KvHead h{static_cast<const unsigned char*>(k_cache) + row0 * HD * KV_BYTES,
             static_cast<const unsigned char*>(v_cache) + row0 * HD * KV_BYTES, nullptr, nullptr};
    if constexpr (qw::kv8) {
        h.ks = kv8_scales(k_cache, capacity) + row0;
        h.vs = kv8_scales(v_cache, capacity) + row0;
    }
    return h;
}
}  // namespace

// The prefill attention's body. PACK (a speculative pass, attn_pass_packed): the block serves
// a kv head (grid y) and its query rows are the n tokens' `group` heads, row r token
// r / group's head kvh x group + r % group (n x group <= PF_Q), so the block reads its keys once
// for all of them; without it, a query head (grid y) and PF_Q tokens a block.
template <bool PACK>
__device__ __forceinline__ void prefill_attention(
    const bf16_t* __restrict__ q, const void* __restrict__ k_cache,
    const void* __restrict__ v_cache, const int* __restrict__ start_at, int start_arg, int n,
    int capacity, float scale, bf16_t* __restrict__ out, float* __restrict__ part_o,
    float* __restrict__ part_ml) {
    // The first query's position: start_arg, or *start_at (a short prompt's graph, prefill.py)
    const int start = start_at ? *start_at : start_arg;
    extern __shared__ __align__(16) bf16_t kv_stages[];  // [2][K tile, V tile]
    const int head = PACK ? 0 : blockIdx.y, kvh = PACK ? blockIdx.y : head / qw::group;
    // Query row r's token and head.
    const int rows = PACK ? n * qw::group : n;
    const auto token_of = [&](int r) { return PACK ? r / qw::group : r; };
    const auto head_of = [&](int r) { return PACK ? kvh * qw::group + r % qw::group : head; };
    if (PACK && rows > PF_Q) __trap();  // (the host packs 8 rows of 8 heads at most)
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = lane >> 2, t = lane & 3;
    // The last query tiles have the most keys: they go first, so none is left alone at the end.
    const int q_tile = gridDim.x - 1 - blockIdx.x;
    const int q_row0 = q_tile * PF_Q + warp * 16;  // this warp's first query (0-based in n)
    const KvHead kv = kv_head(k_cache, v_cache, kvh, capacity);

    const int block_last_query = token_of(min(rows, (q_tile + 1) * PF_Q) - 1);
    const int kv_len = start + block_last_query + 1;
    const int splits = gridDim.z, split = blockIdx.z;
    const int tiles_per_split = ((kv_len + PF_KV - 1) / PF_KV + splits - 1) / splits;
    const int k_begin = split * tiles_per_split * PF_KV;
    const int k_end = min(kv_len, k_begin + tiles_per_split * PF_KV);
    if (k_begin < k_end) load_kv_tile(kv_stages, kv.k, kv.v, kv.ks, kv.vs, k_begin, k_end);
    cp_async_commit();

    // Q fragments stay in registers for the whole key loop.
    unsigned qa[HD / 16][4];
#pragma unroll
    for (int ks = 0; ks < HD / 16; ++ks) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int r = q_row0 + g + (e & 1) * 8;
            const int c = ks * 16 + t * 2 + (e >> 1) * 8;
            qa[ks][e] = r < rows ? ld_u32(q + (static_cast<long long>(token_of(r)) * qw::heads +
                                               head_of(r)) * HD + c)
                                 : 0u;
        }
    }

    float o[HD / 8][4];
#pragma unroll
    for (int d = 0; d < HD / 8; ++d)
#pragma unroll
        for (int e = 0; e < 4; ++e) o[d][e] = 0.f;
    float m_row[2] = {QW_NEG_INF, QW_NEG_INF}, l_row[2] = {0.f, 0.f};
    const float qk_scale = scale * LOG2E;  // softmax in base 2
    const int pos_row[2] = {PACK ? start + token_of(q_row0 + g) : start + q_row0 + g,
                            PACK ? start + token_of(q_row0 + g + 8) : start + q_row0 + g + 8};
    // ldmatrix row addresses: lane l gives row l % 8 of matrix l / 8.
    const int mrow = lane & 7, mat = lane >> 3;

    for (int j0 = k_begin, stage = 0; j0 < k_end; j0 += PF_KV, stage ^= 1) {
        const bf16_t* Ks = kv_stages + stage * 2 * PF_TILE;
        const bf16_t* Vs = Ks + PF_TILE;
        if (j0 + PF_KV < k_end)  // the next tile into the other stage (free since the last
            load_kv_tile(kv_stages + (stage ^ 1) * 2 * PF_TILE, kv.k, kv.v, kv.ks, kv.vs,
                         j0 + PF_KV, k_end);
        cp_async_commit();  // (an empty group at the end keeps the count right)
        cp_async_wait<1>();  // this tile's copies have landed (each thread its own)
        __syncthreads();     // ... and every thread's

        // S = Q K^T: matrices (keys 8j..8j+7) x (dims 16ks + 0..7 | 8..15 | 16.. | 24..).
        float s[PF_KV / 8][4];
#pragma unroll
        for (int j = 0; j < PF_KV / 8; ++j) {
#pragma unroll
            for (int e = 0; e < 4; ++e) s[j][e] = 0.f;
#pragma unroll
            for (int ks = 0; ks < HD / 16; ks += 2) {
                unsigned b[4];
                // (head_dim 16: one k-step; the x4 load's last two matrices are not used)
                ldmatrix_x4(b, Ks + (j * 8 + mrow) * LDS + (ks * 16 + mat * 8) % HD);
                mma_bf16_16816(s[j], qa[ks], b);
                if (ks + 1 < HD / 16) mma_bf16_16816(s[j], qa[ks + 1], b + 2);
            }
        }

        // Mask (causal; only a tile that reaches past this warp's first query), then the online
        // softmax update of each of this thread's two rows.
        const bool diagonal = j0 + PF_KV - 1 > (PACK ? start + token_of(q_row0) : start + q_row0);
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            float mx = QW_NEG_INF;
#pragma unroll
            for (int j = 0; j < PF_KV / 8; ++j) {
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int key = j0 + j * 8 + t * 2 + e;
                    float v = s[j][half * 2 + e] * qk_scale;
                    if (diagonal && key > pos_row[half]) v = QW_NEG_INF;
                    s[j][half * 2 + e] = v;
                    mx = fmaxf(mx, v);
                }
            }
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
            const float m_new = fmaxf(m_row[half], mx);
            // A row whose keys are all masked so far keeps m = -inf; use 0 to avoid inf - inf.
            const float m_use = m_new == QW_NEG_INF ? 0.f : m_new;
            const float alpha = exp2f(m_row[half] - m_use);
            float sum = 0.f;
#pragma unroll
            for (int j = 0; j < PF_KV / 8; ++j) {
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const float p = exp2f(s[j][half * 2 + e] - m_use);
                    s[j][half * 2 + e] = p;
                    sum += p;
                }
            }
            l_row[half] = l_row[half] * alpha + sum;
            m_row[half] = m_new;
#pragma unroll
            for (int d = 0; d < HD / 8; ++d) {
                o[d][half * 2] *= alpha;
                o[d][half * 2 + 1] *= alpha;
            }
        }

        // O += P V, reusing the score accumulators as A fragments (C layout == A layout); V's
        // fragments by transposed ldmatrix: matrices (keys 16kk + 0..7 | 8..15) x (dims 8d..,
        // 8d + 8..), so b[0..1] serve dims 8d and b[2..3] dims 8d + 8.
#pragma unroll
        for (int kk = 0; kk < PF_KV / 16; ++kk) {
            unsigned pa[4];
            pa[0] = pack_bf16x2(s[2 * kk][0], s[2 * kk][1]);
            pa[1] = pack_bf16x2(s[2 * kk][2], s[2 * kk][3]);
            pa[2] = pack_bf16x2(s[2 * kk + 1][0], s[2 * kk + 1][1]);
            pa[3] = pack_bf16x2(s[2 * kk + 1][2], s[2 * kk + 1][3]);
#pragma unroll
            for (int d = 0; d < HD / 8; d += 2) {
                unsigned b[4];
                const int key = kk * 16 + (mat & 1) * 8 + mrow;
                ldmatrix_x4_trans(b, Vs + key * LDS + (d + (mat >> 1)) * 8);
                mma_bf16_16816(o[d], pa, b);
                mma_bf16_16816(o[d + 1], pa, b + 2);
            }
        }
        __syncthreads();  // every warp is done with this stage before it is loaded again
    }
    cp_async_wait<0>();

#pragma unroll
    for (int half = 0; half < 2; ++half) {
        float l = l_row[half];
        l += __shfl_xor_sync(0xffffffffu, l, 1);
        l += __shfl_xor_sync(0xffffffffu, l, 2);
        const int r = q_row0 + g + half * 8;
        if (r >= rows) continue;
        if (splits > 1) {  // this split's share, merged by attn_prefill_merge
            const long long at =
                (static_cast<long long>(token_of(r)) * qw::heads + head_of(r)) * splits + split;
            float* dst = part_o + at * HD;
#pragma unroll
            for (int d = 0; d < HD / 8; ++d)
                *reinterpret_cast<float2*>(dst + d * 8 + t * 2) =
                    make_float2(o[d][half * 2], o[d][half * 2 + 1]);
            if (t == 0) {
                part_ml[at * 2] = l > 0.f ? m_row[half] : QW_NEG_INF;
                part_ml[at * 2 + 1] = l;
            }
            continue;
        }
        const float inv = 1.f / l;
        bf16_t* dst = out + (static_cast<long long>(token_of(r)) * qw::heads + head_of(r)) * HD;
#pragma unroll
        for (int d = 0; d < HD / 8; ++d) {
            *reinterpret_cast<unsigned*>(dst + d * 8 + t * 2) =
                pack_bf16x2(o[d][half * 2] * inv, o[d][half * 2 + 1] * inv);
        }
    }
}

