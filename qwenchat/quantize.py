"""`qwenchat quantize`: a checkpoint's linear layers in 4 bits (AutoAWQ's layout, as Qwen's AWQ
releases have it) or FP8 (Qwen's 128 x 128 blocks), written once as a checkpoint that qwenchat,
and other engines that read those layouts, load as it is: the same codes `--quantize` makes at
every start, so the written model runs bit for bit as `--quantize` would run the original.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import TextIO

import numpy as np

from qwenchat.errors import ModelError, UsageError
from qwenchat.model import awq, fp8
from qwenchat.model.checkpoint import TensorOut, write_safetensors
from qwenchat.model.floats import f32_to_bf16_bits
from qwenchat.model.formats import is_linear
from qwenchat.model.loader import open_model
from qwenchat.progress import progress_bar

TARGETS = ("int4", "fp8")
AWQ_CONFIG = {"quant_method": "awq", "bits": awq.BITS, "group_size": awq.GROUP,
              "zero_point": True, "version": "gemm", "modules_to_not_convert": None}
FP8_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
              "weight_block_size": [fp8.BLOCK, fp8.BLOCK]}
# Files beside the weights that a model directory carries over as they are.
COPIED = ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "vocab.json",
          "merges.txt", "special_tokens_map.json", "added_tokens.json", "chat_template.jinja")


def check_out(out: Path) -> None:
    """OUT is a new directory (or an empty one): nothing is ever overwritten."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UsageError(f"{out} already exists and is not an empty directory; qwenchat never "
                         "writes over files: choose a new directory")
    if not out.parent.is_dir():
        raise UsageError(f"{out.parent}: no such directory to write {out.name} in")


def linear_tensors(name: str, shape: tuple[int, ...], to: str, float32) -> list[TensorOut]:
    """A linear layer's tensors in the target layout, made when written."""
    module = name.removesuffix(".weight")
    out_features, in_features = shape
    if to == "fp8":
        made: dict[str, np.ndarray] = {}

        def part(which: int):
            def data() -> bytes:
                if not made:
                    made["codes"], made["scales"] = fp8.quantize(float32(name))
                array = made.pop("codes" if which == 0 else "scales")
                return np.ascontiguousarray(array).tobytes()
            return data

        rows, cols = fp8.scale_shape(shape)
        return [TensorOut(name, "F8_E4M3", shape, out_features * in_features, part(0)),
                TensorOut(f"{module}.weight{fp8.SCALE_SUFFIX}", "F32", (rows, cols),
                          rows * cols * 4, part(1))]
    groups: dict[str, np.ndarray] = {}
    shapes = awq.packed_shapes(out_features, in_features)

    def piece(suffix: str):
        def data() -> bytes:
            if not groups:
                groups.update(zip(awq.SUFFIXES, awq.quantize(float32(name)), strict=True))
            return np.ascontiguousarray(groups.pop(suffix)).tobytes()
        return data

    return [TensorOut(f"{module}.{suffix}", "F16" if suffix == "scales" else "I32",
                      shapes[suffix], math.prod(shapes[suffix]) * (2 if suffix == "scales" else 4),
                      piece(suffix))
            for suffix in awq.SUFFIXES]


def encode(array: np.ndarray, dtype: str) -> bytes:
    """float32 values as a tensor of `dtype` (BF16, F16 or F32)."""
    if dtype == "BF16":
        return f32_to_bf16_bits(array).tobytes()
    return np.ascontiguousarray(array, np.float16 if dtype == "F16" else np.float32).tobytes()


