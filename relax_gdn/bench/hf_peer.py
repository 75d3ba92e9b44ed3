"""The peer side of ``relax_gdn.bench.peers``: Hugging Face transformers' ``Qwen3_5ForCausalLM``
trained as LLaMA-Factory, ms-swift and axolotl train it, one document per forward.

* the model: ``from_pretrained`` of the benchmark's checkpoint (bf16 on CUDA, fp32 on CPU), SDPA
  attention, transformers' GDN path as installed (FLA's kernels on CUDA where ``fla`` imports,
  its pure-torch functions on CPU), ``peft`` LoRA adapters for the LoRA workload, and the settings
  of :class:`HFSettings` (activation checkpointing, Liger's kernels, torchao float8 with
  ``torch.compile`` per decoder block);
* one step: every document of the global batch forward + backward on its own (batch 1, no
  padding) with ``num_items_in_batch`` = the global batch's loss tokens, so the loss is the mean
  per loss token of the whole batch, reduced as relax-gdn reduces it; then the gradient norm
  clipped as HF's Trainer does, and fused AdamW (HF's default optimizer) when the workload has
  an optimizer;
* the records: :class:`relax_gdn.train.metrics.MetricsProcessor`'s, the FLOPs of
  ``relax_gdn.train.flops`` for both sides.

LoRA adapters start as relax-gdn's (:func:`relax_gdn.model.lora.initial_adapter`: PEFT's
initialisation drawn from the run's seed and the module's name), so the first step's gradients
of the two sides can be compared.
"""

from __future__ import annotations

import importlib.util
import json
import math
import re
import shutil
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from relax_gdn.train.gpu_memory import release_gpu_memory

# written last into a random-init checkpoint directory: what it was made from
INIT_MARKER = "relax_gdn_peers_init.json"
# HF's initialisation sets these to constants or fixed patterns: seeded noise of this size makes
# every one of them change the loss, so a tensor the import maps wrongly cannot go unnoticed
INIT_NOISE = 0.3
NOISY_TENSORS = ("norm", "A_log", "dt_bias")
FP8_RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
LIGER_FIX = "install the `peers` extra (pip install -e '.[peers]': liger-kernel 0.8.5)"


# ---------------------------------------------------------------------------------------------
# the checkpoint both sides start from
# ---------------------------------------------------------------------------------------------


def init_marker(preset: str, seed: int, dtype: torch.dtype) -> dict:
    return {"preset": preset, "seed": seed, "dtype": str(dtype).removeprefix("torch.")}


def existing_init_problem(directory: Path, marker: dict) -> str | None:
    """Why ``directory`` cannot be the random-init checkpoint of ``marker`` (None: it is, or it is
    absent and will be written)."""
    if not directory.exists():
        return None
    made = directory / INIT_MARKER
    if not made.is_file():
        return (
            f"--init-dir {directory} exists and is not a checkpoint this benchmark wrote: pass it as "
            "--hf-checkpoint to start from it, or name another --init-dir"
        )
    found = json.loads(made.read_text())
    if found != marker:
        return (
            f"--init-dir {directory} holds the random-init checkpoint of {found}, not {marker}: name another "
            "--init-dir (or delete that one)"
        )
    return None


def write_random_checkpoint(
    directory: Path, preset: str, seed: int, dtype: torch.dtype, device: torch.device
) -> Path:
    """A random ``Qwen3_5ForCausalLM`` of ``preset``'s sizes (HF's initialisation, the norms, ``A_log``
    and ``dt_bias`` moved by seeded noise) saved by transformers into ``directory``, unless a
    previous run wrote it there already. Written into ``<directory>.partial`` first and renamed when
    complete: a run killed while writing leaves no directory that a later run would take."""
    marker = init_marker(preset, seed, dtype)
    if (directory / INIT_MARKER).is_file():
        return directory
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    from relax_gdn.model import qwen3_5_preset
    from relax_gdn.model.hf_checkpoint import hf_text_config, preset_dims

    config = Qwen3_5TextConfig(**hf_text_config(preset_dims(preset, qwen3_5_preset(preset).vocab_size)))
    torch.manual_seed(seed)
    with torch.device(device):  # on the GPU where there is one: the 9B initialises in seconds there
        model = Qwen3_5ForCausalLM._from_config(config, dtype=dtype)
    noise = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if any(part in name for part in NOISY_TENSORS):
                param.add_((INIT_NOISE * torch.randn(param.shape, generator=noise)).to(param))
    partial = directory.with_name(directory.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)  # a write of an earlier run that never finished
    model.save_pretrained(partial)
    (partial / INIT_MARKER).write_text(json.dumps(marker))
    del model
    release_gpu_memory(device)
    partial.rename(directory)
    return directory


