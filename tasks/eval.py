"""eval stage: greedy held-out accuracy, format rate and response length of a model manifest.

Run alone: `posttrain eval --preset tiny` (evaluates the pipeline's final model).
"""

from __future__ import annotations

from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE

from tasks.common import SECTIONS, TrackingRef, run_stage
from tasks.prepare_data import load_split
from tasks.sft import model_dir
from trainer import storage
from trainer.evaluate import evaluate
from trainer.model import load_model
from trainer.tokenizer import load_tokenizer


@task(name="eval", cache_policy=NO_CACHE)
def run_eval(cfg, data: dict, model: dict, ref: TrackingRef, label: str = "eval") -> dict:
    def body(work: Path, logger) -> dict:
        path = model_dir(model)
        policy, tok = load_model(path, cfg.model.dtype), load_tokenizer(path)
        result = evaluate(policy, tok, load_split(data, "test"), cfg.eval)
        storage.write_jsonl(str(work / "results.jsonl"), result.rows)
        metrics = {**result.metrics(), "eval/seconds": result.seconds}
        logger.log_metrics(metrics)
        logger.log_table(result.rows, "eval_results.json")
        return {"metrics": metrics, "evaluated": model["key"], "evaluated_stage": model["stage"]}

    return run_stage(label, cfg, SECTIONS["eval"], {"data": data, "model": model}, body, ref)


def paired_comparison(before: dict, after: dict) -> dict[str, float]:
    """Problems fixed / broken between two evals of the same held-out rows, and McNemar's z."""
    a = {r["id"]: r["correct"] for r in load_results(before)}
    b = {r["id"]: r["correct"] for r in load_results(after)}
    common = a.keys() & b.keys()
    fixed = sum(1 for k in common if b[k] and not a[k])
    broken = sum(1 for k in common if a[k] and not b[k])
    z = (fixed - broken) / (fixed + broken) ** 0.5 if fixed + broken else 0.0
    return {"grpo_fixed": float(fixed), "grpo_broken": float(broken), "mcnemar_z": z}


def load_results(manifest: dict) -> list[dict]:
    return storage.read_jsonl(storage.join(manifest["uri"], "results.jsonl"))
