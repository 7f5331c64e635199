"""Open a model directory: config, validated checkpoint, tokenizer and stop ids, together."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from qwenchat.errors import ModelError
from qwenchat.model.checkpoint import Checkpoint
from qwenchat.model.config import Qwen3Config
from qwenchat.model.locate import DownloadProgress, resolve_model
from qwenchat.model.tokenizer import Tokenizer
from qwenchat.sampling.params import eos_token_ids


@dataclass
class Model:
    spec: str  # what the user passed to --model
    directory: Path
    config: Qwen3Config
    checkpoint: Checkpoint
    tokenizer: Tokenizer
    eos_ids: frozenset[int]

    def close(self) -> None:
        self.checkpoint.close()


def open_model(spec: str, progress: DownloadProgress | None = None) -> Model:
    """`progress` gets a line on a hub download's progress (else huggingface_hub's bars)."""
    directory = resolve_model(spec, progress)
    return open_model_dir(directory, spec)


def open_model_dir(directory: Path, spec: str | None = None) -> Model:
    config = Qwen3Config.from_file(directory / "config.json")
    tokenizer = Tokenizer(directory)
    if tokenizer.vocab_size > config.vocab_size:
        raise ModelError(f"{directory}: tokenizer.json has {tokenizer.vocab_size} tokens but "
                         f"config.json's vocab_size is {config.vocab_size}")
    checkpoint = Checkpoint(directory, config)
    fallback = [i for i in (tokenizer.im_end_id, tokenizer.end_of_text_id) if i is not None]
    eos = frozenset(eos_token_ids(directory, fallback))
    if not eos:
        raise ModelError(f"{directory}: no end-of-sequence token (generation_config.json has no "
                         "eos_token_id and the tokenizer has no <|im_end|>)")
    return Model(spec or str(directory), directory, config, checkpoint, tokenizer, eos)
