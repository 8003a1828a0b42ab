"""rooms: a tiny house where the obvious action fails and success needs looking around.

It is the paper's "turn on the red light bulb" situation (docs/algorithm.md, "The problem")
in a few hundred lines of pure Python, for tests and notebooks. The goal ("turn on the red
light bulb") names an object that is never in the start room; the start room holds a
look-alike of another colour, and the goal's own action is always offered, so an agent that
follows its prior ("turn on red light bulb" right away) is told "There is no red light bulb
here." and earns nothing. The target sits two doors away, behind the hallway.

Reward: 1.0 when the goal action is done on the target, which ends the episode; 0 otherwise.
Step limit: 10 (max_steps). An action is matched after envs.normalize_action; text that is the
last words of exactly one valid action ("hallway" for "go to hallway") runs that action. info["score"] is 1.0 once won, else 0.0.
Splits: "train" (60 tasks), "val" (40 tasks, layouts in neither train nor test: for choosing
hyper-parameters) and "test" (100 tasks, layouts unseen in train) use the kinds "turn on ...
light bulb" and "open ... box"; "ood" (30 tasks) uses a kind never seen in training,
"water ... plant". Each split has its own seed; a layout is the tuple _signature() returns.
tasks(split, kinds=...) (train.py's --task-names) gives train, val and test other kinds, e.g. all
eight of TRAIN_KINDS: a policy that has acted with eight verbs acts on the ood split's unseen one
where one trained on two does not (README, "Memory that carries information"); ood stays "plant".
"""
from __future__ import annotations

import random
from dataclasses import dataclass

from envs import Task, invalid_action_message, normalize_action, valid_actions_of

ROOMS = ("kitchen", "bedroom", "workshop", "garden", "bathroom", "office", "attic", "cellar")
COLORS = ("red", "blue", "green", "yellow", "white", "orange", "purple")
# kind -> (verb, object noun, what the env says when it works)
KINDS = {
    "bulb": ("turn on", "light bulb", "The {obj} is now on. Task complete!"),
    "box": ("open", "box", "The {obj} is now open. Task complete!"),
    "plant": ("water", "plant", "The {obj} is now watered. Task complete!"),
    "bell": ("ring", "bell", "The {obj} rings. Task complete!"),
    "book": ("read", "book", "You read the {obj}. Task complete!"),
    "candle": ("light", "candle", "The {obj} is now lit. Task complete!"),
    "clock": ("wind", "clock", "The {obj} is now wound. Task complete!"),
    "towel": ("fold", "towel", "The {obj} is now folded. Task complete!"),
    "cat": ("feed", "cat", "The {obj} is now fed. Task complete!"),
}
SPLIT_KINDS = {"train": ("bulb", "box"), "test": ("bulb", "box"), "ood": ("plant",), "val": ("bulb", "box")}
# the kinds tasks(split, kinds=...) may give train, val and test: every kind but the ood split's
TRAIN_KINDS = tuple(k for k in KINDS if k not in SPLIT_KINDS["ood"])
SPLIT_SIZES = {"train": 60, "test": 100, "ood": 30, "val": 40}
SPLIT_SEEDS = {"train": 0, "test": 1, "ood": 2, "val": 3}
# the splits whose layouts a split must avoid (test was made before val existed, so it avoids train only)
SPLIT_AVOIDS = {"test": ("train",), "val": ("train", "test")}
FURNITURE = ("a table", "a chair", "a shelf", "a rug", "a lamp", "a cupboard")


@dataclass(frozen=True)
class RoomsTask(Task):
    kind: str = "bulb"
    color: str = "red"          # colour of the target object
    decoy_color: str = "blue"   # colour of the look-alike in the start room
    start: str = "kitchen"
    target_room: str = "garden"
    side_rooms: tuple = ()      # every room off the hallway, start and target included


def _layout(rng: random.Random, kind: str, index: int, split: str) -> RoomsTask:
    side_rooms = tuple(rng.sample(ROOMS, 4))
    start, target_room = side_rooms[0], rng.choice(side_rooms[1:])
    color, decoy = rng.sample(COLORS, 2)
    verb, noun, _ = KINDS[kind]
    return RoomsTask(task_id=f"rooms/{split}/{kind}-{index}", instruction=f"Your task is to {verb} the {color} {noun}.",
                     kind=kind, color=color, decoy_color=decoy, start=start, target_room=target_room,
                     side_rooms=side_rooms)


def tasks(split: str, kinds: tuple[str, ...] = ()) -> list[RoomsTask]:
    """The split's tasks; kinds (of TRAIN_KINDS) replaces train, val and test's two, taken in turn."""
    if split not in SPLIT_KINDS:
        raise ValueError(f"unknown split {split!r} for rooms; valid: {', '.join(SPLIT_KINDS)}")
    bad = [k for k in kinds if k not in TRAIN_KINDS]
    if bad:
        raise ValueError(f"rooms kinds {bad} are not allowed (the ood split's kinds never train); valid: {', '.join(TRAIN_KINDS)}")
    split_kinds = tuple(kinds) if kinds and split != "ood" else SPLIT_KINDS[split]
    rng = random.Random(SPLIT_SEEDS[split])
    # test layouts differ from every train layout; val layouts from every train and test one
    seen = {_signature(t) for other in SPLIT_AVOIDS.get(split, ()) for t in tasks(other, kinds)}
    out = []
    while len(out) < SPLIT_SIZES[split]:
        kind = split_kinds[len(out) % len(split_kinds)]
        task = _layout(rng, kind, len(out), split)
        if _signature(task) not in seen:
            seen.add(_signature(task))
            out.append(task)
    return out


