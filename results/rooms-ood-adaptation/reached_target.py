"""Where the rooms ood adaptation test fails: per arm and trial, the episodes that reached the target's
room, the first action taken there, and how many actions used the task's verb at all.

    python results/rooms-ood-adaptation/reached_target.py results/rooms-ood-adaptation/two-kinds
    python results/rooms-ood-adaptation/reached_target.py results/rooms-ood-adaptation/held-out-cat/ws0 cat

Reads the eval_ood_{off,on,shuffled}.json files evaluate.py writes (each episode's actions are in them);
the layouts come from envs.tasks("rooms", "ood"), which this script reads and the policy never did. A
second argument names the ood split's kind when held_out_verb.py changed it (default: plant).
"""
import collections
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import envs  # noqa: E402
from envs.rooms import KINDS, SPLIT_KINDS  # noqa: E402

if len(sys.argv) > 2:
    SPLIT_KINDS["ood"] = (sys.argv[2],)
layouts = {t.task_id: t for t in envs.tasks("rooms", "ood")}
folder = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).parent / "two-kinds")
print("| arm | trial | won | reached the target's room | first action there | actions with the task's verb | 'look around' share | valid actions |")
print("|---|---|---|---|---|---|---|---|")
for arm in ("off", "on", "shuffled"):
    path = folder / f"eval_ood_{arm}.json"
    if not path.exists():
        continue
    episodes = json.loads(path.read_text())["episodes"]
    for trial in sorted({e["trial"] for e in episodes}):
        eps = [e for e in episodes if e["trial"] == trial]
        reached, first, verb_acts, looks, steps = 0, collections.Counter(), 0, 0, 0
        for e in eps:
            task, acts = layouts[e["task_id"]], e["actions"]
            verb = KINDS[task.kind][0]
            if f"go to {task.target_room}" in acts:
                reached += 1
                first.update(acts[acts.index(f"go to {task.target_room}") + 1:][:1] or ["(episode ended)"])
            verb_acts += sum(a.startswith(verb + " ") for a in acts)
            looks += acts.count("look around")
            steps += len(acts)
        there = ", ".join(f"{a} {n}" for a, n in first.most_common())
        print(f"| {arm} | {trial} | {sum(e['won'] for e in eps)} of {len(eps)} | {reached} | {there or '-'} | "
              f"{verb_acts} of {steps} | {100 * looks / max(steps, 1):.0f} % | "
              f"{100 * sum(e['valid_steps'] for e in eps) / max(steps, 1):.0f} % |")
