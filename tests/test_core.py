"""Rollouts, tips, the hybrid update: the plumbing that a wrong line would silently break."""
import numpy as np
import pytest
import torch

import envs
from empo2 import (Config, episode_returns, grpo_advantages, intrinsic_rewards, reflect, rollout, store_tips,
                   tip_block, update_policy)
from memory import NoveltyCounter, TipMemory
from policy import ChatFormat


def rooms_batch(n_tasks, group_size=1, split="train"):
    tasks = [t for t in envs.tasks("rooms", split)[:n_tasks] for _ in range(group_size)]
    return tasks, [envs.make("rooms") for _ in tasks]


def test_chat_format_of_smollm2(tiny_policy):
    assert tiny_policy.chat == ChatFormat(prefix="<|im_start|>system\n", system_to_user="<|im_end|>\n<|im_start|>user\n",
                                          user_to_assistant="<|im_end|>\n<|im_start|>assistant\n",
                                          assistant_to_user="<|im_end|>\n<|im_start|>user\n")
    assert tiny_policy.tokenizer.convert_ids_to_tokens(tiny_policy.stop_ids) == ["<|im_end|>"]


def test_trajectory_tokens_render_like_the_chat_template(tiny_policy, embedder):
    """The segments, decoded, are exactly what the tokenizer's chat template makes of the conversation."""
    cfg = Config(env="rooms", max_steps=3, max_new_tokens=6, demo="on")
    tasks, pool = rooms_batch(2)
    memory = TipMemory()
    memory.add(tasks[0].task_id, embedder([pool[0].reset(tasks[0])[0]])[0], "go to the hallway first", 1.0)
    trajs = rollout(tiny_policy, pool, tasks, [("memory", "off-policy"), ("plain", "on-policy")], cfg,
                    memory=memory, embedder=embedder, temperature=1.0)
    tok = tiny_policy.tokenizer
    assert trajs[0].has_tips and not trajs[1].has_tips
    for tr in trajs:
        messages = [{"role": "system", "content": __import__("empo2").SYSTEM_PROMPT}]
        for demo_obs, demo_act in pool[0].demo:
            messages += [{"role": "user", "content": demo_obs}, {"role": "assistant", "content": demo_act}]
        actions = [seg for kind, seg in tr.segments if kind == "action"]
        for step, act in zip(tr.transcript, actions):
            messages.append({"role": "user", "content": step["observation"] + (tip_block(step["tips"]) if step["tips"] else "")})
            ids = act[:-1] if act[-1] in tiny_policy.stop_ids else act
            messages.append({"role": "assistant", "content": tok.decode(ids)})
        ids, mask = tr.tokens()
        text = tok.decode(ids)
        if tr.segments[-1][0] == "context":  # the last observation: a user turn not yet closed
            messages.append({"role": "user", "content": tr.final_obs})
            text += tiny_policy.chat.user_to_assistant.split("\n")[0] + "\n"
        assert text == tok.apply_chat_template(messages, tokenize=False)
        # the action mask marks exactly the generated ids
        assert [i for i, m in zip(ids, mask) if m] == [t for a in actions for t in a]


