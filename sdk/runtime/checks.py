"""Checks of a call's arrays: the input and its per-sequence lengths, the caller's `out`, and the error for a
non-finite output (which layer went non-finite first, found on the CPU reference engine).

Every check raises one typed, one-line error naming the bad value and what is allowed (docs/runtime.md, "Errors" and "Non-finite outputs").
"""

from __future__ import annotations

import numpy as np

from ..errors import InputError, NonFiniteOutputError
from ..format.constants import COMPOSITION_RESIDUAL

INPUT_DTYPES = (np.dtype(np.float32), np.dtype(np.float16))  # either byte order; converted to native float32


def check_input(x, input_lengths, shape: tuple[int, int], hidden: int, shapes: int = 1):
    """Validate x and input_lengths against a runtime's largest compiled `shape` (batch, tokens), its `hidden` size
    and the count of compiled `shapes`; return x as (batch, tokens, hidden) and lengths (batch,) or None.

    Raises:
        InputError: as `Runtime.infer` says for x and input_lengths.
    """
    fixed_batch, fixed_tokens = shape
    expected = (
        f"(batch <= {fixed_batch}, tokens <= {fixed_tokens}, {hidden}) or (tokens <= {fixed_tokens}, {hidden})"
    )
    # One compiled shape: "the bundle's fixed batch"; several: the bound is the largest shape's.
    bound = "fixed" if shapes == 1 else f"largest compiled shape's (batch {fixed_batch} x tokens " \
        f"{fixed_tokens})"
    if not isinstance(x, np.ndarray):
        raise InputError(f"input is a {type(x).__name__}; expected a numpy.ndarray {expected}, float32 or float16")
    if isinstance(x, np.ma.MaskedArray):
        raise InputError(
            "input is a masked array; the mask would be ignored: pass np.asarray(x.filled(0)) and mark padding "
            "with input_lengths"
        )
    if x.dtype.newbyteorder("=") not in INPUT_DTYPES:
        raise InputError(f"input dtype {x.dtype}; allowed: float32, float16 (little- or big-endian)")
    if x.ndim not in (2, 3):
        raise InputError(f"input shape {x.shape}; expected {expected}")
    if x.shape[-1] != hidden:
        hint = ": the hidden size goes last (a transposed array?)" if x.shape[-2] == hidden else ""
        raise InputError(f"input hidden size {x.shape[-1]} (shape {x.shape}); expected {hidden}{hint}")
    x3 = x if x.ndim == 3 else x[None]
    batch, tokens, _ = x3.shape
    if not 1 <= batch <= fixed_batch:
        raise InputError(f"input batch {batch} (shape {x.shape}); allowed: {counts_up_to(fixed_batch)}, the "
                         f"bundle's {bound} batch")
    if not 1 <= tokens <= fixed_tokens:
        raise InputError(f"input tokens {tokens} (shape {x.shape}); allowed: {counts_up_to(fixed_tokens)}, the "
                         f"bundle's {bound} tokens")
    if not x.flags.c_contiguous:
        raise InputError(
            f"input is not C-contiguous (shape {x.shape}, strides {x.strides}); pass np.ascontiguousarray(x)"
        )
    lengths = None if input_lengths is None else check_lengths(input_lengths, x.ndim, batch, tokens, fixed_tokens,
                                                                 shapes)
    return x3, lengths


def counts_up_to(bound: int) -> str:
    """The counts 1..bound as an error message names them: "1" alone where bound is 1."""
    return "1" if bound == 1 else f"1..{bound}"


