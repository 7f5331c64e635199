"""The Qwen3 architecture (dense, and the mixture-of-experts Qwen3-MoE) as one typed dataclass,
read and checked from config.json."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from qwenchat.errors import ModelError
from qwenchat.model.formats import BLOCK, INT4
from qwenchat.model.rope import Yarn

# model_type -> the one architecture config.json may name with it.
ARCHITECTURES = {"qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}
# transformers' Qwen3MoeConfig defaults, for a qwen3_moe config.json that leaves a field out.
MOE_DEFAULTS: dict[str, Any] = {"num_experts": 128, "num_experts_per_tok": 8,
                                "moe_intermediate_size": 768, "norm_topk_prob": False,
                                "decoder_sparse_step": 1, "mlp_only_layers": [],
                                "intermediate_size": 6144, "tie_word_embeddings": False}
MOE_SIZES = ("num_experts", "num_experts_per_tok", "moe_intermediate_size",
             "decoder_sparse_step")


def parameters_text(n: int) -> str:
    """A parameter count as people write it: 8.19B, 596.0M."""
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def parameters_summary(config: Qwen3Config) -> str:
    """The count as /info shows it: "8.19B parameters", or for a mixture of experts "30.53B
    parameters (3.35B active a token; 128 experts, 8 a token)"."""
    text = f"{parameters_text(config.parameter_count())} parameters"
    if config.is_moe:
        text += (f" ({parameters_text(config.active_parameter_count())} active a token; "
                 f"{config.num_experts} experts, {config.num_experts_per_tok} a token)")
    return text


