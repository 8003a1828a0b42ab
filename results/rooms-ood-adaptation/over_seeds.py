"""The adaptation test's figures over several warm starts: per folder (one warm start, evaluate.py's
eval_ood_{on,off,shuffled}.json), success % by trial and the three paired differences at trial 3 with
their 95 % bootstrap CI over the layouts; then each difference over the warm starts with Student's t.

    python results/rooms-ood-adaptation/over_seeds.py results/rooms-ood-adaptation/eight-kinds-facts \
        results/rooms-ood-adaptation/confirm-ws{1,2,3,4}
    python results/rooms-ood-adaptation/over_seeds.py results/rooms-ood-adaptation/held-out-cat/ws{0,1,2,3,4}
"""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from evaluate import paired_goal_difference, t_interval  # noqa: E402


def trial(episodes: list[dict], k: int) -> list[dict]:
    return [e for e in episodes if e["trial"] == k]


differences = {"trial 3 − trial 1, memory on": [], "memory on − off, trial 3": [], "memory on − shuffled, trial 3": []}
print("| warm start | memory on, trial 1 / 2 / 3 (%) | off, trial 3 | shuffled, trial 3 | "
      + " | ".join(differences) + " |")
print("|---" * (4 + len(differences)) + "|")
for folder in map(Path, sys.argv[1:]):
    arms = {a: json.loads((folder / f"eval_ood_{a}.json").read_text())["episodes"] for a in ("on", "off", "shuffled")}
    rate = lambda a, k: 100 * sum(e["won"] for e in trial(arms[a], k)) / len(trial(arms[a], k))  # noqa: E731
    pairs = [(trial(arms["on"], 1), trial(arms["on"], 3)), (trial(arms["off"], 3), trial(arms["on"], 3)),
             (trial(arms["shuffled"], 3), trial(arms["on"], 3))]
    cells = []
    for name, (before, after) in zip(differences, pairs):
        d = paired_goal_difference(before, after, "won")
        differences[name].append(d["difference"])
        lo, hi = d["difference_ci95"]
        cells.append(f"{d['difference']:+.1f} [{lo:+.1f}, {hi:+.1f}]")
    by_trial = " / ".join(f"{rate('on', k):.1f}" for k in (1, 2, 3))
    print(f"| {folder.name} | {by_trial} | {rate('off', 3):.1f} | "
          f"{rate('shuffled', 3):.1f} | " + " | ".join(cells) + " |")
n = len(sys.argv) - 1
cells = []
for values in differences.values():
    mean, half = t_interval(values)
    cells.append(f"**{mean:+.1f} [{mean - half:+.1f}, {mean + half:+.1f}]**")
print(f"| over the {n} warm starts (t, {n - 1} df) | | | | " + " | ".join(cells) + " |")
