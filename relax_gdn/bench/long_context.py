"""The long-context measurements' glue: pick the attention kernel, list the e2e rows of a device
call, and read the results against the targets (issue 32). ``relax_gdn/bench/long_context.sh``
calls it.

    python -m relax_gdn.bench.long_context winner attention.json      # prints the fastest exact kernel
    python -m relax_gdn.bench.long_context rows --call 2a --winner fa4
    python -m relax_gdn.bench.long_context targets e2e_2a_1.json [more.json ...]
    python -m relax_gdn.bench.long_context plan --capacity-gib 79.1 --cp 2 --optimizer adam

``winner``: among the backends of ``bench.attention`` whose check passed, the one with the least
fwd+bwd time summed over the cases of 32k tokens and more (``varlen`` when none beats it).
``rows``: the e2e rows of one device call (:data:`E2E_CALLS`), one ``<seconds>\t<variant>`` line
each: per micro-batch size, full recompute with ``varlen`` (what the issue's table measured) and
the candidate (``recompute=mixed`` with the winner; the memory model picks its whole layers), the
selective row at 32k, and at 8k full and selective with the winner; the 64k candidate carries
``profile``. ``targets``: each candidate's tok/s against the same size's full-recompute
``varlen`` row (from any of the files), MFU, peak memory and the memory model's estimate, next to
the issue's targets. ``plan``: what the memory model fits per micro-batch size on a GPU of a given
size (docs/long_context.md).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

# micro-batch tokens -> (speed-up over full recompute at the same size, tok/s floor) of issue 32
TARGETS = {8192: (0.98, None), 32768: (1.20, 8550), 65536: (1.25, 7550), 131072: (1.25, 6780)}
# issue 32's own full-recompute tok/s (its table, FlashAttention-2): what "today's full recompute" of
# its targets refers to; a run's own full-recompute row can differ from it by ~10 % either way
ISSUE_FULL_RECOMPUTE = {8192: 8708, 16384: 7942, 32768: 7126, 65536: 6052, 131072: 5424}
LONG_CASES_FROM = 32768
# The e2e rows by device call of <= 9.5 minutes on one H200, the most informative first: 64k full
# recompute with FlashAttention-2 against mixed with the winner, then 32k, then 128k, whose two
# rows take a call each, then 8k. Each row is a bench.train_e2e process of its own (a warm-up pass,
# then 5 steps); the seconds are its time limit (the first row of a fresh machine also compiles
# and tunes its kernels), and a row starts only while that much of the call is left. {winner}: the
# attention kernel of the candidates.
E2E_CALLS: dict[str, list[tuple[int, str]]] = {
    "2a": [
        (270, "mt=65536,recompute=full,model.attention_backend=varlen"),
        (270, "mt=65536,recompute=mixed,model.attention_backend={winner},profile"),
    ],
    "2b": [
        (210, "mt=32768,recompute=full,model.attention_backend=varlen"),
        (150, "mt=32768,recompute=mixed,model.attention_backend={winner}"),
        (60, "mt=32768,recompute=selective,model.attention_backend={winner}"),
    ],
    "2c": [(450, "mt=131072,recompute=full,model.attention_backend=varlen")],
    "2d": [
        (420, "mt=131072,recompute=mixed,model.attention_backend={winner}"),
        (240, "mt=65536,recompute=full,model.attention_backend={winner}"),
    ],
    "2e": [
        (120, "mt=8192,recompute=full,model.attention_backend=varlen"),
        (90, "mt=8192,recompute=full,model.attention_backend={winner}"),
        (90, "mt=8192,recompute=selective,model.attention_backend={winner}"),
    ],
    # FP8 at 64k (docs/fp8.md): mixed with the winner in bf16 and in tensorwise, in ONE process so that
    # the ratio is measured side by side (the memory model picks each variant's whole layers)
    "2f": [
        (
            520,
            "mt=65536,recompute=mixed,model.attention_backend={winner};"
            "mt=65536,recompute=mixed,model.attention_backend={winner},fp8=tensorwise",
        ),
    ],
}


def winner(attention: dict) -> tuple[str, dict[str, float]]:
    """The fastest backend whose check passed (summed fwd+bwd ms over the long cases), and each
    passing backend's sum."""
    long_cases = [c["name"] for c in attention["cases"] if c["tokens"] >= LONG_CASES_FROM]
    sums = {}
    for entry in attention["backends"]:
        if entry.get("status") != "ok":
            continue
        times = [entry["cases"][name]["fwd_bwd_ms"] for name in long_cases if name in entry.get("cases", {})]
        if len(times) == len(long_cases) and times:
            sums[entry["backend"]] = sum(times)
    best = min(sums, key=sums.get) if sums else "varlen"
    if "varlen" in sums and sums[best] >= sums["varlen"]:
        best = "varlen"
    return best, sums


