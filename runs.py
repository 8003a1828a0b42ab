"""Run plumbing for train.py: the run folder, checkpoints and --resume, the files written after each
iteration (metrics.jsonl, TensorBoard, samples, learning curve, adapter), and evaluations cached on
disk. Nothing here is part of EMPO²; train.py's main() is the algorithm's story.
"""
from __future__ import annotations

import dataclasses
import json
import random
import re
import sys
from pathlib import Path

import numpy as np
import torch

import envs
from empo2 import Config, evaluate_policy
from memory import NoveltyCounter, TipMemory
from utils import fmt_ci, json_safe, replace_atomically, write_atomically
from warm_start import source_hash


RESUME_MAY_CHANGE = ("iterations", "eval_episodes", "report_to")  # none changes what training does up to the last checkpoint


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


def resume_state(run: Path, cfg: Config, policy) -> tuple[int, dict, dict | None, list, TipMemory, NoveltyCounter]:
    """(first iteration, evals, checkpoint, metrics rows, memory, novelty): where a run starts or continues."""
    start, evals, ckpt = 0, {}, None
    memory = TipMemory(cfg.memory_threshold, cfg.memory_top_k, cfg.memory_capacity)
    novelty = NoveltyCounter(cfg.novelty_threshold)
    if cfg.resume and (run / "checkpoint.pt").exists():
        ckpt = load_checkpoint(run, policy)
        start, memory, novelty = ckpt["iteration"], ckpt["memory"], ckpt["novelty"]
        evals = json.loads((run / "eval.json").read_text()) if (run / "eval.json").exists() else {}
        print(f"resumed {run} at iteration {start}")
    rows = [r for r in read_metrics(run / "metrics.jsonl") if r["iteration"] < start]  # drop an unsaved iteration
    write_atomically(run / "metrics.jsonl", "".join(json.dumps(json_safe(r)) + "\n" for r in rows))
    return start, evals, ckpt, rows, memory, novelty


def save_iteration(run: Path, rows: list[dict], log: "MetricsLog", trajs, policy, optimizer, memory, novelty, cfg: Config,
                   reference: dict, probe: list) -> None:
    """Every file of the iteration first, the checkpoint last: --resume restarts after the last checkpoint."""
    it = rows[-1]["iteration"]
    log.write(rows[-1])
    write_sample(run, it, trajs)
    memory.save(run / "memory.json")
    save_adapter(run, policy)
    plot_learning_curve(run, rows)
    save_checkpoint(run, it + 1, policy, optimizer, memory, novelty, cfg, reference, probe)


class MetricsLog:
    """metrics.jsonl, one line per iteration; with --report-to tensorboard the same numbers as
    TensorBoard scalars in RUN/tensorboard (tensorboard --logdir runs), keyed by the same names."""

    def __init__(self, run: Path, report_to: str = "none"):
        self.path, self.writer = run / "metrics.jsonl", None
        if report_to == "tensorboard":
            from torch.utils.tensorboard import SummaryWriter
            self.writer = SummaryWriter(str(run / "tensorboard"))

    def write(self, row: dict) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(json_safe(row)) + "\n")
        if self.writer is not None:
            for key, value in row.items():
                if key != "iteration" and isinstance(value, (int, float)) and np.isfinite(value):
                    self.writer.add_scalar(key, value, row["iteration"])
            self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


# metrics.jsonl keys of runs made before the keys had CleanRL-style namespaces -> their names now
RENAMED_METRICS = {
    "reward": "charts/return", "reward_std": "charts/return_std", "reward_ext": "charts/return_ext",
    "reward_int": "charts/return_int", "success_rate": "charts/success_rate",
    "frac_reward_zero_std": "charts/frac_reward_zero_std", "frac_return_zero_std": "charts/frac_return_zero_std",
    "invalid_actions": "charts/invalid_actions", "valid_action_rate": "charts/valid_action_rate",
    "episode_steps": "charts/episode_steps", "truncated": "charts/truncated",
    "truncated/plain_frac": "charts/truncated_plain_frac", "truncated/memory_frac": "charts/truncated_memory_frac",
    "tokens_generated": "charts/tokens_generated", "tokens_per_s": "charts/tokens_per_s",
    "episodes_with_tips": "memory/episodes_with_tips", "loss": "losses/policy_loss", "entropy": "losses/entropy",
    "clip_ratio": "losses/clip_frac", "dual_clip_ratio": "losses/dual_clip_frac", "masked_fraction": "losses/masked_frac",
    "update/ratio_mean": "losses/ratio_mean", "update/ratio_min": "losses/ratio_min", "update/ratio_max": "losses/ratio_max",
    "update/kl_ref": "losses/kl_ref", "kl/probe": "losses/approx_kl", "offpolicy_logratio": "losses/offpolicy_logratio",
    "grad_norm": "losses/grad_norm", "update/grad_norm_max": "losses/grad_norm_max",
    "skipped_step": "update/skipped_steps", "action_tokens": "update/action_tokens", "scored_tokens": "update/scored_tokens"}


