// Token choice shared by the per-op sampler kernels and the decode megakernel: the rules of
// qwenchat/sampling/sampler.py (see sampling.cu), written for a block of NT threads.
// Thresholds are found by radix selection over the float bits, and probability masses are
// summed as 64-bit fixed point, so the result does not depend on the order in which threads
// add: the same seed gives the same token on every run.
#pragma once
#include "common.cuh"
#include "qwen3.cuh"

struct SampleParams {
    float temperature;
    float top_p;
    float min_p;
    float repetition_penalty;
    float presence_penalty;
    float frequency_penalty;
    int top_k;
    int step;
    unsigned long long seed;
};

namespace qws {
constexpr double FIXED_ONE = 4294967296.0;  // probabilities <= 1 scaled by 2^32

__device__ __forceinline__ unsigned long long splitmix64(unsigned long long x) {
    x += 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}

// Float -> unsigned key with the same order (negative floats reversed).
__device__ __forceinline__ unsigned order_key(float f) {
    const unsigned u = __float_as_uint(f);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// Keep the larger value; on equal values the lower id, as NumPy's and torch's argmax do.
__device__ __forceinline__ void argmax_merge(float& val, int& idx, float other_val, int other_idx) {
    if (other_val > val || (other_val == val && other_idx < idx)) {
        val = other_val;
        idx = other_idx;
    }
}

__device__ __forceinline__ void argmax_warp(float& val, int& idx) {
    for (int o = 16; o > 0; o >>= 1)
        argmax_merge(val, idx, __shfl_xor_sync(0xffffffffu, val, o),
                     __shfl_xor_sync(0xffffffffu, idx, o));
}

// The block's maximum (first index on ties) lands in thread 0's (val, idx); the warps' maxima
// pass through vals / idxs (one slot per warp). Ends after a __syncthreads: a caller that
// reuses the slots must sync before calling again.
template <int NT>
__device__ __forceinline__ void argmax_block(float& val, int& idx, float* vals, int* idxs) {
    argmax_warp(val, idx);
    if ((threadIdx.x & 31) == 0) {
        vals[threadIdx.x >> 5] = val;
        idxs[threadIdx.x >> 5] = idx;
    }
    __syncthreads();
    if (threadIdx.x == 0)  // already holds warp 0's maximum
        for (int w = 1; w < NT / 32; ++w) argmax_merge(val, idx, vals[w], idxs[w]);
}

template <int NT>
struct SampleShared {
    unsigned long long hist[256];
    unsigned long long scan[NT / 32];
    float fscratch[32];
    float best_val[NT / 32];
    int best_idx[NT / 32];
    unsigned prefix;
    unsigned bin;
    unsigned long long above;
    int token;
};

template <int NT>
__device__ unsigned long long block_sum_u64(unsigned long long v, SampleShared<NT>& sh) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    __syncthreads();
    if ((threadIdx.x & 31) == 0) sh.scan[threadIdx.x >> 5] = v;
    __syncthreads();
    unsigned long long total = 0;
    for (int w = 0; w < NT / 32; ++w) total += sh.scan[w];
    return total;
}

// The logits a sampler chooses from. VocabLogits: the whole (penalised) vocabulary in `work`.
// Every source has n slots; a slot may be empty (valid() false), and the ids of the valid slots
// rise with the slot number, so "in slot order" is "in vocabulary order".
struct VocabLogits {
    const float* work;
    __device__ __forceinline__ int n() const { return qw::vocab; }
    __device__ __forceinline__ bool valid(int) const { return true; }
    __device__ __forceinline__ float value(int i) const { return ld_cg(work + i); }
    __device__ __forceinline__ int id(int i) const { return i; }
};

// Finds, from the top bin down, the bin at which *above plus the running total of hist[]
// first reaches `target` (bin 0 if none does), with warp 0: lane l scans bins 255 - 8l down to
// 248 - 8l. Writes the bin to *bin_out, and to *above the total of the bins above it (of all
// bins when none reached the target, as a serial scan from the top would leave it).
template <typename Count>
__device__ __forceinline__ void find_bin(const Count* hist, Count target, Count* above,
                                         unsigned* bin_out) {
    if (threadIdx.x >= 32) return;
    const int lane = threadIdx.x;
    const Count above_in = *above;
    Count mine = 0;
#pragma unroll
    for (int j = 0; j < 8; ++j) mine += hist[255 - 8 * lane - j];
    const Count incl = warp_inclusive_scan(mine);  // over lanes 0..lane: the higher bins first
    const unsigned reached = __ballot_sync(0xffffffffu, above_in + incl >= target);
    __syncwarp();  // every lane has read *above before one lane writes it
    if (reached == 0) {
        if (lane == 31) {
            *bin_out = 0;
            *above = above_in + incl;
        }
        return;
    }
    if (lane == __ffs(reached) - 1) {
        Count run = above_in + incl - mine;
        int bin = 255 - 8 * lane - 7;
        for (int j = 0; j < 8; ++j) {
            const int b = 255 - 8 * lane - j;
            if (run + hist[b] >= target) {
                bin = b;
                break;
            }
            run += hist[b];
        }
        *bin_out = static_cast<unsigned>(bin);
        *above = run;
    }
}

// Radix descent over 32-bit keys, 8 bits at a time, from the top: returns the key of the element
// at which the running total of `weight` (in descending key order, inclusive) first reaches
// `target`. weight_of(i, key) gives each valid slot's weight (0 excludes it). Each of `hists`
// groups of warps counts into its own histogram (`warp_hist`, hists x 256 in shared memory):
// most keys share their top bits, and one shared histogram would serialise the whole
// vocabulary on one bin (a source of a few hundred candidates can use one).
template <int NT, typename Src, typename WeightFn>
__device__ unsigned radix_descend(const Src& src, unsigned long long target, WeightFn weight_of,
                                  SampleShared<NT>& sh, unsigned long long* warp_hist, int hists) {
    __syncthreads();  // every thread has read the previous descent's result
    if (threadIdx.x == 0) {
        sh.prefix = 0;
        sh.above = 0;
    }
    unsigned long long* mine = warp_hist + (threadIdx.x >> 5) % hists * 256;
    const int n = src.n();
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int b = threadIdx.x; b < hists * 256; b += NT) warp_hist[b] = 0;
        __syncthreads();
        const unsigned prefix = sh.prefix;
        const unsigned high_mask = shift == 24 ? 0u : (0xffffffffu << (shift + 8));
        for (int i = threadIdx.x; i < n; i += NT) {
            if (!src.valid(i)) continue;
            const unsigned key = order_key(src.value(i));
            if ((key & high_mask) != (prefix & high_mask)) continue;
            const unsigned long long w = weight_of(i, key);
            if (w) atomicAdd(&mine[(key >> shift) & 0xffu], w);
        }
        __syncthreads();
        for (int b = threadIdx.x; b < 256; b += NT) {
            unsigned long long total = 0;
            for (int w = 0; w < hists; ++w) total += warp_hist[w * 256 + b];
            sh.hist[b] = total;
        }
        __syncthreads();
        find_bin<unsigned long long>(sh.hist, target, &sh.above, &sh.bin);
        __syncthreads();
        if (threadIdx.x == 0) sh.prefix = prefix | (sh.bin << shift);
        __syncthreads();
    }
    return sh.prefix;
}

