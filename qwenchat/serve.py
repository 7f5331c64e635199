"""`qwenchat serve`: an OpenAI-compatible HTTP server on one engine, one reply at a time."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import queue
import socket
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from qwenchat.engine import EngineFlags
from qwenchat.engine.base import Engine
from qwenchat.engine.speculate import Proposer
from qwenchat.errors import ContextFullError, QwenchatError, UsageError
from qwenchat.model.tokenizer import Message, Tokenizer, check_text
from qwenchat.sampling.params import (
    RANGES,
    LiveParams,
    SamplingParams,
    check_value,
    generation_defaults,
)
from qwenchat.session import ChatSession, Event, Progress, ReplyStats, TextPiece, TurnsDropped, now

MAX_BODY_BYTES = 8 * 1024 * 1024
QUEUE_HEADER = "x-qwenchat-queue"
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "presence_penalty",
                   "frequency_penalty", "repetition_penalty", "seed")
ROLES = ("system", "user", "assistant", "tool")
MAX_STOPS = 16
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
               404: "not_found_error", 405: "invalid_request_error",
               413: "invalid_request_error", 500: "server_error"}
FINISH_REASONS = {"eos": "stop", "max_tokens": "length", "context_full": "length",
                  "cancelled": "stop"}


@dataclass
class ServeOptions(EngineFlags):
    model: str
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    speculate: str = "off"  # --speculate, as for ask
    draft: str | None = None  # --draft, as for ask


@dataclass
class ServedModel:
    """What the server answers with; `names[0]` is the id /v1/models lists, any is accepted."""

    names: tuple[str, ...]
    directory: Path | None  # holds generation_config.json (the thinking defaults)
    engine: Engine
    tokenizer: Tokenizer
    eos_ids: frozenset[int]
    speculate: int = 0  # tokens proposed a step at most (0: off), as ChatSession takes it
    proposer: Proposer | None = None  # a draft model's (None: prompt lookup)

    def session(self, params: SamplingParams, system: str | None = None,
                thinking: bool = False) -> ChatSession:
        """A session for one request, on the served engine (its KV cache carries over)."""
        return ChatSession(self.engine, self.tokenizer, self.eos_ids, LiveParams(params),
                           system=system, thinking=thinking, speculate=self.speculate,
                           proposer=self.proposer)


class ApiError(Exception):
    """A request that cannot be answered: an OpenAI-style error body and its HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": ERROR_TYPES.get(self.status, "error"),
                          "param": self.param, "code": self.code}}

    def response(self, headers: dict[str, str] | None = None) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def from_qwenchat_error(exc: Exception) -> ApiError:
    """A failure inside a reply as the client sees it: theirs (400) or ours (500)."""
    if isinstance(exc, (UsageError, ContextFullError)):
        return ApiError(400, str(exc), code="context_length_exceeded"
                        if isinstance(exc, ContextFullError) else None)
    if isinstance(exc, QwenchatError):
        return ApiError(500, str(exc))
    return ApiError(500, f"{type(exc).__name__}: {exc}")


# --- one reply at a time -------------------------------------------------------------------

# The engine's thread hands its events to the event loop in batches this often, not a token at
# a time: each handoff wakes the loop, which then takes Python's lock from the engine's thread,
# and a token at a time that slowed the tiny test model's decode from 3,800 to 120 tok/s. The
# loop still writes a chunk for each piece of text (about a token), as other servers do, so
# that a client counting chunks counts tokens.
HANDOFF_S = 0.02

_END = object()


@dataclass
class Job:
    """A request's reply: run on the engine's thread, its events handed to the event loop."""

    run: Callable[[threading.Event, float], Iterator[Event]]  # (cancel, started_at)
    ahead: int  # replies queued or running when it came
    loop: asyncio.AbstractEventLoop
    out: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancel: threading.Event = field(default_factory=threading.Event)
    queued_at: float = field(default_factory=now)
    started_at: float | None = None

    def put(self, item: object) -> None:
        with contextlib.suppress(RuntimeError):  # the loop closed: the server is stopping
            self.loop.call_soon_threadsafe(self.out.put_nowait, item)

    @property
    def waited_s(self) -> float:
        return (self.started_at or now()) - self.queued_at


