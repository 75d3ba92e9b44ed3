"""bench.peers on CPU: the tiny Qwen3.5 through Hugging Face transformers + peft and through
relax-gdn from one random-init HF checkpoint, both workloads, and what the table makes of each
kind of row.

One run in this process (``CPU_RUN``, the CPU command with two documents per step and two more
rows) is read by several tests: every row that runs agrees with the HF reference step (fp32,
relative 1e-5 in loss, 1e-2 in gradient norm) over documents with different loss-token counts, so
the reduction (mean per loss token of the global batch) is the same on both sides; the packed row
runs the step's documents as one micro-batch; a row on other LoRA scaling disagrees and loses its
timing; rows whose kernels need a GPU say why. The timing is printed, never asserted.
"""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from relax_gdn.bench import peers
from relax_gdn.bench.hf_peer import HFSettings, out_of_memory, parse_hf_settings
from tests.distributed import child_env
from tests.helpers import ROOT

# alpha 64 instead of the LoRA workload's 32: the same first loss (B starts at zero), twice the
# adapters' gradient, so the LoRA workload must mark it as disagreeing (in the full workload the row
# trains adapters where HF trains every weight, and disagrees too; LoRA options without a rank are refused)
OFF_SCALE_ROW = "relax,model.lora.rank=16,model.lora.alpha=64"
CPU_RUN = [
    "--preset",
    "qwen3_5_tiny",
    "--steps",
    "2",
    "--docs-per-step",
    "2",
    "--doc-tokens",
    "160",
    "--rows",
    ";".join([*peers.default_rows(2), OFF_SCALE_ROW]),
]
# torch's message when the caching allocator gives up (torch 2.14)
TORCH_OOM = (
    "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 139.81 GiB of which "
    "1.37 GiB is free. Including non-PyTorch memory, this process has 138.43 GiB memory in use. Of the "
    "allocated memory 134.10 GiB is allocated by PyTorch, and 2.91 GiB is reserved by PyTorch but "
    "unallocated."
)


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
    """``(result, stdout, the --out path)`` of one CPU run; the kernels transformers' Qwen3.5 module
    names before it, and after."""
    import transformers.models.qwen3_5.modeling_qwen3_5 as modeling

    from relax_gdn.compat.transformers_kernels import KERNEL_HANDLES

    tmp = tmp_path_factory.mktemp("peers")
    out = tmp / "peers.json"
    bound = {name: getattr(modeling, name) for name in KERNEL_HANDLES}
    stream = io.StringIO()
    with contextlib.redirect_stdout(stream):
        result = peers.main([*CPU_RUN, "--init-dir", str(tmp / "init"), "--out", str(out)])
    print(stream.getvalue())  # the table, for whoever reads the test's output
    after = {name: getattr(modeling, name) for name in KERNEL_HANDLES}
    return result, stream.getvalue(), out, bound == after


def _rows(result: dict, workload: str) -> dict:
    (found,) = [w for w in result["workloads"] if w["name"] == workload]
    return {entry["name"]: entry for entry in found["rows"]}


@pytest.mark.slow  # trains the tiny model on both sides (in this process)
@pytest.mark.parametrize("workload", ["lora", "full"])
def test_every_row_that_runs_agrees_with_the_hf_reference_step(cpu_run, workload):
    result, _, _, _ = cpu_run
    (found,) = [w for w in result["workloads"] if w["name"] == workload]
    reference = found["reference"]
    assert reference["loss"] > 1.0 and reference["grad_norm"] > 0.0 and "error" not in reference
    rows = _rows(result, workload)
    agreeing = {"hf", "hf,ckpt", "relax", "relax,recompute=full", "relax,packed"}
    for name in agreeing:
        entry = rows[name]
        check = entry["agreement"]
        assert check["agrees"] is True, (name, check)
        assert check["loss_rel"] <= 1e-5 and check["grad_norm_rel"] <= 1e-2, (name, check)
        assert entry["records"][0]["grad_norm"] == pytest.approx(reference["grad_norm"], rel=1e-2)
        assert len(entry["records"]) == 2 and peers.timed(entry) > 0
    # the same documents on both sides, step by step; the two relax-gdn forms of a step
    hf, relax, packed = rows["hf"]["records"], rows["relax"]["records"], rows["relax,packed"]["records"]
    assert [r["tokens"] for r in hf] == [r["tokens"] for r in relax] == [2 * 160] * 2
    assert [r["loss_tokens"] for r in hf] == [r["loss_tokens"] for r in relax]
    assert {r["num_micro_batches"] for r in relax} == {2} and {r["num_micro_batches"] for r in packed} == {1}
    assert rows["relax"]["config"]["recompute.granularity"] == "none"  # best on CPU: no GPU to fit


