"""What `info` and `--backend auto` conclude from the CUDA stack they find (no GPU needed)."""

from __future__ import annotations

import dataclasses

from qwenchat.engine.cuda.probe import NO_DRIVER, CudaProbe, GpuInfo

H100 = GpuInfo(0, "NVIDIA H100 80GB HBM3", (9, 0), 80 * 2**30, 132)


def test_matching_driver_and_nvrtc_is_usable():
    found = CudaProbe(driver_version="13.0", nvrtc_version="13.0", gpus=[H100])
    assert found.usable and found.mismatch is None


def test_older_driver_than_nvrtc_names_the_extra_that_fixes_it():
    found = CudaProbe(driver_version="12.8", nvrtc_version="13.0", gpus=[H100])
    assert not found.usable
    assert "pip install 'qwenchat[cu12]'" in found.mismatch


def test_newer_driver_runs_older_nvrtc_code():
    assert CudaProbe(driver_version="13.0", nvrtc_version="12.9", gpus=[H100]).usable


def test_no_gpu_or_no_nvrtc_is_not_usable():
    assert not CudaProbe(driver_version="13.0", nvrtc_version=None, gpus=[H100]).usable
    assert not CudaProbe(driver_version="13.0", nvrtc_version="13.0", gpus=[]).usable


def test_no_driver_is_the_one_problem_whatever_nvrtc_says():
    for nvrtc in (None, "13.0"):
        assert CudaProbe(driver_version=None, nvrtc_version=nvrtc).problems == [NO_DRIVER]


def test_a_driver_without_a_gpu_says_so_without_nvrtc_advice():
    assert CudaProbe(driver_version="13.0").problems == ["the driver reports no GPU"]


def test_a_driver_without_nvrtc_names_the_library_once_and_the_extra_for_that_driver():
    for driver, extra in (("13.0", "cu13"), ("12.8", "cu12")):
        (problem,) = CudaProbe(driver_version=driver, nvrtc_version=None, gpus=[H100]).problems
        assert problem.count("libnvrtc") == 1 and "NVRTC" in problem
        assert problem.endswith(f"pip install 'qwenchat[{extra}]'")
    (old,) = CudaProbe(driver_version="11.8", nvrtc_version=None, gpus=[H100]).problems
    assert "update the NVIDIA driver" in old and "pip" not in old


def cpu_notice(found: CudaProbe, monkeypatch) -> list[str]:
    """What `--backend auto` says as it falls back to the CPU where the probe finds `found`."""
    from qwenchat.engine import create_engine
    from qwenchat.engine.cuda import probe as cuda_probe
    from qwenchat.model.presets import PRESETS
    from qwenchat.model.random_weights import RandomWeights

    config = dataclasses.replace(PRESETS["qwen3-0.6b"], num_hidden_layers=1,
                                 max_position_embeddings=64)
    monkeypatch.setattr(cuda_probe, "probe", lambda: found)
    said: list[str] = []
    create_engine("auto", config, RandomWeights(config), ctx=16, notice=said.append).close()
    return said


def test_auto_without_a_driver_says_in_one_short_line_that_it_runs_on_the_cpu(monkeypatch):
    (line,) = cpu_notice(CudaProbe(nvrtc_version=None), monkeypatch)
    assert line == "no NVIDIA driver: running on the CPU (--backend cpu skips this note)"


def test_auto_with_a_driver_but_no_nvrtc_says_what_to_install(monkeypatch):
    (line,) = cpu_notice(CudaProbe(driver_version="13.0", gpus=[H100]), monkeypatch)
    assert line.startswith("running on the CPU: ") and line.count("libnvrtc") == 1
    assert line.endswith("pip install 'qwenchat[cu13]'") and len(line) < 120


def test_without_a_driver_the_probe_answers_before_importing_cuda_python(monkeypatch):
    # (cuda-python blocked: had the probe imported it, its answer would be the import error)
    import sys

    from qwenchat.engine.cuda import probe as cuda_probe

    for name in ("cuda", "cuda.bindings", "cuda.bindings.driver", "cuda.bindings.nvrtc"):
        monkeypatch.setitem(sys.modules, name, None)  # (whether imported before or not)
    monkeypatch.setattr(cuda_probe, "driver_library_loads", lambda: False)
    found = cuda_probe.probe()
    assert found.problems == [NO_DRIVER] and found.nvrtc_version is None
    monkeypatch.setattr(cuda_probe, "driver_library_loads", lambda: True)
    assert "cuda-python is not importable" in cuda_probe.probe().problems[0]


def test_a_cpu_answer_imports_no_cuda_python_where_there_is_no_driver(tiny_model_dir):
    import subprocess
    import sys

    import pytest

    from qwenchat.engine.cuda.probe import driver_library_loads

    if driver_library_loads():
        pytest.skip("this machine has an NVIDIA driver")
    script = ("import sys; from qwenchat.cli import main; "
              "sys.argv = ['qwenchat', 'ask', '--model', sys.argv[1], '--max-tokens', '2', 'Hi']\n"
              "try:\n    main()\nexcept SystemExit:\n    pass\n"
              "print('imported' if 'cuda.bindings.driver' in sys.modules else 'not imported')")
    result = subprocess.run([sys.executable, "-c", script, str(tiny_model_dir)],
                            capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert result.stdout.splitlines()[-1] == "not imported", result.stderr
    assert "no NVIDIA driver: running on the CPU" in result.stderr
