"""``relax_gdn/bench/gpu_suite.sh`` (the one-GPU suite, docs/gpu.md) names every test file that holds a
GPU test: a file left out of it would never run on the device, and a name it keeps after the file
went would end a stream with pytest's "file not found". A card too small for a call's streams at once
is refused before any stream starts."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_gpu_suite_names_every_file_with_a_gpu_test():
    named = set(re.findall(r"tests/test_\w+\.py", (ROOT / "relax_gdn/bench/gpu_suite.sh").read_text()))
    with_gpu_tests = {
        f"tests/{path.name}"
        for path in (ROOT / "tests").glob("test_*.py")
        if path.name != Path(__file__).name and "pytest.mark.gpu" in path.read_text()
    }
    assert sorted(with_gpu_tests - named) == [], "add these files to a stream of gpu_suite.sh"
    assert sorted(named - with_gpu_tests) == [], "gpu_suite.sh names files without a GPU test"


def _run_suite(tmp_path: Path, gpu_mib: int, **env: str) -> subprocess.CompletedProcess:
    """gpu_suite.sh as on the device, from an empty directory, with an ``nvidia-smi`` that reports a
    card of ``gpu_mib`` MiB named NVIDIA H100 80GB HBM3."""
    stub = tmp_path / "bin"
    stub.mkdir(exist_ok=True)
    smi = stub / "nvidia-smi"
    report = f'case "$*" in *memory.total*nounits*) echo {gpu_mib};; *) echo "NVIDIA H100 80GB HBM3";; esac'
    smi.write_text(f"#!/bin/sh\n{report}\n")
    smi.chmod(0o755)
    return subprocess.run(
        ["bash", str(ROOT / "relax_gdn/bench/gpu_suite.sh")],
        cwd=tmp_path,
        env={**os.environ, "PATH": f"{stub}:{os.environ['PATH']}", "OUT": str(tmp_path / "out"), **env},
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_an_80_gb_card_gets_one_stream_per_call(tmp_path):
    done = _run_suite(tmp_path, 81559, CALL="1")
    assert done.returncode == 2, done.stderr
    assert "this GPU has 79 GiB, too little for the streams checkpoint trainer kernels at once" in done.stderr
    assert "STREAMS=checkpoint" in done.stderr
    assert not list((tmp_path / "out").glob("*.log"))  # no pytest stream was started


def test_a_stream_of_another_call_is_refused_with_the_calls_streams(tmp_path):
    done = _run_suite(tmp_path, 143771, CALL="2", STREAMS="kernels")
    assert done.returncode == 2, done.stderr
    assert "STREAMS: CALL=2 has no stream kernels (its streams: lora hf_export)" in done.stderr
    assert not list((tmp_path / "out").glob("*.log"))
