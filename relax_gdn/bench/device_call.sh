# Sourced by the device-call scripts (long_context.sh, fp8.sh, peers.sh): one call of at most BUDGET_S seconds
# on the GPU host, run from the repository root with the .gpu bundle carried. Sets OUT, the caches
# (Triton autotuning, Inductor, TileLang, FA4's CuTe DSL in .gpu-cache/, which a warm machine keeps
# between calls) and the environment every step needs; `step NAME LIMIT_S COMMAND...` runs a step only
# while its limit still fits the budget, its log in $OUT/NAME.log and one line in $OUT/summary.txt;
# `use_fa4` makes FlashAttention-4 importable where its parts were carried; `build_torch_extensions`
# builds Megatron-Core's C++ extension before the timed steps; `save_caches` packs .gpu-cache for a
# fresh machine when small enough.
BUDGET_S=${BUDGET_S:-570}
mkdir -p "$OUT" .gpu-cache
start=$SECONDS
summary="$OUT/summary.txt"

left() { echo $(( BUDGET_S - (SECONDS - start) )); }

step() {  # step NAME LIMIT_S COMMAND...: runs when LIMIT_S still fits, log in $OUT/NAME.log
  local name=$1 limit=$2 t0=$SECONDS rc; shift 2
  if (( limit < 30 || $(left) < limit )); then
    echo "$name: skipped, $(left) s left of the budget, needs $limit" | tee -a "$summary"; return 0
  fi
  timeout --signal=INT --kill-after=15 "$limit" "$@" > "$OUT/$name.log" 2>&1; rc=$?
  echo "$name: exit $rc after $(( SECONDS - t0 )) s" | tee -a "$summary"
  return 0
}

use_fa4() {  # FlashAttention-4 importable where its parts were carried (relax_gdn/bench/fa4_wheels.sh): fa4_ok=1
  local log=${TMPDIR:-/tmp}/fa4_install.log  # not under $OUT: a call returns a limited number of files
  fa4_ok=0
  if relax_gdn/bench/fa4_wheels.sh install > "$log" 2>&1; then
    eval "$(relax_gdn/bench/fa4_wheels.sh env)"
    fa4_ok=1
    echo "fa4: $(tail -1 "$log")" | tee -a "$summary"
  else
    echo "fa4: not installed ($(tail -1 "$log")); the attention kernel is the next one available" | tee -a "$summary"
  fi
}

build_torch_extensions() {  # Megatron-Core's share_storage C++ extension (mlp_act), before any timed step
  # on a fresh host its build took over a minute inside step 1, which ended every 80 s curve run of a
  # call; kept in .gpu-cache/torch_extensions, a warm machine (or a carried cache) loads it in seconds
  step torch_extensions 240 python3 -c "import logging; logging.basicConfig(level=logging.INFO)
from relax_gdn.compat.share_storage import build_share_storage; build_share_storage()"
}

save_caches() {  # the caches for a fresh machine (unpack into the repository root and carry .gpu-cache)
  du -sh .gpu-cache 2>/dev/null | tee -a "$summary"
  # Triton's autotuning choices alone, kilobytes: small enough to carry beside .gpu, they spare a fresh
  # machine the timing of every config of every tuned kernel (it compiles the chosen one only)
  find .gpu-cache/triton -name '*.autotune.json' -print0 2>/dev/null | tar -czf "$OUT/gpu-autotune.tgz" --null -T -
  tar -czf "$OUT/gpu-cache.tgz" --exclude=winner .gpu-cache 2>/dev/null
  if (( $(stat -c %s "$OUT/gpu-cache.tgz") > 60 * 1024 * 1024 )); then rm -f "$OUT/gpu-cache.tgz"; fi
}

[[ -f .gpu/activate.sh ]] && source .gpu/activate.sh
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
# one Triton cache per GPU model: an autotuning choice is keyed by the architecture (sm_90 for H100 and
# H200 alike), not the card, and one timed on an H100 must not pick an H200 benchmark's kernels
gpu_model=$(nvidia-smi --query-gpu=name --format=csv,noheader -i 0 2>/dev/null | tr -cs 'A-Za-z0-9' '_')
# the first GPU's memory in whole GiB, for the scripts that size their work to it (empty without a GPU)
gpu_gib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits -i 0 2>/dev/null)
gpu_gib=${gpu_gib:+$(( gpu_gib / 1024 ))}
export TRITON_CACHE_DIR=$PWD/.gpu-cache/triton/${gpu_model%_} TRITON_CACHE_AUTOTUNING=1
export TORCHINDUCTOR_CACHE_DIR=$PWD/.gpu-cache/inductor TILELANG_CACHE_DIR=$PWD/.gpu-cache/tilelang
export FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1 FLASH_ATTENTION_CUTE_DSL_CACHE_DIR=$PWD/.gpu-cache/fa4
export TORCH_EXTENSIONS_DIR=$PWD/.gpu-cache/torch_extensions
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$OUT/gpu.txt" 2>&1
git log -1 --format='commit %h %s' > "$OUT/commit.txt" 2>/dev/null
