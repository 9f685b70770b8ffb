"""What a finished speedrun leaves for people: a plot and summary in Prefect and MLflow, the final
policy in the MLflow Model Registry with its lineage, and the comparison with earlier nightlies."""

from __future__ import annotations

import base64
import io
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tasks import lease
from tasks.tracking import prefect_logger, same_store
from trainer import storage

COMPARED = ("final_accuracy", "final_flexible_accuracy", "final_lm_strict_accuracy", "final_lm_flexible_accuracy",
            "start_accuracy", "sft_accuracy", "control_accuracy",
            "mcnemar_z", "vs_control_mcnemar_z", "final_seen_accuracy", "final_reward", "wall_seconds")


# ---------------------------------------------------------------- plot

def grpo_history(grpo: dict | None) -> list[dict[str, Any]]:
    if not grpo:
        return []
    return storage.read_jsonl(storage.join(grpo["uri"], "history.jsonl"))


def progress_png(history: list[dict[str, Any]], headline: dict[str, float]) -> bytes:
    """Reward and accuracy per GRPO round, with the starting (SFT or pretrained) and final greedy
    accuracy as lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.6), dpi=100)
    rounds = [h["round"] for h in history]
    if history:
        ax.plot(rounds, [h.get("reward/mean", math.nan) for h in history], lw=1, alpha=0.6, label="reward (train rollouts)")
        ax.plot(rounds, [h.get("rollout/accuracy", math.nan) for h in history], lw=1, alpha=0.6,
                label="rollout accuracy")
        evals = [h for h in history if "eval/accuracy" in h]
        if evals:
            ax.plot([h["round"] for h in evals], [h["eval/accuracy"] for h in evals], "o-", label="held-out greedy accuracy")
    start = "sft_accuracy" if "sft_accuracy" in headline else "start_accuracy"  # no SFT: the pretrained policy
    for name, style in ((start, ":"), ("final_accuracy", "--")):
        if name in headline:
            ax.axhline(headline[name], ls=style, color="k", lw=1, label=f"{name} {headline[name]:.1%}")
    ax.set_xlabel("GRPO round")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return buf.getvalue()


def accuracy_lines(head: dict[str, float]) -> list[str]:
    """Held-out and seen-equation accuracy of SFT, GRPO and the SFT-only control, then the paired
    comparisons on the held-out problems (plain text: the CLI prints it, the summary quotes it)."""
    grpo_ran = "grpo_fixed" in head  # without GRPO the final policy is the SFT one: no GRPO row repeating it
    sft_ran = "sft_accuracy" in head or "start_accuracy" not in head  # runs before start_accuracy: SFT ran
    start = "SFT" if sft_ran else "start (pretrained)"
    names = ((start, "sft" if sft_ran else "start"), ("GRPO", "final"), ("control (SFT only)", "control"))
    # eval.pretrained / eval.few_shot: the policy before SFT, zero-shot and with k shots, first
    names = (("pretrained", "pretrained"), (f"pretrained {head.get('few_shot_k', 0):.0f}-shot", "few_shot")) + names
    rows = [(label, head.get(f"{name}_accuracy"), head.get(f"{name}_flexible_accuracy"),
             head.get(f"{name}_seen_accuracy"), head.get(f"{name}_lm_strict_accuracy"),
             head.get(f"{name}_lm_flexible_accuracy")) for label, name in names if name != "final" or grpo_ran]
    rows = [r for r in rows if r[1] is not None]
    if not rows:
        return []
    lm = any(r[4] is not None for r in rows)  # eval.lm_eval: lm-evaluation-harness's two GSM8K scores

    def pct(v: float | None) -> str:
        return f"{v:.1%}" if v is not None else "-"

    # held-out: strict (the last ####, what the reward scores); flexible: the last number in the text;
    # lm strict / lm flex: lm-evaluation-harness's strict-match and flexible-extract
    lines = [f"{'model':<20}{'held-out':>10}{'flexible':>10}" + (f"{'lm strict':>10}{'lm flex':>10}" if lm else "")
             + f"{'seen':>10}{'gap':>10}"]
    for label, held, flexible, seen, lm_strict, lm_flexible in rows:
        gap = f"{(seen - held) * 100:+.1f}pt" if seen is not None else "-"
        lines.append(f"{label:<20}{held:>10.1%}{pct(flexible):>10}"
                     + (f"{pct(lm_strict):>10}{pct(lm_flexible):>10}" if lm else "")
                     + f"{pct(seen):>10}{gap:>10}")
    n = head.get("pretrained_n", head.get("few_shot_n", 0))
    if 0 < n < head.get("held_out_n", 0):  # eval.pretrained_examples
        lines.append(f"(the pretrained rows: the first {n:.0f} of the {head['held_out_n']:.0f} held-out problems)")
    if grpo_ran:
        versus = "GRPO vs " + ("SFT:" if sft_ran else "start:")
        lines.append(f"{versus:<17}fixed {head['grpo_fixed']:.0f}, broke {head['grpo_broken']:.0f} held-out "
                     f"problems, McNemar z = {head['mcnemar_z']:.2f}")
        if "grpo_flexible_fixed" in head:
            lines.append(f"{'  flexible:':<17}fixed {head['grpo_flexible_fixed']:.0f}, broke "
                         f"{head['grpo_flexible_broken']:.0f}, McNemar z = {head['grpo_flexible_mcnemar_z']:.2f}")
        if "grpo_lm_flexible_fixed" in head:
            lines.append(f"{'  lm flex:':<17}fixed {head['grpo_lm_flexible_fixed']:.0f}, broke "
                         f"{head['grpo_lm_flexible_broken']:.0f}, McNemar z = {head['grpo_lm_flexible_mcnemar_z']:.2f}")
    if "vs_control_fixed" in head:
        lines.append(f"GRPO vs control: fixed {head['vs_control_fixed']:.0f}, broke {head['vs_control_broken']:.0f} "
                     f"held-out problems, McNemar z = {head['vs_control_mcnemar_z']:.2f}")
        if "vs_control_lm_flexible_fixed" in head:
            lines.append(f"{'  lm flex:':<17}fixed {head['vs_control_lm_flexible_fixed']:.0f}, broke "
                         f"{head['vs_control_lm_flexible_broken']:.0f}, McNemar z = "
                         f"{head['vs_control_lm_flexible_mcnemar_z']:.2f}")
    tools = [(label, name) for label, name in names if f"{name}_tool_calls_mean" in head]
    if tools:  # a multi-turn environment with tools (rollout.environment)
        # problems that called a tool, calls per problem, calls that parsed and succeeded, and the
        # held-out accuracy of the same policy with its tools and answering alone
        lines.append(f"{'tool use':<20}{'problems':>10}{'calls':>10}{'succeed':>10}{'with':>10}{'without':>10}")
        for label, name in tools:
            alone = head.get(f"{name}_accuracy_without_tools")
            lines.append(f"{label:<20}{head[f'{name}_tool_use_rate']:>10.1%}{head[f'{name}_tool_calls_mean']:>10.2f}"
                         f"{head[f'{name}_tool_success_rate']:>10.1%}{head[f'{name}_accuracy']:>10.1%}{pct(alone):>10}")
        if "rollout_tool_calls_mean" in head:
            lines.append(f"GRPO's last round: {head['rollout_tool_calls_mean']:.2f} tool calls per episode")
    return lines


def summary_markdown(result: dict[str, Any], png: bytes) -> str:
    head = result["headline"]
    lines = [f"# posttrain {result['flow_name']} ({result['preset']})", "",
             f"MLflow run `{result['mlflow_run_id']}`", ""]
    task = result.get("task", "math")
    table = accuracy_lines(head)
    if table:
        judged = (f"task {task}, judged by {result.get('grader', task)}" if task != "math" else
                  "held-out: strict (the final `#### n` or \\boxed{}); flexible: the last number")
        lines += [f"Accuracy on held-out problems and on a sample of training problems (seen); {judged}:", "",
                  "```", *table, "```"]
    lines += ["", "| stage | status | wall s |", "|---|---|---|"]
    lines += [f"| {s['label']} | {'cache hit' if s['cache_hit'] else 'ran'} | {s['wall_seconds']:.1f} |"
              for s in result["stages"]]
    lines += ["", f"![reward and accuracy per round](data:image/png;base64,{base64.b64encode(png).decode()})"]
    if result.get("comparison"):
        lines += ["", "## Against the best earlier nightly", "", "```", result["comparison"], "```"]
    return "\n".join(lines) + "\n"


def eval_table(stages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for s in stages:
        if s["stage"] == "eval":
            m = s["metrics"]
            rows.append({"model": s["label"], "accuracy": round(m.get("eval/accuracy", math.nan), 4),
                         "flexible_accuracy": round(m.get("eval/flexible_accuracy", math.nan), 4),
                         "seen_accuracy": round(m.get("eval/seen_accuracy", math.nan), 4),
                         "format_rate": round(m.get("eval/format_rate", math.nan), 4),
                         "mean_response_tokens": round(m.get("eval/mean_response_tokens", math.nan), 1),
                         "n": m.get("eval/n", ""), "cache_hit": s["cache_hit"]})
    return rows


def publish(run, result: dict[str, Any], grpo: dict | None) -> None:
    """Prefect artifacts (markdown summary with the plot, eval table) and the plot in MLflow."""
    from PIL import Image

    png = progress_png(grpo_history(grpo), result["headline"])
    run.logger.client.log_image(run.ref.parent_run_id, Image.open(io.BytesIO(png)), "plots/progress.png")
    if run.ref.flow_run_id is None:
        return
    from prefect.artifacts import create_markdown_artifact, create_table_artifact

    key = _artifact_key(result["flow_name"])
    create_markdown_artifact(summary_markdown(result, png), key=f"{key}-summary",
                             description="posttrain summary: accuracy, stage times, reward/accuracy per round")
    create_table_artifact(eval_table(result["stages"]), key=f"{key}-eval", description="held-out evaluation")


def _artifact_key(name: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in name.lower())


# ---------------------------------------------------------------- model registry

def register_policy(run, stages: dict[str, dict], model_stage: str) -> tuple[str, str] | None:
    """Register the final policy (the `model_stage` manifest's exported model) with its lineage.
    A policy already registered (same stage key) is not registered twice; returns (name, version)."""
    from mlflow.exceptions import MlflowException

    client, cfg, log = run.logger.client, run.cfg, prefect_logger()
    policy = stages[model_stage]
    name = cfg.registered_model_name()
    try:
        client.get_registered_model(name)
    except MlflowException:
        try:
            client.create_registered_model(name, description=f"posttrain final policies of preset {cfg.name}, "
                                                               f"task {cfg.task.label} (grader {cfg.task.grader})")
        except MlflowException:
            client.get_registered_model(name)  # created meanwhile by a concurrent run
    # runs on one artifact root register one policy once: the search and the creation under one lease
    with lease.hold(storage.join(cfg.artifact_root, "registry", f"{name}-{policy['key']}"),
                    lambda msg: log.info("registering %s: %s", name, msg)):
        return _register(run, stages, model_stage, name)


def _register(run, stages: dict[str, dict], model_stage: str, name: str) -> tuple[str, str]:
    client, cfg, log = run.logger.client, run.cfg, prefect_logger()
    policy = stages[model_stage]
    for v in client.search_model_versions(f"name = '{name}'"):
        if v.tags.get("posttrain.policy_key") == policy["key"]:
            log.info("final policy already registered as %s version %s", name, v.version)
            known = run.logger.known_model(policy.get("mlflow_model_id"))
            _registered(run, f"{name}/{v.version}", known.model_id if known else None)
            return name, v.version
    source_run = policy["source_run_id"]
    source, model_id, run_artifacts = policy_source(run.logger, policy)
    tags = {
        "posttrain.policy_key": policy["key"], "posttrain.policy_stage": model_stage,
        "posttrain.dataset_key": stages["prepare_data"]["key"], "posttrain.dataset_uri": stages["prepare_data"]["uri"],
        "posttrain.sft_run": stages["sft"]["source_run_id"], "posttrain.sft_key": stages["sft"]["key"],
        "posttrain.config_hash": config_hash(cfg), "posttrain.pipeline_run": run.ref.parent_run_id,
        "posttrain.preset": cfg.name, "posttrain.task": cfg.task.label, "posttrain.grader": cfg.task.grader,
    }
    if cfg.model.lora is not None:  # the version's source is the merged model; the adapter sits beside it
        adapter = f"{run_artifacts}/adapter" if run_artifacts else storage.join(policy["uri"], policy["adapter_subdir"])
        tags.update({"posttrain.lora": f"merged ({cfg.model.lora.describe()}); adapter in adapter/",
                     "posttrain.adapter_uri": adapter})
    else:
        tags["posttrain.lora"] = "none: full fine-tuning"
    if "grpo" in stages:
        tags.update({"posttrain.grpo_run": stages["grpo"]["source_run_id"], "posttrain.grpo_key": stages["grpo"]["key"]})
    if pretrained := run.pretrained():  # what training started from (a models:/ URI pinned to its version)
        tags["posttrain.pretrained"] = pretrained
        if run.source and run.source.model_id:
            tags["posttrain.pretrained_model_id"] = run.source.model_id
    if run.ref.flow_run_id:
        tags["prefect.flow_run_id"] = run.ref.flow_run_id
    version = client.create_model_version(name, source, run_id=source_run, tags=tags, model_id=model_id,
                                          description=f"final policy of MLflow run {run.ref.parent_run_id}")
    if model_id:  # the logged model's page lists the versions made from it (as mlflow.register_model records)
        listed = json.loads(client.get_logged_model(model_id).tags.get("mlflow.modelVersions") or "[]")
        client.set_logged_model_tags(model_id, {"mlflow.modelVersions": json.dumps(
            listed + [{"name": name, "version": version.version}])})
    _registered(run, f"{name}/{version.version}", model_id)
    log.info("registered the final policy as %s version %s", name, version.version)
    return name, version.version


def _registered(run, version: str, model_id: str | None) -> None:
    """The pipeline's run names its registered policy: a tag, and the policy's logged model (`model_id`,
    one this store has) as the run's output (its page's *Registered models* then shows the version;
    the model's source run stays the stage that trained it)."""
    run.registered_model = version
    run.logger.set_tags({"posttrain.registered_model": version})
    if model_id:
        run.logger.log_output(model_id)


def policy_source(logger, policy: dict) -> tuple[str, str | None, str | None]:
    """Where a registered version of `policy` (a stage's result) points: its MLflow logged model
    (`models:/<id>`, the model id) where this store has it, else (a result from before posttrain
    logged policies as models) the model folder among its run's artifacts, else (a run this store
    does not have: the result was computed while tracking elsewhere) its folder under the artifact
    root. Also the source run's artifact URI, where this store has that run."""
    import mlflow
    from mlflow.exceptions import MlflowException

    try:
        artifacts = logger.client.get_run(policy["source_run_id"]).info.artifact_uri.rstrip("/")
    except MlflowException:
        artifacts = None
    if model := logger.known_model(policy.get("mlflow_model_id")):
        # MLflow 3.17's SQL registry looks a models:/ source up in the process's global tracking store
        # (SqlAlchemyStore.create_model_version), not this client's: where the two differ, the model's
        # artifact location (the same weights; the version page then shows no source model)
        if same_store(logger.client.tracking_uri, mlflow.get_tracking_uri()):
            return f"models:/{model.model_id}", model.model_id, artifacts
        return model.artifact_location, model.model_id, artifacts
    if artifacts:
        return f"{artifacts}/{policy['model_subdir']}", None, artifacts
    return storage.join(policy["uri"], policy["model_subdir"]), None, None


def config_hash(cfg) -> str:
    return cfg.section_hash(*(k for k in cfg.to_dict() if k not in ("name", "artifact_root", "tracking")))


# ---------------------------------------------------------------- nightly comparison

@dataclass
class Comparison:
    run: Any
    baseline: Any | None
    rows: list[tuple[str, float | None, float | None]]
    chosen: bool = False  # the baseline was named (--baseline), not the best earlier nightly
    paired: str | None = None  # the final policies' held-out answers, problem by problem
    data: str | None = None  # whether the two read the same prepared rows

    def text(self) -> str:
        r = self.run
        lines = [f"run       {r.info.run_id}  {r.info.run_name}  (starts from {_start_policy(r)})"]
        if r.info.status != "FINISHED":  # failed, or still running: its headline has only what it reached
            lines[0] += f"  [{r.info.status}]"
        if self.baseline is None:
            lines.append("baseline  none: no earlier finished nightly run to compare with")
        else:
            b = self.baseline
            why = "named by --baseline" if self.chosen else "best earlier nightly of the task by final_accuracy"
            lines.append(f"baseline  {b.info.run_id}  {b.info.run_name}  ({why}; starts from {_start_policy(b)})")
            if b.info.status != "FINISHED":
                lines[-1] += f"  [{b.info.status}]"
        mine = _task_of(r)
        if self.baseline is not None and _task_of(self.baseline) != mine:
            lines.append(f"task      other tasks: run {mine}, baseline {_task_of(self.baseline)}: each accuracy is its "
                         "own task's verdict, so the two are not comparable")
        else:
            lines.append(f"task      {mine}: every accuracy below is its grader's verdict")
        if self.data:
            lines.append(self.data)
        lines.append(f"{'metric':<22}{'run':>12}{'baseline':>12}{'delta':>12}")
        for name, mine, base in self.rows:
            if mine is None and base is None:  # neither run has it (a task with one verdict has no flexible)
                continue
            delta = mine - base if mine is not None and base is not None else None
            pct = "accuracy" in name
            lines.append(f"{name:<22}{_fmt(mine, pct):>12}{_fmt(base, pct):>12}{_fmt(delta, pct, sign=True):>12}")
        if self.paired:
            lines.append(self.paired)
        return "\n".join(lines)

    def deltas(self) -> dict[str, float]:
        return {f"delta_{n}": m - b for n, m, b in self.rows if m is not None and b is not None}


BEST_ALIAS = "nightly-best"


def promote(run, comparison: Comparison) -> str | None:
    """A nightly whose final policy is more accurate (held-out, strict) than the best earlier
    nightly's, or the first nightly, moves the registered model's alias `nightly-best` to its
    version: `model.pretrained: models:/<name>@nightly-best` starts from the best nightly so far. A
    line saying what happened, or None (not registered, or not better: the alias stays)."""
    mine = run.headline.get("final_accuracy")
    if not run.registered_model or mine is None:
        return None
    best = comparison.baseline.data.metrics.get("final_accuracy") if comparison.baseline else None
    if best is not None and mine <= best:
        return None
    name, version = run.registered_model.rsplit("/", 1)
    run.logger.client.set_registered_model_alias(name, BEST_ALIAS, version)
    run.logger.set_tags({"posttrain.alias": BEST_ALIAS})
    than = f"the best earlier nightly's {best:.1%}" if best is not None else "no earlier nightly"
    return f"alias {BEST_ALIAS} -> {run.registered_model} (final accuracy {mine:.1%} against {than})"


def _task_of(run) -> str:
    """The task a pipeline run learned, as its tags say (runs before the tag: math)."""
    task = run.data.tags.get("posttrain.task", "math")
    grader = run.data.tags.get("posttrain.grader", "math")
    return task if task == grader else f"{task} (grader {grader})"


def _start_policy(run) -> str:
    """What GRPO started from: "sft", or "pretrained: <model.pretrained>" (runs before the tag: sft)."""
    return run.data.tags.get("posttrain.start_policy", "sft")


def _fmt(v: float | None, pct: bool, sign: bool = False) -> str:
    if v is None:
        return "-"
    if pct:
        return f"{v * 100:+.1f} pt" if sign else f"{v:.1%}"
    return f"{v:+.4g}" if sign else f"{v:.4g}"


def nightly_runs(client, experiment_id: str) -> list[Any]:
    return client.search_runs(
        [experiment_id], "tags.`posttrain.nightly` = 'true' and attributes.status = 'FINISHED'",
        order_by=["attributes.start_time DESC"], max_results=500)


def compare(client, experiment: str, run_id: str | None = None, baseline_id: str | None = None) -> Comparison:
    """`run_id` (default: the latest finished nightly) against `baseline_id` (any pipeline run), by
    default the best earlier finished nightly; with the final policies' held-out answers paired."""
    from trainer.errors import InputError

    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        raise InputError(f"MLflow experiment {experiment!r} does not exist; check --experiment or MLFLOW_TRACKING_URI")
    nightlies = nightly_runs(client, exp.experiment_id)
    if run_id is None:
        if not nightlies:
            raise InputError(f"no finished nightly run in experiment {experiment!r}; run the speedrun-nightly "
                             "deployment (or `posttrain speedrun --nightly`) first, or pass --run RUN_ID")
        run = nightlies[0]
    else:
        run = _pipeline_run(client, run_id, "--run")
    if baseline_id is not None:
        baseline = _pipeline_run(client, baseline_id, "--baseline")
        if baseline.info.run_id == run.info.run_id:
            raise InputError(f"--baseline {baseline_id}: that is the compared run itself; name another run")
    else:
        earlier = [r for r in nightlies if r.info.start_time < run.info.start_time and _task_of(r) == _task_of(run)
                   and r.info.run_id != run.info.run_id and "final_accuracy" in r.data.metrics]
        baseline = max(earlier, key=lambda r: (r.data.metrics["final_accuracy"], r.info.start_time), default=None)
    rows = [(m, run.data.metrics.get(m), baseline.data.metrics.get(m) if baseline else None) for m in COMPARED]
    paired = paired_text(final_answers(client, run), final_answers(client, baseline)) if baseline else None
    data = data_text(run, baseline) if baseline else None
    return Comparison(run, baseline, rows, chosen=baseline_id is not None, paired=paired, data=data)


def data_text(run, baseline) -> str:
    """Whether two pipeline runs read the same prepared rows: their MLflow dataset inputs (each
    split's name and content digest), or that a run holds none (it stopped before its data, or ran
    before posttrain logged datasets)."""
    def read(r) -> dict[str, str]:
        return {d.dataset.name: d.dataset.digest for d in (r.inputs.dataset_inputs if r.inputs else [])}

    def listed(d: dict[str, str]) -> str:
        return ", ".join(f"{name} {digest}" for name, digest in sorted(d.items()))

    mine, theirs = read(run), read(baseline)
    missing = [who for who, d in (("the run", mine), ("the baseline", theirs)) if not d]
    if missing:
        return f"data      not recorded for {' and '.join(missing)} (no MLflow dataset inputs)"
    if mine == theirs:
        return f"data      the same rows: {listed(mine)}"
    return f"data      other rows: run {listed(mine)}; baseline {listed(theirs)}"


def _pipeline_run(client, run_id: str, flag: str):
    """A run by id; a stage's run (what MLflow lists under a pipeline run) stands for its pipeline's,
    which holds the headline."""
    from trainer.errors import InputError

    try:
        run = client.get_run(run_id)
    except Exception:
        raise InputError(f"{flag} {run_id}: no such MLflow run in {client.tracking_uri}") from None
    parent = run.data.tags.get("mlflow.parentRunId")
    if parent and run.data.tags.get("posttrain.stage"):
        run = client.get_run(parent)
    return run


def final_answers(client, run) -> list[dict] | None:
    """The held-out rows (id, question, correct, ...) of a pipeline run's final policy: its eval of
    GRPO, else of SFT or the starting policy, as the eval stage logged them (a cache hit's, from the
    run that computed it); None where the run has none (it stopped before, or holds no eval)."""
    import os

    evals = client.search_runs([run.info.experiment_id], f"tags.mlflow.parentRunId = '{run.info.run_id}' "
                               "and tags.`posttrain.stage` = 'eval'")
    bar = os.environ.get("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR")
    os.environ["MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR"] = "false"  # no progress bar per file downloaded
    try:
        table = _final_table(client, evals)
    finally:
        if bar is None:
            os.environ.pop("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", None)
        else:
            os.environ["MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR"] = bar
    if not table or "id" not in table.get("columns", ()):
        return None
    return [dict(zip(table["columns"], row)) for row in table["data"]]


def _final_table(client, evals) -> dict | None:
    """The eval table of the latest stage (GRPO, SFT, start) among a pipeline run's eval runs."""
    import tempfile

    by_stage: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as tmp:
        def artifact(run_id: str, name: str) -> Any:
            try:
                return json.loads(Path(client.download_artifacts(run_id, name, tmp)).read_text())
            except Exception:  # not logged (an older or failed run), or the artifact store is out of reach
                return None

        for child in evals:
            source = child.data.tags.get("source_run_id", child.info.run_id)
            manifest = artifact(source, "manifest.json") or {}
            by_stage.setdefault(manifest.get("evaluated_stage"), source)
        final = next((by_stage[s] for s in ("grpo", "sft", "start") if s in by_stage), None)
        return artifact(final, "eval_results.json") if final else None


def paired_text(mine: list[dict] | None, base: list[dict] | None) -> str:
    """The two final policies on the held-out problems both answered (same id, same question): how many
    the run gets right that the baseline got wrong (fixed), the reverse (broke), McNemar's z."""
    if mine is None or base is None:
        return "held-out, problem by problem: not available (a run has no final eval table in MLflow)"
    theirs = {(r["id"], r["question"]): bool(r["correct"]) for r in base}
    pairs = [(bool(r["correct"]), theirs[(r["id"], r["question"])]) for r in mine if (r["id"], r["question"]) in theirs]
    if not pairs:
        return ("held-out, problem by problem: no problem in common (different held-out sets: other data or "
                "settings), no paired test")
    fixed = sum(1 for a, b in pairs if a and not b)
    broke = sum(1 for a, b in pairs if b and not a)
    z = (fixed - broke) / math.sqrt(fixed + broke) if fixed + broke else 0.0
    common = "" if len(pairs) == len(mine) == len(base) else f" (of {len(mine)} and {len(base)})"
    return (f"held-out, problem by problem: run fixed {fixed}, broke {broke} of the baseline's answers on "
            f"{len(pairs)} common problems{common}, McNemar z = {z:.2f}")
