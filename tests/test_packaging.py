"""The wheel carries cuda_src/, and an installed (non-editable) copy finds it; ruff is clean."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    pytest.importorskip("build")
    pytest.importorskip("hatchling")
    out = tmp_path_factory.mktemp("dist")
    subprocess.run([sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir",
                    str(out), str(ROOT)], check=True, capture_output=True, timeout=300)
    return next(out.glob("qwenchat-*.whl"))


def test_wheel_contains_every_cuda_source(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    sources = sorted(p.name for p in (ROOT / "cuda_src").glob("*.cu*"))
    assert sources
    for name in sources:
        assert f"qwenchat/cuda_src/{name}" in names


def test_installed_wheel_finds_its_cuda_sources(wheel, tmp_path):
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index",
                    "--target", str(target), str(wheel)], check=True, capture_output=True,
                   timeout=300)
    probe = ("from qwenchat.engine.cuda.sources import cuda_src_dir, kernel_sources;"
             "print(cuda_src_dir()); print(sorted(kernel_sources()))")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                            cwd=tmp_path, env={"PYTHONPATH": str(target)}, timeout=60)
    assert result.returncode == 0, result.stderr
    found, names = result.stdout.splitlines()
    assert Path(found) == target / "qwenchat" / "cuda_src"
    assert "qwen3.cuh" in names


def test_console_script_is_declared(wheel):
    with zipfile.ZipFile(wheel) as archive:
        entry_points = next(n for n in archive.namelist() if n.endswith("entry_points.txt"))
        assert "qwenchat = qwenchat.cli:main" in archive.read(entry_points).decode()


def test_ruff_is_clean():
    ruff = shutil.which("ruff") or str(Path(sys.executable).parent / "ruff")
    if not Path(ruff).exists():
        pytest.skip("ruff is not installed (pip install -e '.[dev]')")
    result = subprocess.run([ruff, "check", str(ROOT)], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stdout


def test_every_import_of_qwenchat_in_the_tests_resolves():
    """CI has no GPU, so the GPU tests' bodies never run there: an import inside one of a name
    that has moved fails only on a GPU (`qwenchat.model.fp8.weight_bytes` did, three tests for
    a while). Every `from qwenchat... import name` and `import qwenchat...` in tests/, at module
    level or inside a function, names something that exists."""
    import ast
    import importlib

    missing = []
    for path in sorted(Path(__file__).parent.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            where = f"{path.name}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] == "qwenchat":
                        try:
                            importlib.import_module(alias.name)
                        except ImportError as exc:
                            missing.append(f"{where}: import {alias.name} ({exc})")
            elif (isinstance(node, ast.ImportFrom) and node.level == 0 and node.module
                  and node.module.split(".")[0] == "qwenchat"):
                try:
                    module = importlib.import_module(node.module)
                except ImportError as exc:
                    missing.append(f"{where}: from {node.module} ({exc})")
                    continue
                for alias in node.names:
                    if hasattr(module, alias.name):
                        continue
                    try:  # a submodule not imported yet
                        importlib.import_module(f"{node.module}.{alias.name}")
                    except ImportError:
                        missing.append(f"{where}: from {node.module} import {alias.name}")
    assert not missing, "\n".join(missing)


@pytest.mark.parametrize(("cores", "workers"), [(1, 1), (2, 2), (16, 4)])
def test_the_test_commands_auto_workers_are_a_core_each_and_at_most_four(monkeypatch, cores,
                                                                        workers):
    """pyproject's `-n auto`: conftest's pytest_xdist_auto_num_workers (an explicit `-n N` is
    never capped)."""
    import os

    import conftest

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)), raising=False)
    assert conftest.pytest_xdist_auto_num_workers(None) == workers
