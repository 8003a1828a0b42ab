"""Train an LLM agent with EMPO² (or the GRPO baseline) on a text environment.

    python train.py --env webshop-mini                       # the default model, CPU-sized defaults
    python train.py --env rooms --iterations 20              # the tiny exploration task
    python train.py --env webshop-mini --algo grpo           # the baseline: same code, p=0, no r_int
    python train.py --env scienceworld --task-names find-living-thing
    python train.py --env webshop-mini --model Qwen/Qwen2.5-1.5B-Instruct --tasks-per-iter 16 --group-size 8 \\
        --iterations 200 --eval-episodes 100                 # paper-scale, on a GPU with hub access
    python train.py --env webshop-mini --resume              # continue runs/webshop-mini-empo2-s0
    python train.py --env rooms --name NAME --out runs/sweep-rooms --resume --eval-episodes 100
                                                             # a validation-sweep run, now on the test split

A run folder runs/NAME holds config.json, metrics.jsonl (one line per iteration; with --report-to
tensorboard also tensorboard/), learning_curve.png, samples/ (one transcript and the tips of every
iteration), adapter/ (LoRA, PeftModel.from_pretrained), memory.json, checkpoint.pt (everything --resume
needs) and eval.json (untrained, warm start and trained, no memory). How those files are written is in
runs.py; this file is the algorithm's story: main() runs one training iteration top to bottom.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch

import envs
from empo2 import (MEMORY, PLAIN, Config, add_config_flags, episode_returns, eval_subset, evaluate_policy, grpo_advantages,
                   intrinsic_rewards, make_probe, probe_kl, reflect, rollout, sample_modes, store_tips, tip_information,
                   tip_quality, update_policy)
from memory import Embedder
from runs import MetricsLog, cached_evaluation, open_run, print_eval, resume_state, save_adapter, save_iteration
from sampler import keep_freed_memory
from utils import json_safe, write_atomically
from warm_start import warm_start


def parse_args(argv=None) -> Config:
    """Command-line flags are the Config fields (tasks_per_iter -> --tasks-per-iter); Config.check
    rejects bad settings before any work is done."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_flags(parser)
    cfg = Config(**vars(parser.parse_args(argv)))
    try:
        cfg.check(task_lists=not cfg.resume)   # a resumed run's own config.json was checked when it started
    except ValueError as e:
        parser.error(str(e))
    return cfg


def given_flags(argv=None) -> set[str]:
    """The Config fields set on the command line (a resumed run keeps its own value of the others)."""
    parser = argparse.ArgumentParser(add_help=False)
    add_config_flags(parser)
    for action in parser._actions:
        action.default = argparse.SUPPRESS
    return set(vars(parser.parse_args(argv)))


def iteration_metrics(it: int, trajs, returns: torch.Tensor, cfg: Config, memory, novelty, stats: dict) -> dict:
    """One metrics.jsonl line: returns, success, learning signal, modes as trained, truncation, memory."""
    ext = np.array([tr.ext_return for tr in trajs])
    # groups with no signal: judged on the EXTRINSIC return (novelty noise and penalties always differ)
    per_group = torch.tensor(ext, dtype=torch.float32).view(cfg.tasks_per_iter, cfg.group_size)
    first = trajs[::cfg.group_size]   # one episode per group: its modes
    off = [any(t.scored_without_tips for t in trajs if t.group == tr.group) for tr in first]

    def mean_in_mode(attr: str, kind: str) -> float:   # over the episodes of one rollout mode; NaN if none
        chosen = [getattr(tr, attr) for tr in trajs if tr.rollout_mode == kind]
        return float(np.mean(chosen)) if chosen else float("nan")
    return {"iteration": it, "charts/return": float(returns.mean()), "charts/return_std": float(returns.std()),
            "charts/return_ext": float(ext.mean()), "charts/return_int": float(np.mean([tr.int_return for tr in trajs])),
            "charts/success_rate": float(np.mean([tr.won for tr in trajs])),
            "charts/frac_reward_zero_std": float((per_group.std(dim=1) < 1e-6).float().mean()),
            "charts/frac_return_zero_std": float((returns.view(cfg.tasks_per_iter, cfg.group_size).std(dim=1) < 1e-6)
                                                 .float().mean()),
            "charts/invalid_actions": float(np.mean([tr.invalid_actions for tr in trajs])),
            "charts/valid_action_rate": float(np.mean([s.get("valid", False) for tr in trajs for s in tr.transcript] or [0])),
            "charts/episode_steps": float(np.mean([len(tr.rewards) for tr in trajs])),
            "charts/truncated": int(sum(tr.truncated for tr in trajs)),
            "charts/truncated_plain_frac": mean_in_mode("truncated", PLAIN),
            "charts/truncated_memory_frac": mean_in_mode("truncated", MEMORY),
            "charts/tokens_generated": sum(len(s) for tr in trajs for kind, s in tr.segments if kind == "action"),
            "modes/plain": sum(tr.rollout_mode == PLAIN for tr in first),
            "modes/on_policy_tips": sum(tr.rollout_mode == MEMORY and not trained_off for tr, trained_off in zip(first, off)),
            "modes/off_policy": sum(off),   # memory groups trained off-policy: those whose episodes saw tips
            # memory-mode vs plain rollouts of the same iteration: does reading tips help?
            "charts/success_plain": mean_in_mode("won", PLAIN), "charts/success_memory": mean_in_mode("won", MEMORY),
            "memory/episodes_with_tips": int(sum(tr.has_tips for tr in trajs)), **tip_quality(trajs),
            **tip_information(cfg.env, [(tr.task, tr.tip, tr.ext_return) for tr in trajs if tr.tip], it,
                              envs.settings(cfg.env, cfg.max_steps, cfg.task_names)[0]),
            "memory/size": len(memory), "novelty/states": len(novelty), **stats}


