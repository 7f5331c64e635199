"""What the CUDA stack on this machine offers: driver, GPUs, NVRTC, or why it is unusable."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class GpuInfo:
    index: int
    name: str
    compute_capability: tuple[int, int]
    total_memory: int
    sm_count: int


NO_DRIVER = "no NVIDIA driver found"  # the usual CPU-only machine: nothing to fix


@dataclass
class CudaProbe:
    driver_version: str | None = None  # None: no NVIDIA driver (libcuda) on this machine
    nvrtc_version: str | None = None
    gpus: list[GpuInfo] = field(default_factory=list)
    import_error: str | None = None  # why cuda-python cannot be imported
    driver_error: str | None = None  # why a driver that is there cannot start

    @property
    def usable(self) -> bool:
        return bool(self.gpus) and self.nvrtc_version is not None and not self.mismatch

    @property
    def problems(self) -> list[str]:
        """What keeps the CUDA backend from running: the first cause, in one line with its fix
        (NVRTC is advised on only where a driver and a GPU are there to run what it builds)."""
        if self.import_error is not None:
            return [f"cuda-python is not importable ({self.import_error}); pip install "
                    "cuda-python"]
        if self.driver_version is None:
            return [NO_DRIVER]
        if self.driver_error is not None:
            return [f"the NVIDIA driver cannot start ({self.driver_error})"]
        if not self.gpus:
            return ["the driver reports no GPU"]
        if self.nvrtc_version is None:
            return [f"no NVRTC (libnvrtc, the CUDA compiler) for the CUDA "
                    f"{self.driver_version} driver: {self._nvrtc_fix()}"]
        return [self.mismatch] if self.mismatch else []

    @property
    def mismatch(self) -> str | None:
        """Why NVRTC's CUDA version cannot run on this driver, with the install that fixes it."""
        if not self.driver_version or not self.nvrtc_version:
            return None
        nvrtc_major = int(self.nvrtc_version.split(".")[0])
        if nvrtc_major <= self._driver_major():
            return None
        fix = self._nvrtc_fix()
        if fix.startswith("pip"):
            fix += " (or update the NVIDIA driver)"
        return (f"NVRTC {self.nvrtc_version} builds CUDA {nvrtc_major} code but the driver runs "
                f"CUDA {self.driver_version}: {fix}")

    def _driver_major(self) -> int:
        return int((self.driver_version or "0").split(".")[0])

    def _nvrtc_fix(self) -> str:
        """The install that gives NVRTC for this driver (a newer driver runs older code)."""
        major = self._driver_major()
        if major < 12:
            return "update the NVIDIA driver to CUDA 12 or newer"
        return f"pip install 'qwenchat[cu{min(major, 13)}]'"


def _version(number: int) -> str:
    return f"{number // 1000}.{(number % 1000) // 10}"


def driver_library_loads() -> bool:
    """Whether the NVIDIA driver's library (libcuda, nvcuda.dll on Windows) loads: a few
    milliseconds, where importing cuda-python's bindings and loading NVRTC to find that out
    took ~0.4 s of every answer on a machine without a GPU (docs/perf.md)."""
    import ctypes
    import sys

    try:
        ctypes.CDLL("nvcuda.dll" if sys.platform == "win32" else "libcuda.so.1")
    except OSError:
        return False
    return True


def probe_nvrtc() -> str | None:
    """NVRTC's CUDA version ("13.0"), or None where cuda-python or libnvrtc is missing."""
    try:
        from cuda.bindings import nvrtc

        (err, major, minor) = nvrtc.nvrtcVersion()
    except Exception:  # libnvrtc not found: `problems` says what to install for the driver
        return None
    return f"{major}.{minor}" if err == nvrtc.nvrtcResult.NVRTC_SUCCESS else None


def probe() -> CudaProbe:
    """Ask the driver and NVRTC what they have, turning every failure into a readable problem.
    Without a driver that is the whole answer (NO_DRIVER), found without cuda-python's import;
    NVRTC's version is then left out (`probe_nvrtc` asks for it)."""
    result = CudaProbe()
    if not driver_library_loads():
        return result
    try:
        from cuda.bindings import driver
    except Exception as exc:
        result.import_error = str(exc)
        return result
    result.nvrtc_version = probe_nvrtc()
    try:
        # Answered by libcuda before cuInit: this fails only where there is no driver at all.
        err, version = driver.cuDriverGetVersion()
    except Exception:
        return result
    if err != driver.CUresult.CUDA_SUCCESS:
        return result
    result.driver_version = _version(version)
    try:
        (err,) = driver.cuInit(0)
    except Exception as exc:
        result.driver_error = _first_line(exc)
        return result
    if err != driver.CUresult.CUDA_SUCCESS:
        result.driver_error = f"cuInit returned {err.name}"
        return result
    err, count = driver.cuDeviceGetCount()
    attr = driver.CUdevice_attribute
    for index in range(count if err == driver.CUresult.CUDA_SUCCESS else 0):
        _, dev = driver.cuDeviceGet(index)
        _, name = driver.cuDeviceGetName(256, dev)
        _, cc_major = driver.cuDeviceGetAttribute(
            attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev)
        _, cc_minor = driver.cuDeviceGetAttribute(
            attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev)
        _, sms = driver.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev)
        _, memory = driver.cuDeviceTotalMem(dev)
        result.gpus.append(GpuInfo(index, name.split(b"\0", 1)[0].decode(errors="replace"),
                                   (cc_major, cc_minor), int(memory), sms))
    return result


def _first_line(exc: BaseException) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
