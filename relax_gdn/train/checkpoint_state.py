"""What a checkpoint holds, and loading it back.

Saved (:func:`state_to_save`): the model's ``sharded_state_dict`` (global tensor keys and offsets,
so a checkpoint written at one world size / TP / CP loads at another; with a frozen base, LoRA's,
only the tensors that train), the optimizer's sharded state keyed like the parameters (CPU:
AdamW's moments; GPU: the distributed optimizer's state in the form
``checkpoint.optimizer_sharding`` names, see ``MegatronOptimizerAdapter.sharded_state_dict`` and
:func:`relax_gdn.train.resume.optimizer_reshard_problem`), and as common state (rank 0's,
identical on every rank) the step, the LR scheduler and the CPU RNGs; ``relax_gdn.json`` beside it
holds the resolved config, the data position's inputs (the global batch of step s is a pure
function of seed, batch size, dataset and s, ``relax_gdn.data.global_batch_at_step``, so the step
IS the data position), the parallel layout it was written at and the W&B run id. CUDA RNG states
are per rank and are restored only when the layout is unchanged (they only drive dropout, 0 in
every preset).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from relax_gdn.train.checkpoint import CheckpointError, verify_checkpoint

# ---------------------------------------------------------------------------------------------
# RNG
# ---------------------------------------------------------------------------------------------


def cpu_rng_state() -> dict[str, Any]:
    """Python, NumPy and torch CPU generators: seeded alike and drawn alike on every rank."""
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def set_cpu_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


def cuda_rng_sharded(is_loading: bool):
    """This rank's CUDA generator + Megatron-Core tracker as a per-rank ShardedObject."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    state = (
        None
        if is_loading
        else {"cuda": torch.cuda.get_rng_state(), "tracker": get_cuda_rng_tracker().get_states()}
    )
    return ShardedObject("rng_state.cuda", state, (dist.get_world_size(),), (dist.get_rank(),), replica_id=0)


# ---------------------------------------------------------------------------------------------
# what a checkpoint holds of the model
# ---------------------------------------------------------------------------------------------


def model_sharded_state_dict(model) -> dict[str, Any]:
    """The model's sharded tensors a checkpoint holds: all of them, or where part of the model is
    frozen (LoRA's base) only those that train; the frozen ones are rebuilt from the base the
    manifest names (``model.hf_checkpoint``, or the preset and seed)."""
    sharded = model.sharded_state_dict()
    if all(p.requires_grad for p in model.parameters()):
        return sharded
    return {
        k: v
        for k, v in sharded.items()
        if isinstance(getattr(v, "data", None), torch.Tensor) and v.data.requires_grad
    }


def load_model_state(model, state: dict[str, Any]) -> None:
    """``model.load_state_dict`` of what :func:`model_sharded_state_dict` loaded: every tensor, or
    every tensor that trains (the frozen base stays as the model has it)."""
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    if not frozen:
        model.load_state_dict(state)
        return
    result = model.load_state_dict(state, strict=False)
    left = [k for k in result.missing_keys if k not in frozen and not k.endswith("_extra_state")]
    if left or result.unexpected_keys:
        raise RuntimeError(
            f"checkpoint state does not fit the model: missing {left[:5]}, "
            f"unexpected {result.unexpected_keys[:5]}"
        )


def state_to_save(step: int, *, model, optimizer, scheduler) -> dict[str, Any]:
    """Everything a checkpoint of step ``step`` holds but its manifest, as Megatron-Core's
    distributed checkpointing saves it (sharded tensors and common state)."""
    model_sd = model_sharded_state_dict(model)
    state = {
        "model": model_sd,
        "optimizer": optimizer.sharded_state_dict(model_sd),
        "scheduler": scheduler.state_dict(),
        "rng": cpu_rng_state(),
        "step": step,
    }
    if torch.cuda.is_available():
        state["rng_cuda"] = cuda_rng_sharded(is_loading=False)
    return state


# ---------------------------------------------------------------------------------------------
# load
# ---------------------------------------------------------------------------------------------


def give_unstepped_adam_state(adam: torch.optim.Optimizer) -> None:
    """Give every parameter of ``adam`` (torch Adam / AdamW) that has no state yet the state of
    step 0 (zero moments), so a checkpoint load has tensors to fill: an optimizer that has not
    stepped holds none."""
    for group in adam.param_groups:
        for p in group["params"]:
            if not adam.state.get(p):
                adam.state[p] = {
                    "step": torch.zeros((), dtype=torch.float32),
                    "exp_avg": torch.zeros_like(p),
                    "exp_avg_sq": torch.zeros_like(p),
                }