# ---------------------------------------------------------------------------------------------
# settings of an HF row
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class HFSettings:
    """How an HF row trains (the words after ``hf`` in a row: ``hf,ckpt,liger``).

    Args:
        checkpointing: ``ckpt``: transformers' activation checkpointing of every decoder layer
            (``activation_checkpointing_enable``, non-reentrant).
        liger: ``liger``: Liger's kernels as ``apply_liger_kernel_to_qwen3_5`` sets them by default
            (RMSNorm, SwiGLU, the fused linear cross-entropy): what the Liger switch of the
            transformers-based recipes applies.
        fp8: ``fp8`` / ``fp8=<recipe>``: torchao's float8 training of every decoder linear (not the
            output layer) with that recipe (``tensorwise`` when none is named); implies ``compile``.
        compile: ``compile``: ``torch.compile`` of each decoder block.
        attention: ``attn=<implementation>``: transformers' ``attn_implementation`` (``sdpa``).
    """

    checkpointing: bool = False
    liger: bool = False
    fp8: str | None = None
    compile: bool = False
    attention: str = "sdpa"

    def as_dict(self) -> dict:
        return {
            "checkpointing": self.checkpointing,
            "liger": self.liger,
            "fp8": self.fp8,
            "compile": self.compile or self.fp8 is not None,
            "attention": self.attention,
        }


def parse_hf_settings(words: list[str]) -> HFSettings:
    """:class:`HFSettings` of a row's words after ``hf``; ``ValueError`` naming a word it does not know."""
    found: dict = {}
    for word in words:
        key, eq, value = word.partition("=")
        if word in ("ckpt", "liger", "compile"):
            found[{"ckpt": "checkpointing"}.get(word, word)] = True
        elif key == "fp8" and (not eq or value in FP8_RECIPES):
            found["fp8"] = value if eq else "tensorwise"
        elif key == "attn" and eq and value:
            found["attention"] = value
        else:
            raise ValueError(
                f"HF row setting {word!r}: want ckpt, liger, compile, fp8, fp8=<{'|'.join(FP8_RECIPES)}> "
                "or attn=<transformers attn_implementation>"
            )
    return HFSettings(**found)


def cannot_run(settings: HFSettings, device: torch.device) -> str | None:
    """Why a row of ``settings`` cannot run here (a package missing, no GPU for its kernels), or None."""
    if settings.liger:
        if importlib.util.find_spec("liger_kernel") is None:
            return f"liger-kernel is not installed: {LIGER_FIX}"
        import liger_kernel.transformers as liger

        if not hasattr(liger, "apply_liger_kernel_to_qwen3_5"):
            return f"this liger-kernel has no Qwen3.5 support (apply_liger_kernel_to_qwen3_5): {LIGER_FIX}"
        if device.type != "cuda":
            return "liger-kernel's kernels are Triton GPU kernels: it runs on CUDA only"
    if settings.fp8 is not None:
        if importlib.util.find_spec("torchao") is None:
            return "torchao is not installed (torchao==0.18.0)"
        if device.type != "cuda" or torch.cuda.get_device_capability(device) < (8, 9):
            return (
                "torchao's float8 training needs a CUDA GPU of compute capability 8.9 or above (float8 GEMMs)"
            )
    if (settings.compile or settings.fp8 is not None) and device.type != "cuda":
        return "torch.compile of the decoder blocks: on CPU the Runtime turns TorchDynamo off (a GPU row)"
    return None


