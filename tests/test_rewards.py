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


def picky_reward(response, example):
    if "13" in response:
        raise ValueError(f"cannot grade {response!r}")
    return 1.0


def one_argument_reward(response):
    return 1.0


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


def test_a_reward_that_raises_is_noted_with_its_sample_and_logged_once(caplog):
    """The user's reward raising on some responses: those samples' totals are None (a bad reward, as
    NaN is), the error is noted by sample, and its first traceback of the call goes to the log."""
    mix = RewardMix.from_specs([RewardSpec(name="tests.test_rewards:picky_reward"), RewardSpec(name="format")])
    with caplog.at_level("WARNING", logger="trainer.rl.rewards"):
        totals, parts = mix.score(["#### 12", "#### 13", "#### 13"], [EX] * 3)
    assert totals == [2.0, None, None]
    assert mix.raised == {1: "reward 'tests.test_rewards:picky_reward' raised ValueError: cannot grade '#### 13'",
                          2: "reward 'tests.test_rewards:picky_reward' raised ValueError: cannot grade '#### 13'"}
    assert parts["format"] == [1.0, 1.0, 1.0]
    [record] = [r for r in caplog.records if "raised" in r.getMessage()]
    assert record.exc_info and "example 'e1'" in record.getMessage()
    assert mix.score(["#### 12"], [EX])[0] == [2.0] and mix.raised == {}  # per call


@pytest.mark.slow
def test_a_reward_that_raises_stops_the_round_naming_it_or_is_skipped(tmp_path, capsys, caplog, small_sft):
    """Through the CLI: exit 2 naming the reward, its error and the example (was the user's
    traceback and exit 1); with grpo.on_bad_reward=skip the round drops those samples and goes on.
    A reward that cannot take (response, example) stops the run before any stage. GRPO starts from
    the session's small SFT (tests/seeded.py): the reward is what this tests."""
    from flows.cli import main
    from tests.seeded import seed
    from tests.test_pipeline import SMALL

    seed(small_sft, tmp_path / "art")
    small = [a for o in [f"artifact_root={tmp_path / 'art'}", *SMALL, "grpo.rounds=1", "rollout.prompts_per_round=4"]
             for a in ("--set", o)]
    raising = ["--set", "grpo.rewards=[{name: math}, {name: 'tests.test_rewards:string_reward_that_raises'}]"]
    assert main(["grpo", *small, *raising]) == 2
    err = capsys.readouterr().err
    assert ("grpo.rewards: reward 'tests.test_rewards:string_reward_that_raises' raised TypeError: can only "
            "concatenate str") in err and "on example 'syn-" in err and "grpo.on_bad_reward=skip" in err, err[-3000:]
    assert "Traceback" not in err.split("posttrain: grpo.rewards")[-1]
    # on two DeepSpeed ranks the same words (it was exit 1, the launcher's failure and both ranks' tracebacks)
    assert main(["grpo", *small, *raising, "--set", "grpo.deepspeed.ranks_per_node=2"]) == 2
    two = capsys.readouterr().err
    said = two.split("posttrain: ")[-1]
    assert said.startswith("grpo.rewards: reward 'tests.test_rewards:string_reward_that_raises' raised TypeError: "
                           "can only concatenate str") and "grpo.on_bad_reward=skip" in said, two[-3000:]
    assert "the launcher exited with code 1: local rank" in caplog.text  # the ranks' story, in the log
    assert main(["grpo", *small, *raising, "--set", "grpo.on_bad_reward=skip"]) == 0
    # every sample dropped: the summary says the round did not update the policy
    assert "grpo: 1 of 1 rounds did not update the policy: no sample was left" in " ".join(
        capsys.readouterr().out.split())
    assert main(["grpo", *small, "--set", "grpo.rewards=[{name: 'tests.test_rewards:one_argument_reward'}]"]) == 2
    assert ("grpo.rewards: 'tests.test_rewards:one_argument_reward' cannot be called as "
            "tests.test_rewards:one_argument_reward(response, example)") in capsys.readouterr().err


def string_reward_that_raises(response, example):
    return response + 1  # a bug in the user's reward: every sample raises


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
    """Named by its own setting, not the policy's (model.pretrained), whose path checks it shares."""
    with pytest.raises(RewardError, match=r"^grpo\.rewards\[\]\.path: '.*nothing' is not a model folder \(no config"):
        resolve("reward_model", str(tmp_path / "nothing"))
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.json").write_text("{}")  # a folder transformers cannot load
    with pytest.raises(RewardError, match="^grpo.rewards: reward_model path .*empty' could not be loaded: "):
        resolve("reward_model", str(tmp_path / "empty"))


@pytest.mark.slow
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
