"""Running code that a policy wrote, which no one has read.

`run(program, entry, inputs, limits)` runs `program` (Python source) in a process of its own,
calls `entry(*args)` for each element of `inputs`, and returns what came back for each, as JSON
values, with why it stopped. The expected values never enter the sandbox: the caller compares
(`same`), so a program that patches `assert`, exits 0 early or prints "passed" has gained nothing;
the only way to pass is to return the right values.

Isolation (trainer/problems/_sandbox_init.py does it): as root, new mount, network, PID, IPC and
UTS namespaces; a read-only root that holds the system's libraries and the interpreter's standard
library only (not /etc, not /root or /home, not the project, not site-packages); an empty tmpfs
working folder of `disk_kb`; a user ID of its own (100000 + the launcher's PID) that owns no file
and can signal no other process; no capabilities, no setuid, no new privileges. Without root, the
same inside a user namespace where the kernel allows one, else (`isolation == "none"`) the resource
limits and an empty folder only — then the program can read what the user running posttrain can,
and reach the network; `isolation()` says which, and the code task logs it once.

Limits: CPU seconds, address space, processes (per sandbox user), open files, file size, the
folder's size, the bytes of output kept and read (past `output_bytes` it is killed), and a wall
clock that kills the whole namespace (its first process dies, and the kernel kills the rest).
"""

from __future__ import annotations

import json
import math
import os
import selectors
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

INIT = Path(__file__).with_name("_sandbox_init.py")

# what an interpreter needs from the system; everything else stays outside the sandbox's root
SYSTEM = ("/usr", "/lib", "/lib32", "/lib64", "/libx32", "/bin")

HARNESS = r"""
import json, os, sys
req = json.loads(sys.stdin.read())
sys.stdin.close()
out = os.fdopen(req["result_fd"], "w", closefd=False)
encoder = json.JSONEncoder()
def say(obj):
    # streamed, so that a huge value meets the byte cap as it is written, not the memory limit as
    # it is built; a line cut by an error is no JSON and is skipped, the error's line follows it
    try:
        for chunk in encoder.iterencode(obj):
            out.write(chunk)
    finally:
        out.write("\n")
        out.flush()
def why(e):
    return (type(e).__name__ + ": " + str(e))[:300]
ns = {"__name__": "solution", "__builtins__": __builtins__}
try:
    exec(compile(req["program"], "<program>", "exec"), ns)
    fn = ns[req["entry"]]
except BaseException as e:
    say({"error": why(e)})
    os._exit(0)
for i, args in enumerate(req["inputs"]):
    try:
        say({"i": i, "value": fn(*args)})
    except BaseException as e:
        say({"i": i, "error": why(e)})
"""


@dataclass(frozen=True)
class Limits:
    wall_s: float = 10.0  # the whole execution, every test included
    cpu_s: int = 5
    memory_mb: int = 256  # address space
    processes: int = 16
    open_files: int = 32
    output_bytes: int = 64 << 10  # stdout + stderr + results; past it the sandbox is killed
    disk_kb: int = 4096  # the working folder (a tmpfs)
    inodes: int = 256

    def rlimits(self) -> dict[str, list[int]]:
        mem = self.memory_mb << 20
        return {"RLIMIT_CPU": [self.cpu_s, self.cpu_s + 1], "RLIMIT_AS": [mem, mem],
                "RLIMIT_NPROC": [self.processes, self.processes], "RLIMIT_NOFILE": [self.open_files] * 2,
                "RLIMIT_FSIZE": [self.disk_kb << 10] * 2, "RLIMIT_CORE": [0, 0]}


