"""8-bit KV caches against float32 keys and values on the CPU reference engine: the relative
logit error and top-1 agreement of teacher-forced greedy steps after a random prompt, for the
formats an 8-bit cache could take (the figure that chose int8 rows: docs/perf.md; run by hand,
not by pytest). With --backend cuda: the GPU's int8 cache against its bf16 cache, every layer
of the shape unless --layers says otherwise, the int8 engine decoding greedily (the
megakernel where it runs) and the bf16 one following its tokens.

    python tests/kv_cache_error.py --config qwen3-0.6b --layers 4 --prompt 1024 --steps 64
    python tests/kv_cache_error.py --backend cuda --config qwen3-8b --prompt 8192 --steps 256
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable

import numpy as np

from qwenchat.engine import reference
from qwenchat.engine.reference import ReferenceEngine
from qwenchat.model.floats import (
    E4M3_MAX,
    bf16_bits_to_f32,
    e4m3_to_f32,
    f32_to_bf16_bits,
    f32_to_e4m3,
)
from qwenchat.model.kv_cache import cached
from qwenchat.model.presets import preset
from qwenchat.model.random_weights import RandomWeights


def e4m3_rows(rows: np.ndarray) -> np.ndarray:
    """Each row as e4m3 codes times its own scale (max |x| / 448)."""
    scale = np.abs(rows).max(axis=-1, keepdims=True) / np.float32(E4M3_MAX)
    safe = np.where(scale > 0, scale, np.float32(1))
    return (e4m3_to_f32(f32_to_e4m3(rows / safe)) * scale).astype(np.float32)


def int8_blocks(rows: np.ndarray, block: int = 32) -> np.ndarray:
    """int8 codes with a scale per `block` values (llama.cpp's q8_0 layout)."""
    shape = rows.shape
    blocks = rows.reshape(*shape[:-1], shape[-1] // block, block)
    return cached(blocks, "int8").reshape(shape)


VARIANTS: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "bf16 rounding": lambda rows: bf16_bits_to_f32(f32_to_bf16_bits(rows)),
    "int8 rows (kept)": lambda rows: cached(rows, "int8"),
    "int8 blocks of 32": int8_blocks,
    "e4m3 rows": e4m3_rows,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="qwen3-0.6b")
    parser.add_argument("--layers", type=int, help="(default: 4 on the CPU, all on the GPU)")
    parser.add_argument("--prompt", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--backend", choices=("cpu", "cuda"), default="cpu")
    args = parser.parse_args()
    config = preset(args.config)
    layers = args.layers or (4 if args.backend == "cpu" else config.num_hidden_layers)
    config = dataclasses.replace(config, num_hidden_layers=layers)
    weights = RandomWeights(config, seed=2)
    ctx = args.prompt + args.steps + 1
    prompt = [int(i) for i in np.random.default_rng(0).integers(0, config.vocab_size,
                                                                 args.prompt)]
    if args.backend == "cuda":
        gpu_figure(args, config, weights, ctx, prompt)
        return
    base = ReferenceEngine(config, weights, ctx)
    base.prefill(prompt)
    tokens, logits = [], []
    for _ in range(args.steps):
        logits.append(base.last_logits().copy())
        tokens.append(int(np.argmax(logits[-1])))
        base.prefill([tokens[-1]])
    for name, rows in VARIANTS.items():
        # (the engine's cache takes its rows through this module's `cached`)
        reference.cached = lambda values, _format, rows=rows: rows(values)
        engine = ReferenceEngine(config, weights, ctx, kv_cache=name)
        engine.prefill(prompt)
        errors, agree = [], 0
        for want, token in zip(logits, tokens, strict=True):
            ours = engine.last_logits()
            errors.append(float(np.abs(ours - want).max() / np.abs(want).max()))
            agree += int(np.argmax(ours) == np.argmax(want))
            engine.prefill([token])
        print(f"{args.config} ({args.layers} layers), {args.prompt}-token prompt, {name}: "
              f"relative logit error median {np.median(errors):.2e}, max {max(errors):.2e}; "
              f"top-1 agreement {agree}/{args.steps}")
    reference.cached = cached


def gpu_figure(args, config, weights, ctx: int, prompt: list[int]) -> None:
    from test_cuda_fp8 import one_step_a_launch  # (last_logits() is each step's)

    from qwenchat.engine.base import GenerateRequest
    from qwenchat.engine.cuda.engine import CudaEngine
    from qwenchat.sampling.params import LiveParams, SamplingParams

    eight = CudaEngine(config, weights, ctx=ctx, kv_cache="int8")
    plain = CudaEngine(config, weights, ctx=ctx)
    one_step_a_launch(eight)
    eight.prefill(prompt)
    plain.prefill(prompt)
    request = GenerateRequest(LiveParams(SamplingParams(temperature=0.0, max_tokens=args.steps)),
                              frozenset(), seed=0)
    errors, agree = [], 0
    for token in eight.generate(request):
        want, ours = plain.last_logits(), eight.last_logits()
        errors.append(float(np.abs(ours - want).max() / np.abs(want).max()))
        agree += int(token == int(np.argmax(want)))
        plain.prefill([token])
    print(f"{args.config} ({config.num_hidden_layers} layers, GPU, {eight.decode}), "
          f"{args.prompt}-token prompt, int8 cache against the bf16 cache: relative logit error "
          f"median {np.median(errors):.2e}, max {max(errors):.2e}; top-1 agreement "
          f"{agree}/{len(errors)}")
    eight.close()
    plain.close()


if __name__ == "__main__":
    main()
