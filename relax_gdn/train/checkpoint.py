"""Checkpoints: Megatron-Core distributed checkpointing (``torch_dist``), saved so that no work is lost.

Layout of ``checkpoint.dir``::

    step_000010/            one checkpoint: Megatron-Core's files (.metadata, __<rank>_<i>.distcp,
                            metadata.json, common state) + relax_gdn.json (this recipe's manifest)
    step_000020/
    latest                  the name of the newest complete checkpoint, written last
    .step_000030.partial/   a save in progress (or killed); never read, removed by the next save

What is saved: the model's ``sharded_state_dict`` (global tensor keys and offsets, so a
checkpoint written at one world size / TP / CP loads at another), the optimizer's sharded state
keyed like the parameters (CPU: AdamW's moments; GPU: the distributed optimizer's state in the
form ``checkpoint.optimizer_sharding`` names, see ``MegatronOptimizerAdapter.sharded_state_dict``
and :func:`optimizer_reshard_problem`), and as common state (rank 0's,
identical on every rank) the step, the LR scheduler, the CPU RNGs and everything ``relax_gdn.json`` holds: the resolved config, the
data position's inputs (the global batch of step s is a pure function of seed, batch size,
dataset and s, ``relax_gdn.data.global_batch_at_step``, so the step IS the data position), the
parallel layout it was written at and the W&B run id. CUDA RNG states are per rank and are
restored only when the layout is unchanged (they only drive dropout, 0 in every preset).

Atomicity: every rank writes into ``.step_N.partial``; when all are done, rank 0 writes the
manifest, renames the directory to ``step_N`` (one rename: a checkpoint is either complete or
invisible) and then rewrites ``latest`` (temporary file + rename). A ``kill -9`` at any point
leaves the previous checkpoint complete and loadable.

Resuming reads ``latest`` first: the checkpoint it names is the one to continue (a ``step_N`` newer
than it is a save killed before ``latest`` named it; saving step N again replaces it). Only when
``latest`` is missing or names a damaged checkpoint is the directory scanned for the newest
complete one, and the log says so. Rank 0 decides, every rank loads what it decided
(:func:`relax_gdn.train.agreement.decided_by_rank0`).

A save that fails for the file system (full, over quota, read-only, not permitted) is one
:class:`CheckpointError` naming the checkpoint, the cause and the free space, chained to what the
writer raised; any other failure stays an exception with its traceback.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import random
import shutil
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from relax_gdn.compat.write_results import dies_with_parent
from relax_gdn.errors import RecipeError
from relax_gdn.runtime import require_runtime
from relax_gdn.train.agreement import agree_on_errors

logger = logging.getLogger("relax_gdn.train")

MANIFEST = "relax_gdn.json"
LATEST = "latest"
FORMAT = "megatron-core-dist-checkpoint"
FORMAT_VERSION = 1
_PARTIAL_SUFFIX = ".partial"


class CheckpointError(RecipeError):
    """A checkpoint that cannot be used; the message names the file and what to do."""


def disk_size(n_bytes: float) -> str:
    """``12.34 GiB``, or ``3.4 MiB`` below a GiB (a small model's checkpoint is not "0.00 GiB")."""
    return f"{n_bytes / 2**30:.2f} GiB" if n_bytes >= 2**30 else f"{n_bytes / 2**20:.1f} MiB"


# torch.distributed.checkpoint reports failed writes as CheckpointException (a BaseException);
# this module's own file operations (the manifest, the rename, ``latest``) raise OSError
_WRITE_FAILURES = (CheckpointException, OSError)
# errors of the file system a checkpoint goes to, which the user fixes (space, quota, permissions)
DISK_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM})
_ERRNO_TEXT = re.compile(r"\[Errno (\d+)\] ([^'\n]*)")


# ---------------------------------------------------------------------------------------------
# names on disk
# ---------------------------------------------------------------------------------------------


def step_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"step_{step:06d}"


def _partial_dir(final: Path) -> Path:
    return final.parent / f".{final.name}{_PARTIAL_SUFFIX}"


def _step_of(path: Path) -> int | None:
    name = path.name
    if not name.startswith("step_") or not name[5:].isdigit():
        return None
    return int(name[5:])


