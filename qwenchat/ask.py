"""`qwenchat ask`: one question, one streamed answer on stdout, pipe-friendly."""

from __future__ import annotations

import codecs
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from qwenchat import remote
from qwenchat.engine import EngineFlags, create_engine
from qwenchat.engine.speculate import check_speculate, start_speculation
from qwenchat.errors import UsageError
from qwenchat.model.loader import open_model
from qwenchat.model.locate import looks_like_path, resolve_model
from qwenchat.model.tokenizer import check_text
from qwenchat.remote import check_remote_flags
from qwenchat.sampling.params import LiveParams, check_value, generation_defaults
from qwenchat.session import ChatSession, Progress, ReplyStats, TextPiece, TurnsDropped


@dataclass
class AskOptions(EngineFlags):
    prompt: str
    model: str
    system: str | None = None
    think: bool = False
    show_thinking: bool = False
    as_json: bool = False
    verbose: bool = False
    overrides: dict[str, Any] = field(default_factory=dict)  # sampling flags the user gave
    speculate: str = "off"
    draft: str | None = None  # a draft model's directory or hub id (speculative decoding)
    url: str | None = None  # --backend openai: the server's address
    api_key_env: str | None = None  # --backend openai: the variable holding its API key


# Byte-order marks honoured on stdin: UTF-8's is dropped, UTF-16's (as Windows tools write)
# switch the decoding. Anything else must be UTF-8.
_BOMS = ((codecs.BOM_UTF8, "utf-8"), (codecs.BOM_UTF16_LE, "utf-16-le"),
         (codecs.BOM_UTF16_BE, "utf-16-be"))


def decode_stdin(data: bytes) -> str:
    """Standard input as text; bytes that are not text are a usage error naming the first."""
    codec = "utf-8"
    for bom, name in _BOMS:
        if data.startswith(bom):
            data, codec = data[len(bom):], name
            break
    try:
        return data.decode(codec)
    except UnicodeDecodeError as exc:
        raise UsageError(
            f"standard input is not {codec.upper()} text (byte 0x{data[exc.start]:02x} at "
            f"offset {exc.start:,}); convert it first, e.g. iconv -f LATIN1 -t UTF-8"
        ) from None


def combine_prompt(argument: str | None, stdin_text: str | None) -> str:
    """stdin first (as context), then the argument; an empty result is a usage error."""
    if argument:
        check_text(argument, "the prompt argument")
    parts = [p for p in ((stdin_text or "").rstrip(), argument or "") if p.strip()]
    if not parts:
        raise UsageError('no prompt: pass it as an argument (qwenchat ask "...") or on stdin')
    return "\n\n".join(parts)


def check_overrides(overrides: dict[str, Any]) -> None:
    """Validate sampling flags before any model is loaded, so mistakes fail fast."""
    for name, value in overrides.items():
        check_value(name, value)


def run_ask(options: AskOptions, out: TextIO = sys.stdout, err: TextIO = sys.stderr) -> int:
    check_overrides(options.overrides)
    check_remote_flags(options.backend, options.url, options.api_key_env)
    if options.backend == remote.BACKEND:
        return _ask_remote(options, out, err)
    options.check_engine_flags()
    check_speculate(options.speculate, options.draft)
    draft = options.draft
    if draft and (looks_like_path(draft) or Path(draft).expanduser().exists()):
        resolve_model(draft, flag="--draft")  # a wrong path fails before the model loads
    say = _stderr_line(err)
    load_started = time.perf_counter()
    # The tokenizer loads on its own thread while the engine compiles and uploads.
    model = open_model(options.model, tokenizer_in_background=True)
    params = generation_defaults(model.directory, options.think).with_updates(**options.overrides)
    # A seeded answer is the same cold or warm: it waits for the megakernel's compile.
    later = "seed" not in options.overrides
    engine = create_engine(options.backend, options.roped(model.config), model.checkpoint,
                           options.ctx, notice=say, megakernel_later=later,
                           **options.engine_options())
    tokenizer = model.tokenizer
    load_s = time.perf_counter() - load_started
    speculate, proposer = start_speculation(options.speculate, options.draft, model, engine,
                                            options, say, megakernel_later=later)
    session = ChatSession(engine, tokenizer, model.eos_ids, LiveParams(params),
                          system=options.system, thinking=options.think, speculate=speculate,
                          proposer=proposer)
    described = {"model": model.spec, "backend": engine.name, "weights": engine.weight_format,
                 "kv_cache": engine.kv_format,
                 "speculate": ("draft" if proposer else options.speculate) if speculate
                 else "off", "draft": options.draft if proposer else None,
                 "load_s": round(load_s, 4)}
    return _answer(session, options, described, params.as_dict(), out, say)


