"""A Hugging Face checkpoint folder: `config.json` plus safetensors weights, single file or sharded.

The tensor index (names, dtypes, shapes) comes from `safetensors.safe_open`. Tensor bytes are then read with
plain positioned reads (`readinto` at the tensor's offset from the safetensors header) into a fresh buffer, one
tensor or one contiguous slice at a time. Reading through safetensors' memory map instead would make the pages it
touches count towards the resident set (with large page-cache folios, whole shards of it), so peak memory would
follow the shard size; with positioned reads it is one tensor, whatever the size of the checkpoint.
bf16 is widened to float32 by a 16-bit shift (exact; no torch needed).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from pathlib import Path

import numpy as np

from ..errors import ConvertError

logger = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# safetensors dtype strings this converter reads (the dtypes Hugging Face MoE checkpoints ship in).
SOURCE_DTYPES = ("BF16", "F16", "F32")


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """Where one checkpoint tensor lives. shape: as stored; dtype: the safetensors dtype string ("BF16", ...);
    offset: absolute byte offset of its data in `file` (None until the shard header was parsed)."""

    name: str
    file: Path
    dtype: str
    shape: tuple[int, ...]
    offset: int | None = None


# safetensors dtype → little-endian storage dtype; BF16 is read as its 16-bit pattern.
_STORAGE = {"BF16": np.dtype("<u2"), "F16": np.dtype("<f2"), "F32": np.dtype("<f4")}
# Integer dtypes that quantized checkpoints use (MXFP4 blocks/scales: U8; compressed-tensors packs: I32, I64).
_RAW_STORAGE = {"U8": np.dtype("u1"), "I8": np.dtype("i1"), "I32": np.dtype("<i4"), "I64": np.dtype("<i8"), **_STORAGE}


def _short(exc: BaseException, limit: int = 200) -> str:
    """An exception's message cut to `limit` characters (a hostile file must not make a huge message)."""
    text = str(exc)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _data_offsets(path: Path) -> dict[str, int]:
    """Absolute data offset of every tensor in a safetensors file, from its header (8-byte LE length + JSON)."""
    size = path.stat().st_size
    with open(path, "rb") as fh:
        n = int.from_bytes(fh.read(8), "little")
        if not 0 < n <= size - 8:
            raise ConvertError(f"{path}: safetensors header length {n} does not fit a {size}-byte file")
        header = json.loads(fh.read(n))
    offsets = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        begin, end = entry["data_offsets"]
        if not 0 <= begin <= end <= size - 8 - n:
            raise ConvertError(f"{path}: tensor {name!r} data_offsets {entry['data_offsets']} lie outside the file")
        offsets[name] = 8 + n + begin
    return offsets


def _byte_range(shape: tuple[int, ...], itemsize: int, index) -> tuple[int, tuple[int, ...]]:
    """(byte offset, shape) of `tensor[index]` for index = leading integers, optionally followed by one
    step-1 slice: such a selection is one contiguous run of a row-major tensor."""
    index = () if index is None else (index if isinstance(index, tuple) else (index,))
    strides = [itemsize] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * shape[d + 1]
    offset, out = 0, list(shape)
    for d, item in enumerate(index):
        if isinstance(item, slice):
            start, stop, step = item.indices(shape[d])
            if step != 1 or d != len(index) - 1:
                raise ValueError(f"index {index!r}: only a final step-1 slice is contiguous")
            offset += start * strides[d]
            out = [max(stop - start, 0)] + list(shape[d + 1:])
            return offset, tuple(out)
        if not 0 <= item < shape[d]:
            raise ValueError(f"index {item} out of range for dimension {d} of size {shape[d]}")
        offset += item * strides[d]
        out = list(shape[d + 1:])
    return offset, tuple(out)


def _safe_open(path: Path):
    from safetensors import safe_open

    try:
        # safetensors reports an unreadable file as "No such file or directory": open it first for the real reason.
        with open(path, "rb"):
            pass
    except OSError as exc:
        raise ConvertError(f"{path}: cannot read: {exc.strerror}") from None
    try:
        return safe_open(str(path), framework="numpy")
    except Exception as exc:  # safetensors raises its own SafetensorError and OSError subclasses
        raise ConvertError(f"{path}: not a readable safetensors file ({exc})") from exc


