"""The real ScienceWorld simulator behind the envs protocol (envs/scienceworld.py).

Needs Java and the `scienceworld` package; skipped otherwise. One env (one JVM) is shared by
the module; the task lists are built from the simulator into a temporary cache file.
"""
import dataclasses
import json
import math
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("scienceworld", reason="the scienceworld package is not installed")
if shutil.which("java") is None:
    pytest.skip("ScienceWorld needs a Java runtime (apt-get install default-jre-headless)", allow_module_level=True)

import envs  # noqa: E402
from envs import scienceworld as sw  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
# (task, variation, needs another room): the gold paths run 5-15 steps
GOLD = [("power-component", 0, True),                      # the paper's red light bulb, in the workshop
        ("find-living-thing", 0, True),                    # carry an animal from outside to the kitchen
        ("lifespan-longest-lived", 0, True),
        ("chemistry-mix-paint-secondary-color", 1, False)]  # starts at score 20


@pytest.fixture(scope="module", autouse=True)
def task_cache(tmp_path_factory):
    """Build the task lists from the simulator, not from a cache file left by earlier runs."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sw, "CACHE_PATH", tmp_path_factory.mktemp("sw") / "tasks.json")
        mp.setattr(sw, "_cache", None)
        yield


@pytest.fixture(scope="module")
def env():
    e = envs.make("scienceworld")
    yield e
    e.close()


@pytest.fixture(scope="module")
def train_tasks():
    ts = envs.tasks("scienceworld", "train", task_names=[g[0] for g in GOLD])
    return {(t.task_name, t.variation): t for t in ts}


def run(env, actions):
    out = []
    for a in actions:
        out.append(env.step(a))
    return out


def test_import_envs_starts_no_java():
    code = "import envs, sys; print('scienceworld' in sys.modules, 'py4j' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["False", "False"], out.stderr


@pytest.mark.parametrize("name,variation,moves", GOLD, ids=[g[0] for g in GOLD])
def test_gold_path_wins(env, train_tasks, name, variation, moves):
    task = train_tasks[(name, variation)]
    gold = env.gold_actions(task)
    assert gold and not gold[0].startswith("ERROR")
    assert any(a.startswith("go to") for a in gold) == moves
    obs, info = env.reset(task)
    assert obs.startswith(task.instruction) and "This " in obs  # goal text, then the first look
    total, steps = 0.0, 0
    for action in gold:
        obs, reward, done, info = env.step(action)
        steps, total = steps + 1, total + reward
        assert info["valid"] and not info["corrected"], (action, obs)
        assert info["executed_action"] == sw.normalize_action(action)
        if done:
            break
    assert done and info["won"] and info["score"] == 100.0 and not info["failed"]
    assert math.isclose(total, 1.0)  # rewards sum to the final score / 100
    assert steps <= len(gold) <= env.max_steps
    print(f"{name} v{variation}: score {info['score']}, won {info['won']}, {steps} steps")


def test_splits_follow_the_paper(env):
    names = sw.DEFAULT_TASK_NAMES
    train = envs.tasks("scienceworld", "train")
    test = envs.tasks("scienceworld", "test", task_names=list(names))
    ood = envs.tasks("scienceworld", "ood", num_variations=1)
    assert [t.task_id for t in train] == [t.task_id for t in envs.tasks("scienceworld", "train", task_names=names)]
    for name in names:
        env.sim.load(name, 0, "")
        sim_train, sim_test = env.sim.get_variations_train(), env.sim.get_variations_test()
        tr = [t.variation for t in train if t.task_name == name]
        te = [t.variation for t in test if t.task_name == name]
        assert tr == list(sim_train)[:5]
        assert len(te) == min(20, len(sim_test)) and set(te) <= set(sim_test) and te[0] == sim_test[0]
        assert not set(tr) & set(te)
    assert {t.task_name for t in ood} == set(sw.all_task_names()) - set(names)
    assert len(ood) == 30 - len(names) and len(sw.all_task_names()) == 30
    ids = [t.task_id for t in train + test + ood]
    assert len(ids) == len(set(ids))
    for t in train + test + ood:
        assert t.task_id == f"scienceworld/{t.task_name}/v{t.variation}"
        assert t.instruction.startswith("Your task is")
    assert "red light bulb" in train[0].instruction
    with pytest.raises(dataclasses.FrozenInstanceError):
        train[0].variation = 7


def test_val_split_is_the_dev_variations(env):
    names = sw.DEFAULT_TASK_NAMES
    val = envs.tasks("scienceworld", "val")
    others = {s: envs.tasks("scienceworld", s, **kw) for s, kw in
              (("train", {}), ("test", {}), ("ood", {"num_variations": 1}))}
    assert val and [t.task_id for t in val] == [t.task_id for t in envs.tasks("scienceworld", "val")]  # deterministic
    for name in names:
        env.sim.load(name, 0, "")
        dev = list(env.sim.get_variations_dev())
        va = [t.variation for t in val if t.task_name == name]
        assert len(va) == min(10, len(dev)) and set(va) <= set(dev) and va[0] == dev[0]
    assert len(val) == 5 + 10 + 10   # power-component has 5 dev variations
    pairs = {(t.task_name, t.variation) for t in val}
    for split, ts in others.items():
        assert not pairs & {(t.task_name, t.variation) for t in ts}, split
        assert not {t.task_id for t in val} & {t.task_id for t in ts}, split
    for t in val:
        assert t.task_id == f"scienceworld/{t.task_name}/v{t.variation}" and t.instruction.startswith("Your task is")


def test_a_cache_file_from_before_val_gets_the_dev_variations(env, monkeypatch, tmp_path):
    """Cache files written before val held [train, test] per task: reading val from one must not
    break (nor use test variations); the simulator starts once and the file gets the dev list."""
    train = envs.tasks("scienceworld", "train", task_names=["power-component"])
    old = json.loads(json.dumps(sw._task_cache()))
    old["variations"] = {"power-component": old["variations"]["power-component"][:2]}
    monkeypatch.setattr(sw, "CACHE_PATH", tmp_path / "old.json")
    (tmp_path / "old.json").write_text(json.dumps(old))
    monkeypatch.setattr(sw, "_cache", None)
    starts, start = [], sw._start_simulator
    monkeypatch.setattr(sw, "_start_simulator", lambda: starts.append(1) or start())
    val = envs.tasks("scienceworld", "val", task_names=["power-component"])
    env.sim.load("power-component", 0, "")
    assert len(starts) == 1 and [t.variation for t in val] == list(env.sim.get_variations_dev())   # all 5
    assert envs.tasks("scienceworld", "train", task_names=["power-component"]) == train
    saved = json.loads((tmp_path / "old.json").read_text())["variations"]["power-component"]
    assert len(saved) == 3 and saved[2] == [t.variation for t in val]


def test_task_lists_come_back_from_the_cache_file(monkeypatch, train_tasks):
    assert Path(sw.CACHE_PATH).exists()
    monkeypatch.setattr(sw, "_cache", None)  # a new process: only the file is left

    def no_simulator():
        raise AssertionError("a cached task list must not start a simulator")
    monkeypatch.setattr(sw, "_start_simulator", no_simulator)
    again = envs.tasks("scienceworld", "train", task_names=[g[0] for g in GOLD])
    assert {(t.task_name, t.variation): t for t in again} == train_tasks


def test_garbage_actions_never_raise(env, train_tasks):
    env.reset(train_tasks[("find-living-thing", 0)])
    moves = env.sim.get_num_moves()
    rng = random.Random(0)
    noise = "".join(chr(rng.randrange(32, 0x2FFF)) for _ in range(10_000))
    garbage = ["", "   ", noise, noise[:250], "🔥 日本語 ünïcödé", "\x00\x01\x1b[2J\n\n", '{"action": "open door"}',
               "<action></action>", "focus on", "0", "reset task", "reset", "1e309", 12345, None]
    for g in garbage:
        obs, reward, done, info = env.step(g)
        assert not info["valid"] and reward == 0.0 and info["executed_action"] is None, g
        assert obs.startswith("Invalid action") and "open door to kitchen" in obs
    assert env.sim.get_num_moves() == moves and info["score"] == 0.0  # the world never moved
    assert env.steps == len(garbage)  # but every step counted


def test_invalid_actions_count_toward_the_step_limit(train_tasks):
    small = envs.make("scienceworld", max_steps=3)
    try:
        small.reset(train_tasks[("find-living-thing", 0)])
        dones = [small.step("fly to the moon")[2] for _ in range(3)]
        assert dones == [False, False, True]
        obs, reward, done, info = small.step("look around")
        assert done and not info["valid"] and reward == 0.0
        # a second env ran beside the shared one; close() ends its JVM
        proc = small.sim._gateway.java_process
    finally:
        small.close()
    deadline = time.time() + 10
    while proc.poll() is None and time.time() < deadline:
        time.sleep(0.1)
    assert proc.poll() is not None
    with pytest.raises(RuntimeError):
        small.step("look around")


def test_fuzzy_correction(env, train_tasks):
    env.reset(train_tasks[("find-living-thing", 0)])
    obs, reward, done, info = env.step("Open door to kitchn.")
    assert info["valid"] and info["corrected"] and info["executed_action"] == "open door to kitchen"
    assert obs == "The door is now open." and reward > 0
    obs, reward, done, info = env.step("go to the kitchen")
    assert info["corrected"] and info["executed_action"] == "go to kitchen" and obs == "You move to the kitchen."
    obs, reward, done, info = env.step("look around")
    assert info["valid"] and not info["corrected"] and "kitchen" in obs


def test_correction_never_swaps_objects(env, train_tasks):
    env.reset(train_tasks[("power-component", 0)])
    run(env, ["open door to workshop", "go to workshop"])
    assert "focus on red light bulb" in env.valid_actions and "focus on violet light bulb" in env.valid_actions
    moves = env.sim.get_num_moves()
    for near_miss in ["focus on purple light bulb", "connect battery anode to black wire terminal 3",
                      "focus on unknown light bulb"]:
        obs, reward, done, info = env.step(near_miss)
        assert not info["valid"] and not done, (near_miss, info["executed_action"])
    assert env.sim.get_num_moves() == moves
    obs, reward, done, info = env.step("focus on red light blub")
    assert info["corrected"] and info["executed_action"] == "focus on red light bulb" and not info["failed"]


def test_ambiguous_request_asks_for_a_number(env, train_tasks):
    env.reset(train_tasks[("find-living-thing", 0)])
    run(env, ["open door to kitchen", "go to kitchen"])
    obs, reward, done, info = env.step("pick up orange")  # free text the parser takes: two oranges
    assert info["valid"] and obs.startswith("Ambiguous request")
    assert info["admissible_actions"] == ["0", "1"]
    obs, reward, done, info = env.step("look around")  # not a number: cancels, then runs
    assert info["executed_action"] == "look around" and obs.startswith("This room is called the kitchen")
    assert "0" not in info["admissible_actions"]
    env.step("pick up orange")
    obs, reward, done, info = env.step("1")
    assert info["valid"] and obs == "You move the orange to the inventory."


def test_fatal_mistake_scores_zero(env, train_tasks):
    env.reset(train_tasks[("find-living-thing", 0)])
    results = run(env, ["open door to kitchen", "go to kitchen", "focus on painting"])  # not a living thing
    rewards = [r[1] for r in results]
    obs, reward, done, info = results[-1]
    assert rewards[0] > 0 and rewards[1] > 0
    assert done and info["failed"] and info["score"] == 0.0 and not info["won"]
    assert math.isclose(sum(rewards), 0.0, abs_tol=1e-9)  # the failure takes back the points
    obs, reward, done, info = env.step("look around")
    assert done and reward == 0.0 and not info["valid"]


def test_reset_reuses_the_simulator(env, train_tasks):
    task = train_tasks[("power-component", 0)]
    pid = env.sim._gateway.java_process.pid
    obs1, info1 = env.reset(task)
    env.step("open door to workshop")
    obs2, info2 = env.reset(task)
    assert obs1 == obs2 and info2["score"] == 0.0 and info2["steps"] == 0
    assert env.sim._gateway.java_process.pid == pid
    assert set(info1) >= {"task_id", "instruction", "admissible_actions", "score", "won", "valid"}
    adm = info1["admissible_actions"]
    assert adm[0] == "look around" and len(adm) <= env.max_admissible and set(adm) <= set(env.valid_actions)
    assert "reset task" not in env.valid_actions and "open door to workshop" in adm


def test_order_actions_keeps_every_kind_under_the_cap():
    acts = [f"connect agent to thing {i}" for i in range(50)] + [f"connect wire {i} to bulb" for i in range(50)]
    acts += [f"look at thing {i}" for i in range(50)] + ["look around", "wait", "open door to kitchen"]
    out = sw.order_actions(acts, 12)
    assert len(out) == 12 and out[0] == "look around"
    assert {"wait", "open door to kitchen"} <= set(out) and any(a.startswith("connect wire") for a in out)
    assert not any("agent" in a for a in out)  # junk waits behind the useful connections
    full = sw.order_actions(acts, None)
    assert sorted(full) == sorted(acts) and full[-1] == "wait"
    assert full.index("connect wire 49 to bulb") < full.index("connect agent to thing 0")


def test_missing_java_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.raises(RuntimeError, match="^ScienceWorld needs a Java runtime: apt-get install default-jre-headless$"):
        envs.make("scienceworld")
    monkeypatch.setattr(sw, "_cache", {"version": "x", "variations": {}, "instructions": {}})
    with pytest.raises(RuntimeError, match="needs a Java runtime"):
        envs.tasks("scienceworld", "train", task_names=["boil"])


def test_unknown_names_are_clear_errors():
    with pytest.raises(ValueError, match="boil-water.*valid names: .*find-living-thing"):
        envs.tasks("scienceworld", "train", task_names=["boil-water"])
    with pytest.raises(ValueError, match="unknown split"):
        envs.tasks("scienceworld", "dev")
    with pytest.raises(TypeError):
        envs.make("scienceworld", task_names=["boil"])
