"""Activation-aware 4-bit scales (`qwenchat quantize --calibrate`): never worse than rounding to
nearest on the calibration activations, better where a few input columns carry large ones,
the same function before rounding, and the same bytes run after run."""

from __future__ import annotations

import io

import numpy as np
import pytest
from tiny_model import write_tiny_model

from qwenchat.calibrate import CalibratedWeights, calibrate, search
from qwenchat.engine.reference import ReferenceEngine
from qwenchat.errors import UsageError
from qwenchat.model.loader import open_model_dir
from qwenchat.quantize import run_quantize

WIDE = dict(hidden_size=128, intermediate_size=256, num_attention_heads=2, head_dim=64,
            tie_word_embeddings=False)
CALIBRATION = ("Calibration text: the weights are scaled where the activations are large, "
               "then rounded to sixteen levels a group. " * 8)


@pytest.fixture(scope="module", params=[1, 2], ids=["gqa", "mha"])
def wide_model(request, tmp_path_factory, tiny_tokenizer):
    # (MHA: o_proj's scales fold into v_proj; with GQA that search is skipped)
    return write_tiny_model(tmp_path_factory.mktemp("wide") / "m", tokenizer=tiny_tokenizer,
                            num_key_value_heads=request.param, **WIDE)


def test_large_activation_columns_get_scaled_and_the_rounding_error_falls():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((256, 256)).astype(np.float32)
    x[:, :4] *= 40  # a few outlier channels, as trained models have
    weights = [rng.standard_normal((64, 256)).astype(np.float32) / 16 for _ in range(2)]
    found = search(x, weights)
    assert found.alpha > 0 and found.error < 0.8 * found.rtn_error
    assert found.scales[:4].min() > found.scales[4:].max()  # the outliers' columns grow


def test_without_outliers_it_is_never_worse_than_round_to_nearest():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((128, 256)).astype(np.float32)
    found = search(x, [rng.standard_normal((32, 256)).astype(np.float32)])
    assert found.error <= found.rtn_error


def test_the_scales_fold_into_the_model_without_changing_its_function(wide_model):
    model = open_model_dir(wide_model)
    ids = model.tokenizer.encode(CALIBRATION)
    calibration = calibrate(model.checkpoint, ids)
    config = model.config
    assert len(calibration.found) == config.num_hidden_layers * (
        4 if config.group_size == 1 else 3)
    assert all(f.error <= f.rtn_error for f in calibration.found.values())
    folded = CalibratedWeights(model.checkpoint, calibration)
    prompt = ids[:24]
    plain = ReferenceEngine(config, model.checkpoint).prefill_logits(prompt)
    scaled = ReferenceEngine(config, folded).prefill_logits(prompt)
    assert np.abs(scaled - plain).max() <= 1e-4 * np.abs(plain).max()


def test_a_calibrated_checkpoint_is_the_same_bytes_run_after_run_and_loads(wide_model,
                                                                          tmp_path):
    text = tmp_path / "calibration.txt"
    text.write_text(CALIBRATION, encoding="utf-8")
    written = []
    for run in ("a", "b"):
        err = io.StringIO()
        assert run_quantize(str(wide_model), tmp_path / run, "int4", err, text, 64) == 0
        assert "calibrated on 64 tokens" in err.getvalue()
        written.append((tmp_path / run / "model.safetensors").read_bytes())
    assert written[0] == written[1]
    plain = tmp_path / "plain"
    run_quantize(str(wide_model), plain, "int4", io.StringIO())
    assert (plain / "model.safetensors").read_bytes() != written[0]
    model = open_model_dir(tmp_path / "a")
    assert model.checkpoint.weight_format == "awq"
    logits = ReferenceEngine(model.config, model.checkpoint).prefill_logits([5, 9, 200])
    assert np.isfinite(logits).all()


def test_calibration_flags_it_cannot_use_are_one_line(wide_model, tmp_path):
    text = tmp_path / "calibration.txt"
    text.write_text(CALIBRATION, encoding="utf-8")
    with pytest.raises(UsageError, match="--calibrate chooses 4-bit scales: it goes with "
                                         "--to int4"):
        run_quantize(str(wide_model), tmp_path / "a", "fp8", io.StringIO(), text)
    with pytest.raises(UsageError, match=r"--calibrate .*nope\.txt: no such file"):
        run_quantize(str(wide_model), tmp_path / "b", "int4", io.StringIO(),
                     tmp_path / "nope.txt")
    assert not any(tmp_path.glob("a*")) and not any(tmp_path.glob("b*"))
