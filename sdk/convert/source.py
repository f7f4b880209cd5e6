"""The model being converted, behind one small interface: a Hugging Face checkpoint folder or a GGUF file.

Both give the converter a ModelSpec, a Layout (kind, file layer, index) → Source, and readers for a source as
exact float32 or, for pre-quantized sources, as their codes and scales (tensors.Codes).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from ..errors import ConvertError
from ..format.constants import GROUP_SIZES, QUANT_INT4, QUANT_INT8
from . import compressed, mxfp4, tensors
from .checkpoint import INDEX_FILE, Checkpoint
from .families import model_spec
from .layout import Source, plan
from .model import MATRIX_KINDS, Model

__all__ = ["MATRIX_KINDS", "HFModel", "Model", "open_model"]

def _check_group(family: str, quant: int, size: int, what: str) -> None:
    if size not in GROUP_SIZES[quant]:
        name = "int8" if quant == QUANT_INT8 else "int4"
        raise ConvertError(
            f"{family}: {what} has group size {size}, which .colibri {name} does not hold (allowed: "
            f"{', '.join(map(str, GROUP_SIZES[quant]))}); convert with --dtype fp16 or fp32 (dequantized, exact in fp32)"
        )


class HFModel(Model):
    """A Hugging Face checkpoint folder (config.json + safetensors), float or pre-quantized (compressed-tensors
    pack-quantized; gpt-oss MXFP4)."""

    def __init__(self, folder: str | os.PathLike):
        self.checkpoint = Checkpoint(folder)
        self.spec = model_spec(self.checkpoint.config)
        self.scheme = compressed.scheme(self.checkpoint.config, self.spec.family)
        self.layout = plan(self.checkpoint.tensors, self.spec)
        for source in self.layout.sources.values():
            if source.quant != "pack_quantized":
                continue
            if self.scheme is None:
                raise ConvertError(
                    f"{self.spec.family}: tensor {source.name!r} is pack-quantized, but config.json has no "
                    f"compressed-tensors quantization_config"
                )
            if not source.aux[0]:
                raise ConvertError(
                    f"{self.spec.family}: tensor {source.name!r} has no "
                    f"{source.name.removesuffix('_packed')}_scale; a pack-quantized Linear needs its weight_scale"
                )

    def read_float(self, source: Source) -> np.ndarray:
        return tensors.read_float(self.checkpoint, source, self.scheme)

    def read_codes(self, source: Source) -> tensors.Codes:
        return tensors.read_codes(self.checkpoint, source, self.scheme)

    def native_storage(self) -> tuple[int, int, bool] | None:
        sources = self.quantized_sources()
        if not sources:
            return None
        if sources[0].quant == "mxfp4":
            return QUANT_INT8, mxfp4.BLOCK, False
        quant = QUANT_INT4 if self.scheme.bits == 4 else QUANT_INT8
        _check_group(self.spec.family, quant, self.scheme.group_size, "the compressed-tensors scheme")
        return quant, self.scheme.group_size, not self.scheme.symmetric

    def scales_fit_fp16(self) -> bool:
        for source in self.quantized_sources():
            if source.quant == "mxfp4":
                raw = self.checkpoint.read_raw(source.aux[0], source.index)
                exponents = raw.astype(np.int32) - mxfp4.E8M0_BIAS - 1
                if raw.size and (exponents.min() < -24 or exponents.max() > 15):
                    return False
            else:
                if not tensors.fp16_exact(self.checkpoint.read(source.aux[0])):
                    return False
        return True

    def source_dtypes(self) -> tuple[str, ...]:
        names = {s.name for s in self.layout.sources.values()}
        return tuple(sorted({self.checkpoint.tensors[n].dtype for n in names}))

    def files(self) -> set[Path]:
        files = {info.file for info in self.checkpoint.tensors.values()}
        return files | {self.checkpoint.folder / "config.json", self.checkpoint.folder / INDEX_FILE}

    def close(self) -> None:
        self.checkpoint.close()


def _magic(path: Path) -> bytes:
    try:
        with open(path, "rb") as fh:
            return fh.read(4)
    except OSError:
        return b""


def open_model(path: str | os.PathLike) -> Model:
    """A Hugging Face checkpoint folder, or a `.gguf` file.

    Raises:
        ConvertError: see Checkpoint, model_spec, layout.plan, compressed.scheme and gguf_model.
    """
    path = Path(path)
    try:
        is_file = path.is_file()
    except OSError as exc:  # e.g. EACCES on a folder above it: Path.is_file raises what is not "no such file"
        raise ConvertError(f"{path}: cannot examine it: {exc.strerror}") from None
    if path.suffix == ".gguf" or (is_file and _magic(path) == b"GGUF"):
        from .gguf_model import GGUFModel

        return GGUFModel(path)
    return HFModel(path)
