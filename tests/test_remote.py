"""`ask`, `info --url` and the chat on an OpenAI-compatible server: `qwenchat serve`, in-process."""

from __future__ import annotations

import asyncio
import io
import threading
import time

import pytest
from fake_engine import fake_model
from served import Running
from textual.widgets import Static
from typer.testing import CliRunner

from qwenchat.ask import AskOptions, run_ask
from qwenchat.cli import app
from qwenchat.engine import create_engine
from qwenchat.model.loader import open_model
from qwenchat.remote import RemoteServer, RemoteSession
from qwenchat.sampling.params import LiveParams, SamplingParams
from qwenchat.serve import ServedModel
from qwenchat.session import TextPiece
from qwenchat.tui.app import QwenchatApp
from qwenchat.tui.loader import remote_loader
from qwenchat.tui.options import ChatOptions
from qwenchat.tui.screens.chat import ChatScreen
from qwenchat.tui.widgets.message import AssistantMessage
from qwenchat.tui.widgets.status import KVGauge

PROMPT = "Tell me about foxes."
THOUGHT = "<think>\nThe user asks about foxes.\n</think>\n\nFoxes are quick."


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    model = open_model(str(tiny_model_dir))
    engine = create_engine("cpu", model.config, model.checkpoint)
    running = Running(ServedModel(("tiny", str(tiny_model_dir)), model.directory, engine,
                                  model.tokenizer, model.eos_ids), api_key=None)
    yield running
    running.stop()


@pytest.fixture(scope="module")
def thoughtful(tiny_model_dir):
    """A server whose scripted engine thinks, then answers, and wants an API key."""
    loaded = fake_model(tiny_model_dir, THOUGHT)
    running = Running(ServedModel(("tiny",), tiny_model_dir, loaded.engine, loaded.tokenizer,
                                  loaded.eos_ids), api_key="sesame")
    yield running
    running.stop()


def ask(model: str, backend: str = "openai", **options) -> str:
    out = io.StringIO()
    assert run_ask(AskOptions(PROMPT, model, backend=backend, **options), out,
                   io.StringIO()) == 0
    return out.getvalue()


def cli(*args: str, env: dict[str, str] | None = None):
    return CliRunner().invoke(app, list(args), env=env)


@pytest.mark.parametrize("overrides", [{"seed": 1234, "max_tokens": 24},
                                       {"temperature": 0.0, "max_tokens": 16},
                                       {"seed": 7, "max_tokens": 16, "top_k": 5, "min_p": 0.1}])
@pytest.mark.parametrize("think", [False, True])
def test_ask_on_the_server_prints_what_ask_on_the_cpu_prints(tiny, tiny_model_dir, overrides,
                                                             think):
    local = ask(str(tiny_model_dir), "cpu", overrides=overrides, think=think,
                show_thinking=True)
    assert ask("tiny", url=tiny.url, overrides=overrides, think=think,
               show_thinking=True) == local


def test_ask_shows_the_servers_reasoning_as_thinking(thoughtful, monkeypatch):
    monkeypatch.setenv("THE_KEY", "sesame")
    shown = ask("tiny", url=thoughtful.url, api_key_env="THE_KEY", think=True,
                show_thinking=True)
    assert shown == "<think>\nThe user asks about foxes.\n</think>\n\nFoxes are quick.\n"
    assert ask("tiny", url=thoughtful.url, api_key_env="THE_KEY", think=True) == \
        "Foxes are quick.\n"


def test_ask_json_and_verbose_say_the_kv_cache_is_not_known(tiny, capsys):
    out, err = io.StringIO(), io.StringIO()
    options = AskOptions(PROMPT, "tiny", backend="openai", url=tiny.url, as_json=True,
                         verbose=True, overrides={"seed": 3, "max_tokens": 8})
    assert run_ask(options, out, err) == 0
    assert '"backend": "openai"' in out.getvalue() and '"seed": 3' in out.getvalue()
    assert "KV n/a (remote)" in err.getvalue() and "8 tokens" in err.getvalue()


def test_info_url_lists_the_served_models_verbatim(tiny):
    result = cli("info", "--url", tiny.url)
    assert result.exit_code == 0, result.output
    assert result.output == "tiny\n"


