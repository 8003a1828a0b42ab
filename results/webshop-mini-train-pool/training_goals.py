"""Which product types each iteration of the screen's runs trained on (seed 0, 8 iterations x 4 goals),
recomputed from the run's draws (train.seed_iteration) without training anything.

    python results/webshop-mini-train-pool/training_goals.py
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import envs                          # noqa: E402
from empo2 import eval_subset        # noqa: E402
from train import seed_iteration     # noqa: E402

kind = envs.task_kind("webshop-mini")
for n in (28, 12):
    pool = eval_subset(envs.tasks("webshop-mini", "train"), n)
    cat = []
    for it in range(8):
        rng = seed_iteration(0, it)               # the run's own draws: its first is the iteration's goals
        picked = [pool[k] for k in rng.choice(len(pool), 4, replace=False)]
        cat += [(it, t.task_id) for t in picked if kind(t) == "cat litter"]
    print(f"--train-tasks {n}: cat-litter goals drawn (iteration, goal): {cat or 'none'}")
