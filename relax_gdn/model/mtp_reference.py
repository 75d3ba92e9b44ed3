"""A pure-torch reference of Qwen3.5's multi-token-prediction (MTP) layer, written from the
Hugging Face weight layout (``mtp.*``, as vLLM's ``Qwen3_5MultiTokenPredictor`` and transformers'
``MtpModel`` read it), for packed documents. No Megatron-Core, no process group: what the model's
MTP layer (:mod:`relax_gdn.model.mtp`) is tested against, in fp64.

For position ``i`` of a document, with ``h_i`` the decoder's output (after its final norm) and
``t_{i+1}`` the next token::

    x_i = mtp.fc · [rmsnorm1p(E[t_{i+1}], pre_fc_norm_embedding), rmsnorm1p(h_i, pre_fc_norm_hidden)]
    x   = x + o_proj(attention(rmsnorm1p(x, layers.0.input_layernorm)))      gated, causal per document
    x   = x + down(silu(gate(y)) · up(y)),  y = rmsnorm1p(x, layers.0.post_attention_layernorm)
    logits_i = lm_head · rmsnorm1p(x_i, mtp.norm)                            predicts t_{i+2}

``rmsnorm1p(x, w) = x / rms(x) · (1 + w)``; the attention is Qwen3.5's: ``q_proj`` gives per head
``[query, gate]``, RMS norms (1 + w) on query and key per head, rotate-half RoPE on the first
``partial_rotary_factor`` of each head's dimensions, grouped KV heads, softmax(q·kᵀ/√d) within the
document up to the position, the output times ``sigmoid(gate)``, then ``o_proj``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class MTPReferenceShape:
    """The sizes the reference needs besides the weights' own shapes."""

    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rotary_dims: int  # leading dimensions of each head that RoPE rotates
    rope_theta: float
    rms_norm_eps: float

    @classmethod
    def from_hf_config(cls, config: Mapping) -> MTPReferenceShape:
        """From a Qwen3.5 (text) ``config.json`` dict; a VLM config's ``text_config`` is read."""
        cfg = config.get("text_config", config)
        rope = cfg.get("rope_parameters") or {}
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        partial = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.25))
        return cls(
            num_attention_heads=cfg["num_attention_heads"],
            num_key_value_heads=cfg["num_key_value_heads"],
            head_dim=head_dim,
            rotary_dims=int(head_dim * partial),
            rope_theta=rope.get("rope_theta", cfg.get("rope_theta", 1e7)),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        )


