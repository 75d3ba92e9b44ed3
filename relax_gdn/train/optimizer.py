"""Gradient synchronisation, optimizer, clipping and the LR schedule, behind one small interface.

On CUDA (the real runs): Megatron-Core's ``DistributedDataParallel`` (fp32 gradient buffers, one
reduce-scatter per step) and ``get_megatron_optimizer`` with the distributed optimizer (Adam,
clipping by the global grad norm, bf16 params with fp32 main params).

On CPU (tests, the demo): Megatron-Core 0.19.2 cannot run either piece without a GPU. Its DDP
grad sync calls ``torch.cuda.current_stream()`` (``param_and_grad_buffer.start_grad_sync``) and
every ``MegatronOptimizer`` allocates ``torch.tensor(..., device='cuda')`` in ``__init__`` and in
``clip_grads`` — patching those would be patching the optimizer itself. The nearest working
equivalent is used instead, with the same semantics: gradients SUMMED over the data-parallel x
context-parallel group (``calculate_per_token_loss``: the loss is already divided by the global
loss-token count), TP-partial gradients summed over TP as Megatron-Core's ``finalize_model_grads``
does (sequence-parallel norms by their ``sequence_parallel`` attribute; the QK-norms, which
Megatron-Core picks by name, by the ``SUM_GRAD_OVER_TP`` attribute their norm sets), the grad
norm over non-duplicated parameters reduced over TP (Megatron's ``get_grad_norm_fp32``), clipping by ``clip / (norm + 1e-6)``,
``torch.optim.AdamW`` (what Megatron-Core itself falls back to without TE/Apex) with Megatron's
no-weight-decay rule for biases and 1-D parameters. Both paths use Megatron-Core's
``OptimizerParamScheduler`` for warm-up + cosine.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from relax_gdn.config import RunConfig
from relax_gdn.train.checkpoint_state import give_unstepped_adam_state
from relax_gdn.train.megatron_optimizer import build_megatron_ddp_and_optimizer

logger = logging.getLogger("relax_gdn.train")


def _no_weight_decay(name: str, param: torch.nn.Parameter) -> bool:
    # Megatron-Core's default rule (optimizer/__init__.py: biases and 1-D params get no decay)
    return name.endswith(".bias") or param.dim() == 1


class CPUGradSyncOptimizer:
    """The CPU stand-in for Megatron-Core DDP + MegatronOptimizer (see the module docstring)."""

    def __init__(
        self, model: torch.nn.Module, cfg: RunConfig, *, dp_cp_group, tp_group, sequence_parallel: bool
    ):
        from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

        self.model = model
        self.dp_cp_group = dp_cp_group
        self.tp_group = tp_group
        self.sequence_parallel = sequence_parallel
        self.clip_grad = cfg.optim.clip_grad
        self.update = cfg.optim.name != "none"  # "none": gradients synced and measured, no update
        self.named_params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        # duplicates over the TP group it was given, not Megatron-Core's global one
        self._norm_params = [
            p for _, p in self.named_params if param_is_not_tensor_parallel_duplicate(p, tp_group=tp_group)
        ]
        decay = [p for n, p in self.named_params if not _no_weight_decay(n, p)]
        no_decay = [p for n, p in self.named_params if _no_weight_decay(n, p)]
        o = cfg.optim
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "wd_mult": 1.0}, {"params": no_decay, "wd_mult": 0.0}],
            lr=cfg.learning_rates[0],
            betas=(o.beta1, o.beta2),
            eps=o.eps,
            weight_decay=o.weight_decay,
        )

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    def zero_grad(self) -> None:
        self.model.zero_grad(set_to_none=False)
        for _, p in self.named_params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)

    def _finish_grad_sync(self) -> None:
        params = [p for _, p in self.named_params]
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        if dist.get_world_size(self.dp_cp_group) > 1:
            grads = [p.grad for p in params]
            flat = _flatten_dense_tensors(grads)
            dist.all_reduce(flat, group=self.dp_cp_group)
            for g, synced in zip(grads, _unflatten_dense_tensors(flat, grads)):
                g.copy_(synced)
        if dist.get_world_size(self.tp_group) > 1:
            partial = [p.grad for p in params if self._partial_over_tp(p)]
            if partial:
                flat = _flatten_dense_tensors(partial)
                dist.all_reduce(flat, group=self.tp_group)
                for g, synced in zip(partial, _unflatten_dense_tensors(flat, partial)):
                    g.copy_(synced)

    def _partial_over_tp(self, param: torch.nn.Parameter) -> bool:
        """Whether ``param``'s gradient is a partial sum over TP, told by attributes set where the
        parameter is made (never by its name)."""
        from relax_gdn.model.norms import SUM_GRAD_OVER_TP

        return (self.sequence_parallel and getattr(param, "sequence_parallel", False)) or getattr(
            param, SUM_GRAD_OVER_TP, False
        )

    def _grad_norm(self) -> float:
        local = torch.zeros((), dtype=torch.float64)
        for p in self._norm_params:
            local += p.grad.double().pow(2).sum()
        if dist.get_world_size(self.tp_group) > 1:
            dist.all_reduce(local, group=self.tp_group)
        return math.sqrt(local.item())

    def step(self) -> tuple[bool, float]:
        """Sync gradients, clip, update; returns (updated, grad norm before clipping). A grad norm
        that is not finite (the same on every rank: it is reduced) leaves the weights and the
        optimizer state as they were."""
        self._finish_grad_sync()
        norm = self._grad_norm()
        if not math.isfinite(norm):
            return False, norm
        if self.clip_grad > 0:
            coeff = self.clip_grad / (norm + 1e-6)
            if coeff < 1.0:
                for _, p in self.named_params:
                    p.grad.mul_(coeff)
        if not self.update:
            return False, norm
        self.optimizer.step()
        return True, norm

    def _parameters(self):
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    checkpoint_form = {"kind": "cpu_adamw"}  # one form, resharding at any TP / CP / DP
    main_params = (
        None  # the weights are fp32 themselves: no main copy (see MegatronOptimizerAdapter.main_params)
    )

    def sharded_state_dict(
        self, model_sharded_state_dict, is_loading: bool = False, sharding: str | None = None
    ) -> dict[str, Any]:
        """AdamW's state as Megatron-Core sharded tensors keyed like the parameters they belong to
        (``optimizer.state.exp_avg.<parameter key>``), so the moments reshard with the model across
        TP / CP / DP exactly like the weights; the step count (one for all parameters) and the
        param groups are common state. Loading builds zero moments first for the load to fill."""
        from megatron.core.dist_checkpointing.optimizer import (
            get_param_id_to_sharded_param_map,
            optim_state_to_sharding_state,
        )

        if is_loading:
            give_unstepped_adam_state(self.optimizer)
        state = self.optimizer.state_dict()
        steps = {float(s["step"]) for s in state["state"].values()}
        if len(steps) > 1:
            raise RuntimeError(f"AdamW parameters are at different steps {sorted(steps)}; expected one")
        id_to_sharded = get_param_id_to_sharded_param_map(model_sharded_state_dict, self._parameters())
        optim_state_to_sharding_state(state, id_to_sharded, exclude_keys=("step",))
        state["state"]["common_step"] = steps.pop() if steps else 0.0
        return {"kind": "cpu_adamw", "optimizer": state}

    def load_sharded_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("kind") != "cpu_adamw":
            raise ValueError(
                f"checkpoint optimizer state is {state.get('kind')!r}, this run uses the CPU AdamW path"
            )
        optim = state["optimizer"]
        step = optim["state"].pop("common_step")
        for param_state in optim["state"].values():
            param_state["step"] = torch.tensor(step, dtype=torch.float32)
        self.optimizer.load_state_dict(optim)


def build_training_model_and_optimizer(
    model, transformer_config, cfg: RunConfig, parallel, *, device: torch.device, bf16: bool
):
    """What runs forward/backward and the optimizer that syncs its gradients and updates it: on
    CUDA, ``model`` in the bf16 wrapper (as Megatron's ``get_model``: bf16 params, fp32 outputs, the
    per-token loss) and Megatron-Core DDP, every DP replica starting from rank 0's weights; on CPU
    ``model`` itself and :class:`CPUGradSyncOptimizer` over ``parallel``'s groups."""
    if device.type != "cuda":
        return model, CPUGradSyncOptimizer(
            model,
            cfg,
            dp_cp_group=parallel.dp_cp_group,
            tp_group=parallel.tp_group,
            sequence_parallel=cfg.parallel.sp,
        )
    if bf16:
        from megatron.core.transformer.module import Float16Module

        model = Float16Module(transformer_config, model)
    model, optimizer = build_megatron_ddp_and_optimizer(model, transformer_config, cfg, bf16=bf16)
    model.broadcast_params()
    return model, optimizer


