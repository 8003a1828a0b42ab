"""The warm start: demonstrators that see only what the agent sees, and the adapter cache."""
import contextlib
import copy
import json
import random

import pytest
import torch

import envs
import warm_start
from empo2 import Config, rollout
from envs.webshop_mini import get_catalog


def play(name, split, n, seed=0):
    demo, env = envs.demonstrator(name), envs.make(name, split)
    rng, runs = random.Random(seed), []
    for task in envs.tasks(name, split)[:n]:
        obs, info = env.reset(task)
        actions, done = [], False
        while not done:
            actions.append(demo(obs, rng))
            obs, reward, done, info = env.step(actions[-1])
            assert info["valid"], (actions[-1], obs)
        runs.append((actions, info["score"]))
    return runs


def test_webshop_demonstrator_never_reads_the_goal(monkeypatch):
    """Scramble every hidden field of every goal (target product, options, attributes): the
    demonstrator's actions must not change, since it sees only the observation."""
    plain = play("webshop-mini", "test", 30)
    catalog = get_catalog()
    scrambled = copy.deepcopy(catalog.goals)
    rng = random.Random(1)
    asins = [p["asin"] for p in catalog.products]
    for g in scrambled:
        g.update(asin=rng.choice(asins), goal_options=["nonexistent option"], attributes=["nothing"], name="x", query="y")
    monkeypatch.setattr(catalog, "goals", scrambled)
    again = play("webshop-mini", "test", 30)
    assert [a for a, _ in again] == [a for a, _ in plain]
    assert [s for _, s in again] != [s for _, s in plain]   # the reward did read the scrambled goals
    # it searches the instruction without the price clause, opens the first result, picks options, buys
    actions = plain[0][0]
    assert actions[0].startswith("search[") and "price" not in actions[0] and actions[-1] == "click[buy now]"


def test_demonstrations_touch_only_the_agents_interface(tiny_policy):
    """demonstration() may use what the agent's loop uses (reset, step, the example turns), nothing else."""
    touched = set()

    class Guarded:
        def __init__(self, env):
            object.__setattr__(self, "_env", env)

        def __getattr__(self, name):
            touched.add(name)
            return getattr(self._env, name)
    for name in ("rooms", "webshop-mini"):
        env = envs.make(name, "train")
        tr = warm_start.demonstration(tiny_policy, Guarded(env), envs.tasks(name, "train")[0], envs.demonstrator(name),
                                      random.Random(0), use_demo=True)
        assert tr.transcript and all(s["valid"] for s in tr.transcript)
    assert touched <= {"reset", "step", "demo"}, touched


def scripted_rollout(policy, monkeypatch, env, task, action_ids, cfg):
    """rollout() of one plain episode whose sampler "samples" the given action tokens, in order."""
    actions = iter(action_ids)

    class Scripted:
        def generate(self, prompts, keys, *a, **k):
            return [next(actions) for _ in prompts]

    @contextlib.contextmanager
    def scripted_sampling():
        yield Scripted()
    monkeypatch.setattr(policy, "sampling", scripted_sampling)
    return rollout(policy, [env], [task], [("plain", "on-policy")], cfg)[0]


def test_demonstration_segments_are_what_rollout_builds(tiny_policy, monkeypatch):
    """Replaying a demonstration's actions through the policy's own loop must give the same tokens."""
    env = envs.make("rooms", "train")
    task = envs.tasks("rooms", "train")[3]
    tr = warm_start.demonstration(tiny_policy, env, task, envs.demonstrator("rooms"), random.Random(0), use_demo=True)
    actions = [ids for kind, ids in tr.segments if kind == "action"]
    replay = scripted_rollout(tiny_policy, monkeypatch, env, task, actions, Config(env="rooms", demo="on"))
    assert replay.segments == tr.segments and replay.rewards == tr.rewards


