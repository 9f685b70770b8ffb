"""Training checkpoints that hold everything an exact resume needs.

DeepSpeed saves weights, optimizer and LR scheduler under `<dir>/<tag>/`; we add the client state
(step, data position, RNG states, anything the loop carries) and then write `<tag>/COMMITTED`
last. Only committed tags are ever loaded; a torn one is skipped with a warning.
"""

from __future__ import annotations

import json
import logging
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

log = logging.getLogger(__name__)
COMMITTED = "COMMITTED"


def rng_state() -> dict[str, Any]:
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
    }


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def tag_for(step: int) -> str:
    return f"step{step:08d}"


def save(engine, ckpt_dir: str | Path, step: int, client_state: dict[str, Any], keep: int = 2) -> Path:
    """Save and commit a checkpoint; keep only the newest `keep` committed ones."""
    from trainer.engine import rank
    import torch.distributed as dist

    ckpt_dir = Path(ckpt_dir)
    tag = tag_for(step)
    state = dict(client_state, step=step, rng=rng_state())
    engine.save_checkpoint(str(ckpt_dir), tag=tag, client_state=state, save_latest=False)
    if dist.is_initialized():
        dist.barrier()
    if rank() == 0:
        (ckpt_dir / tag / COMMITTED).write_text(json.dumps({"step": step}))
        for old in committed_tags(ckpt_dir)[:-keep]:
            shutil.rmtree(ckpt_dir / old, ignore_errors=True)
    if dist.is_initialized():
        dist.barrier()
    return ckpt_dir / tag


def committed_tags(ckpt_dir: str | Path) -> list[str]:
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        return []
    tags = sorted(p.name for p in ckpt_dir.iterdir() if p.is_dir() and p.name.startswith("step"))
    good = []
    for t in tags:
        if (ckpt_dir / t / COMMITTED).is_file():
            good.append(t)
        else:
            log.warning("checkpoint %s has no COMMITTED marker (torn write); it will not be loaded",
                        ckpt_dir / t)
    return good


def load_latest(engine, ckpt_dir: str | Path) -> dict[str, Any] | None:
    """Load the newest committed checkpoint into `engine`; returns its client state or None."""
    tags = committed_tags(ckpt_dir)
    if not tags:
        return None
    _, client = engine.load_checkpoint(str(ckpt_dir), tag=tags[-1], load_optimizer_states=True,
                                       load_lr_scheduler_states=True)
    if client is None:
        raise RuntimeError(f"checkpoint {ckpt_dir}/{tags[-1]} could not be loaded")
    set_rng_state(client["rng"])
    log.info("resumed from checkpoint %s/%s (step %d)", ckpt_dir, tags[-1], client["step"])
    return client
