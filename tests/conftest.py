"""Shared fixtures: a tiny randomly initialised Llama (with the real SmolLM2 tokenizer and chat
template) for the maths and plumbing tests, and the real default model where behaviour matters."""
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


@pytest.fixture(scope="session", autouse=True)
def private_cache(tmp_path_factory):
    """EMPO2_CACHE in a temporary folder, so tests never read or leave warm starts and cached evaluations
    in the user's cache. The user's converted default model, if there is one, is linked in; nothing here
    loads or converts it, so tests that never touch the model (tests/test_math.py) run without it."""
    import os

    from policy import cache_dir
    real = cache_dir() / "SmolLM2-135M-Instruct"
    cache = tmp_path_factory.mktemp("empo2-cache")
    if (real / "config.json").exists():
        (cache / real.name).symlink_to(real, target_is_directory=True)
    old = os.environ.get("EMPO2_CACHE")
    os.environ["EMPO2_CACHE"] = str(cache)
    yield cache
    if old is None:
        os.environ.pop("EMPO2_CACHE", None)
    else:
        os.environ["EMPO2_CACHE"] = old


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from policy import default_model_dir
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir())
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192,
                         tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    path = tmp_path_factory.mktemp("tiny-llama")
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture()
def tiny_policy(tiny_model_dir):
    from policy import load_policy
    torch.manual_seed(0)
    return load_policy(tiny_model_dir, dtype="float32", device="cpu", lora_r=4, lora_alpha=8)


@pytest.fixture(scope="session")
def real_policy():
    from policy import load_policy
    return load_policy(dtype="float32", device="cpu")


@pytest.fixture(scope="session")
def embedder():
    from memory import Embedder
    return Embedder()



def freed_resident_bytes() -> int:
    """How much the process's resident memory drops when a 64 MB tensor (every page written) is freed:
    glibc hands it back to the system, or keeps it (sampler.keep_freed_memory). Plain, so a test's
    fresh subprocess can import it too."""
    import os

    def resident() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    x = torch.ones(16 << 20)
    before = resident()
    del x
    return before - resident()


@pytest.fixture()
def resident_bytes_freed():
    """freed_resident_bytes, for tests in this process."""
    return freed_resident_bytes
