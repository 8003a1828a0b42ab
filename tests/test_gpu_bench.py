"""gpu_bench.py on a CPU with a tiny Qwen2-architecture config: the GPU measurement path runs end to end."""
import json

import gpu_bench


def test_gpu_bench_runs_the_training_iteration_on_a_tiny_config(capsys):
    assert gpu_bench.main(["--arch", "tiny-qwen2", "--device", "cpu", "--dtype", "float32", "--iterations", "1",
                           "--tasks-per-iter", "2", "--group-size", "2", "--action-tokens", "5", "--tip-tokens", "6",
                           "--p", "1"]) == 0
    text = capsys.readouterr().out
    result = json.loads(text[text.find("{"):])
    assert result["arch"] == "tiny-qwen2" and result["random_weights"] and result["device"] == "cpu"
    assert result["iteration_s"] > 0 and result["rollout_s"] > 0 and result["update_s"] > 0
    assert result["peak_gb"] == {"rollout": None, "reflection": None, "update": None}   # no GPU here
    # the demonstrator drove the env: real episodes that end by buying, not 15 invalid steps
    assert 2 <= result["episode_steps"] < 15
    assert len(result["iterations"]) == 1


def test_the_demonstrator_driven_env_steps_as_the_demonstrator_whatever_it_is_sent():
    import random

    import envs
    task = envs.tasks("webshop-mini", "train")[5]
    driven = gpu_bench.DemonstratorDriven(envs.make("webshop-mini", "train", seed=0), random.Random(1))
    plain, demonstrator, rng = envs.make("webshop-mini", "train", seed=0), envs.demonstrator("webshop-mini"), random.Random(1)
    obs, _ = driven.reset(task)
    assert obs == plain.reset(task)[0]
    done = False
    while not done:
        expected = plain.step(demonstrator(obs, rng))
        obs, reward, done, info = driven.step("gibberish that is no action")
        assert (obs, reward, done, info["valid"]) == (expected[0], expected[1], expected[2], expected[3]["valid"])
    assert info["valid"] and driven.demo == plain.demo      # everything else is the wrapped env's own


def test_every_shipped_config_builds_the_architecture_it_names():
    from transformers import AutoConfig
    for arch, layers, hidden in (("qwen2.5-1.5b", 28, 1536), ("qwen2.5-3b", 36, 2048)):
        spec = {k: v for k, v in json.loads((gpu_bench.CONFIGS / f"{arch}.json").read_text()).items() if not k.startswith("_")}
        config = AutoConfig.for_model(**spec)
        assert (config.model_type, config.num_hidden_layers, config.hidden_size, config.vocab_size) == ("qwen2", layers, hidden, 151936)
