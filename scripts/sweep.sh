#!/usr/bin/env bash
# Choosing settings on the VALIDATION split (never on test): one short training run per setting and
# seed, each evaluated on the val split before (the warm start, cached) and after training; then a table
# of trained - warm start on val, paired over the same goals. Resumable: run it again after a stop.
#   bash scripts/sweep.sh rooms                       # the learning-rate sweep of docs/algorithm.md
#   SETTINGS="lr3e-5:--lr_3e-5 kl:--lr_1e-4_--kl-coef_0.05" SEEDS="0 1" bash scripts/sweep.sh rooms
set -euo pipefail
cd "$(dirname "$0")/.."
ENV=${1:?usage: scripts/sweep.sh rooms|webshop-mini}
OUT=${OUT:-runs/sweep-$ENV}
SEEDS=${SEEDS:-0 1}
ALGO=${ALGO:-grpo}
SETTINGS=${SETTINGS:-lr3e-5:--lr_3e-5 lr1e-4:--lr_1e-4}   # name:flags entries, space-separated; "_" stands for a space in flags
case "$ENV" in
    rooms)        SIZES=${SIZES:---iterations 6 --tasks-per-iter 4 --group-size 8 --temperature 1.0} ;;
    webshop-mini) SIZES=${SIZES:---iterations 6 --tasks-per-iter 4 --group-size 4 --train-tasks 12} ;;
    *) echo "unknown env $ENV" >&2; exit 2 ;;
esac
VAL=${VAL:---val-every 3 --val-episodes 40 --eval-episodes 0}   # test split untouched
for entry in $SETTINGS; do
    name=${entry%%:*}; flags=${entry#*:}; flags=${flags//_/ }
    for seed in $SEEDS; do
        run="$ALGO-$name-s$seed"
        if grep -qs '"trained_val"' "$OUT/$run/eval.json"; then continue; fi
        if [ -f "$OUT/$run/checkpoint.pt" ]; then resume=--resume; else resume=; rm -rf "${OUT:?}/$run"; fi
        python train.py --env "$ENV" $SIZES $VAL --algo "$ALGO" --seed "$seed" $flags --out "$OUT" --name "$run" $resume
    done
done
python evaluate.py --sweep "$OUT"/*/ --out "$OUT/sweep.md"
