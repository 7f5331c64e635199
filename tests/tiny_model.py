"""Writes tiny random Qwen3 checkpoints in Hugging Face layout, so tests run offline in seconds."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np

from qwenchat.model import awq, fp8
from qwenchat.model.checkpoint import TensorOut
from qwenchat.model.checkpoint import write_safetensors as write_to
from qwenchat.model.config import Qwen3Config
from qwenchat.model.floats import f32_to_bf16_bits, f32_to_e4m3
from qwenchat.model.formats import is_linear

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
NON_SPECIAL_ADDED = ["<think>", "</think>"]

# A ChatML template in the spirit of Qwen3's: earlier assistant turns lose their <think> part,
# and enable_thinking=false pre-fills an empty think block.
CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' %}"
    "{%- set content = message.content.split('</think>')[-1].lstrip('\\n') %}"
    "{{- '<|im_start|>assistant\\n' + content + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{%- endif %}"
)

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello, world! How are you today? I am fine, thank you.",
    "def add(a, b):\n    return a + b\n",
    "Qwen3 is a family of language models. Tokens stream to the terminal.",
    "你好，世界。今天天气很好。我们一起学习。",
    "こんにちは世界。日本語のテキストです。",
    "Emoji: 😀 🎉 🚀 👍 ❤️ and accents: café, naïve, über, señor.",
    "system user assistant think answer question",
    "1234567890 + - * / = ( ) [ ] { } < > | \\ ; : ' \" , . ? !",
]


def train_tokenizer(vocab_size: int = 400):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from tokenizers import processors as post

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = post.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 20, trainer=trainer)
    from tokenizers import AddedToken

    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in NON_SPECIAL_ADDED])
    return tok


def tiny_config(**overrides) -> dict:
    raw = {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": 512,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1_000_000.0,
        "max_position_embeddings": 512,
        "tie_word_embeddings": True,
        "hidden_act": "silu",
        "attention_bias": False,
        "rope_scaling": None,
        "use_sliding_window": False,
        "torch_dtype": "bfloat16",
    }
    raw.update(overrides)
    return raw


# A tiny Qwen3-MoE: 5 experts, 3 a token (neither a power of two), layer 1 of 3 dense
# (mlp_only_layers), experts narrower than the dense MLP, untied (transformers' default for
# qwen3_moe).
TINY_MOE = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
            "num_hidden_layers": 3, "num_experts": 5, "num_experts_per_tok": 3,
            "moe_intermediate_size": 48, "norm_topk_prob": True, "decoder_sparse_step": 1,
            "mlp_only_layers": [1], "tie_word_embeddings": False}


def tiny_moe_config(**overrides) -> dict:
    return tiny_config(**{**TINY_MOE, **overrides})


def random_tensors(config: Qwen3Config, seed: int = 0) -> dict[str, np.ndarray]:
    """float32 weights scaled so activations stay O(1) and logits are well separated."""
    rng = np.random.default_rng(seed)
    tensors = {}
    for name, shape in config.tensor_shapes().items():
        if name.endswith("norm.weight"):
            tensors[name] = (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
        elif name == "model.embed_tokens.weight" or name == "lm_head.weight":
            tensors[name] = rng.standard_normal(shape).astype(np.float32)
        else:
            # Output projections get extra gain so the layers, not the tied embedding, decide
            # the next token: otherwise a random model only echoes its last input token.
            gain = 4.0 if name.endswith(("o_proj.weight", "down_proj.weight")) else 1.0
            tensors[name] = (gain * rng.standard_normal(shape) / np.sqrt(shape[1])).astype(
                np.float32)
    return tensors


def encode_tensor(array: np.ndarray, dtype: str) -> bytes:
    if dtype == "I32":
        return array.astype("<i4").tobytes()
    if dtype == "F8_E4M3":
        return array.astype(np.uint8).tobytes()  # already e4m3 codes
    if dtype == "BF16":
        return f32_to_bf16_bits(array).tobytes()
    if dtype == "F16":
        return array.astype("<f2").tobytes()
    return array.astype("<f4").tobytes()


def write_safetensors(path: Path, tensors: dict[str, np.ndarray],
                      dtype: str | dict[str, str]) -> None:
    """One file; `dtype` is every tensor's, or a dtype per tensor name."""
    out = []
    for name, array in tensors.items():
        kind = dtype if isinstance(dtype, str) else dtype[name]
        blob = encode_tensor(array, kind)
        out.append(TensorOut(name, kind, tuple(array.shape), len(blob), lambda b=blob: b))
    write_to(path, out)


