"""A trained Qwen3 test model: a benchmark aid run by hand (torch and transformers; on a GPU for
the real sizes), not by pytest.

Random weights leave logits nearly flat, so what a lossy choice costs (FP8, 4 bits, the int8
KV cache) or what speculation gains cannot be measured on them. This trains a small Qwen3 with
the real tokenizer, grouped-query attention and head_dim 64 (every kernel path takes it) on
text every machine has: the Python standard library's own sources, in a fixed order, every
twentieth file held out as the evaluation text. The corpus and the batches are fixed by the
Python (its standard library is the corpus) and the seed, and training stops after a fixed
number of steps; on a GPU the weights are not bit-reproducible (two H100 runs: held-out
perplexity 19.53 and 19.64), so measure a model in the session that trained it. The output is
a model directory in Hugging Face layout (bf16), with the held-out text and what the run was
(`training.json`: sizes, steps, loss, held-out perplexity, corpus digest); `qwenchat quantize
OUT OUT-fp8 --to fp8` gives Qwen's FP8 layout of it.

    python tests/train_test_model.py --tokenizer ../shared/fixtures/qwen3-tokenizer \\
        --size test --out /tmp/qwen3-test          # 90M parameters, ~2.5 min on an H100
    python tests/train_test_model.py ... --size draft --out /tmp/qwen3-test-draft
    python tests/train_test_model.py ... --size ci --out /tmp/qwen3-ci   # CPU, minutes

The `ci` size does not make a CPU test model: with the real vocabulary its tied 151,936-row
head is most of the work, and 60 steps took 4.5 minutes on the 2-core machine to a held-out
perplexity of 722 (qwenchat's reference engine gives transformers' logits on it within 7e-7),
so the CPU tests keep their tiny random models.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import shutil
import sys
import sysconfig
import time
from pathlib import Path

# hidden, layers, query heads, key/value heads, intermediate, steps, sequences a step, length
SIZES = {
    "test": dict(hidden=512, layers=4, heads=8, kv_heads=2, intermediate=1536, steps=1500,
                 batch=32, length=512, lr=2e-3),
    "draft": dict(hidden=256, layers=2, heads=4, kv_heads=1, intermediate=768, steps=3000,
                  batch=32, length=512, lr=3e-3),
    "ci": dict(hidden=128, layers=2, heads=2, kv_heads=1, intermediate=384, steps=60, batch=8,
               length=128, lr=5e-3),
}
HEAD_DIM = 64
QWEN3_VOCAB = 151_936  # the released models' embedding rows (the tokenizer uses 151,669)
HELD_OUT_EVERY = 20  # every twentieth source file is the evaluation text


def corpus() -> tuple[str, str, str]:
    """(training text, held-out text, digest): the standard library's .py files in name order,
    each preceded by its name."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in stdlib.rglob("*.py")
                   if "site-packages" not in p.parts and "test" not in p.parts)
    train, held = [], []
    digest = hashlib.sha256()
    for i, path in enumerate(files):
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        piece = f"# file: {path.relative_to(stdlib)}\n{text}\n"
        digest.update(piece.encode())
        (held if i % HELD_OUT_EVERY == 0 else train).append(piece)
    return "".join(train), "".join(held), digest.hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", type=Path, required=True,
                        help="the real Qwen3 tokenizer's directory")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--size", choices=sorted(SIZES), default="test")
    parser.add_argument("--steps", type=int, help="override the size's step count")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda if usable)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.out.exists():
        raise SystemExit(f"{args.out} exists; give a new directory")

    import torch
    from tokenizers import Tokenizer
    from transformers import Qwen3Config, Qwen3ForCausalLM

    size = dict(SIZES[args.size])
    if args.steps:
        size["steps"] = args.steps
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(args.seed)
    torch.use_deterministic_algorithms(True, warn_only=True)
    tokenizer = Tokenizer.from_file(str(args.tokenizer / "tokenizer.json"))
    train_text, held_text, digest = corpus()
    ids = torch.tensor(tokenizer.encode(train_text).ids, dtype=torch.long)
    held_ids = torch.tensor(tokenizer.encode(held_text).ids, dtype=torch.long)
    config = Qwen3Config(
        vocab_size=max(QWEN3_VOCAB, tokenizer.get_vocab_size(with_added_tokens=True)),
        hidden_size=size["hidden"], intermediate_size=size["intermediate"],
        num_hidden_layers=size["layers"], num_attention_heads=size["heads"],
        num_key_value_heads=size["kv_heads"], head_dim=HEAD_DIM, max_position_embeddings=4096,
        rope_theta=1_000_000.0, tie_word_embeddings=True, rms_norm_eps=1e-6,
        torch_dtype="bfloat16", bos_token_id=None, eos_token_id=151645)
    model = Qwen3ForCausalLM(config).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=size["lr"], betas=(0.9, 0.95),
                                  weight_decay=0.1)
    steps, batch, length = size["steps"], size["batch"], size["length"]
    warmup = max(1, steps // 20)

    def lr_at(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_at)
    generator = torch.Generator().manual_seed(args.seed)
    autocast = torch.autocast(device_type=device, dtype=torch.bfloat16, enabled=device == "cuda")
    started, loss_value = time.perf_counter(), float("nan")
    model.train()
    for step in range(steps):
        starts = torch.randint(0, len(ids) - length - 1, (batch,), generator=generator)
        x = torch.stack([ids[s : s + length] for s in starts.tolist()]).to(device)
        with autocast:
            loss = model(input_ids=x, labels=x).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        loss_value = float(loss)
        if step % max(1, steps // 20) == 0 or step == steps - 1:
            print(f"step {step + 1}/{steps}: loss {loss_value:.3f} "
                  f"({time.perf_counter() - started:.0f} s)", file=sys.stderr, flush=True)
    held_ppl = perplexity(model, held_ids, length, device, autocast)
    model = model.to(torch.bfloat16)
    args.out.mkdir(parents=True)
    model.save_pretrained(args.out, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (args.tokenizer / name).is_file():
            shutil.copy2(args.tokenizer / name, args.out / name)
    (args.out / "heldout.txt").write_text(held_text, encoding="utf-8")
    record = {"size": args.size, **size, "head_dim": HEAD_DIM, "seed": args.seed,
              "device": device, "torch": torch.__version__, "python": sys.version.split()[0],
              "corpus_sha256": digest, "train_tokens": len(ids), "heldout_tokens": len(held_ids),
              "final_loss": loss_value, "heldout_perplexity": held_ppl,
              "parameters": sum(p.numel() for p in model.parameters()),
              "seconds": time.perf_counter() - started}
    (args.out / "training.json").write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps(record, indent=1))


def perplexity(model, ids, length: int, device: str, autocast, most: int = 65536) -> float:
    """Perplexity of the held-out tokens in non-overlapping windows (the first `most`)."""
    import torch

    model.eval()
    total, count = 0.0, 0
    with torch.no_grad(), autocast:
        for begin in range(0, min(len(ids), most) - 1, length):
            x = ids[begin : begin + length + 1].to(device)
            if len(x) < 2:
                break
            logits = model(input_ids=x[None, :-1]).logits.float()
            nll = torch.nn.functional.cross_entropy(logits[0], x[1:], reduction="sum")
            total, count = total + float(nll), count + len(x) - 1
    model.train()
    return math.exp(total / count)


if __name__ == "__main__":
    main()