@pytest.mark.slow
def test_lora_reference_is_the_adapters_gradient(cpu_run):
    result, _, _, _ = cpu_run
    refs = {w["name"]: w["reference"] for w in result["workloads"]}
    assert refs["lora"]["loss"] == pytest.approx(
        refs["full"]["loss"], rel=1e-6
    )  # B = 0: the base model's loss
    assert refs["lora"]["grad_norm"] < refs["full"]["grad_norm"]
    lora = next(w for w in result["workloads"] if w["name"] == "lora")
    assert lora["lora"]["rank"] == 16 and lora["lora"]["alpha"] == 32 and lora["optimizer"] == "adam"


@pytest.mark.slow
def test_a_row_that_disagrees_is_shown_without_its_timing(cpu_run):
    result, printed, out, _ = cpu_run
    entry = _rows(result, "lora")[OFF_SCALE_ROW]
    check = entry["agreement"]
    assert check["agrees"] is False and check["loss_rel"] <= 1e-5
    assert check["grad_norm_rel"] == pytest.approx(1.0, rel=1e-3)  # twice the reference
    assert entry["summary"]["tokens_per_s"] > 0 and peers.timed(entry) is None
    line = next(
        row
        for row in out.with_suffix(".md").read_text().splitlines()  # the first table: LoRA's
        if row.startswith(f"| {OFF_SCALE_ROW} ")
    )
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[1:4] == ["-", "-", "-"]  # no tok/s, no ratios
    assert cells[-1].startswith("DISAGREES with HF's first step: grad norm")
    assert f"lora / {OFF_SCALE_ROW}: no timing; DISAGREES" in printed


@pytest.mark.slow
def test_gpu_rows_say_why_they_cannot_run_on_cpu(cpu_run):
    result, _, _, _ = cpu_run
    for workload in ("lora", "full"):
        rows = _rows(result, workload)
        assert rows["hf,ckpt,liger"]["summary"] == {
            "cannot_run": "liger-kernel's kernels are Triton GPU kernels: it runs on CUDA only"
        }
        assert "compute capability 8.9" in rows["hf,fp8"]["summary"]["cannot_run"]
        assert rows["hf,ckpt,liger"]["records"] == [] and rows["hf,ckpt,liger"]["agreement"]["agrees"] is None


@pytest.mark.slow
def test_outputs_json_markdown_and_the_table_last(cpu_run):
    result, printed, out, kernels_restored = cpu_run
    assert kernels_restored  # transformers' GDN handles as they were before the run
    saved = json.loads(out.read_text())
    assert saved["meta"]["command"].startswith("python -m relax_gdn.bench.peers --preset qwen3_5_tiny")
    assert saved["meta"]["versions"]["transformers"] == "5.23.0" and saved["meta"]["dtype"] == "float32"
    assert [w["name"] for w in saved["workloads"]] == ["lora", "full"]
    names = peers.default_rows(2) + [OFF_SCALE_ROW]
    assert [e["name"] for e in saved["workloads"][0]["rows"]] == names
    markdown = out.with_suffix(".md").read_text()
    assert markdown.count("| row | tok/s | ÷ hf,ckpt |") == 2
    assert "| relax (recompute=none) |" in markdown
    lines = printed.rstrip().splitlines()
    bottom = max(i for i, line in enumerate(lines) if line.startswith("└"))  # the rich tables are last:
    assert "relax,packed" in "\n".join(lines[bottom - 12 : bottom])  # the full workload's rows,
    assert lines[bottom + 1].startswith("hf,ckpt,liger: cannot run: ")  # then the notes under them
    assert not any("│" in line for line in lines[bottom + 1 :])
    assert "Traceback" not in printed


