"""Hydra launchers for relax-gdn sweeps: ``hydra/launcher=local`` and ``hydra/launcher=slurm``
(``conf/hydra/launcher/*.yaml``), one engine for both: hydra-submitit-launcher on submitit.

What they add to hydra-submitit-launcher's ``LocalLauncher`` / ``SlurmLauncher``:

* every job is a process group: submitit starts ``nodes x tasks_per_node`` tasks, each maps
  submitit's view of the job to torch's env:// variables (``relax_gdn.sweep``) before ``train.py``'s
  task function runs, so the training loop joins the group exactly as under torchrun;
* a config the recipe refuses is refused HERE, before the job is submitted (no process, no queue
  wait), and the job is recorded as failed with the message;
* a failed job never stops the sweep. The task returns its failure as a value instead of raising
  (a raising task makes submitit's ``results()`` raise, and the plugin returns the first result it
  cannot read, so Hydra's sweeper would stop at the first failed job). After every job has ended
  the launcher exits with the number of failed jobs (capped at 125) when any failed;
* ``sweep.json``: each job's overrides, run directory, status, return code / error and W&B id
  (``relax_gdn.sweep.SweepManifest``), rewritten when a job starts or ends; the launcher prints a
  line for each start and end, a tally when it changes, and names a job running far past the
  median duration of the finished ones (``relax_gdn.sweep.SweepProgress``);
* W&B: ``group`` = the sweep's name, ``job_type`` = the job's variant (its overrides of the keys
  the sweep varies, seeds left out), the run id fixed per job (a requeued job continues its run).

Hydra only instantiates launchers defined under ``hydra_plugins``, hence this package's place.
"""

# No ``from __future__ import annotations``: Hydra executes plugin modules without registering them in
# sys.modules, where dataclasses look string annotations up, and structured configs need real types.
import copy
import logging
import os
import shutil
import signal
import socket
import subprocess
import time
import traceback
from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, JobStatus, filter_overrides, run_job, setup_globals
from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf, LocalQueueConf, SlurmQueueConf
from hydra_plugins.hydra_submitit_launcher.submitit_launcher import BaseSubmititLauncher
from omegaconf import OmegaConf, open_dict, read_write

from relax_gdn.errors import INTERRUPTED_EXIT_CODE, PREEMPTED_EXIT_CODE, RecipeError, report_user_error
from relax_gdn.sweep import SLOW_JOB_FACTOR, job_counts

log = logging.getLogger(__name__)

# PREEMPTED_EXIT_CODE (relax_gdn.errors): train.py's exit after a stop request (SIGUSR1/SIGTERM)
# made it save a checkpoint. (A hang, relax_gdn.errors.HANG_EXIT_CODE, ends the process from the
# step watchdog's thread: the job fails with 124 and is not requeued from here.)
MAX_FAILED_EXIT_CODE = 125  # exit codes above are the shell's (126: not executable, 128+n: signal n)
POLL_SECONDS = 1.0
AT_ONCE_WAIT_S = 30.0  # after a second Ctrl-C, how long the jobs it stopped at once are waited for


@contextmanager
def _submitting():
    """SIGINT ignored while a job is submitted: the process submitit starts to run a local job (its
    controller) inherits that, so a Ctrl-C does not make it kill the job's tasks a second later,
    mid-checkpoint; each task takes SIGINT back (``_SweepLauncher.__call__``)."""
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _failed_or_stopped(rc: int) -> str:
    """A job's status for an exit code that is not 0: ``stopped`` for Ctrl-C's 130, else ``failed``."""
    return "stopped" if rc == INTERRUPTED_EXIT_CODE else "failed"


@dataclass
class LocalSweepConf(LocalQueueConf):
    """``hydra/launcher=local``: the keys of hydra-submitit-launcher's local launcher and these."""

    _target_: str = "hydra_plugins.relax_gdn_launcher.launcher.LocalSweepLauncher"
    tasks_per_node: int = 1  # processes per job (the job's world size)
    timeout_min: int = 24 * 60
    parallel_jobs: int = 1  # jobs running at once on this machine (each is tasks_per_node processes)
    wandb_group: str | None = None  # null: sweep-<date>_<time> from the sweep directory
    # name a job that has run this many times the median duration of the finished jobs (0: never)
    slow_job_factor: float = SLOW_JOB_FACTOR


