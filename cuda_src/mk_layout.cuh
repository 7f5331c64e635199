// The decode megakernel's geometry (stages, warps, segments, attention lanes) and the
// arguments and per-layer pointers it gets from the host (MegaArgs and MegaLayer mirror the
// ctypes structures in qwenchat/engine/cuda/engine.py).
#pragma once
#include "kv8.cuh"
#include "sampling.cuh"
#include "weights.cuh"
// A mixture of experts (its builds define the router's shape, compiler.py kernel_defines):
// every layer's MLP is routed on the device, inside the step (megakernel.cu, route_block).
#ifdef QW_EXPERTS
#define QW_MK_MOE 1
#else
#define QW_MK_MOE 0
#endif
#include "moe.cuh"

#ifndef QW_MK_STAGES
#define QW_MK_STAGES 4
#endif
#ifndef QW_MK_STAGE_BYTES
#define QW_MK_STAGE_BYTES 32768
#endif
#ifndef QW_MK_SKIP
#define QW_MK_SKIP 0
#endif
// 1: the attention phase defers its last refill until its outputs are written (mk_attention.cuh);
// 0 keeps the producer's refill at each stage's release (experiments).
#ifndef QW_MK_DEFER
#define QW_MK_DEFER 1
#endif
// 1: a matrix phase's producer leaves its refill after the phase's last stage until the next
// phase's input is staged (pipe_settle), so that its issue (0.5-1 µs) is not on the block
// barriers of that staging; 0: each refill at its stage's release. An experiment, off: +1-3% on
// 0.6B bf16, -3% on 0.6B int4 and -1% on 8B FP8 (H100, docs/perf.md, twenty-first session).
#ifndef QW_MK_OWE
#define QW_MK_OWE 0
#endif
// 1: a kv head's keys are cut into chunks of equal length (within one key), so no block streams
// more than ceil(len / splits) keys; 0: chunks of whole stages (KEYS keys), which leaves up to
// a stage a block more and fewer chunks (mk_pipe.cuh, attn_geom; experiments).
#ifndef QW_MK_EVEN
#define QW_MK_EVEN 1
#endif
// The most LM-head rows a block owns (the host passes ceil(vocab / blocks)).
#ifndef QW_MK_LM_ROWS
#define QW_MK_LM_ROWS ((QW_VOCAB + 15) / 16)
#endif
// FP8 rows on the tensor cores (mk_matvec.cuh, narrow_pair_dot), which needs the e4m3 -> f16x2
// conversion of sm_89 and later: the host decides (megakernel.py, fp8_on_tensor_cores); 0 is
// the FMA consumer. int4 rows always take the tensor cores (their conversion is integer work).
#ifndef QW_MK_F8_MMA
#define QW_MK_F8_MMA 0
#endif
// How the matrix phases stream their rows (the host decides, megakernel.py): 1, runs of
// 256-column items whatever the rows (stages that hold parts of rows); 0, whole rows.
#ifndef QW_MK_SPLIT
#define QW_MK_SPLIT 0
#endif
// Columns of a row that one consumer warp dots, for FP8 rows on the tensor cores (whose input
// vector is in shared memory, so a segment's length costs no registers); the host decides.
#ifndef QW_MK_MMA_SEG
#define QW_MK_MMA_SEG 1024
#endif
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && !defined(QW_MK_NO_TMA)
#define QW_MK_TMA 1
#else
#define QW_MK_TMA 0
#endif