@pytest.mark.slow
def test_the_random_init_checkpoint_is_written_once(cpu_run):
    from relax_gdn.bench.hf_peer import existing_init_problem, init_marker, write_random_checkpoint

    init = Path(cpu_run[0]["meta"]["checkpoint"])
    written = {p.name: p.stat().st_mtime_ns for p in init.iterdir()}
    assert "model.safetensors" in written and "config.json" in written
    assert write_random_checkpoint(init, "qwen3_5_tiny", 1234, torch.float32, torch.device("cpu")) == init
    assert {p.name: p.stat().st_mtime_ns for p in init.iterdir()} == written  # reused, not written again
    assert existing_init_problem(init, init_marker("qwen3_5_tiny", 1234, torch.float32)) is None
    other = existing_init_problem(init, init_marker("qwen3_5_tiny", 7, torch.float32))
    assert "holds the random-init checkpoint of {'preset': 'qwen3_5_tiny', 'seed': 1234" in other
    assert not init.with_name(init.name + ".partial").exists()


def test_rows_parse_to_settings_and_overrides():
    assert parse_hf_settings(["ckpt", "liger"]) == HFSettings(checkpointing=True, liger=True)
    assert (
        parse_hf_settings(["fp8=rowwise"]).fp8 == "rowwise" and parse_hf_settings(["fp8"]).fp8 == "tensorwise"
    )
    row = peers.parse_row("relax,packed,recompute=full,model.fp8.recipe=tensorwise", 1024)
    assert row.overrides == {
        "recompute.granularity": "full",
        "train.max_tokens_per_gpu": 1024,
        "model.fp8.recipe": "tensorwise",
    }
    assert row.fp8 and not peers.parse_row("relax", 64).fp8
    assert peers.parse_row("relax", 64).overrides == {"recompute.granularity": "best"}
    assert peers.parse_row(
        "relax,recompute=selective,recompute.modules=[mlp_act,gdn_core]", 64
    ).overrides == {
        "recompute.granularity": "selective",
        "recompute.modules": ["mlp_act", "gdn_core"],
    }
    for bad, says in (
        ("hf,ckpt,fast", "HF row setting 'fast'"),
        ("relax,speed=11", "unknown shorthand 'speed'"),
        ("megatron", "a row starts with hf or relax"),
    ):
        with pytest.raises(ValueError, match=says):
            peers.parse_row(bad, 64)


def test_agreement_tolerances_by_precision():
    reference = {"loss": 10.0, "grad_norm": 2.0}
    assert peers.agreement({"loss": 10.0002, "grad_norm": 2.0}, reference, "fp32")["agrees"] is False
    assert peers.agreement({"loss": 10.005, "grad_norm": 2.01}, reference, "bf16")["agrees"] is True
    assert peers.agreement({"loss": 10.05, "grad_norm": 2.1}, reference, "fp8")["agrees"] is True
    no_norm = peers.agreement({"loss": 10.0, "grad_norm": None}, reference, "bf16")  # optim.name=none
    assert no_norm["agrees"] is True and "grad_norm_rel" not in no_norm
    assert peers.agreement(None, reference, "bf16")["agrees"] is None
    assert peers.agreement({"loss": 10.0}, None, "bf16")["why"] == "no HF reference step"


def test_an_fp8_row_says_which_gemms_ran_in_fp8():
    """relax-gdn's FP8 row carries the run summary's FP8 line (bench.train_e2e's summary) into its note."""
    ran = "FP8 (tensorwise): 96 of 97 linear layers ran forward, input-gradient and weight-gradient GEMMs in FP8"
    entry = {
        "side": "relax",
        "summary": {"tokens_per_s": 9000.0, "fp8": ran},
        "agreement": {"agrees": True},
    }
    assert peers.note(entry, fastest_hf=5000.0) == ran
    assert peers.note(entry, fastest_hf=10000.0) == f"{ran}; an HF row is faster"


