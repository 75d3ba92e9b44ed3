"""Which linear layers of a model run their GEMMs in FP8, decided once when the model is built.

:func:`install_fp8` walks the model's Megatron-Core parallel linears, keeps in bf16 what
:class:`~relax_gdn.model.fp8.options.FP8Options` keeps (and every layer whose local weight
dimensions are not multiples of 16), gives the others an :class:`~relax_gdn.model.fp8.linear.FP8LinearImpl`
and returns the :class:`FP8Plan`: the start-up line that names what stays in bf16, and, after
training, the summary of which layers really ran in FP8 (counted per forward, so a layer that a
fused path bypasses shows up as such instead of passing for FP8).

A frozen weight that runs in FP8 (LoRA's base) is read by its GEMMs only through its kept FP8
casts, so with ``model.fp8.frozen_weights_on_host`` the plan moves its bf16 values to host memory
before step 1 (:meth:`FP8Plan.keep_frozen_weights_on_host`): the GPU keeps the two FP8 layouts its
GEMMs read (a byte each) per such weight instead of two bytes of bf16 plus the FP8 casts. What reads the weights
themselves (a checkpoint save, the export) does so inside :meth:`FP8Plan.frozen_weights_on_device`.
"""

from __future__ import annotations

import contextlib
import fnmatch
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from relax_gdn.errors import ConfigError, RecipeError
from relax_gdn.model.fp8.options import FP8Options, fp8_problems

if TYPE_CHECKING:  # torchao takes seconds to import: only a model built with FP8 loads it
    from relax_gdn.model.fp8.casts import CastKernels
    from relax_gdn.model.fp8.linear import FP8LinearImpl


class HostMemoryError(RecipeError):
    """Host memory too short for what ``model.fp8.frozen_weights_on_host`` moves there."""


# torch._scaled_mm: both dimensions of the weight (the GEMMs' inner and outer sizes) multiples of 16
_ALIGN = 16


@dataclass
class PlannedLayer:
    """One parallel linear of the model: its FP8 implementation (None: bf16) and why not, or which
    of its output rows stay in bf16."""

    name: str
    out_features: int  # this rank's rows
    in_features: int
    impl: FP8LinearImpl | None
    bf16_reason: str = ""
    weight: torch.nn.Parameter | None = field(default=None, repr=False)  # the layer's, for host keeping

    @property
    def frozen_in_fp8(self) -> bool:
        """Runs in FP8 with a frozen weight (LoRA's base): its FP8 casts are kept across steps."""
        return self.impl is not None and self.weight is not None and not self.weight.requires_grad

    @property
    def kind(self) -> str:
        return self.name.rsplit(".", 1)[-1]

    @property
    def fp8_weights(self) -> int:
        if self.impl is None:
            return 0
        return (self.out_features - self.impl.bf16_rows) * self.in_features


