"""Our memory-mapped safetensors reader agrees with the format's reference implementation."""

from __future__ import annotations

import numpy as np
import pytest
from tiny_model import write_tiny_model

from qwenchat.model.checkpoint import Checkpoint, read_header
from qwenchat.model.config import Qwen3Config


@pytest.mark.parametrize("dtype", ["BF16", "F16", "F32"])
def test_headers_and_values_match_the_safetensors_package(tmp_path, tiny_tokenizer, dtype):
    safetensors = pytest.importorskip("safetensors")
    directory = write_tiny_model(tmp_path / dtype, dtype=dtype, tokenizer=tiny_tokenizer)
    path = directory / "model.safetensors"
    ours = read_header(path)
    checkpoint = Checkpoint(directory, Qwen3Config.from_file(directory / "config.json"))
    with safetensors.safe_open(str(path), framework="numpy") as reference:
        assert set(reference.keys()) == set(ours)
        for name in reference.keys():  # noqa: SIM118 (safe_open has no __iter__)
            spec = reference.get_slice(name)
            assert spec.get_dtype() == ours[name].dtype
            assert tuple(spec.get_shape()) == ours[name].shape
            if dtype != "BF16":  # NumPy has no bfloat16, so the package cannot load those
                np.testing.assert_array_equal(reference.get_tensor(name), checkpoint.raw(name))
