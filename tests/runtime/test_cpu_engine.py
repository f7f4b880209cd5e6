"""The CPU backend's engine (sdk/runtime/cpu_engine.py, kernels in cpu_kernels.py) against the float64 reference
engine, the oracle: every storage (fp32, fp16, int8 per row and grouped, int4 grouped, zero points) with and
without every v2 feature (routing variants, group-limited selection, router / correction / expert biases, shared
experts with their gate, clamped SwiGLU, routed scaling, a layer map), at token counts on both paths (the
compiled per-expert kernel and BLAS); v1 files with a float16 router; the exact float16 widening;
a corrupted tensor named by a FormatError.
"""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

from colibri_sdk import blas
from colibri_sdk.blas import LazyBlasThreads
from colibri_sdk.errors import FormatError
from colibri_sdk.format import ColibriFile, Header, HeaderV2, write_model
from colibri_sdk.format.quant import QuantizedTensor, quantize_rtn
from colibri_sdk.format.writer import write_arrays
from colibri_sdk.reference import ReferenceEngine
from colibri_sdk.runtime import cpu_jit, cpu_kernels
from colibri_sdk.runtime.cpu_engine import CpuEngine

BASE = dict(num_layers=2, num_experts=4, top_k=2, hidden_size=70, intermediate_size=45, routing=0, composition=1)
FEATURES = dict(
    routing=2, norm_topk=1, n_group=2, topk_group=1, group_score=2, router_bias=1, correction_bias=1,
    num_shared_experts=2, shared_intermediate_size=33, shared_gate=1, expert_bias=1, activation=1, swiglu_limit=7.0,
    swiglu_alpha=1.702, routed_scaling_factor=2.5, num_model_layers=4, layer_map=(1, 3),
)
# (dtype, quant, group size, zero points): the float dtype is the scales' for int8 / int4
STORAGES = [(0, 0, 0, 0), (1, 0, 0, 0), (1, 1, 0, 0), (0, 1, 32, 0), (1, 1, 64, 1), (1, 1, 128, 0),
            (1, 2, 32, 0), (0, 2, 64, 1), (1, 2, 128, 1)]
BLAS_TEST_PAIRS = 16  # blas_pairs set this low: some experts of the last token count take the BLAS path
TOKENS = (1, 5, 3 * BLAS_TEST_PAIRS)


def write_v2(path, fields, rng, spread=1 / 3):
    """A v2 file with N(0, spread^2) weights; with zero points, RTN codes and scales and random zero points."""
    h = HeaderV2(**fields)
    arrays = {}
    for kind in h.kinds:
        lead = (h.num_layers, h.count(kind)) if h.is_matrix(kind) else (h.num_layers,)
        arrays[kind] = (rng.standard_normal(lead + h.shape(kind)) * spread).astype(np.float32)
    if h.zero_points:
        scale_dtype = np.float16 if h.dtype == 1 else np.float32
        for kind in [k for k in arrays if h.is_matrix(k)]:
            tensors = []
            for layer in arrays[kind]:
                row = []
                for w in layer:
                    t = quantize_rtn(w, h.quant, h.group_size, scale_dtype)
                    zeros = rng.integers(-3, 4, t.scales.shape).astype(np.int8)
                    row.append(QuantizedTensor(t.codes, t.scales, zeros, t.cols, t.group_size, t.quant))
                tensors.append(row)
            arrays[kind] = tensors
    write_arrays(path, h, arrays)
    return path


def run_engine(path, x, blas_pairs=None, threads=1):
    with ColibriFile(path) as model:
        engine = CpuEngine(model, x.shape[0])
        engine.threads = threads
        if blas_pairs is not None:
            engine.blas_pairs = blas_pairs
        engine.warm_up()
        out = np.full_like(x, np.nan)
        with LazyBlasThreads(x.shape[0]) as engine.blas:  # as CpuBackend runs it (colibri_sdk.blas)
            engine.run_into(x, out, 0, model.header.num_layers)
        del engine
    return out


