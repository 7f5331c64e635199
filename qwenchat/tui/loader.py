"""Loading the model and engine for the chat, one reported step at a time."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from qwenchat.engine import Engine, create_engine
from qwenchat.engine.speculate import DraftProposer, open_draft
from qwenchat.model import rope
from qwenchat.model.config import parameters_summary
from qwenchat.model.loader import open_model
from qwenchat.model.tokenizer import Tokenizer
from qwenchat.tui.options import ChatOptions

Report = Callable[[str], None]


@dataclass
class LoadedModel:
    """What a chat session needs: an engine with its KV cache, the tokenizer and stop ids."""

    spec: str  # the model as the user named it
    directory: Path | None  # holds generation_config.json; None: Qwen's presets only
    engine: Engine
    tokenizer: Tokenizer
    eos_ids: frozenset[int]
    proposer: DraftProposer | None = None  # --draft: the draft model that proposes tokens
    draft_spec: str | None = None  # the draft as the user named it

    @property
    def device_name(self) -> str:
        return getattr(self.engine, "device_name", "CPU")

    def describe(self) -> str:
        """/info: the model and the draft, each with its engine and (GPU) memory."""
        lines = [f"model {self.spec}: {_engine_text(self.engine)}"]
        if self.proposer is not None:
            lines.append(f"draft {self.draft_spec}: {_engine_text(self.proposer.engine)}")
        else:
            lines.append("draft: none (--draft MODEL loads one; --speculate ngram needs none)")
        return "\n".join(lines)

    def close(self) -> None:
        """Free the engine's memory (its KV cache, and on a GPU its weights), from whichever
        thread quits (the CUDA engine makes its context current on that thread itself)."""
        self.engine.close()
        if self.proposer is not None:
            self.proposer.close()


# A loader runs in a worker thread: `step` says what it starts doing now, `notice` reports
# something the user should still see once the chat is open, `progress` how far the current
# step has got (a download's bytes and files).
Loader = Callable[[Report, Report, Report], LoadedModel]


def model_loader(options: ChatOptions) -> Loader:
    def load(step: Report, notice: Report, progress: Report) -> LoadedModel:
        if Path(options.model).expanduser().is_dir():
            step(f"reading {options.model}")
        else:
            step(f"finding {options.model} in the Hugging Face cache (downloading it when "
                 "missing)")
        downloading = threading.Event()

        def download(text: str) -> None:  # from the download's threads
            if not downloading.is_set():
                downloading.set()
                step(f"downloading {options.model} from the Hugging Face hub")
            progress(text)

        # The tokenizer loads on its own thread while the engine compiles and uploads.
        model = open_model(options.model, progress=download, tokenizer_in_background=True)
        size = model.config.parameter_count() / 1e9
        step(f"loading {size:.2f} B parameters into the {options.backend} engine")

        def engine_message(text: str) -> None:
            # The engine reports kernel compilation and warnings through one callback; only
            # warnings matter once the chat is open. Compiles run beside the weight upload:
            # their step shows each kernel as it ends.
            if text.startswith("compiling "):
                step(text)
            else:
                notice(text)

        config = rope.with_flag(model.config, options.rope_scaling)
        engine = create_engine(options.backend, config, model.checkpoint, options.ctx,
                               options.device, notice=engine_message, decode=options.decode,
                               quantize=options.quantize, progress=progress,
                               kv_cache=options.kv_cache, megakernel_later=True)
        proposer = None
        try:
            tokenizer, eos_ids = model.tokenizer, model.eos_ids
            if options.draft and engine.can_speculate:
                step(f"loading the draft model {options.draft}")
                proposer = open_draft(options.draft, model, engine, options.backend,
                                      options.device, options.decode, options.quantize,
                                      engine_message, progress)
        except BaseException:
            engine.close()
            raise
        return LoadedModel(model.spec, model.directory, engine, tokenizer, eos_ids, proposer,
                           options.draft if proposer else None)

    return load


def _engine_text(engine: Engine) -> str:
    """Its parameters (and a mixture of experts' active ones), backend and device, weight
    format, and (where the engine counts them) the GPU memory of its weights and KV cache."""
    cfg = engine.config
    device = getattr(engine, "device_name", None)
    text = (f"{parameters_summary(cfg)}, {engine.name}"
            f"{f' on {device}' if device else ''}, {engine.weight_format} weights"
            f"{'' if engine.kv_format == 'bf16' else f', {engine.kv_format} KV cache'}")
    weights, cache = getattr(engine, "weight_bytes", None), getattr(engine, "kv_bytes", None)
    if weights is not None and cache is not None:
        text += (f" ({weights / 2**30:.2f} GiB), KV cache of {engine.capacity:,} tokens "
                 f"({cache / 2**30:.2f} GiB)")
    else:
        text += f", KV cache of {engine.capacity:,} tokens"
    return f"{text}; {rope.describe(cfg)}"
