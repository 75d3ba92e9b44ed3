"""Per-GPU memory model of a training run: weights, gradients, optimizer state, activations.

Pure arithmetic on the model's shape and the run's settings (CPU-tested); the training loop logs it
at start and, on CUDA, refuses before building anything a run whose estimate exceeds the GPU.

* weights: bf16 (2 bytes) or fp32 parameters, split over TP;
* gradients: Megatron-Core DDP's fp32 gradient buffer (``grad_reduce_in_fp32``), 4 bytes each;
* optimizer: the distributed optimizer's fp32 main weights and two Adam moments (12 bytes),
  sharded over data parallel x context parallel; none with ``optim.name=none``;
* with LoRA (``ModelShape.lora_rank``) gradients and optimizer state exist for the adapters only
  (:func:`lora_parameter_count`, this rank's share), their weights come on top of the frozen
  base's, and the activations are taken as full fine-tuning's (the adapted linears keep the same
  inputs, the frozen ones keep less; the adapters' rank-wide intermediates are left out);
* activations: what autograd keeps for backward, per local token and layer, by recompute setting
  (:data:`ACTIVATION_BYTES_PER_TOKEN`), plus the loss and a fixed workspace. Under ``mixed``
  recompute the first ``full_layers`` layers keep only their input and the others what selective
  keeps; the peak is the larger of the end of forward (everything kept) and a recomputed layer's
  backward (the inputs of the recomputed layers plus one layer's full activations, the selective
  layers' already freed);
* the loss (``logits``): with the chunked cross-entropy, one chunk's logits and their gradient
  (bf16; the compiled kernel reads the logits once, the eager fallback of a torch whose compiler
  fails holds several fp32 copies more), the output layer's weight gradient (formed in forward,
  held until backward) and per token the final norm's input and output and the gradient of the
  loss's input (also formed in forward); without it, the full logits.

FP8 GEMMs (``fp8``: ``model.fp8.recipe``) keep what bf16 keeps for backward (the linears save their
high-precision inputs; the FP8 operands are transient) and add ``fp8``: the casts of the largest
linear live during its backward (its input and output gradient in FP8 with their transposed copies,
the weight's casts, the weight gradient before it is added into the main grad), and with LoRA the
frozen base weights' casts, kept across steps: two bytes per FP8 weight (both GEMM layouts), or one
under ``tensorwise`` when their bf16 values stay on the GPU (the forward's rows; the input
gradient's transposed copy is made from them for its GEMM). With ``fp8_frozen_on_host``
(``model.fp8.frozen_weights_on_host``) those bf16 values are kept in host memory and leave the
weights' term.

A multi-token-prediction layer (``ModelShape.mtp_num_layers``) adds its parameters (an attention
layer, its MLP, the input fusion ``eh_proj`` and three norms), its activations (an attention
layer's at the recompute setting it runs under, :func:`relax_gdn.model.recompute.mtp_recompute`:
kept whole under ``full``, as with ``recompute.skip_unused``, selective under ``selective`` and
``mixed``; plus its input fusion, :data:`MTP_FUSION_BYTES_PER_TOKEN`) and its pass through the
output layer (the fused loss holds one more output-layer gradient from forward to backward; the
plain one a second set of logits).

:func:`fewest_full_layers` is the memory-aware choice of ``recompute.full_layers``;
:func:`settings_that_fit` lists the recompute settings (and the smaller micro-batch, the
optimizer off, more CP ranks) that fit a given GPU, for the refusal message.

The per-token activation figures are fitted to peaks measured on an H200 with ``bench.train_e2e``
(the full 9B at 8k-128k tokens; docs/benchmarks.md gives each measured peak next to its estimate)
and scaled with the hidden size for other presets; they round up, so the check errs towards
refusing, except where few layers are selective: ``mixed`` at 128k (2 of 32 selective) peaked
3.8 % above its estimate, likely the selective layers' backward on top of everything kept
(docs/benchmarks.md, "Long context"), which :data:`MIXED_HEADROOM` absorbed. The selective
figures come from the memory in use when ``mixed`` runs with 3-20 selective layers ran out of
memory at 32k-128k tokens: a fit at 8k alone had hidden part of the per-token cost of a selective
layer in the fixed terms (docs/benchmarks.md, "Figures behind code comments").
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from relax_gdn.model.fp8.options import ONE_WEIGHT_CAST_RECIPES
from relax_gdn.train.flops import ModelShape

GIB = 2**30

# Bytes kept for backward per local token, per layer, at the 9B widths (hidden 4096), bf16.
# (GDN layer, attention layer): each includes that layer's two norms, its MLP and residuals.
ACTIVATION_BYTES_PER_TOKEN = {
    # fused norms (default)
    ("none", True): (180_000, 170_000),
    ("selective", True): (131_500, 118_500),
    ("full", True): (8_192, 8_192),  # the layer input; one layer's activations live during its recompute
    # the fp32 formula chain of the plain norms keeps several fp32 copies of each norm's input
    ("none", False): (290_000, 260_000),
    ("selective", False): (150_000, 130_000),
    ("full", False): (8_192, 8_192),
}
# the MTP layer's input fusion per local token at hidden 4096, bf16: the embedding, the two norms'
# outputs and eh_proj's [embedding, hidden] input kept for backward (counted, not yet fitted to a
# measured peak)
MTP_FUSION_BYTES_PER_TOKEN = 40_000
WORKSPACE_BYTES = 3 * GIB  # allocator fragmentation, cuBLAS / NCCL workspaces, autotune buffers
# recompute.full_layers=null (mixed) picks the fewest whole-layer recomputes whose estimate fits this
# fraction of the GPU: the estimate counts what torch allocates, and the process also holds the
# allocator's reserved-but-unused blocks and memory outside torch (CUDA context, kernel modules,
# NCCL), which grow with the micro-batch; the rest of the GPU is what they took where mixed ran out
# of memory, and half of it again (docs/benchmarks.md, "Figures behind code comments")
MIXED_HEADROOM = 0.92


@dataclass(frozen=True)
class MemoryEstimate:
    """Per-GPU bytes; ``total`` is what must fit."""

    weights: float
    gradients: float
    optimizer: float
    activations: float
    logits: float
    workspace: float
    fp8: float = 0.0

    @property
    def total(self) -> float:
        return (
            self.weights
            + self.gradients
            + self.optimizer
            + self.activations
            + self.logits
            + self.workspace
            + self.fp8
        )

    def as_gib(self) -> dict[str, float]:
        return {k: round(v / GIB, 2) for k, v in {**asdict(self), "total": self.total}.items()}

    def summary(self) -> str:
        g = self.as_gib()
        return (
            f"weights {g['weights']:.1f} + grads {g['gradients']:.1f} + optimizer {g['optimizer']:.1f} + "
            f"activations {g['activations']:.1f} + logits {g['logits']:.1f} + workspace {g['workspace']:.1f} "
            + (f"+ FP8 casts {g['fp8']:.1f} " if self.fp8 else "")
            + f"= {g['total']:.1f} GiB per GPU"
        )


def parameter_count(shape: ModelShape) -> int:
    """Parameters of the Qwen3.5 hybrid (untied embedding and output layer)."""
    h, ffn = shape.hidden_size, shape.ffn_hidden_size
    q = shape.kv_channels * shape.num_attention_heads
    kv = shape.kv_channels * shape.num_query_groups
    gate = q if shape.attention_output_gate else 0
    qk = shape.linear_key_head_dim * shape.linear_num_key_heads
    v = shape.linear_value_head_dim * shape.linear_num_value_heads
    hv = shape.linear_num_value_heads
    mlp = h * ffn * (3 if shape.swiglu else 2)
    norms = 2 * h
    gdn = (
        h * (2 * qk + 2 * v + 2 * hv)
        + (2 * qk + v) * shape.linear_conv_kernel_dim
        + 2 * hv
        + shape.linear_value_head_dim
        + v * h
    )
    attention = h * (q + gate + 2 * kv) + q * h + 2 * shape.kv_channels
    per_layer = mlp + norms
    mtp = per_layer + attention + 2 * h * h + 3 * h  # an attention layer, eh_proj, its three norms
    return (
        2 * shape.vocab_size * h
        + h
        + shape.num_gdn_layers * (per_layer + gdn)
        + shape.num_attention_layers * (per_layer + attention)
        + shape.mtp_num_layers * mtp
    )


def fp8_linear_shapes(shape: ModelShape) -> list[tuple[int, int, int]]:
    """(in, out, count) of the linear layers an FP8 recipe runs in FP8 by default (the output layer
    and the GDN gates' rows stay in bf16; relax_gdn.model.fp8.options)."""
    h, ffn = shape.hidden_size, shape.ffn_hidden_size
    q = shape.kv_channels * shape.num_attention_heads
    kv = shape.kv_channels * shape.num_query_groups
    gate = q if shape.attention_output_gate else 0
    qk = shape.linear_key_head_dim * shape.linear_num_key_heads
    v = shape.linear_value_head_dim * shape.linear_num_value_heads
    attention = shape.num_attention_layers + shape.mtp_num_layers
    mlp = [
        (h, 2 * ffn, shape.num_layers + shape.mtp_num_layers),
        (ffn, h, shape.num_layers + shape.mtp_num_layers),
    ]
    return [
        (h, 2 * qk + 2 * v, shape.num_gdn_layers),
        (v, h, shape.num_gdn_layers),
        (h, q + gate + 2 * kv, attention),
        (q, h, attention),
        (2 * h, h, shape.mtp_num_layers),
        *mlp,
    ]


def fp8_weight_count(shape: ModelShape, tp: int = 1) -> float:
    """One TP rank's weights in the linear layers an FP8 recipe runs in FP8 (:func:`fp8_linear_shapes`)."""
    return sum(i * o * n for i, o, n in fp8_linear_shapes(shape)) / tp


def _fp8_bytes(shape: ModelShape, tokens: float, tp: int, recipe: str, frozen_on_host: bool) -> float:
    """The FP8 casts' memory (see the module docstring): the largest linear's transient casts, and
    the frozen base weights' kept casts with LoRA."""
    linears = [(i, o) for i, o, n in fp8_linear_shapes(shape) if n]
    widest = max(i + o for i, o in linears) / tp
    largest = max(i * o for i, o in linears) / tp
    transient = tokens * widest * 2 + largest * (
        2 + 2
    )  # operands + transposed copies; weight casts, bf16 wgrad
    if not shape.lora_rank:
        return transient
    # relax_gdn.model.fp8.linear.FP8LinearImpl.kept_layouts
    kept_bytes = 1 if recipe in ONE_WEIGHT_CAST_RECIPES and not frozen_on_host else 2
    return transient + kept_bytes * fp8_weight_count(shape, tp)


def lora_parameter_count(shape: ModelShape, tp: int = 1) -> float:
    """One TP rank's LoRA adapter parameters: a column-parallel layer's ``A [r, in]`` is
    replicated and its ``B [out, r]`` split over TP, a row-parallel layer's (and the embedding's)
    the other way round (relax_gdn.model.lora)."""
    r = shape.lora_rank
    return sum(
        count * r * (inp + out / tp if column else inp / tp + out)
        for inp, out, count, column in shape.lora_adapter_shapes().values()
    )


def _activation_bytes_per_token(
    shape: ModelShape, recompute: str, fused_norms: bool, full_layers: int
) -> float:
    """Peak bytes kept for backward per local token, all layers (see the module docstring)."""

    def kept(granularity: str, layers: range) -> float:
        gdn_bytes, attn_bytes = ACTIVATION_BYTES_PER_TOKEN[(granularity, fused_norms)]
        return sum(attn_bytes if (i + 1) % shape.linear_attention_freq == 0 else gdn_bytes for i in layers)

    layers = shape.num_layers
    if recompute != "mixed":
        full_layers = layers if recompute == "full" else 0
        recompute = "selective" if recompute == "full" else recompute
    full_layers = min(max(full_layers, 0), layers)
    inputs = kept("full", range(full_layers))
    peak = inputs + kept(recompute if recompute != "mixed" else "selective", range(full_layers, layers))
    if full_layers:  # the one layer being recomputed holds its full activations meanwhile
        peak = max(peak, inputs + ACTIVATION_BYTES_PER_TOKEN[("none", fused_norms)][0])
    # the MTP layers live from their forward to their backward, beside everything above
    mtp_granularity = "selective" if recompute in ("selective", "mixed") else "none"
    mtp = ACTIVATION_BYTES_PER_TOKEN[(mtp_granularity, fused_norms)][1] + MTP_FUSION_BYTES_PER_TOKEN
    return (peak + shape.mtp_num_layers * mtp) * shape.hidden_size / 4096


def estimate_memory(
    shape: ModelShape,
    *,
    tokens_per_gpu: int,
    tp: int = 1,
    cp: int = 1,
    dp: int = 1,
    sequence_parallel: bool = False,
    bf16: bool = True,
    recompute: str = "none",
    full_layers: int = 0,
    fused_norms: bool = True,
    fused_cross_entropy: bool = True,
    optimizer: str = "adam",
    fp8: str | None = None,
    fp8_frozen_on_host: bool = False,
) -> MemoryEstimate:
    """The per-GPU memory of one training step (see the module docstring); ``full_layers``: the
    layers recomputed whole under ``recompute="mixed"``; ``fp8``: the FP8 recipe (None: bf16 GEMMs);
    ``fp8_frozen_on_host``: a LoRA run's frozen FP8 weights keep their values in host memory."""
    params = parameter_count(shape) / tp
    trained = lora_parameter_count(shape, tp) if shape.lora_rank else params
    if fp8 and fp8_frozen_on_host and shape.lora_rank:
        params -= fp8_weight_count(shape, tp)
    weights = (params + (trained if shape.lora_rank else 0)) * (2 if bf16 else 4)
    gradients = trained * 4
    optimizer_bytes = 0.0 if optimizer == "none" else trained * 12 / (dp * cp)
    act_tokens = tokens_per_gpu / (tp if sequence_parallel else 1)
    activations = act_tokens * _activation_bytes_per_token(shape, recompute, fused_norms, full_layers)
    logits = _loss_bytes(shape, tokens_per_gpu, tp, act_tokens, 2 if bf16 else 4, fused=fused_cross_entropy)
    fp8_bytes = (
        _fp8_bytes(shape, act_tokens * (tp if sequence_parallel else 1), tp, fp8, fp8_frozen_on_host)
        if fp8
        else 0.0
    )
    return MemoryEstimate(
        weights=weights,
        gradients=gradients,
        optimizer=optimizer_bytes,
        activations=activations,
        logits=logits,
        workspace=WORKSPACE_BYTES,
        fp8=fp8_bytes,
    )


def _loss_bytes(
    shape: ModelShape, tokens_per_gpu: int, tp: int, act_tokens: float, dtype_bytes: int, *, fused: bool
) -> float:
    """What the loss holds at the end of forward (see the module docstring)."""
    vocab, hidden = shape.vocab_size / tp, shape.hidden_size
    final_norm = act_tokens * hidden * dtype_bytes * 2  # its input (kept for backward) and output
    if fused and tp == 1:
        from relax_gdn.model.fusion import cross_entropy_chunk_tokens

        chunk = min(tokens_per_gpu, cross_entropy_chunk_tokens(shape.vocab_size)) * vocab * (2 + 2)
        # the chunked loss forms both gradients in forward: the output layer's and its input's; each
        # MTP layer's loss holds one more of each from its forward to its backward
        held = vocab * hidden * dtype_bytes + tokens_per_gpu * hidden * dtype_bytes
        return chunk + held * (1 + shape.mtp_num_layers) + final_norm
    # bf16 logits and the fp32 softmax kept for backward, the MTP layers' too
    return tokens_per_gpu * vocab * 6 * (1 + shape.mtp_num_layers) + final_norm


def fewest_full_layers(shape: ModelShape, capacity_bytes: float, **settings) -> int | None:
    """The fewest layers recomputed whole (``recompute.granularity=mixed``) whose estimate fits
    :data:`MIXED_HEADROOM` of ``capacity_bytes``; None when not even every layer recomputed does.
    ``settings``: the other keywords of :func:`estimate_memory`."""
    settings = {k: v for k, v in settings.items() if k not in ("recompute", "full_layers")}
    budget = capacity_bytes * MIXED_HEADROOM
    for layers in range(shape.num_layers + 1):
        if estimate_memory(shape, recompute="mixed", full_layers=layers, **settings).total <= budget:
            return layers
    return None


@dataclass(frozen=True)
class Alternative:
    """One change of settings that the memory model says fits: ``overrides`` (config key -> value)
    and its estimate."""

    overrides: dict
    estimate: MemoryEstimate

    def describe(self) -> str:
        keys = " ".join(f"{k}={v}" for k, v in self.overrides.items())
        return f"{keys} ({self.estimate.total / GIB:.1f} GiB)"


def settings_that_fit(shape: ModelShape, capacity_bytes: float, **settings) -> list[Alternative]:
    """What fits ``capacity_bytes`` when the run with ``settings`` (keywords of
    :func:`estimate_memory`) does not: each other recompute setting at the same micro-batch (mixed
    with its fewest full layers), else the largest power-of-two ``train.max_tokens_per_gpu`` with
    full recompute, the optimizer state off (benchmarks) and the smallest CP size that shards the
    optimizer state enough; only those whose estimate fits."""

    def fits(**change) -> MemoryEstimate | None:
        estimate = estimate_memory(shape, **{**settings, **change})
        return estimate if estimate.total <= capacity_bytes else None

    found: list[Alternative] = []
    current = settings.get("recompute", "none")
    for granularity in ("none", "selective", "mixed", "full"):
        if granularity == current and granularity != "mixed":
            continue
        change: dict = {"recompute": granularity}
        if granularity == "mixed":
            layers = fewest_full_layers(shape, capacity_bytes, **settings)
            if layers is None or layers in (0, shape.num_layers):
                continue  # no mixed setting fits, or the one that does is plain selective / full
            change["full_layers"] = layers
        if (estimate := fits(**change)) is not None:
            overrides = {"recompute.granularity": granularity}
            if "full_layers" in change:
                overrides["recompute.full_layers"] = change["full_layers"]
            found.append(Alternative(overrides, estimate))
    if not found:
        tokens = settings["tokens_per_gpu"]
        while tokens > 1024 and fits(tokens_per_gpu=tokens, recompute="full") is None:
            tokens //= 2
        if tokens < settings["tokens_per_gpu"] and (
            estimate := fits(tokens_per_gpu=tokens, recompute="full")
        ):
            found.append(
                Alternative({"train.max_tokens_per_gpu": tokens, "recompute.granularity": "full"}, estimate)
            )
    if settings.get("optimizer", "adam") != "none" and (estimate := fits(optimizer="none")):
        found.append(Alternative({"optim.name": "none"}, estimate))
    cp = settings.get("cp", 1)
    for more in (2 * cp, 4 * cp, 8 * cp):
        if settings.get("optimizer", "adam") != "none" and (estimate := fits(cp=more)):
            found.append(Alternative({"parallel.cp": more}, estimate))
            break
    return found


__all__ = [
    "ACTIVATION_BYTES_PER_TOKEN",
    "GIB",
    "MIXED_HEADROOM",
    "MTP_FUSION_BYTES_PER_TOKEN",
    "Alternative",
    "MemoryEstimate",
    "estimate_memory",
    "fewest_full_layers",
    "fp8_linear_shapes",
    "fp8_weight_count",
    "lora_parameter_count",
    "parameter_count",
    "settings_that_fit",
]
