"""Speed where it counts, measured side by side in one run; prints one JSON object.

    python bench.py                     # the default model on CPU: ~7 minutes on 2 cores, plus a GRPO iteration
    python bench.py --no-iteration      # without the training iteration, ~4 minutes

decode_vs_plain_32_rows            decode tokens/s of the project's sampler (sampler.CachedSampler) vs a plain Hugging
                                   Face forward with a DynamicCache, 32 rows continuing one ~300-token
                                   prompt, as a GRPO group's rows do (target >= 5); decode tokens/s of both
                                   at 1, 8, 32 and 64 rows are printed as decode_tok_s_{sampler,plain}_{rows}
decode_vs_plain_32_rows_distinct   the same with 32 different prompts, nothing shared (the sampler then
                                   cannot hold the prompt once for all rows)
sampling_blocked_vs_running_sum    ms of sample_tokens_reference over sample_tokens, 32 rows x 49,152 logits
decode_matmul_cap_tok_s_{rows}     one decode step's matrix products alone (F.linear), as tokens/s: about the
                                   ceiling of any decoder on this machine in this dtype; and
                                   decode_share_of_cap_32, the sampler's 32-row decode over it, the two
                                   timed alternately (best of 4 each); ..._prepacked_...: the same with
                                   the sampler's prepacked products (oneDNN), the tighter cap where they
                                   are faster
onednn_vs_linear_decode_{rows}     decode tokens/s of the sampler with oneDNN's prepacked weights (default)
                                   over the same with plain F.linear, alternated; decoder_setup_ms_*: the
                                   cost of preparing the weights once per sampling context
decode_step_*_ms_32                where a 32-row decode step goes (torch profiler): products, attention,
                                   the rest; decode_parts_bound_tok_s_32, the speed if the rest were free,
                                   and decode_parts_bound_share_of_cap_32, that speed over the cap
keep_freed_memory_decode_32        32-row decode tokens/s with freed memory kept in the process
                                   (sampler.keep_freed_memory, what train.py does) over glibc's default;
                                   everything after it runs with freed memory kept
prefill_vs_plain                   tokens/s of the sampler's prefill (8 distinct 300-token prompts) vs a
                                   plain forward over the same batch
scoring_tok_s                      trained tokens/s of Policy.score, forward + backward, one ~1,100-token
                                   trajectory (the update's unit of work)
lora_in_base_dtype_vs_peft         the same with LoRA multiplied in the base dtype (default) over peft's
                                   float32 LoRA (scoring_tok_s_peft_float32_lora); 1.0 on a float32 model
scoring_matmul_cap_tok_s           the same forward + backward's matrix products alone, as tokens/s; and
                                   scoring_share_of_cap, scoring_tok_s over it
iteration_*                        one default training iteration (python train.py --env webshop-mini,
                                   warm start when cached) in seconds: rollout, reflection, update; and
                                   iteration_empo2_over_grpo, its time over the same seed's GRPO iteration
rollout_batched_vs_sequential      tokens/s of 8 rooms episodes in lockstep (one generate call per
                                   step) vs the same 8 episodes one after another
scoring_single_pass_vs_per_turn    scoring the action tokens of a 10-turn trajectory in one forward
                                   pass vs re-encoding the prompt at every turn        (target >= 3)
env_steps_per_s                    webshop-mini steps/s of a random walk over admissible actions, no model
retrieval_vectorized_vs_loop       TipMemory.retrieve at 10,000 entries vs a per-entry Python loop
                                   with the same results                              (target >= 50)

Also printed: rollout_decode_steps_one_by_one_vs_lockstep, the forward passes one-by-one decoding
needs per lockstep decode step for the same tokens (a lockstep step lasts until its longest action
is done): the most the first ratio could reach even if 8 rows cost what 1 row costs.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time

import numpy as np
import torch

import envs
from empo2 import Config, rollout
from memory import TipMemory
from sampler import (CachedSampler, Decoder, keep_freed_memory, prepared_linear, sample_tokens, sample_tokens_reference,
                     with_cache)


def bench_rollout(policy, steps: int, new_tokens: int, repeats: int = 3) -> dict:
    """Sampled at the training temperature, so the two runs generate different actions: each of the
    `repeats` seeds runs both, one after the other, and the figures are totals over all of them."""
    cfg = Config(env="rooms", warm_start="off", max_steps=steps, max_new_tokens=new_tokens)  # untrained: with the example
    tasks = envs.tasks("rooms", "test")[:8]
    pool = [envs.make("rooms") for _ in tasks]
    rollout(policy, pool[:2], tasks[:2], [("plain", "on-policy")] * 2, cfg)  # warm-up
    modes = [("plain", "on-policy")]

    def actions(trajs):  # tokens of each action, per episode
        return [[len(s) for kind, s in tr.segments if kind == "action"] for tr in trajs]
    tokens_b = tokens_s = time_b = time_s = lockstep_steps = 0
    for seed in range(repeats):
        torch.manual_seed(seed)
        t = time.perf_counter()
        lengths = actions(rollout(policy, pool, tasks, modes * 8, cfg))
        time_b += time.perf_counter() - t
        tokens_b += sum(map(sum, lengths))
        # CachedSampler decodes until the longest action of the step is done; one after another, each episode
        # decodes only its own tokens. Their ratio caps the speed-up of decoding even if 8 rows cost what 1 does.
        lockstep_steps += sum(max(a[k] for a in lengths if len(a) > k) for k in range(max(map(len, lengths))))
        torch.manual_seed(seed)
        t = time.perf_counter()
        tokens_s += sum(sum(map(sum, actions(rollout(policy, pool[:1], [task], modes, cfg)))) for task in tasks)
        time_s += time.perf_counter() - t
    return {"batched_tokens_per_s": tokens_b / time_b, "sequential_tokens_per_s": tokens_s / time_s,
            "rollout_tokens_batched": tokens_b, "rollout_tokens_sequential": tokens_s,
            "rollout_decode_steps_one_by_one_vs_lockstep": tokens_b / lockstep_steps,
            "rollout_batched_vs_sequential": (tokens_b / time_b) / (tokens_s / time_s)}


def bench_scoring(policy, turns: int = 10, repeats: int = 3) -> dict:
    rng = np.random.default_rng(0)
    vocab = len(policy.tokenizer)
    segments = [("context", rng.integers(100, vocab, 150).tolist())]
    for _ in range(turns):  # an action of ~16 tokens, then an observation of ~80
        segments += [("action", rng.integers(100, vocab, 16).tolist()), ("context", rng.integers(100, vocab, 80).tolist())]
    ids = [t for _, s in segments for t in s]
    mask = [k == "action" for k, s in segments for _ in s]
    ends = np.cumsum([len(s) for _, s in segments])
    turn_ends = [int(e) for (k, _), e in zip(segments, ends) if k == "action"]

    def single_pass():
        return policy.score(ids, mask)[0]

    def per_turn():  # what a per-step trainer does: re-encode the whole prompt for each turn's action
        return torch.cat([policy.score(ids[:end], [m and (k >= start) for k, m in enumerate(mask[:end])])[0]
                          for start, end in zip([0] + turn_ends[:-1], turn_ends)])
    with torch.no_grad():
        a, b = single_pass(), per_turn()  # warm-up, and the same numbers
        t = time.perf_counter()
        for _ in range(repeats):
            single_pass()
        t_single = (time.perf_counter() - t) / repeats
        t = time.perf_counter()
        for _ in range(repeats):
            per_turn()
        t_turn = (time.perf_counter() - t) / repeats
    return {"scoring_single_pass_s": t_single, "scoring_per_turn_s": t_turn, "trajectory_tokens": len(ids),
            "scoring_max_abs_logp_diff": float((a - b).abs().max()),
            "scoring_single_pass_vs_per_turn": t_turn / t_single}


def retrieve_loop(memory: TipMemory, task_id: str, query: np.ndarray) -> list[str]:
    """The same semantics as TipMemory.retrieve, one entry at a time."""
    hits = []
    for index, (key, tip, score) in enumerate(zip(memory.keys[task_id], memory.tips[task_id], memory.scores[task_id])):
        sim = float(sum(float(k) * float(q) for k, q in zip(key, query)))
        if sim > memory.threshold:
            hits.append((-score, -index, tip))   # highest score first, ties: newest first
    return [tip for _, _, tip in sorted(hits, key=lambda h: (h[0], h[1]))[:memory.top_k]]


def bench_env_steps(steps: int = 3000) -> dict:
    """webshop-mini's own speed: steps/s of a random walk over admissible actions (no model)."""
    import random

    import envs
    from envs.webshop_mini import SEARCH_FORM
    env, rng = envs.make("webshop-mini", "train", seed=0), random.Random(0)
    tasks, n, start = envs.tasks("webshop-mini", "train"), 0, time.perf_counter()
    while n < steps:
        _, info = env.reset(rng.choice(tasks))
        done = False
        while not done:
            acts = info["admissible_actions"]
            _, _, done, info = env.step("search[red running shoes]" if acts == [SEARCH_FORM] else rng.choice(acts))
            n += 1
    return {"env_steps_per_s": n / (time.perf_counter() - start)}


