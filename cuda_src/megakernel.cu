// The decode megakernel: whole decode steps, many per launch, in one cooperative grid.
//
// Each step runs every layer (RMSNorm + Q/K/V, QK-norm + RoPE + KV append + flash-decoding
// attention, o_proj + residual, RMSNorm + gate/up + SwiGLU, down + residual), the final norm and
// LM head, then samples on the GPU, streams the token to a host-mapped ring buffer and checks the
// stop conditions (EOS ids, step budget, capacity, a host-written cancel flag). Sampling
// parameters are read from host-mapped memory every step, so a change applies to the next token.
// The host never sits in the per-token loop.
//
// Weights never wait. Every block owns a fixed slice of every weight matrix (and, for
// attention, a fixed set of key/value chunks), so the whole sequence of bytes a block will read
// is known in advance: a ring of shared-memory stages is refilled by bulk asynchronous copies
// (TMA on sm_90, cp.async before) as soon as a stage is consumed, running ahead across phases,
// layers and steps. The dependent chain of a phase is then only its input vector (a few KB from
// L2), the math on shared memory, and the wait for the values it reads.
//
// There is no grid-wide barrier. The phases are Q/K/V | attention | o_proj | gate/up | down,
// five a layer, plus the blocks' best logits and the chosen token a step; every value another
// block reads carries the number of the phase that wrote it (see "tagged" below), and a
// consumer waits only for the values it reads. Attention: the block whose chunk holds the new
// position computes that key and value itself, each warp keeps an online softmax over its keys
// of every stage, and the last block to finish a key/value head merges its chunks.
// Sampling: each block offers its own top-k logits as candidates (top-k <= CAND), block 0
// samples among them; otherwise block 0 samples over the whole vocabulary.
//
// QW_MK_SKIP leaves parts out, for timing only (the results are then wrong): 1 weight copies,
// 2 attention, 4 the waits for other blocks' values, 8 sampling.
#include "sampling.cuh"
#include "weights.cuh"

#ifndef QW_MK_STAGES
#define QW_MK_STAGES 4
#endif
#ifndef QW_MK_STAGE_BYTES
#define QW_MK_STAGE_BYTES 32768
#endif
#ifndef QW_MK_SKIP
#define QW_MK_SKIP 0
#endif
// The most LM-head rows a block owns (the host passes ceil(vocab / blocks)).
#ifndef QW_MK_LM_ROWS
#define QW_MK_LM_ROWS ((QW_VOCAB + 15) / 16)
#endif
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && !defined(QW_MK_NO_TMA)
#define QW_MK_TMA 1
#else
#define QW_MK_TMA 0
#endif

namespace mk {
constexpr int THREADS = 512;
constexpr int WARPS = THREADS / 32;
constexpr int STAGES = QW_MK_STAGES;
constexpr int STAGE = QW_MK_STAGE_BYTES;
constexpr int HD = qw::head_dim;
constexpr int QKV_ROWS = qw::q_size + 2 * qw::kv_size;

// A matrix-vector phase over K columns: each warp holds one segment of the input vector in
// registers (CPL 16-byte chunks per lane), NSEG segments cover K, and WARPS / NSEG row groups
// take the rows of a stage in turn; a row's segment sums are added in a fixed order.
__host__ __device__ constexpr int chunks(int k) { return k / 8; }
__host__ __device__ constexpr int nseg(int k) {
    return (k + 1023) / 1024 < WARPS ? (k + 1023) / 1024 : WARPS;
}
__host__ __device__ constexpr int cpl(int k) { return (chunks(k) + nseg(k) * 32 - 1) / (nseg(k) * 32); }
// Rows of K columns in a stage, for the model's weight format (F8 = qw::fp8) or bf16 (the LM
// head). An FP8 row carries its block scales after its codes (weights.cuh).
template <bool F8 = qw::fp8>
__host__ __device__ constexpr int rows_per_stage(int k) {
    return static_cast<int>(STAGE / row_bytes<F8>(k));
}
constexpr int PAIRS_PER_STAGE =  // gate/up rows, both halves
    static_cast<int>(STAGE / (2 * row_bytes<qw::fp8>(qw::hidden)));
constexpr int KEYS = STAGE / (4 * HD);                      // keys (K and V rows) per stage
constexpr int RED = 1024;                                   // segment sums kept per stage

static_assert(STAGE % 128 == 0, "stages are 128-byte aligned");
static_assert(rows_per_stage(qw::hidden) >= 1 && rows_per_stage(qw::q_size) >= 1 &&
                  rows_per_stage(qw::intermediate) >= 1 && PAIRS_PER_STAGE >= 1 &&
                  rows_per_stage<false>(qw::hidden) >= 1,
              "QW_MK_STAGE_BYTES must hold a whole weight row (and a gate/up pair)");
static_assert(rows_per_stage(qw::hidden) * nseg(qw::hidden) <= RED &&
                  rows_per_stage<false>(qw::hidden) * nseg(qw::hidden) <= RED &&
                  rows_per_stage(qw::q_size) * nseg(qw::q_size) <= RED &&
                  rows_per_stage(qw::intermediate) * nseg(qw::intermediate) <= RED &&
                  2 * PAIRS_PER_STAGE * nseg(qw::hidden) <= RED,
              "a stage holds more rows than the segment-sum buffer");
static_assert(qw::group + 2 <= WARPS, "a warp per query head of a group, plus two");

enum Phase { QKV = 0, ATTN, OPROJ, GATEUP, DOWN, NPHASES };

// Attention: a warp takes KPW keys of each stage, KPASS at a time with LPK lanes a key (DPK
// dimensions a lane) for the scores; for P . V each lane holds DPL of the head's dimensions.
constexpr int DPK = 16, LPK = HD / DPK, DPL = HD / 32;
constexpr int KPW = KEYS / WARPS;
constexpr int KPASS = 32 / LPK < KPW ? 32 / LPK : KPW;
static_assert(HD >= 32 && KPW >= 1 && KPW % KPASS == 0, "attention lane geometry");

// Sampling with top-k <= CAND: each block offers its own top-k (ties included) as candidates.
constexpr int CAND = 64;
constexpr int LM_ROWS = QW_MK_LM_ROWS;

__host__ __device__ constexpr int cmax(int a, int b) { return a > b ? a : b; }
constexpr int HIST_BYTES = WARPS * 256 * 8;
constexpr int VEC_FLOATS = cmax(cmax(qw::hidden, qw::q_size), qw::intermediate);
// The union after the stages: a phase's input vector, or the warps' attention partial sums,
// or the block's LM-head logits, or (block 0, sampling) the radix histograms.
constexpr int UNION_BYTES =
    (cmax(cmax(HIST_BYTES, 4 * VEC_FLOATS), cmax(4 * LM_ROWS, WARPS * qw::group * HD * 4)) + 127) /
    128 * 128;
constexpr int RESID = 512;       // residual rows a block may own
constexpr int MAX_SPLITS = 64;   // flash-decoding chunks per kv head at most
}  // namespace mk

struct MegaLayer {
    const bf16_t* input_norm;
    const unsigned char* qkv;  // the linear layers: rows in the model's format (weights.cuh)
    const bf16_t* q_norm;
    const bf16_t* k_norm;
    const unsigned char* o;
    const bf16_t* post_norm;
    const unsigned char* gate_up;
    const unsigned char* down;
    bf16_t* k_cache;
    bf16_t* v_cache;
};

