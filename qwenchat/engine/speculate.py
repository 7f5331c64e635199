"""What proposes tokens for speculative decoding: the context's own continuation (prompt
lookup), or a smaller draft model with the target's vocabulary, run by an engine of its own.

A proposer follows one reply: `start` with the context before it, `extend` with each token the
reply emits, and `propose(k, ...)` for up to k tokens, with the distribution each was drawn
from (None: the proposals are one-hot, which verification then keeps exactly as plain decoding
would draw them).
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

import numpy as np

from qwenchat.errors import UsageError
from qwenchat.model.tokenizer import shared_prefix_length
from qwenchat.sampling.lookup import PromptLookup
from qwenchat.sampling.params import SamplingParams
from qwenchat.sampling.speculative import draft_token

if TYPE_CHECKING:
    from qwenchat.engine import EngineFlags
    from qwenchat.engine.base import Engine
    from qwenchat.model.loader import Model

SPECULATE_MODES = ("off", "ngram")
SPECULATE_MOST = 7  # tokens proposed a step at most (the adaptive k's ceiling)


def check_speculate(mode: str, draft: str | None = None) -> None:
    """Validate --speculate (and --draft beside it) before anything is loaded."""
    if mode not in SPECULATE_MODES:
        raise UsageError(f"--speculate must be one of {', '.join(SPECULATE_MODES)}; "
                         f"got {mode!r}")
    if draft is not None and mode != "off":
        raise UsageError(f"--draft and --speculate {mode} are two ways to propose tokens: "
                         "give one of them")


def speculate_flag(given: str | None, draft: str | None) -> str:
    """The speculation mode from the command line's --speculate (None where not given: off)
    and --draft: `--speculate off` beside a draft contradicts it, a usage error as any other
    mode beside one is (check_speculate)."""
    if given == "off" and draft is not None:
        raise UsageError("--draft proposes tokens and --speculate off turns speculation off: "
                         "give one of them")
    mode = "off" if given is None else given
    check_speculate(mode, draft)
    return mode


def cannot_verify(engine: Engine) -> str:
    """Why speculation stays off on `engine`, or "" where it verifies proposals."""
    if engine.can_speculate:
        return ""
    return f"the {engine.name} backend does not verify proposals"


def speculation_asked(mode: str, draft: str | None, engine: Engine) -> tuple[int, str]:
    """What --speculate and --draft give on `engine`: the tokens proposed a step at most (0:
    off), and a one-line notice where speculation was asked of an engine that cannot verify
    (else "")."""
    if mode == "off" and draft is None:
        return 0, ""
    if why := cannot_verify(engine):
        flag = f"--draft {draft}" if draft else f"--speculate {mode}"
        return 0, f"{flag}: {why}; answering without speculation"
    return SPECULATE_MOST, ""


class Proposer(Protocol):
    def start(self, context: Sequence[int]) -> None: ...

    def extend(self, tokens: Sequence[int]) -> None: ...

    def propose(self, k: int, params: SamplingParams, seed: int, step: int
                ) -> tuple[list[int], np.ndarray | None]: ...


class LookupProposer:
    """Prompt lookup (sampling.lookup.PromptLookup): no second model, one-hot proposals. The
    context is indexed at the first proposal, so a reply that never asks for one (speculation
    switched off) costs nothing."""

    def __init__(self, max_ngram: int = 3):
        self.lookup = PromptLookup(max_ngram)
        self._unindexed: list[int] | None = []

    def start(self, context: Sequence[int]) -> None:
        self._unindexed = list(context)

    def extend(self, tokens: Sequence[int]) -> None:
        if self._unindexed is None:
            self.lookup.extend(tokens)
        else:
            self._unindexed.extend(tokens)

    def propose(self, k: int, params: SamplingParams, seed: int, step: int
                ) -> tuple[list[int], None]:
        if self._unindexed is not None:
            self.lookup.reset(self._unindexed)
            self._unindexed = None
        return self.lookup.propose(k), None


class DraftProposer:
    """A draft model's proposals, each drawn from its own distribution q at that step (the
    target's sampling parameters and penalties, the draft's stream of uniform numbers; greedy:
    its argmax). Its engine's cache follows the reply: before each proposal it keeps what it
    shares with the context and prefills the rest, so rejected proposals leave nothing."""

    def __init__(self, engine: Engine, vocab_size: int):
        if engine.config.vocab_size != vocab_size:
            raise UsageError(f"the draft model's vocabulary has {engine.config.vocab_size:,} "
                             f"tokens and the model's {vocab_size:,}: use a draft of the same "
                             "family (every Qwen3 size shares one tokenizer)")
        self.engine = engine
        self.context: list[int] = []
        self.reply: list[int] = []
        self.counts: Counter[int] = Counter()

    @property
    def parameters(self) -> int:
        """The draft's parameters a token uses: what a proposed token costs, against the
        model's (AdaptiveK)."""
        return self.engine.config.active_parameter_count()

    def start(self, context: Sequence[int]) -> None:
        self.context, self.reply, self.counts = list(context), [], Counter()

    def extend(self, tokens: Sequence[int]) -> None:
        self.reply.extend(tokens)
        self.counts.update(tokens)

    def propose(self, k: int, params: SamplingParams, seed: int, step: int
                ) -> tuple[list[int], np.ndarray | None]:
        if k <= 0:
            return [], None
        tokens = self.context + self.reply
        self._follow(tokens)
        if params.greedy and not (params.presence_penalty or params.frequency_penalty):
            return self._greedy(k, params, seed), None
        counts = Counter(self.counts)
        proposal: list[int] = []
        probs = []
        for i in range(k):
            if i:
                self.engine.prefill([proposal[-1]])
            token, q = draft_token(self.engine.last_logits(), params, seed, step + i, tokens,
                                   counts)
            proposal.append(token)
            probs.append(q)
            counts[token] += 1
        return proposal, np.stack(probs)

    def _greedy(self, k: int, params: SamplingParams, seed: int) -> list[int]:
        """Its greedy proposals from its own decode path (on the GPU, megakernel launches
        instead of a prefill pass a token): the argmax of its logits with the repetition
        penalty over the same tokens, as draft_token would choose them (the reply's own
        penalties are off)."""
        from qwenchat.engine.base import GenerateRequest
        from qwenchat.sampling.params import LiveParams

        request = GenerateRequest(LiveParams(dataclasses.replace(params, max_tokens=k)),
                                  frozenset(), seed=seed)
        return list(self.engine.generate(request))

    def close(self) -> None:
        self.engine.close()

    def _follow(self, tokens: list[int]) -> None:
        """Make the draft's cache hold `tokens`, with the logits after the last."""
        common = shared_prefix_length(self.engine.tokens, tokens)
        common = min(common, len(tokens) - 1)  # (at least the last token runs: its logits)
        self.engine.truncate(common)
        self.engine.prefill(tokens[common:])


