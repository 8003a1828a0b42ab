"""evaluate.py: the main metric on a trained run, the adaptation test (tips, no weight update),
--compare (table + PNG), and bad input. One 1-iteration rooms run with the default model, made once."""
import json
import shutil
import struct

import numpy as np
import pytest

import envs
from empo2 import eval_subset
import evaluate
import train
from memory import TipMemory
from runs import read_sample_tips

TINY = ["--episodes", "2", "--max-steps", "2", "--max-new-tokens", "4", "--tip-max-new-tokens", "4"]


def strict_json(path):
    def refuse(token):
        raise ValueError(f"{path} holds {token}: not strict JSON")
    return json.loads(path.read_text(), parse_constant=refuse)


def full_checksum(policy):
    return evaluate.weights_checksum([p for _, p in sorted(policy.model.named_parameters())])


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """python train.py --env rooms --iterations 1 ... (in process), with the real default model."""
    out = tmp_path_factory.mktemp("runs")
    argv = ["--env", "rooms", "--model", "default", "--dtype", "float32", "--device", "cpu", "--iterations", "1",
            "--tasks-per-iter", "2", "--group-size", "2", "--eval-episodes", "1", "--max-steps", "2",
            "--max-new-tokens", "8", "--tip-max-new-tokens", "4", "--lr", "1e-2", "--min-logp=-1e9",
            "--warm-start-episodes", "2", "--warm-start-epochs", "1", "--out", str(out), "--name", "rooms-empo2-s0"]
    assert train.main(argv) == 0
    return out / "rooms-empo2-s0"


@pytest.fixture(scope="module")
def eval_off(run_dir):
    assert evaluate.main(["--run", str(run_dir), *TINY]) == 0
    return run_dir / "eval_test_off.json"   # the default output path


def test_eval_json_of_a_trained_run(run_dir, eval_off):
    res = strict_json(eval_off)
    s = res["settings"]
    config = json.loads((run_dir / "config.json").read_text())
    # settings: the run's env and model, temperature 0.4, no memory, the overrides
    assert (s["env"], s["split"], s["memory"], s["trials"], s["episodes"]) == ("rooms", "test", "off", 1, 2)
    assert s["temperature"] == 0.4 and s["max_steps"] == 2 and s["model"] == config["model"] == "default"
    assert (s["dtype"], s["device"]) == ("float32", "cpu")
    assert res["mode"] == "eval" and res["adapter"] == str(run_dir / "adapter")
    # N tasks spread over the split (the same as train.py evaluates), one episode each
    first = [t.task_id for t in eval_subset(envs.tasks("rooms", "test"), 2)]
    assert [t["task_id"] for t in res["per_task"]] == first
    assert [e["task_id"] for e in res["episodes"]] == first and res["n_episodes"] == 2
    for e in res["episodes"]:
        assert 1 <= e["steps"] <= 2 and 0.0 <= e["reward"] <= 1.0 and e["trial"] == 1
    # overall numbers are 100 x the episode means; one episode per task -> no per-task CI (null, not NaN)
    rewards = [e["reward"] for e in res["episodes"]]
    assert res["score"] == pytest.approx(100 * np.mean(rewards))
    assert res["success_rate"] == pytest.approx(100 * np.mean([e["won"] for e in res["episodes"]]))
    assert res["mean_steps"] == pytest.approx(np.mean([e["steps"] for e in res["episodes"]]))
    assert 0 <= res["score"] <= 100 and 0 <= res["success_rate"] <= 100 and res["score_ci95"] >= 0
    for t, e in zip(res["per_task"], res["episodes"]):
        assert t["n_episodes"] == 1 and t["score_ci95"] is None and t["score"] == pytest.approx(100 * e["reward"])
    assert len(res["trials"]) == 1 and res["trials"][0]["score"] == pytest.approx(res["score"])


def test_the_runs_adapter_is_what_gets_evaluated(run_dir, eval_off):
    """The evaluated LoRA weights are the saved adapter's, and training moved them (else the check is void)."""
    from peft import get_peft_model_state_dict
    from safetensors.torch import load_file
    saved = load_file(run_dir / "adapter" / "adapter_model.safetensors")
    policy = next(iter(evaluate.POLICY_CACHE.values()))
    live = get_peft_model_state_dict(policy.model)
    assert set(saved) == set(live)
    for k in saved:
        assert np.array_equal(saved[k].float().numpy(), live[k].detach().float().cpu().numpy()), k
    assert any(float(v.abs().max()) > 0 for k, v in saved.items() if "lora_B" in k)  # a fresh LoRA has B = 0


