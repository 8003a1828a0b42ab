"""rooms-far: the goal three doors away, rarely found by a random walk; tips that say where it is help."""
import random
import re

import pytest

import envs
from empo2 import Config
from envs.rooms_far import RoomsFarTask, _signature, oracle_actions
from envs.tips import FOLLOWERS, scripted_tip


def play(name, task, policy, seed, max_steps=10):
    """(transcript, final observation, score, steps) of one episode of `policy` (obs, rng) -> action."""
    env, rng = envs.make(name, max_steps=max_steps), random.Random(seed)
    obs, _ = env.reset(task)
    transcript, done = [], False
    while not done:
        action = policy(obs, rng)
        step = {"observation": obs, "action": action}
        obs, _, done, info = env.step(action)
        transcript.append({**step, "valid": info["valid"]})
    return transcript, obs, info["score"], len(transcript)


def test_the_goal_is_three_doors_away_and_the_shortest_solution_works_on_every_split():
    env = envs.make("rooms-far")
    for split in ("train", "val", "test", "ood"):
        for task in envs.tasks("rooms-far", split):
            obs, info = env.reset(task)
            assert [a for a in info["admissible_actions"] if a.startswith("go to")] == ["go to hallway"]
            _, _, _, info = env.step("go to hallway")
            assert f"go to {task.target_room}" not in info["admissible_actions"]   # not a side room
            env.reset(task)
            for action in oracle_actions(task):
                obs, reward, done, info = env.step(action)
                assert info["valid"]
            assert reward == 1.0 and done and info["won"]


def test_splits_are_disjoint_and_bad_input_is_a_clear_error():
    splits = {s: envs.tasks("rooms-far", s) for s in ("train", "val", "test", "ood")}
    assert {s: len(t) for s, t in splits.items()} == {"train": 60, "val": 40, "test": 100, "ood": 30}
    sig = {s: {_signature(t) for t in ts} for s, ts in splits.items()}
    assert not sig["train"] & sig["test"] and not sig["val"] & (sig["train"] | sig["test"])
    assert {t.kind for t in splits["ood"]} == {"plant"} and "plant" not in {t.kind for t in splits["train"]}
    assert all(isinstance(t, RoomsFarTask) for ts in splits.values() for t in ts)
    with pytest.raises(ValueError, match="valid: train"):
        envs.tasks("rooms-far", "dev")
    with pytest.raises(TypeError, match="rooms-far needs a task"):
        envs.make("rooms-far").reset(envs.tasks("rooms", "train")[0])


def success_rate(name, split, policy_for, repeats=5):
    tasks = envs.tasks(name, split)
    wins = [play(name, t, policy_for(t, k), seed=100 * r + k)[2] for r in range(repeats) for k, t in enumerate(tasks)]
    return sum(wins) / len(wins)


def test_a_random_walk_rarely_finds_the_goal():
    """The warm start's demonstrator (a uniform random walk) on validation layouts: far less often than
    in rooms, where the goal is two doors away."""
    walk = lambda task, k: envs.demonstrator("rooms-far")   # noqa: E731
    far, near = success_rate("rooms-far", "val", walk), success_rate("rooms", "val", walk)
    assert far <= 0.08 and near >= 2 * far


def test_a_tip_says_what_lies_behind_which_door_and_the_follower_goes_there():
    """The scripted tip of a successful episode leads the follower straight to the goal (4 steps, on every
    test layout); tips of random walks, mostly failures, still lift it far above walking at random."""
    name, follower = "rooms-far", FOLLOWERS["rooms-far"]
    for k, task in enumerate(envs.tasks(name, "test")[:30]):
        transcript, final, score, _ = play(name, task, lambda obs, rng, it=iter(oracle_actions(task)): next(it), k)
        tip = scripted_tip(name, transcript, final, score)
        front = {back: side for side, back in task.behind}[task.target_room]
        assert f"Done in the {task.target_room}" in tip and f"{task.target_room} behind the {front}" in tip
        assert play(name, task, follower([tip]), k)[2:] == (1.0, 4)

    def with_walk_tip(task, k):
        return follower([scripted_tip(name, *play(name, task, envs.demonstrator(name), 7 + k)[:3])])
    walk = lambda task, k: envs.demonstrator(name)   # noqa: E731
    assert success_rate(name, "val", with_walk_tip) >= 3 * max(success_rate(name, "val", walk), 0.05)


def test_the_facts_a_follower_needs_survive_the_cut_to_a_self_written_tips_length(tiny_policy):
    """A reflection stops at cfg.tip_max_new_tokens and the warm start clones tips cut there, so where the
    goal was done or what is left to explore, and the way to the back rooms, come first: over random
    walks on the validation layouts every such sentence is still whole after the cut (with the walk and
    the attempts first, half the tips that had back-room sentences lost them all)."""
    budget = Config().tip_max_new_tokens - 1
    checked = 0
    for k, task in enumerate(envs.tasks("rooms-far", "val")):
        for r in range(3):
            tip = scripted_tip("rooms-far", *play("rooms-far", task, envs.demonstrator("rooms-far"), 100 * r + k)[:3])
            cut = tiny_policy.decode(tiny_policy.encode(tip)[:budget]).strip()
            for sentence in re.findall(r"(?:Back rooms: |Never entered |Done in the ).*?\.", tip):
                assert sentence in cut, (tip, cut)
                checked += 1
    assert checked >= 150


def test_the_follower_reads_which_room_is_behind_which_in_both_tip_forms():
    """Runs' samples/ keep tips written before "Back rooms: ..." replaced "The X is behind the Y."."""
    follower = FOLLOWERS["rooms-far"]
    assert follower(["Score 0.00. Back rooms: cellar behind the garden, attic behind the studio."]).front == \
        {"cellar": "garden", "attic": "studio"}
    assert follower(["Score 0.00. Went to garden. The cellar is behind the garden."]).front == {"cellar": "garden"}


def test_tip_information_tells_a_tip_that_says_where_from_noise():
    """empo2.tip_information: a follower shown a winning episode's scripted tip goes straight to the goal;
    shown noise (a 135M policy's early tips) it does no better than when shown nothing useful."""
    from empo2 import tip_information
    pool = envs.tasks("rooms-far", "train")[:20]
    told = [(t, scripted_tip("rooms-far", *play("rooms-far", t, lambda obs, rng, it=iter(oracle_actions(t)): next(it), 0)[:3]), 1.0)
            for t in pool]
    good = tip_information("rooms-far", told, seed=3)
    noise = tip_information("rooms-far", [(t, "SOLOMO, a nice thankfull snack", 0.0) for t in pool], seed=3)
    assert good["memory/tip_follow_success"] == 1.0 and good["memory/walk_success"] <= 0.3
    # noise tells the follower nothing: it plays as it does shown no tip (same seeds), far below a telling tip
    assert noise["memory/tip_follow_success"] == noise["memory/blank_follow_success"] == good["memory/blank_follow_success"] <= 0.4
    assert noise["memory/walk_success"] == good["memory/walk_success"]
    assert tip_information("scienceworld", told) == {} and tip_information("rooms-far", []) == {}
