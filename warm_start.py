"""Behaviour-cloning warm start: the common starting policy of EMPO² and GRPO for models that cannot act yet.

Measured on webshop-mini: the untrained 135M default model writes a valid action in few steps and
never buys anything, so every return is 0 and neither algorithm has anything to compare. As WebShop's
own paper does before RL (imitation, then RL), a short LoRA fine-tune on episodes of a scripted
demonstrator teaches the action syntax and a naive strategy first:

    demonstrations(policy, cfg)        N episodes of envs.demonstrator(env): it reads only the
                                       observation the agent sees (never env.goal), and its episodes
                                       are built from token segments exactly as rollout() builds them
    behaviour_clone(policy, trajs, cfg) LoRA, AdamW, mean negative log-likelihood of the action tokens
    warm_start(policy, cfg)            load the adapter from the cache, or build and cache it

RL then has to find what the demonstrator does not know (webshop-mini: which option the instruction
asks for; rooms: where the goal object is). The cached adapter is keyed by everything that shapes it
(model, dtype, env, N, seed, epochs, learning rate, LoRA shape, the prompt, and the source code of the
env module and of the functions below), so EMPO² and GRPO runs with the same settings start from the
same weights.
A cache entry that is missing, unreadable or made for other settings is rebuilt, never used.
"""
from __future__ import annotations

import hashlib
import inspect
import json
import random
import re
import string
import time
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

import envs
from empo2 import (MEMORY, ON_POLICY, ON_POLICY_TIPS, PLAIN, SYSTEM_PROMPT, Trajectory, episode_start, fit_tips,
                   reflection_prompt)
from envs.tips import FOLLOWERS, scripted_tip
from utils import mean_ci95, replace_atomically, write_atomically
from sampler import SharedPrefix


def invalid_action(obs: str, previous: str | None, action: str, rng: random.Random) -> str | None:
    """A wrong action of the two kinds the cloned webshop-mini policy was seen repeating to the step
    limit (README, "webshop-mini, GRPO, 8 iterations"): its previous action again where this page no
    longer lists it, or the demonstrator's next action with a made-up argument (a product id that is
    not on the page). It reads the observation and the demonstrator's own actions, never the task.
    None where no wrong action is sure to be invalid: a free-text form (search[<your query>]) takes any text."""
    valid = {envs.normalize_action(a) for a in envs.valid_actions_of(obs)}
    if not valid or any("<" in a and ">" in a for a in valid):
        return None
    wrong = [previous] if previous and envs.normalize_action(previous) not in valid else []
    parts = re.fullmatch(r"(.*\[)(.+)\]", action) or re.fullmatch(r"(.* )(\S+)", action)
    if parts:
        head, arg = parts.groups()
        keep = 2 if len(arg) >= 6 else 0     # made-up ids start like real ones ("b0..."), as the policy's do
        made_up = arg[:keep] + "".join(rng.choice(string.ascii_lowercase + string.digits)
                                       for _ in range(max(4, len(arg)) - keep))
        made_up = head + made_up + ("]" if head.endswith("[") else "")
        if envs.normalize_action(made_up) not in valid:
            wrong.append(made_up)
    return rng.choice(wrong) if wrong else None


def demonstration(policy, env, task, demonstrator, rng: random.Random, use_demo: bool,
                  mistakes: float = 0.0, mistake_rng: random.Random | None = None) -> Trajectory:
    """One demonstrator episode as a Trajectory whose segments are those rollout() would have built
    had the policy sampled the same actions (each action ends with the end-of-turn token).

    mistakes > 0: before each demonstrator action, with this probability (twice in a row at most), an
    invalid_action is taken first; its tokens are context, not cloned, and the action cloned after it
    is the one the demonstrator chose on the page itself, which an invalid action leaves unchanged.
    Its draws come from mistake_rng, so the demonstrator's own draws are those of mistakes = 0."""
    chat = policy.chat
    obs, _ = env.reset(task)
    tr = Trajectory(task=task, group=0, rollout_mode=PLAIN, update_mode=ON_POLICY, first_obs=obs)
    tr.segments.append(("context", policy.encode(episode_start(policy, env, obs, use_demo))))
    done, previous = False, None

    def take(action: str, cloned: bool):
        act_ids = policy.encode(action) + [policy.end_of_turn_id]
        tr.segments.extend([("context", policy.encode(chat.user_to_assistant)),
                            ("action" if cloned else "context", act_ids)])
        tr.transcript.append({"observation": obs, "tips": [], "action": action})
        next_obs, reward, done, info = env.step(action)
        tr.rewards.append(float(reward))
        tr.transcript[-1].update(reward=float(reward), valid=bool(info.get("valid", True)))
        tr.score, tr.won = float(info.get("score", 0.0)), bool(info.get("won", False))
        if not done:
            tr.segments.append(("context", policy.encode(policy.after_action(act_ids) + next_obs)))
        return next_obs, done

    while not done:
        action, page = demonstrator(obs, rng), obs
        for _ in range(2 if mistakes else 0):
            wrong = invalid_action(page, previous, action, mistake_rng) if mistake_rng.random() < mistakes else None
            if wrong is None or done:
                break
            obs, done = take(wrong, cloned=False)
            tr.transcript[-1]["injected"] = True
            previous = wrong
        if not done:
            obs, done = take(action, cloned=True)
            previous = action
    tr.final_obs = obs
    return tr


