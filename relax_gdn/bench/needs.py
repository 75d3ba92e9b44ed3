"""What a benchmark needs of the machine, checked first thing in its ``main``: where it cannot run
(no CUDA, too few GPUs, not started as one process per GPU) it says so in one line on stderr and
exits with code 2, before any GPU call and before Megatron-Core or FLA are imported, instead of a
driver traceback. Also the command-line arguments benchmarks share (``--cuda-alloc-conf``, the
``--steps`` / ``--skip`` defaults)."""

from __future__ import annotations

import argparse
import os

import torch

from relax_gdn.errors import RecipeError, report_user_error


class MachineError(RecipeError):
    """This machine cannot run the benchmark as started; the message says what it needs."""

    same_on_every_rank = True  # every rank of a torchrun job sees the same GPUs


def gpu_problem(module: str, gpus: int, more_ok: bool, visible: int, world_size: int | None) -> str | None:
    """Why ``python -m <module>`` cannot run with ``visible`` CUDA devices in a job of ``world_size``
    processes (None: not started by torchrun), or None. ``gpus`` > 1: one process per GPU through
    torchrun, exactly ``gpus`` of them (``more_ok``: at least)."""
    many = gpus > 1
    command = f"torchrun --nproc-per-node {gpus} -m {module}" if many else f"python -m {module}"
    if visible < gpus:
        here = "no CUDA GPU is visible here" if visible == 0 else f"{visible} are visible here"
        need = f"{'at least ' if more_ok else ''}{gpus} CUDA GPUs" if many else "a CUDA GPU"
        return f"{module} needs {need}; {here}. Run it on a GPU host: {command}"
    if many and (world_size is None or world_size < gpus or (world_size > gpus and not more_ok)):
        return f"{module} runs as {gpus} processes, one per GPU: {command}"
    return None


def require_gpus(module: str, gpus: int = 1, more_ok: bool = False) -> None:
    """Exit with code 2 and one line (rank 0's) unless this machine and launch can run ``module``
    (:func:`gpu_problem`)."""
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    world_size = int(os.environ["WORLD_SIZE"]) if "WORLD_SIZE" in os.environ else None
    problem = gpu_problem(module, gpus, more_ok, visible, world_size)
    if problem is not None:
        report_user_error(MachineError(problem))


def add_cuda_alloc_conf(parser: argparse.ArgumentParser) -> None:
    """A benchmark's ``--cuda-alloc-conf`` (:func:`apply_cuda_alloc_conf` sets it)."""
    parser.add_argument(
        "--cuda-alloc-conf",
        help="PYTORCH_CUDA_ALLOC_CONF for this process, set before CUDA starts (e.g. expandable_segments:True)",
    )


def apply_cuda_alloc_conf(parser: argparse.ArgumentParser, conf: str | None) -> None:
    """Set ``PYTORCH_CUDA_ALLOC_CONF`` to ``conf`` (when given): CUDA's caching allocator reads it once,
    when CUDA starts, so a process that has started it is refused (a parser error, exit 2)."""
    if not conf:
        return
    if torch.cuda.is_initialized():
        parser.error("--cuda-alloc-conf must be set before CUDA starts in this process")
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = conf


def resolve_skip(parser: argparse.ArgumentParser, args: argparse.Namespace, first_step: str) -> None:
    """A benchmark's ``--steps`` (at least 2: ``first_step``, then the timed ones) and its
    ``--skip`` left out: 2, or all but the last step when there are fewer."""
    if args.steps < 2:
        parser.error(f"--steps {args.steps} must be at least 2: {first_step}, then the timed ones")
    if args.skip is None:
        args.skip = min(2, args.steps - 1)
