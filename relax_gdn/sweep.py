"""Sweep bookkeeping shared by the Hydra launchers (``hydra_plugins/relax_gdn_launcher``) and the
tools that read a sweep: the manifest, variant labels, W&B ids and the torch.distributed
environment of a submitit task. No Hydra here.

The manifest: each job owns ``<sweep dir>/.jobs/<num>.json`` (written atomically by the
launcher when it submits or refuses the job, by the job's rank 0 when it starts and ends, and by
the launcher again when it collects the result). ``sweep.json`` is the merge of those files,
rewritten by the launcher whenever it sees a job change state (it reads the job files every
poll: :class:`SweepProgress` says what changed). Per-job files instead of one locked file:
jobs on different nodes never write the same file, and ``rename`` is atomic on the shared
filesystems SLURM clusters use (advisory locks on NFS are not reliable).
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MANIFEST_NAME = "sweep.json"
JOB_FILES_DIR = ".jobs"
MANIFEST_VERSION = 1
# a job stopped by Ctrl-C (after its checkpoint, or at once) is "stopped", one the sweep never
# started after a Ctrl-C "not_run": neither is a failure
STATUSES = ("submitted", "running", "ok", "failed", "stopped", "not_run")
# Keys that make a job a repeat, not a different variant (W&B job_type, compare's grouping).
REPEAT_KEYS = ("train.seed",)
MAX_JOB_TYPE_CHARS = 64  # W&B's limit
SLOW_JOB_FACTOR = 3.0  # a job running this many times its finished siblings' median duration is named
MAX_ERROR_CHARS = 300  # of a job's error in its one progress line (sweep.json keeps the whole message)


def atomic_write_json(path: Path, value: Any) -> None:
    """Write ``value`` to ``path`` so that a reader sees the old file or the new one, never half."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(value, indent=2, sort_keys=False) + "\n")
    os.replace(tmp, path)


def override_key(override: str) -> str:
    """``"gdn.cp_mode=headwise"`` -> ``"gdn.cp_mode"`` (``+``/``++``/``~`` prefixes dropped)."""
    return override.split("=", 1)[0].lstrip("+~")


def varying_keys(job_overrides: Sequence[Sequence[str]]) -> list[str]:
    """Override keys whose value differs between the jobs of a sweep (a key only some jobs set
    differs too), in first-seen order."""
    per_job = [{override_key(o): o.split("=", 1)[-1] for o in overrides} for overrides in job_overrides]
    keys = dict.fromkeys(k for job in per_job for k in job)
    return [k for k in keys if len({job.get(k) for job in per_job}) > 1]


def variant_label(overrides: Iterable[str], varying: Sequence[str]) -> str:
    """What this job compares: its overrides of the varying keys, repeats (seed) left out, e.g.
    ``gdn.cp_mode=headwise``; ``default`` when nothing but the seed varies."""
    parts = [o for o in overrides if override_key(o) in varying and override_key(o) not in REPEAT_KEYS]
    return ",".join(parts)[:MAX_JOB_TYPE_CHARS] or "default"


def sweep_wandb_group(sweep_dir: str | Path) -> str:
    """The W&B group of a sweep: ``sweep-`` + the sweep directory's last two parts
    (``outputs/sweeps/2026-12-01/11-40-00`` -> ``sweep-2026-12-01_11-40-00``)."""
    parts = Path(sweep_dir).resolve().parts[-2:]
    return "sweep-" + "_".join(parts)


def wandb_run_id(sweep_dir: str | Path, job_num: int) -> str:
    """A W&B run id fixed by (sweep directory, job number): the manifest knows it before the run
    starts, and a requeued job continues the same W&B run."""
    digest = hashlib.sha1(f"{Path(sweep_dir).resolve()}#{job_num}".encode()).hexdigest()
    return digest[:16]