FP8_QUANTIZATION = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                    "weight_block_size": [128, 128]}


def round_significand(values: np.ndarray, bits: int) -> np.ndarray:
    """float32 values rounded to `bits` significant bits (toward zero)."""
    mask = np.uint32((0xFFFFFFFF << (24 - bits)) & 0xFFFFFFFF)
    return (np.ascontiguousarray(values, np.float32).view(np.uint32) & mask).view(np.float32)


def fp8_tensors(tensors: dict[str, np.ndarray], scale_dtype: str = "BF16",
                exact_in_bf16: bool = True) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Tensors in Qwen's FP8 layout: each linear weight as e4m3 codes plus a
    `_scale_inv` tensor of its 128 x 128 block scales; everything else in BF16.

    With `exact_in_bf16` the scales keep 4 significant bits, so every code x scale (4 bits
    times 4 bits) is exactly a bfloat16 number: a bf16 copy of the dequantized weights is then
    the very same model, for comparisons with engines that cannot read FP8."""
    out: dict[str, np.ndarray] = {}
    dtypes: dict[str, str] = {}
    for name, weight in tensors.items():
        if not is_linear(name):
            out[name], dtypes[name] = weight, "BF16"
            continue
        codes, scales = fp8.quantize(weight)
        if exact_in_bf16:
            scales = round_significand(scales, 4)
            safe = np.where(scales > 0, scales, np.float32(1))
            codes = f32_to_e4m3(weight / fp8.expand_scales(safe, weight.shape))
        out[name], dtypes[name] = codes, "F8_E4M3"
        out[name + fp8.SCALE_SUFFIX], dtypes[name + fp8.SCALE_SUFFIX] = scales, scale_dtype
    return out, dtypes


AWQ_QUANTIZATION = {"bits": 4, "group_size": 128, "modules_to_not_convert": None,
                    "quant_method": "awq", "version": "gemm", "zero_point": True}
# A tiny shape AWQ can hold: input columns in whole groups of 128 (down_proj's 384: an odd
# number of groups, 3).
AWQ_SHAPE = {"hidden_size": 128, "intermediate_size": 384, "num_attention_heads": 4,
             "num_key_value_heads": 2, "head_dim": 32}


def awq_tensors(tensors: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Every linear layer in AWQ's layout (round to nearest, the recipe awq.quantize has), the
    rest in fp16, as AWQ files store them."""
    out: dict[str, np.ndarray] = {}
    dtypes: dict[str, str] = {}
    for name, weight in tensors.items():
        if not is_linear(name):
            out[name], dtypes[name] = weight, "F16"
            continue
        module = name.removesuffix(".weight")
        for suffix, array, dtype in zip(awq.SUFFIXES, awq.quantize(weight),
                                        ("I32", "I32", "F16"), strict=True):
            out[f"{module}.{suffix}"], dtypes[f"{module}.{suffix}"] = array, dtype
    return out, dtypes


