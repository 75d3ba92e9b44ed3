#!/usr/bin/env bash
# FP8 against bf16 on one GPU (docs/fp8.md, docs/benchmarks.md "FP8 on one GPU"), in device calls of at
# most 9.5 minutes each, from the repository root on the GPU host with the .gpu bundle carried (built
# with EXTRA including torchao==0.18.0, docs/gpu.md):
#
#   CALL=1 relax_gdn/bench/fp8.sh   the FP8 GPU tests without the reduced 9B, bench.gemm (the 9B's linear
#       layers, bf16 vs each recipe; the call stops where it fails), the full 9B at 8k tokens (one
#       bench.train_e2e process per table: full recompute bf16 / tensorwise, LIGHT bf16 / tensorwise
#       (profiled)), the reduced 9B's GPU test in tensorwise
#   CALL=2 relax_gdn/bench/fp8.sh   LoRA r16 + Adam bf16 / RECIPE, the reduced 9B's loss curves (bf16 and
#       RECIPE, seeds 1 and 2; packed into $OUT/curves.tgz) and relax_gdn.compare over them
#   CALL=3 relax_gdn/bench/fp8.sh   LIGHT bf16 / rowwise / rowwise_gw_hp
#   CALL=4 relax_gdn/bench/fp8.sh   where FP8 starts to pay: full recompute bf16 / RECIPE with every
#       micro-batch one sample of 2k, 4k and 8k tokens (32k tokens per step; one process per length)
#   CALL=5 relax_gdn/bench/fp8.sh   two GPUs of one host (2 x H200: full fine-tuning of the 9B with Adam
#       needs ≈ 201 GiB on one): the 9B, NINE_B_STEPS steps on the distributed optimizer, bf16 and
#       RECIPE, and relax_gdn.compare over the two runs
#   CALL=6 relax_gdn/bench/fp8.sh   one GPU: the 9B with LoRA r16 (every linear's GEMMs run, only the
#       adapters train), NINE_B_STEPS steps of 4 samples with Adam, bf16 and RECIPE, and relax_gdn.compare
#   CALL=7 relax_gdn/bench/fp8.sh   the GPU tests of a step's first weight gradient written into main_grad
#       and of no host sync, then LIGHT bf16 / tensorwise / tensorwise with the 4,096 -> 4,096 projections
#       in bf16 (model.fp8.bf16_modules=BF16_MODULES: slower in FP8 in bench.gemm), one process
#   CALL=8 relax_gdn/bench/fp8.sh   the GPU tests of frozen weights kept in host memory, then LoRA r16 + Adam,
#       no recompute, bf16 / RECIPE, both profiled (the kernel split says where FP8 LoRA's time goes on
#       packed micro-batches), one process
#   CALL=9 relax_gdn/bench/fp8.sh   the reduced 9B's loss curves in bf16, rowwise and rowwise_gw_hp, seeds 1
#       and 2 (packed into $OUT/curves.tgz), and relax_gdn.compare over them
#   CALL=10 relax_gdn/bench/fp8.sh  the issue's one-GPU rows in one call: the GPU tests of frozen weights kept
#       in host memory, then LoRA r16 + Adam (no recompute) bf16 / RECIPE, then LIGHT bf16 / RECIPE
#   CALL=11 relax_gdn/bench/fp8.sh  the reduced 9B's loss curves alone (fits an 80 GB card): bf16 and each of
#       CURVE_RECIPES, seeds 1 and 2, and relax_gdn.compare, whose same-seed verdict reads each pair; 100 s
#       a run, for a fresh machine's first (Triton compiles FLA's kernels)
#   CALL=12 relax_gdn/bench/fp8.sh  what needs an H200 in the least time: LIGHT bf16 / RECIPE (the issue's
#       selective row), then the reduced 9B's loss curves in bf16 and RECIPE, seeds 1 and 2, and
#       relax_gdn.compare
#
# Environment: RECIPE (the recipe of the loss curves and the LoRA row; tensorwise), PRESET (qwen3_5_9b;
# qwen3_5_tiny checks the script on a CPU machine), STEPS (4), SKIP (1), GBS (4), CURVE_STEPS (150),
# CURVE_ARGS (model=qwen3_5_9b_reduced train=h200; model=tiny train=cpu_demo on a CPU machine), LIGHT
# (recompute=selective; recompute=mixed on a card under 100 GiB, where selective does not fit the 9B at 8k),
# CURVE_RECIPES (CALL=11: tensorwise), LORA (the LoRA rows' recompute: recompute=full, which
# fits both cards), NINE_B_STEPS (50), NINE_B_ARGS
# (model=qwen3_5_9b train=h200; model=tiny train=cpu_demo on a CPU machine), BF16_MODULES
# ([output_layer,*.out_proj,*.linear_proj]).
set -uo pipefail
CALL=${CALL:-1}
OUT=${OUT:-outputs/fp8}
source "$(dirname "$0")/device_call.sh"
build_torch_extensions
RECIPE=${RECIPE:-tensorwise}
# selective recompute keeps 85 GiB of the 9B at 8k: an 80 GB card runs the lightest form that fits it
if [[ -n $gpu_gib ]] && (( gpu_gib < 100 )); then LIGHT=${LIGHT:-recompute=mixed}; fi
LIGHT=${LIGHT:-recompute=selective}
BF16_MODULES=${BF16_MODULES:-[output_layer,*.out_proj,*.linear_proj]}
LORA=${LORA:-recompute=full}
PRESET=${PRESET:-qwen3_5_9b}
E2E=(python3 -m relax_gdn.bench.train_e2e --preset "$PRESET" --max-tokens-per-gpu 8192
     --global-batch-size "${GBS:-4}" --steps "${STEPS:-4}" --skip "${SKIP:-1}")

