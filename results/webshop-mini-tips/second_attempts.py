"""What the policy did at trial 2 of the adaptation test after its own trial-1 tip, read from the tips it
wrote (evaluate.py --memory on keeps each episode's tip): did it buy the same product, with the same
options? And, for the shuffled-tips control, how many episodes searched a query that shares less than
half of its words with their own instruction (another task's query, copied from the tip shown).

    python results/webshop-mini-tips/second_attempts.py results/webshop-mini-tips/purchase-first
"""
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import envs  # noqa: E402


def purchase(tip: str | None):
    """(product, full match?, options chosen, score) that a tip states; product None if it states none."""
    bought = re.search(r"Bought (\w+): (a full match|not a full match)", tip or "")
    chose = re.search(r"Chose (.*?)\.(?: |$)", tip or "")
    score = re.search(r"Score (\d\.\d\d)", tip or "")
    return (bought.group(1) if bought else None, bool(bought) and bought.group(2) == "a full match",
            frozenset(chose.group(1).split(", ")) if chose else frozenset(), float(score.group(1)) if score else None)


def by_task(path: Path) -> dict:
    out = {}
    for e in json.loads(path.read_text())["episodes"]:
        out.setdefault(e["task_id"], {})[e["trial"]] = e
    return out


def main(run: Path) -> None:
    trials = by_task(run / "eval_ood_on.json")
    table = {}
    for eps in trials.values():
        product, full, options, score = purchase(eps[1].get("tip"))
        if product is None:
            continue
        kind = "full match" if full else "partial (score >= 0.5)" if score >= 0.5 else "poor (score < 0.5)"
        again = purchase(eps[2].get("tip"))
        row = table.setdefault(kind, {"tasks": 0, "same product": 0, "same product and options": 0,
                                      "trial 2 scored higher": 0, "trial 2 scored lower": 0})
        row["tasks"] += 1
        row["same product"] += again[0] == product
        row["same product and options"] += again[0] == product and again[2] == options
        row["trial 2 scored higher"] += eps[2]["reward"] > eps[1]["reward"]
        row["trial 2 scored lower"] += eps[2]["reward"] < eps[1]["reward"]
    print("after the policy's own trial-1 tip (memory on):", json.dumps(table, indent=1))
    instruction = {t.task_id: t.instruction for t in envs.tasks("webshop-mini", "ood")}
    words = lambda text: set(text.lower().replace(",", " ").split())
    for name in ("on", "shuffled"):
        if not (run / f"eval_ood_{name}.json").exists():
            continue
        other = {}
        for eps in by_task(run / f"eval_ood_{name}.json").values():
            for k, e in eps.items():
                query = re.search(r"Searched '(.*?)'(?:[.;]|$)", e.get("tip") or "")
                if query:
                    q = words(query.group(1))
                    other.setdefault(k, [0, 0])[0] += len(q & words(instruction[e["task_id"]])) < 0.5 * len(q)
                    other[k][1] += 1
        print(f"memory {name}: episodes whose tip names a query unlike their own instruction, per trial:",
              {k: f"{a} of {n}" for k, (a, n) in sorted(other.items())})


if __name__ == "__main__":
    main(Path(sys.argv[1]))