def test_evaluate_py_replays_the_final_evaluation_train_py_wrote(run_dir, tmp_path):
    """With the run's own settings (batch size too: the run's pool of 2 x 2), evaluate.py plays exactly the
    episodes of eval.json's "trained" evaluation, actions included."""
    out = tmp_path / "again.json"
    assert evaluate.main(["--run", str(run_dir), "--episodes", "1", "--out", str(out)]) == 0
    again, trained = strict_json(out), strict_json(run_dir / "eval.json")["trained"]
    parser, args = evaluate.parse_args(["--run", str(run_dir)])
    assert evaluate.batch_size(args, *evaluate.build_config(parser, args)) == 4   # the run's pool (1 task: 1 row used)
    keys = ("task_id", "reward", "won", "steps", "valid_steps", "actions")
    assert [{k: e[k] for k in keys} for e in again["episodes"]] == [{k: e[k] for k in keys} for e in trained["episodes"]]
    assert all(e["actions"] for e in trained["episodes"])


def test_the_main_metric_and_the_memory_off_trial_draw_alike_batch_by_batch(tiny_policy):
    """evaluate_policy (train.py's evaluations) and evaluate.py's memory-off trial 1 seed each batch the same
    way: at T = 1 over two batches of a random model, the same actions, and a different seed differs."""
    from empo2 import Config, evaluate_policy
    cfg = Config(env="rooms", seed=3, eval_temperature=1.0, max_steps=3, max_new_tokens=6, demo="off")
    tasks = eval_subset(envs.tasks("rooms", "val"), 3)
    pool = [envs.make("rooms", split="val", seed=cfg.seed + i, max_steps=3) for i in range(2)]
    main_metric = evaluate_policy(tiny_policy, pool, tasks, cfg, seed=cfg.seed)["episodes"]
    trial = evaluate.play_trials(tiny_policy, pool, tasks, cfg, 1, memory_on=False)
    assert [{k: v for k, v in r.items() if k != "trial"} for r in trial] == main_metric
    other = evaluate_policy(tiny_policy, pool, tasks, cfg, seed=cfg.seed + 1)["episodes"]
    assert [e["actions"] for e in other] != [e["actions"] for e in main_metric]


def test_adaptation_writes_tips_and_never_changes_weights(run_dir, eval_off):
    argv = ["--run", str(run_dir), "--memory", "on", "--trials", "2", *TINY]
    parser, args = evaluate.parse_args(argv)
    cfg, run = evaluate.build_config(parser, args)
    policy = evaluate.get_policy(cfg, run / "adapter")  # the object main() will use (cached)
    before = full_checksum(policy)
    assert evaluate.main(argv) == 0
    assert evaluate.get_policy(cfg, run / "adapter") is policy
    assert full_checksum(policy) == before   # every parameter, base and LoRA, bit for bit

    res = strict_json(run_dir / "eval_test_on.json")
    assert res["mode"] == "adaptation" and res["weights_unchanged"] is True
    assert [t["trial"] for t in res["trials"]] == [1, 2]
    for t in res["trials"]:
        assert t["n_episodes"] == 2 and 0 <= t["score"] <= 100
    # trial 1 starts from an empty memory; in trial 2 every episode is shown its task's tip
    assert res["trials"][0]["episodes_with_tips"] == 0 and res["trials"][1]["episodes_with_tips"] == 2
    first = [t.task_id for t in eval_subset(envs.tasks("rooms", "test"), 2)]
    memory = TipMemory.load(run_dir / "eval_test_on_memory.json")
    assert set(memory.tips) == set(first) and 2 <= len(memory) <= 4 and res["memory_size"] == len(memory)
    for t in res["per_task"]:
        assert len(t["tips"]) == 2 and all(t["tips"]) and len(t["trial_scores"]) == 2
        assert memory.tips[t["task_id"]][0].startswith(t["tips"][0])  # stored text = tip + "(score: ...)"
    # each trial's tips, read by the scripted follower with the trial as seed, on the evaluated split's tasks
    from empo2 import tip_information
    by_id = {t.task_id: t for t in envs.tasks("rooms", "test")}
    for t in res["trials"]:
        told = tip_information("rooms", [(by_id[e["task_id"]], e["tip"], e["reward"]) for e in res["episodes"]
                                         if e["trial"] == t["trial"] and e["tip"]], t["trial"], {"max_steps": 2}, "test")
        assert [t[k.split("/")[1]] for k in evaluate.TIP_INFORMATION] == [100 * told[k] for k in evaluate.TIP_INFORMATION]


