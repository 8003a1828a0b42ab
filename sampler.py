"""Speed: how this project samples and scores fast on a CPU. Not needed to follow EMPO²: policy.py
calls it through Policy.sampling() and Policy.score(prefix=...), and each trick has a plain path
beside it that the tests compare it with.

- CachedSampler: sampling for a batch of episodes whose prompts only grow, with one KV cache kept
  across environment steps (plain path: HFDecoder, the model's own forward pass); with keep_finished,
  reflection continues each finished episode's cache (plain path: a new sampler encodes it again).
- Decoder: the forward pass of Llama-family models written out (a cache written in place, prepared
  matmuls, the LoRA update folded into its own copy of the weights).
- sample_tokens: inverse-CDF sampling, exact like torch.multinomial and faster on CPU.
- SharedPrefix: the keys and values of a prefix many trajectories share, encoded once, gradients
  included (plain path: score each trajectory from its first token).
- lora_in_base_dtype: LoRA's products in the base model's bf16 while its weights stay float32 (plain
  path: peft's own float32 LoRA computation).
- keep_freed_memory: freed memory stays in the process for the next step's tensors (plain path: the C
  library's default, which hands large blocks back to the system).
"""
from __future__ import annotations

import functools
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from policy import Policy


def with_cache(model, cache) -> dict:
    """The keyword argument that hands `cache` to model's forward pass: `cache` since transformers 5.24,
    `past_key_values` before (5.24-5.39 still accept the old name with a FutureWarning; 5.40 drops it)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return {cache_keyword(type(base)): cache}


@functools.cache
def cache_keyword(model_class) -> str:
    """with_cache's keyword for a model class, read off its forward's signature once (HFDecoder calls per step)."""
    import inspect
    return "cache" if "cache" in inspect.signature(model_class.forward).parameters else "past_key_values"


class SharedPrefix:
    """The keys and values of the tokens a set of trajectories starts with (system prompt, example turns,
    a group's task), encoded once for all of them; exact, gradients included.

    Each trajectory's forward pass (Policy.score with prefix=...) attends to leaf copies of these
    tensors, so its backward pass stops there and adds its share to their .grad; backward() then sends
    the summed share through the prefix's own graph once. Without it, every trajectory would re-encode
    (and back-propagate through) a prefix that is half of a webshop-mini episode.

        prefix = SharedPrefix(policy, sequences)   # longest common prefix that predicts no action token
        for ids, mask in sequences: logp, _ = policy.score(ids, mask, prefix=prefix); loss(logp).backward()
        prefix.backward()                          # the prefix's share of the LoRA gradient
    """

    def __init__(self, policy: "Policy", sequences: list[tuple[list[int], list[bool]]]):
        n = min(len(ids) for ids, _ in sequences) if sequences else 0
        first = sequences[0][0] if sequences else []
        for ids, mask in sequences:
            n = min(n, next((t for t, m in enumerate(mask) if m), len(ids)) - 1)  # keep the predicting position
            n = next((k for k in range(n) if ids[k] != first[k]), n)
        self.ids, self.length, self.graph, self.leaves = first[:max(n, 0)], max(n, 0), [], []
        if self.length == 0:
            return
        from transformers import DynamicCache
        cache = DynamicCache()
        with policy.lora_compute():
            policy.model(input_ids=torch.tensor([self.ids], device=policy.device), **with_cache(policy.model, cache),
                         use_cache=True, logits_to_keep=1)
        self.graph = [(layer.keys, layer.values) for layer in cache.layers]      # each (1, kv heads, n, head dim)
        grad = torch.is_grad_enabled()
        self.leaves = [(k.detach().requires_grad_(grad), v.detach().requires_grad_(grad)) for k, v in self.graph]

    def backward(self) -> None:
        """Back-propagate the gradient the trajectories left on the prefix's keys and values."""
        pairs = [(t, leaf.grad) for kv, leaves in zip(self.graph, self.leaves) for t, leaf in zip(kv, leaves)
                 if leaf.grad is not None and t.requires_grad]
        if pairs:
            torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])
        self.graph, self.leaves = [], []   # frees the graph


@contextmanager
def scoring(policy: "Policy", sequences: list[tuple[list[int], list[bool]]], temperature: float, shared: bool = True):
    """A block in which score(ids, mask) gives Policy.score's (logp, entropy) of any of `sequences`.

    shared=True: their common prefix is encoded once (SharedPrefix) and, when the block ends without an
    error, the prefix's share of the gradient is sent back through it. shared=False is the plain path
    (every sequence from its first token); both give the same log-probs and gradients (tests/test_policy.py).

        with scoring(policy, seqs, T) as score:
            for ids, mask in seqs: logp, _ = score(ids, mask); loss(logp).backward()
    """
    if not shared:
        yield lambda ids, mask: policy.score(ids, mask, temperature)
        return
    prefix = SharedPrefix(policy, sequences)
    yield lambda ids, mask: policy.score(ids, mask, temperature, prefix)
    prefix.backward()


