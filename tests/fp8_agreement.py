"""FP8 or int4 against bf16 on the same random weights: relative logit error and top-1
agreement over a greedy continuation (a sanity figure for the note and docs/perf.md, not a
quality claim; run by hand on a GPU, not by pytest).

    python tests/fp8_agreement.py --config qwen3-8b --steps 256
    python tests/fp8_agreement.py --config qwen3-8b --steps 256 --quantize int4
"""

from __future__ import annotations

import argparse

import numpy as np

from qwenchat.engine import create_engine
from qwenchat.engine.base import GenerateRequest
from qwenchat.model.presets import preset
from qwenchat.model.random_weights import RandomWeights
from qwenchat.sampling.params import LiveParams, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="qwen3-0.6b")
    parser.add_argument("--steps", type=int, default=256)
    parser.add_argument("--prompt", type=int, default=32, help="random prompt tokens")
    parser.add_argument("--backend", default="cuda")
    parser.add_argument("--quantize", default="fp8", choices=("fp8", "int4"))
    args = parser.parse_args()
    config = preset(args.config)
    weights = RandomWeights(config)
    ctx = args.prompt + args.steps + 1
    prompt = [int(i) for i in np.random.default_rng(0).integers(0, config.vocab_size, args.prompt)]
    bf16 = create_engine(args.backend, config, weights, ctx)
    bf16.prefill(prompt)
    request = GenerateRequest(LiveParams(SamplingParams(temperature=0.0, max_tokens=args.steps)),
                              frozenset(), seed=0)
    tokens = list(bf16.generate(request))
    # Both models read the same sequence: the prompt and bf16's greedy continuation.
    sequence = prompt + tokens[:-1]
    bf16.truncate(0)
    reference = bf16.prefill_logits(sequence)[args.prompt - 1 :]
    bf16.close()
    narrow = create_engine(args.backend, config, weights, ctx, quantize=args.quantize)
    ours = narrow.prefill_logits(sequence)[args.prompt - 1 :]
    narrow.close()
    errors = np.abs(ours - reference).max(axis=1) / np.abs(reference).max(axis=1)
    agree = float(np.mean(ours.argmax(axis=1) == reference.argmax(axis=1)))
    print(f"{args.config} {args.quantize}: {len(tokens)} steps, relative logit error median "
          f"{np.median(errors):.2e}, worst {errors.max():.2e}; top-1 agreement {agree:.1%}")


if __name__ == "__main__":
    main()
