"""Megatron-Core DDP + the distributed optimizer on CUDA (the real runs), behind the small
interface of :mod:`relax_gdn.train.optimizer`: :class:`MegatronOptimizerAdapter` (an update whose
grad norm is not finite skipped: :class:`SkipNonfiniteUpdate`), :class:`GradientsOnly`
(``optim.name=none``) and :func:`build_megatron_ddp_and_optimizer`."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from relax_gdn.config import RunConfig
from relax_gdn.train.checkpoint_state import give_unstepped_adam_state


class GradientsOnly:
    """``optim.name=none`` on CUDA: Megatron-Core DDP's gradient reduction (``finalize_model_grads``)
    and no update, no optimizer state (benchmarks of models whose Adam state does not fit).
    ``param_groups`` only carries the scheduled learning rate."""

    def __init__(self, ddp_model, lr: float):
        self.model = ddp_model
        self.param_groups = [{"lr": lr, "weight_decay": 0.0, "wd_mult": 1.0, "lr_mult": 1.0}]

    def zero_grad(self) -> None:
        self.model.zero_grad_buffer()

    def step(self) -> tuple[bool, float | None]:
        from megatron.core.distributed import finalize_model_grads

        finalize_model_grads([self.model])
        return False, None  # no grad norm measured

    checkpoint_form = {"kind": "none"}
    main_params = None  # no optimizer state, no main copy

    def sharded_state_dict(
        self, model_sharded_state_dict, is_loading: bool = False, sharding: str | None = None
    ) -> dict[str, Any]:
        return {"kind": "none"}  # no optimizer state to save

    def load_sharded_state_dict(self, state: dict[str, Any]) -> None:
        pass


class SkipNonfiniteUpdate:
    """Megatron-Core's optimizer step without the update when the grad norm is not finite.

    With bf16 (no loss scaler) Megatron-Core 0.19.2 applies whatever the gradients hold: a NaN
    norm makes the clipping factor NaN, ``NaN < 1`` is false, nothing is clipped, and Adam writes
    NaN into the weights and moments (the chained optimizer's ``grad_norm_skip_threshold`` test is
    false for NaN too). Its step computes the norm (``get_grad_norm`` in ``ChainedOptimizer.step``,
    ``clip_grad_norm`` in ``MixedPrecisionOptimizer.step``: the step's host read, the same value on
    every rank) before ``step_with_ready_grads`` applies the update; this object, installed on the
    optimizer get_megatron_optimizer returned, notes that norm and turns the update into a no-op
    when it is not finite. (DDP's ``check_for_nan_in_grad`` would instead raise on the rank whose
    local gradients hold the NaN, before the reduction the other ranks wait in.)"""

    def __init__(self, optimizer):
        self.norm: float | None = None
        for name in ("get_grad_norm", "clip_grad_norm"):
            if hasattr(optimizer, name):
                setattr(optimizer, name, self._noting(getattr(optimizer, name)))
        apply = optimizer.step_with_ready_grads
        optimizer.step_with_ready_grads = lambda: False if self.skips else apply()

    @property
    def skips(self) -> bool:
        return self.norm is not None and not math.isfinite(self.norm)

    def _noting(self, compute):
        def noted(*args, **kwargs):
            self.norm = compute(*args, **kwargs)
            return self.norm

        return noted


class MegatronOptimizerAdapter:
    """Megatron-Core DDP + distributed optimizer (CUDA); an update whose grad norm is not finite is
    skipped (:class:`SkipNonfiniteUpdate`)."""

    def __init__(self, ddp_model, optimizer, checkpoint_sharding: str):
        self.model = ddp_model
        self.optimizer = optimizer
        self.checkpoint_sharding = checkpoint_sharding
        self._guard = SkipNonfiniteUpdate(optimizer)

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    def zero_grad(self) -> None:
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()

    def step(self) -> tuple[bool, float | None]:
        """Reduce the gradients, clip, update; returns (updated, grad norm). A non-finite norm
        applies nothing (:class:`SkipNonfiniteUpdate`)."""
        from megatron.core.distributed import finalize_model_grads

        finalize_model_grads([self.model])
        self._guard.norm = None
        updated, grad_norm, _ = self.optimizer.step()
        if grad_norm is None:  # Megatron-Core found inf/NaN itself (a loss scaler) and skipped the update
            grad_norm = self._guard.norm if self._guard.norm is not None else float("nan")
        return bool(updated), float(grad_norm)

    @property
    def checkpoint_form(self) -> dict[str, Any]:
        return {"kind": "megatron", "sharding": self.checkpoint_sharding}

    def sharded_state_dict(
        self, model_sharded_state_dict, is_loading: bool = False, sharding: str | None = None
    ) -> dict[str, Any]:
        """The distributed optimizer's state in one of Megatron-Core's two current forms
        (``checkpoint.optimizer_sharding``; a load passes the form the checkpoint was written in):

        - ``dp_reshardable``: each rank writes its own slice of the optimizer's flat buffers, with
          no gather and no host copy of the whole state (and async save stays async). The
          distributed optimizer shards over DP x CP, so the state resumes at any DP, CP and
          dynamic CP; it does not resume at another TP.
        - ``fully_reshardable``: the slices are all-gathered over DP x CP and cut into
          model-shaped fp32 tensors, loadable at any TP / CP / DP. The price is the gather and
          every rank holding its TP shard's whole optimizer state (main params + 2 moments,
          12 bytes a parameter) in host memory at save and at load.
        """
        sharding = sharding or self.checkpoint_sharding
        if is_loading:
            # Without Transformer Engine or Apex (the local specs) Megatron-Core's
            # DistributedOptimizer.state_dict asserts that every state has exactly one ``step``,
            # which a torch Adam that has not stepped yet does not have.
            for megatron_optimizer in self._members():
                give_unstepped_adam_state(megatron_optimizer.optimizer)
        return {
            "kind": "megatron",
            "optimizer": self.optimizer.sharded_state_dict(
                model_sharded_state_dict,
                is_loading,
                metadata={"distrib_optim_sharding_type": sharding, "chained_optim_avoid_prefix": True},
            ),
        }

    @property
    def main_params(self):
        """The fp32 main parameters of a bf16 run, for the HF export's float32 tensors
        (:meth:`fp32_main_params`; the CPU path and ``optim.name=none`` have none: None)."""
        return self.fp32_main_params

    def fp32_main_params(self, params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This TP rank's fp32 main copy of each of ``params`` (model tensors by name), whole and
        shaped like the parameter: the distributed optimizer holds it as slices spread over its
        DP x CP ranks (each rank knows only its own), summed into place here; a parameter whose
        slices do not cover it is left out. A collective over that group: every rank asks for the
        same names in the same order (the HF export's float32 tensors)."""
        members = self._members()
        group = members[0].data_parallel_group
        out = {}
        for name, param in params.items():
            flat = torch.zeros(param.numel(), dtype=torch.float32, device=param.device)
            covered = torch.zeros(1, dtype=torch.int64, device=param.device)
            for member in members:
                if param not in member.model_param_group_index_map:  # no slice on this rank
                    continue
                # Megatron-Core's own accessors: what its checkpoints save as the main parameter
                piece = member._get_model_param_range_map(param)["param"]
                main = member._get_main_param_and_optimizer_states(param)["param"]
                flat[piece.start : piece.end] = main.detach().view(-1).float()
                covered += piece.end - piece.start
            dist.all_reduce(flat, group=group)
            dist.all_reduce(covered, group=group)
            if covered.item() == param.numel():
                out[name] = flat.view(param.shape)
        return out

    def _members(self) -> list:
        """The distributed optimizers (get_megatron_optimizer may return a ChainedOptimizer)."""
        return list(getattr(self.optimizer, "chained_optimizers", [self.optimizer]))

    def load_sharded_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("kind") != "megatron":
            raise ValueError(
                f"checkpoint optimizer state is {state.get('kind')!r}, this run uses Megatron's optimizer"
            )
        for megatron_optimizer in self._members():
            _skip_torch_adam_step_on_load(megatron_optimizer)
        self.optimizer.load_state_dict(state["optimizer"])
        for megatron_optimizer in self._members():
            _own_adam_step_per_parameter(megatron_optimizer.optimizer)


