"""train.py through Hydra, as a user runs it (one process, CPU): a short run writes its resolved
config and metrics into the Hydra run directory (never into the package); every bad input
(configuration or data) exits with status 2 and one message naming the key or file, no traceback,
and leaves no run directory behind."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.distributed import child_env
from tests.helpers import ROOT, TYPO_MESSAGE
from tests.helpers import train_py as _train


def test_short_run_writes_config_and_metrics_in_the_run_dir(short_train_py):
    done, run, before, after = short_train_py("3 steps")
    assert done.returncode == 0, done.stderr[-3000:]
    assert {"config.yaml", "metrics.jsonl", ".hydra"} <= {p.name for p in run.iterdir()}
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert "run_name: entry-test" in (run / "config.yaml").read_text()
    assert "step 3/3" in done.stdout
    assert before == after  # nothing written into the package


def test_impossible_config_exits_before_training(tmp_path):
    done = _train(tmp_path, "parallel.cp=2", "gdn.cp_mode=all_gather")
    assert done.returncode == 2
    text = done.stdout + done.stderr
    assert "world size 1 is not divisible by parallel.tp x parallel.cp" in text
    assert "python -m relax_gdn.launch --nproc-per-node 2 train.py" in text  # how to start enough processes
    run = tmp_path / "run"
    assert not (run / "metrics.jsonl").exists() and not (run / "config.yaml").exists()


def _data_file(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


# (overrides, what the one message must contain); {tmp} is the test's directory
BAD_INPUTS = {
    "append unknown key": (["+train.stepz=3"], ["'train.stepz'", "steps"]),
    "unknown key": (["train.stepz=3"], ["'train.stepz'", "steps"]),
    "unknown group": (["parallel.pp=2"], ["'parallel.pp'", "tp, cp"]),
    "float for a float": (["optim.lr=fast"], ["optim.lr=fast", "Float"]),
    "float for an int": (["train.steps=1.5"], ["train.steps=1.5", "Integer"]),
    "unknown group option": (["gdn=ringwise"], ["gdn=ringwise", "chunkwise"]),
    "unknown choice": (["gdn.route=eager"], ["gdn.route='eager'", "lazy_cache"]),
    "impossible combination": (["parallel.cp=2", "gdn.cp_mode=all_gather"], ["world size 1", "parallel.cp"]),
    "sp without tp": (["parallel.sp=true"], ["parallel.sp=true", "parallel.tp"]),
    "missing data file": (["data=jsonl", "data.path={tmp}/none.jsonl"], ["data.path=", "none.jsonl"]),
    "wrong field names": (
        ["data=jsonl", "data.path={tmp}/fields.jsonl"],
        ["fields.jsonl", "data.prompt_field", "['question', 'answer']"],
    ),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_is_one_message_and_leaves_nothing(tmp_path, case):
    _data_file(tmp_path, "fields.jsonl", json.dumps({"question": "1+1?", "answer": "2"}) + "\n")
    overrides, needles = BAD_INPUTS[case]
    done = _train(tmp_path, *(o.format(tmp=tmp_path) for o in overrides))
    text = done.stdout + done.stderr
    assert done.returncode == 2, text[-3000:]
    assert "Traceback" not in text
    assert len(re.findall(r"^error: ", done.stderr, flags=re.M)) == 1, done.stderr
    for needle in needles:
        assert needle in done.stderr, (needle, done.stderr)
    assert not (tmp_path / "run").exists()  # nothing written: Hydra's run directory is gone too


def test_selective_recompute_without_a_compiler_is_one_message_before_step_1(tmp_path):
    """``mlp_act``'s recompute needs a C++ extension torch builds with ninja and a compiler. On a
    machine without them (here: an empty PATH and no cached build) the run stops while the model is
    built, with the cause and the fix, instead of inside step 1's backward with ninja's traceback."""
    (tmp_path / "bin").mkdir()
    env = {"PATH": str(tmp_path / "bin"), "TORCH_EXTENSIONS_DIR": str(tmp_path / "torch_extensions")}
    done = _train(tmp_path, "recompute=selective", "train.steps=2", env=env)
    text = done.stdout + done.stderr
    assert done.returncode == 2, text[-3000:]
    assert "Traceback" not in text and "step 1" not in text
    (line,) = re.findall(r"^error: .*", done.stderr, flags=re.M)
    assert "share_storage C++ extension" in line and "Ninja is required" in line, line
    assert "pip install ninja" in line and "recompute.modules=[core_attn,gdn_core]" in line, line
    assert not (tmp_path / "run").exists()


def test_an_empty_data_file_is_one_message_and_leaves_no_default_run_directory_behind(tmp_path):
    """A bad input found while loading the data (BAD_INPUTS' checks, in one run). Without
    hydra.run.dir, Hydra makes outputs/runs/<date>/<time>/; the failed attempt removes that and the
    empty parents made for it."""
    _data_file(tmp_path, "empty.jsonl", "")
    (tmp_path / "kept").mkdir()  # what was there before stays
    done = _train(tmp_path, "data=jsonl", f"data.path={tmp_path}/empty.jsonl", run_dir=False)
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stdout + done.stderr
    assert len(re.findall(r"^error: ", done.stderr, flags=re.M)) == 1, done.stderr
    assert "empty.jsonl" in done.stderr and "no records" in done.stderr, done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty.jsonl", "kept"]


def test_a_typo_is_reported_before_torch_is_imported(tmp_path):
    done = _train(tmp_path, "train.stepz=3", python_flags=("-X", "importtime"))
    assert done.returncode == 2
    imported = {
        line.rsplit("|", 1)[-1].strip()
        for line in done.stderr.splitlines()
        if line.startswith("import time:")
    }
    assert "omegaconf" in imported and "relax_gdn.config.validate" in imported
    for heavy in ("torch", "megatron", "fla", "wandb", "transformers"):
        assert heavy not in imported, heavy


def test_hydra_full_error_shows_the_traceback(tmp_path):
    done = _train(tmp_path, "train.steps=0", env={"HYDRA_FULL_ERROR": "1"})
    assert done.returncode != 0 and "Traceback" in done.stderr and "train.steps=0" in done.stderr


CONFIG_PROBLEMS = {  # override: the one message
    "train.steps=0": "error: configuration problem: train.steps=0 must be an integer >= 1",
    "train.stepz=3": TYPO_MESSAGE,
}


def _launch(tmp_path: Path, launcher: str, *args: str) -> subprocess.CompletedProcess:
    """``python -m <launcher> --nproc-per-node 2 <args>`` in ``tmp_path``, as a user starts it."""
    return subprocess.run(
        [sys.executable, "-m", launcher, "--nproc-per-node", "2", *args],
        cwd=tmp_path,
        env=child_env({"PYTHONPATH": str(ROOT)}),
        capture_output=True,
        text=True,
        timeout=300,
    )


# each launcher with one kind of problem: a typo and a bad value take the same path (compose, validate)
@pytest.mark.parametrize(
    "launcher,override", [("torch.distributed.run", "train.stepz=3"), ("relax_gdn.launch", "train.steps=0")]
)
def test_under_torchrun_rank_zero_alone_reports_a_config_problem(tmp_path, launcher, override):
    """Every rank finds the problem; rank 0 prints it, the others exit 2 when torchrun stops them.
    torchrun itself then exits 1 below its own report (its exit code is not the workers');
    relax_gdn.launch (what make run and slurm/train.sbatch start) exits 2 without it."""
    done = _launch(tmp_path, launcher, str(ROOT / "train.py"), f"hydra.run.dir={tmp_path / 'run'}", override)
    assert done.returncode != 0
    assert re.findall(r"^(?:\[rank \d+\] )?error: .*", done.stderr, flags=re.M) == [CONFIG_PROBLEMS[override]]
    assert not (tmp_path / "run").exists()
    if launcher == "torch.distributed.run":
        assert done.returncode == 1 and "ChildFailedError" in done.stderr
        # rank 0 exited 2; rank 1 too, or was stopped by torchrun before it got to its own report
        root_cause = done.stderr.split("Root Cause", 1)[1]
        assert re.findall(r"exitcode  : (-?\d+)", root_cause) == ["2"], done.stderr
        assert set(re.findall(r"exitcode  : (-?\d+)", done.stderr)) <= {"2", "-15"}, done.stderr
    else:
        assert done.returncode == 2, done.stderr
        assert "Traceback" not in done.stderr and "exitcode" not in done.stderr, done.stderr
        assert done.stderr.strip() == CONFIG_PROBLEMS[override]  # the one line, nothing of torchrun's


def test_a_sweep_under_torchrun_is_refused_once(tmp_path):
    done = _launch(
        tmp_path, "relax_gdn.launch", str(ROOT / "train.py"), "-m", "gdn.cp_mode=headwise,chunkwise"
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("cannot run under torchrun") == 1 and "Traceback" not in done.stderr, done.stderr
    assert not (tmp_path / "outputs").exists()


@pytest.mark.parametrize(
    "sweep,says",
    [
        (
            ["gdn=chunkwise,chunkwis"],
            "gdn=chunkwis is not an option of the gdn group; use one of all_gather,",
        ),
        (["train.stepz=3"], "unknown config key 'train.stepz'"),
        (["hydra/launcher=locl"], "hydra/launcher=locl is not an option of the hydra/launcher group"),
    ],
    ids=["a swept value", "a key", "the launcher"],
)
def test_a_typo_in_a_sweep_is_one_message_before_any_job(tmp_path, sweep, says):
    """Wherever the typo is (a value only the second job takes, too), the sweep stops before
    Hydra starts a job: one line, exit 2, no sweep directory."""
    done = _train(tmp_path, "-m", "train.seed=1,2", *sweep, f"hydra.sweep.dir={tmp_path / 'sweep'}")
    errors = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert done.returncode == 2 and len(errors) == 1 and says in errors[0], done.stderr[-3000:]
    assert "Traceback" not in done.stderr and "Launching" not in done.stdout + done.stderr
    assert not (tmp_path / "sweep").exists()


@pytest.mark.parametrize(
    "modes,says",
    [
        (["--multirun", "--cfg", "job"], "error: --multirun and --cfg cannot be given together"),
        (["-c", "job", "-i"], "error: --cfg and --info cannot be given together"),
    ],
    ids=["sweep and print", "print and info"],
)
def test_two_of_hydras_modes_are_one_line_naming_both(tmp_path, modes, says):
    """Hydra runs one of --run, --multirun, --cfg, --info, --shell-completion and ends two of them
    with its own traceback; the user gets one line naming both (with the way to see one sweep
    job's configuration), exit 2, and nothing written."""
    done = _train(tmp_path, *modes, "train.seed=1,2", f"hydra.sweep.dir={tmp_path / 'sweep'}", run_dir=False)
    errors = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert done.returncode == 2 and len(errors) == 1 and errors[0].startswith(says), done.stderr[-3000:]
    assert "Traceback" not in done.stderr and done.stdout == ""
    if "--multirun" in modes:
        assert "give --cfg job that job's overrides (one value per key)" in errors[0]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "argv,says",
    [
        (
            ["--nproc-per-node", "two", "train.py"],
            "--nproc-per-node two (Unsupported nproc_per_node value: two)",
        ),
        (
            ["--nproc-per-node", "2", "-m", "relax_gdn.bench.nothere"],
            "-m relax_gdn.bench.nothere: no such module",
        ),
        (["--nproc-per-node", "2", "trian.py"], "trian.py is not a file (from "),
    ],
    ids=["nproc", "module", "script"],
)
def test_a_launch_no_worker_could_run_is_refused_naming_it(argv, says, tmp_path, monkeypatch):
    from relax_gdn.launch import LaunchError, check_launch

    monkeypatch.chdir(tmp_path)
    with pytest.raises(LaunchError) as refused:
        check_launch(argv)
    assert says in str(refused.value)
    check_launch(["--nproc-per-node", "2", str(ROOT / "train.py"), "train.steps=1"])  # the good one passes


def test_a_launch_usage_error_names_the_command_the_user_typed(capsys):
    """torchrun's parser with no script: argparse's message and exit 2, under the command the user
    typed (not ``launch.py``, the module's file name)."""
    from relax_gdn.launch import check_launch

    with pytest.raises(SystemExit) as stopped:
        check_launch(["--nproc-per-node", "2"])
    err = capsys.readouterr().err
    assert stopped.value.code == 2
    assert err.startswith("usage: python -m relax_gdn.launch [-h]") and "launch.py" not in err, err
    assert err.splitlines()[-1].startswith(
        "python -m relax_gdn.launch: error: the following arguments are required"
    )


def test_a_launch_of_a_script_that_is_not_there_is_one_line_and_starts_no_worker(tmp_path):
    done = _launch(tmp_path, "relax_gdn.launch", "trian.py", "train.steps=1")
    assert done.returncode == 2, done.stderr[-3000:]
    assert [line for line in done.stderr.splitlines() if "trian.py" in line] == [
        f"error: trian.py is not a file (from {tmp_path}): give the path of train.py, or -m and a module "
        "(python -m relax_gdn.launch --nproc-per-node N train.py <overrides>)"
    ]
    assert "Traceback" not in done.stderr and "can't open file" not in done.stderr
    assert list(tmp_path.iterdir()) == []


def test_check_validates_the_command_line_for_the_world_size_alone(tmp_path):
    def check(*args: str, flag_last: bool = False) -> subprocess.CompletedProcess:
        flagged = [*args, "--check"] if flag_last else ["--check", *args]
        return subprocess.run(
            [sys.executable, str(ROOT / "train.py"), *flagged],
            cwd=tmp_path,
            env=child_env(),
            capture_output=True,
            text=True,
            timeout=120,
        )

    # the flags where a user puts them: --world-size among the overrides, --check after them
    ok = check("parallel.cp=2", "--world-size", "2", "recompute.granularity=mixed")
    assert ok.returncode == 0 and ok.stderr == "", ok.stderr
    if not torch.cuda.is_available():  # what the one line says on a machine without CUDA
        assert ok.stdout == (
            "train.py --check: ok for 2 processes (dp 1 x cp 2 x tp 1) on this machine's CPU "
            "(no CUDA); memory: CPU run, not modelled; recompute mixed: no layer whole on CPU\n"
        )
    refused = check("parallel.cp=2", flag_last=True)
    assert refused.returncode == 2 and refused.stderr.startswith(
        "error: configuration problem: world size 1 is"
    )
    without_check = _train(tmp_path, "--world-size", "2", "parallel.cp=2", run_dir=False)
    assert without_check.returncode == 2 and without_check.stderr.startswith(
        "error: --world-size is an option of --check"
    ), without_check.stderr
    typo = check("--world-size", "2", "parallel.cp=2", "train.stepz=3")
    assert typo.returncode == 2 and typo.stderr.strip() == CONFIG_PROBLEMS["train.stepz=3"]
    assert list(tmp_path.iterdir()) == []  # nothing written


def _make_run(tmp_path: Path, args: str) -> subprocess.CompletedProcess:
    """``make run ARGS=...`` from the repository with this interpreter (a stand-in venv directory
    marked installed: nothing is installed)."""
    venv = tmp_path / "venv"
    venv.mkdir()
    (venv / ".installed").touch()  # newer than pyproject.toml and requirements.lock
    return subprocess.run(
        [
            "make",
            "--no-print-directory",
            "-C",
            str(ROOT),
            "run",
            f"VENV={venv}",
            f"PY={sys.executable}",
            f"ARGS={args}",
        ],
        cwd=tmp_path,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.mark.parametrize("case", ["typo", "data"])
def test_make_run_reports_a_problem_once_with_exit_code_2(tmp_path, case):
    """A typo is refused by the check before any worker starts; a data problem is found by the
    workers (relax_gdn.launch ends with their code). Either way one message, no traceback."""
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    args = {
        "typo": "train.stepz=3",
        "data": f"data=jsonl data.path={empty} hydra.run.dir={tmp_path / 'run'}",
    }[case]
    done = _make_run(tmp_path, args)
    assert done.returncode == 2, done.stdout[-3000:] + done.stderr[-3000:]
    messages = re.findall(r"^(?:\[rank \d+\] )?error: .*", done.stderr, flags=re.M)
    assert len(messages) == 1, done.stderr
    assert "Traceback" not in done.stderr and "ChildFailedError" not in done.stderr, done.stderr
    if case == "typo":
        assert messages == [CONFIG_PROBLEMS["train.stepz=3"]]
        assert "relax_gdn.launch" not in done.stdout  # make stopped before starting the workers
    else:
        assert str(empty) in messages[0] and "relax_gdn.launch" in done.stdout
        assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("steps", [1, 3])
def test_any_step_count_trains_with_the_default_warmup(short_train_py, steps):
    done, run, _, _ = short_train_py({1: "1 step on jsonl, third-party notices", 3: "3 steps"}[steps])
    assert done.returncode == 0, done.stderr[-3000:]
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    assert records[0]["lr"] > 0  # no warm-up step at rate 0: 0.1 x 1 or 3 steps rounds to none


def test_jsonl_data_runs_on_the_demo_defaults_skipping_what_does_not_fit(short_train_py):
    """One step on the demo defaults with data=jsonl: 20 short records and one longer than the
    default limit (the session's run, tests/conftest.py SHORT_TRAIN_PY_FILES)."""
    done, _, _, _ = short_train_py("1 step on jsonl, third-party notices")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "20/21 records kept; skipped: too_long=1" in done.stdout + done.stderr


# ------------------------------------------------------------------ the commands the docs show

DOCUMENTS = [
    "README.md",
    "conf/README.md",
    "conf/config.yaml",
    *sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").rglob("*.md")),
]
_COMMAND = re.compile(r"^(?:#\s*)?(python train\.py|torchrun --nproc-per-node (\d+) train\.py)(?P<args>.*)$")


def documented_runs() -> list[tuple[str, int, list[str]]]:
    """(where, world size, overrides) of every ``python train.py ...`` / ``torchrun --nproc-per-node N
    train.py ...`` line the docs show as a command (continuation lines joined; sweeps, Hydra flags,
    transcripts of errors and placeholders left out)."""
    runs = []
    for name in DOCUMENTS:
        lines = (ROOT / name).read_text().splitlines()
        for number, line in enumerate(lines):
            match = _COMMAND.match(line.strip())
            if match is None:
                continue
            text, follow = match.group("args"), number
            while text.rstrip().endswith("\\"):
                follow += 1
                text = text.rstrip()[:-1] + " " + lines[follow].strip().removeprefix("#").strip()
            args = text.split("#", 1)[0].split()
            if any(a.startswith("-") or "..." in a or "<" in a for a in args):
                continue
            runs.append((f"{name}:{number + 1}", int(match.group(2) or 1), args))
    return runs


def test_every_documented_command_passes_the_check():
    """What the docs show as a command runs as written: composed and validated at its world size
    (one process for ``python train.py``)."""
    from relax_gdn.config import validate
    from relax_gdn.config.hydra_io import compose_run_config
    from relax_gdn.errors import RecipeError

    runs = documented_runs()
    assert len(runs) >= 20 and any(world > 1 for _, world, _ in runs)
    refused = {}
    for where, world, overrides in runs:
        try:
            validate(compose_run_config(ROOT / "conf", overrides), world)
        except RecipeError as e:
            # the reader's own files (data, tokenizer, checkpoint) are not here; everything else must hold
            problems = [p for p in getattr(e, "problems", [str(e)]) if not _NOT_HERE.search(p)]
            if problems:
                refused[where] = problems
    assert refused == {}


_NOT_HERE = re.compile(r"does not exist|is neither 'embedded' nor an existing|is not a directory")


@pytest.mark.parametrize(
    "codes,agreed",
    [
        ([2, 2], 2),
        ([2, -15], 2),
        ([75, -15, 75], 75),
        ([2, 1], None),
        ([1, -15], None),
        ([-9], None),
        ([-15], None),
        ([2, 75], None),
    ],
)
def test_the_launcher_passes_on_the_code_the_failed_workers_agree_on(codes, agreed):
    from relax_gdn.launch import agreed_exit_code

    assert agreed_exit_code(codes) == agreed
