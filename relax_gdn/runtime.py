"""The one owner of every process-wide change the recipe makes.

Library code (model building, the GDN kernels, the training loop) changes nothing outside the
objects it builds. What the process itself needs is done here, once, by the entry point
(``train.py``, ``python -m relax_gdn.export_hf``, every ``python -m relax_gdn.bench.*``), and
undone by :meth:`Runtime.close`. The entry point hands its Runtime to what needs it::

    with Runtime() as runtime:
        run_training(cfg, run_dir, runtime=runtime)

A :class:`Runtime` owns, in the order it installs them:

* the environment variables it is given (``environ``: read by a library when it imports, such as
  FLA's ``FLA_TILELANG``), first;
* the filters for third-party notices known to be harmless (:mod:`relax_gdn.known_warnings`),
  first, so they are in place before Megatron-Core, FLA or torch's extension loader import;
* wandb loaded on its first use rather than when Megatron-Core imports it
  (:mod:`relax_gdn.compat.deferred_wandb`; not undone: the entry is wandb itself);
* on a machine without CUDA, Megatron-Core's CPU shims (:mod:`relax_gdn.compat.cpu`:
  ``torch.cuda.current_device``, the RNG tracker functions, a checkpoint staging method, dynamo)
  and a quiet CPU profiler (``KINETO_LOG_LEVEL``, :func:`relax_gdn.known_warnings.quiet_cpu_profiler`);
* on CUDA, FLA's process settings: the bundled kernel configs (``FLA_CONFIG_DIR``,
  :mod:`relax_gdn.gdn.fla_tuning`) and the CP pre-processing that skips unread transition
  summaries for the layers that ask for it (:mod:`relax_gdn.gdn.fla_cp_summaries`);
* torch's CUDA sync debug mode, when one is asked for;
* the signal handlers other components ask it for (:meth:`Runtime.handle_signal`), and the thread
  that runs those that must act the moment their signal arrives (a stop at once), whatever the main
  thread is blocked in; the handler that ends a rank quietly once rank 0 has reported an error
  every rank hit (:meth:`Runtime.exit_quietly_on_sigterm`, :func:`relax_gdn.errors.report_user_error`);
* the queue Megatron-Core's checkpoint writer reports through, one that dies with this process
  (:meth:`Runtime.checkpoint_write_results`, :mod:`relax_gdn.compat.write_results`);
* the process-wide changes a run can only make once it knows its device and configuration
  (Megatron-Core's fused wgrad GEMM, torch's deterministic algorithms): made by the run, handed
  over with :meth:`Runtime.adopt` / :meth:`Runtime.use_deterministic_algorithms`;
* Inductor's compile workers, where ``torch.compile`` started them: stopped on close, the one that
  does not stop within 10 s killed, instead of torch's exit hook waiting 300 s for it
  (:mod:`relax_gdn.compat.compile_workers`);
* what a tool or benchmark asks for: transformers' Qwen3.5 on its pure-torch kernels
  (:meth:`Runtime.use_torch_kernels_in_transformers`), a module attribute set for the process
  (:meth:`Runtime.replace_attribute`: the precision benchmark's FLA guard and dynamo switch).

Code that needs one of these is handed the Runtime and asks it (:meth:`Runtime.require` says what
is missing), instead of patching the process itself. One Runtime is installed at a time.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any, ClassVar

# imported with this module: neither imports anything beyond the standard library
from relax_gdn.compat.compile_workers import stop_compile_workers
from relax_gdn.compat.deferred_wandb import defer_wandb_import
from relax_gdn.known_warnings import quiet_cpu_profiler, silence_known_warnings

SignalHandler = Callable[[int, FrameType | None], object]


class Runtime:
    """Every process-wide change of one run, made by :meth:`install` and undone by :meth:`close`
    (see the module docstring). A context manager: ``with Runtime(): ...``.

    Args:
        silence_warnings: install the known-harmless warning and log filters
            (``logging.show_third_party_warnings=false``).
        cpu_shims: apply Megatron-Core's CPU shims; None: where CUDA is not available.
        fla: FLA's bundled kernel configs and CP-summary patch; None: where CUDA is available and
            FLA is installed.
        sync_debug_mode: torch's CUDA sync debug mode for the run (``"warn"``, ``"error"``); None
            leaves torch's. CUDA only.
        environ: environment variables set before anything else (and put back by :meth:`close`).
    """

    # Two Runtimes at once would undo each other's changes out of order: the installed one, if any.
    _installed: ClassVar[Runtime | None] = None

    def __init__(
        self,
        *,
        silence_warnings: bool = True,
        cpu_shims: bool | None = None,
        fla: bool | None = None,
        sync_debug_mode: str | None = None,
        environ: dict[str, str] | None = None,
    ) -> None:
        self.silence_warnings = silence_warnings
        self.environ = dict(environ or {})
        self._cpu_shims, self._fla = cpu_shims, fla
        self.sync_debug_mode = sync_debug_mode
        self._undo: list[Callable[[], None]] = []
        self._signals: dict[int, object] = {}
        self._signal_thread: _SignalThread | None = None  # made by the first on_arrival handler
        self._write_results: tuple[bool, Callable[[], None]] | None = None  # (background, undo)
        self.installed = False
        self.cpu_shims = False  # resolved by install
        self.fla = False

    # ------------------------------------------------------------------ install / close

    def install(self) -> Runtime:
        """Make the changes (see the class docstring); returns ``self``. Refused while another
        Runtime is installed."""
        if self.installed:
            raise RuntimeError("this Runtime is already installed")
        if Runtime._installed is not None:
            raise RuntimeError("another relax_gdn Runtime is installed in this process; close it first")
        Runtime._installed, self.installed = self, True
        self._undo.append(stop_compile_workers)  # undone last: after everything that might compile
        try:
            for name, value in self.environ.items():
                self._set_environ(name, value)
            if self.silence_warnings:
                self._undo.append(silence_known_warnings())
            defer_wandb_import()  # before the CPU shims import Megatron-Core, which imports wandb
            self._install_device_shims()
        except BaseException:
            self.close()
            raise
        return self

    def _install_device_shims(self) -> None:
        import torch

        cuda = torch.cuda.is_available()
        self.cpu_shims = not cuda if self._cpu_shims is None else self._cpu_shims
        if self.cpu_shims:
            from relax_gdn.compat.cpu import apply_cpu_shims

            self._undo.append(apply_cpu_shims())
        if not cuda:  # before any profile: kineto reads its log level once per process
            self._undo.append(quiet_cpu_profiler())
        self.fla = (cuda and importlib.util.find_spec("fla") is not None) if self._fla is None else self._fla
        if self.fla:
            self._install_fla(torch.device("cuda", torch.cuda.current_device()) if cuda else None)
        if self.sync_debug_mode is not None and cuda:
            before = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode(self.sync_debug_mode)
            self._undo.append(lambda: torch.cuda.set_sync_debug_mode(before))

    def _install_fla(self, device) -> None:
        from relax_gdn.gdn import fla_cp_summaries

        if device is not None:
            from relax_gdn.gdn.fla_tuning import use_bundled_fla_configs

            undo_configs = use_bundled_fla_configs(device)
            if undo_configs is not None:
                self._undo.append(undo_configs)
        if not fla_cp_summaries.installed():
            fla_cp_summaries.install()
            self._undo.append(fla_cp_summaries.uninstall)

    def close(self) -> None:
        """Undo everything :meth:`install` and :meth:`handle_signal` did, newest first; a closed
        Runtime does nothing more (a second close is a no-op)."""
        for signum in list(self._signals):
            self.restore_signal(signum)
        if self._signal_thread is not None:
            self._signal_thread.close()
            self._signal_thread = None
        while self._undo:
            self._undo.pop()()
        self._write_results = None
        if Runtime._installed is self:
            Runtime._installed = None
        self.installed = False

    def __enter__(self) -> Runtime:
        return self.install()

    def __exit__(self, *exc) -> None:
        self.close()

    def require(self, what: str, *, cpu_shims: bool = False) -> Runtime:
        """This Runtime, for ``what`` (a phrase naming the caller); raises ``RuntimeError`` saying
        how to install it when it is not installed, or when it lacks the CPU shims and
        ``cpu_shims`` is asked for."""
        if not self.installed:
            raise RuntimeError(
                f"{what} needs the process set up by relax_gdn.runtime.Runtime, and the Runtime it was given "
                "is not installed: wrap the call in `with Runtime() as runtime: ...` and pass that runtime "
                "(train.py, export_hf and the benchmarks do; tests use the `runtime` fixture)"
            )
        if cpu_shims and not self.cpu_shims:
            raise RuntimeError(
                f"{what} needs Megatron-Core's CPU shims, which the installed Runtime did not apply (it "
                "applies them only where CUDA is not available): run on a machine without CUDA, or on CUDA "
                "with train.device=auto"
            )
        return self

    # ------------------------------------------------------------------ changes made by the run

    def adopt(self, undo: Callable[[], None] | None) -> None:
        """Take over a process-wide change made after :meth:`install` by code that needed the run's
        device or configuration first: ``undo`` (None: nothing was changed) runs at :meth:`close`,
        with the Runtime's own, newest first."""
        if not self.installed:
            raise RuntimeError("Runtime.adopt needs an installed Runtime")
        if undo is not None:
            self._undo.append(undo)

    def use_deterministic_algorithms(self, warn_only: bool = True) -> None:
        """``torch.use_deterministic_algorithms(True, warn_only=...)`` until :meth:`close`, which puts
        torch's previous setting back (``train.deterministic``)."""
        import torch

        enabled, warn_only_before = (
            torch.are_deterministic_algorithms_enabled(),
            torch.is_deterministic_algorithms_warn_only_enabled(),
        )
        torch.use_deterministic_algorithms(True, warn_only=warn_only)
        self.adopt(lambda: torch.use_deterministic_algorithms(enabled, warn_only=warn_only_before))

    def replace_attribute(self, owner: Any, name: str, value: Any) -> None:
        """``setattr(owner, name, value)`` (a module's or a config object's attribute) until
        :meth:`close`, which puts the previous value back."""
        if not self.installed:
            raise RuntimeError("Runtime.replace_attribute needs an installed Runtime")
        before = getattr(owner, name)
        setattr(owner, name, value)
        self._undo.append(lambda: setattr(owner, name, before))

    def use_torch_kernels_in_transformers(self) -> None:
        """transformers' Qwen3.5 on its own pure-torch GDN and conv kernels until :meth:`close`
        (:func:`relax_gdn.model.hf_checkpoint.use_torch_kernels_in_transformers`: CPU inference of
        an export, exact comparisons)."""
        from relax_gdn.compat.transformers_kernels import use_torch_kernels_in_transformers

        self.adopt(use_torch_kernels_in_transformers())

    def _set_environ(self, name: str, value: str) -> None:
        before = os.environ.get(name)
        os.environ[name] = value

        def restore() -> None:
            if before is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = before

        self._undo.append(restore)

    # ------------------------------------------------------------------ checkpoint writer

    def checkpoint_write_results(self, *, background: bool) -> None:
        """Until :meth:`close`, Megatron-Core's checkpoint writer reports into a queue that dies
        with this process (:mod:`relax_gdn.compat.write_results`): an in-process one for inline
        saves, one served by a process that dies with this one for ``background`` (forked) saves.
        Asked for by the checkpoint saver; asking again for the other kind replaces it."""
        if not self.installed:
            raise RuntimeError("Runtime.checkpoint_write_results needs an installed Runtime")
        if self._write_results is not None:
            if self._write_results[0] == background:
                return
            undo = self._write_results[1]
            self._undo.remove(undo)
            undo()
        from relax_gdn.compat.write_results import use_write_results_queue

        undo = use_write_results_queue(background)
        self._write_results = (background, undo)
        self._undo.append(undo)

    # ------------------------------------------------------------------ signals

    def handle_signal(self, signum: int, handler: SignalHandler, *, on_arrival: bool = False) -> bool:
        """Install ``handler`` for ``signum`` until :meth:`restore_signal` or :meth:`close`, which
        put back the handler it replaced. Python takes signal handlers in the main thread only:
        elsewhere nothing is installed and False is returned (the caller then gets no signal).

        Python runs a handler in the main thread once it is back in Python, which a thread inside a
        collective or a CUDA wait may never be. ``on_arrival``: ``handler`` runs on the Runtime's
        signal thread as the signal arrives, whatever the main thread does (it only has a blocking
        call interrupted); a process forked from this one does not report its signals here."""
        if not self.installed:
            raise RuntimeError("Runtime.handle_signal needs an installed Runtime")
        if threading.current_thread() is not threading.main_thread():
            return False
        if on_arrival:
            if self._signal_thread is None:
                self._signal_thread = _SignalThread()
            self._signal_thread.handlers[signum] = handler
            handler = _noted_by_the_signal_thread
        elif self._signal_thread is not None:
            self._signal_thread.handlers.pop(signum, None)
        previous = signal.signal(signum, handler)
        self._signals.setdefault(signum, previous)  # handled twice: close restores the original
        return True

    def restore_signal(self, signum: int) -> None:
        """Put back the handler ``signum`` had before :meth:`handle_signal` (nothing if none was set)."""
        if signum in self._signals:
            signal.signal(signum, self._signals.pop(signum))
        if self._signal_thread is not None:
            self._signal_thread.handlers.pop(signum, None)

    def exit_quietly_on_sigterm(self, code: int) -> None:
        """Until :meth:`close`, SIGTERM ends this process with ``code`` and no traceback: what a rank
        waiting for rank 0 to report an error sets, as torchrun stops it with SIGTERM once rank 0
        has exited (:func:`relax_gdn.errors.report_user_error`)."""

        def exit_quietly(signum, frame):
            raise SystemExit(code)

        self.handle_signal(signal.SIGTERM, exit_quietly)


