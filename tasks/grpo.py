"""The GRPO stage as rounds of Prefect tasks: rollout -> reward -> update (+ weight publish) -> eval /
checkpoint, the round of `trainer.loop`.

    posttrain grpo --preset tiny

With one rank the rounds run in this process and each step is a task in the Prefect UI; the
trainer object lives in this process across tasks (it holds the DeepSpeed engine), wrapped in
`quote()` so Prefect does not walk thousands of token ids looking for futures. With several
(grpo.deepspeed.ranks_per_node > 1) the same loop runs on every rank under the DeepSpeed launcher,
supervised by the stage's task; rank 0's per-round lines stream into its log.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.utilities.annotations import quote

from tasks.runner import run_launched
from tasks.tracking import prefect_logger
from tasks.prepare_data import load_split
from tasks.sft import model_dir

# torch, transformers and the trainer are imported where a round runs: a run whose stages are all
# cache hits never needs them (seconds of start-up off every fully cached command)
if TYPE_CHECKING:
    from trainer.grpo import GRPOTrainer

# what on_rank imports when it runs: a launcher that forks the ranks imports them once first
# (tasks/rank_main.py's preload)
RANK_IMPORTS = ("trainer.grpo", "trainer.loop", "trainer.model", "trainer.tokenizer", "trainer.lora")


def launch_sglang(cfg, sft: dict):
    """SGLang servers on the SFT policy (or connections to rollout.sglang.urls), healthy."""
    from trainer.inference.sglang import SGLangEngine
    from trainer.tokenizer import load_tokenizer

    path = model_dir(sft)
    return SGLangEngine.from_config(cfg.rollout.sglang, str(path), load_tokenizer(path), cfg.model.dtype)


def with_sglang_urls(cfg, urls: list[str]):
    """cfg whose ranks connect to already running servers instead of launching their own."""
    sglang = cfg.rollout.sglang.model_copy(update={"urls": urls, "launch": False})
    return cfg.model_copy(update={"rollout": cfg.rollout.model_copy(update={"sglang": sglang})})


def make_trainer(cfg, data: dict, sft: dict, work: Path, logger) -> GRPOTrainer:
    from trainer.grpo import GRPOTrainer
    from trainer.model import load_model
    from trainer.tokenizer import load_tokenizer

    path = model_dir(sft)
    tok = load_tokenizer(path)
    model = load_model(path, cfg.model.dtype)
    engine = None
    if cfg.rollout.engine == "sglang":
        engine = launch_sglang(cfg, sft)
    try:
        trainer = GRPOTrainer(cfg, model, tok, load_split(data, "train"), load_split(data, "test"), work, logger,
                              engine)
    except BaseException:
        if engine is not None:
            engine.close()
        raise
    if getattr(trainer.producer, "pid", None):
        prefect_logger().info("grpo: rollout process %d started (rollout.async_steps=%d)", trainer.producer.pid,
                              trainer.async_steps)
    if trainer.resumed_from is not None:
        prefect_logger().info("grpo: resuming from the checkpoint at round %d", trainer.resumed_from)
        logger.set_tags({"resumed_from_round": trainer.resumed_from})
    return trainer


def _step_task(name: str):
    @task(name=name, task_run_name=name + "-r{round_}", cache_policy=NO_CACHE)
    def step(fn, round_: int, args: tuple):
        return fn(*args)

    return step


# a round's steps as the Prefect UI names them (trainer.loop runs them)
STEP_TASKS = {"rollout": _step_task("rollout"), "reward": _step_task("reward"), "update": _step_task("update"),
              "eval": _step_task("grpo-eval"), "checkpoint": _step_task("checkpoint")}


def as_prefect_tasks(step: str, round_: int, fn, *args):
    """trainer.loop's `call`: the step as a Prefect task run. The trainer, batches and bound methods are
    live objects: quote() keeps Prefect from walking thousands of token ids looking for futures."""
    return STEP_TASKS[step](quote(fn), round_, quote(args))


def submit_prefect_task(step: str, round_: int, fn, *args):
    """trainer.loop's `submit` (async rounds): the step as a Prefect task run on the flow's task
    runner's threads, beside the steps that follow; its future's result is the step's."""
    return STEP_TASKS[step].submit(quote(fn), round_, quote(args))


