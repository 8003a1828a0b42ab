"""grpo_advantages and policy_loss against numbers worked out by hand (docs/algorithm.md, steps 5 and 8)."""
import math

import numpy as np
import pytest
import torch

from empo2 import Config, grpo_advantages, policy_loss, sample_modes
from utils import mean_ci95


def test_grpo_advantages_by_hand():
    # group "a": mean 2, unbiased std 1 -> (-1, 0, 1); group "b" of one: mean 0, std 1 -> 5
    adv = grpo_advantages(torch.tensor([1.0, 2.0, 3.0, 5.0]), ["a", "a", "a", "b"])
    expected = torch.tensor([-1.0, 0.0, 1.0, 5.0]) / (1 + 1e-6)
    torch.testing.assert_close(adv, expected)


def test_grpo_advantages_unbiased_std_and_interleaved_groups():
    # group 0 = {0, 4}: mean 2, unbiased std sqrt(8) (biased would be 2)
    adv = grpo_advantages([0.0, 7.0, 7.0, 1.0, 4.0], [0, 1, 1, 2, 0])
    s = math.sqrt(8)
    assert adv[0].item() == pytest.approx(-2 / (s + 1e-6))
    assert adv[4].item() == pytest.approx(2 / (s + 1e-6))
    assert adv[1].item() == 0.0 and adv[2].item() == 0.0      # no learning signal in a constant group
    assert adv[3].item() == pytest.approx(1 / (1 + 1e-6))


def test_grpo_advantages_length_mismatch():
    with pytest.raises(ValueError):
        grpo_advantages([1.0, 2.0], [0])


def _case():
    # row 0: A = +2, ratios 1.0, 1.5 (clipped at 1.3), 0.5 (unclipped: min(1.0, 1.6))
    # row 1: A = -1, ratios 20 (dual clip: -10), 0.5 (clipped: -0.8), 1.0 with logp=-6 (masked by log delta=-5)
    old = torch.tensor([[-1.0, -1.0, -1.0, -4.0], [-4.0, -1.0, -6.0, -1.0]])
    ratios = torch.tensor([[1.0, 1.5, 0.5, 1.0], [20.0, 0.5, 1.0, 1.0]])
    logp = (old + ratios.log()).requires_grad_(True)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 0]], dtype=torch.bool)  # last column is not an action token
    adv = torch.tensor([2.0, -1.0])
    return logp, old, adv, mask


def test_policy_loss_by_hand():
    logp, old, adv, mask = _case()
    loss, stats = policy_loss(logp, old, adv, mask, 0.2, 0.3, 10.0, min_logp=-5.0)
    # kept objective: 2.0 + 2.6 + 1.0 - 10 - 0.8 = -5.2 over 5 kept tokens
    assert loss.item() == pytest.approx(5.2 / 5, abs=1e-5)
    assert stats["kept_tokens"] == 5 and stats["action_tokens"] == 6
    assert stats["masked_fraction"] == pytest.approx(1 / 6)
    assert stats["clip_ratio"] == pytest.approx(2 / 5)        # ratio 1.5 with A>0, ratio 0.5 with A<0
    assert stats["dual_clip_ratio"] == pytest.approx(1 / 5)   # ratio 20 with A<0
    loss.backward()
    g = logp.grad
    # d(-obj/5)/dlogp = -A * ratio / 5 where the unclipped branch is active, 0 where clipped or masked
    assert g[0, 0].item() == pytest.approx(-2 * 1.0 / 5, abs=1e-6)
    assert g[0, 2].item() == pytest.approx(-2 * 0.5 / 5, abs=1e-6)
    for r, c in [(0, 1), (1, 0), (1, 1), (1, 2), (0, 3), (1, 3)]:
        assert g[r, c].item() == 0.0, (r, c)


def test_policy_loss_without_mask_or_dual_clip():
    logp, old, adv, mask = _case()
    loss, stats = policy_loss(logp, old, adv, mask, 0.2, 0.3, dual_clip=None, min_logp=None)
    # all 6 action tokens kept; row 1: -20 (no dual clip), -0.8, -1.0
    assert stats["kept_tokens"] == 6
    assert loss.item() == pytest.approx(-(2.0 + 2.6 + 1.0 - 20 - 0.8 - 1.0) / 6, abs=1e-5)


def test_policy_loss_per_token_advantages_and_masked_inf_is_not_nan():
    logp = torch.tensor([[-1.0, -float("inf")]], requires_grad=True)
    old = torch.tensor([[-1.0, -1.0]])
    loss, stats = policy_loss(logp, old, torch.tensor([[1.0, 1.0]]), torch.ones(1, 2, dtype=torch.bool), min_logp=-5.0)
    assert torch.isfinite(loss) and loss.item() == pytest.approx(-1.0)
    loss.backward()
    assert torch.isfinite(logp.grad).all()


def test_sample_modes_frequencies():
    rng = np.random.default_rng(0)
    modes = sample_modes(rng, 20000, p=0.25, q=0.68)
    frac = {m: sum(x == m for x in modes) / len(modes) for m in set(modes)}
    # reference split: off-policy 17 %, on-policy with tips 8 %, plain 75 %
    assert frac[("plain", "on-policy")] == pytest.approx(0.75, abs=0.01)
    assert frac[("memory", "off-policy")] == pytest.approx(0.17, abs=0.01)
    assert frac[("memory", "on-policy-tips")] == pytest.approx(0.08, abs=0.01)
    assert sample_modes(rng, 100, p=0.0, q=0.5) == [("plain", "on-policy")] * 100


def test_config_algo_and_ablations():
    assert (Config(algo="grpo").p, Config(algo="grpo").intrinsic_coef) == (0.0, 0.0)
    assert Config(no_off_policy=True).q == 0.0
    assert Config(no_memory_on_policy=True).q == 1.0


