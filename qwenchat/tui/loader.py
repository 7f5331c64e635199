"""Loading the model and engine for the chat, one reported step at a time."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from qwenchat.engine import Engine, create_engine
from qwenchat.engine.speculate import DraftProposer, cannot_verify, open_draft, speculation_asked
from qwenchat.model import rope
from qwenchat.model.config import parameters_summary
from qwenchat.model.loader import open_model
from qwenchat.model.tokenizer import Tokenizer
from qwenchat.remote import BACKEND, KV_UNAVAILABLE, RemoteServer, RemoteSession
from qwenchat.sampling.params import LiveParams
from qwenchat.session import ChatSession
from qwenchat.tui.options import ChatOptions
from qwenchat.tui.status_layout import Piece, engine_piece, remote_piece

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

    kv_unavailable = ""  # (the KV gauge shows the engine's cache)
    live_sampler = True  # a sampler change reaches the reply under way, at its next token

    @property
    def device_name(self) -> str:
        return getattr(self.engine, "device_name", "CPU")

    def new_session(self, params: LiveParams, system: str | None, thinking: bool,
                    speculate: int) -> ChatSession:
        return ChatSession(self.engine, self.tokenizer, self.eos_ids, params, system=system,
                           thinking=thinking, speculate=speculate, proposer=self.proposer)

    def speculation(self, mode: str, draft: str | None) -> tuple[int, str]:
        return speculation_asked(mode, draft, self.engine)

    def cannot_verify(self) -> str:
        return cannot_verify(self.engine)

    def kv(self) -> tuple[int, int]:
        """The KV cache's position and capacity now."""
        return self.engine.position, self.engine.capacity

    def status_piece(self) -> Piece:
        engine = self.engine
        return engine_piece(engine.name, self.device_name, engine.weight_format,
                            engine.kv_format)

    def rope_note(self) -> str:
        return rope.gauge_note(self.engine.config)

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


@dataclass
class RemoteModel:
    """A model on an OpenAI-compatible server, offering the chat what LoadedModel does; its
    cache, speculation and memory are the server's, so none of them shows here."""

    spec: str  # the model's name on the server
    server: RemoteServer
    served: tuple[str, ...]  # what the server lists (/info)
    directory: Path | None = None  # (the sampler starts from Qwen's presets)
    kv_unavailable = KV_UNAVAILABLE
    live_sampler = False  # a request's values are sent with it

    def new_session(self, params: LiveParams, system: str | None, thinking: bool,
                    speculate: int) -> RemoteSession:
        return RemoteSession(self.server, self.spec, params, system=system, thinking=thinking)

    def speculation(self, mode: str, draft: str | None) -> tuple[int, str]:
        if mode == "off" and draft is None:
            return 0, ""
        return 0, f"{'--draft' if draft else '--speculate'}: a remote server speculates by " \
                  "its own settings; asking without"

    def cannot_verify(self) -> str:
        return "speculation on a remote server is the server's own setting"

    def kv(self) -> tuple[int, int]:
        return 0, 0  # not known: the server does not report its cache

    def status_piece(self) -> Piece:
        return remote_piece(self.server.url, self.spec)

    def rope_note(self) -> str:
        return ""

    def describe(self) -> str:
        return (f"model {self.spec} on the OpenAI-compatible server at {self.server.url} "
                f"(it serves: {', '.join(self.served) or 'none'}); its KV cache, speculation "
                "and memory are the server's: the status bar shows the speed and TTFT seen "
                "here, and sampler changes apply from the next request")

    def close(self) -> None:
        self.server.close()


# A loader runs in a worker thread: `step` says what it starts doing now, `notice` reports
# something the user should still see once the chat is open, `progress` how far the current
# step has got (a download's bytes and files).
ChatModel = LoadedModel | RemoteModel  # what the chat runs on: an engine here, or a server
Loader = Callable[[Report, Report, Report], ChatModel]


def remote_loader(options: ChatOptions) -> Loader:
    def load(step: Report, notice: Report, progress: Report) -> RemoteModel:
        step(f"asking {options.url} for its models")
        server = RemoteServer(options.url or "", options.api_key_env)
        try:  # (a name it does not list may still be an alias it takes: the first turn tells)
            served = tuple(server.models())
        except BaseException:
            server.close()
            raise
        return RemoteModel(options.model, server, served)

    return load


def model_loader(options: ChatOptions) -> Loader:
    if options.backend == BACKEND:
        return remote_loader(options)

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

        engine = create_engine(options.backend, options.roped(model.config), model.checkpoint,
                               options.ctx, notice=engine_message, progress=progress,
                               megakernel_later=True, **options.engine_options())
        proposer = None
        try:
            tokenizer, eos_ids = model.tokenizer, model.eos_ids
            if options.draft and engine.can_speculate:
                step(f"loading the draft model {options.draft}")
                proposer = open_draft(options.draft, model, engine, options, engine_message,
                                      progress)
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
