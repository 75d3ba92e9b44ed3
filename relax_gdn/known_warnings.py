"""Third-party warnings and log lines known to be harmless here, silenced once per process.

Without this, a CPU demo's console is mostly Megatron-Core / Apex / Transformer Engine notices.
:func:`silence_known_warnings` must run in EVERY rank before Megatron-Core, FLA or torch's
extension loader are imported: :class:`relax_gdn.runtime.Runtime` calls it first thing when an
entry point installs it, and undoes it on close; ``logging.show_third_party_warnings=true``
skips it and shows them all.

Each entry names what it silences and why that is harmless for this recipe. Filters match the
start of one message, so any other warning from the same library still shows. This is the one list:
``train.py`` (a run, a resumed run), ``python -m relax_gdn.export_hf`` and every benchmark install
it through their Runtime, ``python -m relax_gdn.compare`` for the time it runs
(:func:`silence_known_warnings`).
"""

from __future__ import annotations

import logging
import os
import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class KnownWarning:
    message: str  # regular expression matched against the START of the message
    why: str  # why silencing it hides nothing a user must act on
    category: type[Warning] = UserWarning
    # regular expression matched against the START of the module that warns (for a SyntaxWarning
    # raised while Python compiles a file: its path without ".py"); empty: any module
    module: str = ""


# ``warnings.warn`` notices.
KNOWN_WARNINGS = (
    KnownWarning(
        r"Transformer Engine and Apex are not installed",
        "Megatron-Core's optimizer/grad-clip/FSDP fall back to torch kernels; the recipe uses "
        "those on purpose where TE/Apex are absent (CPU, images without TE)",
    ),
    KnownWarning(
        r"Apex is not installed\. Falling back to Torch Norm",
        "the local spec uses torch's LayerNorm/RMSNorm, the intended norm without Apex",
    ),
    KnownWarning(
        r"absl\.logging is not installed",
        "Megatron-Core's process-grid helper then logs through the standard logging module",
    ),
    KnownWarning(
        r"Triton is not supported on current platform",
        "FLA on a machine without a GPU; the recipe's CPU path uses its own pure-torch kernels",
    ),
    KnownWarning(
        r"full scope is deprecated\. Use empty cuda_graph_modules",
        "raised by Megatron-Core's own TransformerConfig defaults; CUDA graphs are not used",
    ),
    KnownWarning(
        r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated",
        "torch 2.14 renamed these collectives; Megatron-Core (TP/SP mappings, DDP buffers) and "
        "FLA's CP helpers still call the old names, which do the same thing",
        FutureWarning,
    ),
    KnownWarning(
        r"torch\.distributed is disabled, unavailable or uninitialized, assuming the intent is to "
        r"load in a single process",
        "torch's distributed checkpoint reader in a process without a process group (the export, a "
        "one-process run resuming): reading the whole checkpoint in this process is what it asks "
        "for",
    ),
    KnownWarning(
        r"The argument order of load has been changed",
        "torch's distributed checkpoint notice to callers that pass load's arguments by position, "
        "which Megatron-Core 0.19.2 does; its arguments are the right ones",
    ),
    KnownWarning(
        r"If you are using transformer_engine as the transformer implementation, the core_attn is "
        r"from transformer_engine",
        "Megatron-Core's TransformerConfig says it whenever recompute names core_attn; the recipe's "
        "attention core is its own (relax_gdn.model.attention), never Transformer Engine's fused "
        "one under selective or mixed recompute",
    ),
    KnownWarning(
        r"MimoModelConfig is experimental",
        "printed when Megatron-Core's multimodal package is imported; the recipe does not use MIMO",
    ),
    KnownWarning(
        r"Synchronization debug mode is a prototype feature",
        "torch's note when CUDA sync debug mode is set (logging.count_host_syncs, the benchmarks' "
        "host-sync counts): the recipe counts the syncs it asks about and says where",
    ),
    KnownWarning(
        r"invalid escape sequence",
        "Python compiling Megatron-Core 0.19.2's sources on their first import (a docstring's "
        r"'\-'): a note for Megatron-Core's authors, about text, not behaviour",
        SyntaxWarning,
        module=r".*megatron[/\\]core",
    ),
    KnownWarning(
        r"invalid escape sequence",
        "Python compiling torchao 0.18.0's sources on their first import (a docstring's '\\.' in "
        "quantization/quant_api.py, seen on the GPU host): about text, not behaviour",
        SyntaxWarning,
        module=r".*torchao[/\\]",
    ),
)


@dataclass(frozen=True)
class KnownLogLine:
    logger: str  # the exact logger that emits it (a logger's filters see only its own records)
    message: str  # regular expression matched against the start of the formatted message
    why: str


