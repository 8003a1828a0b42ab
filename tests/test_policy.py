"""Sampling machinery: the cross-step KV cache, the newline stop and the merged-LoRA context."""
import torch

import pytest

from policy import load_policy
from sampler import CachedSampler, Decoder, HFDecoder, keep_freed_memory, sample_tokens


def randomise_lora(policy, seed=0):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in policy.model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)


def test_kv_cache_across_calls_gives_what_fresh_generation_gives(tiny_policy):
    """A CachedSampler kept across calls (rows growing, one dropping out) must pick the same greedy
    tokens as generating every prompt from scratch, batched or alone."""
    randomise_lora(tiny_policy)
    enc = tiny_policy.encode
    prompts = [enc("You are in the kitchen. Go"), enc("A long hallway with three doors, one of them red. Open"),
               enc("Kitchen")]
    kept = CachedSampler(tiny_policy)
    first = kept.generate(prompts, [0, 1, 2], 6, temperature=0.0)
    assert first == CachedSampler(tiny_policy).generate(prompts, [0, 1, 2], 6, temperature=0.0)
    grown = {0: prompts[0] + first[0] + enc(" Nothing happens. Look"), 2: prompts[2] + first[2] + enc(" ok")}
    second = kept.generate([grown[0], grown[2]], [0, 2], 6, temperature=0.0)  # episode 1 finished
    assert kept.cached_ids[0][:len(prompts[0])] == prompts[0] and len(kept.episode_ids) == 2
    assert second == tiny_policy.generate([grown[0], grown[2]], 6, temperature=0.0)
    for row, key in enumerate([0, 2]):
        assert second[row] == tiny_policy.generate([grown[key]], 6, temperature=0.0)[0]


