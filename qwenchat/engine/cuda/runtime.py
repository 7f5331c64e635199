"""A thin, checked layer over the CUDA driver API: device, memory, streams, kernels, graphs.

Every driver call goes through `check`, so a failure surfaces as one `CudaError` line naming the
call and CUDA's own error name and text. Only APIs whose Python signatures are the same in
cuda-python 12.6+ and 13.x are used.
"""

from __future__ import annotations

import ctypes
import statistics
import threading
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
from cuda.bindings import driver

from qwenchat.errors import BackendUnavailable, QwenchatError

_SUCCESS = driver.CUresult.CUDA_SUCCESS
_ATTR = driver.CUdevice_attribute
_FUNC_ATTR = driver.CUfunction_attribute


class CudaError(QwenchatError):
    """A driver call that failed; `result` is the CUresult it returned."""

    def __init__(self, call: str, result: Any) -> None:
        super().__init__(f"{call} failed: {describe(result)}")
        self.call = call
        self.result = result


def describe(result: Any) -> str:
    """CUDA's name and text for a CUresult, e.g. "CUDA_ERROR_OUT_OF_MEMORY (out of memory)"."""
    fallback = str(getattr(result, "name", result))
    try:
        name_err, name = driver.cuGetErrorName(result)
        text_err, text = driver.cuGetErrorString(result)
    except Exception:  # the driver library itself may be what is broken
        return fallback
    name = name.decode(errors="replace") if name_err == _SUCCESS and name else fallback
    if text_err == _SUCCESS and text:
        return f"{name} ({text.decode(errors='replace')})"
    return name


def check(result: tuple, call: str) -> Any:
    """Unwrap cuda-python's `(err, *values)`: None, the single value, or a tuple of them."""
    err, *values = result
    if err != _SUCCESS:
        raise CudaError(call, err)
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


