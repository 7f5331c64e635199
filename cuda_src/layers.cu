// Per-token building blocks of a Qwen3 layer: embedding rows, RMSNorm, matrix-vector products
// with 16-byte weight loads (decode), QK-norm + RoPE + KV-cache append, SwiGLU; and the random
// weights of `bench --config`, drawn on the device.
// The residual stream is float32; the KV cache is bf16; the linear layers' weights are bf16 or
// FP8 (weights.cuh).
#include "common.cuh"
#include "qwen3.cuh"
#include "weights.cuh"

constexpr int GEMV_THREADS = 256;
constexpr int GEMV_WARPS = GEMV_THREADS / 32;

__device__ __forceinline__ float silu(float g) { return g / (1.f + __expf(-g)); }

// x[i, :] = embed[ids[i], :] for n tokens (one block per token).
extern "C" __global__ void embed_rows(const int* __restrict__ ids, int n,
                                      const bf16_t* __restrict__ embed, float* __restrict__ x) {
    const int row = blockIdx.x;
    if (row >= n) return;
    const bf16_t* src = embed + static_cast<long long>(ids[row]) * qw::hidden;
    for (int j = threadIdx.x; j < qw::hidden; j += blockDim.x)
        x[static_cast<long long>(row) * qw::hidden + j] = bf16_to_f32(src[j]);
}

// out[i, :] = bf16(rmsnorm(x[i, :]) * w) for n rows (one block per row): prefill's GEMM input.
extern "C" __global__ void rmsnorm_rows(const float* __restrict__ x, const bf16_t* __restrict__ w,
                                        int n, float eps, bf16_t* __restrict__ out) {
    __shared__ float scratch[32];
    const int row = blockIdx.x;
    if (row >= n) return;
    const float* xr = x + static_cast<long long>(row) * qw::hidden;
    float ss = 0.f;
    for (int j = threadIdx.x; j < qw::hidden; j += blockDim.x) ss += xr[j] * xr[j];
    const float rstd = rsqrtf(block_sum(ss, scratch) / qw::hidden + eps);
    for (int j = threadIdx.x; j < qw::hidden; j += blockDim.x)
        out[static_cast<long long>(row) * qw::hidden + j] = f32_to_bf16(xr[j] * rstd * bf16_to_f32(w[j]));
}

// Each warp computes ROWS dot products of W rows (format F8, weights.cuh) with a K-vector in
// shared memory. The weights do not depend on the vector, so a lane's first loads for all its
// rows are issued before the block prepares the vector (`prepare`, which ends with
// __syncthreads): the memory latency of the weight stream overlaps the vector's preparation
// instead of following it.
template <int K, int ROWS, bool F8, typename Prepare>
__device__ __forceinline__ void warp_rows_dot(const unsigned char* __restrict__ W, int rows,
                                              int row0, const float* xs, Prepare prepare,
                                              float* result) {
    const int lane = threadIdx.x & 31;
    constexpr int PER = piece_values<F8>();
    constexpr long long RB = row_bytes<F8>(K);
    static_assert(K % PER == 0, "rows are whole 16-byte pieces");
    constexpr int STEPS = K / PER;  // 16-byte pieces per row
    constexpr int PER_LANE = (STEPS + 31) / 32;
    constexpr int PRE = PER_LANE < 16 / ROWS ? PER_LANE : 16 / ROWS;  // <= 16 loads in flight
    WeightPiece first[PRE][ROWS];
#pragma unroll
    for (int p = 0; p < PRE; ++p)
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
            const int c = lane + p * 32, row = row0 + r;
            first[p][r] = (row < rows && c < STEPS) ? load_piece<F8, K>(W + row * RB, c)
                                                    : no_piece();
        }
    prepare();
    float acc[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; ++r) acc[r] = 0.f;
#pragma unroll
    for (int p = 0; p < PRE; ++p) {
        const int c = lane + p * 32;
        if (c < STEPS) {
#pragma unroll
            for (int r = 0; r < ROWS; ++r) acc[r] += piece_dot<F8>(first[p][r], xs + c * PER);
        }
    }
    for (int c = lane + PRE * 32; c < STEPS; c += 32) {
        WeightPiece w[ROWS];
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
            const int row = row0 + r;
            w[r] = row < rows ? load_piece<F8, K>(W + row * RB, c) : no_piece();
        }
