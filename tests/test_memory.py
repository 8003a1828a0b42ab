"""TipMemory and NoveltyCounter semantics (the public API that notebooks and course assignments call), and the real embedder."""
import json

import numpy as np
import pytest

from memory import Embedder, NoveltyCounter, TipMemory
from utils import write_atomically


def unit(*xs, dim=384):
    v = np.zeros(dim, dtype=np.float32)
    v[:len(xs)] = xs
    return v / np.linalg.norm(v)


def test_retrieve_threshold_order_and_top_k():
    mem = TipMemory(threshold=0.5, top_k=2)
    q = unit(1, 0)
    mem.add("t", unit(1, 0), "exact, low score", 0.1)
    mem.add("t", unit(1, 1), "cos 0.707, high score", 0.9)
    mem.add("t", unit(1, 2), "cos 0.447: below threshold", 1.0)
    mem.add("t", unit(2, 1), "cos 0.894, mid score", 0.5)
    mem.add("other", unit(1, 0), "another task", 5.0)
    assert mem.retrieve("t", q) == ["cos 0.707, high score", "cos 0.894, mid score"]  # top 2 by score
    mem.top_k = 10
    assert mem.retrieve("t", q) == ["cos 0.707, high score", "cos 0.894, mid score", "exact, low score"]
    assert mem.retrieve("missing", q) == []
    assert len(mem) == 5


def test_ties_in_score_prefer_the_newest_entry():
    """Before any success every tip scores 0: the newest must come first, not the untrained policy's
    oldest tips for the whole run (nor the most similar one)."""
    mem = TipMemory(top_k=2)
    mem.add("t", unit(1, 0), "oldest, most similar", 0.0)
    mem.add("t", unit(1, 1), "middle", 0.0)
    mem.add("t", unit(1, 1), "newest", 0.0)
    assert mem.retrieve("t", unit(1, 0)) == ["newest", "middle"]
    mem.add("t", unit(1, 1), "a success", 1.0)
    assert mem.retrieve("t", unit(1, 0)) == ["a success", "newest"]


def test_duplicates_stored_once_and_capacity_drops_oldest():
    mem = TipMemory(capacity=3)
    assert mem.add("t", unit(1), "a", 0.0) is True
    assert mem.add("t", unit(1), "a", 1.0) is False           # same text: not stored again
    assert mem.add("u", unit(1), "a", 1.0) is True            # per task
    for tip in "bcd":
        mem.add("t", unit(1), tip, 0.0)
    assert mem.tips["t"] == ["b", "c", "d"] and mem.keys["t"].shape == (3, 384)
    assert mem.scores["t"] == [0.0, 0.0, 0.0]
    assert mem.add("t", unit(1), "a", 0.0) is True            # "a" was dropped, so it is new again


def test_save_load_round_trip_is_exact(tmp_path):
    mem = TipMemory(threshold=0.3, top_k=4, capacity=7)
    rng = np.random.default_rng(0)
    for k in range(5):
        mem.add(f"task{k % 2}", unit(*rng.normal(size=8)), f"tip {k} ünïcode", float(k) / 3)
    mem.save(tmp_path / "m.json")
    back = TipMemory.load(tmp_path / "m.json")
    assert (back.threshold, back.top_k, back.capacity) == (0.3, 4, 7)
    assert back.tips == mem.tips and back.scores == mem.scores
    for tid in mem.keys:
        np.testing.assert_array_equal(back.keys[tid], mem.keys[tid])
    assert "pickle" not in (tmp_path / "m.json").read_text()
    json.loads((tmp_path / "m.json").read_text())  # plain JSON


def test_corrupt_memory_file_names_the_file(tmp_path):
    path = tmp_path / "memory.json"
    mem = TipMemory()
    mem.add("t", unit(1), "a", 0.0)
    mem.save(path)
    path.write_text(path.read_text()[:40])  # truncated
    with pytest.raises(ValueError, match="memory.json"):
        TipMemory.load(path)
    path.write_text(json.dumps({"threshold": 0.5}))
    with pytest.raises(ValueError, match="memory.json"):
        TipMemory.load(path)
    with pytest.raises(FileNotFoundError, match="nope.json"):
        TipMemory.load(tmp_path / "nope.json")


def test_write_atomically_keeps_old_file_when_writing_fails(tmp_path, monkeypatch):
    path = tmp_path / "f.json"
    write_atomically(path, "old")

    def boom(*a, **k):
        raise OSError("disk full")
    monkeypatch.setattr("os.replace", boom)
    with pytest.raises(OSError):
        write_atomically(path, "new")
    assert path.read_text() == "old"


def test_novelty_counter_counts_similar_states_including_itself(tmp_path):
    nov = NoveltyCounter(threshold=0.9)
    assert nov.visit("t", unit(1, 0)) == 1
    assert nov.visit("t", unit(1, 0.1)) == 2      # cos 0.995 > 0.9
    assert nov.visit("t", unit(0, 1)) == 1        # new state
    assert nov.visit("u", unit(1, 0)) == 1        # other task
    assert nov.visit("t", unit(1, 0)) == 3
    assert nov.visit_many(["t", "t", "v"], np.stack([unit(0, 1), unit(0, 1), unit(0, 1)])) == [2, 2, 1]
    assert nov.visit("t", unit(0, 1)) == 4
    nov.save(tmp_path / "n.json")
    back = NoveltyCounter.load(tmp_path / "n.json")
    assert back.visit("t", unit(1, 0)) == 4 and len(back) == 10


def test_embedder_is_normalised_and_semantic():
    emb = Embedder()
    v = emb(["turn on the red light bulb", "switch on the red lamp", "the stock market fell today", ""])
    assert v.shape == (4, 384) and v.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(v, axis=1), 1.0, atol=1e-5)
    assert v[0] @ v[1] > 0.5 > v[0] @ v[2]
    # batching and the cache give the same vectors as one-at-a-time
    np.testing.assert_allclose(emb(["switch on the red lamp"])[0], v[1], atol=1e-6)
    fresh = Embedder(batch_size=1)
    np.testing.assert_allclose(fresh(["the stock market fell today"])[0], v[2], atol=1e-5)
    assert emb([]).shape == (0, 384)
