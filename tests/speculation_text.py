"""Speculative decoding on real text: a benchmark aid (CUDA; `--backend cpu` to try it), not a
test.

On a trained model (tests/train_test_model.py) and its held-out text, greedy continuations of
`--prompts` passages (each `--prompt-tokens` long, begun at a line start) decoded three ways:
plainly, with prompt lookup (`--speculate ngram`) and with a draft model (`--draft`, the
`draft` size of the same script); then a prompt that quotes its input (a passage of code, and
its first lines again: the continuation copies it, as a code-editing reply does). For each: the
decode rate (tokens after the first over the time from the first to the last, as `bench`
times it), the target's passes, the share of proposed tokens kept and the tokens kept a reply.
Every speculative reply must be the plain one token for token (greedy), or part from it only at
a near-tie of plain decoding's two best logits (printed), or the script stops.

    python tests/speculation_text.py --model /tmp/qt --draft /tmp/qt-draft \\
        --text /tmp/qt/heldout.txt --prompts 16

Issue 40, item 6: acceptance and speed against plain decoding on held-out continuations and on
a prompt that quotes its input.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from qwenchat.engine import create_engine
from qwenchat.engine.base import GenerateRequest
from qwenchat.engine.speculate import SPECULATE_MOST, DraftProposer
from qwenchat.model.loader import open_model
from qwenchat.sampling.params import LiveParams, SamplingParams


@dataclass
class Run:
    tokens: list[int]
    tok_s: float
    passes: int
    proposed: int
    accepted: int


def decode(engine, prompt: list[int], tokens: int, speculate: int, proposer) -> Run:
    engine.truncate(0)
    engine.prefill(prompt)
    request = GenerateRequest(LiveParams(SamplingParams(temperature=0.0, max_tokens=tokens)),
                              frozenset(), seed=0, speculate=speculate, proposer=proposer)
    out, first = [], None
    for token in engine.generate(request):
        out.append(token)
        if first is None:
            first = time.perf_counter()
    last = time.perf_counter()
    spec = engine.speculation
    rate = (len(out) - 1) / (last - first) if len(out) > 1 and last > first else 0.0
    return Run(out, rate, spec.passes, spec.proposed, spec.accepted)


# A speculative reply may part from the plain one only where plain decoding's two best logits
# are this close (relative to the largest): the verify pass sums in another order than a step
NEAR_TIE = 2e-3


def near_tie(engine, prompt: list[int], plain: list[int], other: list[int], way: str) -> None:
    """Where `other` first parts from `plain`, say how close plain's two best logits were
    there: a near-tie is printed and the run goes on; a real gap stops the script."""
    at = next((i for i, (a, b) in enumerate(zip(plain, other, strict=False)) if a != b),
              min(len(plain), len(other)))
    engine.truncate(0)
    engine.prefill(prompt + plain[:at])
    logits = engine.last_logits()
    second, first = sorted(logits)[-2:]
    gap = float(first - second) / float(abs(logits).max())
    line = (f"{way} parted from plain decoding at token {at}: plain's two best logits "
            f"{gap:.1e} apart (of the largest)")
    if gap > NEAR_TIE:
        raise SystemExit(f"{line}, not a near-tie")
    print(f"  ({line}: a near-tie; the figures stand)")


def passages(ids: list[int], newline_ids: set[int], count: int, length: int) -> list[list[int]]:
    """`count` prompts of `length` tokens spread over `ids`, each begun after a newline."""
    prompts = []
    for k in range(count):
        at = (len(ids) - length - 1) * k // max(1, count)
        while at < len(ids) - length and ids[at] not in newline_ids:
            at += 1
        prompts.append(ids[at + 1 : at + 1 + length])
    return prompts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--draft", required=True)
    parser.add_argument("--text", type=Path, required=True)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--backend", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--dump", type=Path,
                        help="write each prompt's text here (prompt_N.txt), for other engines")
    args = parser.parse_args()
    model, draft = open_model(args.model), open_model(args.draft)
    ctx = args.prompt_tokens * 3 + args.tokens + 16
    say = lambda line: print(f"  ({line})", file=sys.stderr)  # noqa: E731
    engine = create_engine(args.backend, model.config, model.checkpoint, ctx, notice=say)
    draft_engine = create_engine(args.backend, draft.config, draft.checkpoint, ctx, notice=say)
    tokenizer = model.tokenizer
    ids = tokenizer.encode(args.text.read_text(encoding="utf-8"))
    newlines = {i for i in range(tokenizer.vocab_size)
                if (tokenizer.id_to_token(i) or "").endswith("Ċ")}  # byte-level "\n"
    held_out = passages(ids, newlines, args.prompts, args.prompt_tokens)
    # The quoting prompt: a passage, two newlines, then its first 16 tokens again.
    code = passages(ids, newlines, 3, args.prompt_tokens)[1]
    quoting = [*code, *tokenizer.encode("\n\n"), *code[:16]]
    if args.dump:
        args.dump.mkdir(parents=True, exist_ok=True)
        for n, prompt in enumerate([*held_out, quoting]):
            args.dump.joinpath(f"prompt_{n}.txt").write_text(
                tokenizer.decode(prompt, skip_special_tokens=False), encoding="utf-8")
    ways = {"plain": (0, None), "ngram": (SPECULATE_MOST, None),
            "draft": (SPECULATE_MOST, DraftProposer(draft_engine, model.config.vocab_size))}
    try:
        decode(engine, held_out[0], 16, 0, None)  # (warm: every kernel compiled and loaded)
        for label, prompts in (("held-out continuations", held_out),
                               ("a prompt that quotes its input", [quoting])):
            runs: dict[str, list[Run]] = {way: [] for way in ways}
            for prompt in prompts:
                for way, (most, proposer) in ways.items():
                    runs[way].append(decode(engine, prompt, args.tokens, most, proposer))
                plain = runs["plain"][-1].tokens
                for way in ("ngram", "draft"):
                    if runs[way][-1].tokens != plain:
                        near_tie(engine, prompt, plain, runs[way][-1].tokens, way)
            print(f"{label} ({len(prompts)} prompt{'s' if len(prompts) > 1 else ''} of "
                  f"{len(prompts[0])} tokens, {args.tokens} generated, greedy):")
            base = statistics.median(r.tok_s for r in runs["plain"])
            for way, done in runs.items():
                rate = statistics.median(r.tok_s for r in done)
                proposed = sum(r.proposed for r in done)
                kept = sum(r.accepted for r in done) / proposed if proposed else 0.0
                passes = sum(r.passes for r in done) / len(done)
                accepted = sum(r.accepted for r in done) / len(done)
                print(f"  {way:5}: {rate:9,.1f} tok/s (median) {rate / base:5.2f}x plain · "
                      f"{passes:5.1f} passes a reply · {kept:6.1%} of {proposed:,} proposed "
                      f"tokens kept · {accepted:5.1f} kept a reply")
    finally:
        engine.close()
        draft_engine.close()


if __name__ == "__main__":
    main()
