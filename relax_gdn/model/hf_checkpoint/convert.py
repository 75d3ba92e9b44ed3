"""Plain state-dict conversion: full (TP = 1) tensors in, full tensors out, no process group and
no files; plus the checkpoint-key and model-name lookups the file side shares."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import replace

import torch

from relax_gdn.errors import RecipeError
from relax_gdn.model.hf_checkpoint.dims import Qwen3_5Dims
from relax_gdn.model.hf_checkpoint.plan import TensorRule, conversion_plan
from relax_gdn.model.lora_options import LORA_PARAMETER

VLM_TEXT_PREFIX = "model.language_model."
TEXT_PREFIX = "model."
VISION_PREFIXES = ("model.visual.", "visual.")
MTP_PREFIXES = ("mtp.", "model.mtp.")
# Weights of the VLM checkpoint that text SFT without MTP does not use (vision tower, multi-token
# prediction): the import skips them, a drop-in export copies them from the source
# (``drop_in.tensor_origins``). A model with an MTP layer has a place for ``mtp.*``
# (:func:`ignored_prefixes`; the conversion plan maps them).
IGNORED_PREFIXES = VISION_PREFIXES + MTP_PREFIXES


def ignored_prefixes(dims: Qwen3_5Dims) -> tuple[str, ...]:
    """The checkpoint prefixes a model of ``dims`` has no place for: the vision tower, and the MTP
    layer unless the model has one."""
    return VISION_PREFIXES if dims.mtp_num_layers else IGNORED_PREFIXES


class CheckpointMismatchError(RecipeError, ValueError):
    """A checkpoint tensor is missing, mis-shaped or unknown; the message names it."""

    same_on_every_rank = True  # every rank reads the same files


def text_layout_name(name: str) -> str:
    """A checkpoint key in the text layout (VLM ``model.language_model.x`` -> ``model.x``)."""
    if name.startswith(VLM_TEXT_PREFIX):
        return TEXT_PREFIX + name[len(VLM_TEXT_PREFIX) :]
    return name


def hf_text_name(name: str, ignored: tuple[str, ...] = IGNORED_PREFIXES) -> str | None:
    """The text-layout name of a checkpoint key (VLM ``model.language_model.x`` -> ``model.x``),
    or None for weights the model ignores (``ignored``: by default the vision tower and MTP)."""
    if name.startswith(ignored):
        return None
    return text_layout_name(name)


def hf_to_mcore_state_dict(
    hf_state: Mapping[str, torch.Tensor], dims: Qwen3_5Dims
) -> dict[str, torch.Tensor]:
    """Full Megatron-Core state dict from an HF Qwen3.5 state dict (text or VLM layout).

    Vision weights are ignored, and MTP weights unless ``dims`` has MTP layers; a missing,
    mis-shaped or unknown text tensor raises :class:`CheckpointMismatchError` naming it.
    """
    text = TextKeys(hf_state.keys(), ignored_prefixes(dims))
    out = {rule.mcore: merge_rule(rule, lambda n: hf_state[text.lookup(n)]) for rule in conversion_plan(dims)}
    text.check_all_used()
    return out


def mcore_to_hf_state_dict(
    mcore_state: Mapping[str, torch.Tensor], dims: Qwen3_5Dims
) -> dict[str, torch.Tensor]:
    """HF text-layout state dict (``Qwen3_5ForCausalLM``) from a full Megatron-Core state dict."""
    plan = conversion_plan(replace(dims, lm_head_from_embedding=False))  # export always writes lm_head
    known = {rule.mcore for rule in plan}
    extra = sorted(k for k in mcore_state if k not in known and not k.endswith("_extra_state"))
    if extra:
        raise CheckpointMismatchError(f"model tensor(s) with no HF counterpart: {extra[:5]}")
    out: dict[str, torch.Tensor] = {}
    for rule in plan:
        if rule.mcore not in mcore_state:
            raise CheckpointMismatchError(f"model state dict lacks {rule.mcore!r}")
        out.update(split_rule(rule, mcore_state[rule.mcore]))
    return out


class TextKeys:
    """Checkpoint keys seen through :func:`hf_text_name` (``ignored``: the prefixes left out);
    remembers which were used."""

    def __init__(self, keys, ignored: tuple[str, ...] = IGNORED_PREFIXES):
        self.by_text: dict[str, str] = {}
        for key in keys:
            text = hf_text_name(key, ignored)
            if text is None:
                continue
            if text in self.by_text:
                raise CheckpointMismatchError(
                    f"checkpoint holds {text!r} twice (as {self.by_text[text]!r} and {key!r}): "
                    "mixed VLM and text layouts"
                )
            self.by_text[text] = key
        self.used: set[str] = set()

    def lookup(self, text_name: str) -> str:
        key = self.by_text.get(text_name)
        if key is None:
            vlm = (
                f" (or {VLM_TEXT_PREFIX + text_name[len(TEXT_PREFIX) :]!r} in the VLM layout)"
                if text_name.startswith(TEXT_PREFIX)
                else ""
            )
            raise CheckpointMismatchError(
                f"checkpoint lacks tensor {text_name!r}{vlm}; is it a Qwen3.5 checkpoint with the model's "
                "number of layers and layer types?"
            )
        self.used.add(text_name)
        return key

    def check_all_used(self) -> None:
        left = sorted(set(self.by_text) - self.used)
        if left:
            raise CheckpointMismatchError(
                f"checkpoint has {len(left)} text tensor(s) the model has no place for, e.g. "
                f"{[self.by_text[n] for n in left[:5]]}; the model is smaller than the checkpoint "
                "(layers, tied embeddings) or the checkpoint is not Qwen3.5"
            )


_HF_FIX = (
    "the checkpoint does not match the model's dimensions (compare its config.json with the model config)"
)


def merge_rule(rule: TensorRule, fetch: Callable[[str], torch.Tensor]) -> torch.Tensor:
    """``rule``'s full Megatron-Core tensor from its HF tensors (``fetch(name)``, shapes checked)."""
    tensors = []
    for name, shape in zip(rule.hf, rule.hf_shapes):
        tensor = fetch(name)
        check_shape("checkpoint", name, tensor, shape, _HF_FIX)
        tensors.append(tensor)
    return rule.merge(tensors)


