"""The Decoder's products through oneDNN's prepacked weights (default) vs plain F.linear, in float32
on a CPU without native bf16, and whether the two draw the same tokens; printed as one JSON object
(onednn-fp32-2026-12-07.json). Run from the repository root: python results/bench/onednn_fp32.py
That JSON was printed by this script's first version, which wrote the CPU as a hand-typed "cpu" string
where this one reads the avx512_bf16 flag; the measurements are the same code."""
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import bench
from policy import load_policy
from sampler import keep_freed_memory, CachedSampler, Decoder
keep_freed_memory(True)
p = load_policy("default", "auto", "auto")
r = {"dtype": str(next(p.model.parameters()).dtype), "threads": torch.get_num_threads(), "cpu_flags_avx512_bf16": "avx512_bf16" in Path("/proc/cpuinfo").read_text()}
r.update(bench.bench_onednn(p))
r.update(bench.bench_matmul_cap(p))
r.update(bench.bench_decode_share(p, rounds=4))
r.update(bench.bench_decode_parts(p))
# do the two product paths sample the same tokens? 32 rows, 32 tokens, same draws
prompt = bench.decode_prompt(p)
toks = {}
with bench.decoding_without_stops(p):
    for onednn in (True, False):
        s = CachedSampler(p, decoder=Decoder(p.model, onednn=onednn))
        torch.manual_seed(0)
        toks[onednn] = s.generate([prompt] * 32, list(range(32)), 32, temperature=1.0)
same = sum(a == b for ra, rb in zip(toks[True], toks[False]) for a, b in zip(ra, rb))
first_diff = [next((i for i, (a, b) in enumerate(zip(ra, rb)) if a != b), None) for ra, rb in zip(toks[True], toks[False])]
r["tokens_same"] = same; r["tokens_total"] = sum(len(x) for x in toks[True])
r["rows_identical"] = sum(d is None for d in first_diff)
print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()}, indent=1))
