"""Hugging Face MoE checkpoints (Mixtral, Qwen3-MoE, OLMoE; per-expert or fused experts) → .colibri.

Needs `safetensors` (the `convert` extra); no torch. Usage guide: docs/convert.md.
"""

from .checkpoint import Checkpoint, TensorInfo
from .converter import ConvertReport, convert, inspect_checkpoint
from .families import SUPPORTED_MODEL_TYPES, ModelSpec, model_spec
from .layout import Layout, Source, plan

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "Checkpoint",
    "ConvertReport",
    "Layout",
    "ModelSpec",
    "Source",
    "TensorInfo",
    "convert",
    "inspect_checkpoint",
    "model_spec",
    "plan",
]
