"""tests/conftest.py marks every test that starts a process ``slow`` at collection: through the pool
fixture, ``run_distributed``, ``subprocess`` or ``multiprocessing``, in the test, in a fixture it
uses, or in a tests/ function either calls; a test that starts none stays unmarked."""

from __future__ import annotations

import textwrap

pytest_plugins = ["pytester"]

SAMPLE = '''
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
'''


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

