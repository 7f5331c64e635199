"""Safetensors checkpoints: every on-disk dtype and layout reads back the values written, and
every broken file is refused with one line that names the file and the tensor."""

from __future__ import annotations

import json
import mmap
import os
import re
import shutil
import struct
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from tiny_model import random_tensors, write_safetensors, write_tiny_model

from qwenchat.errors import ModelError
from qwenchat.model.checkpoint import (
    INDEX_FILE,
    SINGLE_FILE,
    Checkpoint,
    bf16_bits_to_f32,
    f32_to_bf16_bits,
)
from qwenchat.model.config import Qwen3Config

SEED = 7
MISSING = "model.layers.1.mlp.up_proj.weight"


def bf16_rounded(array: np.ndarray) -> np.ndarray:
    return bf16_bits_to_f32(f32_to_bf16_bits(array))


ROUNDING: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "BF16": bf16_rounded,
    "F16": lambda a: a.astype(np.float16).astype(np.float32),
    "F32": lambda a: a,
}
RAW_DTYPE = {"BF16": np.uint16, "F16": np.float16, "F32": np.float32}


def config_of(directory: Path) -> Qwen3Config:
    return Qwen3Config.from_file(directory / "config.json")


def originals(directory: Path) -> dict[str, np.ndarray]:
    """The float32 arrays write_tiny_model rounded onto disk (same config, same seed)."""
    return random_tensors(config_of(directory), SEED)


def open_checkpoint(directory: Path) -> Checkpoint:
    return Checkpoint(directory, config_of(directory))


def refusal(directory: Path) -> str:
    with pytest.raises(ModelError) as caught:
        open_checkpoint(directory)
    return str(caught.value)


def assert_names_file(message: str, path: Path) -> None:
    """The whole path is named: not merely a prefix of it (model.safetensors.index.json)."""
    assert re.search(re.escape(str(path)) + r"(?![\w.-])", message), (str(path), message)


def read_parts(path: Path) -> tuple[dict, bytes]:
    blob = path.read_bytes()
    (length,) = struct.unpack("<Q", blob[:8])
    return json.loads(blob[8 : 8 + length]), blob[8 + length :]


def write_parts(path: Path, header: dict, data: bytes) -> None:
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)
    path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + data)


@pytest.fixture(scope="module", params=["BF16", "F16", "F32"])
def dtype_model_dir(request, tmp_path_factory, tiny_tokenizer) -> tuple[str, Path]:
    dtype = request.param
    directory = tmp_path_factory.mktemp(f"ckpt-{dtype}") / "model"
    write_tiny_model(directory, dtype=dtype, seed=SEED, tokenizer=tiny_tokenizer)
    return dtype, directory


@pytest.fixture
def model_dir(tmp_path, tiny_tokenizer) -> Path:
    """A fresh single-file bf16 model this test may break."""
    return write_tiny_model(tmp_path / "model", seed=SEED, tokenizer=tiny_tokenizer)


@pytest.fixture
def sharded_dir(tmp_path, tiny_tokenizer) -> Path:
    return write_tiny_model(tmp_path / "sharded", shards=3, seed=SEED, tokenizer=tiny_tokenizer)


# --- reading ---------------------------------------------------------------------------------


def test_checkpoint_reads_back_the_written_values_rounded_to_its_disk_dtype(dtype_model_dir):
    dtype, directory = dtype_model_dir
    checkpoint = open_checkpoint(directory)
    for name, original in originals(directory).items():
        got = checkpoint.float32(name)
        assert got.dtype == np.float32
        np.testing.assert_array_equal(got, ROUNDING[dtype](original), err_msg=name)
    checkpoint.close()


def test_raw_has_the_disk_dtype_and_the_config_shape(dtype_model_dir):
    dtype, directory = dtype_model_dir
    checkpoint = open_checkpoint(directory)
    for name, shape in checkpoint.config.tensor_shapes().items():
        assert checkpoint.dtype(name) == dtype
        raw = checkpoint.raw(name)
        assert (raw.dtype, raw.shape) == (np.dtype(RAW_DTYPE[dtype]), shape)
    del raw  # a live view keeps the mapping open
    checkpoint.close()


def test_bf16_bits_are_the_disk_values_rounded_to_bf16(dtype_model_dir):
    dtype, directory = dtype_model_dir
    checkpoint = open_checkpoint(directory)
    for name, original in originals(directory).items():
        expected = f32_to_bf16_bits(ROUNDING[dtype](original))
        np.testing.assert_array_equal(checkpoint.bf16_bits(name), expected, err_msg=name)
    checkpoint.close()