// Values other blocks wait for are "tagged": 8 bytes, the float (or int) bits and the number
// of the phase that wrote them. A consumer spins until every value it needs carries the tag
// it expects, so no grid-wide barrier is needed anywhere: a phase waits only for the data it
// reads, one L2 round trip after the last producer's store. The host zeroes the tags (and the
// merge counters) before each launch.
typedef unsigned long long tagged_t;

struct MegaArgs {
    const MegaLayer* layers;
    const bf16_t* embed;
    const bf16_t* final_norm;
    const bf16_t* lm_head;
    const float* inv_freq;
    tagged_t* x;       // [hidden] the residual stream
    tagged_t* qkv;     // [q_size + 2 kv_size]
    tagged_t* attn;    // [q_size]
    tagged_t* h;       // [intermediate] SwiGLU output
    tagged_t* best;    // [4 x blocks] each block's best logit, its id, its candidates, its k-th key
    tagged_t* chosen;  // [1] the token block 0 chose, bit 31: stop
    float* logits;
    float* work;
    float* part_o;
    float* part_ml;
    int2* cand;  // [blocks x CAND] each block's sampling candidates: (logit bits, id)
    unsigned* merge_count;  // [kv_heads] chunks finished, counting up through the launch
    unsigned char* seen;
    int* counts;
    int* token;  // the token to feed first (in), the last token sampled (out)
    int* pos;    // cache length (in/out)
    int* stopped;  // set when a reply ends on the GPU (EOS, cancel, full cache): later launches
                   // already queued behind this one return at once
    const int* eos;
    const unsigned* host;  // host-mapped: SampleParams, then the cancel flag
    SampleParams* params;  // [2] the steps' parameters, copied from the host by the last block
    int* ring;             // host-mapped: (token, sequence number) pairs, the reply's token
                           // n in slot n % ring_len
    float eps;
    float scale;
    int num_layers;
    int capacity;
    int splits;  // the most chunks per kv head (the partial buffers' size)
    int n_eos;
    int max_steps;
    int feed_first;
    int first_step;  // the reply's tokens before this launch's first
    int ring_len;
    int epoch;  // the launch's number (12 bits), the high bits of every tag
};

namespace {
using namespace mk;

__device__ __forceinline__ float silu(float g) { return g / (1.f + __expf(-g)); }

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

// ------------------------------------------------------------------ the stage pipeline
// This block's contiguous share of n rows, for the four row counts the phases use (computed
// once: the producer asks for them at every stage).
__shared__ int2 row_ranges[4];

__device__ __forceinline__ int range_index(int n) {
    return n == QKV_ROWS ? 0 : n == qw::hidden ? 1 : n == qw::intermediate ? 2 : 3;
}

__device__ void init_ranges() {
    if (threadIdx.x < 4) {
        const int counts[4] = {QKV_ROWS, qw::hidden, qw::intermediate, qw::vocab};
        const long long n = counts[threadIdx.x];
        row_ranges[threadIdx.x] = make_int2(static_cast<int>(n * blockIdx.x / gridDim.x),
                                            static_cast<int>(n * (blockIdx.x + 1) / gridDim.x));
    }
}

__device__ __forceinline__ void block_range(int n, int& lo, int& hi) {
    const int2 r = row_ranges[range_index(n)];
    lo = r.x;
    hi = r.y;
}

__device__ __forceinline__ int range_tiles(int n, int per_tile) {
    int lo, hi;
    block_range(n, lo, hi);
    return (hi - lo + per_tile - 1) / per_tile;
}

// Flash-decoding geometry for `len` keys: chunks of whole stages, at most `most` per kv head.
struct AttnGeom {
    int splits, chunk;
};

__device__ __forceinline__ AttnGeom attn_geom(int len, int most) {
    int splits = min(most, (len + KEYS - 1) / KEYS);
    splits = max(1, splits);
    const int chunk = ((len + splits - 1) / splits + KEYS - 1) / KEYS * KEYS;
    return {(len + chunk - 1) / chunk, chunk};
}

// This block's attention items are blockIdx.x, + gridDim.x, ...; each is a (kv head, chunk).
__device__ __forceinline__ int item_keys(const AttnGeom& g, int len, int item) {
    const int split = item % g.splits;
    return min(len, (split + 1) * g.chunk) - split * g.chunk;
}

__device__ int attn_tiles(const AttnGeom& g, int len) {
    int total = 0;
    for (int item = blockIdx.x; item < qw::kv_heads * g.splits; item += gridDim.x)
        total += (item_keys(g, len, item) + KEYS - 1) / KEYS;
    return total;
}

// Where the block's stream of stages is: forward f (position pos0 + f), layer (num_layers is
// the LM head), phase, tile. Kept in shared memory and advanced by the issuing thread(s) only.
struct Cursor {
    int f, layer, phase, t, count;
};

struct Producer {
    Cursor c;
    unsigned issued;
    int more, forwards, pos0;
};

// Dynamic shared memory: the stages, then the input vector of a phase (or, while sampling,
// the radix histograms), then the table of layer pointers.
extern __shared__ __align__(128) unsigned char stage_mem[];
__shared__ __align__(8) unsigned long long stage_bars[STAGES];
__shared__ Producer producer;

__device__ __forceinline__ float* vec_buf() {
    return reinterpret_cast<float*>(stage_mem + STAGES * STAGE);
}
__device__ __forceinline__ MegaLayer* layer_table() {
    return reinterpret_cast<MegaLayer*>(stage_mem + STAGES * STAGE + UNION_BYTES);
}

__device__ int phase_tiles(const MegaArgs& a, int layer, int phase, int f) {
    if (layer == a.num_layers) return range_tiles(qw::vocab, rows_per_stage<false>(qw::hidden));
    switch (phase) {
        case QKV: return range_tiles(QKV_ROWS, rows_per_stage(qw::hidden));
        case ATTN: {
            if (QW_MK_SKIP & 2) return 0;
            const int len = producer.pos0 + f + 1;
            return attn_tiles(attn_geom(len, a.splits), len);
        }
        case OPROJ: return range_tiles(qw::hidden, rows_per_stage(qw::q_size));
        case GATEUP: return range_tiles(qw::intermediate, PAIRS_PER_STAGE);
        default: return range_tiles(qw::hidden, rows_per_stage(qw::intermediate));
    }
}

// Moves the producer cursor to the next tile of the stream (false at its end).
__device__ bool advance(const MegaArgs& a) {
    Cursor c = producer.c;
    ++c.t;
    while (c.t >= c.count) {
        c.t = 0;
        if (c.layer == a.num_layers) {
            if (++c.f >= producer.forwards) return false;
            c.layer = 0;
            c.phase = QKV;
        } else if (++c.phase == NPHASES) {
            c.phase = 0;
            ++c.layer;
        }
        c.count = phase_tiles(a, c.layer, c.phase, c.f);
    }
    producer.c = c;
    return true;
}

// The bytes of the cursor's tile: one or two contiguous ranges (the second at `offset1`).
struct TileSource {
    const void* src0;
    const void* src1;
    unsigned bytes0, bytes1, offset1;
    bool weights;
};

__device__ TileSource tile_source(const MegaArgs& a) {
    const Cursor c = producer.c;
    TileSource s{nullptr, nullptr, 0, 0, 0, true};
    int lo, hi;
    // n rows of k columns, each `bytes` long, `per` to a stage
    auto rows = [&](const void* w, int n, long long bytes, int per) {
        block_range(n, lo, hi);
        const int r0 = lo + c.t * per, r1 = min(hi, r0 + per);
        s.src0 = static_cast<const unsigned char*>(w) + r0 * bytes;
        s.bytes0 = static_cast<unsigned>((r1 - r0) * bytes);
    };
    auto linear = [&](const unsigned char* w, int n, int k) {
        rows(w, n, row_bytes<qw::fp8>(k), rows_per_stage(k));
    };
    if (c.layer == a.num_layers) {
        rows(a.lm_head, qw::vocab, row_bytes<false>(qw::hidden), rows_per_stage<false>(qw::hidden));
        return s;
    }
    const MegaLayer& L = layer_table()[c.layer];
    switch (c.phase) {
        case QKV: linear(L.qkv, QKV_ROWS, qw::hidden); break;
        case OPROJ: linear(L.o, qw::hidden, qw::q_size); break;
        case DOWN: linear(L.down, qw::hidden, qw::intermediate); break;
        case GATEUP: {
            constexpr long long RB = row_bytes<qw::fp8>(qw::hidden);
            block_range(qw::intermediate, lo, hi);
            const int r0 = lo + c.t * PAIRS_PER_STAGE, r1 = min(hi, r0 + PAIRS_PER_STAGE);
            s.src0 = L.gate_up + r0 * RB;
            s.src1 = L.gate_up + (qw::intermediate + r0) * RB;
            s.bytes0 = s.bytes1 = static_cast<unsigned>((r1 - r0) * RB);
            s.offset1 = static_cast<unsigned>(PAIRS_PER_STAGE * RB);
            break;
        }
        default: {  // ATTN: find the item and the stage within it
            const int len = producer.pos0 + c.f + 1;
            const AttnGeom g = attn_geom(len, a.splits);
            int t = c.t;
            for (int item = blockIdx.x;; item += gridDim.x) {
                const int keys = item_keys(g, len, item);
                const int tiles = (keys + KEYS - 1) / KEYS;
                if (t < tiles) {
                    const int kvh = item / g.splits;
                    const int k0 = (item % g.splits) * g.chunk + t * KEYS;
                    const int n = min(KEYS, keys - t * KEYS);
                    const long long off = (static_cast<long long>(kvh) * a.capacity + k0) * HD;
                    s.src0 = L.k_cache + off;
                    s.src1 = L.v_cache + off;
                    s.bytes0 = s.bytes1 = static_cast<unsigned>(n * HD * 2);
                    s.offset1 = KEYS * HD * 2;
                    s.weights = false;
                    break;
                }
                t -= tiles;
            }
        }
    }
    return s;
}

// Issues the cursor's tile into the next free stage. Called by every thread at the same point
// (right after the __syncthreads that ended the stage's previous use). With TMA one thread
// does it all; without, every thread copies 16-byte pieces and the block syncs around the
// cursor's move.
__device__ void issue(const MegaArgs& a) {
#if QW_MK_TMA
    // Only thread 0 may even read the producer's state (thread 0 writes it, unsynchronised).
    if (threadIdx.x != 0) return;
    if (!*static_cast<volatile int*>(&producer.more)) return;
    const int stage = producer.issued % STAGES;
    unsigned char* dst = stage_mem + stage * STAGE;
    const unsigned bar = smem_u32(stage_bars + stage);
    const TileSource s = tile_source(a);
    if (!((QW_MK_SKIP & 1) && s.weights)) {
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
        asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar),
                     "r"(s.bytes0 + s.bytes1)
                     : "memory");
        asm volatile(
            "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, "
            "[%3];" ::"r"(smem_u32(dst)),
            "l"(s.src0), "r"(s.bytes0), "r"(bar)
            : "memory");
        if (s.bytes1)
            asm volatile(
                "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], "
                "%2, [%3];" ::"r"(smem_u32(dst + s.offset1)),
                "l"(s.src1), "r"(s.bytes1), "r"(bar)
                : "memory");
    } else {
        asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
    }
    ++producer.issued;
    producer.more = advance(a);