class SweepManifest:
    """``sweep.json`` and the per-job files it is merged from (see the module docstring)."""

    def __init__(self, sweep_dir: str | Path):
        self.sweep_dir = Path(sweep_dir)
        self.jobs_dir = self.sweep_dir / JOB_FILES_DIR
        self.path = self.sweep_dir / MANIFEST_NAME

    def _job_path(self, job_num: int) -> Path:
        return self.jobs_dir / f"{job_num}.json"

    def read_job(self, job_num: int) -> dict[str, Any]:
        path = self._job_path(job_num)
        return json.loads(path.read_text()) if path.exists() else {"num": job_num}

    def update_job(self, job_num: int, **fields: Any) -> dict[str, Any]:
        """Merge ``fields`` into the job's file (the only writer of a job's file at a time is the
        launcher before/after the job, or the job's rank 0 while it runs)."""
        entry = self.read_job(job_num)
        if "status" in fields:
            assert fields["status"] in STATUSES, fields["status"]
        entry.update(fields, updated=time.time())
        atomic_write_json(self._job_path(job_num), entry)
        return entry

    def record_submission(self, job_num: int, submitit_job_id: str) -> None:
        """The scheduler's id of a submitted job, in a file of the launcher's own: the job may
        already be writing its file (a local job starts before ``submit`` returns), and two
        writers of one file would lose one's update."""
        atomic_write_json(self.jobs_dir / f"{job_num}.submission", {"submitit_job_id": submitit_job_id})

    def jobs(self) -> list[dict[str, Any]]:
        if not self.jobs_dir.is_dir():
            return []
        entries = [json.loads(p.read_text()) for p in self.jobs_dir.glob("*.json")]
        for entry in entries:  # what the job wrote itself wins
            submission = self.jobs_dir / f"{entry['num']}.submission"
            if submission.exists():
                entry.setdefault("submitit_job_id", json.loads(submission.read_text())["submitit_job_id"])
        return sorted(entries, key=lambda e: e["num"])

    def merge(self, jobs: Sequence[dict[str, Any]] | None = None, **sweep_fields: Any) -> dict[str, Any]:
        """Rewrite ``sweep.json`` from the job files (or from ``jobs``, entries :meth:`jobs` read);
        ``sweep_fields`` (launcher, W&B group, ...) are kept from the previous ``sweep.json``
        unless given again."""
        previous = json.loads(self.path.read_text()) if self.path.exists() else {}
        jobs = self.jobs() if jobs is None else list(jobs)
        counts = job_counts(jobs)
        manifest = {
            "version": MANIFEST_VERSION,
            "sweep_dir": str(self.sweep_dir),
            **{k: v for k, v in previous.items() if k not in ("version", "sweep_dir", "jobs", "counts")},
            **sweep_fields,
            "counts": counts,
            "jobs": jobs,
        }
        atomic_write_json(self.path, manifest)
        return manifest


def job_counts(jobs: Sequence[dict[str, Any]]) -> dict[str, int]:
    """Jobs per status, and ``refused``: how many of the failed ones the launcher refused before
    submitting them (a config the recipe rejects)."""
    counts = {s: sum(j.get("status") == s for j in jobs) for s in STATUSES}
    counts["refused"] = sum(bool(j.get("refused")) for j in jobs)
    return counts


