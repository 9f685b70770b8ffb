"""The GRPO stage as rounds of Prefect tasks: rollout -> reward -> update (+ sync) -> eval / checkpoint.

    posttrain grpo --preset tiny
"""

from __future__ import annotations

from prefect.utilities.annotations import quote

from tasks.common import TrackingRef, run_stage
from tasks.grpo import finish, make_trainer, periodic_eval, reward, rollout, save_checkpoint, update
from trainer import faults


def grpo_stage(cfg, data: dict, sft: dict, ref: TrackingRef, fault: dict | None = None) -> dict:
    fault = fault or {}

    def rounds(work, logger) -> dict:
        trainer = make_trainer(cfg, data, sft, work, logger)
        t = quote(trainer)  # a live object: Prefect must not walk into it
        while not trainer.done():
            r = trainer.round + 1
            batch = rollout(t, r)
            batch = reward(t, quote(batch), r)
            faults.check("grpo_mid_round", r, fault)
            update(t, quote(batch), r)
            faults.check("grpo_after_update", r, fault)
            if trainer.round % cfg.grpo.sample_table_every == 0:
                logger.log_table(trainer.sample_table(batch), f"rollouts/round_{r:04d}.json")
            if trainer.should_eval():
                periodic_eval(t, r)
            if trainer.should_checkpoint():
                save_checkpoint(t, r)
            faults.check("grpo_round", r, fault)
        return finish(trainer, work, logger)

    return run_stage("grpo", cfg, ("rollout", "grpo"), {"data": data, "sft": sft}, rounds, ref)
