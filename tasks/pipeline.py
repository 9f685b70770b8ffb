"""One pipeline run: its MLflow parent run, the stage records, headline metrics and the summary."""

from __future__ import annotations

import logging
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator

import yaml

from tasks.sources import ModelSource
from tasks.tracking import (MlflowLogger, TrackingError, TrackingRef, artifact_store_problem, ended_status,
                            mlflow_client, prefect_logger, tracking_uri)
from trainer import storage
from trainer.config import RunConfig


@dataclass
class PipelineRun:
    cfg: RunConfig
    ref: TrackingRef
    logger: MlflowLogger
    flow_name: str
    started: float = field(default_factory=time.perf_counter)
    stages: list[dict[str, Any]] = field(default_factory=list)
    headline: dict[str, float] = field(default_factory=dict)
    registered_model: str | None = None  # "name/version" once the final policy is registered
    comparison: str | None = None  # nightly runs: the comparison with the best earlier nightly
    source: ModelSource | None = None  # what a models:/ model.pretrained named (cfg holds its download)

    def pretrained(self) -> str | None:
        """model.pretrained as configured (a models:/ URI pinned to its version), not its download."""
        return self.source.pinned if self.source else self.cfg.model.pretrained

    def add(self, manifest: dict[str, Any]) -> dict[str, Any]:
        """Record a finished stage (ran or cache hit) and pass its manifest on; the prepared data's
        splits become the parent run's dataset inputs."""
        from tasks.stages import TRAIN_TEST

        self.stages.append(manifest)
        if manifest["stage"] == "prepare_data":
            self.logger.log_data(manifest, TRAIN_TEST)
        return manifest

    def report(self, **metrics: float) -> None:
        """Headline metrics on the parent run under stable names (nightly comparisons use them)."""
        self.headline.update(metrics)
        self.logger.log_metrics(metrics)

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def result(self) -> dict[str, Any]:
        return {
            "flow_name": self.flow_name,
            "preset": self.cfg.name,
            "task": self.cfg.task.label, "grader": self.cfg.task.grader,
            "mlflow_run_id": self.ref.parent_run_id,
            "mlflow_experiment_id": self.ref.experiment_id,
            "flow_run_id": self.ref.flow_run_id,
            "headline": dict(self.headline),
            "registered_model": self.registered_model,
            "comparison": self.comparison,
            "wall_seconds": self.elapsed(),
            "stages": [{"stage": m["stage"], "label": _label(m), "key": m["key"], "uri": m["uri"], "cache_hit": m["cache_hit"],
                        "wall_seconds": m["wall_seconds"], "metrics": m.get("metrics", {})}
                       for m in self.stages],
        }


def _label(manifest: dict[str, Any]) -> str:
    if manifest.get("skipped"):
        return f"{manifest['stage']} (off: pretrained)"
    evaluated = manifest.get("evaluated_stage")
    return f"{manifest['stage']} ({evaluated})" if evaluated else manifest["stage"]


# MLflow 3's UI opens an experiment in the view this tag names; without it, an experiment whose runs
# it cannot classify opens in the GenAI view (traces, judges, prompts; no metric columns).
EXPERIMENT_KIND = {"mlflow.experimentKind": "custom_model_development"}


def experiment_id(client, name: str, artifact_location: str | None = None) -> str:
    """The experiment's id, creating it (with its artifact location, if given) when missing; tagged
    as model training for MLflow's UI unless someone chose another kind."""
    exp = client.get_experiment_by_name(name)
    if exp is not None:
        if not any(k in exp.tags for k in EXPERIMENT_KIND):
            for k, v in EXPERIMENT_KIND.items():
                client.set_experiment_tag(exp.experiment_id, k, v)
        if artifact_location and exp.artifact_location.rstrip("/") != artifact_location.rstrip("/"):
            logging.getLogger(__name__).warning(
                "tracking.artifact_location=%s: experiment %r already keeps its artifacts at %s (MLflow cannot "
                "move them); use a new tracking.experiment for the new location", artifact_location, name,
                exp.artifact_location)
        return exp.experiment_id
    try:
        return client.create_experiment(name, artifact_location=artifact_location, tags=EXPERIMENT_KIND)
    except Exception:  # created meanwhile by a concurrent run
        return client.get_experiment_by_name(name).experiment_id


