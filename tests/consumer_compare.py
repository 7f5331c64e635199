"""Megakernel decode speeds side by side: a benchmark, not a test (CUDA only).

Decodes random weights of real shapes with the tensor-core FP8 consumer ("auto") and the
CUDA-core one ("fma") in one process, on one GPU, through the bench's own decode measurement,
so the numbers are comparable with `qwenchat bench` and with each other; or (one consumer)
several sizes, other rings (`--stages 4` or `--stages 4x32768,3x50688`) or the layout of a GPU with
less shared memory (`--shared 101376`, an RTX 4090's):

    python tests/consumer_compare.py --configs qwen3-0.6b,qwen3-8b --positions 1,4096
    python tests/consumer_compare.py --weights bf16 --consumers auto --configs qwen3-14b
    python tests/consumer_compare.py --weights int4 --consumers auto --stages 2,3,4,5
    python tests/consumer_compare.py --weights bf16 --consumers auto \
        --variants "QW_MK_DEFER=0;QW_MK_DEFER=1"     # kernel variants behind a define

Each cell is tok/s (median of `--repeats` runs of `--steps` greedy steps) and the share of the
copy bandwidth that the bytes read per step reach.
"""

from __future__ import annotations

import argparse
import itertools
import json

from qwenchat.bench import BenchSettings, measure_engine, parse_sizes
from qwenchat.engine.cuda.engine import CudaEngine
from qwenchat.engine.cuda.megakernel import EXPERIMENT_DEFINES, MEGAKERNEL_CONSUMERS
from qwenchat.model.presets import PRESETS
from qwenchat.model.random_weights import RandomWeights


def parse_ring(text: str) -> int | tuple[int, int]:
    """`--stages`: a ring depth ("4"), or its depth and stage size in bytes ("3x50688")."""
    count, _, size = text.partition("x")
    return (int(count), int(size)) if size else int(count)


def parse_defines(texts: list[str]) -> dict[str, int]:
    """`--define NAME=VALUE` (repeatable): megakernel defines for an experiment."""
    defines = {}
    for text in texts:
        name, sep, value = text.partition("=")
        if not sep or not name.startswith("QW_MK_"):
            raise SystemExit(f"--define takes QW_MK_NAME=VALUE; got {text!r}")
        defines[name] = int(value)
    return defines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default="qwen3-0.6b,qwen3-8b")
    parser.add_argument("--weights", default="fp8", choices=("fp8", "bf16", "int4"))
    parser.add_argument("--consumers", default=",".join(MEGAKERNEL_CONSUMERS))
    parser.add_argument("--positions", default="1,4096")
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", action="store_true", help="one JSON object a line")
    parser.add_argument("--stages", help="the stage ring's depth, or DEPTHxBYTES its depth and "
                                          "stage size; several, comma-separated, are measured "
                                          "in turn (default: the layout's)")
    parser.add_argument("--rows", default="auto", choices=("auto", "whole", "parts"),
                        help="what the stages hold (default: as the layout chooses)")
    parser.add_argument("--variants", default="",
                        help="megakernel define sets measured in turn, ';' between sets, ',' "
                             "within one (e.g. 'QW_MK_DEFER=0;QW_MK_DEFER=1'; experiments)")
    parser.add_argument("--shared", type=int,
                        help="lay the megakernel out for this much shared memory a block "
                             "(101376: an RTX 4090's)")
    args = parser.parse_args()
    positions = parse_sizes(args.positions, "--positions")
    rings: list[tuple[str | None, int | tuple[int, int] | None]] = [(None, None)]
    if args.stages:
        rings = [(ring, parse_ring(ring)) for ring in args.stages.split(",")]
    settings = BenchSettings(prompts=(1,), positions=positions, steps=args.steps,
                             repeats=args.repeats)
    for name in args.configs.split(","):
        config = PRESETS[name]
        weights = RandomWeights(config, seed=0, weight_format=args.weights)
        for consumer, (ring, stages), variant in itertools.product(
                args.consumers.split(","), rings, args.variants.split(";")):
            EXPERIMENT_DEFINES.clear()
            EXPERIMENT_DEFINES.update(parse_defines([d for d in variant.split(",") if d]))
            engine = CudaEngine(config, weights, ctx=settings.default_ctx(config),
                                decode="megakernel", megakernel_consumer=consumer,
                                megakernel_stages=stages,
                                megakernel_shared=args.shared,
                                megakernel_rows=args.rows)
            try:
                result = measure_engine(engine, settings, name, "random")
            finally:
                engine.close()
            cells = {d.position: (d.tok_s, d.copy_fraction) for d in result.decode}
            if args.json:
                print(json.dumps({"config": name, "weights": args.weights, "consumer": consumer,
                                  "stages": ring, "shared": args.shared,
                                  "rows": args.rows, "defines": variant,
                                  "decode": {p: {"tok_s": t, "of_copy": f}
                                             for p, (t, f) in cells.items()}}), flush=True)
                continue
            row = "".join(f"  @{p}: {t:8.1f} tok/s {100 * (f or 0):5.1f}% of copy"
                          for p, (t, f) in cells.items())
            tag = " ".join(([f"stages={ring}"] if ring else [])
                           + ([f"shared={args.shared}"] if args.shared else [])
                           + ([f"rows={args.rows}"] if args.rows != "auto" else [])
                           + ([variant] if variant else []))
            print(f"{name:<11} {args.weights:<5} {consumer:<5}{row} {tag}", flush=True)


if __name__ == "__main__":
    main()