def bench_retrieval(entries: int = 10_000, queries: int = 20) -> dict:
    rng = np.random.default_rng(0)
    centre = rng.normal(size=384)
    keys = centre + rng.normal(size=(entries, 384)) * 1.2  # a cluster: a fair share pass the 0.5 threshold
    keys = (keys / np.linalg.norm(keys, axis=1, keepdims=True)).astype(np.float32)
    memory = TipMemory(capacity=entries)
    for k in range(entries):
        memory.add("task", keys[k], f"tip {k}", float(rng.integers(0, 100)) / 100)
    qs = [keys[k] for k in rng.integers(0, entries, queries)]
    t = time.perf_counter()
    fast = [memory.retrieve("task", q) for q in qs]
    t_fast = (time.perf_counter() - t) / queries
    t = time.perf_counter()
    slow = [retrieve_loop(memory, "task", q) for q in qs]
    t_slow = (time.perf_counter() - t) / queries
    assert fast == slow, "vectorised and loop retrieval disagree"
    return {"retrieve_vectorized_ms": 1000 * t_fast, "retrieve_loop_ms": 1000 * t_slow,
            "retrieval_vectorized_vs_loop": t_slow / t_fast}


def plain_decode(policy, prompt: list[int], rows: int, steps: int) -> float:
    """Seconds per decode step of a plain Hugging Face forward with a DynamicCache (no mask, all rows the
    same length): the prompt encoded once and its cache copied to every row, then `steps` sampled tokens."""
    from transformers import DynamicCache

    model, cache = policy.model, DynamicCache()
    out = model(input_ids=torch.tensor([prompt]), **with_cache(model, cache), use_cache=True, logits_to_keep=1)
    cache.batch_repeat_interleave(rows)
    token = sample_tokens(out.logits[:, -1].float().expand(rows, -1), 1.0)
    t = time.perf_counter()
    for _ in range(steps):
        out = model(input_ids=token[:, None], **with_cache(model, cache), use_cache=True)
        token = sample_tokens(out.logits[:, -1].float(), 1.0)
    return (time.perf_counter() - t) / steps


