"""Hydra entry point: ``python train.py [overrides]`` or ``torchrun --nproc-per-node N train.py [overrides]``.

Thin on purpose: check the command line -> Hydra -> typed config -> train. The default (no
overrides) is the embedded CPU demo; see conf/config.yaml for the groups.

A mistake in the configuration is one message naming the key and the fix, exit status 2, no
traceback (``HYDRA_FULL_ERROR=1`` shows it), and nothing written: the command line is composed
and validated before Hydra creates the run directory and before torch or Megatron-Core are
imported (about a second), and a problem found later in setup (a data file that cannot be used)
removes the run directory Hydra made for the attempt.

The check also refuses what this machine cannot run (CUDA-only choices on a CPU machine, a GPU
generation or package a backend needs: ``relax_gdn.config.machine``), importing torch only once
the configuration is valid. ``python train.py --check [--world-size N] [overrides]`` (the flags
in any place) does only that check, for a run of N processes, and exits: 0 with one line saying
what it checked (the world size, this machine, the memory model's verdict), or 2 with the
message. A launcher runs it once before it starts workers (``make run``, ``slurm/train.sbatch``).
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import signal
import sys
from functools import partial
from pathlib import Path

import hydra
from omegaconf import DictConfig

from relax_gdn.config import ParallelDims, RunConfig, validate
from relax_gdn.config.hydra_io import (
    MULTIRUN_FLAGS,
    compose_run_config,
    hydra_mode_problem,
    register_schema,
    run_config_from_hydra,
    sweep_jobs_to_compose,
)
from relax_gdn.config.machine import Machine, check_machine
from relax_gdn.errors import (
    INTERRUPTED_EXIT_CODE,
    RecipeError,
    record_exit_code,
    report_user_error,
)
from relax_gdn.launch import AT_ONCE_SIGNAL, LAUNCHED_ENV

log = logging.getLogger("train")

CONF_DIR = Path(__file__).resolve().parent / "conf"
RANK = int(os.environ.get("RANK", "0"))

# Only global rank 0 writes the run directory: other torchrun ranks tell Hydra to write no
# .hydra/ files and no job log (they learn rank 0's run directory from it after init).
if RANK != 0 and not any(a.startswith("hydra.output_subdir") for a in sys.argv):
    sys.argv += [
        "hydra.output_subdir=null",
        "hydra/job_logging=disabled",
        "hydra/hydra_logging=disabled",
        "hydra.run.dir=.",
    ]

register_schema()


def check_command_line(overrides: list[str], world_size: int | None = None, *, report: bool = False) -> None:
    """Compose and validate what Hydra is about to run (for ``world_size`` processes; None: torchrun's
    ``WORLD_SIZE``, else 1), then what this machine can run (``relax_gdn.config.machine``); a problem
    exits here with status 2. ``report``: print the line :func:`check_report` says (``--check``).

    A sweep (``-m``) is composed before its first job, once per value of each swept key (a typo is
    one message, whichever job it is in); each job validates its own combination in :func:`main`
    and removes its run directory when it fails, and the sweep goes on. Other flags (``--cfg``,
    ``--help``, ...) are left to Hydra."""
    flags = [arg for arg in overrides if arg.startswith("-")]
    if any(flag.split("=")[0] == "--world-size" for flag in flags):  # --check's option, given to a run
        report_user_error(
            RecipeError(
                "--world-size is an option of --check (python train.py --check --world-size N <overrides>); "
                "a run's world size is its launcher's: python -m relax_gdn.launch --nproc-per-node N train.py "
                "<overrides>"
            )
        )
    if flags:
        if (problem := hydra_mode_problem(overrides)) is not None:
            report_user_error(RecipeError(problem))
        if set(flags) <= MULTIRUN_FLAGS:
            check_sweep_composes([arg for arg in overrides if arg not in MULTIRUN_FLAGS])
        return
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        cfg = compose_run_config(CONF_DIR, overrides)
        dims = validate(cfg, world_size)
        machine = Machine.here(gpu_details=report)  # torch imported once the configuration is valid
        check_machine(cfg, machine)
        if report:
            print(check_report(cfg, dims, machine))
    except RecipeError as e:
        report_user_error(e)


def check_sweep_composes(overrides: list[str]) -> None:
    """``train.py -m <overrides>``: compose every value of the sweep (``sweep_jobs_to_compose``);
    a problem exits here with status 2, before Hydra starts a job."""
    try:
        for job in sweep_jobs_to_compose(overrides) or []:
            compose_run_config(CONF_DIR, job)
    except RecipeError as e:
        report_user_error(e)


def memory_verdict(cfg: RunConfig, dims: ParallelDims, machine: Machine) -> str:
    """The memory model's word on ``cfg`` for ``machine``'s first GPU; raises ``MemoryFitError``
    (as the training loop would after its start-up) where it will not fit. A CPU run has no GPU
    memory to model, and ``recompute=mixed`` without ``recompute.full_layers`` then recomputes no
    layer whole: that choice is the GPU's."""
    if not machine.cuda or cfg.train.device == "cpu":
        mixed = cfg.recompute.granularity == "mixed" and cfg.recompute.full_layers is None
        return "memory: CPU run, not modelled" + ("; recompute mixed: no layer whole on CPU" if mixed else "")
    import torch

    from relax_gdn.model.presets import PRESETS
    from relax_gdn.train.build import check_memory_fits, memory_inputs, padded_vocab_size, resolve_full_layers
    from relax_gdn.train.memory import estimate_memory

    device, bf16 = torch.device("cuda", 0), cfg.train.precision != "fp32"
    # the preset's vocabulary stands for the tokenizer's, padded as the run pads it
    vocab = padded_vocab_size(cfg, PRESETS[cfg.model.preset].vocab_size, dims.tp)
    cfg = resolve_full_layers(cfg, dims, device, bf16, vocab)
    check_memory_fits(cfg, dims, device, bf16, vocab, log=False)
    shape, settings = memory_inputs(cfg, dims, bf16, vocab)
    whole = f" ({cfg.recompute.full_layers} layers whole)" if cfg.recompute.granularity == "mixed" else ""
    estimate = estimate_memory(shape, **settings).summary()
    return f"memory: {estimate} with recompute {cfg.recompute.granularity}{whole}"


