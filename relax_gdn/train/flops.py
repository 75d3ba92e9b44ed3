"""Model FLOPs of the Qwen3.5 hybrid — the ONE place that counts them (docs/design/QWEN3_5.md).

Headline: Megatron-Core's accounting (``megatron.training.training.num_floating_point_operations``,
its GDN branch, THD form): for a step with real tokens ``N = Σ L_i`` and ``Σ L_i²`` over the packed
documents,

    F = 3 · 2 · ( N · per_token_linear  +  Σ L_i² · per_sequence_square )

* per token: MLP (SwiGLU: 3 · h · ffn per layer), attention projections (q + gate + k + v + o),
  GDN in_proj / conv / delta-rule state update / out_proj, logits (h · vocab);
* the L² part: causal core attention, ``q_proj_size / 2 · 2`` per attention layer.

With a multi-token-prediction layer (``model.mtp.num_layers``) each one adds what it is: a
gated-attention layer with its MLP (the formula of one attention layer, its L² part included), the
input fusion (``eh_proj``: 2h x h per token, plus 3h for its norms, Megatron-Core's MTP term) and its
own pass through the output layer (h x vocab per token). Megatron-Core's counter places the MTP layer
in the ``linear_attention_freq`` pattern after the decoder's (a GDN layer for the 9B's 33rd); here it
counts as the attention layer it is.

The Relax/verl counter behind the seed's MFU also counts the input embedding as a GEMM
(``h · vocab`` more per token, ≈ +6.1 GFLOP for 9B): :func:`relax_flops` adds exactly that.
Per token with ``s_eff = Σ L² / Σ L``: F/N = linear + s_eff · square — 49.53 GFLOP at s_eff 8192 and
52.75 at 24,576 for Qwen3.5-9B. Padding tokens count for nothing (real lengths only).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

H200_PEAK_BF16_TFLOPS = 989.0  # dense BF16 (never the 1979 sparse figure)

_FWD_BWD = 3  # forward, backward dgrad, backward wgrad
_FMA = 2


@dataclass(frozen=True)
class ModelShape:
    """What the FLOPs depend on; ``from_transformer_config`` reads them off Megatron-Core's config."""

    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    vocab_size: int
    num_attention_heads: int
    num_query_groups: int
    kv_channels: int
    attention_output_gate: bool
    linear_attention_freq: int  # every freq-th layer is full attention, the rest GDN
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    swiglu: bool = True
    mtp_num_layers: int = 0  # multi-token-prediction layers (each a gated-attention layer)

    @classmethod
    def from_transformer_config(cls, config, vocab_size: int, mtp_num_layers: int = 0) -> "ModelShape":
        return cls(
            num_layers=config.num_layers, hidden_size=config.hidden_size, ffn_hidden_size=config.ffn_hidden_size,
            vocab_size=vocab_size, num_attention_heads=config.num_attention_heads,
            num_query_groups=config.num_query_groups or config.num_attention_heads,
            kv_channels=config.kv_channels, attention_output_gate=bool(config.attention_output_gate),
            linear_attention_freq=config.linear_attention_freq, linear_num_key_heads=config.linear_num_key_heads,
            linear_num_value_heads=config.linear_num_value_heads, linear_key_head_dim=config.linear_key_head_dim,
            linear_value_head_dim=config.linear_value_head_dim, linear_conv_kernel_dim=config.linear_conv_kernel_dim,
            swiglu=bool(config.gated_linear_unit), mtp_num_layers=mtp_num_layers,
        )

    @property
    def num_attention_layers(self) -> int:
        return sum((i + 1) % self.linear_attention_freq == 0 for i in range(self.num_layers))

    @property
    def num_gdn_layers(self) -> int:
        return self.num_layers - self.num_attention_layers


@dataclass(frozen=True)
class FlopsBreakdown:
    """Training FLOPs (fwd + bwd) by part; ``total`` is Megatron-Core's figure."""

    mlp: float
    gdn_projections: float
    gdn_conv: float
    gdn_core: float
    attention_projections: float
    attention_core: float
    logits: float
    mtp: float = 0.0  # the MTP layers: input fusion, attention layer (L² part included), MLP, their logits

    @property
    def total(self) -> float:
        return (self.mlp + self.gdn_projections + self.gdn_conv + self.gdn_core + self.attention_projections
                + self.attention_core + self.logits + self.mtp)


