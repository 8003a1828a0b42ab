"""A second held-out verb for the rooms adaptation test: the recipe chosen on the "water ... plant" ood split
(eight training kinds, facts-only tips) checked on a verb it was not chosen on. Training gets seven kinds
(envs.rooms.TRAIN_KINDS without "cat", through --task-names), and the ood split, patched in this process,
becomes "feed the ... cat" on the same 30 layouts (the split's seed draws the same rooms and colours
whatever the kind). Then the same test: 3 trials, memory on / off / shuffled, T = 0.4, seed 0.

    python results/rooms-ood-adaptation/held_out_verb.py SEED runs/ood-cat

One warm start per SEED (--warm-start-seed: which demonstrations are cloned). The warm start is cached
under its own key (the kinds are in it), so runs of other settings never share it.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import envs.rooms as rooms  # noqa: E402

HELD_OUT = "cat"
seed, out = sys.argv[1], sys.argv[2]
rooms.SPLIT_KINDS["ood"] = (HELD_OUT,)
kinds = ",".join(k for k in rooms.TRAIN_KINDS if k != HELD_OUT)

import evaluate  # noqa: E402
import train  # noqa: E402

train.main(["--env", "rooms", "--iterations", "0", "--warm-start-tips", "--task-names", kinds, "--warm-start-seed", seed,
            "--eval-episodes", "10", "--out", out, "--name", f"ws{seed}"])
evaluate.main(["--run", f"{out}/ws{seed}", "--split", "ood", "--episodes", "30", "--memory", "all", "--trials", "3"])
