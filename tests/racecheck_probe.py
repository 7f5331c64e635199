"""Does racecheck understand a named barrier over part of the block (bar.sync 1, N)? A
benchmark aid for the device (CUDA), not a test.

The kernel does what QW_MK_OVERLAP's staging does with warp_sums, with no race in it: a block
stages (every warp writes its slot, __syncthreads, every warp reads all), then the consumer
warps alone stage again behind `bar.sync 1, NT` while the last warp does other work, then a
block barrier, then the whole block stages again. Run under
    compute-sanitizer --tool racecheck python3 tests/racecheck_probe.py [--no-named]
If it reports hazards with the named barrier and none without, the megakernel's are the tool's."""
import ctypes
import sys
import tempfile
from pathlib import Path

import numpy as np

from qwenchat.engine.cuda import runtime as rt
from qwenchat.engine.cuda.compiler import compile_source

SOURCE = r'''
constexpr int THREADS = 288, WARPS = THREADS / 32, CWARPS = WARPS - 1;
__shared__ float warp_sums[WARPS];
template <int NT> __device__ __forceinline__ void sync_nt() {
    if constexpr (NT == THREADS) __syncthreads();
    else asm volatile("bar.sync 1, %0;" ::"n"(NT) : "memory");
}
template <int NT> __device__ __forceinline__ float stage(float v) {
    if constexpr (NT == THREADS) __syncthreads(); else sync_nt<NT>();
    if ((threadIdx.x & 31) == 0) warp_sums[threadIdx.x >> 5] = v;
    sync_nt<NT>();
    float t = 0.f;
    for (int w = 0; w < NT / 32; ++w) t += warp_sums[w];
    return t;
}
extern "C" __global__ void __launch_bounds__(THREADS) probe(float* out, int named, int rounds) {
    float acc = 0.f;
    for (int r = 0; r < rounds; ++r) {
        acc += stage<THREADS>(threadIdx.x + r);      // the router's input: the whole block
        __syncthreads();                             // route_and_stage's first barrier
        if (threadIdx.x >> 5 == CWARPS) {
            acc += 1.f;                              // the producer "routes"
        } else if (named) {
            acc += stage<CWARPS * 32>(acc);          // the consumers stage gate/up's input
        }
        __syncthreads();                             // the routing, and gate/up's input
        acc += stage<THREADS>(acc);                  // a later phase's staging
    }
    out[blockIdx.x * THREADS + threadIdx.x] = acc;
}
'''


def main() -> None:
    named = "--no-named" not in sys.argv
    with tempfile.TemporaryDirectory() as d:
        Path(d, "probe.cu").write_text(SOURCE)
        cubin = compile_source("probe.cu", "sm_90", {}, source_dir=Path(d))
    device = rt.Device(0)
    module = rt.Module(cubin)
    out = rt.DeviceBuffer(4 * 288 * 4)
    rt.launch(module.function("probe"), 4, 288, [out, ctypes.c_int(int(named)), ctypes.c_int(3)])
    host = np.empty(4 * 288, np.float32)
    out.download(host)
    print("named" if named else "block barriers only", "ran:", bool(np.isfinite(host).all()))
    device.close()


if __name__ == "__main__":
    main()
