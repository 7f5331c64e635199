"""What the status bar shows at a given width: its pieces, each in forms from the widest to
the narrowest, shortened one step at a time in one stated order (DEGRADE) until the line fits.

Live tok/s (now and on average) and the KV position/capacity are the figures the chat exists
to show: they come through down to 60 columns, whatever else has to go.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from rich.cells import cell_len
from rich.text import Text

from qwenchat.session import ReplyStats
from qwenchat.tui.stats import rate_text, speculation_text, ttft_text

SEPARATOR = " · "  # between the pieces that share a widget
PADDING = 2  # each of the bar's widgets has one cell of padding either side
GAUGE_CELLS = 10

# The KV gauge's forms, widest first: (bar cells, with the RoPE scaling note).
GAUGE_FORMS = ((GAUGE_CELLS, True), (GAUGE_CELLS, False), (GAUGE_CELLS // 2, False), (0, False))

# The order in which the bar gives up room: each entry takes that piece one form narrower.
# The engine label shortens first (to "CPU · bf16"), then the prompt counts, the gauge's
# RoPE note, TTFT and the speculation figures go; the gauge halves, the short engine label
# goes, the gauge keeps only position/capacity, and the activity shortens to its sign.
# Only below 60 columns does the average speed go too.
DEGRADE = ("engine", "prompt", "kv", "ttft", "speculation", "kv", "engine", "kv",
           "activity", "activity", "rate")


@dataclass(frozen=True)
class Piece:
    name: str
    widget: str  # the bar's widget that shows it; pieces of one widget are joined by " · "
    forms: tuple[str, ...]  # widest first; "" leaves the piece out


def fit(pieces: Sequence[Piece], width: int, order: Sequence[str] = DEGRADE) -> dict[str, int]:
    """The form each piece is shown in (an index into its `forms`): the widest ones, shortened
    in `order`, step by step, until the line fits `width` or nothing more can give way. The
    room the last step freed beyond what was needed then goes back to the pieces still shown,
    the latest to give way (the most important) first, where it is enough for a wider form; a
    piece left out stays out, so figures never trade places as their digits change."""
    chosen = {piece.name: 0 for piece in pieces}
    last = {piece.name: len(piece.forms) - 1 for piece in pieces}
    taken: list[str] = []
    for name in order:
        if line_width(pieces, chosen) <= width:
            break
        if name in chosen and chosen[name] < last[name]:
            chosen[name] += 1
            taken.append(name)
    forms = {piece.name: piece.forms for piece in pieces}
    for name in reversed(taken):  # (the form a piece gave up last comes back first)
        wider = {**chosen, name: chosen[name] - 1}
        if forms[name][chosen[name]] and line_width(pieces, wider) <= width:
            chosen = wider
    return chosen


def line_width(pieces: Sequence[Piece], chosen: dict[str, int]) -> int:
    """Cells the bar takes with the pieces in the chosen forms (an empty widget is hidden)."""
    widgets: dict[str, list[str]] = {}
    for piece in pieces:
        text = piece.forms[chosen[piece.name]]
        widgets.setdefault(piece.widget, [])
        if text:
            widgets[piece.widget].append(text)
    return sum(PADDING + cell_len(SEPARATOR.join(texts)) for texts in widgets.values() if texts)


def joined(pieces: Sequence[Piece], chosen: dict[str, int], widget: str) -> str:
    """What one widget shows: its pieces in their chosen forms."""
    texts = (p.forms[chosen[p.name]] for p in pieces if p.widget == widget)
    return SEPARATOR.join(text for text in texts if text)


# ------------------------------------------------------------------------------- the pieces
def engine_piece(engine: str, device: str, weights: str, kv: str) -> Piece:
    """"reference (NumPy, CPU) · bf16 weights", then "CPU · bf16" ("H100 · fp8 · int8 KV")."""
    label = f"{engine} · {device}" if device not in engine else engine
    label += f" · {weights} weights"
    short = f"{short_device(device)} · {weights}"
    if kv != "bf16":  # (the usual cache goes unsaid)
        label += f" · {kv} KV cache"
        short += f" · {kv} KV"
    return Piece("engine", "engine", (label, short, ""))


def remote_piece(url: str, model: str) -> Piece:
    """"Qwen3-0.6B on http://gpu-box:8000 (remote)", then "remote · Qwen3-0.6B"."""
    host = re.sub(r"^https?://", "", url)
    return Piece("engine", "engine", (f"{model} on {host} (remote)", f"remote · {model}", ""))


def short_device(device: str) -> str:
    """The GPU's model without vendor, memory size and form factor: "NVIDIA H100 80GB HBM3",
    "NVIDIA A100-SXM4-80GB" -> "H100", "A100"; "NVIDIA GeForce RTX 4090" -> "RTX 4090"."""
    words = [word for word in re.split(r"[\s-]+", device)
             if word not in ("NVIDIA", "GeForce")
             and not re.fullmatch(r"\d+GB|HBM\w*|PCIe|SXM\d*|NVL", word, re.IGNORECASE)]
    return " ".join(words) or device


def activity_piece(stats: ReplyStats | None, stopping: bool = False) -> Piece:
    """What the reply is doing: reading the prompt (how far), generating, stopping; nothing
    between replies (None)."""
    if stats is None:
        return Piece("activity", "activity", ("",))
    if stopping:
        return Piece("activity", "activity", ("■ stopping", "■"))
    if stats.generated_tokens:
        return Piece("activity", "activity", ("● generating", "●"))
    if 0 < stats.prefill_done < stats.prefill_tokens:  # a long prompt, part way
        # (the footer already says Esc stops it: the bar keeps its room for the numbers)
        done = f"{stats.prefill_done:,}/{stats.prefill_tokens:,}"
        return Piece("activity", "activity",
                     (f"● reading the prompt {done}", f"● prompt {done}", f"● {done}"))
    return Piece("activity", "activity", ("● reading the prompt", "● prompt", "●"))


def live_numbers(stats: ReplyStats, rate_now: float | None) -> list[Piece]:
    """While a reply streams: speed now and on average (the prompt's, while it is read),
    TTFT, speculation, prompt reuse."""
    if not stats.generated_tokens and 0 < stats.prefill_done < stats.prefill_tokens:
        prefill_rate = stats.prefill_done / stats.prefill_s if stats.prefill_s > 0 else None
        rate = (f"prefill {rate_text(prefill_rate)} tok/s",)
    else:
        now = f"{rate_text(rate_now)} tok/s"
        rate = (f"{now} (avg {rate_text(stats.decode_tok_s)})", now)
    return [Piece("rate", "numbers", rate), *_reply_numbers(stats)]


def idle_numbers(stats: ReplyStats | None) -> list[Piece]:
    """Between replies: the last reply's speed, TTFT, speculation and prompt reuse."""
    if stats is None:
        return []
    return [Piece("rate", "numbers", (f"{rate_text(stats.decode_tok_s)} tok/s",)),
            *_reply_numbers(stats)]


def _reply_numbers(stats: ReplyStats) -> list[Piece]:
    speculation = speculation_text(stats)
    return [
        Piece("ttft", "numbers", (f"TTFT {ttft_text(stats)}", "")),
        Piece("speculation", "numbers", (speculation, "") if speculation else ("",)),
        Piece("prompt", "numbers", (f"prompt {stats.prefill_tokens:,} new + "
                                    f"{stats.reused_tokens:,} cached", "")),
    ]


def gauge_piece(position: int, capacity: int, note: str, unavailable: str = "") -> Piece:
    """The KV gauge's forms; `unavailable`: what it says where the cache is not known."""
    if unavailable:
        return Piece("kv", "kv", (unavailable,) * len(GAUGE_FORMS))
    return Piece("kv", "kv", tuple(gauge_text(position, capacity, cells, note if with_note else "")
                                   .plain for cells, with_note in GAUGE_FORMS))


def gauge_text(position: int, capacity: int, cells: int, note: str = "") -> Text:
    """"KV ██░░░░░░░░ 743/4,096" (`cells` bar cells; none: "KV 743/4,096"), then the note."""
    used = min(1.0, position / capacity) if capacity else 0.0
    filled = round(used * cells)
    text = Text("KV ")
    if cells:
        text.append("█" * filled, style="bold")
        text.append("░" * (cells - filled), style="dim")
        text.append(" ")
    text.append(f"{position:,}/{capacity:,}")
    if note:
        text.append(f" {note}", style="dim")
    return text