@dataclass(frozen=True)
class Qwen3Config:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 40_960
    tie_word_embeddings: bool = True
    torch_dtype: str = "bfloat16"
    # "fp8" when config.json declares Qwen's fine-grained FP8 (quantization_config), "awq" for
    # Qwen's 4-bit AWQ, else None.
    quantization: str | None = None
    # YaRN from config.json's rope_scaling / rope_parameters or --rope-scaling (rope.py); None:
    # plain RoPE.
    rope_scaling: Yarn | None = None
    # Mixture of experts (Qwen3MoeForCausalLM); the defaults describe a dense model. A sparse
    # layer's MLP routes each token to num_experts_per_tok of num_experts SwiGLU MLPs of
    # moe_intermediate_size (sparse_layer says which layers are sparse).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()

    @property
    def trained_positions(self) -> int:
        """The positions the model was trained on: YaRN's original length, else the config's."""
        if self.rope_scaling is not None:
            return self.rope_scaling.original_max_position_embeddings
        return self.max_position_embeddings

    @property
    def context_limit(self) -> int:
        """The longest context it runs well: YaRN's factor x original length, else the
        config's maximum."""
        if self.rope_scaling is not None:
            return max(self.rope_scaling.positions, self.max_position_embeddings)
        return self.max_position_embeddings

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @property
    def group_size(self) -> int:
        """Query heads that share one key/value head (grouped-query attention)."""
        return self.num_attention_heads // self.num_key_value_heads

    def sparse_layer(self, layer: int) -> bool:
        """Whether `layer`'s MLP is a mixture of experts, decided as transformers'
        Qwen3MoeDecoderLayer does; the other layers have a dense MLP of intermediate_size."""
        return (layer not in self.mlp_only_layers and self.num_experts > 0
                and (layer + 1) % self.decoder_sparse_step == 0)

    @property
    def sparse_layers(self) -> int:
        return sum(self.sparse_layer(n) for n in range(self.num_hidden_layers))

    @property
    def is_moe(self) -> bool:
        """Whether any layer routes tokens to experts."""
        return self.sparse_layers > 0

    def kv_bytes_per_position(self, bytes_per_value: int = 2) -> int:
        return self.num_hidden_layers * 2 * self.kv_size * bytes_per_value

    def parameter_count(self) -> int:
        """Every parameter, all experts included."""
        h = self.hidden_size
        attention = h * (self.q_size + 2 * self.kv_size) + self.q_size * h
        norms = 2 * h + 2 * self.head_dim
        dense_mlp = 3 * h * self.intermediate_size
        sparse_mlp = self.num_experts * (h + 3 * h * self.moe_intermediate_size)  # router, experts
        dense_layers = self.num_hidden_layers - self.sparse_layers
        embed = self.vocab_size * h
        head = 0 if self.tie_word_embeddings else embed
        return (self.num_hidden_layers * (attention + norms) + dense_layers * dense_mlp
                + self.sparse_layers * sparse_mlp + embed + head + h)

    def active_parameter_count(self) -> int:
        """The parameters one token uses: all but the experts it is not routed to (the
        embedding counted whole, as Qwen counts Qwen3-30B-A3B's 3.3B)."""
        idle = self.num_experts - self.num_experts_per_tok
        return (self.parameter_count()
                - self.sparse_layers * idle * 3 * self.hidden_size * self.moe_intermediate_size)

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor a checkpoint of this shape must hold, by its Hugging Face name."""
        h, i, d = self.hidden_size, self.intermediate_size, self.head_dim
        shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (self.vocab_size, h)}
        for n in range(self.num_hidden_layers):
            p = f"model.layers.{n}."
            shapes[p + "input_layernorm.weight"] = (h,)
            shapes[p + "self_attn.q_proj.weight"] = (self.q_size, h)
            shapes[p + "self_attn.k_proj.weight"] = (self.kv_size, h)
            shapes[p + "self_attn.v_proj.weight"] = (self.kv_size, h)
            shapes[p + "self_attn.o_proj.weight"] = (h, self.q_size)
            shapes[p + "self_attn.q_norm.weight"] = (d,)
            shapes[p + "self_attn.k_norm.weight"] = (d,)
            shapes[p + "post_attention_layernorm.weight"] = (h,)
            if self.sparse_layer(n):
                m = self.moe_intermediate_size
                shapes[p + "mlp.gate.weight"] = (self.num_experts, h)  # the router
                for e in range(self.num_experts):
                    shapes[p + f"mlp.experts.{e}.gate_proj.weight"] = (m, h)
                    shapes[p + f"mlp.experts.{e}.up_proj.weight"] = (m, h)
                    shapes[p + f"mlp.experts.{e}.down_proj.weight"] = (h, m)
                continue
            shapes[p + "mlp.gate_proj.weight"] = (i, h)
            shapes[p + "mlp.up_proj.weight"] = (i, h)
            shapes[p + "mlp.down_proj.weight"] = (h, i)
        shapes["model.norm.weight"] = (h,)
        if not self.tie_word_embeddings:
            shapes["lm_head.weight"] = (self.vocab_size, h)
        return shapes

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config.json") -> Qwen3Config:
        _refuse_unsupported(raw, source)
        moe = raw["model_type"] == "qwen3_moe"
        if moe:
            raw = {**raw, **{name: default for name, default in MOE_DEFAULTS.items()
                             if raw.get(name) is None}}
        values: dict[str, Any] = {}
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads"):
            if raw.get(name) is None:
                raise ModelError(f"{source}: required field '{name}' is missing")
            values[name] = _integer(raw[name], name, source)
        heads, hidden = values["num_attention_heads"], values["hidden_size"]
        kv_heads, head_dim = raw.get("num_key_value_heads"), raw.get("head_dim")
        values["num_key_value_heads"] = (heads if kv_heads is None
                                         else _integer(kv_heads, "num_key_value_heads", source))
        values["head_dim"] = (hidden // heads if head_dim is None and heads > 0
                              else _integer(head_dim or 0, "head_dim", source))
        for name, kind in (("rms_norm_eps", float), ("max_position_embeddings", int),
                           ("torch_dtype", str)):
            if raw.get(name) is not None:
                try:
                    values[name] = kind(raw[name])
                except (TypeError, ValueError):
                    raise ModelError(f"{source}: {name}={raw[name]!r} is not a "
                                     f"{kind.__name__}") from None
        tie = raw.get("tie_word_embeddings")
        if tie is not None:
            if not isinstance(tie, bool):
                raise ModelError(f"{source}: tie_word_embeddings={json.dumps(tie)} must be "
                                 "true or false")
            values["tie_word_embeddings"] = tie
        if raw.get("dtype") is not None and raw.get("torch_dtype") is None:
            values["torch_dtype"] = str(raw["dtype"])
        values["quantization"] = _quantization(raw.get("quantization_config"), source)
        theta = _rope_theta(raw)
        if theta is not None:
            values["rope_theta"] = theta
        values["rope_scaling"] = _rope_scaling(raw, source)
        if moe:
            values.update(_experts(raw, values["num_hidden_layers"], source))
        config = cls(**values)
        config._check_sizes(source)
        return config

    @classmethod
    def from_file(cls, path: Path) -> Qwen3Config:
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ModelError(f"{path} not found: a model directory needs its config.json") from None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ModelError(f"{path} is not readable JSON ({exc})") from None
        if not isinstance(raw, dict):
            raise ModelError(f"{path} does not hold a JSON object")
        return cls.from_dict(raw, source=str(path))

    def _check_sizes(self, source: str) -> None:
        for f in fields(self):
            if f.name in MOE_SIZES:  # (0 in a dense config; _experts checks a qwen3_moe one's)
                continue
            value = getattr(self, f.name)
            if isinstance(value, int) and not isinstance(value, bool) and value <= 0:
                raise ModelError(f"{source}: {f.name} must be positive, got {value}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ModelError(
                f"{source}: num_attention_heads ({self.num_attention_heads}) is not a multiple "
                f"of num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            raise ModelError(f"{source}: head_dim must be even for RoPE, got {self.head_dim}")
        for name in ("rms_norm_eps", "rope_theta"):
            value = getattr(self, name)
            if not value > 0:
                raise ModelError(f"{source}: {name} must be positive, got {value}")


def _experts(raw: dict[str, Any], layers: int, source: str) -> dict[str, Any]:
    """A qwen3_moe config's expert fields, each checked, in one line naming the field."""
    values: dict[str, Any] = {}
    for name in MOE_SIZES:
        values[name] = _integer(raw[name], name, source)
        if values[name] <= 0:
            raise ModelError(f"{source}: {name} must be positive, got {values[name]}")
    if values["num_experts_per_tok"] > values["num_experts"]:
        raise ModelError(f"{source}: num_experts_per_tok ({values['num_experts_per_tok']}) is "
                         f"more than num_experts ({values['num_experts']}); a token goes to "
                         f"that many different experts, so at most {values['num_experts']}")
    if not isinstance(raw["norm_topk_prob"], bool):
        raise ModelError(f"{source}: norm_topk_prob={json.dumps(raw['norm_topk_prob'])} must be "
                         "true or false")
    values["norm_topk_prob"] = raw["norm_topk_prob"]
    dense = raw["mlp_only_layers"]
    if not isinstance(dense, list):
        raise ModelError(f"{source}: mlp_only_layers={json.dumps(dense)} must be a list of "
                         "layer numbers")
    for layer in dense:
        if _integer(layer, "mlp_only_layers", source) not in range(layers):
            raise ModelError(f"{source}: mlp_only_layers names layer {json.dumps(layer)}, but "
                             f"num_hidden_layers is {layers} (layers 0 to {layers - 1})")
    values["mlp_only_layers"] = tuple(sorted({int(layer) for layer in dense}))
    return values


