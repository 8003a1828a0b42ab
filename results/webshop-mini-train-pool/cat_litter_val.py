"""The warm start or a trained adapter on the 6 cat-litter goals of webshop-mini's validation split
(the one product type whose item page has no options), evaluation seeds 0-4, T = 0.4, no memory.

    python results/webshop-mini-train-pool/cat_litter_val.py ADAPTER_FOLDER OUT.json
"""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import envs                                    # noqa: E402
from empo2 import Config, evaluate_policy      # noqa: E402
from evaluate import get_policy                # noqa: E402
from utils import write_atomically             # noqa: E402

adapter, out = Path(sys.argv[1]), Path(sys.argv[2])
kind = envs.task_kind("webshop-mini")
tasks = [t for t in envs.tasks("webshop-mini", "val") if kind(t) == "cat litter"]
cfg = Config(env="webshop-mini")
policy = get_policy(cfg, adapter)
pool = [envs.make("webshop-mini", split="val", seed=i) for i in range(len(tasks))]
episodes = []
for seed in range(5):
    result = evaluate_policy(policy, pool, tasks, cfg, desc=f"cat litter, seed {seed}", seed=seed)
    episodes += [{**e, "eval_seed": seed} for e in result["episodes"]]
steps = sum(e["steps"] for e in episodes)
invalid = [e["steps"] - e["valid_steps"] for e in episodes]
summary = {"adapter": str(adapter), "goals": [t.task_id for t in tasks], "episodes": len(episodes),
           "score": 100 * sum(e["reward"] for e in episodes) / len(episodes),
           "success_rate": 100 * sum(e["won"] for e in episodes) / len(episodes),
           "valid_action_rate": 100 * (steps - sum(invalid)) / steps, "invalid_steps": sum(invalid),
           "loops (episodes with >= 5 invalid steps)": sum(k >= 5 for k in invalid),
           "bought": sum(any(a.lower() == "click[buy now]" for a in e["actions"]) for e in episodes)}
write_atomically(out, json.dumps({**summary, "episode_records": episodes}, indent=1))
print(json.dumps(summary, indent=1))