def test_sharded_checkpoint_reads_the_same_values_as_a_single_file(model_dir, sharded_dir):
    assert (sharded_dir / INDEX_FILE).is_file()
    assert not (sharded_dir / SINGLE_FILE).exists()
    single, sharded = open_checkpoint(model_dir), open_checkpoint(sharded_dir)
    assert len(sharded.files) == 3
    assert sharded.entries.keys() == single.entries.keys()
    for name in single.entries:
        np.testing.assert_array_equal(sharded.raw(name), single.raw(name), err_msg=name)
    single.close()
    sharded.close()


def test_raw_is_a_view_into_the_memory_mapped_file(model_dir):
    checkpoint = open_checkpoint(model_dir)
    name = "model.embed_tokens.weight"
    raw = checkpoint.raw(name)
    assert not raw.flags.owndata
    assert not raw.flags.writeable
    base = raw
    while isinstance(base, np.ndarray):
        base = base.base
    if isinstance(base, memoryview):
        base = base.obj
    assert isinstance(base, mmap.mmap)
    assert np.shares_memory(raw, checkpoint.raw(name))
    del raw
    checkpoint.close()


def test_untied_checkpoint_reads_its_own_lm_head(tmp_path, tiny_tokenizer):
    directory = write_tiny_model(tmp_path / "untied", seed=SEED, tokenizer=tiny_tokenizer,
                                 tie_word_embeddings=False)
    checkpoint = open_checkpoint(directory)
    assert checkpoint.lm_head_name() == "lm_head.weight"
    expected = bf16_rounded(originals(directory)["lm_head.weight"])
    np.testing.assert_array_equal(checkpoint.float32("lm_head.weight"), expected)
    checkpoint.close()


def test_tied_checkpoint_uses_the_embedding_as_lm_head(model_dir):
    checkpoint = open_checkpoint(model_dir)
    assert checkpoint.lm_head_name() == "model.embed_tokens.weight"
    checkpoint.close()


# --- bfloat16 rounding -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("f32_bits", "bf16_bits"),
    [
        (0x3F800000, 0x3F80),  # 1.0 is exact
        (0x3F807FFF, 0x3F80),  # just below half an ulp: down
        (0x3F808001, 0x3F81),  # just above half an ulp: up
        (0x3F808000, 0x3F80),  # tie, even neighbour below: down
        (0x3F818000, 0x3F82),  # tie, odd neighbour below: up to the even one
        (0xBF818000, 0xBF82),  # same tie, negative
        (0x3F80FFFF, 0x3F81),  # carries into the next mantissa value
        (0x7F7FFFFF, 0x7F80),  # largest float32 rounds to +inf, as IEEE round-to-nearest does
        (0xFF800000, 0xFF80),  # -inf stays -inf
        (0x00000001, 0x0000),  # smallest subnormal rounds to zero
    ],
)
def test_f32_to_bf16_rounds_to_nearest_even(f32_bits, bf16_bits):
    value = np.array([f32_bits], dtype=np.uint32).view(np.float32)
    assert int(f32_to_bf16_bits(value)[0]) == bf16_bits


def test_f32_to_bf16_maps_every_nan_to_a_nan():
    # 0x7F800001 and 0x7FFFFFFF would round (or carry) into +inf or wrap without special care.
    patterns = np.array([0x7FC00000, 0x7F800001, 0x7FFFFFFF, 0xFFFFFFFF, 0xFF800001],
                        dtype=np.uint32)
    bits = f32_to_bf16_bits(patterns.view(np.float32))
    assert bits.dtype == np.uint16
    assert np.isnan(bf16_bits_to_f32(bits)).all()


def test_every_bf16_value_survives_a_round_trip_through_float32():
    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    values = bf16_bits_to_f32(bits)
    finite = ~np.isnan(values)
    np.testing.assert_array_equal(f32_to_bf16_bits(values)[finite], bits[finite])


# --- refusals --------------------------------------------------------------------------------


def test_missing_tensor_is_refused_naming_file_and_tensor(model_dir):
    tensors = originals(model_dir)
    del tensors[MISSING]
    write_safetensors(model_dir / SINGLE_FILE, tensors, "BF16")
    message = refusal(model_dir)
    assert_names_file(message, model_dir / SINGLE_FILE)
    assert MISSING in message


