"""`qwenchat serve`'s streamed rate against the engine's own: a benchmark aid (CUDA), not a test.

Random weights of a real shape on the CUDA engine behind the server (in this process, on a
free port) and the real tokenizer (`--tokenizer DIR`, a directory with tokenizer.json and its
config); a greedy chat reply of `--tokens` tokens is streamed over HTTP `--repeats` times, and
its rate (tokens after the first, over the time from the first content chunk to the last, as a
client sees them) is set beside `qwenchat bench`'s decode rate on the same engine at a nearby
cache position (the bench's own measurement):

    python tests/serve_rate.py --config qwen3-0.6b --tokenizer ../shared/fixtures/qwen3-tokenizer

Then the same reply through the chat's remote backend (`--backend openai`: RemoteSession, whose
decode_tok_s is the rate the chat's status bar shows) against the server's own rate for it.

Issue 42's targets: the stream at 95% of the bench or more, the chat at 95% of the server's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from pathlib import Path

import httpx
from served import Running

from qwenchat.bench import BenchSettings, measure_engine
from qwenchat.engine.cuda.engine import CudaEngine
from qwenchat.model.presets import PRESETS
from qwenchat.model.random_weights import RandomWeights
from qwenchat.model.tokenizer import Tokenizer
from qwenchat.remote import RemoteServer, RemoteSession
from qwenchat.sampling.params import LiveParams, SamplingParams, eos_token_ids
from qwenchat.serve import ServedModel
from qwenchat.session import Progress


def streamed(url: str, tokens: int) -> tuple[int, float]:
    """(completion tokens, seconds from the first content chunk to the last) of one reply."""
    body = {"model": "bench", "messages": [{"role": "user", "content": "Tell me a long story."}],
            "max_tokens": tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    first = last = None
    used = 0
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=120) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                used = chunk["usage"]["completion_tokens"]
            if any(c["delta"].get("content") for c in chunk.get("choices", [])):
                last = time.perf_counter()
                first = first or last
    if first is None or last is None or last <= first:
        raise SystemExit("the reply streamed no content over time")
    return used, last - first


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="qwen3-0.6b", choices=sorted(PRESETS))
    parser.add_argument("--quantize", default="none", choices=("none", "fp8", "int4"))
    parser.add_argument("--tokenizer", type=Path, required=True)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    config = PRESETS[args.config]
    weights = RandomWeights(config, weight_format="bf16" if args.quantize == "none"
                            else args.quantize)
    engine = CudaEngine(config, weights, ctx=args.tokens + 256, decode="megakernel")
    tokenizer = Tokenizer(args.tokenizer)
    eos = frozenset(eos_token_ids(args.tokenizer, [tokenizer.im_end_id]))
    running = Running(ServedModel(("bench",), args.tokenizer, engine, tokenizer, eos))
    url, lines = running.url, running.lines
    try:
        streamed(url, 16)  # warm: the kernels, the prompt's prefix in the cache
        rates = []
        for _ in range(args.repeats):
            used, seconds = streamed(url, args.tokens)
            rates.append((used - 1) / seconds)
            print(f"streamed {used} tokens: {rates[-1]:,.1f} tok/s  | server: {lines[-1]}",
                  flush=True)
        def logged(count: int) -> str:  # the server's line for the request that made `count`
            deadline = time.perf_counter() + 10
            while len(lines) < count and time.perf_counter() < deadline:
                time.sleep(0.01)
            return lines[count - 1]

        chat = []
        for _ in range(args.repeats):
            count = len(lines) + 1
            session = RemoteSession(RemoteServer(url), "bench", LiveParams(SamplingParams(
                temperature=0.0, max_tokens=args.tokens)))
            final = [e for e in session.send("Tell me a long story.", threading.Event())
                     if isinstance(e, Progress) and e.final][-1]
            served = float(logged(count).split(" tok/s")[0].rsplit("· ", 1)[1])
            chat.append((final.stats.decode_tok_s, served))
            print(f"chat (remote backend): {final.stats.decode_tok_s:,.1f} tok/s, the server's "
                  f"{served:,.1f}", flush=True)
        settings = BenchSettings(prompts=(1,), positions=(32,), steps=args.tokens,
                                 repeats=args.repeats)
        bench = measure_engine(engine, settings, args.config, "random").decode[0].tok_s
    finally:
        running.stop()
        engine.close()
    stream = statistics.median(rates)
    print(f"{args.config} {args.quantize}: streamed {stream:,.1f} tok/s (median of "
          f"{args.repeats}), bench {bench:,.1f} tok/s at position 32: {stream / bench:.1%}")
    shown, served = (statistics.median(v) for v in zip(*chat, strict=True))
    print(f"the chat on the remote backend shows {shown:,.1f} tok/s, the server's log "
          f"{served:,.1f}: {shown / served:.1%}")


if __name__ == "__main__":
    main()
