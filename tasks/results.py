"""A stage's result folder: where its work is written, how it is committed, what a cache hit checks.

Outputs live in `<artifact_root>/<stage>/<key>/`, committed by `manifest.json` written last: a
folder with a manifest is a finished result (a cache hit), one without is not. Keys (tasks/keys.py)
live in the artifact store rather than in Prefect's local cache records so that a re-run on another
machine (or against the same s3:// root) finds the same results, and so that deleting a folder
really forces a recompute. s3:// stages write into a scratch folder on this machine first.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
from pathlib import Path
from typing import Any

from trainer import launch, storage
from trainer.checkpoint import COMMITTED, committed_tags
from trainer.procwatch import process_gone

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
    if replace:  # the old result's files; the checkpoints committed beside it are the new run's
        storage.remove(folder, keep=("checkpoints/",))
    storage.put_dir(work, folder, skip=UNCHECKED)
    storage.commit_manifest(folder, manifest)


# What a result's manifest does not list, a cache hit does not check and a commit does not copy to
# the result's folder (on an s3:// root nothing is uploaded that nothing reads): checkpoints, which a
# local root keeps in the folder, and an s3:// root in the machine's scratch folder ($POSTTRAIN_CACHE/work),
# each also committed to the folder's `checkpoints/` as it is saved (trainer.checkpoint's mirror), where
# a resume or continuation on any machine finds them; GRPO's `sync/` (the weights pushed to SGLang each round); the launch's own
# bookkeeping. The manifest itself is written separately, last.
UNCHECKED = ("checkpoints/", "sync/", "rank_status/", "launch_spec.json", "launch_result.json", launch.HOSTFILE,
             launch.DS_ENV_FILE, HOLDER_FILE, storage.MANIFEST)


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
