"""Builders shared by test modules (and by the functions their gloo ranks run): run configs,
``python train.py`` as a child process, training in this process, small numeric helpers."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from relax_gdn.config import RunConfig
from tests.distributed import child_env

ROOT = Path(__file__).resolve().parents[1]


def _typo_message() -> str:
    from dataclasses import fields

    from relax_gdn.config.schema import TrainConfig

    keys = ", ".join(f.name for f in fields(TrainConfig))
    return (
        f"error: configuration problem: unknown config key 'train.stepz': train has no key 'stepz'; its keys "
        f"are {keys} (relax_gdn/config/schema.py). Did you mean train.steps?"
    )


# What train.py prints for the typo ``train.stepz=3``: the one message, the keys in schema order,
# the key it is closest to.
TYPO_MESSAGE = _typo_message()
GDN_MODES = ("headwise", "chunkwise", "all_gather")
EQ_TOL = 1e-5  # fp32, relative: CP 2 vs CP 1 on the same samples
MESSAGES_EXAMPLE = ROOT / "examples" / "data" / "chat.jsonl"
# a child's whole run, start-up included, on a loaded 2-core machine
TRAIN_PY_TIMEOUT_S = 300
# A third-party notice in a command's output: a warnings.warn line (its library's file path), or a
# log line relax_gdn.known_warnings names.
THIRD_PARTY_NOTICE = re.compile(
    r"Warning: |site-packages|IS DEPRECATED|No CUDA runtime|Megatron-FSDP|"
    r"decay style|checkpoint value|gpuGetDeviceCount|USDT:|^wandb: "
)


def config_with(**dotted) -> RunConfig:
    """The default (demo) config with ``a__b__c=value`` overrides."""
    return RunConfig().with_overrides({key.replace("__", "."): value for key, value in dotted.items()})


def small_config(**dotted) -> RunConfig:
    """A small demo config (short synthetic problems, small batches) with ``a__b=value`` overrides."""
    base = dict(
        train__steps=4,
        train__global_batch_size=8,
        train__max_tokens_per_gpu=1024,
        data__max_sample_tokens=512,
        data__synthetic_max_steps=2,
        data__num_samples=256,
        optim__warmup_steps=1,
        logging__console=False,
    )
    return config_with(**{**base, **dotted})


def step_fields(record: dict) -> dict:
    """What two runs of one step on the same samples must agree on."""
    return {k: record[k] for k in ("loss", "grad_norm", "tokens", "loss_tokens")}


def messages_config(**dotted) -> RunConfig:
    """The small config on the example chat file (``messages`` format)."""
    base = dict(
        train__steps=2,
        train__global_batch_size=8,
        train__max_tokens_per_gpu=1024,
        optim__warmup_steps=1,
        data__source="jsonl",
        data__path=str(MESSAGES_EXAMPLE),
        data__format="messages",
        logging__console=False,
        logging__jsonl=False,
    )
    return config_with(**{**base, **dotted})


def train_py(
    tmp_path: Path,
    *overrides: str,
    python_flags: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
    run_dir: bool = True,
) -> subprocess.CompletedProcess:
    """``python train.py`` in ``tmp_path``; ``run_dir``: pin Hydra's run directory to tmp_path/run
    (False: Hydra's default outputs/runs/<date>/<time>/ under tmp_path)."""
    pinned = [f"hydra.run.dir={tmp_path / 'run'}"] if run_dir else []
    return subprocess.run(
        [sys.executable, *python_flags, str(ROOT / "train.py"), *pinned, *overrides],
        cwd=tmp_path,
        env=child_env(env),
        capture_output=True,
        text=True,
        timeout=TRAIN_PY_TIMEOUT_S,
    )


def train_in_this_process(runtime, run_dir: Path | None = None, **overrides):
    """Two steps (unless ``train.steps`` says otherwise) of the tiny model on 16 short samples
    (``run_training`` here, no process group started, in the installed ``runtime``, writing into
    ``run_dir`` when given): its ``TrainResult``."""
    from relax_gdn.train import run_training

    cfg = RunConfig().with_overrides(
        {
            "train.steps": 2,
            "train.global_batch_size": 4,
            "data.num_samples": 16,
            "data.max_sample_tokens": 512,
            "optim.warmup_steps": 1,
            "logging.console": False,
            "logging.jsonl": False,
            **overrides,
        }
    )
    return run_training(cfg, run_dir, runtime=runtime)


def train_records_in_this_process(runtime, **overrides) -> list[dict]:
    """:func:`train_in_this_process`'s records."""
    return train_in_this_process(runtime, **overrides).records


# two steps of the reduced 9B on one GPU in bf16 with host syncs counted: what the GPU tests of a
# model-level change train (their own keys on top)
REDUCED_9B_GPU_RUN = {
    "model.preset": "qwen3_5_9b_reduced",
    "train.device": "cuda",
    "train.precision": "bf16",
    "train.steps": 2,
    "train.global_batch_size": 8,
    "train.max_tokens_per_gpu": 2048,
    "data.max_sample_tokens": 2048,
    "data.synthetic_max_steps": 20,
    "data.num_samples": 64,
    "optim.warmup_steps": 1,
    "optim.lr": 1e-5,
    "optim.min_lr": 1e-6,
    "logging.console": False,
    "logging.jsonl": False,
    "logging.count_host_syncs": True,
}


def train_reduced_9b_on_gpu(runtime, **overrides):
    """``run_training`` of :data:`REDUCED_9B_GPU_RUN` with ``overrides`` in ``runtime``: the result."""
    from relax_gdn.train import run_training

    return run_training(
        RunConfig().with_overrides({**REDUCED_9B_GPU_RUN, **overrides}), None, runtime=runtime
    )


def relative_error(a, b) -> float:
    """``|a - b| / |b|`` in float64 (Frobenius norms)."""
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def plain_rms_norm(x, w, eps, zero_centered):
    """RMSNorm in fp32 the plain way (``zero_centered``: the weight is stored as ``w - 1``)."""
    import torch

    x32 = x.float()
    scale = w.float() + 1.0 if zero_centered else w.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * scale).to(x.dtype)


