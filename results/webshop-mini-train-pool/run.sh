#!/bin/bash
# The screen of PLAN.md, one job at a time; resumable (a finished step is skipped).
set -e
cd "$(dirname "$0")/../.."
OUT=${OUT:-runs/train-pool}
HERE=results/webshop-mini-train-pool
WS=${WS:?set WS to the cached warm start adapter folder}
[ -f $OUT/ws_cat_litter_val.json ] || python $HERE/cat_litter_val.py "$WS" $OUT/ws_cat_litter_val.json
for n in 28 12; do
  run=$OUT/pool$n-s0
  [ -f $run/done ] || {
    python train.py --env webshop-mini --algo grpo --seed 0 --iterations 8 --tasks-per-iter 4 --group-size 4 \
      --train-tasks $n --eval-episodes 0 --val-every 4 --val-episodes 40 --out $OUT --name pool$n-s0 \
      $( [ -f $run/checkpoint.pt ] && echo --resume ) && touch $run/done; }
  [ -f $run/cat_litter_val.json ] || python $HERE/cat_litter_val.py $run/adapter $run/cat_litter_val.json
done
