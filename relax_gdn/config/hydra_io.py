"""The only bridge between Hydra/OmegaConf and the typed config (ARCHITECTURE.md: only train.py
and relax_gdn/config read Hydra)."""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue

from relax_gdn.config.schema import RunConfig, run_config_from_dict
from relax_gdn.config.validate import ConfigError


def run_config_from_hydra(cfg: DictConfig) -> RunConfig:
    """Resolve interpolations and build the typed config; a ``???`` left unset names its key."""
    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:
        raise ConfigError([f"{key} is required (it is ??? in the chosen config group); pass {key}=..." for key in missing])
    try:
        values = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    except MissingMandatoryValue as e:  # pragma: no cover - missing_keys catches these first
        raise ConfigError([str(e)]) from e
    values.pop("hydra", None)
    return run_config_from_dict(values)


def save_run_config(cfg: RunConfig, run_dir: str | Path) -> Path:
    """Write the resolved config as ``<run_dir>/config.yaml`` (rank 0 only; the caller decides)."""
    path = Path(run_dir) / "config.yaml"
    path.write_text(OmegaConf.to_yaml(OmegaConf.create(cfg.to_dict())))
    return path


def load_run_config(path: str | Path) -> RunConfig:
    """The typed config saved by :func:`save_run_config`."""
    return run_config_from_dict(OmegaConf.to_container(OmegaConf.load(path), resolve=True))
