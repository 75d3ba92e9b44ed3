"""Per-step metrics in one place (torchtitan's metrics processor): throughput, TFLOP/s, MFU, memory.

Conventions (docs/design/QWEN3_5.md): ``tokens`` are REAL (non-padding) tokens of the global batch;
``tokens_per_s`` divides them by the step's wall time; ``tflops_per_gpu`` and ``mfu`` use
Megatron-Core's FLOPs accounting (the headline), ``mfu_relax`` the Relax/verl one (embedding
counted as a GEMM). MFU is null where the accelerator's peak is unknown (CPU).
"""

from __future__ import annotations

import time
import warnings
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from relax_gdn.train.flops import ModelShape, peak_tflops, step_flops

REQUIRED_RECORD_FIELDS = ("step", "loss", "grad_norm", "lr", "tokens", "tokens_per_s", "mfu")


@dataclass
class StepRecord:
    """One JSONL line. ``step`` is 1-based (the number of optimizer steps done)."""

    step: int
    loss: float
    grad_norm: float | None  # None: not measured (optim.name=none); NaN / inf: a non-finite step
    lr: float
    tokens: int  # real tokens of the global batch
    tokens_per_s: float
    mfu: float | None  # Megatron-Core accounting / dense BF16 peak
    mfu_relax: float | None
    tflops_per_gpu: float
    step_time_s: float
    loss_tokens: int
    padded_tokens: int  # tokens the model processed, padding included
    num_micro_batches: int  # run by this rank (rank 0's count in the JSONL)
    num_samples: int
    epoch: int
    peak_mem_gb: float | None  # GPU only
    host_syncs: int | None  # in this rank's forward + backward passes (GPU; null on CPU)
    world_size: int  # processes (GPUs) of the run: tokens_per_s / world_size is tok/s/GPU
    extra: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        record = asdict(self)
        extra = record.pop("extra")
        record.update(extra)
        return record


def format_cp_sizes(histogram: dict[str, int]) -> str:
    return ", ".join(f"CP{d} x {n}" for d, n in histogram.items())


SYNC_WARNING = "called a synchronizing CUDA operation"


class HostSyncCounter:
    """Counts host<->device synchronisations inside ``with counter:`` blocks, as torch's sync debug
    mode ("warn") reports them, and where they happened (``file:line`` of the Python caller).

    Off unless ``enabled`` (``logging.count_host_syncs``, on in benchmarks and GPU tests): the
    debug mode is process-wide and costs a check per CUDA call. Inside the block the mode is
    "warn" on CUDA; after it, whatever mode was set before. Every warning raised inside is
    recorded (the sync ones have to be seen); the others are issued again after the block
    through ``warnings.warn_explicit``, so the process's filters decide, once per counter."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.count = 0
        self.locations: Counter[str] = Counter()
        self._shown: set[tuple] = set()
        self._catch = None
        self._mode_before: int | None = None

    def reset(self) -> None:
        self.count = 0
        self.locations.clear()

    def __enter__(self) -> HostSyncCounter:
        if self.enabled:
            self._catch = warnings.catch_warnings(record=True)
            self._caught = self._catch.__enter__()
            warnings.simplefilter("always")
            if torch.cuda.is_available():
                self._mode_before = torch.cuda.get_sync_debug_mode()
                torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc) -> None:
        if not self.enabled:
            return
        if self._mode_before is not None:
            torch.cuda.set_sync_debug_mode(self._mode_before)
            self._mode_before = None
        self._catch.__exit__(*exc)
        for w in self._caught:
            if SYNC_WARNING in str(w.message):
                self.count += 1
                self.locations[f"{w.filename}:{w.lineno}"] += 1
            else:
                key = (w.category, str(w.message), w.filename, w.lineno)
                if key not in self._shown:
                    self._shown.add(key)
                    warnings.warn_explicit(w.message, w.category, w.filename, w.lineno, source=w.source)
        self._caught = None


class StepTimer:
    """Wall time of a step; on CUDA the caller's loss ``.item()`` already waits for the GPU."""

    def __init__(self) -> None:
        self._start = time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self._start


class OptimizerTimer:
    """Time of the optimizer step: CUDA events (read after the step's one host sync, so no sync of
    its own), wall time on CPU."""

    def __init__(self, device: torch.device):
        self._cuda = device.type == "cuda"
        if self._cuda:
            self._start, self._end = (
                torch.cuda.Event(enable_timing=True),
                torch.cuda.Event(enable_timing=True),
            )
            self._start.record()
        else:
            self._t0 = time.perf_counter()

    def stop(self) -> None:
        if self._cuda:
            self._end.record()
        else:
            self._t1 = time.perf_counter()

    def seconds(self) -> float:
        if self._cuda:
            return self._start.elapsed_time(self._end) / 1e3
        return self._t1 - self._t0


class MetricsProcessor:
    """Turns what the loop measured into a :class:`StepRecord`."""

    def __init__(self, shape: ModelShape, world_size: int, device: torch.device):
        self.shape = shape
        self.world_size = world_size
        self.device = device
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else None
        self.peak_tflops = peak_tflops(name)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)

    def record(
        self,
        *,
        step: int,
        loss: float,
        grad_norm: float | None,
        lr: float,
        seq_lengths: list[int],
        loss_tokens: int,
        padded_tokens: int,
        num_micro_batches: int,
        epoch: int,
        step_time_s: float,
        host_syncs: int | None = None,
    ) -> StepRecord:
        tokens = int(sum(seq_lengths))
        flops, flops_relax = step_flops(self.shape, seq_lengths)
        seconds = max(step_time_s, 1e-9)
        tflops_per_gpu = flops / seconds / self.world_size / 1e12
        tflops_relax = flops_relax / seconds / self.world_size / 1e12
        peak_mem = None
        if self.device.type == "cuda":
            peak_mem = torch.cuda.max_memory_allocated(self.device) / 2**30
        mfu = tflops_per_gpu / self.peak_tflops if self.peak_tflops else None
        mfu_relax = tflops_relax / self.peak_tflops if self.peak_tflops else None
        return StepRecord(
            step=step,
            loss=loss,
            grad_norm=grad_norm,  # a non-finite norm stays: the step is marked by it
            lr=lr,
            tokens=tokens,
            tokens_per_s=tokens / seconds,
            mfu=mfu,
            mfu_relax=mfu_relax,
            tflops_per_gpu=tflops_per_gpu,
            step_time_s=step_time_s,
            loss_tokens=loss_tokens,
            padded_tokens=padded_tokens,
            num_micro_batches=num_micro_batches,
            num_samples=len(seq_lengths),
            epoch=epoch,
            peak_mem_gb=peak_mem,
            host_syncs=host_syncs,
            world_size=self.world_size,
        )