def sampler_decode(policy, prompts: list[list[int]], steps: int, around=None, onednn: bool = True) -> float:
    """Seconds per decode step of the project's sampler, one row per prompt: a first call encodes the
    prompts, the timed call feeds each row its sampled token and decodes `steps` (inside the context
    manager `around`, e.g. a profiler, when given). onednn=False: the Decoder's plain F.linear path."""
    rows = len(prompts)
    sampling = policy.sampling() if onednn else contextlib.nullcontext(
        CachedSampler(policy, decoder=Decoder(policy.model, onednn=False)))
    with sampling as sampler:
        first = sampler.generate(prompts, list(range(rows)), 1, temperature=1.0)
        with around if around is not None else contextlib.nullcontext():
            t = time.perf_counter()
            sampler.generate([p + f for p, f in zip(prompts, first)], list(range(rows)), steps, temperature=1.0)
            return (time.perf_counter() - t) / steps


@contextlib.contextmanager
def decoding_without_stops(policy):
    """A no-grad block in eval mode with no stop tokens, so every row decodes every step; restored after."""
    stops, policy.stop_ids = policy.stop_ids, []
    try:
        with torch.no_grad():
            policy.model.eval()
            yield
    finally:
        policy.stop_ids = stops
        policy.model.train()


def decode_prompt(policy, context: int = 300) -> list[int]:
    """The prompt every row of bench_decode's shared-prompt setting starts from: `context` random token ids
    (seed 0); the decode benchmarks that compare with it use the same one."""
    return np.random.default_rng(0).integers(100, len(policy.tokenizer), context).tolist()


