"""Mutated GGUF files (llama.cpp) through `convert`, checked against gguf-py's own reader.

The base is a qwen3moe file written with gguf-py's `GGUFWriter`: 1 layer, 4 experts, top-2, hidden 8, intermediate
16, F32 tensors, with a string array, a float array and a nested array beside the model keys. Most mutations hit
the header: a count, a length, a value type, a dimension or an offset (each field located through gguf-py's
`ReaderField.parts`, which are views into the file) set to an interesting value; bit flips and byte writes inside
the header; a truncation inside it. The rest flip bytes anywhere (tensor data included).

Independent check of an accepted file: gguf-py reads it (`GGUFReader`), and the converted file's sizes, router and
expert matrices equal its metadata and F32 tensors (router = ffn_gate_inp.T, gate / up / down = ffn_*_exps[e]; the
layers are those of `block_count` with a router, docs/convert.md).
"""

from __future__ import annotations

import random
import struct
from pathlib import Path

import numpy as np

from .cases import Tally, Wrong, flip_bytes, run_case

ARCH = "qwen3moe"
E, K, H, I = 4, 2, 8, 16
INTERESTING = (0, 1, 2, 3, 4, 5, 7, 8, 9, 12, 13, 255, 2**16, 2**31, 2**32 - 1, 2**32, 2**40, 2**62, 2**63,
               2**64 - 1)


def gguf_base(path: Path) -> Path:
    """A valid tiny qwen3moe GGUF file (F32 tensors, N(0, 1) values)."""
    import gguf

    rng = np.random.default_rng(2)
    w = gguf.GGUFWriter(str(path), ARCH)
    w.add_block_count(1)
    w.add_embedding_length(H)
    w.add_expert_count(E)
    w.add_expert_used_count(K)
    w.add_expert_feed_forward_length(I)
    w.add_array("tokenizer.ggml.tokens", ["<s>", "a", "bc", "déf"])
    w.add_array("tokenizer.ggml.scores", [0.0, -1.0, -2.0, -3.0])
    w.add_array("test.nested", [[1, 2], [3]])
    w.add_tensor("blk.0.ffn_gate_inp.weight", rng.standard_normal((E, H)).astype(np.float32))
    for name, shape in (("ffn_gate_exps", (E, I, H)), ("ffn_up_exps", (E, I, H)), ("ffn_down_exps", (E, H, I))):
        w.add_tensor(f"blk.0.{name}.weight", rng.standard_normal(shape).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def header_fields(path: Path) -> tuple[list[tuple[int, int]], int]:
    """(offset, size) of every u32 / u64 of the header (counts, lengths, types, dims, offsets), and the header's
    length in bytes, from gguf-py's parts (views into its memory map)."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    base = reader.data.ctypes.data
    fields = []
    for field in list(reader.fields.values()) + [t.field for t in reader.tensors]:
        for part in field.parts:
            if part.dtype.itemsize in (4, 8) and part.dtype.kind == "u" and part.size == 1:
                fields.append((part.ctypes.data - base, part.dtype.itemsize))
    return sorted(set(fields)), reader.data_offset


def mutate_gguf(data: bytes, fields: list[tuple[int, int]], header: int, rng: random.Random) -> tuple[bytes, str]:
    out = bytearray(data)
    kind = rng.randrange(4)
    if kind <= 1:  # a count, length, type, dimension or offset set to an interesting value
        offset, size = rng.choice(fields)
        value = rng.choice(INTERESTING + (len(data), len(data) - offset, rng.randrange(2**(8 * size))))
        struct.pack_into("<I" if size == 4 else "<Q", out, offset, value % 2**(8 * size))
        return bytes(out), f"u{8 * size} at {offset} = {value % 2**(8 * size)}"
    if kind == 2:  # bit flips / byte writes / a truncation inside the header (the rest of the file after it)
        head = flip_bytes(data[:header], rng)
        if len(head) < header and rng.random() < 0.5:
            return head, f"the file cut at {len(head)}, inside the header"
        return head + data[header:], "header bytes"
    return flip_bytes(data, rng), "bytes"


def check_gguf(source: Path, output: Path) -> None:
    """The converted file against gguf-py's reading of the source."""
    import gguf

    from colibri_sdk.format import ColibriFile

    reader = gguf.GGUFReader(str(source))
    meta = {k: reader.fields[f"{ARCH}.{k}"].contents() for k in ("block_count", "expert_count", "expert_used_count",
                                                                    "embedding_length", "expert_feed_forward_length")}
    tensors = {t.name: np.asarray(t.data) for t in reader.tensors}
    # docs/convert.md: layers without blk.N.ffn_gate_inp are dense and left out
    meta["block_count"] = sum(f"blk.{l}.ffn_gate_inp.weight" in tensors for l in range(meta["block_count"]))
    with ColibriFile(output) as f:
        h = f.header
        sizes = (h.num_layers, h.num_experts, h.top_k, h.hidden_size, h.intermediate_size)
        if sizes != tuple(meta.values()):
            raise Wrong(f"converted sizes {sizes}; gguf-py reads {tuple(meta.values())}")
        pairs = [(f.router(0), tensors["blk.0.ffn_gate_inp.weight"].T)]
        for e in range(h.num_experts):
            for kind, name in (("gate_proj", "ffn_gate_exps"), ("up_proj", "ffn_up_exps"),
                               ("down_proj", "ffn_down_exps")):
                pairs.append((f.tensor(kind, 0, e), tensors[f"blk.0.{name}.weight"][e]))
        for got, want in pairs:
            if got.shape != want.shape or not np.array_equal(got, want.astype(np.float32), equal_nan=True):
                raise Wrong("a converted tensor differs from gguf-py's")


def fuzz_gguf(count: int, seed: int, work: Path, timeout: float) -> Tally:
    from colibri_sdk.convert import convert

    tally = Tally("gguf")
    base = gguf_base(work / "base.gguf")
    data = base.read_bytes()
    fields, header = header_fields(base)
    rng = random.Random(seed)
    target, output = work / "case.gguf", work / "case.colibri"
    for i in range(count):
        mutated, what = mutate_gguf(data, fields, header, rng)
        target.write_bytes(mutated)
        output.unlink(missing_ok=True)

        def action():
            convert(target, output, dtype="fp32", progress=False)
            check_gguf(target, output)

        run_case(tally, f"gguf#{i} ({what})", action, None, timeout)
    return tally