def test_injected_mistakes_are_invalid_shown_and_not_cloned(tiny_policy, monkeypatch):
    """--warm-start-mistakes: every injected action is invalid, its tokens are context (never cloned),
    the actions cloned are exactly the mistake-free demonstration's, and the token layout is what
    rollout() builds when the policy itself samples the same actions (mistakes included)."""
    env = envs.make("webshop-mini", "train")
    tasks = envs.tasks("webshop-mini", "train")[:6]
    demo = envs.demonstrator("webshop-mini")

    def run(task, mistakes):
        return warm_start.demonstration(tiny_policy, env, task, demo, random.Random(0), use_demo=False,
                                        mistakes=mistakes, mistake_rng=random.Random(2))
    kinds = set()
    for task in tasks:
        plain, noisy = run(task, 0.0), run(task, 0.6)
        injected = [s for s in noisy.transcript if s.get("injected")]
        assert injected and all(not s["valid"] for s in injected)
        assert all(s["valid"] for s in noisy.transcript if not s.get("injected"))
        cloned = lambda tr: [ids for kind, ids in tr.segments if kind == "action"]
        assert cloned(noisy) == cloned(plain) and (noisy.score, noisy.won) == (plain.score, plain.won)
        assert noisy.invalid_actions == len(injected)
        kinds |= {"repeat" if k and s["action"] == noisy.transcript[k - 1]["action"] else "made-up"
                  for k, s in enumerate(noisy.transcript) if s.get("injected")}
    assert kinds == {"repeat", "made-up"}

    # the same tokens as the policy's own loop playing every action, the injected ones included
    tr = run(tasks[1], 0.6)
    played = [tiny_policy.encode(s["action"]) + [tiny_policy.end_of_turn_id] for s in tr.transcript]
    replay = scripted_rollout(tiny_policy, monkeypatch, env, tasks[1], played,
                              Config(env="webshop-mini", demo="off", warm_start="off"))
    assert [ids for _, ids in replay.segments] == [ids for _, ids in tr.segments]
    assert sum(kind == "action" for kind, _ in replay.segments) == len(tr.transcript)
    assert sum(kind == "action" for kind, _ in tr.segments) == len(tr.transcript) - tr.invalid_actions


def test_injected_mistakes_never_read_the_goal(tiny_policy, monkeypatch):
    """Scrambling the hidden goals changes no action of a demonstration with mistakes, injected or cloned."""
    def actions():
        env, rng, mistake_rng = envs.make("webshop-mini", "test"), random.Random(0), random.Random(2)
        return [[s["action"] for s in warm_start.demonstration(tiny_policy, env, t, envs.demonstrator("webshop-mini"),
                                                               rng, False, 0.5, mistake_rng).transcript]
                for t in envs.tasks("webshop-mini", "test")[:8]]
    plain = actions()
    catalog = get_catalog()
    scrambled = copy.deepcopy(catalog.goals)
    for g in scrambled:
        g.update(goal_options=["nonexistent option"], attributes=["nothing"], name="x", query="y")
    monkeypatch.setattr(catalog, "goals", scrambled)
    assert actions() == plain


def test_warm_start_mistakes_setting_is_checked_and_keys_the_cache(tiny_policy):
    with pytest.raises(ValueError, match="--warm-start-mistakes must be in"):
        Config(env="rooms", warm_start_mistakes=1.5).check(task_lists=False)
    off = warm_start.cache_key(tiny_policy, Config(env="rooms"))
    on = warm_start.cache_key(tiny_policy, Config(env="rooms", warm_start_mistakes=0.2))
    assert "mistakes" not in off and on["mistakes"] == 0.2
    assert warm_start.cache_folder(off) != warm_start.cache_folder(on)
    # a free-text form accepts any text, so nothing there is sure to be invalid
    assert warm_start.invalid_action("Valid actions: search[<your query>]", None, "search[red shoes]",
                                     random.Random(0)) is None


