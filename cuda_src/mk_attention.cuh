// Attention: QK-norm, RoPE and the key/value append for the new position, flash-decoding
// over each block's chunks, and the merge of a kv head's chunks.
#pragma once
#include "mk_matvec.cuh"

namespace {
using namespace mk;

struct AttnShared {
    float q[qw::group][HD];
    float k_new[HD];
    float v_new[HD];
    float wm[WARPS][qw::group], wl[WARPS][qw::group];  // each warp's running max and sum
    float gm[qw::group], gl[qw::group];                // the chunk's max and sum
    float merge_w[qw::group][MAX_SPLITS];  // a chunk's weight in the merge
    float merge_l[qw::group];
    float kv_scale[2];  // (int8 cache) the new key's and value's row scales
    int last;
};

// A float that another block may have written during this launch, from the coherent L2 copy.
__device__ __forceinline__ float ld_strong_f32(const float* p) {
    float v;
    asm volatile("ld.relaxed.gpu.global.f32 %0, [%1];" : "=f"(v) : "l"(p) : "memory");
    return v;
}

// RMSNorm over head_dim with weight w, then rotate-half RoPE at pos; one warp.
__device__ __forceinline__ void norm_rope_warp(const tagged_t* src, unsigned tag, const bf16_t* w,
                                               const float* inv_freq, int pos, float eps,
                                               float* dst) {
    constexpr int PER = (HD / 2 + 31) / 32;
    const int lane = threadIdx.x & 31;
    const tagged_t* at[2 * PER];
#pragma unroll
    for (int j = 0; j < PER; ++j) {
        const int i = min(lane + 32 * j, HD / 2 - 1);  // (lanes past HD / 2 load and drop)
        at[2 * j] = src + i;
        at[2 * j + 1] = src + i + HD / 2;
    }
    float got[2 * PER], x0[PER], x1[PER], ss = 0.f;
    take_all(at, tag, got);
#pragma unroll
    for (int j = 0; j < PER; ++j) {
        const bool in = lane + 32 * j < HD / 2;
        x0[j] = in ? got[2 * j] : 0.f;
        x1[j] = in ? got[2 * j + 1] : 0.f;
        ss += x0[j] * x0[j] + x1[j] * x1[j];
    }
    const float rstd = rsqrtf(warp_sum(ss) / HD + eps);
#pragma unroll
    for (int j = 0; j < PER; ++j) {
        const int i = lane + 32 * j;
        if (i < HD / 2) {
            const float a0 = x0[j] * rstd * bf16_to_f32(w[i]);
            const float a1 = x1[j] * rstd * bf16_to_f32(w[i + HD / 2]);
            float s, c;
            sincosf(static_cast<float>(pos) * inv_freq[i], &s, &c);
            dst[i] = a0 * c - a1 * s;
            dst[i + HD / 2] = a1 * c + a0 * s;
        }
    }
}

// The last block to finish a kv head's chunks merges them into attn (its group's heads). The
// counters only grow during a launch: this layer's chunks are the ones after merge_base.
// The barrier before thread 0's release orders every thread's partials before it (release is
// cumulative), and the barrier after its acquire orders it before every thread's loads of the
// other chunks' partials (one acq_rel atomic: measured 2-4% faster at 128-2K positions on 0.6B
// than every thread's sequentially consistent __threadfence around a relaxed atomicAdd).
__device__ void merge_if_last(const MegaArgs& a, int kvh, int splits, unsigned merge_base,
                              unsigned tag, AttnShared& sh) {
    __syncthreads();
    if (threadIdx.x == 0) {
        unsigned before;
        asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], 1;"
                     : "=r"(before) : "l"(&a.merge_count[kvh]) : "memory");
        sh.last = before + 1u == merge_base + splits;
    }
    __syncthreads();
    if (!sh.last) return;
    // Every chunk's (max, sum) at once, then each output's chunks eight loads at a time.
    if (threadIdx.x < qw::group * 32) {
        const int gh = threadIdx.x / 32, lane = threadIdx.x % 32;
        const int head = kvh * qw::group + gh;
        float m[MAX_SPLITS / 32], l[MAX_SPLITS / 32], mx = QW_NEG_INF;
#pragma unroll
        for (int j = 0; j < MAX_SPLITS / 32; ++j) {
            const int sp = lane + 32 * j;
            m[j] = sp < splits ? ld_cg(a.part_ml + (head * a.splits + sp) * 2) : QW_NEG_INF;
            l[j] = sp < splits ? ld_cg(a.part_ml + (head * a.splits + sp) * 2 + 1) : 0.f;
            mx = fmaxf(mx, m[j]);
        }
        mx = warp_max(mx);
        float total = 0.f;
#pragma unroll
        for (int j = 0; j < MAX_SPLITS / 32; ++j) {
            const float w = lane + 32 * j < splits ? __expf(m[j] - mx) : 0.f;
            if (lane + 32 * j < splits) sh.merge_w[gh][lane + 32 * j] = w;
            total += w * l[j];
        }
        total = warp_sum(total);
        if (lane == 0) sh.merge_l[gh] = total;
    }
    __syncthreads();
    for (int i = threadIdx.x; i < qw::group * HD; i += THREADS) {
        const int gh = i / HD, head = kvh * qw::group + gh, d = i % HD;
        const float* po = a.part_o + static_cast<long long>(head) * a.splits * HD + d;
        float acc = 0.f;
        for (int s0 = 0; s0 < splits; s0 += 8) {
            float v[8];
#pragma unroll
            for (int j = 0; j < 8; ++j) v[j] = s0 + j < splits ? ld_cg(po + (s0 + j) * HD) : 0.f;
#pragma unroll
            for (int j = 0; j < 8; ++j)
                if (s0 + j < splits) acc += sh.merge_w[gh][s0 + j] * v[j];
        }
        put(a.attn + head * HD + d, acc / sh.merge_l[gh], tag);
    }
}