def write_tiny_model(
    directory: Path,
    dtype: str = "BF16",
    shards: int = 1,
    seed: int = 0,
    tokenizer=None,
    scale_dtype: str = "BF16",
    **config_overrides,
) -> Path:
    """A complete model directory: config, weights, generation config, tokenizer, template.
    dtype "FP8" writes Qwen's FP8 layout (scales in `scale_dtype`), "AWQ" Qwen's AWQ layout
    (in AWQ_SHAPE unless the overrides say otherwise)."""
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = tokenizer or train_tokenizer()
    if dtype == "AWQ":
        config_overrides = {**AWQ_SHAPE, **config_overrides}
    raw = tiny_config(**config_overrides)
    raw["vocab_size"] = max(raw["vocab_size"], tokenizer.get_vocab_size())
    if dtype == "FP8":
        raw.setdefault("quantization_config", FP8_QUANTIZATION)
    if dtype == "AWQ":
        raw.setdefault("quantization_config", AWQ_QUANTIZATION)
    config = Qwen3Config.from_dict(raw)
    (directory / "config.json").write_text(json.dumps(raw, indent=2))
    tensors = random_tensors(config, seed)
    dtypes: str | dict[str, str] = dtype
    if dtype == "FP8":
        tensors, dtypes = fp8_tensors(tensors, scale_dtype)
    if dtype == "AWQ":
        tensors, dtypes = awq_tensors(tensors)
    if shards == 1:
        write_safetensors(directory / "model.safetensors", tensors, dtypes)
    else:
        names = list(tensors)
        weight_map = {}
        for k in range(shards):
            part = names[k::shards]
            filename = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
            write_safetensors(directory / filename, {n: tensors[n] for n in part}, dtypes)
            weight_map.update({n: filename for n in part})
        index = {"metadata": {}, "weight_map": weight_map}
        (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    im_end, eot = tokenizer.token_to_id("<|im_end|>"), tokenizer.token_to_id("<|endoftext|>")
    generation = {"eos_token_id": [im_end, eot], "do_sample": True, "temperature": 0.6,
                  "top_k": 20, "top_p": 0.95, "pad_token_id": eot}
    (directory / "generation_config.json").write_text(json.dumps(generation, indent=2))
    tokenizer.save(str(directory / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "Qwen2Tokenizer",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "bos_token": None,
        "unk_token": None,
        "add_bos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": raw["max_position_embeddings"],
        "chat_template": CHATML_TEMPLATE,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    return directory


def write_tiny_moe_model(directory: Path, **overrides) -> Path:
    """A complete mixture-of-experts model directory (TINY_MOE, changed by `overrides`)."""
    return write_tiny_model(directory, **{**TINY_MOE, **overrides})


def write_edited_model(directory: Path, tokenizer, dtype: str, edit) -> Path:
    """A tiny model in `dtype`'s quantized layout ("FP8" or "AWQ") whose encoded tensors and
    their dtypes `edit(tensors, dtypes)` changes before they are written (broken files)."""
    write_tiny_model(directory, dtype=dtype, tokenizer=tokenizer)
    raw = json.loads((directory / "config.json").read_text())
    config = Qwen3Config.from_dict({**raw, "quantization_config": None})
    encode = fp8_tensors if dtype == "FP8" else awq_tensors
    tensors, dtypes = encode(random_tensors(config, 0))
    edit(tensors, dtypes)
    write_safetensors(directory / "model.safetensors", tensors, dtypes)
    return directory


def refusal_line(directory: Path) -> str:
    """The ModelError opening the model at `directory` raises: one line, naming the
    directory."""
    import pytest

    from qwenchat.errors import ModelError
    from qwenchat.model.loader import open_model_dir

    with pytest.raises(ModelError) as caught:
        open_model_dir(directory)
    message = str(caught.value)
    assert "\n" not in message and str(directory) in message
    return message


def without_quantization_config(source: Path, directory: Path) -> Path:
    """`source` copied to `directory` with config.json's quantization_config dropped (its
    quantized tensors kept)."""
    shutil.copytree(source, directory)
    raw = json.loads((directory / "config.json").read_text())
    del raw["quantization_config"]
    (directory / "config.json").write_text(json.dumps(raw))
    return directory


def _rewritten_copy(source: Path, directory: Path,
                    quantization: dict | None) -> dict[str, np.ndarray]:
    """`source` copied to `directory` with its weight files removed and config.json's
    quantization_config set (or dropped); returns the source's weights as float32."""
    from qwenchat.model.loader import open_model_dir

    shutil.copytree(source, directory)
    raw = json.loads((directory / "config.json").read_text())
    raw.pop("quantization_config", None)
    if quantization is not None:
        raw["quantization_config"] = quantization
    (directory / "config.json").write_text(json.dumps(raw, indent=2))
    model = open_model_dir(source)
    tensors = {name: model.checkpoint.float32(name) for name in model.config.tensor_shapes()}
    model.close()
    for old in directory.glob("model*.safetensors*"):
        old.unlink()
    return tensors


def write_dequantized_copy(source: Path, directory: Path, dtype: str = "BF16") -> Path:
    """The FP8 model at `source` as a plain checkpoint of its dequantized weights (no
    quantization_config), tokenizer and all: what transformers can read."""
    tensors = _rewritten_copy(source, directory, None)
    write_safetensors(directory / "model.safetensors", tensors, dtype)
    return directory


def write_quantized_copy(source: Path, directory: Path, scale_dtype: str = "F32") -> Path:
    """The model at `source` as an FP8 checkpoint made offline with the recipe `--quantize
    fp8` applies at load time (scales as computed, not rounded)."""
    tensors = _rewritten_copy(source, directory, FP8_QUANTIZATION)
    encoded, dtypes = fp8_tensors(tensors, scale_dtype, exact_in_bf16=False)
    write_safetensors(directory / "model.safetensors", encoded, dtypes)
    return directory
