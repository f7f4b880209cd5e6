"""Mutated Hugging Face checkpoints (config.json, safetensors headers, links) through `convert`, checked against
safetensors' own loader (Mixtral layout: w1 = gate, w3 = up, w2 = down, gate.T = router).
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import numpy as np

from .cases import Tally, Wrong, flip_bytes, mutate_json, run_case

CONFIG = {"model_type": "mixtral", "num_hidden_layers": 1, "num_local_experts": 2, "num_experts_per_tok": 1,
          "hidden_size": 4, "intermediate_size": 8}
PREFIX = "model.layers.0.block_sparse_moe."


def checkpoint_base(folder: Path, **config) -> Path:
    """A valid tiny checkpoint folder (config.json + model.safetensors, float32): 1 layer, 2 experts, top-1, hidden
    4, intermediate 8; `config` overrides config.json keys (tests/robustness uses it too)."""
    from safetensors.numpy import save_file

    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({**CONFIG, **config}))
    rng = np.random.default_rng(0)
    tensors = {PREFIX + "gate.weight": rng.standard_normal((2, 4)).astype(np.float32)}
    for e in range(2):
        tensors[f"{PREFIX}experts.{e}.w1.weight"] = rng.standard_normal((8, 4)).astype(np.float32)
        tensors[f"{PREFIX}experts.{e}.w3.weight"] = rng.standard_normal((8, 4)).astype(np.float32)
        tensors[f"{PREFIX}experts.{e}.w2.weight"] = rng.standard_normal((4, 8)).astype(np.float32)
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


def mutate_safetensors_header(path: Path, rng: random.Random) -> None:
    data = path.read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    name = rng.choice([k for k in header if k != "__metadata__"])
    field = rng.choice(("dtype", "shape", "data_offsets", "name"))
    if field == "dtype":
        header[name]["dtype"] = rng.choice(("F16", "BF16", "F64", "I8", "U8", "BOOL", "F8_E4M3", "x"))
    elif field == "shape":
        header[name]["shape"] = rng.choice(([], [0], [2, 2], [8, 4, 1], [-1, 4], [2**40, 4], [4, 8]))
    elif field == "data_offsets":
        a, b = header[name]["data_offsets"]
        header[name]["data_offsets"] = rng.choice(([b, a], [a, b + 4], [a + 4, b], [0, 0], [a, 2**62]))
    else:
        header[name.replace("w1", "w9") if "w1" in name else name + "x"] = header.pop(name)
    blob = json.dumps(header).encode()
    path.write_bytes(len(blob).to_bytes(8, "little") + blob + data[8 + n:])


def mutate_checkpoint(folder: Path, outside: Path, rng: random.Random) -> str:
    kind = rng.randrange(6)
    config = json.loads((folder / "config.json").read_text())
    if kind == 0:
        what = mutate_json(config, rng)
        (folder / "config.json").write_text(json.dumps(config))
        return what
    if kind == 1:
        key = rng.choice(list(CONFIG))
        config[key] = rng.choice((0, 1, 2, 3, 9, 17, -1, 2**16, 2**70, 1.0, "2", None, True, "qwen3_moe", "llama"))
        (folder / "config.json").write_text(json.dumps(config))
        return f"config {key}"
    if kind == 2:
        (folder / "config.json").write_bytes(flip_bytes((folder / "config.json").read_bytes(), rng))
        return "config bytes"
    if kind == 3:
        mutate_safetensors_header(folder / "model.safetensors", rng)
        return "safetensors header"
    if kind == 4:
        st = folder / "model.safetensors"
        st.write_bytes(flip_bytes(st.read_bytes(), rng))
        return "safetensors bytes"
    # kind 5: an index, with or without the single file, naming shards inside, missing, or outside
    from safetensors.numpy import load_file

    tensors = load_file(str(folder / "model.safetensors"))
    shard = rng.choice(("model-00001.safetensors", "../outside/model.safetensors", str(outside / "model.safetensors"),
                        "missing.safetensors", "model.safetensors", "config.json"))
    if shard == "model-00001.safetensors":
        shutil.copyfile(folder / "model.safetensors", folder / shard)
    weight_map = {name: shard for name in tensors if rng.random() < 0.9}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    if rng.random() < 0.5:
        os.replace(folder / "model.safetensors", folder / "moved.bin")
    return f"index → {shard}"


def independent_checkpoint_check(folder: Path, output: Path, dtype: str) -> None:
    """The converted file against safetensors' own loader, in transformers' file order (single file first)."""
    from safetensors.numpy import load_file

    from colibri_sdk.format import ColibriFile

    config = json.loads((folder / "config.json").read_text())
    if (folder / "model.safetensors").is_file():
        tensors = load_file(str(folder / "model.safetensors"))
    else:
        index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
        tensors = {}
        for shard in sorted(set(index.values())):
            tensors.update(load_file(str(folder / shard)))
    cast = np.float16 if dtype == "fp16" else np.float32
    with ColibriFile(output) as f:
        h = f.header
        sizes = (h.num_layers, h.num_experts, h.top_k, h.hidden_size, h.intermediate_size)
        expect = tuple(config[k] for k in ("num_hidden_layers", "num_local_experts", "num_experts_per_tok",
                                           "hidden_size", "intermediate_size"))
        if config.get("model_type") != "mixtral" or sizes != expect:
            raise Wrong(f"converted {config.get('model_type')!r} with sizes {sizes}; config.json says {expect}")
        pairs = [(f.router(0), tensors[PREFIX + "gate.weight"].T)]
        for e in range(h.num_experts):
            for kind, name in (("gate_proj", "w1"), ("up_proj", "w3"), ("down_proj", "w2")):
                pairs.append((f.tensor(kind, 0, e), tensors[f"{PREFIX}experts.{e}.{name}.weight"]))
        for got, want in pairs:
            if got.shape != want.shape or not np.array_equal(got, want.astype(cast)):
                raise Wrong("a converted tensor differs from the checkpoint's")


def fuzz_checkpoints(count: int, seed: int, work: Path, timeout: float) -> Tally:
    from colibri_sdk.convert import convert

    tally = Tally("checkpoint")
    base = checkpoint_base(work / "base_ckpt")
    outside = Path(shutil.copytree(base, work / "outside_ckpt"))
    rng = random.Random(seed)
    for i in range(count):
        folder = Path(shutil.copytree(base, work / f"c{i}"))
        what = mutate_checkpoint(folder, outside, rng)
        if rng.random() < 0.3:
            try:  # a second mutation on top of the first (it may not apply to an already broken file)
                what += "; " + mutate_checkpoint(folder, outside, rng)
            except Exception:  # noqa: BLE001 (a mutator failing on a broken file is not a finding)
                pass
        dtype = rng.choice(("fp16", "fp32"))
        output = work / f"c{i}.colibri"

        def action(folder=folder, output=output, dtype=dtype):
            convert(folder, output, dtype=dtype, progress=False)
            independent_checkpoint_check(folder, output, dtype)

        run_case(tally, f"checkpoint#{i} ({what})", action, outside, timeout)
        shutil.rmtree(folder, ignore_errors=True)
        output.unlink(missing_ok=True)
    return tally
