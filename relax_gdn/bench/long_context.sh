#!/usr/bin/env bash
# Issue 32's measurements on one H200, in device calls of at most 9.5 minutes each:
#
#   CALL=1 relax_gdn/bench/long_context.sh    the attention kernels: GPU tests at head dim 256 (fa4
#       against SDPA per CP rank, auto's choice, one step of the reduced 9B with fa4 against varlen),
#       bench.attention (varlen and fa4, each in its own process, 8k-128k) and the kernel it picks
#       (written to .gpu-cache/winner and $OUT/winner)
#   CALL=2a / ... / 2f relax_gdn/bench/long_context.sh    the full 9B, CP 1, one bench.train_e2e
#       process per row (a warm-up pass over the row's batches, then --steps 5 --skip 2), rows from
#       `python -m relax_gdn.bench.long_context rows --call 2a`: 2a 64k full recompute with varlen
#       against mixed with the winner (profiled); 2b 32k the same and selective; 2c 128k full with
#       varlen; 2d 128k mixed with the winner, then 64k full with the winner if time is left; 2e 8k
#       full recompute with varlen and with the winner, selective with the winner; 2f 64k mixed with
#       the winner in bf16 and in FP8 (tensorwise), one process (.gpu built with torchao).
#       Each row writes $OUT/e2e_<call>_<n>.json; the call ends with the targets over its rows
#       (`python -m relax_gdn.bench.long_context targets e2e_*.json` over every call's files gives
#       the ratios across calls).
#
# Run from the repository root on the GPU host with the .gpu bundle (and, for FA4, the parts of
# relax_gdn/bench/fa4_wheels.sh) carried; logs and JSON under $OUT, a short table at the end.
# Each step runs only if its time limit still fits the call's budget (BUDGET_S, default 570 s); a
# row that fails or runs out of memory ends only its own process. Caches (Triton autotuning,
# Inductor, FA4's CuTe DSL, TileLang) live in .gpu-cache/, which the machine keeps between calls
# while it stays warm (the rows of a call share them); $OUT/gpu-cache.tgz carries them to a fresh
# one when it is small enough.
# Environment: WINNER (calls 2x; default .gpu-cache/winner, else fa4 when it is installed, else
# varlen), STEPS (5), SKIP (2), GBS (2), ALLOC_CONF (PYTORCH_CUDA_ALLOC_CONF for the e2e rows).
set -uo pipefail
CALL=${CALL:-1}
OUT=${OUT:-outputs/long-context}
source "$(dirname "$0")/device_call.sh"
use_fa4
build_torch_extensions
if [[ $CALL == 1 ]]; then
  step test_attention_gpu 270 python3 -m pytest -q -s -m gpu tests/test_cp_attention_gpu.py \
    -k "(kernel_equals and 16-4-256) or host_syncs or bottom_right or auto_runs or reduced_9b"
  step bench_attention 270 python3 -m relax_gdn.bench.attention --backends varlen,fa4 --out "$OUT/attention.json"
  python3 -m relax_gdn.bench.long_context winner "$OUT/attention.json" > "$OUT/winner" 2>> "$summary"
  cp "$OUT/winner" .gpu-cache/winner
  echo; echo "== attention (fwd+bwd ms, speed-up over varlen) =="; sed -n '/^case /,$p' "$OUT/bench_attention.log"
  echo; echo "== GPU tests =="; tail -3 "$OUT/test_attention_gpu.log"
  echo; echo "attention kernel chosen for the e2e calls: $(cat "$OUT/winner")"
else
  winner=${WINNER:-$(cat .gpu-cache/winner 2>/dev/null || echo fa4)}
  if [[ $winner == fa4 && $fa4_ok == 0 ]]; then
    echo "winner fa4 is not installed here: the candidates run varlen" | tee -a "$summary"; winner=varlen
  fi
  rows=$(python3 -m relax_gdn.bench.long_context rows --call "$CALL" --winner "$winner") || exit 2
  echo "call $CALL, winner $winner, rows:"$'\n'"$rows" | tee -a "$summary"
  n=0
  while IFS=$'\t' read -r limit variant <&3; do  # one process per row: a crash or OOM ends only its own
    n=$(( n + 1 ))
    step "e2e_${CALL}_$n" "$limit" python3 -m relax_gdn.bench.train_e2e --preset qwen3_5_9b \
      --steps "${STEPS:-5}" --skip "${SKIP:-2}" --global-batch-size "${GBS:-2}" --mean-fraction 0.5 \
      --min-tokens 1024 --out "$OUT/e2e_${CALL}_$n.json" \
      ${ALLOC_CONF:+--cuda-alloc-conf "$ALLOC_CONF"} --variants "$variant"
  done 3<<< "$rows"
  echo; echo "== the 9B by micro-batch size against full recompute with varlen (issue 32 targets) =="
  python3 -m relax_gdn.bench.long_context targets "$OUT"/e2e_"${CALL}"_*.json
  echo; echo "== profiled steps (kernel seconds, idle) =="
  grep -h -A2 ": kernels [0-9]" "$OUT"/e2e_"${CALL}"_*.log | tail -6
fi
save_caches
echo; cat "$summary"