def test_off_policy_scores_new_policy_without_tips_and_old_policy_with_them(tiny_policy, embedder, monkeypatch):
    cfg = Config(env="rooms", max_steps=2, max_new_tokens=5)
    tasks, pool = rooms_batch(1, group_size=2)
    memory = TipMemory()
    memory.add(tasks[0].task_id, embedder([pool[0].reset(tasks[0])[0]])[0], "<tip> tricky: the bulb is elsewhere", 0.5)
    trajs = rollout(tiny_policy, pool, tasks, [("memory", "off-policy")] * 2, cfg, groups=[0, 0],
                    memory=memory, embedder=embedder)
    assert all(tr.has_tips for tr in trajs)
    calls = []
    original = tiny_policy.score

    def recording_score(ids, mask, temperature=1.0, prefix=None):
        calls.append((list(ids), list(mask), torch.is_grad_enabled()))
        return original(ids, mask, temperature, prefix)
    monkeypatch.setattr(tiny_policy, "score", recording_score)
    opt = torch.optim.AdamW(tiny_policy.lora_parameters(), lr=1e-3)
    update_policy(tiny_policy, opt, trajs[:1], torch.tensor([1.0]), cfg)
    (old_ids, old_mask, old_grad), (new_ids, new_mask, new_grad) = calls   # pi_old is recorded before any step
    decode = tiny_policy.tokenizer.decode
    assert new_grad and not old_grad
    assert "tricky" not in decode(new_ids) and "<tip>" not in decode(new_ids)
    assert decode(old_ids).count("tricky") == 1  # a tip is shown once per episode
    assert (new_ids, new_mask) == trajs[0].tokens(with_tips=False)
    assert (old_ids, old_mask) == trajs[0].tokens(with_tips=True)
    tip_tokens = sum(len(s) for k, s in trajs[0].segments if k == "tip")
    assert len(old_ids) - len(new_ids) == tip_tokens > 0
    # the same action tokens are scored in both contexts
    assert [t for t, m in zip(new_ids, new_mask) if m] == [t for t, m in zip(old_ids, old_mask) if m]

    calls.clear()
    trajs[1].update_mode = "on-policy-tips"
    update_policy(tiny_policy, opt, trajs[1:], torch.tensor([1.0]), cfg)
    assert [(ids, mask) for ids, mask, _ in calls] == [trajs[1].tokens(with_tips=True)] * 2   # old, then new
    assert [grad for *_, grad in calls] == [False, True]


def test_intrinsic_reward_reaches_the_advantages(tiny_policy, embedder):
    """Same rollouts (greedy), coefficient 0 vs 1: the advantages must differ."""
    tasks, pool = rooms_batch(3)
    results = {}
    for coef in (0.0, 1.0):
        cfg = Config(env="rooms", max_steps=3, max_new_tokens=4, intrinsic_coef=coef)
        trajs = rollout(tiny_policy, pool, tasks, [("plain", "on-policy")] * 3, cfg, groups=[0, 1, 2], temperature=0.0)
        intrinsic_rewards(trajs, NoveltyCounter(0.9), embedder, coef)
        results[coef] = (trajs, grpo_advantages(episode_returns(trajs), [0, 1, 2]))  # groups of one: A = R
    (t0, a0), (t1, a1) = results[0.0], results[1.0]
    assert [s["action"] for tr in t0 for s in tr.transcript] == [s["action"] for tr in t1 for s in tr.transcript]
    assert all(tr.int_return == 0 for tr in t0) and all(tr.int_return > 0 for tr in t1)
    assert torch.all(a0 == 0)          # no extrinsic success: no signal without r_int
    assert not torch.allclose(a0, a1)
    # an invalid action leaves the state as it was: garbage quoted back by the env is no new state
    assert not any(s["valid"] for tr in t1 for s in tr.transcript)  # a random model's output
    for tr in t1:
        assert tr.intrinsic == pytest.approx([1 / (1 + k) for k in range(len(tr.transcript) + 1)])


def test_batch_order_never_changes_the_intrinsic_reward(tiny_policy, embedder):
    """Twin episodes of one group, stepped in lockstep, get the same r_int (no first-in-batch bonus)."""
    cfg = Config(env="rooms", max_steps=3, max_new_tokens=4, intrinsic_coef=1.0)
    tasks, pool = rooms_batch(1, group_size=3)
    trajs = rollout(tiny_policy, pool, tasks, [("plain", "on-policy")] * 3, cfg, groups=[0, 0, 0], temperature=0.0)
    intrinsic_rewards(trajs, NoveltyCounter(0.9), embedder, cfg.intrinsic_coef)
    assert trajs[0].intrinsic == trajs[1].intrinsic == trajs[2].intrinsic
    assert trajs[0].intrinsic == pytest.approx([1 / (1 + 3 * k) for k in range(len(trajs[0].transcript) + 1)])
    assert torch.all(grpo_advantages(episode_returns(trajs), [0, 0, 0]) == 0)


