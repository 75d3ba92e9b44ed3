"""What LoRA adapters a model gets (:class:`LoRAOptions`) and every rule of ``model.lora``, written
once: :func:`lora_problems` is what ``relax_gdn.config.validate`` reports before anything is built
and what :func:`relax_gdn.model.qwen3_5.build_qwen3_5_model` refuses.

Adapters are named by the Hugging Face module they adapt (:data:`LORA_MODULES`: the names of PEFT's
``target_modules``), one adapter per HF module: a Megatron-Core linear that fuses several HF
modules (GDN ``in_proj`` = ``in_proj_qkv`` + ``in_proj_z`` + ``in_proj_b`` + ``in_proj_a``,
attention ``linear_qkv`` = ``q_proj`` (query + gate) + ``k_proj`` + ``v_proj``, MLP
``linear_fc1`` = ``gate_proj`` + ``up_proj``) carries one adapter per part, each adding
``scaling · B·A`` to that part's output rows. A PEFT adapter of the HF model is then the same
function, tensor for tensor (docs/lora.md says why this and not one adapter per fused linear).

Torch-free, so configuration checks import it without Megatron-Core.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

from relax_gdn.choices import LORA_TARGETS

# HF module name -> the Megatron-Core module (path in a decoder layer, or in the model) it adapts;
# the order is the order adapters are listed in, everywhere
LORA_MODULES: dict[str, str] = {
    "in_proj_qkv": "self_attention.in_proj",  # GDN layers
    "in_proj_z": "self_attention.in_proj",
    "in_proj_b": "self_attention.in_proj",
    "in_proj_a": "self_attention.in_proj",
    "out_proj": "self_attention.out_proj",
    "q_proj": "self_attention.linear_qkv",  # attention layers; q_proj holds the query and its gate
    "k_proj": "self_attention.linear_qkv",
    "v_proj": "self_attention.linear_qkv",
    "o_proj": "self_attention.linear_proj",
    "gate_proj": "mlp.linear_fc1",  # every layer
    "up_proj": "mlp.linear_fc1",
    "down_proj": "mlp.linear_fc2",
    "embed_tokens": "embedding.word_embeddings",  # once per model
    "lm_head": "output_layer",
}

_GDN = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")
_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")
# the named groups of model.lora.targets (the Megatron-Core module names and coarser ones)
LORA_GROUPS: dict[str, tuple[str, ...]] = {
    "all_linear": _GDN + _ATTENTION + _MLP,
    "gdn": _GDN,
    "attention": _ATTENTION,
    "mlp": _MLP,
    "gdn_in_proj": _GDN[:4],
    "gdn_out_proj": ("out_proj",),
    "attention_qkv": _ATTENTION[:3],
    "attention_o": ("o_proj",),
    "mlp_fc1": ("gate_proj", "up_proj"),
    "mlp_fc2": ("down_proj",),
    "embedding": ("embed_tokens",),
    "output": ("lm_head",),
}

assert set(LORA_TARGETS) == set(LORA_GROUPS) | set(LORA_MODULES), (
    "relax_gdn.choices.LoRATarget lists these names"
)

# a parameter attribute set where an adapter's parameters are made: the HF checkpoint import and
# export leave them out, the checkpoint of a LoRA run holds only them
LORA_PARAMETER = "is_lora_adapter"
# set on the factor whose gradient is exactly zero while its partner is at its zero start (A next to
# B = 0; the embedding adapter's B next to A = 0): the check for parameters without gradient
# (relax_gdn.train.gradient_check) checks its partner instead
STARTS_WITHOUT_GRADIENT = "starts_without_gradient"


def resolve_targets(targets) -> tuple[str, ...]:
    """The HF module names ``targets`` (names of :data:`LORA_MODULES` and :data:`LORA_GROUPS`) stand
    for, in :data:`LORA_MODULES` order. Unknown names are :func:`lora_problems`' to report."""
    wanted = set()
    for name in targets:
        wanted.update(LORA_GROUPS.get(name, (name,)))
    return tuple(m for m in LORA_MODULES if m in wanted)