def test_out_of_memory_rows_show_what_they_asked_for():
    oom = out_of_memory(f"OutOfMemoryError: {TORCH_OOM}")
    assert oom == {"asked": "2.00 GiB", "in_use": "138.43 GiB", "capacity": "139.81 GiB"}
    assert out_of_memory("RuntimeError: CUDA error: an illegal memory access was encountered") is None
    entry = {
        "name": "hf",
        "side": "hf",
        "records": [{}],
        "summary": {
            "error": TORCH_OOM,
            "oom": oom | {"step": 2},
            "steps_done": 1,
            "step_tokens_per_s": [7300.4],
            "peak_mem_gib": 134.0,
        },
    }
    assert peers.note(entry, None) == (
        "OOM at step 2: asked 2.00 GiB with 138.43 GiB in use (steps before: 7,300 tok/s, peak 134.0 GiB)"
    )


@pytest.mark.slow  # imports transformers and liger-kernel in this process (~8 s of a fast run otherwise)
@pytest.mark.filterwarnings("ignore:Triton is not supported on current platform")  # FLA, imported by liger
def test_liger_leaves_transformers_classes_as_they_were():
    """Liger's ``apply_*`` replaces transformers' classes for every model built after it; the HF
    rows apply it to their model alone (instance by instance), so a later plain HF row is plain."""
    import transformers.models.qwen3_5.modeling_qwen3_5 as modeling
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    from relax_gdn.bench.hf_peer import apply_liger
    from relax_gdn.model.hf_checkpoint import hf_text_config, preset_dims

    config = Qwen3_5TextConfig(**hf_text_config(preset_dims("qwen3_5_tiny", 256)))
    before = dict(vars(modeling))
    model = Qwen3_5ForCausalLM(config)
    apply_liger(model)
    assert "forward" in vars(model.model.norm) and "forward" in vars(model.model.layers[0].mlp)  # patched
    assert "forward" in vars(model)  # the fused linear cross-entropy
    assert dict(vars(modeling)) == before
    later = Qwen3_5ForCausalLM(config)
    assert "forward" not in vars(later.model.norm) and type(later.model.layers[0].mlp) is modeling.Qwen3_5MLP


def test_bad_input_is_one_message_before_anything_is_written(tmp_path, capsys):
    """Refused on the command line, in the pytest process: nothing built, nothing written."""
    init = tmp_path / "init"
    cases = [
        (["--preset", "qwen3_5_9b"], "--preset qwen3_5_9b on CPU: only qwen3_5_tiny trains there"),
        (["--preset", "qwen3_5_tiny", "--skip", "0"], "--skip 0 must be at least 1"),
        (["--preset", "qwen3_5_tiny", "--steps", "0"], "--steps 0 must be at least 2"),
        (["--preset", "qwen3_5_tiny", "--rows", "hf;relax"], "--baseline-row hf,ckpt is not one of the rows"),
        (["--preset", "qwen3_5_tiny", "--rows", "hf,ckpt;hf,turbo"], "HF row setting 'turbo'"),
        (["--preset", "qwen3_5_tiny", "--hf-checkpoint", str(tmp_path / "missing")], "model.hf_checkpoint="),
    ]
    for argv, says in cases:
        with pytest.raises(SystemExit) as exit_:
            peers.main([*argv, "--init-dir", str(init), "--out", str(tmp_path / "o.json")])
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and says in err, (argv, err)
        assert "Traceback" not in err
    # a directory of the user's own is never taken for (or written over as) the random-init checkpoint
    init.mkdir()
    (init / "notes.txt").write_text("mine")
    with pytest.raises(SystemExit):
        peers.main(["--preset", "qwen3_5_tiny", "--init-dir", str(init)])
    assert "is not a checkpoint this benchmark wrote" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["init"] and [p.name for p in init.iterdir()] == [
        "notes.txt"
    ]