def split_rule(rule: TensorRule, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    """``rule``'s HF tensors from its full Megatron-Core tensor (shape checked)."""
    check_shape(
        "model", rule.mcore, tensor, rule.mcore_shape, "the model does not match the dimensions given"
    )
    return {name: t.contiguous() for name, t in zip(rule.hf, rule.split(tensor))}


def check_shape(what: str, name: str, tensor: torch.Tensor, expected: tuple[int, ...], fix: str) -> None:
    if tuple(tensor.shape) != tuple(expected):
        raise CheckpointMismatchError(
            f"{what} tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(expected)}; {fix}"
        )


# Transformer Engine fuses the pre-attention / pre-MLP norms into the next linear
# (``layer_norm_weight``); the local spec keeps separate norm modules. Same tensor either way.
_FUSED_NORM_ALIASES = (
    (
        re.compile(r"^(decoder\.layers\.\d+\.)input_layernorm\.weight$"),
        (r"\1self_attention.linear_qkv.layer_norm_weight", r"\1self_attention.in_proj.layer_norm_weight"),
    ),
    (
        re.compile(r"^(decoder\.layers\.\d+\.)pre_mlp_layernorm\.weight$"),
        (r"\1mlp.linear_fc1.layer_norm_weight",),
    ),
)


def model_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's state-dict tensors as the live parameters (``keep_vars``), no ``_extra_state``
    and no LoRA adapter (an HF checkpoint holds the base model; the adapters have their own export)."""
    return {
        k: v
        for k, v in model.state_dict(keep_vars=True).items()
        if not k.endswith("_extra_state") and not getattr(v, LORA_PARAMETER, False)
    }


def resolve_model_names(plan: list[TensorRule], tensors: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """Plan name -> the model's name for it; errors on model tensors the plan does not cover."""
    resolved = {}
    for rule in plan:
        name = rule.mcore
        if name not in tensors:
            for pattern, aliases in _FUSED_NORM_ALIASES:
                if pattern.match(name):
                    name = next((a for a in (pattern.sub(x, name) for x in aliases) if a in tensors), name)
        if name not in tensors:
            raise CheckpointMismatchError(
                f"model has no tensor {rule.mcore!r} (from {rule.hf[0]!r}); the model's layer pattern "
                "or modules differ from the Qwen3.5 layout this mapping knows"
            )
        resolved[rule.mcore] = name
    unknown = sorted(set(tensors) - set(resolved.values()))
    if unknown:
        raise CheckpointMismatchError(
            f"model tensor(s) with no HF checkpoint source: {unknown[:5]}; extend conversion_plan"
        )
    return resolved
