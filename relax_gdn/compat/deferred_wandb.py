"""wandb run when a run first uses it, not when Megatron-Core imports it.

Megatron-Core 0.19.2's timers (``megatron.core.timers``, which ``import megatron.core`` runs) import
wandb whether or not the run logs to W&B: about 0.4 s of every process that imports Megatron-Core
on the 2-core development machine, a tenth of a ``train.py`` process's start (docs/testing.md).
:func:`defer_wandb_import`, called before Megatron-Core is imported, puts wandb's module object into
``sys.modules`` with its code not yet run: ``import wandb`` then returns at once, and the code runs
into that same object when an attribute wandb defines is first read, which only a run with W&B
logging does (:mod:`relax_gdn.train.loggers`).

Not importlib's ``LazyLoader``: its module runs on any attribute read, and Python 3.12's ``import``
statement reads ``__spec__`` of a module already in ``sys.modules``, so Megatron-Core's own
``import wandb`` would run it. This module imports neither torch nor Megatron-Core.
"""

from __future__ import annotations

import importlib.util
import sys
import types


class _Deferred(types.ModuleType):
    """wandb before its code has run: the module attributes an import reads (``__spec__``,
    ``__path__``, ...) are there; reading any other runs the code into this object first."""

    def __getattr__(self, name: str):  # only for names the module does not have yet
        self.__class__ = types.ModuleType  # from here on a plain module, also while its code runs
        try:
            self.__spec__.loader.exec_module(self)
        except BaseException:
            sys.modules.pop(self.__name__, None)  # as a failed import leaves it: not imported
            raise
        return getattr(self, name)


def defer_wandb_import() -> bool:
    """Make ``import wandb`` give the module with its code not yet run, to run on first use; True
    when it did, False where wandb is imported already (or deferred) or not installed.

    Nothing to undo: the entry is wandb itself (Megatron-Core keeps a reference to it), the module
    an import would give, its code run later."""
    if "wandb" in sys.modules:
        return False
    spec = importlib.util.find_spec("wandb")
    if spec is None or spec.loader is None:
        return False
    module = importlib.util.module_from_spec(spec)
    module.__class__ = _Deferred
    sys.modules["wandb"] = module
    return True