class Scheduler:
    """The engine's batch is 1: replies run one after another, on one thread, first come
    first served."""

    def __init__(self) -> None:
        self._queue: queue.Queue[Job | None] = queue.Queue()
        self._lock = threading.Lock()
        self._pending = 0
        self._thread = threading.Thread(target=self._work, name="qwenchat-serve", daemon=True)
        self._thread.start()

    def submit(self, run: Callable[[threading.Event, float], Iterator[Event]]) -> Job:
        loop = asyncio.get_running_loop()
        with self._lock:  # `ahead` and the queue's order agree
            job = Job(run, self._pending, loop)
            self._pending += 1
            self._queue.put(job)
        return job

    @property
    def pending(self) -> int:
        """Replies queued or running."""
        return self._pending

    def close(self) -> None:
        self._queue.put(None)

    def _work(self) -> None:
        while (job := self._queue.get()) is not None:
            batch: list[object] = []
            try:
                if not job.cancel.is_set():  # a client gone while it waited is skipped
                    job.started_at = flushed = now()
                    texts = 0
                    for event in job.run(job.cancel, job.started_at):
                        if isinstance(event, Progress) and not event.final:
                            continue
                        batch.append(event)
                        texts += isinstance(event, TextPiece)
                        # (the first text at once, for the time to first token; then batches)
                        first_text = isinstance(event, TextPiece) and texts == 1
                        if first_text or now() - flushed >= HANDOFF_S:
                            job.put(batch)
                            batch, flushed = [], now()
            except Exception as exc:  # the request fails; the server goes on
                batch.append(exc)
            finally:
                with self._lock:
                    self._pending -= 1
                if batch:
                    job.put(batch)
                job.put(_END)


# --- stop strings --------------------------------------------------------------------------


class StopMatcher:
    """Cuts streamed text before the first stop string, holding back a tail that could begin
    one until the next piece decides."""

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.stopped = False
        self._held = ""

    def push(self, text: str) -> str:
        if self.stopped:
            return ""
        text = self._held + text
        found = [at for at in (text.find(s) for s in self.stops) if at >= 0]
        if found:
            self.stopped, self._held = True, ""
            return text[: min(found)]
        keep = next((k for k in range(min(len(text), self._longest() - 1), 0, -1)
                     if any(s.startswith(text[-k:]) for s in self.stops)), 0)
        self._held = text[len(text) - keep:]
        return text[: len(text) - keep]

    def flush(self) -> str:
        held, self._held = self._held, ""
        return held

    def _longest(self) -> int:
        return max((len(s) for s in self.stops), default=0)


# --- request parsing -----------------------------------------------------------------------


def sampling_params(body: dict[str, Any], defaults: SamplingParams) -> SamplingParams:
    """The request's sampling fields over the mode's defaults, in the CLI's ranges."""
    changes: dict[str, Any] = {}
    for name in SAMPLING_FIELDS:
        value = body.get(name)
        if value is None:
            continue
        if name == "top_k" and value == -1:
            value = 0  # vLLM's and llama.cpp's spelling of "off"
        changes[name] = _checked(name, name, value)
    for key in ("max_completion_tokens", "max_tokens"):
        if body.get(key) is not None:
            changes["max_tokens"] = _checked("max_tokens", key, body[key])
            break
    return defaults.with_updates(**changes)


def _checked(name: str, key: str, value: Any) -> Any:
    try:
        check_value(name, value)
    except UsageError:
        raise ApiError(400, f"{key} must be {RANGES[name][4]}; got {json.dumps(value)}",
                       param=key) from None
    return value


def chat_messages(body: dict[str, Any]) -> tuple[str | None, list[Message]]:
    """The leading system message apart, then the turns; the last must be the user's."""
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise ApiError(400, "messages is required: a list of {role, content} objects",
                       param="messages")
    messages = []
    for i, item in enumerate(raw):
        role = item.get("role") if isinstance(item, dict) else None
        if role == "developer":
            role = "system"
        if role not in ROLES:
            raise ApiError(400, f"messages[{i}].role must be one of {', '.join(ROLES)}",
                           param=f"messages[{i}].role")
        text = _content_text(item.get("content"), f"messages[{i}].content")
        messages.append(Message(role, text))
    system = messages.pop(0).content if messages[0].role == "system" else None
    if not messages or messages[-1].role != "user" or not messages[-1].content.strip():
        raise ApiError(400, "the last message must be the user's, with some text",
                       param="messages")
    return system, messages


