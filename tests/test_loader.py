"""Opening a model directory: the tokenizer checked against the config, loaded now or on a
thread of its own while the engine is built."""

from __future__ import annotations

import shutil

import pytest

from qwenchat.errors import ModelError
from qwenchat.model.loader import open_model_dir


@pytest.fixture
def broken_tokenizer_dir(tiny_model_dir, tmp_path):
    """The tiny model with a tokenizer.json cut short."""
    directory = tmp_path / "m"
    shutil.copytree(tiny_model_dir, directory)
    path = directory / "tokenizer.json"
    path.write_text(path.read_text()[:100])
    return directory


def test_a_broken_tokenizer_is_refused_when_opened(broken_tokenizer_dir):
    with pytest.raises(ModelError, match=r"not a valid tokenizer\.json"):
        open_model_dir(broken_tokenizer_dir)


def test_a_background_tokenizer_raises_the_same_refusal_on_first_use(broken_tokenizer_dir):
    model = open_model_dir(broken_tokenizer_dir, tokenizer_in_background=True)
    assert model.checkpoint.weight_format == "bf16"  # config and checkpoint were opened
    with pytest.raises(ModelError, match=r"not a valid tokenizer\.json"):
        _ = model.tokenizer
    with pytest.raises(ModelError, match=r"not a valid tokenizer\.json"):
        _ = model.eos_ids


def test_a_background_tokenizer_is_the_one_loaded_in_the_foreground(tiny_model_dir):
    now = open_model_dir(tiny_model_dir)
    later = open_model_dir(tiny_model_dir, tokenizer_in_background=True)
    text = "Hello, world! 你好 😀"
    assert later.tokenizer.encode(text) == now.tokenizer.encode(text)
    assert later.eos_ids == now.eos_ids and now.eos_ids
