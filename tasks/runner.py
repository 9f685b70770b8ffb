"""Running one stage: from cache when its result is committed, else its body under the stage's
lease (tasks/lease.py), with an MLflow child run, the manifest committed last (tasks/results.py),
and, for launched stages, its ranks supervised under the DeepSpeed launcher."""

from __future__ import annotations

import contextvars
import json
import os
import shutil
import socket
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from tasks import lease, stages
from tasks.keys import MAX_OTHER_WORLD_SIZE, KeyRule, code_version, extent, resolve, stage_key, world_sizes
from tasks.results import HOLDER_FILE, adopt_checkpoint, commit, damage, work_dir_for
from tasks.stages import rule_for
from tasks.tracking import MlflowLogger, TrackingRef, child_logger, ended_status, prefect_logger
from trainer import storage
from trainer.checkpoint import COMMITTED, committed_tags, guarded as checkpoint_guard, mirror_tags, mirrored as checkpoint_mirrored
from trainer.config import RunConfig

# the lease a stage holds while its body runs (run_launched hands its ranks lock to the ranks)
_held: contextvars.ContextVar[lease.StageLease | None] = contextvars.ContextVar("held_lease", default=None)


def _cache_hit(stage: str, where, ref: TrackingRef, t0: float, reads: dict[str, str], inputs: dict,
               policy: str | None, start: str | None) -> dict[str, Any]:
    manifest = where.manifest
    source = manifest.get("mlflow_run_id", "")
    logger = child_logger(ref, stage, {"cache_hit": True, "source_run_id": source})
    logger.log_reads(inputs, reads, cached_from=source, policy=policy, pretrained=start,
                     cached_model=manifest.get("mlflow_model_id"))
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
    *,
    row: str,
) -> dict[str, Any]:
    """Return the stage's manifest: from cache if committed, else by running `body`. `row` names
    the table's row (`ref.recompute` holds row names: rows of one kind share its folders).

    `body(work_dir, logger)` writes its files into work_dir and returns {"metrics": {...}, ...};
    the runner uploads the folder (for s3:// roots) and commits the manifest last. One run at a
    time computes a folder (tasks/lease.py): the others wait and then take its result."""
    log = prefect_logger()
    t0 = time.perf_counter()
    recompute = row in ref.recompute
    rule = rule_for(stage)
    this = stages.row(row)
    reads, policy = this.splits_read(cfg), this.policy
    start = ref.pretrained_model_id if this.pretrained else None  # the logged model a models:/ start names
    where = resolve(cfg, stage, rule, inputs)
    if where.manifest is not None and not recompute and not damage(where.folder, where.manifest):
        return _cache_hit(stage, where, ref, t0, reads, inputs, policy, start)
    while True:
        key = where.key
        say = lambda msg: log.info("%s (key %s): %s", stage, key, msg)  # noqa: E731
        with lease.hold(where.folder, say, {"flow_run_id": ref.flow_run_id, "mlflow_run_id": ref.parent_run_id}) as held:
            again = resolve(cfg, stage, rule, inputs)  # another run may have committed it meanwhile
            if again.folder != where.folder:  # ... and so moved this run's result to a folder of its own
                where = again
                continue
            where = again
            fresh = recompute and where.manifest is not None
            if where.manifest is not None and not recompute:
                broken = damage(where.folder, where.manifest)
                if not broken:
                    return _cache_hit(stage, where, ref, t0, reads, inputs, policy, start)
                log.warning("%s: the result at %s is damaged (%s); computing it again beside it", stage,
                            where.folder, broken)
                fresh = True
            token = _held.set(held)
            try:
                return _compute(stage, rule, cfg, inputs, body, ref, where, held, fresh, t0, reads, policy, start)
            finally:
                _held.reset(token)