def _content_text(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, list):  # content parts: text only
        if not all(isinstance(p, dict) and p.get("type") == "text"
                   and isinstance(p.get("text"), str) for p in content):
            raise ApiError(400, f"{where}: only text content parts are supported", param=where)
        content = "".join(p["text"] for p in content)
    if not isinstance(content, str):
        raise ApiError(400, f"{where} must be a string", param=where)
    try:
        check_text(content, where)
    except UsageError as exc:
        raise ApiError(400, str(exc), param=where) from None
    return content


def completion_prompt(body: dict[str, Any]) -> str:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt:
        raise ApiError(400, "prompt is required: a non-empty string (one prompt a request)",
                       param="prompt")
    try:
        check_text(prompt, "prompt")
    except UsageError as exc:
        raise ApiError(400, str(exc), param="prompt") from None
    return prompt


def stop_strings(body: dict[str, Any]) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if (not isinstance(stops, list) or len(stops) > MAX_STOPS
            or not all(isinstance(s, str) for s in stops)):
        raise ApiError(400, f"stop must be a string or a list of at most {MAX_STOPS} strings",
                       param="stop")
    return stops


def enable_thinking(body: dict[str, Any]) -> bool:
    kwargs = body.get("chat_template_kwargs") or {}
    value = kwargs.get("enable_thinking", False) if isinstance(kwargs, dict) else None
    if not isinstance(value, bool):
        raise ApiError(400, "chat_template_kwargs.enable_thinking must be true or false",
                       param="chat_template_kwargs")
    return value


def stream_flags(body: dict[str, Any]) -> tuple[bool, bool]:
    stream, options = body.get("stream", False), body.get("stream_options") or {}
    if not isinstance(stream, bool):
        raise ApiError(400, "stream must be true or false", param="stream")
    usage = options.get("include_usage", False) if isinstance(options, dict) else None
    if not isinstance(usage, bool):
        raise ApiError(400, "stream_options.include_usage must be true or false",
                       param="stream_options")
    return stream, usage


def check_n(body: dict[str, Any]) -> None:
    n = body.get("n")
    if n is not None and n != 1:
        raise ApiError(400, f"n must be 1 (one reply a request: the engine decodes one "
                       f"sequence at a time); got {json.dumps(n)}", param="n")


async def read_json(request: Request) -> dict[str, Any]:
    length = request.headers.get("content-length")
    if length and length.isdigit() and int(length) > MAX_BODY_BYTES:
        raise _too_large()
    data = bytearray()
    async for chunk in request.stream():
        data += chunk
        if len(data) > MAX_BODY_BYTES:
            raise _too_large()
    try:
        body = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ApiError(400, f"the body is not valid JSON ({exc})") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object")
    return body


def _too_large() -> ApiError:
    return ApiError(413, f"the body is over {MAX_BODY_BYTES // (1024 * 1024)} MB",
                    code="request_too_large")


# --- the service ---------------------------------------------------------------------------


@dataclass
class Outcome:
    """How a reply went, filled in as its events arrive."""

    stats: ReplyStats = field(default_factory=ReplyStats)
    stopped_by_string: bool = False
    notes: list[str] = field(default_factory=list)

    @property
    def finish_reason(self) -> str:
        if self.stopped_by_string:
            return "stop"
        return FINISH_REASONS.get(self.stats.stop_reason or "", "stop")

    def usage(self) -> dict[str, int]:
        prompt, completion = self.stats.prompt_tokens, self.stats.generated_tokens
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion}


