"""LoRA on the Megatron-Core Qwen3.5: adapters on the parallel linears and the embedding, split over
tensor parallelism the way their base layer is, the base frozen (docs/lora.md).

:func:`add_lora_adapters` (called by :func:`relax_gdn.model.qwen3_5.build_qwen3_5_model` when its
options carry :class:`~relax_gdn.model.lora_options.LoRAOptions`) freezes every parameter and gives
each adapted layer one :class:`LoRAAdapter` per Hugging Face module it holds (``lora.<hf name>``,
parameters ``lora_A [r, in]`` and ``lora_B [out, r]`` as PEFT names them). The layer's class becomes
a subclass of its own (same parameters and checkpoint keys for the base weight) whose forward adds
``scaling · B·A`` to the base output:

* column-parallel base (GDN ``in_proj``, attention ``linear_qkv``, ``linear_fc1``, the output
  layer): ``A`` replicated, ``B`` split like the base's output rows. ``u = A·x`` is formed on this
  rank's tokens and, rank-wide, either copied to the TP ranks (backward: all-reduce) or, with
  sequence parallelism, all-gathered over the sequence (backward: reduce-scatter); each rank's
  ``B`` then makes its own output rows. Under SP, ``A``'s gradient is a partial sum over the
  sequence shards (marked ``sequence_parallel``, summed over TP like the norms').
* row-parallel base (GDN ``out_proj``, attention ``linear_proj``, ``linear_fc2``): ``A`` split
  like the base's input columns, ``B`` replicated: ``u = A·x`` is a partial sum, all-reduced over
  TP (reduce-scattered over the sequence with SP, where ``B``'s gradient is then partial).
* the embedding (vocabulary split over TP): ``A [r, vocab]`` split like the embedding's rows,
  ``B [hidden, r]`` replicated, PEFT's ``lora_embedding_A/B`` (``A`` starts at zero, ``B`` random).

Where a Megatron-Core linear fuses several HF modules (``in_proj`` = ``in_proj_qkv`` +
``in_proj_z`` + ``in_proj_b`` + ``in_proj_a``; ``linear_qkv`` = ``q_proj`` + ``k_proj`` +
``v_proj``, grouped by KV head; ``linear_fc1`` = ``gate_proj`` + ``up_proj``) each adapter writes
the base output rows of its HF module: which rows those are on each TP rank is derived from the HF
conversion plan (:mod:`relax_gdn.model.hf_checkpoint.plan`), the one place that knows the layouts
(:mod:`relax_gdn.model.lora_rows`), so an adapter is the PEFT adapter of that HF module tensor for tensor, rows in HF order.

The ``A`` matrices start as PEFT's (Kaiming-uniform), drawn whole from a seeded generator and cut
for this TP rank, ``B`` at zero: a model at any TP size starts from the same adapters, and from
exactly the base model. :mod:`relax_gdn.model.lora_export` folds them into the base weights (the merged
export) or gathers them in HF shapes (the PEFT export);
:func:`seed_base_weights` is the base of a run without a Hugging Face checkpoint.
"""

from __future__ import annotations

import functools
import math
import zlib
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    get_cuda_rng_tracker,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)

from relax_gdn.model.hf_checkpoint.plan import ROW, TensorRule, TPSplit, shard_for_tp
from relax_gdn.model.lora_options import LORA_MODULES, LORA_PARAMETER, STARTS_WITHOUT_GRADIENT, LoRAOptions
from relax_gdn.model.lora_rows import column_rows, rows_mode
from relax_gdn.model.seeded_draws import seeded_values

# ---------------------------------------------------------------------------------------------
# one adapter
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AdapterLayout:
    """Where one adapter sits: its HF module and how TP cuts its matrices.

    Args:
        hf_module: the HF text-layout module name (``model.layers.0.linear_attn.in_proj_qkv``).
        a_split: how TP cuts the whole ``A [r, in]`` (None: replicated).
        b_split: how TP cuts the whole ``B [out, r]`` (None: replicated); its sections are the HF
            module's head-indexed parts that TP cuts one by one (``in_proj_qkv``: q, k, v).
        a_shape: the whole ``A``'s shape.
        b_shape: the whole ``B``'s shape.
    """

    hf_module: str
    a_split: TPSplit | None
    b_split: TPSplit | None
    a_shape: tuple[int, int]
    b_shape: tuple[int, int]


