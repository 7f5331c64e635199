"""The CUDA engine: NVRTC-compiled kernels from cuda_src/, tensor-core prefill, GPU decode.

Prefill runs the new tokens through every layer as batched tensor-core GEMMs and flash
attention, in chunks that bound the scratch memory. Decode has two paths. "megakernel": one
cooperative launch runs many whole decode steps, sampling and stop checks on the GPU,
streaming token ids to a host-mapped ring buffer and reading live sampling parameters and a
cancel flag from host-mapped memory. "layered": one token through a CUDA graph of per-op
kernels whose position and input token live in device memory. "auto" (the default) takes the
megakernel wherever it can run (it is the faster at every position and sampler measured,
docs/perf.md) and the graph where it cannot.
"""

from __future__ import annotations

import ctypes
import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from qwenchat.engine import DECODES, FP8_ACTIVATIONS
from qwenchat.engine.base import CacheBookkeeping, GenerateRequest
from qwenchat.engine.cuda import runtime as rt
from qwenchat.engine.cuda.builds import (
    SM90_KERNELS,
    kernel_builds,
    kernel_names,
    prefill_paths,
    run_weights,
    unsupported_reason,
)
from qwenchat.engine.cuda.compiler import Compilation, KernelBuild, KernelCache
from qwenchat.engine.cuda.layered import DECODE_MAX_CHUNK, LayeredDecode
from qwenchat.engine.cuda.megakernel import (
    MEGAKERNEL_MIN_SHARED,
    GpuShape,
    MegakernelDecode,
    MegakernelLayout,
    fp8_on_tensor_cores,
    megakernel_build,
    megakernel_layout,
    megakernel_unusable,
)
from qwenchat.engine.cuda.moe import MoeLayers
from qwenchat.engine.cuda.prefill import (
    GEMM90_SHARED,
    GEMM_FP8_KERNELS,
    PREFILL_KERNELS,
    PREFILL_MAX_KEY_SPLITS,
    PREFILL_QUERIES_PER_BLOCK,
    SPLIT_K_BYTES,
    Prefill,
    attention90_shared,
    dense_mlp_rows,
    dequant_scratch_bytes,
    gemm_shared_bytes,
    prefill_attention_shared,
    prefill_scratch_budget,
)
from qwenchat.engine.cuda.sampler import SAMPLE_PARAMS, SAMPLER_HISTOGRAM_BYTES
from qwenchat.engine.cuda.scoring import Scoring
from qwenchat.engine.cuda.verify import (
    DEPENDENT_KERNELS,
    VERIFY_ROWS,
    VerifyPass,
    pass_norm_parts,
)
from qwenchat.engine.cuda.weights import WeightUpload
from qwenchat.errors import BackendUnavailable, QwenchatError
from qwenchat.model.checkpoint import WeightSource
from qwenchat.model.config import Qwen3Config
from qwenchat.model.formats import FORMATS
from qwenchat.model.kv_cache import KV_CACHE_CHOICES, bytes_per_position
from qwenchat.sampling.params import SamplingParams
from qwenchat.sampling.sampler import sample_token_gpu
from qwenchat.sampling.speculative import verify


class KeptTokens(ctypes.Structure):
    """sampling.cu's KeptTokens: a speculative pass's kept tokens, passed by value."""

    _fields_ = (("ids", ctypes.c_int * VERIFY_ROWS), ("n", ctypes.c_int),
                ("next_token", ctypes.c_int), ("position", ctypes.c_int))


LM_HEAD_ROWS_PER_BLOCK = 32  # 8 warps x 4 rows (rmsnorm_gemv4)
MEMORY_MARGIN = 512 * 2**20  # left free for the driver, other programs and fragmentation


def decode_split_options(config: Qwen3Config, capacity: int, sm_count: int) -> list[int]:
    """Flash-decoding split counts, one decode graph each: few chunks while the context is
    short (little to merge), enough chunks to fill the chip later; the largest also keeps
    every chunk within DECODE_MAX_CHUNK keys at full capacity."""
    widest = max(math.ceil(capacity / DECODE_MAX_CHUNK),
                 math.ceil(4 * sm_count / config.num_key_value_heads))
    return sorted({min(16, widest), widest})


