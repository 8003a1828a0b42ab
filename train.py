"""Train an LLM agent with EMPO² (or the GRPO baseline) on a text environment.

    python train.py --env webshop-mini                       # the default model, CPU-sized defaults
    python train.py --env rooms --iterations 20              # the tiny exploration task
    python train.py --env webshop-mini --algo grpo           # the baseline: same code, p=0, no r_int
    python train.py --env scienceworld --task-names find-living-thing
    python train.py --env webshop-mini --model Qwen/Qwen2.5-1.5B-Instruct --tasks-per-iter 16 --group-size 8 \\
        --iterations 200 --eval-episodes 100                 # paper-scale, on a GPU with hub access
    python train.py --env webshop-mini --resume              # continue runs/webshop-mini-empo2-s0

A run folder runs/NAME holds config.json, metrics.jsonl (one line per iteration), learning_curve.png,
samples/ (one transcript and the tips of every iteration), adapter/ (LoRA, PeftModel.from_pretrained),
memory.json, checkpoint.pt (everything --resume needs) and eval.json (untrained vs trained, no memory).
"""
from __future__ import annotations

import argparse
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
from empo2 import (Config, episode_returns, eval_subset, evaluate_policy, grpo_advantages, json_safe, reflect, rollout, sample_modes, store_tips,
                   update_policy)
from memory import Embedder, NoveltyCounter, TipMemory, write_atomically


def parse_args(argv=None) -> Config:
    """Command-line flags are the Config fields (tasks_per_iter -> --tasks-per-iter)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for f in dataclasses.fields(Config):
        flag = "--" + f.name.replace("_", "-")
        if f.type in ("bool", bool):  # --demo / --no-demo for flags that default to on
            action = argparse.BooleanOptionalAction if f.default else "store_true"
            parser.add_argument(flag, action=action, default=f.default, help=f.metadata.get("help"))
        else:
            kind = {"int": int, "float": float, "str": str}[f.type if isinstance(f.type, str) else f.type.__name__]
            parser.add_argument(flag, type=kind, default=f.default, help=f"{f.metadata.get('help')} (default: {f.default})")
    args = parser.parse_args(argv)
    if args.env not in envs.ENV_NAMES:
        parser.error(f"unknown --env {args.env!r}; valid environments: {', '.join(envs.ENV_NAMES)}")
    if args.algo not in ("empo2", "grpo"):
        parser.error("--algo must be empo2 or grpo")
    for name in ("p", "q"):
        if not 0.0 <= getattr(args, name) <= 1.0:
            parser.error(f"--{name} must be in [0, 1], got {getattr(args, name)}")
    if args.group_size < 2:
        parser.error("--group-size must be at least 2: GRPO compares rollouts within a group")
    for name in ("iterations", "tasks_per_iter", "max_new_tokens", "tip_max_new_tokens"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.train_tasks and args.train_tasks < args.tasks_per_iter:
        parser.error(f"--train-tasks {args.train_tasks} is fewer than --tasks-per-iter {args.tasks_per_iter}")
    if args.intrinsic_coef < 0 or args.lr <= 0 or args.eval_episodes < 0 or args.max_steps < 0:
        parser.error("--intrinsic-coef, --eval-episodes and --max-steps must be >= 0, --lr > 0")
    if args.no_off_policy and args.no_memory_on_policy:
        parser.error("--no-off-policy and --no-memory-on-policy together leave memory groups no update")
    return Config(**vars(args))


def env_kwargs(cfg: Config) -> tuple[dict, dict]:
    """(kwargs of envs.make, kwargs of envs.tasks) for this config."""
    kwargs = {"max_steps": cfg.max_steps} if cfg.max_steps else {}
    if cfg.env == "scienceworld" and cfg.task_names:
        return kwargs, {"task_names": cfg.task_names.split(",")}
    return kwargs, {}


def rng_state(rng: np.random.Generator) -> dict:
    return {"torch": torch.get_rng_state(), "numpy": rng.bit_generator.state, "python": random.getstate()}


def set_rng_state(rng: np.random.Generator, state: dict) -> None:
    torch.set_rng_state(state["torch"])
    rng.bit_generator.state = state["numpy"]
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))


def save_checkpoint(run: Path, iteration: int, policy, optimizer, memory, novelty, rng, cfg: Config) -> None:
    """One plain dict, written to a temp file and renamed: a kill mid-save keeps the previous one."""
    from peft import get_peft_model_state_dict
    ckpt = {"iteration": iteration, "config": dataclasses.asdict(cfg),
            "lora": {k: v.detach().cpu() for k, v in get_peft_model_state_dict(policy.model).items()},
            "optimizer": optimizer.state_dict(), "rng": rng_state(rng),
            "memory": _json_of(memory), "novelty": _json_of(novelty)}
    tmp = run / "checkpoint.pt.tmp"
    torch.save(ckpt, tmp)
    tmp.replace(run / "checkpoint.pt")


def _json_of(obj) -> str:
    """The object's own save() format, as a string (so the checkpoint stays one file)."""
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        obj.save(Path(d) / "x.json")
        return (Path(d) / "x.json").read_text()


