"""Evaluate EMPO² runs: the paper's main metric, its adaptation test, and runs side by side.

    python evaluate.py --run runs/rooms-empo2-s0                  # test split, no memory, T=0.4
                                                                  #   -> runs/rooms-empo2-s0/eval_test_off.json
    python evaluate.py --run runs/rooms-empo2-s0 --split ood --episodes 30
    python evaluate.py --env rooms                                # the untrained model (base + fresh, zero LoRA)
                                                                  #   -> runs/untrained-rooms/eval_test_off.json
    python evaluate.py --run runs/rooms-empo2-s0 --split ood --memory on --trials 10
                                                                  # adaptation: tips on, NO weight update
    python evaluate.py --env rooms --split ood --memory on --trials 10   # memory-only baseline (Reflexion-style)
    python evaluate.py --run runs/rooms-empo2-s0 --split ood --memory both --trials 3
                                                                  # adaptation and its memory-off control, side by side
    python evaluate.py --run runs/rooms-empo2-s0 --memory all --trials 3
                                                                  # ... and the shuffled-tips control as a third column
    python evaluate.py --compare runs/rooms-empo2-s0 runs/rooms-empo2-s1 runs/rooms-grpo-s0 runs/untrained-rooms
                                                                  # -> compare.md (table) and compare.png (curves)

Main metric (docs/algorithm.md, "Evaluation"): the policy WITHOUT memory at temperature 0.4 on --episodes
tasks spread evenly over a split (the same tasks train.py evaluates, for every seed), one episode
per task and trial; score = 100 x mean
episode return, success rate (%) = episodes won, mean steps, each with a 95 % CI, per task and over
all episodes. --trials K > 1 with --memory off repeats the episodes independently (a control for
the adaptation curve).

Adaptation (--memory on): K consecutive trials per task; every step retrieves the task's tips
(rollout mode "memory"), and after each trial the policy writes a tip (empo2.reflect) that is stored
(empo2.store_tips) for the next trial. No optimiser exists here, so the weights cannot change; the
output records a checksum of the LoRA weights before and after. Tips are sampled at the evaluation
temperature too. The memory is saved next to the eval file (..._memory.json). Each batch of
--batch-size episodes of each trial samples from its own seed (empo2.batch_seed) in every arm, so trial 1,
where no tip exists yet, plays the same episodes with memory on, off or shuffled; each episode's
actions are in the eval file.

Shuffled tips (--memory shuffled), the control for what a tip SAYS: the adaptation test, except that
each task's memory receives the tip another task's episode wrote (the trial's tasks rotated by one),
stored under the task's own first observation so retrieval finds it exactly as it finds a real tip.
Memory on beating memory off but not shuffled tips means the prompt with a tip helps, not its content.

When --run is given, every setting (env, model, dtype, max steps, tokens per action, ...) defaults
to the run's config.json; the flags override it. So does --batch-size (the run's pool): then
`python evaluate.py --run RUN --episodes N` (N = the run's --eval-episodes) replays the episodes of
train.py's final evaluation (RUN/eval.json, "trained"), on the same machine and dtype.
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import re
import sys
import time
from pathlib import Path

import numpy as np
import torch
from scipy import stats

import envs
from empo2 import (MEMORY, NO_UPDATE, PLAIN, Config, add_config_flags, batch_seed, episode_record, episode_stats, eval_subset,
                   reflect, rollout, store_tips, tip_information)
from memory import Embedder, TipMemory
from runs import RENAMED_METRICS, read_metrics, read_sample_tips
from sampler import keep_freed_memory
from utils import fmt_ci, json_safe, replace_atomically, write_atomically

SPLITS = ("val", "test", "ood")
STAGES = ("untrained", "warm_start", "trained")   # train.py's eval.json: held-out evaluations of a run
POLICY_CACHE: dict = {}     # one (key -> Policy) entry: in-process callers (tests, notebooks) load a model once
EMBEDDER_CACHE: dict = {}
SEED_ONLY_FIELDS = ("seed", "name", "out", "resume")  # runs that differ only in these are seeds of one experiment
# Config fields evaluate.py takes as flags; without --run the defaults are Config's (untrained model)
RUN_SETTINGS = ("env", "model", "dtype", "device", "seed", "eval_temperature", "max_steps", "max_new_tokens",
                "tip_max_new_tokens", "task_names", "demo")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", default=None, help="a run folder written by train.py (omit, or 'none': the untrained model)")
    p.add_argument("--split", choices=SPLITS, default="test", help="val: for choosing settings; test: unseen instances, for final tables only; ood: unseen kinds of task")
    p.add_argument("--memory", choices=("off", "on", "both", "shuffled", "all"), default="off",
                   help="on: the adaptation test (tips, no weight update); both: it and its memory-off control on the "
                        "same goals and seed, side by side; shuffled: the adaptation test with each task given another "
                        "task's tips; all: off, on and shuffled side by side")
    p.add_argument("--trials", type=int, default=None, help="trials per task (default: 1 with --memory off, 3 with on)")
    p.add_argument("--episodes", type=int, default=Config.eval_episodes, help=f"N tasks spread evenly over the split, the same as train.py evaluates (default: {Config.eval_episodes})")
    p.add_argument("--out", default=None, help="eval: the JSON file (default RUN/eval_SPLIT_MEMORY.json); "
                                               "--compare: the markdown file (default compare.md; the PNG goes next to it)")
    p.add_argument("--compare", nargs="+", metavar="RUN", default=None, help="put these run folders side by side")
    p.add_argument("--sweep", nargs="+", metavar="RUN", default=None,
                   help="runs trained with --val-every: trained - warm start on the validation split, per setting and seed")
    p.add_argument("--metric", default="charts/return_ext", help="--compare: metrics.jsonl key of the learning curves")
    add_config_flags(p, RUN_SETTINGS, keep_run_settings=True)   # the run's settings, overridden where given
    p.add_argument("--batch-size", type=int, default=None,
                   help="episodes played in lockstep (one env each; default: the run's pool, tasks per iteration x group "
                        "size, so --memory off replays train.py's own evaluation of the run; without --run: 8)")
    args = p.parse_args(argv)
    if args.compare is not None or args.sweep is not None:
        if args.run is not None:
            p.error("--compare and --sweep take run folders themselves; drop --run")
        return p, args
    if args.env is not None and args.env not in envs.ENV_NAMES:
        p.error(f"unknown --env {args.env!r}; valid environments: {', '.join(envs.ENV_NAMES)}")
    for name in ("episodes", "batch_size", "max_new_tokens", "tip_max_new_tokens"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.trials is None:
        args.trials = 1 if args.memory == "off" else 3
    if args.memory in ("both", "all") and args.out is not None:
        p.error(f"--memory {args.memory} writes one file per setting next to the run (eval_SPLIT_off.json, "
                "eval_SPLIT_on.json, ...); drop --out")
    if args.memory in ("shuffled", "all") and args.episodes < 2:
        p.error(f"--memory {args.memory} gives each task another task's tips: it needs --episodes 2 or more")
    if args.trials < 1 or (args.max_steps is not None and args.max_steps < 0):
        p.error("--trials must be at least 1 and --max-steps at least 0")
    if args.eval_temperature is not None and args.eval_temperature < 0:
        p.error("--eval-temperature must be >= 0")
    if args.run is not None and args.run.lower() == "none":
        args.run = None
    if args.run is None and args.env is None:
        p.error(f"--env is required without --run; valid environments: {', '.join(envs.ENV_NAMES)}")
    return p, args


def check_run(parser, run: Path) -> dict:
    """The run's config.json as a dict; a clear error naming whatever is missing."""
    if not run.is_dir():
        parser.error(f"--run {run}: no such folder")
    missing = [what for what, path in (("config.json", run / "config.json"),
                                       ("adapter/adapter_config.json (the LoRA train.py saves after each iteration)",
                                        run / "adapter" / "adapter_config.json")) if not path.exists()]
    if missing:
        parser.error(f"--run {run} is not a finished training run: missing {' and '.join(missing)}. "
                     f"To evaluate the untrained model use --run none --env ENV")
    try:
        return json.loads((run / "config.json").read_text())
    except json.JSONDecodeError as e:
        parser.error(f"--run {run}: config.json is corrupt ({e})")


