"""The numbers shown while and after a reply streams: speed now and on average, summaries."""

from __future__ import annotations

from collections import deque
from dataclasses import fields

from qwenchat.session import ReplyStats

KV_WARN = 0.75  # the gauge turns amber: older turns will soon be dropped
KV_FULL = 0.90  # the gauge turns red


class RateMeter:
    """Decode speed over the last second of a reply, from the session's progress snapshots.

    Uses the reply's own decode clock (`decode_s`), so the rate is the engine's, not how
    often the UI happened to look.
    """

    def __init__(self, window_s: float = 1.0):
        self._window_s = window_s
        self._points: deque[tuple[float, int]] = deque()

    def add(self, stats: ReplyStats) -> None:
        if stats.generated_tokens == 0:
            return
        self._points.append((stats.decode_s, stats.generated_tokens))
        while len(self._points) > 2 and self._points[-1][0] - self._points[1][0] >= self._window_s:
            self._points.popleft()

    @property
    def rate(self) -> float | None:
        if len(self._points) < 2:
            return None
        (t0, n0), (t1, n1) = self._points[0], self._points[-1]
        return (n1 - n0) / (t1 - t0) if t1 > t0 else None


def rate_text(rate: float | None) -> str:
    if rate is None:
        return "–"
    return f"{rate:,.0f}" if rate >= 100 else f"{rate:.1f}"


def ttft_text(stats: ReplyStats) -> str:
    return f"{stats.ttft_s * 1000:,.0f} ms" if stats.ttft_s is not None else "–"


def stop_text(reason: str | None) -> str:
    if reason == "cancelled":
        return "stopped"
    return f"stop: {(reason or 'unknown').replace('_', ' ')}"


def speculation_text(stats: ReplyStats) -> str:
    """With speculation on: tokens a pass of the model gave (every step that ran it, plain or
    verifying proposals) and the share of proposed tokens kept; else empty."""
    if not stats.spec_proposed:
        return ""
    runs = max(1, stats.generated_tokens - stats.spec_accepted)
    return (f"{stats.generated_tokens / runs:.2f} tok/step · "
            f"{stats.spec_accepted / stats.spec_proposed:.0%} kept")


def reply_summary(stats: ReplyStats) -> str:
    """The line under every reply: tokens, speed, time to first token, why it ended (and,
    with speculation on, the proposed tokens kept)."""
    line = (f"{stats.generated_tokens:,} tokens · {rate_text(stats.decode_tok_s)} tok/s · "
            f"TTFT {ttft_text(stats)} · {stop_text(stats.stop_reason)}")
    if stats.spec_proposed:
        line += f" · kept {stats.spec_accepted:,}/{stats.spec_proposed:,} proposed"
    return line


def stats_from_dict(stored: dict) -> ReplyStats:
    """ReplyStats back from the history (ReplyStats.as_dict()), ignoring unknown keys."""
    known = {f.name for f in fields(ReplyStats)}
    return ReplyStats(**{k: v for k, v in stored.items() if k in known})


def kv_level(position: int, capacity: int) -> str:
    """"ok", "warn" or "full": how close the KV cache is to holding no more."""
    used = position / capacity if capacity else 0.0
    return "full" if used >= KV_FULL else "warn" if used >= KV_WARN else "ok"