def _signature(t: RoomsTask) -> tuple:
    return (t.kind, t.color, t.decoy_color, t.start, t.target_room, t.side_rooms)


class RoomsEnv:
    name = "rooms"
    # one example exchange shown before every episode (small models need it to answer with an action):
    # a list of (user, assistant) turns
    demo = [("You are in a shop. You see: a fridge, a counter. Doors lead to: street.\n"
             "Valid actions: look around, go to street, open fridge", "go to street")]

    def __init__(self, max_steps: int = 10, seed: int = 0):
        self.max_steps = max_steps
        self.rng = random.Random(seed)
        self.task: RoomsTask | None = None

    # --- world model -------------------------------------------------------------------
    def _objects(self, room: str) -> list[str]:
        t = self.task
        noun = KINDS[t.kind][1]
        objs = list(self._furniture[room])
        if room == t.start:
            objs.append(f"a {t.decoy_color} {noun}")
        if room == t.target_room:
            objs.append(f"a {t.color} {noun}")
        return objs

    def _exits(self, room: str) -> list[str]:
        return list(self.task.side_rooms) if room == "hallway" else ["hallway"]

    def _admissible(self) -> list[str]:
        t = self.task
        verb, noun, _ = KINDS[t.kind]
        acts = ["look around"] + [f"go to {r}" for r in self._exits(self.room) if r != self.room]
        targets = {f"{t.color} {noun}"} | {o[2:] for o in self._objects(self.room) if o.endswith(noun)}
        return acts + [f"{verb} {o}" for o in sorted(targets)]

    def _describe(self) -> str:
        objs = ", ".join(self._objects(self.room)) or "nothing"
        exits = ", ".join(r for r in self._exits(self.room) if r != self.room)
        return (f"You are in the {self.room}. You see: {objs}. Doors lead to: {exits}.\n"
                f"Valid actions: {', '.join(self._admissible())}")

    # --- protocol ----------------------------------------------------------------------
    def reset(self, task: RoomsTask):
        if not isinstance(task, RoomsTask):
            raise TypeError(f"rooms needs a task from envs.tasks('rooms', split), got {type(task).__name__}")
        self.task, self.room, self.steps, self.won = task, task.start, 0, False
        layout_rng = random.Random(task.task_id)  # furniture is part of the task, not of the episode
        self._furniture = {r: layout_rng.sample(FURNITURE, 2) for r in task.side_rooms + ("hallway",)}
        obs = f"{task.instruction}\n{self._describe()}"
        return obs, self._info(valid=True)

    def _info(self, valid: bool) -> dict:
        return {"task_id": self.task.task_id, "instruction": self.task.instruction,
                "admissible_actions": self._admissible(), "score": float(self.won), "won": self.won, "valid": valid}

    def step(self, action: str):
        if self.task is None:
            raise RuntimeError("call reset(task) before step()")
        self.steps += 1
        act = normalize_action(action)
        valid_actions = self._admissible()
        # lenient: "hallway" means "go to hallway" when exactly one valid action ends with the text
        ends = [a for a in valid_actions if len(act) >= 4 and a.endswith(" " + act)]
        if act not in valid_actions and len(ends) == 1:
            act = ends[0]
        reward, valid = 0.0, act in valid_actions
        t = self.task
        verb, noun, success = KINDS[t.kind]
        if not valid:
            obs = invalid_action_message(valid_actions)
        elif act == "look around":
            obs = self._describe()
        elif act.startswith("go to "):
            self.room = act[len("go to "):]
            obs = self._describe()
        else:
            obj = act[len(verb) + 1:]
            here = [o[2:] for o in self._objects(self.room)]
            if obj not in here:
                obs = f"There is no {obj} here.\n{self._describe()}"
            elif obj == f"{t.color} {noun}":
                self.won, reward = True, 1.0
                obs = success.format(obj=obj)
            else:
                obs = f"You {verb} the {obj}. Nothing else happens. That is not the {t.color} {noun}.\n{self._describe()}"
        done = self.won or self.steps >= self.max_steps
        return obs, reward, done, self._info(valid)

    def close(self):
        pass


def make(split: str = "train", seed: int = 0, max_steps: int = 10, **kwargs) -> RoomsEnv:
    if kwargs:
        raise TypeError(f"rooms does not take {', '.join(kwargs)}")
    return RoomsEnv(max_steps=max_steps, seed=seed)


def demonstrator(obs: str, rng: random.Random) -> str:
    """The warm start's demonstrator: a random walker, one of the valid actions the observation lists,
    uniformly. It knows the action syntax and nothing of the task (succeeds in ~17 % of test tasks)."""
    return rng.choice(valid_actions_of(obs) or ["look around"])


def oracle_actions(task: RoomsTask) -> list[str]:
    """The shortest successful action sequence (for tests and notebooks)."""
    verb, noun, _ = KINDS[task.kind]
    return ["go to hallway", f"go to {task.target_room}", f"{verb} {task.color} {noun}"]