def spread_over_kinds(pool: list, kind, n: int, rng: random.Random) -> list:
    """n tasks of the pool taken in turns from each kind of task (kinds in a random order, a random task
    of the kind each time, no task twice while the kind has unused ones): every kind once before any twice."""
    by_kind: dict[str, list] = {}
    for task in pool:
        by_kind.setdefault(kind(task), []).append(task)
    order = sorted(by_kind)
    rng.shuffle(order)
    unused = {k: rng.sample(by_kind[k], len(by_kind[k])) for k in order}
    tasks = []
    while len(tasks) < n:
        for k in order[:n - len(tasks)]:
            tasks.append(unused[k].pop() if unused[k] else rng.choice(by_kind[k]))
    return tasks


def demonstrations(policy, cfg, make_kwargs: dict | None = None) -> list[Trajectory]:
    """cfg.warm_start_episodes demonstrator episodes on training tasks drawn with cfg.warm_start_seed."""
    demonstrator = envs.demonstrator(cfg.env)
    if demonstrator is None:
        raise ValueError(f"{cfg.env} has no scripted demonstrator, so there is no warm start for it; "
                         f"pass --warm-start off")
    rng = random.Random(cfg.warm_start_seed)
    pool = envs.tasks(cfg.env, "train", **envs.settings(cfg.env, cfg.max_steps, cfg.task_names)[1])
    if cfg.warm_start_spread:
        tasks = spread_over_kinds(pool, envs.task_kind(cfg.env), cfg.warm_start_episodes, rng)
    else:
        tasks = [pool[k] for k in rng.sample(range(len(pool)), min(cfg.warm_start_episodes, len(pool)))]
        tasks += [rng.choice(pool) for _ in range(cfg.warm_start_episodes - len(tasks))]  # a pool smaller than N
    env = envs.make(cfg.env, split="train", seed=cfg.warm_start_seed, **(make_kwargs or {}))
    mistake_rng = random.Random(cfg.warm_start_seed + 2)
    try:
        return [demonstration(policy, env, t, demonstrator, rng, cfg.shows_demo, cfg.warm_start_mistakes, mistake_rng)
                for t in tasks]
    finally:
        env.close()


def tip_demonstration(policy, tr: Trajectory, cfg) -> Trajectory:
    """The reflection step (docs/algorithm.md, step 3) as a demonstration: the episode and the reflection
    prompt as context, the scripted tip (written only from what the episode saw) as the action cloned.
    Its .tip is the text cloned."""
    # cut to what a reflection can write (cfg.tip_max_new_tokens with its end-of-turn token): the policy
    # learns no longer tips, and memory_demonstrations shows this cut tip, the most a self-written tip holds
    tip_ids = policy.encode(scripted_tip(cfg.env, tr.transcript, tr.final_obs, tr.ext_return))[:cfg.tip_max_new_tokens - 1]
    out = Trajectory(task=tr.task, group=0, rollout_mode=PLAIN, update_mode=ON_POLICY, first_obs=tr.first_obs,
                     tip=policy.decode(tip_ids).strip())
    out.segments = [("context", reflection_prompt(policy, tr, cfg)), ("action", tip_ids + [policy.end_of_turn_id])]
    return out


