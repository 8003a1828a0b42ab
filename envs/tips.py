"""Scripted reflection: a factual tip written from what the agent saw, for a small model to learn from.

The paper's 7B policy can already reflect; a 135M model writes noise (README, "Limitations"). These
writers show it what a useful tip looks like: what the episode tried, what it found where, what it left
unexplored, and the score it reached. They read only the episode's transcript (observations, actions)
and its final observation and score, exactly what the agent saw; never the task object, so a hidden
goal (which room holds the target, which product is right) cannot leak into a tip.

    scripted_tip("rooms", transcript, final_obs, score)
"""
from __future__ import annotations

import re

ROOM_RE = re.compile(r"You are in the (\w+)\. You see: (.*?)\. Doors lead to: (.*?)\.")


def rooms_tip(transcript: list[dict], final_obs: str, score: float) -> str:
    """Rooms visited in order, the coloured objects seen in each, the rooms never entered, what was
    tried on which object, and the score."""
    visited, found, doors, tried, room = [], {}, [], [], None
    for step, obs in zip([*transcript, {}], [s["observation"] for s in transcript] + [final_obs]):
        for room, objects, exits in ROOM_RE.findall(obs):   # room: where the next action is taken
            if room not in visited:
                visited.append(room)
            coloured = [o.removeprefix("a ").removeprefix("an ") for o in objects.split(", ")
                        if len(o.split()) >= 3]   # "a blue light bulb", not furniture ("a table")
            found.setdefault(room, [])
            found[room] += [o for o in coloured if o not in found[room]]
            doors += [d for d in exits.split(", ") if d not in doors]
        action = step.get("action", "")
        if step.get("valid") and action and not action.startswith(("go to", "look around")):
            tried.append(f"{action} in the {room}" if room else action)
    parts = [f"Score {score:.2f}."]
    if visited:
        parts.append("Went to " + ", ".join(visited) + ".")
    seen = [f"{o} in the {room}" for room, objs in found.items() for o in objs]
    if seen:
        parts.append("Saw " + "; ".join(seen) + ".")
    if tried:
        parts.append("Tried " + "; ".join(dict.fromkeys(tried)) + ".")
    unexplored = [d for d in doors if d not in visited]
    if score >= 1.0:
        parts.append(f"Done in the {visited[-1]}: go there directly." if visited else "Done.")
    elif unexplored:
        parts.append("Never entered " + ", ".join(unexplored) + ": look there next.")
    return " ".join(parts)


def webshop_tip(transcript: list[dict], final_obs: str, score: float) -> str:
    """The queries searched, the products opened, the options clicked, what was bought and the score."""
    queries, opened, options = [], [], []
    for step in transcript:
        action = step.get("action", "")
        if not step.get("valid"):
            continue
        if action.startswith("search[") and action.endswith("]"):
            queries.append(action[7:-1])
        elif action.startswith("click[") and action.endswith("]"):
            target = action[6:-1]
            titles = re.findall(r"\[" + re.escape(target) + r"\] (.*?) \| \$", step["observation"], re.I)
            if titles:
                opened.append(f"{target.upper()} ({titles[0]})")
            elif target not in ("back to search", "next >", "< prev", "description", "features", "reviews",
                                "buy now", "search"):
                options.append(target)
    parts = [f"Score {score:.2f}."]
    if queries:
        parts.append("Searched " + "; ".join(f"'{q}'" for q in dict.fromkeys(queries)) + ".")
    if opened:
        parts.append("Opened " + "; ".join(dict.fromkeys(opened)) + ".")
    if options:
        parts.append("Chose " + ", ".join(dict.fromkeys(options)) + ".")
    bought = re.search(r"You bought (\S+)", final_obs)
    if bought:
        parts.append(f"Bought {bought.group(1).rstrip('.')}" + (": a full match." if score >= 1.0 else
                     ": not a full match, so try another product or other options."))
    else:
        parts.append("Bought nothing: finish with click[buy now] on a matching product.")
    return " ".join(parts)


WRITERS = {"rooms": rooms_tip, "webshop-mini": webshop_tip}


def scripted_tip(env: str, transcript: list[dict], final_obs: str, score: float) -> str:
    """The tip the scripted reflector writes for an episode of environment ENV."""
    if env not in WRITERS:
        raise ValueError(f"no scripted reflector for {env}; there is one for {', '.join(WRITERS)}")
    return WRITERS[env](transcript, final_obs, score)
