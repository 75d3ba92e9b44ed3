"""``python -m relax_gdn.export_hf CHECKPOINT OUT`` off the happy path, as a user meets it, on the
checkpoint of the session's short ``train.py`` run:

* CHECKPOINT may be a run directory, its checkpoint directory or a step directory; one that is none
  of these is one message naming CHECKPOINT (not a training key), exit 2;
* OUT must be new or empty: a directory holding an earlier export (or anything) is refused and left
  as it was; ``--overwrite`` replaces it whole (no file of the earlier export survives, nothing is
  left beside it); a file, a path that cannot be written, a file system without room for the
  export are refused before anything is built;
* a successful export prints its report and no third-party notice.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.distributed import child_env
from tests.helpers import THIRD_PARTY_NOTICE
from tests.hf_sources import export_cli

EXPORT_LIMIT_S = 300
EXPORT_FILES = [
    "chat_template.jinja",
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
]
EARLIER = {
    "adapter_config.json": "{}",
    "adapter_model.safetensors": "old",
    "tokenizer.model": "old",
    "model-00001-of-00002.safetensors": "old",
}  # what an earlier export (merged or adapter) left


@pytest.fixture(scope="module")
def run_dir(short_train_py) -> Path:
    done, run, _, _ = short_train_py("3 steps")
    assert done.returncode == 0, done.stderr[-3000:]
    return run


def _export(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "relax_gdn.export_hf", *map(str, args)],
        cwd=tmp_path,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=EXPORT_LIMIT_S,
    )


def _beside(out: Path) -> list[str]:
    return sorted(p.name for p in out.parent.iterdir() if p.name != out.name)


@pytest.mark.slow
def test_export_replaces_an_earlier_export_only_with_overwrite_and_says_nothing_third_party(
    run_dir, tmp_path
):
    out = tmp_path / "hf"
    out.mkdir()
    for name, text in EARLIER.items():
        (out / name).write_text(text)
    rc, stdout, stderr = export_cli(str(run_dir), str(out))  # in this process: refused before any build
    assert rc == 2 and stdout == "", stderr[-3000:]
    assert stderr == (
        f"error: OUT {out} is not empty (adapter_config.json, adapter_model.safetensors, "
        "model-00001-of-00002.safetensors, tokenizer.model): an export goes into a new or "
        "empty directory; give another OUT, or add --overwrite to replace what is there\n"
    )
    assert {p.name: p.read_text() for p in out.iterdir()} == EARLIER and _beside(out) == []
    done = _export(tmp_path, run_dir, out, "--overwrite")  # a run directory as CHECKPOINT
    text = done.stdout + done.stderr
    assert done.returncode == 0, text[-3000:]
    assert sorted(p.name for p in out.iterdir()) == EXPORT_FILES and _beside(out) == []
    assert done.stdout.startswith(f"wrote {out}: Qwen3_5ForCausalLM (text layout)")
    assert [line for line in text.splitlines() if THIRD_PARTY_NOTICE.search(line)] == [], text
    assert done.stderr == "" and len(done.stdout.splitlines()) <= 6, text


@pytest.mark.slow  # the exports' Runtime, in this process
@pytest.mark.parametrize("given", ["run", "checkpoints", "step"])
def test_checkpoint_may_be_a_run_a_checkpoint_or_a_step_directory(run_dir, tmp_path, given):
    """The argument is resolved before anything is built: OUT is a file here, so the export stops
    right after CHECKPOINT was found (its message is OUT's, not CHECKPOINT's)."""
    checkpoint = {
        "run": run_dir,
        "checkpoints": run_dir / "checkpoints",
        "step": run_dir / "checkpoints" / "step_000003",
    }[given]
    out = tmp_path / "a_file"
    out.write_text("")
    rc, stdout, stderr = export_cli(str(checkpoint), str(out))
    assert (rc, stdout) == (2, "") and stderr == (
        f"error: OUT {out} is a file: give the path of a directory (made if it does not exist)\n"
    ), stderr


@pytest.mark.slow  # the run_dir fixture trains
def test_resume_takes_the_same_three_forms_as_the_export(run_dir, tmp_path):
    """checkpoint.resume=<run directory> continues the run's newest checkpoint, as export_hf reads it."""
    from relax_gdn.train.checkpoint import CheckpointError, resolve_resume

    step = run_dir / "checkpoints" / "step_000003"
    for given in (run_dir, run_dir / "checkpoints", step):
        assert resolve_resume(str(given), None) == (step, [])
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match=r"holds no complete checkpoint .*or at a run directory"):
        resolve_resume(str(tmp_path / "empty"), None)


@pytest.mark.slow
def test_a_checkpoint_argument_that_is_none_of_those_names_checkpoint(run_dir, tmp_path):
    what = (
        "give a step_NNNNNN checkpoint directory, the checkpoint directory holding them, or a run directory"
    )
    missing, empty, damaged = tmp_path / "missing", tmp_path / "empty", tmp_path / "damaged" / "step_000003"
    empty.mkdir()
    shutil.copytree(run_dir / "checkpoints" / "step_000003", damaged)
    (damaged / "relax_gdn.json").write_text("{")
    for checkpoint, said in [
        (missing, f"error: CHECKPOINT {missing} does not exist: {what}"),
        (
            empty,
            f"error: CHECKPOINT {empty} holds no complete checkpoint (a step_NNNNNN directory with "
            f"relax_gdn.json): {what}",
        ),
        (
            damaged,
            f"error: CHECKPOINT {damaged}: checkpoint manifest {damaged / 'relax_gdn.json'} cannot be read",
        ),
    ]:
        rc, stdout, stderr = export_cli(str(checkpoint), str(tmp_path / "out"))
        assert rc == 2 and stdout == "" and stderr.startswith(said) and stderr.count("\n") == 1, stderr
        assert "checkpoint.resume" not in stderr and "resume from" not in stderr, stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_an_out_that_cannot_be_written_or_has_no_room_is_refused_before_anything_is_built(run_dir, tmp_path):
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    cases = [
        (
            a_file / "hf",
            (),
            f"error: OUT {a_file / 'hf'} cannot be made: {a_file} is a file: give a path under a directory\n",
        )
    ]
    if os.geteuid() != 0:
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o555)
        cases.append(
            (locked / "hf", (), f"error: OUT {locked / 'hf'} cannot be written (Permission denied: ")
        )
    else:  # root writes into any directory, not into sysfs
        sysfs = Path("/sys/relax_gdn_export_test/hf")
        cases.append(
            (
                sysfs,
                (),
                f"error: OUT {sysfs} cannot be written (Operation not permitted: {sysfs.parent}): "
                "give a directory you can write to\n",
            )
        )
    # a --like checkpoint whose weights (sparse: nothing on disk) outweigh the free space
    like = tmp_path / "like"
    like.mkdir()
    free = shutil.disk_usage(tmp_path).free
    (like / "model.safetensors").touch()
    os.truncate(like / "model.safetensors", free + 2**30)
    cases.append(
        (tmp_path / "hf", ("--like", str(like)), f"error: OUT {tmp_path / 'hf'}: the export needs about ")
    )
    for out, args, said in cases:
        rc, stdout, stderr = export_cli(str(run_dir), str(out), *args)
        assert rc == 2 and stdout == "" and stderr.startswith(said) and stderr.count("\n") == 1, stderr
        assert not out.exists() and not list(out.parent.glob(f".{out.name}.*")), stderr
