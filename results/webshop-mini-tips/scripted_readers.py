"""How much can a factual shopping tip carry on webshop-mini? No model: the scripted players only.

For every goal of a split, as the adaptation test plays it (evaluate.py --memory on, 3 trials):
  trial 1  the warm start's demonstrator (envs/webshop_mini.py, `demonstrator`) plays once;
           envs/tips.py writes its tip, cut to what a reflection can write (the default model's tokens,
           Config.tip_max_new_tokens - 1, as warm_start.tip_demonstration cuts it)
  trial 2  envs/tips.py's WebshopTipFollower shown that tip; and, with the same random seed, shown no
           tip (the demonstrator's own habits: the control), and a reader that only skips a product
           bought without a full match (the follower before this change: "skip only")
  trial 3  the follower shown both tips, best first (as memory returns them)
Also: how many cut tips keep the purchase sentence, with the tip's sentences in envs/tips.py's order
and in the order before this change (queries first), and the reward parts of the demonstrator's
partial purchases (envs/webshop_reward.py).

    python results/webshop-mini-tips/scripted_readers.py          # writes scripted_readers.json beside it
"""
import json
import random
import re
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import envs  # noqa: E402
from empo2 import Config  # noqa: E402
from envs import valid_actions_of  # noqa: E402
from envs.tips import WebshopTipFollower, webshop_tip  # noqa: E402
from envs.webshop_mini import _NAVIGATION, demonstrator  # noqa: E402
from policy import default_model_dir  # noqa: E402


PURCHASE = re.compile(r"Bought \w+: (a full match|not a full match)|Bought nothing")   # the whole purchase sentence's point


def skip_only(tips: list[str]):
    """The reader before this change: skips, on a results page, a product a tip says was bought without a full match."""
    avoid = {m.lower() for m in re.findall(r"Bought (\w+): not a full match", " ".join(tips))}

    def act(obs: str, rng: random.Random) -> str:
        action = demonstrator(obs, rng)
        if "(Total results: " in obs and action[6:-1] in avoid:
            others = [a for a in valid_actions_of(obs) if a.startswith("click[") and a not in _NAVIGATION and a[6:-1] not in avoid]
            return others[0] if others else action
        return action
    return act


def queries_first(tip: str) -> str:
    """The same sentences in the order webshop_tip wrote them before this change."""
    parts = dict(re.findall(r"(Score|Bought|Chose|Opened|Searched)(.*?\.)(?= (?:Score|Bought|Chose|Opened|Searched) |$)", tip))
    return " ".join(k + parts[k] for k in ("Score", "Searched", "Opened", "Chose", "Bought") if k in parts)


def play(env, task, act, rng):
    obs, info = env.reset(task)
    transcript, done = [], False
    while not done:
        action = act(obs, rng)
        next_obs, _, done, info = env.step(action)
        transcript.append({"observation": obs, "action": action, "valid": info.get("valid", True)})
        obs = next_obs
    return transcript, obs, float(info.get("score", 0.0)), info


def paired_ci(a: np.ndarray, b: np.ndarray, seed: int = 0) -> list[float]:
    """mean of a - b in points, with a 95 % bootstrap CI over goals."""
    d, rng = 100 * (a - b), np.random.default_rng(seed)
    boots = [d[rng.integers(0, len(d), len(d))].mean() for _ in range(2000)]
    return [round(float(d.mean()), 1), *(round(float(x), 1) for x in np.percentile(boots, [2.5, 97.5]))]


def main() -> dict:
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir())
    budget = Config.tip_max_new_tokens - 1
    cut = lambda text: tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)[:budget]).strip()
    shown = lambda tip, score: f"{tip} (score: {score:.2f})"   # as a memory rollout shows a tip
    out = {}
    for split in ("val", "ood"):
        env = envs.make("webshop-mini", split=split, seed=0)
        scores = {k: [] for k in ("trial 1", "no tip", "skip only", "follower", "follower, trial 3")}
        kept, parts = {"purchase first (envs/tips.py)": 0, "queries first (before)": 0}, []
        for k, task in enumerate(envs.tasks("webshop-mini", split)):
            transcript, final_obs, score, info = play(env, task, demonstrator, random.Random(k))
            if score < 1.0 and info.get("reward_info"):
                parts.append(info["reward_info"])
            full = webshop_tip(transcript, final_obs, score)
            tip = cut(full)
            kept["purchase first (envs/tips.py)"] += bool(PURCHASE.search(tip))
            kept["queries first (before)"] += bool(PURCHASE.search(cut(queries_first(full))))
            scores["trial 1"].append(score)
            scores["no tip"].append(play(env, task, WebshopTipFollower([]), random.Random(10_000 + k))[2])
            scores["skip only"].append(play(env, task, skip_only([shown(tip, score)]), random.Random(10_000 + k))[2])
            t2, f2, s2, _ = play(env, task, WebshopTipFollower([shown(tip, score)]), random.Random(10_000 + k))
            scores["follower"].append(s2)
            both = sorted([(score, shown(tip, score)), (s2, shown(cut(webshop_tip(t2, f2, s2)), s2))], key=lambda x: -x[0])
            scores["follower, trial 3"].append(play(env, task, WebshopTipFollower([t for _, t in both]), random.Random(20_000 + k))[2])
        env.close()
        s = {k: np.array(v) for k, v in scores.items()}
        won = {k: (v == 1.0).astype(float) for k, v in s.items()}
        out[split] = {
            "goals": len(s["trial 1"]), "tip_budget_tokens": budget, "cut_tips_with_the_purchase_sentence": kept,
            "score": {k: round(100 * float(v.mean()), 1) for k, v in s.items()},
            "success_pct": {k: round(100 * float(v.mean()), 1) for k, v in won.items()},
            "minus_no_tip_score": {k: paired_ci(s[k], s["no tip"]) for k in ("skip only", "follower", "follower, trial 3")},
            "minus_no_tip_success": {k: paired_ci(won[k], won["no tip"]) for k in ("skip only", "follower", "follower, trial 3")},
            "partial_purchases_of_trial_1": len(parts),
            "their_mean_reward_parts": {key: round(float(np.mean([p[key] for p in parts if key in p])), 3)
                                        for key in ("r_type", "r_att", "r_option", "r_price")},
        }
        print(split, json.dumps(out[split]), flush=True)
    (Path(__file__).parent / "scripted_readers.json").write_text(json.dumps(out, indent=1) + "\n")
    return out


if __name__ == "__main__":
    main()