def verify_chunk_bytes(config: Qwen3Config) -> int:
    """The speculative pass's flash-decoding output for one chunk of keys: a float per
    dimension of every head of each of its rows (one chunk per DECODE_MAX_CHUNK positions at
    full capacity)."""
    return VERIFY_ROWS * config.num_attention_heads * config.head_dim * 4


def partials_bytes(config: Qwen3Config, capacity: int, split_k: bool, sm_count: int) -> int:
    """CudaEngine.partials: the largest of the float partial sums its passes take in turn (a
    decode step's chunks, a prefill's key splits, the speculative pass's chunks of each row,
    and split K's products where `split_k`)."""
    heads, hd = config.num_attention_heads, config.head_dim
    most = decode_split_options(config, capacity, sm_count)[-1]
    return max(heads * most * hd * 4,
               PREFILL_QUERIES_PER_BLOCK * heads * PREFILL_MAX_KEY_SPLITS * hd * 4,
               verify_chunk_bytes(config) * most,
               SPLIT_K_BYTES if split_k else 0)


@dataclass(frozen=True)
class KernelPlan:
    """Which paths a run takes on a GPU, and so which kernels it compiles."""

    decode: str  # "megakernel" or "layered"
    why_layered: str | None  # why the megakernel cannot decode here, if it cannot
    hopper_gemm: bool  # prefill products on gemm_sm90.cu
    hopper_attention: bool  # prefill attention on attention_sm90.cu
    fp8_gemm: bool  # FP8 weights' prefill products on e4m3 tensor cores (gemm_fp8_sm90.cu)
    megakernel_layout: MegakernelLayout | None
    megakernel: KernelBuild | None
    builds: list[KernelBuild]


def plan_kernels(config: Qwen3Config, weight_format: str, device: GpuShape,
                 decode: str = "auto", prefill_kernels: str = "auto",
                 megakernel_skip: Sequence[str] = (),
                 megakernel_stages: int | tuple[int, int] | None = None,
                 megakernel_timeline: int = 0, megakernel_consumer: str = "auto",
                 megakernel_shared: int | None = None,
                 megakernel_rows: str = "auto", kv_format: str = "bf16",
                 fp8_activations: str = "auto") -> KernelPlan:
    """The paths and kernels of a run: "auto" decodes in the megakernel wherever it can run
    and prefills with the Hopper kernels on sm_90. `megakernel_shared` lays the megakernel out
    for that much shared memory a block instead of the GPU's (at most the GPU's): 101,376
    runs an H100 as an RTX 4090 would lay it out. `megakernel_rows` "whole" or "parts" forces
    how its stages hold the weight rows (megakernel_layout; tests and comparisons). An int8
    KV cache (`kv_format`) is decoded by the megakernel only at head_dim 128 (its rows must
    fill whole lines). FP8 weights prefill with e4m3 activations on Hopper's FP8 tensor cores
    unless `fp8_activations` is "bf16" (their codes then widened to bf16 for gemm_sm90.cu)."""
    shared = device.max_shared_per_block_optin
    if megakernel_shared is not None:
        if not MEGAKERNEL_MIN_SHARED <= megakernel_shared <= shared:
            raise QwenchatError(f"the megakernel's shared memory must be {MEGAKERNEL_MIN_SHARED:,} "
                                f"to {shared:,} bytes on this GPU; got {megakernel_shared:,}")
        shared = megakernel_shared
    hopper_gemm, hopper_attention, fp8_gemm = prefill_paths(config, weight_format, device.arch,
                                                            prefill_kernels, fp8_activations)
    layout = megakernel_layout(config, shared, device.sm_count, weight_format,
                               fp8_on_tensor_cores(device.arch, megakernel_consumer),
                               megakernel_rows, device.memory_bandwidth)
    why = megakernel_unusable(config, device, layout)
    if why is None and kv_format != "bf16" and config.head_dim < 128:
        # (an int8 row must fill whole 128-byte lines, as a bf16 one must: megakernel_unusable)
        why = f"head_dim {config.head_dim} is below the megakernel's 128 for an int8 KV cache"
    chosen = "layered" if why or decode == "layered" else "megakernel"
    build = None
    if chosen == "megakernel":
        layout, build = megakernel_build(config, device.arch, weight_format, layout,
                                         megakernel_skip, megakernel_stages, megakernel_timeline,
                                         kv_format)
    else:
        layout = None
    return KernelPlan(chosen, why, hopper_gemm, hopper_attention, fp8_gemm, layout, build,
                      kernel_builds(config, weight_format, device.arch, hopper_gemm=hopper_gemm,
                                    hopper_attention=hopper_attention, megakernel=build,
                                    kv_format=kv_format, fp8_gemm=fp8_gemm))


