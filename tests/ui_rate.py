"""How fast the chat shows a reply, beside the engine alone: a benchmark, not a test.

Drives the real chat app headless (Textual's Pilot) through one long reply and reads the rate
the app prints under it, then runs the same reply through a plain ChatSession (what `ask`
does) for the engine's own rate. Two engines:

    python tests/ui_rate.py --fake 2000 --busy 1        # scripted tokens at 2,000 tok/s,
                                                       # another core kept busy
    python tests/ui_rate.py --config qwen3-0.6b --tokenizer DIR   # the CUDA engine, random
                                                                  # weights, Qwen's tokenizer

The fake engine delivers tokens in launches the way the megakernel does (`--launch-steps`,
`--ahead` launches queued behind the running one), so a reply thread that falls behind delays
it exactly as it would delay the GPU. Its reply is this repository's README, as Markdown.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import re
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from fake_engine import FakeEngine  # noqa: E402
from tiny_model import write_tiny_model  # noqa: E402

from qwenchat.model.config import Qwen3Config  # noqa: E402
from qwenchat.model.tokenizer import Tokenizer  # noqa: E402
from qwenchat.sampling.params import LiveParams, SamplingParams  # noqa: E402
from qwenchat.session import ChatSession, Progress, ReplyStats  # noqa: E402
from qwenchat.tui.loader import LoadedModel  # noqa: E402

QUESTION = "Tell me everything about qwenchat, in Markdown."
SAMPLER = dict(temperature=0.7, top_p=0.8, top_k=20, seed=1)  # Qwen's non-thinking values


def fake_model(rate: float, launch_steps: int, ahead: int, folder: Path) -> LoadedModel:
    model_dir = write_tiny_model(folder / "model")
    tokenizer = Tokenizer(model_dir)
    config = Qwen3Config.from_file(model_dir / "config.json")
    script = tokenizer.encode((HERE.parent / "README.md").read_text(encoding="utf-8"))
    engine = FakeEngine(config, script, capacity=1 << 20, rate=rate,
                        launch_steps=launch_steps, launches_ahead=ahead)
    eos = frozenset(i for i in (tokenizer.im_end_id, tokenizer.end_of_text_id) if i is not None)
    return LoadedModel("fake", model_dir, engine, tokenizer, eos)


def cuda_model(preset: str, tokenizer_dir: Path, ctx: int, ahead: int) -> LoadedModel:
    from qwenchat.engine.cuda.engine import CudaEngine
    from qwenchat.model.presets import PRESETS
    from qwenchat.model.random_weights import RandomWeights

    config = PRESETS[preset]
    engine = CudaEngine(config, RandomWeights(config, seed=0), ctx=ctx)
    if engine.decode == "megakernel":
        engine.launches_ahead = ahead
    tokenizer = Tokenizer(tokenizer_dir)
    eos = frozenset({tokenizer.im_end_id, tokenizer.end_of_text_id})
    return LoadedModel(preset, tokenizer_dir, engine, tokenizer, eos)


def engine_alone(model: LoadedModel, tokens: int) -> ReplyStats:
    """The reply through a ChatSession and nothing else, as `qwenchat ask` runs it."""
    model.engine.truncate(0)
    session = ChatSession(model.engine, model.tokenizer, model.eos_ids,
                          LiveParams(SamplingParams(**SAMPLER, max_tokens=tokens)))
    final = None
    for event in session.send(QUESTION):
        if isinstance(event, Progress) and event.final:
            final = event.stats
    assert final is not None
    return final


def in_the_chat(model: LoadedModel, tokens: int, size: tuple[int, int]) -> tuple[str, ReplyStats]:
    """The reply in the chat app, headless: the summary line it shows, and its stats."""
    from qwenchat.tui.app import QwenchatApp
    from qwenchat.tui.options import ChatOptions
    from qwenchat.tui.screens.chat import ChatScreen

    model.engine.truncate(0)
    app = QwenchatApp(ChatOptions("bench", overrides={**SAMPLER, "max_tokens": tokens}),
                      loader=lambda *reports: model, history=None)
    shown: list[str] = []

    async def main() -> None:
        async with app.run_test(size=size) as pilot:
            while not (isinstance(app.screen, ChatScreen) and app.screen.is_mounted
                       and app.focused is app.screen.prompt):
                await pilot.pause(0.01)
            screen = app.screen
            screen.prompt.load_text(QUESTION)
            await pilot.press("enter")
            summary = None
            while summary is None or not str(summary.render()):
                await pilot.pause(0.05)
                if screen.chat.session.last_reply is not None and not screen.generating:
                    summary = screen.conversation.turns[-1].query_one(".summary")
            screen.chat.stop_preparing()
            shown.append(str(summary.render()))

    asyncio.run(main())
    reply = app.chat_screen.chat.session.last_reply
    return shown[0], reply.stats


def shown_rate(summary: str) -> float:
    match = re.search(r"([\d,.]+) tok/s", summary)
    if match is None:
        raise SystemExit(f"no rate in the reply's summary line: {summary!r}")
    return float(match.group(1).replace(",", ""))


def spin() -> None:
    while True:
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fake", type=float, metavar="TOK_S", help="fake engine at this rate")
    parser.add_argument("--launch-steps", type=int, default=100)
    parser.add_argument("--ahead", type=int, default=1,
                        help="launches queued behind the running one (fake engine, megakernel)")
    parser.add_argument("--config", help="a preset, for the CUDA engine on random weights")
    parser.add_argument("--tokenizer", type=Path, help="Qwen3 tokenizer directory (--config)")
    parser.add_argument("--tokens", type=int, default=8000)
    parser.add_argument("--busy", type=int, default=0, help="cores to keep busy meanwhile")
    parser.add_argument("--size", default="120x40")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    size = tuple(int(n) for n in args.size.split("x"))
    with tempfile.TemporaryDirectory() as folder:
        if args.fake:
            model = fake_model(args.fake, args.launch_steps, args.ahead, Path(folder))
        elif args.config and args.tokenizer:
            model = cuda_model(args.config, args.tokenizer, args.tokens + 256, args.ahead)
        else:
            raise SystemExit("give --fake RATE, or --config PRESET --tokenizer DIR")
        spinners = [multiprocessing.Process(target=spin, daemon=True) for _ in range(args.busy)]
        for process in spinners:
            process.start()
        try:
            alone = engine_alone(model, args.tokens)
            summary, chat = in_the_chat(model, args.tokens, size)
        finally:
            for process in spinners:
                process.terminate()
            model.close()
    result = {"engine": model.engine.name, "tokens": args.tokens, "busy_cores": args.busy,
              "nominal_tok_s": args.fake, "launch_steps": args.launch_steps if args.fake else None,
              "launches_ahead": args.ahead,
              "alone_tok_s": alone.decode_tok_s, "alone_tokens": alone.generated_tokens,
              "chat_shows_tok_s": shown_rate(summary), "chat_tokens": chat.generated_tokens,
              "chat_summary": summary, "size": args.size, "time": time.strftime("%F %T")}
    result["chat_over_alone"] = result["chat_shows_tok_s"] / result["alone_tok_s"]
    if args.json:
        print(json.dumps(result))
        return
    print(f"{result['engine']}, {args.tokens:,} tokens, {args.busy} busy core(s)")
    if args.fake:
        print(f"  nominal:       {args.fake:,.0f} tok/s")
    print(f"  engine alone:  {alone.decode_tok_s:,.0f} tok/s ({alone.generated_tokens:,} tokens)")
    print(f"  chat shows:    {result['chat_shows_tok_s']:,.0f} tok/s "
          f"({result['chat_over_alone']:.1%} of the engine alone)  [{summary}]")


if __name__ == "__main__":
    main()
