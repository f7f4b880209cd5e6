"""GGUF MoE files (llama.cpp) as a conversion source, read with the `gguf` package (gguf-py, llama.cpp's own).

Metadata (`{arch}.*` keys of gguf-py `Keys.LLM`) → ModelSpec; tensors per block `blk.N.` (gguf-py
`TENSOR_NAMES`): `ffn_gate_inp` router (experts, hidden), `ffn_gate_exps` / `ffn_up_exps` (experts, inter, hidden),
`ffn_down_exps` (experts, hidden, inter), and for Qwen2-MoE the shared expert `ffn_{gate,up,down}_shexp` with its
gate `ffn_gate_inp_shexp` (hidden,). Shapes here are NumPy order (GGUF lists them reversed, `ne[0]` first).

Routing per architecture, as llama.cpp builds it (`build_moe_ffn` calls in src/models/*.cpp): llama (Mixtral)
and qwen3moe softmax → top-k → renormalise; qwen2moe and olmoe softmax → top-k, not renormalised;
`{arch}.expert_weights_scale` (≠ 0, 1) scales the weights; `{arch}.expert_weights_norm` overrides the
renormalisation when present. deepseek2 (DeepSeek-V2/V3 as llama.cpp runs them): `expert_gating_func` 1 softmax
or 2 sigmoid (with the selection-only bias `blk.N.exp_probs_b.bias`), `expert_weights_norm`,
`expert_weights_scale`, the first `leading_dense_block_count` layers dense, an ungated shared expert of
`expert_shared_count × expert_feed_forward_length`; group-limited selection (`expert_group_count` > 1) is refused.

Storage: F32, F16, BF16 tensors are floats; Q8_0 (blocks of 32: fp16 d, 32 int8 q; w = d·q) and Q4_0 (fp16 d, 16
bytes: element j in the low nibble of byte j, element j+16 in its high nibble; w = d·(nibble − 8)) map onto
.colibri v2 int8 / int4 with group 32 and fp16 scales exactly, without re-quantizing (the int4 nibbles are
re-ordered to the format's column order). Float reads use `gguf.quants.dequantize`; tests check the codes and
scales against it bit for bit. Other GGML types are refused by name.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from ..errors import ConvertError
from ..format.constants import QUANT_INT4, QUANT_INT8
from .families import U16_MAX, ExpertSpec, ModelSpec, RouterSpec, SharedSpec
from .gguf_header import check_header
from .layout import Layout, Source
from .model import Model
from .tensors import Codes

# GGUF architecture → (family, renormalise the top-k weights by default, has a gated shared expert).
ARCHITECTURES = {
    "llama": ("mixtral", True, False),
    "qwen3moe": ("qwen3_moe", True, False),
    "qwen2moe": ("qwen2_moe", False, True),
    "olmoe": ("olmoe", False, False),
    "deepseek2": ("deepseek_v2", False, False),
}
FLOAT_TYPES = ("F32", "F16", "BF16")
QUANT_TYPES = {"Q8_0": (QUANT_INT8, 8), "Q4_0": (QUANT_INT4, 4)}
GROUP = 32


def _gguf():
    try:
        import gguf
    except ImportError as exc:
        raise ConvertError(
            "reading GGUF files needs the `gguf` package: pip install 'colibri-sdk[convert]' (or pip install gguf)"
        ) from exc
    return gguf


class GGUFModel(Model):
    """One GGUF file (`.gguf`) holding a MoE model.

    Raises:
        ConvertError: a header count or length beyond the file's end, or an unknown value type (gguf_header), not
            a readable GGUF file, an architecture other than ARCHITECTURES, missing or out-of-range
            metadata, a layout without 3-D `*_exps` tensors, missing or mis-shaped tensors, a GGML type other
            than F32/F16/BF16/Q8_0/Q4_0.
    """

    def __init__(self, path: str | os.PathLike):
        gguf = _gguf()
        self.path = Path(path)
        if not self.path.is_file():
            raise ConvertError(f"{self.path}: no such GGUF file")
        check_header(self.path, gguf)  # every count and length against the file's size, before gguf-py trusts them
        try:
            self.reader = gguf.GGUFReader(str(self.path), "r")
        except Exception as exc:  # gguf-py raises ValueError / struct.error / OSError on malformed files
            raise ConvertError(f"{self.path}: not a readable GGUF file ({type(exc).__name__}: {str(exc)[:200]})") from exc
        self.quants = gguf.quants
        self._file = None
        self.tensors = {t.name: t for t in self.reader.tensors}
        self.spec = self._spec()
        self.layout = self._plan()

    # ---- metadata ---------------------------------------------------------------------------------------------
    def _field(self, key: str, default=None):
        field = self.reader.fields.get(key)
        if field is None:
            return default
        try:
            return field.contents()
        except (ValueError, IndexError) as exc:  # e.g. a string value that is not UTF-8 (UnicodeDecodeError)
            raise ConvertError(
                f"{self.path.name}: GGUF metadata {key} is unreadable ({type(exc).__name__}: {str(exc)[:120]}); "
                f"allowed: a value of its GGUF type (strings UTF-8)"
            ) from None

    def _size(self, key: str, what: str, fallback: str | None = None) -> int:
        value = self._field(key)
        if value is None and fallback is not None:
            key, value = fallback, self._field(fallback)
        if value is None:
            raise ConvertError(f"{self.path.name}: GGUF metadata has no {what} ({key})")
        if not isinstance(value, int) or not 1 <= value <= U16_MAX:
            raise ConvertError(f"{self.path.name}: GGUF {key} = {value!r}; allowed: an integer in 1..{U16_MAX}")
        return value

    def _spec(self) -> ModelSpec:
        arch = self._field("general.architecture")
        if arch not in ARCHITECTURES or (arch == "llama" and not self._field("llama.expert_count")):
            raise ConvertError(
                f"{self.path.name}: GGUF general.architecture = {arch!r} is not a supported MoE; allowed: "
                f"{', '.join(ARCHITECTURES)} (llama with experts: Mixtral)"
            )
        family, renorm, shared = ARCHITECTURES[arch]
        gating = self._field(f"{arch}.expert_gating_func")
        allowed = (None, 1, 2) if arch == "deepseek2" else (None, 1)
        if gating not in allowed:
            raise ConvertError(
                f"{arch}: GGUF {arch}.expert_gating_func = {gating!r}; allowed: "
                f"{'1 (softmax), 2 (sigmoid)' if arch == 'deepseek2' else '1 (softmax)'} or absent"
            )
        sigmoid = gating == 2
        if sigmoid:
            family = "deepseek_v3"
        groups = self._field(f"{arch}.expert_group_count")
        if groups not in (None, 0, 1):
            raise ConvertError(
                f"{family}: GGUF {arch}.expert_group_count = {groups!r}: group-limited routing is not imported from "
                f"GGUF; convert the Hugging Face checkpoint (deepseek_v2 / deepseek_v3 keep n_group, topk_group)"
            )
        norm = self._field(f"{arch}.expert_weights_norm")
        if norm is not None and not isinstance(norm, bool):  # bool("false") is True: only a GGUF BOOL is read
            raise ConvertError(f"{family}: GGUF {arch}.expert_weights_norm = {norm!r}; allowed: true or false (BOOL)")
        renorm = renorm if norm is None else norm
        scale = self._field(f"{arch}.expert_weights_scale")
        if scale is not None and (isinstance(scale, (bool, str)) or not isinstance(scale, (int, float)) or scale < 0):
            raise ConvertError(f"{family}: GGUF {arch}.expert_weights_scale = {scale!r}; allowed: a number >= 0")
        scale = 1.0 if scale in (None, 0, 0.0) else float(scale)
        L = self._size(f"{arch}.block_count", "layer count")
        E = self._size(f"{arch}.expert_count", "expert count")
        K = self._size(f"{arch}.expert_used_count", "top-k")
        H = self._size(f"{arch}.embedding_length", "hidden size")
        inter = self._size(f"{arch}.expert_feed_forward_length", "expert size", fallback=f"{arch}.feed_forward_length")
        if K > E:
            raise ConvertError(f"{arch}: GGUF {arch}.expert_used_count = {K} exceeds expert_count = {E}; allowed: 1..{E}")
        shared_spec = None
        if shared and any(n.endswith("ffn_gate_shexp.weight") for n in self.tensors):
            size = self._size(f"{arch}.expert_shared_feed_forward_length", "shared expert size")
            shared_spec = SharedSpec(size, gated=True)
        if arch == "deepseek2" and self._field(f"{arch}.expert_shared_count"):
            shared_spec = SharedSpec(self._size(f"{arch}.expert_shared_count", "shared expert count") * inter, gated=False)
        moe = tuple(l for l in range(L) if f"blk.{l}.ffn_gate_inp.weight" in self.tensors)
        if not moe:
            raise ConvertError(f"{family}: no MoE router in {self.path.name} (no tensor blk.N.ffn_gate_inp.weight)")
        lead = self._field(f"{arch}.leading_dense_block_count")
        if arch == "deepseek2" and lead is not None and moe != tuple(range(lead, L)):
            raise ConvertError(
                f"{family}: GGUF {arch}.leading_dense_block_count = {lead!r}, but the routers are in layers {list(moe)}"
            )
        bias = sigmoid and any(n.endswith("exp_probs_b.bias") for n in self.tensors)
        keys = dict(num_layers=f"{arch}.block_count", num_experts=f"{arch}.expert_count",
                    top_k=f"{arch}.expert_used_count", hidden_size=f"{arch}.embedding_length",
                    intermediate_size=f"{arch}.expert_feed_forward_length")
        order = "softmax_topk"
        return ModelSpec(
            family=family, num_layers=L, moe_layers=moe, dense_layers=tuple(sorted(set(range(L)) - set(moe))),
            num_experts=E, top_k=K, hidden_size=H, expert=ExpertSpec(inter),
            router=RouterSpec(scoring="sigmoid" if sigmoid else "softmax", order=order, renormalize=renorm,
                              renorm_epsilon=1e-20 if sigmoid else 0.0, scaling=scale, correction_bias=bias),
            shared=shared_spec, keys=keys,
        )

    # ---- tensors ----------------------------------------------------------------------------------------------
    def _tensor(self, name: str, shape: tuple[int, ...]):
        t = self.tensors.get(name)
        if t is None and name.endswith(("ffn_gate_exps.weight", "ffn_up_exps.weight")):
            merged = name.rsplit(".", 2)[0] + ".ffn_gate_up_exps.weight"
            if merged in self.tensors:
                raise ConvertError(
                    f"{self.spec.family}: {self.path.name} stores gate and up fused ({merged!r}), which is not "
                    f"imported; convert the Hugging Face checkpoint"
                )
        if t is None:
            if name.endswith("_exps.weight") and any(f".{name.split('.')[2].removesuffix('_exps')}.0." in n for n in self.tensors):
                raise ConvertError(
                    f"{self.spec.family}: {self.path.name} stores one tensor per expert (an old GGUF layout); "
                    f"re-convert it with a current llama.cpp convert_hf_to_gguf.py (3-D *_exps tensors)"
                )
            raise ConvertError(f"{self.spec.family}: GGUF tensor {name!r} is missing from {self.path.name}")
        got = tuple(int(v) for v in reversed(list(t.shape)))
        if got != shape:
            raise ConvertError(f"{self.spec.family}: GGUF tensor {name!r} has shape {got}; expected {shape}")
        kind = t.tensor_type.name
        if kind not in FLOAT_TYPES and kind not in QUANT_TYPES:
            raise ConvertError(
                f"{self.spec.family}: GGUF tensor {name!r} is {kind}, which is not imported; allowed: "
                f"{', '.join(FLOAT_TYPES + tuple(QUANT_TYPES))} (re-quantize with llama-quantize to Q8_0 or Q4_0, "
                f"or convert the Hugging Face checkpoint)"
            )
        return t

    def _plan(self) -> Layout:
        s = self.spec
        E, H, I = s.num_experts, s.hidden_size, s.intermediate_size
        sources = {}
        for fl, layer in enumerate(s.moe_layers):
            b = f"blk.{layer}."
            self._tensor(b + "ffn_gate_inp.weight", (E, H))
            sources[("router", fl, None)] = Source(b + "ffn_gate_inp.weight", None, "T")
            for kind, name, shape in (("gate_proj", "ffn_gate_exps", (E, I, H)), ("up_proj", "ffn_up_exps", (E, I, H)),
                                      ("down_proj", "ffn_down_exps", (E, H, I))):
                t = self._tensor(b + name + ".weight", shape)
                for e in range(E):
                    sources[(kind, fl, e)] = Source(t.name, (e,), None, self._quant(t))
            if s.router.correction_bias:
                self._tensor(b + "exp_probs_b.bias", (E,))
                sources[("correction_bias", fl, None)] = Source(b + "exp_probs_b.bias")
            if s.shared is not None:
                Is = s.shared.intermediate_size
                for kind, name, shape in (("shared_gate_proj", "ffn_gate_shexp", (Is, H)),
                                          ("shared_up_proj", "ffn_up_shexp", (Is, H)),
                                          ("shared_down_proj", "ffn_down_shexp", (H, Is))):
                    t = self._tensor(b + name + ".weight", shape)
                    sources[(kind, fl, 0)] = Source(t.name, None, None, self._quant(t))
                if s.shared.gated:
                    self._tensor(b + "ffn_gate_inp_shexp.weight", (H,))
                    sources[("shared_expert_gate", fl, None)] = Source(b + "ffn_gate_inp_shexp.weight")
        left_out = {l: "dense MLP layer" for l in s.dense_layers}
        return Layout(sources, "gguf", left_out)

    def _quant(self, t) -> str | None:
        return "gguf" if t.tensor_type.name in QUANT_TYPES else None

    def _data(self, source: Source) -> tuple[np.ndarray, object]:
        """The bytes (or floats) of a tensor or of one expert, read with a positioned read at the tensor's offset
        (not through gguf-py's memory map, whose touched pages would count towards the resident set)."""
        t = self.tensors[source.name]
        view = t.data if source.index is None else t.data[source.index]  # shape and dtype only; no data touched
        nbytes = view.size * view.dtype.itemsize
        offset = t.data_offset + (0 if source.index is None else source.index[0] * nbytes)
        out = np.empty(view.shape, view.dtype)
        if self._file is None:
            try:
                self._file = open(self.path, "rb", buffering=0)
            except OSError as exc:
                raise ConvertError(f"cannot open {self.path}: {exc.strerror}") from exc
        self._file.seek(offset)
        if self._file.readinto(memoryview(out).cast("B")) != nbytes:
            raise ConvertError(f"{self.path.name}: tensor {t.name!r} is cut short (file shorter than its header says)")
        return out, t.tensor_type

    def read_float(self, source: Source) -> np.ndarray:
        data, qtype = self._data(source)
        if qtype.name == "BF16":
            values = (data.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
        else:
            values = self.quants.dequantize(data, qtype).astype(np.float32, copy=False)
        if source.transform == "T":
            values = values.T
        return np.ascontiguousarray(values)

    def read_codes(self, source: Source) -> Codes:
        data, qtype = self._data(source)
        rows = data.shape[0]
        if qtype.name == "Q8_0":
            blocks = data.reshape(rows, -1, 2 + GROUP)
            scales = blocks[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)
            codes = blocks[..., 2:].copy().view(np.int8).reshape(rows, -1)
            return Codes(codes, scales, None, GROUP, 8, codes.shape[1])
        blocks = data.reshape(rows, -1, 2 + GROUP // 2)
        scales = blocks[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)
        qs = blocks[..., 2:]
        codes = np.concatenate([(qs & 0x0F), (qs >> 4)], axis=-1).astype(np.int8) - 8  # elements 0..15, 16..31
        codes = codes.reshape(rows, -1)
        return Codes(codes, scales, None, GROUP, 4, codes.shape[1])

    def native_storage(self):
        types = {self.tensors[s.name].tensor_type.name for s in self.quantized_sources()}
        if not types:
            return None
        if len(types) > 1:
            raise ConvertError(
                f"{self.spec.family}: the expert tensors of {self.path.name} mix {', '.join(sorted(types))}; .colibri "
                f"holds one storage per file; convert with --dtype fp16 or fp32 (dequantized exactly in fp32)"
            )
        quant, _ = QUANT_TYPES[types.pop()]
        return quant, GROUP, False

    def scales_fit_fp16(self) -> bool:
        return True  # Q8_0 and Q4_0 scales are fp16

    def source_dtypes(self) -> tuple[str, ...]:
        return tuple(sorted({self.tensors[s.name].tensor_type.name for s in self.layout.sources.values()}))

    def files(self) -> set[Path]:
        return {self.path}

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
