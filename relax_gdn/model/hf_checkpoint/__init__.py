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
   :func:`save_drop_in_checkpoint` (:mod:`.drop_in`) writes the layout of the checkpoint a run
   started from instead (vision tower copied; MTP written when the run trained it, else copied;
   :func:`tensor_origins` deciding).

:mod:`.source` reads a checkpoint directory's layout from its headers (:class:`HFCheckpoint`) and
decides the vocabulary of a run started from one (:func:`run_vocab_size`);
:func:`use_torch_kernels_in_transformers` (:mod:`relax_gdn.compat.transformers_kernels`) keeps
transformers' Qwen3.5 on its pure-torch kernels where FLA's Triton ones cannot run.
"""

from relax_gdn.compat.transformers_kernels import use_torch_kernels_in_transformers
from relax_gdn.model.hf_checkpoint.convert import (
    CheckpointMismatchError,
    hf_text_name,
    hf_to_mcore_state_dict,
    mcore_to_hf_state_dict,
    text_layout_name,
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
from relax_gdn.model.hf_checkpoint.drop_in import (
    Origin,
    drop_in_origins,
    save_drop_in_checkpoint,
    tensor_origins,
)
from relax_gdn.model.hf_checkpoint.files import (
    ExportReport,
    MainParams,
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
from relax_gdn.model.hf_checkpoint.source import HFCheckpoint, preset_dims, run_vocab_size

__all__ = [
    "HF_NORM_CONVENTIONS",
    "CheckpointMismatchError",
    "ExportReport",
    "HFCheckpoint",
    "MainParams",
    "NormConventions",
    "Origin",
    "Qwen3_5Dims",
    "TPSplit",
    "TensorRule",
    "conversion_plan",
    "dims_from_hf_config",
    "dims_from_model",
    "drop_in_origins",
    "gather_from_tp",
    "hf_text_config",
    "hf_text_name",
    "hf_to_mcore_state_dict",
    "load_hf_checkpoint",
    "mcore_to_hf_state_dict",
    "norm_conventions_of",
    "preset_dims",
    "qwen3_5_config_from_hf",
    "read_hf_state_dict",
    "run_vocab_size",
    "save_drop_in_checkpoint",
    "save_hf_checkpoint",
    "shard_for_tp",
    "tensor_origins",
    "text_layout_name",
    "unshard_from_tp",
    "use_torch_kernels_in_transformers",
    "unwrap_model",
]
