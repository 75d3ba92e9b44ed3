"""A checkpoint on disk: its names, its manifest, whether it is whole, and which one to resume.

Layout of ``checkpoint.dir``::

    step_000010/            one checkpoint: Megatron-Core's files (.metadata, __<rank>_<i>.distcp,
                            metadata.json, common state) + relax_gdn.json (this recipe's manifest)
    step_000020/
    latest                  the name of the newest complete checkpoint, written last
    .step_000030.partial/   a save in progress (or killed); never read, removed by the next save

What a checkpoint holds: :mod:`relax_gdn.train.checkpoint_state`; how it is written (atomically):
:mod:`relax_gdn.train.checkpoint_writer`; when, and the resume of a run:
:mod:`relax_gdn.train.checkpoint_manager`.

Resuming reads ``latest`` first: the checkpoint it names is the one to continue (a ``step_N`` newer
than it is a save killed before ``latest`` named it; saving step N again replaces it). Only when
``latest`` is missing or names a damaged checkpoint is the directory scanned for the newest
complete one, and the log says so (:func:`resolve_resume`; rank 0 decides, every rank loads what it
decided). A damaged checkpoint is found by :func:`verify_checkpoint` before any load, naming the
file.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from relax_gdn.errors import RecipeError

MANIFEST = "relax_gdn.json"
LATEST = "latest"
FORMAT = "megatron-core-dist-checkpoint"
FORMAT_VERSION = 1
PARTIAL_SUFFIX = ".partial"


class CheckpointError(RecipeError):
    """A checkpoint that cannot be used; the message names the file and what to do."""


# ---------------------------------------------------------------------------------------------
# names on disk
# ---------------------------------------------------------------------------------------------


def step_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"step_{step:06d}"


def partial_dir(final: Path) -> Path:
    return final.parent / f".{final.name}{PARTIAL_SUFFIX}"


def step_of(path: Path) -> int | None:
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
    found = [p for p in root.iterdir() if p.is_dir() and step_of(p) is not None and (p / MANIFEST).is_file()]
    return sorted(found, key=step_of, reverse=True)


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
        raise CheckpointError(
            f"checkpoint manifest {path} cannot be read ({type(e).__name__}: {e}); "
            "the checkpoint is incomplete or corrupt: resume from another one"
        ) from e
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or "step" not in manifest:
        raise CheckpointError(
            f"checkpoint manifest {path} is not a relax-gdn {FORMAT} manifest "
            f"(format={manifest.get('format') if isinstance(manifest, dict) else None!r})"
        )
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
        raise CheckpointError(
            f"checkpoint file {megatron_meta} cannot be read ({type(e).__name__}: {e}); the "
            "checkpoint is corrupt: resume from another one"
        ) from e
    if backend != "torch_dist":
        raise CheckpointError(
            f"checkpoint file {megatron_meta} names backend {backend!r}, expected 'torch_dist'"
        )
    index = directory / ".metadata"
    try:
        metadata = FileSystemReader(str(directory)).read_metadata()
    except Exception as e:  # noqa: BLE001 - a pickle of anything: any failure means an unreadable index
        raise CheckpointError(
            f"checkpoint index {index} cannot be read ({type(e).__name__}: {e}); the checkpoint "
            "is corrupt: resume from another one"
        ) from e
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        path = directory / name
        actual = path.stat().st_size if path.is_file() else None
        if actual is None or actual < size:
            what = "is missing" if actual is None else f"is truncated ({actual} of {size} bytes)"
            raise CheckpointError(
                f"checkpoint file {path} {what}; the checkpoint is incomplete or corrupt: "
                "resume from another one"
            )
    return manifest


# ---------------------------------------------------------------------------------------------
# which checkpoint to resume
# ---------------------------------------------------------------------------------------------


def read_latest(root: Path) -> Path | None:
    """The checkpoint directory ``root/latest`` names, or None when there is no such file or it does
    not name a ``step_NNNNNN`` directory."""
    try:
        name = (root / LATEST).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError):
        return None
    return root / name if step_of(Path(name)) is not None and "/" not in name else None


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
            notes.append(
                f"{root / LATEST} names {named.name}, which cannot be used: {e}; falling back to the "
                f"newest complete checkpoint in {root}"
            )
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


RUN_CHECKPOINTS = "checkpoints"  # where a run keeps its checkpoints without checkpoint.dir
RUN_CONFIG = "config.yaml"  # the resolved config a run writes into its directory


def run_checkpoint_dir(run_dir: Path) -> Path | None:
    """The checkpoint directory of a run directory: ``checkpoints/`` in it, else the
    ``checkpoint.dir`` its config.yaml names; None when it is not a run directory."""
    if (run_dir / RUN_CHECKPOINTS).is_dir():
        return run_dir / RUN_CHECKPOINTS
    if not (run_dir / RUN_CONFIG).is_file():
        return None
    from omegaconf import OmegaConf

    named = OmegaConf.select(OmegaConf.load(run_dir / RUN_CONFIG), "checkpoint.dir", default=None)
    return Path(named) if named else None


def checkpoint_in(path: Path) -> tuple[Path | None, str]:
    """The checkpoint a directory that is not one itself stands for: the one ``latest`` names in
    it, else its newest complete one; for a run directory, in its checkpoint directory
    (:func:`run_checkpoint_dir`). None and the words that say where else it was looked for ("" when
    nowhere else) when there is none."""
    holds = complete_checkpoints(path) or (path / LATEST).exists()
    root = path if holds else run_checkpoint_dir(path)
    chosen = None if root is None else read_latest(root) or next(iter(complete_checkpoints(root)), None)
    elsewhere = f" (nor does {root}, the run's checkpoint directory)" if root not in (None, path) else ""
    return chosen, elsewhere


def resolve_resume(resume: str, root: Path | None) -> tuple[Path | None, list[str]]:
    """The checkpoint directory to load for ``checkpoint.resume`` (``auto`` or a path), and notes
    for the log (rank 0 calls it and broadcasts the answer). ``auto``: the checkpoint
    :func:`newest_usable_checkpoint` finds under ``checkpoint.dir``, or None (a fresh start). A
    path: that checkpoint, or the one ``latest`` names in that directory (else its newest), or in
    a run directory's checkpoint directory (:func:`run_checkpoint_dir`); any damage is an error."""
    notes: list[str] = []
    if resume == "auto":
        if root is None:
            raise CheckpointError(
                "checkpoint.resume=auto needs checkpoint.dir (where to look for checkpoints)"
            )
        _refuse_per_rank_files(root)
        found = newest_usable_checkpoint(root, notes)
        if found is None:
            notes.append(f"checkpoint.resume=auto: no complete checkpoint in {root}, starting fresh")
        return found, notes
    path = Path(resume)
    if not path.exists():
        raise CheckpointError(
            f"checkpoint.resume={resume!r} does not exist; give a step_NNNNNN directory, the "
            "checkpoint.dir holding them, or auto"
        )
    _refuse_per_rank_files(path)
    if (path / MANIFEST).is_file() or path.name.endswith(PARTIAL_SUFFIX) or step_of(path) is not None:
        verify_checkpoint(path)
        return path, notes
    chosen, elsewhere = checkpoint_in(path)
    if chosen is None:
        raise CheckpointError(
            f"checkpoint.resume={resume!r} holds no complete checkpoint (a step_NNNNNN "
            f"directory with {MANIFEST}){elsewhere}; point it at one, at the directory that contains them, "
            "or at a run directory"
        )
    verify_checkpoint(chosen)
    return chosen, notes


# ---------------------------------------------------------------------------------------------
# whole files
# ---------------------------------------------------------------------------------------------


def write_text_atomically(path: Path, text: str) -> None:
    """``path`` holds either its old text or ``text``, never a part (temporary file, fsync, rename)."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
