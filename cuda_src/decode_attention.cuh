// Decode attention (flash-decoding) as device functions over one item: a chunk of one kv head's
// keys for one query row, and the merge of one head's chunks. attention.cu launches each as a
// kernel (grid: kv_heads x splits x rows, and heads x rows); a persistent kernel can run them as
// phases, a block taking items in turn (docs/perf.md, fourteenth session). The cache is
// [kv_head][capacity][head_dim], bf16, or int8 rows and their scales (kv8.cuh).
#pragma once
#include "common.cuh"
#include "kv8.cuh"
#include "qwen3.cuh"

namespace {
constexpr int DC_MAX_CHUNK = 256;  // the host picks splits >= capacity / DC_MAX_CHUNK
constexpr int LANES_PER_KEY = qw::head_dim / 8;  // each lane reads 8 dims (16 bytes) of a key
constexpr int KEYS_PER_WARP = 32 / LANES_PER_KEY;

// One block's chunk `split` of `splits` of kv head kvh's keys for the query of row `row` (a
// speculative pass's rows: row r's query at position *pos_ptr + r; a step's: row 0), its group
// of query heads' unnormalised output and running max and sum into part_o and part_ml, for a
// block of THREADS threads.
template <int THREADS>
__device__ __forceinline__ void attn_decode_partial_of(const bf16_t* q, const void* k_cache,
                                                       const void* v_cache, const int* pos_ptr,
                                                       int capacity, float scale, float* part_o,
                                                       float* part_ml, int kvh, int split,
                                                       int splits, int row) {
    constexpr int HD = qw::head_dim;
    __shared__ __align__(16) float qs[qw::group][HD];
    __shared__ float p[qw::group][DC_MAX_CHUNK];
    __shared__ float scratch[32];
    q += static_cast<long long>(row) * qw::q_size;
    part_o += static_cast<long long>(row) * qw::heads * splits * HD;
    part_ml += static_cast<long long>(row) * qw::heads * splits * 2;
    const int len = *pos_ptr + row + 1;
    const int chunk = max(16, (len + splits - 1) / splits);
    if (chunk > DC_MAX_CHUNK) __trap();  // the host sizes splits so that this cannot happen
    const int k_begin = split * chunk, k_end = min(len, k_begin + chunk);
    const int count = k_end - k_begin;  // may be <= 0 for the tail splits of a short context
    if (count <= 0) {  // nothing to attend to: an empty partial that the merge gives weight 0
        for (int i = threadIdx.x; i < qw::group * HD; i += THREADS) {
            const int head = kvh * qw::group + i / HD;
            part_o[(static_cast<long long>(head) * splits + split) * HD + i % HD] = 0.f;
        }
        if (threadIdx.x < qw::group) {
            const int head = kvh * qw::group + threadIdx.x;
            part_ml[(head * splits + split) * 2] = QW_NEG_INF;
            part_ml[(head * splits + split) * 2 + 1] = 0.f;
        }
        return;
    }

    const KvHead kvc = kv_head(k_cache, v_cache, kvh, capacity);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int sub = lane / LANES_PER_KEY, part = lane % LANES_PER_KEY;
    constexpr int KEY_STRIDE = (THREADS / 32) * KEYS_PER_WARP;
    // Key `key`'s 8 values at this lane's dimensions: 16 bytes of bf16, or 8 int8 codes (in
    // .x and .y; their scale multiplies the dot product).
    const auto load_key = [&](int key) {
        const unsigned char* at = kvc.k + (static_cast<long long>(k_begin + key) * HD + part * 8) * qw::kv_bytes;
        if constexpr (qw::kv8) {
            const uint2 w = *reinterpret_cast<const uint2*>(at);
            return make_uint4(w.x, w.y, 0u, 0u);
        } else {
            return *reinterpret_cast<const uint4*>(at);
        }
    };
    // The first keys' loads go out before q is staged, so their latency overlaps it.
    const int first = warp * KEYS_PER_WARP + sub;
    uint4 kv_next = make_uint4(0, 0, 0, 0);
    if (first < count) kv_next = load_key(first);
    for (int i = threadIdx.x; i < qw::group * HD; i += THREADS) {
        const int gh = i / HD, d = i % HD;
        qs[gh][d] = bf16_to_f32(q[(kvh * qw::group + gh) * HD + d]);
    }
    __syncthreads();

    for (int kidx = first; kidx - sub < count; kidx += KEY_STRIDE) {
        const uint4 kv = kv_next;
        const int next = kidx + KEY_STRIDE;
        if (next < count) kv_next = load_key(next);
        float kf[8];
        if constexpr (qw::kv8) {
            const float ksc = kidx < count ? kvc.ks[k_begin + kidx] : 0.f;
            kv8_floats(make_uint2(kv.x, kv.y), kf);
#pragma unroll
            for (int e = 0; e < 8; ++e) kf[e] *= ksc;
        }
#pragma unroll
        for (int gh = 0; gh < qw::group; ++gh) {
            float dot;
            if constexpr (qw::kv8) {
                dot = 0.f;
#pragma unroll
                for (int e = 0; e < 8; ++e) dot += kf[e] * qs[gh][part * 8 + e];
            } else {
                dot = dot8(kv, &qs[gh][part * 8]);
            }
#pragma unroll
            for (int o = LANES_PER_KEY / 2; o > 0; o >>= 1)
                dot += __shfl_xor_sync(0xffffffffu, dot, o);
            if (part == 0 && kidx < count) p[gh][kidx] = dot * scale;
        }
    }
    __syncthreads();

    float m[qw::group], l[qw::group];
#pragma unroll
    for (int gh = 0; gh < qw::group; ++gh) {
        float mx = QW_NEG_INF;
        for (int i = threadIdx.x; i < count; i += THREADS) mx = fmaxf(mx, p[gh][i]);
        m[gh] = block_max(mx, scratch);
        float sum = 0.f;
        for (int i = threadIdx.x; i < count; i += THREADS) {
            const float e = __expf(p[gh][i] - m[gh]);
            p[gh][i] = e;
            sum += e;
        }
        l[gh] = block_sum(sum, scratch);
    }
    __syncthreads();

    // O = P . V with 16-byte value loads: LANES_PER_KEY threads cover a key's HD dims, the
    // block walks VALUE_SLOTS keys at a time, 4 of them in flight per thread; the slots' partial
    // sums are then added through shared memory (reusing the K staging space is not needed).
    constexpr int VALUE_SLOTS = THREADS / LANES_PER_KEY;
    const int slot = threadIdx.x / LANES_PER_KEY, dim0 = (threadIdx.x % LANES_PER_KEY) * 8;
    float acc[qw::group][8];
#pragma unroll
    for (int gh = 0; gh < qw::group; ++gh)
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[gh][e] = 0.f;
    for (int i0 = slot; i0 < count; i0 += 4 * VALUE_SLOTS) {
        uint4 v[4];
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            const int i = i0 + u * VALUE_SLOTS;
            const unsigned char* at = kvc.v + (static_cast<long long>(k_begin + i) * HD + dim0) * qw::kv_bytes;
            v[u] = make_uint4(0, 0, 0, 0);
            if (i < count) {
                if constexpr (qw::kv8) {
                    const uint2 w = *reinterpret_cast<const uint2*>(at);
                    v[u] = make_uint4(w.x, w.y, 0u, 0u);
                } else {
                    v[u] = *reinterpret_cast<const uint4*>(at);
                }
            }
        }
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            const int i = i0 + u * VALUE_SLOTS;
            if (i >= count) continue;
            float vf[8];
            if constexpr (qw::kv8) {
                const float vsc = kvc.vs[k_begin + i];
                kv8_floats(make_uint2(v[u].x, v[u].y), vf);
#pragma unroll
                for (int e = 0; e < 8; ++e) vf[e] *= vsc;
            } else {
                const float b[8] = {bf16_lo(v[u].x), bf16_hi(v[u].x), bf16_lo(v[u].y),
                                    bf16_hi(v[u].y), bf16_lo(v[u].z), bf16_hi(v[u].z),
                                    bf16_lo(v[u].w), bf16_hi(v[u].w)};
#pragma unroll
                for (int e = 0; e < 8; ++e) vf[e] = b[e];
            }
#pragma unroll
            for (int gh = 0; gh < qw::group; ++gh) {
                const float pw = p[gh][i];
#pragma unroll
                for (int e = 0; e < 8; ++e) acc[gh][e] += pw * vf[e];
            }
        }
    }
    __syncthreads();  // p is no longer read: reuse it for the slots' partial sums
    float* slot_sums = &p[0][0];  // [VALUE_SLOTS][group][HD] floats fit in p when HD <= 256
    for (int s = 0; s < VALUE_SLOTS; ++s) {
        if (slot == s) {
#pragma unroll
            for (int gh = 0; gh < qw::group; ++gh)
#pragma unroll
                for (int e = 0; e < 8; ++e) {
                    float* dst = slot_sums + gh * HD + dim0 + e;
                    *dst = s == 0 ? acc[gh][e] : *dst + acc[gh][e];
                }
        }
        __syncthreads();
    }
    for (int i = threadIdx.x; i < qw::group * HD; i += THREADS) {
        const int gh = i / HD, d = i % HD;
        const int head = kvh * qw::group + gh;
        part_o[(static_cast<long long>(head) * splits + split) * HD + d] = slot_sums[i];
    }
    if (threadIdx.x == 0) {
#pragma unroll
        for (int gh = 0; gh < qw::group; ++gh) {
            const int head = kvh * qw::group + gh;
            part_ml[(head * splits + split) * 2] = count > 0 ? m[gh] : QW_NEG_INF;
            part_ml[(head * splits + split) * 2 + 1] = count > 0 ? l[gh] : 0.f;
        }
    }
}