def _ask_remote(options: AskOptions, out: TextIO, err: TextIO) -> int:
    """The same answer from a model on an OpenAI-compatible server: only the sampling flags
    given are sent, so the server's defaults (the model's own) apply to the rest."""
    server = remote.RemoteServer(options.url or "", options.api_key_env)
    try:
        params = generation_defaults(None, options.think).with_updates(**options.overrides)
        session = remote.RemoteSession(server, options.model, LiveParams(params),
                                       system=options.system, thinking=options.think,
                                       send_fields=set(options.overrides))
        described = {"model": options.model, "backend": remote.BACKEND, "url": server.url}
        return _answer(session, options, described, dict(options.overrides), out,
                       _stderr_line(err))
    finally:
        server.close()


def _answer(session: ChatSession | remote.RemoteSession, options: AskOptions,
            described: dict[str, Any], params: dict[str, Any], out: TextIO,
            say: Callable[[str], None]) -> int:
    """Stream the answer (or collect it for --json), then the summary if asked."""
    writer = _JsonCollector() if options.as_json else _StreamWriter(out, options.show_thinking)
    stats = ReplyStats()
    for event in session.send(options.prompt):
        if isinstance(event, TextPiece):
            writer.piece(event)
        elif isinstance(event, TurnsDropped):
            say(event.message)
        elif isinstance(event, Progress) and event.final:
            stats = event.stats
    if options.as_json:
        record = {**described, **writer.result(), **stats.as_dict(), "params": params}
        out.write(json.dumps(record, ensure_ascii=False) + "\n")
    else:
        writer.close()
    out.flush()
    if options.verbose:
        say(summary_line(stats))
    return 0


def summary_line(stats: ReplyStats) -> str:
    rate = f"{stats.decode_tok_s:.1f} tok/s" if stats.decode_tok_s else "– tok/s"
    ttft = f"{stats.ttft_s * 1000:.0f} ms" if stats.ttft_s is not None else "–"
    line = (f"{stats.generated_tokens} tokens · {rate} · TTFT {ttft} · prompt "
            f"{stats.prompt_tokens} tokens ({stats.reused_tokens} reused) · "
            f"{kv_text(stats)} · stop: {stats.stop_reason} · "
            f"seed {stats.seed}")
    if stats.spec_proposed:
        line += (f" · speculation: {stats.spec_accepted}/{stats.spec_proposed} proposed "
                 f"tokens kept over {stats.spec_passes} passes")
    return line


def kv_text(stats: ReplyStats) -> str:
    """"KV 743/4096", or that a remote server does not say."""
    return f"KV {stats.position}/{stats.capacity}" if stats.capacity else remote.KV_UNAVAILABLE


def _stderr_line(err: TextIO) -> Callable[[str], None]:
    def say(message: str) -> None:
        err.write(f"qwenchat: {message}\n")
        err.flush()

    return say


class _StreamWriter:
    """Writes the answer as it arrives; thinking, when shown, goes first inside <think> tags."""

    def __init__(self, out: TextIO, show_thinking: bool):
        self._out = out
        self._show_thinking = show_thinking
        self._in_thinking = False
        self._last = ""

    def piece(self, piece: TextPiece) -> None:
        if piece.kind == "thinking":
            if not self._show_thinking:
                return
            if not self._in_thinking:
                self._write("<think>\n")
                self._in_thinking = True
        elif self._in_thinking:
            self._end_thinking()
        self._write(piece.text)

    def close(self) -> None:
        if self._in_thinking:
            self._end_thinking()
        self._out.write("\n")

    def _end_thinking(self) -> None:
        self._write("\n</think>\n\n" if not self._last.endswith("\n") else "</think>\n\n")
        self._in_thinking = False

    def _write(self, text: str) -> None:
        self._out.write(text)
        self._out.flush()
        if text:
            self._last = text


class _JsonCollector:
    def __init__(self) -> None:
        self.answer: list[str] = []
        self.thinking: list[str] = []

    def piece(self, piece: TextPiece) -> None:
        (self.thinking if piece.kind == "thinking" else self.answer).append(piece.text)

    def result(self) -> dict[str, str]:
        return {"text": "".join(self.answer), "thinking": "".join(self.thinking).rstrip("\n")}
