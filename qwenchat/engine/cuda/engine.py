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
import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

import numpy as np

from qwenchat.engine import DECODES
from qwenchat.engine.base import CacheBookkeeping, GenerateRequest
from qwenchat.engine.cuda import runtime as rt
from qwenchat.engine.cuda.compiler import KernelCache, kernel_defines
from qwenchat.errors import BackendUnavailable, QwenchatError
from qwenchat.model import fp8
from qwenchat.model.checkpoint import WeightSource
from qwenchat.model.config import Qwen3Config
from qwenchat.sampling.params import SamplingParams

KERNELS = {
    "layers.cu": ("embed_rows", "rmsnorm_rows", "rmsnorm_gemv2", "rmsnorm_gemv4",
                  "gemv_residual_attn", "gemv_residual_swiglu", "swiglu_rows",
                  "qk_norm_rope_store"),
    "gemm.cu": ("gemm_store", "gemm_add"),
    "attention.cu": ("attn_prefill", "attn_prefill_merge", "attn_decode_partial",
                     "attn_decode_merge"),
    "sampling.cu": ("sample_prepare", "sample_token", "mark_seen"),
}
MEGAKERNEL_THREADS = 512
MEGAKERNEL_STAGE_BYTES = 32768  # one shared-memory stage of the weight/KV stream
MEGAKERNEL_STATIC_SHARED = 24 * 1024  # its static shared memory, rounded up (ptxas: ~16 KB)
MEGAKERNEL_HISTOGRAM_BYTES = MEGAKERNEL_THREADS // 32 * 256 * 8  # the sampler's radix bins
MEGAKERNEL_LAYER_BYTES = 10 * 8  # struct MegaLayer: ten pointers
MEGAKERNEL_CANDIDATES = 64  # sampling candidates a block offers at most (CAND in megakernel.cu)
# Parts the megakernel can leave out, for timing only (QW_MK_SKIP bits in megakernel.cu).
MEGAKERNEL_PARTS = {"weights": 1, "attention": 2, "waits": 4, "sampling": 8}
MEGAKERNEL_LAUNCH_SECONDS = 0.05  # work per launch, far below any display watchdog
MEGAKERNEL_TIMEOUT_S = 30.0
MEGAKERNEL_RING = 1024  # token slots in host-mapped memory: two launches' worth and more
GEMV_ROWS_PER_BLOCK = 16  # 8 warps x 2 rows (rmsnorm_gemv2)
RESIDUAL_ROWS_PER_BLOCK = 8  # 8 warps x 1 row (gemv_residual_*)
LM_HEAD_ROWS_PER_BLOCK = 32  # 8 warps x 4 rows (rmsnorm_gemv4)
GEMM_TILE = 128
PREFILL_QUERIES_PER_BLOCK = 64
PREFILL_MAX_KEY_SPLITS = 16  # a few new tokens' attention split over the cached keys
PREFILL_MIN_SPLIT_KEYS = 256  # keys per split at least: fewer is not worth a merge
DECODE_MAX_CHUNK = 256  # keys per flash-decoding block at most (attention.cu)
DECODE_SHORT_CHUNK = 64  # keys per block below which the fewer-split graph is used
PREFILL_SCRATCH_BUDGET = 160 * 2**20
SAMPLER_HISTOGRAM_BYTES = 32 * 256 * 8  # sample_token's per-warp radix histograms
MEMORY_MARGIN = 512 * 2**20  # left free for the driver, other programs and fragmentation
SAMPLE_PARAMS = np.dtype([
    ("temperature", "<f4"), ("top_p", "<f4"), ("min_p", "<f4"), ("repetition_penalty", "<f4"),
    ("presence_penalty", "<f4"), ("frequency_penalty", "<f4"), ("top_k", "<i4"), ("step", "<i4"),
    ("seed", "<u8"),
])


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


