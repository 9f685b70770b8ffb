from pathlib import Path

import pytest

from trainer.config import CONFIGS_DIR, ConfigError, RunConfig, load_config

PRESETS = sorted(CONFIGS_DIR.rglob("*.yaml")) + sorted(CONFIGS_DIR.rglob("*.yml"))


def test_presets_found():
    names = {p.stem for p in PRESETS}
    assert {"tiny", "qwen2.5-0.5b-gsm8k"} <= names


@pytest.mark.parametrize("path", PRESETS, ids=lambda p: str(p.relative_to(CONFIGS_DIR)))
def test_every_preset_loads_and_validates(path: Path):
    cfg = load_config(str(path))
    assert isinstance(cfg, RunConfig)
    # Validation round-trips: the resolved config is itself a valid config.
    assert RunConfig.model_validate(cfg.to_dict()) == cfg


def test_dotted_overrides_apply_and_parse_types():
    cfg = load_config("tiny", ["sft.lr=1e-4", "sft.deepspeed.zero_stage=2", "data.synthetic.ops=[+, '*']"])
    assert cfg.sft.lr == 1e-4 and cfg.sft.deepspeed.zero_stage == 2
    assert cfg.data.synthetic.ops == ["+", "*"]


def test_bad_value_names_field_value_and_fix():
    with pytest.raises(ConfigError) as exc:
        load_config("tiny", ["sft.lr=-1"])
    msg = str(exc.value)
    assert "sft.lr" in msg and "-1" in msg and "greater than 0" in msg


def test_unknown_key_is_rejected_with_its_path():
    with pytest.raises(ConfigError) as exc:
        load_config("tiny", ["sft.learning_rate=1e-3"])
    assert "sft.learning_rate: unknown key" in str(exc.value)


@pytest.mark.parametrize("override, said", [
    ("model.lora={r: 8}", "model.lora.r: unknown key; did you mean model.lora.rank?"),  # peft's name
    ("grpo.learning_rate=1e-5", "grpo.learning_rate: unknown key; did you mean grpo.lr?"),  # TRL's
    ("grpo.beta=0.04", "grpo.beta: unknown key; did you mean grpo.kl_coef?"),
    ("grpo.num_generations=4", "grpo.num_generations: unknown key; did you mean rollout.n_samples_per_prompt?"),
    ("eval.max_completion_length=9", "eval.max_completion_length: unknown key; did you mean eval.max_new_tokens?"),
    ("grpo.max_completion_length=9", "grpo.max_completion_length: unknown key; did you mean "
                                     "rollout.max_response_tokens?"),
    ("sft.bf16=true", "sft.bf16: unknown key; did you mean sft.deepspeed.precision?"),
    ("data.synthetic.n_trian=4", "data.synthetic.n_trian: unknown key; did you mean data.synthetic.n_train?"),
    ("rollout.sglang.mem_frac=0.3", "rollout.sglang.mem_frac: unknown key; did you mean "
                                    "rollout.sglang.mem_fraction_static?"),
    ("grpo.rewards=[{name: math, weigth: 2}]", "grpo.rewards.0.weigth: unknown key; did you mean grpo.rewards.0.weight?"),
    ("sft.beta=0.1", "sft.beta: unknown key; remove it or check its spelling"),  # sft has no KL term
    ("nonsense=1", "nonsense: unknown key; remove it or check its spelling"),
])
def test_an_unknown_key_names_the_setting_it_likely_meant(override, said):
    """Another tool's name for a setting (TRL's, peft's) or a near spelling of a key of its section."""
    with pytest.raises(ConfigError) as exc:
        load_config("tiny", [override])
    assert f"  - {said}" in str(exc.value).splitlines()


def test_all_errors_listed_at_once():
    with pytest.raises(ConfigError) as exc:
        load_config("tiny", ["sft.lr=0", "eval.batch_size=0", "modle.x=1"])
    msg = str(exc.value)
    assert "3 invalid" in msg and "sft.lr" in msg and "eval.batch_size" in msg and "modle" in msg


def test_cross_field_rule_explains_fix():
    with pytest.raises(ConfigError, match="min_ops <= max_ops"):
        load_config("tiny", ["data.synthetic.min_ops=3", "data.synthetic.max_ops=2"])
    with pytest.raises(ConfigError, match="tokenizer.train=false") as exc:
        load_config("tiny", ["model.pretrained=/some/model"])
    # the whole config's own check: its message, not every value of the config before it
    assert str(exc.value).splitlines()[1] == ("  - (top level): tokenizer.train=true with model.pretrained set: a "
                                              "pretrained model uses its own tokenizer; set tokenizer.train=false")