def greedy_without_cache(policy, prompt, n):
    """The reference: every token from a full forward pass over the whole sequence, one row, no mask."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(policy.model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def test_lockstep_with_holes_and_a_kept_cache_matches_a_plain_forward(tiny_policy):
    """Holes (unequal rows, rows that stopped early), hole-skipping positions and the attention mask
    built by CachedSampler must give each row what a plain forward pass over its own tokens gives."""
    randomise_lora(tiny_policy, seed=2)
    tiny_policy.model.eval()
    enc = tiny_policy.encode
    prompts = [enc("Go"), enc("A long hallway with three doors, one of them red. Open"), enc("Kitchen sink")]
    decoder = CachedSampler(tiny_policy)
    stops = tiny_policy.stop_ids
    tiny_policy.stop_ids = [greedy_without_cache(tiny_policy, prompts[0], 3)[2]]  # row 0 stops early: holes
    first = decoder.generate(prompts, [0, 1, 2], 6, temperature=0.0)
    tiny_policy.stop_ids = stops
    assert len(first[0]) == 3 and max(map(len, first)) == 6
    for row, prompt in enumerate(prompts):
        assert first[row] == greedy_without_cache(tiny_policy, prompt, 6)[:len(first[row])]
    grown = [p + o + enc(" You see a key. Take") for p, o in zip(prompts, first)]
    second = decoder.generate(grown, [0, 1, 2], 5, temperature=0.0)
    for row, prompt in enumerate(grown):
        assert second[row] == greedy_without_cache(tiny_policy, prompt, 5)


@pytest.fixture()
def tiny_qwen_policy(tiny_model_dir):
    """A tiny Qwen2-architecture model (biases on q, k, v; random, where Hugging Face starts them at 0)."""
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    from policy import Policy, add_lora
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    torch.manual_seed(1)
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    model = Qwen2ForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)
    return Policy(add_lora(model, 4, 8), tokenizer)


def sample_without_cache(policy, prompts, n, temperature, seed):
    """The reference: at every step a full forward pass over each row's whole sequence, alone (no cache, no
    mask, no padding), then one sample_tokens call for all rows: the random draws the sampler makes."""
    torch.manual_seed(seed)
    sequences, out = [list(p) for p in prompts], [[] for _ in prompts]
    for _ in range(n):
        logits = torch.stack([policy.model(input_ids=torch.tensor([s])).logits[0, -1].float() for s in sequences])
        for s, o, t in zip(sequences, out, sample_tokens(logits, temperature).tolist()):
            s.append(t)
            o.append(t)
    return out


SHARED = "You are a text-game agent. Reply with exactly one valid action.\n"


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("merged", [False, True])
@pytest.mark.parametrize("decoder", [Decoder, HFDecoder, "linear"])
@pytest.mark.parametrize("shared", [False, True])
def test_sampled_tokens_are_those_of_a_plain_forward_with_the_same_draws(arch, merged, decoder, shared, request):
    """Sampling at temperature 1 through the kept cache (unequal rows: holes; a grown second call past the
    cache's first capacity; a finished episode leaving) must draw exactly the tokens a plain uncached
    forward pass draws with the same random numbers, for the LoRA merged into the weights or not, and
    with the prompt all rows start with held once as Decoder's shared prefix; "linear" is Decoder with
    its products through F.linear instead of oneDNN's prepacked weights."""
    import contextlib
    policy = request.getfixturevalue("tiny_policy" if arch == "llama" else "tiny_qwen_policy")
    assert Decoder.supports(policy.model)
    randomise_lora(policy, seed=4)
    policy.model.eval()
    policy.stop_ids = []   # every row samples every step: the draws line up row for row
    enc = policy.encode
    head = enc(SHARED) if shared else []
    prompts = [head + enc(t) for t in ("Go", "A long hallway with three doors, one of them red. Open", "Kitchen sink")]
    with torch.no_grad(), (policy.merged_lora() if merged else contextlib.nullcontext()):
        made = Decoder(policy.model, onednn=False) if decoder == "linear" else decoder(policy.model)
        sampler = CachedSampler(policy, made)
        torch.manual_seed(5)
        first = sampler.generate(prompts, [0, 1, 2], 6, temperature=1.0)
        if decoder is not HFDecoder:
            assert (sampler.decoder.prefix is not None) == shared
        assert first == sample_without_cache(policy, prompts, 6, 1.0, seed=5)
        grown = [prompts[k] + first[k] + enc(" You see a key, a lamp and a very long corridor. Take") for k in (0, 2)]
        torch.manual_seed(6)
        second = sampler.generate(grown, [0, 2], 5, temperature=1.0)
        assert sampler.episode_ids == [0, 2]
        assert second == sample_without_cache(policy, grown, 5, 1.0, seed=6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prepared_linear_multiplies_as_f_linear(dtype):
    """oneDNN's prepacked product (the default on CPU) is x W^T + b: bit-identical to F.linear in bf16,
    equal up to the order of float32 sums in float32; onednn=False is F.linear itself."""
    from sampler import prepared_linear
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(96, 64, generator=g).to(dtype), torch.randn(96, generator=g).to(dtype)
    x = torch.randn(7, 64, generator=g).to(dtype)
    reference = torch.nn.functional.linear(x, w, b)
    assert torch.equal(prepared_linear(w, b, onednn=False)(x), reference)
    out = prepared_linear(w, b)(x)
    assert out.dtype == dtype and out.shape == (7, 96)
    if dtype == torch.bfloat16:
        assert torch.equal(out, reference)
    else:
        torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-5)
        assert not torch.equal(out, prepared_linear(w.flip(0), b)(x))  # it reads the weight


@pytest.mark.parametrize("gather_below", [0.0, 1.0])
@pytest.mark.parametrize("decoder", [Decoder, HFDecoder])
@pytest.mark.parametrize("shared", [False, True])
def test_rows_that_stop_early_keep_the_draws_and_tokens_of_a_plain_forward(decoder, gather_below, shared, tiny_policy):
    """Rows stopping at different steps: the rows still sampling are decoded alone (gathered, GATHER_BELOW
    1.0) or with holes for the others (0.0); either way each row's tokens are the reference's up to its stop,
    in this call and in the next one, which continues from the holes left behind."""
    randomise_lora(tiny_policy, seed=7)
    tiny_policy.model.eval()
    enc = tiny_policy.encode
    head = enc(SHARED) if shared else []
    prompts = [head + enc(t) for t in ("Go", "A long hallway with three doors. Open", "Kitchen sink", "North")]
    free = sample_without_cache(tiny_policy, prompts, 8, 1.0, seed=8)
    tiny_policy.stop_ids = [free[0][1], free[2][4]]

    def cut(tokens):  # the reference's tokens up to and including the first stop
        return next((tokens[:k + 1] for k, t in enumerate(tokens) if t in tiny_policy.stop_ids), tokens)
    sampler = CachedSampler(tiny_policy, decoder(tiny_policy.model))
    sampler.GATHER_BELOW = gather_below
    with torch.no_grad():
        torch.manual_seed(8)
        first = sampler.generate(prompts, [0, 1, 2, 3], 8, temperature=1.0)
        if decoder is Decoder:
            assert (sampler.decoder.prefix is not None) == shared
        assert first == [cut(f) for f in free]
        assert len(first[0]) == 2 and len(first[2]) <= 5 and max(map(len, first)) == 8   # stops at different steps
        grown = [p + o + enc(" It is dark.") for p, o in zip(prompts, first)]
        again = sample_without_cache(tiny_policy, grown, 6, 1.0, seed=9)
        torch.manual_seed(9)
        assert sampler.generate(grown, [0, 1, 2, 3], 6, temperature=1.0) == [cut(a) for a in again]


def test_decoder_falls_back_for_other_architectures(tiny_model_dir):
    """A model Decoder does not write out (here GPT-2) is sampled through its own forward."""
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

    from policy import Policy, add_lora
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=1, n_head=2))
    policy = Policy(add_lora(model, 4, 8), tokenizer)
    assert not Decoder.supports(policy.model)
    with policy.sampling() as sampler:
        assert isinstance(sampler.decoder, HFDecoder)
        out = sampler.generate([policy.encode("Hello there")], [0], 4, temperature=0.0)
    assert len(out[0]) == 4 or out[0][-1] in policy.stop_ids


