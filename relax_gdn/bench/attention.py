"""Exact varlen causal GQA attention kernels side by side at the 9B's attention shapes, one GPU.

    python -m relax_gdn.bench.attention [--out attention.json] [--backends varlen,flex,cudnn,fa4]
        [--lengths 8192,32768,65536,131072] [--packings mixed,long] [--iters 10]

16 query / 4 key-value heads of dim 256, bf16, forward + backward through
:func:`relax_gdn.model.attention.attend_zigzag_shard` (what a training step runs at CP 1; the zigzag
split at CP 1 is only the documents' ``cu_seqlens``), one backend at a time
(:mod:`relax_gdn.model.attention_kernels`):

1. Check, on a small packed case (documents of 1,000 / 512 / 2,584 tokens): each backend's output
   and q/k/v gradients against per-document causal SDPA in fp32, relative L2 error; it passes when
   within ``max(2.5 x SDPA-in-bf16's error, 2e-2)`` (the GPU tests' rule).
2. Time, per micro-batch of 8k / 32k / 64k / 128k tokens: ``mixed`` packs documents of log-normal
   lengths (median 8k, 1k-64k), ``long`` documents of 64k (or the whole micro-batch when shorter).
   CUDA events, medians of ``--iters`` calls after warm-up; ``first`` is the first call on a new
   packing after the backend has compiled (per-micro-batch set-up: plan, block mask, cuDNN graph).

Prints a table of fwd+bwd ms and the ratio to ``varlen`` (torch's FlashAttention-2) per case, and
writes everything to ``--out`` (JSON). A backend that is unavailable here, fails, or fails the check
is reported as such (with the reason) and the run goes on with the next.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import statistics
import time
import traceback
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from relax_gdn.bench.needs import require_gpus

HEADS, GROUPS, DIM = 16, 4, 256  # Qwen3.5-9B full attention
CHECK_LENGTHS = (1000, 512, 2584)
BACKENDS = ("varlen", "flex", "cudnn", "fa4")


def mixed_lengths(total: int, seed: int, longest: int = 65536, shortest: int = 1024) -> list[int]:
    """Document lengths summing to ``total``: log-normal (median 8k, sigma 1) clipped to
    ``[shortest, longest]``; the remainder joins the last document or becomes one."""
    rng = np.random.default_rng(seed)
    lengths: list[int] = []
    while sum(lengths) < total:
        n = int(np.clip(rng.lognormal(math.log(8192), 1.0), shortest, longest))
        lengths.append(min(n, total - sum(lengths)))
    if len(lengths) > 1 and lengths[-1] < shortest and lengths[-2] + lengths[-1] <= longest:
        lengths[-2] += lengths.pop()
    return lengths


def long_lengths(total: int, longest: int = 65536) -> list[int]:
    return [longest] * (total // longest) + ([total % longest] if total % longest else [])


def boundaries(lengths: list[int]) -> list[int]:
    return [0, *np.cumsum(lengths).tolist()]


def attention_flops(lengths: list[int], fwd_bwd: bool = True) -> float:
    """Causal attention FLOPs (QK^T and PV, 2 per multiply-add); backward is 2.5x forward."""
    fwd = 4.0 * sum(n * (n + 1) / 2 for n in lengths) * HEADS * DIM
    return fwd * (3.5 if fwd_bwd else 1.0)


def _tensors(total: int, seed: int, device, dtype=torch.bfloat16):
    g = torch.Generator(device="cpu").manual_seed(seed)
    def make(*shape):
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)

    return make(total, HEADS, DIM), make(total, GROUPS, DIM), make(total, GROUPS, DIM), make(total, HEADS, DIM)


def _plan(cu: list[int], device):
    from relax_gdn.model.attention import build_zigzag_attention_plan

    return build_zigzag_attention_plan(cu, 1, 0, device)


def _step(backend: str, plan, q, k, v, grad, scale: float):
    """fwd + bwd of one call; returns (out, dq, dk, dv)."""
    from relax_gdn.model.attention import attend_zigzag_shard

    q, k, v = (x.detach().requires_grad_(True) for x in (q, k, v))
    out = attend_zigzag_shard(q, k, v, plan, softmax_scale=scale, backend=backend)
    out.backward(grad)
    return out.detach(), q.grad, k.grad, v.grad


def reference(q, k, v, grad, cu: list[int], scale: float):
    """Per-document causal SDPA in fp32: (out, dq, dk, dv)."""
    q, k, v = (x.detach().float().requires_grad_(True) for x in (q, k, v))
    outs = []
    for s, e in zip(cu[:-1], cu[1:]):
        outs.append(F.scaled_dot_product_attention(
            q[s:e].transpose(0, 1), k[s:e].transpose(0, 1), v[s:e].transpose(0, 1), is_causal=True,
            scale=scale, enable_gqa=True).transpose(0, 1))
    out = torch.cat(outs)
    out.backward(grad.float())
    return out.detach(), q.grad, k.grad, v.grad


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


def check(backend: str, device) -> dict:
    """Output and q/k/v gradient errors of ``backend`` against fp32 per-document SDPA."""
    cu = boundaries(list(CHECK_LENGTHS))
    scale = 1 / math.sqrt(DIM)
    q, k, v, grad = _tensors(cu[-1], seed=1, device=device, dtype=torch.float32)
    ref = reference(q, k, v, grad, cu, scale)
    low = _step("sdpa", _plan(cu, device), *(x.bfloat16() for x in (q, k, v, grad)), scale)
    got = _step(backend, _plan(cu, device), *(x.bfloat16() for x in (q, k, v, grad)), scale)
    errors, passed = {}, True
    for name, g, lo, r in zip(("out", "dq", "dk", "dv"), got, low, ref):
        err, bound = _rel(g, r), max(2.5 * _rel(lo, r), 2e-2)
        errors[name] = {"rel_err": err, "sdpa_bf16_rel_err": _rel(lo, r), "bound": bound}
        passed &= err < bound
    return {"passed": passed, "errors": errors}


def _events_ms(fn, iters: int) -> list[float]:
    samples = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end))
    return samples


def time_case(backend: str, lengths: list[int], device, iters: int, warmup: int, seed: int) -> dict:
    """First-call, forward and fwd+bwd times of ``backend`` on one packing."""
    from relax_gdn.model.attention import attend_zigzag_shard

    cu = boundaries(lengths)
    scale = 1 / math.sqrt(DIM)
    q, k, v, grad = _tensors(cu[-1], seed, device)
    torch.cuda.synchronize()
    wall = time.perf_counter()
    plan = _plan(cu, device)  # what a new micro-batch pays: plan (block mask, segments) and first call
    first = _events_ms(lambda: _step(backend, plan, q, k, v, grad, scale), 1)[0]
    first_wall = (time.perf_counter() - wall) * 1e3
    for _ in range(warmup):
        _step(backend, plan, q, k, v, grad, scale)

    def forward():
        with torch.no_grad():
            attend_zigzag_shard(q, k, v, plan, softmax_scale=scale, backend=backend)

    fwd = _events_ms(forward, iters)
    fwd_bwd = _events_ms(lambda: _step(backend, plan, q, k, v, grad, scale), iters)
    ms = statistics.median(fwd_bwd)
    return {"fwd_ms": statistics.median(fwd), "fwd_bwd_ms": ms, "first_ms": first, "first_wall_ms": first_wall,
            "tflops": attention_flops(lengths) / ms / 1e9, "fwd_bwd_ms_all": fwd_bwd}


def cases(totals: list[int], packings: list[str], seed: int) -> list[dict]:
    out = []
    for total in totals:
        for packing in packings:
            lengths = mixed_lengths(total, seed + total) if packing == "mixed" else long_lengths(total)
            out.append({"name": f"{total // 1024}k {packing}", "tokens": total, "packing": packing,
                        "lengths": lengths, "s_eff": sum(n * n for n in lengths) / total})
    return out


def _status(backend: str, device) -> str | None:
    """Why ``backend`` cannot run at the benchmark's shapes here (None when it can)."""
    from relax_gdn.model.attention_kernels import unsupported_reason

    cu = boundaries(list(CHECK_LENGTHS))
    q = torch.empty(cu[-1], HEADS, DIM, device=device, dtype=torch.bfloat16)
    return unsupported_reason(backend, q, _plan(cu, device))