def read_metrics(path: Path) -> list[dict]:
    """metrics.jsonl rows under today's key names (older runs' keys are renamed on reading)."""
    if not path.exists():
        return []
    return [{RENAMED_METRICS.get(k, k): v for k, v in json.loads(line).items()}
            for line in path.read_text().splitlines() if line.strip()]


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
    lines += [f"- [{t.task.task_id}, return {t.ext_return:.2f}] {' '.join(t.tip.split())}" for t in trajs if t.tip]
    write_atomically(run / "samples" / f"iter_{iteration:04d}.txt", "\n".join(lines) + "\n")


def read_sample_tips(run: Path) -> list[tuple[int, str, float, str]]:
    """Every tip write_sample recorded: (iteration, task_id, return of its episode, tip), in order."""
    out = []
    for path in sorted((run / "samples").glob("iter_*.txt")):
        it = int(path.stem.removeprefix("iter_"))
        section = path.read_text().partition("# tips written this iteration")[2]
        out += [(it, task_id, float(ret), tip) for task_id, ret, tip in
                re.findall(r"^- \[(\S+), return (-?[\d.]+)\] (.*)$", section, re.M)]
    return out


def plot_learning_curve(run: Path, rows: list[dict]) -> None:
    from matplotlib.figure import Figure  # no pyplot: leaves a notebook's plotting backend alone
    it = [r["iteration"] for r in rows]
    fig = Figure(figsize=(13, 3.6))
    axes = fig.subplots(1, 3)
    axes[0].plot(it, [r["charts/return"] for r in rows], marker="o", label="return (ext + int - penalty)")
    axes[0].plot(it, [r["charts/return_ext"] for r in rows], marker=".", label="extrinsic return")
    axes[0].set_title("mean return")
    axes[1].plot(it, [100 * r["charts/success_rate"] for r in rows], marker="o", color="C2")
    axes[1].set_title("success rate (%)")
    axes[2].plot(it, [r["charts/frac_reward_zero_std"] for r in rows], marker="o", color="C3", label="groups with no signal")
    axes[2].plot(it, [r["losses/entropy"] for r in rows], marker=".", color="C4", label="entropy")
    axes[2].set_title("exploration")
    for ax in axes:
        ax.set_xlabel("iteration")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    axes[2].legend(fontsize=8)
    fig.suptitle(run.name)
    fig.tight_layout()
    replace_atomically(run / "learning_curve.png", lambda tmp: fig.savefig(tmp, dpi=100))


def save_adapter(run: Path, policy) -> None:
    """The LoRA weights as PeftModel.from_pretrained reads them."""
    replace_atomically(run / "adapter", policy.model.save_pretrained)


def save_checkpoint(run: Path, iteration: int, policy, optimizer, memory, novelty, cfg: Config,
                    reference: dict, probe: list) -> None:
    """One plain dict, written to a temp file and renamed: a kill mid-save keeps the previous one."""
    from peft import get_peft_model_state_dict
    ckpt = {"iteration": iteration, "config": dataclasses.asdict(cfg),
            "lora": {k: v.detach().cpu() for k, v in get_peft_model_state_dict(policy.model).items()},
            "reference": {k: v.cpu() for k, v in reference.items()}, "probe": probe,
            "optimizer": optimizer.state_dict(), "rng": rng_state(),
            "memory": json.dumps(memory.to_dict()), "novelty": json.dumps(novelty.to_dict())}
    replace_atomically(run / "checkpoint.pt", lambda tmp: torch.save(ckpt, tmp))


def load_checkpoint(run: Path, policy) -> dict:
    """Loads the LoRA weights and the RNG state; returns the checkpoint (iteration, optimizer, memory, novelty)."""
    from peft import set_peft_model_state_dict
    path = run / "checkpoint.pt"
    try:
        ckpt = torch.load(path, weights_only=True)
        set_peft_model_state_dict(policy.model, ckpt["lora"])
        set_rng_state(ckpt["rng"])
        ckpt["memory"] = TipMemory.from_dict(json.loads(ckpt["memory"]), f"checkpoint {path}: memory")
        ckpt["novelty"] = NoveltyCounter.from_dict(json.loads(ckpt["novelty"]), f"checkpoint {path}: novelty")
    except FileNotFoundError:
        raise FileNotFoundError(f"--resume: no checkpoint at {path}") from None
    except (RuntimeError, KeyError, EOFError, ValueError) as e:
        raise RuntimeError(f"checkpoint {path} is corrupt or truncated ({e}); "
                           f"the run cannot resume from it") from None
    return ckpt


def rng_state() -> dict:
    """Torch's and Python's generators; the iterations' own draws come from train.seed_iteration, so no
    NumPy generator needs saving (checkpoints written before that hold one under "numpy": ignored)."""
    return {"torch": torch.get_rng_state(), "python": random.getstate()}


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))


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


def print_eval(label: str, e: dict, cfg: Config, split: str = "test") -> None:
    cached = " (cached)" if e.get("cached") else ""
    print(f"{label:11s} ({split} split, no memory, T={cfg.eval_temperature}): score {fmt_ci(e['score'], e['score_ci95'])}, "
          f"success {fmt_ci(e['success_rate'], e['success_ci95'])} %, valid actions {e['valid_action_rate']:.0f} %, "
          f"{e['mean_steps']:.1f} steps, {len(e['episodes'])} episodes{cached}", flush=True)