def test_spread_covers_every_kind_of_task_before_repeating_one(tiny_policy):
    """--warm-start-spread: n goals cover min(n, kinds) product types, no type twice before all once,
    the same draw for the same seed; an env without kinds of task is refused."""
    pool = envs.tasks("webshop-mini", "train")
    kind = envs.task_kind("webshop-mini")
    kinds = {kind(t) for t in pool}
    assert "cat litter" in kinds and len(kinds) > 20   # the one type whose products have no options
    for n in (10, len(kinds), len(kinds) + 5):
        tasks = warm_start.spread_over_kinds(pool, kind, n, random.Random(3))
        counts = [sum(kind(t) == k for t in tasks) for k in kinds]
        assert len(tasks) == n and max(counts) - min(counts) <= 1 and len({t.task_id for t in tasks}) == n
    assert warm_start.spread_over_kinds(pool, kind, 12, random.Random(3)) == \
        warm_start.spread_over_kinds(pool, kind, 12, random.Random(3))
    # a uniform draw of 32 usually misses types; the spread one never does
    assert len({kind(pool[k]) for k in random.Random(0).sample(range(len(pool)), 32)}) < len(kinds)
    key = warm_start.cache_key(tiny_policy, Config(env="webshop-mini", warm_start_spread=True))
    assert "spread" in key and "spread" not in warm_start.cache_key(tiny_policy, Config(env="webshop-mini"))
    with pytest.raises(ValueError, match="no kinds of task"):
        Config(env="rooms", warm_start_spread=True).check(task_lists=False)


def lora_state(policy):
    return {k: v.detach().clone() for k, v in policy.model.state_dict().items() if "lora_" in k}


def test_warm_start_is_cached_reused_and_rebuilt_when_broken(tiny_model_dir, capsys):
    from policy import load_policy
    cfg = Config(env="rooms", model=tiny_model_dir, dtype="float32", warm_start="on", warm_start_episodes=2,
                 warm_start_epochs=1, warm_start_batch=2, lora_r=4, lora_alpha=8, max_steps=3)

    def fresh():
        torch.manual_seed(0)
        return load_policy(tiny_model_dir, dtype="float32", device="cpu", lora_r=4, lora_alpha=8)
    first = fresh()
    untrained = lora_state(first)
    built = warm_start.warm_start(first, cfg)
    trained = lora_state(first)
    assert not built["cached"] and built["demonstrator"]["episodes"] == 2 and len(built["losses"]) == 1
    assert built["tip_following"]["episodes"] == 0   # no --warm-start-tips: no second attempts
    assert any(not torch.equal(untrained[k], trained[k]) for k in trained)

    second = fresh()
    reused = warm_start.warm_start(second, cfg)
    assert reused["cached"] and reused["folder"] == built["folder"]
    assert all(torch.equal(v, trained[k]) for k, v in lora_state(second).items())

    # other settings: another entry, built anew
    other = warm_start.warm_start(fresh(), Config(**{**cfg.__dict__, "warm_start_episodes": 3}))
    assert not other["cached"] and other["folder"] != built["folder"]

    # a corrupt adapter file is rebuilt, never half-used
    folder = warm_start.cache_folder(warm_start.cache_key(second, cfg))
    weights = folder / "adapter" / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:500])
    capsys.readouterr()
    third = fresh()
    rebuilt = warm_start.warm_start(third, cfg)
    assert not rebuilt["cached"] and "unreadable" in capsys.readouterr().out
    assert all(torch.equal(v, trained[k]) for k, v in lora_state(third).items())   # same seed, same result

    # an entry made for another model (its key says so) is not used
    meta = json.loads((folder / "meta.json").read_text())
    meta["key"]["model"] = "someone/else"
    (folder / "meta.json").write_text(json.dumps(meta))
    assert not warm_start.warm_start(fresh(), cfg)["cached"]
    assert "other settings" in capsys.readouterr().out


def test_warm_start_is_on_by_default_only_for_the_default_model():
    assert Config().uses_warm_start and not Config().shows_demo   # the warm start replaces the example turns
    assert not Config(model="Qwen/Qwen2.5-1.5B-Instruct").uses_warm_start
    assert Config(model="Qwen/Qwen2.5-1.5B-Instruct").shows_demo
    assert Config(model="Qwen/Qwen2.5-1.5B-Instruct", warm_start="on").uses_warm_start
    assert not Config(warm_start="off").uses_warm_start and Config(warm_start="off").shows_demo
    assert Config(demo="on").shows_demo and not Config(demo="off", warm_start="off").shows_demo
    assert not Config(env="scienceworld").uses_warm_start and Config(env="scienceworld").shows_demo
    assert all(envs.demonstrator(n) for n in envs.WITH_DEMONSTRATOR) and envs.demonstrator("scienceworld") is None
    with pytest.raises(ValueError, match="no scripted demonstrator"):
        warm_start.demonstrations(None, Config(env="scienceworld", warm_start="on"))