def test_update_trains_only_lora_and_moves_good_actions_up(tiny_policy):
    # a random model gives every token log p ~ -10.8 (uniform over 49k): switch the log-delta mask off
    cfg = Config(env="rooms", max_steps=2, max_new_tokens=4, lr=1e-2, min_logp=-1e9)
    tasks, pool = rooms_batch(1, group_size=2)
    trajs = rollout(tiny_policy, pool, tasks, [("plain", "on-policy")] * 2, cfg, groups=[0, 0])
    base = {n: p.detach().clone() for n, p in tiny_policy.model.named_parameters() if "lora_" not in n}
    lora = {n: p.detach().clone() for n, p in tiny_policy.model.named_parameters() if "lora_" in n}
    assert lora and all(not p.requires_grad for n, p in tiny_policy.model.named_parameters() if "lora_" not in n)
    good = trajs[0].tokens()
    before = tiny_policy.score(*good)[0].detach().sum()
    opt = torch.optim.AdamW(tiny_policy.lora_parameters(), lr=cfg.lr)
    stats = update_policy(tiny_policy, opt, trajs, torch.tensor([1.0, -1.0]), cfg)
    assert stats["update/skipped_steps"] == 0 and stats["update/action_tokens"] > 0
    for n, p in tiny_policy.model.named_parameters():
        if "lora_" in n:
            continue
        assert torch.equal(p, base[n]), n
    assert any(not torch.equal(p, lora[n]) for n, p in tiny_policy.model.named_parameters() if "lora_" in n)
    with torch.no_grad():
        after = tiny_policy.score(*good)[0].sum()
    assert after > before  # the positive-advantage trajectory became more likely


def test_non_finite_loss_skips_the_step(tiny_policy, monkeypatch):
    cfg = Config(env="rooms", max_steps=1, max_new_tokens=3)
    tasks, pool = rooms_batch(1, group_size=2)
    trajs = rollout(tiny_policy, pool, tasks, [("plain", "on-policy")] * 2, cfg, groups=[0, 0])
    original = tiny_policy.score
    monkeypatch.setattr(tiny_policy, "score", lambda ids, m, t=1.0, prefix=None: tuple(x * float("nan") for x in original(ids, m, t, prefix)))
    before = [p.detach().clone() for p in tiny_policy.lora_parameters()]
    opt = torch.optim.AdamW(tiny_policy.lora_parameters(), lr=1e-2)
    stats = update_policy(tiny_policy, opt, trajs, torch.tensor([1.0, -1.0]), cfg)
    assert stats["update/skipped_steps"] == 2 and stats["update/steps"] == 0   # two mini-batches of one trajectory
    assert all(torch.equal(a, b) for a, b in zip(before, tiny_policy.lora_parameters()))


def test_prompt_limit_truncates_and_reflection_still_works(tiny_policy, embedder):
    cfg = Config(env="rooms", max_steps=10, max_new_tokens=8, max_prompt_tokens=260, tip_max_new_tokens=6)
    tasks, pool = rooms_batch(2)
    trajs = rollout(tiny_policy, pool, tasks, [("plain", "on-policy")] * 2, cfg)
    assert all(tr.truncated for tr in trajs)
    for tr in trajs:  # every prompt the policy answered fitted, with room for its answer
        lengths = np.cumsum([len(seg) for _, seg in tr.segments])
        prompts = [lengths[k - 1] for k, (kind, _) in enumerate(tr.segments) if kind == "action"]
        assert prompts and max(prompts) + cfg.max_new_tokens <= cfg.max_prompt_tokens
    # a truncated episode's last state is counted once: one r_int per state it acted in, plus the one it was cut in
    intrinsic_rewards(trajs, NoveltyCounter(0.9), HashEmbedder(), 0.1)
    assert all(len(tr.intrinsic) == len(tr.states) == len(tr.transcript) + 1 for tr in trajs)
    tips = reflect(tiny_policy, trajs, cfg)
    assert len(tips) == 2 and all(tr.tip == tip and tip for tr, tip in zip(trajs, tips))
    memory = TipMemory()
    assert store_tips(memory, embedder, trajs) == len(set(tips)) and len(memory) == len(set(tips))
    assert all(t.endswith("(score: 0.00)") for t in memory.tips[tasks[0].task_id])


