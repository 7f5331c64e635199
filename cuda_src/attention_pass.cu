// A speculative pass's attention, on the prefill attention's body (prefill_attention.cuh): grid
// (1, kv heads, key splits), each block the n <= 8 rows' `group` query heads of its kv head
// (prefill_attention's PACK), so a kv head's keys are read once a split for every row and head.
// Its output as attn_prefill's (attn_prefill_merge). A program of its own: attention.cu, which a
// first answer waits for, compiles without it.
#include "prefill_attention.cuh"

extern "C" __global__ void __launch_bounds__(PF_THREADS)
    attn_pass_packed(const bf16_t* __restrict__ q, const void* __restrict__ k_cache,
                     const void* __restrict__ v_cache, const int* __restrict__ start_at, int n,
                     int capacity, float scale, bf16_t* __restrict__ out,
                     float* __restrict__ part_o, float* __restrict__ part_ml) {
    dependent_start();
    prefill_attention<true>(q, k_cache, v_cache, start_at, 0, n, capacity, scale, out, part_o,
                            part_ml);
}