def megatron_flops_breakdown(shape: ModelShape, num_tokens: float, seqlen_squared_sum: float) -> FlopsBreakdown:
    """Megatron-Core's accounting of one step, by part (``num_tokens``: real tokens Σ L_i)."""
    k = _FWD_BWD * _FMA
    h = shape.hidden_size
    ffn_factor = 3 if shape.swiglu else 2
    q = shape.kv_channels * shape.num_attention_heads
    kv = shape.kv_channels * shape.num_query_groups
    gate = q if shape.attention_output_gate else 0
    qk_dim = shape.linear_key_head_dim * shape.linear_num_key_heads
    v_dim = shape.linear_value_head_dim * shape.linear_num_value_heads
    n_attn, n_gdn = shape.num_attention_layers, shape.num_gdn_layers
    mlp_per_token = h * shape.ffn_hidden_size * ffn_factor
    attention_per_token = h * (q + kv + kv + gate) + q * h
    mtp_per_token = mlp_per_token + attention_per_token + 2 * h * h + 3 * h + h * shape.vocab_size
    return FlopsBreakdown(
        mlp=k * num_tokens * mlp_per_token * shape.num_layers,
        gdn_projections=k * num_tokens * n_gdn * (h * (2 * qk_dim + 2 * v_dim + 2 * shape.linear_num_value_heads)
                                                  + h * v_dim),
        gdn_conv=k * num_tokens * n_gdn * shape.linear_conv_kernel_dim * (2 * qk_dim + v_dim),
        gdn_core=k * num_tokens * n_gdn * shape.linear_num_value_heads * shape.linear_value_head_dim**2 * 4,
        attention_projections=k * num_tokens * n_attn * attention_per_token,
        # causal: half the score matrix (/2), QK^T and PV (x2)
        attention_core=k * seqlen_squared_sum * n_attn * q / 2 * 2,
        logits=k * num_tokens * h * shape.vocab_size,
        mtp=shape.mtp_num_layers * (k * num_tokens * mtp_per_token + k * seqlen_squared_sum * q / 2 * 2),
    )


def megatron_flops(shape: ModelShape, num_tokens: float, seqlen_squared_sum: float) -> float:
    """Megatron-Core's training FLOPs for ``num_tokens`` real tokens with Σ L² = ``seqlen_squared_sum``."""
    return megatron_flops_breakdown(shape, num_tokens, seqlen_squared_sum).total


def relax_flops(shape: ModelShape, num_tokens: float, seqlen_squared_sum: float) -> float:
    """The Relax/verl accounting: Megatron's plus the input embedding counted as an h x vocab GEMM."""
    embedding = _FWD_BWD * _FMA * num_tokens * shape.hidden_size * shape.vocab_size
    return megatron_flops(shape, num_tokens, seqlen_squared_sum) + embedding


def step_flops(shape: ModelShape, seq_lengths: Iterable[int]) -> tuple[float, float]:
    """(Megatron, Relax) FLOPs of a step whose real documents have lengths ``seq_lengths``."""
    lengths = [int(n) for n in seq_lengths]
    tokens, squares = float(sum(lengths)), float(sum(n * n for n in lengths))
    return megatron_flops(shape, tokens, squares), relax_flops(shape, tokens, squares)


def flops_per_token(shape: ModelShape, s_eff: float) -> float:
    """Megatron-Core FLOPs per real token at ``s_eff = Σ L² / Σ L``."""
    return megatron_flops(shape, 1.0, s_eff)


def peak_tflops(device_name: str | None) -> float | None:
    """Dense BF16 peak of one accelerator, where known (MFU is null otherwise)."""
    if device_name and "H200" in device_name:
        return H200_PEAK_BF16_TFLOPS
    if device_name and "H100" in device_name:
        return 989.0
    return None
