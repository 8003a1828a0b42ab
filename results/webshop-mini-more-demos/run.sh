#!/bin/bash
# The screen of PLAN.md, one job at a time; resumable (a finished step is skipped).
set -e
cd "$(dirname "$0")/../.."
OUT=${OUT:-runs/more-demos}
declare -A FLAGS=([spread56]="--warm-start-spread --warm-start-episodes 56" [spread32]="--warm-start-spread" [uniform32]="")
for v in spread56 spread32 uniform32; do
  for s in 0 1 2; do
    [ -f $OUT/$v-s$s/eval.json ] || python train.py --env webshop-mini --iterations 0 --eval-episodes 0 \
      --val-every 4 --val-episodes 40 ${FLAGS[$v]} --seed $s --out $OUT --name $v-s$s
  done
  adapter=$(python -c "import json; print(json.load(open('$OUT/$v-s0/warm_start.json'))['folder'])")/adapter
  [ -f $OUT/$v-cat_litter_val.json ] || \
    python results/webshop-mini-train-pool/cat_litter_val.py $adapter $OUT/$v-cat_litter_val.json
done
