#!/bin/bash
# Submit the seed's 8 x H200 table as ONE job array without Hydra plugins: S1-S4 x GDN CP modes, plus
# the route A/B on S1. Task i of the array runs line i+1 of the task table (its Hydra overrides)
# through slurm/train.sbatch; extra arguments go to every task (data, tokenizer, ...):
#   slurm/seed_table.sh data.path=/data/omr.parquet data.tokenizer=/ckpt/Qwen3.5-9B
#   DRY_RUN=1 slurm/seed_table.sh ...     # print the table, the sbatch line and every task's command
#   SEEDS="1234 1235" slurm/seed_table.sh ...   # every row once per seed (A/A repeats for compare)
#   NAME=my-table OUT_DIR=/scratch/logs slurm/seed_table.sh ...   # W&B group / table and log directory
# Runs share the W&B group "seed-table"; compare them with python -m relax_gdn.compare outputs/slurm/...
set -euo pipefail
cd "$(dirname "$0")/.."
name=${NAME:-seed-table}
out_dir=${OUT_DIR:-outputs/slurm}  # task table and job logs
table=$out_dir/$name.tasks
mkdir -p "$out_dir"  # Slurm opens --output before the script runs: the directory must exist
rows=()
for seed in ${SEEDS:-1234}; do
  for scenario in s1 s2 s3 s4; do
    for mode in chunkwise headwise all_gather; do
      # all_gather needs whole-layer recompute: S2 (no recompute) is refused before step 1 (exit 2);
      # kept in the table so the refusal message is on record.
      rows+=("experiment=$scenario gdn.cp_mode=$mode train.seed=$seed")
    done
  done
  # Route A/B on S1: prebuilt by the data pipeline vs cached on first use.
  for route in prebuild lazy_cache; do
    rows+=("experiment=s1 gdn.cp_mode=chunkwise gdn.route=$route train.seed=$seed")
  done
done
printf '%s\n' "${rows[@]}" > "$table"
n=${#rows[@]}
common=(train.steps=35 logging.wandb.group="$name" "$@")
submit=(sbatch --array="0-$((n - 1))" --job-name="$name" --output="$out_dir/%x-%A_%a.out"
        --export="ALL,TASK_TABLE=$table" slurm/train.sbatch "${common[@]}")
if [[ -n "${DRY_RUN:-}" ]]; then
  echo "# task table $table ($n tasks)"
  echo "${submit[*]}"
  for ((i = 0; i < n; i++)); do
    echo "# task $i: SLURM_ARRAY_TASK_ID=$i slurm/train.sbatch ${rows[$i]} ${common[*]}"
  done
else
  "${submit[@]}"
fi
