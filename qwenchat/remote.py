"""A conversation with a model on an OpenAI-compatible server: ChatSession's events, over HTTP."""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Collection, Iterator
from typing import TYPE_CHECKING, Any

from qwenchat.engine.base import StopReason
from qwenchat.errors import QwenchatError, UsageError
from qwenchat.model.tokenizer import Message
from qwenchat.sampling.params import LiveParams
from qwenchat.session import (
    PROGRESS_INTERVAL_S,
    Conversation,
    Event,
    Progress,
    Reply,
    ReplyStats,
    TextPiece,
    fresh_seed,
    now,
)

if TYPE_CHECKING:  # (httpx loads with the first server: local `ask` starts without it)
    import httpx

BACKEND = "openai"
CONNECT_TIMEOUT_S = 5.0
KV_UNAVAILABLE = "KV n/a (remote)"  # what the KV gauge says: a server does not report its cache
# OpenAI's finish reasons as the local engine's stop reasons.
STOP_REASONS = {"stop": StopReason.EOS.value, "length": StopReason.MAX_TOKENS.value}


def check_remote_flags(backend: str, url: str | None, api_key_env: str | None) -> None:
    """--url goes with --backend openai and nothing else; checked before anything connects."""
    if api_key_env and not url:
        raise UsageError("--api-key-env goes with --url: add the server's --url")
    if backend == BACKEND and not url:
        raise UsageError("--backend openai needs --url URL, the server's address "
                         "(e.g. --url http://127.0.0.1:8000)")
    if backend != BACKEND and url:
        raise UsageError(f"--url is for --backend openai (got --backend {backend}): add "
                         "--backend openai, or drop --url")
    if url and not url.startswith(("http://", "https://")):
        raise UsageError(f"--url must start with http:// or https://; got {url!r}")


class RemoteServer:
    """One OpenAI-compatible server: its models, and chat completions streamed from it."""

    def __init__(self, url: str, api_key_env: str | None = None):
        import httpx

        self.url = url.rstrip("/")
        self.api_key_env = api_key_env
        base = self.url if self.url.endswith("/v1") else f"{self.url}/v1"
        headers = {}
        if api_key_env:
            key = os.environ.get(api_key_env)
            if not key:
                raise UsageError(f"--api-key-env {api_key_env}: the variable is not set; "
                                 f"export {api_key_env}=<the server's key>")
            headers["Authorization"] = f"Bearer {key}"
        # No read timeout: a reply may wait in the server's queue, or think, for long.
        timeout = httpx.Timeout(None, connect=CONNECT_TIMEOUT_S)
        self._client = httpx.Client(base_url=base, headers=headers, timeout=timeout)

    def models(self) -> list[str]:
        """The model ids GET /v1/models lists."""
        response = self._request("GET", "/models")
        data = response.json().get("data") or []
        return [str(item.get("id")) for item in data if isinstance(item, dict)]

    def stream_chat(self, body: dict[str, Any], cancel: threading.Event
                    ) -> Iterator[dict[str, Any]]:
        """POST /v1/chat/completions streamed: each chunk's JSON. Stops once `cancel` is set,
        closing the connection (the server then stops the reply)."""
        import httpx

        try:
            with self._client.stream("POST", "/chat/completions", json=body) as response:
                if response.status_code >= 400:
                    response.read()
                    self._raise(response, body.get("model"))
                for line in response.iter_lines():
                    if cancel.is_set():
                        return
                    if not line.startswith("data:"):
                        continue
                    data = line[len("data:"):].strip()
                    if data == "[DONE]":
                        return
                    chunk = json.loads(data)
                    if "error" in chunk:  # failed after the headers went out
                        raise QwenchatError(f"the server at {self.url} failed the reply: "
                                            f"{_message(chunk)}")
                    yield chunk
        except httpx.TransportError as exc:
            raise self._unreachable(exc) from None

    def close(self) -> None:
        self._client.close()

    def _request(self, method: str, path: str) -> httpx.Response:
        import httpx

        try:
            response = self._client.request(method, path)
        except httpx.TransportError as exc:
            raise self._unreachable(exc) from None
        if response.status_code >= 400:
            self._raise(response, None)
        return response

    def _unreachable(self, exc: httpx.TransportError) -> QwenchatError:
        import httpx

        if isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout)):
            return QwenchatError(f"cannot reach {self.url}: {exc or type(exc).__name__}; "
                                 "is the server running?")
        return QwenchatError(f"the connection to {self.url} failed: "
                             f"{exc or type(exc).__name__}")

    def _raise(self, response: httpx.Response, model: str | None) -> None:
        status, message = response.status_code, _message(_json(response))
        if status == 401:
            if self.api_key_env:
                raise QwenchatError(f"{self.url} refused the key in ${self.api_key_env} (401): "
                                    f"set {self.api_key_env} to the server's key")
            raise QwenchatError(f"{self.url} wants an API key (401): put it in an environment "
                                "variable, e.g. export QWENCHAT_API_KEY=..., and pass "
                                "--api-key-env QWENCHAT_API_KEY")
        if status == 404 and model is not None:
            try:
                served = ", ".join(self.models()) or "none"
            except QwenchatError:  # no model list either: the address is wrong, say so
                raise QwenchatError(f"{self.url} answered 404: {message}") from None
            raise UsageError(f"{self.url} does not serve the model {model!r}; it serves: "
                             f"{served} (pass one with -m)")
        raise QwenchatError(f"{self.url} answered {status}: {message}")