# ---------------------------------------------------------------------------------------------
# the model
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class HFModel:
    """A model of an HF row, ready to train: what runs forward, and what trains."""

    module: torch.nn.Module
    trainable: list[torch.nn.Parameter] = field(repr=False)


def _restoring(module, change: Callable[[], None]) -> None:
    """Run ``change`` and put back every module-level name of ``module`` it rebound or added:
    Liger's ``apply_*`` functions replace transformers' classes for every model built later, while
    the model at hand is patched instance by instance."""
    before = dict(vars(module))
    try:
        change()
    finally:
        for name in [n for n in vars(module) if n not in before]:
            delattr(module, name)
        for name, value in before.items():
            if vars(module).get(name) is not value:
                setattr(module, name, value)


def apply_liger(model: torch.nn.Module) -> None:
    """Liger's kernels on ``model`` (``apply_liger_kernel_to_qwen3_5``'s defaults), leaving the
    classes of ``transformers.models.qwen3_5`` as they were."""
    import transformers.models.qwen3_5.modeling_qwen3_5 as modeling
    from liger_kernel.transformers import apply_liger_kernel_to_qwen3_5

    _restoring(modeling, lambda: apply_liger_kernel_to_qwen3_5(model=model))


def _to_float8(text_model: torch.nn.Module, recipe: str) -> None:
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    def float8_shaped(module: torch.nn.Module, fqn: str) -> bool:  # float8 GEMMs take multiples of 16
        return module.in_features % 16 == 0 and module.out_features % 16 == 0

    convert_to_float8_training(
        text_model, config=Float8LinearConfig.from_recipe_name(recipe), module_filter_fn=float8_shaped
    )


def _with_lora(model: torch.nn.Module, lora) -> torch.nn.Module:
    """``model`` with PEFT adapters of ``lora`` (a :class:`~relax_gdn.model.lora_options.LoRAOptions`),
    each ``A`` relax-gdn's initial one for the same module (``B`` starts at zero on both sides)."""
    from peft import LoraConfig, get_peft_model

    from relax_gdn.model.lora import AdapterLayout, initial_adapter

    config = LoraConfig(
        r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=list(lora.modules)
    )
    with warnings.catch_warnings():  # peft 0.21.2 reads transformers 5's deprecated name for the same flag
        warnings.filterwarnings(
            "ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning
        )
        wrapped = get_peft_model(model, config)
    with torch.no_grad():
        for name, module in wrapped.named_modules():
            adapter = getattr(module, "lora_A", None)
            if not isinstance(adapter, torch.nn.ModuleDict) or "default" not in adapter:
                continue
            weight = adapter["default"].weight
            hf_module = name.removeprefix("base_model.model.")
            a, _ = initial_adapter(
                AdapterLayout(hf_module, None, None, tuple(weight.shape), (0, 0)),
                lora.init_seed,
                embedding=False,
            )
            weight.copy_(a)
    return wrapped


def build_hf_model(
    checkpoint: Path, settings: HFSettings, lora, device: torch.device, dtype: torch.dtype
) -> HFModel:
    """The model of an HF row: the checkpoint in ``dtype`` on ``device`` with ``settings``, and PEFT
    adapters when ``lora`` (LoRAOptions) is given."""
    from transformers import Qwen3_5ForCausalLM

    model = Qwen3_5ForCausalLM.from_pretrained(
        checkpoint, dtype=dtype, attn_implementation=settings.attention, device_map={"": device}
    )
    if settings.liger:
        apply_liger(model)
    if settings.fp8 is not None:
        _to_float8(model.model, settings.fp8)
    if settings.checkpointing:
        model.activation_checkpointing_enable()
    decoder_layers = model.model.layers
    if lora is not None:
        model = _with_lora(model, lora)
    if settings.compile or settings.fp8 is not None:
        for layer in decoder_layers:
            layer.compile()
    model.train()
    return HFModel(model, [p for p in model.parameters() if p.requires_grad])


# ---------------------------------------------------------------------------------------------
# one step
# ---------------------------------------------------------------------------------------------