def test_the_memory_off_control_runs_the_same_goals_and_seed_side_by_side(run_dir, eval_off, capsys):
    assert evaluate.main(["--run", str(run_dir), "--split", "ood", "--memory", "both", "--trials", "2", *TINY]) == 0
    off, on = (strict_json(run_dir / f"eval_ood_{m}.json") for m in ("off", "on"))
    assert off["settings"]["seed"] == on["settings"]["seed"] and off["settings"]["trials"] == on["settings"]["trials"] == 2
    for trial in (1, 2):
        goals = lambda res: [e["task_id"] for e in res["episodes"] if e["trial"] == trial]
        assert goals(off) == goals(on) and len(goals(on)) == 2
    assert all(t["episodes_with_tips"] == 0 for t in off["trials"]) and on["trials"][1]["episodes_with_tips"] == 2
    text = capsys.readouterr().out
    assert "| trial | success, memory on | success, memory off |" in text and "memory on − memory off" in text
    assert "its tips: a scripted follower shown one / shown none / a random walk |" in text and all("tip_follow_success" not in t for t in off["trials"])


def test_until_a_tip_is_shown_memory_on_and_its_control_play_the_same_episodes(run_dir):
    """Three batches of one episode at T = 1: reflection samples between memory on's batches, yet (each
    batch seeded on its own) trial 1, where no tip exists yet, plays the same actions in both arms."""
    assert evaluate.main(["--run", str(run_dir), "--split", "val", "--episodes", "3", "--batch-size", "1",
                          "--eval-temperature", "1.0", "--memory", "both", "--trials", "1", *TINY[2:]]) == 0
    off, on = (strict_json(run_dir / f"eval_val_{m}.json") for m in ("off", "on"))
    played = lambda res: [(e["task_id"], e["actions"]) for e in res["episodes"]]
    assert played(on) == played(off) and len(played(on)) == 3 and all(e["actions"] for e in on["episodes"])
    assert on["trials"][0]["episodes_with_tips"] == 0 and all(e["tip"] for e in on["episodes"])


def test_shuffled_tips_give_each_task_another_tasks_tip_where_its_own_would_be(run_dir, eval_off, capsys):
    """The content control: with --memory all, the shuffled run plays the same goals and seed, and each
    task's memory holds the tip another task's episode wrote in the on run's place, found by retrieval."""
    assert evaluate.main(["--run", str(run_dir), "--split", "ood", "--episodes", "3", "--memory", "all", "--trials", "2",
                          *TINY[2:]]) == 0
    on, shuffled = (strict_json(run_dir / f"eval_ood_{m}.json") for m in ("on", "shuffled"))
    assert shuffled["mode"] == "adaptation, shuffled tips" and shuffled["settings"]["seed"] == on["settings"]["seed"]
    goals = lambda res, k: [e["task_id"] for e in res["episodes"] if e["trial"] == k]
    assert goals(on, 1) == goals(shuffled, 1) and len(goals(on, 1)) == 3
    assert shuffled["trials"][1]["episodes_with_tips"] == 3   # retrieval finds the other task's tip
    memory = TipMemory.load(run_dir / "eval_ood_shuffled_memory.json")
    first = [e for e in shuffled["episodes"] if e["trial"] == 1]
    for k, e in enumerate(first):   # task k holds the tip of the episode of task k + 1 (mod 3)
        assert memory.tips[e["task_id"]][0].startswith(first[(k + 1) % 3]["tip"])
    assert "success, shuffled tips" in capsys.readouterr().out


def test_adaptation_table_pairs_score_as_well_as_success():
    """webshop-mini's score moves without success moving: the last-trial differences report both, paired by goal."""
    def result(rewards_by_trial):
        episodes = [{"task_id": f"g{i}", "trial": k, "reward": r, "won": r == 1.0, "tip": ""}
                    for k, rewards in rewards_by_trial.items() for i, r in enumerate(rewards)]
        trials = [{"trial": k, "success_rate": 0.0, "success_ci95": 0.0, "score": 0.0, "score_ci95": 0.0,
                   "episodes_with_tips": 0} for k in rewards_by_trial]
        return {"trials": trials, "episodes": episodes}
    on = result({1: [0.2, 0.4, 0.6], 2: [0.7, 0.9, 1.0]})      # trial 2 − trial 1: +0.5, +0.5, +0.4 of score
    off = result({1: [0.2, 0.4, 0.6], 2: [0.2, 0.4, 0.6]})
    text = evaluate.adaptation_table(off, on)
    assert "memory on − memory off, paired over 3 goals" in text
    assert "success +33.3 [" in text and "score +46.7 [+40.0, +50.0]" in text


