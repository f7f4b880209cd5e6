"""The CPU benchmark's MoE layer sections (bench/runtime_cpu_bench.py): one layer of shapes A and B against
transformers' block and a NumPy copy ("moe"), and `Runtime.infer` against `CpuBackend.run_layers` ("overhead")."""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np

from runtime_cpu_system import BLAS_VARS, ROOT, child

# ---- one MoE layer: colibri vs transformers vs a NumPy copy ------------------------------------------------------
SHAPES = {"A": (1024, 2816, 8, 2), "B": (2048, 768, 128, 8)}  # hidden, intermediate, experts, top-k
STORAGES = {"fp32": (0, 0, 0), "fp16": (0, 0, 1), "int8": (1, 0, 1), "int4 g128": (2, 128, 1),
            "int4 g32": (2, 32, 1)}  # quant, group, dtype (int4 g32: llama.cpp Q4_0's group and bits per weight)
MOE_TOKENS = (1, 4, 16, 64)
# Shape A, 1 thread: these storages and token counts again on copies of the files made with shutil.copyfile just
# before the run, so cached in 4 KiB pages (colibri_sdk.format.pages), side by side
SMALL_PAGE_STORAGES, SMALL_PAGE_TOKENS, SMALL = ("fp32", "fp16", "int8", "int4 g128"), (1, 4), " 4KiB"
POOL_BYTES = 1 << 30  # the copy's source: the storage's layer size, at most 1 GiB (L3 here: 480 MiB)
MOE_CHILD = """
import json, sys
sys.path.insert(0, sys.argv[4])
import runtime_cpu_moe as bench
print(json.dumps(bench.moe_child(json.loads(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))))
"""
SEED = 0


def torch_block(shape: str):
    """The transformers block of `shape` with N(0, 1/fan_in) weights from SEED (the same in every process)."""
    import torch
    import transformers

    H, I, E, k = SHAPES[shape]
    torch.manual_seed(SEED)
    if shape == "A":
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock as Block

        config = transformers.MixtralConfig(hidden_size=H, intermediate_size=I, num_local_experts=E,
                                            num_experts_per_tok=k, num_hidden_layers=1, num_attention_heads=8,
                                            num_key_value_heads=8)
    else:
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock as Block

        config = transformers.Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=I, num_experts=E,
                                             num_experts_per_tok=k, norm_topk_prob=True, num_hidden_layers=1,
                                             num_attention_heads=8, num_key_value_heads=8)
    block = Block(config).eval()
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, 1.0 / np.sqrt(p.shape[-1]))
    return block


def moe_header(shape: str, quant: int, group: int, dtype: int):
    from colibri_sdk.format import HeaderV2

    H, I, E, k = SHAPES[shape]
    # A: Mixtral (softmax over the k selected logits); B: Qwen3-MoE (softmax over all, top-k, renormalised).
    routing = dict(routing=0) if shape == "A" else dict(routing=1, norm_topk=1)
    return HeaderV2(num_layers=1, num_experts=E, top_k=k, hidden_size=H, intermediate_size=I, dtype=dtype,
                    composition=0, quant=quant, group_size=group, **routing)


