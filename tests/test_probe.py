"""What `info` and `--backend auto` conclude from the CUDA stack they find (no GPU needed)."""

from __future__ import annotations

from qwenchat.engine.cuda.probe import CudaProbe, GpuInfo

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
