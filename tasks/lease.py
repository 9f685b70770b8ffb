"""One computation per stage folder: a run that needs a result another run is computing waits for
it, then takes the cache hit; if that run died, the waiter takes over from its checkpoints.

Local roots: an exclusive `flock` on `<root>/.locks/<stage>/<key>.lock`. The kernel drops it the
moment its holder dies (SIGKILL and OOM kills included), so there is no expiry to tune and no
stale lock to clean up. (flock needs a filesystem that supports it: local disks do, and so does
NFSv4; a plain network mount without lock support is not a safe shared root.)

s3:// roots: S3 has no locks, so a lease object `<root>/.leases/<stage>/<key>.json` is taken with a
conditional write (If-None-Match: *, only one creator wins), renewed by its holder every third of
its time to live, and taken over once it has expired with another conditional write (If-Match on
the expired lease's ETag, only one taker wins). A holder that could not renew in time (paused,
cut off) finds the lease no longer its own at its next checkpoint or at commit, whichever comes
first, and stops there (trainer/checkpoint.py `guarded`; launched ranks check the same lease with
its token). Each holder works in a scratch folder of its own, so a paused holder and its taker never
write into one folder. Expiry rather than a lock is the only choice on S3; the time to live
(POSTTRAIN_LEASE_TTL_S, 60 s) bounds how long a dead holder delays the waiters.

On a local root the stage's folder is the work folder, so the ranks a holder launches take a shared
lock on a local `ranks` file, and a taker waits for it exclusively: a dead holder's ranks (which
exit within seconds, see tasks/rank_main.py) never write into a folder that a taker has started on.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import threading
import time
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

from trainer import storage

POLL_S = 0.5
SAY_EVERY_S = 30.0


class LeaseLost(RuntimeError):
    """This run's lease on a stage folder expired and another run took it over; it must not commit."""


def ttl_s() -> float:
    return float(os.environ.get("POSTTRAIN_LEASE_TTL_S", "60"))


def _holder(extra: dict | None = None) -> dict:
    return {"pid": os.getpid(), "host": socket.gethostname(), "since": time.time(), **(extra or {})}


def _describe(holder: dict | None) -> str:
    if not holder:
        return "another run"
    since = time.strftime("%H:%M:%S", time.localtime(holder.get("since", 0)))
    run = f", flow run {holder['flow_run_id']}" if holder.get("flow_run_id") else ""
    return f"pid {holder.get('pid')} on {holder.get('host')}{run}, since {since}"


def _flock(path: Path, mode: int, say: Callable[[str], None] | None, what: Callable[[], str]) -> int:
    """Open `path` and take `mode` (LOCK_EX or LOCK_SH) on it, waiting as long as it takes; `say`
    what it waits for at once and then every SAY_EVERY_S."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    last = None
    while True:
        try:
            fcntl.flock(fd, mode | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            pass
        if say is not None and (last is None or time.monotonic() - last >= SAY_EVERY_S):
            say(what())
            last = time.monotonic()
        time.sleep(POLL_S)


def _read_holder(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text() or "null")
    except (OSError, json.JSONDecodeError):
        return None


@contextmanager
def _local(lock: Path, info: dict, say: Callable[[str], None]) -> Iterator[None]:
    meta = lock.with_suffix(".holder")
    fd = _flock(lock, fcntl.LOCK_EX, say, lambda: f"waiting: {_describe(_read_holder(meta))} is computing it")
    try:
        storage.write_json(str(meta), _holder(info))
        yield
    finally:
        meta.unlink(missing_ok=True)
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


class _S3Lease:
    """The lease object of one holder, identified by its token. The holder's process renews it; the
    ranks it launches check it (and so renew it) before each checkpoint with the same token."""

    def __init__(self, url: str, info: dict, say: Callable[[str], None], token: str | None = None) -> None:
        self.url, self.info, self.say = url, info, say
        self.token = token or uuid.uuid4().hex
        self.previous: dict | None = None  # the expired lease's holder, when this one took it over
        self.lost = threading.Event()
        self._stop = threading.Event()
        self.fs, self.path = storage.fs_for(url)

    def _put(self, body: dict, **condition) -> bool:
        data = json.dumps({**body, "token": self.token, "expires": time.time() + ttl_s()}).encode()
        try:
            storage._retrying("lease", self.url, lambda: self.fs.pipe_file(self.path, data, **condition))
        except (FileExistsError, OSError) as exc:
            if isinstance(exc, FileExistsError) or "Precondition" in str(exc) or getattr(exc, "errno", None) == 22:
                return False  # another process wrote it first
            raise
        return True

    def _current(self) -> tuple[dict | None, str | None]:
        try:
            info = self.fs.info(self.path, refresh=True)
            self.fs.invalidate_cache(self.path)
            return json.loads(self.fs.cat_file(self.path)), info.get("ETag")
        except FileNotFoundError:
            return None, None
        except json.JSONDecodeError:
            return {"expires": 0}, self.fs.info(self.path).get("ETag")

    def acquire(self) -> None:
        t0 = last = time.monotonic()
        said = False
        while True:
            if self._put(_holder(self.info), mode="create"):
                return
            held, etag = self._current()
            if held is None:
                continue  # released meanwhile: try to create it again
            if held.get("expires", 0) < time.time() and etag and self._put(_holder(self.info), IfMatch=etag):
                self.previous = held
                self.say(f"took over an expired lease from {_describe(held)}")
                return
            if not said or time.monotonic() - last >= SAY_EVERY_S:
                self.say(f"waiting: {_describe(held)} is computing it (lease until "
                         f"{time.strftime('%H:%M:%S', time.localtime(held.get('expires', 0)))})")
                said, last = True, time.monotonic()
            time.sleep(max(POLL_S, min(2.0, (time.monotonic() - t0) / 10)))

    def check(self) -> None:
        """Renew the lease if it is still this holder's (even if it expired meanwhile, as long as no one
        took it over); raise LeaseLost if not. A conditional write on the ETag just read: a takeover
        between the read and the write makes it fail, and the next read sees the taker's token."""
        for _ in range(20):  # another process of this holder (a rank) renewing at the same moment
            held, etag = self._current()
            if self.lost.is_set() or held is None or held.get("token") != self.token:
                self.lost.set()
                taker = f" ({_describe(held)})" if held else ""
                raise LeaseLost(f"the lease {self.url} expired and another run took it over{taker}: this run could "
                                f"not renew it within POSTTRAIN_LEASE_TTL_S={ttl_s():g}s (paused, or cut off from "
                                f"S3), so it stops here and saves or commits nothing more")
            if etag and self._put({k: v for k, v in held.items() if k not in ("token", "expires")}, IfMatch=etag):
                return
        raise LeaseLost(f"the lease {self.url} could not be renewed: it kept changing under this run")

    def renew_forever(self) -> None:
        while not self._stop.wait(ttl_s() / 3):
            try:
                self.check()
            except LeaseLost:
                return
            except Exception as exc:  # noqa: BLE001 - S3 unreachable past the retries: try again next time
                self.say(f"could not renew the lease ({type(exc).__name__}: {exc}); trying again")

    def release(self) -> None:
        self._stop.set()
        held, _ = self._current()
        if held is not None and held.get("token") == self.token:
            storage.remove(self.url)


