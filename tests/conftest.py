"""What every test module shares: the session's gloo pools (fixture ``gloo``) and the collection
hook that marks every test that starts a process ``slow``.

The shared builders live in modules the spawned ranks can import too: ``tests/helpers.py``
(configs, ``python train.py`` runs), ``tests/model_harness.py`` (the tiny Qwen3.5 on process
groups), ``tests/gdn_harness.py`` (one GDN layer).
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import subprocess
import types

import pytest

# One compute thread per pytest process: `make test` runs two workers on two cores and the cases'
# tensors are small, so a second thread per worker only contends (docs/testing.md has the timings).
# The processes the cases start get the same from child_env and the pools.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# A fixture that starts processes: a test that uses it (directly or through other fixtures) is slow.
PROCESS_FIXTURES = frozenset({"gloo", "gloo_once", "short_train_py"})
# What starts a process when a test, one of its fixtures, or a tests/ function they call uses it:
# names as written in the code (also in function-local imports) and the modules behind them.
PROCESS_NAMES = frozenset(
    {"subprocess", "Popen", "multiprocessing", "run_distributed", "RankPool", "RankPools"}
)
PROCESS_MODULES = ("subprocess", "multiprocessing", "torch.multiprocessing", "pty")


@pytest.fixture
def runtime():
    """An installed :class:`relax_gdn.runtime.Runtime` for a test that runs an entry point's work in
    the pytest process (``run_training`` on CPU, a model build that needs the CPU shims), closed
    after the test so no shim, filter or patch reaches a later test."""
    from relax_gdn.runtime import Runtime

    with Runtime() as installed:
        yield installed


@pytest.fixture(scope="session")
def gloo():
    """``gloo(fn, world_size, *args, timeout_s=None, runtime=True)``: ``fn(*args)`` on every rank of
    the session's pool of ``world_size`` gloo processes (started at its first job, kept for the
    session), inside a Runtime unless ``runtime=False``; a list of each rank's result. Same
    guarantees as ``run_distributed``: see tests/distributed.py."""
    from tests.distributed import RankPools

    pools = RankPools()
    yield pools.run
    pools.close()


@pytest.fixture(scope="module")
def gloo_once(gloo):
    """``gloo_once(fn, world_size, *args)``: like ``gloo``, but each distinct call runs once per test
    module; a later call gets the first one's results, or its failure again (a case that several
    tests read fails each of them, and only them). ``args`` must be hashable."""
    outcomes: dict = {}

    def run(fn, world_size: int, *args, runtime: bool = True):
        key = (fn, world_size, args, runtime)
        if key not in outcomes:
            try:
                outcomes[key] = (True, gloo(fn, world_size, *args, runtime=runtime))
            except AssertionError as failure:
                outcomes[key] = (False, str(failure))
        succeeded, value = outcomes[key]
        if not succeeded:
            raise AssertionError(f"{fn.__name__}{args!r} on {world_size} ranks failed:\n{value}")
        return value

    return run


# Short ``python train.py`` runs as a user starts them, each read by several tests (a child's imports
# cost more than its training): name -> overrides ("{dir}": the run's own directory).
SHORT_TRAIN_PY_RUNS = {
    # also the first export of tests/test_hf_export.py's round trip (export_hf_final) and the
    # checkpoint tests/test_checkpoint_lifecycle.py damages (step 3)
    "3 steps": (
        "train.steps=3",
        "train.global_batch_size=4",
        "data.num_samples=64",
        "data.synthetic_max_steps=1",
        "run_name=entry-test",
        "logging.profile_steps=[2,2]",
        "checkpoint.save_final=true",
        "checkpoint.export_hf_final=true",
    ),
    # the demo defaults on a .jsonl file with one record too long for them
    "1 step on jsonl, third-party notices": (
        "train.steps=1",
        "data=jsonl",
        "data.path={dir}/train.jsonl",
        "logging.show_third_party_warnings=true",
    ),
}


def _jsonl_with_one_record_too_long() -> str:
    records = [{"problem": f"What is {i} + {i}?", "generated_solution": f"{2 * i}"} for i in range(20)]
    records.append({"problem": "Repeat x.", "generated_solution": "x" * 3000})  # > 2048 byte tokens
    return "".join(json.dumps(r) + "\n" for r in records)


# the files a run reads, written into its directory first: name -> {file name: its text}
SHORT_TRAIN_PY_FILES = {
    "1 step on jsonl, third-party notices": {"train.jsonl": _jsonl_with_one_record_too_long()}
}


@pytest.fixture(scope="session")
def short_train_py(tmp_path_factory):
    """``short_train_py(name)``: the run ``SHORT_TRAIN_PY_RUNS[name]`` (started when first asked for,
    once per session: under pytest-xdist the workers share it through a lock file in their common
    temporary directory, the first to ask runs it) as ``(CompletedProcess, its run directory, the
    package's .jsonl/.yaml files before it, after it)``."""
    from tests.helpers import ROOT, train_py

    def package_files() -> list[str]:
        return sorted(p.name for p in (ROOT / "relax_gdn").rglob("*") if p.suffix in (".jsonl", ".yaml"))

    # pytest-xdist: each worker's basetemp is popen-gw<N> inside the run's one temporary directory
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    runs: dict = {}

    def run(name: str):
        if name not in runs:
            slug = re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")
            tmp, outcome = shared / f"train_py_{slug}", shared / f"train_py_{slug}.json"
            with open(shared / f"train_py_{slug}.lock", "w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes (or its process ends)
                if not outcome.exists():
                    shutil.rmtree(tmp, ignore_errors=True)  # what a worker that died in the run left
                    tmp.mkdir()
                    for file, text in SHORT_TRAIN_PY_FILES.get(name, {}).items():
                        (tmp / file).write_text(text)
                    before = package_files()
                    done = train_py(tmp, *(o.format(dir=tmp) for o in SHORT_TRAIN_PY_RUNS[name]))
                    saved = dict(
                        args=done.args, returncode=done.returncode, stdout=done.stdout, stderr=done.stderr
                    )
                    outcome.write_text(json.dumps(dict(done=saved, before=before, after=package_files())))
                read = json.loads(outcome.read_text())
            done = subprocess.CompletedProcess(**read["done"])
            runs[name] = (done, tmp / "run", read["before"], read["after"])
        return runs[name]

    return run


def _code_objects(code: types.CodeType):
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _code_objects(const)


def _starts_process_itself(obj: object) -> bool:
    if isinstance(obj, types.ModuleType):
        return obj.__name__.startswith(PROCESS_MODULES)
    module = getattr(obj, "__module__", None) or ""
    return module.startswith(PROCESS_MODULES) or getattr(obj, "__name__", None) in PROCESS_NAMES


def _is_a_test_suite_function(target: object, caller: types.FunctionType) -> bool:
    """A function of the caller's module or of the tests package (not one of a library's)."""
    if not isinstance(target, types.FunctionType):
        return False
    return target.__module__ == caller.__module__ or target.__module__.partition(".")[0] == "tests"


def reaches_a_process_start(fn: types.FunctionType, seen: set | None = None) -> bool:
    """Whether ``fn`` (its nested functions included) names a process starter, or calls a function
    of tests/ that does."""
    seen = set() if seen is None else seen
    if fn in seen:
        return False
    seen.add(fn)
    for code in _code_objects(fn.__code__):
        if PROCESS_NAMES.intersection(code.co_names):
            return True
        for name in code.co_names:
            target = fn.__globals__.get(name)
            if target is None:
                continue
            if _starts_process_itself(target):
                return True
            if _is_a_test_suite_function(target, fn) and reaches_a_process_start(target, seen):
                return True
    return False


def starts_process(item: pytest.Item) -> bool:
    """A test that uses a process fixture, or whose function or fixtures reach a process start."""
    if PROCESS_FIXTURES.intersection(getattr(item, "fixturenames", ())):
        return True
    functions = [getattr(item, "function", None)]
    info = getattr(item, "_fixtureinfo", None)
    for definitions in info.name2fixturedefs.values() if info else ():
        functions.extend(d.func for d in definitions)
    return any(isinstance(f, types.FunctionType) and _reaches(f) for f in functions)


_answers: dict[types.FunctionType, bool] = {}


def _reaches(fn: types.FunctionType) -> bool:
    if fn not in _answers:
        _answers[fn] = reaches_a_process_start(fn)
    return _answers[fn]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Every test that starts a process (a gloo group, ``train.py``, torchrun, a sweep) is ``slow``:
    ``make test-fast`` leaves it out. Marked here so that a new one cannot be forgotten."""
    for item in items:
        if not item.get_closest_marker("slow") and starts_process(item):
            item.add_marker(pytest.mark.slow)
