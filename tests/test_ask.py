"""`ask`'s output shaping: thinking shown or hidden, prompt assembly, one trailing newline."""

from __future__ import annotations

import io

import pytest

from qwenchat.ask import _JsonCollector, _StreamWriter, combine_prompt
from qwenchat.errors import UsageError
from qwenchat.session import TextPiece

PIECES = [TextPiece("Let me ", "thinking"), TextPiece("think.", "thinking"),
          TextPiece("The answer", "answer"), TextPiece(" is 4.", "answer")]


def written(show_thinking: bool) -> str:
    out = io.StringIO()
    writer = _StreamWriter(out, show_thinking)
    for piece in PIECES:
        writer.piece(piece)
    writer.close()
    return out.getvalue()


def test_thinking_is_hidden_unless_asked_for():
    assert written(False) == "The answer is 4.\n"


def test_shown_thinking_comes_first_inside_think_tags():
    assert written(True) == "<think>\nLet me think.\n</think>\n\nThe answer is 4.\n"


def test_json_collects_answer_and_thinking_apart():
    collector = _JsonCollector()
    for piece in PIECES:
        collector.piece(piece)
    assert collector.result() == {"text": "The answer is 4.", "thinking": "Let me think."}


@pytest.mark.parametrize(("argument", "stdin", "expected"), [
    ("Question?", None, "Question?"),
    (None, "Piped text\n", "Piped text"),
    ("Summarise.", "Document\n", "Document\n\nSummarise."),
    ("  Question? ", "", "  Question? "),  # the argument is the user's, byte for byte
])
def test_prompt_combines_stdin_then_argument(argument, stdin, expected):
    assert combine_prompt(argument, stdin) == expected


@pytest.mark.parametrize(("argument", "stdin"), [(None, None), ("", ""), ("  ", "\n\n")])
def test_no_prompt_is_a_usage_error(argument, stdin):
    with pytest.raises(UsageError, match="no prompt"):
        combine_prompt(argument, stdin)


def test_ask_with_speculation_on_an_engine_that_cannot_verify_says_so_once_and_answers(
        monkeypatch, tiny_model_dir):
    from fake_engine import fake_model

    import qwenchat.ask as ask

    model = fake_model(tiny_model_dir, "Short answer here.")
    monkeypatch.setattr(ask, "create_engine", lambda *args, **kwargs: model.engine)
    out, err = io.StringIO(), io.StringIO()
    options = ask.AskOptions("Question?", str(tiny_model_dir), backend="cpu",
                             overrides={"max_tokens": 8}, speculate="ngram")
    assert ask.run_ask(options, out, err) == 0
    [line] = err.getvalue().splitlines()
    assert "--speculate ngram: the fake engine backend does not verify proposals" in line
    assert out.getvalue().startswith("Short answer")


@pytest.mark.parametrize(("overrides", "later"), [({}, True), ({"seed": 7}, False)])
def test_ask_answers_before_the_megakernel_compiles_unless_a_seed_asks_for_the_same_draws(
        monkeypatch, tiny_model_dir, overrides, later):
    # (the CUDA engine decodes a cold first reply on the per-op graph with megakernel_later;
    # a seeded answer must not depend on whether the kernel cache was warm)
    from fake_engine import fake_model

    import qwenchat.ask as ask

    model = fake_model(tiny_model_dir, "Short answer here.")
    asked: list[bool] = []

    def engine(*args, megakernel_later=False, **kwargs):
        asked.append(megakernel_later)
        return model.engine

    monkeypatch.setattr(ask, "create_engine", engine)
    options = ask.AskOptions("Question?", str(tiny_model_dir), backend="cpu",
                             overrides={"max_tokens": 8, **overrides})
    assert ask.run_ask(options, io.StringIO(), io.StringIO()) == 0
    assert asked == [later]
