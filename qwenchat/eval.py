"""`qwenchat eval`: how well the model predicts a text, and how far a lossy choice moves it.

Perplexity over a file in windows of `--window` tokens (a stride apart, each token scored once,
with at least `window - stride` tokens of context after the first window), and against a base
(the same model unquantized, the reference engine, or logits saved by an earlier run) the
KL divergence of the base's next-token distribution to ours, top-1 agreement and the change in
perplexity, as `llama-perplexity --kl-divergence` reports them.

Saved logits keep, per scored token, the base's `top_k` likeliest ids with their log
probabilities and the target's log probability (an .npz), so that a file stays small. KL
against them treats the tokens outside those k as one outcome: a lower bound of the full KL
(merging outcomes never increases it), exact when k covers the vocabulary.
"""

from __future__ import annotations

import hashlib
import json
import math
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from qwenchat.engine import FP8_ACTIVATIONS, EngineFlags, create_engine
from qwenchat.errors import UsageError
from qwenchat.model.loader import open_model
from qwenchat.model.tokenizer import Message, Tokenizer
from qwenchat.progress import progress_bar

PATHS = ("prefill", "decode")
ENGINE_BASES = ("bf16", "cpu")  # --base: the same model unquantized here, or on the CPU
SAVED_FORMAT = 1


