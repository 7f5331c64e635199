// Causal grouped-query attention over the KV cache ([kv_head][capacity][head_dim], bf16, or
// int8 rows and their scales: kv8.cuh).
// Prefill: flash-attention on the tensor cores, one block per (64 queries, head), keys streamed
//   through two shared-memory stages (cp.async) with an online softmax; nothing O(N^2) is
//   stored. A few new tokens after a long cached prefix (a chat's next message) would leave most
//   of the chip idle while each block walks every key, so the keys can be split across blocks
//   too (grid z), each writing an unnormalised partial that attn_prefill_merge combines, as
//   decode does.
// Decode: flash-decoding. The cache is split into chunks across blocks (so long contexts keep
//   the whole chip busy); each block writes an unnormalised partial output with its running max
//   and sum, and a merge kernel combines the chunks.
#include "prefill_attention.cuh"

extern "C" __global__ void __launch_bounds__(PF_THREADS)
    attn_prefill(const bf16_t* __restrict__ q, const void* __restrict__ k_cache,
                 const void* __restrict__ v_cache, const int* __restrict__ start_at,
                 int start_arg, int n, int capacity, float scale, bf16_t* __restrict__ out,
                 float* __restrict__ part_o, float* __restrict__ part_ml) {
    prefill_attention<false>(q, k_cache, v_cache, start_at, start_arg, n, capacity, scale, out,
                             part_o, part_ml);
}

// out[r][head] = the splits' partials of attn_prefill combined. Grid: (n, heads); HD threads.
extern "C" __global__ void attn_prefill_merge(const float* __restrict__ part_o,
                                              const float* __restrict__ part_ml, int splits,
                                              bf16_t* __restrict__ out) {
    const long long row = static_cast<long long>(blockIdx.x) * qw::heads + blockIdx.y;
    const float* ml = part_ml + row * splits * 2;
    float m = QW_NEG_INF;
    for (int s = 0; s < splits; ++s) m = fmaxf(m, ml[2 * s]);
    float total = 0.f, acc = 0.f;
    for (int s = 0; s < splits; ++s) {
        const float l = ml[2 * s + 1];
        const float w = l > 0.f ? exp2f(ml[2 * s] - m) : 0.f;  // maxima are in base 2
        total += w * l;
        acc += w * part_o[(row * splits + s) * HD + threadIdx.x];
    }
    out[row * HD + threadIdx.x] = f32_to_bf16(acc / total);
}

// ---------------------------------------------------------------------------------------------
// Decode. One new query per head at position *pos_ptr (its key is already in the cache), so
// the context length is *pos_ptr + 1. Grid: (kv_heads, splits); each block serves the `group`
// query heads that share one key/value head, over one chunk of the cache.
namespace {
constexpr int DC_THREADS = 128;
constexpr int DC_MAX_CHUNK = 256;  // the host picks splits >= capacity / DC_MAX_CHUNK
constexpr int LANES_PER_KEY = HD / 8;  // each lane reads 8 dims (16 bytes) of a key
constexpr int KEYS_PER_WARP = 32 / LANES_PER_KEY;
}  // namespace

extern "C" __global__ void __launch_bounds__(DC_THREADS)
    attn_decode_partial(const bf16_t* __restrict__ q, const void* __restrict__ k_cache,
                        const void* __restrict__ v_cache, const int* __restrict__ pos_ptr,
                        int capacity, float scale, float* __restrict__ part_o,
                        float* __restrict__ part_ml) {
    dependent_start();
    __shared__ __align__(16) float qs[qw::group][HD];
    __shared__ float p[qw::group][DC_MAX_CHUNK];
    __shared__ float scratch[32];
    const int kvh = blockIdx.x, split = blockIdx.y, splits = gridDim.y;
    // Grid z: the rows of a speculative pass, row r's query at position *pos_ptr + r.
    const int row = blockIdx.z;
    q += static_cast<long long>(row) * qw::q_size;
    part_o += static_cast<long long>(row) * qw::heads * splits * HD;
    part_ml += static_cast<long long>(row) * qw::heads * splits * 2;
    const int len = *pos_ptr + row + 1;
    const int chunk = max(16, (len + splits - 1) / splits);
    if (chunk > DC_MAX_CHUNK) __trap();  // the host sizes splits so that this cannot happen
    const int k_begin = split * chunk, k_end = min(len, k_begin + chunk);
    const int count = k_end - k_begin;  // may be <= 0 for the tail splits of a short context
    if (count <= 0) {  // nothing to attend to: an empty partial that the merge gives weight 0
        for (int i = threadIdx.x; i < qw::group * HD; i += DC_THREADS) {
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
    constexpr int KEY_STRIDE = (DC_THREADS / 32) * KEYS_PER_WARP;
    // Key `key`'s 8 values at this lane's dimensions: 16 bytes of bf16, or 8 int8 codes (in
    // .x and .y; their scale multiplies the dot product).
    const auto load_key = [&](int key) {
        const unsigned char* at = kvc.k + (static_cast<long long>(k_begin + key) * HD + part * 8) * KV_BYTES;
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
    for (int i = threadIdx.x; i < qw::group * HD; i += DC_THREADS) {
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
        for (int i = threadIdx.x; i < count; i += DC_THREADS) mx = fmaxf(mx, p[gh][i]);
        m[gh] = block_max(mx, scratch);
        float sum = 0.f;
        for (int i = threadIdx.x; i < count; i += DC_THREADS) {
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
    constexpr int VALUE_SLOTS = DC_THREADS / LANES_PER_KEY;
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
            const unsigned char* at = kvc.v + (static_cast<long long>(k_begin + i) * HD + dim0) * KV_BYTES;
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
    for (int i = threadIdx.x; i < qw::group * HD; i += DC_THREADS) {
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

// out[head * HD + d] = merged attention output (float), one block per head. The chunks' maxima
// and sums are read once, in parallel, into shared memory; each thread then sums its dimension
// over the chunks with independent loads.
extern "C" __global__ void attn_decode_merge(const float* __restrict__ part_o,
                                             const float* __restrict__ part_ml, int splits,
                                             float* __restrict__ out) {
    dependent_start();
    // [splits rounded up to 4]: the unrolled loop below may read the tail as one 16-byte vector.
    extern __shared__ __align__(16) float weight[];
    __shared__ float scratch[32];
    __shared__ float total_shared;
    const int head = blockIdx.x, row = blockIdx.y;  // (grid y: a speculative pass's rows)
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
