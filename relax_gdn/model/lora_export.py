"""LoRA's adapters as the exports need them: folded into their base weights (the merged export,
:func:`merge_lora_adapters`) or gathered whole in HF shapes (the PEFT export,
:func:`lora_adapter_tensors`)."""

from __future__ import annotations

import torch

from relax_gdn.model.hf_checkpoint.plan import TPSplit
from relax_gdn.model.lora import LoRAEmbedding, LoRALayer, LoRARowParallel, lora_layers


@torch.no_grad()
def _delta(layer: LoRALayer) -> torch.Tensor:
    """``scaling · B·A`` of ``layer``'s adapters, laid out like this rank's base weight (fp32)."""
    adapters = list(layer.lora.values())
    if isinstance(layer, LoRAEmbedding):
        (a,) = adapters
        return (a.lora_B.float() @ a.lora_A.float()).t() * layer.lora_scaling
    if isinstance(layer, LoRARowParallel):
        (a,) = adapters
        return a.lora_B.float() @ a.lora_A.float() * layer.lora_scaling
    rows = torch.cat([a.lora_B.float() @ a.lora_A.float() for a in adapters]) * layer.lora_scaling
    delta = torch.zeros(layer.weight.shape, dtype=torch.float32, device=rows.device)
    return delta.index_add(0, layer.adapter_base_rows(), rows)


@torch.no_grad()
def merge_lora_adapters(model: torch.nn.Module) -> list[str]:
    """Fold every adapter into its base weight (``W + scaling · B·A``, formed in fp32 and rounded
    once to the weight's dtype) and take the adapters away: ``model`` is then the plain model the
    merged export writes. Returns the HF modules merged. On every TP rank (no collective)."""
    merged = []
    for _, layer in lora_layers(model):
        layer.weight.copy_((layer.weight.float() + _delta(layer)).to(layer.weight.dtype))
        merged += [a.layout.hf_module for a in layer.lora.values()]
        del layer.lora
        layer.__dict__.get("_buffers", {}).pop("lora_rows", None)
        layer.__class__ = layer._lora_base_class
    return merged


def lora_adapter_tensors(model: torch.nn.Module) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """HF module name -> its whole ``(A, B)`` on the CPU, rows of ``B`` in HF order (the PEFT
    export). A collective over each layer's TP group (every rank calls it, every rank gets them)."""
    from relax_gdn.model.hf_checkpoint.files import gather_from_tp

    out = {}
    for _, layer in lora_layers(model):
        for adapter in layer.lora.values():
            layout = adapter.layout
            a = gather_from_tp(adapter.lora_A.detach(), layout.a_split or TPSplit(None), layer.tp_group)
            b = gather_from_tp(adapter.lora_B.detach(), layout.b_split or TPSplit(None), layer.tp_group)
            out[layout.hf_module] = (a.cpu(), b.cpu())
    return out


__all__ = ["lora_adapter_tensors", "merge_lora_adapters"]
