"""The driver-API layer: memory, launches, events, graphs, pinned memory and its error lines.

The tests marked `gpu` compile tiny kernels with NVRTC and run them; without a usable GPU they
skip and say why. Argument marshalling is checked everywhere, since it needs no GPU.
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from qwenchat.engine.cuda.compiler import compile_source
from qwenchat.engine.cuda.probe import probe
from qwenchat.errors import BackendUnavailable

rt = pytest.importorskip("qwenchat.engine.cuda.runtime", reason="cuda-python is not importable")

KERNELS = """\
extern "C" __global__ void add(const float* a, const float* b, float* out, float scale, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = a[i] + scale * b[i];
}

extern "C" __global__ void accumulate(float* y, const float* x, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] += x[i];
}

// Writes back every scalar it receives, bit for bit, to check argument marshalling.
extern "C" __global__ void echo(unsigned long long* out, signed char i8, int i32, float f32,
                                unsigned long long u64, double f64, long long i64) {
    out[0] = (unsigned long long)(long long)i8;
    out[1] = (unsigned long long)(long long)i32;
    out[2] = __float_as_uint(f32);
    out[3] = u64;
    out[4] = (unsigned long long)__double_as_longlong(f64);
    out[5] = (unsigned long long)i64;
}

// Block 0..n-1 each arrive at a hand-made grid barrier: it only completes when every block
// is resident at once, which a cooperative launch guarantees.
extern "C" __global__ void grid_barrier(unsigned int* arrived, unsigned int* seen) {
    if (threadIdx.x == 0) {
        atomicAdd(arrived, 1u);
        while (atomicAdd(arrived, 0u) < gridDim.x) {}
        seen[blockIdx.x] = atomicAdd(arrived, 0u);
    }
}
"""


def test_kernel_args_point_at_private_copies_of_each_value():
    scalar = ctypes.c_int(-3)
    args = rt.KernelArgs([rt.Ptr(0x7F00_0000_1234), scalar, ctypes.c_float(1.5),
                       ctypes.c_uint64(2**63 + 5), ctypes.c_double(-0.25), ctypes.c_int8(-7)])
    scalar.value = 99  # packing copied it: a later change must not reach the launch
    slots = (ctypes.c_void_p * 6).from_address(args.address)
    assert ctypes.c_uint64.from_address(slots[0]).value == 0x7F00_0000_1234
    assert ctypes.c_int.from_address(slots[1]).value == -3
    assert ctypes.c_float.from_address(slots[2]).value == 1.5
    assert ctypes.c_uint64.from_address(slots[3]).value == 2**63 + 5
    assert ctypes.c_double.from_address(slots[4]).value == -0.25
    assert ctypes.c_int8.from_address(slots[5]).value == -7


def test_a_struct_argument_is_passed_by_value_as_a_private_copy():
    class Pair(ctypes.Structure):
        _fields_ = [("ptr", ctypes.c_uint64), ("n", ctypes.c_int), ("x", ctypes.c_float)]

    pair = Pair(0x7F00_0000_1234, 7, 2.5)
    args = rt.KernelArgs([pair])
    pair.n = 99  # packing copied it: the queued launch keeps the values it was given
    [slot] = (ctypes.c_void_p * 1).from_address(args.address)
    copy = Pair.from_address(slot)
    assert (copy.ptr, copy.n, copy.x) == (0x7F00_0000_1234, 7, 2.5)


def test_no_kernel_args_is_a_null_pointer():
    assert rt.KernelArgs([]).address == 0


@pytest.mark.parametrize("bad", [3, 1.5, "x", ctypes.c_char_p(b"x"), np.float32(1)],
                         ids=["int", "float", "str", "c_char_p", "numpy-scalar"])
def test_kernel_args_refuse_ambiguous_values(bad):
    with pytest.raises(TypeError, match="kernel argument 1"):
        rt.KernelArgs([rt.Ptr(0), bad])


@pytest.fixture(scope="module")
def device(cuda_gpu):
    dev = rt.Device(0)
    yield dev
    dev.close()


@pytest.fixture(scope="module")
def module(device, tmp_path_factory):
    src = tmp_path_factory.mktemp("kernels")
    (src / "test_kernels.cu").write_text(KERNELS)
    loaded = rt.Module(compile_source("test_kernels.cu", device.arch, {}, source_dir=src))
    yield loaded
    loaded.close()


@pytest.fixture(scope="module")
def kernels(module):
    return {name: module.function(name) for name in ("add", "accumulate", "echo", "grid_barrier")}


@pytest.fixture
def stream(device):
    s = rt.Stream()
    yield s
    s.close()


def _random(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(n).astype(np.float32)


@pytest.mark.gpu
def test_device_describes_the_gpu(device):
    assert device.arch == "sm_{}{}".format(*device.compute_capability)
    assert device.sm_count > 0 and device.max_threads_per_sm > 0 and device.l2_size > 0
    assert device.max_shared_per_block_optin >= 48 * 1024
    free, total = device.mem_info()
    assert 0 < free <= total and total == device.total_memory
    assert device.name


@pytest.mark.gpu
def test_missing_gpu_index_says_how_many_exist(device):
    with pytest.raises(BackendUnavailable, match="--device"):
        rt.Device(len(probe().gpus))


@pytest.mark.gpu
def test_upload_download_round_trip_at_an_offset(device):
    data = _random(256)
    with rt.DeviceBuffer(4096) as buffer:
        buffer.upload(data, offset=1024)
        back = np.empty_like(data)
        buffer.download(back, offset=1024)
        np.testing.assert_array_equal(back, data)
        with pytest.raises(ValueError, match="does not fit"):
            buffer.upload(data, offset=4096 - 512)
        with pytest.raises(ValueError, match="C-contiguous"):
            buffer.upload(np.zeros((16, 16), np.float32)[:, ::2])


@pytest.mark.gpu
def test_async_copies_on_a_stream_round_trip(device, stream):
    data = _random(1000, seed=1)
    back = np.zeros_like(data)
    with rt.DeviceBuffer(data.nbytes) as buffer:
        buffer.upload(data, stream=stream)
        buffer.download(back, stream=stream)
        stream.synchronize()
    np.testing.assert_array_equal(back, data)


@pytest.mark.gpu
def test_fill_u8_poisons_every_byte(device, stream):
    with rt.DeviceBuffer(1 << 16) as buffer:
        buffer.fill_u8(0xFF)
        floats = np.zeros(buffer.nbytes // 4, np.float32)
        buffer.download(floats)
        assert np.isnan(floats).all()
        buffer.fill_u8(0x3C, stream)
        raw = np.zeros(buffer.nbytes, np.uint8)
        buffer.download(raw, stream=stream)
        stream.synchronize()
        assert (raw == 0x3C).all()


@pytest.mark.gpu
def test_launch_adds_with_buffer_and_scalar_args(kernels, stream):
    n = 1000
    a, b = _random(n, 1), _random(n, 2)
    with rt.DeviceBuffer(a.nbytes) as da, rt.DeviceBuffer(b.nbytes) as db, \
            rt.DeviceBuffer(a.nbytes) as out:
        da.upload(a)
        db.upload(b)
        out.fill_u8(0xFF)
        rt.launch(kernels["add"], (n + 255) // 256, 256,
                  [da, rt.Ptr(db.ptr), out, ctypes.c_float(0.5), ctypes.c_int(n)], stream=stream)
        result = np.empty_like(a)
        out.download(result, stream=stream)
        stream.synchronize()
    np.testing.assert_allclose(result, a + 0.5 * b, rtol=1e-6)


@pytest.mark.gpu
def test_scalars_reach_the_kernel_bit_for_bit(kernels, stream):
    with rt.DeviceBuffer(6 * 8) as out:
        rt.launch(kernels["echo"], 1, 1,
                  [out, ctypes.c_int8(-5), ctypes.c_int(-123456), ctypes.c_float(3.25),
                   ctypes.c_uint64(2**64 - 2), ctypes.c_double(1e300), ctypes.c_int64(-(2**40))],
                  stream=stream)
        got = np.zeros(6, np.uint64)
        out.download(got, stream=stream)
        stream.synchronize()
    expected = np.array([-5, -123456], np.int64).view(np.uint64).tolist()
    expected += [int(np.float32(3.25).view(np.uint32)), 2**64 - 2,
                 int(np.float64(1e300).view(np.uint64)),
                 int(np.int64(-(2**40)).view(np.uint64))]
    assert got.tolist() == expected


@pytest.mark.gpu
def test_kernel_reports_attributes_and_occupancy(kernels):
    attributes = kernels["add"].attributes()
    assert set(attributes) == {"num_regs", "local_size_bytes", "shared_size_bytes",
                               "max_threads_per_block"}
    assert attributes["num_regs"] > 0 and attributes["max_threads_per_block"] >= 256
    assert kernels["add"].max_active_blocks_per_sm(256) >= 1
    kernels["add"].set_max_dynamic_shared(64 * 1024)


@pytest.mark.gpu
def test_unknown_kernel_name_is_a_cuda_error(module):
    with pytest.raises(rt.CudaError,
                       match=r"^cuModuleGetFunction\(nope\) failed: CUDA_ERROR_NOT_FOUND"):
        module.function("nope")


@pytest.mark.gpu
def test_events_time_work_on_a_stream(device, stream):
    start, end = rt.Event(), rt.Event()
    with rt.DeviceBuffer(64 << 20) as buffer:
        start.record(stream)
        for _ in range(4):
            buffer.fill_u8(1, stream)
        end.record(stream)
        end.synchronize()
        assert end.elapsed_ms(start) > 0
    start.close()
    end.close()


@pytest.mark.gpu
def test_copy_bandwidth_is_a_plausible_rate(device):
    rate = rt.copy_bandwidth(64 << 20, repeats=3)
    assert 1e9 < rate < 1e14


@pytest.mark.gpu
def test_captured_graph_replays_the_same_work(kernels, stream):
    n = 300
    x = _random(n, 3)
    with rt.DeviceBuffer(x.nbytes) as y, rt.DeviceBuffer(x.nbytes) as dx:
        dx.upload(x)
        y.fill_u8(0)
        with rt.Graph.capture(stream) as graph:
            rt.launch(kernels["accumulate"], (n + 127) // 128, 128, [y, dx, ctypes.c_int(n)],
                   stream=stream)
        stream.synchronize()
        result = np.empty_like(x)
        y.download(result)
        assert (result == 0).all()  # captured, not run
        for _ in range(3):
            graph.launch(stream)
        stream.synchronize()
        y.download(result)
        graph.close()
    np.testing.assert_allclose(result, 3 * x, rtol=1e-6)


@pytest.mark.gpu
def test_a_failing_capture_leaves_the_stream_usable(kernels, stream):
    with pytest.raises(RuntimeError, match="inside the capture"), rt.Graph.capture(stream):
        raise RuntimeError("inside the capture")
    with rt.DeviceBuffer(16) as buffer:
        buffer.fill_u8(7, stream)
        stream.synchronize()


@pytest.mark.gpu
def test_mapped_pinned_memory_is_visible_to_a_kernel(kernels, stream):
    n = 64
    a, b = _random(n, 4), _random(n, 5)
    with rt.PinnedBuffer(n * 4, mapped=True) as host_out, rt.DeviceBuffer(a.nbytes) as da, \
            rt.DeviceBuffer(b.nbytes) as db:
        da.upload(a)
        db.upload(b)
        view = host_out.array(np.float32, n)
        view[:] = np.nan
        rt.launch(kernels["add"], 1, 64,
                  [da, db, host_out, ctypes.c_float(2.0), ctypes.c_int(n)], stream=stream)
        stream.synchronize()
        np.testing.assert_allclose(view, a + 2 * b, rtol=1e-6)
        with pytest.raises(ValueError, match="do not fit"):
            host_out.array(np.float32, n + 1)


@pytest.mark.gpu
def test_pinned_memory_stages_async_copies(device, stream):
    data = _random(512, 6)
    with rt.PinnedBuffer(data.nbytes) as staging, rt.DeviceBuffer(data.nbytes) as buffer:
        view = staging.array(np.float32)
        view[:] = data
        buffer.upload(view, stream=stream)
        stream.synchronize()  # the copy reads the pinned memory until the stream is past it
        view[:] = 0
        buffer.download(view, stream=stream)
        stream.synchronize()
        np.testing.assert_array_equal(view, data)
        with pytest.raises(TypeError, match="mapped"):
            rt.KernelArgs([staging])


@pytest.mark.gpu
def test_cooperative_launch_makes_every_block_resident(device, kernels, stream):
    if not device.cooperative_launch:
        pytest.skip(f"{device.name} does not support cooperative launches")
    kernel = kernels["grid_barrier"]
    blocks = device.sm_count * kernel.max_active_blocks_per_sm(128)
    with rt.DeviceBuffer(4) as arrived, rt.DeviceBuffer(blocks * 4) as seen:
        arrived.fill_u8(0)
        rt.launch(kernel, blocks, 128, [arrived, seen], stream=stream, cooperative=True)
        result = np.zeros(blocks, np.uint32)
        seen.download(result, stream=stream)
        stream.synchronize()
    assert (result == blocks).all()


@pytest.mark.gpu
def test_too_large_allocation_names_the_call_and_error(device):
    before = rt.allocated_bytes()
    with pytest.raises(rt.CudaError, match=r"^cuMemAlloc failed: CUDA_ERROR_OUT_OF_MEMORY \("):
        rt.DeviceBuffer(1 << 50)
    assert rt.allocated_bytes() == before


@pytest.mark.gpu
def test_allocation_counters_rise_and_fall(device):
    base = rt.allocated_bytes()
    first = rt.DeviceBuffer(1 << 20)
    rt.reset_peak()
    assert rt.allocated_bytes() == base + (1 << 20) == rt.peak_allocated_bytes()
    with rt.DeviceBuffer(2 << 20):
        assert rt.allocated_bytes() == base + (3 << 20)
    assert rt.allocated_bytes() == base + (1 << 20)
    assert rt.peak_allocated_bytes() == base + (3 << 20)
    first.free()
    first.free()  # idempotent
    assert rt.allocated_bytes() == base
    with pytest.raises(ValueError, match="after free"):
        _ = first.ptr
    rt.reset_peak()
    assert rt.peak_allocated_bytes() == base


@pytest.mark.gpu
def test_copy_bandwidth_probe_leaves_the_peak_counter_alone(device, stream):
    rt.reset_peak()
    before = rt.peak_allocated_bytes()
    assert rt.copy_bandwidth(64 << 20, repeats=3, stream=stream) > 0
    assert rt.peak_allocated_bytes() == before