def complete_checkpoints(root: str | Path) -> list[Path]:
    """``step_*`` directories with a manifest under ``root``, newest first. A save in progress or
    killed lives under a hidden ``.partial`` name and is never listed."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and _step_of(p) is not None and (p / MANIFEST).is_file()]
    return sorted(found, key=_step_of, reverse=True)


def _per_rank_files(path: Path) -> list[Path]:
    """Per-rank ``torch.save`` files (``rank_NNNNN.pt`` + ``meta.json``): a format this module does not read."""
    files = sorted(path.glob("rank_*.pt"))
    if not files and path.is_dir():
        files = sorted(path.glob("step_*/rank_*.pt"))
    return files


def _refuse_per_rank_files(path: Path) -> None:
    files = _per_rank_files(path)
    if files:
        raise CheckpointError(
            f"{path} holds per-rank torch.save checkpoint files ({files[0]}"
            f"{f' and {len(files) - 1} more' if len(files) > 1 else ''}), a format this recipe does not read: "
            "it reads and writes Megatron-Core distributed checkpoints (docs/checkpoints.md). Finish that run "
            "with the relax-gdn commit that wrote it, or start fresh (checkpoint.resume=null, another checkpoint.dir)"
        )


# ---------------------------------------------------------------------------------------------
# reading and checking a checkpoint (no process group needed)
# ---------------------------------------------------------------------------------------------


def read_manifest(directory: str | Path) -> dict[str, Any]:
    path = Path(directory) / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"checkpoint manifest {path} cannot be read ({type(e).__name__}: {e}); "
                              "the checkpoint is incomplete or corrupt: resume from another one") from e
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or "step" not in manifest:
        raise CheckpointError(f"checkpoint manifest {path} is not a relax-gdn {FORMAT} manifest "
                              f"(format={manifest.get('format') if isinstance(manifest, dict) else None!r})")
    return manifest


def verify_checkpoint(directory: str | Path) -> dict[str, Any]:
    """The manifest of ``directory`` after checking that every file the checkpoint's index names
    is there and long enough (a truncated or half-copied checkpoint fails here, naming the file,
    instead of deep inside the load). Raises :class:`CheckpointError`."""
    from torch.distributed.checkpoint import FileSystemReader

    directory = Path(directory)
    manifest = read_manifest(directory)
    megatron_meta = directory / "metadata.json"
    try:
        backend = json.loads(megatron_meta.read_text()).get("sharded_backend")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError) as e:
        raise CheckpointError(f"checkpoint file {megatron_meta} cannot be read ({type(e).__name__}: {e}); the "
                              "checkpoint is corrupt: resume from another one") from e
    if backend != "torch_dist":
        raise CheckpointError(f"checkpoint file {megatron_meta} names backend {backend!r}, expected 'torch_dist'")
    index = directory / ".metadata"
    try:
        metadata = FileSystemReader(str(directory)).read_metadata()
    except Exception as e:  # noqa: BLE001 - a pickle of anything: any failure means an unreadable index
        raise CheckpointError(f"checkpoint index {index} cannot be read ({type(e).__name__}: {e}); the checkpoint "
                              "is corrupt: resume from another one") from e
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        path = directory / name
        actual = path.stat().st_size if path.is_file() else None
        if actual is None or actual < size:
            what = "is missing" if actual is None else f"is truncated ({actual} of {size} bytes)"
            raise CheckpointError(f"checkpoint file {path} {what}; the checkpoint is incomplete or corrupt: "
                                  "resume from another one")
    return manifest


def optimizer_reshard_problem(directory: Path, manifest: dict[str, Any], optimizer_form: dict[str, Any],
                              layout: dict[str, Any]) -> str | None:
    """Why the optimizer state of the checkpoint in ``directory`` cannot load into this run's
    optimizer (``optimizer_form``) at this run's parallel ``layout``, or None. Checked before the
    load, so the message names the fix instead of a missing tensor key deep in the reader."""
    saved = manifest.get("optimizer")
    if not saved or optimizer_form["kind"] == "none":
        return None  # written before forms were recorded, or a run with no optimizer state to load
    if saved["kind"] != optimizer_form["kind"]:
        names = {"cpu_adamw": "the CPU AdamW state", "megatron": "Megatron-Core's distributed optimizer state",
                 "none": "no optimizer state (optim.name=none)"}
        return (f"checkpoint {directory} holds {names.get(saved['kind'], saved['kind'])}, this run needs "
                f"{names.get(optimizer_form['kind'], optimizer_form['kind'])}: the two do not convert. Resume "
                "on the device type that wrote it, or start from its weights (python -m relax_gdn.export_hf, "
                "then model.hf_checkpoint=<that directory>)")
    saved_tp = (manifest.get("layout") or {}).get("tp")
    if saved.get("sharding") == "dp_reshardable" and saved_tp != layout["tp"]:
        return (f"checkpoint {directory} was written at TP {saved_tp} with checkpoint.optimizer_sharding="
                f"dp_reshardable, whose optimizer state loads at any DP / CP but only at TP {saved_tp} (this run: "
                f"TP {layout['tp']}). Resume once at parallel.tp={saved_tp} with "
                "checkpoint.optimizer_sharding=fully_reshardable and save, then move to the new TP")
    return None


def read_latest(root: Path) -> Path | None:
    """The checkpoint directory ``root/latest`` names, or None when there is no such file or it does
    not name a ``step_NNNNNN`` directory."""
    try:
        name = (root / LATEST).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError):
        return None
    return root / name if _step_of(Path(name)) is not None and "/" not in name else None


def newest_usable_checkpoint(root: Path, notes: list[str]) -> Path | None:
    """The checkpoint to continue in ``root``: the one ``latest`` names; when ``latest`` is missing
    or names a damaged checkpoint (said in ``notes``), the newest complete one that passes
    :func:`verify_checkpoint` (each damaged one skipped, said in ``notes``); None when there is none."""
    named = read_latest(root)
    if named is not None:
        try:
            verify_checkpoint(named)
            return named
        except CheckpointError as e:
            notes.append(f"{root / LATEST} names {named.name}, which cannot be used: {e}; falling back to the "
                         f"newest complete checkpoint in {root}")
    candidates = [c for c in complete_checkpoints(root) if c != named]
    if named is None and candidates:
        how = "cannot be read" if (root / LATEST).exists() else "is missing"
        notes.append(f"{root / LATEST} {how}: looking for the newest complete checkpoint in {root}")
    for candidate in candidates:
        try:
            verify_checkpoint(candidate)
        except CheckpointError as e:
            notes.append(f"skipping {candidate}: {e}; falling back to the previous complete checkpoint")
            continue
        return candidate
    return None


def resolve_resume(resume: str, root: Path | None) -> tuple[Path | None, list[str]]:
    """The checkpoint directory to load for ``checkpoint.resume`` (``auto`` or a path), and notes
    for the log (rank 0 calls it and broadcasts the answer). ``auto``: the checkpoint
    :func:`newest_usable_checkpoint` finds under ``checkpoint.dir``, or None (a fresh start). A
    path: that checkpoint, or the one ``latest`` names in that directory (else its newest); any
    damage is an error."""
    notes: list[str] = []
    if resume == "auto":
        if root is None:
            raise CheckpointError("checkpoint.resume=auto needs checkpoint.dir (where to look for checkpoints)")
        _refuse_per_rank_files(root)
        found = newest_usable_checkpoint(root, notes)
        if found is None:
            notes.append(f"checkpoint.resume=auto: no complete checkpoint in {root}, starting fresh")
        return found, notes
    path = Path(resume)
    if not path.exists():
        raise CheckpointError(f"checkpoint.resume={resume!r} does not exist; give a step_NNNNNN directory, the "
                              "checkpoint.dir holding them, or auto")
    _refuse_per_rank_files(path)
    if (path / MANIFEST).is_file() or path.name.endswith(_PARTIAL_SUFFIX) or _step_of(path) is not None:
        verify_checkpoint(path)
        return path, notes
    chosen = read_latest(path) or next(iter(complete_checkpoints(path)), None)
    if chosen is None:
        raise CheckpointError(f"checkpoint.resume={resume!r} holds no complete checkpoint (a step_NNNNNN "
                              f"directory with {MANIFEST}); point it at one or at the directory that contains them")
    verify_checkpoint(chosen)
    return chosen, notes


# ---------------------------------------------------------------------------------------------
# RNG
# ---------------------------------------------------------------------------------------------


def cpu_rng_state() -> dict[str, Any]:
    """Python, NumPy and torch CPU generators: seeded alike and drawn alike on every rank."""
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def set_cpu_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


def _cuda_rng_sharded(is_loading: bool):
    """This rank's CUDA generator + Megatron-Core tracker as a per-rank ShardedObject."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    state = None if is_loading else {"cuda": torch.cuda.get_rng_state(),
                                     "tracker": get_cuda_rng_tracker().get_states()}
    return ShardedObject("rng_state.cuda", state, (dist.get_world_size(),), (dist.get_rank(),), replica_id=0)