def bench_keep_freed_memory(policy, rows: int = 32, context: int = 300, steps: int = 16, rounds: int = 3) -> dict:
    """Decode tokens/s at `rows` rows with glibc's default memory thresholds and with freed memory kept
    in the process (sampler.keep_freed_memory), alternated; keep_freed_memory_decode_{rows}: the ratio.
    Leaves freed memory kept, as train.py and evaluate.py do."""
    prompt = decode_prompt(policy, context)
    best = {False: float("inf"), True: float("inf")}
    with decoding_without_stops(policy):
        for _ in range(rounds):
            for keep in (False, True):
                if not keep_freed_memory(keep):
                    return {}    # not glibc: nothing to compare
                best[keep] = min(best[keep], sampler_decode(policy, [prompt] * rows, steps))
    keep_freed_memory(True)
    return {f"decode_tok_s_sampler_{rows}_glibc_default": rows / best[False],
            f"keep_freed_memory_decode_{rows}": best[False] / best[True]}


def bench_decode(policy, rows=(1, 8, 32, 64), context: int = 300, steps: int = 16) -> dict:
    """Decode tokens/s at each batch size; no stop token, so every row decodes every step."""
    rng = np.random.default_rng(0)
    prompt = rng.integers(100, len(policy.tokenizer), context).tolist()
    distinct = [rng.integers(100, len(policy.tokenizer), context).tolist() for _ in range(32)]
    result = {}
    with decoding_without_stops(policy):
        for n in rows:
            sampler_decode(policy, [prompt] * n, 2)  # warm-up
            result[f"decode_tok_s_sampler_{n}"] = n / min(sampler_decode(policy, [prompt] * n, steps) for _ in range(2))
            with policy.merged_lora():            # the plain forward gets the merged weights too
                plain_decode(policy, prompt, n, 2)
                result[f"decode_tok_s_plain_{n}"] = n / min(plain_decode(policy, prompt, n, steps) for _ in range(2))
        if 32 in rows:
            result["decode_tok_s_sampler_32_distinct"] = 32 / min(sampler_decode(policy, distinct, steps) for _ in range(2))
    if 32 in rows:
        result["decode_vs_plain_32_rows"] = result["decode_tok_s_sampler_32"] / result["decode_tok_s_plain_32"]
        # the plain forward copies the prompt's cache to every row, so its cost is the same for distinct prompts
        result["decode_vs_plain_32_rows_distinct"] = result["decode_tok_s_sampler_32_distinct"] / result["decode_tok_s_plain_32"]
    return result


def bench_sampling(rows: int = 32, vocab: int = 49152, repeats: int = 50) -> dict:
    """ms per call of sampler.sample_tokens (the draw located in block sums, then in its block) and of
    sample_tokens_reference (one float64 running sum over the vocabulary) on the same logits, once per
    decode step of `rows` rows."""
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(0)) * 3
    result = {}
    for name, f in (("blocked", sample_tokens), ("reference", sample_tokens_reference)):
        f(logits, 1.0)
        t = time.perf_counter()
        for _ in range(repeats):
            f(logits, 1.0)
        result[f"sample_tokens_ms_{name}_{rows}"] = 1000 * (time.perf_counter() - t) / repeats
    result["sampling_blocked_vs_running_sum"] = result[f"sample_tokens_ms_reference_{rows}"] / result[f"sample_tokens_ms_blocked_{rows}"]
    return result


def best_time(step, repeats: int) -> float:
    """Seconds of the fastest of `repeats` calls of step, after one warm-up call."""
    step()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        step()
        best = min(best, time.perf_counter() - t)
    return best


def matmul_cap_step(policy, rows: int, prepacked: bool = False):
    """One decode step's matrix products alone at `rows` rows (every Linear of the model at its own shape,
    the LM head included, in the model's dtype), no attention, no element-wise work: a function to time.
    prepacked: through sampler.prepared_linear (oneDNN's prepacked weights on CPU), else F.linear."""
    weights = [m.weight.detach() for name, m in policy.model.named_modules()
               if isinstance(m, torch.nn.Linear) and "lora_" not in name]   # base weights, LoRA's A and B left out
    inputs = {w.shape[1]: torch.randn(rows, w.shape[1], dtype=w.dtype, device=w.device) for w in weights}
    products = [(prepared_linear(w, None, onednn=prepacked), inputs[w.shape[1]]) for w in weights]

    @torch.no_grad()
    def step():
        for product, x in products:
            product(x)
    return step


