// Tagged values: how the megakernel's blocks wait for each other without a grid barrier.
#pragma once
#include "mk_layout.cuh"

namespace {
using namespace mk;

__device__ __forceinline__ unsigned smem_u32(const void* p) {
    return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void put(tagged_t* p, float v, unsigned tag) {
    const tagged_t w = (static_cast<tagged_t>(tag) << 32) | __float_as_uint(v);
    asm volatile("st.relaxed.gpu.global.u64 [%0], %1;" ::"l"(p), "l"(w) : "memory");
}

// A weak load (served by the nearest L2 copy) is tried first; it may be stale, so a tag that
// does not match yet is polled with strong loads (the coherent copy), backing off a little so
// that 132 blocks polling the same lines leave the producers' stores room. Tags carry the
// launch's epoch: a stale copy from an earlier launch can never match.
__device__ __forceinline__ tagged_t ld_tagged_weak(const tagged_t* p) {
    tagged_t w;
    asm volatile("ld.global.cg.u64 %0, [%1];" : "=l"(w) : "l"(p) : "memory");
    return w;
}

__device__ __forceinline__ tagged_t ld_tagged(const tagged_t* p) {
    tagged_t w;
    asm volatile("ld.relaxed.gpu.global.u64 %0, [%1];" : "=l"(w) : "l"(p) : "memory");
    return w;
}

// (128 ns measured best of 32 to 1024, fixed or doubling: docs/perf.md.)
__device__ __forceinline__ void back_off() { asm volatile("nanosleep.u32 128;" ::: "memory"); }

__device__ __forceinline__ unsigned tag_of(tagged_t w) { return static_cast<unsigned>(w >> 32); }
__device__ __forceinline__ float value_of(tagged_t w) {
    return __uint_as_float(static_cast<unsigned>(w));
}

// The values at p[0..N) once each carries `tag` (QW_MK_SKIP & 4: whatever is there, for
// timing): every load is issued before any is checked, so a thread waits about one L2 round
// trip, not N.
template <int N>
__device__ __forceinline__ void take_all(const tagged_t* const (&p)[N], unsigned tag,
                                         float (&out)[N]) {
    tagged_t w[N];
#pragma unroll
    for (int n = 0; n < N; ++n) w[n] = ld_tagged_weak(p[n]);
#pragma unroll
    for (int n = 0; n < N; ++n) {
        while (!(QW_MK_SKIP & 4) && tag_of(w[n]) != tag) {
            back_off();
            w[n] = ld_tagged(p[n]);
        }
        out[n] = value_of(w[n]);
    }
}

// The value at p once it carries `tag`.
__device__ __forceinline__ float take(const tagged_t* p, unsigned tag) {
    const tagged_t* at[1] = {p};
    float got[1];
    take_all(at, tag, got);
    return got[0];
}
}  // namespace