KNOWN_LOG_LINES = (
    KnownLogLine(
        "torch.utils._pytree",
        r"<enum '(KernelPreference|ScaleCalculationMode)'> is an Enum subclass",
        "torchao 0.18 registers its enums with torch.compile the way older torch needed, once per process "
        "that builds a model with model.fp8; nothing to change on the user's side",
    ),
    KnownLogLine(
        "tilelang.jit.kernel",
        r"TileLang (begins|completes) to compile kernel",
        "TileLang's JIT (FLA's GDN backward on Hopper with triton < 3.7.1) reports each kernel it compiles "
        "on a fresh machine; the compiled kernels are cached",
    ),
    KnownLogLine(
        "torch.utils.cpp_extension",
        r"No CUDA runtime is found",
        "torch's extension loader on a machine without a GPU; no extension is compiled",
    ),
    KnownLogLine(
        "megatron.core.models.gpt.gpt_model",
        r"GPTModel IS DEPRECATED",
        "Qwen3.5 is assembled on GPTModel's blocks with its own GDN/attention specs; "
        "Megatron-Core's HybridModel migration notice does not apply to this recipe",
    ),
    KnownLogLine(
        "megatron.core.dist_checkpointing.strategies.torch",
        r"MCore's async save is deprecated",
        "Megatron-Core 0.19.2 logs it at every save that names its own writer, inline saves "
        "included; its successor (nvidia-resiliency-ext) is not a dependency of this recipe",
    ),
    KnownLogLine(
        "megatron.core.optimizer_param_scheduler",
        r"> learning rate decay style",
        "an info line per run; the schedule is in config.yaml (optim.schedule)",
    ),
    KnownLogLine(
        "megatron.core.optimizer_param_scheduler",
        r" > (using checkpoint value|overriding)",
        "one line per schedule value when a run resumes; the recipe compares the saved schedule "
        "with the run's itself and says what changed (relax_gdn.train.resume.apply_schedule)",
    ),
    KnownLogLine(
        "megatron.core.distributed.fsdp.src.megatron_fsdp.mixed_precision",
        r"Using Megatron-FSDP without Transformer Engine",
        "printed on import; Megatron-FSDP is not used",
    ),
    KnownLogLine(
        "megatron.core.distributed.fsdp.src.megatron_fsdp.param_and_grad_buffer",
        r"Detected Megatron Core, using Megatron-FSDP with Megatron",
        "printed on import; Megatron-FSDP is not used",
    ),
    KnownLogLine(
        "megatron.core.distributed.fsdp.src.megatron_fsdp.megatron_fsdp",
        r"Detected Megatron Core, using Megatron-FSDP with Megatron",
        "printed on import; Megatron-FSDP is not used",
    ),
)


class _DropMessage(logging.Filter):
    def __init__(self, pattern: str):
        super().__init__()
        self.pattern = re.compile(pattern)

    def filter(self, record: logging.LogRecord) -> bool:
        return self.pattern.match(record.getMessage()) is None


def silence_known_warnings() -> Callable[[], None]:
    """Install every filter above; returns the function that removes them again (the warning
    filters as they were, with any added since kept in front; the log filters taken off)."""
    before = list(warnings.filters)
    for known in KNOWN_WARNINGS:
        warnings.filterwarnings("ignore", message=known.message, category=known.category, module=known.module)
    ours = list(warnings.filters)
    log_filters = []
    for known in KNOWN_LOG_LINES:
        drop = _DropMessage(known.message)
        logging.getLogger(known.logger).addFilter(drop)
        log_filters.append((known.logger, drop))

    def restore() -> None:
        added_since = [f for f in warnings.filters if not any(f is o for o in ours)]
        warnings.filters[:] = added_since + before
        warnings._filters_mutated()  # what warnings.catch_warnings calls: cached decisions are stale
        for name, drop in log_filters:
            logging.getLogger(name).removeFilter(drop)

    return restore


# torch.profiler's C++ backend (kineto) prints to stderr by itself, at or above KINETO_LOG_LEVEL
# (0 verbose ... 4 errors, 5 its USDT start/stop markers), read once per process at the first profile.
KINETO_LOG_LEVEL_ENV = "KINETO_LOG_LEVEL"
KINETO_SILENT = "6"  # above every level kineto has


def quiet_cpu_profiler() -> Callable[[], None]:
    """Quiet a process's CPU-only ``torch.profiler`` sessions (what the Runtime does on a machine
    without CUDA, before any profile); returns the function that puts ``KINETO_LOG_LEVEL`` back.
    Kineto's only lines there are its start/stop markers and ``gpuGetDeviceCount failed with code
    35``: a CUDA build of torch asks the driver which GPUs to describe in the trace, and without a
    driver there are none, so the trace loses nothing. A ``KINETO_LOG_LEVEL`` the user set wins."""
    if KINETO_LOG_LEVEL_ENV in os.environ:
        return lambda: None
    os.environ[KINETO_LOG_LEVEL_ENV] = KINETO_SILENT

    def restore() -> None:
        os.environ.pop(KINETO_LOG_LEVEL_ENV, None)

    return restore