def resolve_warmup_steps(warmup: int | float, steps: int, log: bool = True) -> int:
    """The warm-up in steps for ``optim.warmup_steps=warmup`` over ``train.steps=steps``: a value
    below 1 is a fraction of the run (rounded), a whole number is steps. A warm-up that would
    take the whole run is clamped to ``steps - 1`` (the last step trains at the scheduled rate)
    with a warning (``log``: rank 0 says it once): ``train.steps=N`` for a quick try should not need
    a second override."""
    resolved = round(warmup * steps) if warmup < 1 else int(warmup)
    if resolved >= steps and resolved > 0:
        if log:
            logger.warning(
                "optim.warmup_steps=%s is not below train.steps=%d: warming up over %d step(s) instead",
                warmup,
                steps,
                steps - 1,
            )
        return steps - 1
    return resolved


def build_scheduler(optimizer, cfg: RunConfig, log: bool = True):
    """Megatron-Core's ``OptimizerParamScheduler``: linear warm-up from 0, then ``optim.schedule``
    down to ``optim.min_lr``, reached at step ``optim.decay_steps`` (default: ``train.steps``).

    The loop advances it by one BEFORE each optimizer step, so step s (1-based) uses the rate of
    step s: the first step does not waste a zero learning rate and the last one uses ``min_lr``."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    o = cfg.optim
    lr, min_lr = cfg.learning_rates
    warmup = resolve_warmup_steps(o.warmup_steps, cfg.train.steps, log)
    decay_steps = o.decay_steps or cfg.train.steps
    decay_steps = max(decay_steps, warmup + 1)  # the scheduler needs warmup < decay
    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=lr,
        min_lr=min_lr,
        lr_warmup_steps=warmup,
        lr_decay_steps=decay_steps,
        lr_decay_style=o.schedule,
        start_wd=o.weight_decay,
        end_wd=o.weight_decay,
        wd_incr_steps=max(cfg.train.steps, 1),
        wd_incr_style="constant",
    )
