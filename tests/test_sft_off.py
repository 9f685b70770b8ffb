"""GRPO straight from a pretrained model (`sft.enabled: false`), through the real CLI, Prefect and
MLflow: the sft stage trains nothing and commits model.pretrained's own weights as the starting
policy; GRPO, the evals and the control start from it; the summary, the parent run and the nightly
comparison call it the starting policy (`start_accuracy`, tag `posttrain.start_policy`), and
`mcnemar_z` compares the final policy with it. The model is a locally built Qwen2-shaped folder
with a ChatML tokenizer (tests/pretrained.py); a real instruct model's path is tests/test_gguf.py's.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from mlflow import MlflowClient

from tests.pretrained import save_qwen_like
from tests.test_resume_kill import ROOT, manifest, run_cli

pytestmark = pytest.mark.slow


def overrides(model: Path) -> list[str]:
    return [f"model.pretrained={model}", "tokenizer.train=false", "sft.enabled=false",
            "data.synthetic.n_train=300", "data.synthetic.n_test=24", "eval.max_new_tokens=16", "eval.seen_examples=8",
            "grpo.rounds=2", "rollout.prompts_per_round=4", "rollout.n_samples_per_prompt=4",
            "rollout.max_response_tokens=16", "rollout.dynamic_filter=none", "grpo.micro_batch_size=8",
            "grpo.eval_every=2", "grpo.eval_examples=8", "grpo.pass_k=1", "grpo.checkpoint_every=2",
            "grpo.rewards=[{name: tests.test_multirank.digit_share}]",
            "control.enabled=true", "control.steps=3", "sft.micro_batch_size=8"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from trainer.config import SyntheticData
    from trainer.data import synthetic

    root = tmp_path_factory.mktemp("sft-off")
    data = synthetic(SyntheticData(n_train=200, n_test=4), 0)
    model = save_qwen_like(root / "pretrained", [m["content"] for ex in data.train for m in ex["messages"]])
    out = root / "result.json"
    code, _ = run_cli(root / "artifacts", out, overrides=overrides(model))
    assert code == 0
    return model, json.loads(out.read_text()), (out.with_suffix(".log")).read_text()


def test_grpo_starts_from_the_pretrained_weights(run):
    from safetensors.torch import load_file

    model, result, _ = run
    sft = manifest(result, "sft")
    assert sft["skipped"] and sft["metrics"]["sft/steps"] == 0
    start = load_file(str(Path(sft["uri"]) / "model" / "model.safetensors"))
    original = load_file(str(model / "model.safetensors"))
    assert start.keys() == original.keys() and all(torch.equal(start[k], original[k]) for k in original)
    grpo = manifest(result, "grpo")
    assert grpo["inputs"]["sft"] == sft["key"] and grpo["metrics"]["grpo/rounds"] == 2
    assert manifest(result, "control")["metrics"]["control/steps"] == 3
    labels = [s["label"] for s in result["stages"]]
    assert labels == ["prepare_data", "sft (off: pretrained)", "eval (start)", "grpo", "eval (grpo)", "control",
                      "eval (control)"]


def test_the_summary_and_mlflow_name_the_starting_policy(run):
    model, result, log = run
    head = result["headline"]
    assert "sft_accuracy" not in head and {"start_accuracy", "final_accuracy", "mcnemar_z",
                                           "start_seen_accuracy"} <= set(head)
    assert "start (pretrained)" in log and "GRPO vs start:" in log and "\nSFT " not in log
    parent = MlflowClient().get_run(result["mlflow_run_id"])
    assert parent.data.tags["posttrain.start_policy"] == f"pretrained: {model}"
    assert parent.data.metrics["start_accuracy"] == head["start_accuracy"]
    assert parent.data.metrics["mcnemar_z"] == head["mcnemar_z"]
    # the starting policy's MLflow logged model says what it is, and carries its eval's accuracy
    start = MlflowClient().get_logged_model(manifest(result, "sft")["mlflow_model_id"])
    assert start.name == "tiny-start" and "starting (pretrained) policy" in start.tags["mlflow.note.content"]
    assert {m.key: m.value for m in start.metrics}["eval/accuracy"] == head["start_accuracy"]


def test_the_dry_run_shows_the_plan_without_sft(run, tmp_path):
    model, _, _ = run
    cmd = [sys.executable, "-m", "flows.cli", "speedrun", "--preset", "tiny", "--dry-run",
           "--set", f"artifact_root={tmp_path}"] + [a for o in overrides(model) for a in ("--set", o)]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "sft: off (sft.enabled=false)" in out.stdout and "DeepSpeed" not in out.stdout.split("sft: off")[1][:80]
