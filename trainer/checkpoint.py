"""Training checkpoints that hold everything an exact resume needs.

DeepSpeed saves weights, optimizer and LR scheduler under `<dir>/<tag>/`; we add the client state
(step, data position, RNG states, anything the loop carries) and then write `<tag>/COMMITTED`
last. Only committed tags are ever loaded; a torn one is skipped with a warning.
"""

from __future__ import annotations

import contextvars
import json
import logging
import random
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

from trainer import storage
from trainer.errors import InputError

log = logging.getLogger(__name__)
COMMITTED = "COMMITTED"


# torch and numpy are imported where used: the tasks read committed tags and set the save guard in
# stages that never load torch


def rng_state() -> dict[str, Any]:
    import numpy as np
    import torch

    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
    }


def set_rng_state(state: dict[str, Any]) -> None:
    import numpy as np
    import torch

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def numerics() -> dict[str, Any]:
    """What a process's arithmetic depends on beyond the weights and data: the same weights come
    out of a resume only when these match the run that wrote the checkpoint (docs/reproducibility.md)."""
    import os

    import torch

    from trainer.engine import DETERMINISTIC

    return {"threads": torch.get_num_threads(), "deterministic": os.environ.get(DETERMINISTIC, "1") != "0",
            "kernels": os.environ.get("POSTTRAIN_KERNELS", "1") != "0", "torch": torch.__version__}


def numerics_differences(saved: dict[str, Any] | None, now: dict[str, Any]) -> list[str]:
    """How `now` differs from a checkpoint's `numerics()` (nothing for checkpoints older than it)."""
    return [f"{k} {saved[k]!r} then, {now.get(k)!r} now" for k in sorted(saved or {}) if saved[k] != now.get(k)]


def tag_for(step: int) -> str:
    return f"step{step:08d}"


class CheckpointError(InputError):
    """A checkpoint could not be written, or none of the committed ones could be read."""


# Called on rank 0 before every save: raises when this process may no longer write its folder (the
# stage's lease was lost, tasks/lease.py), so a run that has been taken over stops before it saves.
_save_guard: contextvars.ContextVar[Callable[[], None] | None] = contextvars.ContextVar("save_guard", default=None)


@contextmanager
def guarded(check: Callable[[], None] | None) -> Iterator[None]:
    """Run `check` before every checkpoint saved inside the block."""
    token = _save_guard.set(check)
    try:
        yield
    finally:
        _save_guard.reset(token)


def _check_guard() -> None:
    from trainer.engine import any_rank, rank

    check, problem = _save_guard.get(), None
    if check is not None and rank() == 0:
        try:
            check()
        except Exception as exc:  # noqa: BLE001 - raised below, on every rank together
            problem = exc
    if any_rank(problem is not None):
        raise problem or CheckpointError("rank 0 found that this run may no longer write its folder; stopping "
                                         "before this checkpoint (its error is in rank 0's log)")


def save(engine, ckpt_dir: str | Path, step: int, client_state: dict[str, Any], keep: int = 2,
         extra: dict[str, Any] | None = None) -> Path:
    """Save and commit a checkpoint; keep only the newest `keep` committed ones. `extra` engines (name
    -> DeepSpeed engine: PPO's critic) are saved in the same tag, under `<tag>/<name>/`, before the
    commit marker, so a committed tag holds all of them or is not loaded.

    Raises CheckpointError naming the folder when the save fails (a full disk, most often): the torn
    tag is removed, and the earlier committed checkpoints stay as they were. Raises whatever the
    save guard raises (`guarded`) before writing anything."""
    from trainer.engine import rank
    import torch.distributed as dist

    _check_guard()
    ckpt_dir = Path(ckpt_dir)
    tag = tag_for(step)
    state = dict(client_state, step=step, rng=rng_state(), numerics=numerics())
    try:
        engine.save_checkpoint(str(ckpt_dir), tag=tag, client_state=state, save_latest=False)
        for name, other in (extra or {}).items():
            other.save_checkpoint(str(ckpt_dir / tag), tag=name, client_state={"step": step}, save_latest=False)
    except Exception as exc:
        shutil.rmtree(ckpt_dir / tag, ignore_errors=True)
        raise CheckpointError(_save_failed(ckpt_dir / tag, exc)) from exc
    if dist.is_initialized():
        dist.barrier()
    if rank() == 0:
        files = {f.relative_to(ckpt_dir / tag).as_posix(): f.stat().st_size
                 for f in (ckpt_dir / tag).rglob("*") if f.is_file()}
        try:
            storage.write_json(str(ckpt_dir / tag / COMMITTED), {"step": step, "files": files})
        except OSError as exc:
            shutil.rmtree(ckpt_dir / tag, ignore_errors=True)
            raise CheckpointError(_save_failed(ckpt_dir / tag, exc)) from exc
        for old in committed_tags(ckpt_dir)[:-keep]:
            shutil.rmtree(ckpt_dir / old, ignore_errors=True)
    if dist.is_initialized():
        dist.barrier()
    return ckpt_dir / tag


