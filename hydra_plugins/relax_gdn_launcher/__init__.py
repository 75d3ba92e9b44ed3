"""relax-gdn's Hydra launchers (``hydra/launcher=local|slurm``); see :mod:`.launcher`."""