@dataclass
class Execution:
    """One run: a result (a JSON value) or an error per input reached, and why it ended."""

    values: list = field(default_factory=list)  # per input: {"value": v} or {"error": "..."}; missing = never reached
    ended: str = "exit"  # exit | wall | cpu | memory | output | signal | setup | load
    detail: str = ""  # the program's load error, the signal, the setup failure
    exit_code: int | None = None
    stdout: str = ""  # the first bytes only
    stderr: str = ""
    wall_s: float = 0.0
    cpu_s: float | None = None  # the program's first process (where the launcher saw it end)
    isolation: str = ""  # root | userns | none
    user: int | None = None  # the user ID it ran as, with root isolation (100000 + the launcher's PID)
    folder: str = ""  # this machine's folder for it (used without namespaces; removed at its end)

    def passed(self, expected: list) -> list[bool]:
        """Each input's verdict against the expected values (never shown to the program)."""
        return [i < len(self.values) and "value" in self.values[i] and same(self.values[i]["value"], want)
                for i, want in enumerate(expected)]


def same(got, want, rel: float = 1e-6) -> bool:
    """JSON values equal, with a float tolerance; True is not 1 and "1" is not 1."""
    if isinstance(want, bool) or isinstance(got, bool):
        return type(got) is type(want) and got == want
    if isinstance(want, (int, float)) and isinstance(got, (int, float)):
        if isinstance(want, int) and isinstance(got, int):
            return got == want
        return math.isclose(got, want, rel_tol=rel, abs_tol=rel)
    if isinstance(want, list):
        return isinstance(got, list) and len(got) == len(want) and all(same(g, w, rel) for g, w in zip(got, want))
    if isinstance(want, dict):
        return isinstance(got, dict) and got.keys() == want.keys() and all(same(got[k], want[k], rel) for k in want)
    return type(got) is type(want) and got == want


def _interpreter() -> tuple[str, str, list[str]]:
    """The real interpreter under the project's venv, its prefix (bound into the sandbox), and its
    site-packages folders (hidden there)."""
    prefix = os.path.realpath(sys.base_prefix)
    exe = os.path.realpath(sys.executable)
    if not exe.startswith(prefix + os.sep):
        v = f"{sys.version_info.major}.{sys.version_info.minor}"
        exe = next((p for p in (f"{prefix}/bin/python{v}", f"{prefix}/bin/python3") if os.path.exists(p)), exe)
    paths = sysconfig.get_paths(vars={"base": prefix, "platbase": prefix})
    hide = sorted({os.path.realpath(paths[k]) for k in ("purelib", "platlib")})
    return exe, prefix, hide


