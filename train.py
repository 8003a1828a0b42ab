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

A run folder runs/NAME holds config.json, metrics.jsonl (one line per iteration), learning_curve.png,
samples/ (one transcript and the tips of every iteration), adapter/ (LoRA, PeftModel.from_pretrained),
memory.json, checkpoint.pt (everything --resume needs) and eval.json (untrained vs trained, no memory).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import random
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch

import envs
from empo2 import (MEMORY, PLAIN, Config, add_config_flags, episode_returns, eval_subset, evaluate_policy, grpo_advantages,
                   intrinsic_rewards, json_safe, make_probe, probe_kl, reflect, rollout, sample_modes, store_tips,
                   update_policy)
from memory import Embedder, NoveltyCounter, TipMemory, write_atomically
from warm_start import source_hash, warm_start


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


def rng_state(rng: np.random.Generator) -> dict:
    return {"torch": torch.get_rng_state(), "numpy": rng.bit_generator.state, "python": random.getstate()}


def set_rng_state(rng: np.random.Generator, state: dict) -> None:
    torch.set_rng_state(state["torch"])
    rng.bit_generator.state = state["numpy"]
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))


def save_checkpoint(run: Path, iteration: int, policy, optimizer, memory, novelty, rng, cfg: Config,
                    reference: dict, probe: list) -> None:
    """One plain dict, written to a temp file and renamed: a kill mid-save keeps the previous one."""
    from peft import get_peft_model_state_dict
    ckpt = {"iteration": iteration, "config": dataclasses.asdict(cfg),
            "lora": {k: v.detach().cpu() for k, v in get_peft_model_state_dict(policy.model).items()},
            "reference": {k: v.cpu() for k, v in reference.items()}, "probe": probe,
            "optimizer": optimizer.state_dict(), "rng": rng_state(rng),
            "memory": json.dumps(memory.to_dict()), "novelty": json.dumps(novelty.to_dict())}
    tmp = run / "checkpoint.pt.tmp"
    torch.save(ckpt, tmp)
    tmp.replace(run / "checkpoint.pt")


def load_checkpoint(run: Path, policy, rng) -> dict:
    """Loads the LoRA weights and the RNG state; returns the checkpoint (iteration, optimizer, memory, novelty)."""
    from peft import set_peft_model_state_dict
    path = run / "checkpoint.pt"
    try:
        ckpt = torch.load(path, weights_only=True)
        set_peft_model_state_dict(policy.model, ckpt["lora"])
        set_rng_state(rng, ckpt["rng"])
        ckpt["memory"] = TipMemory.from_dict(json.loads(ckpt["memory"]), f"checkpoint {path}: memory")
        ckpt["novelty"] = NoveltyCounter.from_dict(json.loads(ckpt["novelty"]), f"checkpoint {path}: novelty")
    except FileNotFoundError:
        raise FileNotFoundError(f"--resume: no checkpoint at {path}") from None
    except (RuntimeError, KeyError, EOFError, ValueError) as e:
        raise RuntimeError(f"checkpoint {path} is corrupt or truncated ({e}); "
                           f"the run cannot resume from it") from None
    return ckpt


def print_eval(label: str, e: dict, cfg: Config, split: str = "test") -> None:
    cached = " (cached)" if e.get("cached") else ""
    print(f"{label:11s} ({split} split, no memory, T={cfg.eval_temperature}): score {e['score']:.1f} ± {e['score_ci95']:.1f}, "
          f"success {e['success_rate']:.1f} ± {e['success_ci95']:.1f} %, valid actions {e['valid_action_rate']:.0f} %, "
          f"{e['mean_steps']:.1f} steps, {len(e['episodes'])} episodes{cached}", flush=True)


