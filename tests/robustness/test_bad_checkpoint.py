"""Hostile checkpoints and output paths for `colibri-sdk convert`."""

from __future__ import annotations

import json
import os
import stat

import pytest
from colibri_sdk.convert import convert
from colibri_sdk.errors import ConvertError
from robustness_helpers import PREFIX, cli_error, write_checkpoint

INDEX = "model.safetensors.index.json"
DEEP = "[" * 100_000 + "]" * 100_000
HUGE_INT = '{"hidden_size": ' + "9" * 5000 + "}"


@pytest.mark.parametrize("text", [HUGE_INT, DEEP], ids=["int-of-5000-digits", "nested-100000-deep"])
def test_config_json_that_breaks_the_json_parser(tmp_path, capsys, text):
    folder = write_checkpoint(tmp_path / "ckpt")
    (folder / "config.json").write_text(text)
    err = cli_error(capsys, "convert", str(folder), "-o", str(tmp_path / "m.colibri"))
    assert "config.json: not valid JSON (" in err


def _sharded(folder, weight_map) -> None:
    (folder / "model.safetensors").rename(folder / "model-00001.safetensors")
    text = weight_map if isinstance(weight_map, str) else json.dumps({"weight_map": weight_map})
    (folder / INDEX).write_text(text)


@pytest.mark.parametrize(
    ("file", "message"),
    [
        ("", r"maps to ''; expected a file name"),
        ("../model-00001.safetensors", r"maps to '\.\./model-00001\.safetensors'; expected a file name"),
        ("/etc/passwd", r"maps to '/etc/passwd'; expected a file name"),
        ("model-00002.safetensors", r"names shard 'model-00002\.safetensors', which is not in"),
    ],
    ids=["empty", "dotdot", "absolute", "missing-shard"],
)
def test_index_pointing_outside_the_folder_or_at_nothing(tmp_path, file, message):
    folder = write_checkpoint(tmp_path / "ckpt")
    _sharded(folder, {PREFIX + "gate.weight": file})
    with pytest.raises(ConvertError, match=message):
        convert(folder, tmp_path / "m.colibri")


@pytest.mark.parametrize("text", ['{"weight_map": ' + "9" * 5000 + "}", DEEP], ids=["huge-int", "deep"])
def test_index_json_that_breaks_the_json_parser(tmp_path, text):
    folder = write_checkpoint(tmp_path / "ckpt")
    _sharded(folder, text)
    with pytest.raises(ConvertError, match=r"index\.json: expected JSON with a 'weight_map' object \((ValueError|RecursionError)"):
        convert(folder, tmp_path / "m.colibri")


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda b: b[:-10], r"incomplete metadata, file not fully covered"),
        (lambda b: (2**63).to_bytes(8, "little") + b[8:], r"header too large"),
        (lambda b: b"\x10" + bytes(7) + b"not json at all!", r"invalid JSON in header"),
    ],
    ids=["truncated", "huge-header-length", "garbage-header"],
)
def test_broken_safetensors(tmp_path, mutate, message):
    folder = write_checkpoint(tmp_path / "ckpt")
    st = folder / "model.safetensors"
    st.write_bytes(mutate(st.read_bytes()))
    with pytest.raises(ConvertError, match=rf"model\.safetensors: not a readable safetensors file .*{message}"):
        convert(folder, tmp_path / "m.colibri")


@pytest.mark.parametrize("name", ["model.safetensors", "config.json"])
def test_output_onto_the_checkpoints_own_file_is_refused(tmp_path, capsys, name):
    folder = write_checkpoint(tmp_path / "ckpt")
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    err = cli_error(capsys, "convert", str(folder), "-o", str(folder / name))
    assert err.endswith("exists; refusing to replace it without --force (or choose another -o)")
    err = cli_error(capsys, "convert", str(folder), "-o", str(folder / name), "--force")  # never the source itself
    assert err.endswith(f"is the checkpoint's own {name}; refusing to overwrite the source (choose another -o)")
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before


def test_output_onto_a_special_file_is_refused(tmp_path):
    folder = write_checkpoint(tmp_path / "ckpt")
    special = tmp_path / "null"  # a FIFO stands in for /dev/null
    os.mkfifo(special)
    with pytest.raises(ConvertError, match=r"cannot write .*/null: it exists and is not a regular file"):
        convert(folder, special)
    assert stat.S_ISFIFO(os.lstat(special).st_mode)


def test_output_that_is_the_checkpoint_folder_leaves_nothing_behind(tmp_path):
    folder = write_checkpoint(tmp_path / "ckpt")
    with pytest.raises(ConvertError, match=r"cannot write .*/ckpt: it exists and is a folder"):
        convert(folder, folder)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


@pytest.mark.parametrize("output", ["/", ""])
def test_output_without_a_file_name(tmp_path, capsys, output):
    folder = write_checkpoint(tmp_path / "ckpt")
    assert "is not a file path; allowed: a path ending in a file name" in cli_error(
        capsys, "convert", str(folder), "-o", output
    )


@pytest.mark.parametrize("model_type", [[1, 2], {"a": 1}, None, 7])
def test_model_type_that_is_not_a_string(tmp_path, capsys, model_type):
    """Found by bench/fuzz.py: a list or an object as model_type raised TypeError (unhashable) from the family
    lookup."""
    folder = write_checkpoint(tmp_path / "ckpt", model_type=model_type)
    err = cli_error(capsys, "convert", str(folder), "-o", str(tmp_path / "m.colibri"))
    assert f"config.json model_type = {model_type!r}; allowed: mixtral, " in err, err