def bench_matmul_cap(policy, rows=(1, 8, 32, 64), repeats: int = 5) -> dict:
    """The most decode tokens/s this machine allows: matmul_cap_step's products, best of `repeats`, with
    F.linear (decode_matmul_cap_tok_s_*) and with the sampler's prepacked products
    (decode_matmul_cap_prepacked_tok_s_*). Rough ceilings: the sampler fuses q|k|v and gate|up into
    fewer, larger products, and a timing of those fused shapes on one machine (README, Speed) gave caps
    up to 40 % apart from these."""
    result = {}
    for n in rows:
        result[f"decode_matmul_cap_tok_s_{n}"] = n / best_time(matmul_cap_step(policy, n), repeats)
        result[f"decode_matmul_cap_prepacked_tok_s_{n}"] = n / best_time(matmul_cap_step(policy, n, prepacked=True), repeats)
    return result


def bench_decode_share(policy, rows: int = 32, context: int = 300, steps: int = 16, rounds: int = 4) -> dict:
    """decode_share_of_cap_{rows}: the sampler's decode tokens/s (bench_decode's setting) over the
    matrix-product cap, the caps and the decode timed alternately, best of `rounds` each, so that a slow
    spell of a shared machine hits all alike (timed minutes apart, they differed by up to 50 %);
    decode_share_of_prepacked_cap_{rows}: the same over the prepacked products' cap, the tighter one
    wherever oneDNN beats F.linear."""
    prompt = decode_prompt(policy, context)
    step, packed = matmul_cap_step(policy, rows), matmul_cap_step(policy, rows, prepacked=True)
    decode = cap = packed_cap = float("inf")
    with decoding_without_stops(policy):
        for _ in range(rounds):
            decode = min(decode, sampler_decode(policy, [prompt] * rows, steps))
            cap = min(cap, best_time(step, 2))
            packed_cap = min(packed_cap, best_time(packed, 2))
    return {f"decode_share_of_cap_{rows}": cap / decode, f"decode_share_of_prepacked_cap_{rows}": packed_cap / decode}


def bench_onednn(policy, rows=(1, 8, 32, 64), context: int = 300, steps: int = 8, rounds: int = 3) -> dict:
    """Decode tokens/s with the Decoder's products through oneDNN's prepacked weights (the default) and
    through plain F.linear, alternated, best of `rounds` each: onednn_vs_linear_decode_{rows}, the ratio.
    In bf16 F.linear reorders the weight at every call; in float32 it calls MKL. Also the ms of building a
    Decoder (once per sampling context: the weights are copied with the LoRA update, and reordered)."""
    prompt = decode_prompt(policy, context)
    result = {}
    with decoding_without_stops(policy):
        for n in rows:
            best = {True: float("inf"), False: float("inf")}
            for _ in range(rounds):
                for onednn in (True, False):
                    best[onednn] = min(best[onednn], sampler_decode(policy, [prompt] * n, steps, onednn=onednn))
            result[f"decode_tok_s_sampler_{n}_linear"] = n / best[False]
            result[f"onednn_vs_linear_decode_{n}"] = best[False] / best[True]
        for onednn in (True, False):
            result[f"decoder_setup_ms_{'onednn' if onednn else 'linear'}"] = 1000 * best_time(
                lambda: Decoder(policy.model, onednn=onednn), 2)
    return result


# the kernels a decode step's matrix products and attention run in (prepacked on CPU, else F.linear's)
PRODUCT_OPS = ("mkldnn::_linear_pointwise", "aten::mm", "aten::addmm")
ATTENTION_OPS = ("aten::_scaled_dot_product_flash_attention_for_cpu", "aten::_scaled_dot_product_attention_math",
                 "aten::_scaled_dot_product_efficient_attention", "aten::_scaled_dot_product_flash_attention")


