"""bench.train_e2e on CPU with the tiny preset: variants parse, run the same batches, and come back
in the comparison tool's JSON shape; the kernel categories and the idle time of a profile."""

from __future__ import annotations

import gzip
import json

import pytest

from relax_gdn.bench import train_e2e

# bench.train_e2e on the tiny model on CPU: two steps of short lognormal samples
TINY_CPU_RUN = (
    "--preset qwen3_5_tiny --device cpu --steps 2 --skip 1 --global-batch-size 4 --mean-tokens 60 "
    "--min-tokens 16 --max-tokens 400 --max-tokens-per-gpu 256"
).split()


def test_variant_overrides():
    assert train_e2e.variant_overrides(
        "dynamic:headwise,recompute=selective,fused=off,mt=4096,gdn.route=prebuild", 2
    ) == {
        "gdn.cp_mode": "headwise",
        "parallel.cp": 2,
        "parallel.dynamic_cp.enabled": True,
        "parallel.dynamic_cp.max_cp": 2,
        "recompute.granularity": "selective",
        "model.fused_norms": False,
        "model.fused_cross_entropy": False,
        "model.fused_swiglu": False,
        "model.fused_grad_accumulation": False,
        "train.max_tokens_per_gpu": 4096,
        "gdn.route": "prebuild",
    }
    assert train_e2e.variant_overrides("mtp=1,recompute=full", 1) == {
        "model.mtp.num_layers": 1,
        "recompute.granularity": "full",
    }
    assert train_e2e.variant_overrides("baseline,recompute=full", 1) == {
        **train_e2e.variant_overrides("fused=off", 1),
        "recompute.skip_unused": False,
        "recompute.granularity": "full",
    }
    for bad in ("static:ring", "recompute", "speed=11"):
        with pytest.raises(ValueError, match="variant setting"):
            train_e2e.variant_overrides(bad, 1)


def test_a_list_value_keeps_its_commas():
    """What would measure the attention left out of selective recompute, or the 4,096 x 4,096
    projections kept in bf16 under FP8, in one variant each."""
    assert train_e2e.variant_overrides(
        "recompute=selective,recompute.modules=[mlp_act, gdn_core],fp8=tensorwise,"
        "model.fp8.bf16_modules=[output_layer,*.out_proj,*.linear_proj],profile",
        1,
    ) == {
        "recompute.granularity": "selective",
        "recompute.modules": ["mlp_act", "gdn_core"],
        "model.fp8.recipe": "tensorwise",
        "model.fp8.bf16_modules": ["output_layer", "*.out_proj", "*.linear_proj"],
    }
    assert train_e2e.variant_overrides("model.fp8.bf16_modules=[]", 1) == {"model.fp8.bf16_modules": []}
    assert train_e2e.profiled_variant("recompute.modules=[mlp_act,core_attn],profile")
    for bad in ("recompute.modules=[mlp_act,gdn_core", "recompute.modules=mlp_act]"):
        with pytest.raises(ValueError, match=r"a '\[' without its '\]'"):
            train_e2e.variant_overrides(bad, 1)


def test_length_file(tmp_path):
    path = tmp_path / "lengths.txt"
    path.write_text("# length count\n300 2\n\n1200\n")
    assert train_e2e.read_length_file(str(path)) == [300, 300, 1200]
    path.write_text("300 two\n")
    with pytest.raises(ValueError, match="lengths.txt:1"):
        train_e2e.read_length_file(str(path))


