"""What posttrain runs on each host of a several-machine launch (a DeepSpeed hostfile), over ssh.

    python -m trainer.hosts check                 # the preflight: a JSON request on stdin, a JSON answer
    python -m trainer.hosts --local_rank=I rank ID   # one rank, as DeepSpeed's launcher starts it
    python -m trainer.hosts clean ID              # stop what is left of launch ID on this host

`check` answers who this host is (its name, Python, posttrain's source version, addresses, cores) and,
given a launch, writes the launch's spec and environment into `$POSTTRAIN_CACHE/launches/<ID>/`
(0700; the environment, which may hold credentials, 0600): they travel over ssh's standard input,
never on a command line (which `ps` shows any user of the host, and DeepSpeed's runner logs).

`rank` is what DeepSpeed's per-node launcher starts for each rank: it sets the launch's environment,
starts `tasks.rank_main` with the launch's spec, and passes on the rank's output line by line,
prefixed `[rank R]` (pdsh adds the host's name), ending with one line that says how the rank ended
(`STATUS`): the supervisor reads every rank's ending from the output, since no host sees another's
disk, and a launcher's exit code alone misses a node (DeepSpeed#1722). It stops the rank when the
host that launched it is gone (ssh closed the output) and when it is itself stopped (SIGTERM, SIGINT),
and dies with it (SIGKILL): no rank outlives its launch.

`clean` stops every process of a launch (they carry POSTTRAIN_LAUNCH_ID in their environment) and
removes the launch's folder. Standard library only: a host's check must answer even where posttrain's
dependencies fail to import (trainer.procwatch and trainer.local_launch are standard library only too).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from trainer.local_launch import rank_threads
from trainer.procwatch import process_gone

LAUNCH_ID = "POSTTRAIN_LAUNCH_ID"
STATUS = "posttrain-rank-status"  # the last line of each rank: `posttrain-rank-status rank=R host=H ok|...`
ROOT = Path(__file__).resolve().parent.parent
GRACE_S = 5.0


def source_version() -> str:
    """Hash of posttrain's own source (trainer/ and tasks/, the C++ kernels and their header included):
    what the cache keys name as the code, and what every host of a launch must run."""
    h = hashlib.sha256()
    for pkg in ("trainer", "tasks"):
        for f in sorted(x for x in (ROOT / pkg).rglob("*") if x.suffix in (".py", ".cpp", ".h")):
            h.update(f.relative_to(ROOT).as_posix().encode())
            h.update(f.read_bytes())
    return h.hexdigest()[:12]


def cache_dir() -> Path:
    """This host's posttrain cache (as trainer.storage.posttrain_cache says, without importing fsspec)."""
    return Path(os.environ.get("POSTTRAIN_CACHE", Path.home() / ".cache" / "posttrain"))


def launch_dir(launch: str) -> Path:
    return cache_dir() / "launches" / launch