def _save_failed(path: Path, exc: BaseException) -> str:
    try:
        free = f"{shutil.disk_usage(path.parent).free / 2**20:.1f} MiB free there"
    except OSError:
        free = "free space unknown"
    return (f"saving checkpoint {path} failed ({type(exc).__name__}: {exc}; {free}); the torn checkpoint was removed "
            "and the earlier ones are kept. Free space on that disk (or point artifact_root / POSTTRAIN_CACHE at a "
            "larger one) and run again: the stage resumes from its last committed checkpoint")


def damage(tag_dir: Path) -> str | None:
    """What is wrong with a committed checkpoint's files (missing, or not the size saved), or None."""
    try:
        files = json.loads((tag_dir / COMMITTED).read_text()).get("files")
    except (OSError, json.JSONDecodeError, AttributeError) as exc:
        return f"its {COMMITTED} marker is unreadable ({exc})"
    for rel, size in sorted((files or {}).items()):
        f = tag_dir / rel
        if not f.is_file():
            return f"{rel} is missing"
        if f.stat().st_size != size:
            return f"{rel} has {f.stat().st_size} bytes, {size} were saved"
    return None


def committed_tags(ckpt_dir: str | Path) -> list[str]:
    """The checkpoints that were committed and are whole, oldest first."""
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        return []
    tags = sorted(p.name for p in ckpt_dir.iterdir() if p.is_dir() and p.name.startswith("step"))
    good = []
    for t in tags:
        if not (ckpt_dir / t / COMMITTED).is_file():
            log.warning("checkpoint %s has no COMMITTED marker (torn write); it will not be loaded", ckpt_dir / t)
        elif problem := damage(ckpt_dir / t):
            log.warning("checkpoint %s is damaged (%s); it will not be loaded", ckpt_dir / t, problem)
        else:
            good.append(t)
    return good


def load_latest(engine, ckpt_dir: str | Path, extra: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """Load the newest committed checkpoint that loads into `engine` (and its `extra` engines, as
    `save` wrote them); returns its client state, or None when there is none. One that fails to
    load is logged and the one before it is tried.

    Raises CheckpointError when committed checkpoints exist and none of them loads."""
    ckpt_dir = Path(ckpt_dir)
    tags = committed_tags(ckpt_dir)
    failures = []
    for tag in reversed(tags):
        try:
            _, client = engine.load_checkpoint(str(ckpt_dir), tag=tag, load_optimizer_states=True,
                                               load_lr_scheduler_states=True)
            if client is None:
                raise RuntimeError("DeepSpeed found nothing to load")
            for name, other in (extra or {}).items():
                if not (ckpt_dir / tag / name).is_dir():
                    raise RuntimeError(f"it holds no {name} (written by a run without one)")
                _, sub = other.load_checkpoint(str(ckpt_dir / tag), tag=name, load_optimizer_states=True,
                                               load_lr_scheduler_states=True)
                if sub is None:
                    raise RuntimeError(f"DeepSpeed found no {name} to load")
        except Exception as exc:
            failures.append(f"{ckpt_dir / tag}: {type(exc).__name__}: {str(exc)[:300]}")
            log.warning("checkpoint %s could not be loaded (%s: %s); trying the one before it", ckpt_dir / tag,
                        type(exc).__name__, str(exc)[:300])
            continue
        set_rng_state(client["rng"])
        log.info("resumed from checkpoint %s/%s (step %d)", ckpt_dir, tag, client["step"])
        if changed := numerics_differences(client.get("numerics"), numerics()):
            log.warning("resuming %s/%s with other numerics than the run that saved it (%s): the result will "
                        "be close to, not bit-identical with, an uninterrupted run; to match it, run with what it "
                        "had (OMP_NUM_THREADS for threads, POSTTRAIN_DETERMINISTIC, POSTTRAIN_KERNELS)",
                        ckpt_dir, tag, "; ".join(changed))
        return client
    if failures:
        raise CheckpointError("no committed checkpoint under " + str(ckpt_dir) + " could be loaded:\n  "
                              + "\n  ".join(failures) + f"\ndelete {ckpt_dir} to start this stage over")
    return None
