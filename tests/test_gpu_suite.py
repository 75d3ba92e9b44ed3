"""``relax_gdn/bench/gpu_suite.sh`` (the one-GPU suite, docs/gpu.md) names every test file that holds a
GPU test: a file left out of it would never run on the device, and a name it keeps after the file
went would end a stream with pytest's "file not found"."""

from __future__ import annotations

import re
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