def _compute(stage, rule: KeyRule, cfg, inputs, body, ref: TrackingRef, where, held: lease.StageLease, fresh: bool,
             t0: float, reads: dict[str, str], policy: str | None, start: str | None) -> dict[str, Any]:
    log = prefect_logger()
    folder = where.folder
    span = extent(cfg, rule)
    work = work_dir_for(folder, holder=held.token, fresh=fresh)
    took_over = f"took over from {lease._describe(held.previous)}; " if held.previous else ""
    adopted = None
    mirror = checkpoint_mirror(folder)
    if storage.is_remote(folder):
        storage.write_json(str(work / HOLDER_FILE), {"pid": os.getpid(), "host": socket.gethostname(),
                                                     "token": held.token, "flow_run_id": ref.flow_run_id})
        if fresh:  # a recompute starts from its input, not from the checkpoints of the result it replaces
            storage.remove(mirror)
        else:
            adopted = adopt_checkpoint(folder, work)
    checkpoints = committed_tags(work / "checkpoints")
    mirrored = mirror_tags(mirror) if mirror else []
    source = None
    if mirrored and (not checkpoints or mirrored[-1] > checkpoints[-1]):
        source = f"the checkpoint {mirrored[-1]} committed at {mirror}"
    elif checkpoints:
        source = f"the checkpoint {checkpoints[-1]} " + (f"left on this machine by pid {adopted[1].get('pid')}" if adopted
                                                         else f"left in {work} by an earlier attempt")
    borrowed = None
    if source is None and not fresh and where.continues_from is None:
        borrowed = borrow_checkpoint(cfg, stage, rule, inputs, work, mirror)
        if borrowed is not None:
            other, tag, ranks = borrowed
            now = max(world_sizes(cfg, rule))
            source = (f"the checkpoint {tag} that {ranks} rank(s) committed at {other} (a run on {ranks} that did "
                      f"not finish)")
            log.warning("%s: resuming from %s; on %d rank(s) the result will be close to, not bit-identical with, "
                        "an uninterrupted run on %d (the batch is summed in another order)", stage, source, now, now)
    if where.continues_from is not None:
        if source:
            log.info("%s: %scontinuing the result at %s from %d to %d, from %s", stage, took_over, folder,
                     where.continues_from, span, source)
        else:  # a local root's checkpoints were removed, or the result came from another root
            log.warning("%s: %sextending the result at %s from %d to %d, but none of its checkpoints is left: "
                        "computing the stage again from its input", stage, took_over, folder, where.continues_from,
                        span)
        storage.remove(storage.join(folder, storage.MANIFEST))  # uncommitted until the longer run ends
    elif fresh:
        log.warning("%s: recomputing beside the result at %s; it stays in place until the new one commits",
                    stage, folder)
    elif source and borrowed is None:
        log.info("%s: %sresuming from %s", stage, took_over, source)
    elif took_over:
        log.warning("%s: %sthe run it took over (on %s) left no committed checkpoint: restarting from the stage's "
                    "input", stage, took_over, held.previous.get("host"))
    logger = child_logger(ref, stage, {"cache_hit": False, "cache_key": where.key})
    logger.log_reads(inputs, reads, policy=policy, pretrained=start)
    sections = rule.sections  # the config sections the stage logs and records
    logger.log_params({stage_section: cfg.to_dict()[stage_section] for stage_section in sections})
    log.info("%s: running (key %s) in %s; MLflow child run %s", stage, where.key, folder, logger.run_id)
    try:
        with checkpoint_guard(held.check), checkpoint_mirrored(mirror):
            extra = body(work, logger)
        held.check()
        model_id = log_policy(stage, cfg, rule, ref, where, work, extra, logger)
    except BaseException as exc:
        logger.client.set_terminated(logger.run_id, ended_status(exc))
        # nothing written, no checkpoint to resume from: no empty key folder left behind, nor (s3://)
        # a scratch folder holding only its holder's note (a local work folder has none)
        if not {p.name for p in work.iterdir()} - {HOLDER_FILE}:
            shutil.rmtree(work, ignore_errors=True)
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
        "extent": span, **extra, **({"mlflow_model_id": model_id} if model_id else {}),
        **({"checkpoint_from": {"folder": borrowed[0], "tag": borrowed[1], "world_size": borrowed[2]}}
           if borrowed else {}),
    }
    try:
        commit(work, folder, manifest, replace=fresh)
    except BaseException:
        if model_id:
            logger.finalize_model(model_id, ok=False)
        raise
    if model_id:
        logger.finalize_model(model_id, ok=True)
    logger.log_metrics({f"{stage}/wall_seconds": wall})
    logger.log_text(json.dumps(manifest, indent=2, sort_keys=True), "manifest.json")
    logger.client.set_terminated(logger.run_id)
    log.info("%s: done in %.1fs, committed %s", stage, wall, storage.join(folder, storage.MANIFEST))
    return {**manifest, "cache_hit": False, "source_run_id": logger.run_id}