def _clock(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


def _one_line(error: str | None) -> str:
    """A job's error as one line: a traceback's last line (the exception), else the message's lines
    joined (a recipe error: its headline first, then the problems or the records it names)."""
    lines = [line.strip() for line in (error or "").splitlines() if line.strip()]
    text = lines[-1] if lines and "Traceback (most recent call last)" in error else " ".join(lines)
    return text if len(text) <= MAX_ERROR_CHARS else text[: MAX_ERROR_CHARS - 3] + "..."


def _duration(job: dict[str, Any]) -> float | None:
    started, ended = job.get("started"), job.get("ended")
    return ended - started if started is not None and ended is not None else None


@dataclass
class SweepProgress:
    """What a person watching a sweep reads, from successive reads of its job entries
    (:meth:`SweepManifest.jobs`): a line when a job starts, ends (exit code, duration, run
    directory) or is requeued, the tally when it changes, and, once per job, a job that has run
    ``slow_factor`` times the median duration of the jobs that finished (0: never)."""

    slow_factor: float = SLOW_JOB_FACTOR
    _seen: dict[int, tuple[str | None, float | None]] = field(default_factory=dict, init=False, repr=False)
    _named_slow: set[int] = field(default_factory=set, init=False, repr=False)
    _tally: str | None = field(default=None, init=False, repr=False)

    def update(self, jobs: Sequence[dict[str, Any]], now: float) -> list[tuple[str, str]]:
        """``(level, line)`` for what changed since the last call; level is a logging level name."""
        lines: list[tuple[str, str]] = []
        for job in jobs:
            state = (job.get("status"), job.get("started"))
            if self._seen.get(job["num"]) != state:
                self._seen[job["num"]] = state
                lines += self._job_lines(job)
        lines += self._slow_lines(jobs, now)
        tally = self.tally(jobs)
        if tally != self._tally:
            self._tally = tally
            lines.append(("INFO", tally))
        return lines

    @staticmethod
    def tally(jobs: Sequence[dict[str, Any]]) -> str:
        counts = job_counts(jobs)
        refused = f" ({counts['refused']} refused)" if counts["refused"] else ""
        stopped = "".join(
            f", {counts[status]} {status.replace('_', ' ')}"
            for status in ("stopped", "not_run")
            if counts[status]
        )
        return (
            f"sweep: {counts['running']} running, {counts['ok']} ok, {counts['failed']} failed{refused}"
            f"{stopped}, {counts['submitted']} waiting (of {len(jobs)})"
        )

    @staticmethod
    def _job_lines(job: dict[str, Any]) -> list[tuple[str, str]]:
        num, status, run_dir = job["num"], job.get("status"), job.get("run_dir")
        if job.get("refused"):
            return [
                (
                    "ERROR",
                    f"job #{num} refused (exit {job.get('rc')}), not run: {_one_line(job.get('error'))}",
                )
            ]
        if status == "running":
            where = f" on {job['host']}" if job.get("host") else ""
            return [("INFO", f"job #{num} started{where} ({job.get('variant')}): {run_dir}")]
        took = _duration(job)
        took = f", {_clock(took)}" if took is not None else ""
        if status == "ok":
            return [("INFO", f"job #{num} ok (exit 0{took}): {run_dir}")]
        if status == "failed":
            return [
                (
                    "ERROR",
                    f"job #{num} failed (exit {job.get('rc')}{took}): {run_dir}: "
                    f"{_one_line(job.get('error'))}",
                )
            ]
        if status == "stopped":
            return [
                (
                    "WARNING",
                    f"job #{num} stopped by Ctrl-C (exit {job.get('rc')}{took}): {run_dir}: "
                    f"{_one_line(job.get('error'))}",
                )
            ]
        if status == "not_run":
            return [("WARNING", f"job #{num} not run: the sweep was stopped by Ctrl-C before it started")]
        if status == "submitted" and job.get("requeues"):
            return [("WARNING", f"job #{num} requeued after a checkpoint ({job['requeues']}): {run_dir}")]
        return []

    def _slow_lines(self, jobs: Sequence[dict[str, Any]], now: float) -> list[tuple[str, str]]:
        durations = [d for d in map(_duration, jobs) if d is not None]
        if not durations or self.slow_factor <= 0:
            return []
        median = statistics.median(durations)
        lines = []
        for job in jobs:
            if job.get("status") != "running" or job.get("started") is None or job["num"] in self._named_slow:
                continue
            elapsed, typical = now - job["started"], max(median, 1.0)
            if elapsed > self.slow_factor * typical:
                self._named_slow.add(job["num"])
                log = f"; its output: {job['log']}" if job.get("log") else ""
                lines.append(
                    (
                        "WARNING",
                        f"job #{job['num']} has run {_clock(elapsed)}, {elapsed / typical:.1f}x "
                        f"the median {_clock(median)} of the {len(durations)} finished "
                        f"job(s): {job.get('run_dir')}{log}",
                    )
                )
        return lines


def visible_gpu_ids(cuda_visible_devices: str | None, device_count: int) -> list[int]:
    """The GPU ids this process may hand out: ``CUDA_VISIBLE_DEVICES`` when set (numeric ids),
    else ``0..device_count-1``."""
    if cuda_visible_devices is None:
        return list(range(device_count))
    ids = [part.strip() for part in cuda_visible_devices.split(",") if part.strip()]
    if not all(part.isdigit() for part in ids):
        raise ValueError(f"CUDA_VISIBLE_DEVICES={cuda_visible_devices!r}: local sweeps need numeric GPU ids")
    return [int(part) for part in ids]


def gpu_slots(visible: Sequence[int], per_job: int, parallel_jobs: int) -> list[tuple[int, ...]]:
    """Disjoint GPU sets for jobs running at once on one machine: ``parallel_jobs`` slots of
    ``per_job`` GPUs each (fewer slots when the GPUs run out); ``per_job=0``: CPU jobs, no GPUs."""
    if per_job == 0:
        return [()] * parallel_jobs
    if per_job > len(visible):
        raise ValueError(
            f"a job needs {per_job} GPUs (hydra.launcher.gpus_per_node, default tasks_per_node) "
            f"but {len(visible)} are visible ({list(visible)})"
        )
    n = min(parallel_jobs, len(visible) // per_job)
    return [tuple(visible[k * per_job : (k + 1) * per_job]) for k in range(n)]


def export_torch_distributed_env(single_host: bool) -> dict[str, str]:
    """Inside a submitit task: set RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and
    MASTER_PORT (torch's env:// rendezvous, what torchrun would set) from submitit's view of the job
    (SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID and the first host of the node list on SLURM; the local
    executor's task numbers locally). ``CUDA_VISIBLE_DEVICES`` is left alone: every task sees all
    GPUs of its node and picks ``LOCAL_RANK`` (peer-memory transports need the peers visible)."""
    from submitit.helpers import TorchDistributedEnvironment

    env = TorchDistributedEnvironment()
    if single_host:  # the local executor: loopback, not whatever the hostname resolves to
        env.master_addr = "127.0.0.1"
    env.export(set_cuda_visible_devices=False, overwrite=True)
    return {
        k: os.environ[k]
        for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    }
