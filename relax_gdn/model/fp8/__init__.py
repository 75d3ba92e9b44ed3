"""FP8 GEMMs for the model's linear layers on Hopper's FP8 tensor cores, with torchao's float8
recipes (docs/fp8.md): :mod:`~relax_gdn.model.fp8.options` (what ``model.fp8`` says, torch-free),
:mod:`~relax_gdn.model.fp8.casts` (operands to FP8), :mod:`~relax_gdn.model.fp8.linear` (the FP8
form of Megatron-Core's linear function), :mod:`~relax_gdn.model.fp8.plan` (which layers, installed
once when the model is built).

The torch-side names load on first use (PEP 562): configuration checks import the options
without torch or torchao.
"""

from __future__ import annotations

from relax_gdn.lazy_names import lazy_getattr
from relax_gdn.model.fp8.options import FP8Options, fp8_problems

_LAZY = {
    "FP8Plan": "relax_gdn.model.fp8.plan",
    "fp8_plan_of": "relax_gdn.model.fp8.plan",
    "install_fp8": "relax_gdn.model.fp8.plan",
    "FP8LinearImpl": "relax_gdn.model.fp8.linear",
}


__getattr__ = lazy_getattr(__name__, _LAZY)


__all__ = ["FP8LinearImpl", "FP8Options", "FP8Plan", "fp8_plan_of", "fp8_problems", "install_fp8"]