def log_policy(stage: str, cfg, rule: KeyRule, ref: TrackingRef, where, work: Path, extra: dict[str, Any],
               logger: MlflowLogger) -> str | None:
    """A stage that exports a policy (its result's `model_subdir`: sft, grpo, control) logs it as an
    MLflow logged model of its run, named `<name>-<role>` ("tiny-grpo"; "tiny-start" for the
    pretrained policy an sft stage that trains nothing commits), with the stage's config sections as
    params: the experiment's *Models* tab lists the policies, their evals' metrics and registered
    versions. Its id goes into the manifest (`mlflow_model_id`); None for other stages."""
    subdir = extra.get("model_subdir")
    if not subdir:
        return None
    role = "start" if extra.get("skipped") else stage
    what = {"sft": "SFT", "grpo": "GRPO", "control": "SFT-only control", "start": "starting (pretrained)"}[role]
    uri = storage.join(where.folder, subdir)
    uri = uri if storage.is_remote(uri) else os.path.abspath(uri)
    tags = {"posttrain.stage": stage, "posttrain.key": where.key, "posttrain.uri": uri, "posttrain.preset": cfg.name,
            "posttrain.pipeline_run": ref.parent_run_id}
    if ref.flow_run_id:
        tags["prefect.flow_run_id"] = ref.flow_run_id
    if extra.get("adapter_subdir"):
        tags["posttrain.lora"] = f"merged ({cfg.model.lora.describe()}); the adapter is the source run's adapter/"
    description = (f"The {what} policy of preset {cfg.name} (stage {stage}, key {where.key}), also at {uri}: a "
                   f"transformers save_pretrained folder, weights and tokenizer; download the artifacts and load "
                   f"them with AutoModelForCausalLM.from_pretrained and AutoTokenizer.from_pretrained.")
    params = {section: cfg.to_dict()[section] for section in rule.sections}
    return logger.log_model(cfg.logged_model_name(role), work / subdir, params, tags, description)


def borrow_checkpoint(cfg: RunConfig, stage: str, rule: KeyRule, inputs: dict, work: Path,
                      mirror: str | None) -> tuple[str, str, int] | None:
    """A stage with no checkpoint of its own, whose same computation on another number of ranks
    started and did not finish (a run that lost a host, run again on the hosts left): the newest
    checkpoint that run committed, copied to where this one resumes from (its mirror, else its work
    folder), marker last. Returns (that run's folder, the tag, its rank count), or None. A finished
    result on another rank count is never borrowed from: it is another result, not an interruption."""
    sizes = world_sizes(cfg, rule)
    if len(sizes) != 1:
        return None
    now = sizes.pop()
    best = None
    for ranks in range(1, MAX_OTHER_WORLD_SIZE + 1):
        if ranks == now:
            continue
        other = storage.join(cfg.artifact_root, stage, stage_key(cfg, stage, rule, inputs, world_size=ranks))
        ckpts = storage.join(other, "checkpoints")
        tags = mirror_tags(ckpts) if storage.is_remote(other) else committed_tags(storage.fs_for(ckpts)[1])
        if tags and (best is None or tags[-1] > best[1]) and storage.read_manifest(other) is None:
            best = (other, tags[-1], ranks)
    if best is None:
        return None
    other, tag, ranks = best
    src = storage.join(other, "checkpoints", tag)
    marker = storage.read_json(storage.join(src, COMMITTED))
    dest = storage.join(mirror, tag) if mirror else str(work / "checkpoints" / tag)
    storage.copy_files(src, list(marker["files"]), dest)
    storage.write_json(storage.join(dest, COMMITTED), marker)
    return best


def checkpoint_mirror(folder: str) -> str | None:
    """Where a stage on a remote root commits its checkpoints for any machine to resume: its folder's
    `checkpoints/` (never part of the result: tasks.results.UNCHECKED). None for a local root."""
    return storage.join(folder, "checkpoints") if storage.is_remote(folder) else None


def scratch_dir() -> Path:
    return Path(tempfile.mkdtemp(prefix="posttrain-"))


def run_launched(stage: str, cfg: RunConfig, ds_cfg, work: Path, ref: TrackingRef, logger: MlflowLogger,
                 inputs: dict[str, Any]) -> dict[str, Any]:
    """Run `stage`'s body on every rank under the DeepSpeed launcher (tasks.rank_main), supervised:
    its output goes into this task's log; a crash, timeout or cancellation kills every rank."""
    from trainer import launch

    from trainer.checkpoint import current_mirror

    held = _held.get()
    spec = {"stage": stage, "config": cfg.to_dict(), "work_dir": str(work), "inputs": inputs,
            "mlflow": {"tracking_uri": ref.tracking_uri, "run_id": logger.run_id}, "supervisor_pid": os.getpid(),
            "supervisor_host": socket.gethostname(), "collective_timeout_s": ds_cfg.collective_timeout_s,
            "checkpoint_mirror": current_mirror(),
            "ranks_lock": str(held.ranks_lock) if held is not None and held.ranks_lock else None,
            "lease": held.for_ranks() if held is not None else None}
    path = launch.write_spec(work, spec)
    plan = launch.plan(stage, ds_cfg, path)
    log = prefect_logger()
    log.info("%s", plan.describe())
    logger.log_params({f"{stage}.launch.world_size": plan.world_size})
    return launch.supervise(plan, work, on_line=lambda line: log.info("%s", line), timeout_s=ds_cfg.timeout_s)
