"""The speedrun flow, and a flow per stage (each runs its upstream stages, from cache when done).

    posttrain speedrun --preset tiny [--set sft.lr=1e-3 ...]
"""

from __future__ import annotations

from prefect import flow

from flows.grpo import grpo_stage
from tasks.eval import paired_comparison, run_eval
from tasks.pipeline import pipeline_run
from tasks.prepare_data import prepare_data
from tasks.sft import run_sft
from tasks.tokenizer import train_tokenizer
from trainer.config import load_config

STAGES = ("prepare_data", "tokenizer", "sft", "grpo", "eval")


def run_pipeline(preset: str, overrides: list[str], until: str, flow_name: str,
                 fault: dict[str, int] | None = None) -> dict:
    cfg = load_config(preset, overrides)
    fault = fault or {}
    with pipeline_run(cfg, flow_name) as run:
        data = run.add(prepare_data(cfg, run.ref))
        if until == "prepare_data":
            return run.result()
        tok = run.add(train_tokenizer(cfg, data, run.ref)) if cfg.tokenizer.train else None
        if until == "tokenizer":
            return run.result()
        policy = run.add(run_sft(cfg, data, tok, run.ref, fault_at_step=fault.get("sft")))
        if until == "sft":
            return run.result()
        final_eval = sft_eval = run.add(run_eval(cfg, data, policy, run.ref))
        run.report(sft_accuracy=sft_eval["metrics"]["eval/accuracy"])
        if cfg.grpo.enabled and until in ("grpo", "eval"):
            policy = run.add(grpo_stage(cfg, data, policy, run.ref, fault))
            if until == "grpo":
                return run.result()
            final_eval = run.add(run_eval(cfg, data, policy, run.ref))
            run.report(**paired_comparison(sft_eval, final_eval))
        run.report(final_accuracy=final_eval["metrics"]["eval/accuracy"])
    return run.result()


@flow(name="speedrun", log_prints=True)
def speedrun(preset: str = "tiny", overrides: list[str] = []) -> dict:  # noqa: B006 (Prefect form default)
    """The whole pipeline: prepare_data -> tokenizer -> sft -> eval -> grpo -> eval."""
    return run_pipeline(preset, overrides, "eval", "speedrun")


@flow(name="prepare_data")
def prepare_data_flow(preset: str = "tiny", overrides: list[str] = []) -> dict:  # noqa: B006
    return run_pipeline(preset, overrides, "prepare_data", "prepare_data")


@flow(name="tokenizer")
def tokenizer_flow(preset: str = "tiny", overrides: list[str] = []) -> dict:  # noqa: B006
    return run_pipeline(preset, overrides, "tokenizer", "tokenizer")


@flow(name="sft")
def sft_flow(preset: str = "tiny", overrides: list[str] = []) -> dict:  # noqa: B006
    return run_pipeline(preset, overrides, "sft", "sft")


@flow(name="grpo")
def grpo_flow(preset: str = "tiny", overrides: list[str] = []) -> dict:  # noqa: B006
    return run_pipeline(preset, overrides, "grpo", "grpo")


@flow(name="eval")
def eval_flow(preset: str = "tiny", overrides: list[str] = []) -> dict:  # noqa: B006
    return run_pipeline(preset, overrides, "eval", "eval")


FLOWS = {"speedrun": speedrun, "prepare-data": prepare_data_flow, "tokenizer": tokenizer_flow,
         "sft": sft_flow, "grpo": grpo_flow, "eval": eval_flow}
