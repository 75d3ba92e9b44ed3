"""What this machine can run: the choices of a configuration that need CUDA, a GPU generation or a
package, checked where the run starts (``train.py`` and ``train.py --check``, after
:func:`~relax_gdn.config.validate`, before Hydra writes anything or a model is built).

:func:`~relax_gdn.config.validate` holds the rules that are true on every machine; these depend
on the one that checks, so a sweep launcher (which may run on a login node) asks only validate.
:func:`machine_problems` is pure: it takes the machine's facts (:class:`Machine`), so the rules are
tested for any machine on any machine; :meth:`Machine.here` reads them, importing torch (after
validation passed, so a typo is still refused in about a second).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass, field

from relax_gdn.config.schema import RunConfig
from relax_gdn.errors import ConfigError
from relax_gdn.model.fp8.options import fp8_gpu_problem

FA4_SM_MAJORS = (9, 10, 11)  # FlashAttention-4's CuTe DSL kernels (relax_gdn.model.attention_kernels)
FA4_INSTALL = "pip install '.[fa4]' (flash-attn-4 and nvidia-cutlass-dsl, pinned in pyproject.toml)"


def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def _wandb_logged_in() -> bool:
    """Whether W&B finds an API key for its server here (``WANDB_API_KEY``, or ``wandb login``'s
    entry in ~/.netrc), without asking the server or the user."""
    try:
        import wandb
        from wandb.sdk.lib.wbauth.authenticate import authenticate_session
    except ImportError:  # wandb moved its credentials lookup: cannot tell, wandb.init will say
        return True
    try:
        host = wandb.Settings().base_url
        found = authenticate_session(host=host, source="relax-gdn", prompt=False, update_session=False)
    except Exception:  # noqa: BLE001 - a W&B setting it cannot read: wandb.init will say which
        return True
    return found is not None


@dataclass(frozen=True)
class Machine:
    """The facts the rules read. ``gpu``: the first GPU's name, SM major version and memory in
    GiB (None without CUDA, or when not asked for: reading them makes a CUDA context)."""

    cuda: bool
    gpu: tuple[str, int, float] | None = None
    capability: tuple[int, int] | None = None  # the first GPU's compute capability (with ``gpu``)
    installed: Callable[[str], bool] = field(default=_installed, compare=False)
    wandb_logged_in: Callable[[], bool] = field(default=_wandb_logged_in, compare=False)

    @classmethod
    def here(cls, *, gpu_details: bool = False) -> Machine:
        """This machine; ``gpu_details`` only in a process that does not train afterwards
        (``--check``): a training rank picks its GPU later, and a context on GPU 0 would stay."""
        import torch

        cuda = torch.cuda.is_available()
        if not (cuda and gpu_details):
            return cls(cuda=cuda)
        props = torch.cuda.get_device_properties(0)
        return cls(
            cuda=True,
            gpu=(props.name, props.major, props.total_memory / 2**30),
            capability=(props.major, props.minor),
        )

    def describe(self) -> str:
        if not self.cuda:
            return "CPU (no CUDA)"
        if self.gpu is None:
            return "CUDA"
        name, major, gib = self.gpu
        return f"CUDA, {name} (SM {major}.x, {gib:.1f} GiB)"


def _on_cuda(cfg: RunConfig, machine: Machine) -> bool:
    """Whether the run uses CUDA here (``train.device=auto``: where it is available)."""
    return machine.cuda and cfg.train.device != "cpu"


def _device_problems(cfg: RunConfig, machine: Machine) -> list[str]:
    problems = []
    if cfg.train.device == "cuda" and not machine.cuda:
        problems.append("train.device=cuda but CUDA is not available here: use train.device=auto or cpu")
    if cfg.train.precision == "bf16" and not _on_cuda(cfg, machine):
        problems.append(
            "train.precision=bf16 needs CUDA (a CPU run trains in fp32): use train.precision=auto or "
            "fp32 here"
        )
    if cfg.checkpoint.async_save and not _on_cuda(cfg, machine):
        problems.append(
            "checkpoint.async_save=true needs CUDA (Megatron-Core's async writer): set it false here, "
            "saves are then written while training waits"
        )
    return problems


def _attention_problems(cfg: RunConfig, machine: Machine) -> list[str]:
    backend, key = cfg.model.attention_backend, f"model.attention_backend={cfg.model.attention_backend}"
    cuda = _on_cuda(cfg, machine)
    fix = "use model.attention_backend=auto (the SDPA reference here)"
    if backend == "fa4":
        if not cuda:
            return [
                f"{key} (FlashAttention-4) needs a CUDA GPU of SM {FA4_SM_MAJORS[0]}.x-"
                f"{FA4_SM_MAJORS[-1]}.x and "
                f"this run has none: {fix}"
            ]
        if machine.gpu is not None and machine.gpu[1] not in FA4_SM_MAJORS:
            return [
                f"{key} (FlashAttention-4) runs on SM {FA4_SM_MAJORS[0]}.x-{FA4_SM_MAJORS[-1]}.x, this GPU "
                f"({machine.gpu[0]}) is SM {machine.gpu[1]}.x: use model.attention_backend=auto"
            ]
        if not machine.installed("flash_attn"):
            return [f"{key}: flash-attn-4 is not installed: {FA4_INSTALL}"]
    if backend == "varlen" and not (cuda and cfg.train.precision != "fp32"):
        return [f"{key} (torch's flash attention) needs CUDA and bf16: {fix}"]
    if backend == "flex" and not cuda:
        return [f"{key}: FlexAttention has no backward on CPU: {fix}"]
    if (backend == "te" or cfg.model.spec_provider == "te") and not machine.installed("transformer_engine"):
        which = key if backend == "te" else "model.spec_provider=te"
        return [
            f"{which} needs Transformer Engine, which is not installed here: use model.spec_provider=auto "
            "and model.attention_backend=auto"
        ]
    return []


def _gdn_problems(cfg: RunConfig, machine: Machine) -> list[str]:
    if cfg.gdn.kernel_backend != "fla":
        return []
    if not _on_cuda(cfg, machine):
        return [
            "gdn.kernel_backend=fla (FLA's Triton kernels) needs CUDA: use gdn.kernel_backend=auto (FLA on "
            "CUDA, the pure-torch reference here) or torch"
        ]
    if not machine.installed("fla"):
        return [
            "gdn.kernel_backend=fla: FLA's kernels are not installed (fla-core, pinned in pyproject.toml)"
        ]
    return []


def _fp8_problems(cfg: RunConfig, machine: Machine) -> list[str]:
    capability = machine.capability if _on_cuda(cfg, machine) else None
    problem = fp8_gpu_problem(cfg.model.fp8.recipe, capability)
    return [problem] if problem else []


def _logging_problems(cfg: RunConfig, machine: Machine) -> list[str]:
    # wandb.init without a key asks rank 0's terminal for one while the other ranks wait in their
    # first collective, or (no terminal) fails and the run goes on without W&B: either way a run
    # meant to be tracked is not, found out hours later
    if cfg.logging.wandb.mode != "online" or machine.wandb_logged_in():
        return []
    return [
        "logging.wandb.mode=online but W&B has no API key on this machine: run `wandb login` (or set "
        "WANDB_API_KEY), or use logging.wandb.mode=offline (the run ends with the `wandb sync` command "
        "that uploads it) or disabled"
    ]


def machine_problems(cfg: RunConfig, machine: Machine) -> list[str]:
    """Every choice of ``cfg`` that ``machine`` cannot run, one message each naming the key and what
    to set instead (a configuration :func:`~relax_gdn.config.validate` accepted)."""
    return (
        _device_problems(cfg, machine)
        + _attention_problems(cfg, machine)
        + _gdn_problems(cfg, machine)
        + _fp8_problems(cfg, machine)
        + _logging_problems(cfg, machine)
    )


def check_machine(cfg: RunConfig, machine: Machine) -> None:
    """Raise one :class:`ConfigError` listing :func:`machine_problems`, if any."""
    problems = machine_problems(cfg, machine)
    if problems:
        raise ConfigError(problems)
