"""A small decode-megakernel workload for compute-sanitizer: hand-run, not a test (CUDA only).

A 2-layer model 256 wide (4 query heads on 2 key/value heads of 128, vocabulary 4,096) on random
weights: prefill 300 tokens, then 32 greedy steps, 32 sampled with Qwen's non-thinking sampler
and penalties, 32 with top-p alone, 24 steps a launch, so that launches end and restart mid-reply.
Small enough for racecheck to finish in about two minutes on an H100:

    compute-sanitizer --tool memcheck python tests/megakernel_sanitize.py
    compute-sanitizer --tool synccheck python tests/megakernel_sanitize.py
    compute-sanitizer --tool racecheck python tests/megakernel_sanitize.py

`--weights fp8` checks the FP8 consumer (on the tensor cores from sm_89), `--weights int4` the
int4 one (int4_pair_dot; with `--rows parts`, item_dot), `--shared 101376`
the layout of a 99 KB card (two 16 KB stages), `--consumer fma` the CUDA-core FP8 consumer,
`--rows parts` stages that hold parts of rows (the layout takes whole rows at this width),
`--intermediate 8192` a down projection whose input is polled in batches (8 or more pairs a
thread: cuda_src/mk_matvec.cuh, take_pairs), `--speculate` replies verified by speculative
passes (prompt lookup on a prompt that repeats itself: the prefill's kernels on a few tokens
after the cache, interleaved with megakernel launches), `--experts` a mixture of experts (16
experts of 256 rows, 4 a token, every layer sparse: the router's phase, the routing in every
block with gate/up's input staged meanwhile and the experts' stages held until it, megakernel.cu
route_and_stage, and their down rows as one phase). `--define QW_MK_NAME=VALUE` checks a kernel
variant behind a define.
"""

from __future__ import annotations

import argparse
import dataclasses

from consumer_compare import parse_defines
from test_megakernel import reply

from qwenchat.engine.base import GenerateRequest
from qwenchat.engine.cuda.engine import CudaEngine
from qwenchat.engine.cuda.megakernel import EXPERIMENT_DEFINES
from qwenchat.engine.speculate import SPECULATE_MOST
from qwenchat.model.presets import PRESETS
from qwenchat.model.random_weights import RandomWeights
from qwenchat.sampling.params import LiveParams, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--weights", default="bf16", choices=("bf16", "fp8", "int4"))
    parser.add_argument("--consumer", default="auto", choices=("auto", "fma"))
    parser.add_argument("--shared", type=int, help="lay the megakernel out for this much "
                                                   "shared memory a block")
    parser.add_argument("--rows", default="auto", choices=("auto", "whole", "parts"))
    parser.add_argument("--intermediate", type=int, default=768)
    parser.add_argument("--speculate", action="store_true")
    parser.add_argument("--kv-cache", default="bf16", choices=("bf16", "int8"))
    parser.add_argument("--experts", action="store_true")
    parser.add_argument("--define", action="append", default=[], metavar="NAME=VALUE",
                        help="a megakernel define for this run (a variant to check)")
    args = parser.parse_args()
    EXPERIMENT_DEFINES.update(parse_defines(args.define))
    config = dataclasses.replace(PRESETS["qwen3-0.6b"], num_hidden_layers=2, hidden_size=256,
                                 intermediate_size=args.intermediate, vocab_size=4096,
                                 num_attention_heads=4, num_key_value_heads=2)
    if args.experts:
        config = dataclasses.replace(config, num_experts=16, num_experts_per_tok=4,
                                     moe_intermediate_size=256, norm_topk_prob=True,
                                     tie_word_embeddings=False)
    weights = RandomWeights(config, seed=0, weight_format=args.weights)
    engine = CudaEngine(config, weights, ctx=512, decode="megakernel",
                        megakernel_consumer=args.consumer, megakernel_shared=args.shared,
                        megakernel_rows=args.rows, kv_cache=args.kv_cache)
    try:
        if engine.decode != "megakernel":
            raise SystemExit("the megakernel cannot run on this GPU: nothing to check")
        engine.steps_per_launch = 24
        prompt = list(range(5, 305))
        if args.speculate:
            speculated = speculative_replies(engine, prompt)
            print(f"{args.weights}, speculative passes: {speculated}")
            return
        greedy = reply(engine, prompt, 32)
        sampled = reply(engine, prompt, 32, seed=1, temperature=0.7, top_p=0.8, top_k=20,
                        presence_penalty=0.5, frequency_penalty=0.2)
        top_p = reply(engine, prompt, 32, seed=1, temperature=1.0, top_p=0.95, top_k=0)
        layout = engine.mk_layout
        print(f"{args.weights}, {layout.stages} x {layout.stage_bytes} B stages, parts of rows: "
              f"{layout.split}, FP8 on the tensor cores: {layout.mma}; greedy {greedy[:8]} "
              f"sampled {sampled[:8]} top-p {top_p[:8]}")
    finally:
        engine.close()


def speculative_replies(engine, prompt: list[int]) -> str:
    """Greedy and sampled replies with prompt lookup on a prompt that repeats itself."""
    prompt = prompt[:40] * 3
    described = []
    for params in (SamplingParams(temperature=0.0, max_tokens=64),
                   SamplingParams(temperature=0.7, top_p=0.8, top_k=20, presence_penalty=0.5,
                                  max_tokens=64)):
        engine.truncate(0)
        engine.prefill(prompt)
        request = GenerateRequest(LiveParams(params), frozenset(), seed=1,
                                  speculate=SPECULATE_MOST)
        tokens = list(engine.generate(request))
        stats = engine.speculation
        described.append(f"{len(tokens)} tokens, {stats.passes} passes, kept "
                         f"{stats.accepted} of {stats.proposed}")
    return "; ".join(described)


if __name__ == "__main__":
    main()