def run_backend(backend: str, all_cases: list[dict], args, device) -> dict:
    entry: dict = {"backend": backend}
    reason = _status(backend, device)
    if reason is not None:
        entry |= {"status": "unavailable", "reason": reason}
        print(f"[attention] {backend}: unavailable: {reason}", flush=True)
        return entry
    try:
        started = time.perf_counter()
        entry["check"] = check(backend, device)  # also compiles / loads the kernels
        entry["setup_s"] = time.perf_counter() - started
        print(f"[attention] {backend}: check {'passed' if entry['check']['passed'] else 'FAILED'} "
              f"({', '.join(f'{n} {e['rel_err']:.2e}' for n, e in entry['check']['errors'].items())}), "
              f"set-up {entry['setup_s']:.1f} s", flush=True)
        entry["cases"] = {}
        for case in all_cases:
            result = time_case(backend, case["lengths"], device, args.iters, args.warmup, args.seed)
            entry["cases"][case["name"]] = result
            print(f"[attention] {backend} {case['name']}: fwd+bwd {result['fwd_bwd_ms']:.2f} ms "
                  f"({result['tflops']:.0f} TFLOP/s), fwd {result['fwd_ms']:.2f} ms, first call "
                  f"{result['first_wall_ms']:.0f} ms", flush=True)
            torch.cuda.empty_cache()
        entry["status"] = "ok" if entry["check"]["passed"] else "wrong"
    except Exception as e:  # noqa: BLE001 - one kernel failing must not end the comparison
        entry |= {"status": "failed", "reason": f"{type(e).__name__}: {e}"[:2000],
                  "traceback": traceback.format_exc()[-4000:]}
        print(f"[attention] {backend}: FAILED: {entry['reason'][:300]}", flush=True)
    torch.cuda.empty_cache()
    return entry


