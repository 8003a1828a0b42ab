"""rooms-far: rooms with a second ring of rooms, where the goal is three doors away and rarely found
by chance. Built for the question EMPO² asks (docs/algorithm.md, "The problem"): does exploring,
remembered across attempts, pay where the policy's first guesses almost never succeed?

The house: a hallway with five side rooms (the start among them); behind each side room but the
start lies one more room, reached only through it. The goal's object sits in one of those back
rooms; the start room holds a look-alike of another colour, and a second look-alike (a third colour)
sits in another back room. Observations, actions and rewards are those of rooms (envs/rooms.py): the
goal's own action is offered everywhere and fails where its object is not. The shortest solution is
four actions (hallway, side room, back room, the goal's action); a uniform random walk over the valid
actions, the warm start's demonstrator, succeeds on about 5 % of validation layouts within the
10-step limit (tests/test_rooms_far.py measures it), against about 17 % in rooms.

Reward: 1.0 when the goal action is done on the target (the episode ends); 0 otherwise.
Step limit: 10 (max_steps). Splits: "train" (60 layouts), "val" (40, in neither train nor test),
"test" (100, not in train), "ood" (30, the unseen kind "water ... plant"); each has its own seed.
A per-task memory is read only if tasks recur: train with few training layouts
(train.py --train-tasks) so that a task comes back while its tips are in memory.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

from envs import Task
from envs.rooms import COLORS, FURNITURE, KINDS, ROOMS, SPLIT_KINDS, SPLIT_SIZES, RoomsEnv, RoomsTask
from envs.rooms import demonstrator as demonstrator  # the same random walker as rooms

NAMES = ROOMS + ("library", "pantry", "garage", "studio")   # 5 side rooms + 4 back rooms: 9 names
SIDE_ROOMS = 5
SPLIT_SEEDS = {"train": 10, "test": 11, "ood": 12, "val": 13}
SPLIT_AVOIDS = {"test": ("train",), "val": ("train", "test")}


@dataclass(frozen=True)
class RoomsFarTask(RoomsTask):
    behind: tuple = ()           # (side room, the room behind it) for every side room but the start
    far_decoy_color: str = ""    # colour of the second look-alike
    far_decoy_room: str = ""     # the back room that holds it (never the target's)


def _layout(rng: random.Random, kind: str, index: int, split: str) -> RoomsFarTask:
    names = rng.sample(NAMES, 2 * SIDE_ROOMS - 1)
    side_rooms, back_rooms = tuple(names[:SIDE_ROOMS]), names[SIDE_ROOMS:]
    behind = tuple(zip(side_rooms[1:], back_rooms))
    target_room, far_decoy_room = rng.sample(back_rooms, 2)
    color, decoy, far_decoy = rng.sample(COLORS, 3)
    verb, noun, _ = KINDS[kind]
    return RoomsFarTask(task_id=f"rooms-far/{split}/{kind}-{index}", instruction=f"Your task is to {verb} the {color} {noun}.",
                        kind=kind, color=color, decoy_color=decoy, start=side_rooms[0], target_room=target_room,
                        side_rooms=side_rooms, behind=behind, far_decoy_color=far_decoy, far_decoy_room=far_decoy_room)


def _signature(t: RoomsFarTask) -> tuple:
    return (t.kind, t.color, t.decoy_color, t.start, t.target_room, t.side_rooms, t.behind, t.far_decoy_color,
            t.far_decoy_room)


def tasks(split: str, **_) -> list[RoomsFarTask]:
    # rooms.tasks' loop with this module's layouts; not shared through rooms.py, whose source is part
    # of the cached rooms warm start's key (warm_start.cache_key): editing it would void that adapter
    if split not in SPLIT_KINDS:
        raise ValueError(f"unknown split {split!r} for rooms-far; valid: {', '.join(SPLIT_KINDS)}")
    rng = random.Random(SPLIT_SEEDS[split])
    seen = {_signature(t) for other in SPLIT_AVOIDS.get(split, ()) for t in tasks(other)}
    out = []
    while len(out) < SPLIT_SIZES[split]:
        kind = SPLIT_KINDS[split][len(out) % len(SPLIT_KINDS[split])]
        task = _layout(rng, kind, len(out), split)
        if _signature(task) not in seen:
            seen.add(_signature(task))
            out.append(task)
    return out


class RoomsFarEnv(RoomsEnv):
    name = "rooms-far"

    def reset(self, task: Task):
        if not isinstance(task, RoomsFarTask):
            raise TypeError(f"rooms-far needs a task from envs.tasks('rooms-far', split), got {type(task).__name__}")
        obs, info = super().reset(task)
        layout_rng = random.Random(task.task_id + "/behind")   # furniture of the back rooms, fixed per task
        self._furniture.update({back: layout_rng.sample(FURNITURE, 2) for _, back in task.behind})
        return obs, info

    def _objects(self, room: str) -> list[str]:
        objs = super()._objects(room)
        if room == self.task.far_decoy_room:
            objs.append(f"a {self.task.far_decoy_color} {KINDS[self.task.kind][1]}")
        return objs

    def _exits(self, room: str) -> list[str]:
        behind = dict(self.task.behind)
        in_front = {back: side for side, back in self.task.behind}
        if room == "hallway":
            return list(self.task.side_rooms)
        if room in in_front:
            return [in_front[room]]
        return ["hallway"] + ([behind[room]] if room in behind else [])


def make(split: str = "train", seed: int = 0, max_steps: int = 10, **kwargs) -> RoomsFarEnv:
    if kwargs:
        raise TypeError(f"rooms-far does not take {', '.join(kwargs)}")
    return RoomsFarEnv(max_steps=max_steps, seed=seed)


def oracle_actions(task: RoomsFarTask) -> list[str]:
    """The shortest successful action sequence (for tests and notebooks)."""
    verb, noun, _ = KINDS[task.kind]
    front = {back: side for side, back in task.behind}[task.target_room]
    return ["go to hallway", f"go to {front}", f"go to {task.target_room}", f"{verb} {task.color} {noun}"]
