"""A conversation with one engine: renders turns, reuses the KV cache, streams reply events."""

from __future__ import annotations

import os
import threading
import time
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field

from qwenchat.engine.base import Engine, GenerateRequest, StopReason
from qwenchat.engine.speculate import Proposer
from qwenchat.errors import ContextFullError, UsageError
from qwenchat.model.tokenizer import (
    Message,
    PrefixReuse,
    StreamDecoder,
    Tokenizer,
    check_text,
    shared_prefix_length,
)
from qwenchat.sampling.params import LiveParams

DEFAULT_REPLY_RESERVE = 256  # tokens kept free for the reply when deciding to drop old turns
PROGRESS_INTERVAL_S = 0.1
# A prompt's prefill that has run this long reports how far it is (then every
# PROGRESS_INTERVAL_S); it runs in calls of the engine's whole passes and stops between two
# calls on cancel.
PREFILL_REPORT_AFTER_S = 0.5
# A prompt's prefill runs in calls of about this long (whole passes of the engine's), so that
# a cancel waits for one call at most; each call ends in a synchronization and the last
# position's logits, which a prompt in one call pays once (a GPU's 564-token prompt: 3 calls of
# 256 tokens cost ~5 ms more than one). Sized from the engine's last measured rate.
PREFILL_STEP_S = 0.05
_PREFILL_RATES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # engine: tokens/s
# The background prefill of the history runs in steps of about this long: a message sent
# meanwhile waits for the step under way, no more.
PREPARE_STEP_S = 0.05
PREPARE_FIRST_STEP = 32  # tokens; later steps are sized from how long the last one took
PREPARE_MIN_STEP, PREPARE_MAX_STEP = 16, 4096


def now() -> float:
    """The clock reply timings are read on; pass its readings as `sent_at`."""
    return time.perf_counter()


@dataclass
class ReplyStats:
    prompt_tokens: int = 0
    reused_tokens: int = 0  # prompt tokens already in the KV cache from earlier turns
    prefill_tokens: int = 0
    prefill_done: int = 0  # of prefill_tokens, so far
    prefill_s: float = 0.0
    generated_tokens: int = 0
    ttft_s: float | None = None  # from send to the first reply token
    decode_s: float = 0.0  # from the first reply token to the last
    position: int = 0
    capacity: int = 0  # 0: not known (a remote server does not report its KV cache)
    stop_reason: str | None = None
    seed: int = 0
    # Speculative decoding (0 while off): target passes that verified proposals, tokens
    # proposed, and of those, tokens kept.
    spec_passes: int = 0
    spec_proposed: int = 0
    spec_accepted: int = 0

    @property
    def decode_tok_s(self) -> float | None:
        if self.generated_tokens < 2 or self.decode_s <= 0:
            return None
        return (self.generated_tokens - 1) / self.decode_s

    def as_dict(self) -> dict[str, object]:
        fields_ = dict(self.__dict__)
        fields_["decode_tok_s"] = self.decode_tok_s
        return fields_


@dataclass
class TextPiece:
    text: str
    kind: str  # "thinking" | "answer"


@dataclass
class Progress:
    stats: ReplyStats
    final: bool = False


@dataclass
class TurnsDropped:
    count: int  # user turns (with their replies) no longer in the model's context
    message: str


Event = TextPiece | Progress | TurnsDropped


@dataclass
class Reply:
    """One assistant turn as the user saw it."""

    answer: str = ""
    thinking: str = ""
    stats: ReplyStats = field(default_factory=ReplyStats)

    @property
    def stopped(self) -> bool:
        return self.stats.stop_reason == StopReason.CANCELLED.value


class ThinkSplitter:
    """Routes reply tokens into thinking and answer text, using Qwen3's <think> markers."""

    def __init__(self, tokenizer: Tokenizer, parse_thinking: bool):
        self._tokenizer = tokenizer
        self._parse = parse_thinking and tokenizer.think_start_id is not None
        self.kind = "answer"
        self._decoder = tokenizer.stream_decoder()
        self._strip_newlines = False

    def push(self, token_id: int) -> list[TextPiece]:
        if self._parse and token_id in (self._tokenizer.think_start_id,
                                        self._tokenizer.think_end_id):
            pieces = self.finish()
            self.kind = "thinking" if token_id == self._tokenizer.think_start_id else "answer"
            self._decoder = StreamDecoder(self._tokenizer)
            self._strip_newlines = True  # the template puts newlines after both markers
            return pieces
        return self._piece(self._decoder.push(token_id))

    def finish(self) -> list[TextPiece]:
        return self._piece(self._decoder.finish())

    def _piece(self, text: str) -> list[TextPiece]:
        if self._strip_newlines:
            text = text.lstrip("\n")
            self._strip_newlines = not text
        return [TextPiece(text, self.kind)] if text else []