def test_stop_at_newline_cuts_after_the_first_line_with_text(tiny_policy, monkeypatch):
    randomise_lora(tiny_policy, seed=1)
    prompt = [tiny_policy.encode("Say something")]
    free = tiny_policy.generate(prompt, 8, temperature=0.0)[0]
    k = next(i for i in range(1, len(free)) if free[i] != free[0] and free[i] not in free[:i])
    # pretend free[k] is a bare newline token and every earlier token is text
    monkeypatch.setattr(type(tiny_policy), "token_kinds", property(lambda self: ({free[k]}, set(), set(free[:k]))))
    assert tiny_policy.generate(prompt, 8, temperature=0.0, stop_at_newline=True)[0] == free[:k + 1]
    # a newline before any text does not end the action (leading blank lines are stripped later)
    monkeypatch.setattr(type(tiny_policy), "token_kinds", property(lambda self: ({free[0]}, set(), set())))
    assert tiny_policy.generate(prompt, 8, temperature=0.0, stop_at_newline=True)[0][:len(free)] == free


def test_merged_lora_samples_the_same_model_and_restores_bf16_weights_exactly(tiny_model_dir):
    policy = load_policy(tiny_model_dir, dtype="bfloat16", device="cpu", lora_r=4, lora_alpha=8)
    randomise_lora(policy)
    before = {k: v.clone() for k, v in policy.model.state_dict().items()}
    ids = torch.tensor([policy.encode("Open the red door and look around")])
    with torch.no_grad():
        plain = policy.model(input_ids=ids).logits.float()
        with policy.model.disable_adapter():
            base = policy.model(input_ids=ids).logits.float()
        with policy.merged_lora():
            with policy.merged_lora():  # re-entrant
                merged = policy.model(input_ids=ids).logits.float()
            changed = any(not torch.equal(v, before[k]) for k, v in policy.model.state_dict().items())
    assert changed  # the LoRA update really was folded in ...
    # ... giving the LoRA model (up to bf16 rounding), far closer to it than the base model is
    assert (merged - plain).abs().mean() < 0.25 * (base - plain).abs().mean()
    after = policy.model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())  # and not one bit of drift afterwards


def test_sample_tokens_draws_from_the_tempered_softmax():
    torch.manual_seed(0)
    logits = torch.tensor([[2.0, 1.0, 0.0, -float("inf"), 0.5],
                           [-float("inf"), 0.0, 0.0, 3.0, -float("inf")]])
    n, temperature = 40_000, 0.7
    draws = torch.stack([sample_tokens(logits, temperature) for _ in range(n)])  # (n, 2)
    for row in range(2):
        freq = torch.bincount(draws[:, row], minlength=5).double() / n
        probs = torch.softmax(logits[row].double() / temperature, -1)
        sigma = (probs * (1 - probs) / n).sqrt()
        assert ((freq - probs).abs() <= 5 * sigma + 1e-12).all(), (row, freq, probs)
        assert freq[probs == 0].sum() == 0  # a -inf logit is never drawn
    assert sample_tokens(logits, 0).tolist() == [0, 3]


