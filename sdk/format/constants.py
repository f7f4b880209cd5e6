"""Constants of the .colibri v1 format: magic, version, header offsets, dtype and mode tables.

Every other module imports these; nothing retypes them. The byte-level specification is docs/format.md.
"""

from __future__ import annotations

import numpy as np

MAGIC = b"COLI"
VERSION = 0x0100
HEADER_SIZE = 64

# struct layout of the header (little-endian). Offsets in bytes:
#   0 magic[4]  4 version  6 num_layers  8 num_experts  10 top_k  12 hidden_size  14 intermediate_size  16 dtype
#   18..63 reserved (46 bytes). v1 extensions that live in the reserved area (zero = the original v1 description's meaning):
#   18 routing  20 composition   22..63 must be zero.
HEADER_STRUCT = "<4sHHHHHHHHH"  # magic, version, 7 size/dtype fields, routing, composition  → 22 bytes
RESERVED_OFFSET = 18
RESERVED_SIZE = HEADER_SIZE - RESERVED_OFFSET  # 46
EXTENSION_END = 22  # bytes 22..63 must be zero in v1
U16_MAX = 0xFFFF

# dtype code → NumPy little-endian dtype. The one table that maps a dtype to its byte size.
DTYPES: dict[int, np.dtype] = {0: np.dtype("<f4"), 1: np.dtype("<f2")}
DTYPE_NAMES: dict[int, str] = {0: "float32", 1: "float16"}
DTYPE_CODES: dict[str, int] = {"float32": 0, "fp32": 0, "float16": 1, "fp16": 1}

# Routing modes (header offset 18). How the top-k routing weights are formed from router logits z (fp32):
#   0 TOPK_SOFTMAX:  softmax over the k selected logits (== softmax over all experts, then renormalise the top-k;
#                    Mixtral, Qwen3-MoE/OLMoE with norm_topk_prob=True). The source description's meaning.
#   1 SOFTMAX_TOPK:  softmax over all experts, the k selected probabilities used as they are
#                    (OLMoE, Qwen2/3-MoE with norm_topk_prob=False).
ROUTING_TOPK_SOFTMAX = 0
ROUTING_SOFTMAX_TOPK = 1
ROUTING_NAMES: dict[int, str] = {0: "topk_softmax", 1: "softmax_topk"}

# Layer composition (header offset 20). How layer outputs compose in a multi-layer file:
#   0 SEQUENTIAL: x_{l+1} = moe_l(x_l)          (the original v1 description's meaning)
#   1 RESIDUAL:   x_{l+1} = x_l + moe_l(x_l)
COMPOSITION_SEQUENTIAL = 0
COMPOSITION_RESIDUAL = 1
COMPOSITION_NAMES: dict[int, str] = {0: "sequential", 1: "residual"}

# Tensor kinds, in file order. Shapes per expert (gate/up/down) or per layer (router).
KINDS = ("gate_proj", "up_proj", "down_proj", "router")

# Largest value float16 can hold (IEEE 754 binary16).
FP16_MAX = 65504.0
