"""Rules of this test suite, checked: tests/conftest.py marks every test that starts a process
``slow`` at collection (through the pool fixture, ``run_distributed``, ``subprocess`` or
``multiprocessing``, in the test, in a fixture it uses, or in a tests/ function either calls; a
test that starts none stays unmarked); every read of a child process's output has a time limit."""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.processes import output_lines

TESTS = Path(__file__).resolve().parent

pytest_plugins = ["pytester"]

SAMPLE = """
import multiprocessing as mp
import subprocess
import sys

import pytest


def _child():
    return subprocess.run([sys.executable, "-c", "pass"], timeout=60)


def _two_levels_down():
    return _child()


def _arithmetic():
    return 1 + 1


@pytest.fixture
def made_by_a_child():
    return _child()


@pytest.fixture
def ranks(gloo):
    return gloo


def test_plain():
    assert _arithmetic() == 2


def test_helper_two_levels_down():
    _two_levels_down()


def test_imports_run_distributed_in_its_body():
    from tests.distributed import run_distributed

    assert run_distributed


def test_module_alias():
    assert mp.get_context("spawn")


def test_pool_fixture(gloo):
    pass


def test_pool_through_another_fixture(ranks):
    pass


def test_child_in_a_fixture(made_by_a_child):
    pass


@pytest.mark.parametrize("n", [1, 2])
def test_parametrised_child(n):
    subprocess.run([sys.executable, "-c", "pass"], timeout=60)


@pytest.mark.slow
def test_marked_by_hand():
    pass
"""


def test_collection_marks_every_test_that_starts_a_process_slow(pytester):
    pytester.makeini("[pytest]\nmarkers =\n    slow: starts processes\n")
    pytester.makeconftest("from tests.conftest import gloo, pytest_collection_modifyitems  # noqa: F401\n")
    pytester.makepyfile(test_sample=textwrap.dedent(SAMPLE))
    items, _ = pytester.inline_genitems()
    marked = {item.name: [m.name for m in item.iter_markers("slow")] for item in items}
    assert marked == {
        "test_plain": [],
        "test_helper_two_levels_down": ["slow"],
        "test_imports_run_distributed_in_its_body": ["slow"],
        "test_module_alias": ["slow"],
        "test_pool_fixture": ["slow"],
        "test_pool_through_another_fixture": ["slow"],
        "test_child_in_a_fixture": ["slow"],
        "test_parametrised_child[1]": ["slow"],
        "test_parametrised_child[2]": ["slow"],
        "test_marked_by_hand": ["slow"],  # once, not twice
    }


def _call_name(call: ast.Call) -> str:
    func = call.func
    if isinstance(func, ast.Attribute):
        owner = func.value.id if isinstance(func.value, ast.Name) else ""
        return f"{owner}.{func.attr}" if owner else f".{func.attr}"
    return func.id if isinstance(func, ast.Name) else ""


def _unbounded_child_reads(tree: ast.AST) -> list[tuple[int, str]]:
    """Calls that wait for a child without ``timeout=``, and loops or reads on its pipes."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            name = _call_name(node)
            has_timeout = any(k.arg == "timeout" for k in node.keywords)
            waits = name in (
                "subprocess.run",
                "subprocess.call",
                "subprocess.check_call",
                "subprocess.check_output",
            )
            waits |= name.endswith(".communicate")
            # process.wait() (a variable's); threading.Event().wait() in the harness tests is a call's
            waits |= name.endswith(".wait") and not name.startswith(".") and not node.args
            reads_pipe = (
                isinstance(node.func, ast.Attribute)
                and node.func.attr in ("read", "readline", "readlines")
                and isinstance(node.func.value, ast.Attribute)
                and node.func.value.attr in ("stdout", "stderr")
            )
            if (waits and not has_timeout) or reads_pipe:
                found.append((node.lineno, ast.unparse(node)[:80]))
        elif (
            isinstance(node, ast.For)
            and isinstance(node.iter, ast.Attribute)
            and node.iter.attr in ("stdout", "stderr")
        ):
            found.append((node.lineno, f"for ... in {ast.unparse(node.iter)}"))
    return sorted(found)


def test_every_read_of_a_child_process_has_a_time_limit():
    problems = [
        f"{path.name}:{line}: {code}"
        for path in sorted(TESTS.glob("*.py"))
        for line, code in _unbounded_child_reads(ast.parse(path.read_text()))
    ]
    assert problems == [], (
        "read with a timeout (tests.processes.output_lines for a child's lines):\n" + "\n".join(problems)
    )


def test_the_rule_sees_unbounded_reads():
    code = textwrap.dedent("""
        done = subprocess.run(["x"], capture_output=True)
        out, _ = process.communicate()
        process.wait()
        for line in process.stdout:
            pass
        text = process.stdout.read()
        fine = subprocess.run(["x"], timeout=5)
        process.wait(timeout=5)
        threading.Event().wait()
    """)
    assert [line for line, _ in _unbounded_child_reads(ast.parse(code))] == [2, 3, 4, 5, 7]


def test_output_lines_stops_a_child_past_its_limit():
    child = subprocess.Popen(
        [sys.executable, "-c", "import signal; print('started', flush=True); signal.pause()"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    lines = []
    # a bare interpreter prints within a fraction of a second, even on a loaded machine
    with pytest.raises(AssertionError, match=r"still writing after 2 s; its output:\nstarted"):
        for line in output_lines(child, timeout_s=2):
            lines.append(line)
    assert lines == ["started\n"] and child.poll() is not None  # killed and reaped
