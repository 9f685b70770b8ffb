"""A task declared once (`task:`): data prep, the rewards, the evals, the summary, McNemar,
`posttrain compare` and the registry all read its grader's verdict; math stays the default."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from trainer.config import ConfigError, load_config
from trainer.data import DataError, prepare, prompt_messages
from trainer.problems import BUILTIN_GRADERS, Verdict, as_verdict, check_task, exact_answer, task_of
from trainer.rl.envs import Environment, Episode, Step

ROOT = Path(__file__).resolve().parent.parent


# ---------------------------------------------------------------- a task of the user's: reversing letters

def reverse_grader(response: str, example: dict) -> Verdict:
    """The user's grader: the answer is the last word; partial credit for the right letters."""
    words = response.split()
    got = words[-1] if words else ""
    gold = example["answer"]
    return Verdict(float(sorted(got) == sorted(gold)) * 0.5 + 0.5 * (got == gold), got == gold)


def reversal_rows(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        word = "".join(rng.choice("abcdefgh") for _ in range(rng.randint(2, 4)))
        rows.append({"question": f"Reverse the letters of: {word}", "answer": word[::-1], "letters": len(word)})
    return rows


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_the_config_names_the_built_in_graders_that_trainer_problems_builds():
    for grader in BUILTIN_GRADERS:
        assert task_of(load_config("tiny", [] if grader == "math" else [
            f"task.grader={grader}", "data.source=files", "data.train=x.jsonl"]).task).grader == grader


@pytest.mark.parametrize("override, said", [
    (["task.grader=reverse"], "task.grader='reverse': use one of ['math', 'exact', 'code'] or 'package.module:function'"),
    (["task.grader=exact"], "task.grader='exact' with data.source=synthetic (family math): the synthetic math problems are graded by math"),
    (["task.grader=mod:f", "task.name=a b", "data.source=files", "data.train=x.jsonl"], "task.name='a b': use letters"),
])
def test_a_bad_task_declaration_stops_at_config_load_naming_the_field(override, said):
    with pytest.raises(ConfigError) as e:
        load_config("tiny", override)
    assert said in str(e.value)


@pytest.mark.parametrize("grader, said", [
    ("no_such_module_here:grade", "task.grader='no_such_module_here:grade': cannot import module 'no_such_module_here'"),
    ("tests.test_tasks:missing", "module 'tests.test_tasks' has no function 'missing'"),
    ("tests.test_tasks:exact_answer", "cannot be called as exact_answer(response, example)"),
])
def test_a_grader_that_cannot_be_used_stops_the_run_before_any_stage(grader, said):
    cfg = load_config("tiny", [f"task.grader={grader}", "data.source=files", "data.train=x.jsonl"])
    with pytest.raises(ConfigError, match="task.grader") as e:
        check_task(cfg.task)
    assert said in str(e.value)


def test_a_graders_answer_becomes_a_verdict_or_an_error_naming_it():
    assert as_verdict(True, "g") == (1.0, True) and as_verdict(0.25, "g") == (0.25, False)
    assert as_verdict(1, "g") == (1.0, True) and as_verdict((0.5, True), "g") == (0.5, True)
    for bad in (1.5, float("nan"), "yes", None, (2.0, True)):
        with pytest.raises(Exception, match="task.grader='g' returned"):
            as_verdict(bad, "g")


def test_exact_reads_the_answer_after_the_last_marker_else_the_last_line_in_linear_time():
    assert exact_answer("so the answer is\n#### ieag \n") == "ieag"
    assert exact_answer("thinking...\n\n  ieag  \n\n") == "ieag"
    assert exact_answer("") == ""
    task = task_of(load_config("tiny", ["task.grader=exact", "data.source=files", "data.train=x"]).task)
    assert task.grade("It is\nieag", {"answer": "ieag"}) == (1.0, True)
    assert task.grade("It is\nieag.", {"answer": "ieag"}) == (0.0, False)
    from tests.growth import assert_linear

    assert_linear(exact_answer, lambda n: "\n" * n + "####" * (n // 4), 20_000, "exact_answer on newlines and markers")


def test_data_prep_reads_a_non_math_rows_answer_as_its_task_does_and_keeps_its_columns(tmp_path):
    train = write_jsonl(tmp_path / "rev.jsonl", reversal_rows(30, 0))
    cfg = load_config("tiny", ["data.source=files", f"data.train={train}", "data.test_size=5",
                               "task.grader=tests.test_tasks:reverse_grader", "task.name=reverse"])
    data = prepare(cfg.data, cfg.seed, task_of(cfg.task))
    ex = data.train[0]
    assert ex["answer"] == ex["messages"][-1]["content"] and "letters" in ex, ex  # no '####' asked for
    # the same file as math: refused, naming the file, the row and the fix
    with pytest.raises(DataError, match=r"rev.jsonl row 1: field 'answer' has no final answer"):
        prepare(cfg.data, cfg.seed, task_of(None))


def test_a_code_rows_tests_are_checked_at_data_prep_naming_the_file_and_row(tmp_path):
    good = {"question": "Write f(x) returning 2x.", "answer": "```python\ndef f(x):\n    return 2 * x\n```",
            "entry": "f", "tests": [{"args": [1], "expected": 2}]}
    bad = {**good, "tests": [{"args": 1}]}
    train = write_jsonl(tmp_path / "code.jsonl", [good] * 5 + [bad] + [good] * 4)
    cfg = load_config("tiny", ["data.source=files", f"data.train={train}", "data.test_size=2", "task.grader=code"])
    with pytest.raises(DataError) as e:
        prepare(cfg.data, cfg.seed, task_of(cfg.task))
    assert "code.jsonl row 6: tests[0]" in str(e.value) and "data.on_bad_row=skip" in str(e.value)
    cfg = load_config("tiny", ["data.source=files", f"data.train={train}", "data.test_size=2", "task.grader=code",
                               "data.on_bad_row=skip"])
    data = prepare(cfg.data, cfg.seed, task_of(cfg.task))
    assert len(data.train) + len(data.test) == 9 and data.train[0]["tests"] == good["tests"]
    task = task_of(cfg.task)
    assert task.grade(good["answer"], data.train[0]) == (1.0, True)


def test_the_registered_model_and_the_default_reward_follow_the_task():
    from trainer.rl.rewards import RewardMix

    math_cfg = load_config("tiny")
    assert math_cfg.registered_model_name() == "posttrain-tiny"  # math: as before
    cfg = load_config("tiny", ["data.source=files", "data.train=x", "task.grader=tests.test_tasks:reverse_grader",
                               "task.name=reverse"])
    assert cfg.registered_model_name() == "posttrain-tiny-reverse"
    mix = RewardMix.from_specs(cfg.grpo.rewards, task_of(cfg.task))  # the preset names `task`
    totals, parts = mix.score(["so: abc", "so: cba", "x"], [{"answer": "abc"}] * 3)
    assert totals == [1.0, 0.5, 0.0] and set(parts) == {"task"}


# ---------------------------------------------------------------- an environment that grades its own episodes

class _Graded(Episode):
    def step(self, text: str) -> Step:
        return Step(done=True, reward=1.0 if "q" in text else 0.25, reason="answer")


class SelfGraded(Environment):
    """A custom environment: one answer an episode, graded by the environment itself (full marks
    when the answer holds the letter 'q'); the task's grader (math) would say otherwise."""

    def reset(self, example):
        return _Graded(prompt_messages(example))


def test_an_environment_that_grades_its_own_episodes_gives_the_evals_verdict(tiny_tokenizer):
    from tests.test_multiturn import ScriptedPolicy
    from trainer.config import EvalConfig
    from trainer.evaluate import evaluate

    cfg = load_config("tiny", ["rollout.environment.name=tests.test_tasks:SelfGraded"])
    examples = [{"id": f"e{i}", "messages": [{"role": "user", "content": "1+1?"}, {"role": "assistant",
                                                                                   "content": "#### 2"}],
                 "answer": "2"} for i in range(3)]
    for text, correct, score in (("q #### 7", True, 1.0), ("#### 2", False, 0.25)):
        result = evaluate(None, tiny_tokenizer, examples, EvalConfig(max_new_tokens=32),
                          engine=ScriptedPolicy(tiny_tokenizer, [text]), environment=cfg.rollout.environment)
        assert [r["correct"] for r in result.rows] == [correct] * 3, result.rows  # not the math checker's
        assert [r["score"] for r in result.rows] == [score] * 3 and result.accuracy == float(correct)


# ---------------------------------------------------------------- through the CLI

SMALL = ["sft.max_steps=20", "sft.micro_batch_size=16", "sft.checkpoint_every=1000", "model.hidden_size=32",
         "model.num_layers=1", "model.intermediate_size=64", "tokenizer.vocab_size=300", "eval.max_new_tokens=12",
         "eval.seen_examples=10", "grpo.rounds=2", "rollout.prompts_per_round=4", "rollout.n_samples_per_prompt=4",
         "rollout.max_response_tokens=12", "grpo.eval_every=2", "grpo.eval_examples=8", "grpo.pass_k=2",
         "grpo.micro_batch_size=8", "rollout.dynamic_filter=none", "control.steps=4"]


def run_cli(args: list[str], env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flows.cli", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=1200)


@pytest.mark.slow
def test_a_task_of_the_users_own_through_the_cli_is_judged_by_its_grader_everywhere(tmp_path):
    from mlflow import MlflowClient

    train = write_jsonl(tmp_path / "reverse.jsonl", reversal_rows(200, 1))
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path}/mlflow.db"}
    sets = [a for o in SMALL + [f"artifact_root={tmp_path}/art", "data.source=files", f"data.train={train}",
                                "data.test_size=24", "task.grader=tests.test_tasks:reverse_grader",
                                "task.name=reverse"] for a in ("--set", o)]
    results = []
    for seed in (0, 1):
        out = tmp_path / f"result-{seed}.json"
        proc = run_cli(["speedrun", "--preset", "tiny", "--json", str(out), *sets, "--set", f"seed={seed}"], env)
        assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
        assert "task: reverse (grader tests.test_tasks:reverse_grader): every accuracy below is its verdict" \
            in proc.stdout, proc.stdout[-3000:]
        results.append(json.loads(out.read_text()))
    result = results[1]
    assert result["task"] == "reverse" and result["registered_model"].startswith("posttrain-tiny-reverse/")
    client = MlflowClient(tracking_uri=env["MLFLOW_TRACKING_URI"])
    parent = client.get_run(result["mlflow_run_id"])
    assert parent.data.tags["posttrain.task"] == "reverse"
    version = client.get_model_version(*result["registered_model"].split("/"))
    assert version.tags["posttrain.task"] == "reverse"
    # every eval row's verdict is the grader's own, on the response the model gave
    evals = [s for s in result["stages"] if s["stage"] == "eval"]
    assert len(evals) == 3  # SFT, GRPO, the control
    for s in evals:
        rows = [json.loads(x) for x in (Path(s["uri"]) / "results.jsonl").read_text().splitlines()]
        assert len(rows) == 24 and all("correct_flexible" not in r for r in rows)
        for r in rows:
            verdict = reverse_grader(r["response"], {"answer": r["gold"]})
            assert (r["correct"], r["score"]) == (verdict.correct, verdict.score), r
        assert s["metrics"]["eval/accuracy"] == sum(r["correct"] for r in rows) / 24
        assert s["metrics"]["eval/mean_score"] == pytest.approx(sum(r["score"] for r in rows) / 24)
    head = result["headline"]
    assert {"mcnemar_z", "vs_control_mcnemar_z", "final_accuracy", "control_accuracy"} <= set(head), head
    assert "final_flexible_accuracy" not in head and "grpo_flexible_fixed" not in head  # one verdict: no flexible
    # the GRPO stage trained on the grader's score (the `task` reward)
    grpo = client.search_runs([result["mlflow_experiment_id"]], f"tags.mlflow.parentRunId = '{parent.info.run_id}' "
                              "and tags.`posttrain.stage` = 'grpo'")[0]
    assert "reward/task" in grpo.data.metrics
    proc = run_cli(["compare", "--run", results[1]["mlflow_run_id"], "--baseline", results[0]["mlflow_run_id"]], env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "task      reverse (grader tests.test_tasks:reverse_grader): every accuracy below is its grader's " \
           "verdict" in proc.stdout, proc.stdout
    assert "McNemar z" in proc.stdout


@pytest.mark.slow
def test_a_bad_row_stops_data_prep_in_a_few_lines_naming_the_file_row_and_fix(tmp_path):
    bad = write_jsonl(tmp_path / "rows.jsonl", [{"question": "q1", "answer": "#### 1"},
                                                {"question": "q2", "answer": "no answer here"}])
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path}/mlflow.db"}
    proc = run_cli(["prepare-data", "--set", "data.source=files", "--set", f"data.train={bad}", "--set",
                    f"artifact_root={tmp_path}/art"], env)
    out = (proc.stdout + proc.stderr).strip().splitlines()
    assert proc.returncode == 2 and "Traceback" not in proc.stdout + proc.stderr, out
    assert out[-1] == (f"posttrain: {bad} row 2: field 'answer' has no final answer; it must end with '#### <answer>' "
                       "(GSM8K) or contain \\boxed{<answer>} (or set data.on_bad_row=skip to drop such rows)"), out
    assert len(out) <= 15, out
    assert not list((tmp_path / "art").glob("prepare_data/*/manifest.json"))  # no result written


# ---------------------------------------------------------------- the code family (tiny-code)

def test_tiny_codes_problems_are_held_out_by_what_they_compute_and_their_gold_answers_pass():
    from trainer.data import synthetic

    cfg = load_config("tiny-code", ["data.synthetic.n_train=3000", "data.synthetic.n_test=200"])
    assert cfg.task.grader == "code" and cfg.grpo.rewards[0].name == "task"
    data = synthetic(cfg.data.synthetic, cfg.seed)

    steps = lambda ex: ex["messages"][0]["content"].split(" that ")[1]  # noqa: E731 - the operations, worded
    assert not {steps(ex) for ex in data.test} & {steps(ex) for ex in data.train}
    assert len({ex["messages"][0]["content"] for ex in data.test}) == 200
    styles = {("    y = " in ex["messages"][-1]["content"]) for ex in data.train}
    assert styles == {True, False}  # worked and direct answers both in SFT
    task = task_of(cfg.task)
    sample = data.train[:40] + data.test[:40]
    verdicts = task.grade_all([ex["messages"][-1]["content"] for ex in sample], sample)
    assert all(v == (1.0, True) for v in verdicts), verdicts
    wrong = task.grade_all([ex["messages"][-1]["content"].replace("return", "return 1 +", 1) for ex in sample[:10]],
                           sample[:10])
    assert not any(v.correct for v in wrong)
    with pytest.raises(ConfigError, match="task.grader='math' with data.source=synthetic \\(family code\\)"):
        load_config("tiny-code", ["task.grader=math"])
