"""What FP8 a model computes in (:class:`FP8Options`) and every rule of ``model.fp8``, written once:
:func:`fp8_problems` is what ``relax_gdn.config.validate`` reports before anything is built and what
:func:`relax_gdn.model.fp8.install_fp8` refuses.

FP8 here is a compute format of the linear layers' GEMMs, not a storage format: parameters,
gradients, optimizer state and checkpoints stay as they are, so a run can switch it on or off
across a resume. The recipes are torchao's float8 training recipes (``torchao.float8``
``Float8LinearConfig.from_recipe_name``), applied to Megatron-Core's parallel linears:

* ``tensorwise``: one scale per tensor; inputs and weights in e4m3, gradients in e5m2; all three
  GEMMs (output, input gradient, weight gradient) in FP8.
* ``rowwise``: one scale per row of each GEMM operand along its reduction dimension, scales rounded
  down to powers of two, everything in e4m3; all three GEMMs in FP8.
* ``rowwise_gw_hp``: ``rowwise`` with the weight gradient's GEMM in high precision (torchao's
  ``rowwise_with_gw_hp``): the most accurate weight gradients of the three.

Kept in bf16 by default: the output layer (its chunked loss never calls the layer: it is
``model.fused_cross_entropy``'s), the GDN input projection's beta/alpha rows (the gates of the
recurrence: ``bf16_gdn_gates``), the embedding (a lookup, no GEMM), and every linear whose local
weight dimensions are not multiples of 16 (``torch._scaled_mm``'s rule).

Torch-free, so configuration checks import it without Megatron-Core.
"""

from __future__ import annotations

from dataclasses import dataclass

from relax_gdn.choices import FP8_RECIPES, choice_problem

# model.fp8.recipe -> torchao's recipe name (torchao.float8.Float8LinearConfig.from_recipe_name)
TORCHAO_RECIPES: dict[str, str] = {
    "tensorwise": "tensorwise",
    "rowwise": "rowwise",
    "rowwise_gw_hp": "rowwise_with_gw_hp",
}
assert set(TORCHAO_RECIPES) == set(FP8_RECIPES), "relax_gdn.choices.FP8Recipe lists these names"
# The recipes that cast a weight alike for the forward and the input gradient (one scale per tensor):
# a frozen weight whose bf16 values stay on the GPU keeps one FP8 layout, the other a byte copy of it
# (relax_gdn.model.fp8.linear derives this from torchao's config; tests/test_fp8.py holds the two
# together). The memory model reads it here.
ONE_WEIGHT_CAST_RECIPES = frozenset({"tensorwise"})

# FP8 tensor cores: Ada (8.9) and Hopper (9.0) and newer
MIN_CUDA_CAPABILITY = (8, 9)
OUTPUT_LAYER = "output_layer"


@dataclass(frozen=True)
class FP8Options:
    """Which GEMMs of a model run in FP8 and how, fixed when the model is built.

    Args:
        recipe: one of :data:`~relax_gdn.choices.FP8_RECIPES` (see the module docstring).
        bf16_modules: ``fnmatch`` patterns of module names (``output_layer``,
            ``decoder.layers.*.mlp.linear_fc2``, ``mtp.*``) whose GEMMs stay in bf16.
        bf16_gdn_gates: the GDN input projection's beta and alpha output rows (2 x the value heads)
            stay in bf16; its other rows (q, k, v, z) run in FP8.
        frozen_weights_on_host: a frozen weight that runs in FP8 (LoRA's base) keeps its bf16 values
            in host memory from step 1 on; the GPU keeps its FP8 casts (relax_gdn.model.fp8.plan).
    """

    recipe: str
    bf16_modules: tuple[str, ...] = (OUTPUT_LAYER,)
    bf16_gdn_gates: bool = True
    frozen_weights_on_host: bool = True


def fp8_gpu_problem(recipe: str | None, cuda_capability: tuple[int, int] | None) -> str | None:
    """Why a GPU of compute capability ``cuda_capability`` cannot run ``recipe`` (None: it can, or the
    run is on CPU, where the recipe runs as an exact emulation: the same scales and casts, the GEMM
    in fp32)."""
    if recipe is None or cuda_capability is None or tuple(cuda_capability) >= MIN_CUDA_CAPABILITY:
        return None
    major, minor = cuda_capability
    return (
        f"model.fp8.recipe={recipe} needs FP8 tensor cores (compute capability >= 8.9: Ada, Hopper or "
        f"newer); this GPU is {major}.{minor}: set model.fp8.recipe=null"
    )


def fp8_problems(
    recipe: str | None,
    bf16_modules: list[str] | tuple[str, ...],
    *,
    spec_provider: str,
    fused_cross_entropy: bool,
    cuda_capability: tuple[int, int] | None = None,
) -> list[str]:
    """Why ``model.fp8`` cannot run as set (empty when it can; nothing to say without a recipe);
    ``cuda_capability``: the GPU's when known (:func:`fp8_gpu_problem`)."""
    if recipe is None:
        return []
    if problem := choice_problem("model.fp8.recipe", recipe, FP8_RECIPES):
        return [problem + " (or null for bf16 GEMMs)"]
    problems = []
    if spec_provider == "te":
        problems.append(
            "model.fp8.recipe needs the local specs (Megatron-Core's own linears); with "
            "model.spec_provider=te use Transformer Engine's FP8 instead, or model.spec_provider=local"
        )
    if gpu := fp8_gpu_problem(recipe, cuda_capability):
        problems.append(gpu)
    if OUTPUT_LAYER not in bf16_modules and fused_cross_entropy:
        problems.append(
            "model.fp8.bf16_modules leaves out output_layer, but model.fused_cross_entropy=true "
            "computes the output layer inside the chunked loss, never through the layer: add "
            "output_layer back or set model.fused_cross_entropy=false"
        )
    return problems


__all__ = [
    "FP8Options",
    "MIN_CUDA_CAPABILITY",
    "ONE_WEIGHT_CAST_RECIPES",
    "TORCHAO_RECIPES",
    "fp8_gpu_problem",
    "fp8_problems",
]
