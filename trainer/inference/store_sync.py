"""Each round's weights to rollout servers on other machines, through the artifact store.

The trainer's rank 0 uploads the round's save_pretrained folder to
`<artifact_root>/rollout-weights/<stage folder>/<version>/` and writes `READY.json` (the version and
every file's size) last; then asks each server's posttrain front (trainer/inference/rollout_host.py,
on the server's machine) to load it. The front reads READY.json first: a folder without it is still
being written and is refused; every file it lists is downloaded and its size checked before SGLang
loads it from the front's own disk. Once every server has the new version, the previous one is
removed from the store. Nothing here assumes a disk the two machines share.
"""

from __future__ import annotations

import time
from pathlib import Path

from trainer import storage
from trainer.errors import InputError

READY = "READY.json"


class StoreSyncError(InputError):
    pass


class WeightStore:
    """The store folder of one stage's rollout weights, written by the trainer's rank 0."""

    def __init__(self, artifact_root: str, stage: str) -> None:
        self.base = storage.join(artifact_root, "rollout-weights", stage)
        self.published: str | None = None
        self.clear()  # what a killed run of this stage left

    def publish(self, local_dir: Path, version: str, engine) -> dict[str, float]:
        """Upload `local_dir` as `version`, have every server of `engine` load it, drop the previous
        version. Returns the seconds of each part (the servers' slowest download and load)."""
        url = storage.join(self.base, version.replace("@", "-").replace("/", "-"))
        t0 = time.perf_counter()
        files = storage.list_files(local_dir)
        storage.put_dir(local_dir, url)
        storage.write_json(storage.join(url, READY), {"version": version, "files": files})
        upload = time.perf_counter() - t0
        served = engine.update_weights_from_store(url, version)
        previous, self.published = self.published, url
        if previous is not None and previous != url:
            storage.remove(previous)
        return {"weights_upload_seconds": upload, "weights_download_seconds": served["download"],
                "weights_load_seconds": served["load"], "weights_mb": sum(files.values()) / 1e6}

    def clear(self) -> None:
        storage.remove(self.base)
        self.published = None


def fetch(url: str, dest: Path) -> dict:
    """Download the committed weights folder at `url` into `dest` (made here); returns its READY
    record. Raises StoreSyncError if the folder is not committed or a file is not what READY says."""
    try:
        ready = storage.read_json(storage.join(url, READY))
    except FileNotFoundError:
        raise StoreSyncError(f"{url} has no {READY}: the folder is not committed (still being written, or "
                             "removed); the trainer writes it after every file") from None
    files = ready.get("files") if isinstance(ready, dict) else None
    if not isinstance(files, dict) or not files:
        raise StoreSyncError(f"{storage.join(url, READY)} lists no files; it must be {{'version': .., 'files': "
                             "{relative path: size}}")
    dest.mkdir(parents=True, exist_ok=True)
    storage.get_files(url, list(files), dest)
    for rel, size in files.items():
        got = (dest / rel).stat().st_size
        if got != size:
            raise StoreSyncError(f"{storage.join(url, rel)}: {got} bytes downloaded, {READY} says {size}; "
                                 "the folder changed while it was read")
    return ready


def load_once(engine, sync: str, artifact_root: str, local_dir: Path, version: str) -> None:
    """Have every server of `engine` load the folder `local_dir` once (an eval's model): from this
    machine's disk, or through the store (`sync == "store"`), where the copy is removed once loaded."""
    if sync != "store":
        engine.update_weights(str(local_dir), version)
        return
    store = WeightStore(artifact_root, version.replace("@", "-"))
    try:
        store.publish(local_dir, version, engine)
    finally:
        store.clear()
