#!/usr/bin/env bash
# Every one-GPU test (`pytest -m gpu`) in two device calls of at most 9.5 minutes (five on an 80 GB
# card: STREAMS below), from the repository root on the GPU host (docs/gpu.md). The test files run in
# parallel pytest processes ("streams"): much of a GPU test's time is Triton tuning, compiles and model
# building on the host's 16 cores, which overlap another stream's kernels; the 2-GPU cases skip.
# Nothing here is timed.
#
#   CALL=1 relax_gdn/bench/gpu_suite.sh   .gpu carried: every GPU test file but LoRA and the HF export,
#       three streams (the checkpoint resumes; the trainer, safety, MTP and layout cases; the kernels)
#   CALL=2 relax_gdn/bench/gpu_suite.sh   .gpu-hf carried as well (a later call of the same machine):
#       tests/test_lora_gpu.py and tests/test_hf_export_gpu.py, two streams
#   STREAMS="NAME ..." runs only those streams of the call. A card under 100 GiB holds one stream at a
#       time (each holds a reduced 9B at times, LoRA's the full 9B): there the call refuses more than
#       one in a second, and each stream gets a call of its own
#   CALL=3 OLD=DIR relax_gdn/bench/gpu_suite.sh   the 9B at 8k under full recompute (benchmarks.md's first
#       table on an 80 GB card), the tree in DIR (`git archive COMMIT | tar -x -C DIR`) and this one,
#       one process each, in the order old, new, old: the new tree's tok/s against the mean of the two
#       old runs, and the old runs against each other (the spread of the measurement)
#
# Each stream's log is $OUT/<stream>.log; the last lines are each stream's pytest summary.
set -uo pipefail
CALL=${CALL:-1}
OUT=${OUT:-outputs/gpu_suite}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)  # absolute: CALL=3 runs the old tree from its own directory
source "$(dirname "$0")/device_call.sh"
export RELAX_GDN_TEST_TIMEOUT_S=${RELAX_GDN_TEST_TIMEOUT_S:-400}
LIMIT=$(( BUDGET_S - 20 ))

stream() {  # stream NAME FILE...: one pytest process over FILEs, in the background
  local name=$1; shift
  step "$name" "$LIMIT" python3 -m pytest -q -rA -p no:cacheprovider -m gpu --durations=0 "$@" &
}

# the streams of CALL=1 and CALL=2: name -> its test files
declare -A STREAM_FILES=(
  [checkpoint]="tests/test_checkpoint_gpu.py"
  [trainer]="tests/test_train_gpu.py tests/test_train_memory_gpu.py tests/test_run_safety.py tests/test_mtp_gpu.py
    tests/test_qwen3_5_model_gpu.py tests/test_host_sync_counter.py tests/test_layout_gpu.py tests/test_fla_zigzag_gpu.py"
  [kernels]="tests/test_fusion_gpu.py tests/test_gdn_layer_gpu.py tests/test_cp_attention_gpu.py tests/test_fp8_gpu.py"
  [lora]="tests/test_lora_gpu.py"
  [hf_export]="tests/test_hf_export_gpu.py"
)

streams() {  # streams DEFAULT_NAMES...: the call's streams ($STREAMS, else these) in parallel
  local names name
  read -ra names <<< "${STREAMS:-$*}"
  for name in "${names[@]}"; do
    [[ " $* " == *" $name "* ]] || { echo "STREAMS: CALL=$CALL has no stream $name (its streams: $*)" >&2; exit 2; }
  done
  if (( ${#names[@]} > 1 && ${gpu_gib:-0} < 100 )); then
    echo "CALL=$CALL: this GPU has $gpu_gib GiB, too little for the streams ${names[*]} at once (each holds" \
      "a reduced or the full 9B at times): run one per call, STREAMS=${names[0]} and so on" >&2
    exit 2
  fi
  build_torch_extensions  # once, before the streams that would each wait on its build
  for name in "${names[@]}"; do
    # shellcheck disable=SC2086  # the stream's files, one word each
    stream "$name" ${STREAM_FILES[$name]}
  done
  wait
}

case $CALL in
  1) streams checkpoint trainer kernels ;;
  2) source .gpu-hf/activate.sh; streams lora hf_export ;;
  3)
    e2e=(python3 -m relax_gdn.bench.train_e2e --preset qwen3_5_9b --max-tokens-per-gpu 8192
         --global-batch-size 4 --steps 4 --skip 1 --variants recompute=full)
    (cd "$OLD" && PYTHONPATH=$PWD:$PYTHONPATH step old_1 150 "${e2e[@]}" --out "$OUT/old_1.json")
    step new 150 "${e2e[@]}" --out "$OUT/new.json"
    (cd "$OLD" && PYTHONPATH=$PWD:$PYTHONPATH step old_2 150 "${e2e[@]}" --out "$OUT/old_2.json")
    for name in old_1 new old_2; do echo "== $name"; sed -n '/^qwen3_5/,$p' "$OUT/$name.log"; done ;;
esac
for log in "$OUT"/*.log; do echo "== $log"; tail -n 2 "$log"; done
save_caches
echo; cat "$summary"
