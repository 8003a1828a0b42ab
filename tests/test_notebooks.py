"""The walkthrough notebooks (notebooks/*.ipynb).

- Stored notebooks carry no outputs (commit-ready) and open with a markdown cell naming the paper's steps.
- Each one executes top to bottom with nbclient (kernel python3, working directory notebooks/) without an
  error and prints its known markers; its exercise check skips cleanly while the stub is not filled in.
- Each exercise check passes with a correct answer and fails (AssertionError) with a wrong one.
- Every Config value a notebook quotes in its text (`cfg.x` = 5, `cfg.x` (0.9)) equals the value the
  notebook's own Config has (Config's default unless the notebook's `Config(...)` call sets it).
- Notebook 4's "longer runs on disk" cell plots runs when there are some and says so when there are none.

The four executions use the real default model: about 1-2 min each on 2 CPU cores. All eight kernel runs
(four notebooks, four exercise checks) go two at a time, each kernel on one thread (the `kernel_runs` fixture).
"""
import ast
import dataclasses
import json
import os
import re
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

ROOT = Path(__file__).resolve().parents[1]
NB_DIR = ROOT / "notebooks"

# notebook -> strings its executed outputs must contain
MARKERS = {
    "01_rollout.ipynb": ["action tokens:", "tokens below log δ", "NOTEBOOK 01 DONE"],
    "02_memory_and_reflection.ipynb": ["stored again: 0 tips", "<tip>", "r_int = 0.100", "retrieval at the first observation returns:",
                                       "success, shuffled tips", "NOTEBOOK 02 DONE"],
    "03_hybrid_update.ipynb": ["identical ids in both: True", "optimiser steps in", "NOTEBOOK 03 DONE"],
    "04_empo2_vs_grpo.ipynb": ["EMPO² run:", "GRPO run:", "memory.json:", "Found 2 run(s)", "NOTEBOOK 04 DONE"],
}
NOT_DONE = "EXERCISE NOT DONE YET"
PASSED = "EXERCISE PASSED"

# notebook -> (a correct answer, a wrong answer) for the exercise stub; both replace the stub cell
SOLUTIONS = {
    "01_rollout.ipynb": ('''
def my_tokens(segments, with_tips=True):
    ids, mask = [], []
    for kind, seg in segments:
        if kind != "tip" or with_tips:
            ids += list(seg)
            mask += [kind == "action"] * len(seg)
    return ids, mask
''', '''
def my_tokens(segments, with_tips=True):  # wrong: always keeps the tips
    return [i for _, s in segments for i in s], [k == "action" for k, s in segments for _ in s]
'''),
    "02_memory_and_reflection.ipynb": ('''
def my_retrieve(keys, tips, scores, query, threshold=0.5, top_k=10):
    sims = keys @ query
    hits = [i for i in range(len(tips)) if sims[i] > threshold]
    hits.sort(key=lambda i: (-scores[i], -i))
    return [tips[i] for i in hits[:top_k]]
''', '''
def my_retrieve(keys, tips, scores, query, threshold=0.5, top_k=10):  # wrong: orders by similarity
    sims = keys @ query
    hits = sorted((i for i in range(len(tips)) if sims[i] > threshold), key=lambda i: -sims[i])
    return [tips[i] for i in hits[:top_k]]
'''),
    "03_hybrid_update.ipynb": ('''
def my_grpo_advantages(returns, group_ids):
    returns = torch.as_tensor(returns, dtype=torch.float32)
    adv = torch.zeros_like(returns)
    for g in set(group_ids):
        idx = [i for i, gid in enumerate(group_ids) if gid == g]
        r = returns[idx]
        mean, std = (r.mean(), r.std()) if len(idx) > 1 else (0.0, 1.0)
        adv[idx] = (r - mean) / (std + 1e-6)
    return adv
''', '''
def my_grpo_advantages(returns, group_ids):  # wrong: biased std
    returns = torch.as_tensor(returns, dtype=torch.float32)
    adv = torch.zeros_like(returns)
    for g in set(group_ids):
        idx = [i for i, gid in enumerate(group_ids) if gid == g]
        r = returns[idx]
        adv[idx] = (r - r.mean()) / (r.std(unbiased=False) + 1e-6) if len(idx) > 1 else r
    return adv
'''),
    "04_empo2_vs_grpo.ipynb": ('''
def no_signal_fraction(returns, group_size):
    groups = returns.reshape(-1, group_size)
    return float((groups.max(dim=1).values == groups.min(dim=1).values).float().mean())
''', '''
def no_signal_fraction(returns, group_size):  # wrong: counts the groups WITH a signal
    return float((returns.reshape(-1, group_size).std(dim=1) > 1e-6).float().mean())
'''),
}