// Keys on the tensor cores (mma m16n8k16, bf16 in, fp32 out), up to 8 keys of a warp at a
// time, for both cache formats (TC_ATTN). Lane (g, t) = (lane / 4, lane % 4).
//  - Scores, S (keys x heads) = K . q^T: the A rows are the 8 keys (rows 8-15 zero, and rows
//    past the group's `rows` valid keys too), the B columns the group's query heads (zero past
//    G). The 16 "columns" of k-step s are the head dimensions KQ t' + 4s + (0..3) of the lanes
//    t' (KQ = HD / 4): a permutation of the dot product's terms, so that a lane reads its key's
//    row KQ contiguous dimensions at a time. int8 codes and bf16 keys are exact in bf16; q goes
//    in as two bf16 parts (hi + lo: the product keeps ~16 bits), and an int8 key's scale
//    multiplies the fp32 score. Lane (g, t) gets key g's scores of heads 2t, 2t + 1.
//  - P . V: out^T (dims x heads) = V^T . P'^T, with P' = p (x an int8 value row's scale), hi +
//    lo again. The A rows are 16 dimensions (another permutation: the lane's four dimensions
//    32c + 4g + (0..3) of keys 2t and 2t + 1 make rows g and g + 8 of m-tiles 2c and 2c + 1),
//    the K columns the keys (8-15 zero), the B columns heads. Lane (g, t) accumulates
//    dimensions tc_dim(i, g) and tc_dim(i, g + 8) of m-tile i for heads 2t and 2t + 1.
constexpr int KQ = HD / 4;
__device__ __forceinline__ int tc_dim(int tile, int row) {
    return 32 * (tile >> 1) + 4 * (row & 7) + 2 * (tile & 1) + (row >> 3);
}

__device__ __forceinline__ void split_bf16x2(float a, float b, unsigned& hi, unsigned& lo) {
    hi = pack_bf16x2(a, b);
    lo = pack_bf16x2(a - bf16_lo(hi), b - bf16_hi(hi));
}

// The B fragments of the query heads for the scores, into frag[s * 32 + lane] (lane (g, t):
// head g) for k-step s: {hi b0, hi b1, lo b0, lo b1}. One warp writes them for the block.
__device__ __forceinline__ void tc_query(const float (*q)[HD], uint4* frag) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int s = 0; s < HD / 16; ++s) {
        float v[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) v[e] = g < qw::group ? q[g][KQ * t + 4 * s + e] : 0.f;
        uint4 f;
        split_bf16x2(v[0], v[1], f.x, f.z);
        split_bf16x2(v[2], v[3], f.y, f.w);
        frag[s * 32 + lane] = f;
    }
}