def test_mean_ci95_known_values():
    mean, half = mean_ci95([1.0, 2.0, 3.0, 4.0])
    assert mean == 2.5
    assert half == pytest.approx(1.96 * np.std([1, 2, 3, 4], ddof=1) / 2)
    assert math.isnan(mean_ci95([5.0])[1])


def test_advantage_std_floor_keeps_novelty_noise_small():
    # returns that differ only by ~0.01 (novelty noise): std 0.01; the paper's rule blows them up to +-1
    r = torch.tensor([0.0, 0.01, 0.02])
    torch.testing.assert_close(grpo_advantages(r, [0, 0, 0]), torch.tensor([-1.0, 0.0, 1.0]), atol=1e-3, rtol=0)
    torch.testing.assert_close(grpo_advantages(r, [0, 0, 0], std_floor=0.1), torch.tensor([-0.1, 0.0, 0.1]),
                               atol=1e-5, rtol=0)
    # a success among failures (std 0.5) is above the floor: unchanged
    s = torch.tensor([0.0, 0.0, 1.0, 1.0])
    torch.testing.assert_close(grpo_advantages(s, [0] * 4, std_floor=0.1), grpo_advantages(s, [0] * 4))


def test_kl_to_reference_is_zero_where_the_policies_agree_and_positive_elsewhere():
    from empo2 import kl_to_reference
    ref = torch.tensor([-1.0, -2.0, -0.5])
    logp = ref.clone().requires_grad_(True)
    kl = kl_to_reference(logp, ref)
    kl.sum().backward()
    assert torch.equal(kl, torch.zeros(3)) and torch.equal(logp.grad, torch.zeros(3))
    # k3 = e^d - d - 1 with d = log pi_ref - log pi_theta = 0.7, by hand
    assert kl_to_reference(torch.tensor([-1.0]), torch.tensor([-0.3])).item() == pytest.approx(math.exp(0.7) - 0.7 - 1)


def test_the_penalty_caps_a_far_off_token_but_the_probe_diagnostic_does_not():
    """kl_to_reference (a loss term) caps each token at 10; k3 itself (what probe_kl logs) shows a
    collapse at full size: d = 5 gives e^5 - 6 = 142.4."""
    from empo2 import k3, kl_to_reference
    assert kl_to_reference(torch.tensor([-6.0]), torch.tensor([-1.0])).item() == pytest.approx(10.0)
    assert k3(torch.tensor([5.0])).item() == pytest.approx(math.exp(5) - 6)
    d = torch.linspace(-3, 3, 13)
    assert bool((k3(d) >= 0).all()) and k3(torch.zeros(1)).item() == 0.0


def test_paired_difference_pairs_by_goal_not_by_position():
    from evaluate import paired_goal_difference
    before = [{"task_id": "a", "won": 0}, {"task_id": "b", "won": 1}, {"task_id": "c", "won": 0}]
    after = [{"task_id": "c", "won": 1}, {"task_id": "b", "won": 1}, {"task_id": "a", "won": 1}]
    d = paired_goal_difference(before, after, "won", 100.0)
    mean, (lo, hi) = d["difference"], d["difference_ci95"]
    assert mean == pytest.approx(200 / 3)           # a: +1, b: 0, c: +1
    assert 0 <= lo <= mean <= hi <= 100


def test_learning_rate_warmup_is_linear_and_resumes_from_the_optimiser_state():
    from empo2 import set_warmup_lr
    w = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.AdamW([w], lr=1.0)
    cfg = Config(lr=4e-4, lr_warmup_steps=4)
    seen = []
    for _ in range(6):
        set_warmup_lr(opt, cfg)
        seen.append(opt.param_groups[0]["lr"])
        w.grad = torch.ones(2)
        opt.step()
    assert seen == pytest.approx([1e-4, 2e-4, 3e-4, 4e-4, 4e-4, 4e-4])
    resumed = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=1.0)
    resumed.load_state_dict(opt.state_dict())
    set_warmup_lr(resumed, Config(lr=4e-4, lr_warmup_steps=10))
    assert resumed.param_groups[0]["lr"] == pytest.approx(4e-4 * 7 / 10)   # 6 steps done: the 7th of 10


def test_tip_quality_counts_tips_that_name_what_their_episode_saw():
    import envs
    from empo2 import REFLECTION_PROMPT, Trajectory, tip_quality

    def episode(tip):
        tr = Trajectory(task=envs.Task("rooms/x", "Your task is to turn on the red light bulb."), group=0,
                        rollout_mode="plain", update_mode="on-policy", first_obs="You are in the kitchen.")
        tr.transcript = [{"observation": "You are in the kitchen. Doors: hallway.", "action": "go to hallway"},
                         {"observation": "You are in the hallway. Doors: attic, garden.", "action": "go to attic"}]
        tr.final_obs, tr.tip = "You are in the attic. You see a blue box.", tip
        return tr
    trajs = [episode("The attic holds only a blue box; try the garden next."),       # grounded
             episode("Turn on the red light bulb."),                                   # the goal only
             episode(REFLECTION_PROMPT[60:160]),                                       # copies the prompt
             episode("SOLOMO nice snack")]                                              # noise
    q = tip_quality(trajs)
    assert q["memory/tip_grounded_frac"] == pytest.approx(1 / 4)
    assert q["memory/tip_prompt_copy_frac"] == pytest.approx(1 / 4)
    assert q["memory/tip_words"] == pytest.approx(np.mean([len(t.tip.split()) for t in trajs]))
    assert math.isnan(tip_quality([episode("")])["memory/tip_grounded_frac"])   # no tips, no figure
