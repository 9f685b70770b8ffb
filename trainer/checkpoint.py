"""Training checkpoints that hold everything an exact resume needs.

DeepSpeed saves weights, optimizer and LR scheduler under `<dir>/<tag>/`; we add the client state
(step, data position, RNG states, anything the loop carries) and then write `<tag>/COMMITTED`
last. Only committed tags are ever loaded; a torn one is skipped with a warning.

Mirrored (`mirrored(url)`, a stage on an s3:// root): each committed checkpoint is also committed at
`<url>/<tag>/`, every host's files first (each host uploads what its ranks wrote), the marker, listing
all of them, last; the newest `keep` are kept there too. A resume on any host, with any hosts, takes
the newest checkpoint committed there (downloaded where this host's copy is not whole), or a newer
one of its own when it runs alone: machines share no disk, and a checkpoint reaches another host only
through the store.
"""

from __future__ import annotations

import contextvars
import json
import logging
import os
import random
import re
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
# Where checkpoints are committed besides the local folder (a remote URL), or None: `mirrored`.
_mirror: contextvars.ContextVar[str | None] = contextvars.ContextVar("checkpoint_mirror", default=None)


def current_mirror() -> str | None:
    """The mirror `mirrored` set for this context (a launched stage hands it to its ranks)."""
    return _mirror.get()


@contextmanager
def mirrored(url: str | None) -> Iterator[None]:
    """Inside the block, commit every checkpoint at `url` too, and resume from there (None: local only)."""
    token = _mirror.set(url)
    try:
        yield
    finally:
        _mirror.reset(token)


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
    from trainer.engine import any_rank, rank
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
    mirror = _mirror.get()
    files = _local_files(ckpt_dir / tag)
    if mirror is None:
        if rank() == 0:
            _commit_local(ckpt_dir, tag, step, files, keep)
    else:
        # each machine's marker lists the files on that machine's disk (no host sees another's), so
        # each machine's copy is whole or not on its own; the mirror's lists them all
        everything = _upload(ckpt_dir / tag, storage.join(mirror, tag), files)
        if _node_leader():
            _commit_local(ckpt_dir, tag, step, files, keep)
        problem = None
        if rank() == 0:
            try:  # last: a checkpoint any host may resume from
                storage.write_json(storage.join(mirror, tag, COMMITTED), {"step": step, "files": everything})
                _prune_mirror(mirror, keep)
            except OSError as exc:
                problem = exc
        if any_rank(problem is not None):
            raise CheckpointError(f"committing checkpoint {tag} at {mirror} failed ("
                                  f"{type(problem).__name__ + ': ' + str(problem) if problem else 'on rank 0'}); "
                                  "the earlier committed checkpoints stay as they were, and a run again resumes "
                                  "from the newest of them") from problem
    if dist.is_initialized():
        dist.barrier()
    return ckpt_dir / tag


def _commit_local(ckpt_dir: Path, tag: str, step: int, files: dict[str, int], keep: int) -> None:
    """Write `tag`'s marker on this machine's disk, then drop this machine's older checkpoints."""
    try:
        storage.write_json(str(ckpt_dir / tag / COMMITTED), {"step": step, "files": files})
    except OSError as exc:
        shutil.rmtree(ckpt_dir / tag, ignore_errors=True)
        raise CheckpointError(_save_failed(ckpt_dir / tag, exc)) from exc
    for old in committed_tags(ckpt_dir)[:-keep]:
        shutil.rmtree(ckpt_dir / old, ignore_errors=True)


def _local_files(tag_dir: Path) -> dict[str, int]:
    return {f.relative_to(tag_dir).as_posix(): f.stat().st_size for f in tag_dir.rglob("*")
            if f.is_file() and f.name != COMMITTED}


def _node_leader() -> bool:
    """The first rank on its machine: the one that moves that machine's checkpoint files."""
    return int(os.environ.get("LOCAL_RANK", "0")) == 0


def _upload(tag_dir: Path, url: str, files: dict[str, int]) -> dict[str, int]:
    """Each machine's first rank uploads the files its ranks wrote; every rank gets the union (what the
    marker lists). Raises CheckpointError on every rank when any upload failed."""
    import torch.distributed as dist

    from trainer.engine import any_rank, world_size

    problem = None
    mine = files if _node_leader() else {}
    if mine:
        try:
            storage.put_dir(tag_dir, url, skip=(COMMITTED,))
        except Exception as exc:  # noqa: BLE001 - raised below, on every rank together
            problem = exc
    if any_rank(problem is not None):
        shutil.rmtree(tag_dir, ignore_errors=True)
        raise CheckpointError(f"committing checkpoint {tag_dir.name} at {url} failed ("
                              f"{type(problem).__name__ if problem else 'on another host'}: {problem or 'see its log'}); "
                              "the earlier committed checkpoints stay as they were, and a run again resumes from "
                              "the newest of them") from problem
    if world_size() == 1:
        return mine
    gathered: list[dict[str, int]] = [{} for _ in range(world_size())]
    dist.all_gather_object(gathered, mine)
    return {k: v for part in gathered for k, v in part.items()}


