"""The loss of one micro-batch, in one place: training and evaluation both call it.

With a multi-token-prediction (MTP) layer (``model.mtp.num_layers``) the training objective is

    loss + model.mtp.loss_weight × mtp_loss

where ``loss`` is the language model's mean cross-entropy per loss token of the global batch (what
``metrics.jsonl`` calls ``loss``, with MTP or without) and ``mtp_loss`` the MTP layer's, per MTP
loss token of the global batch (``mtp_loss`` in the metrics): position ``i`` predicting token
``i + 2``, counted where the prediction of token ``i + 2`` counts in ``loss``.
"""

from __future__ import annotations

import torch


def summed_token_loss(model, mb) -> torch.Tensor:
    """Σ per-token cross-entropy × loss mask over this rank's shard of micro-batch ``mb`` (fp32).

    Summed, not averaged: the caller divides by the loss tokens of the whole global batch (or
    eval set) so that every loss token counts once across micro-batches, CP and DP ranks."""
    # given the mask, the model sums (the fused loss then forms its gradients in one pass)
    return model(
        mb.tokens,
        mb.position_ids,
        None,
        labels=mb.labels,
        loss_mask=mb.loss_mask,
        packed_seq_params=mb.packed_seq_params,
    )


def summed_token_losses(model, mb) -> torch.Tensor:
    """``[LM, MTP]`` sums of per-token cross-entropy × loss mask over this rank's shard of ``mb``
    (fp32) when ``mb`` carries MTP targets; ``[LM]`` otherwise (:func:`summed_token_loss`). The MTP
    layer's input at each position is the next token of its document: ``mb.labels``."""
    if mb.mtp_labels is None:
        return summed_token_loss(model, mb).reshape(1)
    return model(
        mb.tokens,
        mb.position_ids,
        None,
        labels=mb.labels,
        loss_mask=mb.loss_mask,
        packed_seq_params=mb.packed_seq_params,
        mtp_input_ids=mb.labels,
        mtp_labels=mb.mtp_labels,
        mtp_loss_mask=mb.mtp_loss_mask,
    )


def training_objective(
    sums: torch.Tensor, loss_tokens: int, mtp_loss_tokens: int, mtp_loss_weight: float
) -> torch.Tensor:
    """This micro-batch's share of the step's objective (module docstring) from its
    :func:`summed_token_losses`: every loss token of the global batch (``loss_tokens``, and
    ``mtp_loss_tokens`` for the MTP loss) counts once across micro-batches, CP and DP ranks."""
    objective = sums[0] / max(loss_tokens, 1)
    if sums.numel() > 1:
        objective = objective + mtp_loss_weight * sums[1:].sum() / max(mtp_loss_tokens, 1)
    return objective
