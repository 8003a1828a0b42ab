"""scienceworld: the real ScienceWorld simulator (PyPI `scienceworld`, runs on Java) behind the envs protocol.

The paper's headline environment and its motivating failure ("turn on the red light bulb" is
the task power-component). Each env owns one simulator process (a JVM, started by make() and
reused across episodes; close() ends it), so a trainer can run G envs side by side.
`import envs` never imports `scienceworld` or starts Java; make() and tasks() do.

Reward: the change of the simulator's score, in units of 100 points (score 0 -> 25 gives
0.25), so the rewards of an episode sum to its final score / 100, at most 1. A step can be
negative where the simulator takes points back. Some tasks start part-done (score 20 at
reset); those points come with the first executed action. Invalid actions get 0.
Failure: a fatal mistake (e.g. focusing on the wrong object) makes the simulator's score
negative (-100) and ends the episode. We count it as score 0 (info["failed"] = True), the way
ScienceWorld results are usually reported, so that step's reward takes back the points
earned so far and the episode's return is 0.
info["score"]: the simulator's score clipped to 0-100; info["won"]: it reached 100.
Step limit: max_steps = 30 by default. The gold paths of the default tasks take 2-15 steps,
so 30 leaves room to explore, and a small LLM that reads the whole history each step (the
reference recipe caps prompts near 4,500 tokens) still fits. Invalid actions count.
The episode also ends when the simulator says it is over (task done or failed).

Tasks: any of the 30 ScienceWorld tasks by name (all_task_names(); task_id
"scienceworld/<task name>/v<variation>"); default task_names = DEFAULT_TASK_NAMES: the
red-light-bulb task, a find-and-carry task across rooms and a look-outside-and-reason task,
all solvable well inside the step limit.
Splits (the paper's protocol, plus "val"):
- "train": the first 5 of the simulator's training variations of each task in task_names;
- "val": 10 of its dev variations, spread evenly over the list (all of them where a task has
  fewer: power-component has 5), for choosing hyper-parameters so test stays for final tables;
- "test": 20 of its test variations (never trained on), spread evenly over the list (all of
  them where a task has fewer than 20);
- "ood": every task NOT in task_names, 5 test variations each, spread the same way. Some of
  these need far more steps than max_steps (the genetics tasks' gold paths run 140+).
The simulator's train, dev and test variations of a task are disjoint sets of numbers, so the
splits share no (task, variation). num_variations=k overrides the per-task count (train: the first k).
tasks() loads each variation once to read its goal text (a JVM start plus ~0.05 s per
variation) and caches the answers in memory and in CACHE_PATH (~/.cache/empo2/).

Actions: the policy writes free text. We use the first rule that applies:
1. exact match, after envs.normalize_action, with the simulator's valid-action list;
2. the same with articles (the, a, an) dropped ("go to the kitchen" -> "go to kitchen");
3. the closest valid action by rapidfuzz ratio >= fuzzy_threshold (85), among actions with
   the same number of words, where every word pairs with a word of ratio >= 75 and numbers
   match exactly; ties are refused. Typos get fixed ("open door to kitchn"), but an object
   is never swapped for another ("red" vs "blue", "substance b" vs "substance c",
   "terminal 1" vs "terminal 2" stay apart: such a swap can end the episode);
4. the simulator's own parser: its valid-action list names each object one way, but the
   simulator understands more phrasings (its gold paths use some that the list lacks). It
   rejects text it cannot parse without side effects (no move, no clock tick);
5. otherwise: invalid. The observation is envs.invalid_action_message with the first 30
   admissible actions, valid=False, reward 0; the world does not move, the step still counts.
info["executed_action"] is the text sent to the simulator (None if nothing was), and
info["corrected"] says whether rules 2-3 changed it. "reset task" is never executed.
If the simulator asks "Ambiguous request: ... enter the number", the admissible actions are
the numbers; any other action first cancels the question (the simulator counts the cancel as
a move, as it would for a human player).
Observations: reset() gives the goal text and the first "look around"; step() gives the
simulator's response to the action (or the invalid-action message).

info["admissible_actions"]: the simulator's valid actions (often 400-3,000, most of them
junk like "connect agent to air"), ordered by kind of action (look, doors and moving,
picking up, focusing, devices, ..., connecting, waiting), junk involving the agent or the
air last, capped at max_admissible (100; None keeps all) by taking actions from every kind
in turn, so no kind disappears. Every valid action is accepted, listed or not
(env.valid_actions holds the full list).

Cost, measured on this project's busy 2-core machine: JVM start (make) about 2 s (1.1 s
when idle), reset 0.2 s, a step 0.09 s (most of it the simulator computing its valid-action
list), an invalid step a few ms; each JVM holds about 200 MB.
"""
from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from envs import Task, invalid_action_message, normalize_action