// The key of the k-th largest of the n floats in shared memory (1 <= k), or 0 when k > n
// (every element is then at or above it). hist: 256 counters of shared memory; scratch: two
// words of shared memory. Every thread of the block calls it and gets the key.
template <int NT>
__device__ unsigned block_kth_key(const float* vals, int n, int k, unsigned* hist,
                                  unsigned* scratch) {
    if (k > n) return 0u;
    unsigned prefix = 0;
    const int lane = threadIdx.x & 31;
    __syncthreads();  // the caller's last use of hist / scratch is over
    if (threadIdx.x == 0) scratch[1] = 0;  // the count above the bins still in play
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int b = threadIdx.x; b < 256; b += NT) hist[b] = 0;
        __syncthreads();
        const unsigned high_mask = shift == 24 ? 0u : (0xffffffffu << (shift + 8));
        for (int i0 = 0; i0 < n; i0 += NT) {
            const int i = i0 + static_cast<int>(threadIdx.x);
            const unsigned key = i < n ? order_key(vals[i]) : 0u;
            const bool in = i < n && (key & high_mask) == (prefix & high_mask);
            // One atomic per distinct bin in the warp: most keys share their top bits.
            const unsigned digit = in ? (key >> shift) & 0xffu : 0x100u;
            const unsigned peers = __match_any_sync(0xffffffffu, digit);
            if (in && lane == __ffs(peers) - 1) atomicAdd(&hist[digit], __popc(peers));
        }
        __syncthreads();
        find_bin<unsigned>(hist, static_cast<unsigned>(k), scratch + 1, scratch);
        __syncthreads();
        prefix |= scratch[0] << shift;
        __syncthreads();  // every thread has read the bin before the next pass writes it
    }
    return prefix;
}