def keep_freed_memory(enabled: bool = True) -> bool:
    """Let freed memory stay in the process (Linux with glibc; elsewhere nothing happens, returns False).

    Every decode step makes and frees tensors of several MB (a 32-row step: the logits, their softmax,
    the float64 block sums of sample_tokens, ~30 MB in all). glibc gives large freed blocks back to the
    system, so the next step gets fresh pages and the kernel must fault in and zero each 4 KB page again.
    Measured on the 2-core EPYC: sample_tokens on 32 x 49,152 logits 8.5 ms with glibc's default, 1.4 ms
    with freed memory kept; a whole 32-row decode step 1.11-1.15x faster (bench.py:
    keep_freed_memory_decode_32). The cost: the process's resident
    memory stays near its peak. enabled=False sets glibc's default thresholds again (as fixed values)."""
    import ctypes
    import ctypes.util
    import platform
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3       # mallopt's parameter numbers (malloc.h)
    mmap, trim = ((1 << 30), (1 << 31) - 1) if enabled else (128 * 1024, 128 * 1024)
    return bool(libc.mallopt(M_MMAP_THRESHOLD, mmap)) and bool(libc.mallopt(M_TRIM_THRESHOLD, trim))


@contextmanager
def lora_in_base_dtype(model, enabled: bool = True):
    """A block in which every LoRA layer multiplies in the base model's dtype (bf16 or fp16), while the
    LoRA weights themselves, their gradients and the optimiser stay float32.

    peft keeps the adapter in float32 over a bf16 base and, in each of the model's LoRA layers, casts
    the layer's input to float32, computes the update in float32 and adds it to the bf16 output in
    float32 before rounding back: three full-size float32 copies per layer and direction (measured on a
    bf16 CPU: 5-12 % of a forward + backward pass; bench.py: lora_in_base_dtype_vs_peft). Here autocast
    casts the small A and B matrices to bf16 instead and the activations are left alone; the layer's
    output is rounded to bf16 in both paths. enabled=False (or a float32 base) is the plain path.
    """
    base = model.get_input_embeddings().weight.dtype
    lora = next((p.dtype for p in model.parameters() if p.requires_grad), base)
    if not enabled or base == lora or base == torch.float32:
        yield
        return
    from peft.helpers import disable_input_dtype_casting
    with disable_input_dtype_casting(model), torch.autocast(model.device.type, dtype=base):
        yield


