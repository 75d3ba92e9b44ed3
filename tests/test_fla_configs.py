"""Tuned FLA kernel configs: Triton autotune cache -> FLA config files, and the bundled set loads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from relax_gdn.bench.fla_configs import convert
from relax_gdn.gdn.fla_tuning import BUNDLED_CONFIG_ROOT


def _triton_record(tmp: Path, kernel: str, key: list, timings: list) -> None:
    folder = tmp / "HASH" / kernel  # Triton keeps one folder per cache key
    folder.mkdir(parents=True)
    (folder / f"{kernel}.autotune.json").write_text(json.dumps({"key": key, "configs_timings": timings}))


def _config(bv: int, warps: int) -> dict:
    return {
        "kwargs": {"BV": bv},
        "num_warps": warps,
        "num_stages": 3,
        "num_ctas": 1,
        "maxnreg": None,
        "pre_hook": None,
        "ir_override": None,
    }


def test_convert_keeps_the_fastest_config_and_fla_finds_it(tmp_path, monkeypatch):
    key = [16, 32, 128, "torch.bfloat16"]
    _triton_record(
        tmp_path / "cache",
        "k_fwd",
        key,
        [[_config(32, 4), [0.5, 0.4, 0.6]], [_config(64, 8), [0.3, 0.2, 0.4]]],
    )
    counts = convert([tmp_path / "cache"], tmp_path / "out")
    assert counts == {"k_fwd": 1}

    from fla.ops.utils import cache as fla_cache

    monkeypatch.setenv("FLA_CONFIG_DIR", str(tmp_path / "out"))
    monkeypatch.setattr(fla_cache, "FLA_CACHE_MODE", fla_cache.FlaCacheMode.FUZZY)
    fla_cache.load_config_file.cache_clear()
    exact = fla_cache.load_cached_config("k_fwd", fla_cache.AutotuneKey(tuple(key)))
    assert exact["kwargs"] == {"BV": 64} and exact["num_warps"] == 8 and "pre_hook" not in exact
    # another head count (a TP/CP share) reuses it; another dtype does not
    assert (
        fla_cache.load_cached_config("k_fwd", fla_cache.AutotuneKey((8, 16, 128, "torch.bfloat16"))) == exact
    )
    assert (
        fla_cache.load_cached_config("k_fwd", fla_cache.AutotuneKey((16, 32, 128, "torch.float32"))) is None
    )


def test_convert_without_records_says_how_to_make_them(tmp_path):
    with pytest.raises(ValueError, match="TRITON_CACHE_AUTOTUNING=1"):
        convert([tmp_path], tmp_path / "out")


def test_bundled_h200_configs_parse_as_fla_config_files():
    from fla.ops.utils.cache import KernelConfigFile

    files = sorted((BUNDLED_CONFIG_ROOT / "NVIDIA_H200").glob("*.json"))
    assert len(files) >= 10
    for path in files:
        parsed = KernelConfigFile.from_dict(path, json.loads(path.read_text()))
        assert parsed is not None and parsed.autotune_entries, path.name
        for entry in parsed.autotune_entries.values():
            assert {"kwargs", "num_warps", "num_stages"} <= entry["config"].keys(), path.name