class LoRAAdapter(torch.nn.Module):
    """``lora_A [r, in]`` and ``lora_B [out, r]`` of one HF module, this TP rank's shares."""

    def __init__(self, layout: AdapterLayout, a: torch.Tensor, b: torch.Tensor, *, sequence_parallel: bool):
        from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

        super().__init__()
        self.layout = layout
        self.lora_A = torch.nn.Parameter(a)
        self.lora_B = torch.nn.Parameter(b)
        for param, split in ((self.lora_A, layout.a_split), (self.lora_B, layout.b_split)):
            set_tensor_model_parallel_attributes(
                param, split is not None, -1 if split is None else split.dim, 1
            )
            setattr(param, LORA_PARAMETER, True)
            # a replicated matrix fed by (or feeding) sequence-sharded rows has a partial gradient
            # on each TP rank: summed over TP where the norms' are (finalize_model_grads, CPU optimizer)
            param.sequence_parallel = sequence_parallel and split is None

    def sharded_state_dict(self, prefix: str, sharded_offsets, tp_group, dp_cp_group) -> dict:
        """Both matrices as Megatron-Core sharded tensors (any TP loads them), ``B`` of a module of
        several head-indexed sections split into one tensor per section."""
        from megatron.core.ssm.utils import _split_tensor_factory
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        layout = self.layout
        axes = {
            name: split.dim
            for name, split in (("lora_A", layout.a_split), ("lora_B", layout.b_split))
            if split is not None
        }
        state = {"lora_A": self.lora_A, "lora_B": self.lora_B}
        sharded = make_sharded_tensors_for_checkpoint(
            state, prefix, axes, sharded_offsets, tp_group=tp_group, dp_cp_group=dp_cp_group
        )
        sections = layout.b_split.sections if layout.b_split is not None else None
        if sections and len(sections) > 1:
            tp = tp_group.size()
            sharded[f"{prefix}lora_B"] = _split_tensor_factory(
                sharded[f"{prefix}lora_B"],
                [s // tp for s in sections],
                [str(i) for i in range(len(sections))],
                0,
            )
        return sharded


# ---------------------------------------------------------------------------------------------
# the adapted layers
# ---------------------------------------------------------------------------------------------


class LoRALayer:
    """What every adapted layer has besides its base class (mixed in before it)."""

    lora: torch.nn.ModuleDict  # HF module name (leaf) -> LoRAAdapter
    lora_scaling: float
    lora_dropout: float
    _lora_base_class: type

    def _lora_input(self, x: torch.Tensor, model_parallel_rng: bool) -> torch.Tensor:
        """``x`` with the adapters' dropout while training. Where every TP rank holds the same
        ``x`` (a column-parallel input without SP) the ranks draw the same mask (the default
        generator); elsewhere each rank draws its own (Megatron-Core's model-parallel generator,
        restored by full recompute like the default one)."""
        if not (self.training and self.lora_dropout):
            return x
        if model_parallel_rng:
            with get_cuda_rng_tracker().fork():
                return F.dropout(x, self.lora_dropout)
        return F.dropout(x, self.lora_dropout)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
        from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group

        metadata = ensure_metadata_has_dp_cp_group(metadata)
        # the base layer's (its own tensors; it would take the adapters' as replicated), then the adapters'
        sharded = {
            k: v
            for k, v in super().sharded_state_dict(prefix, sharded_offsets, metadata).items()
            if not k.startswith(f"{prefix}lora.")
        }
        for name, adapter in self.lora.items():
            sharded.update(
                adapter.sharded_state_dict(
                    f"{prefix}lora.{name}.", sharded_offsets, self.tp_group, metadata["dp_cp_group"]
                )
            )
        return sharded


class LoRAColumnParallel(LoRALayer):
    """A column-parallel linear with adapters (see the module docstring). ``lora_rows``: the base
    output rows (this rank's) the adapters' concatenated outputs go to, in adapter order."""

    lora_rows: torch.Tensor
    lora_rows_mode: str  # "identity" (all rows, in order), "permute" (all rows) or "scatter" (some)

    def forward(self, input_, weight=None, runtime_gather_output=None):
        gather = self.gather_output if runtime_gather_output is None else runtime_gather_output
        output, bias = super().forward(input_, weight=weight, runtime_gather_output=False)
        output = self._add_lora(input_, output)
        if gather:
            output = gather_from_tensor_model_parallel_region(output, group=self.tp_group)
        return output, bias

    def _add_lora(self, x: torch.Tensor, output: torch.Tensor) -> torch.Tensor:
        adapters = list(self.lora.values())
        x = self._lora_input(x, model_parallel_rng=self.sequence_parallel)
        # one GEMM for every adapter's A (F.linear, not torch.matmul: under recompute.skip_unused
        # the MLP's linear_fc2 runs with torch.matmul skipped, and B's gradient reads u)
        u = F.linear(x, torch.cat([a.lora_A for a in adapters])) * self.lora_scaling
        if self.sequence_parallel:
            u = gather_from_sequence_parallel_region(u, tensor_parallel_output_grad=True, group=self.tp_group)
        elif self.tp_group.size() > 1:
            u = copy_to_tensor_model_parallel_region(u, group=self.tp_group)
        parts = u.split([a.lora_A.shape[0] for a in adapters], dim=-1)
        delta = torch.cat([F.linear(part, a.lora_B) for part, a in zip(parts, adapters)], dim=-1)
        if self.lora_rows_mode == "identity":
            return output + delta
        if self.lora_rows_mode == "permute":
            return output + delta.index_select(-1, self.lora_rows)
        return output.index_add(-1, self.lora_rows, delta)

    def adapter_base_rows(self) -> torch.Tensor:
        """The base rows of the adapters' concatenated rows, whatever ``lora_rows_mode`` stores (the
        merged export adds ``B·A`` there)."""
        if self.lora_rows_mode == "identity":
            return torch.arange(self.weight.shape[0], device=self.lora_rows.device)
        if self.lora_rows_mode == "permute":  # lora_rows is the inverse permutation
            rows = torch.empty_like(self.lora_rows)
            rows[self.lora_rows] = torch.arange(rows.numel(), device=rows.device)
            return rows
        return self.lora_rows


class LoRARowParallel(LoRALayer):
    """A row-parallel linear with one adapter (see the module docstring)."""

    def forward(self, input_):
        output, bias = super().forward(input_)
        (adapter,) = self.lora.values()
        x = self._lora_input(input_, model_parallel_rng=True)
        u = F.linear(x, adapter.lora_A) * self.lora_scaling  # a partial sum over this rank's input columns
        if self.sequence_parallel:
            u = reduce_scatter_to_sequence_parallel_region(u, group=self.tp_group)
        elif self.tp_group.size() > 1:
            u = reduce_from_tensor_model_parallel_region(u, group=self.tp_group)
        return output + F.linear(u, adapter.lora_B), bias


class LoRAEmbedding(LoRALayer):
    """A vocabulary-parallel embedding with one adapter, PEFT's embedding LoRA (no dropout)."""

    def forward(self, input_):
        output = super().forward(input_)
        (adapter,) = self.lora.values()
        ids = input_
        if self.tp_group.size() > 1:  # this rank's rows of A, as the base masks its own rows
            outside = (ids < self.vocab_start_index) | (ids >= self.vocab_end_index)
            ids = (ids - self.vocab_start_index).masked_fill(outside, 0)
        u = F.embedding(ids, adapter.lora_A.t())
        if self.tp_group.size() > 1:
            u = u.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.reduce_scatter_embeddings:
            u = reduce_scatter_to_sequence_parallel_region(
                u.transpose(0, 1).contiguous(), group=self.tp_group
            )
        elif self.tp_group.size() > 1:
            u = reduce_from_tensor_model_parallel_region(u, group=self.tp_group)
        return output + F.linear(u, adapter.lora_B) * self.lora_scaling


_KINDS = (
    (RowParallelLinear, LoRARowParallel),
    (ColumnParallelLinear, LoRAColumnParallel),
    (VocabParallelEmbedding, LoRAEmbedding),
)


@functools.cache
def _adapted_class(base: type, mixin: type) -> type:
    return type(f"LoRA{base.__name__}", (mixin, base), {})


# ---------------------------------------------------------------------------------------------
# attaching
# ---------------------------------------------------------------------------------------------


def _generator(seed: int, name: str) -> torch.Generator:
    return torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63)


