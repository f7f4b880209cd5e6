"""Device-resident inputs and outputs: arrays exposing `__cuda_array_interface__` (CuPy, PyTorch, Numba).

The interface (https://numba.readthedocs.io/en/stable/cuda/cuda_array_interface.html, version 2 or 3) gives a
device pointer, a shape, a typestr and strides; the runtime reads it without importing the array's library. Only
float32 ("<f4") C-contiguous arrays (strides None or the C strides) of rank 2 (tokens, hidden) or 3 (batch, tokens,
hidden) are taken. DLPack-only objects (`__dlpack__` without the interface) are refused by name: both CuPy and
PyTorch CUDA tensors expose the interface.
"""

from __future__ import annotations

import dataclasses

from ..errors import InputError


@dataclasses.dataclass(frozen=True)
class DeviceArray:
    """A validated device array: ptr (int device address), shape (as given), batch, tokens."""

    ptr: int
    shape: tuple
    batch: int
    tokens: int


def device_view(obj, name: str, fixed_shape: tuple, hidden: int) -> DeviceArray:
    """Validate `obj.__cuda_array_interface__` for a (batch, tokens, hidden) float32 device array.

    Raises:
        InputError: no interface, or a typestr, rank, hidden size, batch/tokens above `fixed_shape`, strides or
            read-only flag that the runtime cannot take; the message names the value seen and what is allowed.
    """
    cai = getattr(obj, "__cuda_array_interface__", None)
    if not isinstance(cai, dict):
        extra = " (it has __dlpack__: pass a CuPy or PyTorch array, which expose the interface)" if hasattr(
            obj, "__dlpack__") else ""
        raise InputError(f"{name} is a {type(obj).__name__} without __cuda_array_interface__{extra}")
    shape = tuple(int(v) for v in cai.get("shape", ()))
    typestr = cai.get("typestr")
    if typestr != "<f4":
        raise InputError(f"{name} typestr {typestr!r}; allowed: '<f4' (float32)")
    if len(shape) not in (2, 3) or shape[-1] != hidden:
        raise InputError(f"{name} shape {shape}; expected (batch, tokens, {hidden}) or (tokens, {hidden})")
    batch, tokens = (1, shape[0]) if len(shape) == 2 else shape[:2]
    fb, ft = fixed_shape
    if not (1 <= batch <= fb and 1 <= tokens <= ft):
        raise InputError(f"{name} shape {shape}; allowed: batch 1..{fb}, tokens 1..{ft} (the bundle's fixed shape)")
    strides = cai.get("strides")
    contiguous = tuple(4 * int(_prod(shape[i + 1:])) for i in range(len(shape)))
    if strides is not None and tuple(int(s) for s in strides) != contiguous:
        raise InputError(f"{name} strides {tuple(strides)}; allowed: None or the C-contiguous {contiguous}")
    ptr, read_only = cai.get("data", (0, False))
    if name == "out" and read_only:
        raise InputError("out is read-only (__cuda_array_interface__ data flag); pass a writable device array")
    if not ptr:
        raise InputError(f"{name} has a null device pointer")
    return DeviceArray(int(ptr), shape, int(batch), int(tokens))


def _prod(values) -> int:
    n = 1
    for v in values:
        n *= int(v)
    return n


def stream_handle(stream) -> int:
    """The raw CUstream address of `stream`: None → 0 (legacy default stream); an int; a cuda-bindings CUstream
    (int()able); torch.cuda.Stream (`cuda_stream`); cupy.cuda.Stream (`ptr`); anything with `handle`.

    Raises:
        InputError: an object none of these.
    """
    if stream is None:
        return 0
    for attr in ("cuda_stream", "ptr", "handle"):
        if hasattr(stream, attr) and not isinstance(stream, int):
            stream = getattr(stream, attr)
            break
    try:
        value = int(stream)
    except (TypeError, ValueError):
        raise InputError(f"stream {stream!r}; allowed: None, an int CUstream handle, a CUstream, "
                         "torch.cuda.Stream or cupy.cuda.Stream") from None
    if value < 0:
        raise InputError(f"stream {value}; a CUstream handle is a non-negative address")
    return value
