"""OUT/results.jsonl as plain-text tables (printed, and written to OUT/table.txt). Reads whatever lines exist:
a phase that died early leaves its rows out and its failure in the last table."""

from __future__ import annotations

import json
from pathlib import Path


def load(out: Path) -> list[dict]:
    lines = []
    path = out / "results.jsonl"
    if path.exists():
        for text in path.read_text(encoding="utf-8").splitlines():
            try:
                lines.append(json.loads(text))
            except json.JSONDecodeError:
                lines.append({"phase": "?", "name": "unreadable line", "status": "fail", "reason": text[:200]})
    return lines


def grid(header: list[str], rows: list[list]) -> list[str]:
    cells = [[str(c) for c in header]] + [["-" if c is None else str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    text = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in cells]
    return [text[0], "-" * len(text[0]), *text[1:]]


def fmt(value, digits: int = 1):
    return None if value is None else f"{value:.{digits}f}"


def pick(lines, phase, name=None, status="ok"):
    return [l for l in lines if l.get("phase") == phase and (name is None or l.get("name") == name)
            and (status is None or l.get("status") == status)]


def render(lines: list[dict]) -> str:
    out: list[str] = []
    for g in pick(lines, "versions", "gpu"):
        out.append(f"GPU: {g.get('gpu')} ({g.get('arch')}, {g.get('sm_count')} SMs), driver {g.get('driver')}")
    for s in pick(lines, "versions", "software"):
        out.append(f"cuda-bindings {s.get('cuda_bindings')}, NVRTC {s.get('nvrtc')}, torch {s.get('torch')}, "
                   f"transformers {s.get('transformers')}, Python {s.get('python')}, install: {s.get('install')}"
                   + (" — FAKE DRIVER (CPU emulation): no number here is a GPU measurement" if s.get("fake_driver")
                      else ""))
    floor = {l["name"]: l for l in pick(lines, "floor")}
    if floor:
        out.append("floor: " + ", ".join(f"{n} {fmt(l.get('gbs'))} GB/s ({l.get('counted')})"
                                         for n, l in floor.items()))
    fwd = pick(lines, "layer", "forward") + pick(lines, "layer-quant", "forward")
    if fwd:
        out += ["", "One layer (forward pass; graph and eager by CUDA events; floor = selected experts' bytes / read "
                "bandwidth; * = the profile's own path; est = the time model's ESTIMATE, bench/kernel_model.py)"]
        out += grid(["storage", "tokens", "path", "graph us", "eager us", "eager/graph", "kernels us", "est us",
                     "floor us", "floor/graph", "experts"],
                    [[l.get("storage") or "fp16",
                      f"{l['tokens']}" + (f"/{l['shape_tokens']}" if l.get("shape_tokens") != l["tokens"] else ""),
                      l["path"] + ("*" if l.get("default_path") else ""), fmt(l.get("graph_median_us")),
                      fmt(l.get("eager_median_us")), fmt(l.get("eager_over_graph"), 2), fmt(l.get("kernel_sum_us")),
                      fmt(l.get("est_layer_us")), fmt(l.get("floor_us")), fmt(l.get("floor_fraction"), 3),
                      len(l.get("selected_experts") or [])]
                     for l in fwd])
        kernels: dict[tuple, list[str]] = {}
        for k in pick(lines, "layer", "kernel") + pick(lines, "layer-quant", "kernel"):
            key = (k.get("storage") or "fp16", k["tokens"], k.get("shape_tokens"), k["path"])
            est = f" (est {fmt(k['est_us'])})" if k.get("est_us") is not None else ""
            kernels.setdefault(key, []).append(
                f"{k['symbol'].removeprefix('colibri_')} {fmt(k.get('median_us'))}{est} "
                f"[{k.get('registers')} regs, {k.get('static_shared_bytes')} B smem, "
                f"{k.get('resident_blocks_per_sm')} blocks/SM]")
        if kernels:
            out += ["", "Per kernel, median us (layer 0):"]
            out += [f"  {st} t{t}{'' if s == t else f'/{s}'} {p}: " + " | ".join(v)
                    for (st, t, s, p), v in kernels.items()]
    many = pick(lines, "layers", "forward")
    if many:
        out += ["", "Layer stack at tokens 1"]
        out += grid(["layers", "path", "graph us", "eager us", "eager/graph", "floor us", "floor/graph"],
                    [[l["layers"], l["path"], fmt(l.get("graph_median_us")), fmt(l.get("eager_median_us")),
                      fmt(l.get("eager_over_graph"), 2), fmt(l.get("floor_us")), fmt(l.get("floor_fraction"), 3)]
                     for l in many])
    hf = pick(lines, "transformers", "moe_block")
    if hf:
        out += ["", "transformers MixtralSparseMoeBlock vs colibri (graph), same weights"]
        out += grid(["tokens", "experts impl", "transformers us", "colibri us", "speedup", "rel err", "match"],
                    [[l["tokens"], l.get("experts_implementation") or "default",
                      fmt(l.get("transformers_median_us")), fmt(l.get("colibri_graph_median_us")),
                      fmt(l.get("speedup"), 2), l.get("relative_err"), l.get("match")] for l in hf])
    cases = pick(lines, "correctness", "case", status=None)
    if cases:
        counts = {s: sum(1 for c in cases if c["status"] == s) for s in ("ok", "skip", "fail")}
        out += ["", f"Correctness (tests/gpu, one process per case): {counts['ok']} passed, {counts['skip']} skipped, "
                f"{counts['fail']} failed"]
        out += [f"  {c['status']:<4} {c['case']}: {c.get('reason', '')}" for c in cases if c["status"] != "ok"]
    phases = pick(lines, "check", "phase", status=None)
    if phases:
        out += ["", "Phases"]
        out += grid(["phase", "status", "seconds", "limit s", "rc", "note"],
                    [[p.get("phase_name"), p["status"], p.get("seconds"), p.get("limit_s"), p.get("rc"),
                      p.get("reason", "")] for p in phases])
    problems = [l for l in lines if l.get("status") in ("fail", "skip") and l.get("name") not in ("case", "phase")]
    if problems:
        out += ["", "Failures and skips"]
        out += [f"  {l['status']:<4} {l.get('phase')}/{l.get('name')}: {l.get('reason', '')}" for l in problems]
    return "\n".join(out) + "\n"


def print_table(out: Path) -> int:
    text = render(load(out))
    (out / "table.txt").write_text(text, encoding="utf-8")
    print(text, end="")
    return 0