def _skip_torch_adam_step_on_load(distributed_optimizer) -> None:
    """Megatron-Core 0.19.2's load sets torch Adam's per-parameter ``step`` from the saved param
    groups (the step the checkpoint was written at), then copies the loaded tensors into each
    parameter's state, ``step`` included, which is wrong in both forms: ``fully_reshardable``
    leaves ``step`` out of the loaded tensors (KeyError: 'step'; Transformer Engine's Adam keeps no
    per-parameter step) and ``dp_reshardable`` hands back the step Adam had when the load request
    was built (a non-persistent object, never saved: 0 in a run that has not stepped), which would
    reset Adam's bias correction to step 0. Mark ``step`` as not loaded (a non-tensor value is
    skipped), leaving the saved step the param groups set."""
    set_states = getattr(distributed_optimizer, "_set_main_param_and_optimizer_states", None)
    if set_states is None or getattr(set_states, "_skips_step", False):
        return

    def set_states_without_step(model_param, tensors):
        set_states(model_param, {**tensors, "step": None})  # last: overrides dp_reshardable's stale step

    set_states_without_step._skips_step = True
    distributed_optimizer._set_main_param_and_optimizer_states = set_states_without_step


def _own_adam_step_per_parameter(adam: torch.optim.Optimizer) -> None:
    """Give every parameter of a loaded torch Adam its own ``step`` tensor. Megatron-Core 0.19.2's
    DistributedOptimizer.load_state_dict (torch Adam, no TE/Apex) puts ONE step tensor into every
    parameter's state, and torch Adam increments each parameter's step in place: shared, it
    advances by the number of parameters at every optimizer step, so from the first step after a
    resume Adam's bias correction (and with it the size of every update) differs from the
    uninterrupted run's. The first resumed step's loss still agrees; the next one's does not."""
    for param_state in adam.state.values():
        step = param_state.get("step")
        if isinstance(step, torch.Tensor):
            param_state["step"] = step.detach().clone()


