"""resolve_model: local directories as given, hub ids from the Hugging Face cache offline, and
one readable line (never a traceback) when neither is there."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import huggingface_hub
import huggingface_hub.constants
import huggingface_hub.errors
import numpy as np
import pytest

from qwenchat.errors import ModelError, UsageError
from qwenchat.model.loader import open_model
from qwenchat.model.locate import download_bars, resolve_model

COMMIT = "0123456789abcdef0123456789abcdef01234567"
REPO_ID = "Org/Name"


def fake_hub_cache(cache: Path, repo_id: str, source: Path) -> Path:
    """Lay `source`'s files out as huggingface_hub does: blobs, a snapshot of symlinks, a ref."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    blobs, snapshot = repo / "blobs", repo / "snapshots" / COMMIT
    for folder in (blobs, snapshot, repo / "refs"):
        folder.mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    for file in sorted(source.iterdir()):
        blob = blobs / hashlib.sha256(file.read_bytes()).hexdigest()
        shutil.copyfile(file, blob)
        (snapshot / file.name).symlink_to(os.path.relpath(blob, snapshot))
    return snapshot


@pytest.fixture
def hub_cache(isolated_home, monkeypatch) -> Path:
    """An empty hub cache in isolated_home, offline; constants were read at import, so patch."""
    cache = (isolated_home / "hf" / "hub").resolve()
    cache.mkdir(parents=True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    return cache


@pytest.fixture
def cached_snapshot(hub_cache, tiny_model_dir) -> Path:
    return fake_hub_cache(hub_cache, REPO_ID, tiny_model_dir)


# --- local directories -----------------------------------------------------------------------


def test_existing_directory_is_returned_resolved(tmp_path, monkeypatch):
    (tmp_path / "models" / "tiny").mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "models")
    assert resolve_model("./tiny/../tiny") == (tmp_path / "models" / "tiny").resolve()


def test_home_relative_directory_is_expanded(tmp_path, monkeypatch):
    (tmp_path / "tiny").mkdir()
    monkeypatch.setenv("HOME", str(tmp_path))
    assert resolve_model("~/tiny") == (tmp_path / "tiny").resolve()


def test_existing_directory_wins_over_the_hub_id_it_looks_like(tmp_path, monkeypatch):
    (tmp_path / "Org" / "Name").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert resolve_model(REPO_ID) == (tmp_path / "Org" / "Name").resolve()


@pytest.mark.parametrize("spec", ["./nope", "/nope", "~/nope", "nope", "a/b/c"])
def test_missing_path_is_a_usage_error_naming_it(spec, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path))
    if spec == "/nope" and Path(spec).exists():
        pytest.skip("/nope exists on this machine")
    with pytest.raises(UsageError) as caught:
        resolve_model(spec)
    assert caught.value.exit_code == 2
    assert spec in str(caught.value)


def test_file_instead_of_directory_is_a_usage_error_naming_it(tmp_path):
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"")
    with pytest.raises(UsageError) as caught:
        resolve_model(str(weights))
    assert caught.value.exit_code == 2
    assert str(weights) in str(caught.value)


# --- hub ids ---------------------------------------------------------------------------------


def test_hub_id_in_the_cache_resolves_to_its_snapshot_offline(cached_snapshot):
    assert resolve_model(REPO_ID).resolve() == cached_snapshot.resolve()


def test_hub_id_in_the_cache_resolves_without_asking_the_hub(cached_snapshot, monkeypatch):
    def no_network(*args, **kwargs):
        raise AssertionError("the hub was asked about a cached model")

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub.HfApi, "repo_info", no_network)
    assert resolve_model(REPO_ID).resolve() == cached_snapshot.resolve()


def test_hub_id_in_the_cache_opens_as_a_model(cached_snapshot, tiny_model_dir):
    model = open_model(REPO_ID)
    try:
        assert model.spec == REPO_ID
        assert model.directory.resolve() == cached_snapshot.resolve()
        local = open_model(str(tiny_model_dir))
        assert model.config == local.config
        name = "model.layers.0.self_attn.q_proj.weight"
        np.testing.assert_array_equal(model.checkpoint.float32(name),
                                      local.checkpoint.float32(name))
        local.close()
    finally:
        model.close()


def test_hub_id_not_in_the_cache_offline_says_how_to_get_it(hub_cache):
    with pytest.raises(ModelError) as caught:
        resolve_model("Org/Missing")
    message = str(caught.value)
    assert "Org/Missing" in message
    assert "network" in message
    assert "--model DIR" in message
    assert "unset HF_HUB_OFFLINE" in message


