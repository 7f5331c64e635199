// Choosing the next token on the GPU, so only its id (4 bytes) goes back to the host.
// Same rules as qwenchat/sampling/sampler.py: repetition penalty over the context, presence and
// frequency penalties over the reply, then exact argmax (temperature 0) or temperature, top-k,
// top-p, min-p and one draw whose uniform number is splitmix64(seed ^ splitmix64(step)).
// One block does it all. Thresholds are found by radix selection over the float bits, and
// probability masses are summed as 64-bit fixed point, so the result does not depend on the
// order in which threads add: the same seed gives the same token on every run.
#include "sampling.cuh"

namespace {
constexpr int THREADS = 1024;
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
        const float l = qws::penalized(logits[i], p, seen[i], counts[i]);
        work[i] = l;
        if (l > best || (l == best && i < best_i)) {
            best = l;
            best_i = i;
        }
    }
    qws::argmax_block<256>(best, best_i, best_val, best_idx);
    if (threadIdx.x == 0) {
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
    __shared__ qws::SampleShared<THREADS> sh;
    extern __shared__ unsigned long long warp_hist[];
    const SampleParams p = *params;
    const int tid = threadIdx.x;
    float best = QW_NEG_INF;
    int best_i = 0x7fffffff;
    for (int b = tid; b < partials; b += THREADS)
        qws::argmax_merge(best, best_i, partial_val[b], partial_idx[b]);
    qws::argmax_block<THREADS>(best, best_i, sh.best_val, sh.best_idx);
    if (tid == 0) {
        sh.best_val[0] = best;
        sh.best_idx[0] = best_i;
    }
    __syncthreads();
    const int token = qws::choose_token<THREADS>(qws::VocabLogits{work}, p, sh.best_val[0], sh.best_idx[0], p.step,
                                                 sh, warp_hist);
    if (tid == 0) {
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

// A speculative pass's tokens kept into the reply, by value: the launch carries them, so the
// host queues it and goes on (no host buffer to keep until the copy has run).
struct KeptTokens {
    int ids[8];      // the first n (a pass's rows at most)
    int n;
    int next_token;  // the next step's input, and its position
    int position;
};

// The kept tokens seen and counted for the penalties, as a plain step counts the token it
// draws (one thread: the ids may repeat), and the next step's token and position.
extern "C" __global__ void count_tokens(const KeptTokens kept, unsigned char* __restrict__ seen,
                                        int* __restrict__ counts, int* __restrict__ token,
                                        int* __restrict__ pos) {
    if (blockIdx.x != 0 || threadIdx.x != 0) return;
    for (int i = 0; i < kept.n; ++i) {
        seen[kept.ids[i]] = 1;
        counts[kept.ids[i]] += 1;
    }
    *token = kept.next_token;
    *pos = kept.position;
}

// A speculative pass's greedy choices where no penalty is on: each row's first maximum (one
// block a row, rows of `vocab` logits), the token a plain greedy step takes from that row.
extern "C" __global__ void __launch_bounds__(THREADS)
    rows_argmax(const float* __restrict__ logits, int vocab, int* __restrict__ out) {
    __shared__ float vals[THREADS / 32];
    __shared__ int idxs[THREADS / 32];
    const float* row = logits + static_cast<long long>(blockIdx.x) * vocab;
    float val = QW_NEG_INF;
    int idx = vocab;
    for (int i = threadIdx.x; i < vocab; i += THREADS) qws::argmax_merge(val, idx, row[i], i);
    qws::argmax_block<THREADS>(val, idx, vals, idxs);
    if (threadIdx.x == 0) out[blockIdx.x] = idx;
}