# The runs table in MLflow 3's model-training view (not GenAI's, which the UI opens by default), the
# finished speedruns only (those with a final accuracy: the parent runs), best first. Which columns
# show is the browser's own saved state in MLflow 3.17, which a link cannot set (docs/serving.md).
RUNS_TABLE_QUERY = ("workflowType=machine_learning&searchFilter=metrics.final_accuracy%20%3E%3D%200"
                    "&orderByKey=metrics.%60final_accuracy%60&orderByAsc=false")


def mlflow_ui_urls(experiment_id: str, run_id: str | None = None, ui: str | None = None) -> tuple[str, str | None]:
    """The MLflow UI's runs table of an experiment, and a run's page: under `ui`, else the tracking
    server when MLFLOW_TRACKING_URI is one, else where `make serve` (and `mlflow ui`) listen by default."""
    runs = f"{_ui_base(ui)}/#/experiments/{experiment_id}/runs"
    return f"{runs}?{RUNS_TABLE_QUERY}", (f"{runs}/{run_id}?workflowType=machine_learning" if run_id else None)


def mlflow_models_url(experiment_id: str, ui: str | None = None) -> str:
    """The experiment's *Models* tab in the MLflow UI (its policies as logged models, with their
    evals' metrics), where `mlflow_ui_urls` finds the UI."""
    return f"{_ui_base(ui)}/#/experiments/{experiment_id}/models?workflowType=machine_learning"


def _ui_base(ui: str | None) -> str:
    uri = tracking_uri()
    return (ui or (uri if uri.startswith(("http://", "https://")) else "http://127.0.0.1:5000")).rstrip("/")


def _flow_run() -> tuple[str | None, str | None]:
    from prefect.runtime import flow_run

    try:
        return flow_run.id, flow_run.name
    except Exception:
        return None, None


def warm_up() -> None:
    """Load what every pipeline run needs first: the MLflow store (created or migrated), the reward
    registry (stage keys) and the plotting stack (the summary). The CLI calls it while its temporary
    Prefect server starts, on the other core, so a fully cached run does not wait for them later."""
    import matplotlib.pyplot  # noqa: F401
    import PIL.Image  # noqa: F401

    import trainer.rl.rewards  # noqa: F401

    mlflow_client(tracking_uri())


