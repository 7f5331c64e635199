"""The real `qwenchat` console script: answers, streams, flags, and exit codes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from child_process import sigint_as_in_a_terminal
from hf_compare import hf_greedy_text
from tiny_model import write_tiny_model

SCRIPT = Path(sys.executable).parent / "qwenchat"


def qwenchat(*args: str, stdin: str | None = None, env: dict | None = None,
             timeout: float = 60) -> subprocess.CompletedProcess:
    merged = {**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})}
    return subprocess.run([str(SCRIPT), *args], input=stdin, capture_output=True, text=True,
                          env=merged, timeout=timeout, stdin=None if stdin is not None
                          else subprocess.DEVNULL)


def assert_one_error_line(result: subprocess.CompletedProcess, code: int, *needles: str):
    assert result.returncode == code, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("qwenchat: error:"), result.stderr
    assert "Traceback" not in result.stderr
    for needle in needles:
        assert needle in lines[0]
    assert result.stdout == ""


MODELS = {
    "tied": dict(),
    "untied-odd": dict(tie_word_embeddings=False, hidden_size=40, num_attention_heads=3,
                       num_key_value_heads=1, head_dim=24, intermediate_size=72, seed=3),
    "f16-sharded": dict(dtype="F16", shards=2, seed=5, num_hidden_layers=3),
}


@pytest.fixture(scope="module", params=list(MODELS))
def model_dir(request, tmp_path_factory, tiny_tokenizer) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp(request.param) / "m",
                            tokenizer=tiny_tokenizer, **MODELS[request.param])


@pytest.mark.parametrize("system", [None, "You are terse. 简洁。"])
def test_greedy_answer_is_exactly_what_transformers_generates(model_dir, system):
    question = "Hello, how are you? 你好 😀"
    messages = ([{"role": "system", "content": system}] if system else [])
    messages.append({"role": "user", "content": question})
    expected = hf_greedy_text(model_dir, messages, max_new_tokens=40)
    args = ["ask", "--backend", "cpu", "--model", str(model_dir), "--temperature", "0",
            "--max-tokens", "40", question]
    if system:
        args[1:1] = ["-s", system]
    result = qwenchat(*args)
    assert result.returncode == 0, result.stderr
    assert result.stdout == expected + "\n"


def test_prompt_from_stdin_matches_transformers(model_dir):
    expected = hf_greedy_text(model_dir, [{"role": "user", "content": "What is a fox?"}], 30)
    result = qwenchat("ask", "--backend", "cpu", "--model", str(model_dir), "--temperature",
                      "0", "--max-tokens", "30", stdin="What is a fox?\n")
    assert result.returncode == 0, result.stderr
    assert result.stdout == expected + "\n"


def raw_qwenchat(args: list[bytes], stdin: bytes) -> subprocess.CompletedProcess:
    """The console script given bytes, as a shell pipes them: nothing decoded on our side."""
    result = subprocess.run([bytes(SCRIPT), *args], input=stdin, capture_output=True,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=60)
    result.stdout, result.stderr = (result.stdout.decode(errors="replace"),
                                    result.stderr.decode(errors="replace"))
    return result


def test_stdin_that_is_not_utf8_is_a_usage_error_naming_the_byte(tiny_model_dir):
    result = raw_qwenchat([b"ask", b"--backend", b"cpu", b"--model", bytes(tiny_model_dir),
                           b"x"], stdin=b"caf\xe9 au lait\n")
    assert_one_error_line(result, 2, "not UTF-8", "0xe9", "offset 3", "iconv")


def test_a_prompt_argument_that_is_not_utf8_is_a_usage_error(tiny_model_dir):
    result = raw_qwenchat([b"ask", b"--backend", b"cpu", b"--model", bytes(tiny_model_dir),
                           b"caf\xe9"], stdin=b"")
    assert_one_error_line(result, 2, "prompt argument", "not valid UTF-8")


def test_utf16_stdin_with_its_byte_order_mark_is_read_as_utf16(tiny_model_dir):
    args = ["ask", "--model", str(tiny_model_dir), "--backend", "cpu", "--json",
            "--temperature", "0", "--max-tokens", "5"]
    utf16 = raw_qwenchat([a.encode() for a in args],
                         stdin=b"\xff\xfe" + "The fox. 狐狸\n".encode("utf-16-le"))
    utf8 = qwenchat(*args, stdin="The fox. 狐狸\n")
    assert utf16.returncode == 0, utf16.stderr
    a, b = json.loads(utf16.stdout), json.loads(utf8.stdout)
    assert a["text"] == b["text"] and a["prompt_tokens"] == b["prompt_tokens"]


def test_stdin_comes_before_the_argument(tiny_model_dir):
    combined = qwenchat("ask", "--model", str(tiny_model_dir), "--backend", "cpu", "--json",
                        "--temperature", "0", "--max-tokens", "5", "Summarise.",
                        stdin="The fox.\n")
    explicit = qwenchat("ask", "--model", str(tiny_model_dir), "--backend", "cpu", "--json",
                        "--temperature", "0", "--max-tokens", "5", "The fox.\n\nSummarise.")
    a, b = json.loads(combined.stdout), json.loads(explicit.stdout)
    assert a["text"] == b["text"] and a["prompt_tokens"] == b["prompt_tokens"]


def test_json_output_is_one_object_with_text_counts_and_timings(tiny_model_dir):
    result = qwenchat("ask", "--model", str(tiny_model_dir), "--backend", "cpu", "--json",
                      "--max-tokens", "6", "--seed", "11", "Hello")
    assert result.returncode == 0, result.stderr
    record = json.loads(result.stdout)
    for key in ("text", "thinking", "prompt_tokens", "generated_tokens", "ttft_s",
                "decode_tok_s", "stop_reason", "seed", "params"):
        assert key in record
    assert record["generated_tokens"] == 6 and record["stop_reason"] == "max_tokens"
    assert record["seed"] == 11 and record["params"]["max_tokens"] == 6


def test_same_seed_same_answer_and_other_seed_differs(tiny_model_dir):
    def answer(seed: str) -> str:
        result = qwenchat("ask", "--model", str(tiny_model_dir), "--backend", "cpu",
                          "--temperature", "1.5", "--top-k", "0", "--top-p", "1",
                          "--max-tokens", "20", "--seed", seed, "Hello")
        assert result.returncode == 0, result.stderr
        return result.stdout

    assert answer("1") == answer("1")
    assert answer("1") != answer("2")


def test_verbose_stats_go_to_stderr_only(tiny_model_dir):
    quiet = qwenchat("ask", "--model", str(tiny_model_dir), "--backend", "cpu",
                     "--temperature", "0", "--max-tokens", "5", "Hello")
    loud = qwenchat("ask", "--model", str(tiny_model_dir), "--backend", "cpu", "-v",
                    "--temperature", "0", "--max-tokens", "5", "Hello")
    assert loud.stdout == quiet.stdout
    assert "tok/s" in loud.stderr and "TTFT" in loud.stderr and "stop: max_tokens" in loud.stderr
    assert quiet.stderr == ""


def test_auto_backend_says_in_one_line_why_it_uses_the_cpu(tiny_model_dir):
    from qwenchat.engine.cuda.probe import probe

    found = probe()
    if found.usable:
        pytest.skip("this machine has a usable GPU: auto takes it")
    result = qwenchat("ask", "--model", str(tiny_model_dir), "--max-tokens", "3", "Hi")
    assert result.returncode == 0
    notices = result.stderr.strip().splitlines()
    assert len(notices) == 1 and "running on the CPU" in notices[0]
    if found.driver_version is None:  # no NVIDIA driver: nothing to fix, so nothing to install
        assert notices == ["qwenchat: no NVIDIA driver: running on the CPU (--backend cpu "
                           "skips this note)"]


def test_cuda_backend_unavailable_is_one_line_exit_1(tiny_model_dir):
    result = qwenchat("ask", "--model", str(tiny_model_dir), "--backend", "cuda", "Hi")
    assert_one_error_line(result, 1, "--backend cuda", "--backend cpu")


@pytest.mark.parametrize(("flag", "value", "name"), [
    ("--temperature", "2.5", "temperature"), ("--top-p", "0", "top-p"),
    ("--top-k", "-1", "top-k"), ("--min-p", "1.5", "min-p"),
    ("--repetition-penalty", "0", "repetition-penalty"),
    ("--presence-penalty", "3", "presence-penalty"),
    ("--frequency-penalty", "-3", "frequency-penalty"), ("--seed", "-1", "seed"),
    ("--max-tokens", "0", "max-tokens"),
])
def test_out_of_range_parameters_exit_2_naming_the_range(tiny_model_dir, flag, value, name):
    result = qwenchat("ask", "--model", str(tiny_model_dir), flag, value, "Hi")
    assert_one_error_line(result, 2, name, "must be")


@pytest.mark.parametrize("args", [
    ["ask", "--temperature", "warm", "Hi"],
    ["ask", "--no-such-flag", "Hi"],
    ["ask", "--backend", "tpu", "Hi"],
    ["ask", "--decode", "fast", "Hi"],
    ["ask", "--ctx", "1", "Hi"],
    ["ask", "--kv-cache", "int4", "Hi"],
    ["ask"],
    ["ask", "   "],
])
def test_usage_errors_exit_2_with_one_line(tiny_model_dir, args):
    result = qwenchat(*args, "--model", str(tiny_model_dir))
    assert_one_error_line(result, 2)


@pytest.mark.parametrize(("args", "needles"), [
    (["--ctx", "600"], ["--ctx 600", "512 positions", "--rope-scaling yarn"]),
    (["--rope-scaling", "yarn:2:256", "--ctx", "600"], ["--ctx 600", "yarn:3"]),
    (["--rope-scaling", "linear"], ["--rope-scaling", "unsupported rope type 'linear'",
                                    "yarn:FACTOR"]),
    (["--rope-scaling", "yarn:0.5"], ["--rope-scaling", "1 or more"]),
    (["--device", "3", "--backend", "cpu", "--ctx", "700"], ["--ctx 700"]),
])
def test_context_past_the_trained_length_and_bad_rope_scaling_exit_2(tiny_model_dir, args,
                                                                     needles):
    """The tiny model is trained for 512 positions: more needs YaRN, named in the line."""
    result = qwenchat("ask", "--model", str(tiny_model_dir), *args, "Hi")
    assert_one_error_line(result, 2, *needles)


def test_rope_scaling_yarn_answers_past_the_trained_length(tiny_model_dir):
    done = qwenchat("ask", "--model", str(tiny_model_dir), "--backend", "cpu",
                    "--rope-scaling", "yarn:2:512", "--ctx", "1024", "--max-tokens", "4",
                    "--temperature", "0", "Hi")
    assert done.returncode == 0, done.stderr


def test_an_explicit_device_that_does_not_exist_exits_2(tiny_model_dir):
    """--device 7 asks for a GPU this machine (no GPU in CI; one or a few elsewhere) lacks:
    refused, not answered on the CPU."""
    result = qwenchat("ask", "--model", str(tiny_model_dir), "--device", "7", "Hi")
    assert_one_error_line(result, 2, "--device 7", "this machine has")


def test_an_int8_kv_cache_answers_and_ask_json_names_it(tiny_model_dir):
    done = qwenchat("ask", "--model", str(tiny_model_dir), "--kv-cache", "int8", "--backend",
                    "cpu", "--max-tokens", "4", "--temperature", "0", "--json", "Hi")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["kv_cache"] == "int8"
    plain = qwenchat("ask", "--model", str(tiny_model_dir), "--backend", "cpu",
                     "--max-tokens", "4", "--temperature", "0", "--json", "Hi")
    assert json.loads(plain.stdout)["kv_cache"] == "bf16"


def test_missing_model_directory_exit_2(tmp_path):
    result = qwenchat("ask", "--model", str(tmp_path / "nowhere"), "Hi")
    assert_one_error_line(result, 2, "nowhere")


def test_ctrl_c_exits_130_without_a_traceback(tmp_path, tiny_tokenizer):
    slow = write_tiny_model(tmp_path / "slow", tokenizer=tiny_tokenizer, hidden_size=512,
                            intermediate_size=1024, num_hidden_layers=8, num_attention_heads=8,
                            num_key_value_heads=4, head_dim=64, max_position_embeddings=4096)
    process = subprocess.Popen(
        [str(SCRIPT), "ask", "--model", str(slow), "--backend", "cpu", "--temperature", "0",
         "Hello"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
        env={**os.environ, "HF_HUB_OFFLINE": "1"}, preexec_fn=sigint_as_in_a_terminal)
    assert process.stdout is not None
    process.stdout.read(1)  # wait until the answer streams
    time.sleep(0.2)
    process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=60)
    assert process.returncode == 130
    assert b"Traceback" not in err and b"interrupted" in err


def test_python_dash_m_runs_the_same_cli():
    result = subprocess.run([sys.executable, "-m", "qwenchat", "--version"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and result.stdout.startswith("qwenchat ")


def test_info_reports_gpu_status_and_locations(isolated_home):
    result = qwenchat("info", env={"XDG_CACHE_HOME": str(isolated_home / "cache")})
    assert result.returncode == 0, result.stderr
    for heading in ("Software", "GPU", "Locations", "cuda backend", "compiled kernels",
                    "weight formats"):
        assert heading in result.stdout
    assert str(isolated_home / "cache") in "".join(result.stdout.split())


@pytest.mark.parametrize(("args", "needle"), [
    (["info", "--model", "x"], "add --compile"),
    (["info", "--config", "qwen3-8b"], "add --compile"),
    (["info", "--compile", "--model", "a", "--config", "qwen3-8b"], "give one"),
    (["info", "--compile", "--config", "qwen3-9b"], "neither a known size"),
    (["info", "--compile", "--config", "qwen3-8b", "--decode", "fast"], "--decode must be"),
    (["info", "--compile", "--config", "qwen3-8b", "--quantize", "int3"], "--quantize must"),
])
def test_info_compile_flag_mistakes_are_one_line_exit_2(args, needle, isolated_home):
    assert_one_error_line(qwenchat(*args), 2, needle)


def test_info_compile_without_a_gpu_says_so_in_one_line(isolated_home, tiny_model_dir):
    from qwenchat.engine.cuda.probe import probe

    if probe().usable:
        pytest.skip("this machine has a usable GPU: the GPU tests compile for it")
    for args in (["--config", "qwen3-0.6b"], ["--model", str(tiny_model_dir)]):
        assert_one_error_line(qwenchat("info", "--compile", *args), 1,
                              "--compile builds for a GPU and found none usable")
    assert not (isolated_home / "cache" / "qwenchat" / "cubins").exists()


def test_info_compile_checks_for_a_gpu_before_downloading_the_default_model(isolated_home):
    from qwenchat.engine.cuda.probe import probe

    if probe().usable:
        pytest.skip("this machine has a usable GPU: the GPU tests compile for it")
    result = qwenchat("info", "--compile", env={"QWENCHAT_MODEL": ""})  # offline, empty cache
    assert_one_error_line(result, 1, "--compile builds for a GPU and found none usable")
    assert "Hugging Face cache" not in result.stderr


def test_info_prints_its_values_verbatim_not_as_rich_markup(monkeypatch):
    from typer.testing import CliRunner

    from qwenchat import info as info_module
    from qwenchat.cli import app

    fix = "pip install 'qwenchat[cu13]' (or 'qwenchat[cu12]' for a CUDA 12 driver)"
    monkeypatch.setattr(info_module, "gather", lambda: [("GPU", [("problem", fix),
                                                                 ("[bold]key[/]", "[red]x")])])
    result = CliRunner().invoke(app, ["info"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert fix in result.output and "[bold]key[/]" in result.output and "[red]x" in result.output


def test_ask_and_info_work_where_textual_and_cuda_python_cannot_load(tiny_model_dir):
    blocked = ("import sys; sys.modules['textual'] = None; sys.modules['cuda'] = None; "
               "from qwenchat.cli import main; sys.argv = ['qwenchat'] + sys.argv[1:]; main()")
    ask = subprocess.run([sys.executable, "-c", blocked, "ask", "--backend", "cpu", "--model",
                          str(tiny_model_dir), "--max-tokens", "3", "Hi"],
                         capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert ask.returncode == 0, ask.stderr
    info = subprocess.run([sys.executable, "-c", blocked, "info"], capture_output=True,
                          text=True, timeout=60)
    assert info.returncode == 0, info.stderr
    # (the first cause: without a driver that is the driver, found without cuda-python)
    from qwenchat.engine.cuda.probe import NO_DRIVER, driver_library_loads

    expected = "cuda-python is not importable" if driver_library_loads() else NO_DRIVER
    assert expected in "".join(info.stdout.split("\n"))


@pytest.mark.parametrize("args", [
    ["chat", "--temperature", "5"],
    ["--top-p", "0"],  # no command: the chat, with the same checks
    ["chat", "--max-tokens", "0"],
    ["chat", "--backend", "tpu"],
    ["chat", "--ctx", "1"],
    ["chat", "--device", "-1"],
    ["chat", "--decode", "fastest"],
    ["chat", "--kv-cache", "fp8"],
    ["chat", "--model", "/nowhere/at/all"],
    ["chat", "--no-such-flag"],
])
def test_chat_flags_are_checked_before_the_app_starts(tiny_model_dir, args, isolated_home):
    if "--model" not in args:
        args = [*args, "--model", str(tiny_model_dir)]
    result = qwenchat(*args)
    assert_one_error_line(result, 2)
    assert not (isolated_home / "data").exists()  # nothing started, nothing written


def test_chat_needs_a_terminal(tiny_model_dir):
    result = qwenchat("chat", "--model", str(tiny_model_dir))
    assert_one_error_line(result, 2, "needs a terminal", "qwenchat ask")


def test_help_lists_the_commands_and_chat_takes_the_ask_flags():
    assert "chat" in qwenchat("--help").stdout
    chat_help, ask_help = qwenchat("chat", "--help").stdout, qwenchat("ask", "--help").stdout
    for flag in ("--model", "--backend", "--system", "--temperature", "--top-p", "--top-k",
                 "--min-p", "--repetition-penalty", "--presence-penalty",
                 "--frequency-penalty", "--seed", "--max-tokens", "--think", "--ctx",
                 "--device", "--decode", "--debug"):
        assert flag in chat_help and flag in ask_help
    assert "--no-history" in chat_help


@pytest.mark.parametrize(("command", "defaults"), [
    ("chat", ["[default: (the model's maximum)]"]),
    ("ask", ["[default: (the model's maximum)]"]),
    ("bench", ["[default: (qwen3-0.6b)]",
               "[default: (room for the largest position and prompt, within the model's "
               "maximum)]"]),
])
def test_help_keeps_the_defaults_that_are_not_values(command, defaults):
    # Rich takes "[default: ...]" written into a help text for a style tag and drops it.
    text = " ".join(qwenchat(command, "--help", env={"COLUMNS": "250"}).stdout.split())
    for default in defaults:
        assert default in text, text


@pytest.mark.parametrize("command", ["ask", "chat", "bench", "info", "eval", "quantize",
                                     "serve"])
def test_help_at_80_columns_reads_whole_phrases_and_flags_show_no_value_type(command):
    text = qwenchat(command, "--help", env={"COLUMNS": "80"}).stdout
    assert "Show tracebacks on errors." in text  # not cut into a 20-column strip
    assert "<bool>" not in text  # a flag takes no value: no type beside it
    assert all(len(line) <= 80 for line in text.splitlines())


def test_root_help_gives_each_command_a_whole_summary_line():
    lines = qwenchat("--help", env={"COLUMNS": "80"}).stdout.splitlines()
    for command in ("chat", "ask", "info", "bench", "eval", "quantize", "serve"):
        (line,) = [line for line in lines if line.split()[:1] == [command]]
        assert line.rstrip().endswith(".") and "..." not in line

def test_chat_runs_in_a_terminal_and_quits_with_ctrl_q(tiny_model_dir, isolated_home):
    pty = pytest.importorskip("pty")
    import select

    pid, fd = pty.fork()
    if pid == 0:  # the child: qwenchat in a pseudo-terminal, 100 × 30
        os.environ.update(HF_HUB_OFFLINE="1", COLUMNS="100", LINES="30", TERM="xterm-256color")
        os.execv(str(SCRIPT), [str(SCRIPT), "--backend", "cpu", "--model", str(tiny_model_dir)])
    screen = b""
    deadline = time.monotonic() + 60
    while b"Enter sends" not in screen and time.monotonic() < deadline:
        if select.select([fd], [], [], 0.5)[0]:
            try:
                screen += os.read(fd, 65536)
            except OSError:
                break
    assert b"Enter sends" in screen, screen[-2000:]
    os.write(fd, b"\x11")  # Ctrl+Q
    while time.monotonic() < deadline:
        if select.select([fd], [], [], 0.5)[0]:
            try:
                if not os.read(fd, 65536):
                    break
            except OSError:
                break
    _, status = os.waitpid(pid, 0)
    assert os.WEXITSTATUS(status) == 0
    assert (isolated_home / "data" / "qwenchat" / "history.sqlite3").is_file()


def test_ask_with_prompt_lookup_answers_as_without_it(tiny_model_dir):
    # A prompt that the reply can quote: lookup proposes, the reference engine verifies, and
    # the answer is the plain greedy one.
    quote = "def add(a, b):\n    return a + b\n" * 3
    args = ["ask", "--backend", "cpu", "--model", str(tiny_model_dir), "--temperature", "0",
            "--max-tokens", "60", "--json", f"Repeat this:\n{quote}"]
    plain = json.loads(qwenchat(*args).stdout)
    fast = qwenchat(*args, "--speculate", "ngram")
    assert fast.returncode == 0, fast.stderr
    record = json.loads(fast.stdout)
    assert record["text"] == plain["text"] and record["generated_tokens"] == 60
    assert plain["spec_proposed"] == 0
    assert 0 < record["spec_accepted"] <= record["spec_proposed"] and record["spec_passes"] > 0
    verbose = qwenchat(*args[:-2], "-v", "--speculate", "ngram", args[-1])
    assert "proposed tokens kept over" in verbose.stderr


def test_an_unknown_speculation_mode_is_one_error_line(tiny_model_dir):
    result = qwenchat("ask", "--backend", "cpu", "--model", str(tiny_model_dir),
                      "--speculate", "draft", "hi")
    assert_one_error_line(result, 2, "--speculate must be one of off, ngram", "'draft'")


@pytest.fixture(scope="module")
def draft_dirs(tmp_path_factory, tiny_tokenizer) -> dict[str, Path]:
    """Another tiny model with the same tokenizer (a draft), and one with another tokenizer."""
    from tiny_model import train_tokenizer

    root = tmp_path_factory.mktemp("drafts")
    return {"same": write_tiny_model(root / "same", tokenizer=tiny_tokenizer, seed=9,
                                     num_hidden_layers=1),
            "other": write_tiny_model(root / "other", tokenizer=train_tokenizer(300))}


def test_ask_with_a_draft_model_answers_as_without_it(tiny_model_dir, draft_dirs):
    quote = "def add(a, b):\n    return a + b\n" * 3
    args = ["ask", "--backend", "cpu", "--model", str(tiny_model_dir), "--temperature", "0",
            "--max-tokens", "40", "--json", f"Repeat this:\n{quote}"]
    plain = json.loads(qwenchat(*args).stdout)
    drafted = qwenchat(*args, "--draft", str(draft_dirs["same"]))
    assert drafted.returncode == 0, drafted.stderr
    record = json.loads(drafted.stdout)
    assert record["text"] == plain["text"]
    assert record["spec_passes"] > 0 and record["spec_accepted"] <= record["spec_proposed"]


def test_a_draft_with_another_tokenizer_is_refused_in_one_line(tiny_model_dir, draft_dirs):
    result = qwenchat("ask", "--backend", "cpu", "--model", str(tiny_model_dir), "--draft",
                      str(draft_dirs["other"]), "hi")
    assert_one_error_line(result, 2, "its tokenizer is not the model's", "same family")


@pytest.mark.parametrize(("flags", "needles"), [
    (["--draft", "Qwen/Qwen3-0.6B", "--speculate", "ngram"], ["two ways to propose"]),
    (["--draft", "Qwen/Qwen3-0.6B", "--speculate", "off"], ["--speculate off", "give one"]),
    (["--draft", "./no/such/draft"], ["--draft ./no/such/draft", "no such directory"]),
])
def test_draft_flag_mistakes_are_one_error_line_before_any_model_loads(tiny_model_dir, flags,
                                                                        needles):
    result = qwenchat("ask", "--backend", "cpu", "--model", str(tiny_model_dir), *flags, "hi")
    assert_one_error_line(result, 2, *needles)


def test_chat_refuses_speculate_off_beside_a_draft_before_the_app_starts(tiny_model_dir):
    result = qwenchat("chat", "--model", str(tiny_model_dir), "--draft", "Qwen/Qwen3-0.6B",
                      "--speculate", "off")
    assert_one_error_line(result, 2, "--speculate off", "give one")
