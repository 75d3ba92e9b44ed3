#!/usr/bin/env bash
# The 9B against Hugging Face transformers + peft on one GPU (docs/benchmarks.md, "Against Hugging Face
# transformers"), in device calls of at most 9.5 minutes each, from the repository root on the GPU host.
# The machine's first call carries .gpu (47 MiB), a later call of the same warm machine .gpu-hf (25 MiB,
# relax_gdn/bench/hf_wheels.sh): together they pass a call's 64 MiB. The first CALL writes the 9B's
# random-init HF checkpoint into outputs/peers/, which later calls of the warm machine reuse. Where
# FlashAttention-4's parts were carried too (relax_gdn/bench/fa4_wheels.sh, part-0 alone in a call of its
# own), relax-gdn's rows run on it.
#
#   CALL=1 relax_gdn/bench/peers.sh   LoRA r16 + AdamW, one 8,192-token document per step: HF without and
#       with checkpointing, + Liger, relax-gdn at its best setting, with full recompute, and in FP8
#   CALL=2 relax_gdn/bench/peers.sh   the same LoRA rows at 32,768 tokens (HF without checkpointing shows
#       where it runs out of memory), STEPS32 steps; the FP8 row last (the JSON is written after each
#       row, so a call that runs out of time keeps the rows before it)
#   CALL=3 relax_gdn/bench/peers.sh   full fine-tuning at 8,192 tokens: HF without checkpointing and HF +
#       torchao float8 with compiled decoder blocks (the rows the H200 table lacks); then full
#       fine-tuning at 32,768 tokens while the budget lasts
#   CALL=4 relax_gdn/bench/peers.sh   HF + torchao float8 with compiled decoder blocks, full fine-tuning at
#       8,192 tokens, beside HF + ckpt and relax-gdn in bf16 and FP8, with the CUDA allocator's expandable
#       segments (ALLOC_CONF; without them the float8 row ran out of memory at 139.7 GiB in use)
#
# Environment: STEPS32 (4: the 32k rows' steps, medians of the steps after the second), ROWS_8K_LORA,
# ROWS_32K, ROWS_8K_FULL, ROWS_8K_FP8 (the --rows of each step; see `python -m relax_gdn.bench.peers --help`),
# ALLOC_CONF (PYTORCH_CUDA_ALLOC_CONF of the bench.peers processes; CALL=4: expandable_segments:True).
set -uo pipefail
CALL=${CALL:-1}
[[ $CALL == [1-4] ]] || { echo "CALL=$CALL: one of 1, 2, 3, 4" >&2; exit 2; }
OUT=${OUT:-outputs/peers}
source "$(dirname "$0")/device_call.sh"
[[ -f .gpu-hf/activate.sh ]] && source .gpu-hf/activate.sh
use_fa4  # relax-gdn's attention: FlashAttention-4 where its parts were carried (model.attention_backend=auto)
build_torch_extensions
[[ $CALL == 4 ]] && ALLOC_CONF=${ALLOC_CONF-expandable_segments:True}
PEERS=(python3 -m relax_gdn.bench.peers --preset qwen3_5_9b ${ALLOC_CONF:+--cuda-alloc-conf "$ALLOC_CONF"})
RELAX_ROWS="relax;relax,recompute=full"

case $CALL in
  1)
    step peers_8k_lora 540 "${PEERS[@]}" --doc-tokens 8192 --workloads lora --out "$OUT/peers_8k_lora.json" \
      --rows "${ROWS_8K_LORA:-hf;hf,ckpt;hf,ckpt,liger;$RELAX_ROWS;relax,model.fp8.recipe=tensorwise}"
    tables=(peers_8k_lora) ;;
  2)
    step peers_32k_lora 540 "${PEERS[@]}" --doc-tokens 32768 --workloads lora --steps "${STEPS32:-4}" \
      --out "$OUT/peers_32k_lora.json" \
      --rows "${ROWS_32K:-hf;hf,ckpt;hf,ckpt,liger;$RELAX_ROWS;relax,model.fp8.recipe=tensorwise}"
    tables=(peers_32k_lora) ;;
  3)
    step peers_8k_full 300 "${PEERS[@]}" --doc-tokens 8192 --workloads full --out "$OUT/peers_8k_full.json" \
      --rows "${ROWS_8K_FULL:-hf;hf,fp8;hf,ckpt}"
    step peers_32k_full 240 "${PEERS[@]}" --doc-tokens 32768 --workloads full --steps "${STEPS32:-4}" \
      --out "$OUT/peers_32k_full.json" --rows "${ROWS_32K:-hf;hf,ckpt;hf,ckpt,liger;$RELAX_ROWS}"
    tables=(peers_8k_full peers_32k_full) ;;
  4)
    step peers_8k_fp8 540 "${PEERS[@]}" --doc-tokens 8192 --workloads full --out "$OUT/peers_8k_fp8.json" \
      --rows "${ROWS_8K_FP8:-hf,fp8;hf,ckpt;relax;relax,model.fp8.recipe=tensorwise}"
    tables=(peers_8k_fp8) ;;
esac
for t in "${tables[@]}"; do
  echo; echo "== $t =="
  if [[ -f "$OUT/$t.md" ]]; then cat "$OUT/$t.md"; else tail -n 30 "$OUT/$t.log"; fi
done
echo; cat "$summary"