def _from_json(cls, text: str, path: Path):
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "x.json").write_text(text)
        try:
            return cls.load(Path(d) / "x.json")
        except ValueError as e:
            raise ValueError(f"checkpoint {path}: {e}") from None


def load_checkpoint(run: Path, policy, optimizer, rng):
    from peft import set_peft_model_state_dict
    path = run / "checkpoint.pt"
    try:
        ckpt = torch.load(path, weights_only=True)
        set_peft_model_state_dict(policy.model, ckpt["lora"])
        optimizer.load_state_dict(ckpt["optimizer"])
        set_rng_state(rng, ckpt["rng"])
    except FileNotFoundError:
        raise FileNotFoundError(f"--resume: no checkpoint at {path}") from None
    except (RuntimeError, KeyError, EOFError, ValueError) as e:
        raise RuntimeError(f"checkpoint {path} is corrupt or truncated ({e}); "
                           f"the run cannot resume from it") from None
    return ckpt["iteration"], _from_json(TipMemory, ckpt["memory"], path), _from_json(NoveltyCounter, ckpt["novelty"], path)


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


def save_adapter(run: Path, policy) -> None:
    tmp = run / "adapter.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    policy.model.save_pretrained(tmp)
    shutil.rmtree(run / "adapter", ignore_errors=True)
    tmp.replace(run / "adapter")