# ---------------------------------------------------------------------------------------------
# what a checkpoint holds of the model
# ---------------------------------------------------------------------------------------------


def model_sharded_state_dict(model) -> dict[str, Any]:
    """The model's sharded tensors a checkpoint holds: all of them, or where part of the model is
    frozen (LoRA's base) only those that train; the frozen ones are rebuilt from the base the
    manifest names (``model.hf_checkpoint``, or the preset and seed)."""
    sharded = model.sharded_state_dict()
    if all(p.requires_grad for p in model.parameters()):
        return sharded
    return {k: v for k, v in sharded.items()
            if isinstance(getattr(v, "data", None), torch.Tensor) and v.data.requires_grad}


def load_model_state(model, state: dict[str, Any]) -> None:
    """``model.load_state_dict`` of what :func:`model_sharded_state_dict` loaded: every tensor, or
    every tensor that trains (the frozen base stays as the model has it)."""
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    if not frozen:
        model.load_state_dict(state)
        return
    result = model.load_state_dict(state, strict=False)
    left = [k for k in result.missing_keys if k not in frozen and not k.endswith("_extra_state")]
    if left or result.unexpected_keys:
        raise RuntimeError(f"checkpoint state does not fit the model: missing {left[:5]}, "
                           f"unexpected {result.unexpected_keys[:5]}")


