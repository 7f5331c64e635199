// The step timeline (tests/step_timeline.py): with QW_MK_TIMELINE = N > 0 the megakernel
// records, for each of a launch's first N phases and each block, when the phase started, when
// its input vector had arrived, when its first stage of weights (or keys) was in shared memory,
// and when its last consumer warp was done (globaltimer, ns); and, while the block's warps were
// in that phase, how many stages the producer warp issued, the SM cycles (clock64) it spent
// issuing them and waiting for consumers to free them, and the cycles warp 0 waited for
// stages to fill. With QW_MK_TIMELINE = 0 (every real run) the hooks expand to nothing and the
// kernel is the same to the byte.
#pragma once
#include "mk_layout.cuh"

#ifndef QW_MK_TIMELINE
#define QW_MK_TIMELINE 0
#endif
#ifndef QW_MK_TL_AT
#define QW_MK_TL_AT 0
#endif
#ifndef QW_MK_TL_MV
#define QW_MK_TL_MV 0
#endif

#if QW_MK_TIMELINE
namespace mk_timeline {
// What a record's phase was (mirrored by tests/step_timeline.py).
enum Kind : unsigned { QKV = 0, ATTENTION = 1, O_PROJ = 2, GATE_UP = 3, DOWN = 4, LM_HEAD = 5,
                       SAMPLE = 6, ROUTER = 7 };
enum Mark { START = 0, INPUT = 1, WEIGHTS = 2, END = 3 };
enum Cycles { ISSUE = 0, FREE_WAIT = 1, FULL_WAIT = 2 };
struct Record {
    unsigned long long t[4];  // by Mark; 0: not reached
    unsigned kind;
    unsigned stages;               // stages the producer issued while in this phase
    unsigned long long cycles[3];  // by Cycles
};
static_assert(sizeof(Record) == 64, "mirrored by TIMELINE_RECORD in megakernel.py");
}  // namespace mk_timeline

// [phase][block] records; the host sets it (cuModuleGetGlobal) and zeroes them.
extern "C" {
__device__ mk_timeline::Record* qw_timeline;
}

namespace mk_timeline {
__shared__ unsigned warp_phase[mk::WARPS];  // phases each warp has entered in this launch

__device__ __forceinline__ unsigned long long now() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// (QW_TL_MV) the phase number + 1 of the last probe each warp recorded: one a phase, the first.
__shared__ unsigned probed[mk::WARPS];

__device__ __forceinline__ void init() {
    if (threadIdx.x < mk::WARPS) warp_phase[threadIdx.x] = probed[threadIdx.x] = 0u;
}

// Every thread of every warp at a phase's entry: the phase's number in this launch (the
// warps go through the phases in one order, each at its own pace, so each keeps its count).
__device__ __forceinline__ unsigned enter() {
    const int warp = threadIdx.x >> 5;
    const unsigned phase = warp_phase[warp];
    __syncwarp();
    if ((threadIdx.x & 31) == 0) warp_phase[warp] = phase + 1u;
    __syncwarp();
    return phase;
}

// This block's record of the launch's phase-th phase.
__device__ __forceinline__ Record* record(unsigned phase) {
    return qw_timeline + phase * gridDim.x + blockIdx.x;
}

// START, INPUT and WEIGHTS as warp 0 sees them; END when the last consumer warp is done.
__device__ __forceinline__ void mark(unsigned phase, Mark m, unsigned kind = 0) {
    if (phase >= QW_MK_TIMELINE || (threadIdx.x & 31) != 0) return;
    Record* r = record(phase);
    const int warp = threadIdx.x >> 5;
    if (m == END) {
        if (warp != mk::PRODUCER) atomicMax(&r->t[END], now());
        return;
    }
    if (warp != 0) return;
    r->t[m] = now();
    if (m == START) r->kind = kind;
}

// A matrix phase's probe point (QW_TL_MV): the WEIGHTS time of the phase the calling warp is
// in, from warp 0 (or, `producer`, from the producer warp), the first time the warp passes it in
// the phase. Reads the phase from warp_phase, so it works in the functions a phase calls.
__device__ __forceinline__ void probe(bool producer) {
    const int warp = threadIdx.x >> 5;
    if (warp != (producer ? mk::PRODUCER : 0) || (threadIdx.x & 31) != 0) return;
    const unsigned phase = warp_phase[warp] - 1u;
    if (phase >= QW_MK_TIMELINE || probed[warp] == phase + 1u) return;
    probed[warp] = phase + 1u;
    record(phase)->t[WEIGHTS] = now();
}

// Lane 0 of a warp: adds `cycles` (and `stages`) to the record of the phase the warp is in.
__device__ __forceinline__ void add(Cycles c, long long cycles, unsigned stages = 0u) {
    const unsigned phase = warp_phase[threadIdx.x >> 5] - 1u;
    if (phase >= QW_MK_TIMELINE || (threadIdx.x & 31) != 0) return;
    Record* r = record(phase);
    // Reductions, not a read-modify-write: the warp does not wait for L2 here (a load would put
    // a round trip between the marks around it: 0.8-1 µs, docs/perf.md 2026-11-27).
    atomicAdd(&r->cycles[c], static_cast<unsigned long long>(cycles));
    if (stages) atomicAdd(&r->stages, stages);
}
}  // namespace mk_timeline

