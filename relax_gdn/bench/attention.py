"""Exact varlen causal GQA attention kernels side by side at the 9B's attention shapes, one GPU.

    python -m relax_gdn.bench.attention [--out attention.json] [--backends varlen,flex,fa4]
        [--lengths 8192,32768,65536,131072] [--packings mixed,long] [--iters 10] [--backend-timeout-s 900]

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
   packing after the backend has compiled (per-micro-batch set-up: plan, block mask).

Each backend runs in a process of its own (this module with ``--one-backend``), which writes its
results after the check and after every case: a kernel that corrupts the CUDA context or kills its
process (an illegal memory access, a segfault, a hang past ``--backend-timeout-s``) is reported as
failed, with the exit status and the end of its stderr, beside whatever it measured before, and the
next backend starts on a clean GPU. A backend that is unavailable here or fails the check is
reported as such, with the reason.

Prints a table of fwd+bwd ms and the ratio to ``varlen`` (torch's FlashAttention-2) per case, and
writes everything to ``--out`` (JSON) after every backend. ``--device cpu`` with a small
``--heads/--kv-heads/--head-dim`` and ``--check-lengths`` runs the same code on CPU, where only
``sdpa`` (the reference) runs: the tests' way to run this benchmark without a GPU.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from relax_gdn.bench.needs import require_gpus
from relax_gdn.bench.timing import event_ms

HEADS, GROUPS, DIM = 16, 4, 256  # Qwen3.5-9B full attention
CHECK_LENGTHS = (1000, 512, 2584)
BACKENDS = ("varlen", "flex", "fa4")
FINAL_STATUSES = ("ok", "wrong", "unavailable")  # what a backend's process reports when it ends normally
STDERR_TAIL = 4000  # characters of a failed backend process's stderr kept in the JSON


@dataclass(frozen=True)
class Shape:
    """The attention's head layout."""

    heads: int = HEADS
    """query heads"""
    kv_heads: int = GROUPS
    """key/value heads (GQA groups)"""
    head_dim: int = DIM
    """channels per head"""


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


def attention_flops(lengths: list[int], fwd_bwd: bool = True, shape: Shape = Shape()) -> float:
    """Causal attention FLOPs (QK^T and PV, 2 per multiply-add); backward is 2.5x forward."""
    fwd = 4.0 * sum(n * (n + 1) / 2 for n in lengths) * shape.heads * shape.head_dim
    return fwd * (3.5 if fwd_bwd else 1.0)


def _tensors(total: int, seed: int, device, shape: Shape, dtype=torch.bfloat16):
    g = torch.Generator(device="cpu").manual_seed(seed)

    def make(*dims):
        return torch.randn(*dims, generator=g).to(device=device, dtype=dtype)

    h, kv, d = shape.heads, shape.kv_heads, shape.head_dim
    return make(total, h, d), make(total, kv, d), make(total, kv, d), make(total, h, d)


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
        outs.append(
            F.scaled_dot_product_attention(
                q[s:e].transpose(0, 1),
                k[s:e].transpose(0, 1),
                v[s:e].transpose(0, 1),
                is_causal=True,
                scale=scale,
                enable_gqa=True,
            ).transpose(0, 1)
        )
    out = torch.cat(outs)
    out.backward(grad.float())
    return out.detach(), q.grad, k.grad, v.grad


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


def check(backend: str, device, shape: Shape = Shape(), lengths=CHECK_LENGTHS) -> dict:
    """Output and q/k/v gradient errors of ``backend`` against fp32 per-document SDPA."""
    cu = boundaries(list(lengths))
    scale = 1 / math.sqrt(shape.head_dim)
    q, k, v, grad = _tensors(cu[-1], 1, device, shape, dtype=torch.float32)
    ref = reference(q, k, v, grad, cu, scale)
    low = _step("sdpa", _plan(cu, device), *(x.bfloat16() for x in (q, k, v, grad)), scale)
    got = _step(backend, _plan(cu, device), *(x.bfloat16() for x in (q, k, v, grad)), scale)
    errors, passed = {}, True
    for name, g, lo, r in zip(("out", "dq", "dk", "dv"), got, low, ref):
        err, bound = _rel(g, r), max(2.5 * _rel(lo, r), 2e-2)
        errors[name] = {"rel_err": err, "sdpa_bf16_rel_err": _rel(lo, r), "bound": bound}
        passed &= err < bound
    return {"passed": passed, "errors": errors}


