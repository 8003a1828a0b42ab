"""Throwaway timing kept for provenance (README, Speed, sixth session): one layer's attention at a 32-row
decode step of the default model's shapes (9 query and 3 key/value heads of 64, a 300-token prompt held
once, 24 own slots per row), bf16: the CPU flash kernel sampler.attend calls, against the same done with
batched products and a float32 softmax. Prints JSON: microseconds per call, best-effort means of 200 calls."""
import json
import time

import torch

torch.manual_seed(0)
B, H, Hkv, d, P, T = 32, 9, 3, 64, 300, 24
G, dt, scale = H // Hkv, torch.bfloat16, 64 ** -0.5
q = torch.randn(B, Hkv, G, d, dtype=dt)
k, v = torch.randn(B, Hkv, 256, d, dtype=dt)[:, :, :T], torch.randn(B, Hkv, 256, d, dtype=dt)[:, :, :T]
pk, pv = torch.randn(1, Hkv, P, d, dtype=dt), torch.randn(1, Hkv, P, d, dtype=dt)
bias = torch.zeros(B, 1, 1, T, dtype=dt)
flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def timed(f, n=200):
    f()
    t = time.perf_counter()
    for _ in range(n):
        f()
    return round((time.perf_counter() - t) / n * 1e6, 1)


def own_products():
    s = torch.matmul(q, k.transpose(-1, -2)).float() * scale + bias
    lse = torch.logsumexp(s, -1)
    return torch.matmul(torch.exp(s - lse[..., None]).to(dt), v), lse


def shared_products():
    qq = q.transpose(0, 1).reshape(Hkv, B * G, d)
    s = torch.bmm(qq, pk[0].transpose(-1, -2)).float() * scale
    lse = torch.logsumexp(s, -1)
    return torch.bmm(torch.exp(s - lse[..., None]).to(dt), pv[0]), lse


print(json.dumps({
    "threads": torch.get_num_threads(),
    "own_keys_flash_us": timed(lambda: flash(q, k, v, attn_mask=bias)),
    "shared_prompt_flash_us": timed(lambda: flash(q.transpose(0, 1).reshape(1, Hkv, -1, d), pk, pv)),
    "own_keys_products_us": timed(own_products),
    "shared_prompt_products_us": timed(shared_products)}, indent=1))