#define QW_TL_CLOCK(var) const long long var = clock64()
// The producer's turn at a stage: waited from t0 to t1 for it to be free, then issued it.
#define QW_TL_PRODUCED(t0, t1)                                           \
    do {                                                                 \
        const long long tl_t2_ = clock64();                              \
        mk_timeline::add(mk_timeline::FREE_WAIT, (t1) - (t0));           \
        mk_timeline::add(mk_timeline::ISSUE, tl_t2_ - (t1), 1u);         \
    } while (0)
// Warp 0 waited from t0 for a stage to fill.
#define QW_TL_WAITED(t0)                                                          \
    do {                                                                          \
        if ((threadIdx.x >> 5) == 0) mk_timeline::add(mk_timeline::FULL_WAIT, clock64() - (t0)); \
    } while (0)
#define QW_TL_INIT() mk_timeline::init()
#define QW_TL_ENTER(kind)                                 \
    const unsigned tl_phase_ = mk_timeline::enter();      \
    mk_timeline::mark(tl_phase_, mk_timeline::START, (kind))
#define QW_TL_MARK(m) mk_timeline::mark(tl_phase_, mk_timeline::m)
#define QW_TL_MARK_IF(cond, m) \
    if (cond) mk_timeline::mark(tl_phase_, mk_timeline::m)
// A probe of the attention phase (tests/step_timeline.py --define QW_MK_TL_AT=K): its
// WEIGHTS mark, by default where its first stage of keys is ready (point 0), is taken at point
// K instead (mk_attention.cuh numbers them), so that the span from its input to each point is
// measured.
#define QW_TL_AT(cond, k) QW_TL_MARK_IF((cond) && QW_MK_TL_AT == (k), WEIGHTS)
// A matrix phase's probe (tests/step_timeline.py --mv-probes, QW_MK_TL_MV=K): its WEIGHTS mark,
// by default where its first stage is ready, is taken at point K instead (mk_matvec.cuh numbers
// them), warp 0's view; QW_TL_MV_PRODUCER the producer warp's.
#define QW_TL_MV(k)                                            \
    do {                                                       \
        if (QW_MK_TL_MV == (k)) mk_timeline::probe(false);     \
    } while (0)
#define QW_TL_MV_PRODUCER(k)                                   \
    do {                                                       \
        if (QW_MK_TL_MV == (k)) mk_timeline::probe(true);      \
    } while (0)
#else
#define QW_TL_CLOCK(var)
#define QW_TL_PRODUCED(t0, t1)
#define QW_TL_WAITED(t0)
#define QW_TL_INIT()
#define QW_TL_ENTER(kind)
#define QW_TL_MARK(m)
#define QW_TL_MARK_IF(cond, m)
#define QW_TL_AT(cond, k)
#define QW_TL_MV(k)
#define QW_TL_MV_PRODUCER(k)
#endif