def addresses() -> dict[str, list[str]]:
    """IPv4 addresses by interface, from `ip -4 -o addr` (empty where iproute2 is missing)."""
    found: dict[str, list[str]] = {}
    try:
        out = subprocess.run(["ip", "-4", "-o", "addr", "show"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return found
    for line in out.splitlines():
        parts = line.split()
        if len(parts) > 3 and parts[2] == "inet":
            found.setdefault(parts[1], []).append(parts[3].split("/")[0])
    return found


def _launch_processes(launch: str) -> list[int]:
    """The processes on this host whose environment names `launch`."""
    mark = f"{LAUNCH_ID}={launch}".encode()
    pids = []
    for name in os.listdir("/proc"):
        if name.isdigit() and int(name) != os.getpid():
            try:
                with open(f"/proc/{name}/environ", "rb") as f:
                    if mark in f.read().split(b"\0"):
                        pids.append(int(name))
            except OSError:
                continue
    return pids


def check(request: dict) -> dict:
    """The preflight's answer. With a launch (`launch`, `spec`, `env`, `supervisor_host`), and only where
    this host runs the asker's source (a host that does not may not start the launch's ranks), the
    launch's files are written first: on a host other than the supervisor's, the ranks work in the
    launch's own folder here (the supervisor's work folder is a path on its own disk)."""
    answer = {"host": socket.gethostname(), "python": sys.version.split()[0], "executable": sys.executable,
              "version": source_version(), "addresses": addresses(), "cores": len(os.sched_getaffinity(0)),
              "cache": str(cache_dir())}
    # launches whose processes are all gone (a host that was cut off, a killed supervisor) leave their
    # folder behind, with its credentials: removed here, at this host's next launch
    launches = cache_dir() / "launches"
    if launches.is_dir():
        for old in launches.iterdir():
            if old.name != request.get("launch") and not _launch_processes(old.name):
                shutil.rmtree(old, ignore_errors=True)
    if request.get("launch") and request.get("version") == answer["version"]:
        folder = launch_dir(request["launch"])
        folder.mkdir(parents=True, exist_ok=True)
        folder.chmod(0o700)
        spec = dict(request["spec"])
        if request.get("supervisor_host") != answer["host"]:
            spec["work_dir"] = str(folder / "work")
        for name, obj in (("spec.json", spec), ("env.json", request.get("env", {}))):
            fd = os.open(folder / name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                json.dump(obj, f)
        answer["launch_dir"] = str(folder)
    return answer


# ---------------------------------------------------------------- one rank

def _set_pdeathsig() -> None:
    """In the rank's process (before exec): SIGKILL when this wrapper dies, however it dies."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _output_closed(fd: int) -> bool:
    """Whether the reader of `fd` (a pipe or socket: the ssh session's) is gone."""
    poller = select.poll()
    poller.register(fd, select.POLLERR | select.POLLHUP)
    try:
        return any(ev & (select.POLLERR | select.POLLHUP) for _, ev in poller.poll(0))
    except OSError:
        return True


def rank(launch: str, local_rank: int) -> int:
    folder = launch_dir(launch)
    env = dict(os.environ)
    env.update(json.loads((folder / "env.json").read_text()))
    env[LAUNCH_ID] = launch
    if "OMP_NUM_THREADS" not in env:  # this host's cores, shared by its ranks (as trainer.local_launch does)
        env["OMP_NUM_THREADS"] = str(rank_threads(int(env.get("LOCAL_SIZE", "1"))))
    global_rank = env.get("RANK", str(local_rank))
    host = socket.gethostname()
    prefix = f"[rank {global_rank}] "
    out = sys.stdout.buffer

    def say(text: str) -> None:
        try:
            out.write(f"{prefix}{text}\n".encode())
            out.flush()
        except OSError:
            pass  # the launch's host is gone: nobody to tell

    proc = subprocess.Popen([sys.executable, "-u", "-m", "tasks.rank_main", "--spec", str(folder / "spec.json"),
                             f"--local_rank={local_rank}"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, preexec_fn=_set_pdeathsig)
    lost = threading.Event()

    def stop(signum=None, frame=None) -> None:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(GRACE_S)
            except subprocess.TimeoutExpired:
                proc.kill()

    signal.signal(signal.SIGTERM, lambda s, f: stop())
    signal.signal(signal.SIGINT, lambda s, f: stop())

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            try:
                out.write(prefix.encode() + line)
                out.flush()
            except OSError:
                lost.set()

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    while proc.poll() is None:
        if lost.is_set() or _output_closed(1):
            # ssh closed the session: the supervisor's host stopped the launch, or was lost
            stop()
            break
        time.sleep(0.5)
    proc.wait()
    reader.join(timeout=10)
    code = proc.returncode
    if code == 0:
        say(f"{STATUS} rank={global_rank} host={host} ok")
        return 0
    error = _rank_error(folder, local_rank)
    how = f"killed by signal {-code} ({signal.Signals(-code).name})" if code < 0 else f"exited with code {code}"
    say(f"{STATUS} rank={global_rank} host={host} {how}" + (f": {error}" if error else ""))
    if code < 0:  # as the rank ended, so that DeepSpeed's launcher reports the signal
        if -code != signal.SIGKILL:
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    return code


def _rank_error(folder: Path, local_rank: int) -> str | None:
    """The exception a rank recorded (tasks/rank_main.py writes it into its work folder's rank_status/)."""
    try:
        spec = json.loads((folder / "spec.json").read_text())
        text = (Path(spec["work_dir"]) / "rank_status" / f"rank{local_rank}.error").read_text().strip()
    except (OSError, ValueError, KeyError):
        return None
    return text.splitlines()[-1][:500] if text else None


def clean(launch: str) -> list[int]:
    """Stop every process of `launch` on this host (SIGTERM, SIGKILL after GRACE_S) and remove its folder;
    the processes that were stopped."""
    pids = _launch_processes(launch)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + (GRACE_S if sig == signal.SIGTERM else 0)
        while time.monotonic() < deadline and any(not process_gone(p) for p in pids):
            time.sleep(0.1)
    shutil.rmtree(launch_dir(launch), ignore_errors=True)
    return pids


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainer.hosts", description=__doc__.split("\n\n")[0])
    parser.add_argument("--local_rank", type=int, default=0, help="set by DeepSpeed's launcher")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("check", help="answer the preflight (JSON on stdin and stdout)")
    r = sub.add_parser("rank", help="run one rank of a launch")
    r.add_argument("launch")
    c = sub.add_parser("clean", help="stop what is left of a launch")
    c.add_argument("launch")
    args = parser.parse_args(argv)
    if args.command == "check":
        print(json.dumps(check(json.loads(sys.stdin.read() or "{}"))), flush=True)
        return 0
    if args.command == "rank":
        return rank(args.launch, args.local_rank)
    stopped = clean(args.launch)
    print(json.dumps({"host": socket.gethostname(), "stopped": stopped}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
