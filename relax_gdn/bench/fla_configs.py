"""Turn Triton's on-disk autotuning results into FLA kernel-config files, so FLA stops autotuning.

FLA autotunes every kernel per head shape and dtype on first use, paid again by every rank of
every job. Triton keeps the results when ``TRITON_CACHE_AUTOTUNING=1``
(``<cache>/<hash>/<kernel>.autotune.json``). FLA reads ``$FLA_CONFIG_DIR/<kernel>.json`` when
``FLA_CACHE_MODE`` is ``strict`` (exact key) or ``fuzzy`` (numeric key parts may differ, e.g.
head counts or lengths). Tune once, convert, ship the directory with the job:

    TRITON_CACHE_AUTOTUNING=1 <run anything that calls the kernels>
    python -m relax_gdn.bench.fla_configs ~/.triton/cache --out fla-configs/H200
    FLA_CONFIG_DIR=fla-configs/H200 FLA_CACHE_MODE=fuzzy python train.py ...
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

_TRITON_SUFFIX = ".autotune.json"


def _best(configs_timings: list) -> dict:
    def median_ms(timing) -> float:
        return timing[0] if isinstance(timing, list) else timing

    config, _ = min(configs_timings, key=lambda ct: median_ms(ct[1]))
    return {k: v for k, v in config.items() if k != "pre_hook"}


def convert(triton_cache_dirs: list[Path], out_dir: Path) -> dict[str, int]:
    """Write one ``<kernel>.json`` per kernel found; return the number of entries per kernel."""
    from fla.ops.utils.cache import AutotuneKey  # FLA looks entries up by its own key hash

    entries: dict[str, dict[str, dict]] = defaultdict(dict)
    for cache_dir in triton_cache_dirs:
        for path in sorted(cache_dir.rglob(f"*{_TRITON_SUFFIX}")):
            record = json.loads(path.read_text())
            key = record["key"]
            entries[path.name[: -len(_TRITON_SUFFIX)]][AutotuneKey.key_hash(key)] = {
                "autotune_key": key,
                "config": _best(record["configs_timings"]),
            }
    if not entries:
        raise ValueError(
            f"no *{_TRITON_SUFFIX} files under {[str(d) for d in triton_cache_dirs]}: run the kernels once "
            "with TRITON_CACHE_AUTOTUNING=1 (and the same TRITON_CACHE_DIR) first"
        )
    out_dir.mkdir(parents=True, exist_ok=True)
    for kernel, by_hash in entries.items():
        (out_dir / f"{kernel}.json").write_text(
            json.dumps({"kernel_name": kernel, "autotune_entries": by_hash}, indent=1)
        )
    return {kernel: len(by_hash) for kernel, by_hash in entries.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("triton_cache", nargs="+", type=Path, help="Triton cache dir(s) (TRITON_CACHE_DIR)")
    parser.add_argument("--out", type=Path, required=True, help="FLA config dir to write (FLA_CONFIG_DIR)")
    args = parser.parse_args()
    for kernel, n in sorted(convert(args.triton_cache, args.out).items()):
        print(f"{kernel}: {n} tuned key(s)")


if __name__ == "__main__":
    from relax_gdn.runtime import Runtime

    with Runtime():  # every process-wide change of the benchmark, undone when it ends
        main()
