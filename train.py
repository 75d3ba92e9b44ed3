"""Hydra entry point: ``python train.py [overrides]`` or ``torchrun --nproc-per-node N train.py [overrides]``.

Thin on purpose: compose -> typed config -> validate (before any process group or model) -> train.
The default (no overrides) is the embedded CPU demo; see conf/config.yaml for the groups.
"""

from __future__ import annotations

import logging
import os
import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

# Only global rank 0 writes the run directory: other torchrun ranks tell Hydra to write no
# .hydra/ files and no job log (they learn rank 0's run directory from it after init).
if int(os.environ.get("RANK", "0")) != 0 and not any(a.startswith("hydra.output_subdir") for a in sys.argv):
    sys.argv += ["hydra.output_subdir=null", "hydra/job_logging=disabled", "hydra/hydra_logging=disabled",
                 "hydra.run.dir=."]

log = logging.getLogger("train")

from relax_gdn.config.hydra_io import register_schema  # noqa: E402 - light: dataclasses + OmegaConf

register_schema()


@hydra.main(config_path="conf", config_name="config", version_base="1.3")
def main(hydra_cfg: DictConfig) -> float | None:
    from relax_gdn.config import validate
    from relax_gdn.config.hydra_io import run_config_from_hydra
    from relax_gdn.errors import USER_ERROR_EXIT_CODE, RecipeError
    from relax_gdn.train.loop import env_world_size, run_training
    from relax_gdn.train.metrics import cp_size_histogram, format_cp_sizes

    try:
        cfg = run_config_from_hydra(hydra_cfg)
        validate(cfg, env_world_size())
        run_dir = HydraConfig.get().runtime.output_dir if int(os.environ.get("RANK", "0")) == 0 else None
        result = run_training(cfg, run_dir)
    except RecipeError as e:  # the user's to fix: the message names it, a traceback would bury it
        log.error("%s", e)
        raise SystemExit(USER_ERROR_EXIT_CODE) from None
    if result.records and int(os.environ.get("RANK", "0")) == 0:
        first, last = result.records[0], result.records[-1]
        log.info("done: %d steps, loss %.4f -> %.4f, %.0f tok/s (last step); outputs in %s",
                 len(result.records), first["loss"], last["loss"], last["tokens_per_s"], result.run_dir)
        histogram = cp_size_histogram(result.records)
        if histogram:  # dynamic CP
            log.info("micro-batches per CP size over the run: %s", format_cp_sizes(histogram))
        return last["loss"]  # what a Hydra sweeper would optimise
    return None


if __name__ == "__main__":
    main()
