"""Which cubins a run compiles: each source's kernels, the Hopper GEMMs as a program a
product, the order the compiles start in, and the builds of a run on an architecture. Nothing
here needs a GPU or cuda-python's driver bindings, so a first run's compiles start from these
(early.py) before the engine imports the bindings, an import that holds Python's lock for half
a second.
The engine's plan (engine.py, plan_kernels) adds the megakernel, laid out for the GPU's shape."""

from __future__ import annotations

from qwenchat.engine.cuda.compiler import KernelBuild, kernel_defines
from qwenchat.errors import BackendUnavailable
from qwenchat.model import fp8
from qwenchat.model.checkpoint import WeightSource
from qwenchat.model.config import Qwen3Config
from qwenchat.model.formats import gpu_format

# The speculative pass's kernels (verify.cu; verify.py launches them)
VERIFY_KERNELS = ("verify_xn", "verify_attn", "verify_attn_r2", "verify_attn_bf16", "verify_act",
                  "verify_head", "verify_norm_rows")
# A mixture of experts' per-op kernels (moe.cu; moe.py launches them)
MOE_KERNELS = ("moe_route", "moe_router", "moe_gate_up", "moe_down", "moe_count", "moe_place",
               "moe_gemm", "moe_router_gemm", "moe_swiglu", "moe_combine", "moe_few_router",
               "moe_few_route", "moe_few_gate_up", "moe_few_down")
MOE_MOST_INTERMEDIATE = 12288  # an expert's SwiGLU output, staged whole (moe.cu: 48 KB)


def moe90_runs(cfg: Qwen3Config, weight_format: str, hopper_gemm: bool) -> bool:
    """Whether a pass's experts take moe_sm90.cu's products: bf16 and FP8 experts where
    Hopper's GEMMs run the dense products (else, and for int4, moe.cu's moe_gemm)."""
    return hopper_gemm and cfg.is_moe and weight_format in ("bf16", "fp8")


KERNELS = {
    "layers.cu": ("embed_rows", "rmsnorm_rows", "rmsnorm_gemv2", "rmsnorm_gemv4",
                  "gemv_residual_attn", "gemv_residual_swiglu", "swiglu_rows",
                  "qk_norm_rope_store", "draw_bf16", "draw_fp8_rows", "draw_int4_rows",
                  "dequant_int4_rows"),
    "gemm.cu": ("gemm_store", "gemm_add"),
    "attention.cu": ("attn_prefill", "attn_prefill_merge", "attn_decode_partial",
                     "attn_decode_merge"),
    # (the pass's attention apart: attention.cu compiled 1.0 -> 1.4 s with it, the longest
    # program a first answer waited for; docs/perf.md)
    "attention_pass.cu": ("attn_pass_packed",),
    "sampling.cu": ("sample_prepare", "sample_token", "mark_seen", "count_tokens", "rows_argmax"),
    "verify.cu": VERIFY_KERNELS,
    "moe.cu": MOE_KERNELS,  # (a mixture of experts' only)
}


# Hopper's prefill kernels (wgmma, TMA), built for sm_90a: the prefill path on sm_90 GPUs, for
# bf16 and FP8 weights (attention_sm90 takes head_dim 64 and 128, attention.cu the rest).
# The Hopper GEMMs compile as one program a product (QW_PART n, sm90.cuh), longest first: ptxas
# takes each wgmma instantiation on its own, so six programs on six threads cost about the
# longest one instead of their sum (gemm_sm90.cu 4.9 s whole on the H100 host: it bounded a
# first run's compiles once the megakernel compiled in the background; docs/perf.md).
SM90_PARTS = {
    "gemm_sm90.cu": (("gemm90_swiglu",), ("gemm90_store_128",), ("gemm90_store_256",),
                     ("gemm90_add_128",), ("gemm90_add_256",), ("splitk_sum", "splitk_swiglu")),
    "gemm_fp8_sm90.cu": (("gemm_fp8_swiglu",), ("gemm_fp8_store_128",), ("gemm_fp8_store_256",),
                         ("gemm_fp8_add_128",), ("gemm_fp8_add_256",), ("quantize_rows_e4m3",)),
    "moe_sm90.cu": (("moe90_gate_up",), ("moe90_down",)),  # bf16 and FP8 experts' grouped products
}
SM90_KERNELS = {**{source: tuple(name for part in parts for name in part)
                   for source, parts in SM90_PARTS.items()},
                "attention_sm90.cu": ("attn_prefill90",)}


def kernel_names(build: KernelBuild) -> tuple[str, ...] | None:
    """The kernels a build's cubin holds (its part's, for a QW_PART build); None for the
    megakernel, which _setup_megakernel loads."""
    part = dict(build.defines).get("QW_PART")
    if part is not None:
        return SM90_PARTS[build.source][int(part)]
    return KERNELS.get(build.source) or SM90_KERNELS.get(build.source)


