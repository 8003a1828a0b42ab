"""Seconds per training iteration and peak GPU memory of this project's own code path at 1.5B and 3B.

    python gpu_bench.py --arch qwen2.5-1.5b                     # on a GPU, the GPU recipe's sizes
    python gpu_bench.py --arch qwen2.5-3b
    python gpu_bench.py --arch tiny-qwen2 --device cpu --tasks-per-iter 2 --group-size 2 --iterations 1

The model is built from configs/ARCH.json with RANDOM weights: the cost of a forward or backward pass
does not depend on the weight values, and no hub is needed. What runs is train.py's iteration on
webshop-mini, unchanged: CachedSampler sampling with the KV cache, reflection, the intrinsic reward,
scoring with the shared prefix, and the hybrid update with one optimiser step.

Random weights write gibberish, so two things are fixed to mirror a real run:
- every action is exactly --action-tokens tokens and every tip --tip-tokens (no stop token);
- the environment is driven by the warm start's demonstrator (envs.demonstrator): real pages and
  episode lengths (~4.7 steps on webshop-mini), while the trajectory holds the sampled tokens, which
  the update scores as usual.
Prompts are real text from the default model's tokenizer (SmolLM2); the model keeps its own, larger
vocabulary for the LM head, and sampled ids outside the tokenizer are dropped when decoded.
Prints one JSON object: settings, seconds per iteration and per phase (rollout, reflection, update),
generated tokens/s, and peak GPU memory per phase (torch.cuda.max_memory_allocated, GB).
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch

import envs
from empo2 import (Config, episode_returns, grpo_advantages, intrinsic_rewards, reflect, rollout, sample_modes,
                   store_tips, update_policy)
from memory import Embedder, NoveltyCounter, TipMemory

CONFIGS = Path(__file__).resolve().parent / "configs"


def build_policy(arch: str, device: str, dtype: torch.dtype, lora_r: int, lora_alpha: int):
    """A Policy around a randomly initialised model of configs/ARCH.json, with LoRA, the default tokenizer
    and no stop tokens (every generation runs to its token limit)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from policy import Policy, add_lora, default_model_dir
    path = CONFIGS / f"{arch}.json"
    if not path.exists():
        raise SystemExit(f"no config {path}; available: {', '.join(p.stem for p in sorted(CONFIGS.glob('*.json')))}")
    spec = {k: v for k, v in json.loads(path.read_text()).items() if not k.startswith("_")}
    config = AutoConfig.for_model(**spec)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype).to(device)
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir())
    policy = Policy(add_lora(model, lora_r, lora_alpha), tokenizer)
    policy.stop_ids, policy._token_kinds = [], (set(), set(), set())   # fixed lengths: never stop early
    vocab = len(tokenizer)
    policy.decode = lambda ids: tokenizer.decode([i for i in ids if i < vocab], skip_special_tokens=True)
    return policy


class DemonstratorDriven:
    """An environment whose step() ignores the action it is given and takes the demonstrator's action
    for the current page instead: random weights write gibberish, and this keeps real pages and
    episode lengths while the trajectory holds the sampled tokens. Everything else is the env's own."""

    def __init__(self, env, rng: random.Random):
        self.env, self.rng, self.demonstrator, self.obs = env, rng, envs.demonstrator("webshop-mini"), ""

    def reset(self, *args, **kwargs):
        self.obs, info = self.env.reset(*args, **kwargs)
        return self.obs, info

    def step(self, _sampled_action: str):
        self.obs, reward, done, info = self.env.step(self.demonstrator(self.obs, self.rng))
        return self.obs, reward, done, info

    def __getattr__(self, name):
        return getattr(self.env, name)


