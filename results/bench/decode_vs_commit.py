"""The 32-row decode of bench.py (~300-token prompt held once, 16 steps, no stop token) for sampler.py as it
was at COMMIT (read with git show) and as it is now, alternated with the matrix-product cap in one process,
best of ROUNDS rounds each (the first round warms up), freed memory kept as train.py keeps it. Also checks
that both draw the same tokens. Prints one JSON object.

    python results/bench/decode_vs_commit.py cbd87cf > results/bench/decode-vs-cbd87cf.json
"""
import importlib.util
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
import bench  # noqa: E402
import sampler  # noqa: E402
from policy import load_policy  # noqa: E402

commit, rounds = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 7
old_source = subprocess.run(["git", "show", f"{commit}:sampler.py"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
path = Path(tempfile.mkdtemp()) / "sampler_before.py"
path.write_text(old_source)
spec = importlib.util.spec_from_file_location("sampler_before", path)
before = importlib.util.module_from_spec(spec)
spec.loader.exec_module(before)

sampler.keep_freed_memory(True)
torch.manual_seed(0)
policy = load_policy()
rows, steps = 32, 16
prompts = [bench.decode_prompt(policy, 300)] * rows
cap_step = bench.matmul_cap_step(policy, rows)
modules = {"before": before, "after": sampler}
best, tokens = {}, {}
with bench.decoding_without_stops(policy):
    decoders = {name: m.Decoder(policy.model) for name, m in modules.items()}

    def decode(name):
        s = modules[name].CachedSampler(policy, decoders[name])
        torch.manual_seed(0)
        first = s.generate(prompts, list(range(rows)), 1, temperature=1.0)
        torch.manual_seed(1)
        t = time.perf_counter()
        out = s.generate([p + f for p, f in zip(prompts, first)], list(range(rows)), steps, temperature=1.0)
        return (time.perf_counter() - t) / steps, out
    for round_ in range(rounds):
        for name in modules:
            seconds, tokens[name] = decode(name)
            if round_:
                best[name] = min(best.get(name, float("inf")), seconds)
        cap = bench.best_time(cap_step, 2)
        if round_:
            best["cap"] = min(best.get("cap", float("inf")), cap)
result = {"commit_before": commit, "rows": rows, "rounds": rounds - 1, "tokens_equal": tokens["before"] == tokens["after"]}
result.update({f"decode_ms_{k}": round(1000 * v, 2) for k, v in best.items()})
result.update({f"tok_s_{k}": round(rows / v, 1) for k, v in best.items()})
result.update({f"share_of_cap_{k}": round(best["cap"] / v, 3) for k, v in best.items() if k != "cap"})
print(json.dumps(result, indent=1))
