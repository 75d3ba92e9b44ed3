"""FLA kernel configs tuned on the GPUs this repo is measured on, used instead of autotuning.

FLA autotunes each kernel per head shape and dtype on first use, in every process, so every rank
of every job would pay it before step 1 (docs/benchmarks.md, "Figures behind code comments"). The
tuned winners live in ``fla_configs/<GPU name>/`` (made with ``relax_gdn.bench.fla_configs`` from
Triton's autotuning cache of the GDN GPU test and layer benchmark at Qwen3.5-9B head shapes, and
of ``bench.train_e2e`` on the full 9B for the gated output norm and the fused decay gate) and
are loaded through FLA's own config cache (``FLA_CONFIG_DIR`` + ``FLA_CACHE_MODE``) in ``fuzzy``
mode: an exact key wins, otherwise a key differing only in numbers (head counts per TP/CP share,
lengths) reuses a tuned config, and a kernel with no file autotunes as usual. A user who sets
either variable keeps full control.

Not covered: FLA's CP kernels (``chunk_cp_*``) use Triton's plain ``triton.autotune``, which FLA's
config cache never consults; they tune on first use. Keep Triton's
own results with ``TRITON_CACHE_AUTOTUNING=1`` and a persistent ``TRITON_CACHE_DIR`` per node.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

BUNDLED_CONFIG_ROOT = Path(__file__).parent / "fla_configs"


def use_bundled_fla_configs(device: torch.device) -> Callable[[], None] | None:
    """Point FLA at the bundled configs for ``device``'s GPU model (what
    :class:`relax_gdn.runtime.Runtime` does on CUDA); returns the function that puts FLA's
    settings back, or None when nothing was changed (no configs for this GPU, or the user set
    ``FLA_CONFIG_DIR`` / ``FLA_CACHE_MODE``)."""
    if "FLA_CONFIG_DIR" in os.environ or "FLA_CACHE_MODE" in os.environ:
        return None
    from fla.ops.utils import cache as fla_cache

    config_dir = BUNDLED_CONFIG_ROOT / fla_cache.sanitize_gpu_name(torch.cuda.get_device_name(device))
    if not config_dir.is_dir():
        return None
    mode_before = fla_cache.FLA_CACHE_MODE
    os.environ["FLA_CONFIG_DIR"] = str(config_dir)
    # FLA reads FLA_CACHE_MODE once at import (already done by now); the directory at every lookup.
    fla_cache.FLA_CACHE_MODE = fla_cache.FlaCacheMode.FUZZY
    logger.info("FLA kernels use the tuned configs in %s (FLA_CACHE_MODE=fuzzy)", config_dir)

    def undo() -> None:
        os.environ.pop("FLA_CONFIG_DIR", None)
        fla_cache.FLA_CACHE_MODE = mode_before

    return undo