def run(program: str, entry: str, inputs: list[list], limits: Limits = Limits()) -> Execution:
    """Run `program` in a sandbox and call `entry(*args)` for each of `inputs`."""
    exe, prefix, hide = _interpreter()
    result_r, result_w = os.pipe()
    mode_r, mode_w = os.pipe()
    folder = tempfile.mkdtemp(prefix="posttrain-sandbox-")  # used only where no namespace could be had
    spec = {"python": exe, "prefix": prefix, "hide": hide, "system": SYSTEM, "harness": HARNESS,
            "rlimits": limits.rlimits(), "disk_kb": limits.disk_kb, "inodes": limits.inodes,
            "result_fd": result_w, "mode_fd": mode_w, "folder": folder}
    request = json.dumps({"program": program, "entry": entry, "inputs": inputs, "result_fd": result_w}).encode()
    out = Execution(folder=folder)
    t0 = time.monotonic()
    proc = subprocess.Popen([exe, "-I", "-S", "-B", str(INIT), json.dumps(spec)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, pass_fds=(result_w, mode_w),
                            start_new_session=True, env={})
    os.close(result_w)
    os.close(mode_w)
    try:
        out.isolation = os.read(mode_r, 16).decode().strip() or "unknown"
        out.user = 100000 + proc.pid if out.isolation == "root" else None
        kept = _collect(proc, request, result_r, limits, out, t0)
    finally:
        if proc.poll() is None:
            proc.kill()  # the launcher: its child (the namespace's first process) dies with it
        proc.wait()
        os.close(result_r)
        os.set_blocking(mode_r, False)
        try:
            tail = os.read(mode_r, 64).decode()
        except BlockingIOError:
            tail = ""
        os.close(mode_r)
        cpu = [float(x.split()[1]) for x in tail.splitlines() if x.startswith("cpu ")]
        out.cpu_s = cpu[0] if cpu else None
        shutil.rmtree(folder, ignore_errors=True)
    out.wall_s = time.monotonic() - t0
    out.exit_code = proc.returncode
    out.stdout, out.stderr = (kept[k][: limits.output_bytes].decode(errors="replace") for k in ("stdout", "stderr"))
    _parse(kept["results"], out, len(inputs))
    if out.ended == "exit":
        out.ended, out.detail = _why(proc.returncode, out, limits)
    return out


def _collect(proc: subprocess.Popen, request: bytes, result_r: int, limits: Limits, out: Execution,
             t0: float) -> dict[str, bytes]:
    """Feed the request, read the three streams up to the byte cap, kill at the wall clock."""
    streams = {proc.stdout.fileno(): "stdout", proc.stderr.fileno(): "stderr", result_r: "results"}
    kept = {name: bytearray() for name in streams.values()}
    total = 0
    sel = selectors.DefaultSelector()
    for fd in streams:
        os.set_blocking(fd, False)
        sel.register(fd, selectors.EVENT_READ)
    try:
        proc.stdin.write(request)
        proc.stdin.close()
    except BrokenPipeError:
        pass  # it died before reading: the exit code says why
    while sel.get_map():
        left = limits.wall_s - (time.monotonic() - t0)
        if left <= 0:
            out.ended = "wall"
            break
        for key, _ in sel.select(timeout=min(left, 1.0)):
            chunk = os.read(key.fd, 65536)
            if not chunk:
                sel.unregister(key.fd)
                continue
            total += len(chunk)
            buf = kept[streams[key.fd]]
            if len(buf) < limits.output_bytes:
                buf += chunk[: limits.output_bytes - len(buf)]
        if total > limits.output_bytes:
            out.ended = "output"
            break
    sel.close()
    if out.ended != "exit":
        proc.kill()
    else:
        try:
            proc.wait(timeout=max(0.1, limits.wall_s - (time.monotonic() - t0)))
        except subprocess.TimeoutExpired:  # its streams closed, it did not end: still the wall clock
            out.ended = "wall"
            proc.kill()
    return {k: bytes(v) for k, v in kept.items()}


def _parse(results: bytes, out: Execution, n: int) -> None:
    for line in results.decode(errors="replace").splitlines():
        try:
            msg = json.loads(line)
        except ValueError:
            continue  # a line cut at the byte cap, or one the program wrote itself: not a result
        if not isinstance(msg, dict):
            continue
        if "i" not in msg and "error" in msg:
            out.ended, out.detail = "load", str(msg["error"])
            continue
        i = msg.get("i")
        if isinstance(i, int) and i == len(out.values) and i < n:  # in order, once each
            out.values.append({"value": msg["value"]} if "value" in msg else {"error": str(msg.get("error"))})


def _why(code: int, out: Execution, limits: Limits) -> tuple[str, str]:
    if out.ended == "load":
        return "load", out.detail
    if code == 96:
        return "setup", out.stderr.strip()[-300:]
    if code > 128:
        sig = code - 128
        if sig == signal.SIGXCPU or sig == signal.SIGKILL and (out.cpu_s or 0) >= limits.cpu_s:
            return "cpu", f"{limits.cpu_s} s of CPU"
        name = signal.Signals(sig).name if sig in {s.value for s in signal.Signals} else str(sig)
        return "signal", name
    if "MemoryError" in out.stderr or any("MemoryError" in v.get("error", "") for v in out.values):
        return "memory", f"{limits.memory_mb} MB of address space"
    return "exit", f"exit code {code}"


def isolation() -> str:
    """Which isolation this machine gives a sandbox (root | userns | none), by running one."""
    return run("def f():\n    return 1\n", "f", [[]], Limits(wall_s=30)).isolation
