"""relax_gdn.runtime.Runtime: it makes every process-wide change of a run, and close() leaves the
process exactly as it found it; library code is handed it and asks it instead of patching the process."""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import signal
import threading
import warnings

import pytest
import torch


def _wakeup_fd() -> int:
    fd = signal.set_wakeup_fd(-1)
    if fd != -1:
        signal.set_wakeup_fd(fd)
    return fd


def _process_state() -> dict:
    """Everything a Runtime may change, as values that compare equal when nothing changed."""
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync
    from megatron.core.tensor_parallel import random as mcore_random
    from torch import _dynamo

    from relax_gdn.compat.transformers_kernels import KERNEL_HANDLES
    from relax_gdn.known_warnings import KNOWN_LOG_LINES

    modeling = _transformers_modeling()  # first: its import adds warning filters of its own
    state = {
        "torch.cuda.current_device": torch.cuda.current_device,
        "dynamo.disable": _dynamo.config.disable,
        "environ": dict(os.environ),
        "warning filters": list(warnings.filters),
        "log filters": {k.logger: list(logging.getLogger(k.logger).filters) for k in KNOWN_LOG_LINES},
        "signal handlers": {
            s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT, signal.SIGUSR2)
        },
        "signal wakeup fd": _wakeup_fd(),
        "threads": sorted(t.name for t in threading.enumerate()),
        "rng tracker": (
            mcore_random._CUDA_RNG_STATE_TRACKER,
            mcore_random._CUDA_RNG_STATE_TRACKER_INITIALIZED,
        ),
        "cuda rng state functions": (mcore_random._get_cuda_rng_state, mcore_random._set_cuda_rng_state),
        "checkpoint staging": FileSystemWriterAsync.__dict__["preload_tensors"],
        "deterministic algorithms": (
            torch.are_deterministic_algorithms_enabled(),
            torch.is_deterministic_algorithms_warn_only_enabled(),
        ),
        "transformers kernels": tuple(getattr(modeling, name) for name in KERNEL_HANDLES),
    }
    if importlib.util.find_spec("fla") is not None:
        from relax_gdn.gdn.fla_cp_summaries import _BWD_NAME, _FWD_NAME, _PATCHED_MODULE

        chunk = importlib.import_module(_PATCHED_MODULE)
        state["FLA pre-processing"] = (getattr(chunk, _FWD_NAME), getattr(chunk, _BWD_NAME))
        state["FLA Hopper guard"] = importlib.import_module(FLA_GUARD_MODULE).TRITON_ABOVE_3_7_1
    return state


FLA_GUARD_MODULE = (
    "fla.ops.common.chunk_o"  # the guard relax_gdn.bench.gdn_precision sets through its Runtime
)


