// The stage pipeline: every block's weight and key/value stream, in the order its phases
// read it, refilled into a ring of shared-memory stages by bulk asynchronous copies.
#pragma once
#include "mk_tagged.cuh"

namespace {
using namespace mk;

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

// The bytes of the cursor's tile: one or two contiguous ranges (the second at `offset1`).
struct TileSource {
    const void* src0;
    const void* src1;
    unsigned bytes0, bytes1, offset1;
    bool weights;
};

struct Producer {  // (the producer warp's alone)
    Cursor c;
    unsigned issued;  // stages issued (one per stage released, copying or not), in stream order
    unsigned filled;  // stages actually copied into
    int more, forwards, pos0;
};

// Dynamic shared memory: the stages, then the input vector of a phase (or, while sampling,
// the radix histograms), then the table of layer pointers.
extern __shared__ __align__(128) unsigned char stage_mem[];
__shared__ __align__(8) unsigned long long stage_bars[STAGES];  // "full": the copy landed
__shared__ __align__(8) unsigned long long free_bars[STAGES];   // "empty": every consumer is done
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

// Issues the cursor's tile into the next stage; called by the producer warp. With TMA its lane 0
// does it all; without, every lane copies 16-byte pieces and arrives on the stage's barrier.
__device__ __noinline__ void issue(const MegaArgs& a) {
    const int lane = threadIdx.x & 31;
    const int stage = producer.issued % STAGES;
    unsigned char* dst = stage_mem + stage * STAGE;
    const unsigned bar = smem_u32(stage_bars + stage);
    const bool more = producer.more;
#if QW_MK_TMA
    if (lane == 0 && more) {
        const TileSource s = tile_source(a);
        if (!((QW_MK_SKIP & 1) && s.weights)) {
            // (the consumers' generic reads and writes of this stage before the copy's writes)
            asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
            asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar),
                         "r"(s.bytes0 + s.bytes1)
                         : "memory");
            asm volatile(
                "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], "
                "%2, [%3];" ::"r"(smem_u32(dst)),
                "l"(s.src0), "r"(s.bytes0), "r"(bar)
                : "memory");
            if (s.bytes1)
                asm volatile(
                    "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], "
                    "[%1], %2, [%3];" ::"r"(smem_u32(dst + s.offset1)),
                    "l"(s.src1), "r"(s.bytes1), "r"(bar)
                    : "memory");
        } else {
            asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
        }
    }
#else
    if (more) {
        const TileSource s = tile_source(a);
        if (!((QW_MK_SKIP & 1) && s.weights)) {
            for (unsigned off = lane * 16; off < s.bytes0; off += 32 * 16)
                cp_async_16(dst + off, static_cast<const unsigned char*>(s.src0) + off, 16);
            for (unsigned off = lane * 16; off < s.bytes1; off += 32 * 16)
                cp_async_16(dst + s.offset1 + off, static_cast<const unsigned char*>(s.src1) + off, 16);
        }
        asm volatile("cp.async.mbarrier.arrive.noinc.shared.b64 [%0];" ::"r"(bar) : "memory");
    }
#endif
    __syncwarp();
    if (lane == 0) {
        if (more) {
            ++producer.filled;
            producer.more = advance(a);
        }
        ++producer.issued;
    }
    __syncwarp();
}

// Sets up the stream of `forwards` steps from position pos0; the producer fills every stage.
__device__ void pipe_start(const MegaArgs& a, int pos0, int forwards) {
    if (threadIdx.x == 0) {
        for (int s = 0; s < STAGES; ++s) {
            // TMA: one arrival (with the bytes expected); cp.async: one from each lane.
            asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(stage_bars + s)),
                         "r"(QW_MK_TMA ? 1 : 32));
            asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(free_bars + s)),
                         "r"(CWARPS * 32));
        }
        producer.issued = producer.filled = 0;
        producer.pos0 = pos0;
        producer.forwards = forwards;
        producer.c = {0, 0, QKV, -1, 0};
        producer.c.count = forwards > 0 ? phase_tiles(a, 0, QKV, 0) : 0;
        producer.more = forwards > 0 && advance(a);
    }
    __syncthreads();
    if (threadIdx.x / 32 == PRODUCER)
        for (int s = 0; s < STAGES; ++s) issue(a);
}

// Spins until the mbarrier at shared address `bar` completes the phase of parity `parity`.
__device__ __forceinline__ void mbar_wait(unsigned bar, unsigned parity) {
    unsigned done = 0;
    while (!done) {
#if QW_MK_TMA
        asm volatile(
            "{ .reg .pred ok; mbarrier.try_wait.parity.shared::cta.b64 ok, [%1], %2; "
            "selp.u32 %0, 1, 0, ok; }"
            : "=r"(done)
            : "r"(bar), "r"(parity)
            : "memory");
#else
        asm volatile(
            "{ .reg .pred ok; mbarrier.test_wait.parity.shared.b64 ok, [%1], %2; "
            "selp.u32 %0, 1, 0, ok; }"
            : "=r"(done)
            : "r"(bar), "r"(parity)
            : "memory");
#endif
    }
}

// Waits for stage `consumed` of the stream (its "full" barrier) and returns it.
__device__ __forceinline__ const unsigned char* pipe_wait(unsigned consumed) {
    const int stage = consumed % STAGES;
    mbar_wait(smem_u32(stage_bars + stage), (consumed / STAGES) & 1);
    return stage_mem + stage * STAGE;
}

// A consumer thread is done with stage `consumed`: its arrival on the stage's "empty" barrier
// (a release: its reads and writes of the stage come first). Every consumer thread arrives, so
// that each one's accesses are ordered before the refill's copy by the barrier itself.
__device__ __forceinline__ void pipe_release(unsigned& consumed) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];"
                 ::"r"(smem_u32(free_bars + consumed % STAGES)) : "memory");
    ++consumed;
}

// The producer warp's turn at stage `consumed`: once every consumer has released it, refill it
// with the stream's next tile (the one STAGES ahead).
__device__ __forceinline__ void pipe_produce(const MegaArgs& a, unsigned& consumed) {
    if ((threadIdx.x & 31) == 0)
        mbar_wait(smem_u32(free_bars + consumed % STAGES), (consumed / STAGES) & 1);
    __syncwarp();
    issue(a);
    ++consumed;
}

// Before the kernel ends (after a __syncthreads): wait for the copies still in flight.
__device__ void pipe_drain(unsigned consumed) {
    const unsigned filled = producer.filled;
    for (; consumed < filled; ++consumed) pipe_wait(consumed);
}
}  // namespace
