"""``python tests/train_with_faults.py <train.py overrides>`` (also under torchrun): train.py itself,
with the faults named in ``RELAX_GDN_TEST_FAULTS`` (comma separated) put in first. The faults are
this file's: nothing of the kind lives in the package.

* ``stuck:<rank>:<step>``: that rank blocks in a receive nobody sends, at the start of that step
  (a peer stuck in a collective)
* ``pause_save:<step>:<dir>``: while writing that step's checkpoint, each rank creates
  ``<dir>/saving.rank<r>`` and waits for ``<dir>/go``
* ``save_error:<step>:<kind>``: writing that step's checkpoint raises ``erofs`` (OSError, a
  read-only file system) or ``bug`` (ValueError)
* ``data_error:<rank>``: loading the data fails on that rank only (a file one node lacks)
* ``nan_loss:<step>[:<step>...]``: those steps' loss (and so their gradients) is NaN on every rank
"""

from __future__ import annotations

import errno
import os
import runpy
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RANK = int(os.environ.get("RANK", "0"))


def stuck(rank: str, step: str) -> None:
    from relax_gdn.train import loop

    train_step = loop.Trainer.train_step

    def stuck_step(self, at: int):
        if at == int(step) and self.rank == int(rank):
            import torch
            import torch.distributed as dist

            dist.recv(
                torch.zeros(1), src=1 - self.rank
            )  # nobody sends: blocked like a peer in a lost collective
        return train_step(self, at)

    loop.Trainer.train_step = stuck_step


def on_checkpoint_write(step: str, action) -> None:
    """``action()`` when Megatron-Core's writer starts on a bucket of that step's checkpoint."""
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    write = FileSystemWriterAsync.write_preloaded_data

    def write_with_fault(*args, **kwargs):
        if kwargs["write_bucket"][0].count(f"step_{int(step):06d}"):
            action()
        return write(*args, **kwargs)

    FileSystemWriterAsync.write_preloaded_data = staticmethod(write_with_fault)


def pause_save(step: str, directory: str) -> None:
    def pause() -> None:
        Path(directory, f"saving.rank{RANK}").touch()
        deadline = time.monotonic() + 300
        while not Path(directory, "go").exists() and time.monotonic() < deadline:
            time.sleep(0.05)  # the test creates it after its signal

    on_checkpoint_write(step, pause)


def save_error(step: str, kind: str) -> None:
    def fail() -> None:
        if kind == "erofs":
            raise OSError(errno.EROFS, os.strerror(errno.EROFS))
        raise ValueError("a bug in the checkpoint writer")

    on_checkpoint_write(step, fail)


def data_error(rank: str) -> None:
    from relax_gdn.errors import DataError
    from relax_gdn.train import run_data

    load = run_data.load_data

    def load_or_fail(cfg, log=True):
        if RANK == int(rank):
            raise DataError(f"data.path: the data file is not visible on this node (rank {rank})")
        return load(cfg, log=log)

    run_data.load_data = load_or_fail


def nan_loss(*steps: str) -> None:
    from relax_gdn.train.step import TrainStep

    forward_backward = TrainStep.forward_backward

    def nan_at_step(self, batch):
        if batch.step not in {int(s) for s in steps}:
            return forward_backward(self, batch)
        hook = self.model.register_forward_hook(lambda module, args, out: out * float("nan"))
        try:
            return forward_backward(self, batch)
        finally:
            hook.remove()

    TrainStep.forward_backward = nan_at_step


FAULTS = {
    "stuck": stuck,
    "pause_save": pause_save,
    "save_error": save_error,
    "data_error": data_error,
    "nan_loss": nan_loss,
}


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    for fault in filter(None, os.environ.get("RELAX_GDN_TEST_FAULTS", "").split(",")):
        name, *args = fault.split(":")
        FAULTS[name](*args)
    sys.argv = [str(ROOT / "train.py"), *sys.argv[1:]]
    runpy.run_path(str(ROOT / "train.py"), run_name="__main__")