def mirror_tags(mirror: str) -> list[str]:
    """The checkpoints committed at `mirror`, oldest first."""
    return _committed_at(storage.list_files(mirror))


def _committed_at(listed: dict[str, int]) -> list[str]:
    """The tags with a COMMITTED marker in a mirror's listing, oldest first."""
    return sorted(rel.split("/")[0] for rel in listed if rel.count("/") == 1 and rel.endswith("/" + COMMITTED)
                  and rel.startswith("step"))


def _prune_mirror(mirror: str, keep: int) -> None:
    """Keep the newest `keep` committed checkpoints at `mirror`; each older one loses its marker first,
    so that no reader ever finds a marker whose files are going. Uncommitted tags older than the newest
    committed one (a save that failed) go too."""
    listed = storage.list_files(mirror)
    tags = _committed_at(listed)
    if not tags:
        return
    old = set(tags[:-keep])
    old |= {t for t in {rel.split("/")[0] for rel in listed if rel.startswith("step")} if t < tags[-1] and t not in tags}
    for tag in sorted(old):
        try:
            storage.remove(storage.join(mirror, tag, COMMITTED))
            storage.remove(storage.join(mirror, tag))
        except OSError as exc:  # the store's hiccup costs space, not correctness: pruned at the next save
            log.warning("could not remove old checkpoint %s/%s (%s)", mirror, tag, exc)


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
    load is logged and the one before it is tried. Mirrored, every rank takes the same checkpoint,
    from the mirror where its host's copy is not whole.

    Raises CheckpointError when committed checkpoints exist and none of them loads."""
    from trainer.engine import any_rank

    ckpt_dir = Path(ckpt_dir)
    mirror = _mirror.get()
    tags = _agreed_tags(ckpt_dir, mirror) if mirror is not None else committed_tags(ckpt_dir)
    failures = []
    for tag in reversed(tags):
        problem = None
        try:
            if mirror is not None:
                _fetch(ckpt_dir, mirror, tag)
            client = _load(engine, ckpt_dir / tag)
            if client is None:
                raise RuntimeError("DeepSpeed found nothing to load")
            for name, other in (extra or {}).items():
                if not (ckpt_dir / tag / name).is_dir():
                    raise RuntimeError(f"it holds no {name} (written by a run without one)")
                if _load(other, ckpt_dir / tag / name) is None:
                    raise RuntimeError(f"DeepSpeed found no {name} to load")
        except Exception as exc:  # noqa: BLE001 - every rank then tries the one before it, together
            problem = exc
        if (any_rank(problem is not None) if mirror is not None else problem is not None):
            where = f"{ckpt_dir / tag}" + (f" (or {storage.join(mirror, tag)})" if mirror else "")
            what = f"{type(problem).__name__}: {str(problem)[:300]}" if problem else "it failed on another rank"
            failures.append(f"{where}: {what}")
            log.warning("checkpoint %s could not be loaded (%s); trying the one before it", where, what)
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


ZERO_PARTITION = re.compile(r"zero_pp_rank_(\d+)_mp_rank_00_optim_states\.pt")


def saved_ranks(tag_dir: Path) -> int | None:
    """How many ranks' ZeRO optimizer partitions a DeepSpeed checkpoint holds (None: no partitions,
    ZeRO stage 0, whose optimizer state any number of ranks loads). Each machine may hold only its
    own ranks' partitions, so the ranks pool what they see (every rank calls this)."""
    import torch.distributed as dist

    ranks = {int(m.group(1)) for f in tag_dir.iterdir() if (m := ZERO_PARTITION.fullmatch(f.name))}
    if dist.is_initialized() and dist.get_world_size() > 1:
        seen: list[set[int]] = [set() for _ in range(dist.get_world_size())]
        dist.all_gather_object(seen, ranks)
        ranks = set().union(*seen)
    return len(ranks) or None


