"""train.py still runs end to end and writes what the loop and the build read (one short epoch)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from timeout_support import guard

ROOT = Path(__file__).resolve().parents[2]
TRAIN = ROOT / "examples" / "jetson_qc" / "train.py"


def test_one_short_epoch_writes_loadable_weights(tmp_path):
    pytest.importorskip("torch", reason="train.py trains with torch")
    from colibri_sdk.format import ColibriFile
    from colibri_sdk.reference import ReferenceEngine
    from qc.model import StemHead

    done = subprocess.run([sys.executable, str(TRAIN), "--epochs", "1", "--train", "256", "--held-out", "64",
                           "--out", str(tmp_path)], capture_output=True, text=True, cwd=ROOT, timeout=guard(1200))
    assert done.returncode == 0, done.stderr
    assert "held-out accuracy (MoE weights rounded to fp16):" in done.stdout
    report = json.loads((tmp_path / "qc_train.json").read_text())
    assert (report["train_frames"], report["held_out_frames"], report["epochs"]) == (256, 64, 1)
    assert 0.0 <= report["held_out_accuracy"] <= 1.0
    # The exported files are the model that was evaluated: rebuilt from them, it scores the reported accuracy on
    # the same held-out frames (seed 2 in train.py).
    import torch

    from qc.dataset import make_dataset
    from qc.preprocess import preprocess_batch
    from qc.torch_model import QCNet

    frames, labels = make_dataset(64, 2)
    with np.load(tmp_path / "qc_stem_head.npz") as arrays, ColibriFile(tmp_path / "qc_moe.colibri") as f:
        assert f.header.to_dict()["dtype"] == "float16"
        net = QCNet.from_arrays(dict(arrays), f)
        with torch.no_grad():
            predicted = net(torch.from_numpy(preprocess_batch(frames))).argmax(dim=1).numpy()
    assert round(float((predicted == labels).mean()), 4) == report["held_out_accuracy"]
    stem = StemHead(tmp_path / "qc_stem_head.npz")
    tokens = stem.tokens(np.zeros((64, 64), np.float32))
    out = ReferenceEngine(tmp_path / "qc_moe.colibri")(tokens[None])
    assert out.shape == (1, 16, 64) and np.isfinite(out).all()