# ---------------------------------------------------------------------------------------------
# save
# ---------------------------------------------------------------------------------------------


@dataclass
class Saver:
    """Saves into ``root`` (a collective: every rank calls :meth:`save` at the same steps).

    ``async_save`` (CUDA only): Megatron-Core writes the shards in a background process
    (``AsyncCallsQueue``); the rename and ``latest`` happen when every rank's write is done,
    checked without blocking after each step (:meth:`poll`) and at the end (:meth:`finish`).
    The writer's helper processes die with their rank (:mod:`relax_gdn.compat.write_results`,
    through the Runtime)."""

    root: Path
    keep_last: int
    dp_cp_group: Any
    async_save: bool = False
    # (step, seconds the training loop was blocked, seconds until the checkpoint was published)
    timings: list[tuple[int, float, float]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._queue = None
        self._in_flight: Path | None = None  # the checkpoint an async save is writing
        require_runtime("saving checkpoints").checkpoint_write_results(background=self.async_save)
        if self.async_save:
            from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

            self._queue = AsyncCallsQueue()

    def save(self, step: int, *, model, optimizer, scheduler, manifest: dict[str, Any]) -> Path:
        from megatron.core import dist_checkpointing
        from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
        from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper

        started = time.perf_counter()
        final = step_dir(self.root, step)
        partial = _partial_dir(final)
        self._finalize(blocking=True)  # one save in flight at a time
        agree_on_errors(lambda: self._make_partial(partial, final))
        model_sd = model_sharded_state_dict(model)
        state = {
            "model": model_sd,
            "optimizer": optimizer.sharded_state_dict(model_sd),
            "scheduler": scheduler.state_dict(),
            "rng": cpu_rng_state(),
            "step": step,
        }
        if torch.cuda.is_available():
            state["rng_cuda"] = _cuda_rng_sharded(is_loading=False)
        # replicated tensors (DP and CP replicas) are written by one rank each, spread over the group
        strategy = FullyParallelSaveStrategyWrapper(get_default_save_sharded_strategy("torch_dist"), self.dp_cp_group)
        manifest = {"format": FORMAT, "format_version": FORMAT_VERSION, "step": step,
                    "optimizer": optimizer.checkpoint_form, **manifest}
        if self._queue is None:
            try:
                dist_checkpointing.save(state, str(partial), strategy, async_strategy="mcore")
            except _WRITE_FAILURES as e:
                self._raise_if_disk_problem(final, e)
                raise
            self._publish(partial, final, manifest, started, blocked=0.0)
        else:
            request = dist_checkpointing.save(state, str(partial), strategy, async_sharded_save=True,
                                              async_strategy="mcore")
            request = request._replace(async_fn=dies_with_parent(request.async_fn))  # the forked writer
            blocked = {}  # until the write is handed to the writer process (its time is set below)
            request.add_finalize_fn(lambda: self._publish(partial, final, manifest, started, blocked["s"]))
            self._queue.schedule_async_request(request)
            self._in_flight = final
            blocked["s"] = time.perf_counter() - started
        return final

    def _make_partial(self, partial: Path, final: Path) -> None:
        """Rank 0 makes the empty ``.step_N.partial`` every rank writes into (a failure to: agreed)."""
        if dist.get_rank() != 0:
            return
        try:
            shutil.rmtree(partial, ignore_errors=True)
            partial.mkdir(parents=True)
        except OSError as e:
            self._raise_if_disk_problem(final, e, agreed=False)
            raise

    def poll(self) -> None:
        """Publish finished background saves (a collective; call it on every rank every step)."""
        self._finalize(blocking=False)

    def finish(self) -> None:
        """Wait for the save in flight and publish it."""
        if self._queue is not None:
            self._finalize(blocking=True)
            self._queue.close()
            self._queue = None

    def _finalize(self, blocking: bool) -> None:
        if self._queue is None or self._in_flight is None:
            return
        try:
            done = self._queue.maybe_finalize_async_calls(blocking=blocking)
        except _WRITE_FAILURES as e:
            self._raise_if_disk_problem(self._in_flight, e)
            raise
        if done:
            self._in_flight = None

    def _raise_if_disk_problem(self, final: Path, error: BaseException, agreed: bool = True) -> None:
        """Raise the :class:`CheckpointError` for a save of ``final`` that failed for the file system
        (:func:`disk_cause`), chained to ``error``; return when it did not (the caller re-raises
        ``error``: a bug keeps its traceback). ``agreed``: every rank is here (a collective: a
        disk problem found on any rank stops every rank with one message)."""
        def check() -> None:
            cause = disk_cause(error, final.parent)
            if cause is not None:
                raise self._save_failed(final, cause) from error

        if agreed:
            agree_on_errors(check)
        else:
            check()

    def _save_failed(self, final: Path, cause: OSError) -> CheckpointError:
        """The message for a save the file system refused: the checkpoint, the cause, the free space
        and the way back."""
        try:
            free = f"{disk_size(shutil.disk_usage(self.root).free)} free there"
        except OSError:
            free = "its free space unknown"
        return CheckpointError(
            f"saving checkpoint {final} failed ({cause}); {free}. The checkpoints saved before it are complete "
            f"(see {self.root / LATEST}): free space or fix {self.root}, then rerun with checkpoint.resume=auto")

    def _publish(self, partial: Path, final: Path, manifest: dict[str, Any], started: float, blocked: float) -> None:
        """When every rank's shards are written (a collective): rank 0 writes the manifest, renames
        ``partial`` to ``final``, rewrites ``latest`` and prunes; a file-system failure there is
        one agreed message."""
        dist.barrier()
        agree_on_errors(lambda: self._publish_on_rank0(partial, final, manifest))
        total = time.perf_counter() - started
        self.timings.append((int(manifest["step"]), blocked or total, total))
        if dist.get_rank() == 0:
            logger.info("checkpoint %s saved (%.1f s%s)", final, total,
                        f", training blocked {blocked:.1f} s" if blocked else "")

    def _publish_on_rank0(self, partial: Path, final: Path, manifest: dict[str, Any]) -> None:
        if dist.get_rank() != 0:
            return
        try:
            write_text_atomically(partial / MANIFEST, json.dumps(manifest, indent=2, default=str) + "\n")
            if final.exists():  # the same step saved again (a rerun): the new one replaces it
                stale = final.parent / f".{final.name}.replaced"
                shutil.rmtree(stale, ignore_errors=True)
                os.replace(final, stale)
                shutil.rmtree(stale, ignore_errors=True)
            os.replace(partial, final)
            _fsync_dir(final.parent)
            write_text_atomically(final.parent / LATEST, final.name + "\n")
        except OSError as e:
            self._raise_if_disk_problem(final, e, agreed=False)
            raise
        self._prune()

    def _prune(self) -> None:
        """Keep the newest ``keep_last`` complete checkpoints (0: all); drop abandoned partial saves."""
        for stale in self.root.glob(f".step_*{_PARTIAL_SUFFIX}"):
            shutil.rmtree(stale, ignore_errors=True)
        if self.keep_last > 0:
            for old in complete_checkpoints(self.root)[self.keep_last:]:
                shutil.rmtree(old, ignore_errors=True)


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


def write_text_atomically(path: Path, text: str) -> None:
    """``path`` holds either its old text or ``text``, never a part (temporary file, fsync, rename)."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------------------------
# load
# ---------------------------------------------------------------------------------------------


@dataclass
class LoadedCheckpoint:
    directory: Path
    step: int
    manifest: dict[str, Any]
    scheduler_state: dict[str, Any]


def _load_sharded(request: dict[str, Any], directory: Path, hint: str = "") -> dict[str, Any]:
    """Megatron-Core's load of ``request`` from ``directory``, a failure named as the checkpoint
    not fitting this model (``hint``: what to check, appended)."""
    from megatron.core import dist_checkpointing

    from megatron.core.dist_checkpointing.core import CheckpointingException

    try:
        return dist_checkpointing.load(request, str(directory))
    except (CheckpointingException, CheckpointException) as e:  # keys, shapes or shardings that do not fit
        raise CheckpointError(f"checkpoint {directory} cannot be loaded into this model ({type(e).__name__}: "
                              f"{str(e)[:500]}){hint}") from e


def load_checkpoint(directory: Path, manifest: dict[str, Any], *, model, optimizer,
                    same_layout: bool) -> LoadedCheckpoint:
    """Load ``directory`` (whose manifest the caller has read) into ``model`` and ``optimizer`` (a
    collective) and restore the RNGs; the scheduler state is returned for the caller to apply (a
    changed schedule is its decision). ``same_layout``: the checkpoint was written at this run's
    world size / TP / CP, so per-rank CUDA RNG states apply. Call :func:`verify_checkpoint` first
    (it names damaged files)."""
    model_sd = model_sharded_state_dict(model)
    saved_sharding = (manifest.get("optimizer") or {}).get("sharding")
    request = {"model": model_sd,
               "optimizer": optimizer.sharded_state_dict(model_sd, is_loading=True, sharding=saved_sharding)}
    if same_layout and torch.cuda.is_available():
        request["rng_cuda"] = _cuda_rng_sharded(is_loading=True)
    state = _load_sharded(request, directory, "; check that model.* matches the run that wrote it")
    load_model_state(model, state["model"])
    optimizer.load_sharded_state_dict(state["optimizer"])
    set_cpu_rng_state(state["rng"])
    if "rng_cuda" in state:
        from megatron.core.tensor_parallel import get_cuda_rng_tracker

        torch.cuda.set_rng_state(state["rng_cuda"]["cuda"])
        get_cuda_rng_tracker().set_states(state["rng_cuda"]["tracker"])
    return LoadedCheckpoint(directory=directory, step=int(state["step"]), manifest=manifest,
                            scheduler_state=state["scheduler"])


def checkpoint_fp32_main_params(directory: Path, manifest: dict[str, Any], model):
    """The fp32 main parameters a checkpoint holds in the model's shapes, as the HF export's
    ``MainParams`` (model tensors by name -> fp32 copies), or None when it holds none in that form:
    Megatron-Core writes them model-shaped (``optimizer.state.param.<key>``) only with
    ``checkpoint.optimizer_sharding=fully_reshardable``; the ``dp_reshardable`` form keeps flat
    slices laid out by the run's DDP buckets, and a CPU run's weights are fp32 themselves."""
    if (manifest.get("optimizer") or {}).get("sharding") != "fully_reshardable":
        return None
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from torch.distributed.checkpoint import FileSystemReader

    stored = set(FileSystemReader(str(directory)).read_metadata().state_dict_metadata)

    def load(params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        request = {}
        for name, sharded in model_sharded_state_dict(model).items():
            key = f"optimizer.state.param.{getattr(sharded, 'key', '')}"
            if name in params and isinstance(sharded, ShardedTensor) and key in stored:
                fp32 = torch.empty_like(sharded.data, dtype=torch.float32)
                request[name] = replace(sharded, key=key, data=fp32, dtype=torch.float32)
        if not request:
            return {}
        # Megatron-Core's load returns the checkpoint's common state (step, scheduler, ...) too
        loaded = _load_sharded(request, directory, "; its optimizer state does not fit this model")
        return {name: loaded[name] for name in request}

    return load


def load_model_weights(directory: Path, model) -> dict[str, Any]:
    """Only the model's tensors of ``directory`` (any TP / CP of the checkpoint), e.g. for export
    (of a LoRA run: the adapters, onto the base already in ``model``)."""
    manifest = verify_checkpoint(directory)
    state = _load_sharded({"model": model_sharded_state_dict(model)}, directory)
    load_model_state(model, state["model"])
    return manifest
