"""The experiment behind four-kinds/ and eight-kinds/: rooms whose TRAINING split has more kinds of task
than "turn on ... light bulb" and "open ... box", to see whether a warm start that has seen more verbs acts
on the ood split's unseen one ("water ... plant"). Validation, test and ood are unchanged. Written before rooms
had them: it patches envs.rooms in this process only (`train.py --task-names` now gives train, val and
test the kinds; the default stays two). The warm start must be cached in its own folder: the cache key hashes envs/rooms.py's source, which the
patch does not change, and a shared cache would hand back the two-kind adapter.

    EMPO2_CACHE=/tmp/cache-4 python results/rooms-ood-adaptation/more_kinds.py 4 runs/ood-kinds
    EMPO2_CACHE=/tmp/cache-8 python results/rooms-ood-adaptation/more_kinds.py 8 runs/ood-kinds8

(EMPO2_CACHE also needs the model: link ~/.cache/empo2/SmolLM2-135M-Instruct into it.) Then
python results/rooms-ood-adaptation/reached_target.py runs/ood-kinds/ws reads the episodes.
"""
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import envs.rooms as rooms  # noqa: E402
import envs.tips as tips  # noqa: E402

EXTRA = {"bell": ("ring", "bell", "The {obj} rings. Task complete!"),
         "book": ("read", "book", "You read the {obj}. Task complete!"),
         "candle": ("light", "candle", "The {obj} is now lit. Task complete!"),
         "clock": ("wind", "clock", "The {obj} is now wound. Task complete!"),
         "towel": ("fold", "towel", "The {obj} is now folded. Task complete!"),
         "cat": ("feed", "cat", "The {obj} is now fed. Task complete!")}
n_kinds, out = int(sys.argv[1]), sys.argv[2]
rooms.KINDS.update(EXTRA)
rooms.SPLIT_KINDS["train"] = ("bulb", "box", *list(EXTRA)[:n_kinds - 2])
tips.GOAL_RE = re.compile(r"Your task is to (" + "|".join(v for v, _, _ in rooms.KINDS.values()) + r") the (.+?)\.")

import evaluate  # noqa: E402
import train  # noqa: E402

train.main(["--env", "rooms", "--iterations", "0", "--warm-start-tips", "--eval-episodes", "10", "--out", out, "--name", "ws"])
evaluate.main(["--run", f"{out}/ws", "--split", "ood", "--episodes", "30", "--memory", "all", "--trials", "3"])