def initial_adapter(layout: AdapterLayout, seed: int, embedding: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole ``(A, B)`` at the start (fp32): PEFT's initialisation, from a generator seeded by
    ``seed`` and the module's name (so every TP size draws the same, and a PEFT model given these
    matrices starts from the same adapters: ``relax_gdn.bench.peers``)."""
    gen = _generator(seed, layout.hf_module)
    if embedding:  # PEFT: lora_embedding_A zeros, lora_embedding_B normal
        return torch.zeros(layout.a_shape), torch.randn(layout.b_shape, generator=gen)
    bound = 1.0 / math.sqrt(layout.a_shape[1])  # kaiming_uniform_(a=sqrt(5)) over the input width
    return torch.empty(layout.a_shape).uniform_(-bound, bound, generator=gen), torch.zeros(layout.b_shape)


def _local(full: torch.Tensor, split: TPSplit | None, group, like: torch.Tensor) -> torch.Tensor:
    share = full if split is None else shard_for_tp(full, split, group.size(), group.rank())
    return share.to(device=like.device, dtype=like.dtype).contiguous()


def _adapters_for(module, rule: TensorRule, leaves: list[str], options: LoRAOptions, kind: type):
    """This rank's adapters of ``module`` for the HF modules ``leaves`` of ``rule`` (its HF names
    and row counts), and the base output rows they write (column layers: ``(mode, rows)``)."""
    group, weight, r = module.tp_group, module.weight, options.rank
    names = [n.split(".")[-2] for n in rule.hf]
    hf_module = {leaf: n.removesuffix(".weight") for leaf, n in zip(names, rule.hf)}
    rows = None
    if kind is LoRAColumnParallel:  # A [r, in] replicated, B [HF rows, r] cut like them
        splits, rows, total = column_rows(rule, leaves, group.size(), group.rank())
        rows = rows_mode(rows, total)
        layouts = {
            leaf: AdapterLayout(
                hf_module[leaf],
                None,
                splits[leaf],
                (r, weight.shape[1]),
                (rule.hf_shapes[names.index(leaf)][0], r),
            )
            for leaf in leaves
        }
    elif kind is LoRARowParallel:  # A [r, in] cut like the input columns, B [out, r] replicated
        if rule.tp != ROW or len(leaves) != 1:
            raise ValueError(f"LoRA on {rule.mcore}: a row-parallel weight of one HF tensor was expected")
        layouts = {
            leaves[0]: AdapterLayout(
                hf_module[leaves[0]], ROW, None, (r, weight.shape[1] * group.size()), (weight.shape[0], r)
            )
        }
    else:  # the embedding: A [r, vocab] cut like the embedding's rows, B [hidden, r] replicated
        layouts = {
            leaves[0]: AdapterLayout(
                hf_module[leaves[0]], ROW, None, (r, module.num_embeddings), (module.embedding_dim, r)
            )
        }
    # rows fed by (or feeding) sequence-sharded activations: sequence parallelism
    sequence_parallel = bool(
        getattr(module, "sequence_parallel", False) or getattr(module, "reduce_scatter_embeddings", False)
    )
    adapters = {}
    for leaf, layout in layouts.items():
        a, b = initial_adapter(layout, options.init_seed, kind is LoRAEmbedding)
        adapter = LoRAAdapter(
            layout,
            _local(a, layout.a_split, group, weight),
            _local(b, layout.b_split, group, weight),
            sequence_parallel=sequence_parallel,
        )
        # the factor next to the one that starts at zero has a zero gradient until that one moves
        setattr(adapter.lora_B if kind is LoRAEmbedding else adapter.lora_A, STARTS_WITHOUT_GRADIENT, True)
        adapters[leaf] = adapter
    return adapters, rows


def _lora_targets(model, options: LoRAOptions):
    """``(module, its weight's plan name, HF leaves it adapts)`` for every layer ``options`` adapt."""
    paths: dict[str, list[str]] = {}
    for leaf in options.modules:
        paths.setdefault(LORA_MODULES[leaf], []).append(leaf)
    for i, layer in enumerate(model.decoder.layers):
        for path, leaves in paths.items():
            module = _submodule(layer, path)
            if module is not None:
                yield module, f"decoder.layers.{i}.{path}.weight", leaves
    for path in ("embedding.word_embeddings", "output_layer"):
        if path in paths and _submodule(model, path) is not None:
            yield _submodule(model, path), f"{path}.weight", paths[path]


def _submodule(root: torch.nn.Module, path: str):
    try:
        return root.get_submodule(path)
    except AttributeError:
        return None


def add_lora_adapters(model: torch.nn.Module, options: LoRAOptions) -> int:
    """Freeze every parameter of ``model`` (a Qwen3.5 ``GPTModel``) and give the layers that
    ``options`` adapt their adapters (module docstring); returns the number of adapters."""
    from relax_gdn.model.hf_checkpoint.dims import dims_from_model
    from relax_gdn.model.hf_checkpoint.plan import conversion_plan

    for param in model.parameters():
        param.requires_grad_(False)
    # the layouts need the shapes only: a plan on rows of width 1
    plan = {
        rule.mcore: rule
        for rule in conversion_plan(replace(dims_from_model(model, probe_norms=False), hidden_size=1))
    }
    count = 0
    for module, name, leaves in _lora_targets(model, options):
        kind = next((mixin for base, mixin in _KINDS if isinstance(module, base)), None)
        if kind is None:
            raise ValueError(
                f"model.lora cannot adapt {name.removesuffix('.weight')} ({type(module).__name__}): "
                "adapters go on Megatron-Core's own parallel linears (model.spec_provider=local)"
            )
        adapters, rows = _adapters_for(module, plan[name], leaves, options, kind)
        base_class = type(module)
        module.__class__ = _adapted_class(base_class, kind)
        module._lora_base_class = base_class
        module.lora = torch.nn.ModuleDict(adapters)
        module.lora_scaling, module.lora_dropout = options.scaling, options.dropout
        if rows is not None:
            module.lora_rows_mode = rows[0]
            module.register_buffer("lora_rows", rows[1].to(module.weight.device), persistent=False)
        count += len(adapters)
    return count


def lora_layers(model: torch.nn.Module) -> list[tuple[str, LoRALayer]]:
    """``(name, layer)`` of every adapted layer of ``model``."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, LoRALayer)]


# ---------------------------------------------------------------------------------------------
# the base of a run without a Hugging Face checkpoint
# ---------------------------------------------------------------------------------------------


@torch.no_grad()
def seed_base_weights(model: torch.nn.Module, seed: int) -> list[str]:
    """Give ``model``'s weights the seeded base of a LoRA run without a Hugging Face checkpoint:
    every weight matrix, the GDN convolutions and decay rates drawn from ``seed`` as a pure
    function of each element's place in the whole tensor (so a run resumed at another TP, and
    its export at TP 1, rebuild the same base), with Megatron-Core's scales: uniform of standard
    deviation ``init_method_std`` (its ``/ √(2 · layers)`` for the row-parallel outputs), the
    convolutions PyTorch's uniform bound, ``A_log = log U(1, 16)``, ``dt_bias`` Megatron-Core's
    ones; the norms keep the constants they are built with. Returns the names drawn."""
    from relax_gdn.model.hf_checkpoint.convert import model_tensors, resolve_model_names
    from relax_gdn.model.hf_checkpoint.dims import dims_from_model, unwrap_model
    from relax_gdn.model.hf_checkpoint.plan import conversion_plan

    model = unwrap_model(model)
    config = model.config
    plan = conversion_plan(dims_from_model(model, probe_norms=False))
    tensors = model_tensors(model)
    names = resolve_model_names(plan, tensors)
    std = config.init_method_std
    drawn = []
    for rule in plan:
        target, name = tensors[names[rule.mcore]], names[rule.mcore]
        if name.endswith("dt_bias"):  # Megatron-Core's constant, set here too: a model built without
            target.fill_(1.0)  # initialisation (an export's) has none
            continue
        if name.endswith("A_log"):
            low_high = lambda u: torch.log(1.0 + 15.0 * u)  # noqa: E731
        elif name.endswith("conv1d.weight"):
            bound = 1.0 / math.sqrt(rule.mcore_shape[-1])
            low_high = lambda u, b=bound: (2 * u - 1) * b  # noqa: E731
        elif len(rule.mcore_shape) == 2 and rule.mcore_shape[1] > 1:
            scale = std / math.sqrt(2 * config.num_layers) if rule.tp == ROW else std
            low_high = lambda u, b=scale * math.sqrt(3): (2 * u - 1) * b  # noqa: E731
        else:
            continue
        key = seed * 1_000_003 + zlib.crc32(rule.mcore.encode())
        target.copy_(seeded_values(rule, target, model.pg_collection.tp, key, low_high))
        drawn.append(name)
    return drawn


def lora_scaling(model: torch.nn.Module) -> float | None:
    """The adapters' ``alpha / rank`` (None without adapters)."""
    layers = lora_layers(model)
    return layers[0][1].lora_scaling if layers else None


__all__ = [
    "AdapterLayout",
    "LoRAAdapter",
    "LoRAColumnParallel",
    "LoRAEmbedding",
    "LoRALayer",
    "LoRARowParallel",
    "add_lora_adapters",
    "initial_adapter",
    "lora_layers",
    "lora_scaling",
    "seed_base_weights",
]