@dataclass
class Call:
    """One request being answered: what the responses carry and the log line needs."""

    endpoint: str
    chat: bool
    model: str
    job: Job | None = None
    stops: list[str] = field(default_factory=list)
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:24])
    created: int = field(default_factory=lambda: int(time.time()))
    outcome: Outcome = field(default_factory=Outcome)

    def chunk(self, delta: dict[str, Any] | None = None, finish: str | None = None,
              usage: dict[str, int] | None = None) -> str:
        if self.chat:
            choices = ([] if delta is None else
                       [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}])
            record = {"id": f"chatcmpl-{self.id}", "object": "chat.completion.chunk"}
        else:
            choices = ([] if delta is None else [{"index": 0, "text": delta.get("content", ""),
                                                  "logprobs": None, "finish_reason": finish}])
            record = {"id": f"cmpl-{self.id}", "object": "text_completion"}
        record.update(created=self.created, model=self.model, choices=choices)
        if usage is not None:
            record["usage"] = usage
        return f"data: {json.dumps(record, ensure_ascii=False)}\n\n"

    def whole(self, answer: str, thinking: str) -> dict[str, Any]:
        finish = self.outcome.finish_reason
        if self.chat:
            message = {"role": "assistant", "content": answer,
                       "reasoning_content": thinking or None}
            choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": finish}
            head = {"id": f"chatcmpl-{self.id}", "object": "chat.completion"}
        else:
            choice = {"index": 0, "text": answer, "logprobs": None, "finish_reason": finish}
            head = {"id": f"cmpl-{self.id}", "object": "text_completion"}
        return {**head, "created": self.created, "model": self.model, "choices": [choice],
                "usage": self.outcome.usage()}


