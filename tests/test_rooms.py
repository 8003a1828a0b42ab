"""rooms: the obvious action fails, looking around succeeds; splits; bad input; the protocol."""
import hashlib

import pytest

import envs
from envs import rooms
from envs.rooms import _signature, oracle_actions


def test_unknown_env_and_split_are_clear_errors():
    with pytest.raises(ValueError, match="valid environments: rooms, webshop-mini, scienceworld"):
        envs.make("atari")
    with pytest.raises(ValueError, match="valid: train, test, ood"):
        envs.tasks("rooms", "dev")


def test_obvious_action_fails_and_exploring_wins():
    env = envs.make("rooms")
    for task in envs.tasks("rooms", "train")[:20]:
        obs, info = env.reset(task)
        assert task.instruction in obs and info["task_id"] == task.task_id and not info["won"]
        obvious = oracle_actions(task)[-1]              # "turn on red light bulb", right away
        assert obvious in info["admissible_actions"]     # offered, like the paper's "focus on red light bulb"
        obs, reward, done, info = env.step(obvious)
        assert reward == 0 and not done and info["valid"] and obs.startswith("There is no")
        for action in oracle_actions(task):
            obs, reward, done, info = env.step(action)
        assert reward == 1.0 and done and info["won"] and info["score"] == 1.0


def test_oracle_solves_every_split_and_splits_are_disjoint():
    env = envs.make("rooms")
    splits = {s: envs.tasks("rooms", s) for s in ("train", "test", "ood")}
    assert {s: len(t) for s, t in splits.items()} == {"train": 60, "test": 100, "ood": 30}
    sig = lambda t: (t.kind, t.color, t.decoy_color, t.start, t.target_room, t.side_rooms)  # noqa: E731
    assert not {sig(t) for t in splits["train"]} & {sig(t) for t in splits["test"]}
    assert not {t.kind for t in splits["train"]} & {t.kind for t in splits["ood"]}
    ids = [t.task_id for ts in splits.values() for t in ts]
    assert len(ids) == len(set(ids))
    for task in splits["test"] + splits["ood"]:
        env.reset(task)
        rewards = [env.step(a)[1] for a in oracle_actions(task)]
        assert rewards[-1] == 1.0
    assert envs.tasks("rooms", "train") == splits["train"]  # deterministic


def _digest(tasks) -> str:
    return hashlib.sha256(repr([(t.task_id, _signature(t)) for t in tasks]).encode()).hexdigest()[:16]


def test_val_split_is_new_layouts_and_leaves_train_and_test_alone():
    splits = {s: envs.tasks("rooms", s) for s in ("train", "val", "test", "ood")}
    val = splits["val"]
    assert len(val) == 40 and {t.kind for t in val} == {"bulb", "box"}
    assert all(t.task_id.startswith("rooms/val/") for t in val)
    val_sigs = {_signature(t) for t in val}
    assert len(val_sigs) == len(val)
    for other in ("train", "test", "ood"):
        assert not val_sigs & {_signature(t) for t in splits[other]}, other
        assert not {t.task_id for t in val} & {t.task_id for t in splits[other]}, other
    # train and test are what they were before val existed (earlier results used them)
    assert (len(splits["train"]), len(splits["test"])) == (60, 100)
    assert (_digest(splits["train"]), _digest(splits["test"])) == ("e926175c140f61b8", "cacb266eb46c5646")
    assert envs.tasks("rooms", "val") == val  # deterministic
    env = envs.make("rooms", "val")
    for task in val:
        env.reset(task)
        assert [env.step(a)[1] for a in oracle_actions(task)][-1] == 1.0


def test_kinds_give_train_val_and_test_more_verbs_and_leave_ood_unseen():
    """--task-names for rooms: the kinds of train/val/test (envs.settings maps it); ood keeps its own kind."""
    kinds = envs.settings("rooms", task_names=",".join(rooms.TRAIN_KINDS))[1]
    assert kinds == {"kinds": rooms.TRAIN_KINDS} and len(rooms.TRAIN_KINDS) == 8 and "plant" not in rooms.TRAIN_KINDS
    splits = {s: envs.tasks("rooms", s, **kinds) for s in ("train", "val", "test", "ood")}
    for split in ("train", "val", "test"):
        assert {t.kind for t in splits[split]} == set(rooms.TRAIN_KINDS), split
    assert splits["ood"] == envs.tasks("rooms", "ood")
    sigs = {s: {_signature(t) for t in ts} for s, ts in splits.items()}
    assert not sigs["val"] & (sigs["train"] | sigs["test"]) and not sigs["train"] & sigs["test"]
    env = envs.make("rooms")
    for task in splits["train"][:8]:   # one task of each kind: its verb works on its object
        env.reset(task)
        assert [env.step(a)[1] for a in oracle_actions(task)][-1] == 1.0
    with pytest.raises(ValueError, match="ood split's kinds never train"):
        envs.tasks("rooms", "train", kinds=("bulb", "plant"))
    with pytest.raises(ValueError, match="scienceworld and rooms only"):
        envs.settings("webshop-mini", task_names="bulb")


@pytest.mark.parametrize("other", ["train", "test"])
def test_val_skips_layouts_of_train_and_test_even_from_their_seed(monkeypatch, other):
    """Random layouts rarely collide, so disjointness alone would pass without the check: with the
    other split's seed, val draws that split's layouts first and must skip every one of them."""
    monkeypatch.setitem(rooms.SPLIT_SEEDS, "val", rooms.SPLIT_SEEDS[other])
    val = envs.tasks("rooms", "val")
    assert len(val) == 40
    assert not {_signature(t) for t in val} & {_signature(t) for t in envs.tasks("rooms", other)}


@pytest.mark.parametrize("action", ["", "   ", "x" * 10_000, "🔥 日本語", "go to", "turn on[", "go to moon", None])
def test_garbage_actions_never_raise(action):
    env = envs.make("rooms")
    task = envs.tasks("rooms", "train")[0]
    env.reset(task)
    obs, reward, done, info = env.step(action)
    assert obs.startswith("Invalid action") and "Valid actions are: look around" in obs
    assert reward == 0 and not done and info["valid"] is False and len(obs) < 1000
    assert env.step("look around")[3]["valid"]  # the episode goes on


def test_lenient_match_and_step_limit():
    env = envs.make("rooms", max_steps=3)
    task = envs.tasks("rooms", "train")[0]
    env.reset(task)
    obs, _, _, info = env.step("Hallway.")
    assert info["valid"] and obs.startswith("You are in the hallway")
    env.step("look around")
    assert env.step("look around")[2] is True
    with pytest.raises(TypeError, match="max_step"):
        envs.make("rooms", max_step=3)


def test_every_observation_ends_with_its_valid_actions_and_the_walker_uses_them():
    env, rng = envs.make("rooms"), __import__("random").Random(0)
    walker = envs.demonstrator("rooms")
    for task in envs.tasks("rooms", "test")[:10]:
        obs, info = env.reset(task)
        done = False
        while not done:
            assert envs.valid_actions_of(obs) == info["admissible_actions"]
            obs, _, done, info = env.step(walker(obs, rng))
            assert info["valid"]