// The A fragment words of key g's scores, k-step s: {dims +0, +1; dims +2, +3} as bf16 pairs.
template <bool INT8>
struct KeyWords {
    unsigned w[INT8 ? HD / 16 : HD / 8];
    __device__ __forceinline__ void load(const unsigned char* row, int t, bool valid) {
        constexpr int N = sizeof(w) / 16;  // 16-byte pieces of the lane's KQ dimensions
        const uint4* src = reinterpret_cast<const uint4*>(row + KQ * t * (INT8 ? 1 : 2));
#pragma unroll
        for (int i = 0; i < N; ++i) {
            const uint4 v = valid ? src[i] : make_uint4(0u, 0u, 0u, 0u);
            w[4 * i] = v.x, w[4 * i + 1] = v.y, w[4 * i + 2] = v.z, w[4 * i + 3] = v.w;
        }
    }
    __device__ __forceinline__ void step(int s, unsigned& lo, unsigned& hi) const {
        if constexpr (INT8) {
            float f[4];
            kv8x4_floats(w[s], f);
            lo = pack_bf16x2(f[0], f[1]);
            hi = pack_bf16x2(f[2], f[3]);
        } else {
            lo = w[2 * s];
            hi = w[2 * s + 1];
        }
    }
};

// The A fragments of P . V for m-tiles 2c, 2c + 1: the lane's dims 32c + 4g + (0..3) of keys
// 2t and 2t + 1 (zero for keys past `rows`: a stage's stale bytes need not be finite bf16;
// an int8 code always is, and weighs nothing there).
template <bool INT8>
__device__ __forceinline__ void value_words(const unsigned char* vt, int first, int rows, int c,
                                            unsigned (&a0)[4], unsigned (&a1)[4]) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int dim = 32 * c + 4 * g;
    if constexpr (INT8) {
        const unsigned va = *reinterpret_cast<const unsigned*>(vt + (first + 2 * t) * HD + dim);
        const unsigned vb = *reinterpret_cast<const unsigned*>(vt + (first + 2 * t + 1) * HD + dim);
        float lo4[4], hi4[4];
        kv8x4_floats(__byte_perm(va, vb, 0x5140), lo4);  // dims +0, +1: (key 2t, key 2t + 1)
        kv8x4_floats(__byte_perm(va, vb, 0x7362), hi4);  // dims +2, +3
        a0[0] = pack_bf16x2(lo4[0], lo4[1]), a0[1] = pack_bf16x2(lo4[2], lo4[3]);
        a1[0] = pack_bf16x2(hi4[0], hi4[1]), a1[1] = pack_bf16x2(hi4[2], hi4[3]);
    } else {
        const uint2 zero = make_uint2(0u, 0u);
        const uint2 va = 2 * t < rows
            ? *reinterpret_cast<const uint2*>(vt + ((first + 2 * t) * HD + dim) * 2) : zero;
        const uint2 vb = 2 * t + 1 < rows
            ? *reinterpret_cast<const uint2*>(vt + ((first + 2 * t + 1) * HD + dim) * 2) : zero;
        a0[0] = __byte_perm(va.x, vb.x, 0x5410), a0[1] = __byte_perm(va.x, vb.x, 0x7632);
        a1[0] = __byte_perm(va.y, vb.y, 0x5410), a1[1] = __byte_perm(va.y, vb.y, 0x7632);
    }
    a0[2] = a0[3] = a1[2] = a1[3] = 0u;  // keys 8-15
}

// `rows` (1..8) keys of a stage from row `first`: the online softmax of heads 2t, 2t + 1 (m:
// equal across g; l: this lane's key's share) and their outputs. k_scale / v_scale: key g's
// row scales (int8), ignored for bf16.
template <bool INT8>
__device__ __forceinline__ void tc_keys(const unsigned char* kt, const unsigned char* vt,
                                        int first, int rows, float k_scale, float v_scale,
                                        float scale, const uint4* q, float (&m)[2], float (&l)[2],
                                        float (&acc)[HD / 16][4]) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const bool valid = g < rows;
    KeyWords<INT8> kw;
    kw.load(kt + (first + g) * HD * (INT8 ? 1 : 2), t, valid || INT8);
    float c[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int s = 0; s < HD / 16; ++s) {
        unsigned a[4] = {0u, 0u, 0u, 0u};
        kw.step(s, a[0], a[2]);
        const uint4 qs = q[s * 32 + lane];
        const unsigned hi[2] = {qs.x, qs.y}, lo[2] = {qs.z, qs.w};
        mma_bf16_16816(c, a, hi);
        mma_bf16_16816(c, a, lo);
    }
    // The online softmax of heads 2t and 2t + 1 over the keys (lanes g)
    float p[2];