def main(argv=None) -> int:
    cfg = parse_args(argv)
    name = cfg.name or f"{cfg.env}-{cfg.algo}-s{cfg.seed}"
    run = Path(cfg.out) / name
    if cfg.resume:
        saved = json.loads((run / "config.json").read_text()) if (run / "config.json").exists() else None
        if saved is None:
            sys.exit(f"--resume: {run} has no config.json; nothing to resume")
        saved.update(resume=True, iterations=cfg.iterations)  # the only settings a resume may change
        cfg = Config(**saved)
    elif (run / "checkpoint.pt").exists():
        sys.exit(f"{run} already holds a run: pass --resume to continue it, or --name for a new one")
    run.mkdir(parents=True, exist_ok=True)
    write_atomically(run / "config.json", json.dumps(dataclasses.asdict(cfg), indent=2))

    from policy import load_policy
    random.seed(cfg.seed)
    np.random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    rng = np.random.default_rng(cfg.seed)
    make_kwargs, task_kwargs = env_kwargs(cfg)
    train_tasks = envs.tasks(cfg.env, "train", **task_kwargs)
    if cfg.train_tasks:
        train_tasks = eval_subset(train_tasks, cfg.train_tasks)
    test_tasks = envs.tasks(cfg.env, "test", **task_kwargs)
    eval_tasks = eval_subset(test_tasks, cfg.eval_episodes)
    n_episodes = cfg.tasks_per_iter * cfg.group_size
    pool = [envs.make(cfg.env, split="train", seed=cfg.seed + i, **make_kwargs) for i in range(n_episodes)]

    policy = load_policy(cfg.model, cfg.dtype, cfg.device, cfg.lora_r, cfg.lora_alpha)
    optimizer = torch.optim.AdamW(policy.lora_parameters(), lr=cfg.lr, weight_decay=0.0)
    memory = TipMemory(cfg.memory_threshold, cfg.memory_top_k, cfg.memory_capacity)
    novelty = NoveltyCounter(cfg.novelty_threshold)
    uses_memory = cfg.p > 0
    embedder = Embedder(device=str(policy.device)) if (uses_memory or cfg.intrinsic_coef > 0) else None
    start, evals = 0, {}
    if cfg.resume:
        start, memory, novelty = load_checkpoint(run, policy, optimizer, rng)
        evals = json.loads((run / "eval.json").read_text()) if (run / "eval.json").exists() else {}
        print(f"resumed {run} at iteration {start}")
    metrics_path = run / "metrics.jsonl"
    rows = [json.loads(line) for line in metrics_path.read_text().splitlines()] if metrics_path.exists() else []
    rows = [r for r in rows if r["iteration"] < start]  # drop lines of an iteration that did not checkpoint
    write_atomically(metrics_path, "".join(json.dumps(r) + "\n" for r in rows))

    if eval_tasks and "untrained" not in evals:
        evals["untrained"] = evaluate_policy(policy, pool, eval_tasks, cfg, desc="eval untrained")
        write_atomically(run / "eval.json", json.dumps(json_safe(evals), indent=1))
        print(f"untrained (no memory, T={cfg.eval_temperature}): score {evals['untrained']['score']:.1f} "
              f"± {evals['untrained']['score_ci95']:.1f}, success {evals['untrained']['success_rate']:.1f} %")

    try:
        for it in range(start, cfg.iterations):
            t0 = time.time()
            # step 1-2: a batch of tasks, G rollouts each, mode sampled per group
            batch = [train_tasks[k] for k in rng.choice(len(train_tasks), cfg.tasks_per_iter, replace=False)]
            modes = sample_modes(rng, cfg.tasks_per_iter, cfg.p, cfg.q)
            ep_tasks = [t for t in batch for _ in range(cfg.group_size)]
            ep_modes = [m for m in modes for _ in range(cfg.group_size)]
            groups = [g for g in range(cfg.tasks_per_iter) for _ in range(cfg.group_size)]
            trajs = rollout(policy, pool, ep_tasks, ep_modes, cfg, groups=groups, memory=memory, embedder=embedder,
                            novelty=novelty if cfg.intrinsic_coef > 0 else None, temperature=cfg.temperature,
                            desc=f"iter {it} rollout")
            t_rollout = time.time() - t0
            # step 3: every episode writes a tip (skipped when no rollout can ever read one, p = 0)
            stored = 0
            if uses_memory:
                reflect(policy, trajs, cfg)
                stored = store_tips(memory, embedder, trajs)
            # step 4-5: return = extrinsic + intrinsic, GRPO advantage per group
            returns = episode_returns(trajs)
            advantages = grpo_advantages(returns, groups)
            # step 6-9: the hybrid update
            stats = update_policy(policy, optimizer, trajs, advantages, cfg)

            ext = np.array([tr.ext_return for tr in trajs])
            per_group = returns.view(cfg.tasks_per_iter, cfg.group_size)
            gen_tokens = sum(len(s) for tr in trajs for kind, s in tr.segments if kind == "action")
            row = {"iteration": it, "reward": float(returns.mean()), "reward_std": float(returns.std()),
                   "reward_ext": float(ext.mean()), "reward_int": float(np.mean([tr.int_return for tr in trajs])),
                   "success_rate": float(np.mean([tr.won for tr in trajs])),
                   "frac_reward_zero_std": float((per_group.std(dim=1) < 1e-6).float().mean()),
                   "valid_action_rate": float(np.mean([s.get("valid", False) for tr in trajs for s in tr.transcript] or [0])),
                   "episode_steps": float(np.mean([len(tr.rewards) for tr in trajs])),
                   "truncated": int(sum(tr.truncated for tr in trajs)),
                   "modes/plain": sum(m[1] == "on-policy" for m in modes),
                   "modes/on_policy_tips": sum(m[1] == "on-policy-tips" for m in modes),
                   "modes/off_policy": sum(m[1] == "off-policy" for m in modes),
                   "episodes_with_tips": int(sum(tr.has_tips for tr in trajs)),
                   "memory/size": len(memory), "memory/stored": stored, "novelty/states": len(novelty),
                   **stats, "tokens_generated": gen_tokens, "tokens_per_s": gen_tokens / max(t_rollout, 1e-9),
                   "time/rollout_s": t_rollout, "time/iteration_s": time.time() - t0}
            rows.append(row)
            # order matters for --resume: every file of this iteration first, the checkpoint last
            with open(metrics_path, "a") as f:
                f.write(json.dumps(row) + "\n")
            write_sample(run, it, trajs)
            memory.save(run / "memory.json")
            save_adapter(run, policy)
            plot_learning_curve(run, rows)
            save_checkpoint(run, it + 1, policy, optimizer, memory, novelty, rng, cfg)
            print(f"iter {it:3d} | return {row['reward']:.3f} (ext {row['reward_ext']:.3f}) | success "
                  f"{100 * row['success_rate']:.0f} % | no-signal groups {row['frac_reward_zero_std']:.2f} | "
                  f"valid {row['valid_action_rate']:.2f} | loss {row['loss']:+.4f} | ent {row['entropy']:.2f} | "
                  f"clip {row['clip_ratio']:.3f} | mem {len(memory)} | {row['time/iteration_s']:.0f}s", flush=True)
    except KeyboardInterrupt:
        print(f"\ninterrupted: the last finished iteration is saved; continue with: "
              f"python train.py --env {cfg.env} --name {name} --out {cfg.out} --resume", file=sys.stderr)
        return 130

    if eval_tasks and "trained" not in evals:
        evals["trained"] = evaluate_policy(policy, pool, eval_tasks, cfg, desc="eval trained")
        evals["trained"]["iterations"] = cfg.iterations
        write_atomically(run / "eval.json", json.dumps(json_safe(evals), indent=1))
    if evals:
        for key in ("untrained", "trained"):
            if key in evals:
                e = evals[key]
                print(f"{key:9s} (test split, no memory, T={cfg.eval_temperature}): score {e['score']:.1f} "
                      f"± {e['score_ci95']:.1f}, success {e['success_rate']:.1f} % over {len(e['episodes'])} episodes")
    for env in pool:
        env.close()
    print(f"run saved in {run}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