@pytest.mark.parametrize("args, code, words", [
    (["ask", "hi", "--backend", "openai"], 2, "--backend openai needs --url URL"),
    (["ask", "hi", "--backend", "cpu", "--url", "http://127.0.0.1:9"], 2,
     "--url is for --backend openai"),
    (["chat", "--url", "http://127.0.0.1:9"], 2, "--url is for --backend openai"),
    (["info", "--api-key-env", "K"], 2, "--api-key-env goes with --url"),
    (["ask", "hi", "--backend", "openai", "--url", "http://127.0.0.1:9"], 1,
     "cannot reach http://127.0.0.1:9: "),
    (["info", "--url", "http://127.0.0.1:9"], 1, "is the server running?"),
])
def test_flag_and_connection_errors_are_one_line(args, code, words):
    result = cli(*args)
    assert result.exit_code == code, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("qwenchat: error: ") and words in lines[0]


def test_server_errors_are_one_line_naming_the_fix(tiny, thoughtful):
    def error(*args: str, env=None) -> tuple[int, str]:
        result = cli("ask", "hi", "--backend", "openai", *args, env=env)
        lines = result.output.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("qwenchat: error: "), result.output
        return result.exit_code, lines[0]

    code, line = error("--url", thoughtful.url, "-m", "tiny")
    assert code == 1 and "(401)" in line and "--api-key-env" in line
    code, line = error("--url", thoughtful.url, "-m", "tiny", "--api-key-env", "THE_KEY",
                       env={"THE_KEY": "wrong"})
    assert code == 1 and "set THE_KEY to the server's key" in line
    code, line = error("--url", thoughtful.url, "-m", "tiny", "--api-key-env", "UNSET_KEY_X")
    assert code == 2 and "UNSET_KEY_X: the variable is not set" in line
    code, line = error("--url", tiny.url, "-m", "nope")
    assert code == 2 and "does not serve the model 'nope'; it serves: tiny" in line
    code, line = error("--url", tiny.url + "/nowhere", "-m", "tiny")
    assert code == 1 and "answered 404" in line and "no such endpoint" in line


def test_the_chat_on_a_server_answers_and_labels_the_remote_engine(tiny, tmp_path,
                                                                   tiny_model_dir):
    options = ChatOptions("tiny", backend="openai", url=tiny.url, overrides={"seed": 5,
                                                                            "max_tokens": 12})
    expected = ask("tiny", url=tiny.url, overrides={"seed": 5, "max_tokens": 12})
    app_ = QwenchatApp(options, loader=remote_loader(options), history=tmp_path / "h.sqlite3")

    async def main() -> None:
        async with app_.run_test(size=(120, 32)) as pilot:
            await _until(pilot, lambda: isinstance(app_.screen, ChatScreen)
                         and app_.screen.is_mounted and app_.focused is app_.screen.prompt)
            screen = app_.screen
            screen.prompt.load_text(PROMPT)
            await pilot.press("enter")
            await _until(pilot, lambda: screen.chat.session.last_reply is not None
                         and not screen.generating)
            reply = screen.chat.session.last_reply
            assert reply.answer + "\n" == expected and not reply.stopped
            assert [t for t in screen.conversation.turns if isinstance(t, AssistantMessage)]
            engine = str(screen.query_one("#engine", Static).render())
            assert "tiny on 127.0.0.1:" in engine and "(remote)" in engine
            assert str(screen.query_one(KVGauge).render()) == "KV n/a (remote)"
            assert "TTFT" in str(screen.query_one("#numbers", Static).render())

    asyncio.run(main())


async def _until(pilot, condition, timeout: float = 15.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not condition():
        assert loop.time() < deadline, "timed out waiting for the UI"
        await pilot.pause(0.01)


def test_cancel_closes_the_stream_and_keeps_what_came(tiny_model_dir):
    loaded = fake_model(tiny_model_dir, "Fine, thanks. ", eos=False, rate=200)
    running = Running(ServedModel(("tiny",), tiny_model_dir, loaded.engine, loaded.tokenizer,
                                  loaded.eos_ids))
    server = RemoteServer(running.url)
    try:
        session = RemoteSession(server, "tiny", LiveParams(SamplingParams(temperature=0.0)))
        cancel = threading.Event()
        for event in session.send("Hello", cancel):
            if isinstance(event, TextPiece):
                cancel.set()
        reply = session.last_reply
        assert reply.stopped and reply.answer and [m.role for m in session.messages] == \
            ["user", "assistant"]
        deadline = time.monotonic() + 5
        while not any("client gone" in line for line in running.lines):
            assert time.monotonic() < deadline, running.lines
            time.sleep(0.02)
    finally:
        server.close()
        running.stop()