def _timed_ms(fn, iters: int, device) -> list[float]:
    """Each of ``iters`` calls' time: CUDA events on a GPU, the host clock on CPU."""
    samples = []
    for _ in range(iters):
        if device.type == "cuda":
            samples.append(event_ms(fn))
            continue
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e3)
    return samples


def _synchronize(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_case(backend: str, lengths: list[int], device, args, shape: Shape = Shape()) -> dict:
    """First-call, forward and fwd+bwd times of ``backend`` on one packing."""
    from relax_gdn.model.attention import attend_zigzag_shard

    cu = boundaries(lengths)
    scale = 1 / math.sqrt(shape.head_dim)
    q, k, v, grad = _tensors(cu[-1], args.seed, device, shape)
    _synchronize(device)
    wall = time.perf_counter()
    plan = _plan(cu, device)  # what a new micro-batch pays: plan (block mask, segments) and first call
    first = _timed_ms(lambda: _step(backend, plan, q, k, v, grad, scale), 1, device)[0]
    first_wall = (time.perf_counter() - wall) * 1e3
    for _ in range(args.warmup):
        _step(backend, plan, q, k, v, grad, scale)

    def forward():
        with torch.no_grad():
            attend_zigzag_shard(q, k, v, plan, softmax_scale=scale, backend=backend)

    fwd = _timed_ms(forward, args.iters, device)
    fwd_bwd = _timed_ms(lambda: _step(backend, plan, q, k, v, grad, scale), args.iters, device)
    ms = statistics.median(fwd_bwd)
    return {
        "fwd_ms": statistics.median(fwd),
        "fwd_bwd_ms": ms,
        "first_ms": first,
        "first_wall_ms": first_wall,
        "tflops": attention_flops(lengths, shape=shape) / ms / 1e9,
        "fwd_bwd_ms_all": fwd_bwd,
    }


def cases(totals: list[int], packings: list[str], seed: int) -> list[dict]:
    out = []
    for total in totals:
        for packing in packings:
            lengths = mixed_lengths(total, seed + total) if packing == "mixed" else long_lengths(total)
            out.append(
                {
                    "name": f"{total // 1024}k {packing}",
                    "tokens": total,
                    "packing": packing,
                    "lengths": lengths,
                    "s_eff": sum(n * n for n in lengths) / total,
                }
            )
    return out


def _status(backend: str, device, shape: Shape) -> str | None:
    """Why ``backend`` cannot run forward + backward at the benchmark's shapes here (None when it can)."""
    from relax_gdn.model.attention_kernels import unsupported_reason

    q = torch.empty(8, shape.heads, shape.head_dim, device=device, dtype=torch.bfloat16, requires_grad=True)
    with torch.enable_grad():
        return unsupported_reason(backend, q)


# ---------------------------------------------------------------------------------------------
# one backend, in its own process
# ---------------------------------------------------------------------------------------------


def _device_facts(device) -> dict:
    facts = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
    }
    try:
        from importlib.metadata import PackageNotFoundError, version

        facts["flash_attn_4"] = version("flash-attn-4")
    except PackageNotFoundError:
        facts["flash_attn_4"] = None
    return facts