def check_report(cfg: RunConfig, dims: ParallelDims, machine: Machine) -> str:
    """The line ``--check`` prints for a run it accepts: what it checked."""
    processes = f"{dims.world_size} process{'es' if dims.world_size > 1 else ''}"
    return (
        f"train.py --check: ok for {processes} (dp {dims.dp} x cp {dims.cp} x tp {dims.tp}) on this "
        f"machine's {machine.describe()}; {memory_verdict(cfg, dims, machine)}"
    )


def check_only(argv: list[str]) -> None:
    """``python train.py --check [--world-size N] [overrides]``: :func:`check_command_line` for a run
    of N processes, then exit 0 with one line saying what was checked (or 2 with the message). Runs
    nothing and writes nothing: launchers call it once before they start workers."""
    parser = argparse.ArgumentParser(
        prog="python train.py --check",
        description="Compose and validate a run's overrides, as train.py would, without running anything.",
    )
    parser.add_argument(
        "--world-size",
        type=int,
        default=1,
        metavar="N",
        help="the processes the run will have (torchrun's nnodes x nproc-per-node; default 1)",
    )
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, as given to train.py")
    args = parser.parse_intermixed_args(argv)  # --world-size before, between or after the overrides
    check_command_line(args.overrides, world_size=args.world_size, report=True)
    raise SystemExit(0)


class MultirunUnderTorchrun(RecipeError):
    """``train.py -m`` started by torchrun: every rank would run every job."""

    same_on_every_rank = True  # every rank sees the same command line: rank 0 alone says so


def refuse_multirun_under_torchrun(argv: list[str]) -> None:
    """A sweep under torchrun would run every job on every rank, each job trying to join a process
    group the other ranks are not in. Sweeps start their own process groups: exit 2 here."""
    multirun = any(a in MULTIRUN_FLAGS or a.startswith("hydra.mode=MULTIRUN") for a in argv)
    if multirun and ("TORCHELASTIC_RUN_ID" in os.environ or "WORLD_SIZE" in os.environ):
        report_user_error(
            MultirunUnderTorchrun(
                "train.py -m (a sweep) cannot run under torchrun: every rank would run every job. Start the "
                "sweep with python; each job gets its own process group:\n"
                "  python train.py -m hydra/launcher=local hydra.launcher.tasks_per_node=N <overrides>   # this machine\n"
                "  python train.py -m hydra/launcher=slurm <overrides>                                   # SLURM\n"
                "(docs/sweeps.md)"
            )
        )


def _hydra_files_only(run_dir: Path | None) -> list[Path]:
    """What Hydra wrote into a fresh run directory (its output subdir and an empty job log), or []
    when the directory holds anything else (a directory the user pointed at, or a run's output)."""
    from hydra.core.hydra_config import HydraConfig

    if run_dir is None:
        return []
    hydra_cfg = HydraConfig.get()
    ours = {name for name in (hydra_cfg.output_subdir, f"{hydra_cfg.job.name}.log") if name}
    entries = list(run_dir.iterdir())
    if any(p.name not in ours or (p.is_file() and p.stat().st_size) for p in entries):
        return []
    return entries