def _integer(value: Any, name: str, source: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value):
        raise ModelError(f"{source}: {name}={json.dumps(value)} is not an integer")
    return int(value)


def _rope_theta(raw: dict[str, Any]) -> float | None:
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and params.get("rope_theta") is not None:
        return float(params["rope_theta"])
    if raw.get("rope_theta") is not None:
        return float(raw["rope_theta"])
    return None


def _rope_scaling(raw: dict[str, Any], source: str) -> Yarn | None:
    """YaRN from `rope_scaling` (older configs) or `rope_parameters` (transformers 5), its type
    named by `rope_type` or `type`; None for plain RoPE; one line for any other type or a
    malformed entry."""
    spec, field = raw.get("rope_scaling"), "rope_scaling"
    if spec is None:
        spec, field = raw.get("rope_parameters"), "rope_parameters"
    if spec is None:
        return None
    if not isinstance(spec, dict):
        raise ModelError(f"{source}: {field}={json.dumps(spec)} is not an object")
    kind = spec.get("rope_type") or spec.get("type") or "default"
    if kind == "default":
        return None
    if kind != "yarn":
        raise ModelError(f"{source}: unsupported {field} type {json.dumps(kind)} (qwenchat runs "
                         "plain RoPE and YaRN)")
    values: dict[str, Any] = {}
    for name, kind_of in (("factor", float), ("original_max_position_embeddings", int),
                          ("beta_fast", float), ("beta_slow", float),
                          ("attention_factor", float), ("mscale", float),
                          ("mscale_all_dim", float)):
        value = spec.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (
                kind_of is int and value != int(value)):
            raise ModelError(f"{source}: {field}.{name}={json.dumps(value)} is not a number")
        values[name] = kind_of(value)
    for name in ("factor", "original_max_position_embeddings"):
        if name not in values:
            raise ModelError(f"{source}: {field} (YaRN) needs {name}")
    if values["factor"] < 1 or values["original_max_position_embeddings"] < 1:
        raise ModelError(f"{source}: {field} (YaRN) needs factor >= 1 and a positive "
                         "original_max_position_embeddings")
    if "truncate" in spec:
        values["truncate"] = bool(spec["truncate"])
    return Yarn(**values)


