"""Hugging Face MoE checkpoint → .colibri, streamed tensor by tensor.

The converter reads config.json (family, sizes, routing), plans where every .colibri tensor comes from
(layout.py), then writes the file in format order through ColibriWriter, reading one source tensor (or one
expert's slice of a fused tensor) at a time. Peak memory is a few copies of one tensor; it does not grow with the
checkpoint.
"""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path

import numpy as np

from ..catalog import MAX_TOP_K
from ..errors import ConvertError, FormatError
from ..format import ColibriWriter, Header
from ..format.constants import COMPOSITION_NAMES, DTYPE_CODES, FP16_MAX
from ..profile import DTYPES
from .checkpoint import INDEX_FILE, Checkpoint
from .families import ModelSpec, model_spec
from .layout import Layout, plan


@dataclasses.dataclass(frozen=True)
class ConvertReport:
    """What a conversion did. bytes_written: size of the .colibri file; seconds: wall time;
    clamped: values clamped to ±65504 (only with clamp_fp16)."""

    path: Path
    header: Header
    family: str
    layout: str
    source_dtypes: tuple[str, ...]
    tensors: int
    bytes_written: int
    seconds: float
    clamped: int

    @property
    def mb_per_s(self) -> float:
        return self.bytes_written / 1e6 / max(self.seconds, 1e-9)


def inspect_checkpoint(folder: str | os.PathLike) -> tuple[Checkpoint, ModelSpec, Layout]:
    """Open a checkpoint and plan its conversion without reading any tensor data.

    Raises:
        ConvertError: see Checkpoint, model_spec and layout.plan.
    """
    checkpoint = Checkpoint(folder)
    spec = model_spec(checkpoint.config)
    layout = plan(checkpoint.tensors, spec)
    return checkpoint, spec, layout


def convert(
    folder: str | os.PathLike,
    output: str | os.PathLike,
    *,
    dtype: str = "fp16",
    clamp_fp16: bool = False,
    composition: str = "residual",
    progress: bool | None = None,
) -> ConvertReport:
    """Convert a Hugging Face MoE checkpoint folder to a .colibri file.

    Args:
        folder: checkpoint folder (config.json + safetensors, single or sharded).
        output: the .colibri path to write (written as `<output>.partial`, renamed when complete).
        dtype: "fp16" | "fp32", the storage dtype.
        clamp_fp16: clamp values beyond ±65504 instead of refusing them (fp16 only).
        composition: "residual" (x + moe(x), the decoder's residual stream; default) or "sequential".
        progress: show a tqdm bar (None: only on a terminal).

    Returns:
        A ConvertReport.

    Raises:
        ConvertError: unsupported model or feature, top-k above catalog.MAX_TOP_K, missing/extra/mis-shaped
            tensor, source dtype, fp16 overflow
            (naming the tensor and the count), non-finite weights, unwritable output.
    """
    if dtype not in DTYPES:
        raise ConvertError(f"dtype {dtype!r}; allowed: {', '.join(DTYPES)}")
    modes = {name: code for code, name in COMPOSITION_NAMES.items()}
    if composition not in modes:
        raise ConvertError(f"composition {composition!r}; allowed: {', '.join(modes)}")
    output = Path(output)
    if output.name in ("", ".", ".."):
        raise ConvertError(f"output {str(output)!r} is not a file path; allowed: a path ending in a file name")
    if not output.parent.is_dir():
        raise ConvertError(f"output folder {output.parent} does not exist")
    start = time.perf_counter()
    checkpoint, spec, layout = inspect_checkpoint(folder)
    check_top_k(spec)
    _refuse_overwriting_source(checkpoint, output)
    header = Header(
        num_layers=spec.num_layers,
        num_experts=spec.num_experts,
        top_k=spec.top_k,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        dtype=DTYPE_CODES[dtype],
        routing=spec.routing,
        composition=modes[composition],
    )
    clamped = _stream(checkpoint, header, layout, output, clamp_fp16=clamp_fp16, progress=progress)
    sources = {s.name for s in layout.sources.values()}
    return ConvertReport(
        path=output,
        header=header,
        family=spec.family,
        layout=layout.style,
        source_dtypes=tuple(sorted({checkpoint.tensors[n].dtype for n in sources})),
        tensors=len(layout.sources),
        bytes_written=header.file_size,
        seconds=time.perf_counter() - start,
        clamped=clamped,
    )


def check_top_k(spec: ModelSpec) -> None:
    """Refuse a model routing more experts per token than the kernels are compiled for (catalog.MAX_TOP_K), before
    anything is written.

    Raises:
        ConvertError: naming the config key, the value and the limit.
    """
    if spec.top_k > MAX_TOP_K:
        key = spec.keys.get("top_k", "num_experts_per_tok") if isinstance(spec.keys, dict) else "num_experts_per_tok"
        raise ConvertError(
            f"config.json {key} = {spec.top_k}; allowed: 1..{MAX_TOP_K} (MAX_TOP_K, the most experts per token the "
            "kernels are compiled for)"
        )


def _refuse_overwriting_source(checkpoint: Checkpoint, output: Path) -> None:
    """Refuse an output path that is one of the checkpoint's own files (its weights, index or config.json): the
    rename at the end of the conversion would replace it."""
    if not output.exists():
        return
    sources = {info.file for info in checkpoint.tensors.values()}
    sources |= {checkpoint.folder / "config.json", checkpoint.folder / INDEX_FILE}
    for source in sorted(sources):
        try:
            same = source.exists() and os.path.samefile(source, output)
        except OSError:
            same = False
        if same:
            raise ConvertError(
                f"output {output} is the checkpoint's own {source.name}; refusing to overwrite the source "
                f"(choose another -o)"
            )


def _stream(checkpoint: Checkpoint, header: Header, layout: Layout, output: Path, *, clamp_fp16: bool, progress) -> int:
    """Write every tensor in format order; return the number of values clamped to ±65504."""
    from tqdm import tqdm

    fp16 = header.itemsize == 2
    clamped = 0
    try:
        writer = ColibriWriter(output, header, clamp_fp16=clamp_fp16)
    except FormatError as exc:
        raise ConvertError(str(exc)) from exc
    bar = tqdm(total=header.data_size, unit="B", unit_scale=True, desc="convert", disable=None if progress is None else not progress)
    try:
        with writer, checkpoint:
            for kind, layer, expert in writer.pending():
                source = layout.sources[(kind, layer, expert)]
                array = checkpoint.read(source.name, source.index)
                if source.transpose:
                    array = array.T
                if fp16 and clamp_fp16:
                    clamped += int(np.count_nonzero(np.abs(array) > FP16_MAX))
                try:
                    writer.write(kind, layer, expert, array, name=source.label)
                except FormatError as exc:
                    hint = " (convert with dtype fp32, or allow clamping: --clamp-fp16)" if "overflow" in str(exc) else ""
                    raise ConvertError(f"{exc}{hint}") from exc
                bar.update(array.size * header.itemsize)
                del array
    except OSError as exc:
        raise ConvertError(f"writing {output} failed: {exc.strerror or exc}") from exc
    except FormatError as exc:  # the final rename (ColibriWriter.close)
        raise ConvertError(str(exc)) from exc
    finally:
        bar.close()
    return clamped