def cached_evaluation(policy, pool, tasks, cfg: Config, weights: str) -> dict:
    """evaluate_policy with seed cfg.seed, kept on disk for weights that many runs share (the untrained
    model, a cached warm start): the same weights, tasks, settings, seed and code give the same episodes,
    so EMPO² and GRPO runs of one seed evaluate their common start once."""
    import hashlib

    import empo2
    import policy as policy_module
    code = source_hash(envs, envs.module(cfg.env), empo2, policy_module)
    key = {"weights": weights, "model": cfg.model, "dtype": str(next(policy.model.parameters()).dtype), "env": cfg.env,
           "task_names": cfg.task_names, "tasks": [t.task_id for t in tasks], "seed": cfg.seed,
           **{k: getattr(cfg, k) for k in ("eval_temperature", "max_steps", "max_new_tokens", "max_prompt_tokens", "demo")},
           "batch": len(pool), "code": code}
    from policy import cache_dir
    path = cache_dir() / "evals" / (hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20] + ".json")
    try:
        saved = json.loads(path.read_text())
        if saved.get("key") == key:
            return {**saved["result"], "cached": True}
    except (OSError, ValueError):
        pass  # missing or unreadable: evaluate
    result = evaluate_policy(policy, pool, tasks, cfg, desc=f"eval {weights[:20]}", seed=cfg.seed)
    if weights:
        write_atomically(path, json.dumps(json_safe({"key": key, "result": result})))
    return {**result, "cached": False}


def plot_learning_curve(run: Path, rows: list[dict]) -> None:
    from matplotlib.figure import Figure  # no pyplot: leaves a notebook's plotting backend alone
    it = [r["iteration"] for r in rows]
    fig = Figure(figsize=(13, 3.6))
    axes = fig.subplots(1, 3)
    axes[0].plot(it, [r["reward"] for r in rows], marker="o", label="return (ext + int)")
    axes[0].plot(it, [r["reward_ext"] for r in rows], marker=".", label="extrinsic return")
    axes[0].set_title("mean return")
    axes[1].plot(it, [100 * r["success_rate"] for r in rows], marker="o", color="C2")
    axes[1].set_title("success rate (%)")
    axes[2].plot(it, [r["frac_reward_zero_std"] for r in rows], marker="o", color="C3", label="groups with no signal")
    axes[2].plot(it, [r["entropy"] for r in rows], marker=".", color="C4", label="entropy")
    axes[2].set_title("exploration")
    for ax in axes:
        ax.set_xlabel("iteration")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    axes[2].legend(fontsize=8)
    fig.suptitle(run.name)
    fig.tight_layout()
    tmp = run / "learning_curve.tmp.png"
    fig.savefig(tmp, dpi=100)
    tmp.replace(run / "learning_curve.png")


def write_sample(run: Path, iteration: int, trajs) -> None:
    """A readable transcript of one episode of the iteration and every tip written."""
    tr = max(trajs, key=lambda t: (t.ext_return, t.has_tips))  # the best episode, preferring one that saw tips
    lines = [f"# iteration {iteration}: task {tr.task.task_id} ({tr.rollout_mode} rollout, {tr.update_mode} update)",
             f"instruction: {tr.task.instruction}", f"return: {tr.ext_return:.3f} extrinsic + {tr.int_return:.3f} intrinsic", ""]
    for k, step in enumerate(tr.transcript):
        lines += [f"--- step {k}", f"observation: {step['observation']}"]
        if step["tips"]:
            lines += ["tips shown:"] + [f"  - {t}" for t in step["tips"]]
        lines += [f"action: {step.get('action', '')!r}  (valid={step.get('valid')}, reward={step.get('reward')})"]
    lines += ["", f"final observation: {tr.final_obs}", "", "# tips written this iteration"]
    lines += [f"- [{t.task.task_id}, return {t.ext_return:.2f}] {t.tip}" for t in trajs if t.tip]
    write_atomically(run / "samples" / f"iter_{iteration:04d}.txt", "\n".join(lines) + "\n")


