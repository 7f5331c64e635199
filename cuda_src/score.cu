// `qwenchat eval` on the device (qwenchat/engine/cuda/scoring.py): a window's rows of logits
// are reduced where they are, and only a few numbers a row come back, instead of the whole
// rows (151,936 floats each) going to the host to be reduced there (qwenchat/eval.py's Rows).
// The rows themselves come from the LM head as products of the window's rows (gemm.cu): the
// normed rows as bf16 plus the bf16 of what that rounding left, two products summed, so the
// logits are those of the float rows the decode path's LM head takes (within ~1e-5), not of
// rows rounded to bf16 (~1e-3).
#include "common.cuh"

namespace {
constexpr int THREADS = 512;
constexpr int WARPS = THREADS / 32;

// A row's running log-sum-exp as (largest value m, sum of exp(x - m)), and, against a base row,
// the running sum of exp(p - m_p) (p - q) (the KL's numerator); sums in double, each term's
// exp in float (relative error ~1e-7 a term, the host's float32 exp as well).
struct Lse {
    float m;
    double s;
};

__device__ __forceinline__ void lse_add(Lse& a, float x) {
    if (x > a.m) {
        a.s = a.s * static_cast<double>(expf(a.m - x)) + 1.0;
        a.m = x;
    } else {
        a.s += static_cast<double>(expf(x - a.m));
    }
}

// (The sums rescaled to the larger maximum; an empty side, m = -inf with s = 0, adds nothing.)
__device__ __forceinline__ void lse_merge(Lse& a, double& at, Lse b, double bt) {
    if (b.m > a.m) {
        const double f = a.m == QW_NEG_INF ? 0.0 : static_cast<double>(expf(a.m - b.m));
        a.s = a.s * f + b.s;
        at = at * f + bt;
        a.m = b.m;
    } else if (b.m != QW_NEG_INF) {
        const double f = static_cast<double>(expf(b.m - a.m));
        a.s += b.s * f;
        at += bt * f;
    }
}

// The first maximum: on equal values the smaller index, as NumPy's argmax.
__device__ __forceinline__ void first_max(float& v, int& i, float ov, int oi) {
    if (ov > v || (ov == v && oi < i)) {
        v = ov;
        i = oi;
    }
}

struct Side {
    Lse lse;
    double t;  // the base's: sum exp(p - m) (p - q); unused for ours
    float best;
    int at;
};

__device__ __forceinline__ Side side_init() {
    return Side{Lse{QW_NEG_INF, 0.0}, 0.0, QW_NEG_INF, 0x7fffffff};
}

__device__ __forceinline__ void side_merge(Side& a, const Side& b) {
    lse_merge(a.lse, a.t, b.lse, b.t);
    first_max(a.best, a.at, b.best, b.at);
}

__device__ __forceinline__ Side side_shuffle(const Side& a, int offset) {
    Side b;
    b.lse.m = __shfl_xor_sync(0xffffffffu, a.lse.m, offset);
    b.lse.s = __shfl_xor_sync(0xffffffffu, a.lse.s, offset);
    b.t = __shfl_xor_sync(0xffffffffu, a.t, offset);
    b.best = __shfl_xor_sync(0xffffffffu, a.best, offset);
    b.at = __shfl_xor_sync(0xffffffffu, a.at, offset);
    return b;
}

// The whole block's merge (every thread returns it): warps by shuffles, then warp 0 over the
// warps' results in a fixed order, so the sums do not depend on timing.
__device__ __forceinline__ Side side_block(Side v, Side* shared) {
    for (int offset = 16; offset > 0; offset >>= 1) side_merge(v, side_shuffle(v, offset));
    if ((threadIdx.x & 31) == 0) shared[threadIdx.x >> 5] = v;
    __syncthreads();
    Side all = shared[0];
    for (int w = 1; w < WARPS; ++w) side_merge(all, shared[w]);
    __syncthreads();  // (the shared slots are taken again by the next merge)
    return all;
}
}  // namespace