def test_batched_and_one_at_a_time_rollouts_choose_the_same_actions(real_policy):
    """CachedSampler batching with left padding must not change what greedy decoding picks."""
    cfg = Config(env="rooms", max_steps=2, max_new_tokens=10, demo="on")
    tasks, pool = rooms_batch(3, split="test")
    batched = rollout(real_policy, pool, tasks, [("plain", "on-policy")] * 3, cfg, temperature=0.0)
    for i, task in enumerate(tasks):
        alone = rollout(real_policy, pool[:1], [task], [("plain", "on-policy")], cfg, temperature=0.0)[0]
        assert [s["action"] for s in alone.transcript] == [s["action"] for s in batched[i].transcript]
        assert alone.tokens() == batched[i].tokens()
    # the real model with the demo exchange answers with valid actions at least sometimes
    assert any(s["valid"] for tr in batched for s in tr.transcript)


class HashEmbedder:
    """A stand-in embedder: every distinct text gets its own random unit vector (all states novel)."""
    def __call__(self, texts):
        out = []
        for t in texts:
            v = np.random.default_rng(abs(hash(t)) % 2**32).normal(size=384)
            out.append(v / np.linalg.norm(v))
        return np.array(out, dtype=np.float32)


@pytest.mark.parametrize("max_prompt_tokens", [2048, 360])
def test_tips_written_from_the_rollouts_cache_are_those_of_encoding_each_episode_again(max_prompt_tokens, tiny_policy,
                                                                                      monkeypatch):
    """Step 3 continues the rollout's KV cache (train.py: policy.sampling(keep_finished=True)) and must give
    exactly the tips that encoding every reflection prompt from its first token gives with the same
    random draws: plain episodes, memory episodes (re-read without their tips) and, at 360 tokens,
    episodes cut short that left the batch early and whose reflection prompt keeps only its head."""
    from empo2 import reflection_prompt
    from tests.test_policy import randomise_lora
    randomise_lora(tiny_policy, seed=3)

    class Fixed:
        def retrieve(self, task_id, key):
            return ["look in the attic first", "the hallway leads everywhere"]
    cfg = Config(env="rooms", max_steps=4, max_new_tokens=40, tip_max_new_tokens=8, max_prompt_tokens=max_prompt_tokens,
                 demo="off")
    tasks, pool = rooms_batch(6)
    modes = [("plain", "on-policy"), ("memory", "off-policy")] * 3
    with tiny_policy.sampling(keep_finished=True) as sampler:
        torch.manual_seed(0)
        trajs = rollout(tiny_policy, pool, tasks, modes, cfg, memory=Fixed(), embedder=HashEmbedder(),
                        temperature=1.0, sampler=sampler)
        assert sum(tr.has_tips for tr in trajs) == 3
        whole = [reflection_prompt(tiny_policy, tr, cfg)[:len(tr.tokens(False)[0])] == tr.tokens(False)[0] for tr in trajs]
        if max_prompt_tokens == 360:   # some cut short, some not: rows left the batch at different steps
            assert 0 < sum(tr.truncated for tr in trajs) < len(trajs) and not any(whole)
        else:
            assert all(whole)
        monkeypatch.setattr(sampler, "_start", lambda *a, **k: pytest.fail("reflection encoded everything again"))
        state = torch.get_rng_state()
        from_cache = reflect(tiny_policy, trajs, cfg, sampler)
    torch.set_rng_state(state)
    assert reflect(tiny_policy, trajs, cfg) == from_cache


def test_wandering_never_out_earns_a_purchase_at_the_default_coefficient():
    """r_int is averaged over an episode's states: a 15-step episode through 16 novel states that buys
    nothing must return less than a 3-step purchase at reward 0.5 whose states were all seen before."""
    from empo2 import Trajectory
    cfg = Config()
    task = envs.tasks("webshop-mini", "train")[0]
    novelty = NoveltyCounter(cfg.novelty_threshold)
    seen = [f"page {k}" for k in range(4)]
    warmup = [Trajectory(task=task, group=0, rollout_mode="plain", update_mode="on-policy", states=list(seen))
              for _ in range(5)]
    intrinsic_rewards(warmup, novelty, HashEmbedder(), cfg.intrinsic_coef)   # those pages are now familiar
    buy = Trajectory(task=task, group=0, rollout_mode="plain", update_mode="on-policy", states=list(seen),
                     rewards=[0.0, 0.0, 0.5])
    wander = Trajectory(task=task, group=0, rollout_mode="plain", update_mode="on-policy",
                        states=[f"new page {k}" for k in range(16)], rewards=[0.0] * 15)
    intrinsic_rewards([buy, wander], novelty, HashEmbedder(), cfg.intrinsic_coef)
    assert wander.intrinsic == [cfg.intrinsic_coef] * 16 and max(buy.intrinsic) < cfg.intrinsic_coef / 5
    returns = episode_returns([buy, wander])
    assert returns[0] > returns[1] and grpo_advantages(returns, [0, 0])[0] > 0
    assert wander.int_return == pytest.approx(cfg.intrinsic_coef)   # the mean, not 16 x c


