"""Text environments behind one small protocol (see README, "Environments").

    env = envs.make("rooms", split="train", seed=0)
    task = envs.tasks("rooms", "train")[0]
    obs, info = env.reset(task)             # info: task_id, instruction, admissible_actions, score, won
    obs, reward, done, info = env.step("look around")   # info also: valid (bool)

Conventions shared by every environment:
- An action is any string. Invalid or garbled actions never raise: the step returns an
  "Invalid action ..." observation that lists valid actions, valid=False, reward 0.
- Every observation ends with the actions valid in it ("Valid actions: ..."), except in
  scienceworld, where there can be hundreds (its invalid-action message lists the first 30).
- The rewards of one episode sum to at most 1 (the trainer's extrinsic return); info["score"]
  is the environment's own progress measure (webshop-mini and rooms: 0-1, scienceworld: 0-100).
- Each environment documents its reward, step limit and splits in its module docstring.
- Splits: "train"; "val" and "test" (same kind of tasks, unseen instances, disjoint from train
  and from each other: choose hyper-parameters on val, keep test for the final tables); "ood"
  (unseen kinds). webshop-mini also has "all".

Environment modules are imported lazily, so `import envs` never starts a simulator.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass

ENV_NAMES = ("rooms", "webshop-mini", "scienceworld", "rooms-far")
WITH_DEMONSTRATOR = ("rooms", "webshop-mini", "rooms-far")   # envs whose module defines demonstrator() (warm_start.py)
_MODULES = {"rooms": "envs.rooms", "webshop-mini": "envs.webshop_mini", "scienceworld": "envs.scienceworld",
            "rooms-far": "envs.rooms_far"}


@dataclass(frozen=True)
class Task:
    """One instance of an environment: a stable id (memory is keyed by it) and the goal text."""
    task_id: str
    instruction: str


def module(name: str):
    """The Python module that implements environment NAME (its source keys the caches)."""
    if name not in _MODULES:
        raise ValueError(f"unknown environment {name!r}; valid environments: {', '.join(ENV_NAMES)}")
    return importlib.import_module(_MODULES[name])


def make(name: str, split: str = "train", seed: int = 0, **kwargs):
    """A fresh environment instance; kwargs are environment-specific (e.g. max_steps, data_dir)."""
    return module(name).make(split=split, seed=seed, **kwargs)


def tasks(name: str, split: str, **kwargs) -> list[Task]:
    """The task list of a split, in a fixed order."""
    return module(name).tasks(split, **kwargs)


def settings(name: str, max_steps: int = 0, task_names: str = "") -> tuple[dict, dict]:
    """(kwargs of make, kwargs of tasks) for a run's settings: max_steps 0 keeps the env's own limit;
    task_names (comma-separated) picks scienceworld's tasks, or the kinds of rooms' train/val/test tasks."""
    make_kwargs = {"max_steps": max_steps} if max_steps else {}
    if not task_names:
        return make_kwargs, {}
    if name == "scienceworld":
        return make_kwargs, {"task_names": task_names.split(",")}
    if name == "rooms":
        return make_kwargs, {"kinds": tuple(task_names.split(","))}
    raise ValueError(f"--task-names applies to scienceworld and rooms only, not to {name!r}")


def demonstrator(name: str):
    """The env's scripted demonstrator for the behaviour-cloning warm start (warm_start.py):
    a function (observation, random.Random) -> action that reads nothing but the observation the
    agent itself sees. None where the env has none (scienceworld)."""
    return getattr(module(name), "demonstrator", None)


def task_kind(name: str):
    """The env's function task -> kind of task (webshop-mini: the product type), or None where it has none.
    It reads the hidden goal, so only the choice of which training tasks to demonstrate may use it."""
    return getattr(module(name), "task_kind", None)


def valid_actions_of(obs: str) -> list[str]:
    """The actions listed on an observation's last "Valid actions: a, b, c" line ([] if none)."""
    for line in reversed(obs.splitlines()):
        if line.startswith("Valid actions: "):
            return [a.strip() for a in line[len("Valid actions: "):].split(", ") if a.strip()]
    return []


def normalize_action(text: str) -> str:
    """Lower-case, collapse whitespace, drop surrounding quotes and trailing punctuation."""
    text = " ".join(str(text).strip().split()).lower()
    return text.strip("\"'`").rstrip(".!").strip()


def invalid_action_message(valid: list[str], where: str = "") -> str:
    """The observation every environment returns for an action it cannot execute.

    The rejected text is not quoted back: a small model copies from the latest observation, and an
    echo of its own mistake invited it to repeat that mistake until the step limit."""
    return f"Invalid action{where}. Nothing happened. Valid actions are: " + ", ".join(valid)