@dataclass(frozen=True)
class LoRAOptions:
    """The adapters a model is built with (``model.lora``), fixed for its life.

    Args:
        rank: the adapters' rank r (``model.lora.rank``); 0: no adapters, the whole model trains.
        alpha: the adapters' output is scaled by ``alpha / rank`` (``model.lora.alpha``).
        dropout: dropout on each adapter's input while training (``model.lora.dropout``).
        modules: the HF modules adapted (:func:`resolve_targets` of ``model.lora.targets``).
        init_seed: the seed of the ``A`` matrices' initialisation (``train.seed``): drawn whole and
            cut for each TP rank, so a model at any TP size starts from the same adapters.
    """

    rank: int = 0
    alpha: float = 0.0
    dropout: float = 0.0
    modules: tuple[str, ...] = ()
    init_seed: int = 0

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    def as_dict(self) -> dict:
        return {**asdict(self), "modules": list(self.modules)}


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def lora_problems(
    rank,
    alpha,
    dropout,
    targets,
    *,
    spec_provider: str,
    fused_cross_entropy: bool,
    set_without_rank: Sequence[str] = (),
) -> list[str]:
    """Every rule ``model.lora`` (``rank``, ``alpha``, ``dropout``, ``targets``) breaks, alone or
    with the model settings LoRA depends on (``model.spec_provider``, ``model.fused_cross_entropy``).
    ``set_without_rank``: the other ``model.lora`` keys the configuration sets away from their
    defaults; with rank 0 they would change nothing (the whole model trains), which is refused
    rather than ignored: the user meant LoRA and forgot its rank."""
    if not (isinstance(rank, int) and not isinstance(rank, bool) and rank >= 0):
        return [f"model.lora.rank={rank!r} must be an integer >= 0 (0: no LoRA, the whole model trains)"]
    if rank == 0:
        if not set_without_rank:
            return []
        given = ", ".join(f"model.lora.{key}" for key in set_without_rank)
        return [
            f"{given} set but model.lora.rank is 0 (no LoRA: the whole model would train and {given} "
            "would do nothing): set model.lora.rank (e.g. 16) to train adapters, or leave model.lora.* "
            "out to train the whole model"
        ]
    problems = []
    if alpha is not None and not (_number(alpha) and alpha > 0):
        problems.append(
            f"model.lora.alpha={alpha!r} must be a number > 0 (the adapters are scaled by alpha / rank) "
            "or null (2 x rank)"
        )
    if not (_number(dropout) and 0 <= dropout < 1):
        problems.append(f"model.lora.dropout={dropout!r} must be a number in [0, 1)")
    names = list(targets) if isinstance(targets, (list, tuple)) else None
    unknown = sorted({str(t) for t in names if t not in LORA_TARGETS}) if names is not None else None
    if not names or unknown:
        problems.append(
            f"model.lora.targets={targets!r} must be a non-empty list of {list(LORA_GROUPS)} (groups) "
            f"or Hugging Face module names {list(LORA_MODULES)}"
            + (f"; unknown: {unknown}" if unknown else "")
        )
        return problems
    if spec_provider == "te":
        problems.append(
            "model.lora needs the local layer specs: Transformer Engine's (model.spec_provider=te) fuse "
            "each norm into the next linear, whose normalised input the adapters read; set "
            "model.spec_provider=auto"
        )
    if "lm_head" in resolve_targets(names) and fused_cross_entropy:
        problems.append(
            "model.lora.targets adapts the output layer (lm_head), but the fused cross-entropy "
            "(model.fused_cross_entropy=true) forms the logits from the output layer's weight alone: "
            "set model.fused_cross_entropy=false or leave lm_head / output out of the targets"
        )
    return problems


__all__ = ["LORA_GROUPS", "LORA_MODULES", "LORA_PARAMETER", "LoRAOptions", "lora_problems", "resolve_targets"]
