"""Scripted reflection (envs/tips.py): tips written only from what the episode saw, and the warm start
that clones them (--warm-start-tips)."""
import copy
import dataclasses
import random
import re

import pytest

import envs
from empo2 import REFLECTION_PROMPT, Config
from envs.rooms import oracle_actions
from envs.tips import scripted_tip
from envs.webshop_mini import get_catalog


def episode(name, task, actions=None, seed=0):
    """(transcript, final observation, score) of one episode: the given actions, else the demonstrator's."""
    env, demo, rng = envs.make(name, "test"), envs.demonstrator(name), random.Random(seed)
    obs, _ = env.reset(task)
    transcript, done, k = [], False, 0
    while not done:
        action = actions[k] if actions else demo(obs, rng)
        k += 1
        step = {"observation": obs, "action": action}
        obs, reward, done, info = env.step(action)
        transcript.append({**step, "valid": info["valid"]})
    return transcript, obs, info["score"]


def test_a_rooms_tip_names_the_rooms_the_episode_saw_and_none_it_did_not():
    for k, task in enumerate(envs.tasks("rooms", "test")[:20]):
        transcript, final, score = episode("rooms", task, seed=k)
        tip = scripted_tip("rooms", transcript, final, score)
        text = " ".join(s["observation"] for s in transcript) + final
        entered = set(re.findall(r"You are in the (\w+)\.", text))
        went = re.search(r"Went to (.*?)\.", tip).group(1).split(", ")
        assert set(went) == entered
        for room in task.side_rooms:   # a room is named only if the episode saw it (entered, or as a door)
            if room not in text:
                assert room not in tip, (room, tip)
        assert tip.startswith(f"Score {score:.2f}.")


def test_a_successful_rooms_tip_says_where_the_target_was():
    task = envs.tasks("rooms", "test")[7]
    tip = scripted_tip("rooms", *episode("rooms", task, oracle_actions(task)))
    assert tip.startswith("Score 1.00.") and f"Done in the {task.target_room}" in tip
    assert f"{task.color} {'light bulb' if task.kind == 'bulb' else 'box'} in the {task.target_room}" in tip


def test_a_failed_rooms_tip_points_at_the_doors_left_unexplored():
    task = envs.tasks("rooms", "test")[3]
    tip = scripted_tip("rooms", *episode("rooms", task, ["go to hallway"] + ["look around"] * 9))
    unexplored = [r for r in task.side_rooms if r != task.start]
    assert tip.startswith("Score 0.00.") and "Never entered " + ", ".join(unexplored) + "." in tip


def test_a_rooms_tip_states_facts_and_gives_no_advice_the_policy_could_copy_as_an_action():
    """The warm-start policy copied "look there next" from "Never entered cellar: look there next." as its
    action, an invalid one; every sentence of a rooms tip now opens with the fact it states."""
    for k, task in enumerate(envs.tasks("rooms", "test")[:20]):
        tip = scripted_tip("rooms", *episode("rooms", task, seed=k))
        for sentence in re.split(r"(?<=\.) ", tip):
            assert re.match(r"(Score [\d.]+|Done in the \w+|Never entered [\w, ]+|Saw .*|Went to .*|Tried .*)\.$", sentence), sentence


def test_webshop_tips_never_read_the_hidden_goal(monkeypatch):
    """The same transcripts give the same tips after every hidden goal field is scrambled."""
    played = [episode("webshop-mini", t, seed=k) for k, t in enumerate(envs.tasks("webshop-mini", "test")[:15])]
    tips = [scripted_tip("webshop-mini", *e) for e in played]
    catalog = get_catalog()
    scrambled = copy.deepcopy(catalog.goals)
    for g in scrambled:
        g.update(asin="B000000000", goal_options=["nonexistent option"], attributes=["nothing"], name="x", query="y")
    monkeypatch.setattr(catalog, "goals", scrambled)
    assert [scripted_tip("webshop-mini", *e) for e in played] == tips
    transcript, final, score = played[0]
    query = transcript[0]["action"][len("search["):-1]
    bought = re.search(r"You bought (\S+)", final).group(1).rstrip(".")
    assert f"'{query}'" in tips[0] and f"Bought {bought}" in tips[0] and tips[0].startswith(f"Score {score:.2f}.")
    # the purchase comes right after the score: a tip the policy writes is cut to a few dozen tokens
    for tip in tips:
        assert re.match(r"Score \d\.\d\d\. (Bought \w+: (a full match|not a full match)|Bought nothing)", tip), tip


def test_the_webshop_tip_follower_repeats_a_full_match_retries_a_partial_one_and_skips_a_poor_one():
    from envs.tips import WebshopTipFollower
    env = envs.make("webshop-mini", "val")

    def play(task, act, seed):
        obs, _ = env.reset(task)
        transcript, done, rng = [], False, random.Random(seed)
        while not done:
            step = {"observation": obs, "action": act(obs, rng)}
            obs, _, done, info = env.step(step["action"])
            transcript.append({**step, "valid": info["valid"]})
        return transcript, obs, info["score"]
    bought = lambda final: re.search(r"You bought (\S+)", final).group(1).rstrip(".").lower()
    clicked_options = lambda transcript: {s["action"][6:-1] for s in transcript[2:-1]}   # after search and product
    seen = set()
    for k, task in enumerate(envs.tasks("webshop-mini", "val")):
        first = play(task, envs.demonstrator("webshop-mini"), k)
        score = first[2]
        kind = "full" if score == 1.0 else "partial" if score >= 0.5 else "poor"
        if kind in seen or "You bought" not in first[1] or not clicked_options(first[0]):
            continue
        seen.add(kind)
        tip = scripted_tip("webshop-mini", *first) + f" (score: {score:.2f})"
        second = play(task, WebshopTipFollower([tip]), 1000 + k)
        if kind == "full":       # the same product with the same options: a full match again
            assert second[2] == 1.0 and bought(second[1]) == bought(first[1])
            assert clicked_options(second[0]) == clicked_options(first[0])
        elif kind == "partial":  # the same product, none of the option values the tip lists where another exists
            assert bought(second[1]) == bought(first[1])
            assert clicked_options(second[0]) != clicked_options(first[0])
        else:                    # another product
            assert f"click[{bought(first[1])}]" not in [s["action"] for s in second[0]]
        if len(seen) == 3:
            break
    assert seen == {"full", "partial", "poor"}


