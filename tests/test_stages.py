"""The stage table (tasks/stages.py) is the one place a stage is declared: a throwaway stage added to
it appears in the CLI's commands and --recompute choices, in what a recompute takes with it, in the
cache keys, in the dry run and in the launched ranks' dispatch, and its flow runs it with the key
the dry run printed. (The dry run's keys against real runs of the tiny and GPU presets are checked
in tests/test_pipeline.py and tests/test_gpu_preset_path.py, beside their runs.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tasks import stages
from tasks.keys import KeyRule
from tests.test_pipeline import SMALL


def shout_body(cfg, inputs: dict, ref, fault: dict):
    def compute(work: Path, logger) -> dict:
        from tasks.prepare_data import load_split

        train = load_split(inputs["data"], "train")
        (work / "shout.txt").write_text(train[0]["messages"][0]["content"].upper())
        return {"metrics": {"shout/n_train": float(len(train))}}

    return compute


def shout_on_rank(cfg, inputs: dict, work: Path, logger) -> dict:
    return shout_body(cfg, inputs, None, {})(work, logger)


def shout_plan(cfg, row, folder: str, inputs: dict, notes: list[str], problems: list[str]) -> list[str]:
    return [f"  shouts the first training question of {inputs['data']['key']}"]


SHOUT = stages.Stage("shout", "shout", KeyRule(("data",)), "tests.test_stages:shout_body", {"data": "prepare_data"},
                     command="shout", rank_body="tests.test_stages:shout_on_rank", plan="tests.test_stages:shout_plan")


@pytest.fixture
def with_shout(monkeypatch):
    monkeypatch.setattr(stages, "STAGES", [stages.STAGES[0], SHOUT, *stages.STAGES[1:]])


def test_the_table_is_what_the_commands_keys_and_recompute_choices_come_from():
    assert list(stages.commands()) == ["prepare-data", "tokenizer", "sft", "grpo", "eval"]
    assert stages.kinds() == ["prepare_data", "tokenizer", "sft", "eval", "grpo", "control"]
    # a recompute takes every row that reads from it, through any number of rows
    # (rows, not kinds: the SFT policy's eval does not read GRPO's result)
    assert stages.downstream(["grpo"]) == {"grpo", "eval (grpo)", "control", "eval (control)"}
    assert stages.downstream(["tokenizer"]) == {"tokenizer", "sft", "eval (sft)", "grpo", "eval (grpo)", "control",
                                                "eval (control)"}
    assert stages.downstream(["eval"]) == {"eval (sft)", "eval (grpo)", "eval (control)"}
    with pytest.raises(KeyError, match="no stage"):
        stages.downstream(["sfft"])
    assert stages.until_for("speedrun") is None and stages.until_for("eval") is None
    assert stages.until_for("grpo") == "grpo"


def test_an_eval_names_the_training_split_only_where_it_samples_seen_problems():
    """The splits a row reads become its MLflow run's dataset inputs: an eval with no seen-problem
    sample (the smollm2 presets) reads the held-out split alone, and says so."""
    from tasks.tracking import data_inputs
    from trainer.config import load_config

    for row in ("eval (sft)", "eval (grpo)", "eval (control)"):
        assert stages.row(row).splits_read(load_config("tiny")) == {"test": "evaluation", "train": "evaluation (seen)"}
        assert stages.row(row).splits_read(load_config("tiny", ["eval.seen_examples=0"])) == {"test": "evaluation"}
        assert stages.row(row).splits_read(load_config("smollm2-135m")) == {"test": "evaluation"}
    assert stages.row("grpo").splits_read(load_config("smollm2-135m")) == {"train": "training", "test": "evaluation"}
    data = {"key": "k" * 16, "uri": "/tmp/prepared", "sha256": {"test.jsonl": "ab" * 32}, "metrics": {"data/n_test": 4.0}}
    [only] = data_inputs(data, stages.row("eval (sft)").splits_read(load_config("tiny", ["eval.seen_examples=0"])))
    assert (only.dataset.name, only.dataset.digest, [t.value for t in only.tags]) == ("synthetic-test", "ab" * 6, ["evaluation"])


def test_a_stage_added_to_the_table_appears_everywhere(with_shout, tmp_path):
    from flows.cli import _parser
    from tasks.keys import stage_key
    from tasks.stages import rule_for, rules
    from tasks.plan import walk
    from trainer.config import load_config

    args = _parser().parse_args(["shout", "--preset", "tiny", "--recompute", "shout"])
    assert args.command == "shout" and args.recompute == ["shout"]
    assert "shout" in stages.downstream(["prepare_data"]) and stages.downstream(["shout"]) == {"shout"}
    assert rule_for("shout").sections == ("data",) and "shout" in rules()
    cfg = load_config("tiny", SMALL + [f"artifact_root={tmp_path}"])
    plan = walk(cfg, "shout")
    assert list(plan.keys) == ["prepare_data", "shout"]
    assert plan.keys["shout"] == stage_key(cfg, "shout", SHOUT.key, {"data": {"key": plan.keys["prepare_data"]}})
    assert any(line.startswith("shout ") and "(will run)" in line for line in plan.lines), plan.lines
    assert f"  shouts the first training question of {plan.keys['prepare_data']}" in plan.lines
    assert "shout" in [s.name for s in stages.until(None)]


@pytest.mark.slow
def test_a_stage_added_to_the_table_runs_under_its_flow_with_the_dry_runs_key(with_shout, tmp_path, capsys):
    from flows.cli import main
    from flows.speedrun import flow_for
    from tasks.plan import walk
    from tasks.rank_main import run_body
    from trainer.config import load_config
    from trainer.tracking import NullLogger

    overrides = SMALL + [f"artifact_root={tmp_path}"]
    planned = walk(load_config("tiny", overrides), "shout").keys
    result = flow_for("shout")(preset="tiny", overrides=overrides)
    assert [s["stage"] for s in result["stages"]] == ["prepare_data", "shout"]
    assert {s["stage"]: s["key"] for s in result["stages"]} == planned
    shout = result["stages"][1]
    manifest = json.loads((Path(shout["uri"]) / "manifest.json").read_text())
    assert manifest["key"] == planned["shout"]
    assert manifest["config"] == {"data": load_config("tiny", overrides).to_dict()["data"]}
    assert (Path(shout["uri"]) / "shout.txt").read_text().isupper()
    # the dry run through the CLI now finds both cached
    argv = ["shout", "--dry-run", "--preset", "tiny"]
    for o in overrides:
        argv += ["--set", o]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert f"shout           {shout['uri']}  (cached)" in out, out
    # a launched rank runs the row's rank body
    data = json.loads((Path(result["stages"][0]["uri"]) / "manifest.json").read_text())
    work = tmp_path / "rank-work"
    work.mkdir()
    out = run_body("shout", load_config("tiny", overrides), {"data": data}, work, NullLogger())
    assert out["metrics"] == shout["metrics"] and (work / "shout.txt").is_file()
