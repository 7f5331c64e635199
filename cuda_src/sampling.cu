// Choosing the next token on the GPU, so only its id (4 bytes) goes back to the host.
// Same rules as qwenchat/sampling/sampler.py: repetition penalty over the context, presence and
// frequency penalties over the reply, then exact argmax (temperature 0) or temperature, top-k,
// top-p, min-p and one draw whose uniform number is splitmix64(seed ^ splitmix64(step)).
// One block does it all. Thresholds are found by radix selection over the float bits, and
// probability masses are summed as 64-bit fixed point, so the result does not depend on the
// order in which threads add: the same seed gives the same token on every run.
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

namespace {
constexpr int THREADS = 1024;
constexpr int PER_THREAD = (qw::vocab + THREADS - 1) / THREADS;
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

struct Shared {
    unsigned long long hist[256];
    unsigned long long scan[THREADS / 32];
    float fscratch[32];
    float best_val[THREADS / 32];
    int best_idx[THREADS / 32];
    unsigned prefix;
    unsigned long long above;
    int token;
};

__device__ unsigned long long block_sum_u64(unsigned long long v, Shared& sh) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    __syncthreads();
    if ((threadIdx.x & 31) == 0) sh.scan[threadIdx.x >> 5] = v;
    __syncthreads();
    unsigned long long total = 0;
    for (int w = 0; w < THREADS / 32; ++w) total += sh.scan[w];
    return total;
}

// Radix descent over 32-bit keys, 8 bits at a time, from the top: returns the key of the element
// at which the running total of `weight` (in descending key order, inclusive) first reaches
// `target`. weight_of(i, key) gives each element's weight (0 excludes it). Each warp counts
// into its own histogram (`warp_hist`, 32 x 256 in dynamic shared memory): most keys share
// their top bits, and one shared histogram would serialise the whole vocabulary on one bin.
template <typename WeightFn>
__device__ unsigned radix_descend(const float* values, unsigned long long target, WeightFn weight_of,
                                  Shared& sh, unsigned long long* warp_hist) {
    __syncthreads();  // every thread has read the previous descent's result
    if (threadIdx.x == 0) {
        sh.prefix = 0;
        sh.above = 0;
    }
    unsigned long long* mine = warp_hist + (threadIdx.x >> 5) * 256;
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int b = threadIdx.x; b < 32 * 256; b += THREADS) warp_hist[b] = 0;
        __syncthreads();
        const unsigned prefix = sh.prefix;
        const unsigned high_mask = shift == 24 ? 0u : (0xffffffffu << (shift + 8));
        for (int i = threadIdx.x; i < qw::vocab; i += THREADS) {
            const unsigned key = order_key(values[i]);
            if ((key & high_mask) != (prefix & high_mask)) continue;
            const unsigned long long w = weight_of(i, key);
            if (w) atomicAdd(&mine[(key >> shift) & 0xffu], w);
        }
        __syncthreads();
        for (int b = threadIdx.x; b < 256; b += THREADS) {
            unsigned long long total = 0;
            for (int w = 0; w < 32; ++w) total += warp_hist[w * 256 + b];
            sh.hist[b] = total;
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            unsigned long long above = sh.above;
            int bin = 0;
            for (int b = 255; b >= 0; --b) {
                if (above + sh.hist[b] >= target) {
                    bin = b;
                    break;
                }
                above += sh.hist[b];
            }
            sh.above = above;
            sh.prefix = prefix | (static_cast<unsigned>(bin) << shift);
        }
        __syncthreads();
    }
    return sh.prefix;
}
}  // namespace

// Step 1, many blocks: penalised logits into `work` (logits stay untouched, for tests and
// last_logits), and each block's first maximum into partial_val / partial_idx.
// seen: 1 for every token in the context (repetition penalty); counts: occurrences in the reply.
extern "C" __global__ void __launch_bounds__(256)
    sample_prepare(const float* __restrict__ logits, float* __restrict__ work,
                   const SampleParams* __restrict__ params,
                   const unsigned char* __restrict__ seen, const int* __restrict__ counts,
                   float* __restrict__ partial_val, int* __restrict__ partial_idx) {
    __shared__ float best_val[8];
    __shared__ int best_idx[8];
    const SampleParams p = *params;
    float best = QW_NEG_INF;
    int best_i = 0x7fffffff;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < qw::vocab; i += gridDim.x * blockDim.x) {
        float l = logits[i];
        if (p.repetition_penalty != 1.f && seen[i])
            l = l > 0.f ? l / p.repetition_penalty : l * p.repetition_penalty;
        const int c = counts[i];
        if (c) l -= p.presence_penalty + p.frequency_penalty * static_cast<float>(c);
        work[i] = l;
        if (l > best || (l == best && i < best_i)) {
            best = l;
            best_i = i;
        }
    }
    argmax_warp(best, best_i);
    if ((threadIdx.x & 31) == 0) {
        best_val[threadIdx.x >> 5] = best;
        best_idx[threadIdx.x >> 5] = best_i;
    }
    __syncthreads();
    if (threadIdx.x == 0) {  // already holds warp 0's maximum
        for (int w = 1; w < static_cast<int>(blockDim.x >> 5); ++w)
            argmax_merge(best, best_i, best_val[w], best_idx[w]);
        partial_val[blockIdx.x] = best;
        partial_idx[blockIdx.x] = best_i;
    }
}

