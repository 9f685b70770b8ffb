"""What every stage task shares: cache keys, the manifest commit, and MLflow tracking.

A stage's cache key = hash(the config fields that change its result + seed, its inputs' result
keys, code version, the content of the files it reads): the table is in tasks/keys.py.
Its outputs live in `<artifact_root>/<stage>/<key>/`, committed by `manifest.json` written last:
a folder with a manifest is a finished result (a cache hit), one without is not. Keys live in the
artifact store rather than in Prefect's local cache records so that a re-run on another machine
(or against the same s3:// root) finds the same results, and so that deleting a folder really
forces a recompute.
"""

from __future__ import annotations

import contextvars
import hashlib
import json
import os
import shutil
import socket
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from tasks import lease
from tasks.keys import code_version, extent, resolve, rule_for
from trainer import storage
from trainer.config import RunConfig
from trainer.checkpoint import COMMITTED, committed_tags, guarded as checkpoint_guard
from trainer.procwatch import process_gone

DEFAULT_TRACKING_URI = "sqlite:///mlflow.db"




# ---------------------------------------------------------------- tracking

@dataclass(frozen=True)
class TrackingRef:
    """What every stage of one pipeline run shares (picklable, small): the MLflow parent run it
    logs under, the Prefect flow run, and the stages this run must recompute despite the cache."""

    tracking_uri: str
    experiment_id: str
    parent_run_id: str
    flow_run_id: str | None = None
    recompute: frozenset[str] = frozenset()


def tracking_uri() -> str:
    return os.environ.get("MLFLOW_TRACKING_URI", DEFAULT_TRACKING_URI)


def flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


class MlflowLogger:
    """trainer.tracking.MetricLogger on one MLflow run, through MlflowClient (thread-safe)."""

    def __init__(self, client, run_id: str) -> None:
        self.client, self.run_id = client, run_id

    def log_params(self, params: dict[str, Any]) -> None:
        from mlflow.entities import Param

        items = [Param(k, json.dumps(v) if isinstance(v, (list, dict)) else str(v))
                 for k, v in flatten(params).items()]
        for i in range(0, len(items), 100):
            self.client.log_batch(self.run_id, params=items[i : i + 100])

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        items = [Metric(k, float(v), now, step or 0) for k, v in metrics.items()]
        self.client.log_batch(self.run_id, metrics=items)

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        path = Path(path)
        if path.is_dir():
            self.client.log_artifacts(self.run_id, str(path), artifact_path)
        else:
            self.client.log_artifact(self.run_id, str(path), artifact_path)

    def log_table(self, rows: list[dict[str, Any]], name: str) -> None:
        if rows:
            columns = {k: [r.get(k) for r in rows] for k in rows[0]}
            self.client.log_table(self.run_id, data=columns, artifact_file=name)

    def log_text(self, text: str, name: str) -> None:
        self.client.log_text(self.run_id, text, name)

    def set_tags(self, tags: dict[str, Any]) -> None:
        for k, v in tags.items():
            self.client.set_tag(self.run_id, k, str(v))


_ready: set[str] = set()