def test_kernel_split(tmp_path):
    events = [
        {"ph": "X", "cat": "kernel", "name": "sm90_xmma_gemm_bf16", "ts": 0, "dur": 400},
        {"ph": "X", "cat": "kernel", "name": "chunk_gated_delta_rule_fwd_kernel_h", "ts": 300, "dur": 200},
        {"ph": "X", "cat": "kernel", "name": "ncclDevKernel_AllReduce", "ts": 600, "dur": 100},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoD", "ts": 700, "dur": 50},
        {"ph": "X", "cat": "kernel", "name": "vectorized_elementwise_kernel", "ts": 800, "dur": 100},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 5000},
        # the host launched the all-reduce late: a slow host op between the two launches
        {
            "ph": "X",
            "cat": "cuda_runtime",
            "name": "cudaLaunchKernel",
            "ts": 250,
            "dur": 5,
            "args": {"correlation": 2},
        },
        {"ph": "X", "cat": "cpu_op", "name": "aten::slow_host_work", "ts": 300, "dur": 280},
        {
            "ph": "X",
            "cat": "cuda_runtime",
            "name": "cudaLaunchKernel",
            "ts": 590,
            "dur": 5,
            "args": {"correlation": 3},
        },
    ]
    events[1]["args"], events[2]["args"] = {"correlation": 2}, {"correlation": 3}
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps({"traceEvents": events}))
    split = train_e2e.kernel_split(trace, step_time_s=0.002)
    assert split["seconds"] == {
        "gemm": 0.0004,
        "gdn": 0.0002,
        "attention": 0.0,
        "communication": 0.0001,
        "copy": 0.00005,
        "elementwise": 0.0001,
    }
    assert split["kernels"] == 5
    assert split["busy_s"] == pytest.approx(0.00075)  # 0-500 (overlapping), 600-750, 800-900
    assert split["idle_s"] == pytest.approx(0.00125) and split["idle_unprofiled_s"] is None
    unprofiled = train_e2e.kernel_split(trace, step_time_s=0.002, unprofiled_step_s=0.001)
    assert unprofiled["idle_unprofiled_s"] == pytest.approx(0.00025)  # the profiler's host cost left out
    # gaps between the union's intervals: 500-600 (100 µs) and 750-800 (50 µs); none inside 0-500
    gaps = split["idle_gaps"]
    assert gaps["seconds_by_gap"] == {
        "<10us": 0.0,
        "<100us": pytest.approx(0.00005),
        "<1000us": pytest.approx(0.0001),
        ">=1000us": 0.0,
    }
    assert gaps["longest"] == [
        [
            0.1,
            0.5,
            "chunk_gated_delta_rule_fwd_kernel_h",
            "ncclDevKernel_AllReduce",
            ["aten::slow_host_work 0.280ms"],
        ],
        [0.05, 0.75, "Memcpy DtoD", "vectorized_elementwise_kernel", []],
    ]
    assert gaps["late_kernels"] == [
        ["ncclDevKernel_AllReduce", pytest.approx(0.0001)],
        ["vectorized_elementwise_kernel", pytest.approx(0.00005)],
    ]


