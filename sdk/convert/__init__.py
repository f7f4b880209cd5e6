"""MoE checkpoints → .colibri: Hugging Face folders (Mixtral, Qwen2/3-MoE, OLMoE, GraniteMoE, DeepSeek-V2/V3,
GLM-4-MoE, gpt-oss; float, compressed-tensors pack-quantized, gpt-oss MXFP4) and GGUF files (F32/F16/BF16, Q8_0,
Q4_0).

Needs `safetensors` (the `convert` extra), `gguf` for GGUF files; no torch. Usage guide: docs/convert.md.
"""

from .checkpoint import Checkpoint, TensorInfo
from .converter import ConvertReport, Storage, build_header, choose_storage, convert, inspect_checkpoint
from .families import SUPPORTED_MODEL_TYPES, ExpertSpec, ModelSpec, RouterSpec, SharedSpec, model_spec
from .layout import Layout, Source, plan
from .source import Model, open_model

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "Checkpoint",
    "ConvertReport",
    "ExpertSpec",
    "Layout",
    "Model",
    "ModelSpec",
    "RouterSpec",
    "SharedSpec",
    "Source",
    "Storage",
    "TensorInfo",
    "build_header",
    "choose_storage",
    "convert",
    "inspect_checkpoint",
    "model_spec",
    "open_model",
    "plan",
]
