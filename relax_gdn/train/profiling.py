"""``logging.profile_steps=[first, last]``: a torch profiler trace per rank over those steps."""

from __future__ import annotations

from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile


class ProfileWindow:
    """A torch profiler trace per rank over steps ``[first, last]``, written to
    ``<trace_dir>/rank<r>_steps<first>-<last>.json`` (layout swaps show up as ``relax_gdn.swap``
    ranges; host ops with their input shapes). A context manager around the steps: a run that ends
    inside the window stops the profiler, writing nothing."""

    def __init__(self, steps: list[int] | None, trace_dir: Path | None, rank: int, device: torch.device):
        self.first, self.last = steps or (0, -1)
        self.trace_dir, self.rank, self.device = trace_dir, rank, device
        self._profiler = None

    def __enter__(self) -> ProfileWindow:
        return self

    def __exit__(self, *exc) -> None:
        if self._profiler is not None:
            self._profiler.__exit__(None, None, None)
            self._profiler = None

    def before_step(self, step: int) -> None:
        if step == self.first and self.trace_dir is not None:  # (CPU: the Runtime quieted kineto)
            activities = [ProfilerActivity.CPU] + (
                [ProfilerActivity.CUDA] if self.device.type == "cuda" else []
            )
            # record_shapes: each host op's input dims / dtypes / strides in the trace, so a long
            # kernel can be traced to the op and shapes that launched it (bench.train_e2e's
            # top_kernels). Host-side metadata only, no device sync; it costs host time in the
            # profiled steps alone (the profiler is off in the others).
            self._profiler = profile(activities=activities, record_shapes=True)
            self._profiler.__enter__()

    def after_step(self, step: int) -> Path | None:
        """The trace written after the window's last step, else None."""
        if self._profiler is None or step != self.last:
            return None
        self._profiler.__exit__(None, None, None)
        self.trace_dir.mkdir(parents=True, exist_ok=True)
        path = self.trace_dir / f"rank{self.rank}_steps{self.first}-{self.last}.json"
        self._profiler.export_chrome_trace(str(path))
        self._profiler = None
        return path