def write_moe_files(folder: Path, shape: str) -> dict[str, Path]:
    """One .colibri file per storage: fp32 and fp16 from the torch block's weights, int8 / int4 random codes."""
    from colibri_sdk.format.quant import QuantizedTensor
    from colibri_sdk.format.writer import ColibriWriter, write_arrays

    block = torch_block(shape)
    H, I, E, k = SHAPES[shape]
    gate_up = block.experts.gate_up_proj.detach().numpy()  # (E, 2I, H), gate rows first
    arrays = {"gate_proj": gate_up[None, :, :I], "up_proj": gate_up[None, :, I:],
              "down_proj": block.experts.down_proj.detach().numpy()[None],
              "router": block.gate.weight.detach().numpy().T[None].copy()}
    paths = {}
    for name, (quant, group, dtype) in STORAGES.items():
        path = paths[name] = folder / f"{shape}-{name.replace(' ', '-')}.colibri"
        header = moe_header(shape, quant, group, dtype)
        if quant == 0:
            write_arrays(path, header, arrays)
            continue
        rng = np.random.default_rng(1)
        lo, hi = (-128, 127) if quant == 1 else (-8, 7)
        with ColibriWriter(path, header) as w:
            for kind, layer, expert in w.pending():
                if kind == "router":
                    w.write(kind, layer, expert, arrays["router"][0])
                    continue
                rows, cols = header.shape(kind)
                codes = rng.integers(lo, hi + 1, (rows, cols), dtype=np.int8)
                groups = 1 if group == 0 else -(-cols // group)
                scale = 3.0 / (np.sqrt(cols) * hi)  # values of about the fp32 weights' size
                scales = (rng.random((rows, groups), dtype=np.float32) * scale + scale / 2).astype(np.float16)
                w.write(kind, layer, expert, QuantizedTensor(codes, scales, None, cols, group, quant))
    del block, gate_up, arrays
    return paths


class _Weights:
    """The part of colibri_sdk.bundle.Bundle that CpuBackend uses, for a bare .colibri file."""

    def __init__(self, path: Path, tokens: int):
        self.path, self.shape, self.manifest = path, (1, tokens), {}

    def open_weights(self):
        from colibri_sdk.format import ColibriFile

        return ColibriFile(self.path)


FLUSH_BYTES = 1 << 30  # read before each timed call: more than the L3 (480 MiB here)
_flush: list = []


def _evict() -> None:
    """Read FLUSH_BYTES of other memory (untimed), so that the next call finds its weights in DRAM, not in the
    cache the previous measurement of the same experts warmed."""
    if not _flush:
        _flush.append(np.ones(FLUSH_BYTES, np.uint8))
    _flush[0].max()


def _fastest(fn, calls: int, evict: bool = False, reset=None) -> float:
    """The fastest of `calls` calls of fn, seconds; before each (untimed): reset() where given, then `_evict()`
    where evict."""
    best = float("inf")
    for _ in range(calls):
        if reset is not None:
            reset()
        if evict:
            _evict()
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def moe_child(paths: dict, rounds: int, calls: int) -> dict:
    """In a process whose BLAS and torch thread counts are set: every (shape, storage, tokens) point, interleaved
    rounds, the fastest call of each; ms, and the selected experts' stored bytes at T=1."""
    import torch

    from colibri_sdk.runtime.cpu_backend import CpuBackend

    threads = int(os.environ.get("OPENBLAS_NUM_THREADS", "1"))
    torch.set_num_threads(threads)
    rng = np.random.default_rng(2)
    points, results, runners = [], {}, {}
    tokens_of = paths.pop("_tokens")
    small_copies = paths.pop("_small", {})
    for shape, files in paths.items():
        H, I, E, k = SHAPES[shape]
        block = torch_block(shape)
        tokens = tokens_of[shape]
        inputs = {t: [rng.standard_normal((1, t, H)).astype(np.float32) for _ in range(8)] for t in tokens}
        for name, path in files.items():
            backends = {t: CpuBackend(_Weights(Path(path), t)) for t in tokens}
            runners[(shape, name)] = (backends, inputs, block if name == "fp32" else None,
                                      min(os.path.getsize(path), POOL_BYTES))
            for t in tokens:
                points.append((shape, name, t))
            backends[tokens[0]]._file.data()[::4096].max()  # read once through a 2 MiB mapping, as Bundle.verify
            if name in small_copies.get(shape, {}):  # a copy of the file, cached in 4 KiB pages
                small = {t: CpuBackend(_Weights(Path(small_copies[shape][name]), t)) for t in SMALL_PAGE_TOKENS}
                runners[(shape, name + SMALL)] = (small, inputs, None, 0)
                points += [(shape, name + SMALL, t) for t in SMALL_PAGE_TOKENS]
        runners[(shape, "copy")] = np.ones(min(os.path.getsize(files["fp32"]), POOL_BYTES), np.uint8)
    diffs = {}
    for shape in paths:  # the fp32 file against the torch block it was written from
        backends, inputs, block, _ = runners[(shape, "fp32")]
        x = inputs[1][0]
        out = np.empty_like(x)
        backends[1].run_layers(x, out, 0, 1)
        with torch.no_grad():
            want = block(torch.from_numpy(x)).numpy()
        diffs[shape] = float(np.abs(out - want).max() / np.abs(want).max())
    for r in range(rounds):
        for shape, name, t in (points if r % 2 == 0 else points[::-1]):
            backends, inputs, block, footprint = runners[(shape, name)]
            backend, out = backends[t], np.empty((1, t, SHAPES[shape][0]), np.float32)
            i = [0]

            def ours():
                i[0] += 1
                backend.run_layers(inputs[t][i[0] % 8], out, 0, 1)

            key = f"{shape}|{name}|{t}"
            entry = results.setdefault(key, {"colibri_ms": float("inf")})
            entry["colibri_ms"] = min(entry["colibri_ms"], _fastest(ours, calls, evict=True) * 1e3)
            if t == 1 and not name.endswith(SMALL):
                selected = int(np.count_nonzero(np.diff(backend._engine.starts)))
                stored = _expert_bytes(backend._engine) * selected
                entry["selected_bytes"] = stored
                pool = runners[(shape, "copy")][:footprint]  # the storage's layer size: the same cache footprint
                dst = np.empty(stored, np.uint8)
                j = [0]

                def copy():
                    j[0] = (j[0] + stored) % max(1, pool.size - stored)
                    np.copyto(dst, pool[j[0]: j[0] + stored])

                copy_ms = _fastest(copy, calls, evict=True) * 1e3
                entry["copy_ms"] = min(entry.get("copy_ms", float("inf")), copy_ms)
                # a read-only pass over as many bytes (BLAS sdot of two halves): the rate a product that only
                # reads its weights could reach, the ceiling of the fp32 ratio to torch at one token
                words = stored // 8
                k = [0]

                def read():
                    k[0] = (k[0] + 8 * words) % max(1, pool.size - 8 * words) // 64 * 64
                    seg = pool[k[0]: k[0] + 8 * words].view(np.float32)
                    np.dot(seg[:words], seg[words:])

                read_ms = _fastest(read, calls, evict=True) * 1e3
                entry["read_ms"] = min(entry.get("read_ms", float("inf")), read_ms)
            if block is not None:
                m = [0]

                def theirs():
                    m[0] += 1
                    with torch.no_grad():
                        block(torch.from_numpy(inputs[t][m[0] % 8]))

                torch_ms = _fastest(theirs, calls, evict=True) * 1e3
                entry["torch_ms"] = min(entry.get("torch_ms", float("inf")), torch_ms)
    huge = {}  # (resident, of which in 2 MiB pages) bytes of each backend's mapping after the calls
    for shape, name, t in points:
        if t == 1 or name.endswith(SMALL):
            backend = runners[(shape, name)][0][t]
            huge[f"{shape}|{name}|{t}"] = backend.mapped_bytes()
    for backends, _, _, _ in (runners[(s, n)] for s, n, _ in points):
        for b in backends.values():
            b.close()
    return {"threads": threads, "points": results, "max_rel_diff_vs_torch": diffs, "mapped_bytes": huge,
            "experts_impl": {s: getattr(runners[(s, "fp32")][2].experts.config, "_experts_implementation", None)
                             for s in paths}}


def _expert_bytes(engine) -> int:
    """Stored bytes of one routed expert (codes, scales, zero points of gate, up and down)."""
    total = 0
    for kind in ("gate_proj", "up_proj", "down_proj"):
        m = engine._layer(0)[kind]
        total += m.codes[0].nbytes
        if m.typed_scales is not None:
            total += m.typed_scales[0].nbytes + (m.zeros[0].nbytes if engine.has_zero else 0)
    return total


def moe_section(tmp: Path, args, say) -> dict:
    import runtime_cpu_llama as llama_peer  # (it imports this module's shapes and timing)
    import torch

    from colibri_sdk.format.pages import drop_cached

    folder = Path(args.moe_files) if args.moe_files else tmp
    folder.mkdir(parents=True, exist_ok=True)
    shapes = args.moe_shapes.split(",")
    peer = llama_peer.setup(folder, shapes)
    paths = {}
    for shape in shapes:
        want = {name: folder / f"{shape}-{name.replace(' ', '-')}.colibri" for name in STORAGES}
        have = all(p.exists() for p in want.values())
        paths[shape] = {k: str(v) for k, v in (want if have else write_moe_files(folder, shape)).items()}
    tokens = {"A": MOE_TOKENS, "B": tuple(int(t) for t in args.moe_b_tokens.split(","))}
    small = {}  # copies made now (copy_file_range: cached in 4 KiB pieces), before the drop below,
    for name in SMALL_PAGE_STORAGES if "A" in paths else ():  # (whose files the copy would read into 4 KiB pages)
        small[name] = str(tmp / f"A-{name.replace(' ', '-')}.cached-4k.colibri")
        shutil.copyfile(paths["A"][name], small[name])
    for files in paths.values():  # read from storage by the backends' own mappings, as after a reboot
        for path in files.values():
            drop_cached(path)
    env_base = {k: v for k, v in os.environ.items() if k not in BLAS_VARS}
    runs = {}
    for threads in (int(t) for t in args.moe_threads.split(",")):
        env = {**env_base, **{k: str(threads) for k in BLAS_VARS[:2]}}
        # 2 threads: shape A only (shape B's layer is 2.4 GB in fp32; one child holds it once)
        wanted = {s: p for s, p in paths.items() if threads == 1 or s == "A"}
        wanted["_tokens"] = {s: tokens[s] for s in wanted}
        if threads == 1 and "A" in wanted:
            wanted["_small"] = {"A": small}
        runs[threads] = child(MOE_CHILD, [json.dumps(wanted), str(args.moe_rounds), str(args.moe_calls),
                                          str(Path(__file__).parent)], env, replace_env=True)
        if "models" in peer:  # right after colibri's child of the same thread count, on the same shapes
            peer["runs"][threads] = llama_peer.measure(peer["models"], wanted["_tokens"], threads, args, env)
    say("")
    say(f"One MoE layer, CpuBackend.run_layers vs transformers' block (torch {torch.__version__}) and a NumPy copy; "
        f"fastest call of {args.moe_rounds} interleaved rounds x {args.moe_calls} calls; A = {SHAPES['A']}, "
        f"B = {SHAPES['B']} (hidden, intermediate, experts, top-k)")
    for threads, run in runs.items():
        say(f"  {threads} thread(s); fp32 output vs torch, max rel diff: "
            + ", ".join(f"{s} {d:.1e}" for s, d in run["max_rel_diff_vs_torch"].items())
            + f"; torch experts implementation: {run['experts_impl']}")
        say(f"    {'shape':<5} {'storage':<10} {'tokens':>6} {'colibri ms':>11} {'torch ms':>9} {'torch/colibri':>14} "
            f"{'GB/s':>7} {'copy GB/s':>10} {'bw/copy':>8} {'read GB/s':>10} {'bw/read':>8} {'fp32/x':>7}")
        for key, p in run["points"].items():
            shape, name, t = key.split("|")
            torch_ms = p.get("torch_ms") or (run["points"].get(f"{shape}|fp32|{t}", {}).get("torch_ms")
                                             if name == "fp32" + SMALL else None)
            ratio = f"{torch_ms / p['colibri_ms']:>13.2f}x" if torch_ms else f"{'':>14}"
            bw = ""
            if "selected_bytes" in p:
                gbs = p["selected_bytes"] / p["colibri_ms"] / 1e6
                copy = p["selected_bytes"] / p["copy_ms"] / 1e6
                read = p["selected_bytes"] / p["read_ms"] / 1e6
                p["bandwidth_ratio"] = gbs / copy
                p["read_ratio"] = gbs / read
                bw = f"{gbs:>7.2f} {copy:>10.2f} {gbs / copy:>7.2f}x {read:>10.2f} {gbs / read:>7.2f}x"
                if torch_ms:
                    p["torch_read_ratio"] = p["selected_bytes"] / torch_ms / 1e6 / read
            else:
                bw = f"{'':>7} {'':>10} {'':>8} {'':>10} {'':>8}"
            fp32 = run["points"][f"{shape}|fp32|{t}"]["colibri_ms"] / p["colibri_ms"]
            say(f"    {shape:<5} {name:<10} {t:>6} {p['colibri_ms']:>11.3f} "
                f"{(f'{torch_ms:.3f}' if torch_ms else ''):>9} {ratio} {bw} {fp32:>6.2f}x")
        for shape in sorted({k.split("|")[0] for k in run["points"]}):
            p = run["points"].get(f"{shape}|fp32|1", {})
            if "torch_read_ratio" in p:
                say(f"    {shape} fp32 T=1: torch reads at {p['torch_read_ratio']:.2f}x the read-only pass, colibri at "
                    f"{p['read_ratio']:.2f}x: a product that reads its weights at the read pass's rate is "
                    f"{1 / p['torch_read_ratio']:.2f}x torch here")
        _say_pages(run, say)
    return {"moe": runs, "llama_cpp_peer": llama_peer.report(peer, runs, say)}


def _say_pages(run: dict, say) -> None:
    """The weights' page size: how much of each file's mapping the kernel mapped in 2 MiB pages, and the rows
    timed again on the copies cached in 4 KiB pages (4 KiB time ÷ 2 MiB time)."""
    huge = run.get("mapped_bytes", {})
    mapped = [(key.split("|")[1], got) for key, got in huge.items() if key.startswith("A|") and key.endswith("|1")]
    if not mapped:
        return
    say("    of the weights the calls touched, in 2 MiB pages (shape A, T=1): "
        + ", ".join(f"{name} {'?' if got is None else f'{got[1] / max(got[0], 1):.0%}'}" for name, got in mapped)
        + "; the 4KiB rows: a copy of each file made with shutil.copyfile just before the run (cached in 4 KiB pages)")
    for name in SMALL_PAGE_STORAGES:
        parts = []
        for t in SMALL_PAGE_TOKENS:
            small, big = run["points"].get(f"A|{name}{SMALL}|{t}"), run["points"].get(f"A|{name}|{t}")
            if small and big:
                parts.append(f"T={t} {small['colibri_ms'] / big['colibri_ms']:.2f}x")
        if parts:
            say(f"    A {name}: 4 KiB pages ÷ 2 MiB pages, time: " + ", ".join(parts))


def overhead_section(tmp: Path, args, say) -> dict:
    """Runtime.infer vs CpuBackend.run_layers at T=1 on shape A fp32 (a CPU bundle by the bundle contract)."""
    sys.path.insert(0, str(ROOT / "tests" / "runtime"))
    from runtime_bundles import write_bundle, write_manifest

    from colibri_sdk.bundle.reader import header_record
    from colibri_sdk.format import ColibriFile
    from colibri_sdk.runtime import Runtime

    folder = Path(args.moe_files) if args.moe_files else tmp
    folder.mkdir(parents=True, exist_ok=True)
    weights = folder / "A-fp32.colibri"
    if not weights.exists():
        write_moe_files(folder, "A")
    bundle = write_bundle(tmp / "bundle-A", weights, 1, 1)
    manifest = json.loads((bundle / "manifest.json").read_text())
    with ColibriFile(bundle / "model.colibri") as f:
        manifest["weights"]["header"] = header_record(f.header)  # the v2 fields too
    write_manifest(bundle, manifest)
    x = np.random.default_rng(3).standard_normal((1, 1, SHAPES["A"][0])).astype(np.float32)
    out = np.empty_like(x)
    best = {"infer": float("inf"), "run_layers": float("inf")}
    with Runtime.load(bundle, backend="cpu", verify=False) as rt:
        backend = rt._backend
        calls = {"infer": lambda: rt.infer(x, out=out), "run_layers": lambda: backend.run_layers(x, out, 0, 1)}
        for r in range(args.moe_rounds * 4):
            for name in (("infer", "run_layers") if r % 2 == 0 else ("run_layers", "infer")):
                best[name] = min(best[name], _fastest(calls[name], args.moe_calls))
    ratio = best["infer"] / best["run_layers"]
    say("")
    say(f"Runtime.infer vs CpuBackend.run_layers, shape A fp32, T=1, fastest of {args.moe_rounds * 4} interleaved "
        f"rounds x {args.moe_calls}: infer {best['infer'] * 1e3:.3f} ms, run_layers {best['run_layers'] * 1e3:.3f} ms, "
        f"{ratio:.3f}x (goal <= 1.1x)")
    return {"overhead": {"infer_ms": best["infer"] * 1e3, "run_layers_ms": best["run_layers"] * 1e3, "ratio": ratio}}
