"""``python -m relax_gdn.compare``: see docs/compare.md.

  python -m relax_gdn.compare outputs/sweeps/2026-12-01/11-40-00 --baseline gdn.cp_mode=headwise
  python -m relax_gdn.compare --wandb ENTITY/PROJECT --group G --out compare/
  python -m relax_gdn.compare --wandb-report ENTITY/PROJECT --group G     # saves a W&B report

Exit codes: 0 done, 2 bad input (no runs, unknown baseline, a missing or unreadable file), with one
message; anything else is a bug and keeps its traceback (exit 1).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from relax_gdn.compare.runs import CompareInputError
from relax_gdn.errors import USER_ERROR_EXIT_CODE, RecipeError
from relax_gdn.known_warnings import silence_known_warnings


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m relax_gdn.compare",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("paths", nargs="*", help="run directories, sweep directories or benchmark .json files")
    p.add_argument(
        "--out",
        help="output directory (default: beside the first input: <dir>/compare for a "
        "directory, <name>-compare/ next to a .json file; ./compare-<group> for W&B "
        "alone)",
    )
    p.add_argument(
        "--baseline",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="the variant others are compared with (repeatable; default: the first variant)",
    )
    p.add_argument("--wandb", metavar="ENTITY/PROJECT", help="also read the runs of --group from W&B")
    p.add_argument("--group", help="W&B group (with --wandb or --wandb-report)")
    p.add_argument(
        "--wandb-report", metavar="ENTITY/PROJECT", help="save a W&B report of --group (needs a server)"
    )
    p.add_argument("--group-by", default="gdn.cp_mode", help="config key the W&B report groups runs by")
    p.add_argument(
        "--print-spec", action="store_true", help="with --wandb-report: print the spec, save nothing"
    )
    return p.parse_args(argv)


def default_out_dir(paths: list[str], group: str | None) -> Path:
    """Where the reports go without ``--out``: beside the first input, so they stay with what they
    describe (``<dir>/compare/`` for a run or sweep directory, ``<stem>-compare/`` next to a
    benchmark file), never into whatever directory the command ran in; W&B alone:
    ``./compare-<group>/``."""
    if not paths:
        return Path(f"compare-{group}")
    first = Path(paths[0])
    return first / "compare" if first.is_dir() else first.with_name(f"{first.stem}-compare")


def main(argv: list[str] | None = None) -> int:
    """The command; the recipe's known third-party notices are silenced while it runs (one list,
    :mod:`relax_gdn.known_warnings`, as for training, the export and the benchmarks)."""
    undo = silence_known_warnings()
    try:
        return _main(parse_args(argv))
    finally:
        undo()


def _main(args: argparse.Namespace) -> int:
    try:
        if args.wandb_report:
            from relax_gdn.compare.wandb_report import report_spec, save_report

            if not args.group:
                raise CompareInputError("--wandb-report needs --group G (the W&B group of the runs)")
            spec = report_spec(args.wandb_report, args.group, args.group_by)
            if args.print_spec:
                print(json.dumps(spec, indent=2))
                return 0
            print(f"saved W&B report: {save_report(spec)}")
            if not args.paths and not args.wandb:
                return 0
        from relax_gdn.compare.report import markdown, write_reports
        from relax_gdn.compare.runs import find_runs, load_wandb_runs
        from relax_gdn.compare.stats import compare_runs

        runs = find_runs(args.paths)
        if args.wandb:
            if not args.group:
                raise CompareInputError("--wandb needs --group G (the W&B group of the runs)")
            runs += load_wandb_runs(args.wandb, args.group)
        if not runs:
            raise CompareInputError(
                "nothing to compare: give run/sweep directories, a benchmark .json or --wandb"
            )
        summary = compare_runs(runs, args.baseline)
        out = Path(args.out) if args.out else default_out_dir(args.paths, args.group)
        paths = write_reports(runs, summary, out)
    except RecipeError as e:  # input the user fixes; any other exception is a bug, with its traceback
        print(f"relax_gdn.compare: {e}", file=sys.stderr)
        return USER_ERROR_EXIT_CODE
    print(markdown(summary))
    print(f"{len(runs)} runs, {len(summary['variants'])} variants -> {out}: {', '.join(sorted(paths))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