def _transformers_modeling():
    import transformers.models.qwen3_5.modeling_qwen3_5 as modeling

    return modeling


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU shims are for machines without CUDA")
def test_close_leaves_the_process_as_it_was():
    from megatron.core.tensor_parallel import random as mcore_random
    from torch import _dynamo

    from relax_gdn.gdn import fla_cp_summaries
    from relax_gdn.runtime import Runtime

    before = _process_state()
    calls = []
    has_fla = importlib.util.find_spec("fla") is not None
    # fla=True on CPU too: the FLA patch is plain Python, so its install and removal are checked here
    runtime = Runtime(fla=has_fla, environ={"FLA_TILELANG": "0"}).install()
    try:
        runtime.use_deterministic_algorithms(warn_only=True)  # what train.deterministic asks for
        runtime.adopt(None)  # a change a run did not need to make: nothing to undo
        runtime.use_torch_kernels_in_transformers()  # what a CPU comparison with transformers asks for
        if has_fla:  # what relax_gdn.bench.gdn_precision --triton-dqkwg asks for
            runtime.replace_attribute(
                importlib.import_module(FLA_GUARD_MODULE),
                "TRITON_ABOVE_3_7_1",
                not before["FLA Hopper guard"],
            )
        during = _process_state()
        assert runtime.installed and runtime.cpu_shims and os.environ["FLA_TILELANG"] == "0"
        assert torch.cuda.current_device() == "cpu" and _dynamo.config.disable
        # what Megatron-Core decorates with torch.compile once this is installed stays the function itself
        assert torch.compile(_process_state) is _process_state
        assert mcore_random._get_cuda_rng_state() is None
        changed = {k for k in before if during[k] != before[k]} - {"environ", "signal handlers", "threads"}
        expected = {
            "torch.cuda.current_device",
            "warning filters",
            "log filters",
            "rng tracker",
            "cuda rng state functions",
            "checkpoint staging",
            "deterministic algorithms",
        }
        expected |= {"dynamo.disable"} if not before["dynamo.disable"] else set()
        expected |= {"FLA pre-processing", "FLA Hopper guard"} if has_fla else set()
        # bound to FLA's kernels when transformers imported with fla importable (not when a test
        # of this process bound them for good before)
        if any(hasattr(handle, "__wrapped__") for handle in before["transformers kernels"]):
            expected.add("transformers kernels")
        assert all(not hasattr(h, "__wrapped__") for h in during["transformers kernels"])
        assert changed == expected, changed ^ expected
        if "FLA pre-processing" in before:
            assert fla_cp_summaries.installed()
        assert runtime.handle_signal(signal.SIGUSR1, lambda signum, frame: calls.append(signum))
        runtime.handle_signal(signal.SIGTERM, lambda signum, frame: calls.append(signum))
        os.kill(os.getpid(), signal.SIGUSR1)
        assert calls == [signal.SIGUSR1]
        runtime.restore_signal(signal.SIGTERM)  # given back early, as a component that is done does
        assert signal.getsignal(signal.SIGTERM) == before["signal handlers"][signal.SIGTERM]
        # a stop at once (relax_gdn.train.stop) and a rank waiting for rank 0's report (relax_gdn.errors)
        assert runtime.handle_signal(signal.SIGUSR2, lambda signum, frame: None, on_arrival=True)
        runtime.exit_quietly_on_sigterm(2)
        with pytest.raises(SystemExit) as exited:
            os.kill(os.getpid(), signal.SIGTERM)
        assert exited.value.code == 2 and _wakeup_fd() != -1
        assert "relax-gdn-signals" in _process_state()["threads"]
        with pytest.raises(RuntimeError, match="another relax_gdn Runtime"):
            Runtime().install()  # one owner at a time
    finally:
        runtime.close()
    after = _process_state()
    assert {k: after[k] for k in before if after[k] != before[k]} == {}
    assert not runtime.installed
    Runtime(silence_warnings=False, cpu_shims=False, fla=False).install().close()  # none left installed
    runtime.close()  # a second close does nothing
    assert _process_state() == before


