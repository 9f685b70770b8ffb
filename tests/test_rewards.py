"""Reward contract tests: each kind returns a float per (response, example), bad ones fail clearly."""

import math

import pytest

from trainer.config import RewardSpec
from trainer.rl.rewards import RewardError, RewardMix, format_reward, math_reward, resolve

EX = {"id": "e1", "answer": "12", "messages": [{"role": "user", "content": "3 times 4?"},
                                                {"role": "assistant", "content": "3*4=12\n#### 12"}]}


def constant_reward(response, example):
    return 0.25


def nan_reward(response, example):
    return float("nan")


def string_reward(response, example):
    return "high"


def numpy_reward(response, example):
    import numpy as np

    return np.float32(0.5) if "12" in response else np.int64(0)


def tensor_reward(response, example):
    import torch

    return torch.tensor(0.75)


@pytest.mark.parametrize("fn", [math_reward, format_reward, constant_reward])
def test_contract_float_in_range(fn):
    for response in ["3*4=12\n#### 12", "#### 13", "", "garbage \\boxed{12}"]:
        value = fn(response, EX)
        assert isinstance(value, float) and math.isfinite(value)


def test_math_and_format_values():
    assert math_reward("#### 12", EX) == 1.0 and math_reward("#### 13", EX) == 0.0
    assert math_reward("", EX) == 0.0
    assert format_reward("#### 13", EX) == 1.0 and format_reward("twelve", EX) == 0.0


def test_dotted_paths_both_forms():
    assert resolve("tests.test_rewards:constant_reward") is constant_reward
    assert resolve("tests.test_rewards.constant_reward") is constant_reward


def test_bad_dotted_paths_name_the_problem():
    with pytest.raises(RewardError, match="cannot import module 'no_such_pkg.mod'"):
        resolve("no_such_pkg.mod:fn")
    with pytest.raises(RewardError, match="has no function 'missing'"):
        resolve("tests.test_rewards:missing")
    with pytest.raises(RewardError, match="not a built-in reward"):
        resolve("mathh")
    with pytest.raises(RewardError, match="needs `path`"):
        resolve("reward_model")


def test_weighted_mix_and_components():
    mix = RewardMix.from_specs([RewardSpec(name="math", weight=1.0), RewardSpec(name="format", weight=0.5)])
    totals, parts = mix.score(["#### 12", "#### 13", "nope"], [EX] * 3)
    assert totals == [1.5, 0.5, 0.0]
    assert parts == {"math": [1.0, 0.0, 0.0], "format": [1.0, 1.0, 0.0]}


def test_nan_reward_is_reported_not_averaged():
    mix = RewardMix.from_specs([RewardSpec(name="tests.test_rewards:nan_reward")])
    totals, _ = mix.score(["#### 12"], [EX])
    assert totals == [None]


def test_numpy_and_0d_tensor_rewards_are_numbers():
    mix = RewardMix.from_specs([RewardSpec(name="tests.test_rewards:numpy_reward"),
                                RewardSpec(name="tests.test_rewards:tensor_reward")])
    totals, parts = mix.score(["#### 12", "#### 13"], [EX, EX])
    assert parts == {"tests.test_rewards:numpy_reward": [0.5, 0.0], "tests.test_rewards:tensor_reward": [0.75, 0.75]}
    assert all(type(v) is float for vs in parts.values() for v in vs) and totals == [1.25, 0.75]


def test_non_float_reward_raises():
    mix = RewardMix.from_specs([RewardSpec(name="tests.test_rewards:string_reward")])
    with pytest.raises(RewardError, match="returned 'high'"):
        mix.score(["x"], [EX])


def test_reward_model_from_path(tmp_path, tiny_tokenizer):
    """A real HF sequence-classification model saved to a folder scores prompt + response."""
    import torch
    from transformers import LlamaConfig, LlamaForSequenceClassification

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tiny_tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, num_labels=1,
                      pad_token_id=tiny_tokenizer.pad_token_id)
    LlamaForSequenceClassification(cfg).save_pretrained(tmp_path / "rm")
    tiny_tokenizer.save_pretrained(tmp_path / "rm")
    mix = RewardMix.from_specs([RewardSpec(name="reward_model", path=str(tmp_path / "rm"))])
    totals, parts = mix.score(["#### 12", "#### 13"], [EX, EX])
    assert all(isinstance(t, float) and math.isfinite(t) for t in totals)
    assert totals[0] != totals[1]
    single = resolve("reward_model", str(tmp_path / "rm"))("#### 12", EX)
    assert single == pytest.approx(totals[0], abs=1e-5)
    # a conversation past the model's 1,024 tokens loses its beginning, not the response it judges
    long = {**EX, "messages": [{"role": "user", "content": "word " * 1500}] + EX["messages"][1:]}
    totals, _ = mix.score(["#### 12", "#### 13"], [long, long])
    assert totals[0] != totals[1]


def test_reward_model_bad_path(tmp_path):
    with pytest.raises(RewardError, match="reward_model path"):
        resolve("reward_model", str(tmp_path / "nothing"))


def test_a_reward_that_cannot_be_imported_stops_the_run_before_any_stage(tmp_path, capsys):
    """The CLI exits 2 naming the reward before a server starts; a run from the Prefect UI (the flow)
    fails the same way before its first stage. Nothing is written either way. A run without GRPO
    does not need its rewards."""
    from flows.cli import main
    from flows.speedrun import speedrun
    from trainer.config import ConfigError, load_config
    from trainer.preflight import check

    root = tmp_path / "art"
    bad = [f"artifact_root={root}", "grpo.rewards=[{name: 'no_such_package.rewards:score'}]"]
    assert main(["speedrun", "--preset", "tiny", *[a for o in bad for a in ("--set", o)]]) == 2
    err = capsys.readouterr().err
    assert "grpo.rewards: cannot import module 'no_such_package.rewards' for reward 'no_such_package.rewards:score'" in err
    assert not root.exists()
    with pytest.raises(ConfigError, match=r"grpo.rewards: module 'math' has no function 'nope'"):
        speedrun(preset="tiny", overrides=[f"artifact_root={root}", "grpo.rewards=[{name: 'math:nope'}]"])
    assert not root.exists()
    check(load_config("tiny", [*bad, "grpo.enabled=false", "control.enabled=false"]))
