"""The file system under ``checkpoint.dir``: room and permissions checked before step 1, and why a
save failed when the file system refused it.

A save that fails for the file system (full, over quota, read-only, not permitted) is one
:class:`~relax_gdn.train.checkpoint.CheckpointError` naming the checkpoint, the cause and the free
space, chained to what the writer raised (:func:`save_failed`); any other failure stays an
exception with its traceback.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from relax_gdn.train.agreement import agree_on_errors
from relax_gdn.train.checkpoint import LATEST, CheckpointError

logger = logging.getLogger("relax_gdn.train")

# torch.distributed.checkpoint reports failed writes as CheckpointException (a BaseException);
# the writer's own file operations (the manifest, the rename, ``latest``) raise OSError
WRITE_FAILURES = (CheckpointException, OSError)
# errors of the file system a checkpoint goes to, which the user fixes (space, quota, permissions)
DISK_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM})
_ERRNO_TEXT = re.compile(r"\[Errno (\d+)\] ([^'\n]*)")


def disk_size(n_bytes: float) -> str:
    """``12.34 GiB``, or ``3.4 MiB`` below a GiB (a small model's checkpoint is not "0.00 GiB")."""
    return f"{n_bytes / 2**30:.2f} GiB" if n_bytes >= 2**30 else f"{n_bytes / 2**20:.1f} MiB"


# ---------------------------------------------------------------------------------------------
# before step 1
# ---------------------------------------------------------------------------------------------


def estimated_checkpoint_bytes(model: torch.nn.Module, tp: int, on_gpu: bool) -> int:
    """An upper bound of one checkpoint's size: the parameters that train (this rank's TP shard x
    TP: the whole model, or LoRA's adapters) plus their optimizer state (fp32 Adam moments; on GPU
    also the fp32 main params)."""
    per_element = 12 if on_gpu else 8
    return (
        sum(p.numel() * (p.element_size() + per_element) for p in model.parameters() if p.requires_grad) * tp
    )


def checkpoints_held_at_once(checkpoint_cfg, steps: int) -> int:
    """How many checkpoints ``checkpoint.dir`` holds at the fullest: ``keep_last`` complete ones
    plus the one being written (the oldest goes only after the new one is complete), at most all
    the saves the run makes."""
    saves = steps // checkpoint_cfg.every_steps + 1 if checkpoint_cfg.every_steps else 1
    return saves if checkpoint_cfg.keep_last == 0 else min(checkpoint_cfg.keep_last + 1, saves)


def check_checkpoint_dir(root: Path, needed_bytes: int, held: int) -> None:
    """Before step 1, on every rank (all of them write shards): ``root`` can be created and written
    and has room for a checkpoint (else every rank raises the problem the first rank met: a
    collective); room for fewer than the ``held`` checkpoints the run keeps at once is a warning
    (older runs' files may yet be pruned)."""
    agree_on_errors(lambda: _check_checkpoint_dir_here(root, needed_bytes, held))


def _check_checkpoint_dir_here(root: Path, needed_bytes: int, held: int) -> None:
    problem = None
    try:
        root.mkdir(parents=True, exist_ok=True)
        probe = root / f".write_test.rank{dist.get_rank()}"
        probe.write_bytes(b"relax-gdn")
        probe.unlink()
        free = shutil.disk_usage(root).free
        if free < needed_bytes:
            problem = (
                f"checkpoint.dir={str(root)!r} has {disk_size(free)} free, a checkpoint needs about "
                f"{disk_size(needed_bytes)}: free space there or point checkpoint.dir elsewhere"
            )
        elif free < needed_bytes * held and dist.get_rank() == 0:
            logger.warning(
                "checkpoint.dir=%r has %s free; this run holds up to %d checkpoints of about %s there at "
                "once (checkpoint.keep_last + the one being written): a save may fail for space; lower "
                "checkpoint.keep_last or free space",
                str(root),
                disk_size(free),
                held,
                disk_size(needed_bytes),
            )
    except OSError as e:
        problem = (
            f"checkpoint.dir={str(root)!r} cannot be written on rank {dist.get_rank()} "
            f"({type(e).__name__}: {e.strerror or e}): fix its permissions or point checkpoint.dir elsewhere"
        )
    if problem is not None:
        raise CheckpointError(problem)


# ---------------------------------------------------------------------------------------------
# a save that failed
# ---------------------------------------------------------------------------------------------


def save_failed(root: Path, final: Path, cause: OSError) -> CheckpointError:
    """The message for a save of ``final`` (under ``root``) the file system refused: the checkpoint,
    the cause, the free space and the way back."""
    try:
        free = f"{disk_size(shutil.disk_usage(root).free)} free there"
    except OSError:
        free = "its free space unknown"
    return CheckpointError(
        f"saving checkpoint {final} failed ({cause}); {free}. The checkpoints saved before it are complete "
        f"(see {root / LATEST}): free space or fix {root}, then rerun with checkpoint.resume=auto"
    )


def raise_if_disk_problem(root: Path, final: Path, error: BaseException, agreed: bool = True) -> None:
    """Raise the :class:`CheckpointError` for a save of ``final`` that failed for the file system
    (:func:`disk_cause`), chained to ``error``; return when it did not (the caller re-raises
    ``error``: a bug keeps its traceback). ``agreed``: every rank is here (a collective: a disk
    problem found on any rank stops every rank with one message)."""

    def check() -> None:
        cause = disk_cause(error, final.parent)
        if cause is not None:
            raise save_failed(root, final, cause) from error

    if agreed:
        agree_on_errors(check)
    else:
        check()


def _exception_chain(error: BaseException):
    """``error``, its causes and contexts, and (torch DCP) every rank's failure with theirs."""
    seen: set[int] = set()
    todo = [error]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        todo += [e.__cause__, e.__context__]
        if isinstance(e, CheckpointException):
            todo += [failure for failure, _ in e.failures.values()]


def disk_cause(error: BaseException, directory: Path) -> OSError | None:
    """Why a save into ``directory`` failed when the file system refused it (``DISK_ERRNOS``: full,
    over quota, read-only, not permitted), else None.

    Megatron-Core's writer keeps only the text of the OSError it caught (``[Errno 28] No space
    left on device``) or not even that (a full disk ends a tensor write as ``RuntimeError:
    unexpected pos``). So: an OSError in ``error``'s chain, else an errno in its text, else, for
    a failed write (CheckpointException), what a small write into ``directory`` raises now."""
    texts = []
    for e in _exception_chain(error):
        if isinstance(e, OSError) and e.errno in DISK_ERRNOS:
            return e
        texts.append(str(e))
    for number, text in _ERRNO_TEXT.findall("\n".join(texts)):
        if int(number) in DISK_ERRNOS:
            return OSError(int(number), text.strip())
    if isinstance(error, CheckpointException):
        return _probe_write(directory)
    return None


def _probe_write(directory: Path) -> OSError | None:
    """The file-system error a 1 MiB write + fsync into ``directory`` meets now, or None."""
    probe = directory / f".write_probe.rank{dist.get_rank() if dist.is_initialized() else 0}"
    try:
        with open(probe, "wb") as f:
            f.write(b"\0" * 2**20)
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        return e if e.errno in DISK_ERRNOS else None
    finally:
        probe.unlink(missing_ok=True)
    return None
