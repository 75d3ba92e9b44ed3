"""Megatron-Core's ``share_storage`` C++ extension, built before step 1.

``recompute.modules: mlp_act`` frees each MLP's SwiGLU output through Megatron-Core's
``CheckpointWithoutOutput``. When that output is recomputed (in backward), Megatron-Core 0.19 points
the freed tensor's storage at the recomputed values with a small C++ function that torch compiles
the first time it is needed (``torch.utils.cpp_extension.load_inline``: ninja and a C++ compiler,
cached under ``TORCH_EXTENSIONS_DIR``, by default ``~/.cache/torch_extensions``, per Python
environment). Left to itself that build runs inside step 1's backward: 30-60 s added to the first
step on a machine that has not built it, more than a minute on a fresh GPU host, and on a machine
without ninja or a compiler step 1 ends in a ninja traceback. :func:`build_share_storage` builds it
(or loads the cached build) while the model is built, says how long a build took, and turns a failed
build into one message with the fix.
"""

from __future__ import annotations

import logging
import time

from relax_gdn.errors import RecipeError

logger = logging.getLogger(__name__)

# a cached build loads in well under this; a longer call compiled it, and the log says so
_BUILD_REPORT_S = 2.0


def build_share_storage() -> None:
    """Build or load Megatron-Core's ``share_storage`` extension; a :class:`RecipeError` naming the
    cause and the fix when torch cannot build it."""
    from megatron.core.tensor_parallel.random import _get_share_storage

    start = time.perf_counter()
    try:
        _get_share_storage()
    except (RuntimeError, OSError) as error:  # no ninja / no compiler / a failed compile
        lines = str(error).strip().splitlines()
        cause = lines[-1] if lines else type(error).__name__
        raise RecipeError(
            "recompute.modules includes mlp_act, whose recompute needs Megatron-Core's share_storage "
            "C++ extension, and torch could not build it (torch.utils.cpp_extension: ninja and a C++ "
            f"compiler, cached under TORCH_EXTENSIONS_DIR): {cause}. Fix: install ninja "
            "(`pip install ninja`) and a C++ compiler (g++), or recompute without mlp_act "
            "(recompute.modules=[core_attn,gdn_core], or recompute=full / recompute=none)"
        ) from error
    seconds = time.perf_counter() - start
    if seconds >= _BUILD_REPORT_S:
        logger.info(
            "built Megatron-Core's share_storage C++ extension (recompute.modules mlp_act) in %.0f s: "
            "once per machine and Python environment, cached under TORCH_EXTENSIONS_DIR",
            seconds,
        )


__all__ = ["build_share_storage"]