def sample_tokens(logits: torch.Tensor, temperature: float, uniforms: torch.Tensor | None = None,
                  block: int = 256) -> torch.Tensor:
    """One token per row of logits (B, V), drawn from softmax(logits / temperature) itself (no top-k or
    top-p truncation); temperature 0 is greedy. uniforms (B, 1) float64 in [0, 1): the draws to use
    (default: fresh ones).

    Inverse-CDF sampling: one uniform draw per row, located in the cumulative probabilities. Exact, as
    torch.multinomial is, but multinomial on CPU spends ~1.2 ms per row drawing one random number per
    vocabulary entry (measured for 8 rows of 49,152: 9.4 ms vs 0.55 ms here), at every decode step.
    The draw is located in two stages: first among the sums of blocks of `block` tokens, then inside
    the block it fell in: the same tokens as one float64 running sum over the vocabulary
    (sample_tokens_reference), which is not vectorised on CPU (bench.py: sampling_blocked_vs_running_sum).
    """
    if temperature == 0:
        return logits.argmax(-1)
    # dividing by 1 changes no bit, so it is skipped: a pass over 32 x 49,152 floats at every decode step
    probs = torch.softmax(logits.float() / temperature if temperature != 1 else logits.float(), dim=-1)   # (B, V)
    B, V = probs.shape
    blocks = -(-V // block)
    if blocks * block != V:
        probs = torch.nn.functional.pad(probs, (0, blocks * block - V))
    probs = probs.view(B, blocks, block)
    # sums in float64: a float32 running sum would lose tokens below ~1e-7 of it
    sums = probs.sum(-1, dtype=torch.float64)                                  # (B, blocks)
    ends = sums.cumsum(-1)                                                     # (B, blocks)
    if uniforms is None:
        uniforms = torch.rand(B, 1, dtype=torch.float64, device=probs.device)
    u = uniforms * ends[:, -1:]                                                # (B, 1)
    # right=True: u = 0 cannot land on a leading zero-probability token; the min: u rounded up to the
    # total cannot land past the last token that has probability
    b = torch.minimum(torch.searchsorted(ends, u, right=True), last_positive(sums))          # (B, 1)
    inside = probs[torch.arange(B, device=probs.device), b[:, 0]]              # (B, block)
    before = torch.where(b > 0, ends.gather(1, (b - 1).clamp(min=0)), torch.zeros_like(u))
    k = torch.searchsorted(inside.cumsum(-1, dtype=torch.float64) + before, u, right=True)
    return (b * block + torch.minimum(k, last_positive(inside))).squeeze(-1)


def last_positive(x: torch.Tensor) -> torch.Tensor:
    """Index (B, 1) of each row's last positive entry of x (B, N)."""
    return x.shape[-1] - 1 - (x > 0).flip(-1).byte().argmax(-1, keepdim=True)


def sample_tokens_reference(logits: torch.Tensor, temperature: float, uniforms: torch.Tensor | None = None) -> torch.Tensor:
    """sample_tokens' plain path: the same draw located in one float64 running sum over the vocabulary."""
    if temperature == 0:
        return logits.argmax(-1)
    cdf = torch.softmax(logits.float() / temperature, dim=-1).cumsum(-1, dtype=torch.float64)   # (B, V)
    if uniforms is None:
        uniforms = torch.rand(cdf.shape[0], 1, dtype=cdf.dtype, device=cdf.device)
    return torch.searchsorted(cdf, uniforms * cdf[:, -1:], right=True).squeeze(-1).clamp(max=cdf.shape[-1] - 1)


def effective_weight(linear) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(weight, bias) of what a linear layer computes: for a LoRA layer with an active, unmerged adapter,
    W + B A * scale, computed as peft's merge computes it (get_delta_weight)."""
    from peft.tuners.lora import LoraLayer
    if not isinstance(linear, LoraLayer):
        return linear.weight, linear.bias
    base = linear.get_base_layer()
    weight = base.weight
    if not linear.merged and not linear.disable_adapters:
        for name in linear.active_adapters:
            if name in linear.lora_A:
                if linear.use_dora.get(name):
                    raise NotImplementedError("DoRA adapters are not supported by Decoder")
                weight = weight + linear.get_delta_weight(name).to(weight.dtype)   # as peft merges it
    return weight, base.bias


def prepared_linear(weight: torch.Tensor, bias: torch.Tensor | None, onednn: bool = True):
    """x -> x W^T + b, prepared once for many calls. On CPU the weight is reordered once into oneDNN's
    blocked layout. In bf16 F.linear reorders it at every call (measured for the default model's
    matmuls at 32 rows: 44 vs 33 ms per decode step; the results are bit-identical). In float32
    F.linear calls MKL, which on an AMD EPYC with AVX2 took twice oneDNN's time at decode shapes
    (the 49,152-row LM head at 32 rows: 42 vs 21 ms; README, Speed); the sums are ordered differently,
    so float32 results differ from F.linear's in the last bits. onednn=False: plain F.linear (the reference).
    A CPU without oneDNN's bf16 instructions (AVX2 only) refuses to prepare bf16 weights: F.linear then."""
    mkldnn = torch.ops.mkldnn
    packable = weight.dtype == torch.float32 or (weight.dtype == torch.bfloat16 and hasattr(
        mkldnn, "_is_mkldnn_bf16_supported") and mkldnn._is_mkldnn_bf16_supported())
    if onednn and packable and weight.device.type == "cpu" and hasattr(mkldnn, "_reorder_linear_weight"):
        packed = mkldnn._reorder_linear_weight(weight.detach())
        return lambda x: mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return lambda x: torch.nn.functional.linear(x, weight, bias)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as Llama's code computes it: normalised in float32, scaled in the model's dtype. (On CPU
    torch's rms_norm is no single kernel but these same steps and more: measured slower.)"""
    h = x.float()
    return weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding of x (B, L, heads, head dim); cos, signed_sin (B, L, 1, head dim), the
    latter from signed(sin). Llama rotates as x cos + [-x2, x1] sin, x = [x1, x2]; [-x2, x1] sin is
    [x2, x1] [-s1, s2] exactly (a sign flip rounds nothing), and [x2, x1] is one roll: four ops, not seven."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * signed_sin


def signed(sin: torch.Tensor) -> torch.Tensor:
    """[-s1, s2] of sin = [s1, s2] (halves of the last dimension), computed once per forward for all layers."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor,
           prefix: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Grouped-query attention. q (B, H, L, d); k, v (B, Hkv, T, d), H = G * Hkv; bias (B, 1, G*L or 1, T),
    added to the scores (0 where a query may look, -inf where not; see fold_mask). Returns (B, L, H * d).

    The G query heads that share a key/value head are folded into its query rows, so keys and values are
    read in place, never repeated G times (what enable_gqa does on CPU: it copies them).

    prefix: keys and values (1, Hkv, P, d) that every row sees before its own T (the prompt all rows share).
    They are read once for the whole batch: all B*G*L queries of a head in one call, then each query's
    two partial attentions are joined by their log-sum-exps (softmax over P + T keys, done in two parts)."""
    B, H, L, d = q.shape
    kv_heads = k.shape[1]
    q = q.reshape(B, kv_heads, H // kv_heads * L, d)                          # rows ordered (head in group, position)
    if prefix is None:
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias)  # (B, Hkv, G*L, d)
    else:
        # the CPU flash kernel behind scaled_dot_product_attention, called directly for its log-sum-exps
        flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        own, own_lse = flash(q, k, v, attn_mask=bias)                           # (B, Hkv, G*L, d), (B, Hkv, G*L)
        shared, shared_lse = flash(q.transpose(0, 1).reshape(1, kv_heads, -1, d), *prefix)  # queries of all rows
        shared = shared.view(kv_heads, B, -1, d).transpose(0, 1)
        shared_lse = shared_lse.view(kv_heads, B, -1).transpose(0, 1)
        weight = torch.sigmoid(shared_lse - own_lse)[..., None]                  # the prefix's share of the softmax
        out = torch.lerp(own.float(), shared.float(), weight).to(q.dtype)
    return out.view(B, H, L, d).transpose(1, 2).reshape(B, L, H * d)


def fold_mask(mask: torch.Tensor, groups: int, dtype: torch.dtype) -> torch.Tensor:
    """A bool mask (B, 1, L, T), True where a query may look, as attend's additive bias: repeated for the
    `groups` query heads folded into each key/value head's rows (B, 1, G*L, T) when L > 1."""
    B, _, L, T = mask.shape
    if L > 1:
        mask = mask[:, :, None].expand(B, 1, groups, L, T).reshape(B, 1, groups * L, T)
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


class Decoder:
    """The forward pass of a Llama-family model (Llama, Qwen2: RMSNorm, rotary positions, grouped-query
    attention, SwiGLU), written out for sampling, with a key/value cache allocated ahead and written in place.

    Why not the model's own forward: at 32 rows a Hugging Face decode step spends most of its time outside
    the matmuls (bench.py: decode_tok_s_plain_*): the cache grows by concatenation at every step, the
    attention mask is rebuilt, and every layer goes through module and LoRA-wrapper overhead. Here each
    layer is four matmuls (q|k|v fused, o, gate|up fused, down) over weights copied once per sampling
    context with the LoRA update added in (so no merge is needed), and a step writes one column.

    Rows are episodes; columns are token slots. A slot may be a hole (padding of unequal rows, or a row
    that stopped sampling): `valid` masks it and positions skip it, so each row sees only its own tokens.

    A prompt every row starts with (system prompt, example exchange, a GRPO group's task) is held once, as
    a prefix in front of all rows (on CPU, see attend), not copied into each: at 32 rows of a 300-token
    prompt, reading 32 copies of its keys and values was the largest cost of a decode step after the
    matmuls (bench.py, decode_tok_s_sampler_32 vs decode_tok_s_sampler_32_distinct).

    onednn=False multiplies with plain F.linear instead of oneDNN's prepacked weights (prepared_linear):
    the reference path, which bench.py times beside the default.
    """

    FAMILIES = ("llama", "qwen2")

    @classmethod
    def supports(cls, model) -> bool:
        from peft.tuners.lora import LoraLayer
        config = model.config
        return (config.model_type in cls.FAMILIES and getattr(config, "hidden_act", "silu") == "silu"
                and not getattr(config, "use_sliding_window", False)
                and not any(isinstance(m, LoraLayer) and any(m.use_dora.values()) for m in model.modules()))

    @torch.no_grad()
    def __init__(self, model, onednn: bool = True):
        lm = model.get_base_model() if hasattr(model, "get_base_model") else model
        config, inner = lm.config, lm.model
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.eps = config.rms_norm_eps
        self.rotary, self.embed, self.final_norm = inner.rotary_emb, inner.embed_tokens.weight, inner.norm.weight
        self.lm_head = prepared_linear(effective_weight(lm.lm_head)[0], None, onednn)

        def fused(*linears):  # one matmul for several projections of the same input
            weights, biases = zip(*(effective_weight(m) for m in linears))
            bias = None if all(b is None for b in biases) else torch.cat(
                [b if b is not None else w.new_zeros(w.shape[0]) for w, b in zip(weights, biases)])
            return prepared_linear(torch.cat(weights) if len(weights) > 1 else weights[0], bias, onednn)
        self.layers = []
        for layer in inner.layers:
            attn, mlp = layer.self_attn, layer.mlp
            self.layers.append((layer.input_layernorm.weight, fused(attn.q_proj, attn.k_proj, attn.v_proj),
                                fused(attn.o_proj), layer.post_attention_layernorm.weight,
                                fused(mlp.gate_proj, mlp.up_proj), fused(mlp.down_proj)))
        self.dtype, self.device = self.embed.dtype, self.embed.device
        self.share_prefix = self.device.type == "cpu"   # attend's two-part softmax uses the CPU flash kernel
        self.prefix = None               # (keys, values) of the shared prompt, (layers, 1, kv heads, P, head dim) each
        self.keys = self.values = None   # (layers, rows, kv heads, capacity, head dim), after the prefix
        self.valid = None                # (rows, capacity) bool: slots that hold a token
        self.next_position = None        # (rows,) position of each row's next token
        self.length = 0                  # slots in use

    def reset(self, rows: int, capacity: int = 256) -> None:
        shape = (len(self.layers), rows, self.kv_heads, capacity, self.head_dim)
        # zeros, not empty: a slot left unwritten (a hole) must hold finite numbers, since a masked
        # attention weight of 0 times a NaN left in memory is NaN
        self.keys = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.values = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.valid = torch.zeros((rows, capacity), dtype=torch.bool, device=self.device)
        self.next_position = torch.zeros(rows, dtype=torch.long, device=self.device)
        self.length = 0
        self.prefix = None

    def repeat(self, rows: int) -> None:
        """The one row held becomes what `rows` rows start from (a prefix encoded once for all episodes):
        kept once as the shared prefix, or (off CPU) copied to every row."""
        if self.share_prefix and self.prefix is None and self.length and bool(self.valid[0, :self.length].all()):
            P = self.length
            prefix = tuple(t[:, :, :, :P].clone() for t in (self.keys, self.values))
            position = self.next_position.expand(rows).contiguous()
            self.reset(rows, capacity=self.valid.shape[1] - P)   # empty per-row caches after the prefix
            self.prefix, self.next_position = prefix, position
            return
        self.keys, self.values = (t.expand(-1, rows, -1, -1, -1).contiguous() for t in (self.keys, self.values))
        self.valid = self.valid.expand(rows, -1).contiguous()
        self.next_position = self.next_position.expand(rows).contiguous()

    def select(self, rows: torch.Tensor) -> None:
        """Keep these rows, in this order (finished episodes leave)."""
        self.keys, self.values = self.keys[:, rows], self.values[:, rows]
        self.valid, self.next_position = self.valid[rows], self.next_position[rows]

    def save_rows(self, rows) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """A copy of each row's own keys and values (after the shared prefix), holes left out, in token
        order: (layers, kv heads, n, head dim) each. Exact: a key carries its position (rotated in), not its slot."""
        saved = []
        for r in rows:
            keep = self.valid[r, :self.length].nonzero().squeeze(-1)
            saved.append((self.keys[:, r][:, :, keep], self.values[:, r][:, :, keep]))
        return saved

    def load_rows(self, saved: list[tuple[torch.Tensor, torch.Tensor] | None], capacity: int) -> None:
        """A new batch after the same shared prefix: row i starts from saved[i] (save_rows' keys and values,
        or a leading part of them; None: nothing after the prefix)."""
        prefix = self.prefix
        start = 0 if prefix is None else prefix[0].shape[3]
        lengths = [0 if s is None else s[0].shape[2] for s in saved]
        self.reset(len(saved), capacity=max(capacity, max(lengths) + 1))
        self.prefix = prefix
        for i, (s, n) in enumerate(zip(saved, lengths)):
            if n:
                self.keys[:, i, :, :n], self.values[:, i, :, :n] = s
                self.valid[i, :n] = True
        self.next_position = torch.tensor(lengths, device=self.device) + start
        self.length = max(lengths)

    def _reserve(self, slots: int) -> None:
        """Room for `slots` more columns; grows by half again (amortised: a copy now and then, not per step)."""
        capacity = self.valid.shape[1]
        if self.length + slots <= capacity:
            return
        grown = max(self.length + slots, capacity * 3 // 2)
        pad = grown - capacity
        self.keys, self.values = (torch.nn.functional.pad(t, (0, 0, 0, pad)) for t in (self.keys, self.values))
        self.valid = torch.nn.functional.pad(self.valid, (0, pad))

    def forward(self, block: torch.Tensor, block_valid: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """Append block (B, L) of token ids, block_valid (B, L) bool, to the cache; returns the logits of the
        block's last column (B, V) in float32. With rows (B,) indices, the block belongs to those rows only
        and only they are computed (their keys and values gathered, a copy): the other rows get holes."""
        B, L = block.shape
        self._reserve(L)
        T0, T = self.length, self.length + L
        at = slice(None) if rows is None else rows
        self.valid[at, T0:T] = block_valid
        positions = self.next_position[at][:, None] + block_valid.long().cumsum(-1) - 1   # holes do not count
        self.next_position[at] += block_valid.sum(-1)
        mask = self.valid[at, :T][:, None, None, :]                                     # (B, 1, 1, T)
        if L > 1:  # causal inside the block; a hole still sees itself, so no query row is all masked (NaN)
            query = torch.arange(T0, T, device=self.device)[:, None]
            key = torch.arange(T, device=self.device)[None, :]
            mask = (mask & (key <= query)) | (key == query)                              # (B, 1, L, T)
        bias = fold_mask(mask, self.heads // self.kv_heads, self.dtype)                 # (B, 1, G*L or 1, T)
        x = torch.nn.functional.embedding(block, self.embed)                            # (B, L, D)
        cos, sin = self.rotary(x, positions.clamp(min=0))                                # (B, L, d) each
        cos, sin = cos[:, :, None], signed(sin)[:, :, None]
        H, Hkv, d = self.heads, self.kv_heads, self.head_dim
        for i, (norm1, qkv, o, norm2, gate_up, down) in enumerate(self.layers):
            qk, v = qkv(rms_norm(x, norm1, self.eps)).split([(H + Hkv) * d, Hkv * d], dim=-1)
            q, k = rotate(qk.view(B, L, H + Hkv, d), cos, sin).transpose(1, 2).split([H, Hkv], dim=1)
            self.keys[i, at, :, T0:T] = k                                               # (B, Hkv, L, d)
            self.values[i, at, :, T0:T] = v.view(B, L, Hkv, d).transpose(1, 2)
            prefix = None if self.prefix is None else (self.prefix[0][i], self.prefix[1][i])
            x = x + o(attend(q, self.keys[i, at, :, :T], self.values[i, at, :, :T], bias, prefix))
            gate, up = gate_up(rms_norm(x, norm2, self.eps)).chunk(2, dim=-1)
            x = x + down(torch.nn.functional.silu(gate) * up)
        self.length = T
        return self.lm_head(rms_norm(x[:, -1].contiguous(), self.final_norm, self.eps)).float()


class HFDecoder:
    """Decoder's interface over the model's own forward and a DynamicCache: for architectures Decoder does
    not write out. Sampled inside Policy.merged_lora (the LoRA update folded into the weights)."""

    def __init__(self, model, pad_id: int = 0):
        self.model, self.pad_id, self.cache, self.valid = model, pad_id, None, None

    def reset(self, rows: int, capacity: int = 0) -> None:
        from transformers import DynamicCache
        self.cache = DynamicCache()
        self.valid = torch.zeros((rows, 0), dtype=torch.bool, device=next(self.model.parameters()).device)

    def repeat(self, rows: int) -> None:
        self.cache.batch_repeat_interleave(rows)
        self.valid = self.valid.expand(rows, -1)

    def select(self, rows: torch.Tensor) -> None:
        self.cache.batch_select_indices(rows)
        self.valid = self.valid[rows]

    def forward(self, block: torch.Tensor, block_valid: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        if rows is not None:  # every row is computed: the others get a hole
            full = torch.full((self.valid.shape[0], block.shape[1]), self.pad_id, dtype=block.dtype, device=block.device)
            full_valid = torch.zeros_like(full, dtype=torch.bool)
            full[rows], full_valid[rows] = block, block_valid
            return self.forward(full, full_valid)[rows]
        self.valid = torch.cat([self.valid, block_valid], dim=1)           # (B, T), T includes the block
        L, T = block.shape[1], self.valid.shape[1]
        positions = (self.valid.cumsum(-1) - 1).clamp(min=0)[:, -L:]        # holes do not count
        attention = self.valid.long()
        if self.model.config._attn_implementation == "sdpa":
            # the (B, 1, L, T) mask built here: given none, transformers asks SDPA for enable_gqa, which on
            # CPU copies the shared key/value heads (measured per layer, 8 rows x 300 tokens: 1.55 vs 0.29 ms)
            query = torch.arange(T - L, T, device=block.device)[:, None]
            key = torch.arange(T, device=block.device)[None, :]
            attention = (self.valid[:, None, None, :] & (key <= query)) | (key == query)
        # an index tensor, not logits_to_keep=1: the strided last-column slice of a (B>1, L, d) batch
        # makes the LM head's matmul copy its weight B times (measured: 0.95 of 1.6 s on CPU)
        last = torch.tensor([L - 1], device=block.device)
        out = self.model(input_ids=block, attention_mask=attention, position_ids=positions,
                         **with_cache(self.model, self.cache), use_cache=True, logits_to_keep=last)
        return out.logits[:, -1].float()


def holes_first(parts: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of unequal length as one block (B, W) of token ids and its valid mask (B, W) bool, the holes
    on the left: every row's last token is in the last column, whose logits the decoder returns."""
    width = max(map(len, parts))
    block = torch.full((len(parts), width), pad, dtype=torch.long)
    block_valid = torch.zeros((len(parts), width), dtype=torch.bool)
    for row, part in enumerate(parts):
        block[row, width - len(part):], block_valid[row, width - len(part):] = torch.tensor(part, dtype=torch.long), True
    return block, block_valid


class CachedSampler:
    """Sampling for a batch of episodes whose prompts only grow, with one KV cache kept across calls.

    Each call feeds only the tokens a row gained since the last call (the previous action's last token,
    the new observation), so a 15-step episode is not re-encoded 15 times. On the first call the
    prefix all rows share (system prompt, example exchange, and for a GRPO group the whole task) is
    encoded once and copied. Rows are named by episode ids; an id missing from a later call drops out of
    the cache (a finished episode); cached_ids[row] are the tokens whose keys and values the cache holds.
    Padding of unequal rows leaves masked holes in the cache, never in the rows' token ids, which are
    exactly the ones sampled. Used through Policy.sampling().

    keep_finished: a finished episode's cache is kept aside instead of dropped, so a later call can
    continue it (reflection writes a tip after the episode without re-encoding it). A call whose
    prompts do not all extend their rows resumes each row from the cached tokens its prompt starts with
    (a row of the batch, a finished episode, or the shared prefix alone): e.g. an episode re-read
    without its tips keeps its cache up to the first tip. The plain path beside it: a new sampler, which
    encodes every prompt from its first token.
    """

    # Decode only the rows still sampling once at most this share of the batch is: gathering their keys
    # and values costs about what attending over them does, so it pays below one half
    GATHER_BELOW = 0.5
    # _feed_down_to_common: rounds of at least this many tokens (fewer rounds, each with fewer holes than this)
    FEED_STEP = 64

    def __init__(self, policy: "Policy", decoder=None, keep_finished: bool = False):
        self.policy, self.episode_ids, self.cached_ids, self.started = policy, [], [], False
        self.decoder = decoder if decoder is not None else (
            Decoder(policy.model) if Decoder.supports(policy.model) else HFDecoder(policy.model, policy.tokenizer.pad_token_id))
        self.keep_finished = keep_finished and hasattr(self.decoder, "save_rows")
        self.finished = {}       # episode id -> (its saved keys and values, the ids they hold): keep_finished only
        self.prefix_ids = []     # the tokens of the decoder's shared prefix (none when rows hold their own copy)

    def _start(self, prompts: list[list[int]], episode_ids: list, room: int):
        shared = min(len(p) for p in prompts) - 1  # every row keeps >= 1 token of its own to feed
        for k in range(shared):
            if any(p[k] != prompts[0][k] for p in prompts):
                shared = k
                break
        self.episode_ids, self.cached_ids, self.started = list(episode_ids), [prompts[0][:shared]] * len(prompts), True
        self.decoder.reset(1, capacity=max(len(p) for p in prompts) + room)
        if shared:
            ids = torch.tensor([prompts[0][:shared]], device=self.policy.device)
            self.decoder.forward(ids, torch.ones_like(ids, dtype=torch.bool))
        self.decoder.repeat(len(prompts))
        self.prefix_ids = prompts[0][:shared] if getattr(self.decoder, "prefix", None) is not None else []
        self.finished = {}

    def _resume(self, prompts: list[list[int]], episode_ids: list, room: int) -> bool:
        """Continue each prompt from the longest run of cached tokens it starts with (its row, its finished
        episode, or only the shared prefix); False, nothing changed, if a prompt lacks the shared prefix.
        Rows with more new tokens than the others are fed their extra part first (_feed_down_to_common)."""
        P = len(self.prefix_ids)
        if not self.keep_finished or any(len(p) <= P or p[:P] != self.prefix_ids for p in prompts):
            return False
        held = dict(zip(self.episode_ids, zip(self.decoder.save_rows(range(len(self.episode_ids))), self.cached_ids)))
        held.update(self.finished)
        saved, cached = [], []
        for p, e in zip(prompts, episode_ids):
            kv, ids = held.get(e, (None, self.prefix_ids))
            n = next((k for k, (a, b) in enumerate(zip(ids, p[:-1])) if a != b), min(len(ids), len(p) - 1))
            n = n if kv is not None and n > P else P     # every row keeps >= 1 token of its own to feed
            saved.append(None if n == P else (kv[0][:, :, :n - P], kv[1][:, :, :n - P]))
            cached.append(p[:n])
            self.finished.pop(e, None)
        self.finished.update({e: held[e] for e in self.episode_ids if e not in episode_ids})  # rows this call leaves out
        self.decoder.load_rows(saved, capacity=max(map(len, prompts)) - P + room)
        self.episode_ids, self.cached_ids = list(episode_ids), cached
        self._feed_down_to_common(prompts)
        return True

    def _feed_down_to_common(self, prompts: list[list[int]]) -> None:
        """Feed rows that have more new tokens than the others until all have the same number left, so the
        call's common block has no holes (one 900-token prompt among short ones would otherwise make every
        row compute 900 columns). Each round takes the rows with the most left down to the next level at
        least FEED_STEP tokens lower: a row pads fewer than FEED_STEP holes per round."""
        pad, device, step = self.policy.tokenizer.pad_token_id, self.policy.device, self.FEED_STEP
        while True:
            left = [len(p) - len(c) for p, c in zip(prompts, self.cached_ids)]
            if max(left) == min(left):
                return
            level = max([n for n in left if n <= max(left) - step] or [min(left)])
            rows = [i for i, n in enumerate(left) if n > level]
            block, block_valid = holes_first([prompts[i][len(self.cached_ids[i]):len(prompts[i]) - level] for i in rows], pad)
            for i in rows:
                self.cached_ids[i] = prompts[i][:len(prompts[i]) - level]
            self.decoder.forward(block.to(device), block_valid.to(device), torch.tensor(rows, device=device))

    def stop_tables(self, vocab: int, stop_at_newline: bool) -> tuple[torch.Tensor, ...]:
        """Bool tensors (vocab,): stop tokens, and the token kinds of Policy.token_kinds (all False
        without stop_at_newline), so the stop test of a decode step is four lookups for every row."""
        key = (vocab, stop_at_newline)
        if getattr(self, "_tables_key", None) != key:
            sets = [self.policy.stop_ids, *(self.policy.token_kinds if stop_at_newline else ((), (), ()))]
            tables = []
            for ids in sets:
                table = torch.zeros(vocab, dtype=torch.bool)
                table[[i for i in ids if i < vocab]] = True
                tables.append(table.to(self.policy.device))
            self._tables_key, self._tables = key, tuple(tables)
        return self._tables

    @torch.inference_mode()   # no_grad and no version counters: measured ~3 ms less per 32-row decode step
    def generate(self, prompts: list[list[int]], episode_ids: list, max_new_tokens: int, temperature: float,
                 stop_at_newline: bool = False) -> list[list[int]]:
        """Sample a continuation of each prompt (temperature 0: greedy), stopping at an end-of-turn
        token or, with stop_at_newline, at the first newline after some text (an action is one line)."""
        if not prompts:
            return []
        policy, device = self.policy, self.policy.device
        rows = [self.episode_ids.index(k) if k in self.episode_ids else -1 for k in episode_ids]
        if not self.started or -1 in rows or any(
                len(self.cached_ids[r]) >= len(p) or p[:len(self.cached_ids[r])] != self.cached_ids[r] for r, p in zip(rows, prompts)):
            if not (self.started and self._resume(prompts, episode_ids, room=max_new_tokens)):
                self._start(prompts, episode_ids, room=max_new_tokens)
            rows = list(range(len(prompts)))
        if rows != list(range(len(self.episode_ids))):  # finished episodes leave the batch
            if self.keep_finished:
                gone = [r for r in range(len(self.episode_ids)) if r not in rows]
                for r, kv in zip(gone, self.decoder.save_rows(gone)):
                    self.finished[self.episode_ids[r]] = (kv, self.cached_ids[r])
            self.decoder.select(torch.tensor(rows, device=device))
            self.cached_ids, self.episode_ids = [self.cached_ids[r] for r in rows], list(episode_ids)
        pad = policy.tokenizer.pad_token_id
        block, block_valid = holes_first([p[len(f):] for p, f in zip(prompts, self.cached_ids)], pad)
        was_training = policy.model.training
        policy.model.eval()
        try:
            logits = self.decoder.forward(block.to(device), block_valid.to(device))       # (B, V)
            stop, newline, newline_after_text, text = self.stop_tables(logits.shape[-1], stop_at_newline)
            B = len(prompts)
            out = torch.empty((B, max_new_tokens), dtype=torch.long, device=device)
            lengths = torch.zeros(B, dtype=torch.long, device=device)
            has_text = torch.zeros(B, dtype=torch.bool, device=device)
            rows = torch.arange(B, device=device)                 # the rows still sampling; logits: (len(rows), V)
            for step in range(max_new_tokens):
                # one draw per row at every step, sampling or not: the draws of a row do not depend on the others
                uniforms = torch.rand(B, 1, dtype=torch.float64, device=device) if temperature else None
                tokens = sample_tokens(logits, temperature, None if uniforms is None else uniforms[rows])
                out[rows, step] = tokens
                lengths[rows] += 1
                ended = stop[tokens] | (newline[tokens] & (has_text[rows] | newline_after_text[tokens]))
                has_text[rows] |= text[tokens]
                if step == max_new_tokens - 1 or ended.all():
                    break
                rows, tokens = rows[~ended], tokens[~ended]
                if len(rows) <= self.GATHER_BELOW * B:
                    logits = self.decoder.forward(tokens[:, None], torch.ones_like(tokens[:, None], dtype=torch.bool), rows)
                else:   # all rows; those that stopped get a hole
                    feed = torch.full((B, 1), pad, dtype=torch.long, device=device)
                    live = torch.zeros((B, 1), dtype=torch.bool, device=device)
                    feed[rows, 0], live[rows, 0] = tokens, True
                    logits = self.decoder.forward(feed, live)
                    logits = logits[rows] if len(rows) < B else logits   # indexing copies all the logits
        finally:
            policy.model.train(was_training)
        out = [row[:n] for row, n in zip(out.tolist(), lengths.tolist())]
        self.cached_ids = [p + o[:-1] for p, o in zip(prompts, out)]  # the last sampled token is not in the cache yet
        return out
