"""The GRPO stage as rounds of Prefect tasks: rollout -> reward -> update (+ sync) -> eval / checkpoint.

    posttrain grpo --preset tiny

With one rank the rounds run in this process and each step is a task in the Prefect UI. With
several (grpo.deepspeed.ranks_per_node > 1) the same loop runs on every rank under the DeepSpeed
launcher, supervised by the grpo task; rank 0's per-round lines stream into its log.
"""

from __future__ import annotations

from tasks.common import SECTIONS, TrackingRef, run_launched, run_stage
from tasks.grpo import launch_sglang, train_rounds, with_sglang_urls


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