def hf_inputs(sample, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, labels)`` of one document, batch 1: a label counts where the sample's loss mask
    says the prediction of that token counts (``loss_mask[i]`` is position ``i``'s next-token label,
    and transformers shifts the labels by one), ``-100`` elsewhere."""
    ids = torch.tensor([sample.input_ids], dtype=torch.long)
    labels = torch.full_like(ids, -100)
    counted = torch.tensor(sample.loss_mask[:-1], dtype=torch.bool)
    labels[0, 1:][counted] = ids[0, 1:][counted]
    return ids.to(device, non_blocking=True), labels.to(device, non_blocking=True)


NORM_CHUNK = 2**26  # elements upcast at a time: 256 MiB of fp32, not a copy of the 9B's embedding gradient


def fp32_grad_norm(params: list[torch.nn.Parameter]) -> float:
    """The gradients' global 2-norm from fp32 values (the agreement check's; HF's clipping forms
    its own norm in the gradients' dtype), upcast a chunk at a time."""
    total = 0.0
    for param in params:
        if param.grad is not None:
            for chunk in param.grad.detach().reshape(-1).split(NORM_CHUNK):
                values = chunk.float()
                total += torch.dot(values, values).item()
    return math.sqrt(total)


@dataclass(frozen=True)
class StepResult:
    loss: float  # mean per loss token of the global batch
    grad_norm: float | None  # before clipping, in fp32 (measured at the first step, or with an optimizer)
    seconds: float


def hf_step(
    model: HFModel,
    docs: list,
    *,
    loss_tokens: int,
    optimizer,
    clip_grad: float,
    device: torch.device,
    measure_norm: bool,
) -> StepResult:
    """One optimizer step of ``model`` over ``docs`` (see the module docstring). ``measure_norm``:
    also the fp32 gradient norm of the agreement check, before the timed clock stops (untimed
    steps only)."""
    start = time.perf_counter()
    loss_sum = torch.zeros((), dtype=torch.float32, device=device)
    for sample in docs:
        ids, labels = hf_inputs(sample, device)
        out = model.module(input_ids=ids, labels=labels, num_items_in_batch=loss_tokens, use_cache=False)
        out.loss.backward()
        loss_sum += out.loss.detach().float()
    norm = fp32_grad_norm(model.trainable) if measure_norm else None
    if optimizer is not None:
        clipped = torch.nn.utils.clip_grad_norm_(model.trainable, clip_grad) if clip_grad > 0 else None
        optimizer.step()
        if norm is None and clipped is not None:
            norm = float(clipped)
    for param in model.trainable:
        param.grad = None
    loss = loss_sum.item()  # the step's one host read: the GPU has finished
    return StepResult(loss, norm, time.perf_counter() - start)


def adamw(model: HFModel, optim, device: torch.device) -> torch.optim.Optimizer:
    """HF Trainer's default optimizer (``adamw_torch_fused``) with relax-gdn's hyper-parameters
    (``optim.*``) at the peak learning rate."""
    return torch.optim.AdamW(
        model.trainable,
        lr=optim.lr,
        betas=(optim.beta1, optim.beta2),
        eps=optim.eps,
        weight_decay=optim.weight_decay,
        fused=device.type == "cuda",
    )


_SIZE = r"([\d.]+ [KMGT]?i?B)"


def out_of_memory(message: str) -> dict | None:
    """``{"asked", "in_use", "capacity"}`` (as torch printed them, None where absent) when ``message``
    is a CUDA out-of-memory error's; None otherwise."""
    if "out of memory" not in message.lower():
        return None

    def find(pattern: str) -> str | None:
        match = re.search(pattern, message)
        return match.group(1) if match else None

    return {
        "asked": find(rf"Tried to allocate {_SIZE}"),
        "in_use": find(rf"this process has {_SIZE} memory in use"),
        "capacity": find(rf"total capacity of {_SIZE}"),
    }


