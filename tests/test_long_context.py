"""The long-context tooling on CPU: the host packing against the per-sample conversion it replaced,
bench.batching, bench.attention's cases and table (the GPU part runs on the GPU host), and the
glue that picks the attention kernel and reads the e2e results against the targets."""

from __future__ import annotations

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
    result = {"cases": cases, "backends": [
        {"backend": "varlen", "status": "ok", "cases": {c["name"]: {"fwd_bwd_ms": 2.0} for c in cases}},
        {"backend": "fa4", "status": "ok", "cases": {c["name"]: {"fwd_bwd_ms": 1.0} for c in cases}},
        {"backend": "cudnn", "status": "unavailable", "reason": "head_dim 256 > 128 needs cuDNN >= 9.10"}]}
    table = attention_bench.format_table(result)
    assert "8k mixed" in table and "2.00x" in table and "cudnn: unavailable (head_dim 256" in table


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
    assert long_context.winner(_attention_result({"varlen": 10.0, "fa4": 6.0, "flex": 7.0},
                                                 {"fa4": "wrong", "flex": "failed"}))[0] == "varlen"
    assert long_context.winner(_attention_result({"varlen": 10.0, "flex": 12.0}))[0] == "varlen"
    assert long_context.winner({"cases": [], "backends": []})[0] == "varlen"


def test_long_context_variants_and_targets():
    rows = long_context.variants("fa4", [65536, 32768, 8192]).split(";")
    assert rows == [
        "mt=65536,recompute=full,model.attention_backend=varlen",
        "mt=65536,recompute=mixed,model.attention_backend=fa4,profile",
        "mt=32768,recompute=full,model.attention_backend=varlen",
        "mt=32768,recompute=selective,model.attention_backend=fa4",
        "mt=32768,recompute=mixed,model.attention_backend=fa4",
        "mt=8192,recompute=full,model.attention_backend=varlen",
        "mt=8192,recompute=full,model.attention_backend=fa4",
        "mt=8192,recompute=selective,model.attention_backend=fa4"]

    def measured(name, mt, tok_s):
        return {"name": name, "config": {"train.max_tokens_per_gpu": mt},
                "summary": {"tokens_per_s": tok_s, "mfu": 0.4, "peak_mem_gib": 100.0}}

    result = {"variants": [
        measured(rows[0], 65536, 6000.0), measured(rows[1], 65536, 7800.0),
        {"name": rows[3], "config": {"train.max_tokens_per_gpu": 32768},
         "summary": {"refused": "qwen3_5_9b will not fit this GPU: ... 170.8 GiB"}},
        measured(rows[2], 32768, 7000.0), measured(rows[4], 32768, 8000.0)]}
    lines = long_context.targets([result])
    by_name = {line.split()[0]: line for line in lines[1:]}
    assert "1.300x" in by_name[rows[1]] and ">= 1.25x and >= 7550 tok/s: met" in by_name[rows[1]]
    assert "1.143x" in by_name[rows[4]] and ": MISSED" in by_name[rows[4]]  # 1.20x needed
    assert "refused by the memory model" in by_name[rows[3]]
    assert by_name[rows[0]].rstrip().endswith("1.000x")  # the baseline row carries no verdict
