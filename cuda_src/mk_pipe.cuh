// The stage pipeline: every block's weight and key/value stream, in the order its phases
// read it, refilled into a ring of shared-memory stages by bulk asynchronous copies.
#pragma once
#include "mk_tagged.cuh"
#include "mk_timeline.cuh"

namespace {
using namespace mk;

// This block's contiguous share of n rows, for the row counts the phases use (computed once:
// the producer asks for them at every stage): four, and a mixture of experts' router rows and
// experts' gate/up rows (equal counts share one range, whichever index they find).
constexpr int RANGES = MOE ? 6 : 4;
__shared__ int2 row_ranges[RANGES];

__device__ __forceinline__ int range_index(int n) {
    if (MOE && n == qwm::EXPERTS) return 4;
    if (MOE && n == KI) return 5;
    return n == QKV_ROWS ? 0 : n == qw::hidden ? 1 : n == qw::intermediate ? 2 : 3;
}

__device__ void init_ranges() {
    if (threadIdx.x < RANGES) {
#if QW_MK_MOE
        const int counts[RANGES] = {QKV_ROWS, qw::hidden, qw::intermediate, qw::vocab,
                                    qwm::EXPERTS, KI};
#else
        const int counts[RANGES] = {QKV_ROWS, qw::hidden, qw::intermediate, qw::vocab};
#endif
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

// Where a stage's items lie (mk_layout.cuh: a phase streams its block's slice of a matrix as
// items of STEP columns). The stream's rows are the slice's n rows (PAIRS: 2n, the gate rows
// then the up rows, each half its own part of the stream); a stage holds items [i0, i1). Each
// part of it is one contiguous copy from the first item's columns to the last's (narrow rows carry
// their scales after their codes, so whole rows come with theirs, and so does a first row cut
// at its start), plus, for a narrow last row cut short, a copy of that row's scales after it.
struct StagePart {
    int first;      // the part's first row (in the part's slice), or -1: the stage has none
    int base;       // the stage offset of that row's column 0 (below the stage for a cut row)
    int last_cut;   // its last row if cut short (narrow rows: its scales are apart), else -1
    int tail;       // the stage offset of those scales
    long long src;  // the copy: byte offset in the matrix, from the part's first row in it
    unsigned bytes, tail_bytes;
    long long tail_src;
    int dst;
};

template <int K, int WF>
__device__ __forceinline__ StagePart stage_part(int i0, int i1, int part, int n, int& dst) {
    constexpr int S = steps(K), SB = scale_bytes<WF>(K);
    constexpr long long RB = row_bytes<WF>(K);
    StagePart s{-1, 0, -1, 0, 0, 0u, 0u, 0, dst};
    const int lo = max(i0, part * n * S) - part * n * S, hi = min(i1, (part + 1) * n * S) - part * n * S;
    if (lo >= hi) return s;
    const int ra = lo / S, c0 = (lo % S) * STEP, rt = (hi - 1) / S;
    const int c1 = min(K, ((hi - 1) % S + 1) * STEP);
    s.first = ra;
    s.base = dst - static_cast<int>(code_bytes<WF>(c0));
    s.src = ra * RB + code_bytes<WF>(c0);
    s.bytes = static_cast<unsigned>((rt - ra) * RB + code_bytes<WF>(c1 - c0) + (c1 == K ? SB : 0));
    if (WF != qw::BF16 && c1 < K) {
        s.last_cut = rt;
        s.tail = dst + static_cast<int>(s.bytes);
        s.tail_src = rt * RB + code_bytes<WF>(K);
        s.tail_bytes = SB;
    }
    dst += static_cast<int>(s.bytes + s.tail_bytes);
    return s;
}

// Stages of a matrix phase over n_rows rows of K columns (PAIRS: gate/up), for this block:
// runs of items (SPLIT), or whole rows (a gate/up pair together) as many as a stage takes.
template <int K, int WF, bool PAIRS>
__device__ __forceinline__ int matrix_tiles(int n_rows) {
    int lo, hi;
    block_range(n_rows, lo, hi);
    if constexpr (SPLIT) {
        const int items = (hi - lo) * steps(K) * (PAIRS ? 2 : 1);
        return (items + items_per_stage<WF>(K) - 1) / items_per_stage<WF>(K);
    } else {
        constexpr int PER = PAIRS ? PAIRS_PER_STAGE : rows_per_stage<WF>(K);
        return (hi - lo + PER - 1) / PER;
    }
}

// Flash-decoding geometry for `len` keys: at most `most` chunks per kv head, of equal length
// (QW_MK_EVEN) or of whole stages.
struct AttnGeom {
    int splits, chunk, len;  // (chunk: QW_MK_EVEN 0's chunk length)
};

__device__ __forceinline__ AttnGeom attn_geom(int len, int most) {
    int splits = min(most, (len + KEYS - 1) / KEYS);
    splits = max(1, splits);
    if (QW_MK_EVEN) return {splits, 0, len};
    const int chunk = ((len + splits - 1) / splits + KEYS - 1) / KEYS * KEYS;
    return {(len + chunk - 1) / chunk, chunk, len};
}

// The first key of a kv head's chunk `split`.
__device__ __forceinline__ int chunk_begin(const AttnGeom& g, int split) {
    if (QW_MK_EVEN) return split * g.len / g.splits;  // (< 2^31: splits <= 64)
    return split * g.chunk;
}

// This block's attention items are blockIdx.x, + gridDim.x, ...; each is a (kv head, chunk).
__device__ __forceinline__ int item_keys(const AttnGeom& g, int len, int item) {
    const int split = item % g.splits;
    if (QW_MK_EVEN) return chunk_begin(g, split + 1) - chunk_begin(g, split);
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

// The bytes of the cursor's tile: up to four contiguous ranges, each to its stage offset (a
// matrix stage: each part's run and its cut row's scales; attention: keys and values). Fixed
// slots, unused ones 0 bytes, so that the producer keeps them in registers.
struct TileSource {
    const void* src[4];
    unsigned bytes[4], dst[4];
    bool weights;
};

struct Producer {  // (the producer warp's alone)
    Cursor c;
    unsigned issued;  // stages issued (one per stage released, copying or not), in stream order
    unsigned filled;  // stages actually copied into
    int more, forwards, pos0;
#if QW_MK_OWE
    int owed;  // a matrix phase's last refill, not yet made: pipe_settle
#endif
#if QW_MK_MOE
    // A mixture of experts: the experts' stages met before the block has routed their layer
    // are held, with every stage after them (their slots taken, nothing copied), and issued
    // once it has (issue_held), up to the next layer's experts: the first one's cursor and
    // slot, and how many.
    Cursor held_c;
    unsigned held_slot, held;
#endif
};

// A mixture of experts: the block's routing of the layer its experts' stages belong to (every
// block routes for itself from the router's logits, on its producer warp, which alone reads
// and writes `ids` and `routed`: megakernel.cu, route_block). `routed` is forward x layers +
// layer + 1 of the routing in `ids` and `weights`, 0 before the first.
#if QW_MK_MOE
struct Routing {
    float logits[qwm::EXPERTS];
    float weights[qwm::TOPK];
    int ids[qwm::TOPK];
    int routed;
};
__shared__ Routing routing;
#endif

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

// The experts' down rows, one phase (mk_layout.cuh): the virtual rows a stage takes
// for a block of n hidden rows. At most 3n + 1, so that a stage's rows come from four experts
// at most (one copy each: expert_down_source).
__device__ __forceinline__ int expert_down_per(int n) {
    return min(rows_per_stage<qw::wfmt>(MINTER), 3 * n + 1);
}
__device__ __forceinline__ int expert_down_stages() {
    int lo, hi;
    block_range(qw::hidden, lo, hi);
    const int per = expert_down_per(hi - lo);
    return (qwm::TOPK * (hi - lo) + per - 1) / per;
}

__device__ int phase_tiles(const MegaArgs& a, int layer, int phase, int f) {
    if (layer == a.num_layers) return matrix_tiles<qw::hidden, qw::BF16, false>(qw::vocab);
    if constexpr (MOE) {
        if (phase == ROUTER) return matrix_tiles<qw::hidden, qw::BF16, false>(qwm::EXPERTS);
        if (phase == GATEUP) return matrix_tiles<qw::hidden, qw::wfmt, true>(KI);
        if (phase == DOWN) return expert_down_stages();
    }
    switch (phase) {
        case QKV: return matrix_tiles<qw::hidden, qw::wfmt, false>(QKV_ROWS);
        case ATTN: {
            if (QW_MK_SKIP & 2) return 0;
            const int len = producer.pos0 + f + 1;
            return attn_tiles(attn_geom(len, a.splits), len);
        }
        case OPROJ: return matrix_tiles<qw::q_size, qw::wfmt, false>(qw::hidden);
        case GATEUP: return matrix_tiles<qw::hidden, qw::wfmt, true>(qw::intermediate);
        default: return matrix_tiles<qw::intermediate, qw::wfmt, false>(qw::hidden);
    }
}

// Moves cursor c to the next tile of the stream (false at its end).
__device__ __forceinline__ bool advance(const MegaArgs& a, Cursor& c) {
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
    return true;
}

// Moves the producer's cursor to the next tile of the stream (false at its end).
__device__ bool advance(const MegaArgs& a) {
    Cursor c = producer.c;
    if (!advance(a, c)) return false;
    producer.c = c;
    return true;
}

__device__ __forceinline__ void set_copy(TileSource& s, int slot, const void* src, unsigned bytes,
                                         int dst) {
    s.src[slot] = src;
    s.bytes[slot] = bytes;
    s.dst[slot] = static_cast<unsigned>(dst);
}

// Stage t of a matrix phase over n_rows rows of w (PAIRS: the up rows follow the gate rows, `up`
// rows further in w): its run of items (SPLIT) or its whole rows.
template <int K, int WF, bool PAIRS>
__device__ __forceinline__ void matrix_source(TileSource& s, int t, const void* w, int n_rows,
                                              int up = 0) {
    constexpr long long RB = row_bytes<WF>(K);
    int lo, hi;
    block_range(n_rows, lo, hi);
    if constexpr (!SPLIT) {  // whole rows: the gate rows of a stage, then its up rows
        constexpr int PER = PAIRS ? PAIRS_PER_STAGE : rows_per_stage<WF>(K);
        const int r0 = lo + t * PER, r1 = min(hi, r0 + PER);
        const unsigned bytes = static_cast<unsigned>((r1 - r0) * RB);
        set_copy(s, 0, static_cast<const unsigned char*>(w) + r0 * RB, bytes, 0);
        if (PAIRS)
            set_copy(s, 2, static_cast<const unsigned char*>(w) + (up + r0) * RB, bytes,
                     static_cast<int>(PER * RB));
        return;
    }
    const int n = hi - lo, total = n * steps(K) * (PAIRS ? 2 : 1);
    const int i0 = t * items_per_stage<WF>(K), i1 = min(total, i0 + items_per_stage<WF>(K));
    int dst = 0;
#pragma unroll
    for (int part = 0; part < (PAIRS ? 2 : 1); ++part) {
        const StagePart p = stage_part<K, WF>(i0, i1, part, n, dst);
        const unsigned char* m = static_cast<const unsigned char*>(w) + (lo + part * up) * RB;
        set_copy(s, 2 * part, m + p.src, p.first < 0 ? 0u : p.bytes, p.dst);
        set_copy(s, 2 * part + 1, m + p.tail_src, p.first < 0 ? 0u : p.tail_bytes, p.tail);
    }
}

#if QW_MK_MOE
// Stage t of the experts' gate/up pairs (whole rows): virtual rows r of KI are expert slot
// r / MINTER's row r % MINTER, so a stage's rows come from one or two experts (two copies
// each for the gate and the up rows).
__device__ __forceinline__ void expert_pairs_source(TileSource& s, int t, const unsigned char* w) {
    constexpr long long RB = row_bytes<qw::wfmt>(qw::hidden);
    constexpr int PER = PAIRS_PER_STAGE;
    int lo, hi;
    block_range(KI, lo, hi);
    const int r0 = lo + t * PER, r1 = min(hi, r0 + PER);
    const int cut = min(r1, (r0 / MINTER + 1) * MINTER);  // where the second expert's rows start
#pragma unroll
    for (int piece = 0; piece < 2; ++piece) {
        const int a = piece ? cut : r0, b = piece ? r1 : cut;
        const unsigned char* gate =
            w + routing.ids[min(a / MINTER, qwm::TOPK - 1)] * (2LL * MINTER * RB) + (a % MINTER) * RB;
        const unsigned bytes = a < b ? static_cast<unsigned>((b - a) * RB) : 0u;
        const int dst = static_cast<int>((a - r0) * RB);
        set_copy(s, piece, gate, bytes, dst);
        set_copy(s, 2 + piece, gate + MINTER * RB, bytes, static_cast<int>(PER * RB) + dst);
    }
}

// Stage t of the experts' down rows (one phase): virtual rows [v0, v1), v = k n + r
// being expert slot k's down row lo + r; each slot's run of them is one copy, to the stage
// offset of its first row (four at most: expert_down_per).
__device__ __forceinline__ void expert_down_source(TileSource& s, int t, const unsigned char* w) {
    constexpr long long RB = row_bytes<qw::wfmt>(MINTER), DOWN_BYTES = qw::hidden * RB;
    int lo, hi;
    block_range(qw::hidden, lo, hi);
    const int n = hi - lo, per = expert_down_per(n);
    const int v0 = t * per, v1 = min(qwm::TOPK * n, v0 + per);
#pragma unroll
    for (int piece = 0; piece < 4; ++piece) {
        const int k = v0 / n + piece;
        const int a = max(v0, k * n), b = min(v1, (k + 1) * n);
        const unsigned char* rows =
            w + routing.ids[min(k, qwm::TOPK - 1)] * DOWN_BYTES + (lo + a - k * n) * RB;
        set_copy(s, piece, rows, a < b ? static_cast<unsigned>((b - a) * RB) : 0u,
                 static_cast<int>((a - v0) * RB));
    }
}

// Whether the tile at c is an expert's, whose rows the block's routing of its layer decides.
__device__ __forceinline__ bool needs_routing(const MegaArgs& a, const Cursor& c) {
    return c.layer < a.num_layers && (c.phase == GATEUP || c.phase == DOWN);
}
#endif
__device__ __forceinline__ int routing_key(const MegaArgs& a, int f, int layer) {
    return f * a.num_layers + layer + 1;
}

__device__ TileSource tile_source(const MegaArgs& a, const Cursor c) {
    TileSource s{{}, {0u, 0u, 0u, 0u}, {}, true};
    using qw::hidden;
    if (c.layer == a.num_layers) {
        matrix_source<hidden, qw::BF16, false>(s, c.t, a.lm_head, qw::vocab);
        return s;
    }
    const MegaLayer& L = layer_table()[c.layer];
#if QW_MK_MOE
    {
        if (c.phase == ROUTER) {
            matrix_source<hidden, qw::BF16, false>(s, c.t, L.router, qwm::EXPERTS);
            return s;
        }
        if (c.phase == GATEUP) {
            expert_pairs_source(s, c.t, L.gate_up);
            return s;
        }
        if (c.phase == DOWN) {
            expert_down_source(s, c.t, L.down);
            return s;
        }
    }
#endif
    switch (c.phase) {
        case QKV: matrix_source<hidden, qw::wfmt, false>(s, c.t, L.qkv, QKV_ROWS); break;
        case OPROJ: matrix_source<qw::q_size, qw::wfmt, false>(s, c.t, L.o, hidden); break;
        case DOWN: matrix_source<qw::intermediate, qw::wfmt, false>(s, c.t, L.down, hidden); break;
        case GATEUP:
            matrix_source<hidden, qw::wfmt, true>(s, c.t, L.gate_up, qw::intermediate,
                                                 qw::intermediate);
            break;
        default: {  // ATTN: find the item and the stage within it
            const int len = producer.pos0 + c.f + 1;
            const AttnGeom g = attn_geom(len, a.splits);
            int t = c.t;
            for (int item = blockIdx.x;; item += gridDim.x) {
                const int keys = item_keys(g, len, item);
                const int tiles = (keys + KEYS - 1) / KEYS;
                if (t < tiles) {
                    const int kvh = item / g.splits;
                    const int k0 = chunk_begin(g, item % g.splits) + t * KEYS;
                    const int n = min(KEYS, keys - t * KEYS);
                    const long long off = (static_cast<long long>(kvh) * a.capacity + k0) * KV_ROW;
                    set_copy(s, 0, static_cast<const unsigned char*>(L.k_cache) + off,
                             static_cast<unsigned>(n * KV_ROW), 0);
                    set_copy(s, 2, static_cast<const unsigned char*>(L.v_cache) + off,
                             static_cast<unsigned>(n * KV_ROW), KEYS * KV_ROW);
                    s.weights = false;
                    break;
                }
                t -= tiles;
            }
        }
    }
    return s;
}

// The copy of the tile at cursor c into stage slot % STAGES (`more`: the stream has one; with
// cp.async every lane copies and arrives).
__device__ __forceinline__ void copy_tile(const MegaArgs& a, const Cursor& c, unsigned slot,
                                          bool more) {
    const int lane = threadIdx.x & 31;
    const int stage = slot % STAGES;
    unsigned char* dst = stage_mem + stage * STAGE;
    const unsigned bar = smem_u32(stage_bars + stage);
#if QW_MK_TMA
    if (lane == 0 && more && (QW_MK_SKIP & 16)) {  // (timing: no source, no copy)
        asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
    } else if (lane == 0 && more) {
        const TileSource s = tile_source(a, c);
        if (!((QW_MK_SKIP & 1) && s.weights)) {
            const unsigned total = s.bytes[0] + s.bytes[1] + s.bytes[2] + s.bytes[3];
            // (the consumers' generic reads and writes of this stage before the copy's writes;
            // QW_MK_SKIP & 32, timing only: not before a copy of weights)
            if (!((QW_MK_SKIP & 32) && s.weights))
                asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
            asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar),
                         "r"(total)
                         : "memory");
#pragma unroll
            for (int i = 0; i < 4; ++i)
                if (s.bytes[i])
                    asm volatile(
                    "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], "
                    "[%1], %2, [%3];" ::"r"(smem_u32(dst + s.dst[i])),
                    "l"(s.src[i]), "r"(s.bytes[i]), "r"(bar)
                    : "memory");
        } else {
            asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
        }
    }
#else
    if (more) {
        const TileSource s = (QW_MK_SKIP & 16) ? TileSource{} : tile_source(a, c);
        if (!((QW_MK_SKIP & 1) && s.weights)) {
#pragma unroll
            for (int i = 0; i < 4; ++i)
                for (unsigned off = lane * 16; off < s.bytes[i]; off += 32 * 16)
                    cp_async_16(dst + s.dst[i] + off, static_cast<const unsigned char*>(s.src[i]) + off,
                                16);
        }
        asm volatile("cp.async.mbarrier.arrive.noinc.shared.b64 [%0];" ::"r"(bar) : "memory");
    }
#endif
}

// Issues the cursor's tile into the next stage; called by the producer warp. With TMA its lane 0
// does it all; without, every lane copies 16-byte pieces and arrives on the stage's barrier.
// (A mixture of experts: an expert's tile before the block has routed its layer is held, its
// slot taken and nothing copied, with every tile after it, until issue_held.)
__device__ __noinline__ void issue(const MegaArgs& a) {
    const int lane = threadIdx.x & 31;
#if QW_MK_MOE
    {
        const Cursor c = producer.c;
        if (producer.more && (producer.held > 0 ||
                              (needs_routing(a, c) &&
                               routing.routed != routing_key(a, c.f, c.layer)))) {
            __syncwarp();
            if (lane == 0) {
                if (producer.held++ == 0) {
                    producer.held_c = c;
                    producer.held_slot = producer.issued;
                }
                // (not `filled` yet: a launch that stops early never copies it, and pipe_drain
                // waits only for the stages copied, all before the held ones)
                producer.more = advance(a);
                ++producer.issued;
            }
            __syncwarp();
            return;
        }
    }
#endif
    copy_tile(a, producer.c, producer.issued, producer.more);
    __syncwarp();
    if (lane == 0) {
        if (producer.more) {
            ++producer.filled;
            producer.more = advance(a);
        }
        ++producer.issued;
    }
    __syncwarp();
}

#if QW_MK_MOE
// The held tiles, now that the block has routed a layer (the producer warp): in stream order,
// up to the first of a later layer's experts (a block with few stages a layer can hold the
// next layer's too), which stay held with the rest.
__device__ void issue_held(const MegaArgs& a) {
    Cursor c = producer.held_c;
    const unsigned held = producer.held, slot = producer.held_slot;
    unsigned n = 0;
    for (; n < held && !(needs_routing(a, c) && routing.routed != routing_key(a, c.f, c.layer));
         ++n) {
        copy_tile(a, c, slot + n, true);
        advance(a, c);
    }
    __syncwarp();
    if ((threadIdx.x & 31) == 0) {
        producer.filled += n;
        producer.held = held - n;
        producer.held_c = c;
        producer.held_slot = slot + n;
    }
    __syncwarp();
}
#endif

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
#if QW_MK_OWE
        producer.owed = 0;
#endif
#if QW_MK_MOE
        producer.held = 0;
        routing.routed = 0;
#endif
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
    QW_TL_CLOCK(t0);
    mbar_wait(smem_u32(stage_bars + stage), (consumed / STAGES) & 1);
    QW_TL_WAITED(t0);
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
    QW_TL_CLOCK(t0);
    if ((threadIdx.x & 31) == 0)
        mbar_wait(smem_u32(free_bars + consumed % STAGES), (consumed / STAGES) & 1);
    __syncwarp();
    QW_TL_CLOCK(t1);
    issue(a);
    QW_TL_PRODUCED(t0, t1);
    ++consumed;
}

// The producer warp's refill owed by the last matrix phase (QW_MK_OWE), now.
__device__ __forceinline__ void pipe_settle(const MegaArgs& a, unsigned& consumed) {
#if QW_MK_OWE
    if (!producer.owed) return;
    pipe_produce(a, consumed);
    if ((threadIdx.x & 31) == 0) producer.owed = 0;
    __syncwarp();
#endif
}

// The producer warp's refills of a matrix phase, one for each of its stages r0 = lo, lo + per, ..
// below hi, as the consumers release them: with QW_MK_OWE, the one owed by the phase before
// first, and the last of this phase owed to the next (pipe_settle), so that the next phase's
// input staging does not wait for it.
__device__ __forceinline__ void pipe_produce_phase(const MegaArgs& a, unsigned& consumed, int lo,
                                                   int hi, int per) {
#if QW_MK_OWE
    pipe_settle(a, consumed);
    for (int r0 = lo; r0 + per < hi; r0 += per) pipe_produce(a, consumed);
    if (lo < hi) {
        __syncwarp();  // (every lane has read `owed` in pipe_settle)
        if ((threadIdx.x & 31) == 0) producer.owed = 1;
        __syncwarp();
    }
#else
    for (int r0 = lo; r0 < hi; r0 += per) pipe_produce(a, consumed);
#endif
}

// Before the kernel ends (after a __syncthreads): wait for the copies still in flight.
__device__ void pipe_drain(unsigned consumed) {
    const unsigned filled = producer.filled;
    for (; consumed < filled; ++consumed) pipe_wait(consumed);
}
}  // namespace