def run_quantize(model_spec: str, out: Path, to: str, err: TextIO = sys.stderr,
                 calibrate_file: Path | None = None, calibrate_tokens: int = 512) -> int:
    if to not in TARGETS:
        raise UsageError(f"--to must be one of {', '.join(TARGETS)}; got {to!r}")
    if calibrate_file is not None:
        if to != "int4":
            raise UsageError("--calibrate chooses 4-bit scales: it goes with --to int4")
        if not calibrate_file.is_file():
            raise UsageError(f"--calibrate {calibrate_file}: no such file; give a text file or "
                             "a .jsonl of chats")
        if calibrate_tokens < 2:
            raise UsageError(f"--calibrate-tokens must be at least 2; got {calibrate_tokens}")
    out = out.expanduser()
    check_out(out)
    model = open_model(model_spec)
    checkpoint, config = model.checkpoint, model.config
    fmt = checkpoint.weight_format
    if fmt in ("fp8", "awq"):
        raise UsageError(f"{model_spec} is already quantized ({fmt}); quantize a bf16, f16 or "
                         "f32 checkpoint")
    if to == "int4":
        try:
            awq.check_int4_shape(config)
        except ModelError as exc:
            raise UsageError(str(exc).replace("--quantize int4", "--to int4")) from None
    source, note = checkpoint, ""
    if calibrate_file is not None:
        from qwenchat.calibrate import CalibratedWeights, calibrate
        from qwenchat.eval import read_documents

        ids = [t for document in read_documents(calibrate_file, model.tokenizer)
               for t in document][:calibrate_tokens]
        err.write(f"qwenchat: calibrating on {len(ids):,} tokens of {calibrate_file} (the "
                  "reference engine, on the CPU)\n")
        calibration = calibrate(checkpoint, ids)
        source = CalibratedWeights(checkpoint, calibration)
        found = list(calibration.found.values())
        gain = np.mean([1 - f.error / f.rtn_error for f in found if f.rtn_error > 0])
        note = (f"; calibrated on {len(ids):,} tokens: the rounded weights' output error "
                f"{100 * gain:.1f}% below round-to-nearest's there (mean of {len(found)} groups)")
    tensors: list[TensorOut] = []
    for name, entry in sorted(checkpoint.entries.items()):
        if is_linear(name):
            tensors += linear_tensors(name, entry.shape, to, source.float32)
        elif source is not checkpoint and source.changes(name):  # a norm a scale folded into
            tensors.append(TensorOut(name, entry.dtype, entry.shape, entry.nbytes,
                                     lambda name=name, kind=entry.dtype:
                                         encode(source.float32(name), kind)))
        else:
            tensors.append(TensorOut(name, entry.dtype, entry.shape, entry.nbytes,
                                     lambda name=name: checkpoint.raw(name).tobytes()))
    raw = json.loads((model.directory / "config.json").read_text(encoding="utf-8"))
    raw["quantization_config"] = AWQ_CONFIG if to == "int4" else FP8_CONFIG
    started = time.perf_counter()
    # Written beside OUT and renamed into place at the end: an interrupted run leaves nothing.
    partial = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    umask = os.umask(0)
    os.umask(umask)
    partial.chmod(0o777 & ~umask)  # (mkdtemp's 0700 is for the temporary name only)
    try:
        with progress_bar(err, "writing", sum(t.nbytes for t in tensors), in_bytes=True) as bar:
            write_safetensors(partial / "model.safetensors", tensors,
                              lambda tensor: bar(tensor.nbytes))
        (partial / "config.json").write_text(json.dumps(raw, indent=2) + "\n", encoding="utf-8")
        for name in COPIED:
            if (model.directory / name).is_file():
                shutil.copy2(model.directory / name, partial / name)
        if out.exists():
            out.rmdir()  # (empty: check_out)
        os.replace(partial, out)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    finally:
        model.close()
    before = sum(e.nbytes for e in checkpoint.entries.values())
    after = sum(t.nbytes for t in tensors)
    layout = "AWQ's 4-bit layout" if to == "int4" else "Qwen's FP8 blocks"
    err.write(f"qwenchat: wrote {out}: {to} ({layout}), {_size(after)} from {_size(before)}, "
              f"in {time.perf_counter() - started:.1f} s{note}\n")
    return 0


def _size(nbytes: int) -> str:
    return f"{nbytes / 1e9:.2f} GB" if nbytes >= 1e8 else f"{nbytes / 1e6:.2f} MB"
