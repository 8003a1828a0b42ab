"""The 32-row decode of bench.py (~300-token prompt held once, 16 steps, no stop token) for the sampler
before this change (sampler.py of commit 9e4a4a2, read with git show) and after it, with glibc's default
memory thresholds and with freed memory kept (sampler.keep_freed_memory), and the matrix-product cap,
all timed alternately in one process, best of 6 rounds each. Prints one JSON object.

    python results/bench/decode_before_after.py > results/bench/decode-before-after-2026-12-07.json
"""
import importlib.util
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
import bench  # noqa: E402
import sampler  # noqa: E402
from policy import load_policy  # noqa: E402

old_source = subprocess.run(["git", "show", "9e4a4a2:sampler.py"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
path = Path(tempfile.mkdtemp()) / "sampler_before.py"
path.write_text(old_source)
spec = importlib.util.spec_from_file_location("sampler_before", path)
before = importlib.util.module_from_spec(spec)
spec.loader.exec_module(before)

torch.manual_seed(0)
policy = load_policy()
rows, steps = 32, 16
prompt = np.random.default_rng(0).integers(100, len(policy.tokenizer), 300).tolist()
prompts = [prompt] * rows
cap_step = bench.matmul_cap_step(policy, rows)
best, tokens = {}, {}
with bench.decoding_without_stops(policy):
    decoders = {"before": before.Decoder(policy.model), "after": sampler.Decoder(policy.model)}
    modules = {"before": before, "after": sampler}

    def decode(name):
        s = modules[name].CachedSampler(policy, decoders[name])
        torch.manual_seed(0)
        first = s.generate(prompts, list(range(rows)), 1, temperature=1.0)
        torch.manual_seed(1)
        t = bench.time.perf_counter()
        out = s.generate([p + f for p, f in zip(prompts, first)], list(range(rows)), steps, temperature=1.0)
        return (bench.time.perf_counter() - t) / steps, out
    for round_ in range(7):
        for keep in (False, True):
            sampler.keep_freed_memory(keep)
            for name in modules:
                seconds, out = decode(name)
                tokens[name, keep] = out
                if round_:   # the first round warms up
                    key = f"{name}_{'kept' if keep else 'glibc_default'}"
                    best[key] = min(best.get(key, float("inf")), seconds)
            cap = bench.best_time(cap_step, 2)
            if round_:
                best["cap"] = min(best.get("cap", float("inf")), cap)
result = {"rows": rows, "tokens_equal": len({json.dumps(t) for t in tokens.values()}) == 1}
result.update({f"decode_ms_{k}": round(1000 * v, 2) for k, v in best.items()})
result.update({f"tok_s_{k}": round(rows / v, 1) for k, v in best.items()})
result.update({f"share_of_cap_{k}": round(best["cap"] / v, 3) for k, v in best.items() if k != "cap"})
print(json.dumps(result, indent=1))