@dataclass
class FP8Plan:
    """The FP8 layout of one model (see the module docstring)."""

    options: FP8Options
    layers: list[PlannedLayer]
    # frozen FP8 weights kept in host memory: (the parameter, its device, its host tensor)
    on_host: list[tuple[torch.nn.Parameter, torch.device, torch.Tensor]] = field(default_factory=list)

    def keep_frozen_weights_on_host(self) -> int:
        """Move the bf16 values of every frozen weight that runs in FP8 from the GPU to pinned host
        memory (its GEMMs read its kept FP8 casts, made once from a copy brought back); returns the
        bytes moved. Nothing to do on CPU, without frozen FP8 weights, or once moved. Call it after
        the weights have their starting values (the broadcast over DP, a checkpoint load)."""
        frozen = [
            layer.weight
            for layer in (self.layers if self.options.frozen_weights_on_host else ())
            if layer.frozen_in_fp8 and layer.weight.is_cuda
        ]
        moved = 0
        for weight in frozen:
            try:
                host = torch.empty(weight.shape, dtype=weight.dtype, device="cpu", pin_memory=True)
            except RuntimeError as e:  # torch's error for a failed cudaHostAlloc (a node short of memory)
                self._back_on_device()
                wanted = sum(w.nbytes for w in frozen)
                raise HostMemoryError(
                    f"model.fp8.frozen_weights_on_host: pinned host memory for the frozen FP8 weights "
                    f"({wanted / 2**30:.1f} GiB) could not be allocated after {moved / 2**30:.1f} GiB "
                    f"({str(e).splitlines()[0]}); free host memory on this node, or set "
                    f"model.fp8.frozen_weights_on_host=false (they stay on the GPU: "
                    f"{wanted / 2**30:.1f} GiB more there)"
                ) from e
            host.copy_(weight.data)
            self.on_host.append((weight, weight.device, host))
            weight.data = host
            moved += host.nbytes
        return moved

    def _back_on_device(self) -> None:
        """Every weight moved to host memory back on its GPU for good (a failed move leaves the
        model as it was built)."""
        for weight, device, host in self.on_host:
            weight.data = host.to(device)
        self.on_host.clear()

    @contextlib.contextmanager
    def frozen_weights_on_device(self) -> Iterator[None]:
        """The weights :meth:`keep_frozen_weights_on_host` moved, back on their GPU for the body (a
        checkpoint save reads them, the export merges adapters into them); host memory again after,
        with what the body wrote into them."""
        versions = []
        for weight, device, _ in self.on_host:
            versions.append(weight._version)
            weight.data = weight.data.to(device, non_blocking=True)
        try:
            yield
        finally:
            for (weight, _, host), version in zip(self.on_host, versions):
                if weight._version != version:  # written while on the GPU
                    host.copy_(weight.data)
                weight.data = host

    def startup_line(self) -> str:
        """One line: the recipe, the layers in FP8 by kind, and what stays in bf16 with why."""
        fp8 = Counter(layer.kind for layer in self.layers if layer.impl is not None)
        gated = Counter(
            layer.kind for layer in self.layers if layer.impl is not None and layer.impl.bf16_rows
        )
        parts = [
            f"{kind} x{n}" + (" (beta/alpha rows bf16)" if gated[kind] else "") for kind, n in fp8.items()
        ]
        kept = [f"{layer.name} ({layer.bf16_reason})" for layer in self.layers if layer.impl is None]
        total = sum(layer.out_features * layer.in_features for layer in self.layers)
        share = sum(layer.fp8_weights for layer in self.layers) / max(total, 1)
        host = sum(h.nbytes for _, _, h in self.on_host)
        return (
            f"FP8 GEMMs ({self.options.recipe}, torchao): {sum(fp8.values())} linear layers: "
            f"{', '.join(parts) or 'none'} ({share:.0%} of the linear weights); bf16: "
            f"{', '.join(kept + ['the embedding (a lookup)'])}"
            + (
                f"; {len(self.on_host)} frozen weights in host memory ({host / 2**30:.1f} GiB of bf16), "
                "their FP8 casts on the GPU"
                if self.on_host
                else ""
            )
        )

    def ran_line(self) -> str:
        """After training: how many layers ran their GEMMs in FP8, and any that were planned for FP8
        but never ran (a path that bypasses the layer)."""
        planned = [layer for layer in self.layers if layer.impl is not None]
        idle = [layer.name for layer in planned if layer.impl.calls == 0]
        frozen = [layer for layer in planned if layer.frozen_in_fp8]
        line = (
            f"FP8 ({self.options.recipe}): {len(planned) - len(idle)} of {len(self.layers)} linear layers "
            f"ran {_gemms_in_fp8(planned)}"
        )
        # a frozen weight's casts are kept: more casts than layers means they were made again
        if frozen:
            casts = sum(layer.impl.weight_casts for layer in frozen)
            line += f"; {len(frozen)} frozen weights, {casts} weight casts made for them"
        return line + (f"; planned but never called: {', '.join(idle)}" if idle else "")


def _gemms_in_fp8(planned: list[PlannedLayer]) -> str:
    """Which of the planned layers' GEMMs ran in FP8. A frozen weight (LoRA's base: LoRA freezes every
    weight it does not add) has no weight gradient, so no weight-gradient GEMM to name."""
    trainable = [layer for layer in planned if not layer.frozen_in_fp8]
    if not trainable:
        return "forward and input-gradient GEMMs in FP8 (frozen weights: no weight-gradient GEMM)"
    if all(layer.impl.operands.weight_grad_in_fp8 for layer in trainable):
        return "forward, input-gradient and weight-gradient GEMMs in FP8"
    return "forward and input-gradient GEMMs in FP8 (weight gradients in bf16)"


def _check_patterns_match(patterns: tuple[str, ...], names: list[str]) -> None:
    """A ``model.fp8.bf16_modules`` pattern that names no linear layer is a mistyped name: the layers
    it meant would silently run in FP8."""
    unmatched = [p for p in patterns if not any(fnmatch.fnmatchcase(name, p) for name in names)]
    if unmatched:
        examples = ", ".join(dict.fromkeys([*names[:2], *names[-3:]]))
        raise ConfigError(
            f"model.fp8.bf16_modules {', '.join(repr(p) for p in unmatched)} match no linear layer of this "
            f"model; its linear layers are named like {examples} (fnmatch patterns, e.g. "
            "'decoder.layers.0.*' or '*.linear_fc2'): fix the pattern or leave it out"
        )