def compile_kernels(config: Qwen3Config, weight_format: str, device: int = 0,
                    decode: str = "auto", announce: Callable[[str], None] | None = None,
                    progress: Callable[[str], None] | None = None
                    ) -> tuple[str, KernelPlan, Compilation]:
    """Fill the kernel cache with every cubin a run of this model would build on GPU `device`
    (`qwenchat info --compile`): (the GPU's name, the plan, the finished compilation)."""
    reason = unsupported_reason(config, weight_format)
    if reason:
        raise QwenchatError(f"the CUDA engine does not run this model: {reason}")
    gpu = rt.Device(device)
    try:
        plan = plan_kernels(config, weight_format, gpu, decode)
        compilation = KernelCache().start(plan.builds, announce, progress)
        compilation.wait()
        return gpu.name, plan, compilation
    finally:
        gpu.close()


class CudaEngine(Prefill, LayeredDecode, MegakernelDecode, VerifyPass, MoeLayers, WeightUpload,
                 CacheBookkeeping, Scoring):
    """The engine protocol on one GPU. Its parts live beside it, one module each, as the
    kernels do: weight upload (weights.py), prefill (prefill.py), the per-op decode graph
    (layered.py), the decode megakernel (megakernel.py), the speculative pass (verify.py),
    a mixture of experts' layers (moe.py) and eval's windows (scoring.py);
    this class owns the device, the buffers they share, and the reply's bookkeeping."""

    def __init__(
        self,
        config: Qwen3Config,
        weights: WeightSource,
        ctx: int | None = None,
        device: int = 0,
        notice: Callable[[str], None] = lambda _: None,
        decode: str = "auto",
        megakernel_skip: Sequence[str] = (),
        megakernel_stages: int | tuple[int, int] | None = None,
        prefill_kernels: str = "auto",
        progress: Callable[[str], None] | None = None,
        megakernel_timeline: int = 0,
        megakernel_consumer: str = "auto",
        megakernel_shared: int | None = None,
        megakernel_rows: str = "auto",
        kv_cache: str = "bf16",
        fp8_activations: str = "auto",
        megakernel_later: bool = False,
    ):
        """`notice` gets what the user should know (a kernel compile starting, a fallback);
        `progress` a line as each kernel compile ends. `megakernel_timeline` > 0 builds a
        megakernel that records that many phases of each launch (tests/step_timeline.py);
        `megakernel_consumer` "fma" keeps FP8 rows off the tensor cores (comparisons);
        `megakernel_shared` lays the megakernel out for less shared memory than the GPU has,
        `megakernel_rows` forces whole rows or parts of rows in its stages (plan_kernels);
        `kv_cache` "int8" keeps keys and values as int8 rows and their scales (kv8.cuh);
        `fp8_activations` "bf16" keeps FP8 weights' prefill off the e4m3 tensor cores
        (plan_kernels). `megakernel_later` (with `decode` "auto"): where the megakernel is not
        in the kernel cache yet, compile it in a process of its own and decode with the per-op
        graph until a reply starts after it is ready, so a first answer does not wait for the
        longest compile (`ask`, the chat; a benchmark waits for it)."""
        if kv_cache not in KV_CACHE_CHOICES:
            raise QwenchatError(f"--kv-cache must be one of {', '.join(KV_CACHE_CHOICES)}; "
                                f"got {kv_cache!r}")
        if decode not in DECODES:
            choices = ", ".join(DECODES)
            raise QwenchatError(f"--decode must be one of {choices}; got {decode!r}")
        if fp8_activations not in FP8_ACTIVATIONS:
            raise QwenchatError(f"fp8_activations must be one of {', '.join(FP8_ACTIVATIONS)}; "
                                f"got {fp8_activations!r}")
        if prefill_kernels not in PREFILL_KERNELS:
            choices = ", ".join(PREFILL_KERNELS)
            raise QwenchatError(f"prefill_kernels must be one of {choices}; "
                                f"got {prefill_kernels!r}")
        weights, self.weight_format = run_weights(weights)
        self.kv_format = kv_cache
        reason = unsupported_reason(config, self.weight_format)
        if reason:
            raise BackendUnavailable(f"{reason}; use --backend cpu")
        self.config = config
        self.notice = notice  # (later compiles announce themselves too: scoring.py's)
        self.device = rt.Device(device)
        self.device_name = self.device.name
        self.name = f"cuda ({self.device.name})"
        self.stream = rt.Stream()
        self._buffers: list[rt.DeviceBuffer] = []
        self._modules: list[rt.Module] = []
        self._graphs: dict[int, rt.Graph] = {}  # decode step per flash-decoding split count
        plan = plan_kernels(config, self.weight_format, self.device, decode, prefill_kernels,
                            megakernel_skip, megakernel_stages, megakernel_timeline,
                            megakernel_consumer, megakernel_shared, megakernel_rows,
                            kv_cache, fp8_activations)
        self.mk_timeline_phases = megakernel_timeline
        if plan.why_layered and decode == "megakernel":
            notice(f"{plan.why_layered}: decoding layer by layer")
        self.decode, self.mk_layout = plan.decode, plan.megakernel_layout
        self.gemm90, self.attention90 = plan.hopper_gemm, plan.hopper_attention
        self.fp8_gemm = plan.fp8_gemm
        # False leaves the prefill's attention kernels out (its output is then stale): only
        # for `qwenchat bench`, which times a prefill with and without them.
        self.prefill_attention = True
        # The kernels compile on worker threads while the weights upload; a megakernel to be
        # ready later compiles in a process of its own (megakernel_later).
        cache, builds = KernelCache(), plan.builds
        self.megakernel_pending = None
        if (megakernel_later and decode == "auto" and plan.megakernel is not None
                and cache.cached(plan.megakernel) is None):
            builds = [build for build in builds if build != plan.megakernel]
            self.megakernel_pending = cache.start_detached(plan.megakernel)
            self.decode = "layered"
            notice("compiling the decode megakernel in the background (once per model and "
                   "GPU): decoding layer by layer until it is ready")
        compilation = cache.start(builds, announce=notice, progress=progress)
        try:
            self._upload(weights)
            super().__init__(self._choose_capacity(ctx, notice))
            self._allocate_state()
            self._load_kernels(compilation)
            self._draw_weights()  # random weights, drawn on the device
            if plan.megakernel is not None and self.megakernel_pending is None:
                self._setup_megakernel(compilation.cubin(plan.megakernel))
        except BaseException:
            compilation.cancel()
            raise
        self._logits_valid = False

    def _upload(self, weights: WeightSource) -> None:
        """The weights onto the GPU, or one line on how much memory they need."""
        try:
            self._upload_weights(weights)
        except rt.CudaError as exc:
            if "OUT_OF_MEMORY" not in str(exc):
                raise
            self.close()
            free, total = self.device.mem_info()
            need = FORMATS[self.weight_format].weight_bytes(self.config.tensor_shapes())
            raise QwenchatError(
                f"out of GPU memory: the weights need {need / 2**30:.2f} GiB and "
                f"{self.device.name} has {free / 2**30:.2f} of {total / 2**30:.2f} GiB free; "
                "close other GPU programs, pick a smaller model or use --backend cpu") from None

    # ----------------------------------------------------------------------------- set-up
    def _load_kernels(self, compilation: Compilation) -> None:
        """The modules of every build but the megakernel's, as their compiles end."""
        self.k: dict[str, rt.Kernel] = {}
        for build, cubin in compilation.wait().items():
            names = kernel_names(build)
            if names is None:  # the megakernel: _setup_megakernel loads it
                continue
            module = rt.Module(cubin)
            self._modules.append(module)
            for name in names:
                self.k[name] = module.function(name)
        self.k["sample_token"].set_max_dynamic_shared(SAMPLER_HISTOGRAM_BYTES)
        for name in ("attn_prefill", "attn_pass_packed"):
            self.k[name].set_max_dynamic_shared(prefill_attention_shared(self.config.head_dim))
        for name in ("gemm_store", "gemm_add"):
            if name in self.k:
                self.k[name].set_max_dynamic_shared(gemm_shared_bytes(self.weight_format))
        for name in (*SM90_KERNELS["gemm_sm90.cu"], *GEMM_FP8_KERNELS,
                     *SM90_KERNELS["moe_sm90.cu"]):
            if name in self.k and name.startswith(("gemm", "moe90")):
                self.k[name].set_max_dynamic_shared(GEMM90_SHARED)
        self._moe_shared()
        if "attn_prefill90" in self.k:
            self.k["attn_prefill90"].set_max_dynamic_shared(
                attention90_shared(self.config.head_dim))

    @property
    def prefill_chunk(self) -> int:
        """Tokens a prefill pass takes (bounded by its scratch memory)."""
        return self.chunk

    def _device_buffer(self, nbytes: int) -> rt.DeviceBuffer:
        buffer = rt.DeviceBuffer(max(nbytes, 16))
        self._buffers.append(buffer)
        return buffer


    def _choose_capacity(self, ctx: int | None, notice: Callable[[str], None]) -> int:
        """The KV-cache size: as asked (or the model's maximum), if it fits in free memory."""
        cfg = self.config
        free, _ = self.device.mem_info()
        # (+ the context id kept for penalties, and the speculative pass's flash-decoding
        # chunks, which grow with the capacity: partials_bytes)
        per_position = (bytes_per_position(cfg, self.kv_format) + 4
                        + math.ceil(verify_chunk_bytes(cfg) / DECODE_MAX_CHUNK))
        scratch = (prefill_scratch_budget(cfg) + cfg.vocab_size * 16 + 16 * 2**20
                   + dequant_scratch_bytes(cfg, self.weight_format) + SPLIT_K_BYTES)
        fits = max(0, (free - MEMORY_MARGIN - scratch) // per_position)
        wanted = ctx or cfg.context_limit
        if wanted <= fits:
            return wanted
        if ctx is not None:
            raise QwenchatError(
                f"out of GPU memory: a {ctx}-token KV cache needs {ctx * per_position / 2**30:.2f}"
                f" GiB but {free / 2**30:.2f} GiB is free after the {self.weight_bytes / 2**30:.2f}"
                f" GiB of weights; use --ctx {max(256, fits // 256 * 256)} or less")
        if fits < 256:
            raise QwenchatError(f"out of GPU memory: {free / 2**30:.2f} GiB free after the "
                                "weights leaves no room for a KV cache; close other GPU programs")
        reduced = int(fits // 256 * 256)
        notice(f"context reduced to {reduced} tokens to fit in GPU memory (--ctx to choose)")
        return reduced

    def _allocate_state(self) -> None:
        cfg, cap = self.config, self.capacity
        # bf16 rows, or int8 rows then their float scales (cuda_src/kv8.cuh)
        layer_cache = bytes_per_position(cfg, self.kv_format) // (2 * cfg.num_hidden_layers) * cap
        self.k_cache = [self._device_buffer(layer_cache) for _ in range(cfg.num_hidden_layers)]
        self.v_cache = [self._device_buffer(layer_cache) for _ in range(cfg.num_hidden_layers)]
        if self.attention90:  # rows it reads past the prompt must be finite (attention_sm90.cu)
            for buffer in (*self.k_cache, *self.v_cache):
                buffer.fill_u8(0)
        self.kv_bytes = 2 * cfg.num_hidden_layers * layer_cache
        c = self.chunk = min(self._prefill_chunk_tokens(), cap)
        qkv_cols = cfg.q_size + 2 * cfg.kv_size
        self.x = self._device_buffer(c * cfg.hidden_size * 4)
        self.xn = self._device_buffer(c * cfg.hidden_size * 2)
        # A pass's RMSNorm inputs (verify.cuh's PassNorm): x times the next norm's weights in
        # bf16, and each token's sums of squares by the blocks of the product that wrote x.
        self.pass_xg = self._device_buffer(VERIFY_ROWS * cfg.hidden_size * 2)
        self.pass_sq = self._device_buffer(VERIFY_ROWS * pass_norm_parts(cfg) * 4)
        if cfg.is_moe:  # qkv, q and attn are dead by the sparse MLP: they lie in its scratch
            self._allocate_moe(max(c, VERIFY_ROWS), qkv_cols * 4 + cfg.q_size * 2)
            self.qkv = rt.Ptr(self.moe_stage.ptr)
            self.q = rt.Ptr(self.moe_stage.ptr + c * qkv_cols * 4)
            self.attn = rt.Ptr(self.moe_act.ptr)
        else:
            self.qkv = self._device_buffer(c * qkv_cols * 4)
            self.q = self._device_buffer(c * cfg.q_size * 2)
            self.attn = self._device_buffer(c * cfg.q_size * 2)
        # fp32 gate/up rows: the layered decode's one row, and the prefill's unless
        # gemm_sm90.cu applies SwiGLU in gate/up's product.
        self.gu = self._device_buffer((1 if self.gemm90 else c) * 2 * cfg.intermediate_size * 4)
        # (the speculative pass's rows too: with e4m3 activations, only those; none where
        # every layer is sparse, past the layered decode's one)
        dense = dense_mlp_rows(cfg)
        act_rows = (VERIFY_ROWS if self.fp8_gemm else c) if dense else 1
        self.act = self._device_buffer(act_rows * cfg.intermediate_size * 2)
        if self.fp8_gemm:  # e4m3 codes and scales of xn / attn (one at a time), and of act
            widest = max(cfg.hidden_size, cfg.q_size)
            self.xq = self._device_buffer(c * widest)
            self.xq_scales = self._device_buffer(c * math.ceil(widest / 128) * 4)
            act_q = c if dense else 1
            self.actq = self._device_buffer(act_q * cfg.intermediate_size)
            self.actq_scales = self._device_buffer(
                act_q * math.ceil(cfg.intermediate_size / 128) * 4)
        self.w16 = self._device_buffer(dequant_scratch_bytes(cfg, self.weight_format))
        self.short_start = self._device_buffer(4)  # a short prompt's graph reads its start here
        self._short_graphs: dict[tuple[int, int, bool], rt.Graph] = {}
        self._window_graphs: dict[tuple, rt.Graph] = {}  # eval's windows (scoring.py)
        self.ids = self._device_buffer(c * 4)
        sms = self.device.sm_count
        self.split_options = decode_split_options(cfg, cap, sms)
        most = self.split_options[-1]
        # One scratch for the partial sums a pass writes and merges before its next kernel
        # reads anything else: a layered decode step's flash-decoding chunks (part_o), a
        # prefill's key splits (prefill_part_o), split K's products of a short prompt on
        # gemm_sm90.cu (splitk_parts) and the speculative pass's chunks (verify_part_o, which
        # the first prefill of a few tokens needs). The passes run one at a time on the
        # engine's stream, so they share it: at 131,072 positions 8B's speculative chunks
        # alone take 64 MiB.
        split_k = self.gemm90 and not self.fp8_gemm
        self.partials = self._device_buffer(partials_bytes(cfg, cap, split_k, sms))
        self.part_o = self.prefill_part_o = self.verify_part_o = self.partials
        self.splitk_parts = self.partials
        self.part_ml = self._device_buffer(cfg.num_attention_heads * most * 2 * 4)
        rows = PREFILL_QUERIES_PER_BLOCK * cfg.num_attention_heads * PREFILL_MAX_KEY_SPLITS
        self.prefill_part_ml = self._device_buffer(rows * 2 * 4)
        self.attn_f32 = self._device_buffer(cfg.q_size * 4)
        self.logits = self._device_buffer(cfg.vocab_size * 4)
        self.work = self._device_buffer(cfg.vocab_size * 4)
        self.sample_blocks = min(math.ceil(cfg.vocab_size / 1024), 4 * sms)
        self.partial_val = self._device_buffer(self.sample_blocks * 4)
        self.partial_idx = self._device_buffer(self.sample_blocks * 4)
        self.seen = self._device_buffer(cfg.vocab_size)
        self.counts = self._device_buffer(cfg.vocab_size * 4)
        self.context_ids = self._device_buffer(cap * 4)
        self.token = self._device_buffer(4)
        self.pos = self._device_buffer(4)
        self.params = self._device_buffer(SAMPLE_PARAMS.itemsize)
        self._host = rt.PinnedBuffer(64)
        self._host_token = self._host.array(np.int32, 1)
        self._host_pos = self._host.array(np.int32, 2)[1:]
        self._host_params = rt.PinnedBuffer(SAMPLE_PARAMS.itemsize).array(SAMPLE_PARAMS, 1)
        self._build_tensor_maps()
        self._build_moe_maps()

    # ----------------------------------------------------------------------------- launches
    def _launch(self, name: str, grid, block, *args, shared: int = 0) -> None:
        rt.launch(self.k[name], grid, block, list(args), shared=shared, stream=self.stream,
                  dependent=self._dependent_now and name in DEPENDENT_KERNELS)

    def _ptr(self, buffer: rt.DeviceBuffer, byte_offset: int = 0) -> rt.Ptr:
        return rt.Ptr(buffer.ptr + byte_offset)


    def _lm_head(self, x_row: rt.Ptr, out: rt.Ptr) -> None:
        cfg = self.config
        self._launch("rmsnorm_gemv4", math.ceil(cfg.vocab_size / LM_HEAD_ROWS_PER_BLOCK), 256,
                     x_row, self.final_norm, self.lm_head, ctypes.c_int(cfg.vocab_size),
                     ctypes.c_float(cfg.rms_norm_eps), out)


    # ----------------------------------------------------------------------------- protocol
    def prefill(self, token_ids: Sequence[int]) -> None:
        self._check_prefill(token_ids, self.config.vocab_size)
        self.device.make_current()
        ids = np.asarray(token_ids, dtype=np.int32)
        start = self.position
        for a in range(0, len(ids), self.chunk):
            part = ids[a : a + self.chunk]
            if len(part) <= VERIFY_ROWS:
                # A few tokens (a draft catching up, a sampled draft's next token, the end of
                # a long prompt): a pass's graph costs about a decode step, the prefill's GEMMs
                # several at these sizes. (Decided by the chunk, so a prompt prefilled in
                # parts of `chunk` tokens still computes what one call does.)
                self._verify_state()
                self._upload_pass_ids(part.tolist())
                self._verify_forward(start + a, len(part))
                self._keep_pass_row(len(part) - 1)
                continue
            rows = self.short_prompt_rows(start + a, len(part))
            if rows is not None:  # a chat's next message: one graph launch (prefill.py)
                self._forward_short(start + a, part, rows)
            else:
                self.ids.upload(part, stream=self.stream)
                self._forward_prefill(start + a, len(part))
            if a + len(part) == len(ids):
                self._lm_head(self._ptr(self.x, (len(part) - 1) * self.config.hidden_size * 4),
                              self._ptr(self.logits))
        self.stream.synchronize()
        self._tokens.extend(int(t) for t in ids)
        self._logits_valid = True

    def prefill_logits(self, token_ids: Sequence[int]) -> np.ndarray:
        """Prefill, returning the logits of every new position (tokens x vocab), for tests."""
        cfg = self.config
        rows = []
        start = 0
        for a in range(0, len(token_ids), self.chunk):
            part = list(token_ids[a : a + self.chunk])
            self.prefill(part)
            out = np.empty((len(part), cfg.vocab_size), np.float32)
            for r in range(len(part)):
                self._lm_head(self._ptr(self.x, r * cfg.hidden_size * 4), self._ptr(self.work))
                self.work.download(out[r], stream=self.stream)
            self.stream.synchronize()
            rows.append(out)
            start += len(part)
        return np.concatenate(rows)

    def last_logits(self) -> np.ndarray:
        if not self._logits_valid:
            raise RuntimeError("no logits yet: prefill first")
        self.device.make_current()
        out = np.empty(self.config.vocab_size, np.float32)
        self.logits.download(out, stream=self.stream)
        self.stream.synchronize()
        return out

    def close(self) -> None:
        """Free the GPU memory, graphs and modules (from any thread: the context is made
        current here)."""
        self.device.make_current()
        mapped = getattr(self, "_mapped", None)
        if mapped is not None:
            mapped.free()
            self._mapped = None
        rt.close_graphs(self._graphs)
        self._close_verify()
        self._close_short()
        self._close_window_graphs()
        for buffer in self._buffers:
            buffer.free()
        self._buffers.clear()
        for module in self._modules:
            module.close()
        self._modules.clear()

    # ----------------------------------------------------------------------------- decode

    def _reset_sampling_state(self) -> None:
        self.seen.fill_u8(0, stream=self.stream)
        self.counts.fill_u8(0, stream=self.stream)
        if self._tokens:
            ids = np.asarray(self._tokens, dtype=np.int32)
            self.context_ids.upload(ids, stream=self.stream)
            self._launch("mark_seen", min(1024, math.ceil(len(ids) / 256)), 256,
                         self.context_ids, ctypes.c_int(len(ids)), self.seen)
        self._host_pos[0] = self.position
        self.pos.upload(self._host_pos, stream=self.stream)


    def _has_logits(self) -> bool:
        return self._logits_valid

    def _drop_logits(self) -> None:
        self._logits_valid = False

    def _begin_reply(self, request: GenerateRequest) -> None:
        self.device.make_current()
        self._adopt_megakernel()
        self._reset_sampling_state()
        self._request = request
        self._reply_counts: Counter[int] = Counter()  # (the device's counts, for verify)
        if self.decode == "megakernel":
            self._megakernel_begin(request)

    def _adopt_megakernel(self) -> None:
        """Between replies: decode in the megakernel from now on where its background compile
        (megakernel_later) has ended; a compile that failed is raised once, and the per-op
        graph goes on decoding."""
        if self.megakernel_pending is None:
            return
        try:
            cubin = self.megakernel_pending.poll()
        except BaseException:
            self.megakernel_pending = None
            raise
        if cubin is not None:
            self.megakernel_pending = None
            self._setup_megakernel(cubin)
            self.decode = "megakernel"

    def _end_reply(self) -> None:
        if self.decode == "megakernel":
            self._megakernel_end()

    def _next_token(self, fed: int | None, params: SamplingParams, seed: int,
                    step: int) -> int | None:
        if self.decode == "megakernel":
            token = self._megakernel_token(fed, params, seed, step)
        else:
            token = self._layered_token(fed, params, seed, step)
        if token is not None:
            self._reply_counts[token] += 1
        return token

    # ----------------------------------------------------------------------------- speculation
    def _speculative_pass(self, fed: int, proposal: list[int], params: SamplingParams,
                          seed: int, step: int, draft_probs: np.ndarray | None) -> list[int]:
        """The fed token and the proposal through the target in one pass (verify.py: each
        weight read once for all of them, the KV cache written for every one, the LM head on
        each row), then the choice a plain step would make from each row: greedy without
        penalties, each row's argmax on the GPU (rows_argmax, the plain sampler's ties); else
        the rows on the host for verify with the GPU sampler's draw (sample_token_gpu), so
        that a kept token is the one a plain step would have drawn from the same logits."""
        self.device.make_current()
        self._verify_state()
        n, start = len(proposal) + 1, self.position
        self._upload_pass_ids([fed, *proposal])
        self._verify_forward(start, n)
        self._tokens.extend([fed, *proposal])
        if params.greedy and not params.penalized:
            self._launch("rows_argmax", n, 1024, self.pass_logits,
                         ctypes.c_int(self.config.vocab_size), self.verify_choice)
            choice = self._host_verify_choice[:n]
            self.verify_choice.download(choice, stream=self.stream)
            self.stream.synchronize()
            kept = []
            for i, token in enumerate(choice.tolist()):
                kept.append(token)
                if i == len(proposal) or token != proposal[i]:
                    return kept
        rows = self._pass_rows_host()[:n]
        self.pass_logits.download(rows, stream=self.stream)
        self.stream.synchronize()
        context = self._tokens[:start]  # (the penalties' context: a copy only where they count)
        return verify(rows, proposal, params, seed, step, context, self._reply_counts,
                      draft_probs, sample=sample_token_gpu)

    def _rewind(self, position: int, row: int, emitted: list[int]) -> None:
        """Keep the cache up to `position` (entries past it are written over later), and
        leave the device as plain decoding would have: the pass's row `row` of logits the last
        position's, the emitted tokens counted and seen for the penalties (count_tokens, as
        plain steps count theirs), the last one to be fed next at `position`. Queued only:
        the tokens travel in count_tokens' launch, so no host buffer has to outlive it."""
        self.device.make_current()
        del self._tokens[position:]
        self._reply_counts.update(emitted)
        self._keep_pass_row(row)
        kept = KeptTokens(n=len(emitted), next_token=emitted[-1], position=position)
        kept.ids[: len(emitted)] = emitted
        self._launch("count_tokens", 1, 32, kept, self.seen, self.counts, self.token, self.pos)
        self._logits_valid = True

    def _feed_next(self, token: int, position: int) -> None:
        """The token the next decode step takes as its input, and its position, on the device
        (queued on the stream from the host arrays: synchronise before writing them again)."""
        self._host_token[0] = token
        self.token.upload(self._host_token, stream=self.stream)
        self._host_pos[0] = position
        self.pos.upload(self._host_pos, stream=self.stream)

    # ----------------------------------------------------------------------------- reports
    def peak_memory_bytes(self) -> int:
        return rt.peak_allocated_bytes()

    def copy_bandwidth(self) -> float:
        self.device.make_current()
        return rt.copy_bandwidth(stream=self.stream)