@dataclass
class SlurmSweepConf(SlurmQueueConf):
    """``hydra/launcher=slurm``: the keys of hydra-submitit-launcher's SLURM launcher (partition,
    account, qos, constraint, exclude, mem_gb, additional_parameters, array_parallelism, ...) and these."""

    _target_: str = "hydra_plugins.relax_gdn_launcher.launcher.SlurmSweepLauncher"
    nodes: int = 1
    gpus_per_node: int | None = 8
    tasks_per_node: int = 8  # one rank per GPU: submitit's tasks are the ranks (no torchrun)
    cpus_per_task: int | None = 12
    timeout_min: int = 4 * 60  # the job's time limit
    # SIGUSR1 to every rank this long before the limit: each finishes its step, saves, exits 75
    signal_delay_s: int = 120
    # on exit 75 rank 0 requeues the job (and sbatch --requeue); every job runs with
    # checkpoint.resume=auto checkpoint.dir=<run dir>/checkpoints
    requeue: bool = True
    container_image: str | None = None  # pyxis/enroot: srun --container-image (a .sqsh or registry#image)
    container_mounts: str | None = None  # pyxis: srun --container-mounts (src:dst[,src:dst])
    slow_job_factor: float = SLOW_JOB_FACTOR  # name a job running this many times the finished jobs' median
    srun_args: list[str] = field(default_factory=list)  # more srun flags, e.g. ["--cpu-bind=none"]
    # lines run in the sbatch script before srun (the same environment as slurm/train.sbatch)
    setup: list[str] | None = field(
        default_factory=lambda: ["export NCCL_NVLS_ENABLE=0", "export TRITON_CACHE_AUTOTUNING=1"]
    )
    wandb_group: str | None = None


ConfigStore.instance().store(
    group="hydra/launcher", name="relax_gdn_local_schema", node=LocalSweepConf, provider="relax_gdn"
)
ConfigStore.instance().store(
    group="hydra/launcher", name="relax_gdn_slurm_schema", node=SlurmSweepConf, provider="relax_gdn"
)

_OWN_KEYS = (
    "parallel_jobs",
    "wandb_group",
    "requeue",
    "container_image",
    "container_mounts",
    "srun_args",
    "slow_job_factor",
)


@dataclass
class JobFailure:
    """What a failed task returns (picklable; submitit carries it back to the launcher)."""

    rc: int
    error: str

    def __str__(self) -> str:
        return f"exit code {self.rc}: {self.error}"


