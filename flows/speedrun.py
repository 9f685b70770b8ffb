"""The speedrun flow, and a flow per stage (each runs its upstream stages, from cache when done).

    posttrain speedrun --preset tiny [--set sft.lr=1e-3 ...]
"""

from __future__ import annotations

from typing import Annotated, Literal, Union

from prefect import flow, task
from prefect.cache_policies import NO_CACHE
from prefect.utilities.annotations import quote
from pydantic import Field

from tasks import report, sources, stages
from tasks.pipeline import pipeline_run, report_final, run_row
from trainer import preflight
from trainer.config import load_config, preset_names
from trainer.faults import POINTS

# Typed parameters: the Prefect UI shows them as a form and the server rejects invalid values.
Preset = Union[Literal[tuple(preset_names())],
               Annotated[str, Field(pattern=r"\.ya?ml$", description="or a path to a YAML preset")]]
Override = Annotated[str, Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*=",
                                description="dotted override, e.g. sft.lr=1e-3")]
Stage = Literal[tuple(stages.kinds())]
Fault = dict[Literal[POINTS], Annotated[int, Field(ge=1)]]


def first_attempt() -> bool:
    """True unless this is a retry of a flow run (faults fire on the first attempt only)."""
    from prefect.runtime import flow_run

    return (flow_run.run_count or 1) <= 1


def run_pipeline(preset: str, overrides: list[str], until: str | None, flow_name: str,
                 fault: dict[str, int] | None = None, recompute: list[str] = (),
                 nightly: bool = False) -> dict:
    """The rows of tasks/stages.py's table in order, up to the row named `until` (None: all of
    them, then the headline metrics, the registered policy and the report)."""
    cfg, source = sources.resolve(load_config(preset, overrides))  # a models:/ model.pretrained: downloaded
    preflight.check(cfg)  # a custom environment or reward that cannot be used stops the run here
    stages.check_servers(cfg, until)  # ... and SGLang servers that cannot start here
    preflight.check_root(cfg)  # ... and an artifact_root that cannot hold results, before any MLflow run
    stages.check_hosts(cfg, until, stages.downstream(recompute))  # ... and hosts that cannot run a stage's ranks
    fault = (fault or {}) if first_attempt() else {}
    results: dict[str, dict | None] = {}
    with pipeline_run(cfg, flow_name, stages.downstream(recompute), nightly, source) as run:
        for row in stages.until(until):
            if not row.enabled(cfg):
                continue
            results[row.name] = run.add(run_row(row, cfg, results, run.ref, fault))
            if row.report:
                stages.load(row.report)(run, results)
        if until is None:
            report_final(run, results)
            policy = results.get("grpo") or results["sft"]
            lineage = {k: results[k] for k in ("prepare_data", "sft", "grpo") if results.get(k)}
            publish_run(quote(run), quote(lineage), policy["stage"], nightly)
    return run.result()


@task(name="report", cache_policy=NO_CACHE)
def publish_run(run, stages: dict, model_stage: str, nightly: bool) -> None:
    """Register the final policy (one a stage trained: starting from model.pretrained with SFT and
    GRPO off evaluates it, and registers nothing), compare with earlier nightlies (nightly runs),
    publish artifacts."""
    if stages[model_stage].get("skipped"):
        report.prefect_logger().info("no stage trained a policy (sft.enabled=false, grpo.enabled=false): the run "
                                     "evaluated model.pretrained, and registers nothing")
    else:
        report.register_policy(run, stages, model_stage)
    if nightly:
        comparison = report.compare(run.logger.client, run.cfg.tracking.experiment, run.ref.parent_run_id)
        promoted = report.promote(run, comparison)  # the best nightly so far: the alias nightly-best
        text = run.comparison = comparison.text() + (f"\n{promoted}" if promoted else "")
        report.prefect_logger().info("nightly comparison:\n%s", text)
        run.logger.log_text(text, "comparison.txt")
        run.logger.log_metrics(comparison.deltas())
        if comparison.baseline is not None:
            run.logger.set_tags({"posttrain.compared_with": comparison.baseline.info.run_id})
    report.publish(run, run.result(), stages.get("grpo"))


@flow(name="speedrun", log_prints=True)
def speedrun(preset: Preset = "tiny", overrides: list[Override] = [], recompute: list[Stage] = [],  # noqa: B006
             nightly: bool = False, fault: Fault = {}) -> dict:  # noqa: B006 (Prefect form defaults)
    """The whole pipeline: prepare_data -> tokenizer -> sft -> eval -> grpo -> eval, and with
    control.enabled the SFT-only control -> eval.

    Args:
        preset: a preset under configs/ (or a YAML path)
        overrides: dotted overrides applied to the preset, e.g. sft.lr=1e-3
        recompute: stages to recompute despite a cached result (their descendants recompute too)
        nightly: tag the MLflow run as a nightly and compare it with the best earlier nightly
        fault: test hook: {point: n} fails once at that point (first attempt of a flow run only)
    """
    return run_pipeline(preset, overrides, None, "speedrun", fault, recompute, nightly)


def _command_flow(row: stages.Stage):
    """The flow of a row's command: the pipeline up to that row (the last row's: all of it, its
    final headline metrics included)."""
    until = stages.until_for(row.command)

    @flow(name=row.kind)
    def stage_flow(preset: Preset = "tiny", overrides: list[Override] = [], recompute: list[Stage] = [],  # noqa: B006
                   fault: Fault = {}) -> dict:  # noqa: B006
        return run_pipeline(preset, overrides, until, row.kind, fault, recompute)

    stage_flow.__doc__ = f"The pipeline up to {row.name}, each stage from cache when it is there."
    return stage_flow


# `posttrain <command>` and prefect.yaml's entrypoints (flows/speedrun.py:sft_flow, ...)
FLOWS = {"speedrun": speedrun, **{command: _command_flow(row) for command, row in stages.commands().items()}}
globals().update({f"{row.kind}_flow": FLOWS[command] for command, row in stages.commands().items()})


def flow_for(command: str):
    """The flow of `posttrain <command>` (built now for a row added to the table since import)."""
    return FLOWS.get(command) or _command_flow(stages.commands()[command])
