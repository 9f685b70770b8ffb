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

import hashlib
import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from tasks.keys import RULES, code_version, extent, resolve
from trainer import storage
from trainer.config import RunConfig

DEFAULT_TRACKING_URI = "sqlite:///mlflow.db"


# The config sections each stage logs and records (eval's label varies: "eval", "eval (grpo)");
# which of their fields are keyed, and what is keyed by content, is tasks/keys.py's table.
SECTIONS: dict[str, tuple[str, ...]] = {name: rule.sections for name, rule in RULES.items()}


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


def client_for(ref: TrackingRef):
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=ref.tracking_uri)


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


def work_dir_for(folder: str, create: bool = True) -> Path:
    """Where a stage writes: its folder itself when local, a local scratch folder for s3://."""
    if not storage.is_remote(folder):
        path = Path(storage.fs_for(folder)[1])
    else:
        scratch = Path(os.environ.get("POSTTRAIN_CACHE", Path.home() / ".cache" / "posttrain")) / "work"
        path = scratch / hashlib.sha256(folder.encode()).hexdigest()[:16]
    if create:
        path.mkdir(parents=True, exist_ok=True)
    return path


def run_stage(
    stage: str,
    cfg: RunConfig,
    sections: tuple[str, ...],
    inputs: dict[str, dict | None],
    body: Callable[[Path, MlflowLogger], dict[str, Any]],
    ref: TrackingRef,
) -> dict[str, Any]:
    """Return the stage's manifest: from cache if committed, else by running `body`.

    `body(work_dir, logger)` writes its files into work_dir and returns {"metrics": {...}, ...};
    the runner uploads the folder (for s3:// roots) and commits the manifest last."""
    log = prefect_logger()
    t0 = time.perf_counter()
    where = resolve(cfg, stage, inputs)
    key, folder, manifest = where.key, where.folder, where.manifest
    if where.continues_from is not None:
        log.info("%s: continuing the result at %s from %d to %d (its last checkpoint)", stage, folder,
                 where.continues_from, extent(cfg, stage))
        storage.remove(storage.join(folder, storage.MANIFEST))  # uncommitted until the longer run ends
    if manifest is not None and stage in ref.recompute:
        log.warning("%s: recompute requested; discarding the cached result at %s", stage, folder)
        storage.remove(folder)
        if storage.is_remote(folder):
            shutil.rmtree(work_dir_for(folder), ignore_errors=True)  # its local checkpoints too
        manifest = None
    if manifest is not None:
        source = manifest.get("mlflow_run_id", "")
        logger = child_logger(ref, stage, {"cache_hit": True, "source_run_id": source})
        logger.log_metrics(manifest.get("metrics", {}))
        logger.client.set_terminated(logger.run_id)
        log.info("%s: cache hit (key %s) at %s", stage, key, folder)
        return {**manifest, "cache_hit": True, "wall_seconds": time.perf_counter() - t0,
                "mlflow_run_id": logger.run_id, "source_run_id": source}
    logger = child_logger(ref, stage, {"cache_hit": False, "cache_key": key})
    logger.log_params({stage_section: cfg.to_dict()[stage_section] for stage_section in sections})
    log.info("%s: running (key %s); MLflow child run %s", stage, key, logger.run_id)
    work = work_dir_for(folder)
    try:
        extra = body(work, logger)
    except BaseException:
        from mlflow.entities import RunStatus

        logger.client.set_terminated(logger.run_id, RunStatus.to_string(RunStatus.FAILED))
        raise
    storage.put_dir(work, folder)
    wall = time.perf_counter() - t0
    manifest = {
        "stage": stage, "key": key, "uri": folder, "code_version": code_version(),
        "config": {s: cfg.to_dict()[s] for s in sections}, "seed": cfg.seed,
        "inputs": {k: (v or {}).get("key") for k, v in inputs.items()},
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "mlflow_run_id": logger.run_id, "flow_run_id": ref.flow_run_id, "wall_seconds": wall,
        "extent": extent(cfg, stage), **extra,
    }
    storage.commit_manifest(folder, manifest)
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

    spec = {"stage": stage, "config": cfg.to_dict(), "work_dir": str(work), "inputs": inputs,
            "mlflow": {"tracking_uri": ref.tracking_uri, "run_id": logger.run_id}, "supervisor_pid": os.getpid()}
    path = launch.write_spec(work, spec)
    plan = launch.plan(stage, ds_cfg, path)
    log = prefect_logger()
    log.info("%s", plan.describe())
    logger.log_params({f"{stage}.launch.world_size": plan.world_size})
    return launch.supervise(plan, work, on_line=lambda line: log.info("%s", line), timeout_s=ds_cfg.timeout_s)
