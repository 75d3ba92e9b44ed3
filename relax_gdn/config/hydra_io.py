"""The only bridge between Hydra/OmegaConf and the typed config (docs/design/ARCHITECTURE.md: only train.py
and relax_gdn/config read Hydra)."""

from __future__ import annotations

import dataclasses
import functools
import re
import types
import typing
from pathlib import Path

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue

from relax_gdn.config.schema import RunConfig, run_config_from_dict, unknown_key_problem
from relax_gdn.errors import ConfigError

SCHEMA_NAME = "relax_gdn_schema"  # conf/config.yaml's defaults list starts from it


def _omegaconf_type(hint):
    """The type OmegaConf 2.3 checks for ``hint``: it knows neither ``Literal`` nor unions of
    values, so a ``Literal`` of strings is checked as ``str`` (``validate`` checks the choice) and
    ``int | float`` as ``float``, a union with a ``Literal`` of strings (``float | Literal["auto"]``)
    as ``str``; ``X | None`` stays optional."""
    if dataclasses.is_dataclass(hint):
        return omegaconf_schema(hint)
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Literal:
        return type(args[0])
    if origin in (typing.Union, types.UnionType):
        kinds = [a for a in args if a is not type(None)]
        if len(kinds) == 1:
            base = _omegaconf_type(kinds[0])
        else:  # a number or a word ("auto") travels as text; the typed config reads the number back
            base = str if str in {_omegaconf_type(k) for k in kinds} else float
        return base | None if type(None) in args else base
    return hint


@functools.cache
def omegaconf_schema(cls: type) -> type:
    """A copy of the dataclass ``cls`` with types OmegaConf can enforce and the same defaults."""
    hints = typing.get_type_hints(cls)
    fields = []
    for f in dataclasses.fields(cls):
        kind = _omegaconf_type(hints[f.name])
        if dataclasses.is_dataclass(hints[f.name]):
            fields.append((f.name, kind, dataclasses.field(default_factory=kind)))
        elif f.default_factory is not dataclasses.MISSING:
            fields.append((f.name, kind, dataclasses.field(default_factory=f.default_factory)))
        else:
            fields.append((f.name, kind, dataclasses.field(default=f.default)))
    return dataclasses.make_dataclass(cls.__name__, fields)


def register_schema() -> None:
    """Register :class:`RunConfig` in Hydra's ConfigStore as ``relax_gdn_schema``: every
    composition starts from the dataclass defaults, and Hydra refuses unknown keys and values
    of the wrong type while composing (before ``validate`` sees anything)."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name=SCHEMA_NAME, node=omegaconf_schema(RunConfig))


def compose_run_config(
    config_dir: str | Path, overrides: list[str], config_name: str = "config"
) -> RunConfig:
    """What ``python train.py <overrides>`` composes, as the typed config; every Hydra composition
    error (unknown key, wrong type, unknown group option, bad syntax) as one :class:`ConfigError`."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException

    register_schema()
    try:
        with initialize_config_dir(config_dir=str(Path(config_dir).resolve()), version_base="1.3"):
            return run_config_from_hydra(compose(config_name=config_name, overrides=list(overrides)))
    except HydraException as e:
        raise ConfigError([hydra_problem(e)]) from e


