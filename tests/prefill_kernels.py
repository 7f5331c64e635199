"""Where a prefill's time goes, kernel by kernel (a benchmark aid run by hand on a GPU, not by
pytest).

The CUDA engine prefills a random prompt once untimed, then again with a timing event recorded
on its stream before and after every kernel it launches; the table sums each kernel's time
over the prefill (all layers, all chunks), with its launches and share. The events sit between
kernels on the one stream, so the sum is the prefill's GPU time; the host's launch gaps show
as "between kernels". Random weights in a preset's shape, drawn as `qwenchat bench --config`
draws them; `--layers N` keeps the first N layers (a 30B-A3B of 8 layers fits beside others).

    python tests/prefill_kernels.py --config qwen3-30b-a3b --layers 8 --tokens 4096
"""

from __future__ import annotations

import argparse
from collections import defaultdict

import numpy as np
from peer_checkpoint import preset

from qwenchat.engine.cuda import runtime as rt
from qwenchat.engine.cuda.engine import CudaEngine
from qwenchat.model.presets import PRESETS
from qwenchat.model.random_weights import RandomWeights


class KernelTimes:
    """rt.launch wrapped: an event before and after each launch on the engine's stream."""

    def __init__(self) -> None:
        self.marks: list[tuple[str, rt.Event, rt.Event]] = []
        self._launch = rt.launch

    def __enter__(self) -> KernelTimes:
        def timed(kernel, grid, block, args, shared=0, stream=None, cooperative=False):
            before, after = rt.Event(), rt.Event()
            before.record(stream)
            self._launch(kernel, grid, block, args, shared=shared, stream=stream,
                         cooperative=cooperative)
            after.record(stream)
            self.marks.append((kernel.name, before, after))

        rt.launch = timed
        return self

    def __exit__(self, *exc) -> None:
        rt.launch = self._launch

    def table(self) -> tuple[dict[str, list[float]], float, float]:
        """Per kernel: [ms, launches]; the whole span and the kernels' sum, in ms."""
        self.marks[-1][2].synchronize()
        per: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
        for name, before, after in self.marks:
            per[name][0] += after.elapsed_ms(before)
            per[name][1] += 1
        span = self.marks[-1][2].elapsed_ms(self.marks[0][1])
        for _, before, after in self.marks:
            before.close()
            after.close()
        return per, span, sum(ms for ms, _ in per.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="qwen3-0.6b", choices=sorted(PRESETS))
    parser.add_argument("--layers", type=int, help="keep the first N layers")
    parser.add_argument("--quantize", default="bf16", choices=("bf16", "fp8", "int4"))
    parser.add_argument("--tokens", type=int, default=4096)
    args = parser.parse_args()
    config = preset(args.config, args.layers)
    engine = CudaEngine(config, RandomWeights(config, weight_format=args.quantize),
                        ctx=args.tokens + 64)
    ids = [int(i) for i in np.random.default_rng(0).integers(0, config.vocab_size, args.tokens)]
    engine.prefill(ids)  # untimed: compiles, warms up
    engine.truncate(0)
    with KernelTimes() as times:
        engine.prefill(ids)
    per, span, kernels = times.table()
    print(f"{args.config}{f' ({args.layers} layers)' if args.layers else ''} {args.quantize}, "
          f"prefill of {args.tokens} tokens in chunks of {engine.chunk}: {span:.2f} ms "
          f"({args.tokens / span * 1e3:,.0f} tok/s with the events)")
    print(f"{'kernel':<28}{'ms':>9}{'share':>8}{'launches':>10}")
    for name, (ms, count) in sorted(per.items(), key=lambda item: -item[1][0]):
        print(f"{name:<28}{ms:>9.2f}{ms / span:>8.1%}{count:>10}")
    print(f"{'between kernels':<28}{span - kernels:>9.2f}{(span - kernels) / span:>8.1%}")


if __name__ == "__main__":
    main()
