// Per-token building blocks of a Qwen3 layer: embedding rows, RMSNorm, matrix-vector products
// with 16-byte weight loads (decode), QK-norm + RoPE + KV-cache append, SwiGLU; and the random
// weights of `bench --config`, drawn on the device.
// The residual stream is float32; the KV cache is bf16; the linear layers' weights are bf16,
// FP8 or int4 (weights.cuh).
#include "common.cuh"
#include "kv8.cuh"
#include "qwen3.cuh"
#include "gemv.cuh"

// x[i, :] = embed[ids[i], :] for n tokens (one block per token).
extern "C" __global__ void embed_rows(const int* __restrict__ ids, int n,
                                      const bf16_t* __restrict__ embed, float* __restrict__ x) {
    const int row = blockIdx.x;
    if (row >= n) return;
    const bf16_t* src = embed + static_cast<long long>(ids[row]) * qw::hidden;
    for (int j = threadIdx.x; j < qw::hidden; j += blockDim.x)
        x[static_cast<long long>(row) * qw::hidden + j] = bf16_to_f32(src[j]);
}

// out[i, :] = bf16(rmsnorm(x[i, :]) * w) for n rows (one block per row, of 256 threads or
// more): prefill's GEMM input. A thread's columns (blockDim.x apart) are loaded at once and
// kept in registers for the second pass; its sum adds them in the same order as a loop over
// them would (the columns past the row add 0).
extern "C" __global__ void rmsnorm_rows(const float* __restrict__ x, const bf16_t* __restrict__ w,
                                        int n, float eps, bf16_t* __restrict__ out) {
    dependent_start();
    constexpr int MOST = (qw::hidden + 255) / 256;  // a thread's columns at most
    __shared__ float scratch[32];
    const int row = blockIdx.x;
    if (row >= n) return;
    const float* xr = x + static_cast<long long>(row) * qw::hidden;
    float v[MOST];
#pragma unroll
    for (int i = 0; i < MOST; ++i) {
        const int j = threadIdx.x + i * blockDim.x;
        v[i] = j < qw::hidden ? xr[j] : 0.f;
    }
    float ss = 0.f;
#pragma unroll
    for (int i = 0; i < MOST; ++i) ss += v[i] * v[i];
    const float rstd = rsqrtf(block_sum(ss, scratch) / qw::hidden + eps);
#pragma unroll
    for (int i = 0; i < MOST; ++i) {
        const int j = threadIdx.x + i * blockDim.x;
        if (j < qw::hidden)
            out[static_cast<long long>(row) * qw::hidden + j] = f32_to_bf16(v[i] * rstd * bf16_to_f32(w[j]));
    }
}

// Q/K/V and gate/up: the model's weight format.
extern "C" __global__ void __launch_bounds__(GEMV_THREADS)
    rmsnorm_gemv2(const float* x, const bf16_t* norm_w, const void* W, int rows, float eps,
                  float* out) {
    rmsnorm_gemv<2, qw::wfmt>(x, norm_w, W, rows, eps, out);
}

// The LM head: bf16 in every format.
extern "C" __global__ void __launch_bounds__(GEMV_THREADS)
    rmsnorm_gemv4(const float* x, const bf16_t* norm_w, const bf16_t* W, int rows, float eps,
                  float* out) {
    rmsnorm_gemv<4, qw::BF16>(x, norm_w, W, rows, eps, out);
}

// The longest vector a residual GEMV stages in shared memory at once: 48 KB, all the static
// shared memory a block may have, and 8B's SwiGLU output exactly. Longer ones (14B's and 32B's:
// 17,408 and 25,600 floats) go through in chunks of it, each lane visiting its columns in the
// same order as in one piece, so the sums are the same.
constexpr int VEC_CHUNK = 12288;

// x[row] += W[row, :] . v for a K-vector made chunk by chunk: `make(begin, count, xs)` writes
// v[begin .. begin + count) to xs and returns; a barrier follows.
template <int K, int WF, typename Make>
__device__ __forceinline__ float warp_row_dot_chunked(const unsigned char* __restrict__ W,
                                                      int rows, int row, float* xs, Make make) {
    constexpr int PER = piece_values<WF>();
    static_assert(VEC_CHUNK % (32 * PER) == 0, "a chunk is whole 16-byte pieces of every lane");
    const int lane = threadIdx.x & 31;
    const unsigned char* w = W + row * row_bytes<WF>(K);
    float acc = 0.f;
    for (int begin = 0; begin < K; begin += VEC_CHUNK) {
        const int count = min(VEC_CHUNK, K - begin);
        if (begin > 0) __syncthreads();  // every warp is done with the last chunk
        make(begin, count, xs);
        __syncthreads();
        const int steps = count / PER, first = begin / PER;
        for (int c = lane; c < steps; c += 32)
            if (row < rows) acc += piece_dot<WF>(load_piece<WF, K>(w, first + c), xs + c * PER);
    }
    return warp_sum(acc);
}