def _load(engine, tag_dir: Path) -> dict[str, Any] | None:
    """Load one DeepSpeed checkpoint folder into `engine`; its client state. A folder written by
    another number of ranks (ZeRO's optimizer state is partitioned by rank, and DeepSpeed refuses to
    load it on another count) is first converted, on each machine, into DeepSpeed's universal
    checkpoint (`deepspeed.checkpoint.ds_to_universal`: each parameter's weights and optimizer state
    whole), which any number of ranks loads."""
    import torch.distributed as dist

    from trainer.engine import world_size

    saved = saved_ranks(tag_dir)
    if saved is None or saved == world_size():
        _, client = engine.load_checkpoint(str(tag_dir.parent), tag=tag_dir.name, load_optimizer_states=True,
                                           load_lr_scheduler_states=True)
        return client
    universal = tag_dir.parent / f".{tag_dir.name}.universal"
    problem = None
    if _node_leader():
        try:
            _to_universal(tag_dir, universal)
        except Exception as exc:  # noqa: BLE001 - raised once every rank is past the barrier
            problem = exc
    if dist.is_initialized():
        dist.barrier()
    if problem is not None:
        raise problem
    log.warning("checkpoint %s was written by %d rank(s); loading it on %d through DeepSpeed's universal "
                "checkpoint: the run goes on close to, not bit-identical with, one that never changed its "
                "number of ranks", tag_dir, saved, world_size())
    engine._config.load_universal_checkpoint = True  # DeepSpeed reads it at load time, from its config
    try:
        _, client = engine.load_checkpoint(str(universal.parent), tag=universal.name, load_optimizer_states=True,
                                           load_lr_scheduler_states=True)
    finally:
        engine._config.load_universal_checkpoint = False  # the checkpoints this run saves are ordinary
        if dist.is_initialized():
            dist.barrier()  # every rank of the machine has read it
        if _node_leader():
            shutil.rmtree(universal, ignore_errors=True)
    return client


def _to_universal(tag_dir: Path, out: Path) -> None:
    """DeepSpeed's own conversion, in a process of its own (it starts worker processes)."""
    import subprocess
    import sys

    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(tag_dir),
           "--output_folder", str(out), "--num_extract_workers", "1", "--num_merge_workers", "1",
           "--inject_missing_state"]  # torch optimizers leave no universal_checkpoint_info; DeepSpeed fills it in
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        shutil.rmtree(out, ignore_errors=True)
        raise RuntimeError(f"converting it to DeepSpeed's universal checkpoint failed: {done.stderr[-1500:]}")


def _agreed_tags(ckpt_dir: Path, mirror: str) -> list[str]:
    """The checkpoints every rank can load, oldest first: those committed at the mirror, and those whole
    on every rank's own disk (a single machine's newer ones, whose commit at the mirror did not finish)."""
    import torch.distributed as dist

    from trainer.engine import rank, world_size

    local = set(committed_tags(ckpt_dir))
    remote = set(mirror_tags(mirror)) if rank() == 0 else set()
    if world_size() > 1:
        parts: list[set[str]] = [set() for _ in range(world_size())]
        dist.all_gather_object(parts, local)
        local = set.intersection(*parts)
        shared = [remote]
        dist.broadcast_object_list(shared, src=0)
        remote = shared[0]
    return sorted(local | remote)


def _fetch(ckpt_dir: Path, mirror: str, tag: str) -> None:
    """Each machine's first rank downloads `tag` from the mirror where its own copy is not whole; every
    rank waits for every machine's download (and raises what failed on its own)."""
    import torch.distributed as dist

    problem = None
    if _node_leader() and (not (ckpt_dir / tag / COMMITTED).is_file() or damage(ckpt_dir / tag)):
        try:
            _download(ckpt_dir, storage.join(mirror, tag), tag)
        except Exception as exc:  # noqa: BLE001 - raised once every rank is past the barrier
            problem = exc
    if dist.is_initialized():
        dist.barrier()
    if problem is not None:
        raise problem


def _download(ckpt_dir: Path, url: str, tag: str) -> None:
    listed = json.loads(storage.read_text(storage.join(url, COMMITTED)))["files"]
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    part = ckpt_dir / f".{tag}.download"
    shutil.rmtree(part, ignore_errors=True)
    storage.get_files(url, list(listed), part)
    storage.write_json(str(part / COMMITTED), {"step": int(tag[4:]), "files": listed})
    if problem := damage(part):
        shutil.rmtree(part, ignore_errors=True)
        raise CheckpointError(f"the checkpoint {url} downloaded torn ({problem})")
    shutil.rmtree(ckpt_dir / tag, ignore_errors=True)
    os.replace(part, ckpt_dir / tag)
    log.info("checkpoint %s: downloaded from %s", tag, url)