class Phase:
    """Wall time and peak GPU memory of a block (CUDA synchronised at both ends)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def __enter__(self):
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if self.cuda:
            torch.cuda.synchronize()
        self.seconds = time.perf_counter() - self.t0
        self.peak_gb = torch.cuda.max_memory_allocated() / 2**30 if self.cuda else None


def measure(policy, cfg: Config, args, device: torch.device) -> dict:
    """Warm-up iteration, then args.iterations measured ones of train.py's loop."""
    rng = np.random.default_rng(0)
    tasks = envs.tasks("webshop-mini", "train")
    driver = random.Random(0)
    pool = [DemonstratorDriven(envs.make("webshop-mini", "train", seed=i), driver)
            for i in range(cfg.tasks_per_iter * cfg.group_size)]
    embedder = Embedder(device=str(device))
    memory, novelty = TipMemory(), NoveltyCounter(cfg.novelty_threshold)
    optimizer = torch.optim.AdamW(policy.lora_parameters(), lr=cfg.lr, weight_decay=0.0)
    rows = []
    for it in range(args.iterations + 1):   # iteration 0 warms up (kernels, allocator) and is not reported
        batch = [tasks[k] for k in rng.choice(len(tasks), cfg.tasks_per_iter, replace=False)]
        modes = sample_modes(rng, cfg.tasks_per_iter, cfg.p, cfg.q)
        groups = [g for g in range(cfg.tasks_per_iter) for _ in range(cfg.group_size)]
        with Phase(device) as t_roll:
            trajs = rollout(policy, pool, [batch[g] for g in groups], [modes[g] for g in groups], cfg, groups=groups,
                            memory=memory, embedder=embedder, temperature=cfg.temperature, desc=f"iter {it} rollout")
        with Phase(device) as t_refl:
            reflect(policy, trajs, cfg)
            store_tips(memory, embedder, trajs)
        with Phase(device) as t_upd:
            intrinsic_rewards(trajs, novelty, embedder, cfg.intrinsic_coef)
            returns = episode_returns(trajs)
            update_policy(policy, optimizer, trajs, grpo_advantages(returns, groups), cfg)
        generated = sum(len(s) for tr in trajs for kind, s in tr.segments if kind == "action")
        rows.append({"iteration_s": t_roll.seconds + t_refl.seconds + t_upd.seconds, "rollout_s": t_roll.seconds,
                     "reflection_s": t_refl.seconds, "update_s": t_upd.seconds,
                     "generated_tokens_per_s": generated / t_roll.seconds,
                     "peak_gb": {"rollout": t_roll.peak_gb, "reflection": t_refl.peak_gb, "update": t_upd.peak_gb},
                     "episode_steps": float(np.mean([len(tr.rewards) for tr in trajs])),
                     "trajectory_tokens": float(np.mean([len(tr.tokens()[0]) for tr in trajs])),
                     "episodes_with_tips": int(sum(tr.has_tips for tr in trajs))})
        # one line per iteration on stderr, so a run stopped by a time limit still leaves its figures
        print(f"iteration {it}{' (warm-up)' if it == 0 else ''}: {json.dumps(rows[-1])}", file=sys.stderr, flush=True)
    measured = rows[1:] or rows
    result = {"arch": args.arch, "random_weights": True, "device": str(device),
              "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
              "dtype": str(next(policy.model.parameters()).dtype).removeprefix("torch."),
              "parameters_b": round(sum(t.numel() for t in policy.model.parameters()) / 1e9, 3),
              "settings": {k: getattr(args, k) for k in ("tasks_per_iter", "group_size", "action_tokens", "tip_tokens",
                                                         "max_prompt_tokens", "p", "iterations")},
              **{k: float(np.mean([r[k] for r in measured])) for k in
                 ("iteration_s", "rollout_s", "reflection_s", "update_s", "generated_tokens_per_s", "episode_steps",
                  "trajectory_tokens")},
              "peak_gb": {k: max((r["peak_gb"][k] or 0.0) for r in rows) if device.type == "cuda" else None
                          for k in ("rollout", "reflection", "update")},
              "iterations": measured}
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", default="qwen2.5-1.5b", help="a config in configs/ (qwen2.5-1.5b, qwen2.5-3b, tiny-qwen2)")
    p.add_argument("--device", default="auto", help="auto, cuda or cpu")
    p.add_argument("--dtype", default="auto", help="auto (bf16 on a GPU), bfloat16 or float32")
    p.add_argument("--iterations", type=int, default=2, help="iterations measured after one warm-up iteration")
    p.add_argument("--tasks-per-iter", type=int, default=16)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--action-tokens", type=int, default=24, help="tokens of every action (real runs: 10-30)")
    p.add_argument("--tip-tokens", type=int, default=128, help="tokens of every tip")
    p.add_argument("--max-prompt-tokens", type=int, default=4500)
    p.add_argument("--p", type=float, default=0.25, help="memory groups (1 measures the most expensive mix)")
    args = p.parse_args(argv)
    from policy import resolve_device, resolve_dtype
    device = resolve_device(args.device)
    policy = build_policy(args.arch, str(device), resolve_dtype(args.dtype, device), 16, 32)
    cfg = Config(env="webshop-mini", model=args.arch, tasks_per_iter=args.tasks_per_iter, group_size=args.group_size,
                 max_new_tokens=args.action_tokens, tip_max_new_tokens=args.tip_tokens,
                 max_prompt_tokens=args.max_prompt_tokens, p=args.p, temperature=1.0, warm_start="off")
    result = measure(policy, cfg, args, device)
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