def _remove_attempt(run_dir: Path, hydra_files: list[Path]) -> None:
    """Remove the run directory of an attempt that failed before writing anything of its own."""
    if not hydra_files or {p.name for p in run_dir.iterdir()} != {p.name for p in hydra_files}:
        return
    for path in hydra_files:
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    run_dir.rmdir()
    # and the parents Hydra made for it (outputs/runs/<date>/), while they are empty
    cwd = Path.cwd().resolve()
    for parent in run_dir.resolve().parents:
        if parent == cwd or cwd not in parent.parents or any(parent.iterdir()):
            break
        parent.rmdir()


def continue_job_log(hydra_run_dir: Path, run_dir: Path) -> None:
    """A resumed run logs on in the run directory it continues: Hydra's job log (the root logger's
    file handler writing into ``hydra_run_dir``, ``train.log``) is appended to the file of the same
    name in ``run_dir``, removed, and continued there, so the new directory keeps only ``.hydra/``."""
    root = logging.getLogger()
    here = hydra_run_dir.resolve()
    for handler in list(root.handlers):
        if not isinstance(handler, logging.FileHandler) or Path(handler.baseFilename).parent != here:
            continue
        job_log = Path(handler.baseFilename)
        handler.close()  # flushed: what it holds goes first
        root.removeHandler(handler)
        continued = run_dir / job_log.name
        if job_log.is_file():
            with open(continued, "ab") as out:
                out.write(job_log.read_bytes())
            job_log.unlink()
        moved = logging.FileHandler(continued, mode="a", encoding=handler.encoding)
        moved.setLevel(handler.level)
        moved.setFormatter(handler.formatter)
        root.addHandler(moved)


@hydra.main(config_path="conf", config_name="config", version_base="1.3")
def main(hydra_cfg: DictConfig) -> float | None:
    from hydra.core.hydra_config import HydraConfig

    # Read here, not the module's RANK: a sweep job (hydra/launcher=local|slurm) runs this function
    # in each of its processes from a pickled copy that carries the launching process's globals.
    rank = int(os.environ.get("RANK", "0"))
    run_dir = Path(HydraConfig.get().runtime.output_dir) if rank == 0 else None
    hydra_files = _hydra_files_only(run_dir)  # before the imports below log into the job log

    # Every process-wide change of the run (warning filters, CPU shims or FLA settings), made before
    # Megatron-Core / FLA / torch extensions are imported (they warn on import) and undone after.
    from relax_gdn.runtime import Runtime

    with Runtime(silence_warnings=not hydra_cfg.logging.show_third_party_warnings) as runtime:
        return _train(hydra_cfg, rank, run_dir, hydra_files, runtime)


def _train(
    hydra_cfg: DictConfig, rank: int, run_dir: Path | None, hydra_files: list[Path], runtime
) -> float | None:
    # imported here, after check_command_line: torch and Megatron-Core take seconds to import
    from relax_gdn.train import run_training
    from relax_gdn.train.console import print_run_summary

    on_continue = partial(continue_job_log, run_dir) if run_dir is not None else None
    try:
        result = run_training(
            run_config_from_hydra(hydra_cfg), run_dir, runtime=runtime, on_continue=on_continue
        )
    except RecipeError as e:  # the user's to fix: the message names it, a traceback would bury it
        if run_dir is not None:
            _remove_attempt(run_dir, hydra_files)
        report_user_error(e, runtime)
    if result.stop is not None:  # a stop signal or a divergence: the loop said which, once
        record_exit_code(result.stop.exit_code)
        raise SystemExit(result.stop.exit_code)
    if result.records and rank == 0:
        if hydra_cfg.logging.console:
            print_run_summary(result)
        return result.records[-1]["loss"]  # what a Hydra sweeper would optimise
    return None


def interrupted_outside_training() -> None:
    """Ctrl-C where the training loop does not handle it (Hydra's start, the imports): one line, exit 130.
    A further Ctrl-C (or relax_gdn.launch's copy of this one) is ignored from here on."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(AT_ONCE_SIGNAL, signal.SIG_IGN)
    if RANK == 0:
        sys.stderr.write("relax-gdn: Ctrl-C outside the training steps: stopped, nothing to save\n")
    record_exit_code(INTERRUPTED_EXIT_CODE)
    raise SystemExit(INTERRUPTED_EXIT_CODE)


if __name__ == "__main__":
    if os.environ.get(LAUNCHED_ENV) == "1":  # relax_gdn.launch's second Ctrl-C: as a Ctrl-C until training
        signal.signal(AT_ONCE_SIGNAL, signal.default_int_handler)
    try:
        if "--check" in sys.argv[1:]:  # anywhere: `python train.py <overrides> --check` too
            check_only([arg for arg in sys.argv[1:] if arg != "--check"])
        refuse_multirun_under_torchrun(sys.argv[1:])
        check_command_line(sys.argv[1:])
        main()
    except KeyboardInterrupt:
        interrupted_outside_training()