def test_kernel_split_launchers(tmp_path):
    """Each top kernel's calls, mean and launchers: the innermost operator enclosing its launch (by
    correlation id, then time on the launching thread) with its input dims, and the range around
    that operator (the autograd node, the Function); kernels launched outside any host op, or
    whose launch the trace lacks, are counted apart."""
    bf16 = ["c10::BFloat16", "c10::BFloat16"]

    def op(name, ts, dur, tid=1, dims=None):
        args = (
            {}
            if dims is None
            else {"Input Dims": dims, "Input type": bf16, "Input Strides": [[d[1], 1] for d in dims]}
        )
        return {
            "ph": "X",
            "cat": "cpu_op",
            "name": name,
            "pid": 10,
            "tid": tid,
            "ts": ts,
            "dur": dur,
            "args": args,
        }

    def launch(correlation, ts, tid=1, cat="cuda_runtime", name="cudaLaunchKernel"):
        return {
            "ph": "X",
            "cat": cat,
            "name": name,
            "pid": 10,
            "tid": tid,
            "ts": ts,
            "dur": 2,
            "args": {"correlation": correlation},
        }

    def kernel(name, correlation, ts, dur):
        args = {} if correlation is None else {"correlation": correlation}
        return {
            "ph": "X",
            "cat": "kernel",
            "name": name,
            "pid": 0,
            "tid": 7,
            "ts": ts,
            "dur": dur,
            "args": args,
        }

    skinny = "nvjet_sm90_tst_512x8_64x3_2x1_v_bz_TNT"
    events = [
        # forward, main thread (1): an autograd Function around matmul -> mm
        op("LinearWithGradAccumulation", 0, 100),
        op("aten::matmul", 1, 90, dims=[[8192, 4096], [4096, 8]]),
        op("aten::mm", 2, 80, dims=[[8192, 4096], [4096, 8]]),
        launch(1, 10),
        # a Triton kernel launched from Python inside a Function: no operator, the Function says where
        op("ChunkGatedDeltaRuleFunction", 1000, 100),
        op("aten::empty", 1001, 2, dims=[[4, 4]]),
        launch(5, 1050, cat="cuda_driver", name="cuLaunchKernelEx"),
        launch(6, 2000),  # outside every host range
        # backward, the autograd thread (2): the same node twice, a second mm with other shapes
        op("autograd::engine::evaluate_function: MmBackward0", 200, 300, tid=2),
        op("MmBackward0", 201, 290, tid=2),
        op("aten::mm", 210, 50, tid=2, dims=[[8, 8192], [8192, 4096]]),
        launch(2, 220, tid=2),
        op("aten::mm", 300, 50, tid=2, dims=[[8192, 8], [8, 4096]]),
        launch(3, 310, tid=2),
        op("autograd::engine::evaluate_function: MmBackward0", 600, 100, tid=2),
        op("MmBackward0", 601, 98, tid=2),
        op("aten::mm", 610, 50, tid=2, dims=[[8, 8192], [8192, 4096]]),
        launch(4, 620, tid=2),
        kernel(skinny, 1, 20, 30000),
        kernel(skinny, 2, 40000, 30000),
        kernel(skinny, 4, 80000, 30000),
        kernel("sm90_xmma_gemm_bf16", 3, 120000, 20000),
        kernel("chunk_gated_delta_rule_fwd_kernel_h", 5, 150000, 15000),
        kernel("vectorized_elementwise_kernel", 6, 210000, 1000),
        kernel("reduce_kernel", 99, 220000, 500),
        kernel("reduce_kernel", None, 230000, 500),  # launches not in the trace
    ]
    trace = tmp_path / "trace.json.gz"  # as --trace-dir keeps it
    with gzip.open(trace, "wt") as f:
        json.dump({"traceEvents": events}, f)
    top = train_e2e.kernel_split(trace, step_time_s=0.3)["top_kernels"]
    assert [row[:5] for row in top] == [
        [skinny, 0.09, "gemm", 3, 0.03],
        ["sm90_xmma_gemm_bf16", 0.02, "gemm", 1, 0.02],
        ["chunk_gated_delta_rule_fwd_kernel_h", 0.015, "gdn", 1, 0.015],
        ["vectorized_elementwise_kernel", 0.001, "elementwise", 1, 0.001],
        ["reduce_kernel", 0.001, "elementwise", 2, 0.0005],
    ]
    launchers = {row[0]: row[5] for row in top}
    # the two backward calls first (more time), the forward one after
    assert [
        (w["context"], w["op"], w["input_dims"], w["calls"], w["seconds"]) for w in launchers[skinny]
    ] == [
        ("MmBackward0", "aten::mm", [[8, 8192], [8192, 4096]], 2, 0.06),
        ("LinearWithGradAccumulation", "aten::mm", [[8192, 4096], [4096, 8]], 1, 0.03),
    ]
    assert launchers[skinny][0]["input_types"] == bf16 and launchers[skinny][0]["input_strides"] == [
        [8192, 1],
        [4096, 1],
    ]
    assert launchers["sm90_xmma_gemm_bf16"][0]["input_dims"] == [[8192, 8], [8, 4096]]
    gdn = launchers["chunk_gated_delta_rule_fwd_kernel_h"]  # aten::empty had ended: not the launcher
    assert [(w["context"], w["op"], w["launch_found"]) for w in gdn] == [
        ("ChunkGatedDeltaRuleFunction", None, True)
    ]
    assert [
        (w["context"], w["op"], w["launch_found"]) for w in launchers["vectorized_elementwise_kernel"]
    ] == [(None, None, True)]
    assert [(w["op"], w["launch_found"], w["calls"]) for w in launchers["reduce_kernel"]] == [
        (None, False, 2)
    ]
    lines = train_e2e._top_kernel_lines(top)
    print("\n".join(lines))
    assert lines == [
        "    top kernels (total = calls x mean, category, name; then calls x launcher > op input dims):",
        f"      0.090 s = 3 x 30.000 ms  gemm  {skinny}",
        "        2 x MmBackward0 > aten::mm [8,8192] [8192,4096] bf16",
        "        1 x LinearWithGradAccumulation > aten::mm [8192,4096] [4096,8] bf16",
        "      0.020 s = 1 x 20.000 ms  gemm  sm90_xmma_gemm_bf16",
        "        1 x MmBackward0 > aten::mm [8192,8] [8,4096] bf16",
        "      0.015 s = 1 x 15.000 ms  gdn  chunk_gated_delta_rule_fwd_kernel_h",
        "        1 x ChunkGatedDeltaRuleFunction",
        "      0.001 s = 1 x 1.000 ms  elementwise  vectorized_elementwise_kernel",
        "        1 x (no enclosing host op)",
        "      0.001 s = 2 x 0.500 ms  elementwise  reduce_kernel",
        "        2 x (launch not in the trace)",
    ]
    # a result written before launchers were recorded still prints
    assert train_e2e._top_kernel_lines([["sm90_xmma_gemm_bf16", 0.5, "gemm"]])[1:] == [
        "      0.500 s  gemm  sm90_xmma_gemm_bf16"
    ]
    # a CPU-only trace: host ops, no launches, no kernels
    cpu_only = tmp_path / "cpu.json"
    cpu_only.write_text(
        json.dumps({"traceEvents": [op("aten::mm", 0, 10, dims=[[2, 2], [2, 2]]), {"ph": "M"}]})
    )
    assert train_e2e.kernel_split(cpu_only, step_time_s=0.001)["top_kernels"] == []