def iteration_metrics(it: int, trajs, returns: torch.Tensor, cfg: Config, memory, novelty, stats: dict) -> dict:
    """One metrics.jsonl line: returns, success, learning signal, modes as trained, truncation, memory."""
    ext = np.array([tr.ext_return for tr in trajs])
    # groups with no signal: judged on the EXTRINSIC return (novelty noise and penalties always differ)
    per_group = torch.tensor(ext, dtype=torch.float32).view(cfg.tasks_per_iter, cfg.group_size)
    first = trajs[::cfg.group_size]   # one episode per group: its modes
    off = [any(t.scored_without_tips for t in trajs if t.group == tr.group) for tr in first]

    def truncated(kind):
        chosen = [tr for tr in trajs if tr.rollout_mode == kind]
        return float(np.mean([tr.truncated for tr in chosen])) if chosen else float("nan")
    return {"iteration": it, "reward": float(returns.mean()), "reward_std": float(returns.std()),
            "reward_ext": float(ext.mean()), "reward_int": float(np.mean([tr.int_return for tr in trajs])),
            "success_rate": float(np.mean([tr.won for tr in trajs])),
            "frac_reward_zero_std": float((per_group.std(dim=1) < 1e-6).float().mean()),
            "frac_return_zero_std": float((returns.view(cfg.tasks_per_iter, cfg.group_size).std(dim=1) < 1e-6).float().mean()),
            "invalid_actions": float(np.mean([tr.invalid_actions for tr in trajs])),
            "valid_action_rate": float(np.mean([s.get("valid", False) for tr in trajs for s in tr.transcript] or [0])),
            "episode_steps": float(np.mean([len(tr.rewards) for tr in trajs])),
            "truncated": int(sum(tr.truncated for tr in trajs)),
            "truncated/plain_frac": truncated(PLAIN), "truncated/memory_frac": truncated(MEMORY),
            "modes/plain": sum(tr.rollout_mode == PLAIN for tr in first),
            "modes/on_policy_tips": sum(tr.rollout_mode == MEMORY and not o for tr, o in zip(first, off)),
            "modes/off_policy": sum(off),   # memory groups trained off-policy: those whose episodes saw tips
            "episodes_with_tips": int(sum(tr.has_tips for tr in trajs)),
            "memory/size": len(memory), "novelty/states": len(novelty), **stats,
            "tokens_generated": sum(len(s) for tr in trajs for kind, s in tr.segments if kind == "action")}


def save_iteration(run: Path, rows: list[dict], trajs, policy, optimizer, memory, novelty, rng, cfg: Config,
                   reference: dict, probe: list) -> None:
    """Every file of the iteration first, the checkpoint last: --resume restarts after the last checkpoint."""
    it = rows[-1]["iteration"]
    with open(run / "metrics.jsonl", "a") as f:
        f.write(json.dumps(json_safe(rows[-1])) + "\n")
    write_sample(run, it, trajs)
    memory.save(run / "memory.json")
    save_adapter(run, policy)
    plot_learning_curve(run, rows)
    save_checkpoint(run, it + 1, policy, optimizer, memory, novelty, rng, cfg, reference, probe)


def save_adapter(run: Path, policy) -> None:
    tmp = run / "adapter.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    policy.model.save_pretrained(tmp)
    shutil.rmtree(run / "adapter", ignore_errors=True)
    tmp.replace(run / "adapter")


RESUME_MAY_CHANGE = ("iterations", "eval_episodes")  # neither changes what training does up to the last checkpoint


def open_run(cfg: Config, given: set[str] = frozenset()) -> tuple[Config, Path]:
    """The run folder and its config.json; with --resume the saved config, where only the given flags of
    RESUME_MAY_CHANGE replace the saved values (more iterations; a test evaluation after a validation sweep)."""
    run = Path(cfg.out) / (cfg.name or f"{cfg.env}-{cfg.algo}-s{cfg.seed}")
    if cfg.resume:
        saved = json.loads((run / "config.json").read_text()) if (run / "config.json").exists() else None
        if saved is None:
            sys.exit(f"--resume: {run} has no config.json; nothing to resume")
        ignored = sorted(k for k in given - set(RESUME_MAY_CHANGE) - {"resume", "name", "out"} if getattr(cfg, k) != saved.get(k))
        if ignored:
            print(f"--resume: the run keeps its own settings; ignored: {', '.join('--' + k.replace('_', '-') for k in ignored)}",
                  file=sys.stderr)
        saved.update(resume=True, out=cfg.out, name=run.name,   # where the run is now (a copied folder too)
                     **{k: getattr(cfg, k) for k in RESUME_MAY_CHANGE if k in given})
        cfg = Config(**saved)
    elif (run / "checkpoint.pt").exists():
        sys.exit(f"{run} already holds a run: pass --resume to continue it, or --name for a new one")
    run.mkdir(parents=True, exist_ok=True)
    write_atomically(run / "config.json", json.dumps(dataclasses.asdict(cfg), indent=2))
    return cfg, run


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


