"""Fault injection at named points, for the resume tests and the retry demo.

Two ways in:
- a flow's `fault` parameter, e.g. {"sft": 7}: raises after SFT step 7 (a failed task and flow run);
- the environment, POSTTRAIN_FAULT="sft@7:kill" (comma-separated): `kill` sends this process
  SIGKILL at that point, like an OOM kill or a pre-empted machine; `hang` stops there until the
  process is killed, like a stalled machine (so a test can kill it at a known step); `stop` sends it
  SIGSTOP, like a paused VM, and carries on once something sends SIGCONT; `raise` (the default) raises.
  Under the DeepSpeed launcher every rank checks; "sft@7:kill:1" fires on rank 1 only.

Points: `sft` (after optimizer step n), `grpo_mid_round` (round n rolled out and scored, not yet
updated), `grpo_after_update` (round n updated, its checkpoint not yet written), `grpo_round`
(round n finished, checkpoint included).
"""

from __future__ import annotations

import functools
import os
import signal
import sys
import time

POINTS = ("sft", "grpo_mid_round", "grpo_after_update", "grpo_round")
ENV = "POSTTRAIN_FAULT"


class InjectedFault(RuntimeError):
    pass


@functools.cache  # checked on every training step: parse each spec once
def parse(spec: str) -> tuple[tuple[str, int, str, int | None], ...]:
    out = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        point, _, rest = item.partition("@")
        at, _, rest = rest.partition(":")
        mode, _, on_rank = rest.partition(":")
        mode = mode or "raise"
        if (point not in POINTS or not at.isdigit() or mode not in ("raise", "kill", "hang", "stop")
                or (on_rank and not on_rank.isdigit())):
            raise ValueError(f"{ENV}={spec!r}: {item!r} is not POINT@N[:raise|kill|hang|stop[:RANK]] with POINT one of {POINTS}")
        out.append((point, int(at), mode, int(on_rank) if on_rank else None))
    return tuple(out)


def check(point: str, n: int, faults: dict[str, int] | None = None) -> None:
    """Fail here if a fault is set for (point, n)."""
    from trainer.engine import rank  # torch: not at import (the flows import POINTS)

    for p, at, mode, on_rank in parse(os.environ.get(ENV, "")):
        if p == point and at == n and on_rank in (None, rank()):
            if mode == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if mode == "stop":
                os.kill(os.getpid(), signal.SIGSTOP)
                continue
            if mode == "hang":
                print(f"injected hang at {point} {n} ({ENV}): waiting to be killed", file=sys.stderr, flush=True)
                while True:
                    time.sleep(3600)
            raise InjectedFault(f"injected fault at {point} {n} ({ENV})")
    if faults and faults.get(point) == n:
        raise InjectedFault(f"injected fault at {point} {n}")