class Service:
    """The endpoints, over one model and its scheduler."""

    def __init__(self, model: ServedModel, api_key: str | None,
                 say: Callable[[str], None]):
        self.model = model
        self.api_key = api_key
        self.say = say
        self.scheduler = Scheduler()

    def close(self) -> None:
        self.scheduler.close()

    async def health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def models(self, request: Request) -> Response:
        return await self._guarded(request, self._models)

    async def chat(self, request: Request) -> Response:
        return await self._guarded(request, self._chat)

    async def completions(self, request: Request) -> Response:
        return await self._guarded(request, self._completions)

    async def _guarded(self, request: Request,
                       handler: Callable[[Request, Call], Any]) -> Response:
        call = Call(f"{request.method} {request.url.path}", chat=False,
                    model=self.model.names[0])
        try:
            self._authorize(request)
            return await handler(request, call)
        except ApiError as exc:
            self._log(call, exc.status)
            return exc.response()
        except Exception as exc:  # a request never takes the server down
            error = from_qwenchat_error(exc)
            self._log(call, error.status)
            return error.response()

    def _authorize(self, request: Request) -> None:
        if self.api_key is None:
            return
        given = request.headers.get("authorization", "")
        scheme, _, key = given.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(key.strip().encode(),
                                                                 self.api_key.encode()):
            raise ApiError(401, "a valid API key is required: send the header "
                           "Authorization: Bearer <key> (the server's --api-key)",
                           code="invalid_api_key")

    async def _models(self, request: Request, call: Call) -> Response:
        self._log(call, 200)
        return JSONResponse({"object": "list", "data": [
            {"id": self.model.names[0], "object": "model", "created": call.created,
             "owned_by": "qwenchat"}]})

    def _check_model(self, body: dict[str, Any]) -> None:
        name = body.get("model")
        if name is not None and name not in self.model.names:
            raise ApiError(404, f"model {json.dumps(name)} is not served here; this server "
                           f"serves {self.model.names[0]!r} (see GET /v1/models)",
                           param="model", code="model_not_found")

    def _common(self, body: dict[str, Any], call: Call, thinking: bool
                ) -> tuple[SamplingParams, bool, bool]:
        self._check_model(body)
        check_n(body)
        defaults = generation_defaults(self.model.directory, thinking)
        params = sampling_params(body, defaults)
        call.stops = stop_strings(body)
        stream, usage = stream_flags(body)
        return params, stream, usage

    def _check_length(self, tokens: int) -> None:
        capacity = self.model.engine.capacity
        if tokens >= capacity:
            raise ApiError(400, f"the prompt is {tokens} tokens but the context holds "
                           f"{capacity}: shorten it, or restart the server with a larger --ctx",
                           param="messages", code="context_length_exceeded")

    async def _chat(self, request: Request, call: Call) -> Response:
        call.chat = True
        body = await read_json(request)
        thinking = enable_thinking(body)
        params, stream, usage = self._common(body, call, thinking)
        system, messages = chat_messages(body)
        model = self.model
        context = ([Message("system", system)] if system else []) + messages
        # (encoded once: the session's rendering of the same conversation reuses it)
        text = model.tokenizer.render(context, thinking)
        ids, cuts = model.tokenizer.encode_with_cuts(text)
        self._check_length(len(ids))

        def run(cancel: threading.Event, started_at: float) -> Iterator[Event]:
            session = model.session(params, system, thinking)
            session.messages = messages[:-1]
            session.remember_encoding(text, ids, cuts)
            return session.send(messages[-1].content, cancel, sent_at=started_at)

        return await self._answer(request, call, run, stream, usage)

    async def _completions(self, request: Request, call: Call) -> Response:
        body = await read_json(request)
        params, stream, usage = self._common(body, call, thinking=False)
        prompt = completion_prompt(body)
        model = self.model
        self._check_length(len(model.tokenizer.encode(prompt)))

        def run(cancel: threading.Event, started_at: float) -> Iterator[Event]:
            return model.session(params).complete(prompt, cancel, sent_at=started_at)

        return await self._answer(request, call, run, stream, usage)

    async def _answer(self, request: Request, call: Call,
                      run: Callable[[threading.Event, float], Iterator[Event]],
                      stream: bool, usage: bool) -> Response:
        call.job = self.scheduler.submit(run)
        headers = {QUEUE_HEADER: str(call.job.ahead)}
        if stream:  # (a client gone mid-stream: _sse's finally)
            return StreamingResponse(self._sse(call, usage), media_type="text/event-stream",
                                     headers={**headers, "cache-control": "no-cache"})
        answer, thinking = [], []
        # A client that leaves before its whole reply (a timeout, Ctrl+C) frees the engine
        # within a step: nothing else would tell this handler until the reply had ended.
        gone = asyncio.create_task(_cancel_when_gone(request, call.job))
        try:
            async with contextlib.aclosing(self._pieces(call)) as pieces:
                async for piece in pieces:
                    (thinking if piece.kind == "thinking" else answer).append(piece.text)
        except Exception as exc:
            error = from_qwenchat_error(exc)
            self._log(call, error.status)
            return error.response(headers)
        finally:
            gone.cancel()
            call.job.cancel.set()  # gone or done: the engine moves on within a step
        if gone.done() and not gone.cancelled():
            self._log(call, "client gone")
            return Response(status_code=499)  # (no one reads it)
        self._log(call, 200)
        return JSONResponse(call.whole("".join(answer), "".join(thinking).rstrip("\n")),
                            headers=headers)

    async def _sse(self, call: Call, usage: bool) -> AsyncIterator[str]:
        status: int | str = "client gone"
        try:
            if call.chat:
                yield call.chunk({"role": "assistant", "content": ""})
            async with contextlib.aclosing(self._pieces(call)) as pieces:
                async for piece in pieces:
                    key = "reasoning_content" if piece.kind == "thinking" else "content"
                    yield call.chunk({key: piece.text})
            yield call.chunk({}, call.outcome.finish_reason)
            if usage:
                yield call.chunk(usage=call.outcome.usage())
            status = 200
        except Exception as exc:  # the headers are gone: the error travels as an event
            error = from_qwenchat_error(exc)
            status = error.status
            yield f"data: {json.dumps(error.body(), ensure_ascii=False)}\n\n"
        finally:
            assert call.job is not None
            call.job.cancel.set()  # a client gone mid-stream frees the engine within a step
            self._log(call, status)
        yield "data: [DONE]\n\n"

    async def _pieces(self, call: Call) -> AsyncIterator[TextPiece]:
        """The reply's text as it comes, answer cut at the first stop string."""
        assert call.job is not None
        job, outcome, matcher = call.job, call.outcome, StopMatcher(call.stops)
        while (batch := await job.out.get()) is not _END:
            for item in batch:
                if isinstance(item, Exception):
                    raise item
                if isinstance(item, Progress):
                    outcome.stats = item.stats
                elif isinstance(item, TurnsDropped):
                    outcome.notes.append(item.message)
                elif isinstance(item, TextPiece):
                    if item.kind == "thinking":
                        if not matcher.stopped:
                            yield item
                        continue
                    text = matcher.push(item.text)
                    if matcher.stopped and not outcome.stopped_by_string:
                        outcome.stopped_by_string = True
                        job.cancel.set()
                    if text:
                        yield TextPiece(text, "answer")
        if tail := matcher.flush():
            yield TextPiece(tail, "answer")

    def _log(self, call: Call, status: int | str) -> None:
        self.say(log_line(call, status))


