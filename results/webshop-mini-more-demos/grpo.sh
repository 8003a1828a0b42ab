#!/bin/bash
# Step 2 of PLAN.md: GRPO from the spread56 warm start, the 8-iteration settings of
# results/webshop-mini-8-iterations/ (test split), seeds given as arguments (default 0-4); resumable.
set -e
cd "$(dirname "$0")/../.."
OUT=${OUT:-runs/more-demos}
for s in ${@:-0 1 2 3 4}; do
  run=$OUT/grpo-s$s
  [ -f $run/done ] || {
    python train.py --env webshop-mini --algo grpo --seed $s --iterations 8 --tasks-per-iter 4 --group-size 4 \
      --train-tasks 12 --eval-episodes 60 --val-every 4 --val-episodes 40 --warm-start-spread --warm-start-episodes 56 \
      --out $OUT --name grpo-s$s $( [ -f $run/checkpoint.pt ] && echo --resume ) && touch $run/done; }
  [ -f $run/cat_litter_val.json ] || python results/webshop-mini-train-pool/cat_litter_val.py $run/adapter $run/cat_litter_val.json
done