class _SweepLauncher(BaseSubmititLauncher):
    _EXECUTOR = "abstract"
    _COUNTS_CTRL_C = False  # the jobs get the terminal's Ctrl-C (local): see _counting_ctrl_c

    # ---- inside a job (every task) ---------------------------------------------------------------

    def __call__(
        self,
        sweep_overrides: list[str],
        job_dir_key: str,
        job_num: int,
        job_id: str,
        singleton_state: dict[type, Singleton],
    ) -> JobReturn | JobFailure:
        import submitit

        from relax_gdn.sweep import SweepManifest, export_torch_distributed_env, wandb_run_id

        # the job controller started with SIGINT ignored (``_submitting``), and so did this task: a
        # Ctrl-C is one here again, for train.py's stop handling
        signal.signal(signal.SIGINT, signal.default_int_handler)
        job_env = submitit.JobEnvironment()
        dist_env = export_torch_distributed_env(single_host=self._EXECUTOR == "local")
        rank = int(dist_env["RANK"])
        Singleton.set_state(singleton_state)
        setup_globals()
        overrides = list(sweep_overrides)
        if rank != 0:  # rank 0 alone writes the run directory's .hydra/ and job log
            overrides += [
                "hydra.output_subdir=null",
                "hydra/job_logging=disabled",
                "hydra/hydra_logging=disabled",
            ]
        sweep_config = self.hydra_context.config_loader.load_sweep_config(self.config, overrides)
        with open_dict(sweep_config.hydra.job) as job:
            job.id = job_env.job_id
            sweep_config.hydra.job.num = job_num
        sweep_dir = self._sweep_dir
        manifest = SweepManifest(sweep_dir)
        wandb_id = None
        if OmegaConf.select(sweep_config, "logging.wandb.mode", default="disabled") != "disabled":
            wandb_id = wandb_run_id(sweep_dir, job_num)
            os.environ["WANDB_RUN_ID"] = wandb_id  # wandb.init reads these (only rank 0 starts W&B)
            os.environ["WANDB_RESUME"] = "allow"
        if rank == 0:
            manifest.update_job(
                job_num,
                status="running",
                started=time.time(),
                host=socket.gethostname(),
                submitit_job_id=job_env.job_id,
                world_size=int(dist_env["WORLD_SIZE"]),
                wandb_id=wandb_id,
                log=str(job_env.paths.stdout),
            )
        try:
            ret = run_job(
                hydra_context=self.hydra_context,
                task_function=self.task_function,
                config=sweep_config,
                job_dir_key=job_dir_key,
                job_subdir_key="hydra.sweep.subdir",
            )
            result: JobReturn | JobFailure = ret
            if ret.status != JobStatus.COMPLETED:
                error = ret._return_value
                result = JobFailure(1, "".join(traceback.format_exception(error))[-4000:])
        except SystemExit as e:  # train.py's refusal of a config or data (exit code 2) or any other exit
            result = self._exit_result(e, rank, manifest, job_num, job_env.paths.folder)
        except KeyboardInterrupt:  # a Ctrl-C before train.py handles it (imports, start-up): nothing trained
            result = JobFailure(INTERRUPTED_EXIT_CODE, "stopped by Ctrl-C before its training steps")
        except BaseException as e:  # noqa: BLE001 - reported in the manifest, the sweep goes on
            result = JobFailure(1, "".join(traceback.format_exception(e))[-4000:])
        if rank == 0:
            if isinstance(result, JobFailure):
                manifest.update_job(
                    job_num,
                    status=_failed_or_stopped(result.rc),
                    rc=result.rc,
                    error=result.error,
                    ended=time.time(),
                )
            else:
                manifest.update_job(job_num, status="ok", rc=0, ended=time.time())
        return result

    def _exit_result(self, e: SystemExit, rank: int, manifest, job_num: int, logs) -> JobReturn | JobFailure:
        """What a task that ended with ``SystemExit`` returns: a preempted job that requeues (SLURM)
        leaves nothing (exits again), a Ctrl-C's 130 is a stop, any other code a failure."""
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if code == 0:
            return JobReturn(status=JobStatus.COMPLETED)
        if code == PREEMPTED_EXIT_CODE and self._requeues():
            if rank == 0:
                entry = manifest.update_job(
                    job_num,
                    status="submitted",
                    ended=None,
                    requeues=manifest.read_job(job_num).get("requeues", 0) + 1,
                )
                log.warning(
                    "job #%d stopped after a checkpoint (preemption or time limit): requeued (%d)",
                    job_num,
                    entry["requeues"],
                )
                subprocess.run(["scontrol", "requeue", os.environ["SLURM_JOB_ID"]], check=False)
            # leave no result behind (submitit would report the job done): the requeued job writes it
            raise SystemExit(code) from None
        if code == INTERRUPTED_EXIT_CODE:
            return JobFailure(
                code,
                f"stopped by Ctrl-C; the task logs in {logs} say after which step and with which checkpoint",
            )
        if e.__context__ is not None:  # train.py exits in an ``except`` block: the error it reported
            return JobFailure(code, str(e.__context__))
        return JobFailure(code, f"exited with code {code}; the task logs in {logs} say why")

    # ---- in the launching process ----------------------------------------------------------------

    def _requeues(self) -> bool:
        return False

    def _executor(self):
        import submitit

        params = dict(self.params)
        for key in _OWN_KEYS:
            params.pop(key, None)
        init = {"folder": params.pop("submitit_folder")}
        if "max_num_timeout" in params:
            init[f"{self._EXECUTOR}_max_num_timeout"] = params.pop("max_num_timeout")
        executor = submitit.AutoExecutor(cluster=self._EXECUTOR, **init)
        base = set(OmegaConf.structured(BaseQueueConf).keys())
        params.pop("_target_", None)
        params.update(self._executor_extras())
        executor.update_parameters(
            **{k if k in base else f"{self._EXECUTOR}_{k}": v for k, v in params.items()}
        )
        return executor

    def _executor_extras(self) -> dict[str, Any]:
        return {}

    def _extra_overrides(self, run_dir: str) -> list[str]:
        return []

    def _world_size(self) -> int:
        return int(self.params.get("nodes", 1)) * int(self.params.get("tasks_per_node", 1))

    def _job_config(self, overrides: list[str], job_num: int):
        sweep_config = self.hydra_context.config_loader.load_sweep_config(self.config, overrides)
        with open_dict(sweep_config.hydra.job):
            sweep_config.hydra.job.num = job_num
        return sweep_config

    def _run_dir(self, overrides: list[str], job_num: int) -> str:
        sweep_config = self._job_config(overrides, job_num)
        return str(Path(str(sweep_config.hydra.sweep.dir)) / str(sweep_config.hydra.sweep.subdir))

    def _refusal(self, overrides: list[str], job_num: int) -> str | None:
        """The recipe's refusal of the job's config (composed and validated here, with the job's
        world size, before anything is submitted), or None."""
        from relax_gdn.config import validate
        from relax_gdn.config.hydra_io import run_config_from_hydra
        from relax_gdn.errors import RecipeError

        sweep_config = self._job_config(overrides, job_num)
        task_config = copy.deepcopy(sweep_config)  # what the task function gets: no hydra node
        with read_write(task_config), open_dict(task_config):
            del task_config["hydra"]
        try:
            validate(run_config_from_hydra(task_config), self._world_size())
        except RecipeError as e:
            return str(e)
        return None

    def _report(self, manifest) -> None:
        """Print what changed since the last look at the job files (starts, ends, the tally, a slow
        job), after rewriting ``sweep.json`` from that same look: a line read off the console is
        already in the file."""
        jobs = manifest.jobs()
        lines = self._progress.update(jobs, time.time())
        if lines:
            manifest.merge(jobs)
        for level, line in lines:
            log.log(logging.getLevelName(level), "%s", line)

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        from relax_gdn.sweep import (
            SweepManifest,
            SweepProgress,
            override_key,
            sweep_wandb_group,
            variant_label,
            varying_keys,
        )

        assert self.config is not None and self.hydra_context is not None
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        sweep_dir.mkdir(parents=True, exist_ok=True)
        self._sweep_dir = sweep_dir  # resolved once here (its ${now:...}); the jobs get it pickled
        manifest = SweepManifest(sweep_dir)
        self._progress = SweepProgress(float(self.params.get("slow_job_factor", SLOW_JOB_FACTOR)))
        group = self.params.get("wandb_group") or sweep_wandb_group(sweep_dir)
        varying = varying_keys([filter_overrides(o) for o in job_overrides])
        manifest.merge(
            launcher=self._EXECUTOR,
            wandb_group=group,
            varying_keys=varying,
            world_size_per_job=self._world_size(),
        )
        log.info(
            "%s sweep of %d jobs x %d processes; sweep dir %s; W&B group %s",
            self._EXECUTOR,
            len(job_overrides),
            self._world_size(),
            sweep_dir,
            group,
        )

        to_run: list[tuple[int, list[str]]] = []
        for offset, job in enumerate(job_overrides):
            num = initial_job_idx + offset
            user = list(job)
            keys = {override_key(o) for o in user}
            variant = variant_label(filter_overrides(user), varying)
            added = [
                f"{k}={v}"
                for k, v in (
                    ("logging.wandb.group", _quoted(group)),
                    ("logging.wandb.job_type", _quoted(variant)),
                )
                if k not in keys
            ]
            run_dir = self._run_dir(user, num)
            added += [o for o in self._extra_overrides(run_dir) if override_key(o) not in keys]
            overrides = user + added
            refusal = self._refusal(overrides, num)
            if refusal is not None:  # no run directory: nothing ran (the progress report prints it)
                manifest.update_job(
                    num,
                    overrides=list(filter_overrides(user)),
                    variant=variant,
                    run_dir=None,
                    status="failed",
                    refused=True,
                    rc=2,
                    error=refusal,
                    ended=time.time(),
                )
                continue
            manifest.update_job(
                num,
                overrides=list(filter_overrides(user)),
                variant=variant,
                run_dir=run_dir,
                status="submitted",
                rc=None,
                error=None,
            )
            log.info("\t#%d : %s", num, " ".join(filter_overrides(user)))
            to_run.append((num, overrides))
        manifest.merge()
        self._report(manifest)

        from relax_gdn.errors import RecipeError

        try:
            results = self._run(to_run, manifest)
        except RecipeError as e:  # the launcher's own settings (e.g. more GPUs per job than visible)
            log.error("%s", e)
            raise SystemExit(2) from None
        self._report(manifest)
        entries = [manifest.read_job(initial_job_idx + i) for i in range(len(job_overrides))]
        failed = [e for e in entries if e.get("status") != "ok"]
        manifest.merge(finished=time.time())
        if getattr(self, "_ctrl_c", 0):
            self._end_interrupted(manifest, sweep_dir)
        if failed:
            which = ", ".join(f"#{e['num']} (exit {e.get('rc')})" for e in failed)
            log.error(
                "%d of %d jobs failed: %s; sweep.json in %s says why",
                len(failed),
                len(entries),
                which,
                sweep_dir,
            )
            raise SystemExit(min(len(failed), MAX_FAILED_EXIT_CODE))
        log.info("all %d jobs ok; sweep.json in %s", len(entries), sweep_dir)
        return [results[num] for num in sorted(results)]

    def _slots(self, n_jobs: int) -> list[dict[str, Any]] | None:
        """Executor parameters per concurrent job (each job takes a free slot), or None to submit
        every job at once (the scheduler decides)."""
        return None

    def _run(self, jobs: list[tuple[int, list[str]]], manifest) -> dict[int, JobReturn]:
        """Submit ``jobs`` (one per free slot, or all at once as a job array) and wait for every
        one, recording each result as it arrives. A Ctrl-C (the terminal's reaches the running
        jobs too, which stop after a checkpoint) ends the submitting: the jobs not started are
        recorded as not run, and the running ones are waited for; a second Ctrl-C (which stops them
        at once) ends the waiting within :data:`AT_ONCE_WAIT_S`."""
        if not jobs:
            return {}
        executor = self._executor()
        state = Singleton.get_state()
        slots = self._slots(len(jobs))
        free = list(range(len(slots))) if slots is not None else []
        pending, running, results = list(jobs), {}, {}

        def submit(batch, slot=None):
            if slot is not None:
                executor.update_parameters(**slots[slot])
            with _submitting(), executor.batch():  # a job array on SLURM
                submitted = [
                    executor.submit(self, ov, "hydra.sweep.dir", num, f"job_id_for_{num}", state)
                    for num, ov in batch
                ]
            for (num, _), job in zip(batch, submitted):
                running[num] = (job, slot)
                manifest.record_submission(num, job.job_id)
            manifest.merge()
            self._report(manifest)

        with self._counting_ctrl_c():
            if slots is None:
                submit(pending)
                pending = []
            while (pending or running) and not self._given_up(running, manifest):
                if self._ctrl_c and pending:
                    self._not_run([num for num, _ in pending], manifest)
                    pending = []
                while pending and free:
                    submit([pending.pop(0)], free.pop(0))
                for num, (job, slot) in list(running.items()):
                    if job.done():
                        results[num] = self._collect(num, job, manifest)
                        del running[num]
                        if slot is not None:
                            free.append(slot)
                self._report(manifest)
                if running:
                    time.sleep(POLL_SECONDS)
        return results

    # ---- Ctrl-C ---------------------------------------------------------------------------------

    @contextmanager
    def _counting_ctrl_c(self):
        """While jobs are submitted and waited for, SIGINT counts presses (``_ctrl_c``) instead of
        raising wherever the launcher is (a half-written sweep.json); put back after. Only where
        the jobs run on this machine, in the terminal's process group (``_COUNTS_CTRL_C``): a
        Ctrl-C of a SLURM sweep's launcher ends the launcher, its jobs run on."""
        self._ctrl_c, self._second_ctrl_c_at = 0, None
        if not self._COUNTS_CTRL_C:
            yield
            return

        def pressed(signum, frame):
            self._ctrl_c += 1
            if self._ctrl_c == 2:
                self._second_ctrl_c_at = time.monotonic()

        previous = signal.signal(signal.SIGINT, pressed)
        try:
            yield
        finally:
            signal.signal(signal.SIGINT, previous)

    def _not_run(self, nums: list[int], manifest) -> None:
        for num in nums:
            manifest.update_job(num, status="not_run", rc=None, error="the sweep was stopped by Ctrl-C first")
        manifest.merge()

    def _given_up(self, running: dict[int, Any], manifest) -> bool:
        """After a second Ctrl-C: whether the jobs still running are no longer waited for (past
        :data:`AT_ONCE_WAIT_S`); they are then recorded as stopped at once."""
        if self._second_ctrl_c_at is None or time.monotonic() - self._second_ctrl_c_at < AT_ONCE_WAIT_S:
            return False
        for num in running:
            self._stopped_at_once(num, manifest)
        return True

    @staticmethod
    def _stopped_at_once(num: int, manifest) -> None:
        manifest.update_job(
            num,
            status="stopped",
            rc=INTERRUPTED_EXIT_CODE,
            ended=time.time(),
            error="stopped at once by a second Ctrl-C (nothing saved since its last checkpoint)",
        )

    def _end_interrupted(self, manifest, sweep_dir: Path) -> None:
        """One line saying what each job became, then exit 130."""
        counts = job_counts(manifest.jobs())
        parts = [
            f"{counts[status]} {status.replace('_', ' ')}"
            for status in ("stopped", "not_run", "ok", "failed")
            if counts[status]
        ]
        log.warning("sweep stopped by Ctrl-C: %s; sweep.json in %s", ", ".join(parts), sweep_dir)
        raise SystemExit(INTERRUPTED_EXIT_CODE)

    def _collect(self, num: int, job, manifest) -> JobReturn:
        """The launcher's final word on a job: every task's result, or submitit's error (a task
        that crashed, was killed or timed out leaves no result)."""
        try:
            outcomes = job.results()
        except Exception as e:  # noqa: BLE001 - the job is failed; the sweep goes on
            if self._ctrl_c:  # its tasks stopped at once on a second Ctrl-C, leaving no result
                self._stopped_at_once(num, manifest)
                return JobReturn(status=JobStatus.FAILED, _return_value=RuntimeError("stopped by Ctrl-C"))
            error = str(e).strip()[-4000:]
            manifest.update_job(
                num, status="failed", rc=manifest.read_job(num).get("rc") or 1, error=error, ended=time.time()
            )
            return JobReturn(status=JobStatus.FAILED, _return_value=RuntimeError(error))
        failures = [o for o in outcomes if isinstance(o, JobFailure)]
        if failures:
            first = failures[0]
            ended = manifest.read_job(num).get("ended") or time.time()  # rank 0's, when it wrote one
            manifest.update_job(
                num,
                status=_failed_or_stopped(first.rc),
                rc=first.rc,
                error=first.error,
                ended=ended,
                failed_tasks=len(failures),
                tasks=len(outcomes),
            )
            return JobReturn(status=JobStatus.FAILED, _return_value=RuntimeError(str(first)))
        manifest.update_job(num, status="ok", rc=0)
        return outcomes[0]


