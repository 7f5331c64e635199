"""The megakernel decode path: one cooperative launch runs many whole decode steps
(cuda_src/megakernel.cu), sampling and stop checks on the GPU, streaming token ids to a
host-mapped ring and reading live sampling parameters and a cancel flag from host-mapped
memory. Its layout (stages, blocks) is chosen here for the GPU's shared memory."""

from __future__ import annotations

import ctypes
import dataclasses
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from qwenchat.engine.base import GenerateRequest
from qwenchat.engine.cuda import runtime as rt
from qwenchat.engine.cuda.compiler import KernelBuild, kernel_defines
from qwenchat.engine.cuda.sampler import SAMPLE_PARAMS
from qwenchat.errors import QwenchatError
from qwenchat.model import rope
from qwenchat.model.config import Qwen3Config
from qwenchat.model.formats import FORMATS
from qwenchat.sampling.params import SamplingParams

MEGAKERNEL_THREADS = 512
MEGAKERNEL_STAGE_BYTES = 32768  # one shared-memory stage of the weight/KV stream
MEGAKERNEL_STATIC_SHARED = 24 * 1024  # its static shared memory, rounded up (ptxas: ~16-22 KB)
MEGAKERNEL_SPLIT_STATIC_SHARED = 27 * 1024  # with parts of rows (their row table: ~20-26.5 KB)
# with experts (the routing, the down rows' expert sums: ~25-26.5 KB)
MEGAKERNEL_MOE_STATIC_SHARED = 27 * 1024
MEGAKERNEL_HISTOGRAM_BYTES = MEGAKERNEL_THREADS // 32 * 256 * 8  # the sampler's radix bins
MEGAKERNEL_LAYER_BYTES = 10 * 8  # struct MegaLayer: ten pointers (a mixture of experts': 11)
MEGAKERNEL_CANDIDATES = 64  # sampling candidates a block offers at most (CAND in megakernel.cu)
MEGAKERNEL_PARTS = {"weights": 1, "attention": 2, "waits": 4, "sampling": 8}
MEGAKERNEL_EXPERT_ROWS = 64  # hidden rows a block may own with experts (DOWN_ROWS, mk_layout.cuh)
MEGAKERNEL_MIN_SHARED = 48 * 1024  # a layout for less shared memory a block is not offered
MEGAKERNEL_CONSUMERS = ("auto", "fma")  # how FP8 rows are dotted (fp8_on_tensor_cores)
MEGAKERNEL_ROWS = ("auto", "whole", "parts")  # what a stage holds (megakernel_layout)
MEGAKERNEL_LAUNCH_SECONDS = 0.05  # work per launch, far below any display watchdog
MEGAKERNEL_TIMEOUT_S = 30.0
MEGAKERNEL_RING = 1024  # token slots in host-mapped memory: two launches' worth and more
# One phase of one block in a timeline build (struct Record in mk_timeline.cuh): globaltimer
# ns at its start, input, first weights and end (0: not reached), what the phase was, and while
# the block was in it: stages the producer issued, SM cycles it spent issuing them and waiting
# for free stages, and cycles warp 0 waited for full ones.
TIMELINE_RECORD = np.dtype([("start", "<u8"), ("input", "<u8"), ("weights", "<u8"),
                            ("end", "<u8"), ("kind", "<u4"), ("stages", "<u4"),
                            ("issue", "<u8"), ("free_wait", "<u8"), ("full_wait", "<u8")])
TIMELINE_KINDS = ("qkv", "attention", "o_proj", "gate_up", "down", "lm_head", "sample", "router")


class MegaArgs(ctypes.Structure):
    """The decode megakernel's argument block (struct MegaArgs in cuda_src/megakernel.cu)."""

    _fields_ = [(name, ctypes.c_uint64) for name in (
        "layers", "embed", "final_norm", "lm_head", "inv_freq", "x", "qkv", "attn", "h", "best",
        "chosen", "logits", "work", "part_o", "part_ml", "cand", "merge_count", "seen",
        "counts", "token", "pos", "stopped", "eos", "host", "params", "ring")]
    _fields_ += [("eps", ctypes.c_float), ("scale", ctypes.c_float)]
    _fields_ += [(name, ctypes.c_int) for name in (
        "num_layers", "capacity", "splits", "n_eos", "max_steps", "feed_first", "first_step",
        "ring_len", "epoch")]