class Checkpoint:
    """A checkpoint folder: its parsed config and an index of every tensor in its safetensors files.

    Args:
        folder: a folder with `config.json` and `model.safetensors` or `model.safetensors.index.json` + shards.

    Raises:
        ConvertError: no such folder, no or malformed config.json, no safetensors weights (or only PyTorch .bin
            files), an index naming a missing shard or a tensor its shard lacks, a tensor in two shards, or a
            file that is not valid safetensors.
    """

    def __init__(self, folder: str | os.PathLike):
        self.folder = Path(folder)
        if not self.folder.is_dir():
            what = "not a folder" if self.folder.exists() else "no such folder"
            raise ConvertError(f"{self.folder}: {what}; expected a Hugging Face checkpoint folder (or a .gguf file)")
        self.config = self._read_config()
        self.tensors: dict[str, TensorInfo] = self._index()
        self._open_path: Path | None = None
        self._file = None

    # ---- discovery --------------------------------------------------------------------------------------------
    def _read_config(self) -> dict:
        path = self.folder / "config.json"
        if not path.is_file():
            raise ConvertError(f"{self.folder}: no config.json; expected a Hugging Face checkpoint folder")
        try:
            config = json.loads(path.read_text(encoding="utf-8"))
        except (ValueError, RecursionError) as exc:  # ValueError: JSONDecodeError, UnicodeDecodeError, a huge int
            raise ConvertError(f"{path}: not valid JSON ({_short(exc)})") from exc
        except OSError as exc:
            raise ConvertError(f"{path}: cannot read: {exc.strerror}") from exc
        if not isinstance(config, dict):
            raise ConvertError(f"{path}: top level is {type(config).__name__}; expected a JSON object")
        return config

    def _shards(self) -> dict[Path, set[str] | None]:
        """Shard path → the tensor names the index assigns to it (None: a single file, no index).

        With both model.safetensors and an index present, model.safetensors is read, as transformers'
        `from_pretrained` does for a local folder (modeling_utils `_get_resolved_checkpoint_files`: the single file
        is tried before the index), with a warning naming both files.
        """
        index_path = self.folder / INDEX_FILE
        single = self.folder / SINGLE_FILE
        if single.is_file():
            if index_path.is_file():
                logger.warning(
                    "%s: both %s and %s exist; reading %s, as transformers' from_pretrained does (remove one of "
                    "them if the index is the checkpoint you mean)", self.folder, SINGLE_FILE, INDEX_FILE, SINGLE_FILE
                )
            return {single: None}
        if index_path.is_file():
            try:
                weight_map = json.loads(index_path.read_text(encoding="utf-8"))["weight_map"]
            except (ValueError, RecursionError, KeyError, TypeError) as exc:
                raise ConvertError(
                    f"{index_path}: expected JSON with a 'weight_map' object ({type(exc).__name__}: {_short(exc)})"
                ) from exc
            except OSError as exc:
                raise ConvertError(f"{index_path}: cannot read: {exc.strerror}") from exc
            if not isinstance(weight_map, dict) or not weight_map:
                raise ConvertError(f"{index_path}: 'weight_map' must be a non-empty object of tensor → file")
            shards: dict[Path, set[str]] = {}
            for name, file in weight_map.items():
                if not isinstance(file, str) or not file or Path(file).name != file:
                    raise ConvertError(f"{index_path}: tensor {name!r} maps to {file!r}; expected a file name")
                shards.setdefault(self.folder / file, set()).add(name)
            for shard in shards:
                if not shard.is_file():
                    raise ConvertError(f"{index_path} names shard {shard.name!r}, which is not in {self.folder}")
            return dict(shards)
        if any(self.folder.glob("*.bin")) or any(self.folder.glob("*.pt")):
            raise ConvertError(
                f"{self.folder}: only PyTorch .bin/.pt weights found; this converter reads safetensors "
                f"(re-save with save_pretrained(..., safe_serialization=True))"
            )
        raise ConvertError(f"{self.folder}: neither {SINGLE_FILE} nor {INDEX_FILE} found")

    def _index(self) -> dict[str, TensorInfo]:
        tensors: dict[str, TensorInfo] = {}
        for shard, expected in sorted(self._shards().items()):
            handle = _safe_open(shard)
            try:
                names = list(handle.keys())
                for name in names:
                    if name in tensors:
                        raise ConvertError(f"tensor {name!r} is in both {tensors[name].file.name} and {shard.name}")
                    view = handle.get_slice(name)
                    tensors[name] = TensorInfo(name, shard, view.get_dtype(), tuple(view.get_shape()))
            finally:
                del handle
            offsets = _data_offsets(shard)
            for name in names:
                info = tensors[name]
                tensors[name] = dataclasses.replace(info, offset=offsets[name])
            if expected is not None:
                missing = sorted(expected - set(names))
                if missing:
                    raise ConvertError(
                        f"{INDEX_FILE} places {missing[0]!r} in {shard.name}, which does not contain it "
                        f"({len(missing)} such tensors)"
                    )
        return tensors

    # ---- reading ----------------------------------------------------------------------------------------------
    def read(self, name: str, index: tuple | int | None = None) -> np.ndarray:
        """Read one tensor, or a contiguous part of it (leading integer indices, optionally one final slice, e.g.
        `index=(expert, slice(0, inter))`), as a new float32 array. Only the bytes of that part are read.

        Raises:
            ConvertError: an unknown name, a dtype outside SOURCE_DTYPES (quantised or integer checkpoints), an
                index that is out of range or not one contiguous run, or a shard shorter than its header says.
        """
        info = self._info(name)
        if info.dtype not in SOURCE_DTYPES:
            raise ConvertError(f"tensor {name!r} has dtype {info.dtype}; allowed: {', '.join(SOURCE_DTYPES)}")
        raw = self._read(info, _STORAGE[info.dtype], index)
        if info.dtype == "BF16":
            # bfloat16 is the upper half of a float32: widen the bit pattern (exact).
            return (raw.astype(np.uint32) << 16).view(np.float32)
        return raw.astype(np.float32, copy=False)

    def read_raw(self, name: str, index: tuple | int | None = None, allowed: tuple[str, ...] = ("U8",)) -> np.ndarray:
        """Read a tensor (or a contiguous part, as `read`) in its stored dtype, e.g. uint8 MXFP4 blocks or int32
        compressed-tensors packs; BF16 comes back as its uint16 bit pattern.

        Raises:
            ConvertError: as `read`, or a dtype outside `allowed`.
        """
        info = self._info(name)
        if info.dtype not in allowed:
            raise ConvertError(f"tensor {name!r} has dtype {info.dtype}; allowed: {', '.join(allowed)}")
        return self._read(info, _RAW_STORAGE[info.dtype], index)

    def _info(self, name: str) -> TensorInfo:
        info = self.tensors.get(name)
        if info is None:
            raise ConvertError(f"tensor {name!r} is not in the checkpoint")
        return info

    def _read(self, info: TensorInfo, storage: np.dtype, index) -> np.ndarray:
        try:
            start, shape = _byte_range(info.shape, storage.itemsize, index)
        except ValueError as exc:
            raise ConvertError(f"tensor {info.name!r} of shape {info.shape}: {exc}") from None
        raw = np.empty(shape, dtype=storage)
        fh = self._handle(info.file)
        fh.seek(info.offset + start)
        if fh.readinto(memoryview(raw).cast("B")) != raw.nbytes:
            raise ConvertError(f"{info.file.name}: tensor {info.name!r} is cut short (file shorter than its header says)")
        return raw

    def _handle(self, path: Path):
        if self._file is None or self._open_path != path:
            self.close()
            try:
                self._file = open(path, "rb", buffering=0)
            except OSError as exc:
                raise ConvertError(f"cannot open {path}: {exc.strerror}") from exc
            self._open_path = path
        return self._file

    def close(self) -> None:
        """Close the open shard (the index stays usable; the next read re-opens)."""
        if self._file is not None:
            self._file.close()
        self._file = None
        self._open_path = None

    def __enter__(self) -> "Checkpoint":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