def mlflow_client(uri: str):
    """An MlflowClient on `uri`. A process's first use of a SQLite store runs under a file lock beside
    the database: MLflow creates a fresh store's tables on first use, and two processes doing that at
    once fail ("No such index ..."). A server-backed store is set up by its server."""
    import fcntl

    from mlflow import MlflowClient

    if not uri.startswith("sqlite:///") or uri in _ready:
        return MlflowClient(tracking_uri=uri)
    db = Path(uri[len("sqlite:///"):]).expanduser()
    db.parent.mkdir(parents=True, exist_ok=True)
    with open(db.with_name(db.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        client = MlflowClient(tracking_uri=uri)  # creates or migrates the tracking tables
        client.search_experiments(max_results=1)
        client.search_registered_models(max_results=1)  # ... and the model registry's
    _ready.add(uri)
    return client


def client_for(ref: TrackingRef):
    return mlflow_client(ref.tracking_uri)


def child_logger(ref: TrackingRef, stage: str, tags: dict[str, Any]) -> MlflowLogger:
    client = client_for(ref)
    run = client.create_run(ref.experiment_id, run_name=stage, tags={
        "mlflow.parentRunId": ref.parent_run_id, "posttrain.stage": stage,
        **({"prefect.flow_run_id": ref.flow_run_id} if ref.flow_run_id else {}),
        **{k: str(v) for k, v in tags.items()},
    })
    return MlflowLogger(client, run.info.run_id)


# ---------------------------------------------------------------- the stage runner

def prefect_logger():
    """The Prefect run logger inside a task, else a std logger (tests calling .fn directly)."""
    import logging

    from prefect import get_run_logger
    from prefect.exceptions import MissingContextError

    try:
        return get_run_logger()
    except MissingContextError:
        return logging.getLogger("posttrain")


HOLDER_FILE = "holder.json"  # in an s3:// stage's scratch folder: the pid, host and lease token of its run


def scratch_root(folder: str) -> Path:
    """This machine's scratch area of an s3:// stage folder: one folder per holder under it."""
    return storage.posttrain_cache() / "work" / hashlib.sha256(folder.encode()).hexdigest()[:16]


def work_dir_for(folder: str, holder: str | None = None, create: bool = True, fresh: bool = False) -> Path:
    """Where a stage writes: its folder itself when local; for s3://, a local scratch folder of the
    run holding its lease (`holder`, the lease's token: a paused holder and the run that took over
    from it never share one).

    `fresh` (a recompute, or a damaged result replaced) on a local root: a staging folder beside it
    instead, emptied first, which replaces the result only once the new one commits (`commit`)."""
    if not storage.is_remote(folder):
        path = Path(storage.fs_for(folder)[1])
        if fresh:
            path = path.parent / ".staging" / path.name
            shutil.rmtree(path, ignore_errors=True)
    else:
        if holder is None:
            raise ValueError(f"{folder}: an s3:// stage folder's scratch folder belongs to the run holding its lease")
        path = scratch_root(folder) / holder
    if create:
        path.mkdir(parents=True, exist_ok=True)
    return path


def adopt_checkpoint(folder: str, work: Path) -> tuple[str, dict] | None:
    """For an s3:// stage folder: link the newest committed checkpoint that an earlier holder left in
    this machine's scratch area into `work` (this holder's folder), then remove the folders of
    earlier holders whose process is gone. Returns (its tag, that holder), or None if there is none.

    Links, not moves: a paused earlier holder may still be alive; it stops at its next save (its
    lease is lost) and never rewrites a committed checkpoint, only prunes it, which a link survives."""
    mine = work / "checkpoints"
    if committed_tags(mine):
        return None
    best: tuple[str, Path, dict] | None = None
    for other in scratch_root(folder).iterdir():
        if other == work or not (other / HOLDER_FILE).is_file():
            continue
        tags = committed_tags(other / "checkpoints")
        if tags and (best is None or tags[-1] > best[0]):
            best = (tags[-1], other, json.loads((other / HOLDER_FILE).read_text()))
    adopted = None
    if best is not None:
        tag, other, who = best
        try:
            shutil.copytree(other / "checkpoints" / tag, mine / tag, copy_function=os.link)
            if (mine / tag / COMMITTED).is_file():
                adopted = (tag, who)
        except OSError:  # pruned while being linked: start from the input instead
            pass
        if adopted is None:
            shutil.rmtree(mine / tag, ignore_errors=True)
    for other in scratch_root(folder).iterdir():
        who = json.loads((other / HOLDER_FILE).read_text()) if (other / HOLDER_FILE).is_file() else None
        if other != work and who and who.get("host") == socket.gethostname() and process_gone(who.get("pid", 0)):
            shutil.rmtree(other, ignore_errors=True)
    return adopted


def commit(work: Path, folder: str, manifest: dict[str, Any], replace: bool) -> None:
    """Publish the work folder's files at `folder` and commit them with the manifest (written last).

    `replace`: the work folder is a staging folder and a result is already at `folder`. Local roots
    swap the folders (the old one stays whole until the rename); s3:// roots remove the old objects,
    then upload (S3 has no rename: a crash inside that upload leaves no result, never a torn one)."""
    manifest = {**manifest, "files": storage.list_files(work, skip=UNCHECKED)}
    if replace and not storage.is_remote(folder):
        storage.write_json(str(work / storage.MANIFEST), manifest)
        storage.replace_dir(work, Path(storage.fs_for(folder)[1]))
        return
    if replace:
        storage.remove(folder)
    storage.put_dir(work, folder, skip=UNCHECKED)
    storage.commit_manifest(folder, manifest)


# What a result's manifest does not list, a cache hit does not check and a commit does not copy to
# the result's folder (on an s3:// root nothing is uploaded that nothing reads): checkpoints, which
# stay in the machine's scratch folder ($POSTTRAIN_CACHE/work) where resumes and continuations on
# that machine read them; GRPO's `sync/` (the weights pushed to SGLang each round); the launch's own
# bookkeeping. The manifest itself is written separately, last.
UNCHECKED = ("checkpoints/", "sync/", "rank_status/", "launch_spec.json", "launch_result.json", HOLDER_FILE,
             storage.MANIFEST)


def damage(folder: str, manifest: dict[str, Any]) -> str | None:
    """What is wrong with a committed result's files (missing, or not the size committed), or None."""
    listed = manifest.get("files")
    if listed is None:
        return None  # committed before manifests listed their files
    present = storage.list_files(folder, skip=UNCHECKED)
    for rel, size in sorted(listed.items()):
        if rel not in present:
            return f"{rel} is missing"
        if present[rel] != size:
            return f"{rel} has {present[rel]} bytes, {size} were committed"
    return None


# the lease a stage holds while its body runs (run_launched hands its ranks lock to the ranks)
_held: contextvars.ContextVar[lease.StageLease | None] = contextvars.ContextVar("held_lease", default=None)


def _cache_hit(stage: str, where, ref: TrackingRef, t0: float) -> dict[str, Any]:
    manifest = where.manifest
    source = manifest.get("mlflow_run_id", "")
    logger = child_logger(ref, stage, {"cache_hit": True, "source_run_id": source})
    logger.log_metrics(manifest.get("metrics", {}))
    logger.client.set_terminated(logger.run_id)
    prefect_logger().info("%s: cache hit (key %s) at %s", stage, where.key, where.folder)
    return {**manifest, "cache_hit": True, "wall_seconds": time.perf_counter() - t0,
            "mlflow_run_id": logger.run_id, "source_run_id": source}


def run_stage(
    stage: str,
    cfg: RunConfig,
    inputs: dict[str, dict | None],
    body: Callable[[Path, MlflowLogger], dict[str, Any]],
    ref: TrackingRef,
) -> dict[str, Any]:
    """Return the stage's manifest: from cache if committed, else by running `body`.

    `body(work_dir, logger)` writes its files into work_dir and returns {"metrics": {...}, ...};
    the runner uploads the folder (for s3:// roots) and commits the manifest last. One run at a
    time computes a folder (tasks/lease.py): the others wait and then take its result."""
    log = prefect_logger()
    t0 = time.perf_counter()
    recompute = stage in ref.recompute
    where = resolve(cfg, stage, inputs)
    if where.manifest is not None and not recompute and not damage(where.folder, where.manifest):
        return _cache_hit(stage, where, ref, t0)
    while True:
        key = where.key
        say = lambda msg: log.info("%s (key %s): %s", stage, key, msg)  # noqa: E731
        with lease.hold(where.folder, say, {"flow_run_id": ref.flow_run_id, "mlflow_run_id": ref.parent_run_id}) as held:
            again = resolve(cfg, stage, inputs)  # another run may have committed it meanwhile
            if again.folder != where.folder:  # ... and so moved this run's result to a folder of its own
                where = again
                continue
            where = again
            fresh = recompute and where.manifest is not None
            if where.manifest is not None and not recompute:
                broken = damage(where.folder, where.manifest)
                if not broken:
                    return _cache_hit(stage, where, ref, t0)
                log.warning("%s: the result at %s is damaged (%s); computing it again beside it", stage,
                            where.folder, broken)
                fresh = True
            token = _held.set(held)
            try:
                return _compute(stage, cfg, inputs, body, ref, where, held, fresh, t0)
            finally:
                _held.reset(token)


def _compute(stage, cfg, inputs, body, ref: TrackingRef, where, held: lease.StageLease, fresh: bool,
             t0: float) -> dict[str, Any]:
    log = prefect_logger()
    folder = where.folder
    work = work_dir_for(folder, holder=held.token, fresh=fresh)
    took_over = f"took over from {lease._describe(held.previous)}; " if held.previous else ""
    adopted = None
    if storage.is_remote(folder):
        storage.write_json(str(work / HOLDER_FILE), {"pid": os.getpid(), "host": socket.gethostname(),
                                                     "token": held.token, "flow_run_id": ref.flow_run_id})
        if not fresh:
            adopted = adopt_checkpoint(folder, work)
    checkpoints = committed_tags(work / "checkpoints")
    source = None
    if checkpoints:
        source = f"the checkpoint {checkpoints[-1]} " + (f"left on this machine by pid {adopted[1].get('pid')}" if adopted
                                                         else f"left in {work} by an earlier attempt")
    if where.continues_from is not None:
        if source:
            log.info("%s: %scontinuing the result at %s from %d to %d, from %s", stage, took_over, folder,
                     where.continues_from, extent(cfg, stage), source)
        else:  # checkpoints stay in the scratch folder of the machine that ran it (see UNCHECKED)
            log.warning("%s: %sextending the result at %s from %d to %d, but its checkpoints are not on this machine "
                        "(they stay in the scratch folder of the machine that computed it): computing the stage "
                        "again from its input", stage, took_over, folder, where.continues_from, extent(cfg, stage))
        storage.remove(storage.join(folder, storage.MANIFEST))  # uncommitted until the longer run ends
    elif fresh:
        log.warning("%s: recomputing beside the result at %s; it stays in place until the new one commits",
                    stage, folder)
    elif source:
        log.info("%s: %sresuming from %s", stage, took_over, source)
    elif took_over:
        log.warning("%s: %sno checkpoint of it is on this machine (checkpoints stay on the machine that wrote "
                    "them; it ran on %s): restarting from the stage's input", stage, took_over,
                    held.previous.get("host"))
    logger = child_logger(ref, stage, {"cache_hit": False, "cache_key": where.key})
    sections = rule_for(stage).sections  # the config sections the stage logs and records
    logger.log_params({stage_section: cfg.to_dict()[stage_section] for stage_section in sections})
    log.info("%s: running (key %s); MLflow child run %s", stage, where.key, logger.run_id)
    try:
        with checkpoint_guard(held.check):
            extra = body(work, logger)
        held.check()
    except BaseException:
        from mlflow.entities import RunStatus

        logger.client.set_terminated(logger.run_id, RunStatus.to_string(RunStatus.FAILED))
        if fresh:
            log.error("%s: the recompute failed; the earlier result at %s is kept", stage, folder)
        raise
    wall = time.perf_counter() - t0
    manifest = {
        "stage": stage, "key": where.key, "uri": folder, "code_version": code_version(),
        "config": {s: cfg.to_dict()[s] for s in sections}, "seed": cfg.seed,
        "inputs": {k: (v or {}).get("key") for k, v in inputs.items()},
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "mlflow_run_id": logger.run_id, "flow_run_id": ref.flow_run_id, "wall_seconds": wall,
        "extent": extent(cfg, stage), **extra,
    }
    commit(work, folder, manifest, replace=fresh)
    logger.log_metrics({f"{stage}/wall_seconds": wall})
    logger.log_text(json.dumps(manifest, indent=2, sort_keys=True), "manifest.json")
    logger.client.set_terminated(logger.run_id)
    log.info("%s: done in %.1fs, committed %s", stage, wall, storage.join(folder, storage.MANIFEST))
    return {**manifest, "cache_hit": False, "source_run_id": logger.run_id}


def scratch_dir() -> Path:
    return Path(tempfile.mkdtemp(prefix="posttrain-"))


def run_launched(stage: str, cfg: RunConfig, ds_cfg, work: Path, ref: TrackingRef, logger: MlflowLogger,
                 inputs: dict[str, Any]) -> dict[str, Any]:
    """Run `stage`'s body on every rank under the DeepSpeed launcher (tasks.rank_main), supervised:
    its output goes into this task's log; a crash, timeout or cancellation kills every rank."""
    from trainer import launch

    held = _held.get()
    spec = {"stage": stage, "config": cfg.to_dict(), "work_dir": str(work), "inputs": inputs,
            "mlflow": {"tracking_uri": ref.tracking_uri, "run_id": logger.run_id}, "supervisor_pid": os.getpid(),
            "ranks_lock": str(held.ranks_lock) if held is not None and held.ranks_lock else None,
            "lease": held.for_ranks() if held is not None else None}
    path = launch.write_spec(work, spec)
    plan = launch.plan(stage, ds_cfg, path)
    log = prefect_logger()
    log.info("%s", plan.describe())
    logger.log_params({f"{stage}.launch.world_size": plan.world_size})
    return launch.supervise(plan, work, on_line=lambda line: log.info("%s", line), timeout_s=ds_cfg.timeout_s)