def _quantization(spec: Any, source: str) -> str | None:
    """"fp8" for Qwen's own FP8 layout (e4m3 weights, 128 x 128 blocks of scales, activations
    unscaled); one line naming the field for any other quantization."""
    if spec is None:
        return None
    if not isinstance(spec, dict):
        raise ModelError(f"{source}: quantization_config must be a JSON object")

    def refuse(field: str, why: str) -> ModelError:
        value = json.dumps(spec.get(field))
        return ModelError(f"{source}: unsupported quantization_config.{field}={value} ({why})")

    if spec.get("quant_method") == "awq":
        return _awq(spec, refuse)
    if spec.get("quant_method") != "fp8":
        raise refuse("quant_method", "qwenchat reads unquantized checkpoints, Qwen's FP8 ones "
                     "(\"fp8\") and Qwen's AWQ ones (\"awq\"); use the model's bf16 release, "
                     "with --quantize fp8 if you want FP8")
    if spec.get("fmt", "e4m3") != "e4m3":
        raise refuse("fmt", "FP8 weights must be e4m3")
    if spec.get("activation_scheme", "dynamic") != "dynamic":
        raise refuse("activation_scheme", "only \"dynamic\": qwenchat keeps activations "
                     "unquantized and reads no activation scales")
    if spec.get("weight_block_size") != [BLOCK, BLOCK]:
        raise refuse("weight_block_size", "Qwen's FP8 checkpoints use [128, 128] blocks, the "
                     "only size qwenchat reads")
    if spec.get("scale_fmt") not in (None, "float"):
        raise refuse("scale_fmt", "scales must be plain floating point")
    return "fp8"


def _awq(spec: dict[str, Any], refuse: Callable[[str, str], ModelError]) -> str:
    """Qwen's AWQ checkpoints: 4-bit weights in groups of 128 input columns with zero points,
    AutoAWQ's "gemm" packing (qwenchat.model.awq)."""
    if spec.get("bits") != INT4.bits:
        raise refuse("bits", "qwenchat reads 4-bit AWQ weights")
    if spec.get("group_size") != BLOCK:
        raise refuse("group_size", f"qwenchat reads groups of {BLOCK} input columns, as "
                     "Qwen's AWQ checkpoints have")
    if spec.get("zero_point", True) is not True:
        raise refuse("zero_point", "qwenchat reads AWQ weights with zero points")
    if str(spec.get("version", "gemm")).lower() != "gemm":
        raise refuse("version", "qwenchat reads AutoAWQ's \"gemm\" packing")
    skipped = spec.get("modules_to_not_convert")
    if skipped is not None and not (isinstance(skipped, list)
                                    and all(isinstance(m, str) for m in skipped)):
        raise refuse("modules_to_not_convert", "a list of module names, or null")
    return "awq"


def _refuse_unsupported(raw: dict[str, Any], source: str) -> None:
    """Name the first field that puts this config outside the Qwen3 family (dense and MoE)."""

    def refuse(field: str, value: Any, why: str) -> ModelError:
        return ModelError(f"{source}: unsupported {field}={json.dumps(value)} ({why})")

    archs, model_type = raw.get("architectures"), raw.get("model_type")
    known = " and ".join(ARCHITECTURES.values())
    if archs is not None and not (isinstance(archs, list) and len(archs) == 1
                                  and archs[0] in ARCHITECTURES.values()):
        raise refuse("architectures", archs, f"qwenchat runs {known} models only")
    if not isinstance(model_type, str) or model_type not in ARCHITECTURES:
        raise refuse("model_type", model_type, "expected \"qwen3\" or \"qwen3_moe\"")
    if archs is not None and archs != [ARCHITECTURES[model_type]]:
        wanted = next(t for t, arch in ARCHITECTURES.items() if [arch] == archs)
        raise refuse("model_type", model_type, f"architectures {json.dumps(archs)} needs "
                     f"model_type {json.dumps(wanted)}")
    if model_type == "qwen3":
        for moe_field in ("num_experts", "num_experts_per_tok", "moe_intermediate_size"):
            if raw.get(moe_field):
                raise refuse(moe_field, raw[moe_field], "a dense \"qwen3\" config has no "
                             "experts; mixture-of-experts models are model_type \"qwen3_moe\"")
    if raw.get("use_sliding_window"):
        raise refuse("use_sliding_window", raw["use_sliding_window"], "sliding-window attention")
    layer_types = raw.get("layer_types")
    if layer_types and any(t != "full_attention" for t in layer_types):
        other = next(t for t in layer_types if t != "full_attention")
        raise refuse("layer_types", other, "every layer must use full attention")
    if raw.get("attention_bias"):
        raise refuse("attention_bias", raw["attention_bias"], "Qwen3 has no attention bias")
    if raw.get("hidden_act", "silu") != "silu":
        raise refuse("hidden_act", raw["hidden_act"], "Qwen3 uses silu")