#else
    if (!producer.more) return;  // every thread sees the same value
    const int stage = producer.issued % STAGES;
    unsigned char* dst = stage_mem + stage * STAGE;
    const TileSource s = tile_source(a);
    if (!((QW_MK_SKIP & 1) && s.weights)) {
        for (unsigned off = threadIdx.x * 16; off < s.bytes0; off += THREADS * 16)
            cp_async_16(dst + off, static_cast<const unsigned char*>(s.src0) + off, 16);
        for (unsigned off = threadIdx.x * 16; off < s.bytes1; off += THREADS * 16)
            cp_async_16(dst + s.offset1 + off, static_cast<const unsigned char*>(s.src1) + off, 16);
    }
    asm volatile("cp.async.mbarrier.arrive.noinc.shared.b64 [%0];" ::"r"(smem_u32(stage_bars + stage))
                 : "memory");
    __syncthreads();
    if (threadIdx.x == 0) {
        ++producer.issued;
        producer.more = advance(a);
    }
    __syncthreads();
#endif
}

// Sets up the stream of `forwards` steps from position pos0 and fills every stage.
__device__ void pipe_start(const MegaArgs& a, int pos0, int forwards) {
    if (threadIdx.x == 0) {
        for (int s = 0; s < STAGES; ++s) {
#if QW_MK_TMA
            asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_u32(stage_bars + s)));
#else
            asm volatile("mbarrier.init.shared.b64 [%0], %1;" ::"r"(smem_u32(stage_bars + s)),
                         "r"(THREADS));
#endif
        }
        producer.issued = 0;
        producer.pos0 = pos0;
        producer.forwards = forwards;
        producer.c = {0, 0, QKV, -1, 0};
        producer.c.count = forwards > 0 ? phase_tiles(a, 0, QKV, 0) : 0;
        producer.more = forwards > 0 && advance(a);
    }
    __syncthreads();
    for (int s = 0; s < STAGES; ++s) issue(a);
}

// Waits for stage `consumed` of the stream and returns it.
__device__ __forceinline__ const unsigned char* pipe_wait(unsigned consumed) {
    const int stage = consumed % STAGES;
    const unsigned b = smem_u32(stage_bars + stage), parity = (consumed / STAGES) & 1;
    unsigned done = 0;
    while (!done) {
#if QW_MK_TMA
        asm volatile(
            "{ .reg .pred ok; mbarrier.try_wait.parity.shared::cta.b64 ok, [%1], %2; "
            "selp.u32 %0, 1, 0, ok; }"
            : "=r"(done)
            : "r"(b), "r"(parity)
            : "memory");
#else
        asm volatile(
            "{ .reg .pred ok; mbarrier.test_wait.parity.shared.b64 ok, [%1], %2; "
            "selp.u32 %0, 1, 0, ok; }"
            : "=r"(done)
            : "r"(b), "r"(parity)
            : "memory");
#endif
    }
    return stage_mem + stage * STAGE;
}