def run_backend(backend: str, all_cases: list[dict], args, device, save: Callable[[dict], None]) -> dict:
    """Check and time ``backend`` in this process; ``save(entry)`` after the check and every case,
    so a process that dies keeps what it measured."""
    shape = Shape(args.heads, args.kv_heads, args.head_dim)
    entry: dict = {"backend": backend, "status": "running", **_device_facts(device)}
    reason = _status(backend, device, shape)
    if reason is not None:
        entry |= {"status": "unavailable", "reason": reason}
        print(f"[attention] {backend}: unavailable: {reason}", flush=True)
        save(entry)
        return entry
    try:
        started = time.perf_counter()
        entry["check"] = check(backend, device, shape, [int(n) for n in args.check_lengths.split(",")])
        entry["setup_s"] = time.perf_counter() - started  # the check also compiles / loads the kernels
        print(
            f"[attention] {backend}: check {'passed' if entry['check']['passed'] else 'FAILED'} "
            f"({', '.join(f'{n} {e["rel_err"]:.2e}' for n, e in entry['check']['errors'].items())}), "
            f"set-up {entry['setup_s']:.1f} s",
            flush=True,
        )
        entry["cases"] = {}
        save(entry)
        for case in all_cases:
            result = time_case(backend, case["lengths"], device, args, shape)
            entry["cases"][case["name"]] = result
            save(entry)
            print(
                f"[attention] {backend} {case['name']}: fwd+bwd {result['fwd_bwd_ms']:.2f} ms "
                f"({result['tflops']:.0f} TFLOP/s), fwd {result['fwd_ms']:.2f} ms, first call "
                f"{result['first_wall_ms']:.0f} ms",
                flush=True,
            )
            if device.type == "cuda":
                torch.cuda.empty_cache()
        entry["status"] = "ok" if entry["check"]["passed"] else "wrong"
    except Exception as e:  # noqa: BLE001 - a kernel that raises is a result; its process ends next
        entry |= {
            "status": "failed",
            "reason": f"{type(e).__name__}: {e}"[:2000],
            "traceback": traceback.format_exc()[-STDERR_TAIL:],
        }
        print(f"[attention] {backend}: FAILED: {entry['reason'][:300]}", flush=True)
    save(entry)
    return entry


def child_command(backend: str, argv: list[str], entry_path: Path) -> list[str]:
    """The process that runs one backend: this module with the run's arguments."""
    return [
        sys.executable,
        "-m",
        "relax_gdn.bench.attention",
        *argv,
        "--one-backend",
        backend,
        "--entry-out",
        str(entry_path),
    ]


def _process_end(returncode: int | None, timeout_s: float) -> str:
    if returncode is None:
        return f"its process ran past --backend-timeout-s {timeout_s:g} and was killed"
    if returncode < 0:
        return f"its process died of {signal.Signals(-returncode).name}"
    return f"its process exited with code {returncode}"


def run_isolated(backend: str, command: list[str], entry_path: Path, timeout_s: float) -> dict:
    """Run ``command`` (one backend's process, which writes its entry to ``entry_path``) and return
    that entry; a process that dies, hangs or ends without a final status is ``failed``, with what
    it measured before, its exit status and the end of its stderr. Its stdout passes through."""
    entry_path.unlink(missing_ok=True)
    with tempfile.TemporaryFile("w+") as stderr:
        process = subprocess.Popen(command, stderr=stderr)  # stdout: this process's own
        try:
            returncode = process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            returncode = None
        finally:
            if process.poll() is None:  # interrupted here: the backend's process goes with us
                process.kill()
                process.wait()
        stderr.seek(0)
        err = stderr.read()
    sys.stderr.write(err)
    entry = json.loads(entry_path.read_text()) if entry_path.exists() else {"backend": backend}
    if returncode == 0 and entry.get("status") in FINAL_STATUSES:
        return entry
    end = _process_end(returncode, timeout_s)
    reason = f"{entry['reason']}; {end}" if entry.get("reason") else end
    entry |= {
        "status": "failed",
        "reason": reason,
        "returncode": returncode,
        "stderr_tail": err[-STDERR_TAIL:],
    }
    print(f"[attention] {backend}: FAILED: {reason[:300]}", flush=True)
    return entry


