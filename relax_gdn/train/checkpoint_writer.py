"""Writing one checkpoint so that no work is lost: :class:`CheckpointWriter`.

Atomicity: every rank writes into ``.step_N.partial``; when all are done, rank 0 writes the
manifest, renames the directory to ``step_N`` (one rename: a checkpoint is either complete or
invisible) and then rewrites ``latest`` (temporary file + rename). A ``kill -9`` at any point
leaves the previous checkpoint complete and loadable. Keeping the newest ``checkpoint.keep_last``
happens after that, on rank 0.

A write that the file system refuses is one agreed message
(:func:`relax_gdn.train.checkpoint_disk.raise_if_disk_problem`); any other failure keeps its
traceback.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist

from relax_gdn.compat.write_results import dies_with_parent
from relax_gdn.train.agreement import agree_on_errors
from relax_gdn.train.checkpoint import (
    FORMAT,
    FORMAT_VERSION,
    LATEST,
    MANIFEST,
    PARTIAL_SUFFIX,
    complete_checkpoints,
    fsync_dir,
    partial_dir,
    step_dir,
    write_text_atomically,
)
from relax_gdn.train.checkpoint_disk import WRITE_FAILURES, raise_if_disk_problem

logger = logging.getLogger("relax_gdn.train")


class CheckpointWriter:
    """Writes checkpoints into ``root`` (a collective: every rank calls :meth:`save` at the same
    steps), keeping the newest ``keep_last`` (0: all).

    ``async_save`` (CUDA only): Megatron-Core writes the shards in a background process
    (``AsyncCallsQueue``); the rename and ``latest`` happen when every rank's write is done,
    checked without blocking after each step (:meth:`poll`) and at the end (:meth:`finish`).
    The writer's helper processes die with their rank (:mod:`relax_gdn.compat.write_results`,
    installed through ``runtime``, the :class:`relax_gdn.runtime.Runtime`)."""

    def __init__(self, root: Path, *, keep_last: int, dp_cp_group, async_save: bool, runtime):
        self.root, self.keep_last, self.dp_cp_group, self.async_save = (
            root,
            keep_last,
            dp_cp_group,
            async_save,
        )
        # (step, seconds the training loop was blocked, seconds until the checkpoint was published)
        self.timings: list[tuple[int, float, float]] = []
        self._queue = None
        self._in_flight: Path | None = None  # the checkpoint an async save is writing
        runtime.checkpoint_write_results(background=async_save)
        if async_save:
            from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

            self._queue = AsyncCallsQueue()

    def save(self, step: int, *, state: Callable[[], dict[str, Any]], manifest: dict[str, Any]) -> Path:
        """Write step ``step``'s checkpoint: ``state()`` (taken once the save before it is complete
        and the directory exists; :func:`relax_gdn.train.checkpoint_state.state_to_save`) and
        ``manifest`` (the run's part of ``relax_gdn.json``). Returns where it will be once published."""
        from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
        from megatron.core.dist_checkpointing.strategies.fully_parallel import (
            FullyParallelSaveStrategyWrapper,
        )

        started = time.perf_counter()
        final = step_dir(self.root, step)
        partial = partial_dir(final)
        self._finalize(blocking=True)  # one save in flight at a time
        agree_on_errors(lambda: self._make_partial(partial, final))
        sharded = state()
        # replicated tensors (DP and CP replicas) are written by one rank each, spread over the group
        strategy = FullyParallelSaveStrategyWrapper(
            get_default_save_sharded_strategy("torch_dist"), self.dp_cp_group
        )
        manifest = {"format": FORMAT, "format_version": FORMAT_VERSION, "step": step, **manifest}
        publish = (partial, final, manifest, started)
        if self._queue is None:
            self._write_inline(sharded, strategy, publish)
        else:
            self._write_in_background(sharded, strategy, publish)
        return final

    def _write_inline(self, sharded: dict[str, Any], strategy, publish: tuple) -> None:
        from megatron.core import dist_checkpointing

        partial, final = publish[:2]
        try:
            dist_checkpointing.save(sharded, str(partial), strategy, async_strategy="mcore")
        except WRITE_FAILURES as e:
            raise_if_disk_problem(self.root, final, e)
            raise
        self._publish(*publish, blocked=0.0)

    def _write_in_background(self, sharded: dict[str, Any], strategy, publish: tuple) -> None:
        from megatron.core import dist_checkpointing

        partial, final, _, started = publish
        request = dist_checkpointing.save(
            sharded, str(partial), strategy, async_sharded_save=True, async_strategy="mcore"
        )
        request = request._replace(async_fn=dies_with_parent(request.async_fn))  # the forked writer
        blocked = {}  # until the write is handed to the writer process (its time is set below)
        request.add_finalize_fn(lambda: self._publish(*publish, blocked=blocked["s"]))
        self._queue.schedule_async_request(request)
        self._in_flight = final
        blocked["s"] = time.perf_counter() - started

    def _make_partial(self, partial: Path, final: Path) -> None:
        """Rank 0 makes the empty ``.step_N.partial`` every rank writes into (a failure to: agreed)."""
        if dist.get_rank() != 0:
            return
        try:
            shutil.rmtree(partial, ignore_errors=True)
            partial.mkdir(parents=True)
        except OSError as e:
            raise_if_disk_problem(self.root, final, e, agreed=False)
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
        except WRITE_FAILURES as e:
            raise_if_disk_problem(self.root, self._in_flight, e)
            raise
        if done:
            self._in_flight = None

    def _publish(
        self, partial: Path, final: Path, manifest: dict[str, Any], started: float, blocked: float
    ) -> None:
        """When every rank's shards are written (a collective): rank 0 writes the manifest, renames
        ``partial`` to ``final``, rewrites ``latest`` and prunes; a file-system failure there is
        one agreed message."""
        dist.barrier()
        agree_on_errors(lambda: self._publish_on_rank0(partial, final, manifest))
        total = time.perf_counter() - started
        self.timings.append((int(manifest["step"]), blocked or total, total))
        if dist.get_rank() == 0:
            logger.info(
                "checkpoint %s saved (%.1f s%s)",
                final,
                total,
                f", training blocked {blocked:.1f} s" if blocked else "",
            )

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
            fsync_dir(final.parent)
            write_text_atomically(final.parent / LATEST, final.name + "\n")
        except OSError as e:
            raise_if_disk_problem(self.root, final, e, agreed=False)
            raise
        self._prune()

    def _prune(self) -> None:
        """Keep the newest ``keep_last`` complete checkpoints (0: all); drop abandoned partial saves."""
        for stale in self.root.glob(f".step_*{PARTIAL_SUFFIX}"):
            shutil.rmtree(stale, ignore_errors=True)
        if self.keep_last > 0:
            for old in complete_checkpoints(self.root)[self.keep_last :]:
                shutil.rmtree(old, ignore_errors=True)