# ---------------------------------------------------------------------------------------------
# a row
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Batches:
    """The run's documents and the global batch of each step, as the relax-gdn run draws them."""

    samples: list = field(repr=False)
    docs_per_step: int
    seed: int

    def at(self, step: int) -> list:
        """The documents of step ``step`` (1-based)."""
        from relax_gdn.data import global_batch_at_step

        return global_batch_at_step(self.samples, self.docs_per_step, self.seed, step - 1)[1]

    def dataset(self):
        from relax_gdn.data import SFTDataset, SkipCounts

        counts = SkipCounts(total=len(self.samples), kept=len(self.samples))
        return SFTDataset(samples=self.samples, source="bench.peers", counts=counts)


def _memory_at_start(device: torch.device) -> float | None:
    """GiB still allocated as a row starts (after a collection): what earlier rows left behind."""
    release_gpu_memory(device)
    return round(torch.cuda.memory_allocated(device) / 2**30, 3) if device.type == "cuda" else None


def _train(
    model_of: Callable[[], HFModel],
    batches: Batches,
    *,
    steps: int,
    optimizer: str,
    optim,
    shape,
    device: torch.device,
    records: list,
) -> None:
    """Build the model and run ``steps`` steps, appending each step's record to ``records`` (kept
    when a later step fails)."""
    from relax_gdn.train.metrics import MetricsProcessor

    model = model_of()
    update = adamw(model, optim, device) if optimizer == "adam" else None
    metrics = MetricsProcessor(shape, 1, device)  # the peak from here: weights, optimizer state, steps
    for step in range(1, steps + 1):
        docs = batches.at(step)
        loss_tokens = sum(s.num_loss_tokens for s in docs)
        result = hf_step(
            model,
            docs,
            loss_tokens=loss_tokens,
            optimizer=update,
            clip_grad=optim.clip_grad,
            device=device,
            measure_norm=step == 1,
        )
        lengths = [len(s) for s in docs]
        records.append(
            metrics.record(
                step=step,
                loss=result.loss,
                grad_norm=result.grad_norm,
                lr=optim.lr,
                seq_lengths=lengths,
                loss_tokens=loss_tokens,
                padded_tokens=sum(lengths),
                num_micro_batches=len(docs),
                epoch=0,
                step_time_s=result.seconds,
            ).as_dict()
        )


def run_hf_row(
    name: str,
    settings: HFSettings,
    *,
    checkpoint: Path,
    lora,
    batches: Batches,
    steps: int,
    skip: int,
    optimizer: str,
    optim,
    shape,
    device: torch.device,
    dtype: torch.dtype,
) -> dict:
    """One HF row: ``steps`` steps, summarised as ``bench.train_e2e`` summarises a variant. A row
    that cannot run here, runs out of memory or fails keeps what it ran and says why in its summary."""
    from relax_gdn.bench.train_e2e import summarize

    entry = {
        "name": name,
        "side": "hf",
        "settings": settings.as_dict(),
        "optimizer": optimizer,
        "records": [],
    }
    why = cannot_run(settings, device)
    if why is not None:
        return entry | {"summary": {"cannot_run": why}}
    entry["memory_at_start_gib"] = _memory_at_start(device)
    records: list[dict] = entry["records"]
    failure = None
    try:
        _train(
            lambda: build_hf_model(checkpoint, settings, lora, device, dtype),
            batches,
            steps=steps,
            optimizer=optimizer,
            optim=optim,
            shape=shape,
            device=device,
            records=records,
        )
    except Exception as e:  # noqa: BLE001 - one row failing (out of memory, a kernel's error) must not end the rest
        failure = f"{type(e).__name__}: {e}"[:2000]
    if settings.compile or settings.fp8 is not None:
        torch._dynamo.reset()  # the compiled blocks' caches hold on to this row's model
    release_gpu_memory(device)
    if failure is None:
        return entry | {"summary": summarize(records, skip, 1)}
    summary = {"error": failure, "steps_done": len(records)}
    oom = out_of_memory(failure)
    if oom is not None:
        summary["oom"] = oom | {"step": len(records) + 1}
    if records:  # what it ran before failing (the step it got to included nothing)
        summary |= {
            "step_tokens_per_s": [r["tokens_per_s"] for r in records],
            "peak_mem_gib": max(r["peak_mem_gb"] or 0.0 for r in records) if device.type == "cuda" else None,
        }
    return entry | {"summary": summary}