def bench_decode_parts(policy, rows: int = 32, context: int = 300, steps: int = 16) -> dict:
    """Where a decode step of `rows` rows goes (bench_decode's setting): ms per step in the matrix products
    and in the attention kernel (self time under torch.profiler, which slows small ops more than large
    ones), the rest of the profiled step, and the step unprofiled. decode_parts_bound_tok_s_{rows}: the
    decode speed if everything but products and attention were free."""
    from torch.profiler import profile
    prompt = decode_prompt(policy, context)
    with decoding_without_stops(policy):
        step = min(sampler_decode(policy, [prompt] * rows, steps) for _ in range(2))
        prof = profile()
        profiled = sampler_decode(policy, [prompt] * rows, steps, around=prof)
    events = prof.key_averages()
    products = sum(e.self_cpu_time_total for e in events if e.key in PRODUCT_OPS) / 1000 / steps      # ms
    attention = sum(e.self_cpu_time_total for e in events if e.key in ATTENTION_OPS) / 1000 / steps
    return {f"decode_step_ms_{rows}": 1000 * step, f"decode_step_profiled_ms_{rows}": 1000 * profiled,
            f"decode_step_products_ms_{rows}": products, f"decode_step_attention_ms_{rows}": attention,
            f"decode_step_other_ms_{rows}": 1000 * profiled - products - attention,
            f"decode_parts_bound_tok_s_{rows}": rows / ((products + attention) / 1000)}


def bench_prefill(policy, rows: int = 8, context: int = 300, repeats: int = 2) -> dict:
    """Tokens/s of encoding a batch of distinct prompts (what a rollout step does with new observations)."""
    rng = np.random.default_rng(1)
    prompts = [rng.integers(100, len(policy.tokenizer), context).tolist() for _ in range(rows)]
    t_sampler = t_plain = float("inf")
    with torch.no_grad():
        policy.model.eval()
        for _ in range(repeats + 1):
            with policy.sampling() as sampler:
                t = time.perf_counter()
                sampler.generate(prompts, list(range(rows)), 1, temperature=1.0)
                t_sampler = min(t_sampler, time.perf_counter() - t)
            with policy.merged_lora():
                t = time.perf_counter()
                policy.model(input_ids=torch.tensor(prompts), use_cache=True, logits_to_keep=1)
                t_plain = min(t_plain, time.perf_counter() - t)
    policy.model.train()
    return {"prefill_tok_s_sampler": rows * context / t_sampler, "prefill_tok_s_plain": rows * context / t_plain,
            "prefill_vs_plain": t_plain / t_sampler}


def bench_score(policy, length: int = 1100, actions: int = 5, repeats: int = 2) -> dict:
    """Trained tokens/s of Policy.score, forward + backward, on one webshop-mini-sized trajectory; with
    LoRA multiplied in the base dtype (the default, sampler.lora_in_base_dtype) and with peft's float32
    LoRA (the plain path), alternated so both see the same machine state."""
    rng = np.random.default_rng(2)
    ids = rng.integers(100, len(policy.tokenizer), length).tolist()
    mask = [False] * length
    for k in range(actions):  # five 12-token actions, spread over the trajectory
        start = (k + 1) * length // (actions + 1)
        mask[start:start + 12] = [True] * 12
    best = {True: float("inf"), False: float("inf")}
    for _ in range(repeats + 1):
        for fast in (True, False):
            policy.fast_lora = fast
            t = time.perf_counter()
            logp, _ = policy.score(ids, mask)
            logp.sum().backward()
            best[fast] = min(best[fast], time.perf_counter() - t)
    policy.fast_lora = True
    policy.model.zero_grad(set_to_none=True)
    return {"scoring_tok_s": length / best[True], "scoring_tok_s_peft_float32_lora": length / best[False],
            "lora_in_base_dtype_vs_peft": best[False] / best[True]}


def bench_score_cap(policy, length: int = 1100, action_tokens: int = 60, repeats: int = 3) -> dict:
    """The most scoring tokens/s this machine allows: the matrix products of bench_score's forward and
    backward alone, at their own shapes in the model's dtype. Forward: every base Linear over all
    `length` tokens, the LM head over the action positions only (score keeps only those logits).
    Backward: each product again for the gradient of its input (the base weights are frozen, so no weight
    gradient; LoRA's rank-r products are left out). No attention, no element-wise work."""
    weights = [(name, m.weight.detach()) for name, m in policy.model.named_modules()
               if isinstance(m, torch.nn.Linear) and "lora_" not in name]
    shapes = [(action_tokens if name.endswith("lm_head") else length, w) for name, w in weights]
    with torch.no_grad():
        inputs = {(n, w.shape[1]): torch.randn(n, w.shape[1], dtype=w.dtype, device=w.device) for n, w in shapes}
        grads = {(n, w.shape[0]): torch.randn(n, w.shape[0], dtype=w.dtype, device=w.device) for n, w in shapes}

        def step():
            for n, w in shapes:
                torch.nn.functional.linear(inputs[n, w.shape[1]], w)    # forward, (n, out)
                torch.matmul(grads[n, w.shape[0]], w)                   # gradient of the input, (n, in)
        return {"scoring_matmul_cap_tok_s": length / best_time(step, repeats)}


