"""The GRPO stage as rounds of Prefect tasks: rollout -> reward -> update (+ sync) -> eval / checkpoint.

    posttrain grpo --preset tiny

With one rank the rounds run in this process and each step is a task in the Prefect UI. With
several (grpo.deepspeed.ranks_per_node > 1) the same loop runs on every rank under the DeepSpeed
launcher, supervised by the grpo task; rank 0's per-round lines stream into its log.
"""

from __future__ import annotations

from typing import Any

from prefect.utilities.annotations import quote

from tasks.common import SECTIONS, TrackingRef, run_launched, run_stage
from tasks.grpo import (finish, launch_sglang, make_trainer, periodic_eval, reward, rollout, save_checkpoint,
                        update, with_sglang_urls)
from trainer import faults


def train_rounds(cfg, data: dict, sft: dict, work, logger, fault: dict | None, as_tasks: bool = True) -> dict[str, Any]:
    """Every round of one GRPO stage, then the export. `as_tasks=False` calls the steps directly
    (on a launched rank, where there is no Prefect flow run)."""
    fault = fault or {}
    trainer = make_trainer(cfg, data, sft, work, logger)

    def call(step, *args):
        if not as_tasks:
            return step.fn(*args)
        # the trainer and batches are live objects: quote() keeps Prefect from walking into them
        return step(*(a if isinstance(a, int) else quote(a) for a in args))

    while not trainer.done():
        r = trainer.round + 1
        batch = call(rollout, trainer, r)
        batch = call(reward, trainer, batch, r)
        faults.check("grpo_mid_round", r, fault)
        call(update, trainer, batch, r)
        faults.check("grpo_after_update", r, fault)
        if trainer.round % cfg.grpo.sample_table_every == 0:
            logger.log_table(trainer.sample_table(batch), f"rollouts/round_{r:04d}.json")
        if trainer.should_eval():
            call(periodic_eval, trainer, r)
        if trainer.should_checkpoint():
            call(save_checkpoint, trainer, r)
        faults.check("grpo_round", r, fault)
    return finish(trainer, work, logger)


def grpo_stage(cfg, data: dict, sft: dict, ref: TrackingRef, fault: dict | None = None) -> dict:
    def rounds(work, logger) -> dict:
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
            return run_launched("grpo", run_cfg, cfg.grpo.deepspeed, work, ref, logger,
                                {"data": data, "sft": sft, "fault": fault})
        finally:
            if servers is not None:
                servers.close()

    return run_stage("grpo", cfg, SECTIONS["grpo"], {"data": data, "sft": sft}, rounds, ref)
