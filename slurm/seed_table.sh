#!/bin/bash
# Submit the seed's 8 x H200 table (issue 7): S1-S4 x GDN CP modes, plus the route A/B on S1.
# Every run logs to W&B group "seed-table" with tags naming scenario, mode and route; compare there
# or with the JSONL files under outputs/. Extra arguments go to every run (data, tokenizer, ...):
#   slurm/seed_table.sh data.path=/data/omr.parquet data.tokenizer=/ckpt/Qwen3.5-9B
#   DRY_RUN=1 slurm/seed_table.sh ...     # print the sbatch lines only
set -euo pipefail
cd "$(dirname "$0")/.."
submit() {
  if [[ -n "${DRY_RUN:-}" ]]; then echo sbatch slurm/train.sbatch "$@"; else sbatch slurm/train.sbatch "$@"; fi
}
common=(train.steps=35 logging.wandb.group=seed-table "$@")
for scenario in s1 s2 s3 s4; do
  for mode in chunkwise headwise all_gather; do
    # all_gather needs whole-layer recompute: S2 (no recompute) must be refused before step 1 —
    # submitted anyway so the table records the refusal message.
    submit experiment=$scenario gdn.cp_mode=$mode "${common[@]}"
  done
done
# Route A/B on S1: prebuilt by the data pipeline vs cached on first use. (Rebuilt per call, the
# seed's naive baseline, is a benchmark variant: python -m relax_gdn.bench.gdn_layer.)
for route in prebuild lazy_cache; do
  submit experiment=s1 gdn.cp_mode=chunkwise gdn.route=$route "${common[@]}"
done
