"""The long-context measurements' glue: pick the attention kernel, write the e2e variants, and
read the results against the targets (issue 32). ``relax_gdn/bench/long_context.sh`` calls it.

    python -m relax_gdn.bench.long_context winner attention.json      # prints the fastest exact kernel
    python -m relax_gdn.bench.long_context variants --winner fa4 --lengths 32768,65536,131072
    python -m relax_gdn.bench.long_context targets e2e.json [more.json ...]
    python -m relax_gdn.bench.long_context plan --capacity-gib 79.1 --cp 2 --optimizer adam

``winner``: among the backends of ``bench.attention`` whose check passed, the one with the least
fwd+bwd time summed over the cases of 32k tokens and more (``varlen`` when none beats it).
``variants``: per micro-batch size, today's setting (full recompute, ``varlen``) and the candidate
(``recompute=mixed`` with the winner), plus the selective row at 32k that the memory model refuses;
the 64k candidate carries ``profile``. ``targets``: each candidate's tok/s against the same size's
full-recompute ``varlen`` row, MFU, peak memory and the memory model's estimate (within 10 % of
the peak, as the memory model promises), next to the issue's targets. ``plan``: what
the memory model fits per micro-batch size on a GPU of a given size (docs/long_context.md).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

# micro-batch tokens -> (speed-up over full recompute at the same size, tok/s floor) of issue 32
TARGETS = {8192: (0.98, None), 32768: (1.20, 8550), 65536: (1.25, 7550), 131072: (1.25, 6780)}
LONG_CASES_FROM = 32768


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


def variants(best: str, lengths: list[int]) -> str:
    rows = []
    for tokens in lengths:
        rows.append(f"mt={tokens},recompute=full,model.attention_backend=varlen")
        if tokens <= 16384:
            rows.append(f"mt={tokens},recompute=full,model.attention_backend={best}")
            rows.append(f"mt={tokens},recompute=selective,model.attention_backend={best}")
            continue
        if tokens == 32768:  # what selective needs there: refused by the memory model, reported
            rows.append(f"mt={tokens},recompute=selective,model.attention_backend={best}")
        rows.append(f"mt={tokens},recompute=mixed,model.attention_backend={best}" + (",profile" if tokens == 65536 else ""))
    return ";".join(rows)


def _tokens(variant: dict) -> int | None:
    return (variant.get("config") or {}).get("train.max_tokens_per_gpu")


def targets(results: list[dict]) -> list[str]:
    """One line per measured variant: tok/s, MFU, peak, the ratio to the same size's full-recompute
    varlen row, and the target where the issue sets one."""
    rows = [v for r in results for v in r["variants"]]
    base = {_tokens(v): v["summary"]["tokens_per_s"] for v in rows
            if v["summary"].get("tokens_per_s") and v["name"].endswith("recompute=full,model.attention_backend=varlen")}
    lines = [f"{'variant':<62}{'tok/s':>8}{'MFU':>7}{'GiB':>7}{'est':>7}{'vs full/varlen':>16}  target"]
    for v in rows:
        s, tokens = v["summary"], _tokens(v)
        if "refused" in s or "error" in s:
            why = "refused by the memory model" if "refused" in s else "FAILED"
            lines.append(f"{v['name']:<62}  {why}: {(s.get('refused') or s.get('error'))[:140]}")
            continue
        ratio = s["tokens_per_s"] / base[tokens] if base.get(tokens) else None
        goal, floor = TARGETS.get(tokens, (None, None))
        verdict = ""
        if goal is not None and ratio is not None and "full,model.attention_backend=varlen" not in v["name"]:
            met = ratio >= goal and (floor is None or s["tokens_per_s"] >= floor)
            verdict = f">= {goal:.2f}x" + (f" and >= {floor} tok/s" if floor else "") + (": met" if met else ": MISSED")
        estimate = (s.get("memory_estimate_gib") or {}).get("total") or 0.0
        lines.append(f"{v['name']:<62}{s['tokens_per_s']:>8.0f}{s['mfu'] or 0:>7.3f}{s['peak_mem_gib'] or 0:>7.1f}"
                     f"{estimate:>7.1f}{(f'{ratio:.3f}x' if ratio else '-'):>16}  {verdict}")
    return lines


def plan(capacity_gib: float, lengths: list[int], *, tp: int = 1, cp: int = 1, dp: int = 1,
         optimizer: str = "none", preset: str = "qwen3_5_9b") -> list[str]:
    """Per micro-batch size (tokens per GPU), what the memory model says fits a GPU of
    ``capacity_gib``: selective where it fits, else mixed with its fewest whole layers, else full,
    else nothing, with the estimate."""
    from relax_gdn.model import qwen3_5_config, qwen3_5_preset
    from relax_gdn.train.flops import ModelShape
    from relax_gdn.train.memory import GIB, estimate_memory, fewest_full_layers

    vocab = -(-qwen3_5_preset(preset).vocab_size // 1024) * 1024
    shape = ModelShape.from_transformer_config(qwen3_5_config(preset), vocab)
    capacity = capacity_gib * GIB
    lines = [f"{preset}, {capacity_gib:g} GiB per GPU, TP {tp}{' + SP' if tp > 1 else ''} x CP {cp} x DP {dp}, "
             f"optimizer {optimizer}:"]
    for tokens in lengths:
        common = dict(tokens_per_gpu=tokens, tp=tp, sequence_parallel=tp > 1, cp=cp, dp=dp, optimizer=optimizer)
        selective = estimate_memory(shape, recompute="selective", **common)
        layers = fewest_full_layers(shape, capacity, **common)
        full = estimate_memory(shape, recompute="full", **common)
        if selective.total <= capacity:
            choice = f"selective ({selective.total / GIB:.1f} GiB)"
        elif layers is not None and layers < shape.num_layers:
            mixed = estimate_memory(shape, recompute="mixed", full_layers=layers, **common)
            choice = f"mixed, {layers} of {shape.num_layers} layers whole ({mixed.total / GIB:.1f} GiB)"
        elif full.total <= capacity:
            choice = f"full ({full.total / GIB:.1f} GiB)"
        else:
            choice = f"nothing fits (full: {full.total / GIB:.1f} GiB)"
        lines.append(f"  {tokens:>7} tokens/GPU: {choice}")
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    w = sub.add_parser("winner")
    w.add_argument("attention_json")
    v = sub.add_parser("variants")
    v.add_argument("--winner", required=True)
    v.add_argument("--lengths", default="32768,65536,131072")
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
        print("\n".join(plan(args.capacity_gib, [int(x) for x in args.lengths.split(",")], tp=args.tp, cp=args.cp,
                             dp=args.dp, optimizer=args.optimizer)))
        return
    if args.command == "winner":
        path = Path(args.attention_json)
        best, sums = winner(json.loads(path.read_text())) if path.exists() else ("varlen", {})
        print(best)
        print(f"(summed fwd+bwd ms over the >= 32k cases: {sums or 'no attention results'})",
              file=sys.stderr)
    elif args.command == "variants":
        print(variants(args.winner, [int(x) for x in args.lengths.split(",")]))
    else:
        found = [json.loads(Path(p).read_text()) for p in args.e2e_json if Path(p).exists()]
        print("\n".join(targets(found)))


if __name__ == "__main__":
    from relax_gdn.runtime import Runtime

    with Runtime():  # every process-wide change of the benchmark, undone when it ends
        main()
