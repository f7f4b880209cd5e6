"""Mutated .colibri v1 files through `ColibriFile`, checked against docs/format.md's v1 layout read here.
"""

from __future__ import annotations

import random
import struct
from pathlib import Path

import numpy as np

from .cases import INTERESTING_U16, Tally, Wrong, flip_bytes, run_case

def colibri_base(folder: Path, dtype: int) -> Path:
    from colibri_sdk.format import Header, write_model

    h = Header(num_layers=2, num_experts=4, top_k=2, hidden_size=8, intermediate_size=16, dtype=dtype)
    rng = np.random.default_rng(1)
    L, E, H, I = 2, 4, 8, 16
    return write_model(folder / f"base{dtype}.colibri", h, rng.standard_normal((L, E, I, H)),
                       rng.standard_normal((L, E, I, H)), rng.standard_normal((L, E, H, I)),
                       rng.standard_normal((L, H, E)))


def check_colibri(path: Path) -> None:
    """Open with the SDK; check header, size and four tensors against docs/format.md's layout read here."""
    from colibri_sdk.format import ColibriFile

    raw = path.read_bytes()
    with ColibriFile(path) as f:
        h = f.header
        magic, version, L, E, K, H, I, dt, routing, composition = struct.unpack_from("<4sHHHHHHHHH", raw, 0)
        fields = (h.num_layers, h.num_experts, h.top_k, h.hidden_size, h.intermediate_size, h.dtype, h.routing,
                  h.composition)
        if magic != b"COLI" or fields != (L, E, K, H, I, dt, routing, composition):
            raise Wrong(f"header read as {fields}, the bytes say {(magic, L, E, K, H, I, dt, routing, composition)}")
        if any(raw[22:64]) or not (1 <= K <= E) or min(L, E, H, I) < 1 or dt not in (0, 1) or routing > 1 \
                or composition > 1:
            raise Wrong(f"accepted a header the spec refuses: {raw[:64].hex()}")
        item = {0: 4, 1: 2}[dt]
        expert = I * H
        sizes = {"gate_proj": L * E * expert, "up_proj": L * E * expert, "down_proj": L * E * expert,
                 "router": L * H * E}
        if len(raw) != 64 + item * sum(sizes.values()):
            raise Wrong(f"accepted {len(raw)} bytes; the header implies {64 + item * sum(sizes.values())}")
        np_dtype = np.dtype("<f4" if dt == 0 else "<f2")
        base = 64
        for kind in ("gate_proj", "up_proj", "down_proj", "router"):
            if kind == "router":
                index, count, got = L - 1, H * E, f.router(L - 1)
            else:
                index, count, got = (L - 1) * E + (E - 1), expert, f.tensor(kind, L - 1, E - 1)
            want = np.frombuffer(raw, np_dtype, count=count, offset=base + index * count * item)
            if got.size != count or got.tobytes() != want.tobytes():
                raise Wrong(f"{kind}: the tensor read differs from the bytes at the spec's offset")
            base += sizes[kind] * item
        f.layout()


def fuzz_colibri(count: int, seed: int, work: Path, timeout: float) -> Tally:
    tally = Tally(".colibri")
    bases = [colibri_base(work, 0).read_bytes(), colibri_base(work, 1).read_bytes()]
    rng = random.Random(seed)
    target = work / "case.colibri"
    for i in range(count):
        data = bytearray(rng.choice(bases))
        if rng.random() < 0.5:  # a header field set to an interesting value
            offset = rng.choice((4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 40, 62))
            struct.pack_into("<H", data, offset, rng.choice(INTERESTING_U16))
            if rng.random() < 0.3:
                data = bytearray(flip_bytes(bytes(data), rng))
        else:
            data = bytearray(flip_bytes(bytes(data), rng))
        target.write_bytes(bytes(data))
        run_case(tally, f"colibri#{i}", lambda: check_colibri(target), None, timeout)
    return tally