def run_all(
    backends: list[str],
    argv: list[str],
    timeout_s: float,
    work_dir: Path,
    command: Callable[[str, list[str], Path], list[str]] = child_command,
    after_each: Callable[[list[dict]], None] | None = None,
) -> list[dict]:
    """Every backend in a process of its own, one after the other: their entries in order.
    ``command(backend, argv, entry_path)`` builds a backend's process (:func:`child_command`);
    ``after_each(entries)`` runs after every backend."""
    entries: list[dict] = []
    for backend in backends:
        entries.append(
            run_isolated(
                backend,
                command(backend, argv, work_dir / f"{backend}.json"),
                work_dir / f"{backend}.json",
                timeout_s,
            )
        )
        if after_each is not None:
            after_each(entries)
    return entries


# ---------------------------------------------------------------------------------------------
# the table and main
# ---------------------------------------------------------------------------------------------


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
        lines.append(
            f"  {e['backend']}: {e['status']}" + (f" ({e['reason'][:200]})" if e.get("reason") else "")
        )
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--backends", default=",".join(BACKENDS))
    parser.add_argument("--lengths", default="8192,32768,65536,131072")
    parser.add_argument("--packings", default="mixed,long")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--backend-timeout-s",
        type=float,
        default=900.0,
        help="a backend's process running longer is killed and reported failed",
    )
    parser.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        default="cuda",
        help="cpu: the same code on CPU, where only sdpa runs (the tests)",
    )
    parser.add_argument("--heads", type=int, default=HEADS)
    parser.add_argument("--kv-heads", type=int, default=GROUPS)
    parser.add_argument("--head-dim", type=int, default=DIM)
    parser.add_argument(
        "--check-lengths",
        default=",".join(map(str, CHECK_LENGTHS)),
        help="the documents of the check against fp32 SDPA",
    )
    parser.add_argument("--out", help="write the results as JSON here")
    parser.add_argument("--one-backend", help=argparse.SUPPRESS)  # a backend's own process (run_isolated)
    parser.add_argument("--entry-out", help=argparse.SUPPRESS)
    return parser


def _one_backend(args, all_cases: list[dict]) -> None:
    """A backend's own process: every process-wide change of the measurement in its Runtime (the
    parent, which only starts these processes, never touches CUDA)."""
    from relax_gdn.runtime import Runtime

    path = Path(args.entry_out)

    def save(entry: dict) -> None:
        path.write_text(json.dumps(entry, indent=1, default=str))

    with Runtime():
        if args.device == "cpu":
            device = torch.device("cpu")
        else:
            device = torch.device("cuda", torch.cuda.current_device())
        run_backend(args.one_backend, all_cases, args, device, save)


def main(argv: list[str] | None = None) -> dict | None:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = _parser().parse_args(argv)
    if args.iters < 10:
        _parser().error("--iters must be >= 10 (medians of at least ten calls)")
    if args.device == "cuda":
        require_gpus("relax_gdn.bench.attention")
    all_cases = cases([int(x) for x in args.lengths.split(",")], args.packings.split(","), args.seed)
    if args.one_backend:
        _one_backend(args, all_cases)
        return None
    shape = {"heads": args.heads, "kv_heads": args.kv_heads, "head_dim": args.head_dim, "dtype": "bf16"}
    result = {
        "meta": {
            "args": vars(args),
            "shape": shape,
            "date_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        },
        "cases": [{k: c[k] for k in ("name", "tokens", "packing", "lengths", "s_eff")} for c in all_cases],
        "backends": [],
    }

    def save(entries: list[dict]) -> None:  # after every backend: a run cut short keeps what it measured
        result["backends"] = entries
        facts = next((e for e in entries if e.get("device")), {})
        result["meta"] |= {k: facts.get(k) for k in ("device", "torch", "flash_attn_4")}
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(result, indent=1, default=str))

    with tempfile.TemporaryDirectory(prefix="bench-attention-") as work:
        run_all(
            [b.strip() for b in args.backends.split(",") if b.strip()],
            argv,
            args.backend_timeout_s,
            Path(work),
            after_each=save,
        )
    print()
    print(format_table(result))
    return result


if __name__ == "__main__":
    main()