// x[r] += W[r, :] . v, where v is the attention output (o_proj). One row per warp: these
// matrices have few rows (hidden_size), and more warps per row keep more loads in flight.
extern "C" __global__ void __launch_bounds__(GEMV_THREADS)
    gemv_residual_attn(const float* __restrict__ v, const void* __restrict__ W, int rows,
                       float* __restrict__ x) {
    __shared__ __align__(16) float vs[qw::q_size];
    const int row = blockIdx.x * GEMV_WARPS + (threadIdx.x >> 5);
    float result[1];
    warp_rows_dot<qw::q_size, 1, qw::wfmt>(static_cast<const unsigned char*>(W), rows, row, vs, [&] {
        for (int j = threadIdx.x; j < qw::q_size; j += blockDim.x) vs[j] = v[j];
        __syncthreads();
    }, result);
    if ((threadIdx.x & 31) == 0 && row < rows) x[row] += result[0];
}

// x[r] += W[r, :] . (silu(gate) * up), with gu = [gate | up] (down_proj, SwiGLU fused in).
extern "C" __global__ void __launch_bounds__(GEMV_THREADS)
    gemv_residual_swiglu(const float* __restrict__ gu, const void* __restrict__ W, int rows,
                         float* __restrict__ x) {
    constexpr int I = qw::intermediate;
    __shared__ __align__(16) float vs[I < VEC_CHUNK ? I : VEC_CHUNK];
    const unsigned char* w = static_cast<const unsigned char*>(W);
    const int row = blockIdx.x * GEMV_WARPS + (threadIdx.x >> 5);
    float result[1];
    if constexpr (I <= VEC_CHUNK) {  // in one piece, the weights' first loads ahead of it
        warp_rows_dot<I, 1, qw::wfmt>(w, rows, row, vs, [&] {
            for (int j = threadIdx.x; j < I; j += blockDim.x) vs[j] = silu(gu[j]) * gu[I + j];
            __syncthreads();
        }, result);
    } else {
        result[0] = warp_row_dot_chunked<I, qw::wfmt>(w, rows, row, vs,
                                                     [&](int begin, int count, float* xs) {
            for (int j = threadIdx.x; j < count; j += blockDim.x)
                xs[j] = silu(gu[begin + j]) * gu[I + begin + j];
        });
    }
    if ((threadIdx.x & 31) == 0 && row < rows) x[row] += result[0];
}

// act[i, j] = bf16(silu(gu[i, j]) * gu[i, I + j]) for n rows: prefill's down_proj input.
extern "C" __global__ void swiglu_rows(const float* __restrict__ gu, int n,
                                       bf16_t* __restrict__ act) {
    dependent_start();
    swiglu_rows_of<qw::intermediate>(gu, n, act);
}

