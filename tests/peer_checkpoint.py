"""A checkpoint of bench's random weights on disk, for the peers: a benchmark aid (hand-run).

`qwenchat bench --config C` draws its random weights itself; llama.cpp (through a GGUF) and
transformers need a file. This writes the very same weights (RandomWeights, seed 0, bf16: every
value is a pure function of the tensor's name) in a preset's shape, with the real tokenizer, so
that every engine of a comparison reads one checkpoint (`bench --model DIR`). `--layers N` keeps
the first N layers (a 30B-A3B of 8 layers is 11 GB), tensors are written one at a time:

    python tests/peer_checkpoint.py --config qwen3-8b --tokenizer TOKDIR --out /tmp/q8b
    python tests/peer_checkpoint.py --config qwen3-30b-a3b --layers 8 --tokenizer TOKDIR \\
        --out /tmp/a3b
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import shutil
from pathlib import Path

from qwenchat.model.checkpoint import TensorOut, write_safetensors
from qwenchat.model.config import Qwen3Config
from qwenchat.model.presets import PRESETS
from qwenchat.model.random_weights import RandomWeights

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


# The mixture of experts' fields: a dense model's config.json has none of them
MOE_FIELDS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
              "decoder_sparse_step", "mlp_only_layers")


def config_json(config: Qwen3Config) -> dict:
    """config.json as Hugging Face writes it for this shape (dense or mixture of experts)."""
    moe = config.num_experts > 0
    raw = {"architectures": ["Qwen3MoeForCausalLM" if moe else "Qwen3ForCausalLM"],
           "model_type": "qwen3_moe" if moe else "qwen3", "hidden_act": "silu",
           "attention_bias": False, "torch_dtype": "bfloat16"}
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        if field.name in MOE_FIELDS and not moe:
            continue
        if isinstance(value, (int, float, bool, tuple)):
            raw[field.name] = list(value) if isinstance(value, tuple) else value
    return raw


def write_checkpoint(directory: Path, config: Qwen3Config, tokenizer: Path,
                     seed: int = 0) -> Path:
    """`config`'s random bf16 weights (RandomWeights(config, seed)) as one safetensors file,
    with its config.json and the tokenizer's files from `tokenizer`; a directory that already
    holds the weights is left as it is."""
    if (directory / "model.safetensors").is_file():
        return directory
    directory.mkdir(parents=True, exist_ok=True)
    weights = RandomWeights(config, seed=seed)
    tensors = [TensorOut(name, "BF16", shape, 2 * math.prod(shape),
                         lambda name=name: weights.bf16_bits(name).tobytes())
               for name, shape in config.tensor_shapes().items()]
    partial = directory / "model.safetensors.partial"
    write_safetensors(partial, tensors)
    partial.replace(directory / "model.safetensors")
    (directory / "config.json").write_text(json.dumps(config_json(config), indent=2))
    for name in TOKENIZER_FILES:
        if (tokenizer / name).is_file():
            shutil.copy(tokenizer / name, directory / name)
    return directory


def preset(name: str, layers: int | None) -> Qwen3Config:
    """A preset's shape, with its first `layers` layers only where given."""
    config = PRESETS[name]
    if layers is None:
        return config
    if not 1 <= layers <= config.num_hidden_layers:
        raise SystemExit(f"--layers: {name} has 1 to {config.num_hidden_layers} layers")
    return dataclasses.replace(config, num_hidden_layers=layers)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="qwen3-0.6b", choices=sorted(PRESETS))
    parser.add_argument("--layers", type=int, help="keep the first N layers (default: all)")
    parser.add_argument("--tokenizer", type=Path, required=True,
                        help="a directory with the real tokenizer.json and its template")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    directory = write_checkpoint(args.out, preset(args.config, args.layers), args.tokenizer)
    size = (directory / "model.safetensors").stat().st_size
    print(f"{directory}: {size / 1e9:.2f} GB")


if __name__ == "__main__":
    main()