def task_lists(cfg: Config) -> tuple[list, list, list]:
    """(training, validation, held-out test tasks): --train-tasks spread over the train split; --val-episodes
    over the val split (when --val-every is set); --eval-episodes spread over the test split, cycled
    through when the split is smaller."""
    make_kwargs, task_kwargs = envs.settings(cfg.env, cfg.max_steps, cfg.task_names)
    train_tasks = envs.tasks(cfg.env, "train", **task_kwargs)
    if cfg.train_tasks:
        train_tasks = eval_subset(train_tasks, cfg.train_tasks)
    test_tasks = envs.tasks(cfg.env, "test", **task_kwargs)
    eval_tasks = eval_subset(test_tasks, cfg.eval_episodes)
    eval_tasks += [test_tasks[k % len(test_tasks)] for k in range(len(eval_tasks), cfg.eval_episodes)]
    val_tasks = eval_subset(envs.tasks(cfg.env, "val", **task_kwargs), cfg.val_episodes) if cfg.val_every else []
    return train_tasks, val_tasks, eval_tasks


def starting_point(run: Path, cfg: Config, policy, pool, eval_tasks, val_tasks, evals: dict, start: int,
                   reference: dict | None = None) -> None:
    """The untrained model's held-out evaluation, then (first start only) the warm start and its evaluations
    (test split; validation split too with --val-every, so choices can be judged by paired differences there).
    A resumed run (its policy holds trained weights) evaluates what it lacks with the weights each evaluation
    is of: --eval-episodes given to a run that trained with 0."""
    resumed = start > 0
    if eval_tasks and "untrained" not in evals:  # with the example turns: without them it writes few valid actions
        # a fresh adapter adds exactly 0 (B = 0); a resumed run is evaluated through an all-zero adapter
        zero = {n: torch.zeros_like(w) for n, w in policy.lora_state().items()} if resumed else None
        with policy.using_lora(zero) if resumed else contextlib.nullcontext():
            evals["untrained"] = cached_evaluation(policy, pool, eval_tasks, dataclasses.replace(cfg, demo="on"),
                                                   "untrained")
        write_atomically(run / "eval.json", json.dumps(json_safe(evals), indent=1))
        print_eval("untrained", evals["untrained"], cfg)
    if not cfg.uses_warm_start or (resumed and reference is None):
        return
    if resumed:
        ws = json.loads((run / "warm_start.json").read_text())
    else:
        ws = warm_start(policy, cfg, envs.settings(cfg.env, cfg.max_steps, cfg.task_names)[0])
        write_atomically(run / "warm_start.json", json.dumps(json_safe(ws), indent=1))
        save_adapter(run, policy)  # evaluate.py --run can use it, even with --iterations 0
    with policy.using_lora(reference) if resumed else contextlib.nullcontext():
        for key, tasks, split in (("warm_start", eval_tasks, "test"), ("warm_start_val", val_tasks, "val")):
            if tasks and key not in evals:
                evals[key] = cached_evaluation(policy, pool, tasks, cfg, Path(ws["folder"]).name)
                if key == "warm_start":
                    evals[key]["demonstrator"] = ws["demonstrator"]
                write_atomically(run / "eval.json", json.dumps(json_safe(evals), indent=1))
                print_eval("warm start", evals[key], cfg, split)