class GpuShape(Protocol):
    """What the kernel plan needs to know of a GPU (rt.Device has it)."""

    arch: str
    sm_count: int
    max_shared_per_block_optin: int
    cooperative_launch: bool
    memory_bandwidth: float  # peak bytes/s (0: unknown)


@dataclass(frozen=True)
class MegakernelLayout:
    """How the decode megakernel uses a GPU's shared memory for one model shape."""

    stages: int  # the weight/KV stream's ring depth
    stage_bytes: int
    fixed: int  # the rest of its dynamic shared memory: the union region, the layer table
    blocks: int  # one per SM
    lm_rows: int  # LM-head rows per block
    mma: bool = False  # narrow (FP8, int4) rows on the tensor cores, their vectors staged as f16
    split: bool = False  # stages hold parts of rows (runs of 256-column items)
    mma_seg: int = 1024  # (mma, whole rows) columns of a row that one consumer warp dots
    comb_half: bool = False  # the attention's partial outputs in half the slots (COMB_HALF)

    def defines(self, config: Qwen3Config, weight_format: str = "bf16",
                kv_format: str = "bf16") -> dict[str, int | float]:
        # (QW_MK_HOST_UNION: the kernel checks at compile time that it sizes its union region
        # as this layout did, so the layer table after it lies inside the shared memory given.)
        union = self.fixed - config.num_hidden_layers * layer_bytes(config)
        defines = dict(kernel_defines(config, weight_format, kv_format), QW_MK_STAGES=self.stages,
                       QW_MK_STAGE_BYTES=self.stage_bytes, QW_MK_LM_ROWS=self.lm_rows,
                       QW_MK_HOST_UNION=union)
        if weight_format == "fp8":
            defines["QW_MK_F8_MMA"] = int(self.mma)
        if self.split:
            defines["QW_MK_SPLIT"] = 1
        if self.mma and self.mma_seg != 1024:
            defines["QW_MK_MMA_SEG"] = self.mma_seg
        if self.comb_half:
            defines["QW_MK_COMB_HALF"] = 1
        return defines


def layer_bytes(cfg: Qwen3Config) -> int:
    """Bytes of struct MegaLayer (mk_layout.cuh): a mixture of experts' has the router's too."""
    return MEGAKERNEL_LAYER_BYTES + (8 if cfg.is_moe else 0)


def fp8_on_tensor_cores(arch: str, consumer: str = "auto") -> bool:
    """Whether the megakernel dots FP8 rows on the tensor cores: with the "auto" consumer,
    on GPUs that convert FP8 in hardware (sm_89 and later); "fma" keeps the CUDA cores."""
    if consumer not in MEGAKERNEL_CONSUMERS:
        raise QwenchatError(f"unknown megakernel consumer {consumer!r}; "
                            f"known: {', '.join(MEGAKERNEL_CONSUMERS)}")
    return consumer == "auto" and int(arch.removeprefix("sm_").rstrip("a")) >= 89


def megakernel_layout(cfg: Qwen3Config, shared_per_block: int, sm_count: int,
                      weight_format: str = "bf16", f8_mma: bool = False,
                      rows: str = "auto", bandwidth: float = 0.0) -> MegakernelLayout | str:
    """The megakernel's layout on a GPU with this much opt-in shared memory per block and
    this many SMs, for linear layers in `weight_format` (FP8: dotted on the tensor cores with
    `f8_mma`, see fp8_on_tensor_cores; int4: always there), or why it cannot run there (then
    the per-op graph decodes).

    Two ways to stream the weights (QW_MK_SPLIT in mk_layout.cuh): whole rows, each consumer
    warp holding a segment of the input vector in registers; or stages that hold parts of
    rows (runs of 256-column items), the vector in shared memory. Whole rows measured faster
    wherever they fill the stages well (docs/perf.md, 2026-11-26: 0.6B-1.7B and 8B bf16, every
    FP8 size); parts of rows are taken where whole rows fill a stage to less than
    SPLIT_BELOW_FILL (4B and 14B bf16) or do not fit at all (32B bf16 on an H100, 14B FP8 and
    8B bf16 on a 99 KB card). `rows` "whole" or "parts" takes that way whatever the fill
    (tests and comparisons). `bandwidth` is the GPU's peak memory bandwidth (bytes/s; 0:
    unknown): where each SM gets at least MMA_RING_BANDWIDTH of it, FP8 rows on the tensor
    cores take the wider ring of _mma_ring."""
    if rows not in MEGAKERNEL_ROWS:
        raise QwenchatError(f"unknown megakernel rows {rows!r}; "
                            f"known: {', '.join(MEGAKERNEL_ROWS)}")
    if cfg.is_moe:  # (the experts' rows stream whole: mk_pipe.cuh, expert_pairs_source)
        if rows == "parts":
            return "the megakernel streams a mixture of experts' rows whole, not in parts"
        rows = "whole"
    # int4 rows always take the tensor cores (their conversion is integer work on any GPU).
    mma = weight_format == "int4" or (f8_mma and weight_format == "fp8")
    wide = mma and bandwidth / sm_count >= MMA_RING_BANDWIDTH

    def choose(comb_half: bool) -> MegakernelLayout | str:
        if rows != "auto":
            return _layout(cfg, shared_per_block, sm_count, weight_format, mma,
                           rows == "parts", wide, comb_half)
        whole = _layout(cfg, shared_per_block, sm_count, weight_format, mma, False, wide,
                        comb_half)
        if isinstance(whole, str) or (not mma and stage_fill(cfg, whole, weight_format)
                                      < SPLIT_BELOW_FILL):
            split = _layout(cfg, shared_per_block, sm_count, weight_format, mma, True,
                            comb_half=comb_half)
            if not isinstance(split, str) or isinstance(whole, str):
                return split
        return whole

    # Where it does not fit, the attention's partial outputs in half the slots (COMB_HALF in
    # mk_layout.cuh) may make it: 8 query heads a kv head (32B, 30B-A3B) on a 99 KB card.
    layout = choose(False)
    if isinstance(layout, str) and attention_sums_bytes(cfg) > MEGAKERNEL_HISTOGRAM_BYTES:
        halved = choose(True)
        if not isinstance(halved, str):
            return halved
    return layout


