// Causal grouped-query attention over the KV cache ([kv_head][capacity][head_dim], bf16).
// Prefill: flash-attention on the tensor cores, one block per (64 queries, head), keys streamed
//   through shared memory 64 at a time with an online softmax; nothing O(N^2) is stored. A few
//   new tokens after a long cached prefix (a chat's next message) would leave most of the chip
//   idle while each block walks every key, so the keys can be split across blocks too (grid z),
//   each writing an unnormalised partial that attn_prefill_merge combines, as decode does.
// Decode: flash-decoding. The cache is split into chunks across blocks (so long contexts keep
//   the whole chip busy); each block writes an unnormalised partial output with its running max
//   and sum, and a merge kernel combines the chunks.
#include "common.cuh"
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
namespace {
constexpr int PF_Q = 64;       // queries per block (4 warps x 16 rows)
constexpr int PF_KV = 64;      // keys per shared-memory tile
constexpr int PF_THREADS = 128;
constexpr int LDK = HD + 8;    // padded rows keep the fragment loads free of bank conflicts
constexpr int LDV = PF_KV + 8;
}  // namespace

extern "C" __global__ void __launch_bounds__(PF_THREADS)
    attn_prefill(const bf16_t* __restrict__ q, const bf16_t* __restrict__ k_cache,
                 const bf16_t* __restrict__ v_cache, int start, int n, int capacity, float scale,
                 bf16_t* __restrict__ out, float* __restrict__ part_o,
                 float* __restrict__ part_ml) {
    __shared__ __align__(16) bf16_t Ks[PF_KV][LDK];
    __shared__ __align__(16) bf16_t Vt[HD][LDV];  // V transposed: B operand rows are head dims
    const int head = blockIdx.y, kvh = head / qw::group;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = lane >> 2, t = lane & 3;
    const int q_row0 = blockIdx.x * PF_Q + warp * 16;  // this warp's first query (0-based in n)
    const bf16_t* kc = k_cache + static_cast<long long>(kvh) * capacity * HD;
    const bf16_t* vc = v_cache + static_cast<long long>(kvh) * capacity * HD;

    // Q fragments stay in registers for the whole key loop.
    unsigned qa[HD / 16][4];
#pragma unroll
    for (int ks = 0; ks < HD / 16; ++ks) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int r = q_row0 + g + (e & 1) * 8;
            const int c = ks * 16 + t * 2 + (e >> 1) * 8;
            qa[ks][e] = r < n ? ld_u32(q + (static_cast<long long>(r) * qw::heads + head) * HD + c)
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
    const int pos_row[2] = {start + q_row0 + g, start + q_row0 + g + 8};

    const int block_last_query = min(n, (blockIdx.x + 1) * PF_Q) - 1;
    const int kv_len = start + block_last_query + 1;
    const int splits = gridDim.z, split = blockIdx.z;
    const int tiles_per_split = ((kv_len + PF_KV - 1) / PF_KV + splits - 1) / splits;
    const int k_begin = split * tiles_per_split * PF_KV;
    const int k_end = min(kv_len, k_begin + tiles_per_split * PF_KV);
    for (int j0 = k_begin; j0 < k_end; j0 += PF_KV) {
        __syncthreads();
        // K tile as rows; V tile transposed. 64 keys x HD dims, 16-byte chunks.
        for (int chunk = threadIdx.x; chunk < PF_KV * HD / 8; chunk += PF_THREADS) {
            const int r = chunk / (HD / 8), c = (chunk % (HD / 8)) * 8;
            const int key = j0 + r;
            uint4 kv = make_uint4(0, 0, 0, 0), vv = make_uint4(0, 0, 0, 0);
            if (key < k_end) {
                kv = *reinterpret_cast<const uint4*>(kc + static_cast<long long>(key) * HD + c);
                vv = *reinterpret_cast<const uint4*>(vc + static_cast<long long>(key) * HD + c);
            }
            *reinterpret_cast<uint4*>(&Ks[r][c]) = kv;
            const unsigned words[4] = {vv.x, vv.y, vv.z, vv.w};
#pragma unroll
            for (int w = 0; w < 4; ++w) {
                Vt[c + 2 * w][r] = static_cast<bf16_t>(words[w] & 0xffffu);
                Vt[c + 2 * w + 1][r] = static_cast<bf16_t>(words[w] >> 16);
            }
        }
        __syncthreads();

        float s[PF_KV / 8][4];
#pragma unroll
        for (int j = 0; j < PF_KV / 8; ++j) {
#pragma unroll
            for (int e = 0; e < 4; ++e) s[j][e] = 0.f;
#pragma unroll
            for (int ks = 0; ks < HD / 16; ++ks) {
                unsigned b[2];
                b[0] = ld_u32(&Ks[j * 8 + g][ks * 16 + t * 2]);
                b[1] = ld_u32(&Ks[j * 8 + g][ks * 16 + 8 + t * 2]);
                mma_bf16_16816(s[j], qa[ks], b);
            }
        }

        // Mask (causal), then the online softmax update of each of this thread's two rows.
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            float mx = QW_NEG_INF;
#pragma unroll
            for (int j = 0; j < PF_KV / 8; ++j) {
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int key = j0 + j * 8 + t * 2 + e;
                    float v = s[j][half * 2 + e] * qk_scale;
                    if (key > pos_row[half]) v = QW_NEG_INF;
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

        // O += P . V, reusing the score accumulators as A fragments (C layout == A layout).
#pragma unroll
        for (int kk = 0; kk < PF_KV / 16; ++kk) {
            unsigned pa[4];
            pa[0] = pack_bf16x2(s[2 * kk][0], s[2 * kk][1]);
            pa[1] = pack_bf16x2(s[2 * kk][2], s[2 * kk][3]);
            pa[2] = pack_bf16x2(s[2 * kk + 1][0], s[2 * kk + 1][1]);
            pa[3] = pack_bf16x2(s[2 * kk + 1][2], s[2 * kk + 1][3]);
#pragma unroll
            for (int d = 0; d < HD / 8; ++d) {
                unsigned b[2];
                b[0] = ld_u32(&Vt[d * 8 + g][kk * 16 + t * 2]);
                b[1] = ld_u32(&Vt[d * 8 + g][kk * 16 + 8 + t * 2]);
                mma_bf16_16816(o[d], pa, b);
            }
        }
    }

#pragma unroll
    for (int half = 0; half < 2; ++half) {
        float l = l_row[half];
        l += __shfl_xor_sync(0xffffffffu, l, 1);
        l += __shfl_xor_sync(0xffffffffu, l, 2);
        const int r = q_row0 + g + half * 8;
        if (r >= n) continue;
        if (splits > 1) {  // this split's share, merged by attn_prefill_merge
            const long long at = (static_cast<long long>(r) * qw::heads + head) * splits + split;
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
        bf16_t* dst = out + (static_cast<long long>(r) * qw::heads + head) * HD;
#pragma unroll
        for (int d = 0; d < HD / 8; ++d) {
            *reinterpret_cast<unsigned*>(dst + d * 8 + t * 2) =
                pack_bf16x2(o[d][half * 2] * inv, o[d][half * 2 + 1] * inv);
        }
    }
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
    attn_decode_partial(const bf16_t* __restrict__ q, const bf16_t* __restrict__ k_cache,
                        const bf16_t* __restrict__ v_cache, const int* __restrict__ pos_ptr,
                        int capacity, float scale, float* __restrict__ part_o,
                        float* __restrict__ part_ml) {
    __shared__ __align__(16) float qs[qw::group][HD];
    __shared__ float p[qw::group][DC_MAX_CHUNK];
    __shared__ float scratch[32];
    const int kvh = blockIdx.x, split = blockIdx.y, splits = gridDim.y;
    const int len = *pos_ptr + 1;
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

    const bf16_t* kc = k_cache + static_cast<long long>(kvh) * capacity * HD;
    const bf16_t* vc = v_cache + static_cast<long long>(kvh) * capacity * HD;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int sub = lane / LANES_PER_KEY, part = lane % LANES_PER_KEY;
    constexpr int KEY_STRIDE = (DC_THREADS / 32) * KEYS_PER_WARP;
    // The first keys' loads go out before q is staged, so their latency overlaps it.
    const int first = warp * KEYS_PER_WARP + sub;
    uint4 kv_next = make_uint4(0, 0, 0, 0);
    if (first < count)
        kv_next = *reinterpret_cast<const uint4*>(kc + static_cast<long long>(k_begin + first) * HD +
                                                  part * 8);
    for (int i = threadIdx.x; i < qw::group * HD; i += DC_THREADS) {
        const int gh = i / HD, d = i % HD;
        qs[gh][d] = bf16_to_f32(q[(kvh * qw::group + gh) * HD + d]);
    }
    __syncthreads();

    for (int kidx = first; kidx - sub < count; kidx += KEY_STRIDE) {
        const uint4 kv = kv_next;
        const int next = kidx + KEY_STRIDE;
        if (next < count)
            kv_next = *reinterpret_cast<const uint4*>(kc + static_cast<long long>(k_begin + next) * HD +
                                                      part * 8);
#pragma unroll
        for (int gh = 0; gh < qw::group; ++gh) {
            float dot = dot8(kv, &qs[gh][part * 8]);
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
            v[u] = i < count ? *reinterpret_cast<const uint4*>(
                                   vc + static_cast<long long>(k_begin + i) * HD + dim0)
                             : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            const int i = i0 + u * VALUE_SLOTS;
            if (i >= count) continue;
            const float vf[8] = {bf16_lo(v[u].x), bf16_hi(v[u].x), bf16_lo(v[u].y), bf16_hi(v[u].y),
                                 bf16_lo(v[u].z), bf16_hi(v[u].z), bf16_lo(v[u].w), bf16_hi(v[u].w)};
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
    // [splits rounded up to 4]: the unrolled loop below may read the tail as one 16-byte vector.
    extern __shared__ __align__(16) float weight[];
    __shared__ float scratch[32];
    __shared__ float total_shared;
    const int head = blockIdx.x;
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
