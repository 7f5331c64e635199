"""`qwenchat serve`: the OpenAI API on the reference engine and a scripted one, in-process."""

from __future__ import annotations

import io
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from child_process import sigint_as_in_a_terminal
from fake_engine import fake_model
from served import Running

import qwenchat.serve as serve
from qwenchat.ask import AskOptions, run_ask
from qwenchat.engine import EngineFlags, create_engine
from qwenchat.model.loader import open_model
from qwenchat.serve import QUEUE_HEADER, ServedModel, StopMatcher


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    model = open_model(str(tiny_model_dir))
    engine = create_engine("cpu", model.config, model.checkpoint)
    running = Running(ServedModel(("tiny", str(tiny_model_dir)), model.directory, engine,
                                  model.tokenizer, model.eos_ids))
    yield running
    running.stop()


def scripted(model_dir, text: str, api_key: str | None = None, **engine_options) -> Running:
    loaded = fake_model(model_dir, text, **engine_options)
    return Running(ServedModel(("tiny",), model_dir, loaded.engine, loaded.tokenizer,
                               loaded.eos_ids), api_key)


@pytest.fixture
def scripted_server(tiny_model_dir):
    started: list[Running] = []

    def start(text: str, **options) -> Running:
        started.append(scripted(tiny_model_dir, text, **options))
        return started[-1]

    yield start
    for running in started:
        running.stop()


HELLO = [{"role": "user", "content": "Hello, how are you?"}]


