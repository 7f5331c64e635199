"""Open a model directory: config, validated checkpoint, tokenizer and stop ids, together."""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
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
    _tokenizer: Future[tuple[Tokenizer, frozenset[int]]]

    @property
    def tokenizer(self) -> Tokenizer:
        """The tokenizer, once loaded (a broken tokenizer.json raises its ModelError here)."""
        return self._tokenizer.result()[0]

    @property
    def eos_ids(self) -> frozenset[int]:
        return self._tokenizer.result()[1]

    def close(self) -> None:
        self.checkpoint.close()


def open_model(spec: str, progress: DownloadProgress | None = None,
               tokenizer_in_background: bool = False, flag: str = "--model") -> Model:
    """`progress` gets a line on a hub download's progress (else huggingface_hub's bars);
    `flag` is the option `spec` came with, as errors name it."""
    directory = resolve_model(spec, progress, flag)
    return open_model_dir(directory, spec, tokenizer_in_background)


def open_model_dir(directory: Path, spec: str | None = None,
                   tokenizer_in_background: bool = False) -> Model:
    """Config and checkpoint now; the tokenizer now too, or, `tokenizer_in_background`, on a
    thread of its own (half a second for Qwen3's), so that it loads while the caller builds
    the engine and any problem with it is raised on first use."""
    config = Qwen3Config.from_file(directory / "config.json")
    if tokenizer_in_background:
        pool = ThreadPoolExecutor(1, thread_name_prefix="qwenchat-tokenizer")
        tokenizer = pool.submit(_open_tokenizer, directory, config)
        pool.shutdown(wait=False)  # its one thread ends with the load
    else:
        tokenizer = Future()
        tokenizer.set_result(_open_tokenizer(directory, config))
    return Model(spec or str(directory), directory, config, Checkpoint(directory, config),
                 tokenizer)


def _open_tokenizer(directory: Path, config: Qwen3Config) -> tuple[Tokenizer, frozenset[int]]:
    """The tokenizer and the ids that end a reply, checked against the config."""
    tokenizer = Tokenizer(directory)
    if tokenizer.vocab_size > config.vocab_size:
        raise ModelError(f"{directory}: tokenizer.json has {tokenizer.vocab_size} tokens but "
                         f"config.json's vocab_size is {config.vocab_size}")
    fallback = [i for i in (tokenizer.im_end_id, tokenizer.end_of_text_id) if i is not None]
    eos = frozenset(eos_token_ids(directory, fallback))
    if not eos:
        raise ModelError(f"{directory}: no end-of-sequence token (generation_config.json has no "
                         "eos_token_id and the tokenizer has no <|im_end|>)")
    return tokenizer, eos