@contextmanager
def pipeline_run(cfg: RunConfig, flow_name: str, recompute: frozenset[str] = frozenset(),
                 nightly: bool = False, source: ModelSource | None = None) -> Iterator[PipelineRun]:
    """The pipeline's MLflow parent run, with the resolved config as params and config.yaml (`source`:
    what a models:/ model.pretrained named, which they show pinned, and the run's tags name)."""
    log = prefect_logger()
    uri = tracking_uri()
    client = mlflow_client(uri)
    exp_id = experiment_id(client, cfg.tracking.experiment, cfg.tracking.artifact_location)
    flow_run_id, flow_run_name = _flow_run()
    tags = {"posttrain.flow": flow_name, "posttrain.preset": cfg.name, "posttrain.nightly": str(nightly).lower(),
            "posttrain.task": cfg.task.label, "posttrain.grader": cfg.task.grader}
    if recompute:
        tags["posttrain.recompute"] = ",".join(sorted(recompute))
    if flow_run_id:
        tags.update({"prefect.flow_run_id": flow_run_id, "prefect.flow_run_name": flow_run_name or ""})
    run = client.create_run(exp_id, run_name=f"{flow_name}-{cfg.name}-{time.strftime('%Y%m%d-%H%M%S')}", tags=tags)
    ref = TrackingRef(uri, exp_id, run.info.run_id, flow_run_id, frozenset(recompute),
                      source.model_id if source else None)
    logger = MlflowLogger(client, run.info.run_id)
    log.info("MLflow run %s (experiment %r, tracking %s)", run.info.run_id, cfg.tracking.experiment, uri)
    try:  # from here on a failure ends the MLflow run as failed, not running for good
        shown = cfg.to_dict()
        if source:
            shown["model"]["pretrained"] = source.pinned
            logger.log_source(source)
        logger.log_params(shown)
        resolved = yaml.safe_dump(shown, sort_keys=False)
        try:  # the run's first artifact: where an artifact store this process cannot use shows
            logger.log_text(resolved, "config.yaml")
        except Exception as exc:
            problem = storage.setup_problem(run.info.artifact_uri, exc)
            if problem is None:
                raise
            raise TrackingError(artifact_store_problem(problem)) from None
        storage.write_text(storage.join(cfg.artifact_root, "runs", run.info.run_id, "config.yaml"), resolved)
        pipe = PipelineRun(cfg, ref, logger, flow_name, source=source)
        yield pipe
    except BaseException as exc:
        client.set_terminated(run.info.run_id, ended_status(exc))
        raise
    if "wall_seconds" not in pipe.headline:
        pipe.report(wall_seconds=pipe.elapsed())
    client.set_terminated(run.info.run_id)


# ---------------------------------------------------------------- running the table's rows

def run_row(stage, cfg: RunConfig, results: dict[str, dict | None], ref: TrackingRef,
            fault: dict[str, int]) -> dict[str, Any]:
    """One row of tasks/stages.py's table, from the results of the rows before it: a Prefect task
    of its own (a row whose steps are tasks, GRPO's, runs in the flow itself)."""
    from tasks import stages
    from tasks.runner import run_stage

    inputs = stage.inputs_from(results)
    compute = stages.load(stage.body)(cfg, inputs, ref, fault)
    config = {section: cfg.to_dict()[section] for section in stage.key.sections}
    upstream = {name: {"key": m["key"], "uri": m["uri"]} if m else None for name, m in inputs.items()}

    # The stage's keyed config and its inputs are the task's parameters (the UI lists them under
    # Task Inputs) and a markdown artifact on the task run's page (values the UI does not show).
    def stage_task(config: dict[str, Any], inputs: dict[str, Any]) -> dict[str, Any]:
        publish_inputs(stage.name, config, inputs)
        return run_stage(stage.kind, cfg, stage.inputs_from(results), compute, ref, row=stage.name)

    if not stage.task:
        return stage_task(config, upstream)
    from prefect import task
    from prefect.cache_policies import NO_CACHE

    return task(name=stage.kind, cache_policy=NO_CACHE)(stage_task)(config, upstream)


def inputs_markdown(stage: str, config: dict[str, Any], inputs: dict[str, Any]) -> str:
    lines = [f"### {stage}: what it ran with", "", "| input | result key | folder |", "|---|---|---|"]
    lines += [f"| {name} | {m['key'] if m else '(off)'} | {m['uri'] if m else ''} |" for name, m in inputs.items()]
    if not inputs:
        lines.append("| (none) | | |")
    lines += ["", "Config (the sections its cache key reads):", "", "```yaml",
              yaml.safe_dump(config, sort_keys=False).rstrip(), "```"]
    return "\n".join(lines)


def publish_inputs(stage: str, config: dict[str, Any], inputs: dict[str, Any]) -> None:
    """A markdown artifact on the current Prefect task run (or flow run): the stage's config and inputs."""
    from prefect.artifacts import create_markdown_artifact

    try:
        create_markdown_artifact(inputs_markdown(stage, config, inputs), description=f"{stage}: config and inputs")
    except Exception as exc:  # the record is for people; a Prefect API hiccup must not fail the stage
        prefect_logger().warning("%s: could not publish its inputs as a Prefect artifact (%s)", stage, exc)