def format_table(result: dict) -> str:
    entries = result["backends"]
    base = next((e for e in entries if e["backend"] == "varlen" and e.get("cases")), None)
    lines = [f"{'case':<14}{'s_eff':>8}" + "".join(f"{e['backend']:>18}" for e in entries)]
    for case in result["cases"]:
        row = f"{case['name']:<14}{case['s_eff']:>8.0f}"
        for e in entries:
            timing = (e.get("cases") or {}).get(case["name"])
            if timing is None:
                row += f"{'-':>18}"
                continue
            ref = base["cases"].get(case["name"]) if base else None
            ratio = f"{ref['fwd_bwd_ms'] / timing['fwd_bwd_ms']:.2f}x" if ref else "-"
            row += f"{timing['fwd_bwd_ms']:>10.2f} {ratio:>7}"
        lines.append(row)
    lines.append("cells: fwd+bwd ms, speed-up over varlen (torch's FlashAttention-2)")
    for e in entries:
        lines.append(f"  {e['backend']}: {e['status']}" + (f" ({e['reason'][:200]})" if e.get("reason") else ""))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backends", default=",".join(BACKENDS))
    parser.add_argument("--lengths", default="8192,32768,65536,131072")
    parser.add_argument("--packings", default="mixed,long")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args(argv)
    if args.iters < 10:
        parser.error("--iters must be >= 10 (medians of at least ten calls)")
    require_gpus("relax_gdn.bench.attention")

    from relax_gdn.runtime import Runtime

    # after the checks above: installing touches CUDA, and a refused run must not pay for it
    with Runtime():  # every process-wide change of the benchmark, undone when it ends
        return _measure(args)


def _measure(args) -> dict:
    device = torch.device("cuda", torch.cuda.current_device())
    all_cases = cases([int(x) for x in args.lengths.split(",")], args.packings.split(","), args.seed)
    result = {"meta": {"device": torch.cuda.get_device_name(device), "torch": torch.__version__,
                       "cudnn": torch.backends.cudnn.version(), "args": vars(args),
                       "date_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                       "shape": {"heads": HEADS, "kv_heads": GROUPS, "head_dim": DIM, "dtype": "bf16"}},
              "cases": [{k: c[k] for k in ("name", "tokens", "packing", "lengths", "s_eff")} for c in all_cases],
              "backends": []}
    for backend in args.backends.split(","):
        result["backends"].append(run_backend(backend.strip(), all_cases, args, device))
        if args.out:  # after every backend: a run cut short keeps what it measured
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(result, indent=1, default=str))
    print()
    print(format_table(result))
    return result


if __name__ == "__main__":
    main()