def _full_param_layout(model, transformer_config, ddp_config):
    """Where each trainable parameter lives in DDP's gradient buffers, padded for the distributed
    optimizer's shards: what Megatron-Core asks its callers to compute and pass in (it computes the
    same itself, with a warning at every run, when they do not). Over the process groups DDP takes
    (none passed: parallel_state's), one bucket per buffer since the gradient reduction does not
    overlap the backward (``overlap_grad_reduce=False``)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from megatron.core.process_groups_config import ProcessGroupCollection

    assert not ddp_config.overlap_grad_reduce, "a bucket size is needed when the reduction overlaps"
    groups = ProcessGroupCollection.setup_process_groups_for_ddp(None, transformer_config, ddp_config)
    return DistributedOptimizer.compute_full_param_layout(
        [p for p in model.parameters() if p.requires_grad],
        None,
        groups["intra_dp_cp_group"].size(),
        ddp_config,
        expert_data_parallel_world_size=groups["intra_expt_dp_group"].size(),
    )


def build_megatron_ddp_and_optimizer(model, transformer_config, cfg: RunConfig, *, bf16: bool):
    """(DDP-wrapped model, adapter) on CUDA."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        use_distributed_optimizer=True,
        # off: it raises on the rank whose local gradients hold a NaN, before the reduction the other
        # ranks wait in, and costs a host read per bucket; the step's reduced grad norm decides instead
        check_for_nan_in_grad=False,
        average_in_collective=False,
    )
    ddp = DistributedDataParallel(
        transformer_config,
        ddp_config,
        model,
        full_param_layout=_full_param_layout(model, transformer_config, ddp_config),
    )
    o = cfg.optim
    lr, min_lr = cfg.learning_rates
    if o.name == "none":
        return ddp, GradientsOnly(ddp, lr)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",
            lr=lr,
            min_lr=min_lr,
            weight_decay=o.weight_decay,
            adam_beta1=o.beta1,
            adam_beta2=o.beta2,
            adam_eps=o.eps,
            clip_grad=o.clip_grad,
            bf16=bf16,
            params_dtype=torch.bfloat16 if bf16 else torch.float32,
            use_distributed_optimizer=True,
        ),
        [ddp],
        use_gloo_process_groups=False,
    )
    return ddp, MegatronOptimizerAdapter(ddp, optimizer, cfg.checkpoint.optimizer_sharding)
