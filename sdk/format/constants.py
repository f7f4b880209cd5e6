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

# ---- v2 (docs/format.md, "v2 (0x0200)") ------------------------------------------------------------------------
VERSION_1 = VERSION
VERSION_2 = 0x0200
VERSIONS = (VERSION_1, VERSION_2)
# The v2 header: the v1 fields at their v1 offsets, then 15 u16 fields (22..51) and 3 float32 fields (52..63).
HEADER_V2_STRUCT = "<4sHHHHHHHHH" + "H" * 15 + "fff"
HEADER_V2_FIELDS = (
    "quant",  # 22
    "group_size",  # 24
    "zero_points",  # 26
    "norm_topk",  # 28
    "n_group",  # 30
    "topk_group",  # 32
    "group_score",  # 34
    "router_bias",  # 36
    "correction_bias",  # 38
    "num_shared_experts",  # 40
    "shared_intermediate_size",  # 42
    "shared_gate",  # 44
    "expert_bias",  # 46
    "activation",  # 48
    "num_model_layers",  # 50
)
HEADER_V2_FLOATS = ("routed_scaling_factor", "swiglu_limit", "swiglu_alpha")  # 52, 56, 60 (float32)
LAYER_MAP_OFFSET = 64  # num_layers × u16 right after the header
BLOCK_ALIGN = 64  # every v2 block starts at a multiple of this many bytes; the gaps are zero

# Routing v2 adds sigmoid scores (DeepSeek-V3, GLM-4.5 MoE).
ROUTING_SIGMOID_TOPK = 2
ROUTING_V2_NAMES: dict[int, str] = {0: "topk_softmax", 1: "softmax_topk", 2: "sigmoid_topk"}

# Weight storage of the expert matrices (header offset 22).
QUANT_FLOAT = 0
QUANT_INT8 = 1
QUANT_INT4 = 2
QUANT_NAMES: dict[int, str] = {0: "float", 1: "int8", 2: "int4"}
QUANT_CODES: dict[str, int] = {name: code for code, name in QUANT_NAMES.items()}
# Allowed group sizes per storage (header offset 24); 0 = one group per row.
GROUP_SIZES: dict[int, tuple[int, ...]] = {QUANT_FLOAT: (0,), QUANT_INT8: (0, 32, 64, 128), QUANT_INT4: (32, 64, 128)}
# Code range of each quantized storage (two's complement int8; int4 nibble u holds q = u - 8).
QUANT_RANGE: dict[int, tuple[int, int]] = {QUANT_INT8: (-128, 127), QUANT_INT4: (-8, 7)}
INT4_OFFSET = 8

# Group-limited selection (header offset 34).
GROUP_SCORE_NONE = 0
GROUP_SCORE_MAX = 1  # DeepSeek-V2 group_limited_greedy
GROUP_SCORE_TOP2_SUM = 2  # DeepSeek-V3 noaux_tc
GROUP_SCORE_NAMES: dict[int, str] = {0: "none", 1: "max", 2: "top2_sum"}

# Expert activation (header offset 48).
ACTIVATION_SWIGLU = 0
ACTIVATION_CLAMPED_SWIGLU = 1  # gpt-oss: gate·sigmoid(alpha·gate)·(up + 1), gate ≤ limit, |up| ≤ limit
ACTIVATION_NAMES: dict[int, str] = {0: "swiglu", 1: "clamped_swiglu"}
GPT_OSS_SWIGLU_LIMIT = 7.0
GPT_OSS_SWIGLU_ALPHA = 1.702

# The expert matrices of a v2 file (routed, then shared), and the float32 vectors/matrices.
MATRIX_KINDS = ("gate_proj", "up_proj", "down_proj")
SHARED_KINDS = ("shared_gate_proj", "shared_up_proj", "shared_down_proj")
BIAS_KINDS = ("gate_bias", "up_bias", "down_bias")
SCALES_SUFFIX = ".scales"
ZEROS_SUFFIX = ".zeros"
