"""Qwen3.5 assembly on Megatron-Core: specs, the CP + THD attention core that needs no Transformer
Engine, norms, checkpoint import.

The names below load on first use (PEP 562): ``relax_gdn.model.presets`` is plain numbers that
configuration checks read before anything heavy is imported, and importing this package eagerly
would pull in Megatron-Core, which takes many times longer to import than the whole configuration
check takes (docs/benchmarks.md, "Figures behind code comments").
"""

from __future__ import annotations

from relax_gdn.choices import ATTENTION_BACKENDS, MODEL_ATTENTION_BACKENDS, SPEC_PROVIDERS
from relax_gdn.lazy_names import lazy_getattr
from relax_gdn.model.presets import PRESETS, Qwen3_5Preset, qwen3_5_preset

_LAZY = {
    "CPDotProductAttention": "relax_gdn.model.attention",
    "RMSNorm": "relax_gdn.model.norms",
    "MTPOptions": "relax_gdn.model.mtp",
    **{
        name: "relax_gdn.model.qwen3_5"
        for name in (
            "Qwen3_5Model",
            "Qwen3_5Options",
            "build_qwen3_5_model",
            "build_qwen3_5_preset_model",
            "qwen3_5_config",
        )
    },
    **{
        name: "relax_gdn.model.qwen3_5_specs"
        for name in (
            "Qwen3_5SelfAttention",
            "TokenRotaryEmbedding",
            "qwen3_5_block_spec",
            "resolve_spec_provider",
            "transformer_engine_import_error",
        )
    },
}


__getattr__ = lazy_getattr(__name__, _LAZY)


__all__ = [
    "ATTENTION_BACKENDS",
    "MODEL_ATTENTION_BACKENDS",
    "PRESETS",
    "Qwen3_5Preset",
    "SPEC_PROVIDERS",
    "qwen3_5_preset",
    *_LAZY,
]