def test_store_others_tips_rotates_tips_and_scores_but_keeps_each_tasks_own_key():
    from types import SimpleNamespace
    trajs = [SimpleNamespace(task=SimpleNamespace(task_id=f"t{k}"), tip=f"tip of t{k}", ext_return=float(k == 1),
                             first_obs=f"obs {k}") for k in range(3)]
    embed = lambda texts: np.stack([np.eye(384, dtype=np.float32)[int(t.split()[1])] for t in texts])
    memory = TipMemory(0.5, 10, 100)
    assert evaluate.store_others_tips(memory, embed, trajs) == 3
    assert memory.tips == {"t0": ["tip of t1 (score: 1.00)"], "t1": ["tip of t2 (score: 0.00)"], "t2": ["tip of t0 (score: 0.00)"]}
    assert memory.retrieve("t0", embed(["obs 0"])[0]) == ["tip of t1 (score: 1.00)"]   # found by t0's own observation
    with pytest.raises(ValueError, match="two tasks"):
        evaluate.store_others_tips(memory, embed, trajs[:1])
    with pytest.raises(ValueError, match="3 episodes but 2 tips"):   # empo2.store_tips, which does the storing
        evaluate.store_tips(memory, embed, trajs, tips_from=trajs[:2])


def test_memory_both_refuses_one_out_file_and_shuffled_one_task():
    with pytest.raises(SystemExit):
        evaluate.parse_args(["--env", "rooms", "--memory", "both", "--out", "x.json"])
    with pytest.raises(SystemExit):
        evaluate.parse_args(["--env", "rooms", "--memory", "shuffled", "--episodes", "1"])


def test_memory_off_trials_repeat_each_task(run_dir, eval_off, tmp_path):
    out = tmp_path / "repeat.json"
    assert evaluate.main(["--run", str(run_dir), "--trials", "2", "--out", str(out), *TINY, "--episodes", "1"]) == 0
    res = strict_json(out)
    assert len(res["episodes"]) == 2 and [t["n_episodes"] for t in res["per_task"]] == [2]
    assert all(t["episodes_with_tips"] == 0 for t in res["trials"])
    assert not out.with_name("repeat_memory.json").exists()


def copy_run(src, dst, **config_changes):
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config.update(config_changes)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def png_width(path):
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">I", data[16:20])[0]