@dataclass(frozen=True)
class MegakernelLayout:
    """How the decode megakernel uses a GPU's shared memory for one model shape."""

    stages: int  # the weight/KV stream's ring depth
    stage_bytes: int
    fixed: int  # the rest of its dynamic shared memory: the union region, the layer table
    blocks: int  # one per SM
    lm_rows: int  # LM-head rows per block

    def defines(self, config: Qwen3Config,
                weight_format: str = "bf16") -> dict[str, int | float]:
        return dict(kernel_defines(config, weight_format), QW_MK_STAGES=self.stages,
                    QW_MK_STAGE_BYTES=self.stage_bytes, QW_MK_LM_ROWS=self.lm_rows)


def megakernel_layout(cfg: Qwen3Config, shared_per_block: int, sm_count: int,
                      weight_format: str = "bf16") -> MegakernelLayout | str:
    """The megakernel's layout on a GPU with this much opt-in shared memory per block and
    this many SMs, for linear layers in `weight_format`, or why it cannot run there (then the
    per-op graph decodes)."""
    stage = MEGAKERNEL_STAGE_BYTES
    blocks = min(sm_count, 512)  # one block per SM (its scratch holds 512)
    # Beside the stages, one region (UNION_BYTES in megakernel.cu) holds in turn a phase's
    # input vector, the warps' attention partial sums, the block's LM-head logits and the
    # sampler's histograms; then the table of layer pointers.
    lm_rows = math.ceil(cfg.vocab_size / blocks)
    union = max(MEGAKERNEL_HISTOGRAM_BYTES,
                4 * max(cfg.hidden_size, cfg.q_size, cfg.intermediate_size),
                4 * lm_rows,
                MEGAKERNEL_THREADS // 32 * cfg.group_size * cfg.head_dim * 4)
    fixed = (union + 127) // 128 * 128 + cfg.num_hidden_layers * MEGAKERNEL_LAYER_BYTES
    room = shared_per_block - MEGAKERNEL_STATIC_SHARED - fixed
    if room // stage < 3:
        stage //= 2  # smaller GPUs: more, smaller stages
    # A stage holds a whole row of every matrix (a gate/up pair together), in the weights'
    # format; the LM head's rows stay bf16.
    row = partial(fp8.linear_bytes, weight_format=weight_format)
    widest_row = max(2 * row((1, cfg.hidden_size)), row((1, cfg.q_size)),
                     row((1, cfg.intermediate_size)), 2 * cfg.hidden_size,
                     4 * cfg.head_dim * 32)
    while stage < widest_row:
        stage *= 2
    count = min(16, room // stage)
    if count < 2:
        # 32B's SwiGLU vector (100 KB) and two 64 KB bf16 stages do not fit in one block's
        # 227 KB (its FP8 rows fit 32 KB stages).
        need = MEGAKERNEL_STATIC_SHARED + fixed + 2 * stage
        return (f"the decode megakernel needs {need:,} bytes of shared memory "
                f"per block for this model and the GPU has {shared_per_block:,}")
    if math.ceil(cfg.hidden_size / blocks) > 512:
        return "this model is too wide for the decode megakernel on this GPU"
    return MegakernelLayout(count, stage, fixed, blocks, lm_rows)


def unsupported_reason(config: Qwen3Config, weight_format: str = "bf16") -> str | None:
    """Why the kernels cannot run this shape, or None (they need 16-byte aligned rows: 8 bf16
    values, or 16 FP8 ones)."""
    if config.head_dim not in (16, 32, 64, 128, 256):
        return f"head_dim {config.head_dim} (the CUDA kernels need 16, 32, 64, 128 or 256)"
    multiple = 16 if weight_format == "fp8" else 8
    for name in ("hidden_size", "intermediate_size"):
        if getattr(config, name) % multiple:
            return (f"{name} {getattr(config, name)} (the CUDA kernels need a multiple of "
                    f"{multiple} for {weight_format} weights)")
    return None


@dataclass
class LayerBuffers:
    input_norm: rt.DeviceBuffer
    qkv: rt.DeviceBuffer  # [q; k; v] rows, hidden columns
    q_norm: rt.DeviceBuffer
    k_norm: rt.DeviceBuffer
    o: rt.DeviceBuffer
    post_norm: rt.DeviceBuffer
    gate_up: rt.DeviceBuffer  # [gate; up] rows
    down: rt.DeviceBuffer


def _upload_rows(parts: Sequence[np.ndarray]) -> rt.DeviceBuffer:
    """One device buffer holding `parts` (bf16 bit arrays) one after another, no host concat."""
    total = sum(p.nbytes for p in parts)
    buffer = rt.DeviceBuffer(total)
    offset = 0
    for part in parts:
        buffer.upload(np.ascontiguousarray(part), offset=offset)
        offset += part.nbytes
    return buffer


class CudaEngine(CacheBookkeeping):
    def __init__(
        self,
        config: Qwen3Config,
        weights: WeightSource,
        ctx: int | None = None,
        device: int = 0,
        notice: Callable[[str], None] = lambda _: None,
        decode: str = "auto",
        megakernel_skip: Sequence[str] = (),
        megakernel_stages: int | None = None,
    ):
        if decode not in DECODES:
            choices = ", ".join(DECODES)
            raise QwenchatError(f"--decode must be one of {choices}; got {decode!r}")
        # Unquantized checkpoints run in bf16 whatever their dtype; FP8 ones stay FP8 (with
        # any layer the file left in bf16 quantized, so every linear layer has one format).
        weights = fp8.with_quantization(weights, "none")
        self.weight_format = "fp8" if weights.weight_format == "fp8" else "bf16"
        reason = unsupported_reason(config, self.weight_format)
        if reason:
            raise BackendUnavailable(f"this model's {reason}; use --backend cpu")
        self.config = config
        self.device = rt.Device(device)
        self.device_name = self.device.name
        self.name = f"cuda ({self.device.name})"
        self.stream = rt.Stream()
        self._buffers: list[rt.DeviceBuffer] = []
        self._modules: list[rt.Module] = []
        self._graphs: dict[int, rt.Graph] = {}  # decode step per flash-decoding split count
        self._load_kernels(notice)
        try:
            self._upload_weights(weights)
        except rt.CudaError as exc:
            if "OUT_OF_MEMORY" not in str(exc):
                raise
            self.close()
            free, total = self.device.mem_info()
            need = fp8.weight_bytes(config.tensor_shapes(), self.weight_format)
            raise QwenchatError(
                f"out of GPU memory: the weights need {need / 2**30:.2f} GiB and "
                f"{self.device.name} has {free / 2**30:.2f} of {total / 2**30:.2f} GiB free; "
                "close other GPU programs, pick a smaller model or use --backend cpu") from None
        super().__init__(self._choose_capacity(ctx, notice))
        self._allocate_state()
        self._logits_valid = False
        # "auto": the megakernel wherever it can run, the per-op graph where it cannot.
        self.decode = "megakernel" if decode == "auto" else decode
        reason = self._megakernel_unusable()
        if reason and decode == "megakernel":
            notice(f"{reason}: decoding layer by layer")
        if reason:
            self.decode = "layered"
        if self.decode == "megakernel":
            self._setup_megakernel(notice, megakernel_skip, megakernel_stages)

    def _megakernel_unusable(self) -> str | None:
        if not self.device.cooperative_launch:
            return "this GPU cannot launch cooperative kernels"
        if self.config.head_dim < 64:
            # A key/value row must fill whole 128-byte lines: within one launch a line read
            # before part of it is written may be served stale to the bulk copies.
            return f"head_dim {self.config.head_dim} is below the megakernel's 64"
        layout = megakernel_layout(self.config, self.device.max_shared_per_block_optin,
                                   self.device.sm_count, self.weight_format)
        return layout if isinstance(layout, str) else None

    # ----------------------------------------------------------------------------- set-up
    def _load_kernels(self, notice: Callable[[str], None]) -> None:
        cache = KernelCache()
        defines = kernel_defines(self.config, self.weight_format)
        self.k: dict[str, rt.Kernel] = {}
        for source, names in KERNELS.items():
            module = rt.Module(cache.load(source, self.device.arch, defines, progress=notice))
            self._modules.append(module)
            for name in names:
                self.k[name] = module.function(name)
        self.k["sample_token"].set_max_dynamic_shared(SAMPLER_HISTOGRAM_BYTES)

    def _device_buffer(self, nbytes: int) -> rt.DeviceBuffer:
        buffer = rt.DeviceBuffer(max(nbytes, 16))
        self._buffers.append(buffer)
        return buffer

    def _upload_weights(self, weights: WeightSource) -> None:
        cfg = self.config

        def one(name: str) -> rt.DeviceBuffer:
            buffer = _upload_rows([weights.bf16_bits(name)])
            self._buffers.append(buffer)
            return buffer

        def rows(*names: str) -> rt.DeviceBuffer:
            """Linear layers, one after another, in the model's format (weights.cuh)."""
            if self.weight_format == "fp8":
                parts = [fp8.pack_rows(*weights.fp8(n)) for n in names]
            else:
                parts = [weights.bf16_bits(n) for n in names]
            buffer = _upload_rows(parts)
            self._buffers.append(buffer)
            return buffer

        self.layers = []
        for i in range(cfg.num_hidden_layers):
            p = f"model.layers.{i}."
            self.layers.append(LayerBuffers(
                input_norm=one(p + "input_layernorm.weight"),
                qkv=rows(p + "self_attn.q_proj.weight", p + "self_attn.k_proj.weight",
                         p + "self_attn.v_proj.weight"),
                q_norm=one(p + "self_attn.q_norm.weight"),
                k_norm=one(p + "self_attn.k_norm.weight"),
                o=rows(p + "self_attn.o_proj.weight"),
                post_norm=one(p + "post_attention_layernorm.weight"),
                gate_up=rows(p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"),
                down=rows(p + "mlp.down_proj.weight"),
            ))
        self.embed = one("model.embed_tokens.weight")
        self.final_norm = one("model.norm.weight")
        head = weights.lm_head_name()
        self.lm_head = self.embed if head == "model.embed_tokens.weight" else one(head)
        self.weight_bytes = sum(b.nbytes for b in self._buffers)
        exponents = np.arange(0, cfg.head_dim, 2, dtype=np.float32) / np.float32(cfg.head_dim)
        inv_freq = (np.float32(1.0) / (np.float32(cfg.rope_theta) ** exponents)).astype(np.float32)
        self.inv_freq = self._device_buffer(inv_freq.nbytes)
        self.inv_freq.upload(inv_freq)

    def _prefill_chunk_tokens(self) -> int:
        cfg = self.config
        per_token = (cfg.hidden_size * (4 + 2) + (cfg.q_size + 2 * cfg.kv_size) * 4
                     + cfg.q_size * 2 * 2 + cfg.intermediate_size * (2 * 4 + 2) + 4)
        chunk = PREFILL_SCRATCH_BUDGET // per_token
        return int(max(64, min(2048, chunk // 64 * 64)))

    def _choose_capacity(self, ctx: int | None, notice: Callable[[str], None]) -> int:
        """The KV-cache size: as asked (or the model's maximum), if it fits in free memory."""
        cfg = self.config
        free, _ = self.device.mem_info()
        per_position = cfg.kv_bytes_per_position() + 4  # + the context id kept for penalties
        scratch = PREFILL_SCRATCH_BUDGET + cfg.vocab_size * 16 + 16 * 2**20
        fits = max(0, (free - MEMORY_MARGIN - scratch) // per_position)
        wanted = ctx or cfg.max_position_embeddings
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
        layer_cache = cfg.num_key_value_heads * cap * cfg.head_dim * 2
        self.k_cache = [self._device_buffer(layer_cache) for _ in range(cfg.num_hidden_layers)]
        self.v_cache = [self._device_buffer(layer_cache) for _ in range(cfg.num_hidden_layers)]
        self.kv_bytes = 2 * cfg.num_hidden_layers * layer_cache
        c = self.chunk = min(self._prefill_chunk_tokens(), cap)
        qkv_cols = cfg.q_size + 2 * cfg.kv_size
        self.x = self._device_buffer(c * cfg.hidden_size * 4)
        self.xn = self._device_buffer(c * cfg.hidden_size * 2)
        self.qkv = self._device_buffer(c * qkv_cols * 4)
        self.q = self._device_buffer(c * cfg.q_size * 2)
        self.attn = self._device_buffer(c * cfg.q_size * 2)
        self.gu = self._device_buffer(c * 2 * cfg.intermediate_size * 4)
        self.act = self._device_buffer(c * cfg.intermediate_size * 2)
        self.ids = self._device_buffer(c * 4)
        sms = self.device.sm_count
        # Flash-decoding split counts, one decode graph each: few chunks while the context is
        # short (little to merge), enough chunks to fill the chip later; the largest also keeps
        # every chunk within DECODE_MAX_CHUNK keys at full capacity.
        widest = max(math.ceil(cap / DECODE_MAX_CHUNK),
                     math.ceil(4 * sms / cfg.num_key_value_heads))
        self.split_options = sorted({min(16, widest), widest})
        most = self.split_options[-1]
        self.part_o = self._device_buffer(cfg.num_attention_heads * most * cfg.head_dim * 4)
        self.part_ml = self._device_buffer(cfg.num_attention_heads * most * 2 * 4)
        rows = PREFILL_QUERIES_PER_BLOCK * cfg.num_attention_heads * PREFILL_MAX_KEY_SPLITS
        self.prefill_part_o = self._device_buffer(rows * cfg.head_dim * 4)
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

    # ----------------------------------------------------------------------------- launches
    def _launch(self, name: str, grid, block, *args, shared: int = 0) -> None:
        rt.launch(self.k[name], grid, block, list(args), shared=shared, stream=self.stream)

    def _ptr(self, buffer: rt.DeviceBuffer, byte_offset: int = 0) -> rt.Ptr:
        return rt.Ptr(buffer.ptr + byte_offset)

    def _forward_prefill(self, start: int, n: int) -> None:
        """Run n tokens (ids already in self.ids) at positions start.. through every layer."""
        cfg, c_int, c_float = self.config, ctypes.c_int, ctypes.c_float
        eps = c_float(cfg.rms_norm_eps)
        h, qkv_cols, inter = cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size, cfg.intermediate_size
        scale = c_float(cfg.head_dim**-0.5)
        rope_block = max(32, cfg.head_dim // 2)
        heads_total = cfg.num_attention_heads + cfg.num_key_value_heads
        self._launch("embed_rows", n, 256, self.ids, c_int(n), self.embed, self.x)
        for i, w in enumerate(self.layers):
            self._launch("rmsnorm_rows", n, 256, self.x, w.input_norm, c_int(n), eps, self.xn)
            self._gemm("gemm_store", self.xn, w.qkv, self.qkv, n, qkv_cols, h)
            self._launch("qk_norm_rope_store", (n, heads_total), rope_block, self.qkv, c_int(n),
                         rt.Ptr(0), c_int(start), w.q_norm, w.k_norm, self.inv_freq, eps,
                         c_int(self.capacity), self.q, self.k_cache[i], self.v_cache[i])
            self._attention_prefill(i, start, n, scale)
            self._gemm("gemm_add", self.attn, w.o, self.x, n, h, cfg.q_size)
            self._launch("rmsnorm_rows", n, 256, self.x, w.post_norm, c_int(n), eps, self.xn)
            self._gemm("gemm_store", self.xn, w.gate_up, self.gu, n, 2 * inter, h)
            blocks = min(4096, math.ceil(n * inter / 256))
            self._launch("swiglu_rows", blocks, 256, self.gu, c_int(n), self.act)
            self._gemm("gemm_add", self.act, w.down, self.x, n, h, inter)

    def prefill_key_splits(self, start: int, n: int) -> int:
        """Blocks along the keys for the prefill attention of n tokens after `start` cached
        ones: one, unless a single tile of queries per head would leave the chip mostly idle
        while each block walks a long cached prefix (a chat's next message)."""
        heads = self.config.num_attention_heads
        if n > PREFILL_QUERIES_PER_BLOCK or heads >= self.device.sm_count:
            return 1
        by_keys = (start + n) // PREFILL_MIN_SPLIT_KEYS
        return max(1, min(PREFILL_MAX_KEY_SPLITS, by_keys,
                          math.ceil(2 * self.device.sm_count / heads)))

    def _attention_prefill(self, layer: int, start: int, n: int, scale: ctypes.c_float) -> None:
        c_int, heads = ctypes.c_int, self.config.num_attention_heads
        splits = self.prefill_key_splits(start, n)
        self._launch("attn_prefill", (math.ceil(n / PREFILL_QUERIES_PER_BLOCK), heads, splits),
                     128, self.q, self.k_cache[layer], self.v_cache[layer], c_int(start),
                     c_int(n), c_int(self.capacity), scale, self.attn, self.prefill_part_o,
                     self.prefill_part_ml)
        if splits > 1:
            self._launch("attn_prefill_merge", (n, heads), self.config.head_dim,
                         self.prefill_part_o, self.prefill_part_ml, c_int(splits), self.attn)

    def _gemm(self, kernel: str, a, b, c, m: int, n: int, k: int) -> None:
        grid = (math.ceil(n / GEMM_TILE), math.ceil(m / GEMM_TILE))
        self._launch(kernel, grid, 256, a, b, c, ctypes.c_int(m), ctypes.c_int(n),
                     ctypes.c_int(k))

    def _lm_head(self, x_row: rt.Ptr, out: rt.Ptr) -> None:
        cfg = self.config
        self._launch("rmsnorm_gemv4", math.ceil(cfg.vocab_size / LM_HEAD_ROWS_PER_BLOCK), 256,
                     x_row, self.final_norm, self.lm_head, ctypes.c_int(cfg.vocab_size),
                     ctypes.c_float(cfg.rms_norm_eps), out)

    def _splits_for(self, length: int) -> int:
        """The fewest chunks that keep each at most DECODE_SHORT_CHUNK keys, else the most."""
        for splits in self.split_options:
            if math.ceil(length / splits) <= DECODE_SHORT_CHUNK:
                return splits
        return self.split_options[-1]

    def _forward_decode(self, splits: int) -> None:
        """One token (self.token) at position *self.pos through every layer, logits out."""
        cfg, c_int, c_float = self.config, ctypes.c_int, ctypes.c_float
        eps = c_float(cfg.rms_norm_eps)
        h, qkv_cols, inter = cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size, cfg.intermediate_size
        scale = c_float(cfg.head_dim**-0.5)
        gemv, residual = GEMV_ROWS_PER_BLOCK, RESIDUAL_ROWS_PER_BLOCK
        heads_total = cfg.num_attention_heads + cfg.num_key_value_heads
        self._launch("embed_rows", 1, 256, self.token, c_int(1), self.embed, self.x)
        for i, w in enumerate(self.layers):
            self._launch("rmsnorm_gemv2", math.ceil(qkv_cols / gemv), 256, self.x, w.input_norm,
                         w.qkv, c_int(qkv_cols), eps, self.qkv)
            self._launch("qk_norm_rope_store", (1, heads_total), max(32, cfg.head_dim // 2),
                         self.qkv, c_int(1), self.pos, c_int(0), w.q_norm, w.k_norm,
                         self.inv_freq, eps, c_int(self.capacity), self.q, self.k_cache[i],
                         self.v_cache[i])
            self._launch("attn_decode_partial", (cfg.num_key_value_heads, splits), 128,
                         self.q, self.k_cache[i], self.v_cache[i], self.pos, c_int(self.capacity),
                         scale, self.part_o, self.part_ml)
            self._launch("attn_decode_merge", cfg.num_attention_heads, min(cfg.head_dim, 128),
                         self.part_o, self.part_ml, c_int(splits), self.attn_f32,
                         shared=(splits + 3) // 4 * 16)
            self._launch("gemv_residual_attn", math.ceil(h / residual), 256, self.attn_f32, w.o,
                         c_int(h), self.x)
            self._launch("rmsnorm_gemv2", math.ceil(2 * inter / gemv), 256, self.x, w.post_norm,
                         w.gate_up, c_int(2 * inter), eps, self.gu)
            self._launch("gemv_residual_swiglu", math.ceil(h / residual), 256, self.gu, w.down,
                         c_int(h), self.x)
        self._lm_head(self._ptr(self.x), self._ptr(self.logits))

    def _sample(self, advance: bool) -> None:
        self._launch("sample_prepare", self.sample_blocks, 256, self.logits, self.work,
                     self.params, self.seen, self.counts, self.partial_val, self.partial_idx)
        rt.launch(self.k["sample_token"], 1, 1024,
                  [self.work, self.params, self.partial_val, self.partial_idx,
                   ctypes.c_int(self.sample_blocks), self.seen, self.counts, self.token,
                   self.pos if advance else rt.Ptr(0)],
                  shared=SAMPLER_HISTOGRAM_BYTES, stream=self.stream)

    # ----------------------------------------------------------------------------- protocol
    def prefill(self, token_ids: Sequence[int]) -> None:
        self._check_prefill(token_ids, self.config.vocab_size)
        self.device.make_current()
        ids = np.asarray(token_ids, dtype=np.int32)
        start = self.position
        for a in range(0, len(ids), self.chunk):
            part = ids[a : a + self.chunk]
            self.ids.upload(part, stream=self.stream)
            self._forward_prefill(start + a, len(part))
        last = (len(ids) - 1) % self.chunk
        self._lm_head(self._ptr(self.x, last * self.config.hidden_size * 4),
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
        for graph in self._graphs.values():
            graph.close()
        self._graphs.clear()
        for buffer in self._buffers:
            buffer.free()
        self._buffers.clear()
        for module in self._modules:
            module.close()
        self._modules.clear()

    # ----------------------------------------------------------------------------- decode
    def _set_params(self, params: SamplingParams, seed: int, step: int) -> None:
        host = self._host_params
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                     "frequency_penalty", "top_k"):
            host[name] = getattr(params, name)
        host["step"] = step
        host["seed"] = seed & ((1 << 64) - 1)
        self.params.upload(host, stream=self.stream)

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

    def _decode_graph(self, length: int) -> rt.Graph:
        splits = self._splits_for(length)
        if splits not in self._graphs:
            with rt.Graph.capture(self.stream) as graph:
                self._forward_decode(splits)
                self._sample(advance=True)
            self._graphs[splits] = graph
        return self._graphs[splits]

    def _read_token(self) -> int:
        self.token.download(self._host_token, stream=self.stream)
        self.stream.synchronize()
        return int(self._host_token[0])

    def _has_logits(self) -> bool:
        return self._logits_valid

    def _drop_logits(self) -> None:
        self._logits_valid = False

    def _begin_reply(self, request: GenerateRequest) -> None:
        self.device.make_current()
        self._reset_sampling_state()
        self._request = request
        if self.decode == "megakernel":
            self._mk_cancel[0] = 0
            self._mk_ring[:] = 0
            self._mk_consumed = self._mk_requested = 0
            self.mk_stopped.fill_u8(0, stream=self.stream)
            eos = np.asarray(sorted(request.eos_ids)[:64], dtype=np.int32)
            if eos.size:
                self.mk_eos.upload(eos, stream=self.stream)
            self._mk_n_eos = int(eos.size)
            self._mirror_params(request.params.current)
            self._unsubscribe = request.params.subscribe(self._mirror_params)

    def _end_reply(self) -> None:
        if self.decode == "megakernel":
            self._unsubscribe()
            self._mk_cancel[0] = 1  # a launch still running stops after its current step,
            self.stream.synchronize()  # and the ones queued behind it return at once
            self._mk_cancel[0] = 0
            self._mk_consumed = self._mk_requested = 0

    def _next_token(self, fed: int | None, params: SamplingParams, seed: int,
                    step: int) -> int | None:
        if self.decode == "megakernel":
            return self._megakernel_token(fed, params, seed, step)
        self._set_params(params, seed, step)
        if fed is None:
            self._sample(advance=False)
        else:
            self._decode_graph(self.position + 1).launch(self.stream)
            self._tokens.append(fed)
        return self._read_token()

    # ----------------------------------------------------------------------------- megakernel
    def _setup_megakernel(self, notice: Callable[[str], None], skip: Sequence[str] = (),
                          stages: int | None = None) -> None:
        """Compile the megakernel for this GPU's shared memory and allocate its state.

        The stage ring takes what shared memory the device allows per block, less the static
        part and the sampler's histograms; `skip` leaves parts out (timing variants only:
        the tokens are then wrong) and `stages` overrides the ring depth (experiments)."""
        cfg, device = self.config, self.device
        unknown = sorted(set(skip) - set(MEGAKERNEL_PARTS))
        if unknown:
            raise QwenchatError(f"unknown megakernel part {unknown[0]!r}; "
                                f"known: {', '.join(MEGAKERNEL_PARTS)}")
        layout = megakernel_layout(cfg, device.max_shared_per_block_optin, device.sm_count,
                                   self.weight_format)
        if isinstance(layout, str):
            raise QwenchatError(f"{layout}; use --decode layered")
        if stages:
            layout = dataclasses.replace(layout, stages=stages)
        count, stage, fixed, blocks = layout.stages, layout.stage_bytes, layout.fixed, layout.blocks
        defines = dict(layout.defines(cfg, self.weight_format),
                       QW_MK_SKIP=sum(MEGAKERNEL_PARTS[p] for p in skip))
        module = rt.Module(KernelCache().load("megakernel.cu", device.arch, defines,
                                              progress=notice))
        self._modules.append(module)
        kernel = self.k["decode_megakernel"] = module.function("decode_megakernel")
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
        tagged = {"x": cfg.hidden_size, "qkv": cfg.q_size + 2 * cfg.kv_size,
                  "attn": cfg.q_size, "h": cfg.intermediate_size, "best": 4 * self.mk_blocks,
                  "chosen": 2}
        self.mk_tagged = self._device_buffer(8 * sum(tagged.values())
                                             + 4 * cfg.num_key_value_heads)
        self._mk_tagged_ptrs, offset = {}, 0
        for name, count in tagged.items():
            self._mk_tagged_ptrs[name] = self.mk_tagged.ptr + offset
            offset += 8 * count
        self._mk_merge_ptr = self.mk_tagged.ptr + offset
        self.mk_eos = self._device_buffer(64 * 4)
        self.mk_params = self._device_buffer(2 * SAMPLE_PARAMS.itemsize)
        layer_ptrs = np.array([[w.input_norm.ptr, w.qkv.ptr, w.q_norm.ptr, w.k_norm.ptr, w.o.ptr,
                                w.post_norm.ptr, w.gate_up.ptr, w.down.ptr, kc.ptr, vc.ptr]
                               for w, kc, vc in zip(self.layers, self.k_cache, self.v_cache,
                                                    strict=True)], dtype=np.uint64)
        self.mk_layers = self._device_buffer(layer_ptrs.nbytes)
        self.mk_layers.upload(layer_ptrs)
        step_seconds = self.weight_bytes / 2e12 + 100e-6
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
            cfg.rms_norm_eps, cfg.head_dim**-0.5, cfg.num_hidden_layers, self.capacity,
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
            if steps <= 0:
                return
            self._launch_megakernel(steps, self._mk_requested)
            self._mk_requested += steps

    def _launch_megakernel(self, steps: int, first_step: int) -> None:
        self.mk_tagged.fill_u8(0, stream=self.stream)
        self._mk_epoch += 1  # every launch tags its values afresh
        args = self._megakernel_args(steps, first_step > 0, first_step, self._mk_n_eos)
        rt.launch(self.k["decode_megakernel"], self.mk_blocks, MEGAKERNEL_THREADS, [args],
                  shared=self.mk_shared, stream=self.stream, cooperative=True)

    # ----------------------------------------------------------------------------- reports
    def peak_memory_bytes(self) -> int:
        return rt.peak_allocated_bytes()

    def copy_bandwidth(self) -> float:
        self.device.make_current()
        return rt.copy_bandwidth(stream=self.stream)