// The stage just used is free (every thread is past a __syncthreads): refill it.
__device__ __forceinline__ void pipe_release(const MegaArgs& a, unsigned& consumed) {
    ++consumed;
    issue(a);
}

// Before the kernel ends (after a __syncthreads): wait for the copies still in flight.
__device__ void pipe_drain(unsigned consumed) {
    const unsigned issued = producer.issued;
    for (; consumed < issued; ++consumed) pipe_wait(consumed);
}

// ------------------------------------------------------------------ matrix-vector phases
template <int K>
struct Vec {
    float v[cpl(K)][8];
};

// The block's warps sum their squares here (the vector itself goes to vec_buf()).
__shared__ float warp_sums[WARPS];

__device__ __forceinline__ void ld_tagged2(const tagged_t* p, tagged_t& a, tagged_t& b,
                                           bool strong) {
    if (strong)
        asm volatile("ld.relaxed.gpu.global.v2.u64 {%0,%1}, [%2];"
                     : "=l"(a), "=l"(b) : "l"(p) : "memory");
    else
        asm volatile("ld.global.cg.v2.u64 {%0,%1}, [%2];" : "=l"(a), "=l"(b) : "l"(p) : "memory");
}

// Loads a K-vector that other blocks are writing with `tag` (or, with `row`, a bf16 embedding
// row) into vec_buf() with the whole block, returning the sum of squares when asked.
template <int K>
__device__ __forceinline__ float stage_vector(const tagged_t* src, const bf16_t* row, unsigned tag,
                                              bool squares, bool wait = true) {
    float* buf = vec_buf();
    float ss = 0.f;
    for (int j = threadIdx.x * 4; j < K; j += THREADS * 4) {
        float4 e;
        if (row) {
            const uint2 r = *reinterpret_cast<const uint2*>(row + j);
            e = make_float4(bf16_lo(r.x), bf16_hi(r.x), bf16_lo(r.y), bf16_hi(r.y));
        } else {
            tagged_t w0, w1, w2, w3;
            for (bool strong = false;; strong = true) {
                if (strong) back_off();
                ld_tagged2(src + j, w0, w1, strong);
                ld_tagged2(src + j + 2, w2, w3, strong);
                if ((QW_MK_SKIP & 4) || !wait ||
                    (tag_of(w0) == tag && tag_of(w1) == tag && tag_of(w2) == tag && tag_of(w3) == tag))
                    break;
            }
            e = make_float4(value_of(w0), value_of(w1), value_of(w2), value_of(w3));
        }
        *reinterpret_cast<float4*>(buf + j) = e;
        ss += e.x * e.x + e.y * e.y + e.z * e.z + e.w * e.w;
    }
    if (squares) {
        ss = warp_sum(ss);
        if ((threadIdx.x & 31) == 0) warp_sums[threadIdx.x >> 5] = ss;
    }
    __syncthreads();
    float total = 0.f;
    if (squares) {
#pragma unroll
        for (int w = 0; w < WARPS; ++w) total += warp_sums[w];
    }
    return total;
}