def final_evaluation(run: Path, cfg: Config, policy, pool, eval_tasks, evals: dict) -> None:
    if eval_tasks and "trained" not in evals:
        if cfg.iterations == 0 and "warm_start" in evals:  # no iteration: the same weights, seed and tasks
            evals["trained"] = {**evals["warm_start"], "cached": True}
        else:
            evals["trained"] = evaluate_policy(policy, pool, eval_tasks, cfg, desc="eval trained", seed=cfg.seed)
        evals["trained"]["iterations"] = cfg.iterations
        write_atomically(run / "eval.json", json.dumps(json_safe(evals), indent=1))
    for key, label in (("untrained", "untrained"), ("warm_start", "warm start"), ("trained", "trained")):
        if key in evals:
            print_eval(label, evals[key], cfg)
    if "warm_start" in evals and "trained" in evals and cfg.iterations > 0:
        # the same goals, evaluation seed and temperature before and after: the paired interval applies
        from evaluate import paired_goal_difference
        score, won = (paired_goal_difference(evals["warm_start"]["episodes"], evals["trained"]["episodes"], key)
                      for key in ("reward", "won"))
        (lo, hi), (wlo, whi) = score["difference_ci95"], won["difference_ci95"]
        print(f"trained - warm start, paired over the same {score['n_goals']} goals (95 % bootstrap CI): score "
              f"{score['difference']:+.1f} [{lo:+.1f}, {hi:+.1f}], success {won['difference']:+.1f} [{wlo:+.1f}, {whi:+.1f}] "
              "points")
        if lo <= 0 <= hi:   # the score interval holds 0
            print(f"{cfg.iterations} iteration(s) of {cfg.tasks_per_iter * cfg.group_size} episodes did not move the policy "
                  "measurably; README.md, 'The main command', gives a run that does")


def print_iteration(row: dict, memory, cfg: Config) -> None:
    val = (f" | val success {row['val/success_rate']:.0f} % valid {row['val/valid_action_rate']:.0f} %"
           if "val/success_rate" in row else "")
    print(f"iter {row['iteration']:3d} | return {row['charts/return']:.3f} (ext {row['charts/return_ext']:.3f}) | "
          f"success {100 * row['charts/success_rate']:.0f} % | no-signal groups {row['charts/frac_reward_zero_std']:.2f} | "
          f"valid {row['charts/valid_action_rate']:.2f} | loss {row['losses/policy_loss']:+.4f} | "
          f"ent {row['losses/entropy']:.2f} | ratio {row['losses/ratio_min']:.2f}-{row['losses/ratio_max']:.2f} "
          f"clip {row['losses/clip_frac']:.3f} | kl {row['losses/approx_kl']:.4f} | mem {len(memory)}{val} | "
          f"{row['time/iteration_s']:.0f}s", flush=True)
    # judged on validation (eval temperature): at the training temperature the warm start itself is near 90 %
    rate = row.get("val/valid_action_rate")
    if rate is not None and rate < 100 * cfg.valid_alarm:
        print(f"WARNING: validation valid-action rate {rate:.1f} % is below --valid-alarm {100 * cfg.valid_alarm:.0f} %: "
              f"the policy is forgetting how to act (lower --lr, or add --kl-coef)", file=sys.stderr, flush=True)


