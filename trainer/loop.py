"""GRPO's round, written once: rollout -> reward -> update and publish -> eval -> checkpoint.

The Prefect tasks (`tasks/grpo.py`, each step a task in the UI), the ranks the DeepSpeed launcher
starts (each step called directly) and the tests all run `run_round` / `run_rounds`; what differs
is `call`, which runs one named step: `direct` here, a Prefect task there.

    stats = run_round(trainer)                     # one round, steps called directly
    run_rounds(trainer, call=as_prefect_tasks)     # to the end of the stage's schedule

With `rollout.async_steps` > 0 the rollouts come from the trainer's producer
(`trainer.rl.async_rollout`), requested as each version is published; `run_rounds` gives each a
rollout step when it is requested (`submit`), so the step runs while the updates before it do.
"""

from __future__ import annotations

import logging
import math
import time
from typing import TYPE_CHECKING, Any, Callable

from trainer import faults

if TYPE_CHECKING:
    from trainer.grpo import GRPOTrainer

log = logging.getLogger(__name__)

# call(step name, round, function, *args) -> the function's result; the steps are named
# "rollout", "reward", "update", "eval" and "checkpoint"
Call = Callable[..., Any]


def direct(step: str, round_: int, fn: Callable[..., Any], *args: Any) -> Any:
    return fn(*args)


class Deferred:
    """A step that runs when its result is asked for: `submit` for callers without a task runner
    (async rounds' producer does the work in its own process or thread either way)."""

    def __init__(self, fn: Callable[..., Any], args: tuple) -> None:
        self.fn, self.args = fn, args

    def result(self) -> Any:
        return self.fn(*self.args)


def deferred(step: str, round_: int, fn: Callable[..., Any], *args: Any) -> Deferred:
    return Deferred(fn, args)


def run_round(trainer: GRPOTrainer, call: Call = direct, fault: dict | None = None,
              say: logging.Logger | None = None, rollouts: dict[int, Any] | None = None,
              follow: Callable[[], None] | None = None) -> dict[str, float]:
    """One round; returns its recorded stats. `fault` injects the test faults of `trainer.faults`.
    Async rounds pass `rollouts` (round -> the submitted step whose result is its batch) and
    `follow`, which submits a rollout step for each round requested meanwhile."""
    fault = fault or {}
    say = say or log
    r = trainer.round + 1
    if rollouts is None:
        batch = call("rollout", r, trainer.rollout)
    else:  # generated beside the previous rounds' updates: the trainer waits only for what is left
        batch = trainer.take(rollouts.pop(r).result)
    batch = call("reward", r, trainer.score, batch)
    faults.check("grpo_mid_round", r, fault)
    stats = call("update", r, lambda b: trainer.publish(trainer.update(b)), batch)
    if follow is not None:
        follow()
    say.info("round %d/%d: reward %.3f  acc %.3f  groups %d used / %d filtered  %.2fs%s", r,
             trainer.cfg.grpo.rounds, stats.get("reward/mean", math.nan), stats.get("rollout/accuracy", math.nan),
             stats.get("rollout/groups_used", 0), stats.get("rollout/groups_filtered", 0),
             stats.get("time/round_seconds", math.nan), time_left(trainer))
    faults.check("grpo_after_update", r, fault)
    if trainer.round % trainer.cfg.grpo.sample_table_every == 0:
        trainer.logger.log_table(trainer.sample_table(batch), f"rollouts/round_{r:04d}.json")
    if trainer.should_eval():
        metrics = call("eval", r, trainer.evaluate)
        if metrics:  # rank 0's
            say.info("round %d eval: %s", r, eval_line(metrics))
    if trainer.should_checkpoint():
        call("checkpoint", r, trainer.save)
    faults.check("grpo_round", r, fault)
    return stats


def time_left(trainer: GRPOTrainer) -> str:
    """`, about 4:10 left`: the stage's rounds still to run at this run's pace so far (its evals and
    checkpoints included; rounds resumed from are not its pace), within grpo.max_seconds; "" after
    the last round."""
    from trainer.progress import duration

    g = trainer.cfg.grpo
    ran, left = trainer.round - (trainer.resumed_from or 0), g.rounds - trainer.round
    if ran <= 0 or left <= 0:
        return ""
    seconds = (time.perf_counter() - trainer.started) / ran * left
    if g.max_seconds is not None:
        seconds = min(seconds, max(0.0, g.max_seconds - trainer.elapsed()))
    return f", about {duration(seconds)} left"


def eval_line(metrics: dict[str, float]) -> str:
    """A round's eval metrics as a line: `accuracy 0.795  flexible_accuracy 0.795  format_rate 1
    pass@4 0.83  (1.11s)`, every metric the eval logged (without the `eval/` of their MLflow names)."""
    parts = [f"{k.removeprefix('eval/').replace('pass_at_', 'pass@')} {v:.4g}" for k, v in metrics.items()
             if k.startswith("eval/")]
    seconds = metrics.get("time/eval_seconds")
    return "  ".join(parts) + (f"  ({seconds:.2f}s)" if seconds is not None else "")


def run_rounds(trainer: GRPOTrainer, call: Call = direct, fault: dict | None = None,
               say: logging.Logger | None = None, submit: Call = deferred) -> None:
    """Rounds until the stage's schedule (grpo.rounds, grpo.max_seconds) is done. With async rounds
    every requested batch gets its rollout step from the moment it is requested (`submit`, a task
    that runs beside the updates under Prefect), so round r + 1's rollout shows beside round r's update."""
    if trainer.producer is None:
        while not trainer.done():
            run_round(trainer, call, fault, say)
        return
    rollouts: dict[int, Any] = {}

    def follow() -> None:
        for r in trainer.producer.in_flight():
            if r not in rollouts:
                rollouts[r] = submit("rollout", r, trainer.producer.collect, r)

    follow()
    while not trainer.done():
        run_round(trainer, call, fault, say, rollouts, follow)