def bench_iteration(policy, env: str = "webshop-mini") -> dict:
    """One training iteration of the main command's defaults (EMPO²), then the same seed's iteration with
    --algo grpo (p = 0, no reflection or intrinsic reward), each timed by train.py itself (metrics.jsonl);
    the warm start is used when it is already cached (never built here: that alone takes minutes)."""
    import tempfile
    from pathlib import Path

    import train
    import warm_start
    cfg = Config(env=env)
    cached = warm_start.cache_folder(warm_start.cache_key(policy, cfg)).exists()
    rows = {}
    for algo in ("empo2", "grpo"):
        with tempfile.TemporaryDirectory() as out, contextlib.redirect_stdout(sys.stderr):  # stdout: the JSON only
            train.main(["--env", env, "--algo", algo, "--iterations", "1", "--eval-episodes", "0", "--out", out,
                        "--name", "bench", "--warm-start", "auto" if cached else "off"])
            rows[algo] = json.loads((Path(out) / "bench" / "metrics.jsonl").read_text().splitlines()[-1])
    row = rows["empo2"]
    return {"iteration_warm_start": cached, "iteration_s": row["time/iteration_s"],
            "iteration_rollout_s": row["time/rollout_s"], "iteration_reflect_s": row["time/reflect_s"],
            "iteration_update_s": row["time/update_s"], "iteration_tokens_generated": row["charts/tokens_generated"],
            "iteration_grpo_s": rows["grpo"]["time/iteration_s"],
            "iteration_empo2_over_grpo": row["time/iteration_s"] / rows["grpo"]["time/iteration_s"]}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--steps", type=int, default=3, help="environment steps per rollout episode")
    parser.add_argument("--new-tokens", type=int, default=32, help="max new tokens per action")
    parser.add_argument("--no-iteration", action="store_true", help="skip the training iteration (~3 minutes)")
    args = parser.parse_args()
    from policy import load_policy
    policy = load_policy(args.model, args.dtype, args.device)
    result = {"model": args.model, "dtype": str(next(policy.model.parameters()).dtype).replace("torch.", ""),
              "device": str(policy.device), "threads": torch.get_num_threads()}
    result.update(bench_keep_freed_memory(policy))   # from here on freed memory stays, as in train.py
    result.update(bench_env_steps())
    result.update(bench_retrieval())
    result.update(bench_scoring(policy))
    result.update(bench_sampling())
    result.update(bench_decode(policy))
    result.update(bench_onednn(policy))
    result.update(bench_matmul_cap(policy))
    result.update(bench_decode_parts(policy))
    result.update(bench_decode_share(policy))
    result["decode_parts_bound_share_of_cap_32"] = result["decode_parts_bound_tok_s_32"] / result["decode_matmul_cap_tok_s_32"]
    result.update(bench_prefill(policy))
    result.update(bench_score(policy))
    result.update(bench_score_cap(policy))
    result["scoring_share_of_cap"] = result["scoring_tok_s"] / result["scoring_matmul_cap_tok_s"]
    result.update(bench_rollout(policy, args.steps, args.new_tokens))
    if not args.no_iteration:
        result.update(bench_iteration(policy))
    ratios = ("decode_vs_plain_32_rows", "decode_vs_plain_32_rows_distinct", "prefill_vs_plain", "rollout_batched_vs_sequential",
              "scoring_single_pass_vs_per_turn", "retrieval_vectorized_vs_loop", "sampling_blocked_vs_running_sum",
              "lora_in_base_dtype_vs_peft", "keep_freed_memory_decode_32", "onednn_vs_linear_decode_32")
    print(json.dumps({**{k: round(result[k], 2) for k in ratios if k in result},
                      **{k: (round(v, 4) if isinstance(v, float) else v) for k, v in result.items() if k not in ratios}},
                     indent=1))


if __name__ == "__main__":
    main()