def test_compare_table_and_png(run_dir, eval_off, tmp_path):
    if not (run_dir / "eval_test_on.json").exists():  # when run alone: make the adaptation result
        assert evaluate.main(["--run", str(run_dir), "--memory", "on", "--trials", "2", *TINY]) == 0
    a = copy_run(run_dir, tmp_path / "rooms-empo2-s0")
    b = copy_run(run_dir, tmp_path / "rooms-empo2-s1", seed=1, name="rooms-empo2-s1")
    (b / "eval.json").unlink()                        # b: falls back to evaluate.py's eval_test_off.json
    c = copy_run(run_dir, tmp_path / "rooms-grpo-s0", algo="grpo", name="rooms-grpo-s0")
    for f in c.glob("eval*.json"):
        f.unlink()
    d = copy_run(run_dir, tmp_path / "rooms-grpo-s1", algo="grpo", seed=1, name="rooms-grpo-s1")
    out = tmp_path / "cmp" / "table.md"
    assert evaluate.main(["--compare", str(a), str(b), str(c), str(d), "--out", str(out)]) == 0

    md = out.read_text()
    main_table = md.split("\n\n")[1]                 # "# title", the run table, then the other tables
    rows = {line.split("|")[1].strip(): line for line in main_table.splitlines() if line.startswith("| rooms-")}
    assert {"rooms-empo2-s0", "rooms-empo2-s1", "rooms-grpo-s0"} <= set(rows)
    trained = json.loads((run_dir / "eval.json").read_text())["trained"]
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert "eval.json (trained)" in rows["rooms-empo2-s0"] and f"{trained['score']:.1f} ±" in rows["rooms-empo2-s0"]
    off = json.loads((run_dir / "eval_test_off.json").read_text())
    assert "eval_test_off.json (2)" in rows["rooms-empo2-s1"] and f"{off['score']:.1f} ±" in rows["rooms-empo2-s1"]
    cells = [x.strip() for x in rows["rooms-grpo-s0"].split("|")]
    assert cells[3] == "grpo" and cells[5] == "–" and cells[8] == "1"          # no eval; 1 iteration
    assert cells[10] == f"{sum(m['charts/tokens_generated'] for m in metrics):,}"
    # seeds of one config are grouped; the grpo run is not
    groups = evaluate.group_runs([evaluate.read_run(None, p) for p in (a, b, c)])
    assert [[r["name"] for r in g] for g in groups] == [["rooms-empo2-s0", "rooms-empo2-s1"], ["rooms-grpo-s0"]]
    assert "| rooms-empo2 (2 seeds) | 0, 1 |" in md and "Adaptation" in md
    assert "relative to each other group" in md and "\n| rooms-grpo (2 seeds) | " in md  # EMPO2 vs GRPO row
    # untrained -> warm start -> trained, pooled over the seeds that have all three
    assert "| rooms-grpo (2 seeds) | warm start | 1 | 1 |" in md and "| rooms-grpo (2 seeds) | trained | 1 | 1 |" in md
    assert "Trained minus warm start" in md and "success ratio" in md
    # what memory did in training, from each run's metrics.jsonl: groups by mode, episodes with tips
    memory_rows = md.split("Memory during training")[1].split("\n\n")[1].splitlines()[2:]
    cells = [x.strip() for x in next(r for r in memory_rows if r.startswith("| rooms-empo2-s0 |")).split("|")]
    modes = {k: sum(m[f"modes/{k}"] for m in metrics) for k in ("plain", "on_policy_tips", "off_policy")}
    assert cells[2:6] == [str(sum(modes.values())), str(modes["on_policy_tips"] + modes["off_policy"]),
                          str(modes["off_policy"]), str(sum(m["memory/episodes_with_tips"] for m in metrics))]
    # what the tips carry, recomputed from samples/ with training's seeds: the metrics' values, pooled over tips
    tips = read_sample_tips(run_dir)
    n = [sum(it == m["iteration"] for it, *_ in tips) for m in metrics]
    assert sum(n) == len(tips) > 0
    pooled = [sum(m[k] * c for m, c in zip(metrics, n) if c) / sum(n) for k in evaluate.TIP_INFORMATION]
    assert cells[-2] == " / ".join(f"{100 * v:.0f}" for v in pooled) + " %"
    # one seed per algorithm is still compared: the ratio row and the stages of groups of one
    one = tmp_path / "cmp" / "one_seed.md"
    assert evaluate.main(["--compare", str(a), str(d), "--out", str(one)]) == 0
    md1 = one.read_text()
    assert "\n| rooms-grpo-s1 | " in md1.split("relative to each other group")[1]
    assert "| rooms-grpo-s1 | warm start | 1 | 1 |" in md1 and "Trained minus warm start" in md1
    png = out.with_suffix(".png")
    assert png.stat().st_size > 5000 and png_width(png) == 1200   # two panels: curves and score vs trial
    assert not list(out.parent.glob("*.tmp"))


def test_ratio_and_difference_with_two_level_bootstrap():
    r = evaluate.ratio_ci95([[20, 20], [20, 20]], [[10, 10], [10, 10]])
    assert r["ratio"] == 2 and r["ratio_ci95"] == [2, 2] and r["difference"] == 10 and r["difference_ci95"] == [10, 10]
    zero = evaluate.ratio_ci95([[50, 0]], [[0, 0], [0, 0]])
    assert zero["ratio"] is None and zero["difference"] == 25
    rng = np.random.default_rng(1)
    num = [list(rng.normal(60, 10, 30)) for _ in range(3)]
    den = [list(rng.normal(40, 10, 30)) for _ in range(3)]
    r = evaluate.ratio_ci95(num, den)
    lo, hi = r["ratio_ci95"]
    assert 1 < lo < r["ratio"] < hi and lo < 1.5 < hi
    # (nearly) the same 30 episodes, spread over seeds that disagree or over seeds that agree:
    # seed-to-seed variation must widen the interval
    varied = [[30.0] * 10, [60.0] * 10, [90.0] * 10]
    agreed = [[30.0, 60.0, 90.0] * 3 + [60.0]] * 3
    width = lambda x: np.diff(evaluate.ratio_ci95(x, den)["difference_ci95"])[0]  # noqa: E731
    assert width(varied) > 2 * width(agreed)


