"""Mutated .colibri v2 files (int8 / int4 / float storage, shared experts, routing variants) through `ColibriFile`,
checked against docs/format.md's v2 layout computed here from the spec: the header fields at their offsets, the
block list (conditions, shapes, element sizes, 64-byte alignment), the exact file size, and one dequantized matrix
per kind (`w = scale · (q − zero)`, int4 low nibble first, `q = u − 8`) against what the reader returns.
"""

from __future__ import annotations

import math
import random
import struct
from pathlib import Path

import numpy as np

from .cases import INTERESTING_U16, Tally, Wrong, flip_bytes, run_case

# Bases: each storage, shared experts, each routing variant (docs/format.md, v2 header table).
BASES = {
    "int8-row": dict(dtype=1, quant=1, group_size=0),
    "int8-g32-zp": dict(dtype=0, quant=1, group_size=32, zero_points=1, routing=1, norm_topk=1),
    "int4-g32-shared": dict(dtype=1, quant=2, group_size=32, num_shared_experts=1, shared_intermediate_size=24,
                            shared_gate=1, routing=1),
    "int4-g64-grouped": dict(dtype=1, quant=2, group_size=64, zero_points=1, routing=2, norm_topk=1, n_group=2,
                             topk_group=1, group_score=2, correction_bias=1, routed_scaling_factor=2.5),
    "fp16-gptoss": dict(dtype=1, quant=0, router_bias=1, expert_bias=1, activation=1, swiglu_limit=7.0,
                        swiglu_alpha=1.702),
}
SIZES = dict(num_layers=2, num_experts=4, top_k=2, hidden_size=40, intermediate_size=36)
FIELDS = ("quant", "group_size", "zero_points", "norm_topk", "n_group", "topk_group", "group_score", "router_bias",
          "correction_bias", "num_shared_experts", "shared_intermediate_size", "shared_gate", "expert_bias",
          "activation", "num_model_layers")
HEADER_OFFSETS = tuple(range(4, 52, 2))  # the u16 fields; 52..63 are the three float32 fields


def v2_base(folder: Path, name: str) -> Path:
    """A two-layer v2 file of base `name`, every array N(0, 0.3²), quantized by the SDK's writer."""
    from colibri_sdk.format import HeaderV2, write_arrays

    header = HeaderV2(**SIZES, **BASES[name])
    rng = np.random.default_rng(sorted(BASES).index(name))
    L = header.num_layers
    arrays = {k: 0.3 * rng.standard_normal(((L, header.count(k)) if header.is_matrix(k) else (L,)) + header.shape(k))
              for k in header.kinds}
    return write_arrays(folder / f"{name}.colibri", header, arrays)


def _spec_header(raw: bytes) -> dict:
    """The header fields as docs/format.md's v2 table places them."""
    values = struct.unpack_from("<4sHHHHHHHHH", raw, 0)
    names = ("magic", "version", "num_layers", "num_experts", "top_k", "hidden_size", "intermediate_size", "dtype",
             "routing", "composition")
    fields = dict(zip(names, values))
    fields.update(zip(FIELDS, struct.unpack_from("<15H", raw, 22)))
    fields.update(zip(("routed_scaling_factor", "swiglu_limit", "swiglu_alpha"), struct.unpack_from("<3f", raw, 52)))
    return fields