curves() {  # curves LIMIT RECIPE...: the reduced 9B, CURVE_STEPS steps, bf16 and each RECIPE, seeds 1 and 2
  # (one job each), then relax_gdn.compare over them against bf16 ($OUT/compare.log); the runs and their
  # logs packed into $OUT/curves.tgz
  local limit=$1 seed recipe; shift
  for seed in 1 2; do
    for recipe in null "$@"; do
      step "curve_${recipe}_seed$seed" "$limit" python3 train.py hydra.run.dir="curves/${recipe}_seed$seed" \
        ${CURVE_ARGS:-model=qwen3_5_9b_reduced train=h200} train.steps="${CURVE_STEPS:-150}" \
        train.global_batch_size=8 data.max_sample_tokens=2048 data.num_samples=2048 optim.lr=2e-4 \
        optim.min_lr=2e-5 recompute=selective logging.wandb.mode=disabled logging.console=false \
        model.fp8.recipe="$recipe" train.seed="$seed"
    done
  done
  rm -rf curves/*/checkpoints
  python3 -m relax_gdn.compare curves --baseline model.fp8.recipe=null > "$OUT/compare.log" 2>&1
  mv "$OUT"/curve_*.log curves/
  tar -czf "$OUT/curves.tgz" curves  # one file: a call returns a limited number of them (8)
}

nine_b() {  # nine_b DIR LIMIT COMMAND...: the 9B, NINE_B_STEPS steps in bf16 and RECIPE, then relax_gdn.compare
  local dir=$1 limit=$2 recipe; shift 2
  for recipe in null "$RECIPE"; do
    step "${dir}_$recipe" "$limit" "$@" ${NINE_B_ARGS:-model=qwen3_5_9b train=h200} hydra.run.dir="$dir/$recipe" \
      train.steps="${NINE_B_STEPS:-50}" logging.wandb.mode=disabled logging.console=false model.fp8.recipe="$recipe"
  done
  rm -rf "$dir"/*/checkpoints
  python3 -m relax_gdn.compare "$dir" --baseline model.fp8.recipe=null > "$OUT/compare_$dir.log" 2>&1
  tar -czf "$OUT/$dir.tgz" "$dir"  # one file: a call returns a limited number of them
  tail -n 12 "$OUT/compare_$dir.log"
}