namespace mk {
constexpr int THREADS = 512;
constexpr int WARPS = THREADS / 32;
// Warps 0 .. CWARPS-1 consume the stages; the last warp is the producer, which refills each
// stage as soon as every consumer has released it, so no consumer ever waits on a refill.
constexpr int CWARPS = WARPS - 1;
constexpr int PRODUCER = CWARPS;  // the producer's warp number
constexpr int STAGES = QW_MK_STAGES;
constexpr int STAGE = QW_MK_STAGE_BYTES;
constexpr int HD = qw::head_dim;
constexpr int QKV_ROWS = qw::q_size + 2 * qw::kv_size;

constexpr bool SPLIT = QW_MK_SPLIT != 0;
// A mixture of experts: a sparse layer's phases are the router's logits (bf16 rows, EXPERTS of
// them), then the chosen experts' gate/up pairs as one matrix of KI virtual rows (the TOPK
// experts' MINTER rows one after another, each expert's rows where its id puts them), then
// their down rows, one expert after another (TOPK phases of MINTER columns).
constexpr bool MOE = QW_MK_MOE != 0;
constexpr int MINTER = QW_MOE_INTER, KI = qwm::TOPK * QW_MOE_INTER;
constexpr int H_LEN = MOE && KI > qw::intermediate ? KI : qw::intermediate;  // h's values
static_assert(!MOE || !SPLIT, "experts stream in whole rows");
__host__ __device__ constexpr int cmax(int a, int b) { return a > b ? a : b; }
// Narrow rows (FP8 or int4) on the tensor cores (mk_matvec.cuh): FP8 needs the e4m3 -> f16x2
// conversion of sm_89 and later (QW_MK_F8_MMA), int4 always; their input vectors are staged as
// f16, padded with zeros to whole steps.
constexpr bool NARROW_MMA = qw::int4 || (qw::fp8 && QW_MK_F8_MMA != 0);
// Whether rows of format WF go to the tensor cores (the LM head's bf16 rows never do).
template <int WF>
__host__ __device__ constexpr bool mma_rows() { return WF != qw::BF16 && NARROW_MMA; }
// 256-column steps: the tensor-core consumer's unit, and (SPLIT) a stage's item.
constexpr int STEP = 256;
__host__ __device__ constexpr int steps(int k) { return (k + STEP - 1) / STEP; }

// Whole rows (SPLIT = 0): each consumer warp holds one segment of a phase's input vector in
// registers (CPL 16-byte chunks per lane), NSEG segments cover K, and CWARPS / NSEG row groups
// take the rows of a stage in turn; a row's segment sums are added in a fixed order.
// Narrow rows on the tensor cores (mma_rows) take segments of QW_MK_MMA_SEG columns instead:
// their vector is in shared memory.
__host__ __device__ constexpr int chunks(int k) { return k / 8; }
template <int WF = qw::BF16>
__host__ __device__ constexpr int nseg(int k) {
    constexpr int SEG = mma_rows<WF>() ? QW_MK_MMA_SEG : 1024;
    return (k + SEG - 1) / SEG < CWARPS ? (k + SEG - 1) / SEG : CWARPS;
}
__host__ __device__ constexpr int cpl(int k) { return (chunks(k) + nseg(k) * 32 - 1) / (nseg(k) * 32); }
template <int WF = qw::BF16>
__host__ __device__ constexpr int groups(int k) { return CWARPS / nseg<WF>(k); }
// The tensor-core consumer: each warp of a row group takes two rows at once.
template <int WF>
__host__ __device__ constexpr int round_rows(int k) {
    return (mma_rows<WF>() ? 2 : 1) * groups<WF>(k);
}
// Of `fit` rows (at most), how many a stage takes: the most rows per round of the row groups
// (a stage's time is its rounds), the larger count on a tie.
__host__ __device__ constexpr int stage_rows(int fit, int groups, int step = 1) {
    int best = 0, best_rate = 0;
    for (int r = step; r <= fit * step; r += step) {
        const int rate = r * 1024 / ((r + groups - 1) / groups);
        if (rate >= best_rate) best = r, best_rate = rate;
    }
    return best;
}
// Rows of K columns in a stage, for the model's weight format (WF = qw::wfmt) or bf16 (the LM
// head). A narrow row carries its scales after its codes (weights.cuh).
template <int WF = qw::wfmt>
__host__ __device__ constexpr int rows_per_stage(int k) {
    return stage_rows(static_cast<int>(STAGE / row_bytes<WF>(k)), round_rows<WF>(k));
}
constexpr int PAIRS_FIT =  // gate/up rows, both halves (as many gate as up rows)
    stage_rows(static_cast<int>(STAGE / (2 * row_bytes<qw::wfmt>(qw::hidden))),
               round_rows<qw::wfmt>(qw::hidden), 2) / 2;
// (A mixture of experts: at most an expert's rows, so that a stage's come from two at most.)
constexpr int PAIRS_PER_STAGE = MOE && PAIRS_FIT > MINTER ? MINTER : PAIRS_FIT;
// A stage's outputs (rows, or gate/up pairs) at most, and its partial sums at most: a row of
// K columns is summed from nseg(K) warps' segments (a pair from twice that).
// (The experts' down rows, MINTER columns, count where the model has them.)
constexpr int DOWN_K = MOE ? MINTER : qw::intermediate;
constexpr int STAGE_OUTS =
    cmax(cmax(cmax(rows_per_stage(qw::hidden), rows_per_stage(qw::q_size)),
              cmax(rows_per_stage(qw::intermediate), rows_per_stage<qw::BF16>(qw::hidden))),
         cmax(PAIRS_PER_STAGE, rows_per_stage(DOWN_K)));
constexpr int STAGE_PARTS =
    cmax(cmax(cmax(rows_per_stage(qw::hidden) * nseg<qw::wfmt>(qw::hidden),
                   rows_per_stage(qw::q_size) * nseg<qw::wfmt>(qw::q_size)),
              cmax(rows_per_stage(qw::intermediate) * nseg<qw::wfmt>(qw::intermediate),
                   rows_per_stage<qw::BF16>(qw::hidden) * nseg(qw::hidden))),
         cmax(2 * PAIRS_PER_STAGE * nseg<qw::wfmt>(qw::hidden),
              rows_per_stage(DOWN_K) * nseg<qw::wfmt>(DOWN_K)));
static_assert(SPLIT || (rows_per_stage(qw::hidden) >= 1 && rows_per_stage(qw::q_size) >= 1 &&
                        rows_per_stage(qw::intermediate) >= 1 && PAIRS_PER_STAGE >= 1 &&
                        rows_per_stage<qw::BF16>(qw::hidden) >= 1),
              "QW_MK_STAGE_BYTES must hold a whole weight row (and a gate/up pair)");
static_assert(SPLIT || STAGE_PARTS * STAGES <= 4096, "the stages' partial sums fit in 16 KB");

// Parts of rows (SPLIT = 1): a matrix phase streams its block's slice of the matrix (gate/up:
// the gate rows, then the up rows) as a sequence of items, item i being 256 columns (the last
// of a row: what is left) of slice row i / steps(K): STEP columns of bf16 (512 bytes) or of FP8
// codes (256 bytes). A stage holds a run of whole items regardless of where rows end, so every
// stage of a phase but its last is full, whatever the row width; each consumer warp takes a
// fixed share of a stage's items, and the input vector stays in shared memory.
// Bytes of a row's block scales (with their padding; 0 for bf16) and of an item's weights.
template <int WF>
__host__ __device__ constexpr int scale_bytes(int k) {
    return static_cast<int>(row_bytes<WF>(k) - code_bytes<WF>(k));
}
// The most bytes m items can take in a stage, wherever the run starts: its rows' scales (each
// row it touches brings them, and a row cut short brings a separate copy of them).
template <int WF>
__host__ __device__ constexpr long long run_bytes(int m, int k) {
    return static_cast<long long>(m) * code_bytes<WF>(STEP) +
           static_cast<long long>((m + steps(k) - 2) / steps(k) + 3) * scale_bytes<WF>(k);
}
// Items a stage holds: as many as fit, rounded down to whole rounds of the consumer warps (a
// stage takes as long as its busiest warp) when there are that many.
template <int WF>
__host__ __device__ constexpr int items_per_stage(int k) {
    int m = static_cast<int>(STAGE / code_bytes<WF>(STEP));
    while (m > 0 && run_bytes<WF>(m, k) > STAGE) --m;
    return m >= CWARPS ? m / CWARPS * CWARPS : m;
}
// A row cut between warps (or stages) is summed from pieces: each piece's sum goes to a table
// at the row's slot, at its first item's offset (zeros at its other items), and the warp whose
// piece completes the row adds the row's entries in order, so the sums never depend on timing.
// Slots are reused every ring_rows(K) rows: more rows than any warps can have open at once
// (warps are at most STAGES stages apart).
template <int WF>
__host__ __device__ constexpr int ring_rows(int k) {
    return (STAGES * items_per_stage<WF>(k) + steps(k) - 1) / steps(k) + 2;
}
template <int WF>
__host__ __device__ constexpr int ring_floats(int k) { return ring_rows<WF>(k) * steps(k); }
// Attention: each consumer warp takes KPW keys of each stage, KPASS at a time with LPK lanes a
// key (DPK dimensions a lane) for the scores; for P . V each lane holds DPL of the head's
// dimensions. KEYS (K and V rows) a stage: as many as fit, in whole passes of every warp.
// (An int8 cache's rows are HD codes a key and a value; their scales are not in the stage:
// mk_attention.cuh loads them itself.)
constexpr int KV_ROW = qw::kv8 ? HD : 2 * HD;  // bytes of a key's (or value's) row
static_assert(!qw::kv8 || HD % 128 == 0, "int8 rows fill whole lines; four codes a lane in P . V");
constexpr int DPK = 16, LPK = HD / DPK, DPL = HD / 32;
constexpr int KPW_FIT = STAGE / (2 * KV_ROW) / CWARPS;
constexpr int KPASS = 32 / LPK < KPW_FIT ? 32 / LPK : KPW_FIT;
// (int8) a warp's keys go to the tensor cores in groups of 8, at most 16 a stage (their
// scales sit in its lanes: mk_attention.cuh)
constexpr int KPW = qw::kv8 ? (KPW_FIT / 8 * 8 < 16 ? KPW_FIT / 8 * 8 : 16)
                            : KPASS > 0 ? KPW_FIT / KPASS * KPASS : 0;
constexpr int KEYS = KPW * CWARPS;
// Attention on the tensor cores (mk_attention.cuh, tc_keys): always with an int8 cache; with
// bf16 for groups of 3 to 8 query heads a kv head. On the CUDA cores a key costs each lane's
// dot products once per head of the group: two heads (0.6B, 1.7B) stay at the copy rate there
// and lose on the tensor cores, four (4B, 8B) reach 72% of it at 128K (docs/perf.md).
// QW_MK_ATTN_TC=0 keeps the CUDA cores for every group, 2 takes the tensor cores for every one.
#ifndef QW_MK_ATTN_TC
#define QW_MK_ATTN_TC 1
#endif
constexpr bool TC_ATTN =
    qw::kv8 || (QW_MK_ATTN_TC && HD % 32 == 0 && qw::group <= 8 &&
                (qw::group >= 3 || QW_MK_ATTN_TC == 2));
static_assert(!qw::kv8 || (KPW >= 8 && qw::group <= 8),
              "int8 attention: a group of 8 keys a warp, at most 8 query heads a kv head");
constexpr int RED = 1024;  // the sampler's scratch floats (two halves)

// The row table's floats and slots (mk_matvec.cuh, rows_phase), for every matrix phase.
constexpr int RING_FLOATS =
    cmax(cmax(cmax(ring_floats<qw::wfmt>(qw::hidden), ring_floats<qw::wfmt>(qw::q_size)),
              ring_floats<qw::wfmt>(qw::intermediate)), ring_floats<qw::BF16>(qw::hidden));
constexpr int RING_ROWS =
    cmax(cmax(cmax(ring_rows<qw::wfmt>(qw::hidden), ring_rows<qw::wfmt>(qw::q_size)),
              ring_rows<qw::wfmt>(qw::intermediate)), ring_rows<qw::BF16>(qw::hidden));
constexpr int PAIR_ROWS = 512;  // gate/up rows a block may own (their pairs' table)

static_assert(STAGE % 128 == 0, "stages are 128-byte aligned");
static_assert(QW_MK_MMA_SEG % STEP == 0, "tensor-core segments are whole 256-column steps");
static_assert(!SPLIT || (items_per_stage<qw::wfmt>(qw::hidden) >= 1 &&
                         items_per_stage<qw::wfmt>(qw::q_size) >= 1 &&
                         items_per_stage<qw::wfmt>(qw::intermediate) >= 1 &&
                         items_per_stage<qw::BF16>(qw::hidden) >= 1),
              "QW_MK_STAGE_BYTES must hold an item of every matrix");
static_assert(!SPLIT || RING_FLOATS + RING_ROWS <= 4096, "the row table fits in 16 KB");
static_assert(qw::group + 2 <= CWARPS, "a consumer warp per query head of a group, plus two");

// A layer's phases in stream order (a mixture of experts' layers have the router's between
// o_proj and gate/up; a dense build has no ROUTER phase).
constexpr int QKV = 0, ATTN = 1, OPROJ = 2, ROUTER = MOE ? 3 : -1, GATEUP = MOE ? 4 : 3,
              DOWN = GATEUP + 1, NPHASES = DOWN + 1;
// Tags a layer uses (megakernel.cu): its Q/K/V, attention, o_proj, (router,) gate/up, down.
constexpr unsigned LAYER_TAGS = MOE ? 6u : 5u;

static_assert(HD >= 32 && KPW >= 1 && KPW % KPASS == 0, "attention lane geometry");

// Sampling with top-k <= CAND: each block offers its own top-k (ties included) as candidates.
constexpr int CAND = 64;
constexpr int LM_ROWS = QW_MK_LM_ROWS;

constexpr int HIST_BYTES = WARPS * 256 * 8;
constexpr int VEC_FLOATS = cmax(cmax(cmax(qw::hidden, qw::q_size), qw::intermediate), MOE ? KI : 0);
// The matrix phases' input vectors: floats, or (narrow rows on the tensor cores) f16 padded to whole
// 256-column steps. The LM head's input is floats either way (its own term below).
// The union after the stages: a phase's input vector, or the warps' attention partial sums,
// or (after the LM head's input vector, which warps may still be reading while others write
// logits) the block's LM-head logits, or (block 0, sampling) the radix histograms.
// Whole int4 rows (int4_pair_dot) take the vector in 512-column steps, in the order its lanes
// read it (stage_f16), and the sums of its 64-column windows after it.
constexpr bool INT4_PAIRS = qw::int4 && !SPLIT;
// A mixture of experts' down rows stream as one phase: virtual rows v = k n + r of the block's
// n hidden rows, expert slot k's down row lo + r, whose input is slot k's part of h. Narrow
// rows on the tensor cores take h as f16 with each slot's part padded to whole steps of their
// consumer (256 columns; int4, 512), so that a row's dot product reads only its own part
// (mk_matvec.cuh, stage_f16's SEG).
constexpr int DOWN_PAD = !NARROW_MMA ? MINTER : INT4_PAIRS ? (MINTER + 511) / 512 * 512
                                                           : steps(MINTER) * STEP;
constexpr int DOWN_KP = MOE ? qwm::TOPK * DOWN_PAD : 0;  // h's columns as staged
constexpr int DOWN_ROWS = 64;  // hidden rows a block may own (the host checks: megakernel.py)
static_assert(!MOE || MINTER % 8 == 0, "an expert's part of h in whole 8-value chunks");
constexpr int VEC_F16_BYTES =
    cmax(INT4_PAIRS ? 1024 * ((VEC_FLOATS + 511) / 512)
                    : 2 * 256 * cmax(cmax(steps(qw::hidden), steps(qw::q_size)), steps(qw::intermediate)),
         INT4_PAIRS ? 1024 * (DOWN_KP / 512) : 2 * DOWN_KP);
constexpr int WINDOW_SUMS = INT4_PAIRS ? cmax((VEC_FLOATS + 511) / 512, DOWN_KP / 512) * 8 : 0;
constexpr int VEC_BYTES = NARROW_MMA ? VEC_F16_BYTES + 4 * WINDOW_SUMS : 4 * VEC_FLOATS;
// The attention's partial outputs (mk_attention.cuh): a slot a warp, or (QW_MK_COMB_HALF, the
// host's choice where shared memory is short: 8 query heads a kv head on a 99 KB card) a slot
// for two warps, the second adding its outputs to the first's.
#ifndef QW_MK_COMB_HALF
#define QW_MK_COMB_HALF 0
#endif
constexpr bool COMB_HALF = QW_MK_COMB_HALF != 0;
constexpr int COMB_SLOTS = COMB_HALF ? WARPS / 2 : WARPS;
constexpr int UNION_BYTES =
    (cmax(cmax(HIST_BYTES, VEC_BYTES),
          cmax(4 * (qw::hidden + LM_ROWS), COMB_SLOTS * qw::group * HD * 4)) + 127) / 128 * 128;
#ifdef QW_MK_HOST_UNION
static_assert(UNION_BYTES == QW_MK_HOST_UNION,
              "the host's megakernel_layout sizes the union region as the kernel does");
#endif
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
    void* k_cache;  // bf16 rows, or int8 rows then their scales (kv8.cuh)
    void* v_cache;
#if QW_MK_MOE
    const bf16_t* router;  // (gate_up and down: every expert's rows, one expert after another)
#endif
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