def build_config(parser, args) -> tuple[Config, Path | None]:
    """Config = the run's config.json (or the defaults), overridden by the flags that were given."""
    run = Path(args.run) if args.run else None
    saved = check_run(parser, run) if run else {}
    cfg = Config(**{k: v for k, v in saved.items() if k in Config.field_names()})
    overrides = {name: getattr(args, name) for name in RUN_SETTINGS if getattr(args, name) is not None}
    cfg = dataclasses.replace(cfg, **overrides, resume=False)
    if run is None:  # the untrained model: no warm start was loaded, so it gets the example turns (demo auto)
        cfg = dataclasses.replace(cfg, warm_start="off")
    try:
        cfg.check(task_lists=False)
    except ValueError as e:
        parser.error(str(e))
    # tips are written at the evaluation temperature as well (reflect samples at cfg.temperature)
    return dataclasses.replace(cfg, temperature=cfg.eval_temperature), run


# ----------------------------------------------------------------------------------------
def get_policy(cfg: Config, adapter: Path | None):
    """load_policy, cached for one (model, adapter) so repeated in-process calls load it once."""
    from policy import load_policy
    stamp = (adapter / "adapter_model.safetensors").stat().st_mtime_ns if adapter and \
        (adapter / "adapter_model.safetensors").exists() else None
    key = (cfg.model, cfg.dtype, cfg.device, cfg.lora_r, cfg.lora_alpha, str(adapter.resolve()) if adapter else None, stamp)
    if key not in POLICY_CACHE:
        POLICY_CACHE.clear()  # one model in memory at a time
        torch.manual_seed(cfg.seed)  # a fresh LoRA's random A (B = 0, so it is the base model either way)
        POLICY_CACHE[key] = load_policy(cfg.model, cfg.dtype, cfg.device, cfg.lora_r, cfg.lora_alpha,
                                        adapter=str(adapter) if adapter else None)
    return POLICY_CACHE[key]


def batch_size(args, cfg: Config, run: Path | None) -> int:
    """--batch-size, else the run's pool: lockstep rows share the random draws, so the same seed gives the
    same episodes only at the same batch size (empo2.evaluate_policy)."""
    return args.batch_size or (cfg.tasks_per_iter * cfg.group_size if run else 8)


def get_embedder(device: str) -> Embedder:
    if device not in EMBEDDER_CACHE:
        EMBEDDER_CACHE[device] = Embedder(device=device)
    return EMBEDDER_CACHE[device]


