"""A scripted engine for UI tests: replays given tokens as fast as asked, or at a fixed rate
in launches the way the megakernel delivers them, and can hold still, recording the live
parameters in force at every step."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from qwenchat.engine.base import CacheBookkeeping, GenerateRequest
from qwenchat.model.config import Qwen3Config
from qwenchat.model.tokenizer import Tokenizer
from qwenchat.sampling.params import SamplingParams
from qwenchat.tui.loader import LoadedModel


class FakeEngine(CacheBookkeeping):
    """Runs the engines' shared reply loop (stop rules, cancel, context size); only the
    "model" is a script."""

    name = "fake engine"
    weight_format = "bf16"
    kv_format = "bf16"
    device_name = "Fake GPU 9000"
    prefill_chunk = 64
    prefill_s_per_token = 0.0  # how long prefill "takes"

    def __init__(self, config: Qwen3Config, script: Sequence[int], capacity: int = 4096,
                 rate: float | None = None, hold_at: int | None = None,
                 stubborn: bool = False, launch_steps: int | None = None,
                 launches_ahead: int = 1):
        super().__init__(capacity)
        self.config = config
        self.script = list(script)  # replayed in a loop until a stop condition holds
        self.rate = rate  # tokens per second; None: as fast as Python goes
        # With launch_steps, a "device" makes tokens at `rate` in launches of that many, each
        # started by the reply's thread as the CUDA engine starts them (launches_ahead queued
        # behind the running one): a thread that falls behind delays the device only as the
        # real one would.
        self.launch_steps = launch_steps
        self.launches_ahead = launches_ahead
        self._ready_at: list[float] = []  # when each token of the reply exists
        self._device_free = 0.0
        self.hold_at = hold_at  # step at which each reply waits for `release`
        self.stubborn = stubborn  # the hold ignores cancel, as a long kernel would
        self.closed = False
        self.holding = threading.Event()
        self.release = threading.Event()
        self.seen: list[SamplingParams] = []  # the parameters in force at every step
        self.prompts: list[list[int]] = []  # the cache at each reply's start, in order
        self._logits = False
        self._cancel = threading.Event()
        self._started = 0.0

    def prefill(self, token_ids: Sequence[int]) -> None:
        self._check_prefill(token_ids, self.config.vocab_size)
        if self.prefill_s_per_token:
            time.sleep(self.prefill_s_per_token * len(token_ids))
        self._tokens.extend(token_ids)
        self._logits = True

    def last_logits(self) -> np.ndarray:
        return np.zeros(self.config.vocab_size, np.float32)

    def close(self) -> None:
        self.closed = True

    def _has_logits(self) -> bool:
        return self._logits

    def _drop_logits(self) -> None:
        self._logits = False

    def _begin_reply(self, request: GenerateRequest) -> None:
        self.prompts.append(list(self._tokens))
        self._cancel = request.cancel
        self._started = time.perf_counter()
        self._ready_at = []
        self._device_free = self._started

    def _next_token(self, fed: int | None, params: SamplingParams, seed: int, step: int) -> int:
        if fed is not None:
            self._tokens.append(fed)  # "runs" the previous token, as a real engine does
        self.seen.append(params)
        if step == self.hold_at:
            self._hold()
        if self.rate:
            if self.launch_steps:
                self._queue_launches(step)
                ready = self._ready_at[step]
            else:
                ready = self._started + step / self.rate
            delay = ready - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
        return self.script[step % len(self.script)]

    def _queue_launches(self, step: int) -> None:
        assert self.rate and self.launch_steps
        while len(self._ready_at) - step <= self.launch_steps * self.launches_ahead:
            start = max(self._device_free, time.perf_counter())
            self._ready_at += [start + (j + 1) / self.rate for j in range(self.launch_steps)]
            self._device_free = self._ready_at[-1]

    def _hold(self) -> None:
        self.holding.set()
        give_up = time.monotonic() + 20  # a failed test must not hang the run
        while not self.release.wait(0.005):
            if (self._cancel.is_set() and not self.stubborn) or time.monotonic() > give_up:
                break
        self.holding.clear()
        self.release.clear()


def fake_model(model_dir: Path, text: str, *, eos: bool = True, **engine_options) -> LoadedModel:
    """A LoadedModel whose engine answers `text` (then <|im_end|> when `eos`); <think> and
    </think> encode as their single special tokens, as the model emits them."""
    tokenizer = Tokenizer(model_dir)
    config = Qwen3Config.from_file(model_dir / "config.json")
    script = tokenizer.encode(text) + ([tokenizer.im_end_id] if eos else [])
    engine = FakeEngine(config, script, **engine_options)
    eos_ids = frozenset(i for i in (tokenizer.im_end_id, tokenizer.end_of_text_id)
                        if i is not None)
    return LoadedModel("tiny-qwen3", model_dir, engine, tokenizer, eos_ids)