def memory_demonstrations(policy, trajs: list[Trajectory], tips: list[str], cfg,
                          make_kwargs: dict | None = None) -> list[Trajectory]:
    """A second attempt at each demonstration's task in memory mode (docs/algorithm.md, step 2): the first
    attempt's scripted tip (tips[k], from tip_demonstration) shown at the first step, as a memory rollout
    shows a retrieved tip, and a demonstrator that follows it (envs/tips.py, FOLLOWERS; it sees the
    observation and the tips, never the task)."""
    env = envs.make(cfg.env, split="train", seed=cfg.warm_start_seed + 1, **(make_kwargs or {}))
    rng, out = random.Random(cfg.warm_start_seed + 1), []
    try:
        for first, tip in zip(trajs, tips):
            tip_ids, shown = fit_tips(policy, [f"{tip} (score: {first.ext_return:.2f})"], cfg.tip_block_tokens)
            tr = demonstration(policy, env, first.task, FOLLOWERS[cfg.env](shown), rng, cfg.shows_demo)
            # the tip block goes where prepare_step puts it: after the first observation, before the turn ends
            tr.segments.insert(1, ("tip", tip_ids))
            tr.transcript[0]["tips"] = shown
            tr.rollout_mode, tr.update_mode = MEMORY, ON_POLICY_TIPS
            out.append(tr)
    finally:
        env.close()
    return out


def behaviour_clone(policy, trajs: list[Trajectory], cfg) -> list[float]:
    """Minimise the mean negative log-likelihood of the demonstrator's action tokens (LoRA only).

    cfg.warm_start_epochs passes over the episodes in a seeded random order, cfg.warm_start_batch
    episodes per AdamW step. Returns the mean NLL per action token of every step."""
    params = policy.lora_parameters()
    optimizer = torch.optim.AdamW(params, lr=cfg.warm_start_lr, weight_decay=0.0)
    rng = np.random.default_rng(cfg.warm_start_seed)
    policy.model.train()
    losses = []
    n_steps = cfg.warm_start_epochs * -(-len(trajs) // cfg.warm_start_batch)
    bar = tqdm(total=n_steps, desc="warm start (behaviour cloning)", leave=False)
    for _epoch in range(cfg.warm_start_epochs):
        order = rng.permutation(len(trajs))
        for start in range(0, len(order), cfg.warm_start_batch):
            batch = [trajs[k] for k in order[start:start + cfg.warm_start_batch]]
            n_tokens = sum(sum(mask) for mask in (tr.tokens()[1] for tr in batch))
            optimizer.zero_grad(set_to_none=True)
            total = 0.0
            prefix = SharedPrefix(policy, [tr.tokens() for tr in batch])   # system prompt and example turns, once
            for tr in batch:
                ids, mask = tr.tokens()
                logp, _ = policy.score(ids, mask, prefix=prefix)   # (n_action_tokens,)
                loss = -logp.sum() / n_tokens                      # token mean over the batch
                loss.backward()
                total += float(loss.detach())
            prefix.backward()
            torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)
            optimizer.step()
            losses.append(total)
            bar.update()
            bar.set_postfix(nll=f"{total:.3f}")
    bar.close()
    optimizer.zero_grad(set_to_none=True)
    return losses


# ----------------------------------------------------------------------------------------
def source_hash(*objects) -> str:
    """A hash of the source code of modules and functions: an edit to any of them is a new warm start."""
    h = hashlib.sha256()
    for obj in objects:
        h.update(inspect.getsource(obj).encode())
    return h.hexdigest()[:16]


def cache_key(policy, cfg) -> dict:
    """Everything that shapes the warm-start adapter; a cache entry is used only if its key is equal."""
    chat = policy.chat
    demo = envs.make(cfg.env).demo if cfg.shows_demo else []
    prompt = json.dumps([chat.prefix, SYSTEM_PROMPT, chat.system_to_user, chat.user_to_assistant,
                         chat.assistant_to_user, demo])
    return {"model": cfg.model if cfg.model == "default" or not Path(cfg.model).exists() else str(Path(cfg.model).resolve()),
            "dtype": str(next(policy.model.parameters()).dtype).removeprefix("torch."),
            "env": cfg.env, "task_names": cfg.task_names, "max_steps": cfg.max_steps,
            "episodes": cfg.warm_start_episodes, "epochs": cfg.warm_start_epochs, "lr": cfg.warm_start_lr,
            "batch": cfg.warm_start_batch, "seed": cfg.warm_start_seed, "lora_r": cfg.lora_r, "lora_alpha": cfg.lora_alpha,
            "max_grad_norm": cfg.max_grad_norm, "prompt": hashlib.sha256(prompt.encode()).hexdigest()[:16],
            "code": source_hash(envs.module(cfg.env), invalid_action, demonstration, demonstrations, behaviour_clone),
            **({"mistakes": cfg.warm_start_mistakes} if cfg.warm_start_mistakes else {}),
            **({"spread": source_hash(spread_over_kinds, envs.task_kind(cfg.env))} if cfg.warm_start_spread else {}),
            **({"tips": source_hash(tip_demonstration, memory_demonstrations, reflection_prompt, envs.tips)}
               if cfg.warm_start_tips else {})}