@pytest.mark.parametrize("variable", [None, "OMP_NUM_THREADS"])
def test_blas_path_experts_split_between_threads_only_with_one_blas_thread(tmp_path, monkeypatch, variable):
    """Experts on the BLAS path go to the call's threads only where each product runs on one BLAS thread (no thread
    variable set): a variable keeps the library's own threads, and several of those products at once from two
    threads stalled OpenBLAS for seconds. Either way the values are the reference's."""
    for name in blas.ENV_VARS:
        monkeypatch.delenv(name, raising=False)
    if variable:
        monkeypatch.setenv(variable, "2")
    split = []
    real = CpuEngine._threaded

    def spy(self, chosen, counts, out, work):
        split.append(bool((counts[chosen] >= self.blas_pairs).all()))
        return real(self, chosen, counts, out, work)

    monkeypatch.setattr(CpuEngine, "_threaded", spy)
    rng = np.random.default_rng(5)
    path = write_v2(tmp_path / "m.colibri", dict(BASE, dtype=1), rng)
    x = rng.standard_normal((3 * BLAS_TEST_PAIRS, BASE["hidden_size"])).astype(np.float32)
    want = ReferenceEngine(path, compute_dtype=np.float64)(x)
    got = run_engine(path, x, blas_pairs=1, threads=2)  # every expert of the call on the BLAS path
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5 * float(np.abs(want).max()))
    assert (True in split) is (variable is None), split


def assert_matches_reference(path, x):
    """The engine on one thread at its own BLAS limit (the compiled kernel up to BLAS_PAIRS pairs) and, at 3 *
    BLAS_TEST_PAIRS tokens, on three threads (the experts split between them) and with blas_pairs BLAS_TEST_PAIRS
    (some experts through BLAS), on one thread and on three (those experts split between them too), against the
    reference."""
    want = ReferenceEngine(path, compute_dtype=np.float64)(x)
    runs = [(None, 1)] + ([(None, 3), (BLAS_TEST_PAIRS, 1), (BLAS_TEST_PAIRS, 3)]
                          if x.shape[0] >= 3 * BLAS_TEST_PAIRS else [])
    for blas_pairs, threads in runs:
        got = run_engine(path, x, blas_pairs, threads)
        assert got.dtype == np.float32
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5 * float(np.abs(want).max()))


@pytest.mark.parametrize("features", [False, True], ids=["plain", "v2-features"])
@pytest.mark.parametrize("dtype,quant,group,zeros", STORAGES,
                         ids=[f"{'fp16' if d else 'fp32'}-{('float', 'int8', 'int4')[q]}-g{g}{'-zp' if z else ''}"
                              for d, q, g, z in STORAGES])
def test_every_storage_and_feature_matches_the_float64_reference(tmp_path, features, dtype, quant, group, zeros):
    rng = np.random.default_rng(quant * 100 + group + zeros)
    fields = dict(BASE, dtype=dtype, quant=quant, group_size=group, zero_points=zeros, **(FEATURES if features else {}))
    path = write_v2(tmp_path / "m.colibri", fields, rng)
    for tokens in TOKENS:
        assert_matches_reference(path, rng.standard_normal((tokens, BASE["hidden_size"])).astype(np.float32))


@pytest.mark.parametrize("cpu,features,hardware", [("generic", None, False), ("x86-64", "+avx,+f16c", True),
                                                    ("x86-64", "+avx", False)])
def test_a_named_numba_target_decides_the_float16_widening(monkeypatch, cpu, features, hardware):
    """NUMBA_CPU_NAME / NUMBA_CPU_FEATURES (a portable cache, an older CPU) choose the hardware float16 conversion
    only where the named target has F16C: hardware conversion for a target without it made LLVM call
    __extendhfsf2, which numba's JIT does not link, and the process aborted."""
    import platform

    from numba.core import config

    if platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("aarch64 converts float16 in hardware on every target (FCVT); the rule is x86's")
    monkeypatch.setattr(config, "CPU_NAME", cpu)
    monkeypatch.setattr(config, "CPU_FEATURES", "" if features is None else features)
    assert cpu_kernels.f16_hardware() is hardware