def _matching(name: str, patterns: tuple[str, ...]) -> str | None:
    return next((p for p in patterns if fnmatch.fnmatchcase(name, p)), None)


def _gdn_gate_rows(model: torch.nn.Module) -> dict[str, int]:
    """GDN input projection name -> its beta/alpha output rows on this rank (the last two sections
    of Megatron-Core's ``in_proj_split_sections``)."""
    from megatron.core.ssm.gated_delta_net.gdn import GatedDeltaNet

    return {
        f"{name}.in_proj": sum(module.in_proj_split_sections[-2:])
        for name, module in model.named_modules()
        if isinstance(module, GatedDeltaNet)
    }


def _plan_layer(
    name: str, module, options: FP8Options, gate_rows: dict[str, int], kernels: CastKernels
) -> PlannedLayer:
    from megatron.core.tensor_parallel import RowParallelLinear

    out_features, in_features = module.weight.shape
    layer = PlannedLayer(name, out_features, in_features, None, weight=module.weight)
    if pattern := _matching(name, options.bf16_modules):
        layer.bf16_reason = f"model.fp8.bf16_modules {pattern!r}"
        return layer
    bf16_rows = gate_rows.get(name, 0) if options.bf16_gdn_gates else 0
    if (out_features - bf16_rows) % _ALIGN or in_features % _ALIGN:
        layer.bf16_reason = f"{out_features - bf16_rows}x{in_features} not multiples of {_ALIGN}"
        return layer
    from relax_gdn.model.fp8.linear import FP8LinearImpl

    layer.impl = FP8LinearImpl.of_recipe(
        options.recipe,
        parallel="row" if isinstance(module, RowParallelLinear) else "column",
        tp_group=module.tp_group,
        kernels=kernels,
        bf16_rows=bf16_rows,
    )
    return layer


def install_fp8(
    model: torch.nn.Module,
    options: FP8Options,
    *,
    spec_provider: str = "local",
    fused_cross_entropy: bool = True,
) -> FP8Plan:
    """Give ``model``'s parallel linears their FP8 GEMMs as ``options`` say (their
    ``_forward_impl``); returns the plan (also kept as ``model.fp8_plan``)."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    from relax_gdn.model.fp8.casts import CastKernels

    if problems := fp8_problems(
        options.recipe,
        options.bf16_modules,
        spec_provider=spec_provider,
        fused_cross_entropy=fused_cross_entropy,
        cuda_capability=None,
    ):
        raise ValueError("; ".join(problems))
    linears = [
        (name, module)
        for name, module in model.named_modules()
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear))
    ]
    _check_patterns_match(options.bf16_modules, [name for name, _ in linears])
    kernels, gate_rows, layers = CastKernels(), _gdn_gate_rows(model), []
    for name, module in linears:
        if module.weight is None:  # an output layer that shares the embedding's weight
            continue
        layer = _plan_layer(name, module, options, gate_rows, kernels)
        if layer.impl is not None:
            module._forward_impl = layer.impl
        layers.append(layer)
    model.fp8_plan = FP8Plan(options, layers)
    return model.fp8_plan


def fp8_plan_of(model: torch.nn.Module) -> FP8Plan | None:
    """The plan :func:`install_fp8` gave ``model`` (None: bf16 GEMMs); ``model`` may be wrapped
    (Megatron-Core's DDP keeps it as ``.module``)."""
    while not hasattr(model, "fp8_plan") and isinstance(getattr(model, "module", None), torch.nn.Module):
        model = model.module
    return getattr(model, "fp8_plan", None)


def keep_frozen_weights_on_host(model: torch.nn.Module) -> int:
    """:meth:`FP8Plan.keep_frozen_weights_on_host` of ``model``'s plan (0 bytes without one)."""
    plan = fp8_plan_of(model)
    return plan.keep_frozen_weights_on_host() if plan is not None else 0


def frozen_weights_on_device(model: torch.nn.Module) -> contextlib.AbstractContextManager:
    """:meth:`FP8Plan.frozen_weights_on_device` of ``model``'s plan (nothing to do without one)."""
    plan = fp8_plan_of(model)
    return plan.frozen_weights_on_device() if plan is not None else contextlib.nullcontext()


__all__ = [
    "FP8Plan",
    "HostMemoryError",
    "PlannedLayer",
    "fp8_plan_of",
    "frozen_weights_on_device",
    "install_fp8",
    "keep_frozen_weights_on_host",
]