// Step 2, one block: the maximum over the partials; greedy stops there, sampling goes on over
// `work`. Writes the token to *token_out, counts it, marks it seen, and advances *pos_ptr when
// it is set. Needs 64 KiB of dynamic shared memory (per-warp radix histograms).
extern "C" __global__ void __launch_bounds__(THREADS)
    sample_token(const float* __restrict__ work, const SampleParams* __restrict__ params,
                 const float* __restrict__ partial_val, const int* __restrict__ partial_idx,
                 int partials, unsigned char* __restrict__ seen, int* __restrict__ counts,
                 int* __restrict__ token_out, int* __restrict__ pos_ptr) {
    __shared__ Shared sh;
    extern __shared__ unsigned long long warp_hist[];
    const SampleParams p = *params;
    const int tid = threadIdx.x;
    float best = QW_NEG_INF;
    int best_i = 0x7fffffff;
    for (int b = tid; b < partials; b += THREADS)
        argmax_merge(best, best_i, partial_val[b], partial_idx[b]);
    argmax_warp(best, best_i);
    if ((tid & 31) == 0) {
        sh.best_val[tid >> 5] = best;
        sh.best_idx[tid >> 5] = best_i;
    }
    __syncthreads();
    if (tid == 0) {
        float bv = sh.best_val[0];
        int bi = sh.best_idx[0];
        for (int w = 1; w < THREADS / 32; ++w) argmax_merge(bv, bi, sh.best_val[w], sh.best_idx[w]);
        sh.best_val[0] = bv;
        sh.token = bi;
    }
    __syncthreads();
    const float max_logit = sh.best_val[0];

    if (p.temperature > 0.f) {
        // 2. top-k: the key of the k-th largest logit (ties at the cut are kept, as on the CPU).
        unsigned kth_key = 0;
        if (p.top_k > 0 && p.top_k < qw::vocab) {
            kth_key = radix_descend(work, static_cast<unsigned long long>(p.top_k),
                                    [](int, unsigned) { return 1ull; }, sh, warp_hist);
        }
        // Each candidate's weight: exp((l - max) / T) in (0, 1], as 2^32 fixed point.
        const float inv_t = 1.f / p.temperature;
        auto fixed_prob = [&](int i, unsigned key) -> unsigned long long {
            if (key < kth_key) return 0ull;
            return static_cast<unsigned long long>(expf((work[i] - max_logit) * inv_t) * FIXED_ONE);
        };
        // 3. top-p: the smallest probability whose descending running mass reaches top_p.
        unsigned long long local = 0;
        for (int i = tid; i < qw::vocab; i += THREADS) local += fixed_prob(i, order_key(work[i]));
        const unsigned long long total = block_sum_u64(local, sh);
        unsigned p_key = 0;
        if (p.top_p < 1.f) {
            const unsigned long long target =
                static_cast<unsigned long long>(static_cast<double>(p.top_p) * total);
            p_key = radix_descend(work, target > 0 ? target : 1ull, fixed_prob, sh, warp_hist);
        }
        // 4. min-p relative to the most likely token, whose weight is exactly 1.
        const unsigned long long min_fixed =
            static_cast<unsigned long long>(static_cast<double>(p.min_p) * FIXED_ONE);
        auto kept = [&](int i) -> unsigned long long {
            const unsigned key = order_key(work[i]);
            if (key < p_key) return 0ull;
            const unsigned long long w = fixed_prob(i, key);
            return w >= min_fixed ? w : 0ull;
        };
        // 5. One draw, inverse CDF in vocabulary order over contiguous per-thread slices.
        const int begin = tid * PER_THREAD, end = min(qw::vocab, begin + PER_THREAD);
        unsigned long long mine = 0;
        for (int i = begin; i < end; ++i) mine += kept(i);
        // Exclusive prefix over threads, in thread order.
        unsigned long long incl = mine;
        for (int o = 1; o < 32; o <<= 1) {
            const unsigned long long n = __shfl_up_sync(0xffffffffu, incl, o);
            if ((tid & 31) >= o) incl += n;
        }
        __syncthreads();
        if ((tid & 31) == 31) sh.scan[tid >> 5] = incl;
        __syncthreads();
        unsigned long long warp_base = 0, all = 0;
        for (int w = 0; w < THREADS / 32; ++w) {
            if (w < (tid >> 5)) warp_base += sh.scan[w];
            all += sh.scan[w];
        }
        const unsigned long long before = warp_base + incl - mine;
        const unsigned long long bits = splitmix64(p.seed ^ splitmix64(static_cast<unsigned long long>(p.step)));
        const double u = static_cast<double>(bits >> 11) * (1.0 / 9007199254740992.0);
        const unsigned long long target = static_cast<unsigned long long>(u * static_cast<double>(all));
        if (mine > 0 && target >= before && target < before + mine) {
            unsigned long long run = before;
            for (int i = begin; i < end; ++i) {
                run += kept(i);
                if (target < run) {
                    sh.token = i;
                    break;
                }
            }
        }
        __syncthreads();
    }

    if (tid == 0) {
        const int token = sh.token;
        *token_out = token;
        counts[token] += 1;
        seen[token] = 1;
        if (pos_ptr) *pos_ptr += 1;
    }
}

// seen[ids[i]] = 1 for the n ids of the context (before a reply starts).
extern "C" __global__ void mark_seen(const int* __restrict__ ids, int n,
                                     unsigned char* __restrict__ seen) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
        seen[ids[i]] = 1;
}
