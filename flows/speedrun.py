"""The speedrun flow, and a flow per stage (each runs its upstream stages, from cache when done).

    posttrain speedrun --preset tiny [--set sft.lr=1e-3 ...]
"""

from __future__ import annotations

from typing import Annotated, Literal, Union

from prefect import flow, task
from prefect.cache_policies import NO_CACHE
from prefect.utilities.annotations import quote
from pydantic import Field

from flows.grpo import grpo_stage
from tasks import report
from tasks.control import run_control
from tasks.eval import paired_comparison, run_eval, seen
from tasks.pipeline import pipeline_run
from tasks.prepare_data import prepare_data
from tasks.sft import run_sft
from tasks.tokenizer import train_tokenizer
from trainer.config import load_config, preset_names
from trainer.faults import POINTS

STAGES = ("prepare_data", "tokenizer", "sft", "grpo", "control", "eval")

# Typed parameters: the Prefect UI shows them as a form and the server rejects invalid values.
Preset = Union[Literal[tuple(preset_names())],
               Annotated[str, Field(pattern=r"\.ya?ml$", description="or a path to a YAML preset")]]
Override = Annotated[str, Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*=",
                                description="dotted override, e.g. sft.lr=1e-3")]
Stage = Literal[STAGES]
Fault = dict[Literal[POINTS], Annotated[int, Field(ge=1)]]


def expand_recompute(stages: list[str]) -> frozenset[str]:
    """A stage and every stage after it in STAGES (all computed from it)."""
    return frozenset(s for stage in stages for s in STAGES[STAGES.index(stage):])


def first_attempt() -> bool:
    """True unless this is a retry of a flow run (faults fire on the first attempt only)."""
    from prefect.runtime import flow_run

    return (flow_run.run_count or 1) <= 1


def run_pipeline(preset: str, overrides: list[str], until: str, flow_name: str,
                 fault: dict[str, int] | None = None, recompute: list[str] = (),
                 nightly: bool = False) -> dict:
    cfg = load_config(preset, overrides)
    fault = (fault or {}) if first_attempt() else {}
    with pipeline_run(cfg, flow_name, expand_recompute(recompute), nightly) as run:
        data = run.add(prepare_data(cfg, run.ref))
        if until == "prepare_data":
            return run.result()
        tok = run.add(train_tokenizer(cfg, data, run.ref)) if cfg.tokenizer.train else None
        if until == "tokenizer":
            return run.result()
        policy = sft = run.add(run_sft(cfg, data, tok, run.ref, fault_at_step=fault.get("sft")))
        if until == "sft":
            return run.result()
        # the starting policy: SFT's, or model.pretrained as it is (sft.enabled=false); its accuracy is
        # start_accuracy either way, and also sft_accuracy (the name older runs have) when SFT ran
        start = "sft" if cfg.sft.enabled else "start"
        run.logger.set_tags({"posttrain.start_policy": "sft" if cfg.sft.enabled else f"pretrained: {cfg.model.pretrained}"})
        final_eval = sft_eval = run.add(run_eval(cfg, data, policy, run.ref))
        run.report(start_accuracy=sft_eval["metrics"]["eval/accuracy"])
        if cfg.sft.enabled:
            run.report(sft_accuracy=sft_eval["metrics"]["eval/accuracy"])
        grpo = None
        if cfg.grpo.enabled and until in ("grpo", "eval"):
            policy = grpo = run.add(grpo_stage(cfg, data, policy, run.ref, fault))
            run.report(final_reward=grpo["metrics"]["grpo/final_reward_mean"])
            if until == "grpo":
                return run.result()
            final_eval = run.add(run_eval(cfg, data, policy, run.ref))
            run.report(**paired_comparison(sft_eval, final_eval),
                       **paired_comparison(sft_eval, final_eval, "grpo_flexible_", field="correct_flexible"))
            if cfg.control.enabled:
                control = run.add(run_control(cfg, data, sft, grpo, run.ref))
                control_eval = run.add(run_eval(cfg, data, control, run.ref))
                run.report(control_accuracy=control_eval["metrics"]["eval/accuracy"],
                           **seen(control_eval, "control"),
                           **paired_comparison(control_eval, final_eval, "vs_control_"))
        run.report(**seen(sft_eval, start), **seen(final_eval, "final"))
        run.report(final_accuracy=final_eval["metrics"]["eval/accuracy"])
        run.report(wall_seconds=run.elapsed())
        stages = {"prepare_data": data, "sft": sft, "grpo": grpo}
        publish_run(quote(run), quote({k: v for k, v in stages.items() if v}), policy["stage"], nightly)
    return run.result()


@task(name="report", cache_policy=NO_CACHE)
def publish_run(run, stages: dict, model_stage: str, nightly: bool) -> None:
    """Register the final policy, compare with earlier nightlies (nightly runs), publish artifacts."""
    report.register_policy(run, stages, model_stage)
    if nightly:
        comparison = report.compare(run.logger.client, run.cfg.tracking.experiment, run.ref.parent_run_id)
        text = run.comparison = comparison.text()
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
    return run_pipeline(preset, overrides, "eval", "speedrun", fault, recompute, nightly)


@flow(name="prepare_data")
def prepare_data_flow(preset: Preset = "tiny", overrides: list[Override] = [],  # noqa: B006
                      recompute: list[Stage] = []) -> dict:  # noqa: B006
    return run_pipeline(preset, overrides, "prepare_data", "prepare_data", recompute=recompute)


@flow(name="tokenizer")
def tokenizer_flow(preset: Preset = "tiny", overrides: list[Override] = [],  # noqa: B006
                   recompute: list[Stage] = []) -> dict:  # noqa: B006
    return run_pipeline(preset, overrides, "tokenizer", "tokenizer", recompute=recompute)


@flow(name="sft")
def sft_flow(preset: Preset = "tiny", overrides: list[Override] = [], recompute: list[Stage] = [],  # noqa: B006
             fault: Fault = {}) -> dict:  # noqa: B006
    return run_pipeline(preset, overrides, "sft", "sft", fault, recompute)


@flow(name="grpo")
def grpo_flow(preset: Preset = "tiny", overrides: list[Override] = [], recompute: list[Stage] = [],  # noqa: B006
              fault: Fault = {}) -> dict:  # noqa: B006
    return run_pipeline(preset, overrides, "grpo", "grpo", fault, recompute)


@flow(name="eval")
def eval_flow(preset: Preset = "tiny", overrides: list[Override] = [], recompute: list[Stage] = [],  # noqa: B006
              fault: Fault = {}) -> dict:  # noqa: B006
    return run_pipeline(preset, overrides, "eval", "eval", fault, recompute)


FLOWS = {"speedrun": speedrun, "prepare-data": prepare_data_flow, "tokenizer": tokenizer_flow,
         "sft": sft_flow, "grpo": grpo_flow, "eval": eval_flow}