def open_draft(spec: str, model: Model, engine: Engine, flags: EngineFlags,
               notice: Callable[[str], None], progress: Callable[[str], None] | None = None,
               megakernel_later: bool = True) -> DraftProposer:
    """The draft model `spec` (--draft) as a proposer for `model`, run by an engine with the
    command's backend, device, decode path and quantization (`flags`; the KV cache its default)
    and room for `engine`'s context; refused in one line unless its
    tokenizer is the model's. `megakernel_later` as for create_engine (False where a seeded
    reply must not depend on whether the kernel cache was warm)."""
    from qwenchat.engine import create_engine
    from qwenchat.model.loader import open_model

    draft = open_model(spec, progress, flag="--draft")
    if not draft.tokenizer.same_vocabulary(model.tokenizer):
        raise UsageError(f"--draft {spec}: its tokenizer is not the model's ({model.spec}), so "
                         "its tokens would mean other words; use a model of the same family "
                         "(every Qwen3 size shares one tokenizer)")
    config = draft.config
    if engine.capacity > config.context_limit:  # the model's YaRN, for a draft as long
        config = dataclasses.replace(config, rope_scaling=engine.config.rope_scaling)
    draft_engine = create_engine(flags.backend, config, draft.checkpoint, engine.capacity,
                                 device=flags.device, notice=notice, decode=flags.decode,
                                 quantize=flags.quantize, megakernel_later=megakernel_later)
    return DraftProposer(draft_engine, model.config.vocab_size)


def start_speculation(mode: str, draft: str | None, model: Model, engine: Engine,
                      flags: EngineFlags, notice: Callable[[str], None],
                      megakernel_later: bool = True) -> tuple[int, DraftProposer | None]:
    """What --speculate and --draft give a one-engine command (`ask`, `serve`): the tokens
    proposed a step at most (0: off, with `notice` told why where asked of an engine that
    cannot verify) and the draft's proposer (None: prompt lookup, or off)."""
    most, why = speculation_asked(mode, draft, engine)
    if why:
        notice(why)
    if not (most and draft):
        return most, None
    return most, open_draft(draft, model, engine, flags, notice,
                            megakernel_later=megakernel_later)
