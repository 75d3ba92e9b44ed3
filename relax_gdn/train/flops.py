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

LoRA (``ModelShape.lora_rank > 0``): only the work done counts. A frozen weight needs no weight
gradient, so its GEMMs count twice (forward, input gradient) instead of three times; the
weightless cores (attention, the GDN scan) keep their count; each adapter adds
``3 · 2 · r · (in + out)`` per token (the embedding's ``A`` is a lookup: ``r · hidden`` only).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

H200_PEAK_BF16_TFLOPS = 989.0  # dense BF16 (never the 1979 sparse figure)

_FWD_BWD = 3  # forward, backward dgrad, backward wgrad
_FROZEN_PASSES = 2  # a frozen weight: forward and dgrad, no wgrad
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
    lora_rank: int = 0  # LoRA adapters of this rank on lora_modules, every other weight frozen; 0: none
    lora_modules: tuple[str, ...] = ()  # HF module names (relax_gdn.model.lora_options.LORA_MODULES)

    @classmethod
    def from_transformer_config(
        cls, config, vocab_size: int, *, mtp_num_layers: int = 0, lora=None
    ) -> ModelShape:
        """The shape of a model of Megatron-Core ``config`` with ``vocab_size`` words, ``mtp_num_layers``
        MTP layers and the adapters of ``lora`` (:class:`~relax_gdn.model.lora_options.LoRAOptions`,
        None: none)."""
        adapters = dict(lora_rank=lora.rank, lora_modules=tuple(lora.modules)) if lora is not None else {}
        return cls(
            num_layers=config.num_layers,
            hidden_size=config.hidden_size,
            ffn_hidden_size=config.ffn_hidden_size,
            vocab_size=vocab_size,
            num_attention_heads=config.num_attention_heads,
            num_query_groups=config.num_query_groups or config.num_attention_heads,
            kv_channels=config.kv_channels,
            attention_output_gate=bool(config.attention_output_gate),
            linear_attention_freq=config.linear_attention_freq,
            linear_num_key_heads=config.linear_num_key_heads,
            linear_num_value_heads=config.linear_num_value_heads,
            linear_key_head_dim=config.linear_key_head_dim,
            linear_value_head_dim=config.linear_value_head_dim,
            linear_conv_kernel_dim=config.linear_conv_kernel_dim,
            swiglu=bool(config.gated_linear_unit),
            mtp_num_layers=mtp_num_layers,
            **adapters,
        )

    @property
    def num_attention_layers(self) -> int:
        return sum((i + 1) % self.linear_attention_freq == 0 for i in range(self.num_layers))

    @property
    def num_gdn_layers(self) -> int:
        return self.num_layers - self.num_attention_layers

    def lora_adapter_shapes(self) -> dict[str, tuple[int, int, int, bool]]:
        """HF module -> ``(in, out, how many in the model, column-parallel)`` for each adapted module
        (the embedding's ``in`` is the vocabulary)."""
        h, ffn, vocab = self.hidden_size, self.ffn_hidden_size, self.vocab_size
        q = self.kv_channels * self.num_attention_heads
        kv = self.kv_channels * self.num_query_groups
        qk = self.linear_key_head_dim * self.linear_num_key_heads
        v = self.linear_value_head_dim * self.linear_num_value_heads
        hv = self.linear_num_value_heads
        gdn, attn, layers = self.num_gdn_layers, self.num_attention_layers, self.num_layers
        table = {
            "in_proj_qkv": (h, 2 * qk + v, gdn, True),
            "in_proj_z": (h, v, gdn, True),
            "in_proj_b": (h, hv, gdn, True),
            "in_proj_a": (h, hv, gdn, True),
            "out_proj": (v, h, gdn, False),
            "q_proj": (h, 2 * q if self.attention_output_gate else q, attn, True),
            "k_proj": (h, kv, attn, True),
            "v_proj": (h, kv, attn, True),
            "o_proj": (q, h, attn, False),
            "gate_proj": (h, ffn, layers, True),
            "up_proj": (h, ffn, layers, True),
            "down_proj": (ffn, h, layers, False),
            "embed_tokens": (vocab, h, 1, False),
            "lm_head": (h, vocab, 1, True),
        }
        return {m: table[m] for m in self.lora_modules} if self.lora_rank else {}


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
    lora_adapters: float = 0.0  # the adapters' GEMMs (LoRA; the frozen base's parts above count no wgrad)

    @property
    def total(self) -> float:
        return (
            self.mlp
            + self.gdn_projections
            + self.gdn_conv
            + self.gdn_core
            + self.attention_projections
            + self.attention_core
            + self.logits
            + self.mtp
            + self.lora_adapters
        )


def megatron_flops_breakdown(
    shape: ModelShape, num_tokens: float, seqlen_squared_sum: float
) -> FlopsBreakdown:
    """Megatron-Core's accounting of one step, by part (``num_tokens``: real tokens Σ L_i); with
    LoRA, the work done (module docstring)."""
    full = _full_breakdown(shape, num_tokens, seqlen_squared_sum)
    if not shape.lora_rank:
        return full
    frozen = _FROZEN_PASSES / _FWD_BWD
    adapters = sum(
        count * shape.lora_rank * ((0 if name == "embed_tokens" else inp) + out)
        for name, (inp, out, count, _) in shape.lora_adapter_shapes().items()
    )
    return FlopsBreakdown(
        mlp=full.mlp * frozen,
        gdn_projections=full.gdn_projections * frozen,
        gdn_conv=full.gdn_conv * frozen,
        gdn_core=full.gdn_core,
        attention_projections=full.attention_projections * frozen,
        attention_core=full.attention_core,
        logits=full.logits * frozen,
        lora_adapters=_FWD_BWD * _FMA * num_tokens * adapters,
    )


def _full_breakdown(shape: ModelShape, num_tokens: float, seqlen_squared_sum: float) -> FlopsBreakdown:
    """Megatron-Core's accounting with every weight trained."""
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
        gdn_projections=k
        * num_tokens
        * n_gdn
        * (h * (2 * qk_dim + 2 * v_dim + 2 * shape.linear_num_value_heads) + h * v_dim),
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
    """The Relax/verl accounting: Megatron's plus the input embedding counted as an h x vocab GEMM
    (without its weight gradient when LoRA freezes it)."""
    passes = _FROZEN_PASSES if shape.lora_rank else _FWD_BWD
    embedding = passes * _FMA * num_tokens * shape.hidden_size * shape.vocab_size
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