def resume_state(run: Path, cfg: Config, policy, rng, memory, novelty) -> tuple[int, dict, dict | None, list, TipMemory,
                                                                               NoveltyCounter]:
    """(first iteration, evals, checkpoint, metrics rows, memory, novelty): where a run continues."""
    start, evals, ckpt = 0, {}, None
    if cfg.resume and (run / "checkpoint.pt").exists():
        ckpt = load_checkpoint(run, policy, rng)
        start, memory, novelty = ckpt["iteration"], ckpt["memory"], ckpt["novelty"]
        evals = json.loads((run / "eval.json").read_text()) if (run / "eval.json").exists() else {}
        print(f"resumed {run} at iteration {start}")
    path = run / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    rows = [r for r in rows if r["iteration"] < start]  # drop lines of an iteration that did not checkpoint
    write_atomically(path, "".join(json.dumps(r) + "\n" for r in rows))
    return start, evals, ckpt, rows, memory, novelty


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
              f"points{'' if lo > 0 or hi < 0 else ' (the interval holds 0: no measurable change)'}")
        if lo <= 0 <= hi and cfg.iterations < 6:
            print(f"{cfg.iterations} iteration(s) of {cfg.tasks_per_iter * cfg.group_size} episodes are a smoke run, too few to "
                  "move the policy measurably; README.md, 'Updates with a controlled size', gives runs that do")


def print_iteration(row: dict, memory, cfg: Config) -> None:
    val = (f" | val success {row['val/success_rate']:.0f} % valid {row['val/valid_action_rate']:.0f} %"
           if "val/success_rate" in row else "")
    print(f"iter {row['iteration']:3d} | return {row['reward']:.3f} (ext {row['reward_ext']:.3f}) | success "
          f"{100 * row['success_rate']:.0f} % | no-signal groups {row['frac_reward_zero_std']:.2f} | "
          f"valid {row['valid_action_rate']:.2f} | loss {row['loss']:+.4f} | ent {row['entropy']:.2f} | "
          f"ratio {row['update/ratio_min']:.2f}-{row['update/ratio_max']:.2f} clip {row['clip_ratio']:.3f} | "
          f"kl {row['kl/probe']:.4f} | mem {len(memory)}{val} | {row['time/iteration_s']:.0f}s", flush=True)
    # judged on validation (eval temperature): at the training temperature the warm start itself is near 90 %
    rate = row.get("val/valid_action_rate")
    if rate is not None and rate < 100 * cfg.valid_alarm:
        print(f"WARNING: validation valid-action rate {rate:.1f} % is below --valid-alarm {100 * cfg.valid_alarm:.0f} %: "
              f"the policy is forgetting how to act (lower --lr, or add --kl-coef)", file=sys.stderr, flush=True)