// hi[r] + lo[r] = rmsnorm(x[r]) * w, each bf16 (lo: what rounding hi to bf16 left); rows of
// `hidden` floats, one block a row (the norm as rmsnorm_gemv computes it: gemv.cuh); hi's and
// lo's rows `ld` elements apart (lo = hi + hidden, ld = 2 hidden: each row's two parts side by
// side, one product of twice the depth).
extern "C" __global__ void __launch_bounds__(256)
    rmsnorm_rows_split(const float* __restrict__ x, const bf16_t* __restrict__ w, int hidden,
                       float eps, bf16_t* __restrict__ hi, bf16_t* __restrict__ lo, int ld) {
    __shared__ float scratch[32];
    const long long r = blockIdx.x;
    const float* xr = x + r * hidden;
    float ss = 0.f;
    for (int j = threadIdx.x; j < hidden; j += blockDim.x) ss += xr[j] * xr[j];
    const float rstd = rsqrtf(block_sum(ss, scratch) / hidden + eps);
    for (int j = threadIdx.x; j < hidden; j += blockDim.x) {
        const float v = xr[j] * rstd * bf16_to_f32(w[j]);
        const bf16_t h = f32_to_bf16(v);
        hi[r * ld + j] = h;
        lo[r * ld + j] = f32_to_bf16(v - bf16_to_f32(h));
    }
}

// Per row r of `ours` (rows `ld` floats apart, `vocab` logits each), out[8 r ..]: our
// log-sum-exp, our logit of targets[r], our first maximum's index; with `base` (its rows at the
// same stride), KL(base || ours), the base's log-sum-exp, its logit of the target and its first
// maximum's index; the last slot 0. (Without a base those four are NaN.) One block a row.
extern "C" __global__ void __launch_bounds__(THREADS)
    score_rows(const float* __restrict__ ours, const float* __restrict__ base, long long ld,
               int vocab, const int* __restrict__ targets, double* __restrict__ out) {
    __shared__ Side shared[WARPS];
    const long long r = blockIdx.x;
    const float* q = ours + r * ld;
    const float* p = base ? base + r * ld : nullptr;
    Side mine = side_init(), theirs = side_init();
    for (int i = threadIdx.x; i < vocab; i += THREADS) {
        const float qi = q[i];
        lse_add(mine.lse, qi);
        first_max(mine.best, mine.at, qi, i);
        if (p) {
            const float pi = p[i];
            // theirs.t rides with theirs.lse: rescaled whenever its maximum moves
            if (pi > theirs.lse.m) {
                const double f = theirs.lse.m == QW_NEG_INF
                                     ? 0.0 : static_cast<double>(expf(theirs.lse.m - pi));
                theirs.lse.s = theirs.lse.s * f + 1.0;
                theirs.t = theirs.t * f + static_cast<double>(pi - qi);
                theirs.lse.m = pi;
            } else {
                const double e = static_cast<double>(expf(pi - theirs.lse.m));
                theirs.lse.s += e;
                theirs.t += e * static_cast<double>(pi - qi);
            }
            first_max(theirs.best, theirs.at, pi, i);
        }
    }
    mine = side_block(mine, shared);
    if (p) theirs = side_block(theirs, shared);
    if (threadIdx.x != 0) return;
    double* o = out + 8 * r;
    const int target = targets[r];
    const double lse_q = static_cast<double>(mine.lse.m) + log(mine.lse.s);
    o[0] = lse_q;
    o[1] = static_cast<double>(q[target]);
    o[2] = static_cast<double>(mine.at);
    o[7] = 0.0;
    if (p) {
        const double lse_p = static_cast<double>(theirs.lse.m) + log(theirs.lse.s);
        // KL = sum p_i ((p_i - lse_p) - (q_i - lse_q)) = t / s - lse_p + lse_q
        o[3] = fmax(theirs.t / theirs.lse.s - lse_p + lse_q, 0.0);
        o[4] = lse_p;
        o[5] = static_cast<double>(p[target]);
        o[6] = static_cast<double>(theirs.at);
    } else {
        const double nan = __longlong_as_double(0x7ff8000000000000LL);
        o[3] = o[4] = o[5] = o[6] = nan;
    }
}

// out[r k + j] = rows[r ld + ids[r k + j]]: our logits at a saved base's top-k ids. One block
// a row.
extern "C" __global__ void __launch_bounds__(256)
    gather_logits(const float* __restrict__ rows, long long ld, const int* __restrict__ ids,
                  int k, float* __restrict__ out) {
    const long long r = blockIdx.x;
    for (int j = threadIdx.x; j < k; j += blockDim.x) out[r * k + j] = rows[r * ld + ids[r * k + j]];
}