def _spec_refuses(h: dict) -> str:
    """A rule of the v2 header table the fields break, or "" (a subset: codes and their combinations)."""
    groups = {0: (0,), 1: (0, 32, 64, 128), 2: (32, 64, 128)}
    checks = [
        (h["magic"] == b"COLI" and h["version"] == 0x0200, "magic/version"),
        (min(h[k] for k in ("num_layers", "num_experts", "top_k", "hidden_size", "intermediate_size")) >= 1,
         "a size of zero"),
        (h["top_k"] <= h["num_experts"], "top_k > num_experts"),
        (h["dtype"] in (0, 1) and h["routing"] in (0, 1, 2) and h["composition"] in (0, 1), "a code"),
        (h["quant"] in groups and h["group_size"] in groups.get(h["quant"], ()), "quant/group_size"),
        (h["zero_points"] in (0, 1) and (h["quant"] or not h["zero_points"]), "zero_points"),
        (h["norm_topk"] in (0, 1) and not (h["routing"] == 0 and h["norm_topk"]), "norm_topk"),
        (1 <= h["n_group"] <= h["num_experts"] and h["num_experts"] % h["n_group"] == 0, "n_group"),
        (1 <= h["topk_group"] <= h["n_group"], "topk_group"),
        (h["group_score"] in (0, 1, 2) and (h["group_score"] == 0) == (h["n_group"] == 1), "group_score"),
        (h["correction_bias"] in (0, 1) and (h["routing"] == 2 or not h["correction_bias"]), "correction_bias"),
        ((h["num_shared_experts"] == 0) == (h["shared_intermediate_size"] == 0), "shared sizes"),
        (h["shared_gate"] in (0, 1) and (h["num_shared_experts"] or not h["shared_gate"]), "shared_gate"),
        (h["router_bias"] in (0, 1) and h["expert_bias"] in (0, 1) and h["activation"] in (0, 1), "flags"),
        (h["num_model_layers"] >= h["num_layers"], "num_model_layers"),
        (math.isfinite(h["routed_scaling_factor"]) and h["routed_scaling_factor"] > 0, "routed_scaling_factor"),
    ]
    return next((what for ok, what in checks if not ok), "")


