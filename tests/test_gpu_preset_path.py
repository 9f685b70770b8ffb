"""The GPU preset's whole path, run on CPU through the real CLI, Prefect and MLflow.

`--preset qwen2.5-0.5b-gsm8k` with its own settings wherever they run on CPU: a pretrained-format
model folder (`model.pretrained`, a Qwen2-architecture model with a ChatML tokenizer and Qwen's chat
template, loaded with its own tokenizer: `tokenizer.train: false`), real GSM8K rows (the excerpt in
tests/data/gsm8k) with the calculator annotations stripped, SFT under ZeRO-2 with 4 accumulated
micro-batches, eval, and GRPO on a real SGLang server (CPU mode) with 4 mini-batches of several
micro-batches, token-mean loss, clip-higher and the math reward. Shrunk: the model (140k
parameters), fp32 instead of bf16, and the counts (rows, rounds, prompts, tokens). The eval stages
answer by HF generate (`eval.engine=hf`): a server launch per eval stage cost about 45 s of the run's
167 s alone on 2 cores, and tests/test_sglang_pipeline.py runs eval stages on SGLang; the periodic
evals inside GRPO still answer through the stage's server.

One change beyond counts: a tiny model SFT'd on 300 rows solves no GSM8K problem (nor reaches the
'####' line in 32 tokens), so with the math reward alone every group would be filtered and no
update would run. A small dense term (the share of digits in the response, weight 0.1) gives the
groups a signal; the math reward stays in the mix and is reported.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from mlflow import MlflowClient

from tests.pretrained import save_qwen_like
from tests.test_resume_kill import run_cli
from tests.test_sglang_server import STANDIN, free_base_port

pytestmark = pytest.mark.slow

GSM8K = Path(__file__).parent / "data" / "gsm8k"
PRESET = "qwen2.5-0.5b-gsm8k"


def overrides(model: Path, port: int) -> list[str]:
    return [
        f"model.pretrained={model}", "model.dtype=float32",
        "data.source=files", f"data.train={GSM8K / 'train.jsonl'}", f"data.test={GSM8K / 'test.jsonl'}",
        "data.max_test=48",
        # SFT: the preset's ZeRO-2 and 4 accumulated micro-batches; fp32, smaller micro-batches
        "sft.deepspeed.precision=fp32", "sft.micro_batch_size=4", "sft.lr=3e-3", "sft.log_every=1",
        "eval.max_new_tokens=32", "eval.engine=hf",
        # GRPO: 4 mini-batches of 4 micro-batches of 2 (the preset: 4 of 8 of 8)
        "grpo.deepspeed.precision=fp32", "grpo.rounds=3", "grpo.micro_batch_size=2", "grpo.lr=1e-4",
        "grpo.eval_every=3", "grpo.eval_examples=16", "grpo.checkpoint_every=2",
        "grpo.rewards=[{name: math, weight: 1.0}, {name: tests.test_multirank.digit_share, weight: 0.1}]",
        "rollout.prompts_per_round=4", "rollout.max_response_tokens=32",
        "rollout.sglang.device=cpu", f"rollout.sglang.base_port={port}", "rollout.sglang.startup_timeout_s=300",
        f"rollout.sglang.env={{PYTHONPATH: {STANDIN}}}",
    ]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpu-preset-path")
    texts = [json.loads(line) for line in (GSM8K / "train.jsonl").read_text().splitlines()]
    model = save_qwen_like(root / "qwen-like", [r["question"] + "\n" + r["answer"] for r in texts])
    out = root / "result.json"
    code, seconds = run_cli(root / "artifacts", out, overrides=overrides(model, free_base_port(1)), preset=PRESET,
                            timeout=900)
    assert code == 0
    return root, json.loads(out.read_text()), seconds


def stage(result: dict, name: str, index: int = 0) -> dict:
    return [s for s in result["stages"] if s["stage"] == name][index]


def test_every_stage_ran_on_the_pretrained_folder_and_real_rows(run):
    root, result, seconds = run
    print(f"\nGPU preset path on CPU: {seconds:.0f} s through the CLI")
    for s in result["stages"]:
        shown = {k: round(v, 4) for k, v in s["metrics"].items()
                 if isinstance(v, float) and k.split("/")[-1] in
                 ("accuracy", "format_rate", "final_loss", "steps", "rounds", "tokens_per_second")}
        print(f"  {s['stage']:<14} {s['wall_seconds']:7.1f} s  {shown}")
    assert not any(s["cache_hit"] for s in result["stages"])
    data = json.loads((Path(stage(result, "prepare_data")["uri"]) / "manifest.json").read_text())
    assert data["metrics"]["data/n_train"] == 300 and data["metrics"]["data/n_test"] == 48
    sft = stage(result, "sft")
    # 300 rows, one epoch, 4 micro-batches of 4 a step: the preset's schedule, counted
    assert sft["metrics"]["sft/steps"] == 19
    sft_model = Path(sft["uri"]) / "model"
    # the policy keeps the pretrained folder's own tokenizer and chat template
    saved = json.loads((sft_model / "tokenizer_config.json").read_text())
    assert saved["eos_token"] == "<|im_end|>" and saved["pad_token"] == "<|endoftext|>"
    assert "<|im_start|>" in (sft_model / "chat_template.jinja").read_text()
    grpo = stage(result, "grpo")
    assert grpo["metrics"]["grpo/rounds"] == 3
    history = [json.loads(x) for x in (Path(grpo["uri"]) / "history.jsonl").read_text().splitlines()]
    assert [h["round"] for h in history] == [1, 2, 3]
    for h in history:
        assert "reward/math" in h and len([k for k in h if k.startswith("reward/") and "digit_share" in k]) == 1
    updated = [h for h in history if not h.get("update/skipped")]
    assert updated, "no round had a group with a learning signal"
    for h in updated:
        assert h["update/optimizer_steps"] == 4  # the preset's 4 mini-batches
    # round 1's rollouts all came from the SFT weights SGLang was started on: its logprobs are the
    # trainer's (measured 1.6e-7 mean); later rounds also use groups carried over from the round
    # before (over_sample 1.5), sampled by the policy one update older: TIS territory, still close
    assert history[0]["update/engine_logprob_abs_diff"] < 1e-4
    assert all(h["update/engine_logprob_abs_diff"] < 0.05 for h in history)
    assert history[1]["rollout/groups_carried"] > 0
    assert "eval/accuracy" in history[-1] and "eval/pass_at_4" in history[-1]


def test_examples_carry_no_machine_path_and_no_calculator_annotations(run):
    _, result, _ = run
    uri = Path(stage(result, "prepare_data")["uri"])
    rows = [json.loads(x) for x in (uri / "train.jsonl").read_text().splitlines()]
    assert rows[0]["id"] == "train-1"
    assert not any("<<" in r["messages"][-1]["content"] for r in rows)
    assert not any(str(GSM8K) in r["id"] for r in rows)


def test_mlflow_has_the_run_and_its_stages(run):
    _, result, _ = run
    client = MlflowClient()
    parent = client.get_run(result["mlflow_run_id"])
    assert parent.data.params["model.pretrained"].endswith("qwen-like")
    children = client.search_runs([parent.info.experiment_id], f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
    assert {"prepare_data", "sft", "eval", "grpo"} <= {r.data.tags.get("posttrain.stage") for r in children}


def test_the_dry_run_has_the_keys_of_the_run(run):
    """The GPU preset's dry run (the stage table walked with this run's config) names the keys the
    run computed, for every stage it ran, and finds them all cached."""
    from tasks.plan import dry_run, walk
    from trainer.config import load_config

    root, result, _ = run
    cfg = load_config(PRESET, overrides(root / "qwen-like", 30000) + [f"artifact_root={root / 'artifacts'}"])
    plan = walk(cfg)
    assert list(plan.keys.values()) == [s["key"] for s in result["stages"]], (plan.keys, result["stages"])
    text, _ = dry_run(cfg)
    assert text.count("(cached)") == len(result["stages"]), text
