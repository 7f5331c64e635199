"""A conversation with one engine: renders turns, reuses the KV cache, streams reply events."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from qwenchat.engine.base import Engine, GenerateRequest, StopReason
from qwenchat.errors import ContextFullError, UsageError
from qwenchat.model.tokenizer import Message, StreamDecoder, Tokenizer
from qwenchat.sampling.params import LiveParams

DEFAULT_REPLY_RESERVE = 256  # tokens kept free for the reply when deciding to drop old turns
PROGRESS_INTERVAL_S = 0.1


@dataclass
class ReplyStats:
    prompt_tokens: int = 0
    reused_tokens: int = 0  # prompt tokens already in the KV cache from earlier turns
    prefill_tokens: int = 0
    prefill_s: float = 0.0
    generated_tokens: int = 0
    ttft_s: float | None = None  # from send to the first reply token
    decode_s: float = 0.0  # from the first reply token to the last
    position: int = 0
    capacity: int = 0
    stop_reason: str | None = None
    seed: int = 0

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


class ChatSession:
    def __init__(
        self,
        engine: Engine,
        tokenizer: Tokenizer,
        eos_ids: frozenset[int],
        params: LiveParams,
        system: str | None = None,
        thinking: bool = False,
    ):
        self.engine = engine
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids
        self.params = params
        self.system = system
        self.thinking = thinking
        self.messages: list[Message] = []
        self.first_in_context = 0  # index into messages of the oldest turn still rendered
        self.last_reply: Reply | None = None

    def send(self, text: str, cancel: threading.Event | None = None) -> Iterator[Event]:
        """Add a user turn and stream the reply; the reply joins the history when it ends."""
        if not text.strip():
            raise UsageError("the prompt is empty: type a message")
        self.messages.append(Message("user", text))
        try:
            yield from self._reply(cancel or threading.Event())
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

    def _reply(self, cancel: threading.Event) -> Iterator[Event]:
        started = time.perf_counter()
        ids, dropped = self._fit_prompt()
        if dropped:
            yield TurnsDropped(dropped, f"dropped the {dropped} oldest turn(s) to fit the "
                                        f"{self.engine.capacity}-token context")
        cached = self.engine.tokens
        common = _common_prefix(cached, ids)
        common = min(common, len(ids) - 1)  # at least one token must run to give logits
        stats = ReplyStats(prompt_tokens=len(ids), reused_tokens=common,
                           prefill_tokens=len(ids) - common, capacity=self.engine.capacity)
        self.engine.truncate(common)
        self.engine.prefill(ids[common:])
        stats.prefill_s = time.perf_counter() - started
        current = self.params.current
        stats.seed = current.seed if current.seed is not None else _fresh_seed()
        request = GenerateRequest(self.params, self.eos_ids, stats.seed, cancel)
        reply = Reply(stats=stats)
        splitter = ThinkSplitter(self.tokenizer, self.thinking)
        generation = self.engine.generate(request)
        first_at = last_report = 0.0
        finished = False
        try:
            for token in generation:
                now = time.perf_counter()
                if stats.generated_tokens == 0:
                    first_at = now
                    stats.ttft_s = now - started
                stats.generated_tokens += 1
                stats.decode_s = now - first_at
                stats.position = self.engine.position
                if token not in self.eos_ids:
                    for piece in splitter.push(token):
                        _append(reply, piece)
                        yield piece
                if now - last_report >= PROGRESS_INTERVAL_S:
                    last_report = now
                    yield Progress(stats)
            stats.stop_reason = (generation.stop_reason or StopReason.CANCELLED).value
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
            reply.thinking = reply.thinking.rstrip("\n")
            self.messages.append(Message("assistant", reply.answer))
            self.last_reply = reply
        yield Progress(stats, final=True)

    def _fit_prompt(self) -> tuple[list[int], int]:
        """Render the conversation, dropping the oldest turns while it does not fit."""
        capacity = self.engine.capacity
        max_tokens = self.params.current.max_tokens
        reserve = min(max_tokens or DEFAULT_REPLY_RESERVE, capacity // 2)
        dropped = 0
        while True:
            ids = self.tokenizer.encode_chat(self.context_messages(), self.thinking)
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

    def _drop_oldest_turn(self) -> bool:
        """Move the context window past the oldest user turn and its reply, if one remains."""
        window = self.messages[self.first_in_context :]
        later_users = [i for i, m in enumerate(window) if m.role == "user"][1:]
        if not later_users:
            return False
        self.first_in_context += later_users[0]
        return True


def _append(reply: Reply, piece: TextPiece) -> None:
    if piece.kind == "thinking":
        reply.thinking += piece.text
    else:
        reply.answer += piece.text


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def _fresh_seed() -> int:
    return int.from_bytes(os.urandom(8), "little") >> 1
