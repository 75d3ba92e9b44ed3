"""The Qwen3.5 presets as plain numbers (docs/design/QWEN3_5.md): one place decides every shape.

Torch-free on purpose: ``relax_gdn.config.validate`` checks head counts against TP and CP from
here before anything heavy is imported (``python train.py`` reports a configuration mistake in
about a second; importing Megatron-Core takes ten or more on a busy machine).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from relax_gdn.choices import MODEL_PRESETS


@dataclass(frozen=True)
class Qwen3_5Preset:
    """Shapes of one Qwen3.5 variant: ``config`` are ``TransformerConfig`` fields (plain values;
    ``qwen3_5_config`` adds the SwiGLU activation function), the rest are what ``GPTModel`` needs
    besides the config."""

    name: str
    config: dict = field(repr=False)
    vocab_size: int = 248_320
    max_sequence_length: int = 262_144
    rotary_percent: float = 0.25
    rotary_base: float = 10_000_000.0
    # the peak learning rate a run of this preset uses when optim.lr is null: fine-tuning rates for
    # the 9B shapes (a pre-trained model diverges at a from-scratch rate), a fast one for the demo
    sft_lr: float = 1e-5
    # the same when only LoRA adapters train (model.lora): the adapters start at zero and move the
    # output by scaling x B x A, so they take a rate about ten times the full fine-tuning one
    lora_lr: float = 1e-4


def _qwen3_5_shapes(**shapes) -> dict:
    """Everything Qwen3.5 fixes, plus the given shapes."""
    return dict(
        normalization="RMSNorm",
        layernorm_epsilon=1e-6,
        layernorm_zero_centered_gamma=True,
        qk_layernorm=True,
        attention_output_gate=True,
        gated_linear_unit=True,
        add_bias_linear=False,
        add_qkv_bias=False,
        rotary_interleaved=False,  # NeoX rotate-half
        experimental_attention_variant="gated_delta_net",
        linear_attention_freq=4,  # layers 3, 7, ... (0-based) are full attention
        linear_conv_kernel_dim=4,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        **shapes,
    )


_NINE_B_WIDTHS = dict(
    hidden_size=4096,
    ffn_hidden_size=12288,
    num_attention_heads=16,
    num_query_groups=4,
    kv_channels=256,
    linear_num_key_heads=16,
    linear_num_value_heads=32,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
)

PRESETS: dict[str, Qwen3_5Preset] = {
    "qwen3_5_9b": Qwen3_5Preset("qwen3_5_9b", _qwen3_5_shapes(num_layers=32, **_NINE_B_WIDTHS)),
    # one 3:1 block at full width: what fits a 2-GPU benchmark
    # (randomly initialised in benchmarks and comparisons, so it trains at a from-scratch rate)
    "qwen3_5_9b_reduced": Qwen3_5Preset(
        "qwen3_5_9b_reduced",
        _qwen3_5_shapes(num_layers=4, **_NINE_B_WIDTHS),
        sft_lr=2e-4,
        lora_lr=1e-3,
    ),
    # trains on CPU in seconds; keeps GQA (4 Q / 2 KV heads), the gate, partial RoPE (4 of 16
    # dims), the 3:1 pattern and GVA (8 value heads = 2 x 4 key heads; headwise works up to
    # TP x CP = 4)
    "qwen3_5_tiny": Qwen3_5Preset(
        "qwen3_5_tiny",
        _qwen3_5_shapes(
            num_layers=4,
            hidden_size=64,
            ffn_hidden_size=128,
            num_attention_heads=4,
            num_query_groups=2,
            kv_channels=16,
            linear_num_key_heads=4,
            linear_num_value_heads=8,
            linear_key_head_dim=8,
            linear_value_head_dim=8,
        ),
        vocab_size=256,
        max_sequence_length=4096,
        sft_lr=3e-3,
        lora_lr=1e-2,
    ),
}

assert tuple(PRESETS) == MODEL_PRESETS, "relax_gdn.choices.ModelPreset lists the presets defined here"


def qwen3_5_preset(preset: str | Qwen3_5Preset) -> Qwen3_5Preset:
    """The preset named ``preset`` (one of :data:`PRESETS`); a preset object is returned as is."""
    if isinstance(preset, Qwen3_5Preset):
        return preset
    if preset not in PRESETS:
        raise ValueError(f"unknown Qwen3.5 preset {preset!r}: use one of {tuple(PRESETS)}")
    return PRESETS[preset]
