"""Megatron-Core's distributed optimizer resumes exactly (CPU, one gloo process, a fresh one per case).

The GPU path (Megatron-Core DDP + DistributedOptimizer: bf16 params, fp32 main params, torch Adam
without Transformer Engine or Apex) saved and loaded with the project's own ``CheckpointWriter`` and
``load_checkpoint``, in both ``checkpoint.optimizer_sharding`` forms, on a small module with a
frozen weight beside the ones that train (LoRA's shape: the frozen one has no DDP buffer, no
optimizer state and is not in the checkpoint). A run resumed from its step-2 checkpoint repeats
steps 3 and 4 of the uninterrupted run exactly: step 3 needs the weights back, step 4 Adam's
state, its per-parameter ``step`` included (its bias correction sets the size of every update).

Megatron-Core 0.19.2's optimizer does not build without a GPU (``param.type()`` must name a CUDA
tensor, scalars are made with ``device='cuda'``); :func:`_distributed_optimizer_on_cpu` bends
those few places for this module's processes only, each a fresh one (run_distributed), never the
session's pool.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.distributed import job_runtime, run_distributed

SHARDINGS = ("dp_reshardable", "fully_reshardable")


@contextlib.contextmanager
def _distributed_optimizer_on_cpu():
    """Megatron-Core's DDP + DistributedOptimizer on CPU tensors (with the Runtime's CPU shims,
    which make ``torch.cuda.current_device()`` the CPU): ``Tensor.type()`` answers with the CUDA
    type name its checks expect, ``torch.tensor``/``zeros``/``empty`` made on ``'cuda'`` are made
    on the CPU, ``Tensor.cuda()`` stays where it is and the gradient reduction's current stream
    (it waits there for CUDA-graph events, of which there are none) is no stream. Put back on exit."""
    saved = {
        "type": torch.Tensor.type,
        "cuda": torch.Tensor.cuda,
        "stream": torch.cuda.current_stream,
        **{name: getattr(torch, name) for name in ("tensor", "zeros", "empty")},
    }

    def cuda_type_name(self, *args, **kwargs):
        name = saved["type"](self, *args, **kwargs)
        return name.replace("torch.", "torch.cuda.", 1) if not (args or kwargs) else name

    def on_cpu(make):
        def made(*args, **kwargs):
            if str(kwargs.get("device", "")).startswith("cuda"):
                kwargs["device"] = "cpu"
            return make(*args, **kwargs)

        return made

    torch.Tensor.type = cuda_type_name
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    torch.cuda.current_stream = lambda *args, **kwargs: None
    for name in ("tensor", "zeros", "empty"):
        setattr(torch, name, on_cpu(saved[name]))
    try:
        yield
    finally:
        torch.Tensor.type, torch.Tensor.cuda = saved["type"], saved["cuda"]
        torch.cuda.current_stream = saved["stream"]
        for name in ("tensor", "zeros", "empty"):
            setattr(torch, name, saved[name])


def _resume_case(sharding: str, tmp: str) -> dict:
    """4 steps saving at step 2, then a fresh model + optimizer resumed from that checkpoint for
    steps 3 and 4: each run's losses and Adam's steps (per parameter, and how many distinct step
    tensors) after the load and at the end."""
    import logging

    from megatron.core import parallel_state
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.module import MegatronModule

    from relax_gdn.config import RunConfig
    from relax_gdn.train.checkpoint import read_manifest
    from relax_gdn.train.checkpoint_state import load_checkpoint, state_to_save
    from relax_gdn.train.checkpoint_writer import CheckpointWriter
    from relax_gdn.train.megatron_optimizer import build_megatron_ddp_and_optimizer

    torch.set_num_threads(1)
    tconfig = TransformerConfig(
        num_layers=1,
        hidden_size=8,
        num_attention_heads=1,
        bf16=True,
        params_dtype=torch.bfloat16,
        use_cpu_initialization=True,
    )
    cfg = RunConfig().with_overrides(
        {"optim.lr": 1e-2, "optim.clip_grad": 1.0, "checkpoint.optimizer_sharding": sharding}
    )

    class Adapted(MegatronModule):
        """A frozen ``base`` and the trained ``a``, ``b`` (a low-rank adapter) and ``c``, in bf16."""

        def __init__(self):
            super().__init__(tconfig)
            g = torch.Generator().manual_seed(0)
            self.base = torch.nn.Parameter(torch.randn(8, 8, generator=g).bfloat16(), requires_grad=False)
            self.a = torch.nn.Parameter(torch.randn(4, 8, generator=g).bfloat16())
            self.b = torch.nn.Parameter(torch.randn(8, 4, generator=g).bfloat16())
            self.c = torch.nn.Parameter(torch.randn(8, 8, generator=g).bfloat16())

        def forward(self, x):
            h = x @ self.base.float().t() + (x @ self.a.float().t()) @ self.b.float().t()
            return h @ self.c.float().t()

        def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
            return {
                f"{prefix}{n}": ShardedTensor.from_rank_offsets(f"{prefix}{n}", p, replica_id=0)
                for n, p in self.named_parameters()
            }

    class Schedule:  # what a checkpoint asks of the LR scheduler
        def state_dict(self):
            return {}

    def build():
        model = Adapted()
        ddp, optimizer = build_megatron_ddp_and_optimizer(model, tconfig, cfg, bf16=True)
        return model, optimizer

    def step(model, optimizer, i: int) -> float:
        optimizer.zero_grad()
        x = torch.randn(16, 8, generator=torch.Generator().manual_seed(100 + i))
        loss = model(x).pow(2).mean()
        loss.backward()
        optimizer.step()
        return loss.item()

    def adam_steps(optimizer) -> tuple[list[float], int]:
        (member,) = optimizer._members()
        states = list(member.optimizer.state.values())
        return [float(s["step"]) for s in states], len({id(s["step"]) for s in states})

    ddp_log: list[str] = []  # what Megatron-Core's DDP warns of while the models are built
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: ddp_log.append(record.getMessage())
    ddp_logger = logging.getLogger("megatron.core.distributed.distributed_data_parallel")
    ddp_logger.addHandler(handler)
    with _distributed_optimizer_on_cpu():
        parallel_state.initialize_model_parallel(1, context_parallel_size=1, create_gloo_process_groups=False)
        try:
            writer = CheckpointWriter(
                Path(tmp), keep_last=0, dp_cp_group=dist.group.WORLD, async_save=False, runtime=job_runtime()
            )
            model, optimizer = build()
            full, saved = [], None
            for i in range(4):
                full.append(step(model, optimizer, i))
                if i == 1:
                    saved = writer.save(
                        2,
                        manifest={"optimizer": optimizer.checkpoint_form},
                        state=lambda: state_to_save(
                            2, model=model, optimizer=optimizer, scheduler=Schedule()
                        ),
                    )
            model, optimizer = build()
            loaded = load_checkpoint(
                saved, read_manifest(saved), model=model, optimizer=optimizer, same_layout=True
            )
            after_load = adam_steps(optimizer)
            resumed = [step(model, optimizer, i) for i in (2, 3)]
            return {
                "full": full,
                "resumed": resumed,
                "start": loaded.step,
                "after_load": after_load,
                "at_end": adam_steps(optimizer),
                "ddp_log": ddp_log,
            }
        finally:
            parallel_state.destroy_model_parallel()
            ddp_logger.removeHandler(handler)


@pytest.mark.parametrize("sharding", SHARDINGS)
def test_a_resumed_run_repeats_the_uninterrupted_one(sharding, tmp_path):
    (r,) = run_distributed(_resume_case, 1, sharding, str(tmp_path))
    assert r["start"] == 2
    # Adam's step: the checkpoint's, one tensor per parameter (one shared tensor would advance by
    # the number of parameters at every step)
    assert r["after_load"] == ([2.0, 2.0, 2.0], 3), r["after_load"]
    assert r["at_end"] == ([4.0, 4.0, 4.0], 3), r["at_end"]
    # the same CPU kernels in the same order: step 3 (weights) and step 4 (Adam's state) exactly
    assert r["resumed"] == r["full"][2:], (r["full"], r["resumed"])
    # the buffers' layout is computed where DDP is built and passed in (Megatron-Core warns when not)
    assert not [m for m in r["ddp_log"] if "full_param_layout" in m], r["ddp_log"]
