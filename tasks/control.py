"""control stage: the SFT-only control. The SFT policy, trained on by SFT (same data, same batch)
for as many seconds as GRPO trained (its rounds' rollouts, rewards and updates), then exported and evaluated like the GRPO policy. GRPO's gain
over it is what RL adds beyond spending the same compute on more SFT.

Run as part of `posttrain speedrun` when control.enabled (the tiny preset enables it).
"""

from __future__ import annotations

from pathlib import Path

from tasks.runner import run_launched
from tasks.tracking import prefect_logger
from tasks.sft import model_dir, train_and_export


def sft_seconds_per_step(sft: dict) -> float:
    """The SFT stage's measured pace (its timed steps: those after a resume, if it resumed)."""
    result = sft["result"]
    timed_steps = result["steps"] - (result.get("resumed_from_step") or 0)
    return max(result["train_seconds"] / max(timed_steps, 1), 1e-9)


def control_steps(cfg, sft: dict, grpo: dict) -> int:
    """SFT steps that take as long as GRPO trained: GRPO's training seconds (its rounds' rollouts,
    rewards and updates; not its evals, checkpoints or weight pushes) x control.time_factor over the
    SFT stage's measured seconds per training step, or control.steps when set. Fixed once both upstream
    results exist, so the control is cached and resumed like any stage; measured seconds vary with
    the machine's load, so only control.steps gives the same control weights run after run."""
    if cfg.control.steps is not None:
        return cfg.control.steps
    budget = grpo["metrics"]["grpo/train_seconds"] * cfg.control.time_factor
    return max(1, round(budget / sft_seconds_per_step(sft)))


def control_config(cfg, sft: dict, steps: int):
    """The run config of the continued SFT: from the SFT policy (and its tokenizer), `steps` steps
    at control.lr, a data order of its own."""
    c = cfg.control
    # epochs >= steps: the planned step count is max_steps, whatever the dataset size
    sft_cfg = cfg.sft.model_copy(update={"enabled": True, "lr": c.lr, "warmup_steps": min(c.warmup_steps, steps), "max_steps": steps,
                                         "epochs": max(cfg.sft.epochs, steps), "max_seconds": None})
    model = cfg.model.model_copy(update={"pretrained": str(model_dir(sft))})
    tokenizer = cfg.tokenizer.model_copy(update={"train": False})
    return cfg.model_copy(update={"sft": sft_cfg, "model": model, "tokenizer": tokenizer, "seed": cfg.seed + 1})


def body(cfg, inputs: dict, ref, fault: dict):
    data, sft, grpo = inputs["data"], inputs["sft"], inputs["grpo"]

    def compute(work: Path, logger) -> dict:
        steps = control_steps(cfg, sft, grpo)
        run_cfg = control_config(cfg, sft, steps)
        if cfg.control.steps is not None:
            prefect_logger().info("control: %d SFT steps from the SFT policy (control.steps)", steps)
        else:
            prefect_logger().info("control: %d SFT steps from the SFT policy, GRPO's %.1f training seconds at the SFT stage's "
                                  "%.3fs per step", steps, grpo["metrics"]["grpo/train_seconds"], sft_seconds_per_step(sft))
        logger.log_params({"control.budget_steps": steps, "control.grpo_train_seconds": grpo["metrics"]["grpo/train_seconds"]})
        if cfg.sft.deepspeed.launched:
            out = run_launched("sft", run_cfg, cfg.sft.deepspeed, work, ref, logger,
                               {"data": data, "tokenizer": None, "fault": None, "label": "control"})
        else:
            out = train_and_export(run_cfg, data, None, work, logger, label="control")
        metrics = {"control/steps": float(steps), "control/seconds": out["metrics"]["sft/train_seconds"],
                   "control/grpo_train_seconds": grpo["metrics"]["grpo/train_seconds"],
                   "control/final_loss": out["metrics"]["sft/final_loss"]}
        logger.log_metrics(metrics)
        return {**out, "metrics": {**out["metrics"], **metrics}}

    return compute
