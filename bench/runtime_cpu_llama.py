"""The CPU benchmark's llama.cpp peer (bench/runtime_cpu_bench.py, section "moe"): llama.cpp's CPU backend on the
MoE layer of shapes A and B with the experts in Q4_0 and Q8_0, beside colibri's int4 and int8 times of the same run.

llama.cpp runs whole models, not one layer, so each point times two one-layer GGUF files written here with gguf-py
and subtracts them: "whole", the experts at the shape's intermediate size, and "tiny", the same model with the
experts' intermediate size TINY_INTERMEDIATE (one quant block; every other tensor the same bytes: embeddings and
output head of VOCAB "no vocab" tokens, one attention head of HEAD_DIM, the router in F32). The MoE layer estimate,
whole - tiny, is the experts' share; what both files share (router product, top-k, attention, norms, the output
head, building the graph) drops out, so the estimate leaves out the router, which colibri's time includes.
Shape A is written as llama.cpp's "llama" architecture with experts (Mixtral), shape B as "qwen3moe": both take
the top-k of a softmax over the experts and renormalise the k weights (build_moe_ffn(..., norm_w = true) in
llama.cpp's src/models/llama.cpp and qwen3moe.cpp), the routing colibri runs on these shapes.

Expert weights are random codes and fp16 scales (as colibri's int8 / int4 files are) in the block layouts of
ggml-common.h: block_q4_0 is d (fp16), then 16 bytes, byte j holding element j in its low nibble and element j + 16
in its high nibble, value (nibble - 8) * d; block_q8_0 is d, then 32 int8 codes, value code * d.

Timing, in a child process per thread count through llama-cpp-python's low-level API: one llama_batch of T tokens
(ids 0 .. T-1, positions 0 .. T-1, logits requested for every token, so that the layer's FFN runs on all T rather
than on the output rows only), n_threads = n_threads_batch = the bench's thread count, the KV cache cleared before
each call (llama_memory_clear: every call the same work), runtime_cpu_moe's 1 GiB read before each call (untimed),
interleaved rounds in alternating order, the fastest call per point.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np

from runtime_cpu_moe import SHAPES, SEED

ARCH = {"A": "llama", "B": "qwen3moe"}  # the llama.cpp architecture of each shape
GGUF_TYPES = ("Q4_0", "Q8_0")
# colibri's storage of the same run beside each GGUF type (Q4_0 is int4 in groups of 32 with fp16 scales)
COLIBRI_PEERS = {"Q4_0": ("int4 g32", "int4 g128"), "Q8_0": ("int8",)}
TINY_INTERMEDIATE = 32  # one Q4_0 / Q8_0 block: the narrowest expert whose down_proj rows llama.cpp can quantize
VOCAB = 64  # token ids 0 .. 63: up to 64 distinct tokens in one batch
HEAD_DIM = 32  # one attention head (and one KV head) of this size; the rope covers all of it
CONTEXT = 256  # n_ctx; every batch starts at position 0
LLAMA_CHILD = """
import json, sys
sys.path.insert(0, sys.argv[5])
import runtime_cpu_llama as peer
print(json.dumps(peer.llama_child(json.loads(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))))
"""


def unavailable() -> str | None:
    """Why the peer cannot run here (a module that is not importable), or None."""
    missing = [name for name in ("llama_cpp", "gguf") if importlib.util.find_spec(name) is None]
    if missing:
        return (f"{', '.join(missing)} not importable; `pip freeze > c.txt && pip install -c c.txt "
                f"llama-cpp-python gguf` builds llama.cpp from source, keeping the installed versions")
    return None


# ---- the GGUF files ----------------------------------------------------------------------------------------------
def quant_blocks(codes: np.ndarray, scales: np.ndarray, qtype: str) -> np.ndarray:
    """Pack codes and scales into GGML blocks (layout: the module's docstring).

    Args:
        codes: (..., cols) int8; Q4_0 codes in [-8, 7], Q8_0 in [-128, 127]; cols a multiple of the block size (32).
        scales: (..., cols / 32) float16, one per block.
        qtype: "Q4_0" or "Q8_0".

    Returns:
        (..., cols / 32 * block bytes) uint8, what gguf.GGUFWriter.add_tensor takes with raw_dtype = qtype.
    """
    import gguf

    block, nbytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]]
    *lead, cols = codes.shape
    blocks = codes.reshape(*lead, cols // block, block)
    out = np.empty((*lead, cols // block, nbytes), np.uint8)
    out[..., :2] = scales.astype(np.float16).view(np.uint8).reshape(*lead, cols // block, 2)
    if qtype == "Q8_0":
        out[..., 2:] = blocks.view(np.uint8)
    else:
        nibbles = (blocks + 8).astype(np.uint8)
        out[..., 2:] = nibbles[..., : block // 2] | (nibbles[..., block // 2:] << 4)
    return out.reshape(*lead, -1)


def _random_quant(rng, experts: int, rows: int, cols: int, qtype: str) -> np.ndarray:
    """(experts, rows, cols) weights of random codes and scales about N(0, 1/cols) in size, packed per expert."""
    import gguf

    block, nbytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]]
    hi = 7 if qtype == "Q4_0" else 127
    scale = 3.0 / (np.sqrt(cols) * hi)  # the scales of runtime_cpu_moe.write_moe_files
    out = np.empty((experts, rows, cols // block * nbytes), np.uint8)
    for e in range(experts):
        codes = rng.integers(-hi - 1, hi + 1, (rows, cols), dtype=np.int8)
        scales = rng.random((rows, cols // block), dtype=np.float32) * scale + scale / 2
        out[e] = quant_blocks(codes, scales, qtype)
    return out


def write_gguf(path: Path, shape: str, qtype: str, intermediate: int) -> Path:
    """A one-layer MoE model of `shape` that llama.cpp loads: experts (gate, up, down) of `intermediate` in `qtype`,
    the router, norms and embeddings in F32, attention in Q8_0. Tensors other than the experts come from one seed,
    so files of one shape differ only in the experts. Raises what gguf.GGUFWriter raises (OSError, ValueError)."""
    import gguf

    H, _, E, k = SHAPES[shape]
    arch = ARCH[shape]
    q8 = gguf.GGMLQuantizationType.Q8_0
    rng = np.random.default_rng(SEED)

    def name(tensor: gguf.MODEL_TENSOR) -> str:
        return gguf.TENSOR_NAMES[tensor].format(bid=0) + ".weight"

    T = gguf.MODEL_TENSOR
    ones = {t: np.ones(n, np.float32) for t, n in ((T.OUTPUT_NORM, H), (T.ATTN_NORM, H), (T.FFN_NORM, H))}
    if arch == "qwen3moe":
        ones.update({T.ATTN_Q_NORM: np.ones(HEAD_DIM, np.float32), T.ATTN_K_NORM: np.ones(HEAD_DIM, np.float32)})
    tensors = [(name(t), a, None) for t, a in ones.items()]
    tensors.append((name(T.TOKEN_EMBD), rng.standard_normal((VOCAB, H), dtype=np.float32), None))
    for t in (T.ATTN_Q, T.ATTN_K, T.ATTN_V):
        tensors.append((name(t), _random_quant(rng, 1, HEAD_DIM, H, "Q8_0")[0], q8))
    tensors.append((name(T.ATTN_OUT), _random_quant(rng, 1, H, HEAD_DIM, "Q8_0")[0], q8))
    router = (rng.standard_normal((E, H), dtype=np.float32) / np.sqrt(H)).astype(np.float32)
    tensors.append((name(T.FFN_GATE_INP), router, None))
    experts = np.random.default_rng(SEED + 1)
    qt = gguf.GGMLQuantizationType[qtype]
    for t, rows, cols in ((T.FFN_GATE_EXP, intermediate, H), (T.FFN_UP_EXP, intermediate, H),
                          (T.FFN_DOWN_EXP, H, intermediate)):
        tensors.append((name(t), _random_quant(experts, E, rows, cols, qtype), qt))

    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"colibri bench MoE layer {shape}")
    w.add_context_length(CONTEXT)
    w.add_embedding_length(H)
    w.add_block_count(1)
    w.add_feed_forward_length(intermediate)  # the experts' width for "llama"
    w.add_expert_feed_forward_length(intermediate)  # and for "qwen3moe"
    w.add_head_count(1)
    w.add_head_count_kv(1)
    w.add_key_length(HEAD_DIM)
    w.add_value_length(HEAD_DIM)
    w.add_rope_dimension_count(HEAD_DIM)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_expert_count(E)
    w.add_expert_used_count(k)
    w.add_vocab_size(VOCAB)
    w.add_tokenizer_model("none")  # llama.cpp's LLAMA_VOCAB_TYPE_NONE: VOCAB dummy tokens, no tokenizer
    for tensor_name, data, raw in tensors:
        w.add_tensor(tensor_name, data, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def write_models(folder: Path, shapes: list[str]) -> dict:
    """{"shape|type": {"whole": path, "tiny": path}} for every shape and GGUF type; files in `folder` are reused."""
    models = {}
    for shape in shapes:
        for qtype in GGUF_TYPES:
            files = {}
            for variant, width in (("whole", SHAPES[shape][1]), ("tiny", TINY_INTERMEDIATE)):
                path = folder / f"{shape}-{qtype}-i{width}.gguf"
                files[variant] = str(path if path.exists() else write_gguf(path, shape, qtype, width))
            models[f"{shape}|{qtype}"] = files
    return models


# ---- the child: load, decode, time ------------------------------------------------------------------------------
_log_keep: list = []  # the log callback, kept alive while llama.cpp holds it


def _quiet_llama(errors: list[str]):
    """llama_cpp with its log routed into `errors` (error lines only), its backend initialised."""
    import llama_cpp

    @llama_cpp.llama_log_callback
    def log(level, text, _user):
        if level == 4:  # GGML_LOG_LEVEL_ERROR (llama.cpp's ggml.h: NONE, DEBUG, INFO, WARN, ERROR, CONT)
            errors.append(text.decode("utf-8", "replace").strip())

    _log_keep.append(log)
    llama_cpp.llama_log_set(log, None)
    llama_cpp.llama_backend_init()
    return llama_cpp


def _open(llama_cpp, path: str, threads: int, tokens: int, errors: list[str]):
    """(model, context) of one GGUF file on the CPU, for batches of up to `tokens`; raises RuntimeError with the
    error lines llama.cpp logged."""
    start = len(errors)
    mparams = llama_cpp.llama_model_default_params()
    mparams.n_gpu_layers = 0
    model = llama_cpp.llama_model_load_from_file(path.encode(), mparams)
    if not model:
        raise RuntimeError(f"llama_model_load_from_file({Path(path).name}) returned NULL: "
                           f"{'; '.join(errors[start:]) or 'no message'}")
    cparams = llama_cpp.llama_context_default_params()
    cparams.n_ctx, cparams.n_batch, cparams.n_ubatch = max(CONTEXT, tokens), tokens, tokens
    cparams.n_seq_max = 1
    cparams.n_threads = cparams.n_threads_batch = threads
    cparams.no_perf = True
    ctx = llama_cpp.llama_init_from_model(model, cparams)
    if not ctx:
        llama_cpp.llama_model_free(model)
        raise RuntimeError(f"llama_init_from_model({Path(path).name}) returned NULL: "
                           f"{'; '.join(errors[start:]) or 'no message'}")
    return model, ctx


def llama_child(models: dict, threads: int, rounds: int, calls: int) -> dict:
    """In a child process: every (shape|type, variant, tokens) point, `rounds` interleaved rounds of `calls` calls,
    the fastest of each, ms. models: {"shape|type": {"whole": path, "tiny": path, "tokens": [T, ...]}}.
    Returns {"points": {"shape|type|variant|T": ms}, "skipped": {"shape|type": reason}, "system_info": str,
    "load_average": the 1-minute load average at the end}."""
    from runtime_cpu_moe import _fastest

    errors: list[str] = []
    llama_cpp = _quiet_llama(errors)
    most = max(max(m["tokens"]) for m in models.values())
    batch = llama_cpp.llama_batch_init(most, 0, 1)
    for i in range(most):
        batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = i % VOCAB, i, 1, 1
        batch.seq_id[i][0] = 0
    opened, skipped, points = {}, {}, []
    for key, spec in models.items():
        try:
            for variant in ("whole", "tiny"):
                opened[(key, variant)] = _open(llama_cpp, spec[variant], threads, most, errors)
        except RuntimeError as e:
            skipped[key] = str(e)
            continue
        points += [(key, variant, t) for variant in ("whole", "tiny") for t in spec["tokens"]]

    def call(ctx, t: int) -> None:
        batch.n_tokens = t
        start = len(errors)
        rc = llama_cpp.llama_decode(ctx, batch)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc} at {t} tokens: {'; '.join(errors[start:]) or 'no message'}")
        llama_cpp.llama_synchronize(ctx)

    for key, variant, t in list(points):  # a first call each (graph, buffers, the Q4_0 repack)
        ctx = opened[(key, variant)][1]
        try:
            llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(ctx), True)
            call(ctx, t)
        except RuntimeError as e:
            skipped[key] = str(e)
    points = [p for p in points if p[0] not in skipped]
    best: dict[str, float] = {}
    for r in range(rounds):
        for key, variant, t in (points if r % 2 == 0 else points[::-1]):
            ctx = opened[(key, variant)][1]
            memory = llama_cpp.llama_get_memory(ctx)
            ms = _fastest(lambda: call(ctx, t), calls, evict=True,
                          reset=lambda: llama_cpp.llama_memory_clear(memory, True)) * 1e3
            name = f"{key}|{variant}|{t}"
            best[name] = min(best.get(name, float("inf")), ms)
    for model, ctx in opened.values():
        llama_cpp.llama_free(ctx)
        llama_cpp.llama_model_free(model)
    llama_cpp.llama_batch_free(batch)
    return {"points": best, "skipped": skipped, "load_average": os.getloadavg()[0],
            "system_info": llama_cpp.llama_print_system_info().decode("utf-8", "replace").strip()}


def setup(folder: Path, shapes: list[str]) -> dict:
    """{"version": llama-cpp-python's, "models": write_models(...), "runs": {}}, or {"skipped": reason} where
    llama_cpp or gguf is not importable or the files cannot be written."""
    reason = unavailable()
    if reason:
        return {"skipped": reason}
    try:
        models = write_models(folder, shapes)
    except (OSError, ValueError, KeyError, AttributeError) as e:  # a gguf-py without these keys or types
        return {"skipped": f"writing the GGUF files failed: {type(e).__name__}: {e}"}
    return {"version": llama_cpp_version(), "models": models, "runs": {},
            "file_bytes": {f"{key}|{variant}": os.path.getsize(path) for key, files in models.items()
                           for variant, path in files.items()}}


def measure(models: dict, tokens: dict, threads: int, args, env: dict) -> dict:
    """Run llama_child for `threads` in a fresh process (environment `env`) on the shapes of `tokens`
    ({shape: (T, ...)}). A child that fails (llama.cpp aborts on some malformed models) is reported, not raised:
    {"skipped": reason}."""
    wanted = {key: {**files, "tokens": list(tokens[key.split("|")[0]])}
              for key, files in models.items() if key.split("|")[0] in tokens}
    out = subprocess.run([sys.executable, "-c", LLAMA_CHILD, json.dumps(wanted), str(threads), str(args.moe_rounds),
                          str(args.moe_calls), str(Path(__file__).parent)],
                         capture_output=True, text=True, env=env, check=False)
    lines = out.stdout.strip().splitlines()
    if out.returncode != 0 or not lines:
        tail = " | ".join(out.stderr.strip().splitlines()[-3:])
        how = f"exited with {out.returncode}"
        if out.returncode < 0:  # killed by a signal: name it (SIGILL: llama.cpp built for instructions this CPU,
            how = f"was killed by {signal.Signals(-out.returncode).name}"  # or its kernel, does not run)
        return {"skipped": f"the llama.cpp child {how}: {tail or 'no message'}"}
    return json.loads(lines[-1])


# ---- the report ---------------------------------------------------------------------------------------------------
def report(peer: dict, runs: dict, say) -> dict:
    """Print the peer's table beside colibri's times of the same run (`runs`: moe_child's result per thread count)
    and return the peer's record for --json, with per thread count {"shape|type|T": {"whole_ms", "tiny_ms",
    "moe_estimate_ms", "colibri": {storage: {"colibri_ms", "whole_ratio", "estimate_ratio"}}}}; ratios llama.cpp
    time ÷ colibri time."""
    if "skipped" in peer:
        say(f"  llama.cpp peer: skipped ({peer['skipped']})")
        return peer
    info = next((r["system_info"] for r in peer["runs"].values() if "system_info" in r), "")
    say("")
    say(f"llama.cpp peer: llama-cpp-python {peer['version']}, llama.cpp's CPU backend ({info})")
    say(f"  one-layer GGUF files, the experts in Q4_0 / Q8_0 (random codes), timed as colibri above (interleaved "
        f"rounds, fastest call, 1 GiB read before each call), each in its own process after colibri's of the same "
        f"thread count. whole ms: llama_decode of T tokens by the whole model (attention of one head of "
        f"{HEAD_DIM}, a {VOCAB}-token head, the router, the experts); tiny ms: the same model with experts of "
        f"intermediate {TINY_INTERMEDIATE}; MoE est = whole - tiny, an estimate of the experts' time (the router's "
        f"product drops out with the rest). Ratios: llama.cpp time ÷ colibri time (> 1: colibri faster)")
    table = {}
    for threads, run in peer["runs"].items():
        if "points" not in run:
            say(f"  {threads} thread(s): skipped ({run['skipped']})")
            continue
        for key, reason in run["skipped"].items():
            say(f"  {threads} thread(s), {key.replace('|', ' ')}: skipped ({reason})")
        say(f"  {threads} thread(s); load average {run['load_average']:.1f} at the end")
        say(f"    {'shape':<5} {'tokens':>6} {'GGUF':<5} {'whole ms':>9} {'tiny ms':>8} {'MoE est':>8}   "
            f"{'colibri':<10} {'ms':>8} {'whole/colibri':>14} {'est/colibri':>12}")
        rows = table[threads] = {}
        colibri = runs[threads]["points"]
        wholes = sorted((n.split("|") for n in run["points"] if n.split("|")[2] == "whole"),
                        key=lambda p: (p[0], int(p[3]), p[1]))
        for shape, qtype, _, t in wholes:
            whole = run["points"][f"{shape}|{qtype}|whole|{t}"]
            tiny = run["points"][f"{shape}|{qtype}|tiny|{t}"]
            row = rows[f"{shape}|{qtype}|{t}"] = {"whole_ms": whole, "tiny_ms": tiny, "moe_estimate_ms": whole - tiny,
                                                   "colibri": {}}
            lead = f"    {shape:<5} {t:>6} {qtype:<5} {whole:>9.3f} {tiny:>8.3f} {whole - tiny:>8.3f}   "
            for storage in COLIBRI_PEERS[qtype]:
                ours = colibri.get(f"{shape}|{storage}|{t}", {}).get("colibri_ms")
                if ours is None:
                    continue
                row["colibri"][storage] = {"colibri_ms": ours, "whole_ratio": whole / ours,
                                           "estimate_ratio": (whole - tiny) / ours}
                say(f"{lead}{storage:<10} {ours:>8.3f} {whole / ours:>13.2f}x {(whole - tiny) / ours:>11.2f}x")
                lead = " " * len(lead)
        if any(row["moe_estimate_ms"] <= 0 for row in rows.values()):
            say("    (an estimate <= 0: the tiny model's fastest call was no faster than the whole's, the machine's "
                "noise larger than the layer; rerun on a quieter machine)")
    return {key: value for key, value in peer.items() if key != "models"} | {"table": table}


def llama_cpp_version() -> str:
    """The installed llama-cpp-python's version (the llama.cpp it vendors is listed in its CHANGELOG)."""
    try:
        return importlib.metadata.version("llama_cpp_python")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"