def test_tips_are_shown_once_within_their_budget_and_never_cut_an_episode(tiny_policy):
    """A memory episode gets each tip once, at most tip_block_tokens of tips in all, and the same room to act
    as a plain episode: max_prompt_tokens bounds the conversation, tips come on top."""
    task = envs.tasks("rooms", "train")[0]
    tips = [f"tip number {k}: look in every room before acting, the goal is never where you start" for k in range(10)]

    class Everything:  # a memory that returns every tip for any state
        def retrieve(self, task_id, key):
            return list(tips)
    cfg = Config(env="rooms", max_steps=4, max_new_tokens=4, tip_block_tokens=60, demo="off")
    tr = rollout(tiny_policy, [envs.make("rooms")], [task], [("memory", "on-policy-tips")], cfg,
                 memory=Everything(), embedder=HashEmbedder(), temperature=1.0)[0]
    shown = [t for step in tr.transcript for t in step["tips"]]
    assert len(shown) == len(set(shown)) > 0                           # never twice in one episode
    assert sum(len(ids) for kind, ids in tr.segments if kind == "tip") <= 60
    assert tr.transcript[0]["tips"] == tips[:len(tr.transcript[0]["tips"])]   # best first
    # a budget that just fits the plain conversation: the memory episode is not cut either
    plain = rollout(tiny_policy, [envs.make("rooms")], [task], [("plain", "on-policy")], cfg, temperature=0.0)[0]
    prompts = [sum(len(s) for _, s in plain.segments[:k]) for k, (kind, _) in enumerate(plain.segments) if kind == "action"]
    tight = Config(**{**cfg.__dict__, "max_prompt_tokens": max(prompts) + cfg.max_new_tokens, "tip_block_tokens": 400})
    assert not rollout(tiny_policy, [envs.make("rooms")], [task], [("plain", "on-policy")], tight, temperature=0.0)[0].truncated
    squeezed = rollout(tiny_policy, [envs.make("rooms")], [task], [("memory", "on-policy-tips")], tight,
                       memory=Everything(), embedder=HashEmbedder(), temperature=0.0)[0]
    assert squeezed.has_tips and not squeezed.truncated and len(squeezed.transcript) == cfg.max_steps


def test_the_low_probability_mask_applies_to_off_policy_tokens_only_by_default(tiny_policy, monkeypatch):
    import empo2
    cfg = Config(env="rooms", max_steps=1, max_new_tokens=3)
    tasks, pool = rooms_batch(1, group_size=2)
    trajs = rollout(tiny_policy, pool, tasks, [("plain", "on-policy")] * 2, cfg, groups=[0, 0])
    seen = []
    original = empo2.policy_loss

    def spy(*args):
        seen.append(args[-1])
        return original(*args)
    monkeypatch.setattr(empo2, "policy_loss", spy)
    opt = torch.optim.AdamW(tiny_policy.lora_parameters(), lr=1e-3)
    stats = update_policy(tiny_policy, opt, trajs, torch.tensor([1.0, -1.0]), cfg)
    assert seen == [None, None] and stats["losses/masked_frac"] == 0   # a random model's tokens are all < log delta
    seen.clear()
    stats = update_policy(tiny_policy, opt, trajs, torch.tensor([1.0, -1.0]), Config(**{**cfg.__dict__, "mask_on_policy": True}))
    assert seen == [cfg.min_logp] * 2 and stats["losses/masked_frac"] == 1.0