class Conversation:
    """A chat's turns as both kinds of session keep them: the messages, the system prompt and
    thinking mode, and what sending, regenerating and clearing do to them. A subclass streams
    the reply (`_reply`): ChatSession on a local engine, remote.RemoteSession on a server."""

    def __init__(self, params: LiveParams, system: str | None = None, thinking: bool = False):
        self.params = params
        self.system = system
        self.thinking = thinking
        self.messages: list[Message] = []
        self.first_in_context = 0  # index into messages of the oldest turn still rendered
        self.last_reply: Reply | None = None

    def send(self, text: str, cancel: threading.Event | None = None,
             sent_at: float | None = None) -> Iterator[Event]:
        """Add a user turn and stream the reply; the reply joins the history when it ends.

        `sent_at` (a `now()` reading) is when the user sent it, if earlier than this call:
        time to first token counts from there."""
        if not text.strip():
            raise UsageError("the prompt is empty: type a message")
        check_text(text, "the message")
        if self.system:
            check_text(self.system, "the system prompt")
        self.messages.append(Message("user", text))
        try:
            yield from self._reply(cancel or threading.Event(), sent_at)
        except BaseException:
            if self.messages and self.messages[-1].role == "user":
                self.messages.pop()  # a failed turn leaves no half-turn behind
            raise

    def regenerate(self, cancel: threading.Event | None = None) -> Iterator[Event]:
        """Drop the last reply and answer the last user message again."""
        if self.messages and self.messages[-1].role == "assistant":
            self.messages.pop()
        if not self.messages or self.messages[-1].role != "user":
            raise UsageError("nothing to regenerate: send a message first")
        text = self.messages.pop().content
        yield from self.send(text, cancel)

    def clear(self) -> None:
        self.messages.clear()
        self.first_in_context = 0

    def context_messages(self) -> list[Message]:
        system = [Message("system", self.system)] if self.system else []
        return system + self.messages[self.first_in_context :]

    def _reply(self, cancel: threading.Event, sent_at: float | None) -> Iterator[Event]:
        raise NotImplementedError