// The warp's segment of rmsnorm(src) * w, src a float vector or (layer 0) a bf16 row.
template <int K>
__device__ __forceinline__ void load_normed(Vec<K>& out, const tagged_t* src, const bf16_t* row,
                                            unsigned tag, const bf16_t* w, float eps) {
    const float rstd = rsqrtf(stage_vector<K>(src, row, tag, true) / K + eps);
    const float* buf = vec_buf();
    const int lane = threadIdx.x & 31, seg = (threadIdx.x >> 5) % nseg(K);
#pragma unroll
    for (int q = 0; q < cpl(K); ++q) {
        const int c = seg * cpl(K) * 32 + lane + 32 * q;
        if (c < chunks(K)) {
            const uint4 g = *reinterpret_cast<const uint4*>(w + c * 8);
            const float gw[8] = {bf16_lo(g.x), bf16_hi(g.x), bf16_lo(g.y), bf16_hi(g.y),
                                 bf16_lo(g.z), bf16_hi(g.z), bf16_lo(g.w), bf16_hi(g.w)};
            const float4 lo = *reinterpret_cast<const float4*>(buf + c * 8);
            const float4 hi = *reinterpret_cast<const float4*>(buf + c * 8 + 4);
            const float e[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
#pragma unroll
            for (int j = 0; j < 8; ++j) out.v[q][j] = e[j] * rstd * gw[j];
        }
    }
}

// The warp's segment of a float vector other blocks are writing with `tag`.
template <int K>
__device__ __forceinline__ void load_plain(Vec<K>& out, const tagged_t* src, unsigned tag,
                                           bool wait = true) {
    stage_vector<K>(src, nullptr, tag, false, wait);
    const float* buf = vec_buf();
    const int lane = threadIdx.x & 31, seg = (threadIdx.x >> 5) % nseg(K);
#pragma unroll
    for (int q = 0; q < cpl(K); ++q) {
        const int c = seg * cpl(K) * 32 + lane + 32 * q;
        if (c < chunks(K)) {
            const float4 lo = *reinterpret_cast<const float4*>(buf + c * 8);
            const float4 hi = *reinterpret_cast<const float4*>(buf + c * 8 + 4);
            out.v[q][0] = lo.x; out.v[q][1] = lo.y; out.v[q][2] = lo.z; out.v[q][3] = lo.w;
            out.v[q][4] = hi.x; out.v[q][5] = hi.y; out.v[q][6] = hi.z; out.v[q][7] = hi.w;
        }
    }
}

// The warp's partial dot product of one weight row in shared memory with its vector segment:
// 8 values a chunk, 16 bytes of bf16 or 8 FP8 codes times their block's scale.
template <int K, bool F8>
__device__ __forceinline__ float row_dot(const unsigned char* row, const Vec<K>& v) {
    const int lane = threadIdx.x & 31, seg = (threadIdx.x >> 5) % nseg(K);
    float acc = 0.f;
#pragma unroll
    for (int q = 0; q < cpl(K); ++q) {
        const int c = seg * cpl(K) * 32 + lane + 32 * q;
        if (c < chunks(K)) {
            if constexpr (F8) {
                const float scale = reinterpret_cast<const float*>(row + K)[c * 8 / qw::FP8_BLOCK];
                acc += dot8_e4m3(reinterpret_cast<const uint2*>(row)[c], v.v[q]) * FP8_UNSCALE * scale;
            } else {
                acc += dot8(reinterpret_cast<const uint4*>(row)[c], v.v[q]);
            }
        }
    }
    return warp_sum(acc);
}

// Rows [lo, hi) of this block's slice, stage by stage. `load(v)` first fills the warp's vector
// segment. Row lo + i belongs to thread i % THREADS, which calls `pre(row)` when the row's
// stage is waited for (to start loads the emit will need) and `emit(row, sum, up, pre)` after
// the stage is released. With PAIRS a stage holds gate rows and then (at PAIRS_PER_STAGE rows)
// the matching up rows, and `up` is the up row's sum. F8: the rows are in the model's weight
// format (false: bf16, the LM head). Not inlined: each phase gets all the registers.
template <int K, bool PAIRS, bool F8 = qw::fp8, typename Load, typename Pre, typename Emit>
__device__ __noinline__ void rows_phase(const MegaArgs& a, unsigned& consumed, int n_rows,
                                        float* red, Load load, Pre pre, Emit emit) {
    constexpr int NSEG = nseg(K), GROUPS = WARPS / NSEG;
    constexpr int PER = PAIRS ? PAIRS_PER_STAGE : rows_per_stage<F8>(K);
    constexpr long long RB = row_bytes<F8>(K);
    static_assert(PER <= THREADS, "a stage holds more rows than the block has threads");
    Vec<K> v;
    load(v);
    const int warp = threadIdx.x >> 5, seg = warp % NSEG, group = warp / NSEG;
    int lo, hi;
    block_range(n_rows, lo, hi);
    for (int r0 = lo; r0 < hi; r0 += PER) {
        const int n = min(PER, hi - r0);
        const int mine = r0 + ((static_cast<int>(threadIdx.x) - (r0 - lo)) % THREADS + THREADS) % THREADS;
        const bool has_row = mine < r0 + n;
        const int extra = has_row ? pre(mine) : 0;
        float* sums = red + (consumed & 1) * RED;
        const unsigned char* tile = pipe_wait(consumed);
        if (group < GROUPS) {
            for (int r = group; r < (PAIRS ? 2 * PER : n); r += GROUPS) {
                if (PAIRS && r % PER >= n) continue;
                const float d = row_dot<K, F8>(tile + r * RB, v);
                if ((threadIdx.x & 31) == 0) sums[r * NSEG + seg] = d;
            }
        }
        __syncthreads();
        pipe_release(a, consumed);
        if (has_row) {
            const int r = mine - r0;
            float total = 0.f, up = 0.f;
#pragma unroll
            for (int s = 0; s < NSEG; ++s) total += sums[r * NSEG + s];
            if (PAIRS) {
#pragma unroll
                for (int s = 0; s < NSEG; ++s) up += sums[(PER + r) * NSEG + s];
            }
            emit(mine, total, up, extra);
        }
    }
}

// ------------------------------------------------------------------ attention
struct AttnShared {
    float q[qw::group][HD];
    float k_new[HD];
    float v_new[HD];
    float wm[WARPS][qw::group], wl[WARPS][qw::group];  // each warp's running max and sum
    float gm[qw::group], gl[qw::group];                // the chunk's max and sum
    float merge_w[qw::group][MAX_SPLITS];  // a chunk's weight in the merge
    float merge_l[qw::group];
    int last;
};

// RMSNorm over head_dim with weight w, then rotate-half RoPE at pos; one warp.
__device__ __forceinline__ void norm_rope_warp(const tagged_t* src, unsigned tag, const bf16_t* w,
                                               const float* inv_freq, int pos, float eps,
                                               float* dst) {
    constexpr int PER = (HD / 2 + 31) / 32;
    const int lane = threadIdx.x & 31;
    const tagged_t* at[2 * PER];
#pragma unroll
    for (int j = 0; j < PER; ++j) {
        const int i = min(lane + 32 * j, HD / 2 - 1);  // (lanes past HD / 2 load and drop)
        at[2 * j] = src + i;
        at[2 * j + 1] = src + i + HD / 2;
    }
    float got[2 * PER], x0[PER], x1[PER], ss = 0.f;
    take_all(at, tag, got);
#pragma unroll
    for (int j = 0; j < PER; ++j) {
        const bool in = lane + 32 * j < HD / 2;
        x0[j] = in ? got[2 * j] : 0.f;
        x1[j] = in ? got[2 * j + 1] : 0.f;
        ss += x0[j] * x0[j] + x1[j] * x1[j];
    }
    const float rstd = rsqrtf(warp_sum(ss) / HD + eps);
#pragma unroll
    for (int j = 0; j < PER; ++j) {
        const int i = lane + 32 * j;
        if (i < HD / 2) {
            const float a0 = x0[j] * rstd * bf16_to_f32(w[i]);
            const float a1 = x1[j] * rstd * bf16_to_f32(w[i + HD / 2]);
            float s, c;
            sincosf(static_cast<float>(pos) * inv_freq[i], &s, &c);
            dst[i] = a0 * c - a1 * s;
            dst[i + HD / 2] = a1 * c + a0 * s;
        }
    }
}

// The last block to finish a kv head's chunks merges them into attn (its group's heads). The
// counters only grow during a launch: this layer's chunks are the ones after merge_base.
__device__ void merge_if_last(const MegaArgs& a, int kvh, int splits, unsigned merge_base,
                              unsigned tag, AttnShared& sh) {
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0)
        sh.last = atomicAdd(&a.merge_count[kvh], 1u) + 1u == merge_base + splits;
    __syncthreads();
    if (!sh.last) return;
    __threadfence();
    // Every chunk's (max, sum) at once, then each output's chunks eight loads at a time.
    if (threadIdx.x < qw::group * 32) {
        const int gh = threadIdx.x / 32, lane = threadIdx.x % 32;
        const int head = kvh * qw::group + gh;
        float m[MAX_SPLITS / 32], l[MAX_SPLITS / 32], mx = QW_NEG_INF;
#pragma unroll
        for (int j = 0; j < MAX_SPLITS / 32; ++j) {
            const int sp = lane + 32 * j;
            m[j] = sp < splits ? ld_cg(a.part_ml + (head * a.splits + sp) * 2) : QW_NEG_INF;
            l[j] = sp < splits ? ld_cg(a.part_ml + (head * a.splits + sp) * 2 + 1) : 0.f;
            mx = fmaxf(mx, m[j]);
        }
        mx = warp_max(mx);
        float total = 0.f;
#pragma unroll
        for (int j = 0; j < MAX_SPLITS / 32; ++j) {
            const float w = lane + 32 * j < splits ? __expf(m[j] - mx) : 0.f;
            if (lane + 32 * j < splits) sh.merge_w[gh][lane + 32 * j] = w;
            total += w * l[j];
        }
        total = warp_sum(total);
        if (lane == 0) sh.merge_l[gh] = total;
    }
    __syncthreads();
    for (int i = threadIdx.x; i < qw::group * HD; i += THREADS) {
        const int gh = i / HD, head = kvh * qw::group + gh, d = i % HD;
        const float* po = a.part_o + static_cast<long long>(head) * a.splits * HD + d;
        float acc = 0.f;
        for (int s0 = 0; s0 < splits; s0 += 8) {
            float v[8];
#pragma unroll
            for (int j = 0; j < 8; ++j) v[j] = s0 + j < splits ? ld_cg(po + (s0 + j) * HD) : 0.f;
#pragma unroll
            for (int j = 0; j < 8; ++j)
                if (s0 + j < splits) acc += sh.merge_w[gh][s0 + j] * v[j];
        }
        put(a.attn + head * HD + d, acc / sh.merge_l[gh], tag);
    }
}

