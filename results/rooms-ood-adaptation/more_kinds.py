"""The experiment behind four-kinds/ and eight-kinds/: rooms whose TRAINING split has more kinds of task
than "turn on ... light bulb" and "open ... box", to see whether a warm start that has seen more verbs acts
on the ood split's unseen one ("water ... plant"). Validation, test and ood are unchanged. It patches only
rooms' train split, in this process (`train.py --task-names` gives train, val and test the kinds; the
default stays two). The warm start must be cached in its own folder: the cache key hashes envs/rooms.py's source, which the
patch does not change, and a shared cache would hand back the two-kind adapter.

    EMPO2_CACHE=/tmp/cache-4 python results/rooms-ood-adaptation/more_kinds.py 4 runs/ood-kinds
    EMPO2_CACHE=/tmp/cache-8 python results/rooms-ood-adaptation/more_kinds.py 8 runs/ood-kinds8

(EMPO2_CACHE also needs the model: link ~/.cache/empo2/SmolLM2-135M-Instruct into it.) Then
python results/rooms-ood-adaptation/reached_target.py runs/ood-kinds/ws reads the episodes.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import envs.rooms as rooms  # noqa: E402

# the kinds themselves now live in envs/rooms.py (KINDS, TRAIN_KINDS: bulb, box, bell, book, candle, clock,
# towel, cat), and envs/tips.py's GOAL_RE reads every one; this patch gives them to train only
n_kinds, out = int(sys.argv[1]), sys.argv[2]
rooms.SPLIT_KINDS["train"] = rooms.TRAIN_KINDS[:n_kinds]

import evaluate  # noqa: E402
import train  # noqa: E402

train.main(["--env", "rooms", "--iterations", "0", "--warm-start-tips", "--eval-episodes", "10", "--out", out, "--name", "ws"])
evaluate.main(["--run", f"{out}/ws", "--split", "ood", "--episodes", "30", "--memory", "all", "--trials", "3"])