def test_one_sample_a_prompt_is_refused_for_group_advantages_only():
    """With one sample a prompt every group-relative advantage is 0: GRPO would skip every update
    (a run did, silently, 'no usable samples after filtering' each round). PPO's critic can use one."""
    with pytest.raises(ConfigError, match=r"rollout.n_samples_per_prompt=1 with grpo.advantage=group: .* sample at "
                                          r"least 2 a prompt"):
        load_config("tiny", ["rollout.n_samples_per_prompt=1"])
    load_config("tiny", ["rollout.n_samples_per_prompt=1", "grpo.advantage=gae"])
    load_config("tiny", ["rollout.n_samples_per_prompt=1", "grpo.enabled=false", "control.enabled=false"])


def test_a_registry_name_mlflow_refuses_is_named_when_the_config_loads():
    """The final policy is registered at the very end of a speedrun: a name MLflow refuses ('/' or
    ':') would fail the run after every stage had run."""
    with pytest.raises(ConfigError, match=r"tracking.registered_model: the MLflow Model Registry name 'team/x' cannot"):
        load_config("tiny", ["tracking.registered_model=team/x"])
    with pytest.raises(ConfigError, match=r"name \(the default tracking.registered_model is posttrain-<name>\): .*"
                                          r"'posttrain-team:x'"):
        load_config("tiny", ["name=team:x"])
    assert load_config("tiny", ["name=qwen2.5"]).registered_model_name() == "posttrain-qwen2-5"


def test_unknown_preset_and_missing_file():
    with pytest.raises(ConfigError, match="unknown preset 'nope'.*tiny"):
        load_config("nope")
    with pytest.raises(ConfigError, match="does not exist"):
        load_config("/no/such/preset.yaml")


def test_bad_override_syntax():
    with pytest.raises(ConfigError, match="no '='"):
        load_config("tiny", ["sft.lr"])


def test_config_is_frozen():
    cfg = load_config("tiny")
    with pytest.raises(Exception):
        cfg.sft.lr = 1.0  # type: ignore[misc]


def test_section_hash_changes_only_with_its_section():
    a, b = load_config("tiny"), load_config("tiny", ["sft.lr=1e-4"])
    assert a.section_hash("data") == b.section_hash("data")
    assert a.section_hash("sft") != b.section_hash("sft")


def test_control_steps_fix_the_controls_budget_whatever_the_seconds():
    """control.steps replaces the seconds-based budget, which follows the machine's load."""
    from tasks.control import control_steps

    sft = {"result": {"steps": 100, "train_seconds": 10.0}}
    fast, slow = {"metrics": {"grpo/train_seconds": 5.0}}, {"metrics": {"grpo/train_seconds": 9.0}}
    cfg = load_config("tiny")
    assert (control_steps(cfg, sft, fast), control_steps(cfg, sft, slow)) == (50, 90)
    pinned = load_config("tiny", ["control.steps=70"])
    assert control_steps(pinned, sft, fast) == control_steps(pinned, sft, slow) == 70
    with pytest.raises(ConfigError, match="control.steps"):
        load_config("tiny", ["control.steps=0"])


def test_sft_off_needs_a_pretrained_model_and_a_fixed_control_budget():
    with pytest.raises(ConfigError, match="sft.enabled=false starts GRPO from model.pretrained"):
        load_config("tiny", ["sft.enabled=false"])
    with pytest.raises(ConfigError, match="set control.steps"):
        load_config("tiny", ["sft.enabled=false", "model.pretrained=/some/folder", "tokenizer.train=false"])
    cfg = load_config("tiny", ["sft.enabled=false", "model.pretrained=/some/folder", "tokenizer.train=false",
                               "control.steps=5"])
    assert not cfg.sft.enabled and cfg.control.steps == 5


@pytest.mark.parametrize("engine", ["hf", "sglang"])
def test_zero3_grpo_on_several_ranks_is_refused_before_the_run(engine):
    """ZeRO-3 needs every rank in every forward; GRPO's rank-0 evals and uneven sample counts would
    hang the ranks, so two ranks are refused up front on either engine, naming the fix. One rank, and
    ZeRO-3 for SFT on two ranks, stay allowed."""
    two = ["grpo.deepspeed.zero_stage=3", "grpo.deepspeed.ranks_per_node=2", f"rollout.engine={engine}"]
    with pytest.raises(ConfigError, match=rf"zero_stage=3 with 2 ranks \(rollout.engine={engine}\).*"
                                          r"zero_stage=1 or 2.*or one rank"):
        load_config("tiny", two)
    load_config("tiny", ["grpo.deepspeed.zero_stage=3", f"rollout.engine={engine}"])
    load_config("tiny", ["sft.deepspeed.zero_stage=3", "sft.deepspeed.ranks_per_node=2"])
