"""A LoRA run's adapters as a PEFT adapter directory: ``adapter_config.json`` (``peft_type`` LORA,
``r``, ``lora_alpha``, ``target_modules`` in Hugging Face module names) and
``adapter_model.safetensors`` (``base_model.model.<module>.lora_A.weight`` / ``lora_B.weight``;
``lora_embedding_A`` / ``lora_embedding_B`` for the embedding), which ``peft.PeftModel`` loads onto
the Hugging Face base model the run started from and vLLM serves as a LoRA adapter (docs/lora.md).

Each adapter of the run is the PEFT adapter of one HF module tensor for tensor
(:mod:`relax_gdn.model.lora`): ``lora_A [r, in]``, ``lora_B [out, r]`` with ``B``'s rows in the HF
module's order, so writing them is naming them. Module names follow the base checkpoint's layout
(``model.language_model.layers...`` for the VLM layout).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from relax_gdn.model.hf_checkpoint.files import write_safetensors
from relax_gdn.model.hf_checkpoint.source import HFCheckpoint

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_PREFIX = "base_model.model."


@dataclass
class AdapterReport:
    """What an adapter export wrote, for the person who runs it (:meth:`lines`)."""

    out: Path
    base: Path
    target_modules: list[str]
    adapters: int
    rank: int
    alpha: float

    def lines(self) -> list[str]:
        return [
            f"wrote {self.out}: a PEFT LoRA adapter (r={self.rank}, lora_alpha={self.alpha:g}) of "
            f"{self.adapters} modules for the base model {self.base}",
            f"  target_modules: {', '.join(self.target_modules)}",
        ]


def _key(module: str, matrix: str) -> str:
    if module.endswith("embed_tokens"):  # PEFT's embedding LoRA: parameters, not linear layers
        return f"{_PREFIX}{module}.lora_embedding_{matrix}"
    return f"{_PREFIX}{module}.lora_{matrix}.weight"


def peft_adapter_state(
    adapters: dict[str, tuple[torch.Tensor, torch.Tensor]], source: HFCheckpoint, vocab_size: int
) -> dict[str, torch.Tensor]:
    """PEFT's tensors for ``adapters`` (HF text-layout module -> whole ``(A, B)``) on the base
    ``source``: module names in its layout, the embedding's and output layer's vocabulary trimmed to
    ``vocab_size`` (a model padded beyond it)."""
    by_text = source.by_text_name()
    state = {}
    for module, (a, b) in adapters.items():
        name = by_text.get(f"{module}.weight", f"{module}.weight").removesuffix(".weight")
        if module.endswith("embed_tokens"):
            a = a[:, :vocab_size]
        elif module == "lm_head":
            b = b[:vocab_size]
        state[_key(name, "A")] = a.contiguous()
        state[_key(name, "B")] = b.contiguous()
    return state


def peft_adapter_config(
    *, rank: int, alpha: float, dropout: float, target_modules: list[str], base: str | None
) -> dict:
    """``adapter_config.json`` of a LoRA adapter with PEFT's defaults for everything else."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base,
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": dropout,
        "target_modules": target_modules,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "init_lora_weights": True,
        "inference_mode": True,
        "layers_to_transform": None,
        "layers_pattern": None,
        "rank_pattern": {},
        "alpha_pattern": {},
        "revision": None,
    }


def save_peft_adapter(
    model: torch.nn.Module,
    out_dir: str | os.PathLike,
    source_dir: str | os.PathLike,
    *,
    dropout: float = 0.0,
    writer: bool | None = None,
) -> AdapterReport | None:
    """Write ``model``'s LoRA adapters as a PEFT adapter directory for the HF base ``source_dir``.
    A collective over the model's TP groups; ``writer`` (default: global rank 0) writes and gets
    the report (None elsewhere)."""
    from relax_gdn.model.hf_checkpoint.dims import dims_from_hf_config
    from relax_gdn.model.lora import lora_layers
    from relax_gdn.model.lora_export import lora_adapter_tensors

    adapters = lora_adapter_tensors(model)  # every rank: the gathers are collectives
    if writer is None:
        writer = not dist.is_initialized() or dist.get_rank() == 0
    if not writer:
        return None
    source = HFCheckpoint.read(source_dir)
    state = peft_adapter_state(adapters, source, dims_from_hf_config(source.config).vocab_size)
    rank = next(iter(adapters.values()))[0].shape[0]
    scaling = lora_layers(model)[0][1].lora_scaling
    targets = sorted({module.rsplit(".", 1)[-1] for module in adapters})
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_safetensors(state, out / ADAPTER_WEIGHTS)
    alpha = scaling * rank
    alpha = int(alpha) if float(alpha).is_integer() else alpha
    config = peft_adapter_config(
        rank=rank, alpha=alpha, dropout=dropout, target_modules=targets, base=str(Path(source_dir).absolute())
    )
    (out / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    return AdapterReport(
        out=out,
        base=Path(source_dir).absolute(),
        target_modules=targets,
        adapters=len(adapters),
        rank=rank,
        alpha=alpha,
    )


__all__ = [
    "ADAPTER_CONFIG",
    "ADAPTER_WEIGHTS",
    "AdapterReport",
    "peft_adapter_config",
    "peft_adapter_state",
    "save_peft_adapter",
]