def test_misshaped_tensor_is_refused_naming_file_tensor_and_shapes(model_dir):
    path = model_dir / SINGLE_FILE
    header, data = read_parts(path)
    name = "model.layers.0.mlp.gate_proj.weight"  # (96, 64); same bytes if transposed
    header[name]["shape"] = header[name]["shape"][::-1]
    write_parts(path, header, data)
    message = refusal(model_dir)
    assert_names_file(message, path)
    assert name in message
    assert "[64, 96]" in message and "[96, 64]" in message


def test_truncated_file_is_refused_naming_file_and_last_tensor(model_dir):
    path = model_dir / SINGLE_FILE
    header, _ = read_parts(path)
    last = list(header)[-1]
    os.truncate(path, path.stat().st_size - 6)
    message = refusal(model_dir)
    assert_names_file(message, path)
    assert last in message
    assert "truncated" in message


def test_file_shorter_than_the_header_length_field_is_refused(model_dir):
    path = model_dir / SINGLE_FILE
    path.write_bytes(b"\x10\x00")
    message = refusal(model_dir)
    assert_names_file(message, path)
    assert "truncated" in message


def test_header_length_beyond_the_end_of_file_is_refused_naming_file(model_dir):
    path = model_dir / SINGLE_FILE
    blob = bytearray(path.read_bytes())
    blob[:8] = struct.pack("<Q", len(blob) * 2)
    path.write_bytes(bytes(blob))
    message = refusal(model_dir)
    assert_names_file(message, path)
    assert str(len(blob) * 2) in message


def test_header_that_is_not_json_is_refused_naming_file(model_dir):
    path = model_dir / SINGLE_FILE
    blob = bytearray(path.read_bytes())
    (length,) = struct.unpack("<Q", blob[:8])
    blob[8 : 8 + length] = b"{ not json".ljust(length, b"#")
    path.write_bytes(bytes(blob))
    message = refusal(model_dir)
    assert_names_file(message, path)
    assert "header" in message


def test_header_that_is_a_json_list_is_refused_naming_file(model_dir):
    path = model_dir / SINGLE_FILE
    _, data = read_parts(path)
    write_parts(path, [], data)  # type: ignore[arg-type]
    assert_names_file(refusal(model_dir), path)


def test_unsupported_dtype_is_refused_naming_file_tensor_and_dtype(model_dir):
    path = model_dir / SINGLE_FILE
    header, data = read_parts(path)
    name = "model.layers.0.input_layernorm.weight"
    header[name]["dtype"] = "I8"
    write_parts(path, header, data)
    message = refusal(model_dir)
    assert_names_file(message, path)
    assert name in message
    assert "I8" in message


def test_byte_range_that_disagrees_with_shape_and_dtype_is_refused(model_dir):
    path = model_dir / SINGLE_FILE
    header, data = read_parts(path)
    name = "model.layers.1.self_attn.k_norm.weight"  # 16 bf16 values = 32 bytes
    header[name]["data_offsets"][1] -= 2
    write_parts(path, header, data)
    message = refusal(model_dir)
    assert_names_file(message, path)
    assert name in message
    assert "30" in message and "32" in message


def test_malformed_header_entry_is_refused_naming_file_and_tensor(model_dir):
    path = model_dir / SINGLE_FILE
    header, data = read_parts(path)
    name = "model.norm.weight"
    del header[name]["data_offsets"]
    write_parts(path, header, data)
    message = refusal(model_dir)
    assert_names_file(message, path)
    assert name in message


def test_untied_config_without_lm_head_is_refused_naming_lm_head(model_dir):
    raw = json.loads((model_dir / "config.json").read_text())
    raw["tie_word_embeddings"] = False
    (model_dir / "config.json").write_text(json.dumps(raw))
    message = refusal(model_dir)
    assert_names_file(message, model_dir / SINGLE_FILE)
    assert "lm_head.weight" in message


def test_missing_shard_is_refused_naming_the_shard(sharded_dir):
    shard = sharded_dir / "model-00002-of-00003.safetensors"
    shard.unlink()
    assert_names_file(refusal(sharded_dir), shard)


def test_tensor_listed_in_the_index_but_absent_from_its_shard_is_refused(sharded_dir):
    index = json.loads((sharded_dir / INDEX_FILE).read_text())
    shard_name = index["weight_map"][MISSING]
    shard = sharded_dir / shard_name
    header, _ = read_parts(shard)
    tensors = {n: random_tensors(config_of(sharded_dir), SEED)[n] for n in header
               if n not in ("__metadata__", MISSING)}
    write_safetensors(shard, tensors, "BF16")
    message = refusal(sharded_dir)
    assert_names_file(message, shard)
    assert MISSING in message


