"""Activation-aware 4-bit scales (AWQ's recipe) from a calibration text, for `qwenchat quantize
--calibrate`.

A weight's input columns that meet large activations matter more, and rounding each group of
128 to 16 levels treats them all alike. AWQ scales those columns up before rounding (W x
diag(s)) and the activations down by the same factors, folded into the operation before: an
RMSNorm's weight (Q/K/V, gate/up), up_proj's rows (down_proj's input is SwiGLU(gate, up)), or
v_proj's rows (o_proj's input, where every query head has its own value head). The model in
full precision computes the same function (up to the folded weights' own rounding); only the
rounding error moves. For each group of weights that share an input, s = mean|x| ** alpha,
normalised, with alpha on a grid from 0 to 1 picked to minimise the error of the rounded
weights' outputs on the calibration activations; alpha 0 is plain round-to-nearest, so a
calibrated group is never worse than it on those activations. Everything is deterministic.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from qwenchat.engine.reference import ReferenceEngine, silu
from qwenchat.model import awq
from qwenchat.model.checkpoint import WeightSource

ALPHAS = tuple(np.round(np.linspace(0.0, 1.0, 21), 2))  # AutoAWQ searches 20 steps too
WINDOW = 512  # calibration tokens a prefill takes


def rounded(weight: np.ndarray) -> np.ndarray:
    """The weight as `--quantize int4` rounds it (groups of 128, round to nearest)."""
    return awq.dequantize(*awq.quantize(weight))


@dataclass(frozen=True)
class Search:
    scales: np.ndarray  # s: the weights' input columns are multiplied by it
    alpha: float
    error: float  # mean squared output error of the rounded, scaled weights
    rtn_error: float  # the same with plain round-to-nearest (alpha 0)


def search(x: np.ndarray, weights: Sequence[np.ndarray]) -> Search:
    """The alpha (and its scales) whose rounded weights reproduce `weights`' outputs on the
    activations `x` (tokens x inputs) best; ties keep the smaller alpha."""
    x = x.astype(np.float32)
    magnitude = np.maximum(np.abs(x).mean(axis=0), 1e-8)
    exact = [x @ w.T for w in weights]
    best: Search | None = None
    rtn = 0.0
    for alpha in ALPHAS:
        s = magnitude ** np.float32(alpha)
        s = (s / np.sqrt(s.max() * s.min())).astype(np.float32)
        error = float(sum(np.mean(((x / s) @ rounded(w * s).T - y) ** 2)
                          for w, y in zip(weights, exact, strict=True)))
        if alpha == 0.0:
            rtn = error
        if best is None or error < best.error:
            best = Search(s, float(alpha), error, rtn)
    assert best is not None
    return Search(best.scales, best.alpha, best.error, rtn)


@dataclass
class Calibration:
    """Per tensor: input columns times `columns[name]`, output rows (or a norm's elements)
    divided by `rows[name]`; and what each search found, by layer and group."""

    columns: dict[str, np.ndarray] = field(default_factory=dict)
    rows: dict[str, np.ndarray] = field(default_factory=dict)
    found: dict[str, Search] = field(default_factory=dict)

    def fold(self, name: str, weight: np.ndarray) -> np.ndarray:
        """The tensor with its scales applied (weights: float32, out x in; norms: in)."""
        if name in self.rows:
            divisor = self.rows[name]
            weight = weight / (divisor[:, None] if weight.ndim == 2 else divisor)
        if name in self.columns:
            weight = weight * self.columns[name][None, :]
        return weight.astype(np.float32)


def calibrate(source: WeightSource, token_ids: Sequence[int]) -> Calibration:
    """Scales for every layer from the activations of `token_ids` through the model in full
    precision (the reference engine, in windows of WINDOW tokens)."""
    config = source.config
    engine = ReferenceEngine(config, source, ctx=min(WINDOW, len(token_ids)))
    seen: dict[tuple[int, str], list[np.ndarray]] = defaultdict(list)
    engine.observe = lambda layer, kind, x: seen[(layer, kind)].append(np.array(x))
    for begin in range(0, len(token_ids), WINDOW):
        engine.truncate(0)
        engine.prefill(list(token_ids[begin:begin + WINDOW]))
    engine.observe = None
    out = Calibration()
    group_size = config.group_size
    for index, w in enumerate(engine.layers):
        p = f"model.layers.{index}."
        x = np.concatenate(seen[(index, "qkv")])
        qkv = [f"{p}self_attn.{n}_proj.weight" for n in "qkv"]
        _apply(out, f"{p}qkv", search(x, [w.q, w.k, w.v]), qkv, f"{p}input_layernorm.weight")
        if group_size == 1:  # o_proj's input column j is value head j's: fold into v_proj
            x = np.concatenate(seen[(index, "o")])
            _apply(out, f"{p}o", search(x, [w.o]), [f"{p}self_attn.o_proj.weight"],
                   f"{p}self_attn.v_proj.weight")
        x = np.concatenate(seen[(index, "mlp")])
        gate_up = [f"{p}mlp.gate_proj.weight", f"{p}mlp.up_proj.weight"]
        _apply(out, f"{p}gate_up", search(x, [w.mlp.gate, w.mlp.up]), gate_up,
               f"{p}post_attention_layernorm.weight")
        act = silu(x @ w.mlp.gate.T) * (x @ w.mlp.up.T)
        _apply(out, f"{p}down", search(act, [w.mlp.down]), [f"{p}mlp.down_proj.weight"],
               f"{p}mlp.up_proj.weight")
    return out


def _apply(out: Calibration, group: str, found: Search, weights: list[str], before: str) -> None:
    out.found[group] = found
    for name in weights:
        out.columns[name] = found.scales
    out.rows[before] = found.scales


class CalibratedWeights:
    """A WeightSource: `source` with a calibration's scales folded in (still full precision;
    `qwenchat quantize` rounds its linear layers)."""

    def __init__(self, source: WeightSource, calibration: Calibration):
        self.source, self.calibration = source, calibration
        self.config = source.config
        self.weight_format = source.weight_format

    def changes(self, name: str) -> bool:
        return name in self.calibration.rows or name in self.calibration.columns

    def float32(self, name: str) -> np.ndarray:
        weight = self.source.float32(name)
        return self.calibration.fold(name, weight) if self.changes(name) else weight

    def bf16_bits(self, name: str) -> np.ndarray:
        from qwenchat.model.floats import f32_to_bf16_bits

        return f32_to_bf16_bits(self.float32(name)) if self.changes(name) else \
            self.source.bf16_bits(name)

    def lm_head_name(self) -> str:
        return self.source.lm_head_name()