def test_paired_bootstrap_cancels_goal_difficulty():
    """Goals of very different difficulty, every one improved by exactly 5 points: paired, the difference
    is 5 with no spread; resampled independently, the goals' spread makes the interval wide."""
    rng = np.random.default_rng(2)
    before = [list(rng.uniform(0, 100, 40))]
    after = [[x + 5 for x in before[0]]]
    paired = evaluate.ratio_ci95(after, before, paired=True)
    independent = evaluate.ratio_ci95(after, before)
    assert paired["difference_ci95"] == pytest.approx([5, 5]) and paired["difference"] == pytest.approx(5)
    lo, hi = independent["difference_ci95"]
    assert lo < 0 < 5 < hi and hi - lo > 20


def test_untrained_model_without_run(tiny_model_dir, tmp_path):
    out = tmp_path / "base.json"
    argv = ["--env", "rooms", "--run", "none", "--model", tiny_model_dir, "--dtype", "float32", "--device", "cpu",
            "--split", "ood", "--out", str(out), *TINY]
    assert evaluate.main(argv) == 0
    res = strict_json(out)
    assert res["run"] is None and res["adapter"] is None and res["settings"]["split"] == "ood"
    assert [t["task_id"] for t in res["per_task"]] == [t.task_id for t in eval_subset(envs.tasks("rooms", "ood"), 2)]
    policy = next(iter(evaluate.POLICY_CACHE.values()))
    assert all(float(p.detach().abs().max()) == 0 for n, p in policy.model.named_parameters() if "lora_B" in n)  # = base model