DEFAULT_TASK_NAMES = ("power-component", "find-living-thing", "lifespan-longest-lived")
SPLIT_VARIATIONS = {"train": 5, "test": 20, "ood": 5, "val": 10}
MAX_STEPS = 30
JAVA_MISSING = "ScienceWorld needs a Java runtime: apt-get install default-jre-headless"

MAX_ACTION_CHARS = 300   # the longest valid actions are under 100 characters
WORD_THRESHOLD = 75      # rule 3's per-word similarity
INVALID_LIST = 30        # valid actions shown in an invalid-action observation
ARTICLES = {"the", "a", "an"}
PARSE_FAILURES = ("No known action matches that input.", "Unknown action.")
# kinds of action in the order admissible_actions lists them; the rest follow
VERB_ORDER = ("look around", "look at", "look in", "open", "close", "go", "pick up", "put down", "move",
              "focus on", "activate", "deactivate", "use", "read", "pour", "dunk", "mix", "eat", "flush",
              "connect", "disconnect", "inventory", "task", "wait", "wait1")
JUNK = re.compile(r"\b(agent|air)\b")
CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


@dataclass(frozen=True)
class ScienceWorldTask(Task):
    task_name: str = ""
    variation: int = 0


def all_task_names() -> tuple[str, ...]:
    """The 30 ScienceWorld task names, in the simulator's numbering (1-1 boil, ...). No JVM needed."""
    from scienceworld.constants import ID2TASK
    return tuple(ID2TASK.values())


def _check_names(names) -> tuple[str, ...]:
    names = (names,) if isinstance(names, str) else tuple(names)
    valid = all_task_names()
    unknown = [n for n in names if n not in valid]
    if unknown or not names:
        raise ValueError(f"unknown ScienceWorld task(s) {unknown or names!r}; valid names: {', '.join(valid)}")
    return names


def _start_simulator():
    if shutil.which("java") is None:
        raise RuntimeError(JAVA_MISSING)
    from scienceworld import ScienceWorldEnv as Simulator
    # the simulator's own step limit is off: our max_steps decides
    return Simulator("", envStepLimit=10 ** 9)


def _stop_simulator(sim) -> None:
    try:
        sim.close()
    except Exception:  # the JVM is already gone
        pass
    sim.close = lambda: None  # its __del__ closes again and would print a BrokenPipeError


# --- task lists ----------------------------------------------------------------------------
# Reading a variation's goal text means loading its world (0.03-0.1 s each; the ood split
# needs 135 of them). The answers never change for a simulator version, so they are cached
# in the process and in CACHE_PATH (None: no file), and a simulator starts only on a miss.
CACHE_PATH = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "empo2" / "scienceworld-tasks.json"
_cache: dict | None = None   # {"version", "variations": {name: [train, test, dev]}, "instructions": {"name/v": text}}


def _task_cache() -> dict:
    global _cache
    if _cache is None:
        from scienceworld import __version__
        _cache = {"version": __version__, "variations": {}, "instructions": {}}
        try:
            data = json.loads(Path(CACHE_PATH).read_text())
            if data.get("version") == __version__:
                _cache = data
        except (OSError, TypeError, ValueError):  # no file yet, no CACHE_PATH, or a broken file
            pass
    return _cache


def _save_task_cache():
    if CACHE_PATH is None:
        return
    try:
        path = Path(CACHE_PATH)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(_cache))
        os.replace(tmp, path)  # atomic: envs listing tasks at once never read half a file
    except OSError:
        pass  # a read-only home only costs speed


