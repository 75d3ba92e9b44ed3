# Two commands set everything up on a fresh machine (see README):
#   make run    - the main job on its embedded default (CPU if no GPU)
#   make test   - the CPU test suite (what CI runs); make test-fast leaves out the slow
#                 multi-process cases (a quick check while editing)
# Both create .venv first (Python 3.12, the pinned set in requirements.lock).

PYTHON ?= python3.12
VENV   := .venv
PY     := $(VENV)/bin/python

.PHONY: setup run lint test test-fast test-gpu gpu-check gpu-check-train bench-routes clean

$(VENV)/.installed: pyproject.toml requirements.lock
	$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 12), f"need Python >= 3.12, got {sys.version}"'
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.lock
	$(PY) -m pip install -q --no-deps -e .
	touch $@

setup: $(VENV)/.installed

# The embedded demo: the tiny Qwen3.5 on the synthetic SFT set, 2 processes with CP 2 chunkwise
# (gloo on CPU, NCCL on GPUs); the run directory under outputs/runs/ gets the resolved config,
# metrics.jsonl, a checkpoint and an offline W&B run. The command line is checked once before any
# worker starts, and relax_gdn.launch (torchrun) ends with the workers' exit code: a problem in
# ARGS or the data is one message and exit code 2.
RUN_NPROC := 2
RUN_ARGS := parallel.cp=2 gdn.cp_mode=chunkwise checkpoint.save_final=true logging.wandb.mode=offline
run: setup
	@$(PY) train.py --check --world-size $(RUN_NPROC) $(RUN_ARGS) $(ARGS)
	$(PY) -m relax_gdn.launch --standalone --nproc-per-node $(RUN_NPROC) train.py $(RUN_ARGS) $(ARGS)

# The pinned ruff (the `test` extra): lint rules and the formatter's layout, pyproject.toml's
# [tool.ruff]. Part of `make test`, so CI runs it.
LINT_PATHS := relax_gdn tests train.py hydra_plugins
lint: setup
	$(VENV)/bin/ruff check $(LINT_PATHS)
	$(VENV)/bin/ruff format --check $(LINT_PATHS)

# Two pytest-xdist workers: the slow cases mostly wait on their child processes, and each worker
# keeps its own gloo pools (tests/conftest.py).
TEST_WORKERS ?= 2
test: setup lint
	$(PY) -m pytest -q -n $(TEST_WORKERS)

# The same two workers: collection (importing torch, Megatron-Core and FLA) and the cases run on
# both cores: 45–55 s against 59–66 s in one process on the 2-core machine (docs/testing.md).
test-fast: setup
	$(PY) -m pytest -q -n $(TEST_WORKERS) -m "not slow and not gpu"

# On a GPU host (2 GPUs for the NCCL tests).
test-gpu: setup
	$(PY) -m pytest -q -m gpu

# The route-build benchmark (CPU): interval intersection vs the per-token baseline.
bench-routes: setup
	$(PY) -m relax_gdn.bench.routes

clean:
	rm -rf $(VENV) .pytest_cache

# Everything the GPU host must check before an issue is resolved, in one command (2 GPUs):
#   make gpu-check PY=python OUT=/some/dir
# Each step has its own time limit and log under $(OUT); a hang dumps every thread's stack.
OUT ?= outputs/gpu-check
# FLA autotunes each kernel per head shape and dtype (minutes on a fresh machine): the GDN test
# uses the benchmark's head shapes and TRITON_CACHE_AUTOTUNING keeps the results for later steps.
GPU_STEP = RELAX_GDN_HANG_DUMP_S=$(1) TRITON_PRINT_AUTOTUNING=1 TRITON_CACHE_AUTOTUNING=1 timeout $$(( $(1) + 15 )) $(2) > $(OUT)/$(3).txt 2>&1; echo "$(3): exit $$?" | tee -a $(OUT)/summary.txt
gpu-check:
	mkdir -p $(OUT)
	-$(call GPU_STEP,45,$(PY) -m pytest -q -s -m gpu tests/test_layout_gpu.py,test_layout_gpu)
	-$(call GPU_STEP,45,$(PY) -m torch.distributed.run --nproc-per-node 2 -m relax_gdn.bench.swap,bench_swap)
	-$(call GPU_STEP,600,$(PY) -m pytest -q -s -m gpu tests/test_gdn_layer_gpu.py,test_gdn_layer_gpu)
	-$(call GPU_STEP,600,$(PY) -m torch.distributed.run --nproc-per-node 2 -m relax_gdn.bench.gdn_layer,bench_gdn_layer)
	-$(call GPU_STEP,120,$(PY) -m relax_gdn.bench.gdn_precision,bench_gdn_precision)
	-$(call GPU_STEP,70,$(PY) -m pytest -q -s -m gpu tests/test_cp_attention_gpu.py,test_cp_attention_gpu)
	cat $(OUT)/summary.txt

# The model and the training loop on 2 GPUs: reduced 9B CP 2 vs CP 1 in every mode, dynamic vs
# static CP 2 in bf16, resume, async checkpoint save at CP 2 resumed at CP 1 (save times printed),
# the Hugging Face export on the GPU host (drop-in, fp32 main parameters), the MTP layer in bf16 on one
# GPU, and training throughput of the CP variants side by side.
gpu-check-train:
	mkdir -p $(OUT)
	-$(call GPU_STEP,200,$(PY) -m pytest -q -s -m gpu tests/test_qwen3_5_model_gpu.py,test_qwen3_5_model_gpu)
	-$(call GPU_STEP,220,$(PY) -m pytest -q -s -m gpu tests/test_train_gpu.py,test_train_gpu)
	-$(call GPU_STEP,300,$(PY) -m pytest -q -s -m gpu tests/test_checkpoint_gpu.py,test_checkpoint_gpu)
	-$(call GPU_STEP,900,$(PY) -m pytest -q -s -m gpu tests/test_hf_export_gpu.py,test_hf_export_gpu)
	-$(call GPU_STEP,300,$(PY) -m pytest -q -s -m gpu tests/test_mtp_gpu.py,test_mtp_gpu)
	-$(call GPU_STEP,300,$(PY) -m torch.distributed.run --nproc-per-node 2 -m relax_gdn.bench.train_e2e --variants "static:chunkwise;dynamic:chunkwise;static:headwise" --out $(OUT)/bench_train_e2e.json $(BENCH_TRAIN_ARGS),bench_train_e2e)
	cat $(OUT)/summary.txt
