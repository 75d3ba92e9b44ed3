"""A package's names imported on first use (PEP 562): its ``__init__`` stays light, so importing one
torch-free module of the package does not pull in what its other modules import."""

from __future__ import annotations

import importlib
from collections.abc import Callable


def lazy_getattr(package: str, modules: dict[str, str]) -> Callable[[str], object]:
    """The module ``__getattr__`` of ``package``: a name in ``modules`` is imported from the module
    named there when first asked for; any other is an ``AttributeError``, as for a plain module."""

    def __getattr__(name: str) -> object:
        if name in modules:
            return getattr(importlib.import_module(modules[name]), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__


__all__ = ["lazy_getattr"]