@pytest.mark.parametrize("vocab", [7, 256, 1000, 49152])
def test_blocked_sampling_draws_what_one_running_sum_draws(vocab):
    """sample_tokens locates each draw in block sums, then inside its block; sample_tokens_reference in
    one float64 running sum over the vocabulary. Same draws, same tokens, at the extremes too: u = 0 skips
    leading impossible tokens, u just below 1 stops at the last possible one (never a -inf logit, never
    the padding of a vocabulary that is not a multiple of the block)."""
    from sampler import sample_tokens_reference
    torch.manual_seed(vocab)
    logits = torch.randn(64, vocab) * 4
    logits[:, :2] = logits[:, -3:] = -float("inf")           # impossible first and last tokens
    logits[0, 3:-4] = -float("inf")                            # a row with two equally likely tokens
    logits[0, 2] = logits[0, -4] = 0.0
    draws = torch.rand(64, 50, dtype=torch.float64)
    draws[:, 0], draws[:, 1] = 0.0, 1 - 2 ** -53
    for k in range(draws.shape[1]):
        u = draws[:, k:k + 1]
        fast, ref = sample_tokens(logits, 0.8, u, block=16), sample_tokens_reference(logits, 0.8, u)
        assert torch.equal(fast, ref), k
        assert torch.isfinite(logits.gather(1, fast[:, None])).all()
    assert set(sample_tokens(logits[:1].expand(400, -1), 0.8).tolist()) == {2, vocab - 4}


def test_forward_passes_with_a_cache_use_the_installed_transformers_keyword(tiny_policy):
    """Every forward pass that hands the model a KV cache (SharedPrefix, score after a prefix, HFDecoder)
    names it as the installed transformers wants: no FutureWarning (pytest.ini ignores them elsewhere), and
    the cache is really used (the prefix is held, HFDecoder's cache grows)."""
    import warnings

    from sampler import SharedPrefix
    enc = tiny_policy.encode
    ids = enc("System: you play a game. Task: find the key.") + enc(" take key")
    mask = [False] * (len(ids) - 2) + [True, True]
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        prefix = SharedPrefix(tiny_policy, [(ids, mask)])
        logp, _ = tiny_policy.score(ids, mask, prefix=prefix)
        decoder = HFDecoder(tiny_policy.model, tiny_policy.tokenizer.pad_token_id)
        decoder.reset(1)
        block = torch.tensor([ids[:5]])
        decoder.forward(block, torch.ones_like(block, dtype=torch.bool))
        decoder.forward(block[:, :1], torch.ones((1, 1), dtype=torch.bool))
    assert prefix.length > 0 and len(logp) == 2 and decoder.cache.get_seq_length() == 6


def test_shared_prefix_gives_the_log_probs_and_gradients_of_separate_passes(tiny_policy):
    """Scoring trajectories that start alike through one SharedPrefix must give exactly the log-probs
    and the LoRA gradient that one full forward and backward pass per trajectory gives."""
    from sampler import SharedPrefix
    randomise_lora(tiny_policy, seed=3)
    enc = tiny_policy.encode
    start = enc("System: you play a game. Example: go north. Task: find the red key.")
    sequences = []
    for k, tail in enumerate([" go east then", " open the door and", " look"]):
        ids = start + enc(tail) + enc(" take key") + enc(" Nothing happens.") + enc(" look around")
        mask = [False] * len(start + enc(tail)) + [True] * len(enc(" take key")) + [False] * len(enc(" Nothing happens."))
        mask += [k != 1] * len(enc(" look around"))
        sequences.append((ids, mask))
    weights = [0.7, -1.3, 2.0]
    params = tiny_policy.lora_parameters()

    def run(shared: bool):
        for p in params:
            p.grad = None
        prefix = SharedPrefix(tiny_policy, sequences) if shared else None
        logps = []
        for (ids, mask), w in zip(sequences, weights):
            logp, _ = tiny_policy.score(ids, mask, prefix=prefix)
            (w * logp.sum()).backward()
            logps.append(logp.detach())
        if shared:
            assert prefix.length == len(start) and prefix.leaves[0][0].grad is not None
            prefix.backward()
        return logps, [p.grad.clone() for p in params]

    plain_logps, plain_grads = run(False)
    shared_logps, shared_grads = run(True)
    for a, b in zip(plain_logps, shared_logps):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert sum(float(g.abs().sum()) for g in plain_grads) > 0
    for a, b in zip(plain_grads, shared_grads):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-5)  # float32 summation order


