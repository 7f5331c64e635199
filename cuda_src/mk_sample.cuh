// Sampling inside the megakernel: the host's parameters, each block's candidates, and block 0's
// choice among them (or over the whole vocabulary).
#pragma once
#include "mk_attention.cuh"

namespace {
using namespace mk;

__device__ __forceinline__ SampleParams read_host_params(const MegaArgs& a, int step) {
    // Three 16-byte reads across PCIe: the parameters (40 bytes), the cancel flag and padding.
    static_assert(sizeof(SampleParams) == 40, "SampleParams layout");
    uint4 w0, w1, w2;
    asm volatile("ld.volatile.global.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(w0.x), "=r"(w0.y), "=r"(w0.z), "=r"(w0.w) : "l"(a.host));
    asm volatile("ld.volatile.global.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(w1.x), "=r"(w1.y), "=r"(w1.z), "=r"(w1.w) : "l"(a.host + 4));
    asm volatile("ld.volatile.global.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(w2.x), "=r"(w2.y), "=r"(w2.z), "=r"(w2.w) : "l"(a.host + 8));
    SampleParams p;
    p.temperature = __uint_as_float(w0.x);
    p.top_p = __uint_as_float(w0.y);
    p.min_p = __uint_as_float(w0.z);
    p.repetition_penalty = __uint_as_float(w0.w);
    p.presence_penalty = __uint_as_float(w1.x);
    p.frequency_penalty = __uint_as_float(w1.y);
    p.top_k = static_cast<int>(w1.z);
    p.step = step;
    p.seed = (static_cast<unsigned long long>(w2.y) << 32) | w2.x;
    return p;
}

// Every thread's copy of this step's parameters (written by the last block before any of its
// tagged outputs that this block has waited for).
__device__ __forceinline__ void load_params(SampleParams* out, const SampleParams* p) {
    const int* src = reinterpret_cast<const int*>(p);
    int* dst = reinterpret_cast<int*>(out);
    for (int i = threadIdx.x; i < 10; i += THREADS) dst[i] = ld_cg_int(src + i);
}
__device__ __forceinline__ bool penalties_on(const SampleParams& p) {
    return p.repetition_penalty != 1.f || p.presence_penalty != 0.f || p.frequency_penalty != 0.f;
}

struct NoPre {
    __device__ int operator()(int) const { return 0; }
};

// What block 0 samples from, as one type so that the sampler is in the kernel once (three
// instances were 136 KB of code: docs/perf.md). The mode says which:
// - VOCAB: the whole (penalised) vocabulary in work;
// - CANDIDATES: the blocks' candidates, slot b * CAND + j being block b's j-th, valid below
//   that block's count (blocks own rising id ranges and list theirs in id order);
// - GATHERED: candidates gathered into shared memory by block 0, their values and the slots
//   they came from (whose ids are read only for the token drawn).
struct StepLogits {
    enum Mode { VOCAB, CANDIDATES, GATHERED };
    Mode mode;
    int count;                    // slots: the vocabulary, blocks x CAND, or those gathered
    const float* work;            // VOCAB
    const int2* cand;             // CANDIDATES, and GATHERED's ids
    const int* counts;            // CANDIDATES: each block's count, in shared memory
    const float* vals;            // GATHERED, in shared memory
    const unsigned short* slots;  // GATHERED, in shared memory
    __device__ __forceinline__ int n() const { return count; }
    __device__ __forceinline__ bool valid(int i) const {
        return mode != CANDIDATES || i % CAND < counts[i / CAND];
    }
    __device__ __forceinline__ float value(int i) const {
        if (mode == GATHERED) return vals[i];
        if (mode == VOCAB) return ld_cg(work + i);
        return __int_as_float(ld_cg_int(&cand[i].x));
    }
    __device__ __forceinline__ int id(int i) const {
        if (mode == VOCAB) return i;
        return ld_cg_int(&cand[mode == GATHERED ? slots[i] : i].y);
    }
};

// This block's sampling candidates: every one of its n logits (vals, in shared memory; ids
// from lo) at or above its k-th largest, written in id order to its CAND slots. Returns how
// many there are (more than CAND: they did not fit, and block 0 must use the whole vocabulary).
// If every block offers its top k, the union holds every logit at or above the k-th largest of
// the vocabulary: a logit missing from it would have k larger ones in its own block alone.
// scratch: 256 + 2 + WARPS words of shared memory. kth: the key of the block's k-th largest.
__device__ int block_candidates(const MegaArgs& a, const float* vals, int lo, int n, int k,
                                unsigned* scratch, unsigned& kth) {
    kth = qws::block_kth_key<THREADS>(vals, n, k, scratch, scratch + 256);
    const int per = (n + THREADS - 1) / THREADS;  // contiguous slices keep the id order
    const int begin = min(n, static_cast<int>(threadIdx.x) * per), end = min(n, begin + per);
    int mine = 0;
    for (int i = begin; i < end; ++i) mine += qws::order_key(vals[i]) >= kth;
    int total;
    int at = block_exclusive_scan<THREADS>(mine, reinterpret_cast<int*>(scratch + 258), total);
    int2* out = a.cand + blockIdx.x * CAND;
    for (int i = begin; i < end; ++i) {
        if (qws::order_key(vals[i]) >= kth) {
            if (at < CAND) out[at] = make_int2(__float_as_int(vals[i]), lo + i);
            ++at;
        }
    }
    return total;
}

// Block 0's choice of the step's token, from the blocks' published bests (4 tagged words a
// block: best logit, its id, what candidates it offers, the key of its k-th largest).
// Sampling with top-k <= CAND, when every block offered its top k' >= k: only candidates at or
// above the largest of the blocks' k-th keys can be in the vocabulary's top k (that block alone
// has k logits at or above it), usually a few times k of them; they are gathered into shared
// memory in id order and sampled there. Otherwise the sampler reads all the candidates, or the
// whole vocabulary, from global memory. red: the block's 2 x RED scratch floats.
__device__ __noinline__ int block0_choose(const MegaArgs& a, const SampleParams& p, bool offer,
                                          unsigned best_tag, float* red,
                                          qws::SampleShared<THREADS>& sh, int fallback) {
    // Gathered candidates: GATHER values and slot numbers after HISTS radix histograms.
    constexpr int HISTS = 4, GATHER = 4096;
    static_assert(HISTS * 256 * 8 + GATHER * 6 <= UNION_BYTES, "the gathered candidates fit");
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, grid = gridDim.x;
    unsigned* scratch = reinterpret_cast<unsigned*>(red);
    unsigned* warp_k = scratch + 300;                 // [WARPS]
    int* counts = reinterpret_cast<int*>(red) + 512;  // [grid]: each block's candidates
    int* kept = reinterpret_cast<int*>(red) + 1024;   // [grid]: those gathered, then offsets
    float best = QW_NEG_INF;
    int best_i = 0x7fffffff;
    bool usable = offer;
    unsigned k_lo = 0;
    for (int b = threadIdx.x; b < grid; b += THREADS) {
        const tagged_t* at[4] = {a.best + 4 * b, a.best + 4 * b + 1, a.best + 4 * b + 2,
                                 a.best + 4 * b + 3};
        float got[4];
        take_all(at, best_tag, got);
        qws::argmax_merge(best, best_i, got[0], __float_as_int(got[1]));
        const int word = __float_as_int(got[2]);
        usable = usable && word >= 0 && (word >> 16) >= p.top_k && (word & 0xffff) <= CAND;
        counts[b] = word & 0xffff;
        k_lo = max(k_lo, __float_as_uint(got[3]));
    }
    k_lo = __reduce_max_sync(0xffffffffu, k_lo);
    if (lane == 0) warp_k[warp] = k_lo;
    if (p.temperature > 0.f) __threadfence();  // acquire: work[], the candidates
    usable = __syncthreads_and(usable);        // (also: every warp's k_lo is written)
    qws::argmax_block<THREADS>(best, best_i, sh.best_val, sh.best_idx);
    if (threadIdx.x == 0) {
        sh.best_val[0] = best;
        sh.best_idx[0] = min(max(best_i, 0), qw::vocab - 1);
    }
    __syncthreads();
    if (QW_MK_SKIP & 8) return fallback;
    unsigned long long* hist = reinterpret_cast<unsigned long long*>(vec_buf());
    StepLogits src{StepLogits::VOCAB, qw::vocab, a.work, a.cand, counts, nullptr, nullptr};
    int hists = WARPS;
    if (usable) {  // (the same in every thread)
        for (int w = 0; w < WARPS; ++w) k_lo = max(k_lo, warp_k[w]);
        // Gather the candidates at or above k_lo: count them per block, offsets, then copy.
        for (int b = warp; b < grid; b += WARPS) {
            int n = 0;
            for (int j = lane; j < CAND; j += 32) {
                const bool in = j < counts[b] && qws::order_key(__int_as_float(
                                                     ld_cg_int(&a.cand[b * CAND + j].x))) >= k_lo;
                n += __popc(__ballot_sync(0xffffffffu, in));
            }
            if (lane == 0) kept[b] = n;
        }
        __syncthreads();
        if (warp == 0) {  // exclusive offsets, in place; the total to scratch[316]
            const int per = (grid + 31) / 32, lo = min(grid, lane * per), hi = min(grid, lo + per);
            int mine = 0;
            for (int b = lo; b < hi; ++b) mine += kept[b];
            const int incl = warp_inclusive_scan(mine);
            int run = incl - mine;
            for (int b = lo; b < hi; ++b) {
                const int n = kept[b];
                kept[b] = run;
                run += n;
            }
            if (lane == 31) scratch[316] = incl;
        }
        __syncthreads();
        const int m = static_cast<int>(scratch[316]);
        if (m > GATHER) {
            src.mode = StepLogits::CANDIDATES;
            src.count = grid * CAND;
        } else {
            float* vals = vec_buf() + HISTS * 256 * 2;
            unsigned short* slots = reinterpret_cast<unsigned short*>(vals + GATHER);
            for (int b = warp; b < grid; b += WARPS) {
                int at = kept[b];
                for (int j = lane; j < CAND; j += 32) {
                    const int c = j < counts[b] ? ld_cg_int(&a.cand[b * CAND + j].x) : 0;
                    const bool in = j < counts[b] && qws::order_key(__int_as_float(c)) >= k_lo;
                    const unsigned ballot = __ballot_sync(0xffffffffu, in);
                    if (in) {
                        const int to = at + __popc(ballot & ((1u << lane) - 1u));
                        vals[to] = __int_as_float(c);
                        slots[to] = static_cast<unsigned short>(b * CAND + j);
                    }
                    at += __popc(ballot);
                }
            }
            __syncthreads();
            src.mode = StepLogits::GATHERED;
            src.count = m;
            src.vals = vals;
            src.slots = slots;
            hists = HISTS;
        }
    }
    return qws::choose_token<THREADS>(src, p, sh.best_val[0], sh.best_idx[0], p.step, sh, hist,
                                      hists);
}
}  // namespace