def read(name):
    return nbformat.read(NB_DIR / name, as_version=4)


def execute(nb, allow_errors=False, timeout=900, env=None):
    """Run nb in a fresh kernel (working directory notebooks/); env: the kernel's environment (default: ours)."""
    client = nbclient.NotebookClient(nb, timeout=timeout, kernel_name="python3", allow_errors=allow_errors,
                                     resources={"metadata": {"path": str(NB_DIR)}})
    client.execute(**({} if env is None else {"env": env}))
    return nb


def cell_text(cell) -> str:
    parts = []
    for out in cell.get("outputs", []):
        if out.output_type == "stream":
            parts.append(out.text)
        elif out.output_type in ("execute_result", "display_data"):
            parts.append(str(out.data.get("text/plain", "")))
        elif out.output_type == "error":
            parts.append(f"{out.ename}: {out.evalue}")
    return "".join(parts)


def errors(cell) -> list:
    return [out for out in cell.get("outputs", []) if out.output_type == "error"]


def tagged(nb, tag):
    cells = [c for c in nb.cells if tag in c.metadata.get("tags", [])]
    assert len(cells) == 1, f"expected one cell tagged {tag!r}, found {len(cells)}"
    return cells[0]


def write_fake_runs(folder: Path) -> None:
    """Two small runs as train.py writes them: config.json, metrics.jsonl, eval.json."""
    for name, algo in (("rooms-empo2", "empo2"), ("rooms-grpo", "grpo")):
        run = folder / name
        run.mkdir(parents=True)
        (run / "config.json").write_text(json.dumps({"env": "rooms", "algo": algo}))
        rows = [{"iteration": i, "reward_ext": i / 30, "success_rate": i / 30, "entropy": 1.0} for i in range(30)]
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        ev = {"score": 10.0, "score_ci95": 1.0, "success_rate": 10.0, "success_ci95": 1.0}
        (run / "eval.json").write_text(json.dumps({"untrained": ev, "trained": ev}))


# ----------------------------------------------------------------------------------------
def test_the_four_notebooks_are_there():
    assert sorted(p.name for p in NB_DIR.glob("*.ipynb")) == sorted(MARKERS)


@pytest.mark.parametrize("name", sorted(MARKERS))
def test_stored_without_outputs_and_well_formed(name):
    nb = read(name)
    nbformat.validate(nb)
    assert nb.metadata["kernelspec"]["name"] == "python3"
    assert nb.cells[0].cell_type == "markdown" and "step" in nb.cells[0].source.lower()
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, f"{name}: outputs not stripped"
    setup = tagged(nb, "setup")
    assert setup is next(c for c in nb.cells if c.cell_type == "code") and "from nbsetup import" in setup.source
    assert "NotImplementedError" in tagged(nb, "exercise-stub").source
    assert NOT_DONE in tagged(nb, "exercise-check").source


QUOTE = re.compile(r"`cfg\.(\w+)`\)?(?: = | \()([−-]?\d+(?:\.\d+)?(?:e[−-]?\d+)?)")


def quoted_config_values(source: str) -> list[tuple[str, float]]:
    return [(name, float(value.replace("−", "-"))) for name, value in QUOTE.findall(source)]


def notebook_config(nb) -> dict:
    """Config's defaults with the keyword arguments of the notebook's Config(...) call applied."""
    import empo2
    values = {f.name: f.default for f in dataclasses.fields(empo2.Config)}
    for cell in (c for c in nb.cells if c.cell_type == "code"):
        for node in ast.walk(ast.parse(cell.source.replace("%matplotlib inline", ""))):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) == "Config":
                for kw in node.keywords:   # a value computed in the notebook cannot be checked here
                    values[kw.arg] = ast.literal_eval(kw.value) if isinstance(kw.value, ast.Constant) else None
    return values


def test_the_config_quote_check_reads_quotes():
    assert quoted_config_values("c = `cfg.intrinsic_coef` = 0.1; `cfg.novelty_threshold` (0.9), `cfg.min_logp` = −5") == [
        ("intrinsic_coef", 0.1), ("novelty_threshold", 0.9), ("min_logp", -5.0)]


