#!/usr/bin/env bash
# The README's EMPO² vs GRPO experiment on webshop-mini (default 135M model, CPU): 3 seeds x 2 algorithms,
# the same budget (ITERS iterations x 2 goals x 2 rollouts), then the adaptation test (memory on, no weight
# update) for the untrained model and for EMPO² seed 0, then the comparison table and plots.
# Resumable: run it again after an interruption and it continues where it stopped.
#   bash scripts/webshop_empo2_vs_grpo.sh            # 98 min on the 2-core CPU (measured)
#   OUT=results/webshop-mini bash scripts/webshop_empo2_vs_grpo.sh   # only re-make the tables and plots
set -euo pipefail
cd "$(dirname "$0")/.."
ITERS=${ITERS:-9}
OUT=${OUT:-runs/webshop-exp}
train() {  # algo seed
    local name="$1-s$2"
    if grep -qs '"trained"' "$OUT/$name/eval.json"; then return; fi  # finished (evaluated after training)
    if [ -f "$OUT/$name/checkpoint.pt" ]; then resume=--resume; else resume=; rm -rf "${OUT:?}/$name"; fi
    python train.py --env webshop-mini --algo "$1" --seed "$2" --iterations "$ITERS" --eval-episodes 8 \
        --out "$OUT" --name "$name" $resume
}
for seed in 0 1 2; do
    for algo in empo2 grpo; do train "$algo" "$seed"; done
done
adapt() {  # eval-file run-args...: OOD goals, 3 trials, tips written after each, weights frozen
    local file="$1"; shift
    if [ ! -f "$file" ]; then python evaluate.py "$@" --split ood --memory on --trials 3 --episodes 4 --out "$file"; fi
}
adapt "$OUT/untrained-webshop-mini/eval_ood_on.json" --env webshop-mini
adapt "$OUT/empo2-s0/eval_ood_on.json" --run "$OUT/empo2-s0"
python evaluate.py --compare "$OUT"/empo2-s* "$OUT"/grpo-s* "$OUT/untrained-webshop-mini" --out "$OUT/compare.md"
python evaluate.py --compare "$OUT"/empo2-s* "$OUT"/grpo-s* --metric valid_action_rate --out "$OUT/compare_valid.md"
# results/webshop-mini/ in the repository holds these runs' config.json, metrics.jsonl and eval files,
# and the compare files re-made from them with the same two commands (OUT=results/webshop-mini).
