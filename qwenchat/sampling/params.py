"""Sampling parameters: validated values, Qwen3's presets, and a holder that can change live."""

from __future__ import annotations

import json
import math
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

from qwenchat.errors import ModelError, UsageError

MAX_SEED = 2**63 - 1

# name -> (low, high, low inclusive, high inclusive, how the range reads in a message)
RANGES: dict[str, tuple[float, float, bool, bool, str]] = {
    "temperature": (0.0, 2.0, True, True, "0 to 2 (0 = greedy)"),
    "top_p": (0.0, 1.0, False, True, "greater than 0, at most 1"),
    "top_k": (0, 1_000_000, True, True, "an integer from 0 to 1000000 (0 = off)"),
    "min_p": (0.0, 1.0, True, True, "0 to 1 (0 = off)"),
    "repetition_penalty": (0.0, 2.0, False, True, "greater than 0, at most 2 (1 = off)"),
    "presence_penalty": (-2.0, 2.0, True, True, "-2 to 2 (0 = off)"),
    "frequency_penalty": (-2.0, 2.0, True, True, "-2 to 2 (0 = off)"),
    "seed": (0, MAX_SEED, True, True, f"an integer from 0 to {MAX_SEED}, or none"),
    "max_tokens": (1, 10_000_000, True, True,
                   "an integer from 1 to 10000000, or none for no limit"),
}
INTEGER_FIELDS = {"top_k", "seed", "max_tokens"}


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.7
    top_p: float = 0.8
    top_k: int = 20
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = None

    def __post_init__(self) -> None:
        for f in fields(self):
            check_value(f.name, getattr(self, f.name))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        """Whether a penalty can change the logits (sampler.apply_penalties)."""
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)

    def with_updates(self, **changes: Any) -> SamplingParams:
        return replace(self, **changes)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def check_value(name: str, value: Any) -> None:
    """Raise a UsageError naming `name` and its valid range unless `value` is acceptable."""
    low, high, low_in, high_in, reads = RANGES[name]
    if value is None and name in ("seed", "max_tokens"):
        return
    if name in INTEGER_FIELDS:
        ok = isinstance(value, int) and not isinstance(value, bool)
    else:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        ok = ok and math.isfinite(value)
    if ok:
        above = value >= low if low_in else value > low
        below = value <= high if high_in else value < high
        ok = above and below
    if not ok:
        raise UsageError(f"{name.replace('_', '-')} must be {reads}; got {value!r}")


THINKING = SamplingParams(temperature=0.6, top_p=0.95, top_k=20, min_p=0.0)
NON_THINKING = SamplingParams(temperature=0.7, top_p=0.8, top_k=20, min_p=0.0)


def parse_value(name: str, text: str) -> Any:
    """Parse a value typed by a user (CLI or `/set`) for parameter `name`, then validate it."""
    key = name.replace("-", "_")
    if key not in RANGES:
        known = ", ".join(n.replace("_", "-") for n in RANGES)
        raise UsageError(f"unknown sampling parameter {name!r}; known: {known}")
    if key in ("seed", "max_tokens") and text.strip().lower() in ("none", "off", ""):
        return None
    try:
        value: Any = int(text) if key in INTEGER_FIELDS else float(text)
    except ValueError:
        flag = key.replace("_", "-")
        raise UsageError(f"{flag} must be {RANGES[key][4]}; got {text!r}") from None
    check_value(key, value)
    return value


def generation_defaults(model_dir: Path | None, thinking: bool) -> SamplingParams:
    """What a reply uses when the user sets nothing.

    Thinking mode takes the model's generation_config.json (Qwen3 ships its thinking preset
    there), falling back to Qwen's preset; non-thinking mode takes Qwen's non-thinking preset,
    which the model card recommends and generation_config.json does not carry.
    """
    if not thinking:
        return NON_THINKING
    config = read_generation_config(model_dir) if model_dir else {}
    if config.get("do_sample") is False:
        return replace(THINKING, temperature=0.0)
    updates = {k: config[k] for k in ("temperature", "top_p", "top_k", "min_p",
                                       "repetition_penalty") if config.get(k) is not None}
    try:
        return replace(THINKING, **updates)
    except UsageError as exc:
        raise ModelError(f"{model_dir}/generation_config.json: {exc}") from None


def read_generation_config(model_dir: Path) -> dict[str, Any]:
    path = model_dir / "generation_config.json"
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelError(f"{path} is not readable JSON ({exc})") from None
    return config if isinstance(config, dict) else {}


def eos_token_ids(model_dir: Path, fallback: list[int]) -> list[int]:
    """Ids that end a reply: generation_config.json's eos_token_id, else `fallback`."""
    eos = read_generation_config(model_dir).get("eos_token_id")
    if isinstance(eos, int):
        eos = [eos]
    if eos is not None and not (
        isinstance(eos, list) and all(isinstance(e, int) and not isinstance(e, bool) for e in eos)
    ):
        raise ModelError(f"{model_dir / 'generation_config.json'}: eos_token_id must be an "
                         f"integer or a list of integers, got {json.dumps(eos)}")
    return sorted(set(eos or fallback))


class LiveParams:
    """The parameters in force, shared between the UI thread and a running generation.

    Engines read `.current` before every token, so a change applies to the next one;
    `version` lets an engine that mirrors the values on the device notice a change cheaply.
    """

    def __init__(self, params: SamplingParams):
        self._lock = threading.Lock()
        self._params = params
        self.version = 0
        self._listeners: list[Callable[[SamplingParams], None]] = []

    def subscribe(self, listener: Callable[[SamplingParams], None]) -> Callable[[], None]:
        """Call `listener` with the new parameters on every change (an engine that runs ahead of
        its reader mirrors them to the device at once); returns the function that unsubscribes."""
        with self._lock:
            self._listeners.append(listener)

        def unsubscribe() -> None:
            with self._lock:
                if listener in self._listeners:
                    self._listeners.remove(listener)

        return unsubscribe

    @property
    def current(self) -> SamplingParams:
        return self._params

    def set(self, params: SamplingParams) -> None:
        with self._lock:
            self._params = params
            self.version += 1
            listeners = list(self._listeners)
        for listener in listeners:
            listener(params)

    def update(self, **changes: Any) -> SamplingParams:
        with self._lock:
            self._params = self._params.with_updates(**changes)
            self.version += 1
            params, listeners = self._params, list(self._listeners)
        for listener in listeners:
            listener(params)
        return params