// out[head * HD + d] = merged attention output (float), one block a head (and row). The chunks' maxima
// and sums are read once, in parallel, into shared memory; each thread then sums its dimension
// over the chunks with independent loads.
// `weight`: shared memory for the splits rounded up to 4 (the unrolled loop below may read the
// tail as one 16-byte vector), 16-byte aligned.
__device__ __forceinline__ void attn_decode_merge_of(const float* part_o, const float* part_ml,
                                                     int splits, float* out, int head, int row,
                                                     float* weight) {
    constexpr int HD = qw::head_dim;
    __shared__ float scratch[32];
    __shared__ float total_shared;
    part_o += static_cast<long long>(row) * qw::heads * splits * HD;
    part_ml += static_cast<long long>(row) * qw::heads * splits * 2;
    out += static_cast<long long>(row) * qw::q_size;
    const int padded = (splits + 3) & ~3;
    for (int s = splits + threadIdx.x; s < padded; s += blockDim.x) weight[s] = 0.f;
    float m = QW_NEG_INF;
    for (int s = threadIdx.x; s < splits; s += blockDim.x) {
        const float ms = part_ml[(head * splits + s) * 2];
        weight[s] = ms;
        m = fmaxf(m, ms);
    }
    m = block_max(m, scratch);
    float total = 0.f;
    for (int s = threadIdx.x; s < splits; s += blockDim.x) {
        const float l = part_ml[(head * splits + s) * 2 + 1];
        const float w = l == 0.f ? 0.f : __expf(weight[s] - m);
        weight[s] = w;
        total += w * l;
    }
    total = block_sum(total, scratch);  // ends with every thread past a barrier
    if (threadIdx.x == 0) total_shared = total;
    __syncthreads();
    const float inv = 1.f / total_shared;
    for (int d = threadIdx.x; d < HD; d += blockDim.x) {
        const float* src = part_o + static_cast<long long>(head) * splits * HD + d;
        float acc = 0.f;
#pragma unroll 8
        for (int s = 0; s < splits; ++s) acc += weight[s] * src[static_cast<long long>(s) * HD];
        out[head * HD + d] = acc * inv;
    }
}
}  // namespace
