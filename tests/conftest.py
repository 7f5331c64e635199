"""Shared fixtures: tiny random Qwen3 checkpoints, the real tokenizer when CI provides it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from tiny_model import train_tokenizer, write_tiny_model

COMPILE_MATRIX_VAR = "QWENCHAT_COMPILE_MATRIX"


def pytest_collection_modifyitems(config, items):
    """The full kernel compile matrix (minutes of NVRTC) runs only where asked for."""
    if os.environ.get(COMPILE_MATRIX_VAR) == "1":
        return
    skip = pytest.mark.skip(reason=f"the full kernel compile matrix: {COMPILE_MATRIX_VAR}=1 "
                                   f"runs it (CI does)")
    for item in items:
        if item.get_closest_marker("compile_matrix") is not None:
            item.add_marker(skip)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config):
    """`-n auto` (pyproject's addopts): a worker a core this process may use, at most 4 (the
    GPU tests share one card). An explicit `-n N` is taken as given."""
    from qwenchat.engine.cuda.compiler import usable_cpus

    return min(usable_cpus(), 4)


def pytest_collection_finish(session):
    """The kernel compile tests' builds start now, on low-priority threads, and compile while
    the tests before them run (test_kernels_compile.py, start_compiles_early)."""
    for item in session.items:
        start = getattr(getattr(item, "module", None), "start_compiles_early", None)
        if start is not None:
            start(session)
            return


@pytest.fixture(scope="session")
def tiny_tokenizer():
    return train_tokenizer()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, tiny_tokenizer) -> Path:
    """A 2-layer bf16 model with a tied LM head and the ChatML template."""
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "model", tokenizer=tiny_tokenizer)


@pytest.fixture(scope="session")
def real_tokenizer_dir() -> Path:
    """The real Qwen3 tokenizer directory named by QWENCHAT_TEST_TOKENIZER, else skip."""
    value = os.environ.get("QWENCHAT_TEST_TOKENIZER")
    if not value or not (Path(value) / "tokenizer.json").is_file():
        pytest.skip("QWENCHAT_TEST_TOKENIZER does not name a directory with the real Qwen3 "
                    "tokenizer")
    return Path(value)


@pytest.fixture(scope="session")
def cuda_gpu():
    """Skip unless cuda-python imports and a usable CUDA GPU is present (the `gpu` tests)."""
    try:
        from qwenchat.engine.cuda.probe import probe
    except ImportError as exc:
        pytest.skip(f"cuda-python not importable: {exc}")
    found = probe()
    if not found.usable:
        pytest.skip("no usable CUDA GPU: " + ("; ".join(found.problems) or "unknown reason"))
    return found


@pytest.fixture
def isolated_home(tmp_path, monkeypatch) -> Path:
    """Point every per-user directory (HF cache, qwenchat cache and data) into tmp_path."""
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    return tmp_path


@pytest.fixture
def spy_calls(monkeypatch):
    """spy_calls(owner, attribute): wraps owner.attribute (for this test) so that each call
    still runs and its first argument is recorded; returns the list of those arguments."""

    def spy_on(owner, attribute: str) -> list:
        calls: list = []
        real = getattr(owner, attribute)

        def spy(first, *args, **kwargs):
            calls.append(first)
            return real(first, *args, **kwargs)

        monkeypatch.setattr(owner, attribute, spy)
        return calls

    return spy_on
