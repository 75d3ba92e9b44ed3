"""What ``python -m relax_gdn.export_hf CHECKPOINT OUT`` settles before it builds anything, each
problem one message in the command's own terms (exit code 2):

* CHECKPOINT: a ``step_NNNNNN`` checkpoint directory, the checkpoint directory holding them (the one
  ``latest`` names, else the newest complete one) or a run directory (its ``checkpoints/``, or the
  ``checkpoint.dir`` its ``config.yaml`` names): :func:`resolve_checkpoint`.
* OUT: absent, or an empty directory; ``--overwrite`` replaces an export already there, whole. A
  file, a path that cannot be written and a file system without room for the export's estimated
  size (:func:`estimated_bytes`) are refused: :meth:`ExportTarget.prepare`.

The export is written into ``.<OUT name>.partial`` beside OUT and renamed to OUT once whole; an OUT
replaced with ``--overwrite`` is moved aside first and removed after the rename. A directory named
OUT is one complete export, never the files of two (a merged model beside an adapter's, or an
earlier export's shards): :meth:`ExportTarget.commit`.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from relax_gdn.errors import RecipeError
from relax_gdn.train.checkpoint import MANIFEST, CheckpointError, checkpoint_in, verify_checkpoint
from relax_gdn.train.checkpoint_disk import disk_size

_WHAT = "give a step_NNNNNN checkpoint directory, the checkpoint directory holding them, or a run directory"


def _is_step_dir(path: Path) -> bool:
    return (path / MANIFEST).is_file() or (path.name.startswith("step_") and path.name[5:].isdigit())


def resolve_checkpoint(arg: str) -> Path:
    """The verified ``step_NNNNNN`` directory CHECKPOINT stands for (module docstring)."""
    path = Path(arg)
    if not path.exists():
        raise RecipeError(f"CHECKPOINT {arg} does not exist: {_WHAT}")
    if not path.is_dir():
        raise RecipeError(f"CHECKPOINT {arg} is a file: {_WHAT}")
    if _is_step_dir(path):
        chosen = path
    else:
        chosen, elsewhere = checkpoint_in(path)
        if chosen is None:
            raise RecipeError(
                f"CHECKPOINT {arg} holds no complete checkpoint (a step_NNNNNN directory with "
                f"{MANIFEST}){elsewhere}: {_WHAT}"
            )
    try:
        verify_checkpoint(chosen)
    except CheckpointError as e:  # its advice is training's (resume from another): the export's instead
        reason = str(e).removesuffix(": resume from another one")
        raise RecipeError(
            f"CHECKPOINT {arg}: {reason}: export another one (an earlier step_NNNNNN beside it)"
        ) from e
    return chosen


def estimated_bytes(
    directory: Path, manifest: dict, *, like: Path | None, dtype_bytes: int | None, adapter: bool
) -> int | None:
    """About what the export of checkpoint ``directory`` writes: in the layout of ``like`` that
    checkpoint's weight files; the adapters, or the text layout, the checkpoint's tensors of the
    model (its optimizer state aside) at ``dtype_bytes`` each (None: the run's dtype). None when
    the checkpoint does not say (the merged model of a LoRA run on the preset's seeded base)."""
    if like is not None and not adapter:
        return sum(f.stat().st_size for f in like.glob("*.safetensors"))
    if manifest["model"].get("lora") and not adapter:
        return None
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(str(directory)).read_metadata().state_dict_metadata
    each = dtype_bytes or (2 if manifest["model"].get("dtype") == "bfloat16" else 4)
    numel = 0
    for key, meta in metadata.items():
        size = getattr(meta, "size", None)
        if size is not None and not key.startswith("optimizer") and (not adapter or ".lora" in key):
            numel += size.numel()
    return numel * (4 if adapter else each)


@dataclass
class ExportTarget:
    """OUT and the directory beside it the export is written into (:meth:`prepare`, :meth:`commit`)."""

    out: Path
    partial: Path
    replaces: bool  # OUT holds an export that --overwrite replaces

    @classmethod
    def prepare(cls, out: str | Path, *, overwrite: bool, needed_bytes: int | None) -> ExportTarget:
        """Check OUT (module docstring) and make the empty directory the export is written into."""
        out = Path(out).absolute()
        if out.exists() and not out.is_dir():
            raise RecipeError(
                f"OUT {out} is a file: give the path of a directory (made if it does not exist)"
            )
        entries = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
        if entries and not overwrite:
            shown = ", ".join(entries[:4]) + (f" and {len(entries) - 4} more" if len(entries) > 4 else "")
            raise RecipeError(
                f"OUT {out} is not empty ({shown}): an export goes into a new or empty directory; "
                "give another OUT, or add --overwrite to replace what is there"
            )
        existing = next(p for p in out.parents if p.exists())
        if not existing.is_dir():
            raise RecipeError(
                f"OUT {out} cannot be made: {existing} is a file: give a path under a directory"
            )
        partial = out.parent / f".{out.name}.partial"
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(partial, ignore_errors=True)  # a killed export's
            partial.mkdir()
            probe = partial / ".probe"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as e:
            raise RecipeError(
                f"OUT {out} cannot be written ({e.strerror or e}: {e.filename or out.parent}): give "
                "a directory you can write to"
            ) from e
        free = shutil.disk_usage(partial).free
        if needed_bytes is not None and needed_bytes > free:
            partial.rmdir()
            raise RecipeError(
                f"OUT {out}: the export needs about {disk_size(needed_bytes)} and its file system has "
                f"{disk_size(free)} free: free space there, or give an OUT on another file system"
            )
        return cls(out=out, partial=partial, replaces=bool(entries))

    def commit(self) -> None:
        """Rename the whole export to OUT (OUT's old content moved aside first, removed after)."""
        aside = self.out.parent / f".{self.out.name}.replaced"
        if self.out.is_dir():
            shutil.rmtree(aside, ignore_errors=True)
            os.replace(self.out, aside)
        os.replace(self.partial, self.out)
        shutil.rmtree(aside, ignore_errors=True)

    def discard(self) -> None:
        """Remove what a failed export wrote (OUT stays as it was)."""
        shutil.rmtree(self.partial, ignore_errors=True)