// This block's flash-decoding items at position pos (the cache then holds len = pos + 1 keys,
// the last one computed here by the block whose chunk holds it).
// Its inputs are tagged `tag`, its outputs `tag + 1`.
//
// Within a stage of KEYS keys every warp takes its own KPW keys and keeps its own online
// softmax (max, sum, and the lane's DPL output dimensions of each query head of the group) in
// registers, so a stage costs the block one __syncthreads (before the stage is refilled). At
// the end of the chunk the warps' states are merged in a fixed order through shared memory.
__device__ __noinline__ void attention_phase(const MegaArgs& a, unsigned& consumed,
                                             const MegaLayer& L, int pos, const AttnGeom& g,
                                             unsigned tag, unsigned merge_base,
                                             AttnShared& sh) {
    constexpr int G = qw::group;
    const int len = pos + 1;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int part = lane % LPK, slot = lane / LPK;
    float* comb = vec_buf();  // [WARPS][G][HD]: the warps' scaled partial outputs
    for (int item = blockIdx.x; item < qw::kv_heads * g.splits; item += gridDim.x) {
        const int kvh = item / g.splits, split = item % g.splits;
        const int k_begin = split * g.chunk, keys = item_keys(g, len, item);
        const bool has_new = k_begin <= pos && pos < k_begin + keys;
        if (warp < G) {
            norm_rope_warp(a.qkv + (kvh * G + warp) * HD, tag, L.q_norm, a.inv_freq, pos, a.eps,
                           sh.q[warp]);
        } else if (has_new && warp == G) {
            norm_rope_warp(a.qkv + qw::q_size + kvh * HD, tag, L.k_norm, a.inv_freq, pos, a.eps,
                           sh.k_new);
        } else if (has_new && warp == G + 1) {
            const tagged_t* at[HD / 32];
            float got[HD / 32];
#pragma unroll
            for (int j = 0; j < HD / 32; ++j)
                at[j] = a.qkv + qw::q_size + qw::kv_size + kvh * HD + lane + 32 * j;
            take_all(at, tag, got);
#pragma unroll
            for (int j = 0; j < HD / 32; ++j) sh.v_new[lane + 32 * j] = got[j];
        }
        __syncthreads();
        if (has_new && threadIdx.x < HD) {  // the new key and value join the cache
            const long long at = (static_cast<long long>(kvh) * a.capacity + pos) * HD + threadIdx.x;
            L.k_cache[at] = f32_to_bf16(sh.k_new[threadIdx.x]);
            L.v_cache[at] = f32_to_bf16(sh.v_new[threadIdx.x]);
        }
        float m[G], l[G], acc[G][DPL];
#pragma unroll
        for (int h = 0; h < G; ++h) {
            m[h] = QW_NEG_INF;
            l[h] = 0.f;
#pragma unroll
            for (int d = 0; d < DPL; ++d) acc[h][d] = 0.f;
        }
        for (int k0 = 0; k0 < keys; k0 += KEYS) {
            const int n = min(KEYS, keys - k0);
            const bf16_t* kt = reinterpret_cast<const bf16_t*>(pipe_wait(consumed));
            const bf16_t* vt = kt + KEYS * HD;
            const int new_row = pos - (k_begin + k0);
            if (has_new && new_row >= 0 && new_row < n) {  // the copy predates the new key
                if (threadIdx.x < HD) {
                    const_cast<bf16_t*>(kt)[new_row * HD + threadIdx.x] = f32_to_bf16(sh.k_new[threadIdx.x]);
                    const_cast<bf16_t*>(vt)[new_row * HD + threadIdx.x] = f32_to_bf16(sh.v_new[threadIdx.x]);
                }
                __syncthreads();
            }
#pragma unroll
            for (int p0 = 0; p0 < KPW; p0 += KPASS) {
                const int first = warp * KPW + p0;  // the pass's first key in the stage
                if (first >= n) break;              // (warp-uniform)
                // Scores: LPK lanes a key, DPK dimensions a lane (16-byte pieces, interleaved).
                const int kk = first + slot;
                const bool scored = slot < KPASS && kk < n;
                float s[G];
#pragma unroll
                for (int h = 0; h < G; ++h) s[h] = 0.f;
                if (scored) {
#pragma unroll
                    for (int c = 0; c < DPK / 8; ++c) {
                        const int piece = c * LPK + part;
                        const uint4 kv = reinterpret_cast<const uint4*>(kt + kk * HD)[piece];
#pragma unroll
                        for (int h = 0; h < G; ++h) s[h] += dot8(kv, &sh.q[h][piece * 8]);
                    }
                }
#pragma unroll
                for (int h = 0; h < G; ++h) {
#pragma unroll
                    for (int o = LPK / 2; o > 0; o >>= 1) s[h] += __shfl_xor_sync(0xffffffffu, s[h], o);
                    s[h] = scored ? s[h] * a.scale : QW_NEG_INF;
                }
                // The pass's values: this lane's DPL dimensions of each of its KPASS keys.
                float v[KPASS][DPL];
#pragma unroll
                for (int j = 0; j < KPASS; ++j) {
                    const bf16_t* row = vt + (first + j) * HD + lane * DPL;
                    if (first + j < n && DPL % 2 == 0) {
#pragma unroll
                        for (int d = 0; d + 1 < DPL; d += 2) {
                            const unsigned pair = *reinterpret_cast<const unsigned*>(row + d);
                            v[j][d] = bf16_lo(pair);
                            v[j][d + 1] = bf16_hi(pair);
                        }
                    } else if (first + j < n) {
#pragma unroll
                        for (int d = 0; d < DPL; ++d) v[j][d] = bf16_to_f32(row[d]);
                    } else {
#pragma unroll
                        for (int d = 0; d < DPL; ++d) v[j][d] = 0.f;
                    }
                }
                // Online softmax per query head over the pass's keys.
#pragma unroll
                for (int h = 0; h < G; ++h) {
                    float sc[KPASS], mt = QW_NEG_INF;
#pragma unroll
                    for (int j = 0; j < KPASS; ++j) {
                        sc[j] = __shfl_sync(0xffffffffu, s[h], j * LPK);
                        mt = fmaxf(mt, sc[j]);
                    }
                    const float m_new = fmaxf(m[h], mt);  // finite: the pass's first key exists
                    const float alpha = __expf(m[h] - m_new);
                    float sum = 0.f;
#pragma unroll
                    for (int d = 0; d < DPL; ++d) acc[h][d] *= alpha;
#pragma unroll
                    for (int j = 0; j < KPASS; ++j) {
                        const float pj = __expf(sc[j] - m_new);
                        sum += pj;
#pragma unroll
                        for (int d = 0; d < DPL; ++d) acc[h][d] += pj * v[j][d];
                    }
                    l[h] = l[h] * alpha + sum;
                    m[h] = m_new;
                }
            }
            __syncthreads();
            pipe_release(a, consumed);
        }
        // The new key and value are visible to the next steps' copies (on other SMs) before
        // anything this item publishes (merge_if_last fences too).
        if (has_new && g.splits == 1 && threadIdx.x < HD) __threadfence();
        // Merge the warps: the chunk's max and sum, then each warp's outputs scaled to it.
        if (lane == 0) {
#pragma unroll
            for (int h = 0; h < G; ++h) {
                sh.wm[warp][h] = m[h];
                sh.wl[warp][h] = l[h];
            }
        }
        __syncthreads();
#pragma unroll
        for (int h = 0; h < G; ++h) {
            float mx = QW_NEG_INF;
            for (int w = 0; w < WARPS; ++w) mx = fmaxf(mx, sh.wm[w][h]);
            const float e = m[h] == QW_NEG_INF ? 0.f : __expf(m[h] - mx);
#pragma unroll
            for (int d = 0; d < DPL; ++d) comb[(warp * G + h) * HD + lane * DPL + d] = acc[h][d] * e;
            if (warp == 0 && lane == 0) {
                float total = 0.f;
                for (int w = 0; w < WARPS; ++w)
                    if (sh.wm[w][h] != QW_NEG_INF) total += __expf(sh.wm[w][h] - mx) * sh.wl[w][h];
                sh.gm[h] = mx;
                sh.gl[h] = total;
            }
        }
        __syncthreads();
        for (int out = threadIdx.x; out < G * HD; out += THREADS) {
            const int h = out / HD, head = kvh * G + h, d = out % HD;
            float total = 0.f;
            for (int w = 0; w < WARPS; ++w) total += comb[(w * G + h) * HD + d];
            if (g.splits == 1) {
                put(a.attn + head * HD + d, total / sh.gl[h], tag + 1);
            } else {
                a.part_o[(static_cast<long long>(head) * a.splits + split) * HD + d] = total;
                if (d == 0) {
                    a.part_ml[(head * a.splits + split) * 2] = sh.gm[h];
                    a.part_ml[(head * a.splits + split) * 2 + 1] = sh.gl[h];
                }
            }
        }
        if (g.splits > 1) merge_if_last(a, kvh, g.splits, merge_base, tag + 1, sh);
        __syncthreads();
    }
}

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

