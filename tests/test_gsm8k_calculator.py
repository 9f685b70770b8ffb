"""GSM8K with the calculator (the GPU preset qwen2.5-0.5b-gsm8k-calculator), on real rows.

- `data.calculator_annotations: tool` turns each '<<48/2=24>>' of a GSM8K answer into a calculator
  call: the answer up to it ends in the call, the tool answers (the calculator environment's own
  result, which equals the annotation's on every annotation of these rows and of the whole GSM8K
  train split, 23,716 of them), and the answer goes on; the text without the calls is the answer
  with its annotations stripped;
- the preset's dry run, on a local model folder and the GSM8K files, plans every stage with no problem.
"""

import json
from fractions import Fraction
from pathlib import Path

from trainer.config import load_config
from trainer.data import CALCULATOR_RE, prepare, strip_calculator

GSM8K = Path(__file__).parent / "data" / "gsm8k"
PRESET = "qwen2.5-0.5b-gsm8k-calculator"


def test_gsm8k_annotations_become_calculator_calls(tmp_path):
    cfg = load_config(PRESET, ["data.source=files", f"data.train={GSM8K / 'train.jsonl'}",
                               f"data.test={GSM8K / 'test.jsonl'}"])
    data = prepare(cfg.data, cfg.seed)
    raw = {f"train-{i + 1}": json.loads(line) for i, line in enumerate((GSM8K / "train.jsonl").read_text().splitlines())}
    calls = 0
    for ex in data.train:
        answer = raw[ex["id"]]["answer"]
        annotations = CALCULATOR_RE.findall(answer)
        msgs = ex["messages"]
        assert msgs[0]["role"] == "system" and msgs[1]["role"] == "user"
        turns = msgs[2:]
        assert [m["role"] for m in turns] == ["assistant", "tool"] * len(annotations) + ["assistant"]
        text = ""
        for k, m in enumerate(turns):
            if m["role"] == "tool":
                # the environment's answer is the annotation's result
                assert Fraction(m["content"]) == Fraction(annotations[k // 2][2:-2].rpartition("=")[2].replace(",", ""))
                continue
            body = m["content"]
            if k < len(turns) - 1:
                head, call = body.split("<tool_call>")
                spec = json.loads(call.removesuffix("</tool_call>"))
                assert spec == {"name": "calculator",
                                "arguments": {"expression": annotations[k // 2][2:-2].rpartition("=")[0]}}
                body = head
                calls += 1
            text += body
        assert text == strip_calculator(answer)
        assert ex["answer"] == answer.rpartition("####")[2].strip().replace(",", "")
    assert calls > 500  # 300 rows with 2-8 annotations each
    from trainer.data import prompt_messages

    # a held-out prompt is the system message and the question, whatever its answer's turns
    assert all([m["role"] for m in prompt_messages(ex)] == ["system", "user"] for ex in data.test)


def test_the_calculator_presets_dry_run_plans_every_stage(tmp_path):
    from tasks.plan import dry_run
    from tests.pretrained import save_qwen_like

    rows = [json.loads(line) for line in (GSM8K / "train.jsonl").read_text().splitlines()]
    model = save_qwen_like(tmp_path / "qwen-like", [r["question"] + "\n" + r["answer"] for r in rows[:50]])
    cfg = load_config(PRESET, [f"model.pretrained={model}", "data.source=files", f"data.train={GSM8K / 'train.jsonl'}",
                               f"data.test={GSM8K / 'test.jsonl'}", f"artifact_root={tmp_path / 'artifacts'}"])
    assert cfg.rollout.environment.name == "calculator" and not cfg.rollout.environment.describe_tools
    text, problems = dry_run(cfg)
    assert problems == [], text
    for stage in ("prepare_data", "sft", "eval (sft)", "grpo", "eval (grpo)"):
        assert stage in text, text