def cache_folder(key: dict) -> Path:
    from policy import cache_dir
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return cache_dir() / "warm_start" / f"{key['env']}-{digest}"


def load_cached(policy, folder: Path, key: dict) -> dict | None:
    """The cached entry's meta dict after loading its adapter into the policy; None (with the reason
    printed) when the entry is missing, unreadable, or was made for other settings."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file
    if not folder.exists():
        return None
    before = {k: v.detach().clone() for k, v in policy.model.state_dict().items() if "lora_" in k}
    try:
        meta = json.loads((folder / "meta.json").read_text())
        if meta.get("key") != key:
            print(f"warm start: {folder} was made for other settings; rebuilding it")
            return None
        weights = load_file(folder / "adapter" / "adapter_model.safetensors")
        result = set_peft_model_state_dict(policy.model, weights)
        if getattr(result, "unexpected_keys", None) or len(weights) != len(before):
            raise ValueError(f"the adapter's tensors do not match the model's LoRA layers "
                             f"({len(weights)} vs {len(before)})")
        return meta
    except Exception as e:  # noqa: BLE001 -- any failure to read the entry (safetensors raises its own) means rebuild
        policy.model.load_state_dict(before, strict=False)   # nothing half-loaded stays behind
        print(f"warm start: the cache entry {folder} is unreadable ({type(e).__name__}: {e}); rebuilding it")
        return None


def warm_start(policy, cfg, make_kwargs: dict | None = None) -> dict:
    """Load the warm-start adapter into the policy's LoRA, or build it (demonstrations, behaviour
    cloning) and cache it. Returns the entry's meta: key, demonstrator score, losses, build time."""
    key = cache_key(policy, cfg)
    folder = cache_folder(key)
    meta = load_cached(policy, folder, key)
    if meta is not None:
        print(f"warm start: loaded {folder} (built in {meta['build_s']:.0f} s)")
        return {**meta, "cached": True, "folder": str(folder)}
    t0 = time.time()
    trajs = demonstrations(policy, cfg, make_kwargs)
    tip_trajs = []   # --warm-start-tips: writing a tip after each episode, and following one in a second attempt
    if cfg.warm_start_tips:
        tip_trajs = [tip_demonstration(policy, tr, cfg) for tr in trajs]
        tip_trajs += memory_demonstrations(policy, trajs, [tr.tip for tr in tip_trajs], cfg, make_kwargs)
    score, score_ci = mean_ci95([100 * tr.score for tr in trajs])
    success, success_ci = mean_ci95([100 * tr.won for tr in trajs])
    tokens = sum(sum(tr.tokens()[1]) for tr in trajs)
    injected = sum(step.get("injected", False) for tr in trajs for step in tr.transcript)
    print(f"warm start: {len(trajs)} demonstrator episodes on training tasks (score {score:.1f}, success "
          f"{success:.0f} %, {tokens} action tokens"
          + (f", {injected} injected invalid actions shown, not cloned" if cfg.warm_start_mistakes else "")
          + f"); behaviour cloning for {cfg.warm_start_epochs} epochs")
    if tip_trajs:
        followed = tip_trajs[len(trajs):]
        print(f"warm start: + {len(trajs)} reflections with scripted tips, e.g. {tip_trajs[0].tip!r}; + {len(followed)} "
              f"second attempts that follow them (success {100 * np.mean([tr.won for tr in followed]):.0f} %, "
              f"first attempts {success:.0f} %)")
    losses = behaviour_clone(policy, trajs + tip_trajs, cfg)
    meta = {"key": key, "build_s": time.time() - t0, "losses": losses,
            "scripted_tips": [tr.tip for tr in tip_trajs[:len(trajs)]],
            "tip_following": {"episodes": len(tip_trajs[len(trajs):]),
                              "success_rate": float(np.mean([100 * tr.won for tr in tip_trajs[len(trajs):]] or [np.nan]))},
            "demonstrator": {"episodes": len(trajs), "score": score, "score_ci95": score_ci, "success_rate": success,
                             "success_ci95": success_ci, "mean_steps": float(np.mean([len(tr.rewards) for tr in trajs])),
                             "action_tokens": tokens, "injected_invalid_actions": injected}}

    def write(tmp: Path) -> None:
        policy.model.save_pretrained(tmp / "adapter")
        write_atomically(tmp / "meta.json", json.dumps(meta, indent=1))
    replace_atomically(folder, write)
    print(f"warm start: NLL per action token {losses[0]:.3f} -> {losses[-1]:.3f} in {meta['build_s']:.0f} s; "
          f"cached in {folder}")
    return {**meta, "cached": False, "folder": str(folder)}
