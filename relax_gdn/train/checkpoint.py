"""Checkpoint / resume: per-rank ``torch.save`` of state dicts.

Layout: ``<checkpoint.dir>/step_NNNNNN/rank_RRRRR.pt`` (every rank) plus ``meta.json`` written by
global rank 0 AFTER every rank has saved (its presence marks the checkpoint complete).

Each rank file holds the model state dict, the optimizer state (on CUDA also this rank's
distributed-optimizer shard), the LR scheduler, the step, every RNG (Python, NumPy, torch CPU,
CUDA and Megatron-Core's CUDA RNG tracker) and the data position. The data position is the
step: the global batch of step s is a pure function of (dataset, seed, global batch size, s)
(``relax_gdn.data.global_batch_at_step``), so a resumed run reads exactly the batches the
uninterrupted run would have read; ``meta.json`` records what that function depends on and a
resume with different values is refused.

Why not Megatron-Core dist checkpointing: it needs CUDA for its default strategies and reshards
across world sizes, which this recipe does not need; per-rank files restore bit-identically on
CPU and GPU. The price: resume needs the same world size, TP and CP (checked).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

META = "meta.json"


def step_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"step_{step:06d}"


def _rank_file(directory: Path, rank: int) -> Path:
    return directory / f"rank_{rank:05d}.pt"


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        from megatron.core.tensor_parallel import get_cuda_rng_tracker

        state["cuda"] = torch.cuda.get_rng_state()
        state["mcore_tracker"] = get_cuda_rng_tracker().get_states()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if torch.cuda.is_available() and "cuda" in state:
        from megatron.core.tensor_parallel import get_cuda_rng_tracker

        torch.cuda.set_rng_state(state["cuda"])
        get_cuda_rng_tracker().set_states(state["mcore_tracker"])


@dataclass(frozen=True)
class ResumeKey:
    """What must match between the saving and the resuming run."""

    world_size: int
    tp: int
    cp: int
    seed: int
    global_batch_size: int
    num_samples: int  # dataset size after skips

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


def save_checkpoint(root: str | Path, step: int, *, model, optimizer, scheduler, key: ResumeKey,
                    extra: dict[str, Any] | None = None) -> Path:
    """Collective: every rank writes its file, then rank 0 writes ``meta.json``."""
    rank = dist.get_rank()
    directory = step_dir(root, step)
    if rank == 0:
        directory.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    state = {
        "step": step, "model": model.state_dict(), "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(), "rng": rng_state(), "data": {"next_step": step},
        "extra": extra or {},
    }
    tmp = _rank_file(directory, rank).with_suffix(".tmp")
    torch.save(state, tmp)
    tmp.replace(_rank_file(directory, rank))
    dist.barrier()
    if rank == 0:
        (directory / META).write_text(json.dumps({"step": step, **key.as_dict()}, indent=2))
    dist.barrier()
    return directory


def find_checkpoint(path: str | Path) -> Path:
    """``path`` itself when it is a complete checkpoint, else its latest complete ``step_*`` child."""
    path = Path(path)
    if (path / META).is_file():
        return path
    candidates = sorted(p for p in path.glob("step_*") if (p / META).is_file())
    if not candidates:
        raise FileNotFoundError(
            f"checkpoint.resume={str(path)!r} holds no complete checkpoint (a step_NNNNNN directory with {META}); "
            "point it at one or at the directory that contains them"
        )
    return candidates[-1]


def load_checkpoint(path: str | Path, *, model, optimizer, scheduler, key: ResumeKey) -> int:
    """Restore everything saved by :func:`save_checkpoint`; returns the step it was saved at."""
    directory = find_checkpoint(path)
    meta = json.loads((directory / META).read_text())
    mismatched = {k: (meta.get(k), v) for k, v in key.as_dict().items() if meta.get(k) != v}
    if mismatched:
        detail = ", ".join(f"{k}: checkpoint {a} vs now {b}" for k, (a, b) in mismatched.items())
        raise ValueError(f"cannot resume from {directory}: {detail}; resume with the same world size, "
                         "parallel.tp/cp, train.seed, train.global_batch_size and data")
    state = torch.load(_rank_file(directory, dist.get_rank()), map_location="cpu", weights_only=False)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    set_rng_state(state["rng"])
    return int(state["step"])