def attention_sums_bytes(cfg: Qwen3Config, comb_half: bool = False) -> int:
    """The attention phase's partial outputs in the union region: a slot a warp, or (COMB_HALF)
    a slot for two warps, the second adding its outputs to the first's."""
    slots = MEGAKERNEL_THREADS // 32 // (2 if comb_half else 1)
    return slots * cfg.group_size * cfg.head_dim * 4


SPLIT_BELOW_FILL = 0.65  # whole rows fill a stage less: stream parts of rows (measured)
# The most bytes a ring of whole rows holds, by weight format. A deeper ring is slower on an
# H100, not faster (docs/perf.md, 2026-11-27: three 32 KB stages against five, 0.6B FP8 +10%,
# 4B FP8 +6%, 1.7B bf16 +3%, 8B bf16 +2%, 8B FP8 even); int4 rows keep four (8B int4 3% and
# 1.7B 2% slower at three, 4B's best at 4K).
WHOLE_RING_BYTES = {"bf16": 3 * 32768, "fp8": 3 * 32768, "int4": 4 * 32768}


def stage_fill(cfg: Qwen3Config, layout: MegakernelLayout, weight_format: str) -> float:
    """How full the least-filled matrix phase keeps a stage with whole rows (rows_per_stage in
    mk_layout.cuh): a warp segment of the vector per 1,024 columns, up to 15 warps, so many
    row groups, and a stage takes as many rows as keep the most rows per round of them."""
    consumers = MEGAKERNEL_THREADS // 32 - 1

    def rows(fit: int, groups: int, step: int = 1) -> int:
        best, best_rate = 0, 0
        for r in range(step, fit * step + 1, step):
            rate = r * 1024 // -(-r // groups)
            if rate >= best_rate:
                best, best_rate = r, rate
        return best

    def fill(k: int, fmt: str, pairs: bool = False) -> float:
        row = FORMATS[fmt].row_bytes(k) * (2 if pairs else 1)
        mma = FORMATS[fmt].narrow and layout.mma
        groups = consumers // min(-(-k // (layout.mma_seg if mma else 1024)), consumers)
        if mma:
            groups *= 2
        n = rows(layout.stage_bytes // row * (2 if pairs else 1), groups, 2 if pairs else 1)
        return n * row / (2 if pairs else 1) / layout.stage_bytes

    return min(fill(cfg.hidden_size, weight_format), fill(cfg.q_size, weight_format),
               fill(cfg.intermediate_size, weight_format),
               fill(cfg.hidden_size, weight_format, pairs=True), fill(cfg.hidden_size, "bf16"))


def megakernel_static_shared(cfg: Qwen3Config, split: bool) -> int:
    """The megakernel's static shared memory, rounded up: what its layout leaves it."""
    if split:
        return MEGAKERNEL_SPLIT_STATIC_SHARED
    return MEGAKERNEL_MOE_STATIC_SHARED if cfg.is_moe else MEGAKERNEL_STATIC_SHARED


def _layout(cfg: Qwen3Config, shared_per_block: int, sm_count: int, weight_format: str,
            mma: bool, split: bool, wide: bool = False,
            comb_half: bool = False) -> MegakernelLayout | str:
    """megakernel_layout for one way of streaming the weights."""
    static = megakernel_static_shared(cfg, split)
    stage = MEGAKERNEL_STAGE_BYTES
    blocks = min(sm_count, 512)  # one block per SM (its scratch holds 512)
    # Beside the stages, one region (UNION_BYTES in megakernel.cu) holds in turn a phase's
    # input vector, the warps' attention partial sums, the block's LM-head logits and the
    # sampler's histograms; then the table of layer pointers.
    lm_rows = math.ceil(cfg.vocab_size / blocks)
    widths = (cfg.hidden_size, cfg.q_size, cfg.intermediate_size)
    # The matrix phases' input vectors: floats, or (FP8 on the tensor cores) f16 padded to
    # whole 256-column steps (VEC_BYTES in mk_layout.cuh).
    f16_vector = 2 * 256 * max(math.ceil(k / 256) for k in widths)
    int4_steps = math.ceil(max(widths) / 512)
    if cfg.is_moe:  # the experts' down phase stages all of h, each slot's part padded (DOWN_PAD)
        k, inter = cfg.num_experts_per_tok, cfg.moe_intermediate_size
        widths += (k * inter,)
        f16_vector = max(f16_vector, 2 * 256 * k * math.ceil(inter / 256))
        int4_steps = max(int4_steps, k * math.ceil(inter / 512))
    if weight_format == "int4" and not split:  # 512-column steps and their windows' sums
        f16_vector = (1024 + 4 * 8) * int4_steps

    comb = attention_sums_bytes(cfg, comb_half)

    def fixed_bytes(vector: int) -> int:  # the union region and the layer table
        union = max(MEGAKERNEL_HISTOGRAM_BYTES, vector,
                    4 * (cfg.hidden_size + lm_rows),  # (the logits go after the LM head's input)
                    comb)
        return (union + 127) // 128 * 128 + cfg.num_hidden_layers * layer_bytes(cfg)

    fixed = fixed_bytes(f16_vector if mma else 4 * max(widths))
    # The ring is sized as for float vectors even where they are f16: the room they free
    # only counts where it makes the megakernel fit at all (a 99 KB card). Deeper rings were
    # measured slower on the H100 (docs/perf.md: 32B FP8 at 4 stages 6% below 3, 8B at 5
    # 2% below 4).
    room = shared_per_block - static - fixed_bytes(4 * max(widths))
    # Attention needs a key and a value row in a stage for each consumer warp.
    least = -(-4 * cfg.head_dim * (MEGAKERNEL_THREADS // 32 - 1) // 1024) * 1024
    if split:  # a stage holds any run of items: its size needs no whole row
        count = min(16, room // stage)
        if count < 3:
            if room // 3 >= 3 * stage // 4:  # three stages a little smaller (32B on an H100)
                stage = room // 3 // 1024 * 1024
            else:
                stage //= 2  # smaller GPUs: more, smaller stages
            count = min(16, room // stage)
        if count < 2:
            room = shared_per_block - static - fixed
            count = min(16, room // stage)
        if count < 2:
            stage, count = room // 2 // 1024 * 1024, 2  # two smaller stages
        fits, smallest = stage >= least, least
    else:
        if room // stage < 3:
            stage //= 2  # smaller GPUs: more, smaller stages
        # A stage holds a whole row of every matrix (a gate/up pair together), in the
        # weights' format; the LM head's rows stay bf16.
        row = FORMATS[weight_format].linear_bytes
        widest_row = max(2 * row((1, cfg.hidden_size)), row((1, cfg.q_size)),
                         row((1, cfg.intermediate_size)), 2 * cfg.hidden_size, least)
        while stage < widest_row:
            stage *= 2
        count = min(16, room // stage, max(2, WHOLE_RING_BYTES[weight_format] // stage))
        if count < 2:
            count = min(16, (shared_per_block - static - fixed) // stage)
        fits, smallest = count >= 2, stage
    # int4 rows on the tensor cores: a warp dots up to MMA_SEG_INT4 columns of a row (a
    # hidden-wide row whole on every size), so a row's fixed cost (its sums, the segments'
    # meeting) comes once per 8,192 columns: a 1,024-column segment of int4 is only 512
    # bytes, and the consumer bound the step at that (docs/perf.md, 2026-11-26).
    seg = MMA_SEG_INT4 if weight_format == "int4" and not split else 1024
    if wide and not split and cfg.hidden_size >= 2048:
        ring = _mma_ring(cfg, shared_per_block - static - fixed, widest_row, weight_format)
        if ring:
            count, stage, seg = ring
    if not fits:
        need = static + fixed + 2 * smallest
        return (f"the decode megakernel needs {need:,} bytes of shared memory "
                f"per block for this model and the GPU has {shared_per_block:,}")
    if math.ceil(cfg.hidden_size / blocks) > 512:
        return "this model is too wide for the decode megakernel on this GPU"
    if cfg.is_moe and math.ceil(cfg.hidden_size / blocks) > MEGAKERNEL_EXPERT_ROWS:
        return "this mixture of experts is too wide for the decode megakernel on this GPU"
    if split and math.ceil(cfg.intermediate_size / blocks) > 512:  # PAIR_ROWS in mk_layout.cuh
        return "this model's MLP is too wide for the decode megakernel on this GPU"
    return MegakernelLayout(count, stage, fixed, blocks, lm_rows, mma, split, seg, comb_half)


MMA_SEG_MOST = 2560  # columns of a row a warp dots on the tensor cores, at most (FP8)
MMA_SEG_INT4 = 8192  # the same for int4 rows (8,192 measured 3-5% faster than 4,096 on 14B/32B)
MMA_STAGE_ROWS = 10  # the fewest hidden-wide rows a stage of that ring must hold
# Peak memory bandwidth a SM (bytes/s) from which FP8 rows take that ring: an H200 (4.8 TB/s,
# 36 GB/s a SM), where the consumer bounds FP8 decode; not an H100 SXM (3.35 TB/s, 25 GB/s a
# SM), where it measured no faster than the 32 KB ring (-4% to +2%; docs/perf.md, 2026-11-26).
MMA_RING_BANDWIDTH = 30e9


def _mma_ring(cfg: Qwen3Config, room: int, widest_row: int,
              weight_format: str = "fp8") -> tuple[int, int, int] | None:
    """(stages, stage bytes, segment columns) for FP8 rows on the tensor cores, or None to keep
    the 32 KB ring: each warp dots a long segment of a row (half of a hidden-wide row from 4B
    up) and a stage holds as many gate/up pairs of hidden-wide rows as three stages leave room
    for (two, where three would hold fewer than MMA_STAGE_ROWS rows). A warp's fixed cost of a
    row segment (its sums, the segments' meeting) then comes once per 2,048-2,560 columns
    instead of 1,024, and more rows a stage keep the consumer warps busy: measured 9-14% faster
    on 4B-32B on an H200, where the consumer bounds FP8 decode (docs/perf.md, 2026-11-26).
    `widest_row`: what every stage must hold (_layout's, whole rows)."""
    hidden = cfg.hidden_size
    parts = -(-hidden // MMA_SEG_MOST)
    seg = -(-hidden // parts // 256) * 256
    row = FORMATS[weight_format].row_bytes(hidden)
    for count in (3, 2):
        rows = room // count // row // 2 * 2
        stage = -(-rows * row // 128) * 128
        if rows >= MMA_STAGE_ROWS and stage >= widest_row and count * stage <= room:
            return count, stage, seg
    return None


def megakernel_unusable(config: Qwen3Config, device: GpuShape,
                        layout: MegakernelLayout | str) -> str | None:
    """Why the megakernel cannot decode this model on this GPU (then the per-op graph does),
    given its layout there (megakernel_layout)."""
    if not device.cooperative_launch:
        return "this GPU cannot launch cooperative kernels"
    if config.is_moe and config.sparse_layers < config.num_hidden_layers:
        return ("the megakernel routes a mixture of experts whose every layer is sparse; this "
                "model's mlp_only_layers or decoder_sparse_step leave dense ones")
    if config.head_dim < 64:
        # A key/value row must fill whole 128-byte lines: within one launch a line read
        # before part of it is written may be served stale to the bulk copies.
        return f"head_dim {config.head_dim} is below the megakernel's 64"
    return layout if isinstance(layout, str) else None


def megakernel_build(config: Qwen3Config, arch: str, weight_format: str,
                     layout: MegakernelLayout, skip: Sequence[str] = (),
                     stages: int | tuple[int, int] | None = None, timeline: int = 0,
                     kv_format: str = "bf16") -> tuple[MegakernelLayout, KernelBuild]:
    """The megakernel's build for its layout on this GPU (and the layout it is built for).

    The stage ring takes what shared memory the device allows per block, less the static
    part and the sampler's histograms; `skip` leaves parts out (timing variants only: the
    tokens are then wrong), `stages` overrides the ring depth, or (count, bytes) its depth and
    stage size (experiments) and `timeline` > 0
    records that many phases of a launch in every block (tests/step_timeline.py)."""
    unknown = sorted(set(skip) - set(MEGAKERNEL_PARTS))
    if unknown:
        raise QwenchatError(f"unknown megakernel part {unknown[0]!r}; "
                            f"known: {', '.join(MEGAKERNEL_PARTS)}")
    if stages:
        count, size = stages if isinstance(stages, tuple) else (stages, layout.stage_bytes)
        layout = dataclasses.replace(layout, stages=count, stage_bytes=size)
    defines = dict(layout.defines(config, weight_format, kv_format),
                   QW_MK_SKIP=sum(MEGAKERNEL_PARTS[p] for p in skip))
    if timeline:
        defines["QW_MK_TIMELINE"] = timeline
    defines.update(EXPERIMENT_DEFINES)
    return layout, KernelBuild.of("megakernel.cu", arch, defines)


# Defines every megakernel build of this process takes on top of its layout's: for benchmark
# aids that compare variants the kernel keeps behind a define (tests/step_timeline.py
# --define, tests/consumer_compare.py --define); empty in every real run.
EXPERIMENT_DEFINES: dict[str, int] = {}


class MegakernelDecode:
    """CudaEngine's megakernel decode: load and allocate (_setup_megakernel, with the layout of
    megakernel_build in mk_layout), then per reply keep a launch queued behind the running one
    and read tokens from the ring. Uses the engine's config, device, kernels, stream, weights,
    KV cache and sampler buffers."""

    def _setup_megakernel(self, cubin: bytes) -> None:
        """Load the compiled megakernel (of megakernel_build) and allocate its state."""
        cfg, layout = self.config, self.mk_layout
        count, stage, fixed, blocks = layout.stages, layout.stage_bytes, layout.fixed, layout.blocks
        module = rt.Module(cubin)
        self._modules.append(module)
        kernel = self.k["decode_megakernel"] = module.function("decode_megakernel")
        self.mk_timeline = None
        if self.mk_timeline_phases:  # [phase][block] records (mk_timeline.cuh)
            self.mk_timeline = self._device_buffer(
                self.mk_timeline_phases * layout.blocks * TIMELINE_RECORD.itemsize)
            module.set_pointer("qw_timeline", self.mk_timeline.ptr)
        self.mk_stages, self.mk_stage_bytes = count, stage
        self.mk_shared = count * stage + fixed
        kernel.set_max_dynamic_shared(self.mk_shared)
        if kernel.max_active_blocks_per_sm(MEGAKERNEL_THREADS, self.mk_shared) < 1:
            raise QwenchatError("the decode megakernel does not fit on this GPU; "
                                "use --decode layered")
        self.mk_blocks = blocks
        # Chunks per kv head: enough for one item per block at long context.
        self.mk_splits = max(1, min(64, self.mk_blocks // cfg.num_key_value_heads))
        heads, hd = cfg.num_attention_heads, cfg.head_dim
        self.mk_part_o = self._device_buffer(heads * self.mk_splits * hd * 4)
        self.mk_part_ml = self._device_buffer(heads * self.mk_splits * 2 * 4)
        self.mk_cand = self._device_buffer(self.mk_blocks * MEGAKERNEL_CANDIDATES * 8)
        # Tagged values (8 bytes each) and the merge counters, zeroed before every launch.
        # (a mixture of experts: h holds the chosen experts' SwiGLU outputs, then the router's
        # logits: H_LEN in mk_layout.cuh)
        h = cfg.intermediate_size
        if cfg.is_moe:
            h = max(h, cfg.num_experts_per_tok * cfg.moe_intermediate_size) + cfg.num_experts
        tagged = {"x": cfg.hidden_size, "qkv": cfg.q_size + 2 * cfg.kv_size,
                  "attn": cfg.q_size, "h": h, "best": 4 * self.mk_blocks, "chosen": 2}
        self.mk_tagged = self._device_buffer(8 * sum(tagged.values())
                                             + 4 * cfg.num_key_value_heads)
        self._mk_tagged_ptrs, offset = {}, 0
        for name, count in tagged.items():
            self._mk_tagged_ptrs[name] = self.mk_tagged.ptr + offset
            offset += 8 * count
        self._mk_merge_ptr = self.mk_tagged.ptr + offset
        self.mk_eos = self._device_buffer(64 * 4)
        self.mk_params = self._device_buffer(2 * SAMPLE_PARAMS.itemsize)
        # struct MegaLayer; a mixture of experts' layer: every expert's rows, and the router's
        layer_ptrs = np.array([
            [w.input_norm.ptr, w.qkv.ptr, w.q_norm.ptr, w.k_norm.ptr, w.o.ptr, w.post_norm.ptr,
             *((w.gate_up.ptr, w.down.ptr) if w.router is None
               else (w.experts_gate_up.ptr, w.experts_down.ptr)),
             kc.ptr, vc.ptr, *(() if w.router is None else (w.router.ptr,))]
            for w, kc, vc in zip(self.layers, self.k_cache, self.v_cache, strict=True)],
            dtype=np.uint64)
        self.mk_layers = self._device_buffer(layer_ptrs.nbytes)
        self.mk_layers.upload(layer_ptrs)
        step_bytes = self.weight_bytes
        if cfg.is_moe:  # (a step reads its chosen experts' rows only)
            experts = sum(w.experts_gate_up.nbytes + w.experts_down.nbytes
                          for w in self.layers if w.router is not None)
            step_bytes -= experts * (1 - cfg.num_experts_per_tok / cfg.num_experts)
        step_seconds = step_bytes / 2e12 + 100e-6
        self.steps_per_launch = int(max(1, min(256, MEGAKERNEL_LAUNCH_SECONDS // step_seconds)))
        # Launches queued behind the running one (0: each launch only once the host has read
        # every token of the one before, so last_logits() is the last read token's; tests).
        self.launches_ahead = 1
        # Host-mapped: the parameters and the cancel flag (48 bytes, read by the kernel), then
        # the ring of (token, sequence number) pairs it writes.
        header = SAMPLE_PARAMS.itemsize + 8
        self._mapped = rt.PinnedBuffer(header + 8 * MEGAKERNEL_RING, mapped=True)
        self._mk_params = self._mapped.array(SAMPLE_PARAMS, 1)
        words = self._mapped.array(np.int32)
        self._mk_cancel = words[SAMPLE_PARAMS.itemsize // 4 : SAMPLE_PARAMS.itemsize // 4 + 1]
        self._mk_ring = words[header // 4 :].reshape(-1, 2)
        self.mk_stopped = self._device_buffer(4)
        self._mk_consumed = self._mk_requested = self._mk_epoch = 0
        self._mk_n_eos = 0
        self._mk_run: int | None = None  # plain steps before a pass may come (None: any)
        self._mk_limit: int | None = None  # the reply step launches stop before, if any

    def _megakernel_begin(self, request: GenerateRequest) -> None:
        self._mk_cancel[0] = 0
        self._mk_ring[:] = 0
        self._mk_consumed = self._mk_requested = 0
        self._mk_run = self._mk_limit = None
        self.mk_stopped.fill_u8(0, stream=self.stream)
        eos = np.asarray(sorted(request.eos_ids)[:64], dtype=np.int32)
        if eos.size:
            self.mk_eos.upload(eos, stream=self.stream)
        self._mk_n_eos = int(eos.size)
        self._mirror_params(request.params.current)
        self._unsubscribe = request.params.subscribe(self._mirror_params)

    def _megakernel_end(self) -> None:
        self._unsubscribe()
        self._mk_cancel[0] = 1  # a launch still running stops after its current step,
        self.stream.synchronize()  # and the ones queued behind it return at once
        self._mk_cancel[0] = 0
        self._mk_consumed = self._mk_requested = 0

    def _megakernel_args(self, steps: int, feed_first: bool, first_step: int,
                         n_eos: int) -> MegaArgs:
        cfg, mapped, t = self.config, self._mapped.device_ptr, self._mk_tagged_ptrs
        return MegaArgs(
            self.mk_layers.ptr, self.embed.ptr, self.final_norm.ptr, self.lm_head.ptr,
            self.inv_freq.ptr, t["x"], t["qkv"], t["attn"], t["h"], t["best"], t["chosen"],
            self.logits.ptr, self.work.ptr, self.mk_part_o.ptr, self.mk_part_ml.ptr,
            self.mk_cand.ptr, self._mk_merge_ptr, self.seen.ptr, self.counts.ptr,
            self.token.ptr, self.pos.ptr, self.mk_stopped.ptr,
            self.mk_eos.ptr, mapped, self.mk_params.ptr, mapped + SAMPLE_PARAMS.itemsize + 8,
            cfg.rms_norm_eps, rope.softmax_scale(cfg), cfg.num_hidden_layers, self.capacity,
            self.mk_splits, n_eos, steps, int(feed_first), first_step, len(self._mk_ring),
            self._mk_epoch & 0xFFF)

    def _mirror_params(self, params: SamplingParams) -> None:
        """Write the parameters to host-mapped memory, which the running kernel reads before
        every token: a change made while a launch runs applies to the next token it samples."""
        host = self._mk_params
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                     "frequency_penalty", "top_k"):
            host[name] = getattr(params, name)
        seed = self._request.seed if params.seed is None else params.seed
        host["seed"] = seed & ((1 << 64) - 1)

    def _megakernel_token(self, fed: int | None, params: SamplingParams, seed: int,
                          step: int) -> int | None:
        """The reply's next token from the ring; None when the GPU has ended the reply first
        (a cancel that reached it before this token)."""
        if fed is not None:
            self._tokens.append(fed)  # the kernel has already run it
        if self._mk_requested == self._mk_consumed != step:
            # After a speculative pass (_rewind left the token and position on the device):
            # the launches go on from the reply's step, for its sampler stream and its ring.
            self._mk_requested = self._mk_consumed = step
        self._mk_limit = None if self._mk_run is None else step + self._mk_run
        self._queue_launches(params)
        waited = time.monotonic()
        wanted = self._mk_consumed + 1
        slot = self._mk_ring[self._mk_consumed % len(self._mk_ring)]
        while int(slot[1]) != wanted:
            if self._request.cancel.is_set():
                self._mk_cancel[0] = 1
                if self.stream.idle() and int(slot[1]) != wanted:
                    return None
            if time.monotonic() - waited > MEGAKERNEL_TIMEOUT_S:
                raise QwenchatError("the decode kernel stopped producing tokens; "
                                    "rerun with --decode layered and report this")
            time.sleep(0)
        token = int(slot[0])
        self._mk_consumed += 1
        return token

    def _plain_pending(self) -> bool:
        return self.decode == "megakernel" and self._mk_requested > self._mk_consumed

    def _plan_plain(self, steps: int | None) -> None:
        self._mk_run = steps  # (from the step _megakernel_token takes next)

    def megakernel_produced(self) -> int:
        """Tokens the reply's launches have written so far."""
        return int(self._mk_ring[:, 1].max())

    def _queue_launches(self, params: SamplingParams) -> None:
        """Keep a second launch queued behind the running one, so the GPU never waits for this
        thread between launches: a host that is late by up to a launch's work (a busy UI, the
        GIL) costs no decode time. The first launch of a reply samples from the prefill's
        logits; every later one feeds the token the one before it left on the device."""
        spl = self.steps_per_launch
        while self._mk_requested - self._mk_consumed <= spl * self.launches_ahead:
            steps = min(spl, len(self._mk_ring) - (self._mk_requested - self._mk_consumed))
            if params.max_tokens is not None:
                steps = min(steps, params.max_tokens - self._mk_requested)
            if self._mk_limit is not None:  # (a speculative pass comes after)
                steps = min(steps, self._mk_limit - self._mk_requested)
            if steps <= 0:
                return
            self._launch_megakernel(steps, self._mk_requested)
            self._mk_requested += steps

    def megakernel_timeline(self) -> np.ndarray:
        """The last launch's timeline records, [phase][block] (a timeline build only)."""
        if self.mk_timeline is None:
            raise QwenchatError("this engine's megakernel records no timeline")
        records = np.empty((self.mk_timeline_phases, self.mk_blocks), TIMELINE_RECORD)
        self.stream.synchronize()
        self.mk_timeline.download(records)
        return records

    def _launch_megakernel(self, steps: int, first_step: int) -> None:
        self.mk_tagged.fill_u8(0, stream=self.stream)
        if self.mk_timeline is not None:
            self.mk_timeline.fill_u8(0, stream=self.stream)
        self._mk_epoch += 1  # every launch tags its values afresh
        args = self._megakernel_args(steps, first_step > 0, first_step, self._mk_n_eos)
        rt.launch(self.k["decode_megakernel"], self.mk_blocks, MEGAKERNEL_THREADS, [args],
                  shared=self.mk_shared, stream=self.stream, cooperative=True)
