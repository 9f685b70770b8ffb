"""Artifact storage through fsspec: local paths and `s3://` URIs alike.

A stage writes its files into its folder and commits them by writing `manifest.json` last; a
folder without a manifest is not a result. Local writes go through a temporary name and an
atomic rename; S3 puts are atomic per object. S3 endpoint and credentials come from the usual
AWS environment variables (AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, ...), never from the config.
A transient S3 error (connection refused or reset, time-out, throttling, 5xx) is retried with
backoff on top of s3fs's own retries; a missing object or a denied request fails at once, and
missing or refused credentials and a missing bucket as a StorageError naming the URL and the fix.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import fsspec

from trainer.errors import InputError

MANIFEST = "manifest.json"
log = logging.getLogger(__name__)


RETRY_ATTEMPTS = 5
RETRY_BASE_S = 1.0  # waits 1, 2, 4, 8 s between attempts, on top of s3fs's and botocore's own retries


def storage_options(url: str) -> dict[str, Any]:
    return {}


def _transient(exc: BaseException) -> bool:
    """A connection that failed or timed out, a throttle, or a 5xx: worth another try. A missing
    object, a denied one or bad credentials are not."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)):
            return False
        if isinstance(exc, (ConnectionError, TimeoutError)):
            return True
        try:
            from botocore import exceptions as be
        except ImportError:
            be = None
        if be is not None:
            if isinstance(exc, (be.ConnectionError, be.HTTPClientError)):
                return True
            if isinstance(exc, be.ClientError):
                meta = exc.response.get("ResponseMetadata", {})
                code = exc.response.get("Error", {}).get("Code", "")
                return meta.get("HTTPStatusCode", 0) >= 500 or code in ("SlowDown", "Throttling", "RequestTimeout")
        exc = exc.__cause__ or exc.__context__
    return False


class StorageError(InputError):
    """An S3 URL this process cannot use as configured: no credentials, refused ones, a missing bucket."""


# S3's error codes that say the setup is wrong, not the moment: (what it means, the fix)
_SETUP_CODES = {
    "NoSuchBucket": ("its bucket does not exist", "create the bucket, or fix the URL"),
    "InvalidAccessKeyId": ("the store does not know the access key", "check AWS_ACCESS_KEY_ID (and AWS_ENDPOINT_URL)"),
    "SignatureDoesNotMatch": ("the store refused the secret key", "check AWS_SECRET_ACCESS_KEY"),
    "AccessDenied": ("access was denied", "give the credentials read, write and list rights on the bucket"),
    "AllAccessDisabled": ("access to the bucket is disabled", "use another bucket"),
}


def setup_problem(url: str, exc: BaseException) -> StorageError | None:
    """A clear error for an S3 failure that no retry can mend (missing or refused credentials, a
    missing bucket), naming the URL and the fix; None for any other failure."""
    try:
        from botocore import exceptions as be
    except ImportError:
        return None
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, (be.NoCredentialsError, be.PartialCredentialsError)):
            return StorageError(f"{url}: no usable AWS credentials ({exc}); export AWS_ACCESS_KEY_ID and "
                                "AWS_SECRET_ACCESS_KEY (or AWS_PROFILE) in the environment that starts the run "
                                "(your shell, or the Prefect worker's), and AWS_ENDPOINT_URL for a non-AWS store")
        if isinstance(exc, be.ClientError):
            code = exc.response.get("Error", {}).get("Code", "")
            if code in _SETUP_CODES:
                meaning, fix = _SETUP_CODES[code]
                return StorageError(f"{url}: {meaning} ({code}); {fix}")
        exc = exc.__cause__ or exc.__context__
    return None


def _retrying(what: str, url: str, fn):
    """fn() for a remote URL, retried with backoff while its error is transient; a setup error
    (credentials, bucket) raises StorageError at once."""
    if not is_remote(url):
        return fn()
    for attempt in range(1, RETRY_ATTEMPTS + 1):
        try:
            return fn()
        except Exception as exc:
            if not _transient(exc):
                problem = setup_problem(url, exc)
                if problem is not None:
                    raise problem from None
                raise
            if attempt == RETRY_ATTEMPTS:
                raise OSError(f"{what} {url}: still failing after {RETRY_ATTEMPTS} attempts ({type(exc).__name__}: "
                              f"{exc}); check that the endpoint (AWS_ENDPOINT_URL) is reachable") from exc
            wait = RETRY_BASE_S * 2 ** (attempt - 1)
            log.warning("%s %s: transient error (%s: %s); retrying in %.0fs (attempt %d of %d)", what, url,
                        type(exc).__name__, exc, wait, attempt + 1, RETRY_ATTEMPTS)
            time.sleep(wait)


def probe(url: str) -> None:
    """Raise StorageError when a remote URL cannot be used as configured (no or refused credentials,
    a missing bucket); an empty prefix, written on first use, is fine."""
    if not is_remote(url):
        return
    fs, path = fs_for(url)
    try:
        _retrying("list", url, lambda: fs.ls(path, refresh=True))
    except FileNotFoundError:
        pass