def main(argv=None) -> int:
    cfg, run = open_run(parse_args(argv), given_flags(argv))
    from policy import load_policy
    random.seed(cfg.seed)
    np.random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    rng = np.random.default_rng(cfg.seed)
    train_tasks, val_tasks, eval_tasks = task_lists(cfg)
    make_kwargs = envs.settings(cfg.env, cfg.max_steps, cfg.task_names)[0]
    pool = [envs.make(cfg.env, split="train", seed=cfg.seed + i, **make_kwargs)
            for i in range(cfg.tasks_per_iter * cfg.group_size)]
    policy = load_policy(cfg.model, cfg.dtype, cfg.device, cfg.lora_r, cfg.lora_alpha)
    embedder = Embedder(device=str(policy.device)) if (cfg.p > 0 or cfg.intrinsic_coef > 0) else None
    start, evals, ckpt, rows, memory, novelty = resume_state(
        run, cfg, policy, rng, TipMemory(cfg.memory_threshold, cfg.memory_top_k, cfg.memory_capacity),
        NoveltyCounter(cfg.novelty_threshold))
    starting_point(run, cfg, policy, pool, eval_tasks, val_tasks, evals, start, ckpt.get("reference") if ckpt else None)
    # the reference policy (KL penalty, KL probe) is where RL starts: the warm start
    reference = ckpt["reference"] if ckpt and "reference" in ckpt else policy.lora_state()
    probe = ckpt.get("probe", []) if ckpt else []
    optimizer = torch.optim.AdamW(policy.lora_parameters(), lr=cfg.lr, weight_decay=0.0)
    if ckpt is not None:
        optimizer.load_state_dict(ckpt["optimizer"])
    try:
        for it in range(start, cfg.iterations):
            t0 = time.time()
            # steps 1-2: a batch of tasks, G rollouts each; rollout mode (and update mode) sampled per group
            batch = [train_tasks[k] for k in rng.choice(len(train_tasks), cfg.tasks_per_iter, replace=False)]
            modes = sample_modes(rng, cfg.tasks_per_iter, cfg.p, cfg.q)
            groups = [g for g in range(cfg.tasks_per_iter) for _ in range(cfg.group_size)]
            trajs = rollout(policy, pool, [batch[g] for g in groups], [modes[g] for g in groups], cfg, groups=groups,
                            memory=memory, embedder=embedder, temperature=cfg.temperature, desc=f"iter {it} rollout")
            t_rollout = time.time() - t0
            # step 3: every episode that acted writes a tip (skipped when no rollout can read one, p = 0)
            acted, stored = [tr for tr in trajs if tr.rewards], 0
            if cfg.p > 0 and acted:
                reflect(policy, acted, cfg)
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
            stats = update_policy(policy, optimizer, trajs, advantages, cfg, reference if cfg.kl_coef > 0 else None, rng)
            stats["kl/probe"] = probe_kl(policy, probe, cfg)
            t_update = time.time() - t0 - t_rollout - t_reflect
            if cfg.val_every and ((it + 1) % cfg.val_every == 0 or it + 1 == cfg.iterations):
                val = evaluate_policy(policy, pool, val_tasks, cfg, desc="validation", seed=cfg.seed)
                if it + 1 == cfg.iterations:   # the validation figure a choice of settings is judged by
                    evals["trained_val"] = {**val, "iterations": cfg.iterations}
                    write_atomically(run / "eval.json", json.dumps(json_safe(evals), indent=1))
                stats.update({"val/score": val["score"], "val/success_rate": val["success_rate"],
                              "val/valid_action_rate": val["valid_action_rate"], "time/val_s": time.time() - t0 - t_rollout
                              - t_reflect - t_update})

            row = iteration_metrics(it, trajs, returns, cfg, memory, novelty, stats)
            row.update({"memory/stored": stored, "time/rollout_s": t_rollout, "time/reflect_s": t_reflect,
                        "time/update_s": t_update, "time/iteration_s": time.time() - t0,
                        "tokens_per_s": row["tokens_generated"] / max(t_rollout, 1e-9)})
            rows.append(row)
            save_iteration(run, rows, trajs, policy, optimizer, memory, novelty, rng, cfg, reference, probe)
            print_iteration(row, memory, cfg)
    except KeyboardInterrupt:
        print(f"\ninterrupted: the last finished iteration is saved; continue with: "
              f"python train.py --env {cfg.env} --name {run.name} --out {cfg.out} --resume", file=sys.stderr)
        return 130
    final_evaluation(run, cfg, policy, pool, eval_tasks, evals)
    for env in pool:
        env.close()
    print(f"run saved in {run}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