def report_start(run: PipelineRun, results: dict) -> None:
    run.logger.set_tags({"posttrain.start_policy": "sft" if run.cfg.sft.enabled else f"pretrained: {run.pretrained()}"})


def report_start_eval(run: PipelineRun, results: dict) -> None:
    # the starting policy's accuracy is start_accuracy either way, and also sft_accuracy (the name
    # older runs have) when SFT ran
    metrics = results["eval (sft)"]["metrics"]
    accuracy = metrics["eval/accuracy"]
    run.report(start_accuracy=accuracy)
    # eval.pretrained and eval.few_shot: the policy before SFT, zero-shot and with k shots
    for name in ("pretrained", "few_shot"):
        if f"eval/{name}_n" not in metrics:
            continue
        run.report(**{f"{name}_n": metrics[f"eval/{name}_n"], "held_out_n": metrics["eval/n"]})
        for key in ("accuracy", "flexible_accuracy", "lm_strict_accuracy", "lm_flexible_accuracy"):
            value = metrics.get(f"eval/{name}_{key}")
            if value is not None and value == value:  # NaN: a task with one verdict
                run.report(**{f"{name}_{key}": value})
    if "eval/few_shot_n" in metrics:
        run.report(few_shot_k=float(run.cfg.eval.few_shot))
    if run.cfg.sft.enabled:
        run.report(sft_accuracy=accuracy)


def report_grpo(run: PipelineRun, results: dict) -> None:
    run.report(final_reward=results["grpo"]["metrics"]["grpo/final_reward_mean"])


def report_grpo_eval(run: PipelineRun, results: dict) -> None:
    from tasks.eval import paired_comparison

    before, after = results["eval (sft)"], results["eval (grpo)"]
    run.report(**paired_comparison(before, after),
               **paired_comparison(before, after, "grpo_flexible_", field="correct_flexible"),
               **paired_comparison(before, after, "grpo_lm_flexible_", field="correct_lm_flexible"))


def report_control_eval(run: PipelineRun, results: dict) -> None:
    from tasks.eval import paired_comparison, seen

    control, final = results["eval (control)"], results["eval (grpo)"]
    run.report(control_accuracy=control["metrics"]["eval/accuracy"], **seen(control, "control"),
               **paired_comparison(control, final, "vs_control_"),
               **paired_comparison(control, final, "vs_control_lm_flexible_", field="correct_lm_flexible"))


def report_final(run: PipelineRun, results: dict) -> None:
    """Once every row ran: the final policy's headline metrics."""
    from tasks.eval import seen

    start, final = results["eval (sft)"], results.get("eval (grpo)") or results["eval (sft)"]
    run.report(**seen(start, "sft" if run.cfg.sft.enabled else "start"), **seen(final, "final"))
    run.report(final_accuracy=final["metrics"]["eval/accuracy"])
    # multi-turn environments: each model's tool use on the held-out problems, and the last round's
    for name, result in (("sft" if run.cfg.sft.enabled else "start", start), ("final", final),
                         ("control", results.get("eval (control)"))):
        metrics = (result or {}).get("metrics", {})
        run.report(**{f"{name}_{k}": metrics[f"eval/{k}"] for k in TOOL_METRICS if f"eval/{k}" in metrics})
    grpo = (results.get("grpo") or {}).get("metrics", {})
    if "grpo/last_tool_calls_mean" in grpo:
        run.report(rollout_tool_calls_mean=grpo["grpo/last_tool_calls_mean"])
    run.report(wall_seconds=run.elapsed())


TOOL_METRICS = ("tool_use_rate", "tool_calls_mean", "tool_success_rate", "accuracy_without_tools")
