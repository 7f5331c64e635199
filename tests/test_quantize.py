"""`qwenchat quantize`: a checkpoint written in 4 bits or FP8 runs as `--quantize` runs the
original, bit for bit, and a bad target, source or output directory is one line."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
from tiny_model import write_tiny_model, write_tiny_moe_model

from qwenchat.engine import create_engine
from qwenchat.errors import UsageError
from qwenchat.model import awq, fp8
from qwenchat.model.formats import is_linear
from qwenchat.model.loader import open_model_dir
from qwenchat.quantize import run_quantize

# Every linear layer's inputs whole groups of 128 (int4's groups; FP8's blocks too).
WIDE = dict(hidden_size=128, intermediate_size=256, num_attention_heads=2,
            num_key_value_heads=1, head_dim=64, tie_word_embeddings=False)
PROMPT = [5, 17, 99, 3, 250, 41, 7, 7, 300, 12]


# A mixture of experts as wide (its experts' down projections too), a dense layer among them.
WIDE_MOE = dict(WIDE, num_hidden_layers=3, num_experts=3, num_experts_per_tok=2,
                moe_intermediate_size=128, norm_topk_prob=True, mlp_only_layers=[1])


@pytest.fixture(scope="module")
def wide_model(tmp_path_factory, tiny_tokenizer):
    return write_tiny_model(tmp_path_factory.mktemp("wide") / "m", tokenizer=tiny_tokenizer,
                            **WIDE)


@pytest.fixture(scope="module")
def wide_moe_model(tmp_path_factory, tiny_tokenizer):
    return write_tiny_moe_model(tmp_path_factory.mktemp("wide-moe") / "m",
                                tokenizer=tiny_tokenizer, **WIDE_MOE)


def logits(directory, quantize="none") -> np.ndarray:
    model = open_model_dir(directory)
    engine = create_engine("cpu", model.config, model.checkpoint, quantize=quantize)
    return engine.prefill_logits(PROMPT)


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
@pytest.mark.parametrize(("to", "fmt"), [("int4", "awq"), ("fp8", "fp8")])
def test_the_written_checkpoint_runs_bit_for_bit_as_quantize_at_load_time(request, tmp_path,
                                                                          to, fmt, moe):
    # A mixture of experts: its experts narrow as the published FP8 and AWQ releases hold
    # them, its router in the checkpoint's own dtype.
    wide_model = request.getfixturevalue("wide_moe_model" if moe else "wide_model")
    out = tmp_path / f"model-{to}"
    err = io.StringIO()
    assert run_quantize(str(wide_model), out, to, err) == 0
    assert err.getvalue().startswith(f"qwenchat: wrote {out}: {to} (")
    written, source = open_model_dir(out), open_model_dir(wide_model)
    assert written.checkpoint.weight_format == fmt and written.config.quantization == fmt
    np.testing.assert_array_equal(logits(out), logits(wide_model, quantize=to))
    for name, entry in source.checkpoint.entries.items():
        if is_linear(name):
            ours = (written.checkpoint.awq_groups(name) if to == "int4"
                    else written.checkpoint.fp8_blocks(name))
            made = (awq.quantize(source.checkpoint.float32(name)) if to == "int4"
                    else fp8.quantize(source.checkpoint.float32(name)))
            for a, b in zip(ours, made, strict=True):
                np.testing.assert_array_equal(a, b)
        else:  # norms, embedding, LM head, a router: the same bytes
            assert written.checkpoint.entries[name].dtype == entry.dtype
            np.testing.assert_array_equal(written.checkpoint.raw(name),
                                          source.checkpoint.raw(name))
    experts = [n for n in source.checkpoint.config.tensor_shapes() if ".mlp.experts." in n]
    assert all(is_linear(n) for n in experts) and len(experts) == (2 * 3 * 3 if moe else 0)
    assert ("model.layers.0.mlp.gate.weight" in written.checkpoint.entries) == moe
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == fmt
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (out / name).read_bytes() == (wide_model / name).read_bytes()


def test_the_output_is_smaller_by_what_the_format_saves(wide_model, tmp_path):
    sizes = {}
    for to in ("int4", "fp8"):
        run_quantize(str(wide_model), tmp_path / to, to, io.StringIO())
        sizes[to] = (tmp_path / to / "model.safetensors").stat().st_size
    original = (wide_model / "model.safetensors").stat().st_size
    assert sizes["int4"] < sizes["fp8"] < original


def test_an_existing_output_directory_is_never_written_over(wide_model, tmp_path):
    out = tmp_path / "taken"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(UsageError, match="already exists and is not an empty directory; "
                                         "qwenchat never writes over files"):
        run_quantize(str(wide_model), out, "int4", io.StringIO())
    assert (out / "notes.txt").read_text() == "mine"
    empty = tmp_path / "empty"
    empty.mkdir()
    assert run_quantize(str(wide_model), empty, "int4", io.StringIO()) == 0


def test_an_interrupted_run_leaves_nothing_behind(wide_model, tmp_path, monkeypatch):
    import qwenchat.quantize as quantize

    real = quantize.write_safetensors

    def interrupted(path, tensors, before_each):
        def each(tensor):
            if tensor.name.endswith("down_proj.qweight"):
                raise KeyboardInterrupt
            before_each(tensor)
        real(path, tensors, each)

    monkeypatch.setattr(quantize, "write_safetensors", interrupted)
    with pytest.raises(KeyboardInterrupt):
        run_quantize(str(wide_model), tmp_path / "out", "int4", io.StringIO())
    assert list(tmp_path.iterdir()) == []


def test_sources_and_targets_it_cannot_make_are_one_line(wide_model, tiny_model_dir, tmp_path):
    with pytest.raises(UsageError, match="--to must be one of int4, fp8; got 'int8'"):
        run_quantize(str(wide_model), tmp_path / "a", "int8", io.StringIO())
    with pytest.raises(UsageError, match="--to int4 needs every linear layer's inputs in whole "
                                         "groups of 128 columns; this model's hidden_size"):
        run_quantize(str(tiny_model_dir), tmp_path / "b", "int4", io.StringIO())
    run_quantize(str(wide_model), tmp_path / "c", "fp8", io.StringIO())
    with pytest.raises(UsageError, match=r"is already quantized \(fp8\); quantize a bf16"):
        run_quantize(str(tmp_path / "c"), tmp_path / "d", "int4", io.StringIO())
    with pytest.raises(UsageError, match="no such directory to write"):
        run_quantize(str(wide_model), tmp_path / "no" / "where", "fp8", io.StringIO())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]