#pragma unroll
        for (int r = 0; r < ROWS; ++r) acc[r] += piece_dot<F8>(w[r], xs + c * PER);
    }
#pragma unroll
    for (int r = 0; r < ROWS; ++r) result[r] = warp_sum(acc[r]);
}

// out[r] = W[r, :] . (rmsnorm(x) * norm_w): fused norm + GEMV for Q/K/V, gate/up and the LM head.
// Each block recomputes the norm of the K-vector (a few KB, from L2) instead of a separate kernel.
template <int ROWS, bool F8>
__device__ void rmsnorm_gemv(const float* __restrict__ x, const bf16_t* __restrict__ norm_w,
                             const void* __restrict__ W, int rows, float eps,
                             float* __restrict__ out) {
    __shared__ __align__(16) float xs[qw::hidden];
    __shared__ float scratch[32];
    const int warp = threadIdx.x >> 5;
    const int row0 = (blockIdx.x * GEMV_WARPS + warp) * ROWS;
    float result[ROWS];
    warp_rows_dot<qw::hidden, ROWS, F8>(static_cast<const unsigned char*>(W), rows, row0, xs, [&] {
        float ss = 0.f;
        for (int j = threadIdx.x; j < qw::hidden; j += blockDim.x) ss += x[j] * x[j];
        const float rstd = rsqrtf(block_sum(ss, scratch) / qw::hidden + eps);
        for (int j = threadIdx.x; j < qw::hidden; j += blockDim.x)
            xs[j] = x[j] * rstd * bf16_to_f32(norm_w[j]);
        __syncthreads();
    }, result);
    if ((threadIdx.x & 31) == 0) {
#pragma unroll
        for (int r = 0; r < ROWS; ++r)
            if (row0 + r < rows) out[row0 + r] = result[r];
    }
}

// Q/K/V and gate/up: the model's weight format.
extern "C" __global__ void __launch_bounds__(GEMV_THREADS)
    rmsnorm_gemv2(const float* x, const bf16_t* norm_w, const void* W, int rows, float eps,
                  float* out) {
    rmsnorm_gemv<2, qw::fp8>(x, norm_w, W, rows, eps, out);
}

// The LM head: bf16 in every format.
extern "C" __global__ void __launch_bounds__(GEMV_THREADS)
    rmsnorm_gemv4(const float* x, const bf16_t* norm_w, const bf16_t* W, int rows, float eps,
                  float* out) {
    rmsnorm_gemv<4, false>(x, norm_w, W, rows, eps, out);
}

// The longest vector a residual GEMV stages in shared memory at once: 48 KB, all the static
// shared memory a block may have, and 8B's SwiGLU output exactly. Longer ones (14B's and 32B's:
// 17,408 and 25,600 floats) go through in chunks of it, each lane visiting its columns in the
// same order as in one piece, so the sums are the same.
constexpr int VEC_CHUNK = 12288;