class StageLease:
    """Held while one run computes (or recomputes) a stage folder; `check()` before each save and
    before committing. `token` names this holder (its scratch folder on an s3:// root)."""

    def __init__(self, s3: _S3Lease | None, ranks_lock: Path | None) -> None:
        self._s3, self.ranks_lock = s3, ranks_lock
        self.token = s3.token if s3 is not None else None
        self.previous = s3.previous if s3 is not None else None

    def check(self) -> None:
        if self._s3 is not None:
            self._s3.check()

    def for_ranks(self) -> dict | None:
        """What a launched rank needs to check this lease itself (`checker`)."""
        return {"url": self._s3.url, "token": self._s3.token} if self._s3 is not None else None


def checker(spec: dict) -> Callable[[], None]:
    """A launched rank's check of its holder's lease (the `for_ranks()` of its task's StageLease)."""
    return _S3Lease(spec["url"], {}, lambda _msg: None, token=spec["token"]).check


def lock_paths(folder: str) -> tuple[str, Path | None]:
    """The lease (a local lock file, or an s3:// lease object) and the local ranks lock of a folder
    (None for s3://, whose holders work in scratch folders of their own)."""
    root, stage, key = folder.rstrip("/").rsplit("/", 2)
    if storage.is_remote(folder):
        return storage.join(root, ".leases", stage, f"{key}.json"), None
    lock = Path(storage.fs_for(root)[1]) / ".locks" / stage / f"{key}.lock"
    return str(lock), lock.with_suffix(".ranks")


@contextmanager
def hold(folder: str, say: Callable[[str], None], info: dict | None = None) -> Iterator[StageLease]:
    """Wait until this process alone may write `folder`, and keep it so until the block ends."""
    lease_path, ranks = lock_paths(folder)
    info = info or {}
    if storage.is_remote(folder):
        s3 = _S3Lease(lease_path, info, say)
        s3.acquire()
        renewer = threading.Thread(target=s3.renew_forever, name="lease-renewer", daemon=True)
        renewer.start()
        try:
            yield StageLease(s3, None)  # its ranks write into its own scratch folder: nothing to wait for
        finally:
            s3.release()
        return
    with _local(Path(lease_path), info, say):
        # an earlier holder's ranks may still be running for a few seconds after it died, writing
        # into the folder this run is about to use
        fd = _flock(ranks, fcntl.LOCK_EX, say, lambda: "waiting for the ranks of the run that held it to exit")
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
        yield StageLease(None, ranks)


def hold_ranks_lock(path: str | Path) -> int:
    """A launched rank's shared hold on its stage's ranks lock, kept until the process exits."""
    return _flock(Path(path), fcntl.LOCK_SH, None, str)
