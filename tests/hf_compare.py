"""transformers as the outside oracle: load a model dir in float32 and run what a user would."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest


def require_transformers():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    return torch, transformers


def hf_model(directory: Path):
    """The class config.json names (Qwen3ForCausalLM or Qwen3MoeForCausalLM), every weight read
    from the checkpoint (none left at transformers' random initialisation)."""
    torch, transformers = require_transformers()
    architecture = json.loads((directory / "config.json").read_text())["architectures"][0]
    model, loading = getattr(transformers, architecture).from_pretrained(
        directory, dtype=torch.float32, output_loading_info=True)
    assert not loading["missing_keys"] and not loading["unexpected_keys"], loading
    return model.eval()


def hf_logits(directory: Path, ids: list[int]) -> np.ndarray:
    torch, _ = require_transformers()
    with torch.no_grad():
        return hf_model(directory)(torch.tensor([ids])).logits[0].numpy()


def hf_greedy_text(directory: Path, messages: list[dict], max_new_tokens: int) -> str:
    """What `generate(do_sample=False)` answers, decoded as a user would print it."""
    torch, transformers = require_transformers()
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                           enable_thinking=False)
    inputs = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        out = hf_model(directory).generate(**inputs, max_new_tokens=max_new_tokens,
                                           do_sample=False)
    return tokenizer.decode(out[0][inputs.input_ids.shape[1]:], skip_special_tokens=True)


def relative_error(ours: np.ndarray, reference: np.ndarray) -> float:
    return float(np.abs(ours - reference).max() / np.abs(reference).max())