def test_first_step_ratio_is_exactly_one_and_later_mini_batch_steps_move_and_clip_it(tiny_policy):
    """pi_old is recorded before the first step, so that step sees ratio 1 exactly; the steps after it
    see a policy that has moved, and the PPO clip bounds them (docs/algorithm.md, steps 8-9)."""
    cfg = Config(env="rooms", max_steps=2, max_new_tokens=4, lr=1e-2, min_logp=-1e9, minibatches=1, ppo_epochs=1)
    tasks, pool = rooms_batch(1, group_size=4)
    trajs = rollout(tiny_policy, pool, tasks, [("plain", "on-policy")] * 4, cfg, groups=[0] * 4)
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0])
    opt = torch.optim.AdamW(tiny_policy.lora_parameters(), lr=cfg.lr)
    one = update_policy(tiny_policy, opt, trajs, adv, cfg)
    assert one["update/steps"] == 1 and one["losses/ratio_min"] == one["losses/ratio_max"] == 1.0
    assert one["losses/clip_frac"] == 0.0
    many = update_policy(tiny_policy, opt, trajs, adv, Config(**{**cfg.__dict__, "minibatches": 2, "ppo_epochs": 3}))
    assert many["update/steps"] == 6
    assert many["losses/ratio_max"] > 1.0 or many["losses/ratio_min"] < 1.0
    assert many["losses/clip_frac"] > 0.0       # the clip binds once the ratio has moved past 1 +- epsilon


def test_kl_to_the_warm_start_is_zero_before_the_first_update(tiny_policy):
    from empo2 import make_probe, probe_kl
    cfg = Config(env="rooms", max_steps=2, max_new_tokens=4, lr=1e-2, min_logp=-1e9, minibatches=2, kl_coef=0.5)
    tasks, pool = rooms_batch(1, group_size=4)
    trajs = rollout(tiny_policy, pool, tasks, [("plain", "on-policy")] * 4, cfg, groups=[0] * 4)
    reference = tiny_policy.lora_state()   # the warm start: where RL begins
    probe = make_probe(tiny_policy, trajs[:2], reference, cfg)
    assert len(probe) == 2
    assert probe_kl(tiny_policy, probe, cfg) == 0.0
    opt = torch.optim.AdamW(tiny_policy.lora_parameters(), lr=cfg.lr)
    first = update_policy(tiny_policy, opt, trajs, torch.tensor([1.0, -1.0, 1.0, -1.0]),
                          Config(**{**cfg.__dict__, "minibatches": 1}), reference)
    assert first["losses/kl_ref"] == 0.0     # the one step starts at the reference
    update_policy(tiny_policy, opt, trajs, torch.tensor([1.0, -1.0, 1.0, -1.0]), cfg, reference)
    moved = tiny_policy.lora_state()
    assert probe_kl(tiny_policy, probe, cfg) > 0.0
    # scoring the reference swaps its weights in and puts the trained ones back, bit for bit
    make_probe(tiny_policy, trajs, reference, cfg)
    assert all(torch.equal(moved[n], p) for n, p in tiny_policy.lora_state().items())
    assert any(not torch.equal(moved[n], reference[n]) for n in reference)


def test_invalid_action_penalty_reaches_the_return_and_the_advantage():
    from empo2 import Trajectory
    task = envs.tasks("rooms", "train")[0]

    def episode(valid):
        tr = Trajectory(task=task, group=0, rollout_mode="plain", update_mode="on-policy")
        tr.transcript = [{"observation": "", "tips": [], "action": "x", "reward": 0.0, "valid": v} for v in valid]
        tr.rewards = [0.0] * len(valid)
        return tr
    trajs = [episode([True, True, True]), episode([False, True, False])]
    assert [tr.invalid_actions for tr in trajs] == [0, 2]
    torch.testing.assert_close(episode_returns(trajs, invalid_penalty=0.05), torch.tensor([0.0, -0.1]))
    assert torch.all(grpo_advantages(episode_returns(trajs), [0, 0]) == 0)      # no penalty: a tie, no signal
    adv = grpo_advantages(episode_returns(trajs, invalid_penalty=0.05), [0, 0])
    assert adv[0] > 0 > adv[1]                                                   # the valid episode is preferred
