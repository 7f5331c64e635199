"""What FP8 activations would cost: the reference engine with every linear layer's input as
e4m3 codes and a scale a token and 128 columns (Qwen's "dynamic" activation scheme, what FP8
tensor cores take: issue 25) against the same engine with float32 inputs, on random FP8
weights of a real shape. Prints the relative logit error (largest |difference| over the
largest |logit|, per position) and top-1 agreement over every position of a random prompt
(a figure for docs/perf.md; run by hand, not by pytest). With --backend cuda: the GPU's
prefill on e4m3 tensor cores (gemm_fp8_sm90.cu) against its prefill with bf16 activations,
every layer of the shape.

    python tests/fp8_activation_error.py --config qwen3-0.6b --prompt 256
    python tests/fp8_activation_error.py --config qwen3-8b --layers 4 --prompt 128
    python tests/fp8_activation_error.py --backend cuda --config qwen3-8b --prompt 512
"""

from __future__ import annotations

import argparse
import dataclasses

import numpy as np

from qwenchat.engine.reference import ReferenceEngine
from qwenchat.model.floats import bf16_bits_to_f32, f32_to_bf16_bits
from qwenchat.model.presets import preset
from qwenchat.model.random_weights import RandomWeights


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="qwen3-0.6b")
    parser.add_argument("--layers", type=int, help="(default: all of the shape's)")
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--backend", choices=("cpu", "cuda"), default="cpu")
    args = parser.parse_args()
    config = preset(args.config)
    config = dataclasses.replace(config, num_hidden_layers=args.layers or config.num_hidden_layers)
    weights = RandomWeights(config, weight_format="fp8")
    prompt = [int(i) for i in np.random.default_rng(0).integers(0, config.vocab_size, args.prompt)]
    if args.backend == "cuda":
        on_the_gpu(config, weights, prompt, args.config)
        return
    inputs = {"float32": None,  # the engine as it is (fp8_activations off)
              "bf16": lambda x: bf16_bits_to_f32(f32_to_bf16_bits(x)),  # the GPU's path today
              "e4m3, a scale a token and 128 columns": "fp8"}
    logits = {}
    for name, into in inputs.items():
        engine = ReferenceEngine(config, weights, args.prompt + 1, fp8_activations=into == "fp8")
        if callable(into):
            engine.linear_input = into
        logits[name] = engine.prefill_logits(prompt)
    plain = logits["float32"]
    for name, ours in logits.items():
        if name == "float32":
            continue
        errors = np.abs(ours - plain).max(axis=1) / np.abs(plain).max(axis=1)
        agree = int(np.sum(ours.argmax(axis=1) == plain.argmax(axis=1)))
        print(f"{args.config} ({config.num_hidden_layers} layers, FP8 weights), {args.prompt} "
              f"positions, linear inputs in {name} against float32: relative logit error median "
              f"{np.median(errors):.2e}, max {errors.max():.2e}; top-1 agreement "
              f"{agree}/{len(errors)}")


def on_the_gpu(config, weights, prompt: list[int], name: str) -> None:
    from qwenchat.engine.cuda.engine import CudaEngine

    logits = {}
    for activations in ("bf16", "e4m3"):
        engine = CudaEngine(config, weights, ctx=len(prompt) + 1, decode="layered",
                            fp8_activations=activations)
        assert engine.fp8_gemm == (activations == "e4m3"), "e4m3 needs gemm_fp8_sm90.cu (sm_90)"
        logits[activations] = engine.prefill_logits(prompt)
        engine.close()
    plain, ours = logits["bf16"], logits["e4m3"]
    errors = np.abs(ours - plain).max(axis=1) / np.abs(plain).max(axis=1)
    agree = int(np.sum(ours.argmax(axis=1) == plain.argmax(axis=1)))
    print(f"GPU {name} ({config.num_hidden_layers} layers, FP8 weights), {len(prompt)} positions, "
          f"e4m3 activations against bf16: relative logit error median {np.median(errors):.2e}, "
          f"max {errors.max():.2e}; top-1 agreement {agree}/{len(errors)}")


if __name__ == "__main__":
    main()
