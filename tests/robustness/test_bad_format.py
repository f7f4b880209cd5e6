"""Hostile input to the .colibri reader/writer and `colibri-sdk inspect`."""

from __future__ import annotations

import os
import stat

import numpy as np
import pytest
from colibri_sdk.errors import FormatError
from colibri_sdk.format import ColibriFile, ColibriWriter, Header
from robustness_helpers import cli_error

HEADER = Header(num_layers=1, num_experts=2, top_k=1, hidden_size=4, intermediate_size=8)
ALARM_S = 120  # the `alarm` fixture (conftest.py): a hang fails the test after this many seconds


def test_opening_a_fifo_is_refused_without_waiting_for_a_writer(tmp_path, alarm):
    fifo = tmp_path / "model.colibri"
    os.mkfifo(fifo)
    with pytest.raises(FormatError, match=r"model\.colibri is not a regular file$"):
        ColibriFile(fifo)


def test_inspect_of_a_fifo_exits_1(tmp_path, alarm, capsys):
    os.mkfifo(tmp_path / "pipe")
    assert cli_error(capsys, "inspect", str(tmp_path / "pipe")).endswith("pipe is not a regular file")


def test_writer_into_a_missing_folder(tmp_path):
    with pytest.raises(FormatError, match=r"cannot write .*/missing/m\.colibri\.partial: No such file or directory"):
        ColibriWriter(tmp_path / "missing" / "m.colibri", HEADER)


def test_writer_refuses_a_folder_and_leaves_no_partial_file(tmp_path):
    target = tmp_path / "out"
    target.mkdir()
    (target / "keep.txt").write_text("keep")
    with pytest.raises(FormatError, match=r"cannot write .*/out: it exists and is a folder"):
        ColibriWriter(target, HEADER)
    assert (target / "keep.txt").read_text() == "keep"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_writer_never_replaces_a_special_file(tmp_path):
    # A FIFO stands in for /dev/null: renaming the finished file onto it would replace the device node.
    special = tmp_path / "null"
    os.mkfifo(special)
    with pytest.raises(FormatError, match=r"cannot write .*/null: it exists and is not a regular file"):
        ColibriWriter(special, HEADER)
    assert stat.S_ISFIFO(os.lstat(special).st_mode)


def test_float64_beyond_float32_is_named_as_an_overflow(tmp_path):
    with pytest.raises(  # noqa: SIM117 (nested: the writer must see the exception and drop its file)
        FormatError, match=r"gate_proj\[layer=0, expert=0\]: 32 values overflow float32 \(max \|x\| = 1e\+300\)"
    ):
        with ColibriWriter(tmp_path / "m.colibri", HEADER) as w:
            w.write("gate_proj", 0, 0, np.full((8, 4), 1e300))
    assert not (tmp_path / "m.colibri").exists()