// For token t and head h (q heads then kv heads), one warp each (item t x heads + h, ROPE_WARPS
// to a block): RMSNorm over head_dim with q_norm / k_norm, rotate-half RoPE at position pos0 +
// t, then write q (bf16) or append k and v to the layer's cache (kv8.cuh: bf16 rows, or int8
// rows and their scales, the row's largest value found by the warp). pos0 is read from device
// memory when pos_ptr is set, so a captured decode graph follows the cache position. Lane l
// rotates the pairs (i, i + head_dim / 2) for i = l, l + 32, ...; the sum of squares adds each
// run of 32 pairs' warp sum in turn, as a block of one thread a pair did (so the bits are the
// megakernel's).
constexpr int ROPE_WARPS = 8;
extern "C" __global__ void __launch_bounds__(32 * ROPE_WARPS)
    qk_norm_rope_store(const float* __restrict__ qkv, int n, const int* __restrict__ pos_ptr,
                       int pos_arg, const bf16_t* __restrict__ q_norm,
                       const bf16_t* __restrict__ k_norm, const float* __restrict__ inv_freq,
                       float eps, int capacity, bf16_t* __restrict__ q_out,
                       void* __restrict__ k_cache, void* __restrict__ v_cache) {
    dependent_start();
    constexpr int HD = qw::head_dim, HALF = HD / 2, PER = (HALF + 31) / 32;
    constexpr int HEADS = qw::heads + qw::kv_heads;
    const int item = blockIdx.x * ROPE_WARPS + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    const int t = item / HEADS, h = item % HEADS;
    if (t >= n) return;  // (a whole warp)
    const int pos = (pos_ptr ? *pos_ptr : pos_arg) + t;
    const float* row = qkv + static_cast<long long>(t) * (qw::q_size + 2 * qw::kv_size);
    const bool is_q = h < qw::heads;
    const int kvh = h - qw::heads;
    const float* src = is_q ? row + h * HD : row + qw::q_size + kvh * HD;
    float a[PER], b[PER];
    float total = 0.f;
#pragma unroll
    for (int j = 0; j < PER; ++j) {
        const int i = lane + 32 * j;
        const bool active = i < HALF;
        a[j] = active ? src[i] : 0.f;
        b[j] = active ? src[i + HALF] : 0.f;
        total += warp_sum(a[j] * a[j] + b[j] * b[j]);
    }
    const float rstd = rsqrtf(total / HD + eps);
    const bf16_t* nw = is_q ? q_norm : k_norm;
    float ra[PER], rb[PER];
#pragma unroll
    for (int j = 0; j < PER; ++j) {
        const int i = lane + 32 * j;
        ra[j] = rb[j] = 0.f;
        if (i < HALF) {
            const float x = a[j] * (rstd * bf16_to_f32(nw[i]));
            const float y = b[j] * (rstd * bf16_to_f32(nw[i + HALF]));
            float s, c;
            sincosf(static_cast<float>(pos) * inv_freq[i], &s, &c);
            ra[j] = x * c - y * s;
            rb[j] = y * c + x * s;
        }
    }
    if (is_q) {
        bf16_t* dst = q_out + static_cast<long long>(t) * qw::q_size + h * HD;
#pragma unroll
        for (int j = 0; j < PER; ++j) {
            const int i = lane + 32 * j;
            if (i >= HALF) continue;
            dst[i] = f32_to_bf16(ra[j]);
            dst[i + HALF] = f32_to_bf16(rb[j]);
        }
        return;
    }
    const float* v = row + qw::q_size + qw::kv_size + kvh * HD;
    float va[PER], vb[PER];
#pragma unroll
    for (int j = 0; j < PER; ++j) {
        const int i = lane + 32 * j;
        va[j] = i < HALF ? v[i] : 0.f;
        vb[j] = i < HALF ? v[i + HALF] : 0.f;
    }
    const long long at = (static_cast<long long>(kvh) * capacity + pos) * HD;
    if constexpr (qw::kv8) {
        float k_big = 0.f, v_big = 0.f;
#pragma unroll
        for (int j = 0; j < PER; ++j) {
            k_big = fmaxf(k_big, fmaxf(fabsf(ra[j]), fabsf(rb[j])));
            v_big = fmaxf(v_big, fmaxf(fabsf(va[j]), fabsf(vb[j])));
        }
        const float ks = __fdiv_rn(warp_max(k_big), 127.f);
        const float vs = __fdiv_rn(warp_max(v_big), 127.f);
        signed char* kc = static_cast<signed char*>(k_cache);
        signed char* vc = static_cast<signed char*>(v_cache);
#pragma unroll
        for (int j = 0; j < PER; ++j) {
            const int i = lane + 32 * j;
            if (i >= HALF) continue;
            kc[at + i] = static_cast<signed char>(kv8_code(ra[j], ks));
            kc[at + i + HALF] = static_cast<signed char>(kv8_code(rb[j], ks));
            vc[at + i] = static_cast<signed char>(kv8_code(va[j], vs));
            vc[at + i + HALF] = static_cast<signed char>(kv8_code(vb[j], vs));
        }
        if (lane == 0) {
            const long long r = static_cast<long long>(kvh) * capacity + pos;
            const_cast<float*>(kv8_scales(k_cache, capacity))[r] = ks;
            const_cast<float*>(kv8_scales(v_cache, capacity))[r] = vs;
        }
    } else {
        bf16_t* kc = static_cast<bf16_t*>(k_cache);
        bf16_t* vc = static_cast<bf16_t*>(v_cache);
#pragma unroll
        for (int j = 0; j < PER; ++j) {
            const int i = lane + 32 * j;
            if (i >= HALF) continue;
            kc[at + i] = f32_to_bf16(ra[j]);
            kc[at + i + HALF] = f32_to_bf16(rb[j]);
            vc[at + i] = f32_to_bf16(va[j]);
            vc[at + i + HALF] = f32_to_bf16(vb[j]);
        }
    }
}

// Random weights drawn on the device, value for value as qwenchat/model/random_weights.py
// draws them on the CPU (`bench --config`): element i of a tensor with key `key` takes the
// table entry picked by the top bits of draw_mix(i * 0x9E3779B9 + key).
__device__ __forceinline__ unsigned draw_mix(unsigned x) {  // murmur3's 32-bit finalizer
    x ^= x >> 16;
    x *= 0x85EBCA6Bu;
    x ^= x >> 13;
    x *= 0xC2B2AE35u;
    return x ^ (x >> 16);
}

__device__ __forceinline__ unsigned draw_hash(unsigned i, unsigned key) {
    return draw_mix(i * 0x9E3779B9u + key);
}

