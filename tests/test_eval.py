"""`qwenchat eval`: perplexity and KL divergence on the reference engine and a tiny model."""

from __future__ import annotations

import io
import json
import math

import numpy as np
import pytest

from qwenchat import eval as ev
from qwenchat.engine.reference import ReferenceEngine
from qwenchat.errors import QwenchatError, UsageError
from qwenchat.model.loader import open_model_dir

TEXT = ("The quick brown fox jumps over the lazy dog. " * 6
        + "Pack my box with five dozen liquor jugs; how vexingly quick daft zebras jump! " * 4)


@pytest.fixture
def text_file(tmp_path):
    path = tmp_path / "text.txt"
    path.write_text(TEXT, encoding="utf-8")
    return path


def run(model_dir, file, **flags) -> tuple[int, dict, str]:
    out, err = io.StringIO(), io.StringIO()
    options = ev.EvalOptions(file, str(model_dir), backend="cpu", as_json=True, **flags)
    code = ev.run_eval(options, out, err)
    return code, json.loads(out.getvalue()), err.getvalue()


def test_perplexity_is_the_reference_engines_own_in_one_window(tiny_model_dir, text_file):
    model = open_model_dir(tiny_model_dir)
    ids = model.tokenizer.encode(TEXT)
    logits = ReferenceEngine(model.config, model.checkpoint).prefill_logits(ids)
    logp = logits - logits.max(-1, keepdims=True)
    logp = logp - np.log(np.exp(logp).sum(-1, keepdims=True))
    expected = math.exp(-np.mean(logp[np.arange(len(ids) - 1), ids[1:]]))
    code, result, _ = run(tiny_model_dir, text_file, window=len(ids), ctx=len(ids))
    assert code == 0 and result["tokens_scored"] == len(ids) - 1
    assert result["perplexity"] == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize(("length", "size", "stride"), [(100, 32, 16), (100, 32, 31),
                                                        (100, 32, 7), (31, 32, 16), (2, 2, 1)])
def test_windows_score_every_token_after_the_first_once_with_context_before_it(length, size,
                                                                               stride):
    scored = []
    for i, w in enumerate(ev.windows(length, size, stride)):
        assert 0 <= w.begin < w.first <= w.end <= length and w.end - w.begin <= size
        if i > 0:  # later windows keep at least size - stride tokens of context
            assert w.first - w.begin >= min(size - stride, w.first)
        scored += range(w.first, w.end)
    assert scored == list(range(1, length))


def test_a_model_against_itself_has_no_kl_and_agrees_on_every_token(tiny_model_dir, text_file):
    code, result, _ = run(tiny_model_dir, text_file, window=48, base="bf16")
    assert code == 0
    assert result["kl"]["max"] == pytest.approx(0.0, abs=1e-9)
    assert result["top1_agreement"] == 1.0 and result["delta_perplexity"] == pytest.approx(0.0)


def test_fp8_weights_move_the_distribution_and_say_by_how_much(tiny_model_dir, text_file):
    code, result, _ = run(tiny_model_dir, text_file, window=48, base="bf16", quantize="fp8")
    assert code == 0 and result["weight_format"] == "fp8"
    kl = result["kl"]
    assert 0 < kl["median"] <= kl["p99"] <= kl["max"] and kl["mean"] > 0
    assert 0 < result["top1_agreement"] < 1


def test_saved_base_logits_give_the_live_bases_kl(tiny_model_dir, text_file, tmp_path):
    saved = tmp_path / "base.npz"
    vocab = open_model_dir(tiny_model_dir).config.vocab_size
    assert run(tiny_model_dir, text_file, window=48, save_logits=saved, top_k=vocab)[0] == 0
    _, live, _ = run(tiny_model_dir, text_file, window=48, base="bf16", quantize="fp8")
    _, kept, _ = run(tiny_model_dir, text_file, window=48, base=str(saved), quantize="fp8")
    for figure in ("mean", "median", "p99", "max"):
        assert kept["kl"][figure] == pytest.approx(live["kl"][figure], rel=1e-4, abs=1e-7)
    assert kept["top1_agreement"] == live["top1_agreement"]
    assert kept["base_perplexity"] == pytest.approx(live["base_perplexity"], rel=1e-5)
    # With fewer ids kept, the rest counts as one outcome: never more KL than the full one.
    few = tmp_path / "few.npz"
    assert run(tiny_model_dir, text_file, window=48, save_logits=few, top_k=8)[0] == 0
    _, approx, _ = run(tiny_model_dir, text_file, window=48, base=str(few), quantize="fp8")
    assert approx["kl"]["mean"] <= live["kl"]["mean"] + 1e-9
    assert approx["kl"]["mean"] > 0.5 * live["kl"]["mean"]