def seed_everything(seed: int) -> None:
    """Python, NumPy and torch seeded for the run; each iteration then reseeds its own draws (seed_iteration)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def seed_iteration(seed: int, it: int) -> np.random.Generator:
    """Iteration it's draws: torch's sampling reseeded, and the returned generator for its tasks, modes and
    mini-batches, from the run's seed and it only, not from what earlier iterations drew. So EMPO² and GRPO
    (or an ablation) of one seed train on the same tasks at every iteration, and their paired difference
    does not carry the noise of different task sequences (common random numbers)."""
    rng = np.random.default_rng([seed, it])
    torch.manual_seed(int(rng.integers(2**63)))
    return rng


def build(cfg: Config):
    """(environment pool, policy, embedder): one environment per rollout of a batch, the base model with
    a fresh LoRA adapter, and the sentence embedder where memory or novelty need it."""
    from policy import load_policy
    make_kwargs = envs.settings(cfg.env, cfg.max_steps, cfg.task_names)[0]
    pool = [envs.make(cfg.env, split="train", seed=cfg.seed + i, **make_kwargs)
            for i in range(cfg.tasks_per_iter * cfg.group_size)]
    policy = load_policy(cfg.model, cfg.dtype, cfg.device, cfg.lora_r, cfg.lora_alpha)
    embedder = Embedder(device=str(policy.device)) if (cfg.p > 0 or cfg.intrinsic_coef > 0) else None
    return pool, policy, embedder


def validate(run: Path, cfg: Config, policy, pool, val_tasks, evals: dict, it: int) -> dict:
    """The validation split (no memory, eval temperature) every --val-every iterations and after the last;
    the last one is kept in eval.json: the figure a choice of settings is judged by."""
    t0 = time.time()
    val = evaluate_policy(policy, pool, val_tasks, cfg, desc="validation", seed=cfg.seed)
    if it + 1 == cfg.iterations:
        evals["trained_val"] = {**val, "iterations": cfg.iterations}
        write_atomically(run / "eval.json", json.dumps(json_safe(evals), indent=1))
    return {"val/score": val["score"], "val/success_rate": val["success_rate"],
            "val/valid_action_rate": val["valid_action_rate"], "time/val_s": time.time() - t0}


def main(argv=None) -> int:
    cfg, run = open_run(parse_args(argv), given_flags(argv))
    keep_freed_memory()   # speed only (sampler.py): ~10 % off a decode step on Linux
    seed_everything(cfg.seed)
    train_tasks, val_tasks, eval_tasks = task_lists(cfg)
    pool, policy, embedder = build(cfg)
    start, evals, ckpt, rows, memory, novelty = resume_state(run, cfg, policy)
    starting_point(run, cfg, policy, pool, eval_tasks, val_tasks, evals, start, ckpt.get("reference") if ckpt else None)
    reference = ckpt["reference"] if ckpt and "reference" in ckpt else policy.lora_state()  # KL reference: the warm start
    probe = ckpt.get("probe", []) if ckpt else []
    optimizer = torch.optim.AdamW(policy.lora_parameters(), lr=cfg.lr, weight_decay=0.0)
    if ckpt is not None:
        optimizer.load_state_dict(ckpt["optimizer"])
    log = MetricsLog(run, cfg.report_to)
    try:
        for it in range(start, cfg.iterations):
            t0 = time.time()
            # steps 1-2: a batch of tasks, G rollouts each; rollout mode (and update mode) sampled per group
            it_rng = seed_iteration(cfg.seed, it)
            batch = [train_tasks[k] for k in it_rng.choice(len(train_tasks), cfg.tasks_per_iter, replace=False)]
            modes = sample_modes(it_rng, cfg.tasks_per_iter, cfg.p, cfg.q)
            groups = [g for g in range(cfg.tasks_per_iter) for _ in range(cfg.group_size)]
            with policy.sampling(keep_finished=cfg.p > 0) as sampler:  # reflection continues the rollout's KV cache
                trajs = rollout(policy, pool, [batch[g] for g in groups], [modes[g] for g in groups], cfg, groups=groups,
                                memory=memory, embedder=embedder, temperature=cfg.temperature, desc=f"iter {it} rollout",
                                sampler=sampler)
                t_rollout = time.time() - t0
                # step 3: every episode that acted writes a tip (skipped when no rollout can read one, p = 0)
                acted, stored = [tr for tr in trajs if tr.rewards], 0
                if cfg.p > 0 and acted:
                    reflect(policy, acted, cfg, sampler)
                    stored = store_tips(memory, embedder, acted)
            t_reflect = time.time() - t0 - t_rollout
            # step 4: intrinsic reward r_int = c / n for the states each episode visited
            if cfg.intrinsic_coef > 0:
                intrinsic_rewards(trajs, novelty, embedder, cfg.intrinsic_coef)
            # step 5: return = extrinsic + intrinsic - invalid-action penalty, GRPO advantage per group
            returns = episode_returns(trajs, cfg.invalid_penalty)
            advantages = grpo_advantages(returns, groups, cfg.adv_std_floor)
            # steps 6-9: the hybrid update (on-policy, on-policy with tips, off-policy without them), mini-batch PPO
            if not probe and start == 0:  # the warm start's own episodes, to measure how far RL moves from it
                probe = make_probe(policy, acted, reference, cfg)
            stats = update_policy(policy, optimizer, trajs, advantages, cfg, reference if cfg.kl_coef > 0 else None, it_rng)
            stats["losses/approx_kl"] = probe_kl(policy, probe, cfg)
            t_update = time.time() - t0 - t_rollout - t_reflect
            if cfg.val_every and ((it + 1) % cfg.val_every == 0 or it + 1 == cfg.iterations):
                stats.update(validate(run, cfg, policy, pool, val_tasks, evals, it))
            row = iteration_metrics(it, trajs, returns, cfg, memory, novelty, stats)
            row.update({"memory/stored": stored, "time/rollout_s": t_rollout, "time/reflect_s": t_reflect,
                        "time/update_s": t_update, "time/iteration_s": time.time() - t0,
                        "charts/tokens_per_s": row["charts/tokens_generated"] / max(t_rollout, 1e-9)})
            rows.append(row)
            save_iteration(run, rows, log, trajs, policy, optimizer, memory, novelty, cfg, reference, probe)
            print_iteration(row, memory, cfg)
    except KeyboardInterrupt:
        print(f"\ninterrupted: the last finished iteration is saved; continue with: "
              f"python train.py --env {cfg.env} --name {run.name} --out {cfg.out} --resume", file=sys.stderr)
        return 130
    finally:
        log.close()
    final_evaluation(run, cfg, policy, pool, eval_tasks, evals)
    for env in pool:
        env.close()
    print(f"run saved in {run}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