// x[row] += W[row, :] . v for a K-vector made chunk by chunk: `make(begin, count, xs)` writes
// v[begin .. begin + count) to xs and returns; a barrier follows.
template <int K, bool F8, typename Make>
__device__ __forceinline__ float warp_row_dot_chunked(const unsigned char* __restrict__ W,
                                                      int rows, int row, float* xs, Make make) {
    constexpr int PER = piece_values<F8>();
    static_assert(VEC_CHUNK % (32 * PER) == 0, "a chunk is whole 16-byte pieces of every lane");
    const int lane = threadIdx.x & 31;
    const unsigned char* w = W + row * row_bytes<F8>(K);
    float acc = 0.f;
    for (int begin = 0; begin < K; begin += VEC_CHUNK) {
        const int count = min(VEC_CHUNK, K - begin);
        if (begin > 0) __syncthreads();  // every warp is done with the last chunk
        make(begin, count, xs);
        __syncthreads();
        const int steps = count / PER, first = begin / PER;
        for (int c = lane; c < steps; c += 32)
            if (row < rows) acc += piece_dot<F8>(load_piece<F8, K>(w, first + c), xs + c * PER);
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
    warp_rows_dot<qw::q_size, 1, qw::fp8>(static_cast<const unsigned char*>(W), rows, row, vs, [&] {
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
        warp_rows_dot<I, 1, qw::fp8>(w, rows, row, vs, [&] {
            for (int j = threadIdx.x; j < I; j += blockDim.x) vs[j] = silu(gu[j]) * gu[I + j];
            __syncthreads();
        }, result);
    } else {
        result[0] = warp_row_dot_chunked<I, qw::fp8>(w, rows, row, vs,
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
    const long long total = static_cast<long long>(n) * qw::intermediate;
    for (long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; i < total;
         i += static_cast<long long>(gridDim.x) * blockDim.x) {
        const long long row = i / qw::intermediate, col = i % qw::intermediate;
        const float* g = gu + row * 2 * qw::intermediate;
        act[i] = f32_to_bf16(silu(g[col]) * g[qw::intermediate + col]);
    }
}

// For token t (blockIdx.x) and head h (blockIdx.y over q heads then kv heads): RMSNorm over
// head_dim with q_norm / k_norm, rotate-half RoPE at position pos0 + t, then write q (bf16) or
// append k and v to the layer's cache ([kv_head][capacity][head_dim], bf16). pos0 is read from
// device memory when pos_ptr is set, so a captured decode graph follows the cache position.
extern "C" __global__ void qk_norm_rope_store(const float* __restrict__ qkv, int n,
                                              const int* __restrict__ pos_ptr, int pos_arg,
                                              const bf16_t* __restrict__ q_norm,
                                              const bf16_t* __restrict__ k_norm,
                                              const float* __restrict__ inv_freq, float eps,
                                              int capacity, bf16_t* __restrict__ q_out,
                                              bf16_t* __restrict__ k_cache,
                                              bf16_t* __restrict__ v_cache) {
    constexpr int HD = qw::head_dim, HALF = HD / 2;
    __shared__ float scratch[32];
    const int t = blockIdx.x, h = blockIdx.y;
    if (t >= n) return;
    const int pos = (pos_ptr ? *pos_ptr : pos_arg) + t;
    const float* row = qkv + static_cast<long long>(t) * (qw::q_size + 2 * qw::kv_size);
    const bool is_q = h < qw::heads;
    const int kvh = h - qw::heads;
    const float* src = is_q ? row + h * HD : row + qw::q_size + kvh * HD;
    // Thread i < HALF rotates the pair (i, i + HALF); the block is rounded up to whole warps.
    const int i = threadIdx.x;
    const bool active = i < HALF;
    float a = active ? src[i] : 0.f, b = active ? src[i + HALF] : 0.f;
    const float rstd = rsqrtf(block_sum(a * a + b * b, scratch) / HD + eps);
    if (!active) return;
    const bf16_t* nw = is_q ? q_norm : k_norm;
    a *= rstd * bf16_to_f32(nw[i]);
    b *= rstd * bf16_to_f32(nw[i + HALF]);
    float s, c;
    sincosf(static_cast<float>(pos) * inv_freq[i], &s, &c);
    const float ra = a * c - b * s, rb = b * c + a * s;
    if (is_q) {
        bf16_t* dst = q_out + static_cast<long long>(t) * qw::q_size + h * HD;
        dst[i] = f32_to_bf16(ra);
        dst[i + HALF] = f32_to_bf16(rb);
    } else {
        const long long at = (static_cast<long long>(kvh) * capacity + pos) * HD;
        k_cache[at + i] = f32_to_bf16(ra);
        k_cache[at + i + HALF] = f32_to_bf16(rb);
        const float* v = row + qw::q_size + qw::kv_size + kvh * HD;
        v_cache[at + i] = f32_to_bf16(v[i]);
        v_cache[at + i + HALF] = f32_to_bf16(v[i + HALF]);
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
