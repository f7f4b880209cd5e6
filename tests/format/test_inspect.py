"""`colibri-sdk inspect FILE [--json]`."""

from __future__ import annotations

import json

from colibri_sdk import cli


def test_inspect_json(small_file, capsys):
    path, _, _ = small_file
    assert cli.main(["inspect", str(path), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["header"] == {
        "magic": "COLI", "version": "0x0100", "num_layers": 2, "num_experts": 3, "top_k": 2, "hidden_size": 4,
        "intermediate_size": 5, "dtype": "float16", "routing": "topk_softmax", "composition": "sequential",
    }
    # fp16: gate/up/down blocks 2*3*5*4*2 = 240 bytes each, router 2*4*3*2 = 48 bytes.
    blocks = [(b["block"], b["offset"], b["bytes"], b["shape"]) for b in info["blocks"]]
    assert blocks == [
        ("header", 0, 64, None),
        ("gate_proj", 64, 240, [2, 3, 5, 4]),
        ("up_proj", 304, 240, [2, 3, 5, 4]),
        ("down_proj", 544, 240, [2, 3, 4, 5]),
        ("router", 784, 48, [2, 4, 3]),
    ]
    assert info["file_bytes"] == 832 == path.stat().st_size


def test_inspect_table(small_file, capsys):
    path, _, _ = small_file
    assert cli.main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == f"{path}  (832 bytes)"
    assert "  dtype              float16" in out
    assert "  down_proj             544            240  2x3x4x5" in out


def test_inspect_bad_file(tmp_path, capsys):
    bad = tmp_path / "bad.colibri"
    bad.write_bytes(b"GGUF" + bytes(60))
    assert cli.main(["inspect", str(bad)]) == 1
    assert capsys.readouterr().err.strip() == "colibri-sdk inspect: error: bad magic b'GGUF'; expected b'COLI'"