@dataclass
class EvalOptions(EngineFlags):  # (ctx, the engine's cache: the window by default)
    file: Path
    model: str
    fp8_activations: str = "auto"
    window: int = 512
    stride: int | None = None  # default: half the window
    path: str = "prefill"
    base: str | None = None  # "bf16", "cpu" or a file of saved logits
    save_logits: Path | None = None
    top_k: int = 32  # ids a saved position keeps
    limit: int | None = None  # score at most this many tokens
    as_json: bool = False

    @property
    def stride_tokens(self) -> int:
        return self.stride if self.stride is not None else max(1, self.window // 2)


def check_options(options: EvalOptions) -> None:
    """Every flag checked before anything loads: one line each."""
    options.check_engine_flags()
    if options.window < 2:
        raise UsageError(f"--window must be at least 2 tokens; got {options.window}")
    if not 1 <= options.stride_tokens < options.window:
        # (windows must overlap: a window's first token is predicted from the one before it)
        raise UsageError(f"--stride must be 1 to the window less one ({options.window - 1}); "
                         f"got {options.stride_tokens}")
    if options.ctx is not None and options.window > options.ctx:
        raise UsageError(f"--window {options.window:,} is longer than --ctx {options.ctx:,}: "
                         "a window must fit the KV cache; lower --window or raise --ctx")
    if options.path not in PATHS:
        raise UsageError(f"--path must be one of {', '.join(PATHS)}; got {options.path!r}")
    if options.fp8_activations not in FP8_ACTIVATIONS:
        raise UsageError(f"--fp8-activations must be one of {', '.join(FP8_ACTIVATIONS)}; "
                         f"got {options.fp8_activations!r}")
    if options.top_k < 1:
        raise UsageError(f"--top-k must be at least 1; got {options.top_k}")
    if options.limit is not None and options.limit < 1:
        raise UsageError(f"--limit must be at least 1 token; got {options.limit}")
    if not options.file.is_file():
        raise UsageError(f"{options.file}: no such file; give a text file or a .jsonl of chats")
    base = options.base
    if base is not None and base not in ENGINE_BASES and not Path(base).is_file():
        raise UsageError(f"--base {base}: neither {' nor '.join(ENGINE_BASES)} nor a file of "
                         "logits saved by eval --save-logits")


# ----------------------------------------------------------------------------- the text
def read_documents(path: Path, tokenizer: Tokenizer) -> list[list[int]]:
    """The file's token ids: plain text is one document; a .jsonl holds one chat a line
    ({"messages": [{"role": ..., "content": ...}, ...]}), each rendered with the model's chat
    template as the conversation it records (no generation prompt)."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise UsageError(f"{path}: not UTF-8 text (byte 0x{exc.object[exc.start]:02x} at offset "
                         f"{exc.start:,}); convert it first, e.g. iconv -t UTF-8") from None
    if path.suffix == ".jsonl":
        documents = [tokenizer.encode(tokenizer.render(messages, enable_thinking=False,
                                                       add_generation_prompt=False))
                     for messages in _chats(path, text)]
    else:
        documents = [tokenizer.encode(text)]
    documents = [ids for ids in documents if len(ids) >= 2]
    if not documents:
        raise UsageError(f"{path}: no text to score (at least two tokens are needed)")
    return documents


def _chats(path: Path, text: str) -> Iterator[list[Message]]:
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}, line {number}"
        try:
            chat = json.loads(line)
        except json.JSONDecodeError as exc:
            raise UsageError(f"{where}: not JSON ({exc.msg}); each line must be "
                             '{"messages": [{"role": ..., "content": ...}, ...]}') from None
        messages = chat.get("messages") if isinstance(chat, dict) else None
        if not isinstance(messages, list) or not messages:
            raise UsageError(f'{where}: no "messages" list')
        for message in messages:
            if (not isinstance(message, dict) or message.get("role") not in
                    ("system", "user", "assistant") or not isinstance(message.get("content"),
                                                                      str)):
                raise UsageError(f'{where}: each message needs a "role" (system, user or '
                                 'assistant) and a "content" string')
        yield [Message(m["role"], m["content"]) for m in messages]


@dataclass(frozen=True)
class Window:
    begin: int  # the window is tokens [begin, end) of its document
    end: int
    first: int  # the first target it scores: targets [first, end), each predicted at j - 1


def windows(length: int, size: int, stride: int) -> list[Window]:
    """Windows of `size` tokens `stride` (< size) apart over a document of `length` tokens,
    each scoring the targets the windows before did not: every token after the first once."""
    out, scored = [], 1
    for begin in range(0, length, stride):
        end = min(begin + size, length)
        if end > scored:
            out.append(Window(begin, end, max(scored, begin + 1)))
            scored = end
        if end == length:
            break
    return out


# ----------------------------------------------------------------------------- the figures
@dataclass
class Rows:
    """A window's rows of logits as the engine gave them (float32) and each row's log-sum-exp
    in float64: log p = logits - lse, taken where needed and never for the whole vocabulary
    in float64 (which took ~4x the time of everything else scoring on a GPU's logits)."""

    logits: np.ndarray  # (n, vocab) float32
    lse: np.ndarray  # (n,) float64

    @classmethod
    def of(cls, logits: np.ndarray) -> Rows:
        x = np.asarray(logits, np.float32)
        most = x.max(axis=-1)
        sums = np.exp(x - most[:, None]).sum(axis=-1, dtype=np.float64)
        return cls(x, most.astype(np.float64) + np.log(sums))

    def logp_at(self, ids: np.ndarray) -> np.ndarray:
        """log p of each row's `ids` (n x k), in float64."""
        return (np.take_along_axis(self.logits, ids, axis=-1).astype(np.float64)
                - self.lse[:, None])

    def target_logp(self, targets: np.ndarray) -> np.ndarray:
        """log p of each row's target token, in float64."""
        return self.logp_at(np.asarray(targets)[:, None])[:, 0]

    def argmax(self) -> np.ndarray:
        return self.logits.argmax(axis=-1)


@dataclass
class Scores:
    """What the scored tokens gave so far."""

    nll: list[float] = field(default_factory=list)  # -log p(target), ours
    base_nll: list[float] = field(default_factory=list)
    kl: list[float] = field(default_factory=list)
    same_top1: list[bool] = field(default_factory=list)

    def figures(self) -> dict[str, Any]:
        n = len(self.nll)
        out: dict[str, Any] = {"tokens_scored": n,
                               "perplexity": math.exp(float(np.mean(self.nll))) if n else None,
                               "nll_mean": float(np.mean(self.nll)) if n else None}
        if self.base_nll:
            base = math.exp(float(np.mean(self.base_nll)))
            kl = np.asarray(self.kl)
            out["base_perplexity"] = base
            out["delta_perplexity"] = out["perplexity"] - base
            out["kl"] = {"mean": float(kl.mean()), "median": float(np.median(kl)),
                         "p99": float(np.percentile(kl, 99)), "max": float(kl.max())}
            out["top1_agreement"] = float(np.mean(self.same_top1))
        return out


def kl_full(base: Rows, ours: Rows) -> np.ndarray:
    """KL(base || ours) a row, over the whole vocabulary: sum p (log p - log q), with log p -
    log q = (x - y) - (lse_p - lse_q); the products in float32, their sums in float64. Within
    ~5e-8 (absolute, a row) of a float64 computation on the same logits, at a fifth to a tenth
    of its time (docs/perf.md)."""
    p = np.exp(base.logits - base.lse[:, None].astype(np.float32))
    spread = np.sum(p * (base.logits - ours.logits), axis=-1, dtype=np.float64)
    mass = p.sum(axis=-1, dtype=np.float64)
    return (spread - (base.lse - ours.lse) * mass).clip(min=0.0)


def kl_top(base_ids: np.ndarray, base_logp: np.ndarray, ours: Rows) -> np.ndarray:
    """KL(base || ours) a row over the base's saved top-k ids and the rest as one outcome."""
    return kl_top_logp(base_logp, ours.logp_at(base_ids))


def kl_top_logp(base_logp: np.ndarray, ours_top: np.ndarray) -> np.ndarray:
    """kl_top from our log probabilities at the base's top-k ids (float64, n x k)."""
    p_base = np.exp(base_logp.astype(np.float64))
    terms = np.sum(p_base * (base_logp - ours_top), axis=-1)
    base_rest = np.clip(1.0 - p_base.sum(axis=-1), 0.0, 1.0)
    ours_rest = np.clip(1.0 - np.exp(ours_top).sum(axis=-1), 1e-300, 1.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        rest = np.where(base_rest > 0, base_rest * (np.log(np.maximum(base_rest, 1e-300))
                                                   - np.log(ours_rest)), 0.0)
    return (terms + rest).clip(min=0.0)


# ----------------------------------------------------------------------------- saved logits
def text_key(documents: Sequence[Sequence[int]], window: int, stride: int) -> str:
    """What saved logits must match: the token ids and how they were windowed."""
    digest = hashlib.sha256(json.dumps([window, stride]).encode())
    for ids in documents:
        digest.update(np.asarray(ids, np.int32).tobytes() + b"|")
    return digest.hexdigest()


class SavedBase:
    """Logits saved by `eval --save-logits`, read back in scoring order."""

    def __init__(self, path: Path, key: str):
        try:
            with np.load(path, allow_pickle=False) as data:
                meta = json.loads(str(data["meta"]))
                self.ids, self.logp = data["top_ids"], data["top_logp"]
                self.target = data["target_logp"]
        except (OSError, ValueError, KeyError) as exc:
            raise UsageError(f"--base {path}: not logits saved by eval --save-logits "
                             f"({exc})") from None
        if meta.get("format") != SAVED_FORMAT:
            raise UsageError(f"--base {path}: saved in format {meta.get('format')}, this "
                             f"qwenchat reads {SAVED_FORMAT}; save them again")
        if meta.get("key") != key:
            raise UsageError(f"--base {path}: saved for other text or windows (window "
                             f"{meta.get('window')}, stride {meta.get('stride')}); use the "
                             "same file, --window and --stride")
        self.at = 0
        self.model = meta.get("model", "?")

    def take(self, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        part = slice(self.at, self.at + n)
        self.at += n
        if self.at > len(self.target):
            raise UsageError("--base: the saved logits end before the text does")
        return self.ids[part], self.logp[part], self.target[part]


class LogitsWriter:
    """The run's own top-k and target log probabilities, for a later --base."""

    def __init__(self, top_k: int):
        self.top_k = top_k
        self.ids: list[np.ndarray] = []
        self.logp: list[np.ndarray] = []
        self.target: list[np.ndarray] = []

    def add(self, rows: Rows, targets: np.ndarray) -> None:
        k = min(self.top_k, rows.logits.shape[-1])
        top = np.argpartition(-rows.logits, k - 1, axis=-1)[:, :k]
        order = np.argsort(-np.take_along_axis(rows.logits, top, axis=-1), axis=-1,
                           kind="stable")
        top = np.take_along_axis(top, order, axis=-1)
        self.ids.append(top.astype(np.int32))
        self.logp.append(rows.logp_at(top).astype(np.float32))
        self.target.append(rows.target_logp(targets).astype(np.float32))

    def save(self, path: Path, meta: dict[str, Any]) -> None:
        empty = np.zeros((0, self.top_k))
        np.savez_compressed(
            path, meta=np.asarray(json.dumps({"format": SAVED_FORMAT, **meta})),
            top_ids=np.concatenate(self.ids) if self.ids else empty.astype(np.int32),
            top_logp=np.concatenate(self.logp) if self.logp else empty.astype(np.float32),
            target_logp=np.concatenate(self.target) if self.target else np.zeros(0, np.float32))


# ----------------------------------------------------------------------------- the run
def window_logits(engine, ids: Sequence[int], path: str) -> np.ndarray:
    """Logits at every position of a window, from an empty cache: in one prefill, or token by
    token through the engine's decode step (`path` "decode")."""
    engine.truncate(0)
    if path == "prefill":
        return engine.prefill_logits(list(ids))
    if hasattr(engine, "decode_rows"):  # the GPU's decode kernels, teacher-forced
        return engine.decode_rows(list(ids))
    rows = []
    for token in ids:
        engine.prefill([token])
        rows.append(engine.last_logits())
    return np.stack(rows)


def run_eval(options: EvalOptions, out: TextIO = sys.stdout, err: TextIO = sys.stderr) -> int:
    check_options(options)
    say = lambda line: print(f"qwenchat: {line}", file=err, flush=True)  # noqa: E731
    model = open_model(options.model)
    config = options.roped(model.config)
    documents = read_documents(options.file, model.tokenizer)
    stride = options.stride_tokens
    key = text_key(documents, options.window, stride)
    ctx = options.ctx or options.window
    engine = create_engine(options.backend, config, model.checkpoint, ctx, notice=say,
                           fp8_activations=options.fp8_activations, **options.engine_options())
    base_engine, saved = None, None
    if options.base in ENGINE_BASES:
        base_engine = create_engine("cpu" if options.base == "cpu" else options.backend, config,
                                    model.checkpoint, ctx, options.device, notice=say,
                                    fp8_activations="bf16")
    elif options.base is not None:
        saved = SavedBase(Path(options.base), key)
    writer = LogitsWriter(options.top_k) if options.save_logits else None
    plan = [(d, w) for d, ids in enumerate(documents)
            for w in windows(len(ids), options.window, stride)]
    total = sum(w.end - w.first for _, w in plan)
    if options.limit is not None:
        total = min(total, options.limit)
    scores = Scores()
    # The GPU engine's prefill windows are scored where their logits are (scoring.py)
    on_device = options.path == "prefill" and hasattr(engine, "window_rows")
    if on_device:  # (their first compile before the clock and the ETA start)
        for scorer in (engine, base_engine):
            if hasattr(scorer, "prepare_scoring"):
                scorer.prepare_scoring()
    else:
        try:
            check_host_memory(options.window, config.vocab_size, base_engine is not None,
                              host_memory_available())
        except UsageError:
            for opened in (engine, base_engine):
                if opened is not None:
                    opened.close()
            raise
    started = time.perf_counter()
    stopped = False
    try:
        with progress_bar(err, "scoring", total) as advance:
            for d, w in plan:
                left = total - len(scores.nll)
                if left <= 0:
                    break
                ids = documents[d][w.begin:w.end]
                rows = slice(w.first - 1 - w.begin, w.end - 1 - w.begin)
                targets = np.asarray(documents[d][w.first:w.end])[:left]
                if on_device:
                    _score_on_device(scores, engine, base_engine, saved, writer, ids,
                                     rows.start, targets)
                else:
                    ours = Rows.of(window_logits(engine, ids, options.path)[rows][:left])
                    _score(scores, ours, targets, base_engine, saved, ids, rows, options.path)
                    if writer is not None:
                        writer.add(ours, targets)
                advance(len(targets))
    except KeyboardInterrupt:
        stopped = True
    finally:
        engine.close()
        if base_engine is not None:
            base_engine.close()
    seconds = time.perf_counter() - started
    if writer is not None and not stopped:
        writer.save(options.save_logits, {"key": key, "window": options.window,
                                          "stride": stride, "model": options.model,
                                          "top_k": options.top_k})
    result = {"model": options.model, "file": str(options.file), "engine": engine.name,
              "weight_format": engine.weight_format, "kv_cache": options.kv_cache,
              "path": options.path, "window": options.window, "stride": stride,
              "tokens_total": total, **scores.figures(), "seconds": seconds,
              "tok_s": len(scores.nll) / seconds if seconds > 0 else None,
              "base": options.base, "stopped": stopped}
    if options.as_json:
        out.write(json.dumps(result) + "\n")
    else:
        _print_table(result, out)
    if stopped:
        say(f"stopped after {len(scores.nll):,} of {total:,} tokens: the figures above are "
            "for those")
        return 130
    return 0


def host_memory_available() -> int | None:
    """The memory the system says new allocations can take (Linux's MemAvailable), or None
    where it does not say."""
    try:
        with open("/proc/meminfo", encoding="ascii") as info:
            for line in info:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def check_host_memory(window: int, vocab: int, with_base: bool, available: int | None) -> None:
    """One line where a window's logits scored on the host (float32 rows and their
    exponentials, a base's too) would not fit the memory available."""
    need = window * vocab * 4 * 2 * (2 if with_base else 1)
    if available is not None and need > available:
        raise UsageError(f"a window of {window:,} tokens needs {need / 2**30:.1f} GiB of memory "
                         f"for its logits and {available / 2**30:.1f} GiB are available; use a "
                         "smaller --window")


def _score_on_device(scores: Scores, engine, base_engine, saved: SavedBase | None,
                     writer: LogitsWriter | None, ids: Sequence[int], first: int,
                     targets: np.ndarray) -> None:
    """A window on the GPU engine: its rows reduced on the device (score.cu), against a base
    engine on the same GPU there too; a base on the CPU, or a top-k to save, takes our rows to
    the host (once)."""
    n = len(targets)
    engine.truncate(0)
    mine = engine.window_rows(ids)
    live = (base_engine is not None and hasattr(base_engine, "window_rows")
            and base_engine.device.index == engine.device.index)
    theirs = None
    if live:
        base_engine.truncate(0)
        theirs = base_engine.window_rows(ids)
    got = engine.score_rows(mine, first, targets, theirs)
    lse = got[:, 0]
    scores.nll.extend((lse - got[:, 1]).tolist())
    host: list[Rows] = []

    def ours_on_host() -> Rows:
        if not host:
            host.append(Rows(engine.download_rows(mine, first, n), lse))
        return host[0]

    if live:
        scores.base_nll.extend((got[:, 4] - got[:, 5]).tolist())
        scores.kl.extend(got[:, 3].tolist())
        scores.same_top1.extend((got[:, 2] == got[:, 6]).tolist())
    elif saved is not None:
        _against_saved(scores, saved, lambda top: engine.gather_rows(mine, first, top)
                       .astype(np.float64) - lse[:, None], got[:, 2])
    elif base_engine is not None:
        base = Rows.of(window_logits(base_engine, ids, "prefill")[first:first + n])
        _against_rows(scores, base, ours_on_host(), targets)
    if writer is not None:
        writer.add(ours_on_host(), targets)


def _score(scores: Scores, ours: Rows, targets: np.ndarray, base_engine,
           saved: SavedBase | None, ids: Sequence[int], rows: slice, path: str) -> None:
    n = len(targets)
    scores.nll.extend((-ours.target_logp(targets)).tolist())
    if base_engine is not None:
        _against_rows(scores, Rows.of(window_logits(base_engine, ids, path)[rows][:n]), ours,
                      targets)
    elif saved is not None:
        _against_saved(scores, saved, ours.logp_at, ours.argmax())


def _against_rows(scores: Scores, base: Rows, ours: Rows, targets: np.ndarray) -> None:
    """The base's figures from its rows on the host."""
    scores.base_nll.extend((-base.target_logp(targets)).tolist())
    scores.kl.extend(kl_full(base, ours).tolist())
    scores.same_top1.extend((base.argmax() == ours.argmax()).tolist())


def _against_saved(scores: Scores, saved: SavedBase,
                   ours_logp_at: Callable[[np.ndarray], np.ndarray], ours_top1: np.ndarray
                   ) -> None:
    """The base's figures from its saved top-k: `ours_logp_at(ids)` gives our log
    probabilities at them (n x k), `ours_top1` our likeliest tokens."""
    top_ids, top_logp, target = saved.take(len(ours_top1))
    scores.base_nll.extend((-target.astype(np.float64)).tolist())
    scores.kl.extend(kl_top_logp(top_logp, ours_logp_at(top_ids)).tolist())
    scores.same_top1.extend((top_ids[:, 0] == ours_top1).tolist())


def _print_table(result: dict[str, Any], out: TextIO) -> None:
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    table = Table(show_header=False, box=None)
    table.add_column(style="bold")
    table.add_column()

    def row(name: str, value: str) -> None:
        table.add_row(Text(name), Text(value))  # (file names and models verbatim)

    row("model", f"{result['model']} ({result['weight_format']} weights, "
                 f"{result['kv_cache']} KV cache, {result['engine']})")
    row("text", f"{result['file']}: {result['tokens_scored']:,} tokens scored "
                f"(window {result['window']:,}, stride {result['stride']:,}, "
                f"{result['path']} path)")
    if result["perplexity"] is not None:
        row("perplexity", f"{result['perplexity']:.4f}")
    if "kl" in result:
        kl = result["kl"]
        row("base perplexity", f"{result['base_perplexity']:.4f} ({result['base']}); "
                               f"Δ {result['delta_perplexity']:+.4f}")
        row("KL divergence", f"mean {kl['mean']:.6f}, median {kl['median']:.6f}, "
                             f"99% {kl['p99']:.6f}, max {kl['max']:.6f}")
        row("top-1 agreement", f"{100 * result['top1_agreement']:.2f}%")
    if result["tok_s"]:
        row("speed", f"{result['tok_s']:,.0f} tokens/s ({result['seconds']:.1f} s)")
    Console(file=out, highlight=False, width=100).print(table)