def check_lengths(input_lengths, ndim: int, batch: int, tokens: int, fixed_tokens: int,
                  shapes: int = 1) -> list[int]:
    """Validate per-sequence lengths of an input of `batch` sequences of `tokens` tokens (`fixed_tokens`: the
    bundle's, or its largest compiled shape's where it has `shapes` > 1, for the message); return them as ints.

    Raises:
        InputError: not integers, the wrong shape, or a length outside 0..tokens.
    """
    try:
        arr = np.asarray(input_lengths)
    except (ValueError, TypeError) as exc:  # e.g. a ragged nested list
        raise InputError(f"input_lengths is not an array of integers ({exc}); expected ({batch},)") from None
    if ndim == 2 and arr.ndim == 0:
        arr = arr.reshape(1)
    if arr.shape != (batch,):
        raise InputError(f"input_lengths shape {arr.shape}; expected ({batch},), one length per sequence")
    if arr.dtype.kind not in "iu":
        raise InputError(f"input_lengths dtype {arr.dtype}; allowed: integers")
    lengths = [int(n) for n in arr]
    for b, n in enumerate(lengths):
        if not 0 <= n <= tokens:
            raise InputError(
                f"input_lengths[{b}] = {n}; allowed: 0..{tokens} (the input's tokens; "
                + (f"the bundle's fixed tokens are {fixed_tokens})" if shapes == 1 else
                   f"the bundle's largest compiled shape's tokens are {fixed_tokens})")
            )
    return lengths


def check_out(out, x) -> np.ndarray:
    """Validate a caller's output array for the input x; return it as (batch, tokens, hidden).

    Raises:
        InputError: not a NumPy array, not float32, not x's shape, not C-contiguous and writable.
    """
    if not isinstance(out, np.ndarray):
        raise InputError(f"out is a {type(out).__name__}; expected a numpy.ndarray of shape {x.shape}, float32")
    if out.dtype != np.float32:
        raise InputError(f"out dtype {out.dtype}; allowed: float32")
    if out.shape != x.shape:
        raise InputError(f"out shape {out.shape}; expected the input's shape {x.shape}")
    if not out.flags.c_contiguous or not out.flags.writeable:
        raise InputError(f"out must be C-contiguous and writable (strides {out.strides}, writeable "
                         f"{out.flags.writeable})")
    return out if out.ndim == 3 else out[None]


# A value this large in the reference's rerun of a token leaves float32 (largest 3.4e38) a margin that another order
# of the same sums (a router logit over hidden-size products, a down projection) can use up.
NEAR_OVERFLOW = 1e30


def nonfinite_output(bundle, backend_name: str, x3: np.ndarray, out: np.ndarray) -> NonFiniteOutputError:
    """The error for an output (batch, tokens, hidden) with NaN/Inf from `bundle` on `backend_name`: where, how many, and the first layer whose output is non-finite
    for the first bad token, found by re-running that one token through the CPU reference engine (float32,
    the bundle's weights; tokens are independent in a MoE layer, so one token suffices)."""
    from ..reference import ReferenceEngine

    bad = np.argwhere(~np.isfinite(out).all(axis=-1))
    b, t = (int(v) for v in bad[0])
    layer = None
    with bundle.open_weights() as weights, np.errstate(over="ignore", invalid="ignore"):
        engine = ReferenceEngine(weights, compute_dtype=np.float32, check_overflow=False)
        state = np.asarray(x3[b, t : t + 1], dtype=np.float32)
        magnitude = float(np.abs(x3[b, t]).max())
        peak = magnitude  # the largest |value| the reference met: the input, each layer's output
        residual = weights.header.composition == COMPOSITION_RESIDUAL
        for index in range(weights.header.num_layers):
            layer_input = float(np.abs(state).max())
            y = engine.layer(index, state)
            state = state + y if residual else y
            if not np.isfinite(state).all():
                layer = index
                break
            peak = max(peak, float(np.abs(state).max()))
    where = f"{len(bad)} valid position{'s' if len(bad) != 1 else ''}, first at (batch {b}, token {t})"
    if layer is None and peak >= NEAR_OVERFLOW:
        cause = (f"the CPU reference engine gives finite values for that token run alone, but values up to "
                 f"{peak:.3g} on the way, near float32's largest (3.4e38): the same sums in another order (the "
                 f"{backend_name} backend's, or the batch's) can overflow there, so the input's scale is the likely "
                 "cause")
    elif layer is None:
        cause = (f"the CPU reference engine gives finite values for that token, so the {backend_name} "
                 "backend's result is wrong")
    else:
        call = "" if layer == 0 else f", the call's {magnitude:.3g}"
        cause = (f"layer {layer} is the first whose output is non-finite (the largest |value| of its input is "
                 f"{layer_input:.3g}{call}; float32's largest value is 3.4e38)")
    return NonFiniteOutputError(
        f"the output is non-finite (NaN or Inf) at {where}, from a finite input: {cause}", layer, (b, t), len(bad)
    )
