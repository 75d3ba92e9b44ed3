"""The loss of one micro-batch, in one place: training and evaluation both call it."""

from __future__ import annotations

import torch


def summed_token_loss(model, mb) -> torch.Tensor:
    """Σ per-token cross-entropy × loss mask over this rank's shard of micro-batch ``mb`` (fp32).

    Summed, not averaged: the caller divides by the loss tokens of the whole global batch (or
    eval set) so that every loss token counts once across micro-batches, CP and DP ranks."""
    # given the mask, the model sums (the fused loss then forms its gradients in one pass)
    return model(mb.tokens, mb.position_ids, None, labels=mb.labels, loss_mask=mb.loss_mask,
                 packed_seq_params=mb.packed_seq_params)