def test_clear_errors(tmp_path, capsys, run_dir):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(SystemExit):
        evaluate.main(["--run", str(empty)])
    err = capsys.readouterr().err
    assert "config.json" in err and "adapter" in err
    no_adapter = tmp_path / "no-adapter"
    no_adapter.mkdir()
    shutil.copy(run_dir / "config.json", no_adapter / "config.json")
    with pytest.raises(SystemExit):
        evaluate.main(["--run", str(no_adapter)])
    err = capsys.readouterr().err
    assert "missing adapter/adapter_config.json" in err and "config.json and" not in err
    with pytest.raises(SystemExit) as e:
        evaluate.main(["--env", "mars"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert all(name in err for name in envs.ENV_NAMES) and "mars" in err
    with pytest.raises(SystemExit):
        evaluate.main(["--episodes", "2"])            # neither --run nor --env
    assert "--env is required" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        evaluate.main(["--compare", str(empty)])
    assert "config.json" in capsys.readouterr().err


# ---- statistics over seeds (no model needed) -------------------------------------------
def test_t_interval_uses_students_t_with_n_minus_1_degrees_of_freedom():
    values = [2.0, 4.0, 9.0]                                   # mean 5
    variance = ((2 - 5) ** 2 + (4 - 5) ** 2 + (9 - 5) ** 2) / 2     # sample variance, by hand: 13
    sd = variance ** 0.5
    mean, half = evaluate.t_interval(values)
    assert mean == 5.0
    assert half == pytest.approx(4.303 * sd / 3 ** 0.5, rel=1e-4)      # t(0.975, 2) = 4.303, not 1.96
    assert half > 2 * 1.96 * sd / 3 ** 0.5
    assert evaluate.t_interval([1.0, 3.0])[1] == pytest.approx(12.706 * 2 ** 0.5 / 2 ** 0.5, rel=1e-4)  # t(0.975, 1), sd = sqrt(2)
    assert evaluate.fmt_t(values) == f"5.0 ± {4.303 * sd / 3 ** 0.5:.1f}"


def test_t_interval_of_one_seed_is_no_interval():
    mean, half = evaluate.t_interval([61.9])
    assert mean == 61.9 and np.isnan(half)
    cell = evaluate.fmt_t([61.9])
    assert cell.startswith("61.9") and "n=1" in cell and "±" not in cell
    assert np.isnan(evaluate.welch_interval([1.0, 2.0, 3.0], [4.0])[1])   # one seed in a group: no Welch interval
    sl = evaluate.seed_level_ci95([20.0, 30.0, 40.0], [10.0])
    assert sl["ratio"] == 3.0 and sl["ratio_ci95"] is None and sl["difference_ci95"] is None


def test_welch_interval_by_hand():
    a, b = [10.0, 12.0, 17.0], [1.0, 5.0]                     # means 13 and 3
    va, vb = 13.0 / 3, 8.0 / 2                               # s²/n: variances 13 and 8, by hand
    df = (va + vb) ** 2 / (va ** 2 / 2 + vb ** 2 / 1)         # Welch-Satterthwaite: 2.80
    diff, half, got_df = evaluate.welch_interval(a, b)
    assert diff == 10.0 and got_df == pytest.approx(df)
    from scipy.stats import t
    assert half == pytest.approx(t.ppf(0.975, df) * (va + vb) ** 0.5)
    assert 3.2 < t.ppf(0.975, df) < 3.4                      # a t quantile at ~2.8 degrees of freedom, not 1.96
    sl = evaluate.seed_level_ci95(a, b)
    assert sl["difference_ci95"] == pytest.approx([10 - half, 10 + half]) and sl["ratio"] == pytest.approx(13 / 3)


def test_seed_level_ratio_resamples_seeds_not_episodes():
    """Seeds that agree exactly: the seed-level interval is a point whatever the episodes' spread;
    seeds that disagree: it is not."""
    same = evaluate.seed_level_ci95([20.0, 20.0, 20.0], [10.0, 10.0, 10.0])
    assert same["ratio"] == 2 and same["ratio_ci95"] == [2, 2] and same["difference_ci95"] == [10, 10]
    varied = evaluate.seed_level_ci95([10.0, 20.0, 30.0], [10.0, 10.0, 10.0])
    lo, hi = varied["ratio_ci95"]
    assert lo < 2 < hi and lo >= 1 and hi <= 3


def episodes(values, order):
    return [{"task_id": f"g{i}", "reward": values[i], "won": float(values[i] >= 0.5), "steps": 4, "valid_steps": 4}
            for i in order]


def test_per_seed_paired_difference_pairs_by_task_id():
    """The trained evaluation lists the goals in another order, and plays one goal the warm start did not:
    every goal improved by exactly 0.05, so paired by goal the difference is +5.0 with no spread."""
    rng = np.random.default_rng(3)
    before_vals = list(rng.uniform(0, 0.9, 20))
    before = episodes(before_vals, range(20))
    after = episodes([v + 0.05 for v in before_vals], reversed(range(20)))
    after.insert(5, {"task_id": "extra", "reward": 1.0, "won": 1.0, "steps": 4, "valid_steps": 4})
    d = evaluate.paired_goal_difference(before, after, "reward")
    assert d["n_goals"] == 20
    assert d["difference"] == pytest.approx(5.0) and d["difference_ci95"] == pytest.approx([5.0, 5.0])
    # by position instead, the same episodes give a wide interval (and the extra goal would count)
    by_position = evaluate.ratio_ci95([[100 * e["reward"] for e in after[:20]]], [[100 * e["reward"] for e in before]],
                                      paired=True)
    assert np.diff(by_position["difference_ci95"])[0] > 10


def fake_run(name, seed, before, after):
    stage = lambda eps: {**evaluate.episode_stats(eps), "episodes": eps}  # noqa: E731
    return {"name": name, "seed": seed, "stages": {"warm_start": stage(before), "trained": stage(after)}}


def test_per_seed_table_and_over_seeds_row():
    """Two seeds, goals in another order after training: +5 and +15 points paired by goal; the row over
    seeds is their mean with a t-interval at 1 degree of freedom (12.706), and counts 2 of 2 above zero."""
    vals = [0.1, 0.3, 0.5, 0.2, 0.8, 0.0, 0.4, 0.6]
    s0 = fake_run("x-s0", 0, episodes(vals, range(8)), episodes([v + 0.05 for v in vals], [3, 1, 7, 0, 2, 6, 5, 4]))
    s1 = fake_run("x-s1", 1, episodes(vals, range(8)), episodes([v + 0.15 for v in vals], reversed(range(8))))
    rows = evaluate.seed_rows("x (2 seeds)", [s0, s1])
    assert len(rows) == 3
    assert rows[0].startswith("| x-s0 | 0 |") and "| +5.0 [+5.0, +5.0] |" in rows[0]
    assert "| +15.0 [+15.0, +15.0] |" in rows[1]
    half = 12.706 * (50 ** 0.5) / 2 ** 0.5                   # sd of (5, 15) = sqrt(50); n = 2
    assert rows[2].startswith("| x (2 seeds) | over seeds (n = 2) |")
    assert f"| +10.0 [{10 - half:+.1f}, {10 + half:+.1f}]; 2 of 2 > 0 |" in rows[2]
    assert evaluate.seed_rows("x-s0", [s0]) == rows[:1]      # one seed: no row over seeds


def test_seed_paired_table_pairs_runs_of_the_same_seed_on_the_same_goals():
    """EMPO2 vs GRPO as the README reports it: seed 0 +30 points (6 vs 3 of 10 goals, listed in another
    order), seed 1 0 points; the seed-2 runs played other goals (left out, counted), GRPO seed 3 has no
    EMPO2 partner. Over seeds: +15 with a t-interval at 1 degree of freedom; ratio sqrt(2 * 1)."""
    won = lambda k, ids: [{"task_id": f"g{i}", "reward": float(i < k), "won": float(i < k)} for i in ids]  # noqa: E731
    run = lambda name, seed, eps: {"name": name, "seed": seed, "main": {"episodes": eps}}  # noqa: E731
    empo2 = [run("e-s0", 0, won(6, range(10))), run("e-s1", 1, won(4, range(10))), run("e-s2", 2, won(5, range(10)))]
    grpo = [run("g-s0", 0, won(3, reversed(range(10)))), run("g-s1", 1, won(4, range(10))),
            run("g-s2", 2, won(5, range(10, 20))), run("g-s3", 3, won(9, range(10)))]
    never = [run("n-s0", 0, won(0, range(10)))]
    lines = evaluate.seed_paired_table([empo2, grpo, never])
    rows = {line.split("|")[1].strip() + "/" + line.split("|")[2].strip(): line for line in lines if line.startswith("| ")}
    half = 12.706 * 30 / 2 ** 0.5 / 2 ** 0.5                 # sd of (30, 0) = 30 / sqrt(2); n = 2
    summary = rows["g (4 seeds)/2 (1 on other goals: left out)"]
    assert f"| +15.0 [{15 - half:+.1f}, {15 + half:+.1f}]; 1 of 2 > 0 |" in summary
    assert "| 1.41 [" in summary
    # paired by goal no goal got worse, so no resample falls below 0 (lined up by position, 3 goals would)
    assert "| e-s0 vs g-s0 | 10 | 60.0 | 30.0 | +30.0 [+0.0, " in rows["g (4 seeds)/0"]
    assert "| +0.0 [+0.0, +0.0] |" in rows["g (4 seeds)/1"] and "g (4 seeds)/2" not in rows and "g (4 seeds)/3" not in rows
    assert rows["n-s0/1"].rstrip().endswith("| +60.0 (n=1, no interval) | – |")   # one seed; its run won nothing
    assert evaluate.seed_paired_table([empo2]) == []


def test_sweep_pairs_validation_goals_and_reports_the_worst_valid_rate(tmp_path, capsys):
    import json

    import evaluate

    def run(name, before, after, valid):
        path = tmp_path / name
        path.mkdir()
        eps = lambda won: [{"task_id": f"t{i}", "won": w, "reward": float(w)} for i, w in enumerate(won)]
        (path / "eval.json").write_text(json.dumps({"warm_start_val": {"success_rate": 100 * sum(before) / len(before), "episodes": eps(before)},
                                                    "trained_val": {"success_rate": 100 * sum(after) / len(after), "episodes": eps(after)[::-1]}}))
        (path / "metrics.jsonl").write_text("".join(json.dumps({"valid_action_rate": v, "val/valid_action_rate": None,
                                                                "time/iteration_s": 60.0}) + "\n" for v in valid))
        return str(path)
    a = run("grpo-lrx-s0", [0, 0, 1, 0], [1, 0, 1, 1], [0.95, 0.61])   # +2 of 4 goals, reversed order
    b = run("grpo-lrx-s1", [0, 0, 0, 0], [1, 0, 0, 0], [0.99, 0.97])
    assert evaluate.main(["--sweep", a, b, "--out", str(tmp_path / "sweep.md")]) == 0
    text = (tmp_path / "sweep.md").read_text()
    assert "| grpo-lrx-s0 | 25.0 → 75.0 | +50.0" in text and "| 61 % |" in text
    # over seeds: mean of +50 and +25 with t(0.975, 1) = 12.706 times sd / sqrt(2) = 12.706 * 17.678 / 1.414
    assert "| grpo-lrx | 2 | +37.5 ± 158.8 |" in text
