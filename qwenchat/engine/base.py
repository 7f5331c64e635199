"""The engine protocol: the one interface the session, `ask` and the TUI use to run a model.

An engine owns a KV cache and the ids of the tokens in it. `prefill` appends a batch of
tokens; `generate` samples inside the engine (so a GPU engine can keep many steps on the
device) and yields ids until a stop condition holds; `truncate` drops the cache's tail so a
new prompt can reuse its longest common prefix.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Protocol, runtime_checkable

import numpy as np

from qwenchat.engine.speculate import SPECULATE_MOST, LookupProposer, Proposer
from qwenchat.errors import ContextFullError, UsageError
from qwenchat.model.config import Qwen3Config
from qwenchat.sampling.params import LiveParams, SamplingParams
from qwenchat.sampling.speculative import AdaptiveK, draft_cost


class StopReason(str, Enum):
    EOS = "eos"
    MAX_TOKENS = "max_tokens"
    CANCELLED = "cancelled"
    CONTEXT_FULL = "context_full"


@dataclass
class SpeculationStats:
    """A reply's speculation so far: target passes that verified proposals, tokens proposed,
    and of those, tokens kept."""

    passes: int = 0
    proposed: int = 0
    accepted: int = 0


@dataclass
class GenerateRequest:
    """What one reply needs besides the cache: live parameters and when to stop."""

    params: LiveParams
    eos_ids: frozenset[int]
    seed: int  # used while params.current.seed is None
    cancel: threading.Event = field(default_factory=threading.Event)
    # Speculative decoding: propose up to this many tokens a step and verify them in one pass
    # (engines that can score several tokens at once; 0: off; read at every step, so it can
    # be switched during a reply), proposed by `proposer` (engine.speculate; None: prompt
    # lookup).
    speculate: int = 0
    proposer: Proposer | None = None


class Generation:
    """Iterates token ids as they are produced; `stop_reason` is set once it is exhausted."""

    def __init__(self, steps: Iterator[int]):
        self._steps = steps
        self.stop_reason: StopReason | None = None

    def __iter__(self) -> Generation:
        return self

    def __next__(self) -> int:
        try:
            return next(self._steps)
        except StopIteration as done:
            self.stop_reason = done.value
            raise


@runtime_checkable
class Engine(Protocol):
    config: Qwen3Config
    name: str
    weight_format: str  # of the linear layers, as the engine runs them: "bf16", "fp8", ...
    kv_format: str  # of the KV cache: "bf16" or "int8" (qwenchat/model/kv_cache.py)
    # Tokens one prefill pass takes: a longer prefill runs in passes of this many (the CUDA
    # engine's scratch memory bounds them), so prefill in parts of this size gives the cache
    # and logits of one call.
    prefill_chunk: int

    @property
    def position(self) -> int: ...

    @property
    def capacity(self) -> int: ...

    @property
    def tokens(self) -> list[int]: ...

    @property
    def can_speculate(self) -> bool: ...

    speculation: SpeculationStats  # the current (or last) reply's

    def prefill(self, token_ids: Sequence[int]) -> None: ...

    def generate(self, request: GenerateRequest) -> Generation: ...

    def truncate(self, position: int) -> None: ...

    def last_logits(self) -> np.ndarray: ...

    def close(self) -> None: ...


class CacheBookkeeping:
    """Token ids in the cache, the checks every engine applies before touching it, and the
    reply loop with its stop rules. An engine supplies `_has_logits`, `_drop_logits`,
    `_begin_reply` and `_next_token` (which feeds the previous token, if any, and samples)."""

    def generate(self, request: GenerateRequest) -> Generation:
        return Generation(self._steps(request))

    def truncate(self, position: int) -> None:
        self._check_truncate(position)
        if position < self.position:
            del self._tokens[position:]
            self._drop_logits()

    def _has_logits(self) -> bool:
        raise NotImplementedError

    def _drop_logits(self) -> None:
        raise NotImplementedError

    def _begin_reply(self, request: GenerateRequest) -> None:
        """Reset per-reply sampling state (penalty counts) before the first token."""

    def _end_reply(self) -> None:
        """The reply is over (stopped, exhausted or abandoned): let device work wind down."""

    def _next_token(self, fed: int | None, params: SamplingParams, seed: int,
                    step: int) -> int | None:
        """Run `fed` (None for the first token, whose logits the prefill left) and sample;
        None when the engine had already stopped on a cancel."""
        raise NotImplementedError

    def _speculative_pass(self, fed: int, proposal: list[int], params: SamplingParams,
                          seed: int, step: int, draft_probs: np.ndarray | None) -> list[int]:
        """Run `fed` and the proposal through the model in one pass (the cache grows by all
        of them) and verify the proposal (sampling.speculative.verify, with the draft's
        distributions if any): the kept tokens and the one that ends the pass. The engine
        keeps the pass's rows of logits for _rewind. Engines that cannot score several tokens
        at once leave this out, and speculation is off on them."""
        raise NotImplementedError

    def _rewind(self, position: int, row: int, emitted: list[int]) -> None:
        """After a pass: keep the cache up to `position`, with the pass's row `row` of logits
        as the last position's (what `emitted`'s last token was drawn from), and count
        `emitted` for the penalties."""
        raise NotImplementedError

    def _plain_pending(self) -> bool:
        """Whether tokens of plain decoding are already under way past the last one taken (a
        decode that runs ahead): a pass waits until they are taken."""
        return False

    def _plan_plain(self, steps: int | None) -> None:
        """The most plain steps the reply takes before a pass may come (None: no bound), so a
        decode that runs ahead stops where a pass starts."""

    @property
    def can_speculate(self) -> bool:
        """Whether this engine verifies proposals (GenerateRequest.speculate)."""
        return type(self)._speculative_pass is not CacheBookkeeping._speculative_pass

    def _steps(self, request: GenerateRequest) -> Iterator[int]:
        # The last token sampled is never run through the model: the cache holds the reply
        # minus its last token, which is what the next turn's prompt starts with anyway.
        if not self._has_logits():
            raise RuntimeError("generate needs the logits of a prefilled position")
        self.speculation = SpeculationStats()
        self._begin_reply(request)
        try:
            if self.can_speculate:  # (with speculate 0 it decodes as the plain loop does)
                return (yield from self._speculative_loop(request))
            return (yield from self._reply_loop(request))
        finally:
            self._end_reply()

    @staticmethod
    def _stop_before(request: GenerateRequest, params: SamplingParams, step: int
                     ) -> StopReason | None:
        """Why no token `step` is drawn, if it is not."""
        if request.cancel.is_set():
            return StopReason.CANCELLED
        if params.max_tokens is not None and step >= params.max_tokens:
            return StopReason.MAX_TOKENS
        return None

    def _stop_after(self, request: GenerateRequest, params: SamplingParams, step: int,
                    token: int) -> StopReason | None:
        """Why the reply ends with `token` (its `step` tokens so far), if it does."""
        if token in request.eos_ids:
            return StopReason.EOS
        if params.max_tokens is not None and step >= params.max_tokens:
            return StopReason.MAX_TOKENS
        if self.position >= self.capacity:
            return StopReason.CONTEXT_FULL
        if request.cancel.is_set():
            return StopReason.CANCELLED
        return None

    def _reply_loop(self, request: GenerateRequest) -> Iterator[int]:
        step, token = 0, None
        while True:
            params = request.params.current
            if stop := self._stop_before(request, params, step):
                return stop
            seed = request.seed if params.seed is None else params.seed
            token = self._next_token(token, params, seed, step)
            if token is None:
                return StopReason.CANCELLED
            step += 1
            yield token
            if stop := self._stop_after(request, params, step, token):
                return stop

    def _speculative_loop(self, request: GenerateRequest) -> Iterator[int]:
        """The reply loop with a proposer: each step proposes up to k tokens, runs them with
        the fed token in one pass and keeps what verify keeps. With one-hot proposals (prompt
        lookup, or greedy decoding) the reply is plain decoding's token for token; with a
        draft model's sampled ones it is distributed as plain decoding's. A pass that would
        run past EOS, max_tokens or the cache's end stops on the token where plain decoding
        stops, and the cache keeps exactly the kept tokens."""
        step, token = 0, None
        stats = self.speculation
        proposer = request.proposer or LookupProposer()
        proposer.start(self._tokens)
        # (a draft model's step against the model's; prompt lookup's proposals cost nothing)
        draft = getattr(proposer, "parameters", None)
        adapt = AdaptiveK(SPECULATE_MOST, 0.0 if draft is None
                          else draft_cost(draft, self.config.active_parameter_count()))
        while True:
            params = request.params.current
            if stop := self._stop_before(request, params, step):
                return stop
            seed = request.seed if params.seed is None else params.seed
            k = min(adapt.k, request.speculate, self.capacity - self.position - 1)
            if params.max_tokens is not None:
                k = min(k, params.max_tokens - step - 1)
            # (ready() first: every plain step of a pause counts it down, tokens under way or
            # not, so a decode that runs ahead still comes back to propose)
            proposal, draft_probs = (proposer.propose(k, params, seed, step)
                                     if token is not None and k > 0 and adapt.ready()
                                     and not self._plain_pending() else ([], None))
            if proposal:
                start = self.position
                kept = self._speculative_pass(token, proposal, params, seed, step, draft_probs)
                adapt.update(len(proposal), len(kept) - 1)
                n = next((j + 1 for j, t in enumerate(kept) if t in request.eos_ids
                          or start + j + 1 >= self.capacity), len(kept))
                stats.passes += 1
                stats.proposed += len(proposal)
                stats.accepted += min(n, len(kept) - 1)  # (the proposals emitted)
                emitted = kept[:n]
                self._rewind(start + n, n - 1, emitted)
            else:
                # (paused: this step and the rest of the pause; else one, as the next may
                # propose; speculation off: no bound)
                self._plan_plain(adapt.paused + 1 if request.speculate > 0 else None)
                token = self._next_token(token, params, seed, step)
                if token is None:
                    return StopReason.CANCELLED
                emitted = [token]
            token = emitted[-1]
            for t in emitted:
                step += 1
                yield t
                proposer.extend([t])
            if stop := self._stop_after(request, params, step, token):
                return stop

    def __init__(self, capacity: int):
        self._capacity = capacity
        self._tokens: list[int] = []
        self.speculation = SpeculationStats()

    @property
    def position(self) -> int:
        return len(self._tokens)

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def tokens(self) -> list[int]:
        return list(self._tokens)

    def _check_prefill(self, token_ids: Sequence[int], vocab_size: int) -> None:
        if not token_ids:
            raise UsageError("prefill needs at least one token")
        if self.position + len(token_ids) > self._capacity:
            raise ContextFullError(
                f"{self.position + len(token_ids)} tokens do not fit in the {self._capacity}-"
                "token context; start a new chat or raise --ctx"
            )
        bad = [t for t in token_ids if not 0 <= t < vocab_size]
        if bad:
            raise UsageError(f"token id {bad[0]} is outside the vocabulary (0..{vocab_size - 1})")

    def _check_truncate(self, position: int) -> None:
        if not 0 <= position <= self.position:
            raise UsageError(f"cannot truncate the cache to {position}: it holds {self.position}")
