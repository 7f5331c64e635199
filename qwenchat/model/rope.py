"""Rotary position embeddings: Qwen3's plain RoPE and YaRN, the context extension Qwen's model
cards give for prompts past the 32,768 positions the models were trained on (issue 26). Shared
by both engines: the reference rotates with these frequencies in NumPy; the GPU engine uploads
them as its inverse-frequency table and folds YaRN's attention factor into the softmax scale.

YaRN as transformers computes it for Qwen3 (modeling_rope_utils._compute_yarn_parameters):
each frequency blends its extrapolated value (theta^(-2i/d)) and its interpolated one (divided
by `factor`) by a linear ramp between the dimensions that turn `beta_fast` and `beta_slow`
times over the original context; cos and sin are multiplied by the attention factor
0.1 ln(factor) + 1 (so every score by its square).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np

from qwenchat.errors import UsageError

if TYPE_CHECKING:
    from qwenchat.model.config import Qwen3Config


@dataclass(frozen=True)
class Yarn:
    """A YaRN rope_scaling entry (rope_type "yarn")."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True

    @property
    def positions(self) -> int:
        """The context it extends the model to: factor x the original length."""
        return int(self.factor * self.original_max_position_embeddings)

    def describe(self) -> str:
        return (f"YaRN x{self.factor:g} over {self.original_max_position_embeddings:,} trained "
                "positions")


def describe(config: Qwen3Config) -> str:
    """The positions the model was trained for, and the scaling in force (/info, `ask -v`)."""
    yarn = config.rope_scaling
    if yarn is None:
        return f"RoPE, trained for {config.max_position_embeddings:,} positions"
    return f"{yarn.describe()}, to {config.context_limit:,}"


def gauge_note(config: Qwen3Config) -> str:
    """What the chat's KV gauge adds where RoPE is scaled ("" for plain RoPE)."""
    yarn = config.rope_scaling
    return "" if yarn is None else f"YaRN ×{yarn.factor:g}"


def _mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def attention_factor(config: Qwen3Config) -> float:
    """How much YaRN scales cos and sin (1 for plain RoPE)."""
    yarn = config.rope_scaling
    if yarn is None:
        return 1.0
    if yarn.attention_factor is not None:
        return float(yarn.attention_factor)
    if yarn.mscale and yarn.mscale_all_dim:
        return _mscale(yarn.factor, yarn.mscale) / _mscale(yarn.factor, yarn.mscale_all_dim)
    return _mscale(yarn.factor)


def softmax_scale(config: Qwen3Config) -> float:
    """The attention scores' scale: 1/sqrt(head_dim), times the square of YaRN's attention
    factor (transformers scales the rotated queries and keys by it; scaling their products
    instead leaves the KV cache as plain RoPE writes it)."""
    return config.head_dim**-0.5 * attention_factor(config) ** 2


def inv_freq(config: Qwen3Config) -> np.ndarray:
    """The head_dim / 2 inverse frequencies (float32), in float32 arithmetic as transformers
    computes them."""
    dim = config.head_dim
    exponents = np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)
    pos_freqs = np.float32(config.rope_theta) ** exponents
    extrapolation = (np.float32(1.0) / pos_freqs).astype(np.float32)
    yarn = config.rope_scaling
    if yarn is None:
        return extrapolation
    interpolation = (np.float32(1.0) / (np.float32(yarn.factor) * pos_freqs)).astype(np.float32)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(yarn.original_max_position_embeddings / (rotations * 2 * math.pi))
                / (2 * math.log(config.rope_theta)))

    low, high = correction_dim(yarn.beta_fast), correction_dim(yarn.beta_slow)
    if yarn.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # (transformers' guard against a zero-width ramp)
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - np.float32(low))
                   / np.float32(high - low), 0, 1).astype(np.float32)
    keep = np.float32(1) - ramp  # the share of each frequency left unscaled
    return (interpolation * (np.float32(1) - keep) + extrapolation * keep).astype(np.float32)


QWEN_TRAINED_POSITIONS = 32_768  # what Qwen3 was trained on (its cards' original length)
DEFAULT_FACTOR = 4.0  # Qwen's recipe: 4 x 32,768 = 131,072 positions


def default_original(config: Qwen3Config) -> int:
    """The trained length `--rope-scaling yarn` assumes: Qwen's 32,768, or the config's maximum
    where that is less."""
    return min(QWEN_TRAINED_POSITIONS, config.max_position_embeddings)


def parse_flag(flag: str) -> tuple[float, int | None] | None:
    """`--rope-scaling`'s text: (factor, original length or None) for "yarn", "yarn:FACTOR"
    and "yarn:FACTOR:ORIGINAL", None for "none"; anything else is a one-line usage error."""
    parts = flag.strip().lower().split(":")
    if parts == ["none"]:
        return None
    usage = (f"--rope-scaling takes yarn, yarn:FACTOR or yarn:FACTOR:ORIGINAL (e.g. yarn:4 or "
             f"yarn:4:32768) or none; got {flag!r}")
    if parts[0].isidentifier() and parts[0] != "yarn":  # a rope type: linear, dynamic, llama3
        raise UsageError(f"--rope-scaling: unsupported rope type {parts[0]!r}; qwenchat runs "
                         "YaRN (yarn, yarn:FACTOR or yarn:FACTOR:ORIGINAL) or none")
    if parts[0] != "yarn" or len(parts) > 3:
        raise UsageError(usage)
    try:
        factor = float(parts[1]) if len(parts) > 1 else DEFAULT_FACTOR
        original = int(parts[2]) if len(parts) > 2 else None
    except ValueError:
        raise UsageError(usage) from None
    if not (math.isfinite(factor) and factor >= 1) or (original is not None and original < 1):
        raise UsageError(f"--rope-scaling: the factor must be 1 or more and the original length "
                         f"positive; got {flag!r}")
    return factor, original


def with_flag(config: Qwen3Config, flag: str | None) -> Qwen3Config:
    """The config with `--rope-scaling` applied (parse_flag): YaRN over ORIGINAL trained
    positions, by default Qwen's 32,768 (or the config's maximum where that is less), factor
    4 by default; "none" turns a config's scaling off; None leaves the config as it is."""
    if flag is None:
        return config
    parsed = parse_flag(flag)
    if parsed is None:
        return replace(config, rope_scaling=None)
    factor, original = parsed
    if original is None:
        original = default_original(config)
    return replace(config, rope_scaling=Yarn(factor=factor,
                                             original_max_position_embeddings=original))


def check_context(config: Qwen3Config, ctx: int | None) -> None:
    """One line, as a usage error, where --ctx asks for more positions than the model runs
    well: past its trained length without scaling (naming --rope-scaling yarn), or past what
    its YaRN factor extends it to."""
    if ctx is None or ctx <= config.context_limit:
        return
    yarn = config.rope_scaling
    if yarn is None:
        raise UsageError(
            f"--ctx {ctx:,} is past the {config.context_limit:,} positions this model was "
            f"trained for; add --rope-scaling yarn (YaRN, as Qwen's model cards describe, up to "
            f"{DEFAULT_FACTOR * default_original(config):,.0f}"
            f") or use --ctx {config.context_limit} or less")
    needed = math.ceil(ctx / yarn.original_max_position_embeddings)
    raise UsageError(f"--ctx {ctx:,} is past the {config.context_limit:,} positions "
                     f"{yarn.describe()} reaches; use --rope-scaling yarn:{needed} or --ctx "
                     f"{config.context_limit} or less")
