"""The long-context tooling on CPU: the host packing against the per-sample conversion it replaced,
bench.batching, bench.attention's cases and table, its process per backend (one that dies or hangs
is reported and the others run; the reference kernel runs the whole benchmark on CPU), and the glue
that picks the attention kernel and reads the e2e results against the targets."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest

from relax_gdn.bench import attention as attention_bench
from relax_gdn.bench import batching as batching_bench
from relax_gdn.bench import long_context
from relax_gdn.data import Sample
from relax_gdn.data.batching import pack_host_arrays


def test_pack_host_arrays_equals_the_per_sample_conversion():
    rng = np.random.default_rng(0)
    samples = []
    for i, n in enumerate((5, 1, 300, 17)):
        ids = rng.integers(0, 248_320, n).tolist()
        mask = (rng.random(n) < 0.7).tolist()
        if i == 1:
            mask = [int(m) for m in mask]  # ints 0/1
        if i == 3:
            mask = [0.5 * m for m in mask]  # weights: the general conversion
        samples.append(Sample(ids, mask, i))
    padded = [8, 4, 304, 20]
    new = pack_host_arrays(samples, padded, pad_id=3)
    old = batching_bench._pack_before(samples, padded, 3)
    for a, b in zip(new, old):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(a, b)
    assert new[2][12 + 299] == 0 and new[1][12 + 299] == 3  # a document's last token: no loss, no label


def test_batching_bench_runs_on_cpu(capsys):
    rows = batching_bench.main(["--lengths", "8192", "--cp", "1,2", "--repeats", "1"])
    assert [(r["tokens"], r["cp"]) for r in rows] == [(8192, 1), (8192, 2)]
    for r in rows:
        assert r["documents"] >= 1 and 0 < r["real_tokens"] <= 8192
        assert all(r[k] > 0 for k in ("before", "pack", "micro_batch", "plan", "flex_mask"))
    assert "pack before" in capsys.readouterr().out


def test_attention_bench_cases_and_table():
    for total in (8192, 32768, 131072):
        lengths = attention_bench.mixed_lengths(total, seed=total)
        assert sum(lengths) == total and max(lengths) <= 65536
        assert sum(attention_bench.long_lengths(total)) == total
    assert attention_bench.long_lengths(131072) == [65536, 65536]
    # causal: L(L+1)/2 score entries, 2 GEMMs x 2 FLOPs per multiply-add, heads x head dim
    assert attention_bench.attention_flops([4], fwd_bwd=False) == 4 * 10 * 16 * 256
    cases = attention_bench.cases([8192], ["mixed", "long"], seed=0)
    result = {
        "cases": cases,
        "backends": [
            {"backend": "varlen", "status": "ok", "cases": {c["name"]: {"fwd_bwd_ms": 2.0} for c in cases}},
            {"backend": "fa4", "status": "ok", "cases": {c["name"]: {"fwd_bwd_ms": 1.0} for c in cases}},
            {"backend": "flex", "status": "failed", "reason": "its process died of SIGSEGV"},
        ],
    }
    table = attention_bench.format_table(result)
    assert "8k mixed" in table and "2.00x" in table and "flex: failed (its process died of SIGSEGV)" in table
    assert "cudnn" not in attention_bench.BACKENDS


# the whole benchmark on CPU at a small shape: only the reference kernel (sdpa) runs there
CPU_ARGS = [
    "--device",
    "cpu",
    "--lengths",
    "1024",
    "--packings",
    "long",
    "--heads",
    "2",
    "--kv-heads",
    "1",
    "--head-dim",
    "16",
    "--check-lengths",
    "100,50,70",
]
# a backend's process that has measured one case when its kernel takes the process down (what an
# illegal memory access does to the CUDA context: nothing after it runs in that process)
DIES_AFTER_ONE_CASE = """
import json, os, signal, sys
entry = {"backend": "fa4", "status": "running", "cases": {"1k long": {"fwd_bwd_ms": 1.5}}}
open(sys.argv[sys.argv.index("--entry-out") + 1], "w").write(json.dumps(entry))
os.kill(os.getpid(), signal.SIGKILL)
"""
HANGS = "import signal; signal.pause()"


@pytest.mark.slow  # starts a process per backend
def test_attention_bench_reports_a_backend_whose_process_dies_and_runs_the_others(tmp_path, capfd):
    def command(backend, argv, entry_path):
        if backend != "fa4":  # the benchmark's own process for the backend
            return attention_bench.child_command(backend, argv, entry_path)
        return [
            sys.executable,
            "-c",
            DIES_AFTER_ONE_CASE,
            *argv,
            "--one-backend",
            backend,
            "--entry-out",
            str(entry_path),
        ]

    done_after: list[list[str]] = []
    entries = attention_bench.run_all(
        ["fa4", "varlen", "sdpa"],
        CPU_ARGS,
        600.0,
        tmp_path,
        command=command,
        after_each=lambda e: done_after.append([x["status"] for x in e]),
    )
    fa4, varlen, sdpa = entries
    assert fa4["status"] == "failed" and fa4["returncode"] == -9
    assert fa4["reason"] == "its process died of SIGKILL"
    assert fa4["cases"] == {"1k long": {"fwd_bwd_ms": 1.5}}  # what it measured before it died
    assert varlen["status"] == "unavailable" and "needs CUDA" in varlen["reason"]
    assert sdpa["status"] == "ok" and sdpa["check"]["passed"] and sdpa["device"] == "cpu"
    assert set(sdpa["cases"]) == {"1k long"} and sdpa["cases"]["1k long"]["fwd_bwd_ms"] > 0
    assert len(sdpa["cases"]["1k long"]["fwd_bwd_ms_all"]) == 10
    assert done_after == [["failed"], ["failed", "unavailable"], ["failed", "unavailable", "ok"]]
    assert "[attention] sdpa 1k long: fwd+bwd" in capfd.readouterr().out  # its own lines pass through
    # a process that hangs is killed at the time limit and reported the same way
    entry_path = tmp_path / "flex.json"
    flex = attention_bench.run_isolated("flex", [sys.executable, "-c", HANGS], entry_path, timeout_s=2.0)
    assert flex == {
        "backend": "flex",
        "status": "failed",
        "returncode": None,
        "stderr_tail": "",
        "reason": "its process ran past --backend-timeout-s 2 and was killed",
    }


@pytest.mark.slow  # starts the benchmark's process for the backend
def test_attention_bench_main_on_cpu_writes_every_backend(tmp_path, capfd):
    out = tmp_path / "attention.json"
    result = attention_bench.main([*CPU_ARGS, "--backends", "sdpa", "--out", str(out)])
    saved = json.loads(out.read_text())
    assert saved == json.loads(json.dumps(result, default=str))
    assert saved["meta"]["device"] == "cpu" and saved["meta"]["shape"]["head_dim"] == 16
    assert [(e["backend"], e["status"]) for e in saved["backends"]] == [("sdpa", "ok")]
    assert "1k long" in capfd.readouterr().out


def test_attention_bench_needs_a_gpu(capsys):
    with pytest.raises(SystemExit) as exit_info:
        attention_bench.main(["--iters", "10"])
    assert exit_info.value.code == 2 and "needs a CUDA GPU" in capsys.readouterr().err


def _attention_result(times: dict[str, float | None], status=None) -> dict:
    cases = [{"name": "8k mixed", "tokens": 8192}, {"name": "64k mixed", "tokens": 65536}]
    backends = []
    for backend, ms in times.items():
        entry = {"backend": backend, "status": (status or {}).get(backend, "ok")}
        if ms is not None:
            entry["cases"] = {"8k mixed": {"fwd_bwd_ms": 0.1}, "64k mixed": {"fwd_bwd_ms": ms}}
        backends.append(entry)
    return {"cases": cases, "backends": backends}


def test_winner_is_the_fastest_exact_kernel():
    best, sums = long_context.winner(_attention_result({"varlen": 10.0, "flex": 8.0, "fa4": 6.0}))
    assert best == "fa4" and sums == {"varlen": 10.0, "flex": 8.0, "fa4": 6.0}
    # a kernel that failed its check or failed outright never wins; nothing faster: varlen
    assert (
        long_context.winner(
            _attention_result({"varlen": 10.0, "fa4": 6.0, "flex": 7.0}, {"fa4": "wrong", "flex": "failed"})
        )[0]
        == "varlen"
    )
    assert long_context.winner(_attention_result({"varlen": 10.0, "flex": 12.0}))[0] == "varlen"
    assert long_context.winner({"cases": [], "backends": []})[0] == "varlen"


def test_long_context_rows_and_targets():
    """The e2e rows by device call: 64k first (full recompute with FA2 against mixed with the winner,
    profiled), every size's candidate with the winner, each call within 9.5 minutes of limits where
    it has more than one row; the targets read rows of several calls together."""
    assert list(long_context.E2E_CALLS) == ["2a", "2b", "2c", "2d", "2e", "2f"]
    assert long_context.rows("2a", "fa4") == [
        (270, "mt=65536,recompute=full,model.attention_backend=varlen"),
        (270, "mt=65536,recompute=mixed,model.attention_backend=fa4,profile"),
    ]
    every = [variant for call in long_context.E2E_CALLS for _, variant in long_context.rows(call, "fa4")]
    assert every == [
        "mt=65536,recompute=full,model.attention_backend=varlen",
        "mt=65536,recompute=mixed,model.attention_backend=fa4,profile",
        "mt=32768,recompute=full,model.attention_backend=varlen",
        "mt=32768,recompute=mixed,model.attention_backend=fa4",
        "mt=32768,recompute=selective,model.attention_backend=fa4",
        "mt=131072,recompute=full,model.attention_backend=varlen",
        "mt=131072,recompute=mixed,model.attention_backend=fa4",
        "mt=65536,recompute=full,model.attention_backend=fa4",
        "mt=8192,recompute=full,model.attention_backend=varlen",
        "mt=8192,recompute=full,model.attention_backend=fa4",
        "mt=8192,recompute=selective,model.attention_backend=fa4",
        # FP8 at 64k: bf16 and tensorwise in one process, measured side by side
        "mt=65536,recompute=mixed,model.attention_backend=fa4;"
        "mt=65536,recompute=mixed,model.attention_backend=fa4,fp8=tensorwise",
    ]
    for call in ("2a", "2b", "2c", "2e", "2f"):  # the calls whose rows must all run
        assert sum(limit for limit, _ in long_context.rows(call, "fa4")) <= 570
    with pytest.raises(ValueError, match="unknown call '3'"):
        long_context.rows("3", "fa4")
    rows = [variant for _, variant in long_context.rows("2a", "fa4") + long_context.rows("2b", "fa4")]

    def measured(name, mt, tok_s, whole=None):
        return {
            "name": name,
            "config": {"train.max_tokens_per_gpu": mt},
            "full_layers": whole,
            "summary": {"tokens_per_s": tok_s, "mfu": 0.4, "peak_mem_gib": 100.0},
        }

    first_call = {"variants": [measured(rows[0], 65536, 6000.0), measured(rows[1], 65536, 7800.0, whole=25)]}
    second_call = {
        "variants": [
            {
                "name": rows[4],
                "config": {"train.max_tokens_per_gpu": 32768},
                "summary": {"refused": "qwen3_5_9b will not fit this GPU: ... 170.8 GiB"},
            },
            measured(rows[2], 32768, 7000.0),
            measured(rows[3], 32768, 8000.0, whole=15),
        ]
    }
    lines = long_context.targets([first_call, second_call])
    by_name = {line.split()[0]: line for line in lines[1:]}
    assert (
        "1.300x" in by_name[rows[1]] and ">= 1.25x and >= 7550 tok/s: met; issue's: met" in by_name[rows[1]]
    )
    assert "1.289x" in by_name[rows[1]]  # 7,800 against the 6,052
    assert by_name[rows[1]].split()[1] == "25"  # the layers mixed recomputed whole
    # 1.20x and 8,550 tok/s needed: 1.143x against this run's full row, 1.123x against the 7,126
    assert "1.143x" in by_name[rows[3]] and ": MISSED; issue's: MISSED" in by_name[rows[3]]
    assert "refused by the memory model" in by_name[rows[4]]
    assert by_name[rows[0]].rstrip().endswith("1.000x    0.991x")  # the baseline row carries no verdict
    assert by_name[rows[0]].split()[1] == "-"


def test_plan_keeps_to_the_share_mixed_keeps_to():
    """plan recommends selective only where it fits the share of the GPU that mixed's choice keeps to
    (at CP 2 with Adam, 8k tokens: selective's estimate is under the card but not under 92 % of it),
    and says when full is above that share."""
    from relax_gdn.train.memory import MIXED_HEADROOM

    one_gpu = long_context.plan(139.8, [8192, 65536])
    assert one_gpu[1].strip().startswith("8192 tokens/GPU: selective (")
    assert one_gpu[2].strip().startswith("65536 tokens/GPU: mixed, ")
    cp2 = long_context.plan(139.8, [8192, 65536], cp=2, optimizer="adam")
    assert cp2[1].strip().startswith("8192 tokens/GPU: mixed, ")
    assert (
        cp2[2].strip().startswith("65536 tokens/GPU: full (")
        and f"above {MIXED_HEADROOM:.0%}: tight" in cp2[2]
    )
