"""Hugging Face MoE checkpoint (or GGUF file) → .colibri, streamed tensor by tensor.

The converter reads the model description (families.py for config.json, gguf_model.py for GGUF metadata), plans
where every .colibri tensor comes from (layout.py), chooses the file's storage, then writes the file in format
order through ColibriWriter, reading one source tensor (or one expert of a fused tensor) at a time. Peak memory is
a few copies of one tensor; it does not grow with the checkpoint.

The file is v1 when the model needs nothing v1 cannot hold (float weights, every layer MoE, no shared expert, no
bias, softmax routing without groups or scaling) and v2 otherwise (docs/format.md).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from pathlib import Path

import numpy as np

from ..catalog import MAX_TOP_K
from ..errors import ConvertError, FormatError
from ..format import ColibriWriter, Header, HeaderV2, QuantizedTensor, quantize_rtn
from ..quantize import DEFAULT_GROUP_SIZE, group_text
from ..format.constants import (
    ACTIVATION_CLAMPED_SWIGLU,
    COMPOSITION_NAMES,
    FP16_MAX,
    GROUP_SCORE_MAX,
    GROUP_SCORE_NONE,
    GROUP_SCORE_TOP2_SUM,
    GROUP_SIZES,
    QUANT_CODES,
    QUANT_FLOAT,
    QUANT_INT8,
    ROUTING_SIGMOID_TOPK,
    ROUTING_SOFTMAX_TOPK,
    ROUTING_TOPK_SOFTMAX,
)
from .checkpoint import Checkpoint
from .families import ModelSpec
from .layout import Layout, Source
from .source import Model, open_model

DTYPE_CHOICES = ("auto", "fp16", "fp32", "int8", "int4")
GROUP_SIZE_CHOICES = (0, 32, 64, 128)

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class ConvertReport:
    """What a conversion did.

    bytes_written: size of the .colibri file; seconds: wall time; clamped: values clamped to ±65504 (only with
    clamp_fp16); storage: "fp16", "fp32", "int8 g128", ... ; imported: quantized tensors copied without
    re-quantizing; quantized: tensors quantized by round-to-nearest; quant_error: kind → max |w − dequant(q(w))| /
    max |w| over the tensors of that kind (round-to-nearest only); left_out: model layer → why it is not in the
    file; notes: facts the file does not hold.
    """

    path: Path
    header: Header
    family: str
    layout: str
    source_dtypes: tuple[str, ...]
    tensors: int
    bytes_written: int
    seconds: float
    clamped: int
    storage: str = "fp16"
    imported: int = 0
    quantized: int = 0
    quant_error: dict = dataclasses.field(default_factory=dict)
    left_out: dict = dataclasses.field(default_factory=dict)
    notes: tuple = ()

    @property
    def mb_per_s(self) -> float:
        return self.bytes_written / 1e6 / max(self.seconds, 1e-9)


def inspect_checkpoint(folder: str | os.PathLike) -> tuple[Checkpoint, ModelSpec, Layout]:
    """Open a checkpoint folder (or GGUF file) and plan its conversion without reading any weights.

    Returns:
        (model, spec, layout): the opened source (a Checkpoint-like object), its ModelSpec and Layout.

    Raises:
        ConvertError: see Checkpoint, model_spec, layout.plan and the GGUF reader.
    """
    model = open_model(folder)
    return model, model.spec, model.layout


@dataclasses.dataclass(frozen=True)
class Storage:
    """The file's expert-matrix storage: quant (format code), group_size, zero_points, dtype ("fp16"/"fp32": the
    float weights, or the scales of int8/int4), import_codes (copy the source's codes instead of quantizing)."""

    quant: int
    group_size: int
    zero_points: bool
    dtype: str
    import_codes: bool

    @property
    def name(self) -> str:
        if self.quant == QUANT_FLOAT:
            return self.dtype
        group = group_text(self.group_size)
        scales = "" if self.dtype == "fp16" else ", fp32 scales"
        zeros = ", zero points" if self.zero_points else ""
        return f"{'int8' if self.quant == QUANT_INT8 else 'int4'} {group}{scales}{zeros}"


def choose_storage(model: Model, dtype: str, group_size: int | None) -> Storage:
    """The storage for `dtype` ("auto": the source's own — fp16 for float checkpoints, the source's int8/int4
    layout for pre-quantized ones).

    Raises:
        ConvertError: a dtype or group size outside the allowed sets; a pre-quantized source asked for another
            integer storage (no re-quantizing: say auto, or fp16/fp32 to dequantize).
    """
    if dtype not in DTYPE_CHOICES:
        raise ConvertError(f"dtype {dtype!r}; allowed: {', '.join(DTYPE_CHOICES)}")
    native = model.native_storage()  # None (float source) or (quant, group_size, zero_points, bits label)
    if dtype in ("fp16", "fp32"):
        if group_size is not None:
            raise ConvertError(f"--group-size {group_size} with --dtype {dtype}; allowed only with int8 or int4")
        return Storage(QUANT_FLOAT, 0, False, dtype, False)
    if dtype == "auto" and native is None:
        if group_size is not None:
            raise ConvertError(f"--group-size {group_size} needs --dtype int8 or int4")
        return Storage(QUANT_FLOAT, 0, False, "fp16", False)
    if native is not None:
        quant, size, zeros = native
        if dtype != "auto" and QUANT_CODES[dtype] != quant or group_size not in (None, size):
            have = Storage(quant, size, zeros, "fp16", True).name
            raise ConvertError(
                f"{model.spec.family}: the checkpoint's experts are already {have}; re-quantizing is refused; "
                f"allowed: --dtype auto (kept as {have}), fp16 or fp32 (dequantized)"
            )
        scale_dtype = "fp16" if model.scales_fit_fp16() else "fp32"
        return Storage(quant, size, zeros, scale_dtype, True)
    quant = QUANT_CODES[dtype]
    size = DEFAULT_GROUP_SIZE[dtype] if group_size is None else group_size
    if size not in GROUP_SIZES[quant]:
        raise ConvertError(
            f"--group-size {size} with --dtype {dtype}; allowed: {', '.join(map(str, GROUP_SIZES[quant]))}"
            + (" (0 = one group per row)" if quant == QUANT_INT8 else "")
        )
    return Storage(quant, size, False, "fp16", False)


def _needs_v2(spec: ModelSpec, storage: Storage) -> bool:
    r = spec.router
    v1_routing = r.scoring == "softmax" and r.n_group == 1 and r.scaling == 1.0 and not r.bias and not r.correction_bias
    return bool(
        storage.quant != QUANT_FLOAT or spec.dense_layers or spec.shared is not None or spec.expert.bias
        or spec.expert.activation != "silu" or not v1_routing or spec.extra_layers
    )


def _routing(spec: ModelSpec) -> tuple[int, int]:
    """(routing code, norm_topk) of the format for the model's router."""
    r = spec.router
    if r.scoring == "sigmoid":
        return ROUTING_SIGMOID_TOPK, int(r.renormalize)
    if r.order == "topk_softmax" or (r.renormalize and r.n_group == 1):
        return ROUTING_TOPK_SOFTMAX, 0
    return ROUTING_SOFTMAX_TOPK, int(r.renormalize)


def build_header(spec: ModelSpec, storage: Storage, composition: int) -> Header:
    """The .colibri header for a model and a storage (v1 when nothing needs v2)."""
    routing, norm = _routing(spec)
    dtype = 1 if storage.dtype == "fp16" else 0
    common = dict(
        num_layers=len(spec.moe_layers), num_experts=spec.num_experts, top_k=spec.top_k,
        hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size, dtype=dtype, routing=routing,
        composition=composition,
    )
    try:
        if not _needs_v2(spec, storage):
            return Header(**common)
        r, e = spec.router, spec.expert
        scores = {"max": GROUP_SCORE_MAX, "top2_sum": GROUP_SCORE_TOP2_SUM}
        return HeaderV2(
            **common, quant=storage.quant, group_size=storage.group_size, zero_points=int(storage.zero_points),
            norm_topk=norm, n_group=r.n_group, topk_group=r.topk_group,
            group_score=GROUP_SCORE_NONE if r.n_group == 1 else scores[r.group_score],
            router_bias=int(r.bias), correction_bias=int(r.correction_bias),
            num_shared_experts=0 if spec.shared is None else 1,
            shared_intermediate_size=0 if spec.shared is None else spec.shared.intermediate_size,
            shared_gate=int(spec.shared is not None and spec.shared.gated), expert_bias=int(e.bias),
            activation=ACTIVATION_CLAMPED_SWIGLU if e.activation == "swiglu_clamped" else 0,
            swiglu_limit=e.limit if e.activation == "swiglu_clamped" else 0.0,
            swiglu_alpha=e.alpha if e.activation == "swiglu_clamped" else 0.0,
            num_model_layers=spec.num_layers, layer_map=tuple(spec.moe_layers), routed_scaling_factor=r.scaling,
        )
    except FormatError as exc:
        raise ConvertError(f"{spec.family}: {exc}") from exc


def convert(
    folder: str | os.PathLike,
    output: str | os.PathLike,
    *,
    dtype: str = "auto",
    group_size: int | None = None,
    clamp_fp16: bool = False,
    composition: str = "residual",
    progress: bool | None = None,
) -> ConvertReport:
    """Convert a Hugging Face MoE checkpoint folder (or a GGUF file) to a .colibri file.

    Args:
        folder: checkpoint folder (config.json + safetensors, single or sharded), or a `.gguf` file.
        output: the .colibri path to write (written as `<output>.partial`, renamed when complete).
        dtype: "auto" (default: fp16 for float checkpoints, the source's own int8/int4 layout for pre-quantized
            ones, copied without re-quantizing), "fp16" | "fp32" (float storage; quantized sources dequantized,
            exactly in fp32), "int8" | "int4" (round-to-nearest from float checkpoints, with `group_size`).
        group_size: 0 (int8 only: per row), 32, 64, 128 for int8/int4; None: int8 per row, int4 128
            (`colibri_sdk.quantize.DEFAULT_GROUP_SIZE`).
        clamp_fp16: clamp values beyond ±65504 instead of refusing them (fp16 only).
        composition: "residual" (x + moe(x), the decoder's residual stream; default) or "sequential".
        progress: show a tqdm bar (None: only on a terminal).

    Returns:
        A ConvertReport.

    Raises:
        ConvertError: unsupported model or feature (naming the model type first, with what would work), top-k
            above catalog.MAX_TOP_K, missing/extra/mis-shaped tensor, source dtype, fp16 overflow (naming the tensor
            and the count), non-finite weights, unwritable output.
    """
    modes = {name: code for code, name in COMPOSITION_NAMES.items()}
    if composition not in modes:
        raise ConvertError(f"composition {composition!r}; allowed: {', '.join(modes)}")
    if dtype not in DTYPE_CHOICES:
        raise ConvertError(f"dtype {dtype!r}; allowed: {', '.join(DTYPE_CHOICES)}")
    text = os.fspath(output)
    output = Path(output)
    # Path() drops a trailing separator: "out.colibri/" (meant as a folder) would become the file out.colibri
    if output.name in ("", ".", "..") or (isinstance(text, str) and text.endswith(("/", os.sep))):
        raise ConvertError(f"output {text!r} is not a file path; allowed: a path ending in a file name")
    if not output.parent.is_dir():
        raise ConvertError(f"output folder {output.parent} does not exist")
    start = time.perf_counter()
    model = open_model(folder)
    try:
        check_top_k(model.spec)
        _refuse_overwriting_source(model, output)
        logger.debug("convert: %s: family %s, %s experts, source dtypes %s, %d tensors to read", folder,
                     model.spec.family, model.layout.style, "/".join(model.source_dtypes()), len(model.layout.sources))
        storage = choose_storage(model, dtype, group_size)
        header = build_header(model.spec, storage, modes[composition])
        logger.debug("convert: storage %s; format v%d, %d bytes to write", storage.name,
                     2 if isinstance(header, HeaderV2) else 1, header.file_size)
        stats = _stream(model, header, storage, output, clamp_fp16=clamp_fp16, progress=progress)
    finally:
        model.close()
    return ConvertReport(
        path=output,
        header=header,
        family=model.spec.family,
        layout=model.layout.style,
        source_dtypes=model.source_dtypes(),
        tensors=len(model.layout.sources),
        bytes_written=header.file_size,
        seconds=time.perf_counter() - start,
        clamped=stats["clamped"],
        storage=storage.name,
        imported=stats["imported"],
        quantized=stats["quantized"],
        quant_error=stats["error"],
        left_out=model.layout.left_out,
        notes=model.spec.notes,
    )


def check_top_k(spec: ModelSpec) -> None:
    """Refuse a model routing more experts per token than the kernels are compiled for (catalog.MAX_TOP_K), before
    anything is written.

    Raises:
        ConvertError: naming the config key, the value and the limit.
    """
    if spec.top_k > MAX_TOP_K:
        key = spec.keys.get("top_k", "num_experts_per_tok")
        source = "GGUF" if "." in key else "config.json"  # GGUF keys are "<arch>.expert_used_count"
        raise ConvertError(
            f"{spec.family}: {source} {key} = {spec.top_k}; allowed: 1..{MAX_TOP_K} (MAX_TOP_K, the most experts per "
            "token the kernels are compiled for)"
        )


def _refuse_overwriting_source(model: Model, output: Path) -> None:
    """Refuse an output path that is one of the source's own files (its weights, index or config.json): the
    rename at the end of the conversion would replace it; nor one whose temporary `<output>.partial` is one of them
    (the writer truncates it before reading a single tensor)."""
    partial = output.with_name(output.name + ".partial")
    for target in (output, partial):
        if not target.exists():
            continue
        for source in sorted(model.files()):
            try:
                same = source.exists() and os.path.samefile(source, target)
            except OSError:
                same = False
            if same:
                what = "" if target == output else f"'s temporary file {target.name}"
                raise ConvertError(
                    f"output {output}{what} is the checkpoint's own {source.name}; refusing to overwrite the source "
                    f"(choose another -o)"
                )


def _matrix(model: Model, storage: Storage, source: Source, kind: str, stats: dict):
    """One expert matrix in the file's storage: a float array, or a QuantizedTensor."""
    if storage.quant == QUANT_FLOAT:
        return model.read_float(source)
    scale_dtype = np.float16 if storage.dtype == "fp16" else np.float32
    if storage.import_codes and model.is_quantized(source):
        codes = model.read_codes(source)
        if codes.bits != (8 if storage.quant == QUANT_INT8 else 4) or codes.group_size != storage.group_size:
            raise ConvertError(
                f"{model.spec.family}: tensor {source.label!r} is {codes.bits}-bit with group size "
                f"{codes.group_size}; the other expert matrices are {storage.name}; allowed: one scheme for every "
                f"expert matrix, or --dtype fp16/fp32 (dequantized)"
            )
        _check_scales(codes.scales, scale_dtype, source, model)
        stats["imported"] += 1
        packed = codes.int4_rows is not None
        return QuantizedTensor(
            codes=codes.int4_rows if packed else codes.codes, scales=codes.scales.astype(scale_dtype),
            zeros=codes.zeros, cols=codes.cols, group_size=codes.group_size, quant=storage.quant, packed=packed,
        )
    weight = model.read_float(source)
    try:
        t = quantize_rtn(weight, storage.quant, storage.group_size, scale_dtype)
    except FormatError as exc:
        # convert writes fp16 scales and has no flag for float32 ones: say what the command line can do.
        hint = " (convert with --dtype fp32, which keeps these weights as floats)" if "exceed float16" in str(exc) else ""
        raise ConvertError(f"{source.label}: {exc}{hint}") from exc
    stats["quantized"] += 1
    amax = float(np.abs(weight).max()) if weight.size else 0.0
    if amax > 0:
        err = float(np.abs(t.dequantize() - weight).max()) / amax
        stats["error"][kind] = max(stats["error"].get(kind, 0.0), err)
    return t


def _check_scales(scales: np.ndarray, dtype, source: Source, model: Model) -> None:
    bad = ~np.isfinite(scales)
    if bad.any():
        raise ConvertError(
            f"{model.spec.family}: scales of {source.label!r} hold {int(bad.sum())} non-finite values (NaN or Inf); "
            f"allowed: finite scales"
        )
    with np.errstate(over="ignore"):
        if not np.array_equal(scales.astype(dtype).astype(np.float32), scales):
            raise ConvertError(
                f"{model.spec.family}: scales of {source.label!r} are not exact in {np.dtype(dtype).name}"
            )


def _stream(model: Model, header: Header, storage: Storage, output: Path, *, clamp_fp16: bool, progress) -> dict:
    """Write every tensor in format order; return counts (clamped, imported, quantized) and the RTN errors."""
    from tqdm import tqdm

    stats = {"clamped": 0, "imported": 0, "quantized": 0, "error": {}}
    v2 = isinstance(header, HeaderV2)
    try:
        writer = ColibriWriter(output, header, clamp_fp16=clamp_fp16)
    except FormatError as exc:
        raise ConvertError(str(exc)) from exc
    pending = writer.pending()
    bar = tqdm(total=len(pending), unit="tensor", desc="convert", disable=None if progress is None else not progress)
    try:
        with writer:
            for kind, layer, index in pending:
                source = model.layout.sources[(kind, layer, index)]
                if (header.is_matrix(kind) if v2 else kind != "router"):
                    array = _matrix(model, storage, source, kind, stats)
                else:
                    array = model.read_float(source)
                fp16_here = storage.quant == QUANT_FLOAT and storage.dtype == "fp16" and (not v2 or header.is_matrix(kind))
                if clamp_fp16 and fp16_here:
                    stats["clamped"] += int(np.count_nonzero(np.abs(array) > FP16_MAX))
                logger.debug("convert: %s layer %d%s <- %s", kind, layer, "" if index is None else f" [{index}]",
                             source.label)
                try:
                    writer.write(kind, layer, index, array, name=source.label)
                except FormatError as exc:
                    hint = " (convert with --dtype fp32, or allow clamping: --clamp-fp16)" if "overflow float16" in str(exc) else ""
                    raise ConvertError(f"{exc}{hint}") from exc
                bar.update(1)
                del array
    except OSError as exc:
        raise ConvertError(f"writing {output} failed: {exc.strerror or exc}") from exc
    except FormatError as exc:  # the final rename (ColibriWriter.close)
        raise ConvertError(str(exc)) from exc
    finally:
        bar.close()
    return stats