def test_saved_logits_of_other_windows_are_refused_in_one_line(tiny_model_dir, text_file,
                                                                tmp_path):
    saved = tmp_path / "base.npz"
    run(tiny_model_dir, text_file, window=48, save_logits=saved)
    with pytest.raises(UsageError, match=r"saved for other text or windows .window 48, stride "
                                         r"24.; use the same file, --window and --stride"):
        run(tiny_model_dir, text_file, window=40, base=str(saved))
    not_logits = tmp_path / "x.npz"
    not_logits.write_bytes(b"not an npz")
    with pytest.raises(UsageError, match="not logits saved by eval --save-logits"):
        run(tiny_model_dir, text_file, base=str(not_logits))


def test_the_decode_path_scores_as_the_prefill_does_on_the_reference(tiny_model_dir, text_file):
    _, prefill, _ = run(tiny_model_dir, text_file, window=32, limit=60)
    _, decode, _ = run(tiny_model_dir, text_file, window=32, limit=60, path="decode")
    assert decode["tokens_scored"] == prefill["tokens_scored"] == 60
    assert decode["perplexity"] == pytest.approx(prefill["perplexity"], rel=1e-4)


def test_a_jsonl_of_chats_is_scored_as_its_template_renders_it(tiny_model_dir, tmp_path):
    chats = tmp_path / "chats.jsonl"
    chat = {"messages": [{"role": "user", "content": "Hello there"},
                         {"role": "assistant", "content": "Hi! How can I help?"}]}
    chats.write_text(json.dumps(chat) + "\n\n" + json.dumps(chat) + "\n", encoding="utf-8")
    model = open_model_dir(tiny_model_dir)
    rendered = model.tokenizer.encode(model.tokenizer.render(
        [ev.Message(m["role"], m["content"]) for m in chat["messages"]], enable_thinking=False,
        add_generation_prompt=False))
    code, result, _ = run(tiny_model_dir, chats, window=256)
    assert code == 0 and result["tokens_scored"] == 2 * (len(rendered) - 1)


@pytest.mark.parametrize(("content", "message"), [
    ("", "no text to score"),
    ("not json\n", "line 1: not JSON"),
    ('{"messages": []}\n', 'line 1: no "messages" list'),
    ('{"messages": [{"role": "robot", "content": "x"}]}\n', 'needs a "role"'),
])
def test_a_bad_or_empty_file_is_one_line(tiny_model_dir, tmp_path, content, message):
    path = tmp_path / ("file.jsonl" if content else "empty.txt")
    path.write_text(content, encoding="utf-8")
    with pytest.raises(UsageError, match=message) as caught:
        run(tiny_model_dir, path)
    assert "\n" not in str(caught.value)


def test_bytes_that_are_not_utf8_are_named(tiny_model_dir, tmp_path):
    path = tmp_path / "latin1.txt"
    path.write_bytes("café au lait".encode("latin-1"))
    with pytest.raises(UsageError, match=r"not UTF-8 text .byte 0xe9 at offset 3"):
        run(tiny_model_dir, path)


@pytest.mark.parametrize(("flags", "message"), [
    (dict(window=64, ctx=32), "--window 64 is longer than --ctx 32"),
    (dict(window=1), "--window must be at least 2"),
    (dict(window=16, stride=16), "--stride must be 1 to the window less one .15."),
    (dict(path="sideways"), "--path must be one of prefill, decode"),
    (dict(base="nowhere.npz"), "--base nowhere.npz: neither bf16 nor cpu nor a file"),
    (dict(fp8_activations="fp16"), "--fp8-activations must be one of"),
])
def test_flags_are_checked_before_anything_loads(text_file, flags, message):
    options = ev.EvalOptions(text_file, "no/such-model", backend="cpu", **flags)
    with pytest.raises(UsageError, match=message):
        ev.run_eval(options, io.StringIO(), io.StringIO())


def test_ctrl_c_leaves_the_figures_of_the_tokens_scored_so_far(tiny_model_dir, text_file,
                                                               monkeypatch):
    real = ev.window_logits
    calls = []

    def interrupted(engine, ids, path):
        calls.append(len(ids))
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(engine, ids, path)

    monkeypatch.setattr(ev, "window_logits", interrupted)
    code, result, err = run(tiny_model_dir, text_file, window=32)
    assert code == 130 and result["stopped"]
    assert 0 < result["tokens_scored"] < result["tokens_total"]
    assert math.isfinite(result["perplexity"])
    assert f"stopped after {result['tokens_scored']:,} of" in err