def _remove_unformatted_folder(folder: str) -> None:
    """submitit's local job controller creates the folder it is given with ``%j`` unformatted
    before it formats the job id into the paths it writes (submitit 1.5.4,
    ``local._local.Controller.start_tasks``): an empty ``.submitit/%j`` would stay behind."""
    path = Path(folder)
    if "%" in path.name and path.is_dir() and not any(path.iterdir()):
        path.rmdir()


def _quoted(value: str) -> str:
    """A Hydra override value that keeps ``=`` and ``,`` (a bare ``,`` would start a sweep)."""
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


class LocalSweepLauncher(_SweepLauncher):
    """``hydra/launcher=local``: jobs as process groups on this machine (submitit's local executor)."""

    _EXECUTOR = "local"
    _COUNTS_CTRL_C = True

    def _world_size(self) -> int:
        return int(self.params.get("tasks_per_node", 1))  # one host

    def _executor(self):
        """submitit's LocalExecutor itself (not through AutoExecutor, which does not pass on the
        GPU ids each slot sets)."""
        import submitit

        executor = submitit.LocalExecutor(folder=self.params["submitit_folder"])
        executor.update_parameters(
            **{
                k: self.params[k]
                for k in ("timeout_min", "tasks_per_node", "stderr_to_stdout")
                if self.params.get(k) is not None
            }
        )
        return executor

    def _run(self, jobs: list[tuple[int, list[str]]], manifest) -> dict[int, JobReturn]:
        try:
            return super()._run(jobs, manifest)
        finally:
            _remove_unformatted_folder(str(self.params["submitit_folder"]))

    def _slots(self, n_jobs: int) -> list[dict[str, Any]] | None:
        """``parallel_jobs`` slots, each with its own GPUs: submitit's local executor shows a job
        only the GPUs it is given (``CUDA_VISIBLE_DEVICES``), none by default."""
        import torch

        from relax_gdn.errors import RecipeError
        from relax_gdn.sweep import gpu_slots, visible_gpu_ids

        parallel = max(1, min(int(self.params.get("parallel_jobs") or 1), n_jobs))
        visible = visible_gpu_ids(os.environ.get("CUDA_VISIBLE_DEVICES"), torch.cuda.device_count())
        per_job = self.params.get("gpus_per_node")
        if per_job is None:  # one GPU per process where there are GPUs
            per_job = int(self.params.get("tasks_per_node", 1)) if visible else 0
        try:
            return [
                {"gpus_per_node": len(gpus), "visible_gpus": gpus}
                for gpus in gpu_slots(visible, int(per_job), parallel)
            ]
        except ValueError as e:
            raise RecipeError(f"hydra/launcher=local: {e}") from None


