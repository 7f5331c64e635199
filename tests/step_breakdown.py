"""Where a megakernel decode step's time goes: a benchmark, not a test (CUDA only).

Times greedy decode with the megakernel as it is, then with one part left out at a time (the
weight copies, attention, the waits for other blocks' values, sampling), then with all four
left out, on random weights of a real shape. A part's cost is roughly the time it saves when
left out. The left-out variants compute wrong tokens: they time the rest, nothing else.

    python tests/step_breakdown.py                                  # Qwen3-0.6B, positions 1, 4K
    python tests/step_breakdown.py --config qwen3-8b --positions 1,4096,32768 --json

Each row is the median of `--repeats` runs of `--steps` steps through the bench's own decode
measurement, so the numbers are comparable with `qwenchat bench`.
"""

from __future__ import annotations

import argparse
import json

from qwenchat.bench import BenchSettings, measure_engine, parse_sizes
from qwenchat.engine.cuda.engine import CudaEngine
from qwenchat.engine.cuda.megakernel import MEGAKERNEL_PARTS
from qwenchat.model.kv_cache import KV_CACHE_CHOICES
from qwenchat.model.presets import PRESETS
from qwenchat.model.random_weights import RandomWeights

VARIANTS: dict[str, tuple[str, ...]] = {
    "nothing": (),
    **{part: (part,) for part in MEGAKERNEL_PARTS},
    "all four": tuple(MEGAKERNEL_PARTS),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="qwen3-0.6b", choices=sorted(PRESETS))
    parser.add_argument("--positions", default="1,4096")
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quantize", default="none", choices=("none", "fp8", "int4"))
    parser.add_argument("--kv-cache", default="bf16", choices=KV_CACHE_CHOICES)
    parser.add_argument("--json", action="store_true", help="one JSON object instead of a table")
    args = parser.parse_args()
    positions = parse_sizes(args.positions, "--positions")
    settings = BenchSettings(prompts=(1,), positions=positions, steps=args.steps,
                             repeats=args.repeats)
    config = PRESETS[args.config]
    weights = RandomWeights(config, seed=0,
                            weight_format="bf16" if args.quantize == "none" else args.quantize)
    ms: dict[str, dict[int, float]] = {}
    for name, skip in VARIANTS.items():
        engine = CudaEngine(config, weights, ctx=settings.default_ctx(config),
                            decode="megakernel", megakernel_skip=skip, kv_cache=args.kv_cache)
        try:
            result = measure_engine(engine, settings, args.config, "random")
        finally:
            engine.close()
        ms[name] = {d.position: 1e3 / d.tok_s if d.tok_s else float("nan")
                    for d in result.decode}
    if args.json:
        print(json.dumps({"config": args.config, "weights": args.quantize, "ms_per_step": ms}))
        return
    print(f"{args.config} ({args.quantize}), ms a step (what leaving the part out saves)")
    print(f"{'part left out':<12}" + "".join(f"{f'position {p}':>22}" for p in positions))
    base = ms["nothing"]
    for name, row in ms.items():
        cells = [f"{row[p]:.3f}" + (f" ({row[p] - base[p]:+.3f})" if name != "nothing" else "")
                 for p in positions]
        print(f"{name:<12}" + "".join(f"{c:>22}" for c in cells))


if __name__ == "__main__":
    main()