def rows(call: str, best: str) -> list[tuple[int, str]]:
    """The ``(time limit s, variant)`` rows of device call ``call`` with ``best`` as the candidates'
    attention kernel."""
    if call not in E2E_CALLS:
        raise ValueError(f"unknown call {call!r}: one of {sorted(E2E_CALLS)}")
    return [(limit, variant.format(winner=best)) for limit, variant in E2E_CALLS[call]]


def _tokens(variant: dict) -> int | None:
    return (variant.get("config") or {}).get("train.max_tokens_per_gpu")


def targets(results: list[dict]) -> list[str]:
    """One line per measured variant: tok/s, MFU, peak, the ratio to the same size's full-recompute
    varlen row of these results and to the issue's own full-recompute figure, and the target where
    the issue sets one, judged against both."""
    measured = [v for r in results for v in r["variants"]]
    base = {
        _tokens(v): v["summary"]["tokens_per_s"]
        for v in measured
        if v["summary"].get("tokens_per_s")
        and v["name"].endswith("recompute=full,model.attention_backend=varlen")
    }
    lines = [
        f"{'variant':<62}{'whole':>6}{'tok/s':>8}{'MFU':>7}{'GiB':>7}{'est':>7}{'vs full/varlen':>16}"
        f"{'vs issue':>10}  target (this run's full row; the issue's)"
    ]
    for v in measured:
        s, tokens = v["summary"], _tokens(v)
        if "refused" in s or "error" in s:
            why = "refused by the memory model" if "refused" in s else "FAILED"
            lines.append(f"{v['name']:<62}  {why}: {(s.get('refused') or s.get('error'))[:140]}")
            continue
        ratio = s["tokens_per_s"] / base[tokens] if base.get(tokens) else None
        issue_ratio = (
            s["tokens_per_s"] / ISSUE_FULL_RECOMPUTE[tokens] if tokens in ISSUE_FULL_RECOMPUTE else None
        )
        verdict = ""
        if "full,model.attention_backend=varlen" not in v["name"]:
            verdict = _verdict(tokens, s["tokens_per_s"], ratio, issue_ratio)
        estimate = (s.get("memory_estimate_gib") or {}).get("total") or 0.0
        whole = v.get("full_layers")  # mixed: the layers recomputed whole
        lines.append(
            f"{v['name']:<62}{'-' if whole is None else whole:>6}{s['tokens_per_s']:>8.0f}"
            f"{s['mfu'] or 0:>7.3f}{s['peak_mem_gib'] or 0:>7.1f}"
            f"{estimate:>7.1f}{(f'{ratio:.3f}x' if ratio else '-'):>16}"
            f"{(f'{issue_ratio:.3f}x' if issue_ratio else '-'):>10}  {verdict}"
        )
    return lines


def _verdict(tokens: int, tok_s: float, ratio: float | None, issue_ratio: float | None) -> str:
    """``>= goal [and >= floor tok/s]: met|MISSED; issue's: met|MISSED`` where the issue sets a target."""
    goal, floor = TARGETS.get(tokens, (None, None))
    if goal is None:
        return ""

    def judged(r: float | None) -> str:
        return "-" if r is None else ("met" if r >= goal and (floor is None or tok_s >= floor) else "MISSED")

    return (
        f">= {goal:.2f}x"
        + (f" and >= {floor} tok/s" if floor else "")
        + f": {judged(ratio)}; issue's: {judged(issue_ratio)}"
    )