def _spec_blocks(h: dict) -> list[tuple[str, int, tuple[int, int], int]]:
    """(name, count per layer, (rows, row bytes or cols), element bytes) of every block, in the spec's order."""
    E, H, I, S, Is = h["num_experts"], h["hidden_size"], h["intermediate_size"], h["num_shared_experts"], \
        h["shared_intermediate_size"]
    s = 4 if h["dtype"] == 0 else 2
    out = []

    def matrix(name, count, rows, cols):
        if h["quant"] == 0:
            out.append((name, count, (rows, cols), s))
            return
        out.append((name, count, (rows, cols if h["quant"] == 1 else -(-cols // 2)), 1))
        g = 1 if h["group_size"] == 0 else -(-cols // h["group_size"])
        out.append((name + ".scales", count, (rows, g), s))
        if h["zero_points"]:
            out.append((name + ".zeros", count, (rows, g), 1))

    for name, rows, cols in (("gate_proj", I, H), ("up_proj", I, H), ("down_proj", H, I)):
        matrix(name, E, rows, cols)
    out.append(("router", 1, (H, E), 4))
    for flag, name, shape in (("router_bias", "router_bias", (1, E)), ("correction_bias", "correction_bias", (1, E))):
        if h[flag]:
            out.append((name, 1, shape, 4))
    if h["expert_bias"]:
        out += [("gate_bias", 1, (E, I), 4), ("up_bias", 1, (E, I), 4), ("down_bias", 1, (E, H), 4)]
    if S:
        for name, rows, cols in (("shared_gate_proj", Is, H), ("shared_up_proj", Is, H), ("shared_down_proj", H, Is)):
            matrix(name, S, rows, cols)
    if h["shared_gate"]:
        out.append(("shared_expert_gate", 1, (1, H), 4))
    return out


def _dequantize(raw: bytes, h: dict, offsets: dict, kind: str, layer: int, index: int, rows: int, cols: int):
    """One matrix as float32 from the file's bytes (docs/format.md, "Matrix storage", "Dequantization")."""
    count = h["num_experts"] if not kind.startswith("shared") else h["num_shared_experts"]
    at = layer * count + index
    if h["quant"] == 0:
        dt = np.dtype("<f4" if h["dtype"] == 0 else "<f2")
        return np.frombuffer(raw, dt, rows * cols, offsets[kind] + at * rows * cols * dt.itemsize).reshape(
            rows, cols).astype(np.float32)
    row_bytes = cols if h["quant"] == 1 else -(-cols // 2)
    data = np.frombuffer(raw, np.uint8, rows * row_bytes, offsets[kind] + at * rows * row_bytes).reshape(rows, -1)
    if h["quant"] == 1:
        q = data.view(np.int8).astype(np.int32)
    else:
        q = np.empty((rows, 2 * row_bytes), np.int32)
        q[:, 0::2], q[:, 1::2] = (data & 0x0F).astype(np.int32) - 8, (data >> 4).astype(np.int32) - 8
        q = q[:, :cols]
    g = 1 if h["group_size"] == 0 else -(-cols // h["group_size"])
    sdt = np.dtype("<f4" if h["dtype"] == 0 else "<f2")
    scales = np.frombuffer(raw, sdt, rows * g, offsets[kind + ".scales"] + at * rows * g * sdt.itemsize).reshape(rows, g)
    zeros = np.zeros((rows, g), np.int32)
    if h["zero_points"]:
        zeros = np.frombuffer(raw, np.int8, rows * g, offsets[kind + ".zeros"] + at * rows * g).reshape(
            rows, g).astype(np.int32)
    group = np.zeros(cols, np.int64) if h["group_size"] == 0 else np.arange(cols) // h["group_size"]
    return scales.astype(np.float32)[:, group] * (q - zeros[:, group]).astype(np.float32)


def check_v2(path: Path) -> None:
    """Open with the SDK; check what it accepted against the layout computed here from docs/format.md."""
    from colibri_sdk.format import ColibriFile

    raw = path.read_bytes()
    with ColibriFile(path) as f:
        h = _spec_header(raw)
        refused = _spec_refuses(h)
        if refused:
            raise Wrong(f"accepted a header the spec refuses ({refused}): {raw[:64].hex()}")
        read = f.header
        for name in ("num_layers", "num_experts", "top_k", "hidden_size", "intermediate_size", "dtype", "routing",
                     "composition", *FIELDS):
            if getattr(read, name) != h[name]:
                raise Wrong(f"{name} read as {getattr(read, name)}, the bytes at its offset say {h[name]}")
        L = h["num_layers"]
        offset = -(-(64 + 2 * L) // 64) * 64
        offsets = {}
        for name, count, (rows, cols), item in _spec_blocks(h):
            offset = -(-offset // 64) * 64
            offsets[name] = offset
            offset += L * count * rows * cols * item
        if len(raw) != offset:
            raise Wrong(f"accepted {len(raw)} bytes; the spec's blocks end at {offset}")
        reported = {b.name: b.offset for b in read.blocks()}
        if reported != offsets:
            raise Wrong(f"block offsets {reported}; the spec's {offsets}")
        E, H, I = h["num_experts"], h["hidden_size"], h["intermediate_size"]
        kinds = [("gate_proj", E, I, H), ("down_proj", E, H, I)]
        if h["num_shared_experts"]:
            kinds.append(("shared_down_proj", h["num_shared_experts"], H, h["shared_intermediate_size"]))
        for kind, count, rows, cols in kinds:
            want = _dequantize(raw, h, offsets, kind, L - 1, count - 1, rows, cols)
            got = f.weight(kind, L - 1, count - 1)
            if got.shape != want.shape or not np.array_equal(got, want, equal_nan=True):
                raise Wrong(f"{kind}[{L - 1}, {count - 1}]: the dequantized matrix differs from the spec's")
        router = np.frombuffer(raw, "<f4", H * E, offsets["router"] + (L - 1) * H * E * 4)
        if f.router(L - 1).tobytes() != router.tobytes():
            raise Wrong("router: the tensor read differs from the bytes at the spec's offset")
        f.layout()


def fuzz_v2(count: int, seed: int, work: Path, timeout: float) -> Tally:
    tally = Tally(".colibri v2")
    bases = [v2_base(work, name).read_bytes() for name in sorted(BASES)]
    rng = random.Random(seed)
    target = work / "case.colibri"
    for i in range(count):
        data = bytearray(rng.choice(bases))
        roll = rng.random()
        if roll < 0.5:  # a header field (or the layer map) set to an interesting value
            offset = rng.choice(HEADER_OFFSETS + (64, 66))
            struct.pack_into("<H", data, offset, rng.choice(INTERESTING_U16))
        elif roll < 0.6:  # one of the float fields
            offset = rng.choice((52, 56, 60))
            struct.pack_into("<f", data, offset, rng.choice((0.0, -1.0, float("nan"), float("inf"), 1e-45, 7.0)))
        if roll >= 0.5 or rng.random() < 0.3:
            data = bytearray(flip_bytes(bytes(data), rng))
        target.write_bytes(bytes(data))
        run_case(tally, f"v2#{i}", lambda: check_v2(target), None, timeout)
    return tally