def _json(response: httpx.Response) -> Any:
    try:
        return response.json()
    except ValueError:
        return response.text.strip()[:200] or response.reason_phrase


def _message(body: Any) -> str:
    """The server's own words: an OpenAI error body's message, else the body itself."""
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])
        if isinstance(error, str):
            return error
        if body.get("detail"):
            return str(body["detail"])
    return str(body)


class RemoteSession(Conversation):
    """What ChatSession offers ask and the chat, answered by a server: the history is kept
    here and sent whole with each turn, with the sampling values in force; the server's cache
    is its own, so nothing is prefilled ahead and the KV position is not known.

    Sampler changes made while a reply streams apply from the next request: a request's
    values cannot change once it is sent."""

    def __init__(self, server: RemoteServer, model: str, params: LiveParams,
                 system: str | None = None, thinking: bool = False,
                 send_fields: Collection[str] | None = None):
        super().__init__(params, system, thinking)
        self.server = server
        self.model = model
        # Sampling values sent (None: all of them; ask sends only those the user gave, so the
        # server's defaults, the model's own, apply to the rest). The seed always goes.
        self.send_fields = send_fields
        self.speculate = 0  # (proposals are verified by an engine: a server's own business)
        # (first_in_context stays 0: the server drops nothing, a prompt too long fails there)

    def set_speculate(self, most: int) -> None:
        """A server speculates (or not) by its own settings."""

    def prepare_next_turn(self, cancel: threading.Event) -> int:
        return 0  # the server's cache is its own

    def request_body(self, seed: int) -> dict[str, Any]:
        """The chat completion request for the conversation as it stands."""
        values = self.params.current.as_dict()
        sampling = {name: value for name, value in values.items()
                    if value is not None and (self.send_fields is None
                                              or name in self.send_fields)}
        return {"model": self.model, "stream": True, "stream_options": {"include_usage": True},
                "messages": [{"role": m.role, "content": m.content}
                             for m in self.context_messages()],
                "chat_template_kwargs": {"enable_thinking": self.thinking},
                **sampling, "seed": seed}

    def _reply(self, cancel: threading.Event, sent_at: float | None) -> Iterator[Event]:
        started = now() if sent_at is None else sent_at
        seed = self.params.current.seed
        stats = ReplyStats(seed=seed if seed is not None else fresh_seed())
        body = self.request_body(stats.seed)
        reply = Reply(stats=stats)
        first_at = last_report = 0.0
        stop: str | None = None
        failed = False  # the server refused or failed the turn: it leaves no reply behind
        try:
            for chunk in self.server.stream_chat(body, cancel):
                usage = chunk.get("usage")
                if isinstance(usage, dict):
                    stats.prompt_tokens = stats.prefill_tokens = usage.get("prompt_tokens", 0)
                    stats.generated_tokens = usage.get("completion_tokens",
                                                       stats.generated_tokens)
                for choice in chunk.get("choices") or []:
                    stop = choice.get("finish_reason") or stop
                    delta = choice.get("delta") or {}
                    for key, kind in (("reasoning_content", "thinking"), ("content", "answer")):
                        text = delta.get(key)
                        if not text:
                            continue
                        at = now()
                        if stats.ttft_s is None:
                            first_at, stats.ttft_s = at, at - started
                        # Tokens as chunks until the usage at the end counts them (servers
                        # send a chunk a token or so; one that sends more reads low here).
                        stats.generated_tokens += 1
                        stats.decode_s = at - first_at
                        piece = TextPiece(text, kind)
                        _append(reply, piece)
                        yield piece
                        if at - last_report >= PROGRESS_INTERVAL_S:
                            last_report = at
                            yield Progress(stats)
            cancelled = cancel.is_set() or stop is None
            stats.stop_reason = (StopReason.CANCELLED.value if cancelled
                                 else STOP_REASONS.get(stop or "", stop))
        except QwenchatError:
            failed = True
            raise
        finally:
            if not failed:
                if stats.stop_reason is None:  # interrupted from outside: keep what was shown
                    stats.stop_reason = StopReason.CANCELLED.value
                reply.thinking = reply.thinking.rstrip("\n")
                self.messages.append(Message("assistant", reply.answer))
                self.last_reply = reply
        yield Progress(stats, final=True)


def _append(reply: Reply, piece: TextPiece) -> None:
    if piece.kind == "thinking":
        reply.thinking += piece.text
    else:
        reply.answer += piece.text