def test_warm_up_variants():
    variants = [
        "fused=off,recompute=full",
        "recompute=full",
        "recompute=full,train.seed=7",
        "fused=off,recompute=full,train.seed=1234",
    ]
    assert train_e2e.warm_up_variants(variants, 1, every=False) == variants[:1]
    # a repeat that differs only in its seed runs the same kernels: no pass of its own
    assert train_e2e.warm_up_variants(variants, 1, every=True) == variants[:2]


@pytest.mark.slow  # trains the tiny model (in this process)
def test_cpu_smoke(tmp_path, capsys):
    out = tmp_path / "e2e.json"
    result = train_e2e.main(
        [
            *TINY_CPU_RUN,
            "--variants",
            "fused=off;recompute=selective",
            "--out",
            str(out),
            "--profile",
            "--trace-dir",
            str(tmp_path / "traces"),
        ]
    )
    saved = json.loads(out.read_text())
    assert [v["name"] for v in saved["variants"]] == ["fused=off", "recompute=selective"]
    # one untimed pass per variant, not listed as variants; each runs the profiled step's batch too (2 + 1)
    assert saved["meta"]["warm_up_pass"] == {
        "variant": "every",
        "runs": [
            {"variant": "fused=off", "steps": 3, "error": None},
            {"variant": "recompute=selective", "steps": 3, "error": None},
        ],
    }
    for variant in saved["variants"]:
        assert variant["optimizer"] == "adam"
        assert len(variant["records"]) == 3 and variant["records"][-1]["profiled"]  # 2 timed + 1 profiled
        assert {"step", "loss", "tokens_per_s", "optimizer_time_s"} <= set(variant["records"][0])
        summary = variant["summary"]
        assert summary["steps_timed"] == 1 and summary["tokens_per_s"] > 0
        assert summary["memory_estimate_gib"]["total"] > 0
        assert variant["lengths"]["max"] <= 256  # cut to one micro-batch
        assert variant["memory_at_start_gib"] is None  # no GPU memory an earlier variant could leave
        kept = tmp_path / "traces" / f"{train_e2e._file_stem(variant['name'])}.json.gz"
        assert summary["kernel_split"]["trace"] == str(kept)
        with gzip.open(kept) as f:  # the profiled step's chrome trace, whole
            assert json.load(f)["traceEvents"]
    assert "fused=off: no GPU kernels in the profiled step" in capsys.readouterr().out  # not a table of zeros
    # the same seed gives both variants the same batches, and the model computes the same loss
    first, second = (v["records"][0] for v in result["variants"])
    assert first["tokens"] == second["tokens"]
    assert first["loss"] == pytest.approx(second["loss"], rel=1e-5)