def test_lora_in_the_base_dtype_is_as_close_to_float32_as_peft_and_keeps_float32_weights(tiny_model_dir):
    """On a bf16 base, score() multiplies LoRA in bf16 (no float32 copy of any LoRA layer's input) while
    the LoRA weights and their gradients stay float32. Against the same model in float32, its log-probs
    and LoRA gradient are as close as peft's float32-LoRA path gets, and both are far closer than the
    LoRA update itself moves them."""
    from sampler import SharedPrefix
    enc = load_policy(tiny_model_dir, dtype="float32", device="cpu").encode
    start = enc("System: you play a game. Task: find the red key.")
    seqs = [(start + enc(t) + enc(" take key"), [False] * len(start + enc(t)) + [True] * len(enc(" take key")))
            for t in (" go east", " open the door")]

    def run(dtype: str, fast: bool, adapter: bool = True):
        policy = load_policy(tiny_model_dir, dtype=dtype, device="cpu", lora_r=4, lora_alpha=8)
        randomise_lora(policy, seed=5)
        policy.fast_lora = fast
        seen = set()
        for n, m in policy.model.named_modules():
            if n.endswith("lora_A.default"):
                m.register_forward_pre_hook(lambda m, args: seen.add(args[0].dtype))
        prefix = SharedPrefix(policy, seqs) if adapter else None
        logps = []
        for k, (ids, mask) in enumerate(seqs):
            if adapter:
                logp, _ = policy.score(ids, mask, prefix=prefix)
                ((1.0 - 2 * k) * logp.sum()).backward()
            else:
                with torch.no_grad(), policy.model.disable_adapter():
                    logp, _ = policy.score(ids, mask)
            logps.append(logp.detach())
        if not adapter:
            return torch.cat(logps), None, seen
        prefix.backward()
        params = policy.lora_parameters()
        assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in params)
        return torch.cat(logps), torch.cat([p.grad.flatten() for p in params]), seen

    exact, exact_grad, _ = run("float32", True)
    base, _, _ = run("float32", False, adapter=False)
    plain, plain_grad, plain_seen = run("bfloat16", False)
    fast, fast_grad, fast_seen = run("bfloat16", True)
    assert plain_seen == {torch.float32} and fast_seen == {torch.bfloat16}
    lora_effect = (base - exact).abs().mean()
    assert (plain - exact).abs().mean() < 0.1 * lora_effect
    assert (fast - exact).abs().mean() < 0.1 * lora_effect
    err = lambda g: float((g - exact_grad).norm() / exact_grad.norm())
    assert err(fast_grad) < max(2 * err(plain_grad), 0.05)