# Sources by how long NVRTC takes over them, longest first (0.6B shape, sm_90, docs/perf.md):
# builds start in this order, so the longest never waits behind the short ones.
COMPILE_ORDER = ("megakernel.cu", "gemm_sm90.cu", "gemm_fp8_sm90.cu", "attention.cu", "sampling.cu",
                 "attention_sm90.cu", "moe_sm90.cu", "gemm.cu", "attention_pass.cu", "verify.cu",
                 "layers.cu", "moe.cu", "score.cu")


def run_weights(weights: WeightSource) -> tuple[WeightSource, str]:
    """The weights the kernels run and their format's name: unquantized checkpoints in bf16
    whatever their dtype; FP8 ones stay FP8 (with any layer the file left in bf16 quantized, so
    every linear layer has one format); AWQ ones run their 4-bit codes (Int4Weights)."""
    weights = fp8.with_quantization(weights, "none")
    return weights, gpu_format(weights.weight_format).name


def unsupported_reason(config: Qwen3Config, weight_format: str = "bf16") -> str | None:
    """Why the kernels cannot run this model, or None: a shape off their grid (they need
    16-byte aligned rows: 8 bf16 values, 16 FP8 ones; int4 rows are whole groups of 128; an
    expert's SwiGLU output is staged whole: moe.cu)."""
    if config.is_moe and config.moe_intermediate_size > MOE_MOST_INTERMEDIATE:
        return (f"this model's moe_intermediate_size {config.moe_intermediate_size} (the CUDA "
                f"kernels take at most {MOE_MOST_INTERMEDIATE:,})")
    if config.head_dim not in (16, 32, 64, 128, 256):
        return (f"this model's head_dim {config.head_dim} (the CUDA kernels need 16, 32, 64, "
                "128 or 256)")
    multiple = {"fp8": 16, "int4": 128}.get(weight_format, 8)
    sizes = ("hidden_size", "intermediate_size") + (("moe_intermediate_size",) if config.is_moe
                                                    else ())
    for name in sizes:
        if getattr(config, name) % multiple:
            return (f"this model's {name} {getattr(config, name)} (the CUDA kernels need a "
                    f"multiple of {multiple} for {weight_format} weights)")
    return None


def kernel_builds(config: Qwen3Config, weight_format: str, arch: str, *, hopper_gemm: bool,
                  hopper_attention: bool, megakernel: KernelBuild | None,
                  kv_format: str = "bf16", fp8_gemm: bool = False) -> list[KernelBuild]:
    """The cubins a run uses, longest compile first: layers.cu, attention.cu, sampling.cu and
    the speculative pass's (verify.cu, attention_pass.cu) always; gemm.cu only where
    gemm_sm90.cu does not run the products; moe.cu for a mixture of experts; the Hopper
    sources (for sm_90a) where they run, gemm_fp8_sm90.cu instead of gemm_sm90.cu where FP8
    weights meet e4m3 activations (`fp8_gemm`), each GEMM as a program a product (SM90_PARTS);
    the megakernel where it decodes."""
    defines = kernel_defines(config, weight_format, kv_format)
    builds = [KernelBuild.of(source, arch, defines) for source in KERNELS
              if not (source == "gemm.cu" and hopper_gemm)
              and not (source == "moe.cu" and not config.is_moe)]
    wanted = {"gemm_sm90.cu": hopper_gemm and not fp8_gemm, "gemm_fp8_sm90.cu": fp8_gemm,
              "attention_sm90.cu": hopper_attention,
              "moe_sm90.cu": moe90_runs(config, weight_format, hopper_gemm)}
    for source in SM90_KERNELS:
        if wanted[source]:
            parts = range(len(SM90_PARTS[source])) if source in SM90_PARTS else [None]
            builds += [KernelBuild.of(source, "sm_90a", defines if part is None
                                      else {**defines, "QW_PART": part}) for part in parts]
    if megakernel is not None:
        builds.append(megakernel)
    return sorted(builds, key=lambda build: COMPILE_ORDER.index(build.source))


def prefill_paths(config: Qwen3Config, weight_format: str, arch: str,
                  prefill_kernels: str = "auto", fp8_activations: str = "auto"
                  ) -> tuple[bool, bool, bool]:
    """(the Hopper GEMMs, the Hopper prefill attention, FP8 products on e4m3 activations) for
    a run on `arch` (plan_kernels; qwenchat/engine/cuda/early.py asks before the driver is up)."""
    hopper = arch == "sm_90"
    if prefill_kernels == "hopper" and not hopper:
        raise BackendUnavailable(f"the Hopper prefill needs an sm_90 GPU; this is {arch}")
    hopper_gemm = hopper and prefill_kernels != "portable"
    hopper_attention = hopper_gemm and config.head_dim in (64, 128)
    # (each 128-row box of the fused Q/K/V rows must lie in one of Q, K, V: one block scale)
    fp8_gemm = (hopper_gemm and weight_format == "fp8" and fp8_activations != "bf16"
                and config.q_size % 128 == 0 and config.kv_size % 128 == 0)
    return hopper_gemm, hopper_attention, fp8_gemm