def test_chat_answers_with_usage_and_streams_the_same_reply(tiny):
    client = tiny.client()
    whole = client.chat.completions.create(model="tiny", messages=HELLO, seed=3, max_tokens=12)
    choice = whole.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason in ("stop", "length")
    usage = whole.usage
    assert usage.prompt_tokens > 0 and 0 < usage.completion_tokens <= 12
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    chunks = list(client.chat.completions.create(
        model="tiny", messages=HELLO, seed=3, max_tokens=12, stream=True,
        stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == \
        usage.completion_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == choice.finish_reason
    assert any("POST /v1/chat/completions 200" in line and "TTFT" in line
               for line in tiny.lines)


def test_a_seeded_reply_is_the_one_ask_gives(tiny, tiny_model_dir):
    out = io.StringIO()
    options = AskOptions("Tell me about foxes.", str(tiny_model_dir), backend="cpu",
                         overrides={"seed": 1234, "max_tokens": 24})
    assert run_ask(options, out, io.StringIO()) == 0
    reply = tiny.client().chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Tell me about foxes."}],
        seed=1234, max_tokens=24)
    assert reply.choices[0].message.content == out.getvalue()[:-1]


@pytest.mark.parametrize("mode", ["ngram", "draft"])
def test_a_speculating_server_answers_as_a_plain_one(tiny, tiny_model_dir, mode):
    # (prompt lookup, or the model as its own draft: every reply is the plain reply)
    from qwenchat.engine.speculate import SPECULATE_MOST, open_draft

    model = open_model(str(tiny_model_dir))
    engine = create_engine("cpu", model.config, model.checkpoint)
    proposer = (open_draft(str(tiny_model_dir), model, engine, EngineFlags(backend="cpu"),
                           lambda _: None) if mode == "draft" else None)
    speculating = Running(ServedModel(("tiny",), model.directory, engine, model.tokenizer,
                                      model.eos_ids, SPECULATE_MOST, proposer))
    try:
        messages = [{"role": "user", "content": "Say the alphabet, twice: a b c d e f"}]
        for request in (dict(temperature=0), dict(seed=99)):
            plain = tiny.client().chat.completions.create(model="tiny", messages=messages,
                                                          max_tokens=40, **request)
            fast = speculating.client().chat.completions.create(model="tiny", messages=messages,
                                                                max_tokens=40, **request)
            assert fast.choices[0].message.content == plain.choices[0].message.content
            assert engine.speculation.passes > 0  # (the last reply's: it did speculate)
    finally:
        speculating.stop()


def test_completion_continues_the_prompt_streamed_or_not(tiny):
    client = tiny.client()
    whole = client.completions.create(model="tiny", prompt="The quick brown", max_tokens=8,
                                      temperature=0)
    assert whole.choices[0].finish_reason in ("stop", "length")
    assert 0 < whole.usage.completion_tokens <= 8
    streamed = client.completions.create(model="tiny", prompt="The quick brown", max_tokens=8,
                                         temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == whole.choices[0].text


def test_models_and_health(tiny):
    assert [m.id for m in tiny.client().models.list()] == ["tiny"]
    health = httpx.get(tiny.url + "/health")
    assert health.status_code == 200 and health.json() == {"status": "ok"}


def test_a_prompt_that_extends_the_last_reuses_its_cache(tiny):
    client = tiny.client()
    first = client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=6)
    follow = [*HELLO, {"role": "assistant", "content": first.choices[0].message.content},
              {"role": "user", "content": "And then?"}]
    second = client.chat.completions.create(model="tiny", messages=follow, max_tokens=6)
    reused = int(tiny.lines[-1].split(" · in ")[1].split("(")[1].split(" ")[0])
    # (all but the generation prompt: the template renders an earlier reply without the
    # empty think block its generation prompt began with)
    assert reused >= first.usage.prompt_tokens - 8
    assert second.usage.prompt_tokens > first.usage.prompt_tokens


def test_a_chat_request_tokenizes_its_conversation_once(scripted_server, monkeypatch):
    """The length check's encoding is the session's: for the first token's time, a long
    prompt is not tokenized twice (only what follows its last special token is again)."""
    from qwenchat.model.tokenizer import Tokenizer

    running = scripted_server("Fine.")
    encoded: list[int] = []
    for name in ("encode", "encode_with_cuts"):
        real = getattr(Tokenizer, name)
        monkeypatch.setattr(Tokenizer, name, lambda self, text, real=real: (
            encoded.append(len(text)), real(self, text))[1])
    message = "Tell me about the weather. " * 80
    reply = running.client().chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": message}], max_tokens=4)
    assert reply.choices[0].message.content
    assert len(message) < sum(encoded) < len(message) + 400, encoded


@pytest.mark.parametrize("think", [True, False])
def test_thinking_comes_apart_from_the_answer_when_asked_for(scripted_server, think):
    text = "<think>Let me think.</think>The answer." if think else "The answer."
    client = scripted_server(text).client()
    extra = {"chat_template_kwargs": {"enable_thinking": think}}
    whole = client.chat.completions.create(model="tiny", messages=HELLO, extra_body=extra)
    message = whole.choices[0].message
    assert message.content == "The answer."
    assert getattr(message, "reasoning_content", None) == ("Let me think." if think else None)
    chunks = list(client.chat.completions.create(model="tiny", messages=HELLO, stream=True,
                                                 extra_body=extra))
    deltas = [c.choices[0].delta for c in chunks]
    reasoning = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
    assert "".join(d.content or "" for d in deltas) == "The answer."
    assert reasoning == ("Let me think." if think else "")


def test_every_sampling_parameter_reaches_the_engine(scripted_server):
    running = scripted_server("Fine, thanks.")
    openai_ones = dict(temperature=0.5, top_p=0.9, presence_penalty=0.5,
                       frequency_penalty=-0.5, seed=99)
    extra = dict(top_k=7, min_p=0.05, repetition_penalty=1.1)
    reply = running.client().chat.completions.create(
        model="tiny", messages=HELLO, max_completion_tokens=3, n=1, **openai_ones,
        extra_body={**extra, "max_tokens": 50})  # max_completion_tokens wins
    assert reply.usage.completion_tokens == 3 and reply.choices[0].finish_reason == "length"
    seen = running.model.engine.seen[-1]
    values = {**openai_ones, **extra}
    assert {name: getattr(seen, name) for name in values} == values


@pytest.mark.parametrize("stop", ["is 4", ["nothing", "is 4"]])
def test_a_stop_string_cuts_the_reply_before_it(scripted_server, stop):
    client = scripted_server("The answer is 42. Done.", eos=False).client()
    whole = client.chat.completions.create(model="tiny", messages=HELLO, stop=stop,
                                           max_tokens=50)
    assert whole.choices[0].message.content == "The answer "
    assert whole.choices[0].finish_reason == "stop"
    chunks = list(client.chat.completions.create(model="tiny", messages=HELLO, stop=stop,
                                                 max_tokens=50, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "The answer "


def test_stop_matcher_holds_back_only_what_could_begin_a_stop():
    matcher = StopMatcher(["END"])
    assert matcher.push("abc E") == "abc "
    assert matcher.push("x") == "Ex"
    assert matcher.push("yE") == "y"
    assert matcher.push("N") == ""
    assert matcher.push("Dtail") == "" and matcher.stopped


def error_of(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


@pytest.mark.parametrize(("body", "param"), [
    ({"model": "tiny"}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ({"messages": HELLO, "n": 2}, "n"),
    ({"messages": HELLO, "temperature": 3}, "temperature"),
    ({"messages": HELLO, "top_p": 0}, "top_p"),
    ({"messages": HELLO, "seed": -1}, "seed"),
    ({"messages": HELLO, "max_tokens": 0}, "max_tokens"),
    ({"messages": HELLO, "stop": 5}, "stop"),
    ({"messages": HELLO, "stream": "yes"}, "stream"),
    ({"messages": [{"role": "user", "content": "word " * 700}]}, "messages"),
])
def test_a_bad_chat_request_is_a_400_naming_the_parameter(tiny, body, param):
    assert error_of(tiny.post("/v1/chat/completions", body), 400)["param"] == param


def test_bad_json_unknown_paths_models_and_big_bodies_get_json_errors(tiny, monkeypatch):
    assert error_of(tiny.post("/v1/chat/completions", b"{not json"), 400)
    assert error_of(tiny.post("/v1/completions", {"prompt": ""}), 400)["param"] == "prompt"
    assert error_of(httpx.get(tiny.url + "/v1/nothing"), 404)
    unknown = tiny.post("/v1/chat/completions", {"model": "gpt-9", "messages": HELLO})
    assert error_of(unknown, 404)["code"] == "model_not_found"
    monkeypatch.setattr(serve, "MAX_BODY_BYTES", 1000)
    big = {"messages": [{"role": "user", "content": "x" * 2000}]}
    assert error_of(tiny.post("/v1/chat/completions", big), 413)


def test_an_engine_failure_is_a_500_and_the_next_request_works(scripted_server, monkeypatch):
    running = scripted_server("Fine.")
    engine = running.model.engine

    def broken(ids):
        raise RuntimeError("the device fell over")

    monkeypatch.setattr(engine, "prefill", broken)
    error = error_of(running.post("/v1/chat/completions", {"messages": HELLO}), 500)
    assert "the device fell over" in error["message"]
    monkeypatch.undo()
    assert running.post("/v1/chat/completions", {"messages": HELLO}).status_code == 200


def test_an_api_key_is_required_when_set(tiny_model_dir):
    running = scripted(tiny_model_dir, "Fine.", api_key="sekret")
    try:
        assert error_of(running.post("/v1/chat/completions", {"messages": HELLO}), 401)
        wrong = running.post("/v1/chat/completions", {"messages": HELLO},
                             headers={"authorization": "Bearer nope"})
        assert error_of(wrong, 401)["code"] == "invalid_api_key"
        reply = running.client("sekret").chat.completions.create(model="tiny", messages=HELLO)
        assert reply.choices[0].message.content == "Fine."
        assert httpx.get(running.url + "/health").status_code == 200
    finally:
        running.stop()


def test_eight_clients_at_once_are_answered_in_order_none_lost(scripted_server):
    running = scripted_server("One two three four five.", hold_at=0)
    engine = running.model.engine
    results: dict[int, tuple[int, str]] = {}

    def ask(i: int) -> None:
        messages = [{"role": "user", "content": f"Hello {i}, how are you?"}]
        response = running.post("/v1/chat/completions", {"messages": messages})
        results[i] = (int(response.headers[QUEUE_HEADER]),
                      response.json()["choices"][0]["message"]["content"])

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 10
    while running.service.scheduler.pending < 8 and time.monotonic() < deadline:
        time.sleep(0.01)
    while any(t.is_alive() for t in threads) and time.monotonic() < deadline:
        engine.release.set()  # each reply holds at its first step until released
        time.sleep(0.005)
    for thread in threads:
        thread.join(5)
    assert len(results) == 8
    assert {text for _, text in results.values()} == {"One two three four five."}
    by_place = sorted(range(8), key=lambda i: results[i][0])
    assert [results[i][0] for i in by_place] == list(range(8))
    # Answered in that order: the engine's replies began with the clients' prompts in turn.
    # (The server's order, not the clients' clocks: a client's thread may note its answer
    # after a later one's on a busy machine.)
    decoded = [running.model.tokenizer.decode(prompt) for prompt in engine.prompts]
    served = [next(i for i in range(8) if f"Hello {i}," in text) for text in decoded]
    assert served == by_place


def test_a_client_gone_mid_stream_frees_the_server(scripted_server):
    running = scripted_server("and on ", eos=False, rate=100)
    body = {"messages": HELLO, "stream": True, "max_tokens": 100_000}
    with httpx.stream("POST", running.url + "/v1/chat/completions", json=body) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
        assert next(lines) == ""
    began = time.monotonic()
    reply = running.post("/v1/chat/completions", {"messages": HELLO, "max_tokens": 3})
    assert reply.status_code == 200 and time.monotonic() - began < 2
    assert any("client gone" in line for line in running.lines)


def test_a_client_gone_before_a_whole_reply_frees_the_server(scripted_server):
    """Not streamed: the client gives up (a timeout, Ctrl+C) while the reply is decoded."""
    running = scripted_server("and on ", eos=False, rate=100)
    with pytest.raises(httpx.TimeoutException):
        httpx.post(running.url + "/v1/chat/completions",
                   json={"messages": HELLO, "max_tokens": 100_000}, timeout=0.5)
    began = time.monotonic()
    reply = running.post("/v1/chat/completions", {"messages": HELLO, "max_tokens": 3})
    assert reply.status_code == 200 and time.monotonic() - began < 2
    gone = [line for line in running.lines if "client gone" in line]
    assert len(gone) == 1 and " · out 100000 · " not in gone[0]


def test_a_client_gone_as_soon_as_it_asked_frees_the_server(scripted_server):
    """Streamed: the connection closes right after the request, before any response."""
    running = scripted_server("and on ", eos=False, rate=100)
    host, port = running.url.removeprefix("http://").split(":")
    body = json.dumps({"messages": HELLO, "stream": True, "max_tokens": 100_000}).encode()
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                     b"Content-Type: application/json\r\n"
                     + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    began = time.monotonic()
    reply = running.post("/v1/chat/completions", {"messages": HELLO, "max_tokens": 3})
    assert reply.status_code == 200 and time.monotonic() - began < 2
    assert any("client gone" in line for line in running.lines)


SCRIPT = Path(sys.executable).parent / "qwenchat"


def start_command(*args: str) -> subprocess.Popen:
    return subprocess.Popen([str(SCRIPT), "serve", *args], stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"},
                            preexec_fn=sigint_as_in_a_terminal)


def test_the_command_serves_until_interrupted(tiny_model_dir):
    process = start_command("-m", str(tiny_model_dir), "--backend", "cpu", "--port", "0")
    try:
        line = process.stderr.readline()
        assert line.startswith("qwenchat: serving "), line + process.stderr.read()
        url = line.split(" on ")[1].split()[0]
        assert httpx.get(url.removesuffix("/v1") + "/health", timeout=10).status_code == 200
    finally:
        process.send_signal(signal.SIGINT)
        _, err = process.communicate(timeout=10)
    assert process.returncode == 130 and "Traceback" not in err  # as `ask` ends on Ctrl-C


@pytest.mark.parametrize(("args", "needle"), [
    (["--port", "{busy}"], "pick another --port"),
    (["-m", "/no/such/model"], "/no/such/model"),
    (["--backend", "tpu"], "--backend must be one of"),
])
def test_a_startup_error_is_one_line_and_a_failing_exit(tiny_model_dir, args, needle):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = str(busy.getsockname()[1])
        args = [a.replace("{busy}", port) for a in args]
        process = start_command("-m", str(tiny_model_dir), "--backend", "cpu", *args)
        _, err = process.communicate(timeout=30)
    assert process.returncode != 0
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("qwenchat: error:") and needle in lines[0]


def test_the_servers_connections_send_small_writes_at_once():
    """Every connection the server accepts has Nagle's algorithm off (TCP_NODELAY), as asyncio
    (uvicorn's loop) sets it only on sockets whose protocol is TCP: a streamed chunk written
    right after the headers then goes out at once instead of waiting for the client's delayed
    ACK (up to 40 ms of first-token latency, measured locally before the fix)."""
    import asyncio

    sock = serve.listen("127.0.0.1", 0)
    seen: list[int] = []

    class Probe(asyncio.Protocol):
        def connection_made(self, transport):
            accepted = transport.get_extra_info("socket")
            seen.append(accepted.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            transport.close()

    async def accept_one() -> None:
        server = await asyncio.get_running_loop().create_server(Probe, sock=sock)
        async with server:
            reader, writer = await asyncio.open_connection(*sock.getsockname()[:2])
            await reader.read()  # until the server closes it
            writer.close()

    try:
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
        asyncio.run(accept_one())
    finally:
        sock.close()
    assert seen and seen[0] != 0