def test_the_decode_path_takes_an_engines_own_teacher_forced_rows(tiny_model_dir, text_file,
                                                                  monkeypatch):
    """An engine with decode_rows (the CUDA engine's teacher-forced decode steps) is scored
    from them, with the figures the token-by-token path gives."""
    model = open_model_dir(tiny_model_dir)
    windows_fed: list[int] = []

    class DecodesRows(ReferenceEngine):
        name = "cuda (fake)"

        def decode_rows(self, ids):
            windows_fed.append(len(ids))
            rows = []
            for token in ids:
                self.prefill([token])
                rows.append(self.last_logits())
            return np.stack(rows)

    _, plain, _ = run(tiny_model_dir, text_file, window=32, limit=60, path="decode")
    monkeypatch.setattr(ev, "create_engine", lambda *a, **k: DecodesRows(model.config,
                                                                         model.checkpoint))
    _, forced, _ = run(tiny_model_dir, text_file, window=32, limit=60, path="decode")
    assert windows_fed and all(n == 32 for n in windows_fed)
    assert forced["engine"] == "cuda (fake)"
    for key in ("perplexity", "tokens_scored", "nll_mean"):
        assert forced[key] == plain[key]


def test_the_table_names_the_figures(tiny_model_dir, text_file):
    out = io.StringIO()
    options = ev.EvalOptions(text_file, str(tiny_model_dir), backend="cpu", window=48,
                             base="bf16", quantize="fp8")
    assert ev.run_eval(options, out, io.StringIO()) == 0
    text = out.getvalue()
    for label in ("perplexity", "base perplexity", "KL divergence", "top-1 agreement",
                  "fp8 weights", "(window 48, stride 24, prefill path)"):
        assert label in text, label


def test_the_command_prints_figures_and_refuses_a_bad_window_in_one_line(tiny_model_dir,
                                                                         text_file):
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = Path(sys.executable).parent / "qwenchat"
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    good = subprocess.run([str(script), "eval", str(text_file), "-m", str(tiny_model_dir), "-b",
                           "cpu", "--window", "32", "--json"], capture_output=True, text=True,
                          env=env, timeout=120)
    assert good.returncode == 0, good.stderr
    assert json.loads(good.stdout)["tokens_scored"] > 0
    bad = subprocess.run([str(script), "eval", str(text_file), "-m", str(tiny_model_dir), "-b",
                          "cpu", "--window", "64", "--ctx", "32"], capture_output=True,
                         text=True, env=env, timeout=120)
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr.splitlines() == ["qwenchat: error: --window 64 is longer than --ctx 32: a "
                                       "window must fit the KV cache; lower --window or raise "
                                       "--ctx"]


def test_the_scores_in_float32_rows_agree_with_a_float64_computation():
    # eval keeps a window's logits in float32 and only each row's log-sum-exp in float64
    # (Rows): the target's log probability, the top-1 and KL(base || ours) against float64
    # log-softmaxes of the same logits.
    from qwenchat.eval import Rows, kl_full, kl_top

    def log_softmax(x):
        x = x.astype(np.float64) - x.max(axis=-1, keepdims=True)
        return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))

    rng = np.random.default_rng(5)
    base = (rng.standard_normal((64, 5000)) * 4).astype(np.float32)
    ours = base + (rng.standard_normal(base.shape) * 0.05).astype(np.float32)
    lb, lo = log_softmax(base), log_softmax(ours)
    rb, ro = Rows.of(base), Rows.of(ours)
    targets = rng.integers(0, 5000, 64)
    assert np.abs(ro.target_logp(targets) - lo[np.arange(64), targets]).max() < 1e-6
    assert (ro.argmax() == lo.argmax(-1)).all()
    expected = np.sum(np.exp(lb) * (lb - lo), axis=-1)
    assert np.abs(kl_full(rb, ro) - expected).max() < 1e-7 and expected.min() > 1e-4
    assert kl_full(rb, rb).max() == 0.0
    every = np.argsort(-lb, axis=-1)  # (a base saved with every id: the same KL)
    top = kl_top(every, np.take_along_axis(lb, every, axis=-1), ro)
    assert np.abs(top - expected).max() < 1e-7


# ----------------------------------------------------------------------------- the GPU's path
class NumpyScoring:
    """The GPU engine's scoring part (qwenchat/engine/cuda/scoring.py) in NumPy, as its
    contract says, on a reference engine: eval's device path run on the CPU. (The GPU test of
    score.cu holds the kernels to these same numbers: test_cuda_engine.py.)"""

    device = type("Device", (), {"index": 0})()
    prepared = False

    def prepare_scoring(self):
        self.prepared = True

    def window_rows(self, ids):
        assert self.prepared, "scored before its kernels were prepared"
        return self.prefill_logits(list(ids))

    def score_rows(self, rows, first, targets, base=None):
        n = len(targets)
        ours, at = ev.Rows.of(rows[first:first + n]), np.arange(n)
        out = np.full((n, 8), np.nan)
        out[:, 0], out[:, 1], out[:, 2], out[:, 7] = ours.lse, ours.logits[at, targets], \
            ours.argmax(), 0.0
        if base is not None:
            theirs = ev.Rows.of(base[first:first + n])
            out[:, 3], out[:, 4] = ev.kl_full(theirs, ours), theirs.lse
            out[:, 5], out[:, 6] = theirs.logits[at, targets], theirs.argmax()
        return out

    def gather_rows(self, rows, first, ids):
        return np.take_along_axis(rows[first:first + len(ids)], ids, axis=-1)

    def download_rows(self, rows, first, n):
        return np.array(rows[first:first + n], np.float32)


