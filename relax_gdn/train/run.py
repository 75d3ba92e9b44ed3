"""The training entry point: :func:`run_training` validates the config before anything is built
and runs a :class:`~relax_gdn.train.loop.Trainer` (setup, the steps, close)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from relax_gdn.config import RunConfig, validate
from relax_gdn.parallel import launcher_world_size
from relax_gdn.runtime import Runtime
from relax_gdn.train.build import resolve_mtp_layers, select_bf16, select_device
from relax_gdn.train.gpu_memory import release_gpu_memory
from relax_gdn.train.loop import Trainer
from relax_gdn.train.run_result import TrainResult


def run_training(
    cfg: RunConfig,
    run_dir: str | Path | None,
    *,
    runtime: Runtime,
    data=None,
    on_continue: Callable[[Path], None] | None = None,
) -> TrainResult:
    """Train ``cfg`` (already validated or not: validated again here, before anything is built;
    ``model.mtp.num_layers=null`` resolved from the checkpoint's tensors).

    ``run_dir``: where rank 0 writes ``config.yaml``, ``metrics.jsonl`` and (by default) the
    checkpoints; None writes nothing (no JSONL, no checkpoints unless ``checkpoint.dir``).
    Uses the initialized default process group, else makes a one-process one. ``runtime``: the
    installed :class:`relax_gdn.runtime.Runtime` (the entry points install one), which makes the
    process-wide changes the run needs (signal handlers, the checkpoint writer's queue). ``data``:
    a prepared ``(tokenizer, SFTDataset)`` pair (benchmarks with a length distribution of their
    own) instead of what ``cfg.data`` names. ``on_continue``: called on rank 0 with the run
    directory a resumed run continues when it is not ``run_dir`` (``train.py`` moves Hydra's job
    log there).
    """
    dims = validate(cfg, launcher_world_size())
    resolved = resolve_mtp_layers(cfg)
    if resolved is not cfg:  # again: the MTP layer a checkpoint brings has rules of its own
        dims = validate(resolved, launcher_world_size())
    cfg = resolved
    device = select_device(cfg)
    bf16 = select_bf16(cfg, device)
    # the entry point's Runtime owns the process-wide changes (on CPU: Megatron-Core's shims)
    cpu = device.type == "cpu"
    runtime.require("training on CPU" if cpu else "training on CUDA", cpu_shims=cpu)

    trainer = Trainer(
        cfg,
        Path(run_dir) if run_dir is not None else None,
        dims=dims,
        device=device,
        bf16=bf16,
        runtime=runtime,
        data=data,
        on_continue=on_continue,
    )
    try:
        trainer.setup()
        return trainer.run()
    finally:
        trainer.close()
        del trainer
        release_gpu_memory(device)