class SlurmSweepLauncher(_SweepLauncher):
    """``hydra/launcher=slurm``: each job an sbatch allocation of ``nodes x tasks_per_node`` ranks."""

    _EXECUTOR = "slurm"

    def setup(self, **kwargs) -> None:
        # before Hydra's sweeper writes the sweep directory: submitit would fail at its first job,
        # a traceback and exit 1, leaving the directory behind
        missing = [tool for tool in ("sbatch", "srun") if shutil.which(tool) is None]
        if missing:
            report_user_error(
                RecipeError(
                    f"hydra/launcher=slurm submits each job with SLURM's sbatch and srun, and this machine "
                    f"has no {' or '.join(missing)} on its PATH: start the sweep on a SLURM login node, or "
                    "run it here with hydra/launcher=local (docs/sweeps.md)"
                )
            )
        super().setup(**kwargs)

    def _requeues(self) -> bool:
        return bool(self.params.get("requeue"))

    def _executor_extras(self) -> dict[str, Any]:
        srun = list(self.params.get("srun_args") or [])
        if self.params.get("container_image"):
            srun.append(f"--container-image={self.params['container_image']}")
        if self.params.get("container_mounts"):
            srun.append(f"--container-mounts={self.params['container_mounts']}")
        extras: dict[str, Any] = {"srun_args": srun} if srun else {}
        additional = dict(self.params.get("additional_parameters") or {})
        # SIGUSR1 to every rank signal_delay_s before the time limit: the training loop finishes its
        # step, saves a checkpoint and exits with PREEMPTED_EXIT_CODE (submitit's own USR2 handler
        # would requeue without saving).
        additional.setdefault("signal", f"USR1@{self.params.get('signal_delay_s', 120)}")
        if self.params.get("requeue"):
            additional.setdefault("requeue", True)  # sbatch --requeue: Slurm may requeue on preemption
        extras["additional_parameters"] = additional
        return extras

    def _extra_overrides(self, run_dir: str) -> list[str]:
        # A requeued job runs the same overrides again and continues from the newest checkpoint
        # in its own run directory (the same path after every requeue).
        if not self.params.get("requeue"):
            return []
        return ["checkpoint.resume=auto", f"checkpoint.dir={_quoted(str(Path(run_dir) / 'checkpoints'))}"]
