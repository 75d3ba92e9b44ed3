#!/usr/bin/env bash
# FP8 against bf16 on one H200 (docs/fp8.md, docs/benchmarks.md "FP8"), in device calls of at most
# 9.5 minutes each, from the repository root on the GPU host with the .gpu bundle carried (built with
# EXTRA including torchao==0.18.0, docs/gpu.md):
#
#   CALL=1 relax_gdn/bench/fp8.sh   the FP8 GPU tests without the reduced 9B, bench.gemm (the 9B's linear
#       layers, bf16 vs each recipe; the call stops where it fails), the full 9B at 8k tokens (one
#       bench.train_e2e process per table: selective recompute bf16 / tensorwise (profiled), full
#       recompute bf16 / tensorwise), the reduced 9B's GPU test in tensorwise
#   CALL=2 relax_gdn/bench/fp8.sh   LoRA r16 + Adam bf16 / RECIPE, selective bf16 / rowwise_gw_hp, the
#       reduced 9B's loss curves (bf16 and RECIPE, seed 1)
#   CALL=3 relax_gdn/bench/fp8.sh   the reduced 9B's loss curves, seed 2, and the comparison of both seeds
#
# Environment: RECIPE (the recipe the loss curves and the LoRA row use; tensorwise), PRESET (qwen3_5_9b;
# qwen3_5_tiny checks the script on a CPU machine), STEPS (5), SKIP (2), GBS (8), CURVE_STEPS (150),
# CURVE_ARGS (model=qwen3_5_9b_reduced train=h200; model=tiny train=cpu_demo on a CPU machine), LIGHT
# (recompute=selective; recompute=mixed on an 80 GB H100).
set -uo pipefail
CALL=${CALL:-1}
OUT=${OUT:-outputs/fp8}
source "$(dirname "$0")/device_call.sh"
RECIPE=${RECIPE:-tensorwise}
# the lighter recompute of the tables: selective on an H200; on an 80 GB H100, where selective does not
# fit the 9B at 8k, mixed with the memory model's fewest whole layers
LIGHT=${LIGHT:-recompute=selective}
PRESET=${PRESET:-qwen3_5_9b}
E2E=(python3 -m relax_gdn.bench.train_e2e --preset "$PRESET" --max-tokens-per-gpu 8192
     --global-batch-size "${GBS:-8}" --steps "${STEPS:-5}" --skip "${SKIP:-2}")

curves() {  # curves SEED: the reduced 9B, CURVE_STEPS steps, bf16 and RECIPE (one job each)
  local seed=$1
  for recipe in null "$RECIPE"; do
    step "curve_${recipe}_seed$seed" 150 python3 train.py hydra.run.dir="$OUT/curves/${recipe}_seed$seed" \
      ${CURVE_ARGS:-model=qwen3_5_9b_reduced train=h200} train.steps="${CURVE_STEPS:-150}" train.global_batch_size=8 \
      data.max_sample_tokens=2048 data.num_samples=2048 optim.lr=2e-4 optim.min_lr=2e-5 recompute=selective \
      logging.wandb.mode=disabled logging.console=false model.fp8.recipe="$recipe" train.seed="$seed"
  done
}

case $CALL in
  1)
    step test_fp8_gpu 70 python3 -m pytest -q -s -m gpu tests/test_fp8_gpu.py -k "not reduced_9b"
    step bench_gemm 130 python3 -m relax_gdn.bench.gemm --out "$OUT/gemm.json"
    if ! grep -q "x bf16" "$OUT/bench_gemm.log"; then  # the FP8 path does not run here: the rest would not
      tail -30 "$OUT/bench_gemm.log"; save_caches; cat "$summary"; exit 1
    fi
    step e2e_selective 170 "${E2E[@]}" --out "$OUT/e2e_selective.json" --variants \
      "$LIGHT;$LIGHT,fp8=tensorwise,profile"
    step e2e_full 120 "${E2E[@]}" --out "$OUT/e2e_full.json" --variants "recompute=full;recompute=full,fp8=tensorwise"
    step test_fp8_gpu_9b 70 python3 -m pytest -q -s -m gpu tests/test_fp8_gpu.py -k "tensorwise-selective"
    echo; echo "== GEMMs =="; sed -n '/^layer /,$p' "$OUT/bench_gemm.log"
    for t in selective full; do echo; echo "== $t =="; sed -n '/^qwen3_5/,$p' "$OUT/e2e_$t.log"; done
    echo; echo "== GPU tests =="; tail -3 "$OUT/test_fp8_gpu.log" "$OUT/test_fp8_gpu_9b.log" ;;
  2)
    step e2e_lora 150 "${E2E[@]}" --optimizer adam --out "$OUT/e2e_lora.json" --variants \
      "model.lora.rank=16;model.lora.rank=16,fp8=$RECIPE"
    step e2e_gw_hp 150 "${E2E[@]}" --out "$OUT/e2e_gw_hp.json" --variants \
      "recompute=selective;recompute=selective,fp8=rowwise_gw_hp"
    curves 1
    for t in lora gw_hp; do echo; echo "== $t =="; sed -n '/^qwen3_5/,$p' "$OUT/e2e_$t.log"; done ;;
  3)
    curves 2
    python3 -m relax_gdn.compare "$OUT/curves" --baseline model.fp8.recipe=null > "$OUT/compare.log" 2>&1
    echo; tail -30 "$OUT/compare.log" ;;
esac
save_caches
echo; cat "$summary"