def test_a_handler_on_arrival_runs_on_the_signal_thread_and_a_forked_child_does_not_report_there():
    """What a stop at once needs: its handler runs as the signal arrives, on the Runtime's thread,
    not when the main thread is next in Python; a process forked from this one (a checkpoint
    writer) that gets the terminal's signal does not run this process's handler."""
    from relax_gdn.runtime import Runtime

    ran = []
    arrived = threading.Event()

    def handler(signum, frame):
        ran.append((signum, threading.current_thread().name))
        arrived.set()

    with Runtime(silence_warnings=False, cpu_shims=False, fla=False) as runtime:
        runtime.handle_signal(signal.SIGUSR2, handler, on_arrival=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # fork() of a process with threads
            child = os.fork()
        if child == 0:
            os.kill(os.getpid(), signal.SIGUSR2)  # handled there by a main-thread handler that does nothing
            os._exit(0)
        assert os.waitpid(child, 0)[1] == 0  # had it reported its signal here, that would come first
        os.kill(os.getpid(), signal.SIGUSR2)
        assert arrived.wait(timeout=60), "the handler did not run"
    assert ran == [(signal.SIGUSR2, "relax-gdn-signals")]  # close() joined the thread: all it read, once


def test_library_code_asks_for_a_runtime_instead_of_patching(tmp_path):
    """Training on CPU with a Runtime that is not installed is refused with a message that says what
    to install, and nothing of the process has changed."""
    from relax_gdn.config import RunConfig
    from relax_gdn.runtime import Runtime
    from relax_gdn.train import run_training

    before = torch.cuda.current_device
    cfg = RunConfig().with_overrides({"train.steps": 1, "train.device": "cpu", "logging.console": False})
    with pytest.raises(
        RuntimeError, match=r"training on CPU needs .*relax_gdn\.runtime\.Runtime.*with Runtime\(\)"
    ):
        run_training(cfg, tmp_path / "run", runtime=Runtime())
    assert torch.cuda.current_device is before and not (tmp_path / "run").exists()
    with pytest.raises(RuntimeError, match="export"):
        Runtime().require("export")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU shims are for machines without CUDA")
def test_a_runtime_without_the_cpu_shims_is_refused_where_they_are_needed():
    from relax_gdn.runtime import Runtime

    with Runtime(cpu_shims=False, silence_warnings=False) as bare:
        assert not bare.cpu_shims
        with pytest.raises(RuntimeError, match="CPU shims"):
            bare.require("training on CPU", cpu_shims=True)
        assert bare.require("reading a config") is bare
    with Runtime() as shimmed:
        assert shimmed.require("training on CPU", cpu_shims=True) is shimmed


@pytest.mark.parametrize("package", ["megatron/core", "torchao"])
def test_a_dependencys_syntax_warning_on_first_import_is_silenced_and_ours_is_not(tmp_path, package):
    """Python compiling a dependency's source with an invalid escape sequence (Megatron-Core's and
    torchao's docstrings, seen on the GPU host) says nothing under the known filters; the same text in
    another package still warns."""
    from relax_gdn.known_warnings import silence_known_warnings

    source = 'def f():\n    """a \\. b"""\n'
    theirs = tmp_path / package / "mod.py"
    ours = tmp_path / "relax_gdn_like" / "mod.py"
    undo = silence_known_warnings()
    try:
        with warnings.catch_warnings(record=True) as seen:
            compile(source, str(theirs), "exec")
            assert not [w for w in seen if issubclass(w.category, SyntaxWarning)], [
                str(w.message) for w in seen
            ]
            compile(source, str(ours), "exec")
            assert [w for w in seen if issubclass(w.category, SyntaxWarning)]
    finally:
        undo()


def test_wandb_deferred_by_the_runtime_runs_on_first_use(tmp_path):
    """In a fresh process (this one imported wandb long ago): a Runtime defers wandb (Megatron-Core's
    import of it then costs nothing); the first attribute access runs it, as the same module
    object, and a W&B offline run works through it."""
    import subprocess
    import sys

    from tests.distributed import child_env

    script = (
        "import sys\n"
        "from relax_gdn.compat.deferred_wandb import defer_wandb_import\n"
        "from relax_gdn.runtime import Runtime\n"
        "with Runtime(cpu_shims=False):\n"
        "    import wandb\n"  # what Megatron-Core's timers do when they import
        "    assert 'wandb.sdk' not in sys.modules, 'executed at import'\n"
        "    assert not defer_wandb_import()  # once per process\n"
        f"    run = wandb.init(mode='offline', dir={str(tmp_path)!r}, project='deferred')\n"
        "    run.log({'loss': 1.0}); run.finish()\n"
        "    assert sys.modules['wandb'] is wandb and 'wandb.sdk' in sys.modules\n"
        "print('ok', type(wandb).__name__)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        env=child_env({"WANDB_SILENT": "true"}),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok module", done.stdout + done.stderr[-3000:]
    assert list((tmp_path / "wandb").glob("offline-run-*"))


@pytest.mark.slow  # starts Inductor's compile-worker sidecar twice (~10 s)
def test_a_wedged_compile_worker_sidecar_is_killed_on_close_not_awaited():
    """Inductor's compile-worker sidecar (started here as torch.compile starts it) stopped with
    SIGSTOP never exits, as a wedged one; torch's exit hook would wait 300 s for it. Closing the
    Runtime kills it after the grace period, and a later compile gets a new pool. A healthy
    sidecar just stops."""
    from torch._inductor import async_compile

    from relax_gdn.compat.compile_workers import stop_compile_workers
    from relax_gdn.runtime import Runtime

    with Runtime(silence_warnings=False, cpu_shims=False, fla=False):
        healthy = async_compile.AsyncCompile.process_pool()
        assert healthy.process.poll() is None
    assert healthy.process.wait(timeout=60) == 0  # stopped by close(), the normal way

    wedged = async_compile.AsyncCompile.process_pool()
    assert wedged is not healthy and wedged.process.poll() is None
    os.kill(wedged.process.pid, signal.SIGSTOP)
    try:
        assert stop_compile_workers(grace_s=1.0) == 1
    finally:
        if wedged.process.poll() is None:
            wedged.process.kill()
    assert wedged.process.wait(timeout=60) == -signal.SIGKILL
    assert stop_compile_workers(grace_s=1.0) == 0 and not async_compile._pool_set
