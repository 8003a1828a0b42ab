"""Speed where it counts, measured side by side in one run; prints one JSON object of ratios.

    python bench.py                 # the default model on CPU, ~3 minutes on 2 cores

rollout_batched_vs_sequential      tokens/s of 8 rooms episodes in lockstep (one generate call per
                                   step) vs the same 8 episodes one after another     (target >= 4)
scoring_single_pass_vs_per_turn    scoring the action tokens of a 10-turn trajectory in one forward
                                   pass vs re-encoding the prompt at every turn        (target >= 3)
retrieval_vectorized_vs_loop       TipMemory.retrieve at 10,000 entries vs a per-entry Python loop
                                   with the same results                              (target >= 50)

Also printed: rollout_decode_steps_one_by_one_vs_lockstep, the forward passes one-by-one decoding
needs per lockstep decode step for the same tokens (a lockstep step lasts until its longest action
is done): the most decoding could speed up even if 8 rows cost what 1 row costs.
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

import envs
from empo2 import Config, rollout
from memory import TipMemory


def bench_rollout(policy, steps: int, new_tokens: int, repeats: int = 3) -> dict:
    """Sampled at the training temperature, so the two runs generate different actions: each of the
    `repeats` seeds runs both, one after the other, and the figures are totals over all of them."""
    cfg = Config(env="rooms", warm_start="off", max_steps=steps, max_new_tokens=new_tokens)  # untrained: with the example
    tasks = envs.tasks("rooms", "test")[:8]
    pool = [envs.make("rooms") for _ in tasks]
    rollout(policy, pool[:2], tasks[:2], [("plain", "on-policy")] * 2, cfg)  # warm-up
    modes = [("plain", "on-policy")]

    def actions(trajs):  # tokens of each action, per episode
        return [[len(s) for kind, s in tr.segments if kind == "action"] for tr in trajs]
    tokens_b = tokens_s = time_b = time_s = lockstep_steps = 0
    for seed in range(repeats):
        torch.manual_seed(seed)
        t = time.perf_counter()
        lengths = actions(rollout(policy, pool, tasks, modes * 8, cfg))
        time_b += time.perf_counter() - t
        tokens_b += sum(map(sum, lengths))
        # Lockstep decodes until the longest action of the step is done; one after another, each episode
        # decodes only its own tokens. Their ratio caps the speed-up of decoding even if 8 rows cost what 1 does.
        lockstep_steps += sum(max(a[k] for a in lengths if len(a) > k) for k in range(max(map(len, lengths))))
        torch.manual_seed(seed)
        t = time.perf_counter()
        tokens_s += sum(sum(map(sum, actions(rollout(policy, pool[:1], [task], modes, cfg)))) for task in tasks)
        time_s += time.perf_counter() - t
    return {"batched_tokens_per_s": tokens_b / time_b, "sequential_tokens_per_s": tokens_s / time_s,
            "rollout_tokens_batched": tokens_b, "rollout_tokens_sequential": tokens_s,
            "rollout_decode_steps_one_by_one_vs_lockstep": tokens_b / lockstep_steps,
            "rollout_batched_vs_sequential": (tokens_b / time_b) / (tokens_s / time_s)}


def bench_scoring(policy, turns: int = 10, repeats: int = 3) -> dict:
    rng = np.random.default_rng(0)
    vocab = len(policy.tokenizer)
    segments = [("context", rng.integers(100, vocab, 150).tolist())]
    for _ in range(turns):  # an action of ~16 tokens, then an observation of ~80
        segments += [("action", rng.integers(100, vocab, 16).tolist()), ("context", rng.integers(100, vocab, 80).tolist())]
    ids = [t for _, s in segments for t in s]
    mask = [k == "action" for k, s in segments for _ in s]
    ends = np.cumsum([len(s) for _, s in segments])
    turn_ends = [int(e) for (k, _), e in zip(segments, ends) if k == "action"]

    def single_pass():
        return policy.score(ids, mask)[0]

    def per_turn():  # what a per-step trainer does: re-encode the whole prompt for each turn's action
        return torch.cat([policy.score(ids[:end], [m and (k >= start) for k, m in enumerate(mask[:end])])[0]
                          for start, end in zip([0] + turn_ends[:-1], turn_ends)])
    with torch.no_grad():
        a, b = single_pass(), per_turn()  # warm-up, and the same numbers
        t = time.perf_counter()
        for _ in range(repeats):
            single_pass()
        t_single = (time.perf_counter() - t) / repeats
        t = time.perf_counter()
        for _ in range(repeats):
            per_turn()
        t_turn = (time.perf_counter() - t) / repeats
    return {"scoring_single_pass_s": t_single, "scoring_per_turn_s": t_turn, "trajectory_tokens": len(ids),
            "scoring_max_abs_logp_diff": float((a - b).abs().max()),
            "scoring_single_pass_vs_per_turn": t_turn / t_single}


def retrieve_loop(memory: TipMemory, task_id: str, query: np.ndarray) -> list[str]:
    """The same semantics as TipMemory.retrieve, one entry at a time."""
    hits = []
    for key, tip, score in zip(memory.keys[task_id], memory.tips[task_id], memory.scores[task_id]):
        sim = float(sum(float(k) * float(q) for k, q in zip(key, query)))
        if sim > memory.threshold:
            hits.append((-score, -sim, tip))
    return [tip for _, _, tip in sorted(hits, key=lambda h: (h[0], h[1]))[:memory.top_k]]


def bench_retrieval(entries: int = 10_000, queries: int = 20) -> dict:
    rng = np.random.default_rng(0)
    centre = rng.normal(size=384)
    keys = centre + rng.normal(size=(entries, 384)) * 1.2  # a cluster: a fair share pass the 0.5 threshold
    keys = (keys / np.linalg.norm(keys, axis=1, keepdims=True)).astype(np.float32)
    memory = TipMemory(capacity=entries)
    for k in range(entries):
        memory.add("task", keys[k], f"tip {k}", float(rng.integers(0, 100)) / 100)
    qs = [keys[k] for k in rng.integers(0, entries, queries)]
    t = time.perf_counter()
    fast = [memory.retrieve("task", q) for q in qs]
    t_fast = (time.perf_counter() - t) / queries
    t = time.perf_counter()
    slow = [retrieve_loop(memory, "task", q) for q in qs]
    t_slow = (time.perf_counter() - t) / queries
    assert fast == slow, "vectorised and loop retrieval disagree"
    return {"retrieve_vectorized_ms": 1000 * t_fast, "retrieve_loop_ms": 1000 * t_slow,
            "retrieval_vectorized_vs_loop": t_slow / t_fast}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--steps", type=int, default=3, help="environment steps per rollout episode")
    parser.add_argument("--new-tokens", type=int, default=32, help="max new tokens per action")
    args = parser.parse_args()
    from policy import load_policy
    policy = load_policy(args.model, args.dtype, args.device)
    result = {"model": args.model, "dtype": str(next(policy.model.parameters()).dtype).replace("torch.", ""),
              "device": str(policy.device), "threads": torch.get_num_threads()}
    result.update(bench_retrieval())
    result.update(bench_scoring(policy))
    result.update(bench_rollout(policy, args.steps, args.new_tokens))
    ratios = ("rollout_batched_vs_sequential", "scoring_single_pass_vs_per_turn", "retrieval_vectorized_vs_loop")
    print(json.dumps({**{k: round(result[k], 2) for k in ratios},
                      **{k: (round(v, 4) if isinstance(v, float) else v) for k, v in result.items() if k not in ratios}},
                     indent=1))


if __name__ == "__main__":
    main()