// The logit after the repetition penalty (tokens in the context) and the presence/frequency
// penalties (tokens in the reply, with their counts).
__device__ __forceinline__ float penalized(float l, const SampleParams& p, unsigned char seen,
                                           int count) {
    if (p.repetition_penalty != 1.f && seen)
        l = l > 0.f ? l / p.repetition_penalty : l * p.repetition_penalty;
    if (count) l -= p.presence_penalty + p.frequency_penalty * static_cast<float>(count);
    return l;
}

// With the (penalised) logits in `src`, their maximum and its first id known: the token.
// Greedy (temperature 0) is that id; otherwise temperature, top-k, top-p, min-p and one
// seeded draw at `step`. Every thread of the block must call it; all get the same token.
// A source holding only some of the vocabulary gives the same token as the whole vocabulary
// when it holds every logit at or above the k-th largest (top-k keeps no other).
// warp_hist: hists x 256 unsigned long long of shared memory (hists: see radix_descend; the
// counts and masses are integers, so the result does not depend on it).
template <int NT, typename Src>
__device__ int choose_token(const Src& src, const SampleParams& p, float max_logit, int argmax,
                            int step, SampleShared<NT>& sh, unsigned long long* warp_hist,
                            int hists = NT / 32) {
    const int tid = threadIdx.x;
    const int n = src.n();
    __syncthreads();
    if (tid == 0) sh.token = argmax;
    __syncthreads();
    if (p.temperature > 0.f) {
        // 2. top-k: the key of the k-th largest logit (ties at the cut are kept, as on the CPU).
        unsigned kth_key = 0;
        if (p.top_k > 0 && p.top_k < qw::vocab) {
            kth_key = radix_descend<NT>(src, static_cast<unsigned long long>(p.top_k),
                                        [](int, unsigned) { return 1ull; }, sh, warp_hist, hists);
        }
        // Each candidate's weight: exp((l - max) / T) in (0, 1], as 2^32 fixed point.
        const float inv_t = 1.f / p.temperature;
        auto fixed_prob = [&](int i, unsigned key) -> unsigned long long {
            if (key < kth_key) return 0ull;
            const float z = (src.value(i) - max_logit) * inv_t;
            return static_cast<unsigned long long>(expf(z) * FIXED_ONE);
        };
        // 3. top-p: the smallest probability whose descending running mass reaches top_p.
        unsigned long long local = 0;
        for (int i = tid; i < n; i += NT)
            if (src.valid(i)) local += fixed_prob(i, order_key(src.value(i)));
        const unsigned long long total = block_sum_u64<NT>(local, sh);
        unsigned p_key = 0;
        if (p.top_p < 1.f) {
            const unsigned long long target =
                static_cast<unsigned long long>(static_cast<double>(p.top_p) * total);
            p_key = radix_descend<NT>(src, target > 0 ? target : 1ull, fixed_prob, sh, warp_hist,
                                     hists);
        }
        // 4. min-p relative to the most likely token, whose weight is exactly 1.
        const unsigned long long min_fixed =
            static_cast<unsigned long long>(static_cast<double>(p.min_p) * FIXED_ONE);
        auto kept = [&](int i) -> unsigned long long {
            if (!src.valid(i)) return 0ull;
            const unsigned key = order_key(src.value(i));
            if (key < p_key) return 0ull;
            const unsigned long long w = fixed_prob(i, key);
            return w >= min_fixed ? w : 0ull;
        };
        // 5. One draw, inverse CDF in vocabulary order over contiguous per-thread slices.
        const int per_thread = (n + NT - 1) / NT;
        const int begin = tid * per_thread, end = min(n, begin + per_thread);
        unsigned long long mine = 0;
        for (int i = begin; i < end; ++i) mine += kept(i);
        unsigned long long all;
        const unsigned long long before = block_exclusive_scan<NT>(mine, sh.scan, all);
        const unsigned long long bits = splitmix64(p.seed ^ splitmix64(static_cast<unsigned long long>(step)));
        const double u = static_cast<double>(bits >> 11) * (1.0 / 9007199254740992.0);
        const unsigned long long target = static_cast<unsigned long long>(u * static_cast<double>(all));
        if (mine > 0 && target >= before && target < before + mine) {
            unsigned long long run = before;
            for (int i = begin; i < end; ++i) {
                run += kept(i);
                if (target < run) {
                    sh.token = src.id(i);
                    break;
                }
            }
        }
        __syncthreads();
    }

    return sh.token;
}
}  // namespace qws
