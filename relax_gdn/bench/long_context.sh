#!/usr/bin/env bash
# Issue 32's measurements on one H200, in two device calls of at most 9.5 minutes each:
#
#   CALL=1 relax_gdn/bench/long_context.sh   the attention kernels (GPU parity tests at head dim 256,
#       bench.attention: check + fwd/bwd timing at 8k-128k), the host's packing (bench.batching),
#       and the choice of the attention kernel (written to .gpu-cache/winner and $OUT/winner)
#   CALL=2 relax_gdn/bench/long_context.sh   the full 9B, CP 1, bench.train_e2e: per micro-batch size
#       (64k, 32k, 128k, 8k) full recompute with varlen against mixed recompute with the winner
#       (32k selective: the memory model's refusal), the 64k candidate profiled, then the targets
#
# Run from the repository root on the GPU host with the .gpu bundle (and, for FA4, the parts of
# relax_gdn/bench/fa4_wheels.sh) carried; logs and JSON under $OUT, a short table at the end.
# Each step runs only if it fits the call's budget (BUDGET_S, default 570 s) and has its own limit.
# Caches (Triton autotuning, Inductor, FA4's CuTe DSL, TileLang) live in .gpu-cache/, which the
# machine keeps between calls while it stays warm; $OUT/gpu-cache.tgz carries them to a fresh one
# (unpack it into the repository root before the next call and carry .gpu-cache).
# Environment: WINNER (call 2; default .gpu-cache/winner, else varlen), STEPS (3), SKIP (1),
# GBS (2), LENGTHS (65536,32768,131072,8192), ALLOC_CONF (PYTORCH_CUDA_ALLOC_CONF for the e2e run).
set -uo pipefail
CALL=${CALL:-1}
OUT=${OUT:-outputs/long-context}
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

[[ -f .gpu/activate.sh ]] && source .gpu/activate.sh
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
export TRITON_CACHE_DIR=$PWD/.gpu-cache/triton TRITON_CACHE_AUTOTUNING=1
export TORCHINDUCTOR_CACHE_DIR=$PWD/.gpu-cache/inductor TILELANG_CACHE_DIR=$PWD/.gpu-cache/tilelang
export FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1 FLASH_ATTENTION_CUTE_DSL_CACHE_DIR=$PWD/.gpu-cache/fa4
if relax_gdn/bench/fa4_wheels.sh install > "$OUT/fa4_install.log" 2>&1; then
  eval "$(relax_gdn/bench/fa4_wheels.sh env)"
  echo "fa4: $(tail -1 "$OUT/fa4_install.log")" | tee -a "$summary"
else
  echo "fa4: not installed ($(tail -1 "$OUT/fa4_install.log")); bench.attention reports it unavailable" | tee -a "$summary"
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$OUT/gpu.txt" 2>&1
git log -1 --format='commit %h %s' > "$OUT/commit.txt" 2>/dev/null

if [[ $CALL == 1 ]]; then
  step test_attention_gpu 150 python3 -m pytest -q -s -m gpu tests/test_cp_attention_gpu.py \
    -k "(kernel_equals and 16-4-256) or host_syncs or bottom_right"
  step bench_attention 270 python3 -m relax_gdn.bench.attention --out "$OUT/attention.json"
  step bench_batching 90 python3 -m relax_gdn.bench.batching --cp 1,2 --repeats 5
  python3 -m relax_gdn.bench.long_context winner "$OUT/attention.json" > "$OUT/winner" 2>> "$summary"
  cp "$OUT/winner" .gpu-cache/winner
  echo; echo "== attention (fwd+bwd ms, speed-up over varlen) =="; sed -n '/^case /,$p' "$OUT/bench_attention.log"
  echo; echo "== host packing per micro-batch (ms) =="; grep -v -i warn "$OUT/bench_batching.log" | tail -9
  echo; echo "== GPU tests =="; tail -3 "$OUT/test_attention_gpu.log"
  echo; echo "attention kernel chosen for call 2: $(cat "$OUT/winner")"
else
  winner=${WINNER:-$(cat .gpu-cache/winner 2>/dev/null || echo varlen)}
  variants=$(python3 -m relax_gdn.bench.long_context variants --winner "$winner" \
             --lengths "${LENGTHS:-65536,32768,131072,8192}")
  echo "winner $winner; variants: $variants" | tee -a "$summary"
  # the e2e run gets what is left minus the summary's time; it writes its JSON after every variant
  step bench_train_e2e $(( $(left) - 25 )) python3 -m relax_gdn.bench.train_e2e --preset qwen3_5_9b \
    --steps "${STEPS:-3}" --skip "${SKIP:-1}" --global-batch-size "${GBS:-2}" --mean-fraction 0.5 \
    --min-tokens 1024 --no-warm-up-pass --out "$OUT/e2e.json" \
    ${ALLOC_CONF:+--cuda-alloc-conf "$ALLOC_CONF"} --variants "$variants"
  echo; echo "== the 9B by micro-batch size against full recompute with varlen (issue 32 targets) =="
  python3 -m relax_gdn.bench.long_context targets "$OUT/e2e.json"
  echo; echo "== the profiled step (kernel seconds, idle) =="
  grep -A2 ": kernels [0-9]" "$OUT/bench_train_e2e.log" | tail -6
fi
du -sh .gpu-cache 2>/dev/null | tee -a "$summary"
tar -czf "$OUT/gpu-cache.tgz" --exclude=winner .gpu-cache 2>/dev/null
if (( $(stat -c %s "$OUT/gpu-cache.tgz") > 60 * 1024 * 1024 )); then rm -f "$OUT/gpu-cache.tgz"; fi
echo; cat "$summary"