def rms_norm_one_plus(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / rms(x) · (1 + w)`` over the last dimension."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1 + weight)


def _rotate(x: torch.Tensor, positions: torch.Tensor, shape: MTPReferenceShape) -> torch.Tensor:
    """Rotate-half RoPE on the first ``rotary_dims`` of each head; ``x [T, heads, d]``."""
    rot = shape.rotary_dims
    inv_freq = 1.0 / shape.rope_theta ** (torch.arange(0, rot, 2, dtype=x.dtype) / rot)
    angles = positions.to(x.dtype)[:, None] * inv_freq  # [T, rot / 2]
    cos, sin = torch.cat([angles, angles], -1).cos()[:, None], torch.cat([angles, angles], -1).sin()[:, None]
    head, rest = x[..., :rot], x[..., rot:]
    half = rot // 2
    rotated = torch.cat([-head[..., half:], head[..., :half]], dim=-1)
    return torch.cat([head * cos + rotated * sin, rest], dim=-1)


def _attention(
    x: torch.Tensor,
    w: Mapping[str, torch.Tensor],
    prefix: str,
    positions: torch.Tensor,
    cu_seqlens: list[int],
    shape: MTPReferenceShape,
) -> torch.Tensor:
    """Qwen3.5's gated full attention of ``x [T, hidden]`` (weights under ``prefix``), each
    document of ``cu_seqlens`` causal on its own."""
    heads, groups, d = shape.num_attention_heads, shape.num_key_value_heads, shape.head_dim
    query, gate = (x @ w[f"{prefix}q_proj.weight"].T).view(-1, heads, 2, d).unbind(2)
    key = (x @ w[f"{prefix}k_proj.weight"].T).view(-1, groups, d)
    value = (x @ w[f"{prefix}v_proj.weight"].T).view(-1, groups, d)
    query = _rotate(
        rms_norm_one_plus(query, w[f"{prefix}q_norm.weight"], shape.rms_norm_eps), positions, shape
    )
    key = _rotate(rms_norm_one_plus(key, w[f"{prefix}k_norm.weight"], shape.rms_norm_eps), positions, shape)
    key, value = key.repeat_interleave(heads // groups, 1), value.repeat_interleave(heads // groups, 1)
    out = torch.zeros_like(query)
    for start, end in zip(cu_seqlens[:-1], cu_seqlens[1:]):
        if end == start:
            continue
        q, k, v = (t[start:end].transpose(0, 1) for t in (query, key, value))  # [heads, n, d]
        scores = q @ k.transpose(1, 2) / d**0.5
        future = torch.ones(end - start, end - start, dtype=torch.bool).triu(1)
        out[start:end] = (scores.masked_fill(future, float("-inf")).softmax(-1) @ v).transpose(0, 1)
    out = out * torch.sigmoid(gate)
    return out.reshape(len(x), heads * d) @ w[f"{prefix}o_proj.weight"].T


def mtp_reference_hidden(
    weights: Mapping[str, torch.Tensor],
    hidden: torch.Tensor,
    next_ids: torch.Tensor,
    positions: torch.Tensor,
    cu_seqlens: list[int],
    shape: MTPReferenceShape,
) -> torch.Tensor:
    """The MTP layer's output before the shared output layer (after ``mtp.norm``), ``[T, hidden]``.

    ``weights``: HF names (``model.embed_tokens.weight`` or the VLM's
    ``model.language_model.embed_tokens.weight``, and ``mtp.*``); ``hidden [T, hidden]``: the
    decoder's output after its final norm; ``next_ids [T]``: each position's next token in its
    document (any id at a document's last position: its prediction is never a target);
    ``positions [T]``: positions within the documents; ``cu_seqlens``: the documents' boundaries.
    """
    eps, w = shape.rms_norm_eps, weights
    embedding = w.get("model.embed_tokens.weight", w.get("model.language_model.embed_tokens.weight"))
    fused = torch.cat(
        [
            rms_norm_one_plus(embedding[next_ids], w["mtp.pre_fc_norm_embedding.weight"], eps),
            rms_norm_one_plus(hidden, w["mtp.pre_fc_norm_hidden.weight"], eps),
        ],
        dim=-1,
    )
    x = fused @ w["mtp.fc.weight"].T
    layer = "mtp.layers.0."
    x = x + _attention(
        rms_norm_one_plus(x, w[f"{layer}input_layernorm.weight"], eps),
        w,
        f"{layer}self_attn.",
        positions,
        cu_seqlens,
        shape,
    )
    y = rms_norm_one_plus(x, w[f"{layer}post_attention_layernorm.weight"], eps)
    mlp = F.silu(y @ w[f"{layer}mlp.gate_proj.weight"].T) * (y @ w[f"{layer}mlp.up_proj.weight"].T)
    x = x + mlp @ w[f"{layer}mlp.down_proj.weight"].T
    return rms_norm_one_plus(x, w["mtp.norm.weight"], eps)


def mtp_reference_logits(
    weights: Mapping[str, torch.Tensor],
    hidden: torch.Tensor,
    next_ids: torch.Tensor,
    positions: torch.Tensor,
    cu_seqlens: list[int],
    shape: MTPReferenceShape,
) -> torch.Tensor:
    """The MTP layer's logits ``[T, vocab]`` (the shared ``lm_head``): at position ``i`` the
    prediction of the token two ahead. Arguments as :func:`mtp_reference_hidden`."""
    return (
        mtp_reference_hidden(weights, hidden, next_ids, positions, cu_seqlens, shape)
        @ weights["lm_head.weight"].T
    )


__all__ = ["MTPReferenceShape", "mtp_reference_hidden", "mtp_reference_logits", "rms_norm_one_plus"]