async def _cancel_when_gone(request: Request, job: Job) -> None:
    """Cancel `job` once the client has gone (the request's body is read: what the server
    receives next is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    job.cancel.set()


def log_line(call: Call, status: int | str) -> str:
    """llama-server's request line: what ran, tokens in and out, TTFT, speed, queue wait."""
    parts = [f"{time.strftime('%H:%M:%S')} {call.endpoint} {status}"]
    if call.job is not None:
        stats = call.outcome.stats
        ttft = f"{stats.ttft_s * 1000:.0f} ms" if stats.ttft_s is not None else "–"
        rate = f"{stats.decode_tok_s:.1f} tok/s" if stats.decode_tok_s else "– tok/s"
        parts += [f"in {stats.prompt_tokens} ({stats.reused_tokens} reused)",
                  f"out {stats.generated_tokens}", f"TTFT {ttft}", rate,
                  f"queue {call.job.ahead} ahead, {call.job.waited_s * 1000:.0f} ms",
                  f"finish {call.outcome.finish_reason}", *call.outcome.notes]
    return " · ".join(parts)


async def _route_error(request: Request, exc: Exception) -> Response:
    status = exc.status_code if isinstance(exc, HTTPException) else 500
    message = {404: f"no such endpoint: {request.method} {request.url.path} (see the "
                    "README's qwenchat serve section)",
               405: f"{request.method} is not allowed on {request.url.path}"}
    return ApiError(status, message.get(status, "internal error")).response()


def build_app(model: ServedModel, api_key: str | None = None,
              say: Callable[[str], None] = lambda _: None) -> tuple[Starlette, Service]:
    service = Service(model, api_key, say)
    routes = [Route("/health", service.health, methods=["GET"]),
              Route("/v1/models", service.models, methods=["GET"]),
              Route("/v1/chat/completions", service.chat, methods=["POST"]),
              Route("/v1/completions", service.completions, methods=["POST"])]
    app = Starlette(routes=routes, exception_handlers={HTTPException: _route_error})
    return app, service


# --- the command ---------------------------------------------------------------------------


def listen(host: str, port: int) -> socket.socket:
    """The server's socket, bound before the model loads so a taken port fails at once."""
    if not 0 <= port <= 65535:
        raise UsageError(f"--port must be from 0 to 65535; got {port}")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise UsageError(f"--host {host!r} is not an address here ({exc.strerror})") from None
    family, kind, proto, _, address = infos[0]
    # With its protocol named (IPPROTO_TCP), asyncio turns Nagle's algorithm off on every
    # connection it accepts (it checks the socket's proto), and TCP_NODELAY here is inherited
    # by them too: otherwise a streamed chunk written right after the headers waits for the
    # client's delayed ACK, up to 40 ms of first-token latency (docs/perf.md).
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        sock.bind(address)
        sock.listen(128)
    except OSError as exc:
        sock.close()
        raise QwenchatError(f"cannot listen on {host}:{port} ({exc.strerror}): pick another "
                            "--port, or stop what holds it") from None
    return sock


def run_serve(options: ServeOptions, err: TextIO = sys.stderr) -> int:
    import uvicorn

    from qwenchat.engine import create_engine
    from qwenchat.engine.speculate import check_speculate, start_speculation
    from qwenchat.model.loader import open_model

    options.check_engine_flags()
    check_speculate(options.speculate, options.draft)

    def say(message: str) -> None:
        err.write(f"qwenchat: {message}\n")
        err.flush()

    sock = listen(options.host, options.port)
    model = open_model(options.model, tokenizer_in_background=True)
    # (megakernel_later left False: a seeded reply is the one `ask --seed` gives from the first)
    engine = create_engine(options.backend, options.roped(model.config), model.checkpoint,
                           options.ctx, notice=say, **options.engine_options())
    most, proposer = start_speculation(options.speculate, options.draft, model, engine, options,
                                       say, megakernel_later=False)
    names = tuple(dict.fromkeys((options.model, model.directory.name)))
    served = ServedModel(names, model.directory, engine, model.tokenizer, model.eos_ids, most,
                         proposer)
    app, service = build_app(served, options.api_key, say)
    host, port = sock.getsockname()[:2]
    say(f"serving {names[0]} ({engine.name}, {engine.capacity}-token context) on "
        f"http://{host}:{port}/v1{' (API key required)' if options.api_key else ''}")
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False,
                                           lifespan="off"))
    try:
        server.run(sockets=[sock])
    finally:
        service.close()
        if proposer is not None:
            proposer.close()
        engine.close()
    return 0