def weights_checksum(params) -> str:
    """sha256 over the raw bytes of the given tensors (exact: any change of any weight shows)."""
    h = hashlib.sha256()
    for prm in params:
        h.update(prm.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def play_trials(policy, pool, tasks, cfg: Config, trials: int, memory_on: bool, embedder=None, memory=None,
                shuffle_tips: bool = False) -> list[dict]:
    """All episodes of all trials, one record each (with the episode's actions). Memory on: tips retrieved
    during, written after each trial; shuffle_tips: each task's memory gets the tip of the next task's
    episode instead of its own. Memory off: the same rollouts in plain mode (the paper's main metric)."""
    records = []
    devices = [policy.device] if policy.device.type == "cuda" else []
    mode = (MEMORY if memory_on else PLAIN, NO_UPDATE)
    for trial in range(1, trials + 1):
        played = []
        for start in range(0, len(tasks), len(pool)):
            chunk = tasks[start:start + len(pool)]
            # each batch of each trial samples from its own seed in every arm, so reflection's draws do not
            # shift the next batch's: until a tip is shown, memory on and its control play the same episodes
            with torch.random.fork_rng(devices=devices), policy.sampling(keep_finished=memory_on) as sampler:
                torch.manual_seed(batch_seed(cfg.seed, trial, start))
                trajs = rollout(policy, pool, chunk, [mode] * len(chunk), cfg, memory=memory, embedder=embedder,
                                temperature=cfg.eval_temperature, desc=f"{'adapt' if memory_on else 'eval'} trial {trial}",
                                sampler=sampler)
                if memory_on:   # the tips continue the episodes' KV cache
                    reflect(policy, trajs, cfg, sampler)   # docs/algorithm.md, step 3: the policy writes itself a tip ...
            played += trajs
            records += [{**episode_record(tr), "trial": trial,
                         **({"tips_seen": tr.has_tips, "tip": tr.tip} if memory_on else {})} for tr in trajs]
        if memory_on and not shuffle_tips:
            store_tips(memory, embedder, played)  # ... kept for the next trial; no weight update
        elif memory_on:
            store_others_tips(memory, embedder, played)
        now = episode_stats([r for r in records if r["trial"] == trial])
        print(f"trial {trial}/{trials}: score {now['score']:.1f} ± {now['score_ci95']:.1f}, success "
              f"{now['success_rate']:.1f} %, steps {now['mean_steps']:.1f}" + (f", memory {len(memory)}" if memory_on else ""),
              flush=True)
    return records


def store_others_tips(memory, embedder, trajs) -> int:
    """The shuffled-tips control: episode k's task stores the tip (and score) of episode k+1's, under the
    embedding of its own first observation, so retrieval works as for its own tip."""
    if len({tr.task.task_id for tr in trajs}) < 2:
        raise ValueError("--memory shuffled needs at least two tasks (--episodes 2 or more)")
    return store_tips(memory, embedder, trajs, tips_from=trajs[1:] + trajs[:1])


def evaluate(parser, args) -> Path:
    """One evaluation (--memory off, on or shuffled) of a run or the untrained model; returns the JSON file written."""
    cfg, run = build_config(parser, args)
    memory_on = args.memory in ("on", "shuffled")
    make_kwargs, task_kwargs = envs.settings(cfg.env, cfg.max_steps, cfg.task_names)
    all_tasks = envs.tasks(cfg.env, args.split, **task_kwargs)
    tasks = eval_subset(all_tasks, args.episodes)
    if len(tasks) < args.episodes:
        print(f"note: the {args.split} split of {cfg.env} has {len(all_tasks)} tasks; evaluating all of them")
    if run is not None:
        out = Path(args.out) if args.out else run / f"eval_{args.split}_{args.memory}.json"
    else:
        slug = "" if cfg.model == "default" else "-" + re.sub(r"[^A-Za-z0-9._-]+", "_", cfg.model.strip("/"))[-40:]
        out = Path(args.out) if args.out else Path(cfg.out) / f"untrained-{cfg.env}{slug}" / f"eval_{args.split}_{args.memory}.json"
    t0 = time.time()
    adapter = run / "adapter" if run else None
    policy = get_policy(cfg, adapter)
    embedder = get_embedder(str(policy.device)) if memory_on else None
    memory = TipMemory(cfg.memory_threshold, cfg.memory_top_k, cfg.memory_capacity) if memory_on else None
    pool = [envs.make(cfg.env, split=args.split, seed=cfg.seed + i, **make_kwargs)
            for i in range(min(batch_size(args, cfg, run), len(tasks)))]
    before = weights_checksum(policy.lora_parameters())
    torch.manual_seed(cfg.seed)
    try:
        records = play_trials(policy, pool, tasks, cfg, args.trials, memory_on, embedder, memory,
                              shuffle_tips=args.memory == "shuffled")
    finally:
        for env in pool:
            env.close()

    result = {"mode": {"on": "adaptation", "shuffled": "adaptation, shuffled tips"}.get(args.memory, "eval"), "run": str(run) if run else None,
              "adapter": str(adapter) if adapter else None,
              "settings": {"env": cfg.env, "split": args.split, "memory": args.memory, "trials": args.trials,
                           "episodes": len(tasks), "temperature": cfg.eval_temperature, "max_steps": pool[0].max_steps,
                           "max_new_tokens": cfg.max_new_tokens, "tip_max_new_tokens": cfg.tip_max_new_tokens,
                           "model": cfg.model, "dtype": str(next(policy.model.parameters()).dtype).removeprefix("torch."),
                           "device": str(policy.device), "seed": cfg.seed, "batch_size": len(pool),
                           "demo": cfg.shows_demo, "task_names": cfg.task_names, "memory_threshold": cfg.memory_threshold,
                           "memory_top_k": cfg.memory_top_k},
              **episode_stats(records)}
    result["trials"] = []
    by_id = {t.task_id: t for t in tasks}
    for k in range(1, args.trials + 1):
        rows = [r for r in records if r["trial"] == k]
        result["trials"].append({"trial": k, **episode_stats(rows), "episodes_with_tips": sum(r.get("tips_seen", False) for r in rows)})
        if memory_on:   # what this trial's tips would tell a perfect reader (empo2.tip_information)
            told = tip_information(cfg.env, [(by_id[r["task_id"]], r["tip"], r["reward"]) for r in rows if r["tip"]], k,
                                   make_kwargs, args.split)
            result["trials"][-1].update({key.split("/")[1]: 100 * v for key, v in told.items()})
    first, last = result["trials"][0]["score"], result["trials"][-1]["score"]
    result["gain_pct"] = 100 * (last - first) / first if args.trials > 1 and first > 0 else None
    result["per_task"] = []
    for task in tasks:
        rows = [r for r in records if r["task_id"] == task.task_id]
        entry = {"task_id": task.task_id, "instruction": task.instruction, **episode_stats(rows),
                 "trial_scores": [100 * r["reward"] for r in rows]}
        if memory_on:
            entry["tips"] = [r["tip"] for r in rows]
        result["per_task"].append(entry)
    result["episodes"] = records
    if memory_on:
        mem_path = out.with_name(out.stem + "_memory.json")
        memory.save(mem_path)
        after = weights_checksum(policy.lora_parameters())
        result.update(memory_file=str(mem_path), memory_size=len(memory), weights_checksum_before=before,
                      weights_checksum_after=after, weights_unchanged=before == after)
    result["time_s"] = time.time() - t0
    write_atomically(out, json.dumps(json_safe(result), indent=1, allow_nan=False))
    what = f"{'adaptation, ' + str(args.trials) + ' trials' if memory_on else 'no memory'}, T={cfg.eval_temperature}"
    what = what.replace("adaptation", "adaptation with shuffled tips") if args.memory == "shuffled" else what
    print(f"{run or 'untrained ' + cfg.model} on {cfg.env}/{args.split} ({what}, {len(tasks)} tasks): score "
          f"{result['score']:.1f} ± {result['score_ci95']:.1f}, success {result['success_rate']:.1f} % "
          f"± {result['success_ci95']:.1f}, steps {result['mean_steps']:.1f}")
    if result["gain_pct"] is not None:
        print(f"trial 1 -> {args.trials}: {first:.1f} -> {last:.1f} ({result['gain_pct']:+.0f} %)")
    print(f"wrote {out}")
    return out


# ----------------------------------------------------------------------------------------
def read_run(parser, path: Path) -> dict:
    """Everything --compare needs from one run folder (or an untrained-ENV folder of eval files)."""
    if not path.is_dir():
        parser.error(f"--compare {path}: no such folder")
    evals = {}
    for f in sorted(path.glob("eval*.json")):
        if f.name.endswith("_memory.json"):
            continue
        try:
            evals[f.name] = json.loads(f.read_text())
        except json.JSONDecodeError as e:
            parser.error(f"--compare {path}: {f.name} is corrupt ({e})")
    config = json.loads((path / "config.json").read_text()) if (path / "config.json").exists() else None
    if config is None and not evals:
        parser.error(f"--compare {path}: missing config.json (not a train.py run) and no eval*.json files")
    rows = read_metrics(path / "metrics.jsonl")   # older runs' keys under today's names
    # the main metric: train.py's eval.json "trained", else evaluate.py's test split without memory
    source, main = None, None
    offs = [n for n in evals if n.endswith("_off.json") and "trials" in evals[n]]
    if "trained" in evals.get("eval.json", {}):
        source, main = "eval.json (trained)", evals["eval.json"]["trained"]
    elif offs:
        name = "eval_test_off.json" if "eval_test_off.json" in offs else offs[0]
        source, main = name, evals[name]
    adaptation = [e for e in evals.values() if e.get("mode") == "adaptation"]
    any_eval = next((e for e in evals.values() if "settings" in e), {})
    settings = any_eval.get("settings", {})
    return {"path": path, "name": (config or {}).get("name") or path.name, "config": config, "metrics": rows,
            "source": source, "main": main, "adaptation": adaptation,
            "stages": {k: v for k, v in evals.get("eval.json", {}).items() if k in STAGES and "episodes" in v},
            "env": (config or settings).get("env", "?"), "algo": config["algo"] if config else "untrained",
            "seed": (config or settings).get("seed", "?")}


def group_runs(runs: list[dict]) -> list[list[dict]]:
    """Runs whose configs differ only in seed/name/out/resume form one group (in first-seen order)."""
    groups: dict = {}
    for r in runs:
        key = (json.dumps({k: v for k, v in r["config"].items() if k not in SEED_ONLY_FIELDS}, sort_keys=True)
               if r["config"] else f"folder:{r['path']}")
        groups.setdefault(key, []).append(r)
    return list(groups.values())


def group_label(group: list[dict]) -> str:
    base = re.sub(r"-s\d+$", "", group[0]["name"])
    if len(group) == 1:
        return group[0]["name"]
    distinct = len({str(r["seed"]) for r in group}) == len(group)
    return f"{base} ({len(group)} {'seeds' if distinct else 'runs'})"


def fmt_ratio(rc: dict) -> str:
    """A ratio and its 95 % CI from ratio_ci95 or seed_level_ci95."""
    if rc["ratio"] is None:
        return "undefined (denominator 0)"
    return f"{rc['ratio']:.2f} " + ("[CI undefined]" if rc["ratio_ci95"] is None else "[{:.2f}, {:.2f}]".format(*rc["ratio_ci95"]))


def fmt_time(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.1f} min" if seconds < 7200 else f"{seconds / 3600:.1f} h"


def t_interval(values, level: float = 0.95) -> tuple[float, float]:
    """Mean and the half-width of the Student's t interval (n - 1 degrees of freedom) at `level`:
    for a mean over a few seeds, where the normal approximation's 1.96 is far too narrow (n = 3:
    t = 4.30). The half-width is NaN for one value (no interval) and the mean NaN for none."""
    x = np.asarray(values, dtype=np.float64)
    if len(x) == 0:
        return float("nan"), float("nan")
    if len(x) == 1:
        return float(x[0]), float("nan")
    t = float(stats.t.ppf(0.5 + level / 2, len(x) - 1))
    return float(x.mean()), t * float(x.std(ddof=1)) / math.sqrt(len(x))


def welch_interval(a, b, level: float = 0.95) -> tuple[float, float, float]:
    """mean(a) - mean(b), the half-width of its Welch t interval at `level` (unequal variances,
    Welch-Satterthwaite degrees of freedom) and those degrees of freedom; half-width NaN unless
    both groups hold at least two values."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    diff = float(a.mean() - b.mean()) if len(a) and len(b) else float("nan")
    if len(a) < 2 or len(b) < 2:
        return diff, float("nan"), float("nan")
    va, vb = a.var(ddof=1) / len(a), b.var(ddof=1) / len(b)
    if va + vb == 0:   # every seed of both groups gave the same value: a point
        return diff, 0.0, float("nan")
    df = (va + vb) ** 2 / (va ** 2 / (len(a) - 1) + vb ** 2 / (len(b) - 1))
    return diff, float(stats.t.ppf(0.5 + level / 2, df)) * math.sqrt(va + vb), float(df)


def fmt_t(values, digits: int = 1, signed: bool = False) -> str:
    """'mean ± half-width of the 95 % t interval' over `values` (e.g. one per seed); one value: no interval."""
    mean, half = t_interval(values)
    if math.isnan(mean):
        return "–"
    sign = "+" if signed else ""
    if len(values) == 1:
        return f"{mean:{sign}.{digits}f} (n=1, no interval)"
    return f"{mean:{sign}.{digits}f} ± {half:.{digits}f}"


def fmt_differences_over_seeds(values) -> str:
    """Per-seed differences (NaN dropped) as 'mean [low, high]; k of n > 0' with the 95 % t-interval
    across seeds; one value: fmt_t's no-interval form."""
    values = [v for v in values if not math.isnan(v)]
    mean, half = t_interval(values)
    if len(values) < 2:
        return fmt_t(values, signed=True)
    return f"{mean:+.1f} [{mean - half:+.1f}, {mean + half:+.1f}]; {sum(v > 0 for v in values)} of {len(values)} > 0"


def ratio_ci95(num: list[list[float]], den: list[list[float]], draws: int = 5000, seed: int = 0,
               paired: bool = False) -> dict:
    """Ratio and difference of mean episode scores, group `num` vs group `den`, each a list of runs
    (seeds) holding per-episode scores; 95 % CIs by a two-level bootstrap (resample seeds, then
    episodes within each), so seed-to-seed variation counts. paired: num[i][j] and den[i][j] are the
    same run and goal (one policy before and after training), so both are resampled with the same
    draws and goal-to-goal difficulty cancels. The ratio is None where den's mean is 0."""
    rng = np.random.default_rng(seed)

    def resampled_means(groups):
        runs = rng.integers(len(groups[0]), size=len(groups[0]))
        episodes = [rng.integers(len(groups[0][i]), size=len(groups[0][i])) for i in runs]
        return [float(np.mean(np.concatenate([np.asarray(g[i])[j] for i, j in zip(runs, episodes)]))) for g in groups]
    mean_num, mean_den = float(np.mean(np.concatenate(num))), float(np.mean(np.concatenate(den)))
    pairs = np.array([resampled_means([num, den]) if paired else resampled_means([num]) + resampled_means([den])
                      for _ in range(draws)])  # (draws, 2)
    diff = pairs[:, 0] - pairs[:, 1]
    out = {"difference": mean_num - mean_den, "difference_ci95": [float(np.percentile(diff, 2.5)), float(np.percentile(diff, 97.5))],
           "ratio": None, "ratio_ci95": None}
    if mean_den > 0:
        ok = pairs[:, 1] > 0
        ratio = pairs[ok, 0] / pairs[ok, 1]
        out["ratio"] = mean_num / mean_den
        out["ratio_ci95"] = ([float(np.percentile(ratio, 2.5)), float(np.percentile(ratio, 97.5))]
                             if ok.mean() > 0.975 else None)  # too many zero denominators: no honest interval
    return out


def seed_level_ci95(num: list[float], den: list[float], draws: int = 5000, seed: int = 0) -> dict:
    """Group `num` vs group `den` at the level of seeds: each run's mean (one value per seed) is one
    observation, episodes are not resampled. Ratio of the group means with a 95 % percentile bootstrap
    over seeds (each group's seeds resampled separately); difference of the group means with a 95 %
    Welch t interval. Intervals are None unless both groups have at least two seeds; the ratio (and its
    interval) None where den's mean is 0, the interval also where resampled means of den are often 0."""
    num, den = np.asarray(num, dtype=np.float64), np.asarray(den, dtype=np.float64)
    diff, half, df = welch_interval(num, den)
    out = {"n": [len(num), len(den)], "difference": diff, "df": None if math.isnan(df) else df,
           "difference_ci95": None if math.isnan(half) else [diff - half, diff + half], "ratio": None, "ratio_ci95": None}
    if den.mean() > 0:
        out["ratio"] = float(num.mean() / den.mean())
    if out["ratio"] is not None and len(num) > 1 and len(den) > 1:
        rng = np.random.default_rng(seed)
        a = num[rng.integers(len(num), size=(draws, len(num)))].mean(axis=1)
        b = den[rng.integers(len(den), size=(draws, len(den)))].mean(axis=1)
        ok = b > 0
        if ok.mean() > 0.975:
            ratio = a[ok] / b[ok]
            out["ratio_ci95"] = [float(np.percentile(ratio, 2.5)), float(np.percentile(ratio, 97.5))]
    return out


def paired_by_goal(before: list[dict], after: list[dict]) -> tuple[list[dict], list[dict]]:
    """The episodes of two evaluations of the same goals, lined up by task_id (in `before`'s order; the
    k-th episode of a goal with the k-th, where a goal was played more than once); goals only one
    side played are dropped."""
    pending: dict = {}
    for e in after:
        pending.setdefault(e["task_id"], []).append(e)
    b, a = [], []
    for e in before:
        if pending.get(e["task_id"]):
            b.append(e)
            a.append(pending[e["task_id"]].pop(0))
    return b, a


def paired_goal_difference(before: list[dict], after: list[dict], key: str, scale: float = 100.0) -> dict:
    """One run: mean of after - before over the goals both evaluations played (paired by task_id), with
    ratio_ci95's paired bootstrap over goals (95 % CI). {"difference", "difference_ci95", "n_goals"}."""
    b, a = paired_by_goal(before, after)
    if not b:
        return {"difference": float("nan"), "difference_ci95": [float("nan")] * 2, "n_goals": 0}
    d = ratio_ci95([[scale * e[key] for e in a]], [[scale * e[key] for e in b]], paired=True)
    return {"difference": d["difference"], "difference_ci95": d["difference_ci95"], "n_goals": len(b)}


def compare_table(runs: list[dict], groups: list[list[dict]]) -> str:
    lines = ["| run | env | algo | seed | score ± 95 % CI | success % ± 95 % CI | eval (episodes) | iterations | wall time | tokens generated |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        m, rows = r["main"] or {}, r["metrics"]
        wall = sum(x.get("time/iteration_s", 0.0) for x in rows)
        tokens = sum(x.get("charts/tokens_generated", 0) for x in rows)
        ev = f"{r['source']} ({len(m.get('episodes', []))})" if r["source"] else "–"
        lines.append(f"| {r['name']} | {r['env']} | {r['algo']} | {r['seed']} | {fmt_ci(m.get('score'), m.get('score_ci95'))} "
                     f"| {fmt_ci(m.get('success_rate'), m.get('success_ci95'))} | {ev} | {len(rows)} "
                     f"| {fmt_time(wall) if rows else '–'} | {f'{tokens:,}' if rows else '–'} |")
    multi = [g for g in groups if len(g) > 1]
    if multi:
        lines += ["", "Mean over seeds ± half-width of the 95 % t-interval across seeds (Student's t, n − 1 degrees "
                  "of freedom, n = seeds with an evaluation; n = 1: no interval):", "",
                  "| group | seeds | n | score | success % |", "|---|---|---|---|---|"]
        for g in multi:
            scored = [r["main"] for r in g if r["main"]]
            lines.append(f"| {group_label(g)} | {', '.join(str(r['seed']) for r in g)} | {len(scored)} "
                         f"| {fmt_t([m['score'] for m in scored])} | {fmt_t([m['success_rate'] for m in scored])} |")
    # per group (one seed is a group too): each seed's per-episode held-out scores
    episodes = [[[100 * e["reward"] for e in r["main"]["episodes"]] for r in g if r["main"]] for g in groups]
    if len(groups) > 1 and episodes[0]:
        wins = [[[100.0 * e["won"] for e in r["main"]["episodes"]] for r in g if r["main"]] for g in groups]
        lines += ["", f"Held-out score of {group_label(groups[0])} relative to each other group, episode level "
                  "(two-level bootstrap: resample seeds, then episodes within each; 95 % CI; with one seed, over episodes only):", "",
                  "| vs group | score ratio | score difference | success ratio | success difference (points) |",
                  "|---|---|---|---|---|"]
        seed_rows = []
        for g, eps, won in zip(groups[1:], episodes[1:], wins[1:]):
            if not eps:
                continue
            cells, seed_cells = [], []
            for rc in (ratio_ci95(episodes[0], eps), ratio_ci95(wins[0], won)):
                cells += [fmt_ratio(rc), "{:+.1f} [{:+.1f}, {:+.1f}]".format(rc["difference"], *rc["difference_ci95"])]
            for first, other in ((episodes[0], eps), (wins[0], won)):  # one mean per seed
                sl = seed_level_ci95([float(np.mean(x)) for x in first], [float(np.mean(x)) for x in other])
                n = "n = {} vs {}".format(*sl["n"])
                seed_cells.append(f"{sl['ratio']:.2f} ({n}: no interval)" if min(sl["n"]) < 2 and sl["ratio"] is not None
                                  else fmt_ratio(sl))
                seed_cells.append("{:+.1f} [{:+.1f}, {:+.1f}]".format(sl["difference"], *sl["difference_ci95"])
                                  if sl["difference_ci95"] is not None else f"{sl['difference']:+.1f} ({n}: no interval)")
            lines.append(f"| {group_label(g)} | " + " | ".join(cells) + " |")
            seed_rows.append(f"| {group_label(g)} | {len(episodes[0])} vs {len(eps)} | " + " | ".join(seed_cells) + " |")
        if not any(len(episodes[0]) > 1 and len(eps) > 1 for eps in episodes[1:]):
            lines += ["", "Seed level: no interval across seeds (n = 1: one seed on at least one side of every comparison)."]
            seed_rows = []
        if seed_rows:
            lines += ["", "The same, seed level (each run's held-out mean is one observation; episodes not resampled): "
                      "ratio of the group means with a 95 % bootstrap over seeds (each group's seeds resampled separately; "
                      "with 2–3 seeds a group has only 3–10 distinct resamples, so this interval is coarse and tends to be "
                      "too narrow), difference of the group means with a 95 % Welch t-interval; both need two seeds or more "
                      "in each group:", "",
                      "| vs group | seeds | score ratio, seed bootstrap | score difference, Welch t | success ratio, seed bootstrap "
                      "| success difference (points), Welch t |", "|---|---|---|---|---|---|", *seed_rows]
    lines += seed_paired_table(groups)
    lines += memory_table(runs)
    lines += stages_table(groups)
    adapt = [(r, a) for r in runs for a in r["adaptation"]]
    if adapt:
        lines += ["", "Adaptation (memory on, no weight update):", "",
                  "| run | split | trials | trial 1 score | last trial score | gain |", "|---|---|---|---|---|---|"]
        for r, a in adapt:
            t = a["trials"]
            gain = f"{a['gain_pct']:+.0f} %" if a.get("gain_pct") is not None else "–"
            lines.append(f"| {r['name']} | {a['settings']['split']} | {len(t)} | {fmt_ci(t[0]['score'], t[0]['score_ci95'])} "
                         f"| {fmt_ci(t[-1]['score'], t[-1]['score_ci95'])} | {gain} |")
    return "\n".join(lines) + "\n"


def seed_paired_table(groups: list[list[dict]]) -> list[str]:
    """The first group against each other group, paired by seed: runs of the same seed evaluate the same
    held-out goals with the same evaluation seed (and, in this project's comparisons, the same warm
    start), so each seed's difference is paired over goals, and the per-seed differences are the
    observations of a t-interval across seeds; the ratio is the geometric mean of the per-seed ratios of
    success, with a t-interval on their logarithms. Rows for seeds whose goals do not line up are left
    out and counted."""
    first = {str(r["seed"]): r for r in groups[0] if r["main"]}
    summary, per_seed = [], []
    for g in groups[1:]:
        label, diffs, log_ratios, unmatched = group_label(g), {"reward": [], "won": []}, [], 0
        for r in g:
            r0 = first.get(str(r["seed"]))
            if r0 is None or not r["main"]:
                continue
            ids0, ids = ([e["task_id"] for e in run["main"]["episodes"]] for run in (r0, r))
            if sorted(map(str, ids0)) != sorted(map(str, ids)):
                unmatched += 1
                continue
            cells = []
            for key in ("reward", "won"):
                d = paired_goal_difference(r["main"]["episodes"], r0["main"]["episodes"], key)   # first - other
                diffs[key].append(d["difference"])
                cells.append("{:+.1f} [{:+.1f}, {:+.1f}]".format(d["difference"], *d["difference_ci95"]))
            won0, won = (100 * float(np.mean([e["won"] for e in run["main"]["episodes"]])) for run in (r0, r))
            if won0 > 0 and won > 0:
                log_ratios.append(math.log(won0 / won))
            else:
                log_ratios.append(float("nan"))   # a zero success rate: no ratio for this seed
            per_seed.append(f"| {label} | {r['seed']} | {r0['name']} vs {r['name']} | {len(ids)} | {won0:.1f} | {won:.1f} | "
                            + " | ".join(cells) + " |")
        n = len(diffs["won"])
        if n == 0:
            continue
        if n < 2 or any(math.isnan(x) for x in log_ratios):
            ratio = "–" if any(math.isnan(x) for x in log_ratios) else f"{math.exp(log_ratios[0]):.2f} (n=1, no interval)"
        else:
            m, h = t_interval(log_ratios)
            ratio = f"{math.exp(m):.2f} [{math.exp(m - h):.2f}, {math.exp(m + h):.2f}]"
        summary.append(f"| {label} | {n}{f' ({unmatched} on other goals: left out)' if unmatched else ''} | {fmt_differences_over_seeds(diffs['reward'])} "
                       f"| {fmt_differences_over_seeds(diffs['won'])} | {ratio} |")
    if not summary:
        return []
    return ["", f"Paired by seed: {group_label(groups[0])} minus each other group, run against run of the same seed on "
            "the same held-out goals (paired over goals, 95 % bootstrap CI), then the per-seed differences over seeds "
            "(mean, 95 % Student's t interval, n − 1 degrees of freedom, and how many seeds are above 0). Success "
            "ratio: geometric mean of the per-seed ratios, t-interval on their logarithms (– where a run won nothing):", "",
            "| vs group | seeds paired | score difference, by seed | success difference (points), by seed "
            "| success ratio, by seed |", "|---|---|---|---|---|", *summary,
            "", "| vs group | seed | runs | goals | first success % | other success % | score difference, paired "
            "| success difference, paired |", "|---|---|---|---|---|---|---|---|", *per_seed]


TIP_INFORMATION = ("memory/tip_follow_success", "memory/blank_follow_success", "memory/walk_success")


def tips_carried(run: dict) -> str:
    """The table cell "tip / no tip / walk %": empo2.tip_information over the tips in the run's samples/, with
    the seeds training used (the iteration), pooled over the tips; "–" without tips or a follower."""
    tips = read_sample_tips(run["path"]) if run["config"] else []
    if not tips:
        return "–"
    cfg = run["config"]
    make_kwargs, task_kwargs = envs.settings(run["env"], cfg.get("max_steps", 0), cfg.get("task_names", ""))
    by_id = {t.task_id: t for t in envs.tasks(run["env"], "train", **task_kwargs)}
    per_iteration: dict[int, list] = {}
    for it, task_id, ret, tip in tips:
        per_iteration.setdefault(it, []).append((by_id[task_id], tip, ret))
    info = [(tip_information(run["env"], told, it, make_kwargs), len(told)) for it, told in sorted(per_iteration.items())]
    if not info[0][0]:
        return "–"
    pooled = [sum(x[k] * n for x, n in info) / len(tips) for k in TIP_INFORMATION]
    return " / ".join(f"{100 * v:.0f}" for v in pooled) + " %"


def memory_table(runs: list[dict]) -> list[str]:
    """What memory did during training, per run, from metrics.jsonl: groups drawn in memory mode (p), of
    them trained off-policy (the tips removed: only groups whose episodes saw tips), episodes that saw a
    tip, success of memory-mode vs plain rollouts pooled over the run, the largest share of off-policy tokens
    masked, and what the run's tips carry (empo2.tip_information on the tips in samples/: a scripted
    follower shown one tip, the same follower shown none, a random walk, each on that tip's task). For GRPO
    (p = 0) every group is plain."""
    lines = []
    for r in runs:
        rows = [x for x in r["metrics"] if "modes/plain" in x]
        if not rows or not r["config"]:
            continue
        size = r["config"]["group_size"]
        groups = {m: sum(x.get(f"modes/{m}", 0) for x in rows) for m in ("plain", "on_policy_tips", "off_policy")}

        def pooled(mode, counts):   # per-iteration success rates weighted by that iteration's episodes
            pairs = [(x[f"charts/success_{mode}"], c * size) for x, c in zip(rows, counts) if c and x.get(f"charts/success_{mode}") is not None]
            n, won = sum(k for _, k in pairs), sum(v * k for v, k in pairs)
            return f"{won:.0f}/{n} = {100 * won / n:.0f} %" if n else "–"
        memory = [x.get("modes/on_policy_tips", 0) + x.get("modes/off_policy", 0) for x in rows]
        lines.append(f"| {r['name']} | {sum(groups.values())} | {sum(memory)} | {groups['off_policy']} "
                     f"| {sum(x.get('memory/episodes_with_tips', 0) for x in rows)} | {pooled('memory', memory)} "
                     f"| {pooled('plain', [x['modes/plain'] for x in rows])} "
                     f"| {max(x.get('losses/masked_frac', 0.0) for x in rows):.2f} | {tips_carried(r)} |")
    if not lines:
        return []
    return ["", "Memory during training (metrics.jsonl; a memory group whose task has no tip yet trains on-policy; "
            "success pooled over the run's iterations; the last column: what the tips in samples/ tell a reader "
            "that follows them perfectly, each tip's task played once by envs/tips.py's goal-blind follower shown that "
            "tip, then with the same seed by the follower shown no tip and by a random walk, training tasks):", "",
            "| run | groups | memory-mode groups | of them trained off-policy | episodes that saw a tip "
            "| success, memory-mode rollouts | success, plain rollouts | off-policy tokens masked, max "
            "| success of a scripted follower shown one of its tips / shown none / a random walk |",
            "|---|---|---|---|---|---|---|---|---|", *lines]


def stages_table(groups: list[list[dict]]) -> list[str]:
    """Per group of seeds: untrained -> warm start -> trained on the held-out split (one run: mean over its
    episodes ± normal-approximation 95 % CI; several seeds: mean of the per-seed values ± 95 % t-interval
    across seeds); trained minus warm start with a two-level bootstrap CI (seeds, then episodes); and per
    seed, trained minus warm start paired by goal, with its mean over seeds (t-interval)."""
    with_stages = [(g, [r for r in g if "trained" in r["stages"]]) for g in groups]
    with_stages = [(g, runs) for g, runs in with_stages if runs]
    if not with_stages:
        return []
    lines = ["", "Held-out test split, no memory, T = 0.4, every run with train.py's eval.json. One run: mean over its "
             "episodes ± 95 % CI (normal approximation over episodes). Several runs (seeds): mean of the per-seed "
             "values ± 95 % t-interval across seeds (n − 1 degrees of freedom, n = runs):", "",
             "| group | stage | runs | episodes | score | success % | valid actions % |", "|---|---|---|---|---|---|---|"]
    diffs, per_seed = [], []
    for label, g in ((group_label(g), runs) for g, runs in with_stages):
        for stage in STAGES:
            have = [r["stages"][stage]["episodes"] for r in g if stage in r["stages"]]
            if not have:
                continue
            n_eps = sum(len(eps) for eps in have)
            if len(have) == 1:
                st = episode_stats(have[0])
                cells = [fmt_ci(st["score"], st["score_ci95"]), fmt_ci(st["success_rate"], st["success_ci95"]),
                         fmt_ci(st["valid_action_rate"], st["valid_ci95"])]
            else:
                seeds = [episode_stats(eps) for eps in have]
                cells = [fmt_t([st[k] for st in seeds if not math.isnan(st[k])])
                         for k in ("score", "success_rate", "valid_action_rate")]
            lines.append(f"| {label} | {stage.replace('_', ' ')} | {len(have)} | {n_eps} | " + " | ".join(cells) + " |")
        both = [r for r in g if "warm_start" in r["stages"]]
        if len(both) == len(g):
            # paired: each run's two evaluations lined up by task_id (both play the same held-out goals)
            lined = [paired_by_goal(r["stages"]["warm_start"]["episodes"], r["stages"]["trained"]["episodes"]) for r in g]
            runs = {"warm_start": [r["stages"]["warm_start"]["episodes"] for r in g],
                    "trained": [r["stages"]["trained"]["episodes"] for r in g]}
            cells = []
            for paired in (False, True):
                for key, scale in (("reward", 100), ("won", 100.0)):
                    if paired and not all(b for b, _ in lined):
                        cells.append("–")
                        continue
                    if paired:
                        num, den = [[scale * e[key] for e in a] for _, a in lined], [[scale * e[key] for e in b] for b, _ in lined]
                    else:
                        num, den = ([[scale * e[key] for e in eps] for eps in runs[k]] for k in ("trained", "warm_start"))
                    d = ratio_ci95(num, den, paired=paired)
                    cells.append("{:+.1f} [{:+.1f}, {:+.1f}]".format(d["difference"], *d["difference_ci95"]))
            diffs.append(f"| {label} | " + " | ".join(cells) + " |")
        per_seed += seed_rows(label, both)
    if diffs:
        lines += ["", "Trained minus warm start, 95 % CI by a two-level bootstrap over seeds and episodes: independent "
                  "(the two evaluations resampled separately) and paired (the same goals resampled together; "
                  "both evaluations play the same held-out goals, lined up by task_id):", "",
                  "| group | score difference | success difference (points) | score difference, paired "
                  "| success difference, paired |", "|---|---|---|---|---|", *diffs]
    if per_seed:
        lines += ["", "Per seed: warm start and trained policy of each run on the same held-out goals; trained minus warm "
                  "start paired by task_id, 95 % bootstrap CI over goals; valid actions of the trained policy (% of steps). "
                  "\"over seeds\": the mean of the per-seed values ± 95 % t-interval across seeds (n − 1 degrees of "
                  "freedom; for the differences the interval is [low, high]), and how many seeds' differences are above "
                  "zero; groups of one run have no such row (n = 1: no interval across seeds):", "",
                  "| run | seed | warm start score | trained score | score difference, paired | warm start success % "
                  "| trained success % | success difference, paired | valid actions %, trained |",
                  "|---|---|---|---|---|---|---|---|---|", *per_seed]
    return lines


def seed_rows(label: str, runs: list[dict]) -> list[str]:
    """stages_table's per-seed rows for the runs of one group (each with a warm-start and a trained
    evaluation), then the row "over seeds" where the group has two runs or more."""
    def diff(d):
        return "–" if d["n_goals"] == 0 else "{:+.1f} [{:+.1f}, {:+.1f}]".format(d["difference"], *d["difference_ci95"])

    rows, cols = [], {k: [] for k in ("ws_score", "tr_score", "d_score", "ws_won", "tr_won", "d_won", "valid")}
    for r in runs:
        ws, tr = r["stages"]["warm_start"], r["stages"]["trained"]
        ds, dw = (paired_goal_difference(ws["episodes"], tr["episodes"], key) for key in ("reward", "won"))
        valid = episode_stats(tr["episodes"])["valid_action_rate"]
        for k, v in zip(cols, (ws["score"], tr["score"], ds["difference"], ws["success_rate"], tr["success_rate"],
                               dw["difference"], valid)):
            cols[k].append(v)
        rows.append(f"| {r['name']} | {r['seed']} | {ws['score']:.1f} | {tr['score']:.1f} | {diff(ds)} "
                    f"| {ws['success_rate']:.1f} | {tr['success_rate']:.1f} | {diff(dw)} | "
                    + ("–" if math.isnan(valid) else f"{valid:.1f}") + " |")
    if len(runs) > 1:
        rows.append(f"| {label} | over seeds (n = {len(runs)}) | {fmt_t(cols['ws_score'])} | {fmt_t(cols['tr_score'])} "
                    f"| {fmt_differences_over_seeds(cols['d_score'])} | {fmt_t(cols['ws_won'])} | {fmt_t(cols['tr_won'])} "
                    f"| {fmt_differences_over_seeds(cols['d_won'])} "
                    f"| {fmt_t([v for v in cols['valid'] if not math.isnan(v)])} |")
    return rows


def plot_compare(groups: list[list[dict]], metric: str, png: Path) -> None:
    import matplotlib.ticker
    from matplotlib.figure import Figure  # no pyplot: leaves a notebook's plotting backend alone
    with_adapt = [g for g in groups if any(r["adaptation"] for r in g)]
    fig = Figure(figsize=(12 if with_adapt else 6.5, 4))
    axes = fig.subplots(1, 2 if with_adapt else 1, squeeze=False)
    ax = axes[0][0]
    for k, g in enumerate(groups):
        curves = [{x["iteration"]: x[metric] for x in r["metrics"] if metric in x} for r in g]
        its = sorted(set().union(*curves))
        if not its:
            continue
        vals = [[c[i] for c in curves if i in c] for i in its]
        mean = [float(np.mean(v)) for v in vals]
        ax.plot(its, mean, marker="o", ms=3, color=f"C{k}", label=group_label(g))
        if len(g) > 1:  # shaded: min-max over seeds
            ax.fill_between(its, [min(v) for v in vals], [max(v) for v in vals], color=f"C{k}", alpha=0.2)
    ax.set_xlabel("iteration")
    names = {"charts/return_ext": "mean extrinsic return", "charts/return": "mean return (ext + int - penalty)",
             "charts/success_rate": "success rate"}
    ax.set_ylabel(f"{names.get(metric, metric)} (training rollouts)")
    ax.set_title("learning curves (mean over seeds, min–max shaded)")
    ax.grid(alpha=0.3)
    if ax.lines:
        ax.legend(fontsize=8)
    else:
        ax.text(0.5, 0.5, "no metrics.jsonl", ha="center", va="center", transform=ax.transAxes)
    if with_adapt:
        ax = axes[0][1]
        for k, g in enumerate(groups):
            for split in sorted({a["settings"]["split"] for r in g for a in r["adaptation"]}):
                runs = [[t["score"] for t in a["trials"]] for r in g for a in r["adaptation"] if a["settings"]["split"] == split]
                n = min(len(s) for s in runs)
                x = np.arange(1, n + 1)
                arr = np.array([s[:n] for s in runs])
                have = [r for r in g if any(a["settings"]["split"] == split for a in r["adaptation"])]
                label = f"{group_label(g) if len(have) == len(g) else ', '.join(r['name'] for r in have)} [{split}]"
                if len(runs) > 1:
                    ax.plot(x, arr.mean(0), marker="o", color=f"C{k}", label=label)
                    ax.fill_between(x, arr.min(0), arr.max(0), color=f"C{k}", alpha=0.2)
                else:
                    a = next(a for r in g for a in r["adaptation"] if a["settings"]["split"] == split)
                    ci = [t["score_ci95"] if t["score_ci95"] is not None else 0.0 for t in a["trials"][:n]]
                    ax.errorbar(x, arr[0], yerr=ci, marker="o", capsize=3, color=f"C{k}", label=label)
        ax.set_xlabel("trial")
        ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
        ax.set_ylabel("score (100 × mean return)")
        ax.set_title("adaptation: memory on, no weight update")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    replace_atomically(png, lambda tmp: fig.savefig(tmp, format="png", dpi=100))


def compare(parser, args) -> int:
    runs = [read_run(parser, Path(p)) for p in args.compare]
    groups = group_runs(runs)
    out = Path(args.out or "compare.md")
    png = out.with_suffix(".png")
    table = compare_table(runs, groups)
    plot_compare(groups, RENAMED_METRICS.get(args.metric, args.metric), png)   # an old key still works
    write_atomically(out, f"# Runs compared\n\n{table}\n![learning curves]({png.name})\n")
    print(table)
    print(f"wrote {out} and {png}")
    return 0


def sweep(parser, args) -> int:
    """The validation table settings are chosen by: per run, the val split's success and score before
    (warm start) and after training, paired over the same goals, the lowest valid-action rate seen in
    training or validation, and the largest KL to the warm start; per setting, the mean over seeds with
    a Student's t interval. Run names are SETTING-sSEED (scripts/sweep.sh)."""
    rows, by_setting = [], {}
    for path in map(Path, args.sweep):
        try:
            ev = json.loads((path / "eval.json").read_text())
            metrics = read_metrics(path / "metrics.jsonl")
        except (OSError, ValueError) as e:
            parser.error(f"--sweep {path}: unreadable run ({e})")
        if "warm_start_val" not in ev or "trained_val" not in ev:
            print(f"skipped {path}: no validation before and after training (train with --val-every)")
            continue
        before, after = ev["warm_start_val"]["episodes"], ev["trained_val"]["episodes"]
        win, score = ([d["difference"], *d["difference_ci95"]] for d in
                      (paired_goal_difference(before, after, k) for k in ("won", "reward")))
        valid = min([100 * m["charts/valid_action_rate"] for m in metrics] +
                    [m["val/valid_action_rate"] for m in metrics if m.get("val/valid_action_rate") is not None])
        setting = re.sub(r"-s\d+$", "", path.name.rstrip("/"))
        by_setting.setdefault(setting, []).append((win[0], score[0]))
        minutes = sum(m.get("time/iteration_s", 0) for m in metrics) / 60
        rows.append(f"| {path.name} | {ev['warm_start_val']['success_rate']:.1f} → {ev['trained_val']['success_rate']:.1f} "
                    f"| {win[0]:+.1f} [{win[1]:+.1f}, {win[2]:+.1f}] | {score[0]:+.1f} [{score[1]:+.1f}, {score[2]:+.1f}] "
                    f"| {valid:.0f} % | {max(m.get('losses/approx_kl', 0) for m in metrics):.3f} | {minutes:.1f} |")
    lines = ["Validation split, trained − warm start, paired over the same goals (95 % bootstrap CI over goals):", "",
             "| run | val success % | success difference | score difference | lowest valid actions (training, T=1, or val) | max KL to warm start "
             "| training min |", "|---|---|---|---|---|---|---|", *rows, "",
             "Per setting, mean over seeds ± Student's t 95 % half-width:", "",
             "| setting | seeds | success difference | score difference | seeds with success gain > 0 |", "|---|---|---|---|---|"]
    for setting, vals in by_setting.items():
        lines.append(f"| {setting} | {len(vals)} | {fmt_t([v[0] for v in vals], signed=True)} "
                     f"| {fmt_t([v[1] for v in vals], signed=True)} | {sum(v[0] > 0 for v in vals)} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        write_atomically(Path(args.out), text)
    return 0


def main(argv=None) -> int:
    parser, args = parse_args(argv)
    keep_freed_memory()   # speed only (sampler.py)
    if args.sweep is not None:
        return sweep(parser, args)
    if args.compare is not None:
        return compare(parser, args)
    if args.memory in ("both", "all"):
        return adaptation_with_control(parser, args)
    evaluate(parser, args)
    return 0


def adaptation_with_control(parser, args) -> int:
    """The adaptation test (memory on) and its control (memory off: the same goals, seed and number of
    trials, each trial independent), with --memory all also the shuffled-tips control; then all per trial
    side by side, and on − off (on − shuffled) at the last trial paired over goals."""
    results = {}
    for memory in ("off", "on", "shuffled") if args.memory == "all" else ("off", "on"):
        print(f"--- memory {memory}")
        out = evaluate(parser, argparse.Namespace(**{**vars(args), "memory": memory}))
        results[memory] = json.loads(out.read_text())
    print(adaptation_table(results["off"], results["on"], results.get("shuffled")))
    return 0


def adaptation_table(off: dict, on: dict, shuffled: dict | None = None) -> str:
    """Markdown: success and score per trial with memory on and off (and with shuffled tips), what the tips
    written in each memory-on trial tell a scripted follower (empo2.tip_information, its own seed; evaluations
    made before it existed show –), and the paired differences at the last trial."""
    cols = ["memory on", "memory off"] + (["shuffled tips"] if shuffled else [])
    runs = [on, off] + ([shuffled] if shuffled else [])
    lines = ["| trial | " + " | ".join(f"success, {c}" for c in cols) + " | " + " | ".join(f"score, {c}" for c in cols)
             + " | episodes with tips | its tips: a scripted follower shown one / shown none / a random walk |",
             "|---|" + "---|" * (2 * len(cols) + 2)]
    keys = [key.split("/")[1] for key in TIP_INFORMATION]   # as evaluate stores them per trial
    for k, a in enumerate(on["trials"]):
        rows = [r["trials"][k] for r in runs]
        told = " / ".join(f"{a[key]:.0f}" if key in a else "–" for key in keys) + " %" if keys[0] in a else "–"
        lines.append(f"| {a['trial']} | " + " | ".join(fmt_ci(r['success_rate'], r['success_ci95']) for r in rows) + " | "
                     + " | ".join(fmt_ci(r['score'], r['score_ci95']) for r in rows) + f" | {a['episodes_with_tips']} | {told} |")
    last = on["trials"][-1]["trial"]
    at = lambda result, k: [e for e in result["episodes"] if e["trial"] == k]

    def diff(before: list[dict], after: list[dict]) -> str:   # success and score, paired over goals
        out = []
        for key, what in (("won", "success"), ("reward", "score")):
            d = paired_goal_difference(before, after, key)
            (lo, hi) = d["difference_ci95"]
            out.append(f"{what} {d['difference']:+.1f} [{lo:+.1f}, {hi:+.1f}]")
        return ", ".join(out)
    n_goals = len(paired_by_goal(at(off, last), at(on, last))[0])
    lines += ["", f"Trial {last}, memory on − memory off, paired over {n_goals} goals (95 % bootstrap CI, points): "
              f"{diff(at(off, last), at(on, last))}; memory on, trial {last} − trial 1: {diff(at(on, 1), at(on, last))}."]
    if shuffled:
        lines[-1] += f" Memory on − shuffled tips: {diff(at(shuffled, last), at(on, last))} (what the tips' content adds)."
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