// Block 0 samples from the blocks' candidates: slot b * CAND + j is block b's j-th, valid
// below that block's count; blocks own rising id ranges and list theirs in id order.
struct CandidateLogits {
    const int2* cand;
    const int* counts;  // shared memory: each block's count
    int blocks;
    __device__ __forceinline__ int n() const { return blocks * CAND; }
    __device__ __forceinline__ bool valid(int i) const { return i % CAND < counts[i / CAND]; }
    __device__ __forceinline__ float value(int i) const {
        return __int_as_float(ld_cg_int(&cand[i].x));
    }
    __device__ __forceinline__ int id(int i) const { return ld_cg_int(&cand[i].y); }
};

// Candidates gathered into shared memory by block 0: values, and the slots they came from
// (whose ids are read only for the token drawn).
struct GatheredLogits {
    const float* vals;
    const unsigned short* slots;
    int count;
    const int2* cand;
    __device__ __forceinline__ int n() const { return count; }
    __device__ __forceinline__ bool valid(int) const { return true; }
    __device__ __forceinline__ float value(int i) const { return vals[i]; }
    __device__ __forceinline__ int id(int i) const { return ld_cg_int(&cand[slots[i]].y); }
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
    if (!usable)
        return qws::choose_token<THREADS>(qws::VocabLogits{a.work}, p, sh.best_val[0],
                                          sh.best_idx[0], p.step, sh, hist);
    for (int w = 0; w < WARPS; ++w) k_lo = max(k_lo, warp_k[w]);
    // Gather the candidates at or above k_lo: count them per block, offsets, then copy.
    for (int b = warp; b < grid; b += WARPS) {
        int n = 0;
        for (int j = lane; j < CAND; j += 32) {
            const bool in = j < counts[b] &&
                            qws::order_key(__int_as_float(ld_cg_int(&a.cand[b * CAND + j].x))) >= k_lo;
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
    if (m > GATHER)
        return qws::choose_token<THREADS>(CandidateLogits{a.cand, counts, grid}, p,
                                          sh.best_val[0], sh.best_idx[0], p.step, sh, hist);
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
    return qws::choose_token<THREADS, HISTS>(GatheredLogits{vals, slots, m, a.cand}, p,
                                             sh.best_val[0], sh.best_idx[0], p.step, sh, hist);
}
}  // namespace

// The arguments come by value, so the host can queue the next launch while this one runs.
extern "C" __global__ void __launch_bounds__(mk::THREADS, 1) decode_megakernel(const MegaArgs args) {
    __shared__ float red[2 * RED];
    __shared__ AttnShared attn_sh;
    __shared__ qws::SampleShared<THREADS> sample_sh;
    __shared__ SampleParams step_params;
    __shared__ MegaArgs args_sh;    // read from shared memory: no registers held for it
    __shared__ float resid[RESID];  // the residual rows this block owns, by thread
    __shared__ int chosen_sh;
    if (threadIdx.x == 0) args_sh = args;
    init_ranges();
    __syncthreads();
    const MegaArgs& a = args_sh;
    // Written only by earlier launches, so every block reads the same value and all leave.
    if (*a.stopped) return;
    for (int i = threadIdx.x; i < a.num_layers * static_cast<int>(sizeof(MegaLayer) / 8); i += THREADS)
        reinterpret_cast<unsigned long long*>(layer_table())[i] =
            reinterpret_cast<const unsigned long long*>(a.layers)[i];
    __syncthreads();
    const int hid_lo = row_ranges[1].x;
    // The block's LM-head logits, kept in shared memory for its sampling candidates.
    const int lm_lo = row_ranges[3].x, lm_n = row_ranges[3].y - lm_lo;
    const bool lm_fits = lm_n <= LM_ROWS;
    float* lm_vals = vec_buf();
    unsigned* scratch = reinterpret_cast<unsigned*>(red);
    const NoPre no_pre;
    const int pos0 = *a.pos;
    int pos = pos0;
    int token = *a.token;
    unsigned merge_base = 0;
    // Tags: step i's phases are numbered from i * per_step + 1: five per layer, then the
    // blocks' best logits and the chosen token.
    const unsigned per_step = 5u * a.num_layers + 3u;
    const int forwards = min(a.max_steps - (a.feed_first ? 0 : 1), a.capacity - pos0);
    unsigned consumed = 0;  // stages of the stream used so far
    pipe_start(a, pos0, forwards);
    if (a.feed_first && blockIdx.x == gridDim.x - 1 && threadIdx.x == 0) {
        a.params[0] = read_host_params(a, a.first_step);  // the first step's parameters
        __threadfence();  // before this block's outputs, which every LM head depends on
    }

    for (int i = 0; i < a.max_steps; ++i) {
        const unsigned base = (static_cast<unsigned>(a.epoch & 0xfff) << 20) +
                              static_cast<unsigned>(i) * per_step + 1u;
        const unsigned best_tag = base + 5u * a.num_layers, chosen_tag = best_tag + 1u;
        float best = QW_NEG_INF;
        int best_i = 0x7fffffff;
        if (i > 0 || a.feed_first) {
            token = min(max(token, 0), qw::vocab - 1);
            const AttnGeom geom = attn_geom(pos + 1, a.splits);  // the same in every layer
            const bf16_t* embed_row = a.embed + static_cast<long long>(token) * qw::hidden;
            for (int layer = 0; layer < a.num_layers; ++layer) {
                const MegaLayer& L = layer_table()[layer];
                const unsigned t = base + 5u * layer;  // this layer's Q/K/V tag
                {  // Q, K, V from the normed residual (layer 0: the embedding row, whose rows
                   // each block also takes as its part of the residual stream)
                    if (layer == 0 && threadIdx.x < row_ranges[1].y - hid_lo)
                        resid[threadIdx.x] = bf16_to_f32(embed_row[hid_lo + threadIdx.x]);
                    const bf16_t* row = layer == 0 ? embed_row : nullptr;
                    rows_phase<qw::hidden, false>(
                        a, consumed, QKV_ROWS, red,
                        [&](Vec<qw::hidden>& v) {
                            load_normed<qw::hidden>(v, a.x, row, t - 1u, L.input_norm, a.eps);
                        },
                        no_pre, [&](int r, float s, float, int) { put(a.qkv + r, s, t); });
                }
                if (!(QW_MK_SKIP & 2))
                    attention_phase(a, consumed, L, pos, geom, t, merge_base, attn_sh);
                // The counters count only chunks that are merged (more than one a head).
                if (geom.splits > 1) merge_base += geom.splits;
                rows_phase<qw::q_size, false>(
                    a, consumed, qw::hidden, red,
                    [&](Vec<qw::q_size>& v) {
                        load_plain<qw::q_size>(v, a.attn, t + 1u, !(QW_MK_SKIP & 2));
                    },
                    no_pre, [&](int r, float s, float, int) { put(a.x + r, resid[r - hid_lo] += s, t + 2u); });
                rows_phase<qw::hidden, true>(
                    a, consumed, qw::intermediate, red,
                    [&](Vec<qw::hidden>& v) {
                        load_normed<qw::hidden>(v, a.x, nullptr, t + 2u, L.post_norm, a.eps);
                    },
                    no_pre, [&](int r, float g, float u, int) { put(a.h + r, silu(g) * u, t + 3u); });
                rows_phase<qw::intermediate, false>(
                    a, consumed, qw::hidden, red,
                    [&](Vec<qw::intermediate>& v) { load_plain<qw::intermediate>(v, a.h, t + 3u); },
                    no_pre, [&](int r, float s, float, int) { put(a.x + r, resid[r - hid_lo] += s, t + 4u); });
            }
            // Final norm and LM head, with the penalties and each block's argmax on the way.
            // (The last block wrote this step's parameters before any output of its that the
            // x below depends on.)
            load_params(&step_params, a.params + (i & 1));
            rows_phase<qw::hidden, false, false>(
                a, consumed, qw::vocab, red,
                [&](Vec<qw::hidden>& v) {
                    load_normed<qw::hidden>(v, a.x, nullptr, best_tag - 1u, a.final_norm, a.eps);
                },
                [&](int r) {  // the penalties' inputs, loaded while the stage is used
                    // (strong loads: block 0 updated them during this launch)
                    if (!penalties_on(step_params)) return 0;
                    int count;
                    unsigned seen;
                    asm volatile("ld.relaxed.gpu.global.s32 %0, [%1];" : "=r"(count) : "l"(a.counts + r));
                    asm volatile("ld.relaxed.gpu.global.u8 %0, [%1];" : "=r"(seen) : "l"(a.seen + r));
                    return count * 2 + static_cast<int>(seen & 1u);
                },
                [&](int r, float s, float, int seen_count) {
                    a.logits[r] = s;
                    if (!(QW_MK_SKIP & 8)) {
                        const float l = qws::penalized(s, step_params, seen_count & 1, seen_count >> 1);
                        a.work[r] = l;
                        if (lm_fits) lm_vals[r - lm_lo] = l;
                        qws::argmax_merge(best, best_i, l, r);
                    }
                });
            ++pos;
        } else {
            // No token to feed: choose from the logits already there (left by prefill). Every
            // block reads the parameters from the host itself (once a launch at most).
            if (threadIdx.x == 0) step_params = read_host_params(a, a.first_step + i);
            __syncthreads();
            int lo, hi;
            block_range(qw::vocab, lo, hi);
            for (int r = lo + threadIdx.x; r < hi; r += THREADS) {
                const float l = qws::penalized(ld_cg(a.logits + r), step_params,
                                               ld_cg_u8(a.seen + r), ld_cg_int(a.counts + r));
                a.work[r] = l;
                if (lm_fits) lm_vals[r - lm_lo] = l;
                qws::argmax_merge(best, best_i, l, r);
            }
        }

        // Sampling: each block's best logit and (sampling with a small top-k) its candidates,
        // after its logits; then block 0 chooses.
        const int k = step_params.top_k;
        const bool offer = !(QW_MK_SKIP & 8) && lm_fits && step_params.temperature > 0.f &&
                           k > 0 && k <= CAND;
        unsigned kth = 0;
        const int offered = offer ? block_candidates(a, lm_vals, lm_lo, lm_n, k, scratch, kth) : 0;
        qws::argmax_block<THREADS>(best, best_i, sample_sh.best_val, sample_sh.best_idx);
        if (threadIdx.x == 0) {
            __threadfence();  // this block's logits and candidates before its best
            put(a.best + 4 * blockIdx.x, best, best_tag);
            put(a.best + 4 * blockIdx.x + 1, __int_as_float(best_i), best_tag);
            // What the candidates are: the k they are the top of, and how many (-1: none).
            put(a.best + 4 * blockIdx.x + 2,
                __int_as_float(offer ? (k << 16) | min(offered, 0xffff) : -1), best_tag);
            put(a.best + 4 * blockIdx.x + 3, __uint_as_float(kth), best_tag);
            // While block 0 chooses, the last block fetches the next step's parameters from
            // the host (so a change applies to the next token), into the other slot.
            if (blockIdx.x == gridDim.x - 1 && i + 1 < a.max_steps) {
                a.params[(i + 1) & 1] = read_host_params(a, a.first_step + i + 1);
                __threadfence();
            }
        }
        if (blockIdx.x == 0) {
            const int chosen = block0_choose(a, step_params, offer, best_tag, red, sample_sh, token);
            if (threadIdx.x == 0) {
                a.counts[chosen] += 1;
                a.seen[chosen] = 1;
                *a.token = chosen;
                // One 8-byte store: the host sees the token and its sequence number together.
                const int n = a.first_step + i;
                asm volatile("st.volatile.global.v2.s32 [%0], {%1, %2};"
                             ::"l"(a.ring + 2 * (n % a.ring_len)), "r"(chosen), "r"(n + 1)
                             : "memory");
                // The cancel flag is read last, so a cancel seen by the host before this token
                // was stops the launch here.
                const int cancel = *reinterpret_cast<const volatile int*>(a.host + 10);
                bool ended = pos >= a.capacity || cancel != 0;
                for (int e = 0; e < a.n_eos; ++e) ended = ended || chosen == a.eos[e];
                if (ended) *a.stopped = 1;
                const bool stop = ended || i + 1 >= a.max_steps;
                __threadfence();  // the counts before the token that the others wait for
                put(a.chosen, __int_as_float(chosen | (stop ? static_cast<int>(0x80000000u) : 0)),
                    chosen_tag);
            }
        }
        if (threadIdx.x == 0) {
            chosen_sh = __float_as_int(take(a.chosen, chosen_tag));
            __threadfence();  // acquire: what block 0 wrote before (counts, the KV rows before)
        }
        __syncthreads();
        const int word = chosen_sh;
        token = word & 0x7fffffff;
        if (word & 0x80000000) break;
    }
    pipe_drain(consumed);
    if (blockIdx.x == 0 && threadIdx.x == 0) *a.pos = pos;
}