def test_sharded_checkpoint_missing_a_tensor_is_refused_naming_index_and_tensor(sharded_dir):
    index_path = sharded_dir / INDEX_FILE
    index = json.loads(index_path.read_text())
    shard = sharded_dir / index["weight_map"].pop(MISSING)
    index_path.write_text(json.dumps(index))
    header, _ = read_parts(shard)
    tensors = {n: random_tensors(config_of(sharded_dir), SEED)[n] for n in header
               if n not in ("__metadata__", MISSING)}
    write_safetensors(shard, tensors, "BF16")
    message = refusal(sharded_dir)
    assert_names_file(message, index_path)
    assert MISSING in message


def test_index_that_is_not_json_is_refused_naming_it(sharded_dir):
    (sharded_dir / INDEX_FILE).write_text("{ nope")
    assert_names_file(refusal(sharded_dir), sharded_dir / INDEX_FILE)


def test_index_whose_weight_map_is_not_an_object_is_refused_naming_it(sharded_dir):
    (sharded_dir / INDEX_FILE).write_text(json.dumps({"weight_map": ["model.norm.weight"]}))
    assert_names_file(refusal(sharded_dir), sharded_dir / INDEX_FILE)


def test_single_file_without_tensors_is_refused_naming_that_file(model_dir):
    write_safetensors(model_dir / SINGLE_FILE, {}, "BF16")
    message = refusal(model_dir)
    assert_names_file(message, model_dir / SINGLE_FILE)
    assert "model.embed_tokens.weight" in message


def test_directory_without_weights_is_refused_naming_what_it_looked_for(model_dir):
    (model_dir / SINGLE_FILE).unlink()
    message = refusal(model_dir)
    assert str(model_dir) in message
    assert SINGLE_FILE in message and INDEX_FILE in message


# --- through the command line ----------------------------------------------------------------


def qwenchat_command() -> str:
    beside = Path(sys.executable).parent / "qwenchat"
    found = str(beside) if beside.is_file() else shutil.which("qwenchat")
    if not found:
        pytest.skip("the qwenchat console script is not installed")
    return found


def run_ask(model: Path, home: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env.pop("QWENCHAT_MODEL", None)
    env.update(HF_HOME=str(home / "hf"), HF_HUB_CACHE=str(home / "hf" / "hub"),
               HF_HUB_OFFLINE="1", XDG_CACHE_HOME=str(home / "cache"),
               XDG_DATA_HOME=str(home / "data"))
    return subprocess.run(
        [qwenchat_command(), "ask", "--backend", "cpu", "--model", str(model), "hi"],
        capture_output=True, text=True, env=env, stdin=subprocess.DEVNULL, timeout=120,
    )


def assert_one_line_error(result: subprocess.CompletedProcess[str], *names: str) -> None:
    assert result.returncode == 1, result.stderr
    assert result.stdout == ""
    assert "Traceback" not in result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("qwenchat: error:")
    for name in names:
        assert re.search(re.escape(name) + r"(?![\w.-])", lines[0]), (name, lines[0])


def test_cli_refuses_a_broken_checkpoint_in_one_line_naming_file_and_tensor(model_dir, tmp_path):
    tensors = originals(model_dir)
    del tensors[MISSING]
    write_safetensors(model_dir / SINGLE_FILE, tensors, "BF16")
    result = run_ask(model_dir, tmp_path)
    assert_one_line_error(result, str((model_dir / SINGLE_FILE).resolve()), MISSING)


def test_cli_refuses_a_directory_without_config_in_one_line(model_dir, tmp_path):
    (model_dir / "config.json").unlink()
    result = run_ask(model_dir, tmp_path)
    assert_one_line_error(result, str((model_dir / "config.json").resolve()))


def test_cli_refuses_experts_in_a_dense_qwen3_config_in_one_line(model_dir, tmp_path):
    raw = json.loads((model_dir / "config.json").read_text())
    raw.update(num_experts=8, num_experts_per_tok=2)
    (model_dir / "config.json").write_text(json.dumps(raw))
    result = run_ask(model_dir, tmp_path)
    assert_one_line_error(result, str((model_dir / "config.json").resolve()), "num_experts=8")