def test_trace_dir_needs_profile(capsys, tmp_path):
    """Asked to keep a trace that no step would record: refused before anything runs."""
    with pytest.raises(SystemExit):
        train_e2e.main(["--device", "cpu", "--trace-dir", str(tmp_path / "traces")])
    assert "add --profile" in capsys.readouterr().err
    assert not (tmp_path / "traces").exists()


def test_grid_variants():
    assert train_e2e.grid_variants("mt=32768/65536; recompute=full/mixed") == [
        "mt=32768,recompute=full",
        "mt=32768,recompute=mixed",
        "mt=65536,recompute=full",
        "mt=65536,recompute=mixed",
    ]
    assert train_e2e.grid_variants("") == []
    with pytest.raises(ValueError, match="--grid axis 'mt'"):
        train_e2e.grid_variants("mt")


def test_table_ratios_per_micro_batch_size_and_refusals():
    def variant(name, mt, tok_s=None, refused=False):
        summary = (
            {
                "refused": "no",
                "memory_estimate_gib": {"total": 170.8},
                "capacity_gib": 139.8,
                "fits": ["recompute.granularity=full (71.3 GiB)"],
            }
            if refused
            else {
                "tokens_per_s": tok_s,
                "tokens_per_s_total": tok_s,
                "tokens_per_s_per_gpu": tok_s,
                "step_time_s": 1.0,
                "optimizer_time_s": 0.0,
                "mfu": 0.4,
                "mfu_relax": 0.45,
                "peak_mem_gib": 60.0,
                "memory_estimate_gib": {"total": 61.0},
                "host_syncs_max": 0,
            }
        )
        return {"name": name, "config": {"train.max_tokens_per_gpu": mt}, "summary": summary}

    table = train_e2e.format_table(
        {
            "variants": [
                variant("mt=8192,recompute=full", 8192, 1000.0),
                variant("mt=8192,recompute=mixed", 8192, 1200.0),
                variant("mt=32768,recompute=selective", 32768, refused=True),
                variant("mt=32768,recompute=full", 32768, 500.0),
                variant("mt=32768,recompute=mixed", 32768, 650.0),
            ]
        }
    )
    rows = {line.split()[0]: line for line in table.splitlines()[1:]}
    assert "1.200x" in rows["mt=8192,recompute=mixed"]
    assert "1.300x" in rows["mt=32768,recompute=mixed"]  # against 32k's first measured row, not 8k's
    assert (
        "REFUSED by the memory model: 170.8 GiB > 139.8 GiB; fits: recompute.granularity=full (71.3 GiB)"
        in rows["mt=32768,recompute=selective"]
    )