def _spread(items: list[int], k: int) -> list[int]:
    if len(items) <= k:
        return list(items)
    return [items[i * len(items) // k] for i in range(k)]


def tasks(split: str, task_names: list[str] | tuple[str, ...] | None = None,
          num_variations: int | None = None, **_) -> list[ScienceWorldTask]:
    if split not in SPLIT_VARIATIONS:
        raise ValueError(f"unknown split {split!r} for scienceworld; valid: {', '.join(SPLIT_VARIATIONS)}")
    chosen = _check_names(DEFAULT_TASK_NAMES if task_names is None else task_names)
    names = chosen if split != "ood" else tuple(n for n in all_task_names() if n not in chosen)
    k = SPLIT_VARIATIONS[split] if num_variations is None else num_variations
    cache, sim = _task_cache(), None
    try:
        out = []
        for name in names:
            if len(cache["variations"].get(name, ())) < 3:   # files from before val held [train, test]
                sim = sim or _start_simulator()
                sim.load(name, 0, "")
                cache["variations"][name] = [list(sim.get_variations_train()), list(sim.get_variations_test()),
                                             list(sim.get_variations_dev())]
            train, test, dev = cache["variations"][name]
            for v in (train[:k] if split == "train" else _spread(dev if split == "val" else test, k)):
                key = f"{name}/v{v}"
                if key not in cache["instructions"]:
                    sim = sim or _start_simulator()
                    sim.load(name, v, "")
                    cache["instructions"][key] = sim.get_task_description()
                out.append(ScienceWorldTask(task_id=f"scienceworld/{key}", instruction=cache["instructions"][key],
                                            task_name=name, variation=v))
        return out
    finally:
        if sim is not None:
            _stop_simulator(sim)
            _save_task_cache()


# --- actions -------------------------------------------------------------------------------
def _verb_rank(action: str) -> int:
    if action.isdigit():  # the answer to an "Ambiguous request"
        return -1
    for i, verb in enumerate(VERB_ORDER):
        if action == verb or action.startswith(verb + " "):
            return i
    return len(VERB_ORDER)


def order_actions(actions: list[str], cap: int | None) -> list[str]:
    """Group by kind of action (VERB_ORDER), junk last in each group; over the cap, take from
    every group in turn so that each kind stays represented."""
    groups: dict[int, list[str]] = {}
    for a in actions:
        groups.setdefault(_verb_rank(a), []).append(a)
    ranks = sorted(groups)
    for r in ranks:
        groups[r].sort(key=lambda a: bool(JUNK.search(a)))  # stable: simulator order otherwise
    if cap is None or len(actions) <= cap:
        return [a for r in ranks for a in groups[r]]
    take, n = dict.fromkeys(ranks, 0), 0
    while n < cap:
        for r in ranks:
            if take[r] < len(groups[r]) and n < cap:
                take[r], n = take[r] + 1, n + 1
    return [a for r in ranks for a in groups[r][:take[r]]]


def _drop_articles(text: str) -> str:
    return " ".join(w for w in text.split() if w not in ARTICLES)


def _words_agree(said: list[str], valid: list[str]) -> bool:
    from rapidfuzz import fuzz
    for a, b in zip(said, valid):
        if a == b:
            continue
        if any(c.isdigit() for c in a + b) or fuzz.ratio(a, b) < WORD_THRESHOLD:
            return False
    return len(said) == len(valid)


# --- the environment -----------------------------------------------------------------------
class ScienceWorldEnv:
    # one example exchange shown before every episode (small models need it to answer with an action)
    demo = [("This room is called the porch. In it, you see: a chair. You also see: A door to the "
             "garage (that is closed)\nValid actions: look around, open door to garage, look at chair",
             "open door to garage")]
    name = "scienceworld"

    def __init__(self, max_steps: int = MAX_STEPS, seed: int = 0, simplifications: str = "",
                 fuzzy_threshold: float = 85.0, max_admissible: int | None = 100):
        self.max_steps = max_steps
        self.seed = seed  # the simulator is deterministic per variation; kept for the protocol
        self.simplifications = simplifications  # e.g. "easy"; see ScienceWorld's README
        self.fuzzy_threshold = fuzzy_threshold
        self.max_admissible = max_admissible
        self.sim = _start_simulator()
        self._join = self.sim._gateway.jvm.java.lang.String.join
        self.task: ScienceWorldTask | None = None
        self.valid_actions: list[str] = []   # everything the simulator lists now
        self.admissible: list[str] = []      # the ordered, capped view of it

    # --- simulator -------------------------------------------------------------------------
    def _refresh_actions(self):
        # one joined string instead of a py4j list: one round trip instead of thousands (3x faster)
        joined = self._join("\n", self.sim.server.getValidActionObjectCombinations())
        acts = [a for a in dict.fromkeys(joined.split("\n")) if a and a != "reset task"]
        self.valid_actions = acts
        self.admissible = order_actions(acts, self.max_admissible)
        self._exact = {normalize_action(a): a for a in acts}
        self._bare = {}
        for a in acts:
            self._bare.setdefault(_drop_articles(normalize_action(a)), a)
        self._choosing = bool(acts) and all(a.isdigit() for a in acts)

    def _sim_step(self, text: str) -> str:
        # the wrapper's step() also fetches look/inventory/valid lists we do not need (8x slower)
        obs = self.sim.server.step(text)
        self._read_score()
        return obs

    def _read_score(self):
        raw = int(round(100 * self.sim.server.getScore()))
        self.failed, self.won = raw < 0, raw >= 100
        self.sim_done = bool(self.sim.server.getCompleted()) or self.failed
        self.score = float(min(max(raw, 0), 100))

    # --- action mapping --------------------------------------------------------------------
    def _closest(self, act: str) -> str | None:
        """Rule 3: a typo-level correction, or None."""
        from rapidfuzz import fuzz, process
        said = _drop_articles(act)
        keys = list(self._bare)
        hits = process.extract(said, keys, scorer=fuzz.ratio, score_cutoff=self.fuzzy_threshold, limit=10)
        ok = [(score, keys[i]) for _, score, i in hits if _words_agree(said.split(), keys[i].split())]
        if not ok or (len(ok) > 1 and ok[1][0] == ok[0][0]):
            return None
        return self._bare[ok[0][1]]

    def _execute(self, action: str) -> tuple[str | None, str, bool]:
        """Map free text to a simulator command and run it: (executed text or None, observation, corrected)."""
        act = normalize_action(CONTROL.sub(" ", action))  # NULs and such never reach the JVM
        if not act or len(act) > MAX_ACTION_CHARS or act.split()[0] == "reset":
            return None, "", False
        if self._choosing and act not in self._exact:
            self.sim.server.step("")  # cancel the pending "Ambiguous request" so the action is not swallowed
            self._refresh_actions()
        if act in self._exact:
            return self._exact[act], self._sim_step(self._exact[act]), False
        fixed = self._bare.get(_drop_articles(act)) or self._closest(act)
        if fixed is not None:
            return fixed, self._sim_step(fixed), True
        obs = self.sim.server.step(act)  # rule 4; a parse failure changes nothing in the world
        if obs.startswith(PARSE_FAILURES):
            return None, "", False
        self._read_score()
        return act, obs, False

    # --- protocol --------------------------------------------------------------------------
    def reset(self, task: ScienceWorldTask):
        if not isinstance(task, ScienceWorldTask):
            raise TypeError("scienceworld needs a task from envs.tasks('scienceworld', split), "
                            f"got {type(task).__name__}")
        if self.sim is None:
            raise RuntimeError("this environment is closed")
        self.sim.load(task.task_name, task.variation, self.simplifications)
        self.task, self.steps, self.done = task, 0, False
        look = self._sim_step("look around")
        self._paid = 0.0  # points some tasks give at the start are paid with the first executed action
        self._refresh_actions()
        return f"{task.instruction}\n\n{look}", self._info(valid=True, executed=None, corrected=False)

    def _info(self, valid: bool, executed: str | None, corrected: bool) -> dict:
        t = self.task
        return {"task_id": t.task_id, "instruction": t.instruction, "admissible_actions": list(self.admissible),
                "score": self.score, "won": self.won, "failed": self.failed, "valid": valid,
                "executed_action": executed, "corrected": corrected, "steps": self.steps}

    def step(self, action: str):
        if self.task is None or self.sim is None:
            raise RuntimeError("call reset(task) before step()")
        if self.done:
            return "The episode is over; call reset(task).", 0.0, True, self._info(False, None, False)
        self.steps += 1
        text = action if isinstance(action, str) else str(action)
        executed, obs, corrected = self._execute(text)
        reward = 0.0
        if executed is None:
            shown = self.admissible[:INVALID_LIST]
            obs = invalid_action_message(shown)
            if len(self.valid_actions) > len(shown):
                obs += f", ... ({len(self.valid_actions) - len(shown)} more)"
        else:
            self._refresh_actions()
            reward, self._paid = (self.score - self._paid) / 100.0, self.score
        self.done = self.sim_done or self.steps >= self.max_steps
        return obs, reward, self.done, self._info(executed is not None, executed, corrected)

    def gold_actions(self, task: ScienceWorldTask) -> list[str]:
        """The simulator's gold action sequence for a task (tests, notebooks). Call reset(task) after."""
        self.sim.load(task.task_name, task.variation, self.simplifications, generateGoldPath=True)
        self.task = None  # the simulator no longer holds an episode of ours
        return list(self.sim.get_gold_action_sequence())

    def close(self):
        if self.sim is not None:
            sim, self.sim = self.sim, None
            _stop_simulator(sim)


def make(split: str = "train", seed: int = 0, max_steps: int = MAX_STEPS, simplifications: str = "",
         fuzzy_threshold: float = 85.0, max_admissible: int | None = 100, **kwargs) -> ScienceWorldEnv:
    """One env with its own simulator process. split is not used: tasks come from tasks(split)."""
    if kwargs:
        raise TypeError(f"scienceworld does not take {', '.join(kwargs)}")
    return ScienceWorldEnv(max_steps=max_steps, seed=seed, simplifications=simplifications,
                           fuzzy_threshold=fuzzy_threshold, max_admissible=max_admissible)