class Device:
    """One GPU with its primary context made current on the calling thread."""

    def __init__(self, index: int = 0) -> None:
        try:
            (err,) = driver.cuInit(0)
        except Exception as exc:  # libcuda missing: cuda-python raises while loading it
            first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise BackendUnavailable(f"no NVIDIA driver found ({first_line})") from exc
        if err != _SUCCESS:
            raise BackendUnavailable(f"the NVIDIA driver cannot start: {describe(err)}")
        count = check(driver.cuDeviceGetCount(), "cuDeviceGetCount")
        if count == 0:
            raise BackendUnavailable("the NVIDIA driver reports no GPU")
        if not 0 <= index < count:
            raise BackendUnavailable(
                f"there is no GPU {index}: this machine has {count} "
                f"(0 to {count - 1}); choose one with --device")
        self.index = index
        self.handle = check(driver.cuDeviceGet(index), "cuDeviceGet")
        self.context = check(driver.cuDevicePrimaryCtxRetain(self.handle),
                             "cuDevicePrimaryCtxRetain")
        self._retained = True
        try:
            self.make_current()
            self._read_properties()
        except CudaError:
            self.close()
            raise

    def _read_properties(self) -> None:
        raw_name = check(driver.cuDeviceGetName(256, self.handle), "cuDeviceGetName")
        self.name = raw_name.split(b"\0", 1)[0].decode(errors="replace")
        self.compute_capability = (
            self._attribute(_ATTR.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR),
            self._attribute(_ATTR.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR))
        self.arch = "sm_{}{}".format(*self.compute_capability)
        self.sm_count = self._attribute(_ATTR.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
        self.total_memory = int(check(driver.cuDeviceTotalMem(self.handle), "cuDeviceTotalMem"))
        self.l2_size = self._attribute(_ATTR.CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE)
        self.max_shared_per_block_optin = self._attribute(
            _ATTR.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)
        self.max_threads_per_sm = self._attribute(
            _ATTR.CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR)
        self.cooperative_launch = bool(
            self._attribute(_ATTR.CU_DEVICE_ATTRIBUTE_COOPERATIVE_LAUNCH))
        # The memory's peak bandwidth (bytes/s: two transfers a clock over the bus), or 0
        # where the driver does not say.
        try:
            clock_khz = self._attribute(_ATTR.CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE)
            bus_bits = self._attribute(_ATTR.CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH)
        except (AttributeError, CudaError):
            clock_khz = bus_bits = 0
        self.memory_bandwidth = 2.0 * clock_khz * 1000 * bus_bits / 8

    def _attribute(self, attribute: Any) -> int:
        return int(check(driver.cuDeviceGetAttribute(attribute, self.handle),
                         f"cuDeviceGetAttribute({attribute.name})"))

    def make_current(self) -> None:
        """Contexts are per thread: call this first in any method run from another thread."""
        check(driver.cuCtxSetCurrent(self.context), "cuCtxSetCurrent")

    def mem_info(self) -> tuple[int, int]:
        free, total = check(driver.cuMemGetInfo(), "cuMemGetInfo")
        return int(free), int(total)

    def synchronize(self) -> None:
        check(driver.cuCtxSynchronize(), "cuCtxSynchronize")

    def close(self) -> None:
        if self._retained:
            self._retained = False
            check(driver.cuDevicePrimaryCtxRelease(self.handle), "cuDevicePrimaryCtxRelease")

    def __enter__(self) -> Device:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class Stream:
    """A non-blocking stream: it never waits on the legacy default stream."""

    def __init__(self) -> None:
        flags = driver.CUstream_flags.CU_STREAM_NON_BLOCKING.value
        self.handle = check(driver.cuStreamCreate(flags), "cuStreamCreate")

    def synchronize(self) -> None:
        check(driver.cuStreamSynchronize(self.handle), "cuStreamSynchronize")

    def idle(self) -> bool:
        """Whether everything queued on the stream has finished (without waiting)."""
        (err,) = driver.cuStreamQuery(self.handle)
        if err == driver.CUresult.CUDA_ERROR_NOT_READY:
            return False
        check((err,), "cuStreamQuery")
        return True

    def close(self) -> None:
        if self.handle is not None:
            check(driver.cuStreamDestroy(self.handle), "cuStreamDestroy")
            self.handle = None


def _stream_handle(stream: Stream | None) -> Any:
    return driver.CUstream(0) if stream is None else stream.handle


def _finish(stream: Stream | None) -> None:
    """Wait for the default stream when no stream was given. The driver's "synchronous" copies
    and memsets may return before the device is done, and our streams do not wait on the
    default stream, so a kernel launched next on a Stream could otherwise see stale memory."""
    if stream is None:
        check(driver.cuStreamSynchronize(driver.CUstream(0)), "cuStreamSynchronize")


class Event:
    """A timing event: record it on a stream, then measure from another event."""

    def __init__(self) -> None:
        flags = driver.CUevent_flags.CU_EVENT_DEFAULT.value
        self.handle = check(driver.cuEventCreate(flags), "cuEventCreate")

    def record(self, stream: Stream | None = None) -> None:
        check(driver.cuEventRecord(self.handle, _stream_handle(stream)), "cuEventRecord")

    def synchronize(self) -> None:
        check(driver.cuEventSynchronize(self.handle), "cuEventSynchronize")

    def elapsed_ms(self, start_event: Event) -> float:
        """Milliseconds from `start_event` to this event; both must have completed."""
        return float(check(driver.cuEventElapsedTime(start_event.handle, self.handle),
                           "cuEventElapsedTime"))

    def close(self) -> None:
        if self.handle is not None:
            check(driver.cuEventDestroy(self.handle), "cuEventDestroy")
            self.handle = None


_memory_lock = threading.Lock()
_allocated = 0
_peak = 0


def allocated_bytes() -> int:
    """Bytes held by live DeviceBuffers of this process."""
    return _allocated


def peak_allocated_bytes() -> int:
    """The most bytes DeviceBuffers held at once since the start or the last `reset_peak()`."""
    return _peak


def reset_peak() -> None:
    global _peak
    with _memory_lock:
        _peak = _allocated


def _restore_peak(value: int) -> None:
    global _peak
    with _memory_lock:
        _peak = max(value, _allocated)


def _count_allocation(nbytes: int) -> None:
    global _allocated, _peak
    with _memory_lock:
        _allocated += nbytes
        _peak = max(_peak, _allocated)


class DeviceBuffer:
    """GPU memory from cuMemAlloc, counted in `allocated_bytes()` until freed."""

    def __init__(self, nbytes: int) -> None:
        if nbytes <= 0:
            raise ValueError(f"a DeviceBuffer needs at least one byte, not {nbytes}")
        self.nbytes = nbytes
        self._ptr = int(check(driver.cuMemAlloc(nbytes), "cuMemAlloc"))
        _count_allocation(nbytes)

    @property
    def ptr(self) -> int:
        if not self._ptr:
            raise ValueError("DeviceBuffer used after free()")
        return self._ptr

    def _host_range(self, array: np.ndarray, offset: int, what: str) -> int:
        if not array.flags.c_contiguous:
            raise ValueError(f"{what} needs a C-contiguous array")
        if offset < 0 or offset + array.nbytes > self.nbytes:
            raise ValueError(f"{what} of {array.nbytes} bytes at offset {offset} does not fit "
                             f"in a {self.nbytes}-byte DeviceBuffer")
        return self.ptr + offset

    def upload(self, array: np.ndarray, offset: int = 0, stream: Stream | None = None) -> None:
        """Copy `array` into the buffer at byte `offset`. Without a stream it is done when this
        returns; on a stream it is async, and a pinned `array` must not change until the
        stream is past it."""
        dst = self._host_range(array, offset, "upload")
        if array.nbytes:
            check(driver.cuMemcpyHtoDAsync(dst, array.ctypes.data, array.nbytes,
                                           _stream_handle(stream)), "cuMemcpyHtoDAsync")
        _finish(stream)

    def download(self, out: np.ndarray, offset: int = 0, stream: Stream | None = None) -> None:
        """Fill `out` from the buffer at byte `offset`. Without a stream it waits for the
        default stream only, so synchronize the Stream that wrote the buffer first; on a
        stream, read `out` only after synchronizing it."""
        src = self._host_range(out, offset, "download")
        if not out.flags.writeable:
            raise ValueError("download needs a writeable array")
        if out.nbytes:
            check(driver.cuMemcpyDtoHAsync(out.ctypes.data, src, out.nbytes,
                                           _stream_handle(stream)), "cuMemcpyDtoHAsync")
        _finish(stream)

    def copy_from(self, src: DeviceBuffer, nbytes: int, src_offset: int = 0, offset: int = 0,
                  stream: Stream | None = None) -> None:
        """Copy `nbytes` of `src` from byte `src_offset` into this buffer at byte `offset`, on
        the device (async on a stream)."""
        if not (0 <= src_offset <= src.nbytes - nbytes and 0 <= offset <= self.nbytes - nbytes):
            raise ValueError(f"copy of {nbytes} bytes from byte {src_offset} of a {src.nbytes}-"
                             f"byte buffer to byte {offset} of a {self.nbytes}-byte one")
        if nbytes:
            check(driver.cuMemcpyDtoDAsync(self.ptr + offset, src.ptr + src_offset, nbytes,
                                           _stream_handle(stream)), "cuMemcpyDtoDAsync")
        _finish(stream)

    def fill_u8(self, value: int, stream: Stream | None = None) -> None:
        """Set every byte to `value` (tests poison buffers so stale reads show up as NaN)."""
        check(driver.cuMemsetD8Async(self.ptr, value, self.nbytes, _stream_handle(stream)),
              "cuMemsetD8Async")
        _finish(stream)

    def free(self) -> None:
        global _allocated
        if self._ptr:
            ptr, self._ptr = self._ptr, 0
            check(driver.cuMemFree(ptr), "cuMemFree")
            with _memory_lock:
                _allocated -= self.nbytes

    def __enter__(self) -> DeviceBuffer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.free()


class PinnedBuffer:
    """Page-locked host memory; `mapped=True` also gives kernels a `device_ptr` into it."""

    def __init__(self, nbytes: int, mapped: bool = False) -> None:
        if nbytes <= 0:
            raise ValueError(f"a PinnedBuffer needs at least one byte, not {nbytes}")
        self.nbytes = nbytes
        self.mapped = mapped
        flags = driver.CU_MEMHOSTALLOC_DEVICEMAP if mapped else 0
        self.address = int(check(driver.cuMemHostAlloc(nbytes, flags), "cuMemHostAlloc"))
        self.device_ptr: int | None = None
        if mapped:
            try:
                self.device_ptr = int(check(driver.cuMemHostGetDevicePointer(self.address, 0),
                                            "cuMemHostGetDevicePointer"))
            except CudaError:
                self.free()
                raise

    def array(self, dtype: Any, count: int | None = None) -> np.ndarray:
        """A NumPy view of the first `count` items (all that fit by default); it must not
        outlive `free()`."""
        if not self.address:
            raise ValueError("PinnedBuffer used after free()")
        itemsize = np.dtype(dtype).itemsize
        count = self.nbytes // itemsize if count is None else count
        if count < 0 or count * itemsize > self.nbytes:
            raise ValueError(f"{count} items of {np.dtype(dtype)} do not fit in "
                             f"{self.nbytes} pinned bytes")
        raw = (ctypes.c_char * self.nbytes).from_address(self.address)
        return np.frombuffer(raw, dtype=dtype, count=count)

    def free(self) -> None:
        if self.address:
            address, self.address, self.device_ptr = self.address, 0, None
            check(driver.cuMemFreeHost(address), "cuMemFreeHost")

    def __enter__(self) -> PinnedBuffer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.free()


class Kernel:
    """One `extern "C"` function of a loaded Module."""

    def __init__(self, handle: Any, name: str) -> None:
        self.handle = handle
        self.name = name

    def set_max_dynamic_shared(self, nbytes: int) -> None:
        """Opt in to more than 48 KiB of dynamic shared memory per block."""
        check(driver.cuFuncSetAttribute(
            self.handle, _FUNC_ATTR.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, nbytes),
            f"cuFuncSetAttribute({self.name})")

    def max_active_blocks_per_sm(self, block_threads: int, dynamic_shared: int = 0) -> int:
        return int(check(driver.cuOccupancyMaxActiveBlocksPerMultiprocessor(
            self.handle, block_threads, dynamic_shared),
            f"cuOccupancyMaxActiveBlocksPerMultiprocessor({self.name})"))

    def attributes(self) -> dict[str, int]:
        wanted = {"num_regs": _FUNC_ATTR.CU_FUNC_ATTRIBUTE_NUM_REGS,
                  "local_size_bytes": _FUNC_ATTR.CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES,
                  "shared_size_bytes": _FUNC_ATTR.CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES,
                  "max_threads_per_block": _FUNC_ATTR.CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK}
        return {key: int(check(driver.cuFuncGetAttribute(attribute, self.handle),
                               f"cuFuncGetAttribute({self.name}, {attribute.name})"))
                for key, attribute in wanted.items()}


class Module:
    """A cubin loaded into the current context."""

    def __init__(self, cubin: bytes) -> None:
        self.handle = check(driver.cuModuleLoadData(cubin), "cuModuleLoadData")

    def function(self, name: str) -> Kernel:
        handle = check(driver.cuModuleGetFunction(self.handle, name.encode()),
                       f"cuModuleGetFunction({name})")
        return Kernel(handle, name)

    def set_pointer(self, name: str, value: int) -> None:
        """Set the module's `__device__` pointer variable `name` (extern "C") to `value`."""
        address, size = check(driver.cuModuleGetGlobal(self.handle, name.encode()),
                              f"cuModuleGetGlobal({name})")
        if size != 8:
            raise ValueError(f"{name} is {size} bytes, not a pointer")
        word = np.array([value], dtype=np.uint64)
        check(driver.cuMemcpyHtoD(address, word.ctypes.data, 8), "cuMemcpyHtoD")

    def close(self) -> None:
        if self.handle is not None:
            check(driver.cuModuleUnload(self.handle), "cuModuleUnload")
            self.handle = None


@dataclass(frozen=True)
class Ptr:
    """A raw device address passed as a kernel pointer argument (a bare int would be
    ambiguous: pointer or integer?)."""

    address: int

    @property
    def ptr(self) -> int:
        """The address, as a DeviceBuffer's `ptr` (a view into one: tensor maps take either)."""
        return self.address


# Scalars a kernel parameter can take; ctypes' aliases (c_int is c_int32, c_size_t is
# c_uint64 on 64-bit Linux, ...) are covered through these.
_SCALAR_TYPES = (ctypes.c_bool, ctypes.c_int8, ctypes.c_uint8, ctypes.c_int16, ctypes.c_uint16,
                 ctypes.c_int32, ctypes.c_uint32, ctypes.c_int64, ctypes.c_uint64,
                 ctypes.c_float, ctypes.c_double)

KernelArg = DeviceBuffer | PinnedBuffer | Ptr | ctypes._SimpleCData | ctypes.Structure


class TensorMap(ctypes.Structure):
    """A CUtensorMap: the tensor-memory accelerator's description of a matrix in device memory
    and of the tiles it copies out of it. Opaque; passed to a kernel by value."""

    _fields_ = [("opaque", ctypes.c_uint64 * 16)]


def tile_map(address: int, rows: int, cols: int, box_rows: int, box_cols: int, *,
             codes: bool = False, row_bytes: int | None = None,
             swizzled_codes: bool = False) -> TensorMap:
    """The tensor map of a row-major matrix (rows x cols) read in box_rows x box_cols tiles;
    elements past its bounds read as zero. bf16 values by default, each tile row written with
    the 128-byte swizzle (so box_cols must be 64); codes=True: bytes (FP8 codes), tile rows
    plain, or with swizzled_codes the 128-byte swizzle (box_cols 128: the e4m3 wgmma's
    operands). row_bytes: the distance between rows when the rows hold more than the matrix
    (FP8 rows end with their scales). The address must be 16-byte aligned and row_bytes a
    multiple of 16. sm_90+ only."""
    u64, u32 = driver.cuuint64_t, driver.cuuint32_t
    codes = codes or swizzled_codes
    element = 1 if codes else 2
    dtype = (driver.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_UINT8 if codes
             else driver.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_BFLOAT16)
    swizzle = (driver.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_NONE
               if codes and not swizzled_codes
               else driver.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B)
    encoded = check(driver.cuTensorMapEncodeTiled(
        dtype, 2, address, [u64(cols), u64(rows)], [u64(row_bytes or cols * element)],
        [u32(box_cols), u32(box_rows)], [u32(1), u32(1)],
        driver.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle,
        driver.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
        driver.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE),
        "cuTensorMapEncodeTiled")
    out = TensorMap()
    out.opaque[:] = [int(v) for v in encoded.opaque]
    return out


class KernelArgs:
    """Arguments laid out as the driver's `kernelParams`: an array of pointers, one per
    argument, each to a private copy of its value. cuda-python accepts that array's address
    as a plain int in 12.x and 13.x alike; the driver copies the values during the launch
    call (or the capture), so this object need only outlive that call."""

    def __init__(self, args: Sequence[KernelArg]) -> None:
        self.values = [_as_ctype(arg, position) for position, arg in enumerate(args)]
        self._pointers = (ctypes.c_void_p * len(self.values))(
            *(ctypes.addressof(value) for value in self.values))

    @property
    def address(self) -> int:
        """The `void**` to hand to cuLaunchKernel; 0 (NULL) when there are no arguments."""
        return ctypes.addressof(self._pointers) if self.values else 0


def _as_ctype(arg: Any, position: int) -> ctypes._SimpleCData:
    kind = type(arg)  # the common exact types first: a prefill pass makes ~10 launches a layer
    if kind is Ptr:
        return ctypes.c_uint64(arg.address)
    if kind is ctypes.c_int:
        return ctypes.c_int(arg.value)
    if kind is TensorMap:
        return TensorMap.from_buffer_copy(arg)
    if isinstance(arg, DeviceBuffer):
        return ctypes.c_uint64(arg.ptr)
    if isinstance(arg, PinnedBuffer):
        if arg.device_ptr is None:
            raise TypeError(f"kernel argument {position}: a PinnedBuffer must be mapped "
                            "(mapped=True) to be passed to a kernel")
        return ctypes.c_uint64(arg.device_ptr)
    if isinstance(arg, Ptr):
        return ctypes.c_uint64(arg.address)
    if isinstance(arg, _SCALAR_TYPES):
        return type(arg)(arg.value)
    if isinstance(arg, ctypes.Structure):  # a struct passed by value, laid out as in C
        return type(arg).from_buffer_copy(arg)
    raise TypeError(f"kernel argument {position} is {type(arg).__name__}; pass a DeviceBuffer, "
                    "Ptr(address), a ctypes scalar such as ctypes.c_int(3) or a ctypes "
                    "Structure")


def _dim3(value: int | Sequence[int], what: str) -> tuple[int, int, int]:
    if type(value) is int and value >= 1:
        return value, 1, 1
    dims = (value,) if isinstance(value, int) else tuple(value)
    if not 1 <= len(dims) <= 3 or not all(isinstance(d, int) and d >= 1 for d in dims):
        raise ValueError(f"{what} must be a positive int or 1 to 3 of them, not {value!r}")
    return (*dims, 1, 1)[:3]


def launch(kernel: Kernel, grid: int | Sequence[int], block: int | Sequence[int],
           args: Sequence[KernelArg], shared: int = 0, stream: Stream | None = None,
           cooperative: bool = False, dependent: bool = False) -> None:
    """Launch `kernel` on `stream` (the legacy default stream when None); `cooperative` uses
    cuLaunchCooperativeKernel, which guarantees every block is resident (for grid barriers).
    `dependent` (compute capability 9.0 and up) lets the kernel start while the stream's
    previous kernel ends (programmatic dependent launch): the kernel must begin with
    common.cuh's dependent_start, which waits for that kernel's end."""
    gx, gy, gz = _dim3(grid, "grid")
    bx, by, bz = _dim3(block, "block")
    params = KernelArgs(args)
    handle = _stream_handle(stream)
    if dependent:
        config = driver.CUlaunchConfig()
        config.gridDimX, config.gridDimY, config.gridDimZ = gx, gy, gz
        config.blockDimX, config.blockDimY, config.blockDimZ = bx, by, bz
        config.sharedMemBytes, config.hStream = shared, handle
        attribute = driver.CUlaunchAttribute()
        ids = driver.CUlaunchAttributeID
        attribute.id = ids.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
        attribute.value.programmaticStreamSerializationAllowed = 1
        config.attrs, config.numAttrs = [attribute], 1
        check(driver.cuLaunchKernelEx(config, kernel.handle, params.address, 0),
              f"cuLaunchKernelEx({kernel.name})")
    elif cooperative:
        check(driver.cuLaunchCooperativeKernel(kernel.handle, gx, gy, gz, bx, by, bz, shared,
                                               handle, params.address),
              f"cuLaunchCooperativeKernel({kernel.name})")
    else:
        check(driver.cuLaunchKernel(kernel.handle, gx, gy, gz, bx, by, bz, shared, handle,
                                    params.address, 0),
              f"cuLaunchKernel({kernel.name})")


class Graph:
    """Work captured from a stream, replayed with one launch."""

    def __init__(self) -> None:
        self._graph: Any = None
        self._exec: Any = None

    @classmethod
    @contextmanager
    def capture(cls, stream: Stream) -> Iterator[Graph]:
        """`with Graph.capture(stream) as g:` records what is issued on `stream` (and not run)
        in the block; `g` is launchable after it."""
        mode = driver.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL
        check(driver.cuStreamBeginCapture(stream.handle, mode), "cuStreamBeginCapture")
        graph = cls()
        try:
            yield graph
        except BaseException:
            # End the capture anyway, or the stream stays unusable; the partial graph is dropped.
            err, partial = driver.cuStreamEndCapture(stream.handle)
            if err == _SUCCESS and int(partial):
                driver.cuGraphDestroy(partial)
            raise
        graph._graph = check(driver.cuStreamEndCapture(stream.handle), "cuStreamEndCapture")

    def launch(self, stream: Stream) -> None:
        if self._graph is None:
            raise ValueError("Graph launched before its capture ended, or after close()")
        if self._exec is None:
            # (hGraph, flags) since cuda-python 12.0; cuGraphInstantiateWithFlags is gone in 13.x.
            self._exec = check(driver.cuGraphInstantiate(self._graph, 0), "cuGraphInstantiate")
        check(driver.cuGraphLaunch(self._exec, stream.handle), "cuGraphLaunch")

    def close(self) -> None:
        if self._exec is not None:
            check(driver.cuGraphExecDestroy(self._exec), "cuGraphExecDestroy")
            self._exec = None
        if self._graph is not None:
            check(driver.cuGraphDestroy(self._graph), "cuGraphDestroy")
            self._graph = None


def close_graphs(graphs: dict[Any, Graph]) -> None:
    """Close every graph of a cache of them and empty it."""
    for graph in graphs.values():
        graph.close()
    graphs.clear()


def copy_bandwidth(device_buffer_bytes: int = 1 << 30, repeats: int = 20,
                   stream: Stream | None = None) -> float:
    """Device-to-device copy speed in bytes/s, counting bytes read plus written: the ceiling
    a memory-bound kernel is measured against. Median of `repeats` after a warm-up. Its two
    scratch buffers are measuring tools, not the program's footprint: the peak counter is put
    back as it was."""
    with _memory_lock:
        peak_before = _peak
    with ExitStack() as cleanup:
        cleanup.callback(_restore_peak, peak_before)
        if stream is None:
            stream = Stream()
            cleanup.callback(stream.close)
        src = cleanup.enter_context(DeviceBuffer(device_buffer_bytes))
        dst = cleanup.enter_context(DeviceBuffer(device_buffer_bytes))
        start, end = Event(), Event()
        cleanup.callback(start.close)
        cleanup.callback(end.close)

        def copy() -> None:
            check(driver.cuMemcpyDtoDAsync(dst.ptr, src.ptr, device_buffer_bytes, stream.handle),
                  "cuMemcpyDtoDAsync")

        src.fill_u8(1, stream)
        for _ in range(2):
            copy()
        times_ms = []
        for _ in range(repeats):
            start.record(stream)
            copy()
            end.record(stream)
            end.synchronize()
            times_ms.append(end.elapsed_ms(start))
        return 2 * device_buffer_bytes / (statistics.median(times_ms) / 1e3)
