"""Where one Policy.score forward + backward goes (1,100 tokens, five 12-token actions: bench.py's
bench_score trajectory), and whether another attention path is faster. Run from the repository root:

    python results/bench/scoring_fp32.py profile     # -> scoring-profile-fp32-2026-12-07.txt
    python results/bench/scoring_fp32.py attention   # -> scoring-attention-fp32-2026-12-07.txt

(The two outputs were written by these two parts when they were still two scripts; the code is the same.)
"""
import contextlib
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from policy import load_policy  # noqa: E402

policy = load_policy("default", "auto", "cpu")
length, actions = 1100, 5
rng = np.random.default_rng(2)
ids = rng.integers(100, len(policy.tokenizer), length).tolist()
mask = [False] * length
for k in range(actions):
    s = (k + 1) * length // (actions + 1)
    mask[s:s + 12] = [True] * 12


def profile_part():
    def once():
        t = time.perf_counter()
        logp, _ = policy.score(ids, mask)
        t1 = time.perf_counter()
        logp.sum().backward()
        t2 = time.perf_counter()
        policy.model.zero_grad(set_to_none=True)
        return t1 - t, t2 - t1
    print(next(policy.model.parameters()).dtype, torch.get_num_threads())
    for _ in range(3):
        print("fwd %.2f bwd %.2f" % once())
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        once()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))


def attention_part():
    """SDPA (the CPU flash kernel) vs SDPA's math backend vs Hugging Face's eager attention, alternated."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def once(mode):
        impl = policy.model.config._attn_implementation
        if mode == "eager":
            policy.model.set_attn_implementation("eager")
        with sdpa_kernel(SDPBackend.MATH) if mode == "math" else contextlib.nullcontext():
            t = time.perf_counter()
            logp, _ = policy.score(ids, mask)
            logp.sum().backward()
            dt = time.perf_counter() - t
        grads = [p.grad.clone() for p in policy.lora_parameters()]
        policy.model.zero_grad(set_to_none=True)
        if mode == "eager":
            policy.model.set_attn_implementation(impl)
        return dt, logp.detach(), grads
    best, ref = {}, None
    for rep in range(3):
        for mode in ("flash", "math", "eager"):
            dt, lp, g = once(mode)
            best[mode] = min(best.get(mode, 1e9), dt)
            if ref is None:
                ref = (lp, g)
            if rep == 0:
                err = (lp - ref[0]).abs().max().item()
                gerr = max(((a - b).norm() / b.norm().clamp(min=1e-30)).item() for a, b in zip(g, ref[1]))
                print(mode, "logp max diff vs flash %.2e, worst relative grad diff %.2e" % (err, gerr))
    for m, v in best.items():
        print(m, "%.2f s  %.1f tok/s" % (v, length / v))


{"profile": profile_part, "attention": attention_part}[sys.argv[1]]()
