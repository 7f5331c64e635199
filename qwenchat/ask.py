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

from qwenchat.engine import check_engine_flags, create_engine
from qwenchat.engine.speculate import check_speculate, open_draft, speculation_asked
from qwenchat.errors import UsageError
from qwenchat.model import rope
from qwenchat.model.loader import open_model
from qwenchat.model.locate import looks_like_path, resolve_model
from qwenchat.model.tokenizer import check_text
from qwenchat.sampling.params import LiveParams, check_value, generation_defaults
from qwenchat.session import ChatSession, Progress, ReplyStats, TextPiece, TurnsDropped


@dataclass
class AskOptions:
    prompt: str
    model: str
    backend: str = "auto"
    system: str | None = None
    think: bool = False
    show_thinking: bool = False
    as_json: bool = False
    verbose: bool = False
    ctx: int | None = None
    overrides: dict[str, Any] = field(default_factory=dict)  # sampling flags the user gave
    device: int = 0
    decode: str = "auto"
    quantize: str = "none"
    speculate: str = "off"
    draft: str | None = None  # a draft model's directory or hub id (speculative decoding)
    kv_cache: str = "bf16"  # the KV cache's format (qwenchat/model/kv_cache.py)
    rope_scaling: str | None = None  # --rope-scaling (qwenchat/model/rope.py)


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
    check_engine_flags(options.backend, options.ctx, options.device, options.decode,
                       options.quantize, options.kv_cache, options.rope_scaling)
    check_speculate(options.speculate, options.draft)
    draft = options.draft
    if draft and (looks_like_path(draft) or Path(draft).expanduser().exists()):
        resolve_model(draft, flag="--draft")  # a wrong path fails before the model loads
    say = _stderr_line(err)
    load_started = time.perf_counter()
    # The tokenizer loads on its own thread while the engine compiles and uploads.
    model = open_model(options.model, tokenizer_in_background=True)
    params = generation_defaults(model.directory, options.think).with_updates(**options.overrides)
    config = rope.with_flag(model.config, options.rope_scaling)
    # A seeded answer is the same cold or warm: it waits for the megakernel's compile.
    later = "seed" not in options.overrides
    engine = create_engine(options.backend, config, model.checkpoint, options.ctx,
                           device=options.device, notice=say, decode=options.decode,
                           quantize=options.quantize, kv_cache=options.kv_cache,
                           megakernel_later=later)
    tokenizer = model.tokenizer
    load_s = time.perf_counter() - load_started
    speculate, notice = speculation_asked(options.speculate, options.draft, engine)
    if notice:
        say(notice)
    proposer = None
    if speculate and options.draft:
        proposer = open_draft(options.draft, model, engine, options.backend, options.device,
                              options.decode, options.quantize, say, megakernel_later=later)
    session = ChatSession(engine, tokenizer, model.eos_ids, LiveParams(params),
                          system=options.system, thinking=options.think, speculate=speculate,
                          proposer=proposer)
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
        record = {"model": model.spec, "backend": engine.name, "weights": engine.weight_format,
                  "kv_cache": engine.kv_format,
                  "speculate": ("draft" if proposer else options.speculate) if speculate
                  else "off", "draft": options.draft if proposer else None,
                  "load_s": round(load_s, 4),
                  **writer.result(), **stats.as_dict(), "params": params.as_dict()}
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
            f"KV {stats.position}/{stats.capacity} · stop: {stats.stop_reason} · "
            f"seed {stats.seed}")
    if stats.spec_proposed:
        line += (f" · speculation: {stats.spec_accepted}/{stats.spec_proposed} proposed "
                 f"tokens kept over {stats.spec_passes} passes")
    return line


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