def sweep_jobs_to_compose(overrides: list[str]) -> list[list[str]] | None:
    """For ``train.py -m <overrides>``: job override lists that together give every value of every
    swept key once (job i takes each key's value i, cycling through shorter lists), so composing
    them finds each unknown key, group option or badly typed value of the sweep before its first
    job starts. None for a sweep Hydra must expand itself (``glob(...)``, which reads the config
    groups). Bad override syntax is a :class:`ConfigError`."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import Glob
    from hydra.errors import HydraException

    try:
        parsed = OverridesParser.create().parse_overrides(list(overrides))
        if any(isinstance(o.value(), Glob) for o in parsed):  # only Hydra's sweeper can list its options
            return None
        columns = [
            [f"{o.get_key_element()}={value}" for value in o.sweep_string_iterator()]
            if o.is_sweep_override()
            else [o.input_line]
            for o in parsed
        ]
    except HydraException as e:
        raise ConfigError([hydra_problem(e)]) from e
    jobs = max((len(column) for column in columns), default=1)
    return [[column[i % len(column)] for column in columns] for i in range(jobs)]


# Hydra's command-line modes, each with its spellings in Hydra's argparse parser: it runs one of
# them (hydra/_internal/utils.py) and raises a ValueError, with a traceback, when given two
HYDRA_MODES = {
    "--run": ("--run", "-r"),
    "--multirun": ("--multirun", "-m"),
    "--cfg": ("--cfg", "-c"),
    "--info": ("--info", "-i"),
    "--shell-completion": ("--shell-completion", "-sc"),
}
MULTIRUN_FLAGS = frozenset(HYDRA_MODES["--multirun"])


def hydra_mode_problem(argv: list[str]) -> str | None:
    """One line for a command line that asks Hydra for two of its modes (``train.py -m --cfg job``),
    None when it asks for one or none."""
    flags = {arg.split("=")[0] for arg in argv if arg.startswith("-")}
    modes = [mode for mode, spellings in HYDRA_MODES.items() if flags.intersection(spellings)]
    if len(modes) < 2:
        return None
    fix = (
        "; to see one sweep job's configuration, give --cfg job that job's overrides (one value per key)"
        if {"--multirun", "--cfg"} <= set(modes)
        else ""
    )
    return f"{' and '.join(modes)} cannot be given together: Hydra runs one of {', '.join(HYDRA_MODES)}{fix}"


def hydra_problem(error: Exception) -> str:
    """One line naming the key (or group) and the fix for an error Hydra raised while composing."""
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError, ValidationError

    cause, text = error.__cause__, str(error)
    key = getattr(cause, "full_key", None)
    if isinstance(cause, (ConfigKeyError, ConfigAttributeError)) and key:
        return unknown_key_problem(key)
    if isinstance(cause, ValidationError) and key:
        given = text.removeprefix("Error merging override ").strip()
        reason = str(cause).splitlines()[0]
        return f"{given}: {reason}; give {key} a value of its type (relax_gdn/config/schema.py)"
    missing = re.search(r"Could not find '([^']+)/([^']+)'", text)
    if missing:
        group, option = missing.groups()
        options = re.findall(r"^\t(\S+)$", text.split("Config search path")[0], flags=re.M)
        return (
            f"{group}={option} is not an option of the {group} group; use one of {', '.join(options)} "
            f"(conf/{group}/)"
        )
    again = re.search(r"Multiple values for (\S+)\. To override a value use 'override \S+ (\S+)'", text)
    if again:
        group, option = again.groups()
        return f"+{group}={option} adds a second {group} option: swap it with {group}={option} (without +)"
    lines = [line.strip() for line in text.split("Config search path")[0].splitlines() if line.strip()]
    return " ".join(lines)


def run_config_from_hydra(cfg: DictConfig) -> RunConfig:
    """Resolve interpolations and build the typed config; a ``???`` left unset names its key."""
    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:
        raise ConfigError(
            [f"{key} is required (it is ??? in the chosen config group); pass {key}=..." for key in missing]
        )
    try:
        values = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    except MissingMandatoryValue as e:  # pragma: no cover - missing_keys catches these first
        raise ConfigError([str(e)]) from e
    values.pop("hydra", None)
    return run_config_from_dict(values)


def save_run_config(cfg: RunConfig, run_dir: str | Path) -> Path:
    """Write the resolved config (derived defaults filled in, :meth:`RunConfig.resolved`) as
    ``<run_dir>/config.yaml`` (rank 0 only; the caller decides)."""
    path = Path(run_dir) / "config.yaml"
    path.write_text(OmegaConf.to_yaml(OmegaConf.create(cfg.resolved().to_dict())))
    return path


def load_run_config(path: str | Path) -> RunConfig:
    """The typed config saved by :func:`save_run_config`."""
    return run_config_from_dict(OmegaConf.to_container(OmegaConf.load(path), resolve=True))


# Registered on import: whatever composes conf/ (train.py, tests, tools) reads Hydra through here.
register_schema()
