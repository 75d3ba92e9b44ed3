"""The GPU image holds what the package and the documented commands need, checked without Docker.

The test replays docker/Dockerfile's COPY lines into an empty directory and, from there, runs what
README.md documents: a short training run, a 2-job local sweep, ``relax_gdn.compare`` and
``relax_gdn.export_hf``. The commands run under ``python -S`` with only site-packages on the path,
so nothing resolves to this checkout (the editable install's import hook is a ``.pth`` file, which
``-S`` skips): a path the image lacks fails here as it would in the image.
"""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from tests.distributed import child_env

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "docker" / "Dockerfile"
TINY = [
    "train.steps=2",
    "optim.warmup_steps=1",
    "train.global_batch_size=4",
    "data.num_samples=32",
    "data.synthetic_max_steps=1",
    "logging.console=false",
]


def dockerfile_copies(dockerfile: Path) -> list[tuple[list[str], str]]:
    """``(sources, destination)`` of each ``COPY`` line, relative to the build context."""
    copies = []
    for line in dockerfile.read_text().splitlines():
        if not line.upper().startswith("COPY "):
            continue
        words = shlex.split(line.split("#", 1)[0])
        *sources, destination = [w for w in words[1:] if not w.startswith("--")]
        copies.append((sources, destination))
    return copies


def replay_copies(dockerfile: Path, context: Path, image: Path) -> None:
    """Copy what the COPY lines copy, with Docker's rules (a directory's contents go into the
    destination; a file goes into a destination ending in ``/``, else becomes it); ``WORKDIR``
    is ``image``. A missing source fails, as the build would."""
    for sources, destination in dockerfile_copies(dockerfile):
        target = image / destination
        for source in sources:
            path = context / source
            assert path.exists(), f"{dockerfile}: COPY {source} names a path the repository does not have"
            if path.is_dir():
                shutil.copytree(
                    path, target, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"), dirs_exist_ok=True
                )
            else:
                dest = target / path.name if destination.endswith("/") or len(sources) > 1 else target
                dest.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(path, dest)


def _in_image(image: Path, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    env = child_env({"PYTHONPATH": f"{image}:{sysconfig.get_paths()['purelib']}", "WANDB_MODE": "disabled"})
    return subprocess.run(
        [sys.executable, "-S", *args], cwd=image, env=env, capture_output=True, text=True, timeout=timeout
    )


@pytest.fixture
def image(tmp_path) -> Path:
    image = tmp_path / "opt" / "relax-gdn"
    image.mkdir(parents=True)
    replay_copies(DOCKERFILE, ROOT, image)
    return image


def test_replayed_copies_hold_the_package_the_launchers_and_the_examples(image):
    for needed in (
        "train.py",
        "relax_gdn/__init__.py",
        "conf/config.yaml",
        "hydra_plugins/relax_gdn_launcher",
        "examples/data/chat.jsonl",
        "slurm/train.sbatch",
        "pyproject.toml",
        "requirements.lock",
    ):
        assert (image / needed).exists(), needed
    found = _in_image(
        image,
        "-c",
        "import relax_gdn, hydra_plugins.relax_gdn_launcher as l; print(relax_gdn.__file__, l.__file__)",
    )
    assert found.returncode == 0, found.stderr[-2000:]
    assert all(path.startswith(str(image)) for path in found.stdout.split()), found.stdout


def test_a_path_the_image_lacks_fails_as_it_would_in_the_image(tmp_path):
    """The control: without hydra_plugins/ in the image the launcher does not import from this
    checkout either (what the test above would otherwise not notice)."""
    image = tmp_path / "image"
    image.mkdir()
    shutil.copytree(ROOT / "relax_gdn", image / "relax_gdn", ignore=shutil.ignore_patterns("__pycache__"))
    missing = _in_image(image, "-c", "import hydra_plugins.relax_gdn_launcher")
    assert missing.returncode != 0 and "ModuleNotFoundError" in missing.stderr


def test_the_documented_commands_run_from_the_image(image):
    run = _in_image(image, "train.py", *TINY, "checkpoint.save_final=true", "hydra.run.dir=outputs/run")
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
    checkpoints = image / "outputs" / "run" / "checkpoints"
    assert (checkpoints / "latest").read_text().strip() == "step_000002"

    sweep = _in_image(
        image,
        "train.py",
        "-m",
        "hydra/launcher=local",
        "train.seed=1,2",
        *TINY,
        "hydra.sweep.dir=outputs/sweep",
    )
    assert sweep.returncode == 0, (sweep.stdout + sweep.stderr)[-4000:]
    manifest = json.loads((image / "outputs" / "sweep" / "sweep.json").read_text())
    assert [job["status"] for job in manifest["jobs"]] == ["ok", "ok"]

    compared = _in_image(image, "-m", "relax_gdn.compare", "outputs/sweep", "--out", "outputs/compare")
    assert compared.returncode == 0, (compared.stdout + compared.stderr)[-4000:]
    assert (image / "outputs" / "compare" / "summary.md").stat().st_size > 0

    exported = _in_image(image, "-m", "relax_gdn.export_hf", str(checkpoints), "outputs/hf")
    assert exported.returncode == 0, (exported.stdout + exported.stderr)[-4000:]
    assert (image / "outputs" / "hf" / "config.json").is_file()
    assert (image / "outputs" / "hf" / "model.safetensors").is_file()
