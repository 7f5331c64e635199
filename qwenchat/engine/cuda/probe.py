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


@dataclass
class CudaProbe:
    driver_version: str | None = None
    nvrtc_version: str | None = None
    gpus: list[GpuInfo] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    @property
    def usable(self) -> bool:
        return bool(self.gpus) and self.nvrtc_version is not None and not self.mismatch

    @property
    def mismatch(self) -> str | None:
        """Why NVRTC's CUDA version cannot run on this driver, with the install that fixes it."""
        if not self.driver_version or not self.nvrtc_version:
            return None
        driver_major = int(self.driver_version.split(".")[0])
        nvrtc_major = int(self.nvrtc_version.split(".")[0])
        if nvrtc_major <= driver_major:
            return None
        return (f"NVRTC {self.nvrtc_version} builds CUDA {nvrtc_major} code but the driver runs "
                f"CUDA {self.driver_version}: pip install 'qwenchat[cu{driver_major}]' "
                "(or update the NVIDIA driver)")


def _version(number: int) -> str:
    return f"{number // 1000}.{(number % 1000) // 10}"


def probe() -> CudaProbe:
    """Ask the driver and NVRTC what they have, turning every failure into a readable problem."""
    result = CudaProbe()
    try:
        from cuda.bindings import driver, nvrtc
    except Exception as exc:
        result.problems.append(f"cuda-python is not importable ({exc}); pip install cuda-python")
        return result
    try:
        (err, major, minor) = nvrtc.nvrtcVersion()
        if err == nvrtc.nvrtcResult.NVRTC_SUCCESS:
            result.nvrtc_version = f"{major}.{minor}"
    except Exception as exc:
        result.problems.append(f"NVRTC not found ({_first_line(exc)}); pip install "
                               "'qwenchat[cu13]' (or 'qwenchat[cu12]' for a CUDA 12 driver)")
    try:
        (err,) = driver.cuInit(0)
    except Exception as exc:
        result.problems.append(f"no NVIDIA driver ({_first_line(exc)})")
        return result
    if err != driver.CUresult.CUDA_SUCCESS:
        result.problems.append(f"cuInit failed: {err.name}")
        return result
    err, version = driver.cuDriverGetVersion()
    result.driver_version = _version(version)
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
    if not result.gpus:
        result.problems.append("the driver reports no GPU")
    if result.mismatch:
        result.problems.append(result.mismatch)
    return result


def _first_line(exc: BaseException) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