def as_ddp_parameter(weight, start: float):
    """Give ``weight`` what Megatron-Core's DDP gives a parameter: an fp32 ``main_grad`` (here
    pre-filled, as after earlier micro-batches) and ``grad_added_to_main_grad``."""
    import torch

    weight.main_grad = torch.full(weight.shape, start, dtype=torch.float32)
    weight.grad_added_to_main_grad = False
    return weight


def force_transformers_pure_torch():
    """transformers binds qwen3_5's conv / gated-delta-rule handles to FLA (Triton, GPU only) at
    import when ``fla`` is installed; the wrappers keep the pure-torch function as ``__wrapped__``,
    which ``use_torch_kernels_in_transformers`` binds instead, as a user's script does (for the
    process: the callers compare transformers' torch path only). Returns what binds FLA's back."""
    import transformers.models.qwen3_5.modeling_qwen3_5 as modeling

    from relax_gdn.compat.transformers_kernels import KERNEL_HANDLES
    from relax_gdn.model import hf_checkpoint as hfc

    bind_back = hfc.use_torch_kernels_in_transformers()
    for name in KERNEL_HANDLES:
        torch_fn = getattr(modeling, name)
        assert torch_fn.__module__ == modeling.__name__ and not hasattr(torch_fn, "__wrapped__"), name
    return bind_back


# the layouts the resharding tests save and resume at (2 processes)
RESHARD_LAYOUTS = {
    "cp2": dict(parallel__cp=2),
    "cp1": dict(parallel__cp=1),  # two processes: DP 2
    "tp2": dict(parallel__tp=2),
    "dynamic": dict(
        parallel__cp=2, parallel__dynamic_cp=dict(enabled=True, max_cp=2), train__max_tokens_per_gpu=256
    ),
}


def reshard_run_config(layout: str, mode: str, steps: int, **dotted):
    """A small run at one of :data:`RESHARD_LAYOUTS` in GDN ``mode``, ``steps`` long."""
    # decay_steps fixed: a 2-step run that saves and its 4-step continuation share one schedule
    return small_config(
        train__steps=steps,
        optim__decay_steps=4,
        gdn__cp_mode=mode,
        recompute__granularity="full" if mode == "all_gather" else "none",
        logging__jsonl=False,
        **{**RESHARD_LAYOUTS[layout], **dotted},
    )


def step_values(record: dict) -> dict:
    """What a resumed step must repeat of the uninterrupted one."""
    return {k: record[k] for k in ("step", "loss", "grad_norm", "lr")}


def checkpoint_model_keys(keys: list[str]) -> list[str]:
    """The model's tensors among a distributed checkpoint's metadata keys: Megatron-Core keys them by
    their own names (``decoder.layers...``), beside ``optimizer.*``, the ``common_state`` shards and,
    on CUDA, each rank's generator state (``rng_state.cuda``, relax_gdn.train.checkpoint)."""
    return [k for k in keys if not k.startswith(("optimizer.", "common", "rng_state."))]


def export_summary_line(out: str, heading: str) -> str:
    """The line of ``export_hf``'s summary that starts at ``heading`` (e.g. ``"written from the run:"``,
    relax_gdn/model/hf_checkpoint/files.py), without the heading; fails naming the output if absent."""
    assert heading in out, f"export_hf printed no {heading!r} line:\n{out}"
    return out.split(heading, 1)[1].split("\n", 1)[0]
