#!/usr/bin/env bash
# The README's EMPO² vs GRPO experiment (default 135M model, CPU), for one environment:
#   1. the warm start alone (train.py --iterations 0): behaviour cloning of the env's demonstrator,
#      evaluated on the held-out test split;
#   2. EMPO² and GRPO from that same warm start, seeds 0 1 2, the same budget each;
#   3. the adaptation test (unseen kind of task, memory on, no weight update) for the warm start and
#      for each EMPO² seed;
#   4. evaluate.py --compare: tables and plots.
# Resumable: run it again after an interruption and it continues where it stopped.
#   bash scripts/empo2_vs_grpo.sh rooms
#   bash scripts/empo2_vs_grpo.sh webshop-mini
#   OUT=results/rooms bash scripts/empo2_vs_grpo.sh rooms compare   # only re-make the tables and plots
set -euo pipefail
cd "$(dirname "$0")/.."
ENV=${1:?usage: scripts/empo2_vs_grpo.sh rooms|webshop-mini [compare]}
OUT=${OUT:-runs/experiment-$ENV}
SEEDS=${SEEDS:-0 1 2}
case "$ENV" in  # per-run budget (see README, Results); every other setting is train.py's default
    # rooms: all 60 training tasks (results/rooms used --train-tasks 8 and both algorithms got worse)
    rooms)        SIZES=${SIZES:---iterations 6 --tasks-per-iter 4 --group-size 8 --temperature 1.0 --eval-episodes 100} ;;
    webshop-mini) SIZES=${SIZES:---iterations 6 --tasks-per-iter 4 --group-size 4 --train-tasks 12 --eval-episodes 60} ;;
    *) echo "unknown env $ENV" >&2; exit 2 ;;
esac
ADAPT=${ADAPT:---split ood --memory on --trials 3 --episodes 30}
train() {  # name, then train.py flags
    local name="$1"; shift
    if grep -qs '"trained"' "$OUT/$name/eval.json"; then return; fi  # finished (evaluated after training)
    if [ -f "$OUT/$name/checkpoint.pt" ]; then resume=--resume; else resume=; rm -rf "${OUT:?}/$name"; fi
    python train.py --env "$ENV" $SIZES --out "$OUT" --name "$name" $resume "$@"
}
adapt() {  # run folder: OOD tasks, 3 trials, tips written after each, weights frozen
    if [ ! -f "$1/eval_ood_on.json" ]; then python evaluate.py --run "$1" $ADAPT --out "$1/eval_ood_on.json"; fi
}
if [ "${2:-}" != compare ]; then
    train warm-start --algo grpo --iterations 0
    for seed in $SEEDS; do
        for algo in empo2 grpo; do train "$algo-s$seed" --algo "$algo" --seed "$seed"; done
    done
    adapt "$OUT/warm-start"
    for seed in $SEEDS; do adapt "$OUT/empo2-s$seed"; done
fi
python evaluate.py --compare "$OUT"/empo2-s* "$OUT"/grpo-s* "$OUT/warm-start" --out "$OUT/compare.md"
python evaluate.py --compare "$OUT"/empo2-s* "$OUT"/grpo-s* --metric success_rate --out "$OUT/compare_success.md"
