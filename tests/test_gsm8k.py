"""The smollm2-135m-gsm8k preset's parts: real GSM8K rows through data prep (the shared copy in
../shared/data/gsm8k where this checkout has one, else the excerpt in tests/data/gsm8k), lm-evaluation-
harness's GSM8K scorers against hand-written cases, the dev split and the fixed test sample, the
few-shot prompt's layout on SmolLM2's real chat template, and a short run of the preset through the CLI
on the real weights."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.growth import assert_linear
from trainer import lm_eval_gsm8k
from trainer.answers import is_correct
from trainer.config import load_config

ROOT = Path(__file__).resolve().parent.parent
SHARED = ROOT.parent / "shared" / "data" / "gsm8k"
EXCERPT = Path(__file__).parent / "data" / "gsm8k"
GSM8K = SHARED if (SHARED / "train.jsonl").is_file() else EXCERPT
FILES = ["data.source=files", f"data.train={GSM8K}/train.jsonl", f"data.test={GSM8K}/test.jsonl"]


def rows_of(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# ---------------------------------------------------------------- lm-evaluation-harness's scorers

@pytest.mark.parametrize("response,gold,strict,flexible", [
    # the gold answer text whole: everything up to its `#### ` is ignored
    ("She pays 3 * 4 = 12 dollars.\n#### 12", "Natalia sold 48/2 = <<48/2=24>>24 clips.\n#### 12", True, True),
    # commas and $ are removed on both sides; a final period is dropped
    ("The total is $1,200.\n#### $1,200", "#### 1200", False, True),  # strict's regex takes no $: "[invalid]"
    ("#### 1,200.", "1200", True, True),
    ("So the answer is 1,200.", "1200", False, True),
    # negatives and decimals as the regexes read them
    ("#### -5", "-5", True, True),
    ("The change is -5 degrees", "-5", False, True),
    ("#### 2.5", "2.5", True, True),
    ("#### 2.50", "2.5", False, False),  # exact_match compares strings: 2.50 is not 2.5
    # several numbers: strict takes the FIRST `#### n`, flexible the LAST number
    ("#### 7\nwait, no\n#### 8", "8", False, True),
    ("#### 8\nThat is 3 more than 5", "8", True, False),
    # no number at all: "[invalid]" on both
    ("I do not know.", "4", False, False),
    # one digit is a number to flexible's second alternative; `4.` is read by its first
    ("It is 4", "4", False, True),
    ("It is 4.", "4", False, True),
    # upper/lower case does not matter (ignore_case), numbers have none
    ("#### 10", "#### 10", True, True),
])
def test_lm_eval_scorers_on_hand_written_cases(response, gold, strict, flexible):
    assert lm_eval_gsm8k.correct(response, gold, "strict") is strict
    assert lm_eval_gsm8k.correct(response, gold, "flexible") is flexible


def test_lm_eval_extraction_is_the_harness_filters():
    assert lm_eval_gsm8k.extract("no digits", "strict") == "[invalid]"
    assert lm_eval_gsm8k.extract("no digits", "flexible") == "[invalid]"
    assert lm_eval_gsm8k.extract("#### 3\n#### 4", "strict") == "3"
    assert lm_eval_gsm8k.extract("a 12, then $3,000.50.", "flexible") == "$3,000.50."
    assert lm_eval_gsm8k.normalised("$3,000.50.") == "3000.50"
    with pytest.raises(ValueError, match="strict or flexible"):
        lm_eval_gsm8k.extract("1", "loose")


def test_lm_eval_scoring_is_linear_in_what_a_policy_writes():
    # the harness's `(?s).*#### ` by re.sub is quadratic on a long text without `#### `; ours is not
    for mode in ("strict", "flexible"):
        score = lambda text, mode=mode: lm_eval_gsm8k.correct(text, "1", mode)  # noqa: E731
        assert_linear(score, lambda n: "1" * n, 20_000, f"{mode} on one long number")
        assert_linear(score, lambda n: "#### " + "9," * n, 20_000, f"{mode} on a long answer after ####")
        assert_linear(score, lambda n: "a 1 " * n + "." * n, 20_000, f"{mode} on many numbers and dots")


# ---------------------------------------------------------------- the data path on real rows

@pytest.fixture(scope="module")
def prepared():
    from trainer.data import prepare

    cfg = load_config("smollm2-135m-gsm8k", FILES + ["data.dev_size=50", "data.test_sample=40"])
    return cfg, prepare(cfg.data, cfg.seed)


def test_every_real_row_parses_with_its_annotations_stripped_and_its_gold_answer_checks(prepared):
    cfg, data = prepared
    raw_train, raw_test = rows_of(GSM8K / "train.jsonl"), rows_of(GSM8K / "test.jsonl")
    assert len(data.train) + 50 == len(raw_train) and len(data.test) == 40 and not data.skipped
    for ex in data.train + data.test:
        system, user, assistant = ex["messages"]
        assert system == {"role": "system", "content": cfg.data.system_prompt} and user["role"] == "user"
        target = assistant["content"]
        assert "<<" not in target and ">>" not in target, ex["id"]
        assert target.rstrip().endswith(f"#### {target.rsplit('#### ', 1)[1].strip()}")
        # the gold solution itself scores correct by every scorer the preset reports
        assert is_correct(target, ex["answer"]), ex["id"]
        assert is_correct(target, ex["answer"], "flexible"), ex["id"]
        assert lm_eval_gsm8k.correct(target, ex["answer"], "strict"), ex["id"]
    # the answers as the file has them: `#### 1,080` checks against 1080
    by_id = {f"train-{i + 1}": r for i, r in enumerate(raw_train)}
    for ex in data.train[:300]:
        assert ex["answer"] == by_id[ex["id"]]["answer"].rsplit("#### ", 1)[1].replace(",", "").strip()
    if GSM8K == SHARED:
        assert (len(raw_train), len(raw_test)) == (7473, 1319)


def test_the_dev_split_is_set_aside_and_the_test_sample_is_fixed(prepared):
    from trainer.data import prepare

    cfg, data = prepared
    on_dev = prepare(load_config("smollm2-135m-gsm8k", FILES + ["data.dev_size=50", "data.held_out=dev"]).data,
                     cfg.seed)
    # the same training rows whichever split the evals read, and the dev rows none of them
    assert [ex["id"] for ex in on_dev.train] == [ex["id"] for ex in data.train]
    assert len(on_dev.test) == 50 and all(ex["id"].startswith("train-") for ex in on_dev.test)
    assert not {ex["id"] for ex in on_dev.test} & {ex["id"] for ex in data.train}
    # the test sample: drawn by seed, in file order, the same again, another for another seed
    ids = [ex["id"] for ex in data.test]
    assert ids == sorted(ids, key=lambda i: int(i.split("-")[1])) and all(i.startswith("test-") for i in ids)
    again = prepare(cfg.data, cfg.seed)
    assert [ex["id"] for ex in again.test] == ids
    assert [ex["id"] for ex in prepare(cfg.data, cfg.seed + 1).test] != ids


def test_bad_declarations_name_the_field():
    from trainer.config import ConfigError

    for sets, field in ((["data.held_out=dev", "data.dev_size=0"], "data.dev_size"),
                        (["eval.lm_eval=true", "task.grader=exact", *FILES], "eval.lm_eval"),
                        (["eval.few_shot=2", "eval.pretrained=false"], "eval.pretrained"),
                        (["eval.pretrained=true", "eval.engine=rollout", "rollout.engine=sglang"], "eval.engine")):
        with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
            load_config("smollm2-135m-gsm8k", sets)


def test_the_few_shot_prompt_is_the_shots_as_earlier_turns_on_smollm2s_template(prepared, smollm2):
    from tasks.eval import few_shot_examples
    from trainer.chat import encode_prompt
    from trainer.data import prompt_messages
    from trainer.evaluate import with_shots

    cfg, data = prepared
    _, _, tok = smollm2
    shots = few_shot_examples(data.train, 3, cfg.seed)
    assert [s["id"] for s in shots] == [s["id"] for s in few_shot_examples(data.train, 3, cfg.seed)]
    question = data.test[0]
    messages = with_shots(prompt_messages(question), shots)
    assert [m["role"] for m in messages] == ["system"] + ["user", "assistant"] * 3 + ["user"]
    assert messages[0]["content"] == cfg.data.system_prompt and messages[-1] == prompt_messages(question)[-1]
    for k, shot in enumerate(shots):
        assert messages[1 + 2 * k]["content"] == shot["messages"][1]["content"]
        assert messages[2 + 2 * k]["content"].endswith(f"#### {shot['answer']}")
    text = tok.decode(encode_prompt(tok, messages))
    # SmolLM2's ChatML: one system turn, each shot a user and an assistant turn, the question last, open
    assert text.count("<|im_start|>system") == 1 and text.count("<|im_start|>assistant") == 4
    assert text.index(shots[2]["messages"][1]["content"]) < text.index(prompt_messages(question)[-1]["content"])
    assert text.rstrip().endswith("<|im_start|>assistant")


# ---------------------------------------------------------------- the preset through the CLI

@pytest.mark.slow
def test_a_short_run_of_the_preset_through_the_cli_scores_every_model_both_ways(tmp_path, smollm2_gguf):
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path}/mlflow.db"}
    sets = FILES + [f"model.pretrained={smollm2_gguf}", f"artifact_root={tmp_path}/art", "data.test_sample=6",
                    "data.dev_size=50",  # the excerpt (where ../shared is absent) has 300 training rows
                    "sft.max_steps=2", "sft.micro_batch_size=2", "sft.grad_accum=1", "sft.max_length=192",
                    "sft.warmup_steps=0", "grpo.rounds=1", "rollout.prompts_per_round=2",
                    "rollout.n_samples_per_prompt=2", "rollout.max_response_tokens=24", "rollout.dynamic_filter=none",
                    "grpo.micro_batch_size=4", "eval.max_new_tokens=24", "eval.few_shot=2", "eval.pretrained_examples=4",
                    "control.steps=1"]
    out = tmp_path / "result.json"
    proc = subprocess.run([sys.executable, "-m", "flows.cli", "speedrun", "--preset", "smollm2-135m-gsm8k", "--json",
                           str(out), *[a for s in sets for a in ("--set", s)]], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    result = json.loads(out.read_text())
    head = result["headline"]
    for name in ("pretrained", "few_shot", "sft", "final", "control"):
        for key in ("accuracy", "flexible_accuracy", "lm_strict_accuracy", "lm_flexible_accuracy"):
            assert f"{name}_{key}" in head or (name == "sft" and key == "accuracy"), (name, key, head)
    assert {"grpo_lm_flexible_mcnemar_z", "vs_control_lm_flexible_mcnemar_z"} <= set(head)
    # the summary's table: every model, strict and flexible both ways
    table = proc.stdout[proc.stdout.index("model "):]
    assert "lm strict" in table and "lm flex" in table
    for label in ("pretrained ", "pretrained 2-shot", "SFT ", "GRPO ", "control (SFT only)"):
        assert label in table, table
    sft_eval = next(s for s in result["stages"] if s["stage"] == "eval")
    folder = Path(sft_eval["uri"])
    assert "(the pretrained rows: the first 4 of the 6 held-out problems)" in table
    for name, n in (("results", 6), ("pretrained_results", 4), ("few_shot_results", 4)):
        rows = [json.loads(x) for x in (folder / f"{name}.jsonl").read_text().splitlines()]
        assert len(rows) == n
        for r in rows:
            assert r["correct_lm_strict"] == lm_eval_gsm8k.correct(r["response"], r["gold"], "strict")
            assert r["correct_lm_flexible"] == lm_eval_gsm8k.correct(r["response"], r["gold"], "flexible")
    shots = json.loads((folder / "few_shot_ids.json").read_text())
    assert len(shots) == 2 and all(i.startswith("train-") for i in shots)
    # the six test problems were drawn by seed and every model answered the same six
    ids = {tuple(sorted(json.loads(x)["id"] for x in (Path(s["uri"]) / "results.jsonl").read_text().splitlines()))
           for s in result["stages"] if s["stage"] == "eval"}
    assert len(ids) == 1