def test_a_bad_row_from_the_command_line_exits_2_with_one_line(tmp_path):
    """As a user runs it: a relax-gdn row whose configuration is impossible, named with its
    workload, exit code 2, one line on stderr, no traceback, nothing written."""
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "relax_gdn.bench.peers",
            "--preset",
            "qwen3_5_tiny",
            "--rows",
            "hf,ckpt;relax,recompute=sometimes",
            "--init-dir",
            str(tmp_path / "init"),
            "--out",
            str(tmp_path / "p.json"),
        ],
        cwd=tmp_path,
        env=child_env({"PYTHONPATH": str(ROOT)}),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 2, done.stderr[-3000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert errors == [line for line in done.stderr.splitlines() if line.strip()], done.stderr[-3000:]
    assert (
        len(errors) == 1 and "row 'relax,recompute=sometimes' (lora): recompute.granularity" in errors[0]
    ), errors
    assert done.stdout == "" and list(tmp_path.iterdir()) == []


def test_hf_inputs_count_the_labels_the_loss_mask_counts():
    from relax_gdn.bench.hf_peer import hf_inputs
    from relax_gdn.data import Sample

    sample = Sample(input_ids=[5, 6, 7, 8, 9], loss_mask=[False, True, True, False, True], sample_id=0)
    ids, labels = hf_inputs(sample, torch.device("cpu"))
    assert ids.tolist() == [[5, 6, 7, 8, 9]]
    # transformers scores labels[i] with the prediction at i - 1: position 1's label is token 7, and so on
    assert labels.tolist() == [[-100, -100, 7, 8, -100]]
    assert int((labels != -100).sum()) == sample.num_loss_tokens


def test_the_reference_step_moves_to_liger_only_where_hf_ckpt_runs_out_of_memory():
    """At 32k on an 80 GB card hf,ckpt runs out of memory on its fp32 logits (asked 30.31 GiB with
    72.79 GiB in use, one H100); hf,ckpt,liger then gives the reference and the title says why. A
    failure other than memory stops there: the next row would fail the same way."""
    oom = {"error": TORCH_OOM, "oom": out_of_memory(TORCH_OOM) | {"step": 1}}
    ran = {"records": [{"loss": 13.2968, "grad_norm": 0.47489}], "summary": {"tokens_per_s": 1.0}}
    entries = {"hf,ckpt": {"records": [], "summary": oom}, "hf,ckpt,liger": ran}
    asked = []

    def run_step(spec):
        asked.append(spec)
        return {"name": spec, "side": "hf", **entries[spec]}

    ref = peers.reference_step(run_step)
    assert asked == ["hf,ckpt", "hf,ckpt,liger"]
    assert ref == {
        "row": "hf,ckpt,liger",
        "loss": 13.2968,
        "grad_norm": 0.47489,
        "instead_of": "hf,ckpt: OOM at step 1: asked 2.00 GiB with 138.43 GiB in use",
    }
    meta = {"preset": "qwen3_5_9b", "docs_per_step": 1, "doc_tokens": 32768, "skip": 2, "steps": 4}
    workload = {"lora": None, "optimizer": "adam", "reference": ref}
    assert peers.workload_title(workload, meta).endswith(
        "HF reference step (hf,ckpt,liger): loss 13.2968, grad norm 0.47489 "
        "(hf,ckpt: OOM at step 1: asked 2.00 GiB with 138.43 GiB in use)"
    )

    asked.clear()
    entries["hf,ckpt"] = ran
    assert peers.reference_step(run_step) == {"row": "hf,ckpt", "loss": 13.2968, "grad_norm": 0.47489}
    assert asked == ["hf,ckpt"]

    asked.clear()
    entries["hf,ckpt"] = {"records": [], "summary": {"error": "ImportError: No module named 'peft'"}}
    ref = peers.reference_step(run_step)
    assert asked == ["hf,ckpt"] and ref["loss"] is None
    assert ref["error"] == "hf,ckpt: FAILED: ImportError: No module named 'peft'"

    asked.clear()
    entries["hf,ckpt"] = entries["hf,ckpt,liger"] = {"records": [], "summary": oom}
    ref = peers.reference_step(run_step)
    assert asked == ["hf,ckpt", "hf,ckpt,liger"] and ref["loss"] is None
    assert ref["error"].count("OOM at step 1") == 2