@dataclass
class LoadedCheckpoint:
    directory: Path
    step: int
    manifest: dict[str, Any]
    scheduler_state: dict[str, Any]


def _load_sharded(request: dict[str, Any], directory: Path, hint: str = "") -> dict[str, Any]:
    """Megatron-Core's load of ``request`` from ``directory``, a failure named as the checkpoint
    not fitting this model (``hint``: what to check, appended)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.core import CheckpointingException

    try:
        return dist_checkpointing.load(request, str(directory))
    except (CheckpointingException, CheckpointException) as e:  # keys, shapes or shardings that do not fit
        raise CheckpointError(
            f"checkpoint {directory} cannot be loaded into this model ({type(e).__name__}: "
            f"{str(e)[:500]}){hint}"
        ) from e


def load_checkpoint(
    directory: Path, manifest: dict[str, Any], *, model, optimizer, same_layout: bool
) -> LoadedCheckpoint:
    """Load ``directory`` (whose manifest the caller has read) into ``model`` and ``optimizer`` (a
    collective) and restore the RNGs; the scheduler state is returned for the caller to apply (a
    changed schedule is its decision). ``same_layout``: the checkpoint was written at this run's
    world size / TP / CP, so per-rank CUDA RNG states apply. Call :func:`verify_checkpoint` first
    (it names damaged files)."""
    model_sd = model_sharded_state_dict(model)
    saved_sharding = (manifest.get("optimizer") or {}).get("sharding")
    request = {
        "model": model_sd,
        "optimizer": optimizer.sharded_state_dict(model_sd, is_loading=True, sharding=saved_sharding),
    }
    if same_layout and torch.cuda.is_available():
        request["rng_cuda"] = cuda_rng_sharded(is_loading=True)
    state = _load_sharded(request, directory, "; check that model.* matches the run that wrote it")
    load_model_state(model, state["model"])
    optimizer.load_sharded_state_dict(state["optimizer"])
    set_cpu_rng_state(state["rng"])
    if "rng_cuda" in state:
        from megatron.core.tensor_parallel import get_cuda_rng_tracker

        torch.cuda.set_rng_state(state["rng_cuda"]["cuda"])
        get_cuda_rng_tracker().set_states(state["rng_cuda"]["tracker"])
    return LoadedCheckpoint(
        directory=directory, step=int(state["step"]), manifest=manifest, scheduler_state=state["scheduler"]
    )


def checkpoint_fp32_main_params(directory: Path, manifest: dict[str, Any], model):
    """The fp32 main parameters a checkpoint holds in the model's shapes, as the HF export's
    ``MainParams`` (model tensors by name -> fp32 copies), or None when it holds none in that form:
    Megatron-Core writes them model-shaped (``optimizer.state.param.<key>``) only with
    ``checkpoint.optimizer_sharding=fully_reshardable``; the ``dp_reshardable`` form keeps flat
    slices laid out by the run's DDP buckets, and a CPU run's weights are fp32 themselves."""
    if (manifest.get("optimizer") or {}).get("sharding") != "fully_reshardable":
        return None
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from torch.distributed.checkpoint import FileSystemReader

    stored = set(FileSystemReader(str(directory)).read_metadata().state_dict_metadata)

    def load(params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        request = {}
        for name, sharded in model_sharded_state_dict(model).items():
            key = f"optimizer.state.param.{getattr(sharded, 'key', '')}"
            if name in params and isinstance(sharded, ShardedTensor) and key in stored:
                fp32 = torch.empty_like(sharded.data, dtype=torch.float32)
                request[name] = replace(sharded, key=key, data=fp32, dtype=torch.float32)
        if not request:
            return {}
        # Megatron-Core's load returns the checkpoint's common state (step, scheduler, ...) too
        loaded = _load_sharded(request, directory, "; its optimizer state does not fit this model")
        return {name: loaded[name] for name in request}

    return load


def load_model_weights(directory: Path, model) -> dict[str, Any]:
    """Only the model's tensors of ``directory`` (any TP / CP of the checkpoint), e.g. for export
    (of a LoRA run: the adapters, onto the base already in ``model``)."""
    manifest = verify_checkpoint(directory)
    state = _load_sharded({"model": model_sharded_state_dict(model)}, directory)
    load_model_state(model, state["model"])
    return manifest
