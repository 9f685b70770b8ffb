"""PID 1 of one simulated host of tests/cluster.py: its mounts, hostname and sshd, then it reaps.

    ip netns exec NS unshare --mount --uts --pid --fork --mount-proc --propagation private \\
        python tests/cluster_host.py '<json spec>'

Runs in the host's new mount, UTS and PID namespaces (its network namespace is the caller's). Standard
library only. The spec: `hostname`; `binds`, [source, target, "dir" | "file"] in order, every source
opened before the first mount, so that a target laid over a source's path (a private /tmp over a
cluster folder under /tmp) hides nothing still to be bound; `tmpfs`, targets that get a fresh tmpfs;
`sshd`, the server's command line; `address`, where it listens; `watch_fd`, the read end of a pipe
whose writer is the process that built the cluster.

It prints `ready` once sshd accepts connections. It exits when the watched pipe closes (its builder
ended, however it ended), on SIGTERM, or when sshd exits; the kernel then kills every process left in
the host's PID namespace: nothing a host ran outlives it.
"""

import ctypes
import json
import os
import select
import signal
import socket
import subprocess
import sys
import time

MS_BIND = 0x1000
MS_REC = 0x4000


def _mount(source: str, target: str, fstype: str | None = None, flags: int = 0, data: str | None = None) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    enc = lambda s: s.encode() if s is not None else None  # noqa: E731
    if libc.mount(enc(source), enc(target), enc(fstype), flags, enc(data)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {source} on {target}: {os.strerror(err)}")


def _listening(address: str, port: int = 22) -> bool:
    try:
        with socket.create_connection((address, port), timeout=0.5):
            return True
    except OSError:
        return False


def main() -> int:
    spec = json.loads(sys.argv[1])
    socket.sethostname(spec["hostname"])
    opened = [(os.open(src, os.O_PATH), dst, kind) for src, dst, kind in spec["binds"]]
    for fd, dst, kind in opened:
        if kind == "dir":
            os.makedirs(dst, exist_ok=True)
        elif not os.path.exists(dst):
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            open(dst, "a").close()
        # the magic link of an O_PATH descriptor names the source as it was when opened
        _mount(f"/proc/self/fd/{fd}", dst, None, MS_BIND | MS_REC)
        os.close(fd)
    for target in spec.get("tmpfs", []):
        os.makedirs(target, exist_ok=True)
        _mount("tmpfs", target, "tmpfs", 0, "mode=1777")
    os.makedirs("/run/sshd", mode=0o755, exist_ok=True)  # sshd's privilege separation folder
    stop = {"now": False}

    def on_term(signum, frame):
        stop["now"] = True

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    sshd = subprocess.Popen(spec["sshd"], stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while not _listening(spec["address"]):
        if sshd.poll() is not None or time.monotonic() > deadline:
            print(f"sshd did not start (exit code {sshd.poll()})", flush=True)
            return 1
        time.sleep(0.05)
    print("ready", flush=True)
    watch = spec["watch_fd"]
    while not stop["now"]:
        try:
            readable, _, _ = select.select([watch], [], [], 0.5)
        except InterruptedError:
            continue
        if readable and not os.read(watch, 64):
            break  # the builder is gone
        while True:  # reap whatever ended: orphans of this host come to PID 1
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                pid = 0
            if pid == 0:
                break
        if sshd.poll() is not None:
            print(f"sshd exited with code {sshd.returncode}", flush=True)
            break
    return 0


if __name__ == "__main__":
    sys.exit(main())
