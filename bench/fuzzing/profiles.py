"""Mutated device profiles (YAML edits, byte flips) through `load_profile`, checked against docs/profiles.md's ranges.
"""

from __future__ import annotations

import random
import re
from pathlib import Path

from .cases import Tally, Wrong, canonical, flip_bytes, run_case

YAML_VALUES = ("-1", "0", "1", "16", "48", "1e400", ".nan", ".inf", "-.inf", "true", "no", "null", "~", '"x"', "''",
               "[1, 2]", "{a: 1}", "!!python/object/apply:os.system ['true']", "*a", "&a 5", "99999999999999999999999",
               "sm_87a", "sm_087", "sm_90", "sm_8\uff17", "0x10", "0o17", "1_000", '"\\x00"', "'unclosed", "[unclosed",
               "!!binary aGk=", "2001-12-14", "fp32", "atomic", "!!float 3", "1e5", "65536", "166912", "12020")


def mutate_profile(text: str, rng: random.Random) -> str:
    lines = text.splitlines()
    kind = rng.randrange(8)
    values = [i for i, line in enumerate(lines) if re.match(r"\s*[a-z_]+: \S", line)]
    if not values or not lines:
        return text + "\nx: 1\n"
    if kind <= 2:
        i = rng.choice(values)
        key = lines[i].split(":")[0]
        lines[i] = f"{key}: {rng.choice(YAML_VALUES)}"
    elif kind == 3:
        del lines[rng.randrange(len(lines))]
    elif kind == 4:
        i = rng.randrange(len(lines))
        lines.insert(i, lines[i])
    elif kind == 5:  # anchors, aliases and merge keys
        i = rng.choice(values)
        key, _, value = lines[i].partition(": ")
        indent = key[: len(key) - len(key.lstrip())]
        lines[i] = f"{key}: &v {value}"
        j = rng.choice(values)
        other = lines[j].split(":")[0]
        lines[j] = rng.choice((f"{other}: *v", f"{indent}<<: {{}}", f"{other}:\n{indent}  <<: *v"))
    elif kind == 6:  # indentation or a tab
        i = rng.randrange(len(lines))
        lines[i] = rng.choice(("\t", "  ", "", " ")) + lines[i].lstrip()
    else:
        return flip_bytes(text.encode(), rng).decode("utf-8", "replace")
    return "\n".join(lines) + "\n"


def independent_profile_check(profile) -> None:
    """docs/profiles.md's ranges, checked on the accepted profile's data."""
    from colibri_sdk.profile import ARCH_SHARED_MEMORY

    d = profile.to_dict()
    t, hw, shape = d["target"], d["hardware"], d["shape"]

    def is_int(v):
        return type(v) is int

    m = re.fullmatch(r"sm_([1-9][0-9]{1,2})", t["arch"]) if isinstance(t["arch"], str) else None
    if not m or int(m.group(1)) not in ARCH_SHARED_MEMORY:
        raise Wrong(f"accepted target.arch {t['arch']!r}")
    optin, per_sm = ARCH_SHARED_MEMORY[int(m.group(1))]
    def sizes(v):  # an int, or 1..8 ints strictly increasing (docs/profiles.md, shape.batch / shape.tokens)
        values = v if type(v) is list else [v]
        ok = 1 <= len(values) <= 8 and all(is_int(x) and 1 <= x <= 65536 for x in values)
        return ok and all(a < b for a, b in zip(values, values[1:]))

    checks = [
        sizes(shape["batch"]) and sizes(shape["tokens"])
        and max(shape["batch"] if type(shape["batch"]) is list else [shape["batch"]])
        * max(shape["tokens"] if type(shape["tokens"]) is list else [shape["tokens"]]) <= 65536,
        d["dtype"] in ("fp16", "fp32"), d["aggregation"] in ("ordered", "atomic"),
        type(d["allow_spills"]) is bool, type(t["unified_memory"]) is bool,
        is_int(t["toolkit"]) and is_int(t["min_driver"]) and t["min_driver"] >= 1000 * t["toolkit"],
        all(is_int(hw[k]) for k in ("sm_count", "shared_memory_per_block", "shared_memory_per_block_optin",
                                     "shared_memory_per_sm")),
        hw["shared_memory_per_block"] <= 49152 and hw["shared_memory_per_block"] <= hw["shared_memory_per_block_optin"]
        <= optin and hw["shared_memory_per_block_optin"] <= hw["shared_memory_per_sm"] <= per_sm,
        isinstance(hw["memory_bandwidth_gbs"], (int, float)) and not isinstance(hw["memory_bandwidth_gbs"], bool)
        and 0 < hw["memory_bandwidth_gbs"] < 1e5,
        all(is_int(v) for k in d["kernels"].values() for v in k.values()),
    ]
    if not all(checks):
        raise Wrong(f"accepted a profile outside docs/profiles.md's ranges (check {checks.index(False)})")
    canonical(d)  # it goes into a manifest: strict JSON must hold it


def fuzz_profiles(count: int, seed: int, work: Path, timeout: float) -> Tally:
    from colibri_sdk.profile import load_profile, packaged_dir

    tally = Tally("profile")
    base = (packaged_dir() / "orin.yaml").read_text()
    rng = random.Random(seed)
    path = work / "board.yaml"
    for i in range(count):
        text = base
        for _ in range(rng.choice((1, 1, 2, 3))):
            text = mutate_profile(text, rng)
        path.write_text(text, encoding="utf-8", errors="surrogateescape")
        run_case(tally, f"profile#{i}", lambda: independent_profile_check(load_profile(path, toolchain=False)),
                 None, timeout)
    return tally
