# Two commands set everything up on a fresh machine (see README):
#   make run    - the main job on its embedded default (CPU if no GPU)
#   make test   - the CPU test suite
# Both create .venv first (Python 3.12, the pinned set in requirements.lock).

PYTHON ?= python3.12
VENV   := .venv
PY     := $(VENV)/bin/python

.PHONY: setup run test test-gpu bench-routes clean

$(VENV)/.installed: pyproject.toml requirements.lock
	$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 12), f"need Python >= 3.12, got {sys.version}"'
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.lock
	$(PY) -m pip install -q --no-deps -e .
	touch $@

setup: $(VENV)/.installed

# Until train.py lands (issue 5), the main job is the route benchmark.
run: setup
	$(PY) -m relax_gdn.bench.routes

test: setup
	$(PY) -m pytest -q

# On a GPU host (2 GPUs for the NCCL tests).
test-gpu: setup
	$(PY) -m pytest -q -m gpu

bench-routes: run

clean:
	rm -rf $(VENV) .pytest_cache