def _noted_by_the_signal_thread(signum: int, frame: FrameType | None) -> None:
    """The main thread's handler of a signal the signal thread handles: nothing more to do."""


class _SignalThread:
    """Runs handlers as their signals arrive: CPython's C-level handler writes each signal's number
    to the wakeup fd (``signal.set_wakeup_fd``), whichever thread the OS delivered it to, and this
    thread reads them. ``handlers``: signal number -> handler, called with ``(signum, None)``."""

    def __init__(self) -> None:
        self.handlers: dict[int, SignalHandler] = {}
        self._read, self._write = os.pipe()
        os.set_blocking(self._write, False)
        self._previous = signal.set_wakeup_fd(self._write, warn_on_full_buffer=False)
        self._closed = False
        # a forked child (a checkpoint writer) would write its own signals into this pipe
        os.register_at_fork(after_in_child=self._forget_in_child)
        self._thread = threading.Thread(target=self._serve, name="relax-gdn-signals", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while chunk := os.read(self._read, 64):  # empty: the write end is closed
            for signum in chunk:
                handler = self.handlers.get(signum)
                if handler is not None:
                    handler(signum, None)

    def _forget_in_child(self) -> None:
        if not self._closed:
            self._closed = True
            signal.set_wakeup_fd(-1)
            os.close(self._read)
            os.close(self._write)

    def close(self) -> None:
        """Give the wakeup fd back and end the thread."""
        if self._closed:
            return
        self._closed = True
        signal.set_wakeup_fd(self._previous)
        os.close(self._write)
        self._thread.join(timeout=10)
        os.close(self._read)


__all__ = ["Runtime"]
