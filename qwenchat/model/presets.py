"""Known Qwen3 sizes by name, for `qwenchat bench --config` and tests that need no download."""

from __future__ import annotations

from pathlib import Path

from qwenchat.errors import UsageError
from qwenchat.model.config import Qwen3Config

_COMMON = dict(vocab_size=151_936, head_dim=128, num_key_value_heads=8, rms_norm_eps=1e-6,
               rope_theta=1_000_000.0, max_position_embeddings=40_960)

PRESETS: dict[str, Qwen3Config] = {
    "qwen3-0.6b": Qwen3Config(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                              num_attention_heads=16, tie_word_embeddings=True, **_COMMON),
    "qwen3-1.7b": Qwen3Config(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                              num_attention_heads=16, tie_word_embeddings=True, **_COMMON),
    "qwen3-4b": Qwen3Config(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                            num_attention_heads=32, tie_word_embeddings=True, **_COMMON),
    "qwen3-8b": Qwen3Config(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                            num_attention_heads=32, tie_word_embeddings=False, **_COMMON),
    "qwen3-14b": Qwen3Config(hidden_size=5120, intermediate_size=17408, num_hidden_layers=40,
                             num_attention_heads=40, tie_word_embeddings=False, **_COMMON),
    "qwen3-32b": Qwen3Config(hidden_size=5120, intermediate_size=25600, num_hidden_layers=64,
                             num_attention_heads=64, tie_word_embeddings=False, **_COMMON),
    # The mixture of experts: 128 experts of 768 rows a layer, 8 a token, 4 key/value heads.
    "qwen3-30b-a3b": Qwen3Config(hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
                                 num_attention_heads=32, tie_word_embeddings=False,
                                 **{**_COMMON, "num_key_value_heads": 4}, num_experts=128,
                                 num_experts_per_tok=8, moe_intermediate_size=768,
                                 norm_topk_prob=True),
}


def preset(name: str) -> Qwen3Config:
    try:
        return PRESETS[name.lower()]
    except KeyError:
        raise UsageError(f"unknown config {name!r}; choose one of {', '.join(PRESETS)}") from None


def named_config(value: str) -> Qwen3Config:
    """A known size by name, or the config.json file at `value` (`--config`)."""
    if value.lower() in PRESETS:
        return preset(value)
    if Path(value).is_file():
        return Qwen3Config.from_file(Path(value))
    raise UsageError(f"--config {value!r} is neither a known size ({', '.join(PRESETS)}) nor "
                     "a config.json file")