#pragma unroll
    for (int e = 0; e < 2; ++e) {
        const float sc = valid ? c[e] * (INT8 ? k_scale * scale : scale) : QW_NEG_INF;
        float mx = sc;
#pragma unroll
        for (int o = 4; o < 32; o <<= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
        const float m_new = fmaxf(m[e], mx);  // finite: key 0 of the group exists
        const float alpha = __expf(m[e] - m_new);
        p[e] = valid ? __expf(sc - m_new) : 0.f;
        l[e] = l[e] * alpha + p[e];
        m[e] = m_new;
#pragma unroll
        for (int i = 0; i < HD / 16; ++i) {
            acc[i][e] *= alpha;
            acc[i][e + 2] *= alpha;
        }
    }
    // P'^T as B: lane (g, t) needs head g's weights of keys 2t and 2t + 1, which lanes
    // (2t, g / 2) and (2t + 1, g / 2) hold as element g % 2.
    const float w0 = INT8 ? p[0] * v_scale : p[0], w1 = INT8 ? p[1] * v_scale : p[1];
    float pk[2];
#pragma unroll
    for (int j = 0; j < 2; ++j) {
        const int src = (2 * t + j) * 4 + g / 2;
        const float a0 = __shfl_sync(0xffffffffu, w0, src), a1 = __shfl_sync(0xffffffffu, w1, src);
        pk[j] = g & 1 ? a1 : a0;
    }
    unsigned b[4];  // {hi, 0, lo, 0}: keys 8-15 are zero
    split_bf16x2(pk[0], pk[1], b[0], b[2]);
    b[1] = b[3] = 0u;
#pragma unroll
    for (int cq = 0; cq < HD / 32; ++cq) {
        unsigned a0[4], a1[4];
        value_words<INT8>(vt, first, rows, cq, a0, a1);
        mma_bf16_16816(acc[2 * cq], a0, b);
        mma_bf16_16816(acc[2 * cq], a0, b + 2);
        mma_bf16_16816(acc[2 * cq + 1], a1, b);
        mma_bf16_16816(acc[2 * cq + 1], a1, b + 2);
    }
}