def plan(
    capacity_gib: float,
    lengths: list[int],
    *,
    tp: int = 1,
    cp: int = 1,
    dp: int = 1,
    optimizer: str = "none",
    preset: str = "qwen3_5_9b",
) -> list[str]:
    """Per micro-batch size (tokens per GPU), what the memory model says fits a GPU of
    ``capacity_gib``: selective where its estimate fits the share of the GPU that mixed's choice
    keeps to (:data:`~relax_gdn.train.memory.MIXED_HEADROOM`: the rest goes to the allocator's
    spare blocks and memory outside torch), else mixed with its fewest whole layers, else full
    (marked tight above that share), else nothing, with the estimate."""
    from relax_gdn.model import qwen3_5_config, qwen3_5_preset
    from relax_gdn.train.flops import ModelShape
    from relax_gdn.train.memory import GIB, MIXED_HEADROOM, estimate_memory, fewest_full_layers

    vocab = -(-qwen3_5_preset(preset).vocab_size // 1024) * 1024
    shape = ModelShape.from_transformer_config(qwen3_5_config(preset), vocab)
    capacity = capacity_gib * GIB
    lines = [
        f"{preset}, {capacity_gib:g} GiB per GPU, TP {tp}{' + SP' if tp > 1 else ''} x CP {cp} x DP {dp}, "
        f"optimizer {optimizer}:"
    ]
    for tokens in lengths:
        common = dict(
            tokens_per_gpu=tokens, tp=tp, sequence_parallel=tp > 1, cp=cp, dp=dp, optimizer=optimizer
        )
        layers = fewest_full_layers(shape, capacity, **common)
        full = estimate_memory(shape, recompute="full", **common)
        if layers == 0:
            selective = estimate_memory(shape, recompute="selective", **common)
            choice = f"selective ({selective.total / GIB:.1f} GiB)"
        elif layers is not None and layers < shape.num_layers:
            mixed = estimate_memory(shape, recompute="mixed", full_layers=layers, **common)
            choice = f"mixed, {layers} of {shape.num_layers} layers whole ({mixed.total / GIB:.1f} GiB)"
        elif full.total <= capacity:
            tight = "" if full.total <= MIXED_HEADROOM * capacity else f", above {MIXED_HEADROOM:.0%}: tight"
            choice = f"full ({full.total / GIB:.1f} GiB{tight})"
        else:
            choice = f"nothing fits (full: {full.total / GIB:.1f} GiB)"
        lines.append(f"  {tokens:>7} tokens/GPU: {choice}")
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    w = sub.add_parser("winner")
    w.add_argument("attention_json")
    r = sub.add_parser("rows", help="one device call's e2e rows, '<seconds>\\t<variant>' per line")
    r.add_argument("--call", required=True, choices=sorted(E2E_CALLS))
    r.add_argument("--winner", required=True)
    t = sub.add_parser("targets")
    t.add_argument("e2e_json", nargs="+")
    p = sub.add_parser("plan", help="what the memory model fits per micro-batch size")
    p.add_argument("--capacity-gib", type=float, default=139.8, help="the GPU's memory as torch reports it")
    p.add_argument("--lengths", default="8192,16384,32768,65536,131072")
    p.add_argument("--tp", type=int, default=1, help="with sequence parallelism when > 1")
    p.add_argument("--cp", type=int, default=1)
    p.add_argument("--dp", type=int, default=1)
    p.add_argument("--optimizer", choices=("adam", "none"), default="none")
    args = parser.parse_args(argv)
    if args.command == "plan":
        print(
            "\n".join(
                plan(
                    args.capacity_gib,
                    [int(x) for x in args.lengths.split(",")],
                    tp=args.tp,
                    cp=args.cp,
                    dp=args.dp,
                    optimizer=args.optimizer,
                )
            )
        )
        return
    if args.command == "winner":
        path = Path(args.attention_json)
        best, sums = winner(json.loads(path.read_text())) if path.exists() else ("varlen", {})
        print(best)
        print(f"(summed fwd+bwd ms over the >= 32k cases: {sums or 'no attention results'})", file=sys.stderr)
    elif args.command == "rows":
        print("\n".join(f"{limit}\t{variant}" for limit, variant in rows(args.call, args.winner)))
    else:
        found = [json.loads(Path(p).read_text()) for p in args.e2e_json if Path(p).exists()]
        print("\n".join(targets(found)))


if __name__ == "__main__":
    from relax_gdn.runtime import Runtime

    with Runtime():  # every process-wide change of the benchmark, undone when it ends
        main()