def folder_problem(folder: str | Path) -> str | None:
    """Why `folder` could not be made (if missing) and written in, found without writing anything:
    the nearest path on the way to it that exists must be a folder this user may write in."""
    existing = Path(folder).expanduser().absolute()
    while not os.path.exists(existing) and existing != existing.parent:  # False too behind a folder it may not search
        existing = existing.parent
    if not existing.is_dir():
        return f"{existing} is a file, not a folder"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"this user may not write in {existing}"
    return None


def local_root_problem(root: str) -> StorageError | None:
    """Why a local artifact_root cannot hold a run's results (`folder_problem`), or None (also for a
    remote root: `probe` checks those)."""
    if is_remote(root):
        return None
    problem = folder_problem(fs_for(root)[1])
    if problem:
        return StorageError(f"artifact_root: {root!r} cannot hold results: {problem}; point artifact_root at a "
                            "folder you can write in (it is created if missing)")
    return None


def fs_for(url: str) -> tuple[fsspec.AbstractFileSystem, str]:
    fs, path = fsspec.core.url_to_fs(url, **storage_options(url))
    return fs, path


def is_remote(url: str) -> bool:
    return "://" in url and not url.startswith("file://")


def join(root: str, *parts: str) -> str:
    return "/".join([root.rstrip("/"), *(p.strip("/") for p in parts)])


def exists(url: str) -> bool:
    fs, path = fs_for(url)
    return _retrying("exists", url, lambda: fs.exists(path))


def write_bytes(url: str, data: bytes) -> None:
    fs, path = fs_for(url)
    if is_remote(url):
        _retrying("write", url, lambda: fs.pipe_file(path, data))
        return
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.")
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, target)


def write_text(url: str, text: str) -> None:
    write_bytes(url, text.encode())


def read_text(url: str) -> str:
    fs, path = fs_for(url)
    return _retrying("read", url, lambda: fs.cat_file(path)).decode()


def write_json(url: str, obj: Any) -> None:
    write_text(url, json.dumps(obj, indent=2, sort_keys=True))


def read_json(url: str) -> Any:
    return json.loads(read_text(url))


def write_jsonl(url: str, rows: list[dict[str, Any]]) -> str:
    data = "".join(json.dumps(r, sort_keys=True) + "\n" for r in rows).encode()
    write_bytes(url, data)
    return hashlib.sha256(data).hexdigest()


def read_jsonl(url: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in read_text(url).splitlines() if line.strip()]


def read_manifest(folder: str) -> dict[str, Any] | None:
    """The committed manifest of a stage folder, or None if the folder holds no result. A truncated
    or garbled manifest is no result either: logged, and the stage computes (or resumes) it again."""
    url = join(folder, MANIFEST)
    if not exists(url):
        return None
    try:
        manifest = read_json(url)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        log.warning("%s is unreadable (%s: %s): the folder is treated as uncommitted, and the stage resumes from "
                    "its checkpoints or computes it again", url, type(exc).__name__, exc)
        return None
    if not isinstance(manifest, dict) or "key" not in manifest:
        log.warning("%s is not a stage manifest (no 'key'): the folder is treated as uncommitted", url)
        return None
    return manifest


def commit_manifest(folder: str, manifest: dict[str, Any]) -> None:
    write_json(join(folder, MANIFEST), manifest)


def _skipped(rel: str, skip: tuple[str, ...]) -> bool:
    return any(rel == s or (s.endswith("/") and rel.startswith(s)) for s in skip)


def list_files(url: str | Path, skip: tuple[str, ...] = ()) -> dict[str, int]:
    """{relative path: size} of every file under a local folder or remote prefix, but `skip`
    (exact names, or prefixes ending in '/')."""
    url = str(url)
    if not is_remote(url):
        root = Path(fs_for(url)[1])
        found = {f.relative_to(root).as_posix(): f.stat().st_size for f in root.rglob("*") if f.is_file()} \
            if root.is_dir() else {}
    else:
        fs, path = fs_for(url)
        prefix = path.rstrip("/") + "/"
        try:
            objects = _retrying("list", url, lambda: fs.find(prefix, detail=True, refresh=True))
        except FileNotFoundError:
            objects = {}
        found = {name[len(prefix):]: int(info.get("size") or 0) for name, info in objects.items()}
    return {rel: size for rel, size in found.items() if not _skipped(rel, skip)}


UPLOAD_PART_BYTES = 16 << 20  # S3's parts are 5 MiB to 5 GiB; 10,000 parts at most (s3fs grows the part past 160 GB)
UPLOAD_PARTS_IN_FLIGHT = 2