class ChatSession(Conversation):
    def __init__(
        self,
        engine: Engine,
        tokenizer: Tokenizer,
        eos_ids: frozenset[int],
        params: LiveParams,
        system: str | None = None,
        thinking: bool = False,
        speculate: int = 0,
        proposer: Proposer | None = None,
    ):
        self.engine = engine
        # Speculative decoding: propose up to this many tokens a step (0: off), by `proposer`
        # (None: prompt lookup).
        self.speculate = speculate
        self.proposer = proposer
        self._request: GenerateRequest | None = None  # the reply's, while one streams
        super().__init__(params, system, thinking)
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids
        self._encoder = PrefixReuse(tokenizer)  # each turn re-encodes only what is new

    def complete(self, text: str, cancel: threading.Event | None = None,
                 sent_at: float | None = None) -> Iterator[Event]:
        """Continue `text` as it is, with no chat template (a plain completion); the reply
        stays out of the history, and the KV cache is reused as for a turn."""
        if not text:
            raise UsageError("the prompt is empty: give some text to continue")
        check_text(text, "the prompt")
        ids = self._encoder.encode(text)
        if len(ids) >= self.engine.capacity:
            raise ContextFullError(
                f"the prompt is {len(ids)} tokens but the context holds "
                f"{self.engine.capacity}: shorten it, or raise --ctx")
        yield from self._stream(ids, cancel or threading.Event(), now(), sent_at,
                                parse_thinking=False, keep=False)

    def remember_encoding(self, text: str, ids: list[int], cuts: list[tuple[int, int]]) -> None:
        """A rendering already encoded elsewhere (Tokenizer.encode_with_cuts), such as the
        server's length check of the same conversation: the turn that renders it again does not
        encode it again."""
        self._encoder.remember(text, ids, cuts)

    def set_speculate(self, most: int) -> None:
        """Propose up to `most` tokens a step from now on (0: off), in a reply streaming now
        too (its next step)."""
        self.speculate = most
        if self._request is not None:
            self._request.speculate = most

    def history_ids(self) -> list[int]:
        """The tokens every next turn's prompt starts with: the conversation as the chat
        template renders it once another user message follows. (Qwen3's template renders an
        earlier reply without the <think> block its generation prompt began, so this differs
        from what the cache holds right after a reply.)"""
        context = self.context_messages()
        probes = [self._encode_chat([*context, Message("user", probe)]) for probe in ("1", "2")]
        shared = shared_prefix_length(*probes)
        # The next message's own header (<|im_start|>user ...) belongs to its turn.
        start = self.tokenizer.im_start_id
        headers = [i for i in range(shared) if probes[0][i] == start]
        return probes[0][: headers[-1] if headers else shared]

    def prepare_next_turn(self, cancel: threading.Event) -> int:
        """Bring the KV cache to `history_ids()` while the user reads and types, so the next
        turn prefills only its own message. Runs in steps of about PREPARE_STEP_S and stops
        between two once `cancel` is set; what is done stays done. Returns the tokens
        prefilled. Must not run beside a reply: both use the engine."""
        target = self.history_ids()
        if len(target) + self._reply_reserve() > self.engine.capacity:
            return 0  # the next turn drops its oldest turns: a different prefix
        done = shared_prefix_length(self.engine.tokens, target)
        if done == len(target):
            return 0  # already there (an empty chat keeps the cache of the one before)
        self.engine.truncate(done)
        prefilled, step = 0, PREPARE_FIRST_STEP
        while done < len(target) and not cancel.is_set():
            part = target[done : done + step]
            began = time.perf_counter()
            self.engine.prefill(part)
            took = time.perf_counter() - began
            done += len(part)
            prefilled += len(part)
            step = round(step * PREPARE_STEP_S / took) if took > 0 else PREPARE_MAX_STEP
            step = min(max(step, PREPARE_MIN_STEP), PREPARE_MAX_STEP)
        return prefilled

    def _reply(self, cancel: threading.Event, sent_at: float | None = None) -> Iterator[Event]:
        began = now()
        ids, dropped = self._fit_prompt()
        if dropped:
            yield TurnsDropped(dropped, f"dropped the {dropped} oldest turn(s) to fit the "
                                        f"{self.engine.capacity}-token context")
        yield from self._stream(ids, cancel, began, sent_at, self.thinking, keep=True)

    def _stream(self, ids: list[int], cancel: threading.Event, began: float,
                sent_at: float | None, parse_thinking: bool, keep: bool) -> Iterator[Event]:
        """Prefill what of `ids` the cache lacks and stream the reply; `keep`: the reply joins
        the history."""
        started = began if sent_at is None else sent_at  # TTFT counts from the send
        cached = self.engine.tokens
        common = shared_prefix_length(cached, ids)
        common = min(common, len(ids) - 1)  # at least one token must run to give logits
        stats = ReplyStats(prompt_tokens=len(ids), reused_tokens=common,
                           prefill_tokens=len(ids) - common, capacity=self.engine.capacity)
        self.engine.truncate(common)
        yield from self._prefill(ids[common:], stats, began, cancel)
        current = self.params.current
        stats.seed = current.seed if current.seed is not None else fresh_seed()
        request = GenerateRequest(self.params, self.eos_ids, stats.seed, cancel,
                                  speculate=self.speculate, proposer=self.proposer)
        self._request = request
        reply = Reply(stats=stats)
        splitter = ThinkSplitter(self.tokenizer, parse_thinking)
        first_at = last_report = 0.0
        finished = False
        try:
            # (a prefill cancelled part way generates nothing: the reply is an empty, stopped one)
            complete = stats.prefill_done == stats.prefill_tokens
            generation = self.engine.generate(request) if complete else None
            for token in generation or ():
                at = now()
                if stats.generated_tokens == 0:
                    first_at = at
                    stats.ttft_s = at - started
                stats.generated_tokens += 1
                stats.decode_s = at - first_at
                stats.position = self.engine.position
                _count_speculation(stats, self.engine)
                if token not in self.eos_ids:
                    for piece in splitter.push(token):
                        _append(reply, piece)
                        yield piece
                if at - last_report >= PROGRESS_INTERVAL_S:
                    last_report = at
                    yield Progress(stats)
            stop = generation.stop_reason if generation is not None else None
            stats.stop_reason = (stop or StopReason.CANCELLED).value
            for piece in splitter.finish():
                _append(reply, piece)
                yield piece
            finished = True
        finally:
            if not finished:  # interrupted from outside: keep what was shown, marked stopped
                stats.stop_reason = StopReason.CANCELLED.value
                for piece in splitter.finish():
                    _append(reply, piece)
            stats.position = self.engine.position
            _count_speculation(stats, self.engine)
            self._request = None
            reply.thinking = reply.thinking.rstrip("\n")
            if keep:
                self.messages.append(Message("assistant", reply.answer))
            self.last_reply = reply
        yield Progress(stats, final=True)

    def _prefill(self, ids: list[int], stats: ReplyStats, began: float,
                 cancel: threading.Event) -> Iterator[Event]:
        """Run the prompt's new tokens in the engine's own passes (the same cache and logits as
        one call), reporting progress once it has taken PREFILL_REPORT_AFTER_S, and stopping
        between two calls once `cancel` is set (what ran stays in the cache). A call takes as
        many passes as the engine ran in about PREFILL_STEP_S last time (one pass the first)."""
        chunk = max(1, self.engine.prefill_chunk)
        report_at = began + PREFILL_REPORT_AFTER_S
        at, last = 0, began  # (one clock reading a call, as the stats take)
        while at < len(ids) and not cancel.is_set():
            rate = _PREFILL_RATES.get(self.engine)
            step = chunk if rate is None else max(chunk,
                                                  int(rate * PREFILL_STEP_S) // chunk * chunk)
            part = ids[at : at + step]
            self.engine.prefill(part)
            done_at = now()
            if len(part) >= chunk and done_at > last:  # (a short call's rate is its overhead's)
                _PREFILL_RATES[self.engine] = len(part) / (done_at - last)
            at, last = at + len(part), done_at
            stats.prefill_done = at
            stats.prefill_s = done_at - began
            stats.position = self.engine.position
            if began + stats.prefill_s >= report_at and stats.prefill_done < len(ids):
                report_at = began + stats.prefill_s + PROGRESS_INTERVAL_S
                yield Progress(stats)

    def _fit_prompt(self) -> tuple[list[int], int]:
        """Render the conversation, dropping the oldest turns while it does not fit."""
        capacity = self.engine.capacity
        reserve = self._reply_reserve()
        dropped = 0
        while True:
            ids = self._encode_chat(self.context_messages())
            if len(ids) + reserve <= capacity:
                return ids, dropped
            if not self._drop_oldest_turn():
                if len(ids) < capacity:
                    return ids, dropped
                raise ContextFullError(
                    f"the prompt is {len(ids)} tokens but the context holds {capacity}: "
                    "shorten it, or raise --ctx"
                )
            dropped += 1

    def _encode_chat(self, messages: list[Message]) -> list[int]:
        """The template's rendering of `messages` as ids (what Tokenizer.encode_chat gives)."""
        return self._encoder.encode(self.tokenizer.render(messages, self.thinking))

    def _reply_reserve(self) -> int:
        """Tokens kept free for a reply when deciding whether the conversation still fits."""
        max_tokens = self.params.current.max_tokens
        return min(max_tokens or DEFAULT_REPLY_RESERVE, self.engine.capacity // 2)

    def _drop_oldest_turn(self) -> bool:
        """Move the context window past the oldest user turn and its reply, if one remains."""
        window = self.messages[self.first_in_context :]
        later_users = [i for i, m in enumerate(window) if m.role == "user"][1:]
        if not later_users:
            return False
        self.first_in_context += later_users[0]
        return True


def _count_speculation(stats: ReplyStats, engine: Engine) -> None:
    spec = engine.speculation
    stats.spec_passes, stats.spec_proposed = spec.passes, spec.proposed
    stats.spec_accepted = spec.accepted


def _append(reply: Reply, piece: TextPiece) -> None:
    if piece.kind == "thinking":
        reply.thinking += piece.text
    else:
        reply.answer += piece.text


def fresh_seed() -> int:
    """A seed for a reply the user gave none: drawn, and reported, so it can be replayed."""
    return int.from_bytes(os.urandom(8), "little") >> 1
