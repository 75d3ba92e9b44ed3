"""Qwen3.5 Hugging Face checkpoints <-> our Megatron-Core ``GPTModel`` (import for SFT, export to serve).

Three steps, each usable alone:

1. **The plan** (:mod:`.plan`, :func:`conversion_plan`): one :class:`TensorRule` per Megatron-Core
   tensor, saying which HF tensors it is made of, how to merge them (and split back), and how
   tensor parallelism cuts it. Pure shape arithmetic on :class:`Qwen3_5Dims` (:mod:`.dims`, read
   from a ``config.json`` or a live model).
2. **Plain state dicts** (:mod:`.convert`, :func:`hf_to_mcore_state_dict`,
   :func:`mcore_to_hf_state_dict`): full (TP = 1) tensors in, full tensors out; no process group,
   no files.
3. **Model + files** (:mod:`.files`, :func:`load_hf_checkpoint`, :func:`save_hf_checkpoint`): read
   safetensors lazily one rule at a time, cut this rank's TP shard and copy it into the
   parameter; or gather the shards over TP and write HF text-layout safetensors + ``config.json``.
"""

from relax_gdn.model.hf_checkpoint.convert import (
    CheckpointMismatchError,
    hf_text_name,
    hf_to_mcore_state_dict,
    mcore_to_hf_state_dict,
)
from relax_gdn.model.hf_checkpoint.dims import (
    HF_NORM_CONVENTIONS,
    NormConventions,
    Qwen3_5Dims,
    dims_from_hf_config,
    dims_from_model,
    hf_text_config,
    norm_conventions_of,
    qwen3_5_config_from_hf,
    unwrap_model,
)
from relax_gdn.model.hf_checkpoint.files import (
    gather_from_tp,
    load_hf_checkpoint,
    read_hf_state_dict,
    save_hf_checkpoint,
)
from relax_gdn.model.hf_checkpoint.plan import (
    TensorRule,
    TPSplit,
    conversion_plan,
    shard_for_tp,
    unshard_from_tp,
)

__all__ = [
    "HF_NORM_CONVENTIONS",
    "CheckpointMismatchError",
    "NormConventions",
    "Qwen3_5Dims",
    "TPSplit",
    "TensorRule",
    "conversion_plan",
    "dims_from_hf_config",
    "dims_from_model",
    "gather_from_tp",
    "hf_text_config",
    "hf_text_name",
    "hf_to_mcore_state_dict",
    "load_hf_checkpoint",
    "mcore_to_hf_state_dict",
    "norm_conventions_of",
    "qwen3_5_config_from_hf",
    "read_hf_state_dict",
    "save_hf_checkpoint",
    "shard_for_tp",
    "unshard_from_tp",
    "unwrap_model",
]