def test_a_failed_download_names_hf_hub_offline_only_where_it_is_set(hub_cache, monkeypatch):
    def no_network(repo_id, *, local_files_only=False, **_):
        raise huggingface_hub.errors.LocalEntryNotFoundError("cannot reach the hub")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", no_network)
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    with pytest.raises(ModelError) as caught:
        resolve_model("Org/Missing")
    assert "connect to the network" in str(caught.value)
    assert "OFFLINE" not in str(caught.value)


# --- download progress, as the chat's loading screen shows it ---------------------------------


def test_a_download_is_reported_as_one_line_of_bytes_speed_and_files(capsys):
    lines, now = [], [0.0]
    bar = download_bars(lines.append, clock=lambda: now[0])
    files = bar(total=5, desc="Fetching 5 files")
    assert lines[-1] == "0 of 5 files"
    data = bar(total=1_500_000_000, unit="B", unit_scale=True, desc="Downloading")
    data.update(100_000_000)
    assert lines[-1] == "100 MB of 1.50 GB · 0 of 5 files"  # no speed yet: too soon
    now[0] = 2.0
    data.update(76_400_000)
    files.update(2)
    assert lines[-1] == "176 MB of 1.50 GB · 38.2 MB/s · 2 of 5 files"
    data.close()
    files.close()
    assert capsys.readouterr() == ("", "")  # nothing drawn on the terminal


def test_a_download_of_unknown_size_reports_the_bytes_so_far():
    lines = []
    bar = download_bars(lines.append)
    bar(unit="B", desc="Downloading bytes").update(5_300)
    assert lines[-1] == "5.30 kB"


def test_a_hub_download_reports_its_progress_through_huggingface_hubs_bars(hub_cache,
                                                                          tiny_model_dir,
                                                                          monkeypatch):
    # What snapshot_download does with tqdm_class: a bar for the files, one for the bytes.
    def fake_snapshot_download(repo_id, *, local_files_only=False, tqdm_class=None, **_):
        if local_files_only:
            raise huggingface_hub.errors.LocalEntryNotFoundError(f"{repo_id} is not cached")
        with tqdm_class(total=1, desc="Fetching 1 files") as files, \
                tqdm_class(total=2_000, unit="B", desc="Downloading") as data:
            data.update(2_000)
            files.update(1)
        return str(tiny_model_dir)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    lines = []
    assert resolve_model(REPO_ID, lines.append) == tiny_model_dir
    assert lines[-1] == "2.00 kB of 2.00 kB · 1 of 1 files"


# --- through the command line ----------------------------------------------------------------


def qwenchat_command() -> str:
    beside = Path(sys.executable).parent / "qwenchat"
    found = str(beside) if beside.is_file() else shutil.which("qwenchat")
    if not found:
        pytest.skip("the qwenchat console script is not installed")
    return found


def run_ask(home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env.pop("QWENCHAT_MODEL", None)
    env.update(HF_HOME=str(home / "hf"), HF_HUB_CACHE=str(home / "hf" / "hub"),
               HF_HUB_OFFLINE="1", XDG_CACHE_HOME=str(home / "cache"),
               XDG_DATA_HOME=str(home / "data"))
    return subprocess.run(
        [qwenchat_command(), "ask", "--backend", "cpu", *args, "hi"],
        capture_output=True, text=True, env=env, stdin=subprocess.DEVNULL, timeout=120,
        cwd=home,
    )


def assert_one_line_error(result: subprocess.CompletedProcess[str], code: int) -> str:
    assert result.returncode == code, result.stderr
    assert result.stdout == ""
    assert "Traceback" not in result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("qwenchat: error:")
    return lines[0]


def test_cli_hub_id_not_in_the_cache_offline_fails_in_one_line(isolated_home):
    line = assert_one_line_error(run_ask(isolated_home, "--model", "Org/Missing"), 1)
    assert "Org/Missing" in line
    assert "network" in line
    assert "--model DIR" in line


def test_cli_missing_model_directory_is_a_usage_error(isolated_home):
    line = assert_one_line_error(run_ask(isolated_home, "--model", "./nope"), 2)
    assert "./nope" in line


def test_cli_answers_from_a_hub_id_in_the_cache_offline(isolated_home, tiny_model_dir):
    fake_hub_cache(isolated_home / "hf" / "hub", REPO_ID, tiny_model_dir)
    result = run_ask(isolated_home, "--model", REPO_ID, "--max-tokens", "2", "--seed", "1")
    assert result.returncode == 0, result.stderr
    assert "error" not in result.stderr
    assert result.stdout.endswith("\n")