def put_dir(local_dir: str | Path, url: str, skip: tuple[str, ...] = ()) -> None:
    """Copy a local folder's files to `url` (a local path or s3:// prefix), but `skip`."""
    local_dir = Path(local_dir)
    if not is_remote(url):
        dest = Path(fs_for(url)[1])
        if dest.resolve() == local_dir.resolve():
            return
        shutil.copytree(local_dir, dest, dirs_exist_ok=True,
                        ignore=lambda d, names: [n for n in names if _skipped(
                            (Path(d) / n).relative_to(local_dir).as_posix(), skip)])
        return
    fs, _ = fs_for(url)
    for f in sorted(local_dir.rglob("*")):
        rel = f.relative_to(local_dir).as_posix()
        if f.is_file() and not _skipped(rel, skip):
            dest = join(url, rel)
            # streamed from the file in parts (a multipart upload past 2 parts' size), never read whole:
            # at most UPLOAD_PARTS_IN_FLIGHT parts of UPLOAD_PART_BYTES in memory at once
            _retrying("upload", dest, lambda f=f, target=fs_for(dest)[1]: fs.put_file(
                str(f), target, chunksize=UPLOAD_PART_BYTES, max_concurrency=UPLOAD_PARTS_IN_FLIGHT))


def get_files(url: str, rels: list[str], local_dir: str | Path) -> None:
    """Copy the files `rels` (relative paths) under `url` into the local folder `local_dir`: put_dir's
    other way, each file retried as every store operation is."""
    fs, path = fs_for(url)
    for rel in sorted(rels):
        target = Path(local_dir) / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        _retrying("download", join(url, rel), lambda rel=rel, target=target: fs.get_file(
            f"{path.rstrip('/')}/{rel}", str(target)))


def copy_files(url: str, rels: list[str], dest: str) -> None:
    """Copy the files `rels` (relative paths) under `url` to the same paths under `dest`: within one
    store (S3 copies them itself, nothing passes through this machine) or between local folders."""
    if not is_remote(url) and not is_remote(dest):
        for rel in sorted(rels):
            target = Path(fs_for(dest)[1]) / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(Path(fs_for(url)[1]) / rel, target)
        return
    fs, path = fs_for(url)
    _, to = fs_for(dest)
    for rel in sorted(rels):
        _retrying("copy", join(url, rel), lambda rel=rel: fs.copy(f"{path.rstrip('/')}/{rel}", f"{to.rstrip('/')}/{rel}"))


def replace_dir(new: Path, dest: Path) -> None:
    """Put the local folder `new` where `dest` is: `dest` stays whole until a rename moves it aside."""
    old = dest.with_name(f".{dest.name}.replaced-{os.getpid()}")
    if dest.exists():
        os.replace(dest, old)
    try:
        os.replace(new, dest)
    except BaseException:
        if old.exists():
            os.replace(old, dest)
        raise
    shutil.rmtree(old, ignore_errors=True)


def posttrain_cache() -> Path:
    """This machine's cache folder ($POSTTRAIN_CACHE, default ~/.cache/posttrain): downloads, GGUF
    conversions, the scratch folders of stages on s3:// roots."""
    return Path(os.environ.get("POSTTRAIN_CACHE", Path.home() / ".cache" / "posttrain"))


def local_dir(url: str, cache_root: str | Path | None = None, version: str | None = None) -> Path:
    """A local folder holding `url`'s files: the folder itself, or a download of a remote one.

    Downloads are kept per (url, version): pass the result's version (its MLflow run) so a result
    recomputed at the same URL is downloaded again. One process downloads; the others wait for it."""
    if not is_remote(url):
        return Path(fs_for(url)[1])
    fs, path = fs_for(url)
    root = Path(cache_root) if cache_root else posttrain_cache()
    root.mkdir(parents=True, exist_ok=True)
    dest = root / hashlib.sha256(f"{url}@{version or ''}".encode()).hexdigest()[:16]
    return fill_once(dest, lambda tmp: _retrying("download", url, lambda: fs.get(path.rstrip("/") + "/", str(tmp),
                                                                                recursive=True)))


def filled(dest: Path) -> bool:
    """Whether `fill_once` has filled `dest` (whole)."""
    return (dest / ".complete").exists()


def fill_once(dest: Path, fill) -> Path:
    """`dest`, filled by `fill(tmp_folder)` the first time: one process fills (the others wait on a
    lock the OS releases if it dies), the folder appears whole or not at all, and `.complete` marks
    it; an incomplete earlier folder is replaced."""
    import fcntl

    if filled(dest):
        return dest
    with open(dest.parent / f".{dest.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or its process dies
        if not filled(dest):
            tmp = Path(tempfile.mkdtemp(dir=dest.parent, prefix=f".{dest.name}."))
            try:
                fill(tmp)
                (tmp / ".complete").touch()
                shutil.rmtree(dest, ignore_errors=True)  # an incomplete earlier folder
                os.replace(tmp, dest)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    return dest


def remove(url: str, keep: tuple[str, ...] = ()) -> None:
    """Remove a file or folder; with `keep` (relative paths, or prefixes ending in '/'), a folder's
    other files only."""
    fs, path = fs_for(url)
    if keep:
        for rel in list_files(url, skip=keep):
            _retrying("remove", join(url, rel), lambda rel=rel: fs.rm(f"{path.rstrip('/')}/{rel}"))
        return
    if exists(url):
        _retrying("remove", url, lambda: fs.rm(path, recursive=True))


def file_sha256(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
