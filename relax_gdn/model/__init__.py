"""Qwen3.5 assembly on Megatron-Core: specs, the CP + THD attention core that needs no Transformer
Engine, norms, checkpoint import."""

from relax_gdn.model.attention import ATTENTION_BACKENDS, CPDotProductAttention
from relax_gdn.model.norms import RMSNorm
from relax_gdn.model.qwen3_5 import (
    MODEL_ATTENTION_BACKENDS,
    PRESETS,
    SPEC_PROVIDERS,
    Qwen3_5Model,
    Qwen3_5Preset,
    Qwen3_5SelfAttention,
    TokenRotaryEmbedding,
    build_qwen3_5_model,
    build_qwen3_5_preset_model,
    qwen3_5_block_spec,
    qwen3_5_config,
    qwen3_5_preset,
    resolve_spec_provider,
    transformer_engine_import_error,
)

__all__ = [
    "ATTENTION_BACKENDS",
    "CPDotProductAttention",
    "MODEL_ATTENTION_BACKENDS",
    "PRESETS",
    "Qwen3_5Model",
    "Qwen3_5Preset",
    "Qwen3_5SelfAttention",
    "RMSNorm",
    "SPEC_PROVIDERS",
    "TokenRotaryEmbedding",
    "build_qwen3_5_model",
    "build_qwen3_5_preset_model",
    "qwen3_5_block_spec",
    "qwen3_5_config",
    "qwen3_5_preset",
    "resolve_spec_provider",
    "transformer_engine_import_error",
]