@pytest.mark.parametrize("name", sorted(MARKERS))
def test_config_values_quoted_in_the_text_are_configs_own(name):
    nb = read(name)
    values = notebook_config(nb)
    for cell in nb.cells:
        for field, quoted in quoted_config_values(cell.source):
            assert field in values, f"{name}: `cfg.{field}` is not a Config field"
            if values[field] is None:
                continue
            assert float(values[field]) == quoted, f"{name}: says `cfg.{field}` is {quoted}, Config has {values[field]}"


def exercise_notebook(name):
    """Only the setup cell, a right answer, the check, a wrong answer, the check (and for notebook 4 the
    runs-on-disk cell): no model is loaded."""
    nb = read(name)
    right, wrong = SOLUTIONS[name]
    check = tagged(nb, "exercise-check").source
    cells = [tagged(nb, "setup").source, right, check, wrong, check]
    if name.startswith("04"):
        cells.append(tagged(nb, "runs-on-disk").source)
    return nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(src) for src in cells], metadata=nb.metadata)


@pytest.fixture(scope="module")
def kernel_runs(tmp_path_factory):
    """Every kernel run of this file, two at a time, longest first, each kernel on one thread: on the 2-core
    EPYC the four notebooks took 122 s this way against 184 s one after another with two threads each.
    Returns (kind, name) -> (the executed notebook, seconds) or the exception its execution raised."""
    from policy import default_model_dir
    default_model_dir()   # converted once here, not by two kernels at the same time
    runs = tmp_path_factory.mktemp("nb-runs")
    write_fake_runs(runs / "runs")
    base = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    jobs = [(("notebook", name), read(name), False,
             {**base, "EMPO2_RUNS_DIR": str(runs / "runs")} if name.startswith("04") else base)
            for name in sorted(MARKERS, reverse=True)]     # 04 is the longest
    jobs += [(("exercise", name), exercise_notebook(name), True, {**base, "EMPO2_RUNS_DIR": str(runs / "no-runs-here")})
             for name in sorted(MARKERS)]

    def run(job):
        key, nb, allow_errors, env = job
        t0 = time.time()
        try:
            return key, (execute(nb, allow_errors=allow_errors, env=env), time.time() - t0)
        except Exception as e:  # noqa: BLE001 - re-raised by the test that reads it
            return key, e
    with ThreadPoolExecutor(max_workers=2) as pool:
        return dict(pool.map(run, jobs))


def kernel_run(kernel_runs, kind, name):
    result = kernel_runs[kind, name]
    if isinstance(result, Exception):
        raise result
    nb, seconds = result
    print(f"{name} ({kind}): executed in {seconds:.0f} s")
    return nb


@pytest.mark.parametrize("name", sorted(MARKERS))
def test_notebook_executes(name, kernel_runs):
    """Notebook 4 runs with EMPO2_RUNS_DIR naming a folder of two fake runs, which it must plot."""
    nb = kernel_run(kernel_runs, "notebook", name)
    assert not [e for c in nb.cells for e in errors(c)]
    text = "\n".join(cell_text(c) for c in nb.cells)
    for marker in MARKERS[name]:
        assert marker in text, f"{name}: {marker!r} missing from the outputs"
    assert NOT_DONE in cell_text(tagged(nb, "exercise-check"))
    images = sum("image/png" in o.get("data", {}) for c in nb.cells for o in c.get("outputs", []))
    assert images >= 1, f"{name}: no plot was drawn"


@pytest.mark.parametrize("name", sorted(MARKERS))
def test_exercise_check_passes_a_right_and_fails_a_wrong_answer(name, kernel_runs):
    """exercise_notebook's cells; notebook 4's runs-on-disk cell with EMPO2_RUNS_DIR naming no folder."""
    out = kernel_run(kernel_runs, "exercise", name).cells
    assert not errors(out[0]) and not errors(out[1]) and not errors(out[3])
    assert not errors(out[2]) and PASSED in cell_text(out[2]), cell_text(out[2])
    assert [e.ename for e in errors(out[4])] == ["AssertionError"], cell_text(out[4])
    if name.startswith("04"):
        assert not errors(out[5]) and "No runs found" in cell_text(out[5])
