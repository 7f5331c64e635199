"""Where CUDA greedy decoding first parts from the reference engine, and by how much: the
reference's best logits at that step beside the GPU's (a diagnosis aid, run by hand on a GPU,
not by pytest).

A checkpoint of the shape issue 22's FP8 divergence was seen on (Qwen's FP8 layout and the
same shape in bf16: hidden 1280, 10 query / 2 KV heads of 128, intermediate 3456 = 27 blocks
of 128, 3 layers, random weights) is written with the real tokenizer, and each prompt is
answered greedily on both decode paths while the reference follows the GPU's tokens.

    python tests/greedy_parting.py --tokenizer ../shared/fixtures/qwen3-tokenizer
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np
from tiny_model import write_tiny_model

from qwenchat.engine.base import GenerateRequest
from qwenchat.engine.cuda.engine import CudaEngine
from qwenchat.engine.reference import ReferenceEngine
from qwenchat.model.fp8 import with_quantization
from qwenchat.model.loader import open_model_dir
from qwenchat.model.tokenizer import Message
from qwenchat.sampling.params import LiveParams, SamplingParams

SHAPE = dict(hidden_size=1280, intermediate_size=3456, num_attention_heads=10,
             num_key_value_heads=2, head_dim=128, num_hidden_layers=3,
             max_position_embeddings=4096, tie_word_embeddings=False)
PROMPTS = ("Explain the moon in one line, 请用中文 🌙",
           'def fibonacci(n):\n    """Return the n-th Fibonacci number."""')


def parting(gpu: CudaEngine, ref: ReferenceEngine, steps: int) -> tuple[float, str | None]:
    """(worst relative logit error, the first step where the GPU's token is not the
    reference's argmax, with both engines' best logits there)."""
    request = GenerateRequest(LiveParams(SamplingParams(temperature=0.0, max_tokens=steps)),
                              frozenset(), seed=0)
    worst, first = 0.0, None
    for step, token in enumerate(gpu.generate(request)):
        expected, ours = ref.last_logits(), gpu.last_logits()
        scale = float(np.abs(expected).max())
        worst = max(worst, float(np.abs(ours - expected).max()) / scale)
        best = int(np.argmax(expected))
        if token != best and first is None:
            top = np.argsort(-expected)[:3]
            first = (f"step {step}: GPU {token}, reference {best} "
                     f"(gap {(expected[best] - expected[token]) / scale:.2e} of the largest); "
                     f"reference {[(int(i), round(float(expected[i]), 3)) for i in top]}, "
                     f"GPU {[(int(i), round(float(ours[i]), 3)) for i in top]}")
        ref.prefill([token])
    return worst, first


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", type=Path, required=True,
                        help="the real Qwen3 tokenizer's directory")
    parser.add_argument("--steps", type=int, default=48)
    args = parser.parse_args()
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(args.tokenizer / "tokenizer.json"))
    with tempfile.TemporaryDirectory() as root:
        for dtype in ("FP8", "BF16"):
            directory = write_tiny_model(Path(root) / dtype, dtype=dtype, scale_dtype="BF16",
                                         tokenizer=tokenizer, **SHAPE)
            model = open_model_dir(directory)
            weights = with_quantization(model.checkpoint, "none")
            for text in PROMPTS:
                prompt = model.tokenizer.encode_chat([Message("user", text)],
                                                     enable_thinking=False)
                for decode in ("megakernel", "layered"):
                    gpu = CudaEngine(model.config, model.checkpoint, 512, decode=decode)
                    if gpu.decode == "megakernel":  # last_logits() stays the last token's
                        gpu.steps_per_launch, gpu.launches_ahead = 1, 0
                    ref = ReferenceEngine(model.config, weights, 512)
                    gpu.prefill(prompt)
                    ref.prefill(prompt)
                    worst, first = parting(gpu, ref, args.steps)
                    print(f"{dtype} {decode} {text[:12]!r}: worst {worst:.2e}; "
                          f"{first or f'no parting in {args.steps}'}")
                    gpu.close()


if __name__ == "__main__":
    main()