def finish(trainer: GRPOTrainer, work: Path, logger) -> dict[str, Any]:
    from trainer import engine as ds

    # a checkpoint at the last round: asking this stage for more rounds later continues from it
    if trainer.checkpointed != trainer.round:
        trainer.save()
    trainer.export(work / "model", work / "adapter")
    if trainer.critic is not None:  # gae: the critic too, as grpo.critic.path takes it
        trainer.export_critic(work / "critic")
    if ds.rank() == 0:  # the other ranks' history has no evals (rank 0 runs them)
        (work / "history.jsonl").write_text("".join(json.dumps(h, sort_keys=True) + "\n" for h in trainer.history))
    last = trainer.history[-1] if trainer.history else {}
    evals = [h for h in trainer.history if "eval/accuracy" in h]
    # training seconds: each round's rollouts, rewards and update (not its evals, checkpoints or
    # weight pushes), what the control's budget matches
    # (async rounds: the seconds the trainer waited for its batches, not the generation beside it)
    train_seconds = sum(h.get("rollout/queue_wait_seconds", h.get("time/generate_seconds", 0.0))
                        + h.get("time/reward_seconds", 0.0) + h.get("time/update_seconds", 0.0) for h in trainer.history)
    metrics = {"grpo/rounds": trainer.round, "grpo/seconds": trainer.elapsed(), "grpo/train_seconds": train_seconds,
               "grpo/final_reward_mean": last.get("reward/mean", math.nan)}
    if evals:
        metrics["grpo/last_eval_accuracy"] = evals[-1]["eval/accuracy"]
    if "rollout/tool_calls_mean" in last:  # a multi-turn environment: the last round's tool use
        metrics["grpo/last_tool_calls_mean"] = last["rollout/tool_calls_mean"]
        metrics["grpo/last_tool_success_rate"] = last["rollout/tool_success_rate"]
    metrics["grpo/world_size"] = ds.world_size()
    # rounds whose every group was filtered out (all of a group's rewards equal): no update
    metrics["grpo/skipped_updates"] = sum(h.get("update/skipped", 0.0) for h in trainer.history)
    logger.log_metrics(metrics)
    logger.log_artifact(work / "history.jsonl")  # a NullLogger off rank 0; the model: tasks.runner.log_policy
    out = {"metrics": metrics, "model_subdir": "model", "state_hash": trainer.state_hash(),
           "resumed_from_round": trainer.resumed_from}
    if trainer.critic is not None:
        logger.log_artifact(work / "critic", "critic")
        out["critic_subdir"] = "critic"
    if cfg_lora := trainer.cfg.model.lora:  # the merged model above, and the adapter that made it
        logger.log_artifact(work / "adapter", "adapter")
        logger.set_tags({"posttrain.lora": f"merged ({cfg_lora.describe()}); adapter in adapter/"})
        out["adapter_subdir"] = "adapter"
    return out


def train_rounds(cfg, data: dict, sft: dict, work, logger, fault: dict | None, as_tasks: bool = True) -> dict[str, Any]:
    """Every round of one GRPO stage (trainer.loop), then the export. `as_tasks=False` calls the
    steps directly (on a launched rank, where there is no Prefect flow run)."""
    from trainer import loop

    trainer = make_trainer(cfg, data, sft, work, logger)
    try:
        if as_tasks:
            loop.run_rounds(trainer, as_prefect_tasks, fault, prefect_logger(), submit_prefect_task)
        else:
            loop.run_rounds(trainer, loop.direct, fault, prefect_logger())
        return finish(trainer, work, logger)
    finally:
        # the rollout process and servers this stage launched stop however it ends (after a SIGKILL
        # the rollout process sees its parent gone, and the servers' wrapper likewise)
        trainer.close()


def body(cfg, inputs: dict, ref, fault: dict):
    data, sft = inputs["data"], inputs["sft"]

    def compute(work, logger) -> dict:
        if not cfg.grpo.deepspeed.launched:
            return train_rounds(cfg, data, sft, work, logger, fault)
        servers = None
        run_cfg = cfg
        if cfg.rollout.engine == "sglang" and not cfg.rollout.sglang.urls:
            # the task owns the SGLang servers: started once here, shared by every rank, stopped
            # when the stage ends however it ends
            servers = launch_sglang(cfg, sft)
            run_cfg = with_sglang_urls(cfg, [s.url for s in servers.servers])
        try:
            return run_launched("grpo", run_cfg, cfg.grpo.deepspeed, work, ref, logger, {**inputs, "fault": fault})
        finally:
            if servers is not None:
                servers.close()

    return compute


def on_rank(cfg, inputs: dict, work, logger) -> dict:
    """The body of a rank launched by the DeepSpeed launcher: every round, steps called directly."""
    return train_rounds(cfg, inputs["data"], inputs["sft"], work, logger, inputs.get("fault"), as_tasks=False)