def test_the_tip_demonstration_clones_the_scripted_tip_after_the_reflection_prompt(tiny_policy):
    import warm_start
    cfg = Config(env="rooms", warm_start_episodes=2, warm_start_tips=True)
    trajs = warm_start.demonstrations(tiny_policy, cfg)
    pairs = [warm_start.tip_demonstration(tiny_policy, tr, cfg) for tr in trajs]
    for tr, pair in zip(trajs, pairs):
        full = scripted_tip("rooms", tr.transcript, tr.final_obs, tr.ext_return)
        # the tip cloned is the scripted one cut to what a reflection can write, end-of-turn token included
        budget = cfg.tip_max_new_tokens - 1
        assert pair.tip == (full if len(tiny_policy.encode(full)) <= budget else tiny_policy.decode(tiny_policy.encode(full)[:budget]).strip())
        (ctx_kind, ctx), (act_kind, act) = pair.segments
        assert len(act) <= cfg.tip_max_new_tokens
        assert (ctx_kind, act_kind) == ("context", "action") and act[-1] == tiny_policy.end_of_turn_id
        assert tiny_policy.decode(act).strip() == pair.tip
        assert REFLECTION_PROMPT.split(".")[0] in tiny_policy.decode(ctx)
        # the hidden goal scrambled after the episode: the same tip (the writer never sees the task)
        tr.task = dataclasses.replace(tr.task, target_room="nowhere", color="no colour")
        assert warm_start.tip_demonstration(tiny_policy, tr, cfg).tip == pair.tip


def test_warm_start_tips_is_its_own_cache_entry(tiny_policy):
    import warm_start
    plain = warm_start.cache_key(tiny_policy, Config(env="rooms"))
    tips = warm_start.cache_key(tiny_policy, Config(env="rooms", warm_start_tips=True))
    assert "tips" not in plain and "tips" in tips
    assert warm_start.cache_folder(plain) != warm_start.cache_folder(tips)


def test_a_warm_start_with_tips_clones_episodes_and_reflections(tiny_policy):
    import warm_start
    cfg = Config(env="rooms", model="tiny", warm_start_episodes=2, warm_start_epochs=1, warm_start_batch=2,
                 warm_start_tips=True)
    meta = warm_start.warm_start(tiny_policy, cfg)
    assert not meta["cached"] and len(meta["scripted_tips"]) == 2 and meta["tip_following"]["episodes"] == 2
    assert len(meta["losses"]) == 3            # 6 sequences (2 episodes, 2 reflections, 2 second attempts), 2 per step
    assert all(t.startswith("Score ") for t in meta["scripted_tips"])


@pytest.mark.parametrize("split", ["test", "ood"])   # ood: the kind no training task has ("water ... plant")
def test_the_rooms_tip_follower_goes_where_the_tip_says(split):
    from envs.tips import RoomsTipFollower
    task = envs.tasks("rooms", split)[11]
    first = scripted_tip("rooms", *episode("rooms", task, oracle_actions(task)))
    env, rng = envs.make("rooms", split), random.Random(0)
    follow = RoomsTipFollower([first + " (score: 1.00)"])
    obs, _ = env.reset(task)
    actions, done = [], False
    while not done:
        actions.append(follow(obs, rng))
        obs, reward, done, info = env.step(actions[-1])
    assert info["won"] and actions[:2] == ["go to hallway", f"go to {task.target_room}"]


def test_memory_demonstrations_show_the_tip_once_and_follow_it(tiny_policy):
    import warm_start
    from empo2 import MEMORY, TIP_HEADER
    cfg = Config(env="rooms", warm_start_episodes=12, warm_start_tips=True)
    firsts = warm_start.demonstrations(tiny_policy, cfg)
    tips = [warm_start.tip_demonstration(tiny_policy, tr, cfg).tip for tr in firsts]
    seconds = warm_start.memory_demonstrations(tiny_policy, firsts, tips, cfg)
    for first, second, tip in zip(firsts, seconds, tips):
        assert second.task == first.task and second.rollout_mode == MEMORY
        blocks = [seg for kind, seg in second.segments if kind == "tip"]
        assert len(blocks) == 1 and tiny_policy.decode(blocks[0]).startswith(TIP_HEADER)
        assert second.transcript[0]["tips"][0].startswith(tip)
        assert all(step["tips"] == [] for step in second.transcript[1:])
    # following the tips pays: the second attempts win far more often than the random first ones
    assert sum(tr.won for tr in seconds) >= sum(tr.won for tr in firsts) + 4


def test_the_rooms_tip_follower_reads_tips_written_before_and_after_the_advice_was_dropped():
    from envs.tips import RoomsTipFollower
    for tip in ("Score 0.00. Never entered cellar, attic: look there next. Went to kitchen, hallway.",
                "Score 0.00. Never entered cellar, attic. Went to kitchen, hallway."):
        assert RoomsTipFollower([tip]).unexplored == ["cellar", "attic"]