def test_the_kernels_compile_and_widen_float16_for_the_generic_target(tmp_path):
    """A process with NUMBA_CPU_NAME=generic (no F16C) compiles the float16 widening and gets exact values."""
    import subprocess
    import sys

    code = (
        "import numpy as np\n"
        "from colibri_sdk.runtime import cpu_kernels\n"
        "assert not cpu_kernels.f16_hardware()\n"
        "h = np.array([0, 1, 0x3C00, 0x7BFF, 0x7C00, 0xFC00, 0x8001, 0x3555], np.uint16)\n"
        "out = np.zeros(len(h), np.float32)\n"
        "cpu_kernels._f16_into(h, out)\n"
        "assert np.array_equal(out, h.view(np.float16).astype(np.float32)), out\n"
        "print('ok')\n"
    )
    env = dict(os.environ, NUMBA_CPU_NAME="generic", NUMBA_CACHE_DIR=str(tmp_path))
    env.pop("NUMBA_CPU_FEATURES", None)
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


@pytest.mark.parametrize("group,zeros", [(64, 1), (128, 0), (128, 1)], ids=["g64-zp", "g128", "g128-zp"])
def test_int4_in_integers_matches_the_float64_reference_through_the_engine(tmp_path, group, zeros):
    """int4 experts whose sizes fit the integer path (hidden 256, intermediate 384: whole groups of 64 and 128), at 1,
    2, 3 and 48 tokens (every expert below 64 pairs multiplies its codes as stored there: `direct_tokens`; at 48
    also on three threads and with some experts through BLAS), through the engine against the float64 reference,
    two layers; weights N(0, 1 / hidden) so the values keep their scale layer to
    layer. On an AVX2 target the gate and up products of these inputs are multiplied in integers (asserted: the
    sizes fit and the first layer's inputs are prepared)."""
    from colibri_sdk.runtime import cpu_direct, cpu_q4_integer

    rng = np.random.default_rng(group + zeros)
    hidden, inter = 256, 384
    fields = dict(BASE, hidden_size=hidden, intermediate_size=inter, dtype=1, quant=2, group_size=group,
                  zero_points=zeros)
    path = write_v2(tmp_path / "m.colibri", fields, rng, spread=hidden ** -0.5)
    avx2 = cpu_q4_integer.avx2_target()
    for cols in (hidden, inter):
        assert cpu_direct._q4_integer_fit(np.uint64(group // 2), np.uint64(cols)) == avx2
    assert cpu_direct.direct_tokens(cpu_kernels.STORE_Q4, group, hidden, inter) == (
        cpu_direct.DIRECT_TOKENS if avx2 else cpu_direct.Q4_FLOAT_TOKENS)
    for tokens in (1, 2, 3, 48):
        x = rng.standard_normal((tokens, hidden)).astype(np.float32)
        groups = hidden // group
        prepared = cpu_q4_integer._prepare_pieces(
            x, np.arange(tokens, dtype=np.int64), tokens, hidden, group, np.zeros((tokens, hidden * 3), np.int8),
            np.zeros((tokens, groups * cpu_q4_integer.SUM_VECTORS * cpu_q4_integer.LANES), np.int32),
            np.zeros((tokens, groups), np.float32))
        assert prepared == 0  # every row held
        assert_matches_reference(path, x)


def test_more_rows_than_the_engine_was_made_for_is_an_input_error(tmp_path):
    """The engine's scratch is sized at load for `rows`; a call with more rows raised nothing and wrote past it
    (a crash in the garbage collector afterwards)."""
    from colibri_sdk.errors import InputError

    path = write_v2(tmp_path / "m.colibri", dict(BASE), np.random.default_rng(9))
    with ColibriFile(path) as f:
        engine = CpuEngine(f, 4)
        x = np.ones((5, BASE["hidden_size"]), np.float32)
        with pytest.raises(InputError, match="5 input rows; this CPU engine was made for at most 4"):
            engine.run_into(x, np.empty_like(x), 0, 1)


@pytest.mark.parametrize("zeros", [0, 1], ids=["symmetric", "zero-points"])
@pytest.mark.parametrize("tokens,outliers", [(3, 1), (14, 1), (40, 1), (40, 6)])
def test_int4_inputs_the_integer_path_declines_take_the_float_kernel_or_decoded_rows(tmp_path, tokens, outliers,
                                                                                    zeros):
    """Input rows the integer path cannot hold (one value 1e4 times the others in `outliers` tokens): at 3 tokens
    the float kernel serves every row; at 14 (about 7 an expert) up to Q4_FLOAT_TOKENS of them take the float
    kernel, each alone, the other tokens staying in integers; at 40 (about 20 an expert, above MIXED_TOKENS) an
    expert declines to decoded rows (where the float kernel is slower). Against the float64 reference."""
    from colibri_sdk.runtime import cpu_q4_integer

    rng = np.random.default_rng(tokens + zeros + outliers - 1)
    hidden, inter = 256, 384
    fields = dict(BASE, hidden_size=hidden, intermediate_size=inter, dtype=1, quant=2, group_size=128,
                  zero_points=zeros)
    path = write_v2(tmp_path / "m.colibri", fields, rng, spread=hidden ** -0.5)
    x = rng.standard_normal((tokens, hidden)).astype(np.float32)
    x[1: 1 + outliers, 7] = 1e4
    not_held = cpu_q4_integer._prepare_pieces(
        x, np.arange(tokens, dtype=np.int64), tokens, hidden, 128, np.zeros((tokens, hidden * 3), np.int8),
        np.zeros((tokens, 2 * cpu_q4_integer.SUM_VECTORS * cpu_q4_integer.LANES), np.int32),
        np.zeros((tokens, 2), np.float32))
    assert not_held == outliers
    assert_matches_reference(path, x)


@pytest.mark.parametrize("quant,group", [(1, 64), (2, 128)], ids=["int8-g64", "int4-g128"])
def test_shared_experts_of_64_tokens_and_more_take_the_decoded_rows(tmp_path, quant, group):
    """Every int8 expert, and int4 in integers, below 64 pairs multiplies its codes as stored (`direct_tokens`);
    shared experts run on every token through the same compiled call, so at 70 tokens they take the decoded rows
    (`_row_block`), against the float64 reference."""
    from colibri_sdk.runtime import cpu_direct

    rng = np.random.default_rng(quant + group)
    fields = dict(BASE, hidden_size=128, intermediate_size=64, dtype=1, quant=quant, group_size=group, **FEATURES)
    fields.update(shared_intermediate_size=128)
    path = write_v2(tmp_path / "m.colibri", fields, rng, spread=128 ** -0.5)
    store = cpu_kernels.STORE_Q8 if quant == 1 else cpu_kernels.STORE_Q4
    assert cpu_direct.direct_tokens(store, group, 128, 128) < 70  # the shared experts' sizes
    assert_matches_reference(path, rng.standard_normal((70, 128)).astype(np.float32))


@pytest.mark.parametrize("routing", [0, 1])
@pytest.mark.parametrize("dtype", [0, 1], ids=["fp32", "fp16"])
def test_v1_files_match_the_reference(tmp_path, dtype, routing):
    """v1: the router in the file's dtype (float16 read as stored: cpu_routing.logits_into), sequential layers."""
    rng = np.random.default_rng(dtype * 2 + routing)
    L, E, k, H, I = 2, 6, 2, 48, 40
    h = Header(num_layers=L, num_experts=E, top_k=k, hidden_size=H, intermediate_size=I, dtype=dtype,
               routing=routing, composition=0)
    path = write_model(tmp_path / "m.colibri", h, rng.standard_normal((L, E, I, H)) / np.sqrt(H),
                       rng.standard_normal((L, E, I, H)) / np.sqrt(H), rng.standard_normal((L, E, H, I)) / np.sqrt(I),
                       rng.standard_normal((L, H, E)))
    for tokens in TOKENS:
        assert_matches_reference(path, rng.standard_normal((tokens, H)).astype(np.float32))


def test_float16_widening_is_exact():
    """Every float16 bit pattern (normals, subnormals, signed zeros, Inf) widens as NumPy's cast does, NaN stays
    NaN: the engine's conversion and both of its variants (hardware `fpext`, integer operations)."""
    from numba import njit

    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    want = bits.view(np.float16).astype(np.float32)
    nan = np.isnan(want)
    convert = [cpu_kernels._f16_into]
    for hardware in (True, False):
        if hardware and not cpu_kernels.f16_hardware():
            continue  # LLVM would call __extendhfsf2 here, which the JIT does not link
        value = cpu_kernels.make_f16_value(hardware)

        def into(src, buf, value=value):
            for c in range(src.shape[0]):
                buf[c] = value(src[c])
        convert.append(njit(into))
    for fn in convert:
        out = np.empty(bits.size, np.float32)
        fn(bits, out)
        np.testing.assert_array_equal(out[~nan].view(np.uint32), want[~nan].view(np.uint32))
        assert np.isnan(out[nan]).all()


def test_int4_rows_decode_to_the_exact_dequantization():
    """rows_into on int4 codes with zero points, a partial last group and an odd column count equals
    colibri_sdk.format.quant.dequantize bit for bit."""
    rng = np.random.default_rng(3)
    rows, cols, group = 5, 77, 32
    t = quantize_rtn(rng.standard_normal((rows, cols)).astype(np.float32), 2, group, np.float16)
    zeros = rng.integers(-8, 8, t.scales.shape).astype(np.int8)
    from colibri_sdk.format.quant import pack_int4

    packed = QuantizedTensor(pack_int4(t.codes), t.scales, zeros, cols, group, 2, packed=True)
    out = np.zeros((rows, cols), np.float32)
    groups = t.scales.shape[1]
    cpu_kernels.rows_into(cpu_kernels.STORE_Q4, packed.codes, np.ascontiguousarray(t.scales).view(np.uint8), True,
                          zeros, True, group, cols, 0, rows, out, np.zeros(cols, np.float32),
                          np.zeros(groups, np.float32))
    np.testing.assert_array_equal(out, packed.dequantize())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mprotect through the C library: Linux only")
@pytest.mark.parametrize("store", [cpu_kernels.STORE_F32, cpu_kernels.STORE_F16], ids=["fp32", "fp16"])
def test_prefetch_hints_past_the_matrix_end_do_not_fault(store):
    """The streamed float32 / float16 product names each pass's rows STREAM_AHEAD bytes on to the prefetcher, past
    the matrix's last byte on the last pass: with the page after the matrix unreadable, the hints must stay hints
    (a load there would end the process), and the products equal NumPy's."""
    import ctypes
    import mmap

    page = mmap.PAGESIZE
    assert cpu_jit.STREAM_AHEAD <= page
    region = mmap.mmap(-1, 2 * page)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    anchor = ctypes.c_char.from_buffer(region)
    base = ctypes.addressof(anchor)
    assert libc.mprotect(base + page, page, 0) == 0, ctypes.get_errno()  # PROT_NONE
    try:
        rows, width = 8, 256  # bytes a row: the matrix fills the first page's last 2 KiB
        codes = np.frombuffer(region, np.uint8, rows * width, page - rows * width).reshape(rows, width)
        dtype = np.float32 if store == cpu_kernels.STORE_F32 else np.float16
        values = np.random.default_rng(4).standard_normal((rows, width // np.dtype(dtype).itemsize)).astype(dtype)
        codes[:] = values.view(np.uint8)
        x = np.random.default_rng(5).standard_normal((2, values.shape[1])).astype(np.float32)
        for n in (1, 2, 3):
            out = np.zeros((n, rows), np.float32)
            cpu_kernels._project_streamed(store, codes, x, np.arange(n, dtype=np.int64) % 2, n, out)
            want = x[np.arange(n) % 2].astype(np.float64) @ values.astype(np.float64).T
            np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
        del codes
    finally:
        assert libc.mprotect(base + page, page, mmap.PROT_READ | mmap.PROT_WRITE) == 0
        del anchor
        region.close()


@pytest.mark.parametrize("quant", [0, 2], ids=["float", "int4"])
def test_a_non_finite_stored_tensor_is_named(tmp_path, quant):
    """A NaN in an expert's matrix (float) or scales (int4) is a FormatError naming the tensor, not an output."""
    fields = dict(BASE, dtype=1, quant=quant, group_size=32 if quant else 0)
    path = write_v2(tmp_path / "m.colibri", fields, np.random.default_rng(4))
    with ColibriFile(path) as f:
        block = f.header.block("gate_proj.scales" if quant else "gate_proj")
    data = bytearray(path.read_bytes())
    data[block.offset:block.offset + block.nbytes] = np.full(block.nbytes // 2, np.nan, np.float16).tobytes()
    path.write_bytes(bytes(data))
    x = np.random.default_rng(5).standard_normal((8, BASE["hidden_size"])).astype(np.float32)
    name = "gate_proj.scales" if quant else "gate_proj"
    with pytest.raises(FormatError, match=rf"m\.colibri: {name} \(layer 0, expert \d\) holds \d+ non-finite values "
                                          r"\(NaN or Inf\); allowed: finite values"):
        run_engine(path, x)


@pytest.mark.parametrize("quant,group,zeros", [(1, 0, 0), (1, 32, 1), (2, 32, 0), (2, 64, 1), (2, 128, 0),
                                               (2, 128, 1)],
                         ids=["int8-row", "int8-g32-zp", "int4-g32", "int4-g64-zp", "int4-g128", "int4-g128-zp"])
@pytest.mark.parametrize("cols", [301, 384], ids=["partial-group", "whole-groups"])
@pytest.mark.parametrize("scale_dtype", [np.float16, np.float32], ids=["f16-scales", "f32-scales"])
def test_codes_multiplied_as_stored_match_the_float64_product(quant, group, zeros, cols, scale_dtype):
    """_project_direct (an int8 / int4 matrix's codes multiplied as stored, each group's scale once) against the
    float64 product of the exact dequantization, at 1, 2, 3 and 9 gathered tokens (it serves up to DIRECT_TOKENS:
    `direct_tokens`): odd column counts and a
    partial last group (the loops of `_rows_q4` / `_rows_q8`), and whole groups (int4 with and without zero
    points: on an AVX2 target g64 and g128 in integers, `_rows_q4_integer`; g32 and other targets the vector kernel
    `_rows_q4_vectors`; scales read as stored), float16 and float32 scales."""
    from colibri_sdk.format.quant import pack_int4
    from colibri_sdk.runtime import cpu_direct, cpu_q4_integer

    rng = np.random.default_rng(quant * 10 + group + zeros + cols)
    rows, tokens = 37, 9
    if quant == 2:  # the path `_project_direct` takes
        vectors = cpu_direct._q4_vectors_fit(np.uint64(group // 2), np.uint64((cols + 1) // 2))
        assert vectors == (cols == 384)
        integers = cpu_direct._q4_integer_fit(np.uint64(group // 2), np.uint64(cols))
        assert integers == (cols == 384 and group >= 64 and cpu_q4_integer.avx2_target())
    t = quantize_rtn(rng.standard_normal((rows, cols)).astype(np.float32), quant, group, scale_dtype)
    z = rng.integers(-3, 4, t.scales.shape).astype(np.int8) if zeros else np.zeros((rows, 1), np.int8)
    codes = pack_int4(t.codes) if quant == 2 else t.codes.view(np.uint8)
    stored = QuantizedTensor(codes if quant == 2 else t.codes, t.scales, z if zeros else None, cols, group, quant,
                             packed=quant == 2)
    w = stored.dequantize().astype(np.float64)
    x = rng.standard_normal((tokens, cols)).astype(np.float32)
    store = cpu_kernels.STORE_Q4 if quant == 2 else cpu_kernels.STORE_Q8
    scales = np.ascontiguousarray(t.scales).reshape(rows, -1).view(np.uint8)  # (rows, groups · itemsize) bytes
    for n in (1, 2, 3, tokens):
        pick = rng.choice(tokens, n, replace=False).astype(np.int64)
        out = np.full((n, rows), np.nan, np.float32)
        cpu_kernels._project_direct(store, codes, scales, scale_dtype == np.float16, z, bool(zeros), group, x, pick,
                                    n, out,
                                    np.zeros(n * 2 * (cols + 1), np.float32), np.zeros(n * cols, np.float32),
                                    np.zeros(rows * cols, np.float32))
        want = x[pick].astype(np.float64) @ w.T
        np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("value", [np.inf, -np.inf, np.nan], ids=["inf", "-inf", "nan"])
@pytest.mark.parametrize("quant,dtype", [(0, 0), (0, 1), (1, 0), (2, 1)], ids=["fp32", "fp16", "int8", "int4"])
def test_one_non_finite_stored_value_of_a_used_expert_is_named(tmp_path, quant, dtype, value):
    """A single Inf or NaN in one expert's down projection (float) or its scales (int8 / int4), every other value
    finite, at one token: a FormatError naming the tensor and the expert (the experts are checked when the layer's
    output is not finite)."""
    fields = dict(BASE, dtype=dtype, quant=quant, group_size=32 if quant == 2 else 0)
    path = write_v2(tmp_path / "m.colibri", fields, np.random.default_rng(6))
    name = "down_proj.scales" if quant else "down_proj"
    with ColibriFile(path) as f:
        block = f.header.block(name)
        itemsize = 2 if (dtype == 1) else 4
        per_expert = block.nbytes // (f.header.num_layers * BASE["num_experts"])
    data = bytearray(path.read_bytes())
    for expert in range(BASE["num_experts"]):  # one value of each expert of layer 0: the used ones are named
        at = block.offset + expert * per_expert + 3 * itemsize
        data[at:at + itemsize] = np.array([value], np.float16 if dtype == 1 else np.float32).tobytes()
    path.write_bytes(bytes(data))
    x = np.random.default_rng(7).standard_normal((1, BASE["hidden_size"])).astype(np.float32)
    with pytest.raises(FormatError, match=rf"m\.colibri: {name} \(layer 0, expert \d\) holds 1 non-finite value "):
        run_engine(path, x)


def test_threads_keep_the_callers_numpy_error_state(tmp_path, monkeypatch):
    """np.errstate is per thread: the helper threads of a split call run under the calling thread's (Runtime's
    "ignore" for overflow, reported once as NonFiniteOutputError), so an overflowing BLAS product warns nowhere,
    even where warnings are errors."""
    import warnings

    for name in blas.ENV_VARS:
        monkeypatch.delenv(name, raising=False)
    rng = np.random.default_rng(6)
    path = write_v2(tmp_path / "m.colibri", dict(BASE), rng)
    x = rng.standard_normal((3 * BLAS_TEST_PAIRS, BASE["hidden_size"])).astype(np.float32) * np.float32(3e18)
    with np.errstate(over="ignore", invalid="ignore"), warnings.catch_warnings():
        warnings.simplefilter("error")
        got = run_engine(path, x, blas_pairs=1, threads=2)
    assert not np.isfinite(got).all()