// This block's flash-decoding items at position pos (the cache then holds len = pos + 1 keys,
// the last one computed here by the block whose chunk holds it).
// Its inputs are tagged `tag`, its outputs `tag + 1`.
//
// Within a stage of KEYS keys every consumer warp takes its own KPW keys and keeps its own
// online softmax (max, sum, and the lane's DPL output dimensions of each query head of the
// group) in registers, and releases the stage when its own keys are done (no block barrier);
// the producer warp refills it. At the end of the chunk the warps' states are merged in a
// fixed order through shared memory (the producer's: empty).
// The timeline's probe points (QW_TL_AT; tests/step_timeline.py --define QW_MK_TL_AT=K): 0
// the first stage of keys ready, 1 the new key and value appended, 2 the warp's keys done, 3
// after the fence that publishes the new row, 4 the warps' maxima and sums shared, 5 the
// outputs summed over the warps, 6 the outputs written.
__device__ __noinline__ void attention_phase(const MegaArgs& a, unsigned& consumed,
                                             const MegaLayer& L, int pos, const AttnGeom& g,
                                             unsigned tag, unsigned merge_base,
                                             AttnShared& sh) {
    constexpr int G = qw::group;
    QW_TL_ENTER(mk_timeline::ATTENTION);
    const int len = pos + 1;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int part = lane % LPK, slot = lane / LPK;
    float* comb = vec_buf();  // [COMB_SLOTS][G][HD]: the warps' scaled partial outputs
    // (QW_MK_DEFER) the producer's refill after the block's last stage of keys waits until
    // this phase's outputs are written: the merges' block barriers would otherwise wait for
    // it (issuing a stage takes the producer ~1 µs), and the outputs are what o_proj waits for.
    bool deferred = false;
    if (warp == PRODUCER) pipe_settle(a, consumed);  // (QW_MK_OWE: the QKV phase's last refill)
    for (int item = blockIdx.x; item < qw::kv_heads * g.splits; item += gridDim.x) {
        const int kvh = item / g.splits, split = item % g.splits;
        const bool last_item = item + static_cast<int>(gridDim.x) >= qw::kv_heads * g.splits;
        const bool first_item = item == static_cast<int>(blockIdx.x);
        (void)first_item;
        const int k_begin = chunk_begin(g, split), keys = item_keys(g, len, item);
        const bool has_new = k_begin <= pos && pos < k_begin + keys;
        if (warp < G) {
            norm_rope_warp(a.qkv + (kvh * G + warp) * HD, tag, L.q_norm, a.inv_freq, pos, a.eps,
                           sh.q[warp]);
        } else if (has_new && warp == G) {
            norm_rope_warp(a.qkv + qw::q_size + kvh * HD, tag, L.k_norm, a.inv_freq, pos, a.eps,
                           sh.k_new);
        } else if (has_new && warp == G + 1) {
            const tagged_t* at[HD / 32];
            float got[HD / 32];
#pragma unroll
            for (int j = 0; j < HD / 32; ++j)
                at[j] = a.qkv + qw::q_size + qw::kv_size + kvh * HD + lane + 32 * j;
            take_all(at, tag, got);
#pragma unroll
            for (int j = 0; j < HD / 32; ++j) sh.v_new[lane + 32 * j] = got[j];
        }
        __syncthreads();
        QW_TL_MARK_IF(first_item, INPUT);
        if constexpr (qw::kv8) {  // the new rows' scales (warp 0: the key's, warp 1: the value's)
            if (has_new && warp < 2) {
                const float* r = warp == 0 ? sh.k_new : sh.v_new;
                float mx = 0.f;
                for (int d = lane; d < HD; d += 32) mx = fmaxf(mx, fabsf(r[d]));
                mx = warp_max(mx);
                if (lane == 0) sh.kv_scale[warp] = __fdiv_rn(mx, 127.f);
            }
        }
        if constexpr (TC_ATTN) {
            if (warp == 2) tc_query(sh.q, reinterpret_cast<uint4*>(comb));
            __syncthreads();
        }
        if (has_new && threadIdx.x < HD) {  // the new key and value join the cache
            const long long row = static_cast<long long>(kvh) * a.capacity + pos;
            const long long at = row * HD + threadIdx.x;
            if constexpr (qw::kv8) {
                static_cast<signed char*>(L.k_cache)[at] =
                    static_cast<signed char>(kv8_code(sh.k_new[threadIdx.x], sh.kv_scale[0]));
                static_cast<signed char*>(L.v_cache)[at] =
                    static_cast<signed char>(kv8_code(sh.v_new[threadIdx.x], sh.kv_scale[1]));
                if (threadIdx.x == 0) {
                    const_cast<float*>(kv8_scales(L.k_cache, a.capacity))[row] = sh.kv_scale[0];
                    const_cast<float*>(kv8_scales(L.v_cache, a.capacity))[row] = sh.kv_scale[1];
                }
            } else {
                static_cast<bf16_t*>(L.k_cache)[at] = f32_to_bf16(sh.k_new[threadIdx.x]);
                static_cast<bf16_t*>(L.v_cache)[at] = f32_to_bf16(sh.v_new[threadIdx.x]);
            }
        }
        // (int8 cache) the scales of this warp's keys of a stage: lane i < KPW holds its key
        // i's key scale, lane KPW + i its value scale, by strong loads (a scale's line is
        // written a row a step, so a bulk copy of it could be stale: kv_cache.md), issued a
        // stage ahead so that their latency hides behind the stage before. The new row's
        // scales come from shared memory.
        const auto stage_scale = [&](int k0) {
            float scale = 0.f;
            if constexpr (qw::kv8) {
                static_assert(2 * KPW <= 32, "a warp's keys' scales in its lanes");
                const int key = k0 + warp * KPW + lane % KPW;  // in the item
                const bool value = lane >= KPW;
                if (warp != PRODUCER && lane < 2 * KPW && key < keys) {
                    const long long row = static_cast<long long>(kvh) * a.capacity + k_begin + key;
                    scale = k_begin + key == pos
                        ? sh.kv_scale[value]
                        : ld_strong_f32(kv8_scales(value ? L.v_cache : L.k_cache, a.capacity) + row);
                }
            }
            return scale;
        };
        QW_TL_AT(first_item, 1);
        float next_scale = stage_scale(0);
        float m[G], l[G], acc[G][DPL];  // (bf16 cache) lane's dims of every head
#pragma unroll
        for (int h = 0; h < G; ++h) {
            m[h] = QW_NEG_INF;
            l[h] = 0.f;
#pragma unroll
            for (int d = 0; d < DPL; ++d) acc[h][d] = 0.f;
        }
        // (TC_ATTN) heads 2t, 2t + 1 on the tensor cores: tc_keys
        // (the query's fragments: in vec_buf until the warps' outputs take it over)
        float m8[2] = {QW_NEG_INF, QW_NEG_INF}, l8[2] = {0.f, 0.f}, acc8[HD / 16][4];
        const uint4* q8 = reinterpret_cast<const uint4*>(comb);
        if constexpr (TC_ATTN) {
#pragma unroll
            for (int i = 0; i < HD / 16; ++i)
#pragma unroll
                for (int e = 0; e < 4; ++e) acc8[i][e] = 0.f;
        }
        for (int k0 = 0; k0 < keys; k0 += KEYS) {
            const int n = min(KEYS, keys - k0);
            const int new_row = pos - (k_begin + k0);
            const bool patch = has_new && new_row >= 0 && new_row < n;
            const unsigned char* stage = nullptr;
            if (warp != PRODUCER) {
                stage = pipe_wait(consumed);
                QW_TL_AT(first_item && k0 == 0, 0);
                if (patch && threadIdx.x < HD) {  // the copy predates the new key
                    unsigned char* st = const_cast<unsigned char*>(stage);
                    if constexpr (qw::kv8) {
                        reinterpret_cast<signed char*>(st)[new_row * HD + threadIdx.x] =
                            static_cast<signed char>(kv8_code(sh.k_new[threadIdx.x], sh.kv_scale[0]));
                        reinterpret_cast<signed char*>(st + KEYS * HD)[new_row * HD + threadIdx.x] =
                            static_cast<signed char>(kv8_code(sh.v_new[threadIdx.x], sh.kv_scale[1]));
                    } else {
                        reinterpret_cast<bf16_t*>(st)[new_row * HD + threadIdx.x] =
                            f32_to_bf16(sh.k_new[threadIdx.x]);
                        reinterpret_cast<bf16_t*>(st + KEYS * KV_ROW)[new_row * HD + threadIdx.x] =
                            f32_to_bf16(sh.v_new[threadIdx.x]);
                    }
                }
            }
            const bf16_t* kt = reinterpret_cast<const bf16_t*>(stage);
            if (patch) __syncthreads();  // (every warp, the producer too, at this one barrier)
            if (warp == PRODUCER) {  // refills the stage once the consumers release it
                if (QW_MK_DEFER && last_item && k0 + KEYS >= keys) deferred = true;
                else pipe_produce(a, consumed);
                continue;
            }
            if constexpr (TC_ATTN) {
                // (int8) this stage's scales, and the next stage's on their way
                const float scale_reg = next_scale;
                if (qw::kv8 && k0 + KEYS < keys) next_scale = stage_scale(k0 + KEYS);
#pragma unroll
                for (int j = 0; j < (KPW + 7) / 8; ++j) {
                    const int first = warp * KPW + 8 * j;
                    const int rows = min(min(8, KPW - 8 * j), n - first);
                    if (rows <= 0) break;  // (warp-uniform)
                    const int g = lane >> 2;
                    const float k_scale =
                        qw::kv8 ? __shfl_sync(0xffffffffu, scale_reg, 8 * j + g) : 1.f;
                    const float v_scale =
                        qw::kv8 ? __shfl_sync(0xffffffffu, scale_reg, KPW + 8 * j + g) : 1.f;
                    tc_keys<qw::kv8>(stage, stage + KEYS * KV_ROW, first, rows, k_scale, v_scale,
                                     a.scale, q8, m8, l8, acc8);
                }
                pipe_release(consumed);
                continue;
            }
            const bf16_t* vt = kt + KEYS * HD;
#pragma unroll
            for (int p0 = 0; p0 < KPW; p0 += KPASS) {
                const int first = warp * KPW + p0;  // the pass's first key in the stage
                if (first >= n) break;              // (warp-uniform)
                // Scores: LPK lanes a key, DPK dimensions a lane (16-byte pieces, interleaved).
                const int kk = first + slot;
                const bool scored = slot < KPASS && kk < n;
                float s[G];
#pragma unroll
                for (int h = 0; h < G; ++h) s[h] = 0.f;
                if (scored) {
#pragma unroll
                    for (int c = 0; c < DPK / 8; ++c) {
                        const int piece = c * LPK + part;
                        const uint4 kv = reinterpret_cast<const uint4*>(kt + kk * HD)[piece];
#pragma unroll
                        for (int h = 0; h < G; ++h) s[h] += dot8(kv, &sh.q[h][piece * 8]);
                    }
                }
#pragma unroll
                for (int h = 0; h < G; ++h) {
#pragma unroll
                    for (int o = LPK / 2; o > 0; o >>= 1) s[h] += __shfl_xor_sync(0xffffffffu, s[h], o);
                    s[h] = scored ? s[h] * a.scale : QW_NEG_INF;
                }
                // The pass's values: this lane's DPL dimensions of each of its KPASS keys.
                float v[KPASS][DPL];
#pragma unroll
                for (int j = 0; j < KPASS; ++j) {
                    const bf16_t* row = vt + (first + j) * HD + lane * DPL;
                    if (first + j < n && DPL % 2 == 0) {
#pragma unroll
                        for (int d = 0; d + 1 < DPL; d += 2) {
                            const unsigned pair = *reinterpret_cast<const unsigned*>(row + d);
                            v[j][d] = bf16_lo(pair);
                            v[j][d + 1] = bf16_hi(pair);
                        }
                    } else if (first + j < n) {
#pragma unroll
                        for (int d = 0; d < DPL; ++d) v[j][d] = bf16_to_f32(row[d]);
                    } else {
#pragma unroll
                        for (int d = 0; d < DPL; ++d) v[j][d] = 0.f;
                    }
                }
                // Online softmax per query head over the pass's keys.
#pragma unroll
                for (int h = 0; h < G; ++h) {
                    float sc[KPASS], mt = QW_NEG_INF;
#pragma unroll
                    for (int j = 0; j < KPASS; ++j) {
                        sc[j] = __shfl_sync(0xffffffffu, s[h], j * LPK);
                        mt = fmaxf(mt, sc[j]);
                    }
                    const float m_new = fmaxf(m[h], mt);  // finite: the pass's first key exists
                    const float alpha = __expf(m[h] - m_new);
                    float sum = 0.f;
#pragma unroll
                    for (int d = 0; d < DPL; ++d) acc[h][d] *= alpha;
#pragma unroll
                    for (int j = 0; j < KPASS; ++j) {
                        const float pj = __expf(sc[j] - m_new);
                        sum += pj;
#pragma unroll
                        for (int d = 0; d < DPL; ++d) acc[h][d] += pj * v[j][d];
                    }
                    l[h] = l[h] * alpha + sum;
                    m[h] = m_new;
                }
            }
            pipe_release(consumed);  // (this warp's keys: no block barrier)
        }
        // The new key and value are visible to the next steps' copies (on other SMs) before
        // anything this item publishes (split heads: merge_if_last's release after the block
        // barrier orders them, as it does the partials).
        QW_TL_AT(first_item, 2);
        if (has_new && g.splits == 1 && threadIdx.x < HD) __threadfence();
        QW_TL_AT(first_item, 3);
        // Merge the warps: the chunk's max and sum, then each warp's outputs scaled to it.
        if constexpr (TC_ATTN) {  // lanes g hold a key's share of l each
            const int g = lane >> 2, t = lane & 3;
#pragma unroll
            for (int e = 0; e < 2; ++e) {
#pragma unroll
                for (int o = 4; o < 32; o <<= 1) l8[e] += __shfl_xor_sync(0xffffffffu, l8[e], o);
                if (g == 0 && 2 * t + e < G) {
                    sh.wm[warp][2 * t + e] = m8[e];
                    sh.wl[warp][2 * t + e] = l8[e];
                }
            }
        } else if (lane == 0) {
#pragma unroll
            for (int h = 0; h < G; ++h) {
                sh.wm[warp][h] = m[h];
                sh.wl[warp][h] = l[h];
            }
        }
        __syncthreads();
        QW_TL_AT(first_item, 4);
        // Each head's max over the warps: lane l takes warp l % WARPS's, and a butterfly over
        // WARPS lanes gives every lane all G maxima (log2 WARPS shuffles, where a loop over the
        // warps was WARPS shared-memory loads in turn: ~1 µs of the warps' merge at 512).
        static_assert(WARPS <= 32 && (WARPS & (WARPS - 1)) == 0, "a lane a warp");
        float gmax[G];
#pragma unroll
        for (int h = 0; h < G; ++h) {
            float v = sh.wm[lane % WARPS][h];
#pragma unroll
            for (int o = 1; o < WARPS; o <<= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
            gmax[h] = v;
        }
        const auto warps_max = [&](int h) {  // (a select, so that gmax stays in registers)
            float mx = gmax[0];
#pragma unroll
            for (int j = 1; j < G; ++j) mx = j == h ? gmax[j] : mx;
            return mx;
        };
        // The warp's outputs, scaled to the chunk's max, into slot `slot` of comb (`add`: added
        // to what is there).
        const auto outputs = [&](int slot, bool add) {
            const auto store = [add](float& to, float v) { to = add ? to + v : v; };
            if constexpr (TC_ATTN) {
                const int g = lane >> 2, t = lane & 3;
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int h = 2 * t + e;
                    if (h >= G) continue;
                    const float f = m8[e] == QW_NEG_INF ? 0.f : __expf(m8[e] - warps_max(h));
                    float* out = comb + (slot * G + h) * HD;
#pragma unroll
                    for (int i = 0; i < HD / 16; ++i) {
                        store(out[tc_dim(i, g)], acc8[i][e] * f);
                        store(out[tc_dim(i, g + 8)], acc8[i][e + 2] * f);
                    }
                }
            } else {
#pragma unroll
                for (int h = 0; h < G; ++h) {
                    const float e = m[h] == QW_NEG_INF ? 0.f : __expf(m[h] - warps_max(h));
#pragma unroll
                    for (int d = 0; d < DPL; ++d)
                        store(comb[(slot * G + h) * HD + lane * DPL + d], acc[h][d] * e);
                }
            }
        };
        // Each warp its own slot; or (COMB_HALF, mk_layout.cuh) the first half of the warps
        // theirs, then each warp of the second half adds its own to slot warp - COMB_SLOTS: a
        // fixed order, so the sums repeat bit for bit.
        if (!COMB_HALF || warp < COMB_SLOTS) outputs(warp, false);
        if constexpr (COMB_HALF) {
            __syncthreads();
            if (warp >= COMB_SLOTS) outputs(warp - COMB_SLOTS, true);
        }
        // Each head's sum over the warps, rescaled to its max: lanes 0..WARPS-1 of warp 0 a
        // warp each, added by a fixed butterfly (the same order every step).
        if (warp == 0) {
#pragma unroll
            for (int h = 0; h < G; ++h) {
                const float wm = sh.wm[lane % WARPS][h];
                float total = lane < WARPS && wm != QW_NEG_INF
                    ? __expf(wm - gmax[h]) * sh.wl[lane % WARPS][h] : 0.f;
#pragma unroll
                for (int o = 1; o < WARPS; o <<= 1) total += __shfl_xor_sync(0xffffffffu, total, o);
                if (lane == 0) {
                    sh.gm[h] = gmax[h];
                    sh.gl[h] = total;
                }
            }
        }
        __syncthreads();
        QW_TL_AT(first_item, 5);
        for (int out = threadIdx.x; out < G * HD; out += THREADS) {
            const int h = out / HD, head = kvh * G + h, d = out % HD;
            float total = 0.f;
            for (int w = 0; w < COMB_SLOTS; ++w) total += comb[(w * G + h) * HD + d];
            if (g.splits == 1) {
                put(a.attn + head * HD + d, total / sh.gl[h], tag + 1);
            } else {
                a.part_o[(static_cast<long long>(head) * a.splits + split) * HD + d] = total;
                if (d == 0) {
                    a.part_ml[(head * a.splits + split) * 2] = sh.gm[h];
                    a.part_ml[(head * a.splits + split) * 2 + 1] = sh.gl[h];
                }
            }
        }
        QW_TL_AT(first_item, 6);
        if (g.splits > 1) merge_if_last(a, kvh, g.splits, merge_base, tag + 1, sh);
        if (deferred) pipe_produce(a, consumed);  // (the producer warp's)
        __syncthreads();
    }
    QW_TL_MARK(END);
}
}  // namespace