// n bf16 values from a table of 65,536 bf16 bit patterns.
extern "C" __global__ void draw_bf16(unsigned short* __restrict__ out, unsigned n, unsigned key,
                                     const unsigned short* __restrict__ table) {
    for (unsigned i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
        out[i] = table[draw_hash(i, key) >> 16];
}

// An FP8 linear layer in its packed rows (weights.cuh): each row's `cols` e4m3 codes from a
// table of 256 codes, then the float scales of its 128 x 128 blocks (`scales`, [row blocks]
// [col_blocks], drawn by the host), then zeros to the row's end; written a 32-bit word at a time.
extern "C" __global__ void draw_fp8_rows(unsigned* __restrict__ out, int rows, int cols,
                                         int row_words, unsigned key,
                                         const unsigned char* __restrict__ table,
                                         const float* __restrict__ scales, int col_blocks) {
    const long long total = static_cast<long long>(rows) * row_words;
    for (long long w = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; w < total;
         w += static_cast<long long>(gridDim.x) * blockDim.x) {
        const int r = static_cast<int>(w / row_words), c = static_cast<int>(w % row_words) * 4;
        unsigned word = 0u;
        if (c < cols) {
            const unsigned i = static_cast<unsigned>(r) * cols + c;
#pragma unroll
            for (int j = 0; j < 4; ++j) word |= static_cast<unsigned>(table[draw_hash(i + j, key) >> 24]) << (8 * j);
        } else if ((c - cols) / 4 < col_blocks) {
            word = __float_as_uint(scales[(r / qw::FP8_BLOCK) * col_blocks + (c - cols) / 4]);
        }
        out[w] = word;
    }
}

// An int4 linear layer in its rows (weights.cuh), as qwenchat/model/random_weights.py draws it:
// column c of row r takes the top 4 bits of draw_hash(r * cols + c, key); group g of row r
// takes h = draw_hash(g * rows + r, key ^ INT4_SALT): scale f16(unit x (h >> 24) / 255 + unit / 2)
// (as float32 arithmetic, then rounded to nearest f16) and zero 7 + (h >> 23 & 1). Written a
// 32-bit word at a time.
extern "C" __global__ void draw_int4_rows(unsigned* __restrict__ out, int rows, int cols,
                                          int row_words, unsigned key, unsigned group_key,
                                          float unit) {
    const long long total = static_cast<long long>(rows) * row_words;
    const int code_words = cols / 8, groups = cols / qw::FP8_BLOCK;
    for (long long w = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; w < total;
         w += static_cast<long long>(gridDim.x) * blockDim.x) {
        const int r = static_cast<int>(w / row_words), c = static_cast<int>(w % row_words);
        unsigned word = 0u;
        if (c < code_words) {
            const unsigned i = static_cast<unsigned>(r) * cols + 8 * c;
            constexpr int ORDER[8] = {0, 2, 4, 6, 1, 3, 5, 7};
#pragma unroll
            for (int j = 0; j < 8; ++j) word |= (draw_hash(i + ORDER[j], key) >> 28) << (4 * j);
        } else if (c - code_words < groups) {
            const unsigned h = draw_hash(static_cast<unsigned>(c - code_words) * rows + r, group_key);
            const float s = __fadd_rn(__fmul_rn(unit, __fdiv_rn(static_cast<float>(h >> 24), 255.f)),
                                      __fmul_rn(unit, 0.5f));  // (no FMA: as NumPy)
            unsigned short sb;
            asm("cvt.rn.f16.f32 %0, %1;" : "=h"(sb) : "f"(s));
            word = sb | ((0x6400u + 7u + ((h >> 23) & 1u)) << 16);
        }
        out[w] = word;
    }
}

// An int4 linear layer's rows (weights.cuh) as bf16 rows, bf16((code - zero) x scale): the
// prefill's GEMMs take int4 weights this way, a matrix at a time (prefill.py). Each thread
// takes words of 8 codes: one 4-byte load, one 16-byte store.
extern "C" __global__ void dequant_int4_rows(const unsigned char* __restrict__ W, int rows,
                                             int cols, uint4* __restrict__ out) {
    const long long row_b = row_bytes<qw::INT4>(cols);
    const int words = cols / 8;
    const long long total = static_cast<long long>(rows) * words;
    for (long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; i < total;
         i += static_cast<long long>(gridDim.x) * blockDim.x) {
        const long long r = i / words;
        const int c = static_cast<int>(i % words);
        const unsigned char* row = W + r * row_b;
        const unsigned w = __ldg(reinterpret_cast<const unsigned*>(row) + c);
        const unsigned rec = __ldg(reinterpret_cast<const unsigned*>(row + cols / 2) + c * 8 / qw::FP8_BLOCK);
        out[i] = int4x8_bf16(w, rec);
    }
}
