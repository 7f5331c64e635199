"""How long a first run takes: a benchmark, not a test (hand-run).

`compile`: NVRTC alone (no GPU needed) compiling every kernel a run of one size builds, one
after another and then concurrently, each into an empty cache, through the cache's own
compile path. `ask`: the wall clock of `qwenchat ask --max-tokens 8` with an empty kernel
cache (cold) and then with every kernel in it (warm: `info --compile` fills what a cold run
left to a background compile), on a checkpoint of a real shape with few layers
written once with random weights and the real tokenizer (CUDA only).

    python tests/cold_start.py compile --config qwen3-0.6b --arch sm_90
    python tests/cold_start.py ask --tokenizer ../shared/fixtures/qwen3-tokenizer --layers 3
    python tests/cold_start.py ask ... --source OTHER_CHECKOUT   # time another version

Each figure is the median of `--repeats` runs. `ask` byte-compiles the timed source first,
as `pip install` does (`--source-bytecode` times it as it is).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gpu_shapes import GPUS, gpu_shape
from peer_checkpoint import preset, write_checkpoint

from qwenchat.engine.cuda.compiler import KernelCache, usable_cpus
from qwenchat.engine.cuda.engine import plan_kernels
from qwenchat.model.presets import PRESETS


def compile_once(config_name: str, arch: str, weights: str, workers: int | None) -> dict:
    """Every kernel of a run into an empty cache, on `workers` threads (None: one per CPU)."""
    plan = plan_kernels(PRESETS[config_name], weights, gpu_shape(arch))
    with tempfile.TemporaryDirectory() as empty:
        started = time.perf_counter()
        compilation = KernelCache(Path(empty)).start(plan.builds, workers=workers)
        compilation.wait()
        seconds = time.perf_counter() - started
    return {"seconds": seconds, "kernels": {build.name: round(took, 2)
                                            for build, took in compilation.compiled.items()}}


def time_compiles(config_name: str, arch: str, weights: str, repeats: int) -> dict:
    """Sequential and concurrent compiles, each run in a process of its own with an empty
    CUDA compute cache: NVRTC keeps its PTX-to-SASS results there (~/.nv/ComputeCache, seen
    on the H100 machine) and in the process, either of which would hide the cost a first run
    pays."""
    rows = {}
    for label, workers in (("sequential", 1), ("concurrent", 0)):
        runs = []
        for _ in range(repeats):
            with tempfile.TemporaryDirectory() as compute_cache:
                done = subprocess.run(
                    [sys.executable, __file__, "compile-once", "--config", config_name,
                     "--arch", arch, "--weights", weights, "--workers", str(workers)],
                    env={**os.environ, "CUDA_CACHE_PATH": compute_cache},
                    capture_output=True, text=True, check=True)
                runs.append(json.loads(done.stdout))
        middle = sorted(runs, key=lambda run: run["seconds"])[len(runs) // 2]
        rows[label] = {"seconds": middle["seconds"], "kernels": middle["kernels"],
                       "runs": [round(run["seconds"], 2) for run in runs]}
    return {"config": config_name, "arch": arch, "weights": weights, "cpus": usable_cpus(),
            **rows, "ratio": rows["concurrent"]["seconds"] / rows["sequential"]["seconds"]}


def compile_bytecode(source: Path) -> None:
    """Byte-compile `source`'s package, as `pip install` does: a checkout that has never run
    (a device's fresh copy, with PYTHONDONTWRITEBYTECODE set) would otherwise compile every
    module's source on each run, ~0.6 s of a warm answer that no installed copy pays."""
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(source / "qwenchat")],
                   check=True, capture_output=True)


def time_ask(model: Path, source: Path, repeats: int) -> dict:
    """Cold: empty kernel and CUDA compute caches; warm: the same caches, filled. Runs in
    `source`, so that its qwenchat is the one imported."""
    command = [sys.executable, "-m", "qwenchat", "ask", "--model", str(model),
               "--max-tokens", "8", "--temperature", "0", "Say hello."]
    path = os.pathsep.join(p for p in (str(source), os.environ.get("PYTHONPATH")) if p)
    cold, warm, said = [], [], ""
    for _ in range(repeats):
        with tempfile.TemporaryDirectory() as cache:
            env = {**os.environ, "XDG_CACHE_HOME": cache, "PYTHONPATH": path,
                   "CUDA_CACHE_PATH": str(Path(cache) / "nv"), "HF_HUB_OFFLINE": "1"}
            for runs in (cold, warm):
                started = time.perf_counter()
                done = subprocess.run(command, env=env, capture_output=True, text=True,
                                      stdin=subprocess.DEVNULL, cwd=source)
                runs.append(time.perf_counter() - started)
                if done.returncode:
                    raise SystemExit(f"ask failed ({done.returncode}): {done.stderr.strip()}")
                said = said or done.stderr
                # A cold run may leave the megakernel compiling in a process of its own:
                # warm means every kernel cached, so have them all before the warm run.
                subprocess.run([sys.executable, "-m", "qwenchat", "info", "--compile",
                                "--model", str(model)], env=env, capture_output=True,
                               check=True, stdin=subprocess.DEVNULL, cwd=source)
    return {"source": str(source), "cold_s": statistics.median(cold),
            "warm_s": statistics.median(warm), "cold_runs": [round(t, 2) for t in cold],
            "warm_runs": [round(t, 2) for t in warm], "stderr_of_a_cold_run": said.strip()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=("compile", "ask", "compile-once"))
    parser.add_argument("--workers", type=int, default=0, help="compile-once: 0 = one a CPU")
    parser.add_argument("--config", default="qwen3-0.6b", choices=sorted(PRESETS))
    parser.add_argument("--arch", default="sm_90", choices=sorted(GPUS))
    parser.add_argument("--weights", default="bf16", choices=("bf16", "fp8"))
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--tokenizer", type=Path, help="the real tokenizer's directory (ask)")
    parser.add_argument("--model-dir", type=Path, default=Path(tempfile.gettempdir())
                        / "qwenchat-cold-start-model")
    parser.add_argument("--source", type=Path, default=Path(__file__).resolve().parents[1],
                        help="the checkout whose qwenchat is timed (ask)")
    parser.add_argument("--source-bytecode", action="store_true",
                        help="ask: time the source as it is, without byte-compiling it first")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if args.what == "compile-once":  # one measurement, run by `compile` in a fresh process
        result = compile_once(args.config, args.arch, args.weights, args.workers or None)
    elif args.what == "compile":
        result = time_compiles(args.config, args.arch, args.weights, args.repeats)
    else:
        if args.tokenizer is None:
            parser.error("ask needs --tokenizer DIR (the real Qwen3 tokenizer)")
        model = write_checkpoint(args.model_dir, preset(args.config, args.layers), args.tokenizer)
        if not args.source_bytecode:
            compile_bytecode(args.source.resolve())
        result = time_ask(model, args.source.resolve(), args.repeats)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