def run_device_path(monkeypatch, model_dir, file, **flags) -> dict:
    """eval with --backend cuda on reference engines that score as the GPU's do."""
    real = ev.create_engine

    def create(backend, *args, **kwargs):
        engine = real("cpu", *args, **kwargs)
        if backend == "cuda":
            engine.__class__ = type("GpuLike", (NumpyScoring, type(engine)), {})
        return engine

    monkeypatch.setattr(ev, "create_engine", create)
    out = io.StringIO()
    options = ev.EvalOptions(file, str(model_dir), backend="cuda", as_json=True, **flags)
    assert ev.run_eval(options, out, io.StringIO()) == 0
    monkeypatch.setattr(ev, "create_engine", real)
    return json.loads(out.getvalue())


@pytest.mark.parametrize("base", ["bf16", "cpu", "saved", None])
def test_the_gpu_path_gives_the_host_paths_figures(tiny_model_dir, text_file, tmp_path,
                                                   monkeypatch, base):
    """Scored where the logits are (a live base beside them, a saved one gathered, one on the
    CPU brought over) or on the host, the figures are the same."""
    flags = dict(window=40, quantize="fp8")
    if base == "saved":
        saved = tmp_path / "base.npz"
        assert run(tiny_model_dir, text_file, window=40, save_logits=saved, top_k=16)[0] == 0
        flags["base"] = str(saved)
    elif base is not None:
        flags["base"] = base
    _, host, _ = run(tiny_model_dir, text_file, **flags)
    device = run_device_path(monkeypatch, tiny_model_dir, text_file, **flags)
    assert device["tokens_scored"] == host["tokens_scored"] > 40
    assert device["perplexity"] == pytest.approx(host["perplexity"], rel=1e-12)
    if base is None:
        assert "kl" not in device
        return
    for figure in ("mean", "median", "p99", "max"):
        assert device["kl"][figure] == pytest.approx(host["kl"][figure], rel=1e-9, abs=1e-12)
    assert device["top1_agreement"] == host["top1_agreement"]
    assert device["base_perplexity"] == pytest.approx(host["base_perplexity"], rel=1e-12)


def test_logits_saved_on_the_gpu_path_are_the_host_paths(tiny_model_dir, text_file, tmp_path,
                                                         monkeypatch):
    host, device = tmp_path / "host.npz", tmp_path / "device.npz"
    assert run(tiny_model_dir, text_file, window=40, save_logits=host, top_k=8)[0] == 0
    run_device_path(monkeypatch, tiny_model_dir, text_file, window=40, save_logits=device,
                    top_k=8)
    with np.load(host) as a, np.load(device) as b:
        for name in ("top_ids", "top_logp", "target_logp"):
            np.testing.assert_allclose(a[name], b[name], rtol=0, atol=1e-6, err_msg=name)


def test_a_window_whose_logits_do_not_fit_the_gpu_is_one_line():
    from qwenchat.engine.cuda.scoring import SCORE_MARGIN, check_window_memory

    check_window_memory(512, 2**30, 2**30 + SCORE_MARGIN)  # fits exactly
    with pytest.raises(QwenchatError, match=r"^a window of 32,768 tokens needs 18\.5 GiB of GPU "
                                            r"memory for its logits and 3\.5 GiB are free; use a "
                                            r"smaller --window$"):
        check_window_memory(32768, 32768 * 151_936 * 4, 4 * 2**30)


def test_a_window_whose_logits_do_not_fit_the_hosts_memory_is_one_line(tiny_model_dir,
                                                                        text_file, monkeypatch):
    ev.check_host_memory(512, 151_936, False, 2**30)  # 0.6 GiB: fits
    with pytest.raises(UsageError, match=r"^a window of 32,768 tokens needs 74\.2 GiB of memory "
                                         r"for its logits and 16\.0 GiB are available; use a "
                                         r"smaller --window$"):
        ev.check_host_memory(32768, 151_936, True, 16 * 2**30)
    monkeypatch.setattr(ev, "host_memory_available", lambda: 1000)
    with pytest.raises(UsageError, match="use a smaller --window"):
        run(tiny_model_dir, text_file, window=48)