def test_every_eos_id_of_the_generation_config_stops_sampling(tiny_model_dir):
    """Qwen's generation config lists <|im_end|> and <|endoftext|>: both must stop an action. Here two
    tokens the model writes greedily in the middle of two continuations are made the config's eos ids."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from policy import Policy
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    plain = Policy(model, tokenizer)
    prompts = [plain.encode("Open the door"), plain.encode("Kitchen sink, north exit")]
    torch.manual_seed(3)
    free = plain.generate(prompts, 8, temperature=1.0)
    assert all(len(f) == 8 for f in free)   # no stop of its own within 8 tokens
    ends = [next(k for k in range(1, 8) if f[k] not in f[:k] and f[k] not in plain.stop_ids) for f in free]
    model.generation_config.eos_token_id = [free[0][ends[0]], free[1][ends[1]]]
    policy = Policy(model, tokenizer)
    assert {tokenizer.eos_token_id, policy.end_of_turn_id} <= set(policy.stop_ids)
    torch.manual_seed(3)
    cut = policy.generate(prompts, 8, temperature=1.0)   # the same draws: rows that stop keep them (see above)
    for row, f, end in zip(cut, free, ends):
        first_stop = next(k for k, t in enumerate(f) if t in policy.stop_ids)
        assert first_stop <= end and row == f[:first_stop + 1]   # each eos id ends its row where it first appears
    assert all(row[-1] in model.generation_config.eos_token_id for row in cut)   # stopped by the config's ids


@pytest.mark.parametrize("feed_step", [64, 2])
@pytest.mark.parametrize("shared", [False, True])
def test_finished_episodes_continue_from_their_cache_with_the_draws_of_a_plain_forward(shared, feed_step, tiny_policy,
                                                                                     monkeypatch):
    """keep_finished: a later call continues episodes that left the batch (kept aside), a row still in it,
    a row whose prompt keeps only the start of its cache (a middle part removed, as reflection removes
    tips) and a new episode; each samples exactly what a plain uncached forward samples with the same
    draws, and nothing is encoded again from the start."""
    randomise_lora(tiny_policy, seed=10)
    tiny_policy.model.eval()
    tiny_policy.stop_ids = []
    enc = tiny_policy.encode
    head = enc(SHARED) if shared else []
    tip = enc(" <tip> the key is in the attic </tip>")
    prompts = [head + enc(t) for t in ("Go", "A long hallway with three doors.", "Kitchen sink", "North")]
    before_tip = prompts[1]
    prompts[1] = before_tip + tip + enc(" Open")
    sampler = CachedSampler(tiny_policy, keep_finished=True)
    sampler.FEED_STEP = feed_step      # 2: unequal prompts are fed in several rounds before the common block
    starts = []
    original = sampler._start
    monkeypatch.setattr(sampler, "_start", lambda *a, **k: (starts.append(1), original(*a, **k))[1])
    with torch.no_grad():
        torch.manual_seed(11)
        first = sampler.generate(prompts, [0, 1, 2, 3], 5, temperature=1.0)
        grown = {k: prompts[k] + first[k] + enc(" It is dark.") for k in (0, 2)}
        second = sampler.generate([grown[0], grown[2]], [0, 2], 4, temperature=1.0)   # 1 and 3 finished
        assert sorted(sampler.finished) == [1, 3]
        ask = enc(" Write a tip.")
        later = [prompts[3] + first[3] + ask,                                   # finished, continued
                 before_tip + enc(" Open") + first[1] + ask,                     # the tip removed
                 grown[0] + second[0] + ask,                                    # still in the batch
                 head + enc("A new episode")]                                  # never seen
        fed, forward = [], sampler.decoder.forward
        monkeypatch.setattr(sampler.decoder, "forward", lambda block, valid, rows=None: (fed.append(int(valid.sum())),
                                                                                         forward(block, valid, rows))[1])
        torch.manual_seed(12)
        third = sampler.generate(later, [3, 1, 0, 9], 6, temperature=1.0)
    assert len(starts) == 1                                                     # the first call only
    assert third == sample_without_cache(tiny_policy, later, 6, 1.0, seed=12)
    assert list(sampler.finished) == [2]                                        # episode 2 left; 1 and 3 were continued
    # only what each row's cache lacks was encoded, then 5 sampled tokens per row fed back
    reused = [len(prompts[3]) + len(first[3]) - 1, len(before_tip), len(grown[0]) + len(second[0]) - 1, len(head)]
    assert sum(fed) == sum(len(p) - n for p, n in zip(later, reused)) + 4 * 5


def test_keep_freed_memory_keeps_a_freed_block_resident():
    """In a fresh process (glibc's thresholds untouched by other tests): a freed 64 MB tensor goes back
    to the system (resident memory drops), so the next one faults its pages in again; after
    keep_freed_memory() it stays in the process."""
    import platform
    import subprocess
    import sys
    from pathlib import Path
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        pytest.skip("keep_freed_memory acts on Linux with glibc only")
    script = """
import sys
sys.path[:0] = sys.argv[1:3]
from conftest import freed_resident_bytes
from sampler import keep_freed_memory
default = freed_resident_bytes()
assert keep_freed_memory()
freed_resident_bytes()   # the first block may still come from a fresh mapping
print(default, freed_resident_bytes())
"""
    tests = Path(__file__).resolve().parent
    out = subprocess.run([sys.executable, "-c", script, str(tests.parent), str(tests)],
                         capture_output=True, text=True, check=True).stdout.split()
    default, kept = map(int, out)
    assert default > 48 << 20
    assert kept < 8 << 20