case $CALL in
  1)
    step test_fp8_gpu 80 python3 -m pytest -q -s -m gpu tests/test_fp8_gpu.py -k "not reduced_9b"
    step bench_gemm 100 python3 -m relax_gdn.bench.gemm --out "$OUT/gemm.json"
    if ! grep -q "x bf16" "$OUT/bench_gemm.log"; then  # the FP8 path does not run here: the rest would not
      tail -30 "$OUT/bench_gemm.log"; save_caches; cat "$summary"; exit 1
    fi
    step e2e_full 150 "${E2E[@]}" --out "$OUT/e2e_full.json" --variants "recompute=full;recompute=full,fp8=tensorwise"
    step e2e_light 150 "${E2E[@]}" --out "$OUT/e2e_light.json" --variants \
      "$LIGHT;$LIGHT,fp8=tensorwise,profile"
    step test_fp8_gpu_9b 70 python3 -m pytest -q -s -m gpu tests/test_fp8_gpu.py -k "tensorwise-selective"
    echo; echo "== GEMMs =="; sed -n '/^layer /,$p' "$OUT/bench_gemm.log"
    for t in full light; do echo; echo "== $t =="; sed -n '/^qwen3_5/,$p' "$OUT/e2e_$t.log"; done
    echo; echo "== GPU tests =="; tail -n 3 "$OUT/test_fp8_gpu.log" "$OUT/test_fp8_gpu_9b.log" ;;
  2)
    step e2e_lora 150 "${E2E[@]}" --optimizer adam --out "$OUT/e2e_lora.json" --variants \
      "model.lora.rank=16,$LORA;model.lora.rank=16,$LORA,fp8=$RECIPE"
    curves 75 "$RECIPE"
    echo; echo "== lora =="; sed -n '/^qwen3_5/,$p' "$OUT/e2e_lora.log"
    echo; tail -n 12 "$OUT/compare.log" ;;
  3)
    step e2e_rowwise 240 "${E2E[@]}" --out "$OUT/e2e_rowwise.json" --variants \
      "$LIGHT;$LIGHT,fp8=rowwise;$LIGHT,fp8=rowwise_gw_hp"
    echo; sed -n '/^qwen3_5/,$p' "$OUT/e2e_rowwise.log" ;;
  4)
    for tokens in 2048 4096 8192; do
      step "e2e_mb$tokens" 150 python3 -m relax_gdn.bench.train_e2e --preset "$PRESET" --max-tokens-per-gpu $tokens \
        --mean-tokens $tokens --sigma 0 --min-tokens $tokens --max-tokens $tokens \
        --global-batch-size $(( 32768 / tokens )) --steps "${STEPS:-4}" --skip "${SKIP:-1}" \
        --out "$OUT/e2e_mb$tokens.json" --variants "recompute=full;recompute=full,fp8=$RECIPE"
    done
    for tokens in 2048 4096 8192; do echo; sed -n '/^qwen3_5/,$p' "$OUT/e2e_mb$tokens.log"; done ;;
  5)
    nine_b nine_b 260 python3 -m relax_gdn.launch --standalone --nproc-per-node 2 train.py \
      train.global_batch_size=16 recompute=full ;;
  6)
    nine_b nine_b_lora 250 python3 train.py train.global_batch_size=4 model.lora.rank=16 recompute=none ;;
  7)
    step test_fp8_gpu_write 150 python3 -m pytest -q -s -m gpu tests/test_fp8_gpu.py -k "no_host_sync or first_weight_gradient"
    step e2e_bf16_modules 300 "${E2E[@]}" --out "$OUT/e2e_bf16_modules.json" --variants \
      "$LIGHT;$LIGHT,fp8=tensorwise;$LIGHT,fp8=tensorwise,model.fp8.bf16_modules=$BF16_MODULES"
    echo; tail -n 3 "$OUT/test_fp8_gpu_write.log"; sed -n '/^qwen3_5/,$p' "$OUT/e2e_bf16_modules.log" ;;
  8)
    step test_fp8_gpu_host 120 python3 -m pytest -q -s -m gpu tests/test_fp8_gpu.py -k "host_memory"
    step e2e_lora_profile 240 "${E2E[@]}" --optimizer adam --out "$OUT/e2e_lora_profile.json" --variants \
      "model.lora.rank=16,recompute=none,profile;model.lora.rank=16,recompute=none,fp8=$RECIPE,profile"
    echo; tail -n 3 "$OUT/test_fp8_gpu_host.log"; sed -n '/^qwen3_5/,$p' "$OUT/e2e_lora_profile.log" ;;
  9)
    curves 85 rowwise rowwise_gw_hp
    echo; tail -n 12 "$OUT/compare.log" ;;
  10)
    step test_fp8_gpu_host 120 python3 -m pytest -q -s -m gpu tests/test_fp8_gpu.py -k "host_memory"
    step e2e_lora 170 "${E2E[@]}" --optimizer adam --out "$OUT/e2e_lora.json" --variants \
      "model.lora.rank=16,recompute=none;model.lora.rank=16,recompute=none,fp8=$RECIPE"
    step e2e_light 170 "${E2E[@]}" --out "$OUT/e2e_light.json" --variants "$LIGHT;$LIGHT,fp8=$RECIPE"
    echo; tail -n 3 "$OUT/test_fp8_gpu_host.log"
    for t in lora light; do echo; echo "== $t =="; sed -n '/^qwen3_5/,$p' "$OUT/e2e_$t.log"; done ;;
  11)
    read -ra curve_recipes <<< "${CURVE_RECIPES:-tensorwise}"
    curves 100 "${curve_recipes[@]}"
    echo; tail -n 16 "$OUT/compare.log" ;;
  12)
    step e2e_light 170 "${E2E[@]}" --out "$OUT/e2e_light.json" --variants "$LIGHT;$LIGHT,fp8=$RECIPE"
    curves 80 "$RECIPE"
    echo; echo "== light =="; sed -n '/^qwen3_5/,$p' "$OUT/e2e_light.log"
    echo; tail -n 12 "$OUT/compare.log" ;;
esac
save_caches
echo; cat "$summary"