def test_a_row_that_left_parameters_without_gradient_is_marked_not_valid():
    summary = {
        "tokens_per_s": 900.0,
        "tokens_per_s_total": 900.0,
        "tokens_per_s_per_gpu": 900.0,
        "step_time_s": 1.0,
        "optimizer_time_s": 0.0,
        "mfu": 0.87,
        "mfu_relax": 0.9,
        "peak_mem_gib": 26.7,
        "memory_estimate_gib": {"total": 38.5},
        "host_syncs_max": 0,
    }
    untrained = [
        "decoder.layers.0.mlp.linear_fc1.lora.gate_proj.lora_B",
        "decoder.layers.1.mlp.linear_fc2.lora.down_proj.lora_B",
    ]
    table = train_e2e.format_table(
        {
            "variants": [
                {"name": "mt=8192,recompute=full", "config": {}, "summary": dict(summary)},
                {
                    "name": "mt=8192,recompute=full,lora",
                    "config": {},
                    "summary": {**summary, "params_without_gradient": untrained},
                },
            ]
        }
    )
    lines = table.splitlines()
    marked = [i for i, line in enumerate(lines) if "NOT A VALID ROW" in line]
    assert len(marked) == 1 and lines[marked[0] - 1].startswith("mt=8192,recompute=full,lora"), table
    assert (
        "2 trainable parameters got no gradient (first: decoder.layers.0.mlp.linear_fc1.lora.gate_proj.lora_B)"
        in lines[marked[0]]
    )


@pytest.mark.slow  # trains the tiny model (in this process)
def test_refused_variant_is_reported_and_the_run_goes_on(tmp_path, capsys, monkeypatch):
    """The memory model refuses a variant before anything is built (here: a GPU of between the
    full-recompute and the selective estimate of the tiny model, in-process): the variant is in the
    table and the JSON as refused, with the estimate and what fits, and the next variants run;
    ``recompute=mixed`` without a layer count takes the memory model's choice."""
    from relax_gdn.model import qwen3_5_config
    from relax_gdn.train import build
    from relax_gdn.train.flops import ModelShape
    from relax_gdn.train.memory import estimate_memory

    shape = ModelShape.from_transformer_config(qwen3_5_config("qwen3_5_tiny"), 1024)  # vocab padded to 1024
    settings = dict(tokens_per_gpu=256, bf16=False, optimizer="adam")
    full, selective = (estimate_memory(shape, recompute=r, **settings).total for r in ("full", "selective"))
    assert full < selective
    monkeypatch.setattr(build, "device_memory_bytes", lambda device: (full + selective) / 2)
    out = tmp_path / "e2e.json"
    train_e2e.main(
        [
            *TINY_CPU_RUN,
            "--variants",
            "recompute=full;recompute=selective;recompute=mixed",
            "--no-warm-up-pass",
            "--out",
            str(out),
        ]
    )
    saved = {v["name"]: v for v in json.loads(out.read_text())["variants"]}
    refused = saved["recompute=selective"]["summary"]
    assert refused["memory_estimate_gib"]["total"] >= refused["capacity_gib"]  # (GiB to 2 decimals)
    assert "will not fit this GPU" in refused["refused"]
    assert refused["fits"] and all("recompute.granularity=selective" not in f for f in refused["fits"])
    assert any(f.startswith("recompute.granularity=full (") for f in refused["fits"])
    assert saved["recompute=selective"]["records"] == []
    for name in ("recompute=full", "recompute=mixed"):
        assert len(saved[name]["records"]) == 2 and saved[name]["summary"]["tokens_per_s"] > 0
    # under the 92 % headroom no partial split fits this small a margin: every layer recomputed whole
    assert saved["recompute=mixed"]["full_layers"] == 4
    printed = capsys.readouterr().out
    assert "recompute=selective: refused by the memory model" in printed
    assert "REFUSED by the memory model" in printed


def test_a_single_step_is_refused_naming_steps(capsys):
    from relax_gdn.bench.train_e2e import main

    with pytest.raises(SystemExit) as refused:
        main(["--preset", "qwen3_5_tiny", "--device", "cpu", "--steps", "1"])
    assert refused.value.code == 2
    assert "--steps 1 must be at least 2: a warm-up step, then the timed ones" in capsys.readouterr().err
