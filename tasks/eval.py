"""eval stage: greedy held-out accuracy, format rate and response length of a model manifest.
With `rollout.engine: sglang` the answers come from SGLang servers on the evaluated model (launched
for the stage, or rollout.sglang.urls loaded with it), otherwise, or with `eval.engine: hf`, from HF
generate in this process.

Run alone: `posttrain eval --preset tiny` (evaluates the pipeline's final model).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from tasks.prepare_data import load_split
from tasks.sft import model_dir
from trainer import storage


def body(cfg, inputs: dict, ref, fault: dict):
    data, model = inputs["data"], inputs["model"]

    def compute(work: Path, logger) -> dict:
        # torch and transformers load here, not at import: a fully cached run never needs them
        from trainer.engine import device, fp32_matmul
        from trainer.evaluate import evaluate
        from trainer.model import load_model
        from trainer.problems import task_of
        from trainer.tokenizer import load_tokenizer

        path = model_dir(model)
        tok = load_tokenizer(path)
        fp32_matmul(cfg.model.tf32)
        engine = policy = None
        if cfg.eval_engine() == "sglang":  # greedy answers from the servers the rollouts use, not HF generate
            from tasks.grpo import launch_sglang

            engine = launch_sglang(cfg, model)
            if cfg.rollout.sglang.urls:  # servers run by someone else serve what they last loaded
                from trainer.inference.store_sync import load_once

                load_once(engine, cfg.rollout.sglang.weight_sync, cfg.artifact_root, path, f"{work.name}@model")
        else:
            policy = load_model(path, cfg.model.dtype).to(device())
        logger.set_tags({"posttrain.answered_by": "sglang" if engine is not None else "hf generate"})
        # an sft stage that trained nothing (sft.enabled=false) holds the pretrained starting policy
        evaluated_stage = "start" if model.get("skipped") else model["stage"]
        label = f"eval ({evaluated_stage})"  # as the summary names the stage
        try:
            env = cfg.rollout.environment  # a multi-turn one: each problem an episode with its tools
            test = load_split(data, "test")
            task = task_of(cfg.task)  # whose verdict every row gets
            result = evaluate(policy, tok, test, cfg.eval, engine=engine, environment=env, label=f"{label} held-out",
                              task=task)
            storage.write_jsonl(str(work / "results.jsonl"), result.rows)
            metrics = {**result.metrics(), "eval/seconds": result.seconds}
            if evaluated_stage in ("sft", "start"):
                metrics.update(_starting_policy(cfg, data, tok, policy, evaluated_stage, test, task, work, label))
            if env.multi_turn:  # the same policy answering alone: what the tools are worth to it
                alone = evaluate(policy, tok, test, cfg.eval, engine=engine, label=f"{label} held-out, no tools",
                                 task=task)
                metrics["eval/accuracy_without_tools"] = alone.accuracy
            seen_rows = seen_sample(load_split(data, "train"), cfg.eval.seen_examples, cfg.seed)
            if seen_rows:
                seen_result = evaluate(policy, tok, seen_rows, cfg.eval.model_copy(update={"max_examples": None}),
                                       engine=engine, environment=env, label=f"{label} seen", task=task)
                storage.write_jsonl(str(work / "seen_results.jsonl"), seen_result.rows)
                logger.log_table(seen_result.rows, "eval_seen_results.json")
                metrics.update({"eval/seen_accuracy": seen_result.accuracy, "eval/seen_n": float(seen_result.n),
                                "eval/memorisation_gap": seen_result.accuracy - result.accuracy})
        finally:
            if engine is not None:
                engine.close()
        log_metrics(logger, metrics, data, model)
        logger.log_table(result.rows, "eval_results.json")
        return {"metrics": metrics, "evaluated": model["key"], "evaluated_stage": evaluated_stage}

    return compute


def _starting_policy(cfg, data: dict, tok, policy, evaluated_stage: str, test: list[dict], task, work: Path,
                     label: str) -> dict[str, float]:
    """eval.pretrained: model.pretrained (the policy SFT started from) on the same held-out problems (the
    first eval.pretrained_examples of them) (eval/pretrained_*, pretrained_results.jsonl); eval.few_shot: the starting policy with k training
    problems as earlier turns (eval/few_shot_*, few_shot_results.jsonl, the shots' ids in
    eval/few_shot_ids.json)."""
    from trainer.engine import device
    from trainer.evaluate import evaluate
    from trainer.model import build_model

    ev, metrics = cfg.eval, {}
    test = test[: ev.pretrained_examples] if ev.pretrained_examples else test
    start = policy if evaluated_stage == "start" else None
    if ev.pretrained and start is None:
        start = build_model(cfg.model, tok, cfg.seed).to(device())
        result = evaluate(start, tok, test, ev, label=f"{label} held-out, pretrained", task=task)
        storage.write_jsonl(str(work / "pretrained_results.jsonl"), result.rows)
        metrics.update({**result.metrics("eval/pretrained_"), "eval/pretrained_seconds": result.seconds})
    if ev.few_shot and start is not None:
        shots = few_shot_examples(load_split(data, "train"), ev.few_shot, cfg.seed)
        storage.write_text(str(work / "few_shot_ids.json"), json.dumps([s["id"] for s in shots]))
        result = evaluate(start, tok, test, ev, label=f"{label} held-out, {ev.few_shot}-shot", task=task, shots=shots)
        storage.write_jsonl(str(work / "few_shot_results.jsonl"), result.rows)
        metrics.update({**result.metrics("eval/few_shot_"), "eval/few_shot_seconds": result.seconds})
    return metrics


def few_shot_examples(train: list[dict], k: int, seed: int) -> list[dict]:
    """k training problems with their worked answers (the same for every question of a run), drawn by seed."""
    picked = random.Random(f"{seed}/few-shot").sample(range(len(train)), min(k, len(train)))
    return [train[i] for i in picked]


def log_metrics(logger, metrics: dict[str, float], data: dict, model: dict) -> None:
    """The eval's metrics on its run, and on the evaluated policy's MLflow logged model where this
    store has it: the held-out ones measured on the test split's dataset, the seen ones on the
    training split's, so the model's page (and the *Models* tab's columns) say what each was
    measured on."""
    from tasks.tracking import dataset_name

    policy = logger.known_model(model.get("mlflow_model_id"))
    if policy is None:
        logger.log_metrics(metrics)
        return
    seen = {k: v for k, v in metrics.items() if k.startswith("eval/seen_")}
    gap = {k: v for k, v in metrics.items() if k == "eval/memorisation_gap"}  # both splits
    # the pretrained policy's scores (eval.pretrained, eval.few_shot) are not this model's: the run's only
    start = {k: v for k, v in metrics.items() if k.startswith(("eval/pretrained_", "eval/few_shot_"))}
    if start:
        logger.log_metrics(start)
    held_out = {k: v for k, v in metrics.items() if k not in seen and k not in gap and k not in start}
    logger.log_metrics(held_out, model_id=policy.model_id, dataset=dataset_name(data, "test"))
    if seen:
        logger.log_metrics(seen, model_id=policy.model_id, dataset=dataset_name(data, "train"))
    if gap:
        logger.log_metrics(gap, model_id=policy.model_id)


def seen_sample(train: list[dict], n: int, seed: int) -> list[dict]:
    """A fixed sample of training rows (the same for every model of a run) to measure accuracy on
    problems the model was trained on."""
    if n <= 0:
        return []
    picked = random.Random(f"{seed}/seen-sample").sample(range(len(train)), min(n, len(train)))
    return [train[i] for i in sorted(picked)]


def paired_comparison(before: dict, after: dict, prefix: str = "grpo_", field: str = "correct") -> dict[str, float]:
    """Held-out problems `after` gets right and `before` wrong (fixed), the reverse (broken), and
    McNemar's z, as {prefix}fixed, {prefix}broken, {prefix}mcnemar_z (the default keeps the
    names of the SFT -> GRPO comparison: grpo_fixed, grpo_broken, mcnemar_z). `field` picks the
    rows' strict `correct` or `correct_flexible`; results older than the flexible column give {}."""
    rows_a, rows_b = load_results(before), load_results(after)
    if any(field not in r for r in rows_a + rows_b):
        return {}
    a = {r["id"]: r[field] for r in rows_a}
    b = {r["id"]: r[field] for r in rows_b}
    common = a.keys() & b.keys()
    fixed = sum(1 for k in common if b[k] and not a[k])
    broken = sum(1 for k in common if a[k] and not b[k])
    z = (fixed - broken) / (fixed + broken) ** 0.5 if fixed + broken else 0.0
    z_name = "mcnemar_z" if prefix == "grpo_" else f"{prefix}mcnemar_z"
    return {f"{prefix}fixed": float(fixed), f"{prefix}broken": float(broken), z_name: z}


def seen(evaluation: dict, name: str) -> dict[str, float]:
    """{name}_seen_accuracy: the model's accuracy on the sample of training problems, if measured,
    {name}_flexible_accuracy: its held-out accuracy by the last number in the response, and with
    eval.lm_eval {name}_lm_strict_accuracy and {name}_lm_flexible_accuracy (lm-evaluation-harness's)."""
    out = {}
    for metric, key in (("eval/seen_accuracy", "seen_accuracy"), ("eval/flexible_accuracy", "flexible_accuracy"),
                        ("eval/lm_strict_accuracy", "lm_strict_accuracy"),
                        ("eval/lm_flexible_accuracy", "lm_flexible_accuracy")):
        value = evaluation["metrics"].get(metric)
        if value is not None and value == value:  # NaN: a task with one verdict has no flexible accuracy
            out[f"{name}_{key}"] = value
    return out


def load_results(manifest: dict) -> list[dict]:
    return storage.read_jsonl(storage.join(manifest["uri"], "results.jsonl"))
