"""Time to first token of every turn of a chat, with and without the background prefill of the
history between turns: a benchmark, not a test.

Plays a 10-turn conversation through the chat's own `Chat` object (what the TUI drives), each
message sent a few seconds after the previous reply ended, as a person types:

    python tests/turn_latency.py --config qwen3-8b --tokenizer DIR   # CUDA, random weights
    python tests/turn_latency.py --model DIR --pause 0.2             # any checkpoint, any backend

TTFT counts from the send, so it includes waiting for a background prefill step under way.
As in the chat screen, Python's full garbage collections wait while a reply streams; the time
the collector took during each turn's wait for its first token is reported beside it.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import threading
import time
from pathlib import Path

from qwenchat.engine import create_engine
from qwenchat.model.loader import open_model_dir
from qwenchat.model.tokenizer import Tokenizer
from qwenchat.session import now
from qwenchat.store import ChatStore
from qwenchat.tui.chat import Chat
from qwenchat.tui.loader import LoadedModel
from qwenchat.tui.quiet_gc import FullCollectionsDeferred
from qwenchat.tui.settings import ChatSettings

MESSAGES = [
    "What is the fastest land animal, and how fast can it run over a short distance?",
    "How does that compare with the top speed of a red fox chasing a rabbit in a field?",
    "Which of the two can keep up its top speed for longer, and what limits it?",
    "Explain how a cheetah's spine and claws help it accelerate so quickly from a standstill.",
    "Do foxes hunt alone or in groups, and how does that change the way they catch prey?",
    "Write a short poem of four lines about a fox crossing a snowy field at night.",
    "Now turn that poem into a haiku that keeps the image of the snow and the moonlight.",
    "What do arctic foxes eat in winter when lemmings are hard to find under the snow?",
    "How do their fur and body shape keep them warm at forty degrees below freezing?",
    "Summarise everything we talked about in three short bullet points for a child.",
]


def cuda_model(preset: str, tokenizer_dir: Path, ctx: int) -> LoadedModel:
    from qwenchat.engine.cuda.engine import CudaEngine
    from qwenchat.model.presets import PRESETS
    from qwenchat.model.random_weights import RandomWeights

    config = PRESETS[preset]
    engine = CudaEngine(config, RandomWeights(config, seed=0), ctx=ctx)
    tokenizer = Tokenizer(tokenizer_dir)
    eos = frozenset({tokenizer.im_end_id, tokenizer.end_of_text_id})
    return LoadedModel(preset, tokenizer_dir, engine, tokenizer, eos)


def checkpoint_model(directory: Path, backend: str, ctx: int) -> LoadedModel:
    model = open_model_dir(directory)
    engine = create_engine(backend, model.config, model.checkpoint, ctx)
    return LoadedModel(str(directory), directory, engine, model.tokenizer, model.eos_ids)


class CollectorClock:
    """Seconds the garbage collector has run so far (gc.callbacks)."""

    def __init__(self) -> None:
        self.total = 0.0
        self._began = 0.0
        gc.callbacks.append(self._tick)

    def _tick(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._began = time.perf_counter()
        else:
            self.total += time.perf_counter() - self._began


COLLECTOR = CollectorClock()


def play(model: LoadedModel, turns: int, reply_tokens: int, pause_s: float,
         background: bool, quiet_gc: bool = True) -> list[dict]:
    """One chat of `turns` turns; each turn's numbers as the status bar would show them."""
    model.engine.truncate(0)
    settings = ChatSettings(model.directory, False,
                            {"temperature": 0.7, "seed": 1, "max_tokens": reply_tokens})
    chat = Chat(ChatStore(None), model, settings, system="You are a helpful assistant.")
    time.sleep(pause_s)  # the first message too is typed after a pause, as every other one
    rows, prepared = [], 0  # tokens the background prefill added before this turn (-1:
    for turn, text in enumerate(MESSAGES[:turns], start=1):  # still running at the send)
        deferred = FullCollectionsDeferred()
        sent_at = now()
        if quiet_gc:
            deferred.begin()  # as the chat screen does from the send to the reply's end
        collected = COLLECTOR.total
        events = chat.send(text, threading.Event(), sent_at)
        next(events)  # the first token (or the dropped-turns notice before it)
        collected = COLLECTOR.total - collected
        for _ in events:
            pass
        deferred.end()
        chat.finish_reply()
        stats = chat.session.last_reply.stats
        rows.append({"turn": turn, "ttft_ms": stats.ttft_s * 1e3,
                     "prefill_ms": stats.prefill_s * 1e3, "gc_ms": collected * 1e3,
                     "prefill_tokens": stats.prefill_tokens, "cached": stats.reused_tokens,
                     "prompt_tokens": stats.prompt_tokens,
                     "generated": stats.generated_tokens,
                     "decode_tok_s": stats.decode_tok_s, "prepared_before": prepared})
        chat.prepared_tokens = 0
        if background:
            chat.start_preparing()
        time.sleep(pause_s)  # the user reads and types the next message
        prepared = -1 if chat.preparing else chat.prepared_tokens
    chat.stop_preparing()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", help="a preset, for the CUDA engine on random weights")
    parser.add_argument("--tokenizer", type=Path, help="Qwen3 tokenizer directory (--config)")
    parser.add_argument("--model", type=Path, help="a checkpoint directory instead")
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--reply-tokens", type=int, default=200)
    parser.add_argument("--pause", type=float, default=3.0, help="seconds between turns")
    parser.add_argument("--ctx", type=int, default=8192)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.config and args.tokenizer:
        model = cuda_model(args.config, args.tokenizer, args.ctx)
    elif args.model:
        model = checkpoint_model(args.model, args.backend, args.ctx)
    else:
        raise SystemExit("give --config PRESET --tokenizer DIR, or --model DIR")
    try:
        play(model, 1, 8, 0.0, background=False)  # warm-up: kernels loaded, caches touched
        result = {mode: play(model, args.turns, args.reply_tokens, args.pause, background)
                  for mode, background in (("background", True), ("none", False))}
    finally:
        model.close()
    if args.json:
        print(json.dumps({"engine": model.engine.name, "config": args.config, **result}))
        return
    print(f"{model.engine.name}, {args.config or args.model}: {args.turns} turns, replies of "
          f"{args.reply_tokens} tokens, {args.pause} s between turns")
    for mode, rows in result.items():
        print(f"\nhistory prefilled in the background: {'yes' if mode == 'background' else 'no'}")
        print("turn  TTFT ms  (prefill ms, gc ms)  prompt = new + cached  prefilled between turns")
        for r in rows:
            print(f"{r['turn']:>4}  {r['ttft_ms']:7.1f}  ({r['prefill_ms']:10.1f}, "
                  f"{r['gc_ms']:5.1f})  {r['prompt_tokens']:>6} = "
                  f"{r['prefill_tokens']:>5} + {r['cached']:>5}  {r['prepared_before']:>6}")
        later = statistics.median(r["ttft_ms"] for r in rows[1:])
        print(f"first turn {rows[0]['ttft_ms']:.1f} ms; later turns: median {later:.1f}, "
              f"worst {max(r['ttft_ms'] for r in rows[1:]):.1f} ms")


if __name__ == "__main__":
    main()
