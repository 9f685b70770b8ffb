"""Run a training stage's ranks under a launcher and supervise them.

The stage's task writes a spec (config, input manifests, MLflow run) into the work folder, then
starts `python -m trainer.local_launch --nprocs N ... -- python -m tasks.rank_main --spec <file>`
(ranks on this machine) or `python -m deepspeed.launcher.runner --hostfile ... --module
tasks.rank_main --spec <file>` (several machines) in a process group of its own. The supervisor
streams the launcher's output line by line into the run's log, kills the whole group on timeout,
cancellation or any error in the caller (SIGTERM, then SIGKILL after a grace period), and turns a
rank's crash into `LaunchError` naming the failed rank and its last lines (where the first rank to
fail raised the user's error, an InputError, that error's message alone, as on one rank). Rank 0 writes
`launch_result.json`; only a run that exits 0 with that file is a success.

`plan()` is also what `posttrain ... --dry-run` prints: the exact command lines, without running.
"""

from __future__ import annotations

import collections
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from trainer import storage
from trainer.config import DeepSpeedConfig
from trainer.engine import RENDEZVOUS, free_port, rendezvous_file
from trainer.errors import InputError

SPEC = "launch_spec.json"
RESULT = "launch_result.json"
GRACE_S = 10.0
# The one-rank group's settings that a parent process may hold: the ranks get the launcher's.
_STRIP_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
              "POSTTRAIN_ONE_RANK_GROUP_PID", RENDEZVOUS)


class LaunchError(RuntimeError):
    """The launched ranks failed, timed out or were cancelled; the message says which and why."""


@dataclass
class LaunchPlan:
    stage: str
    command: list[str]
    world_size: int
    ranks_per_node: int
    nodes: int
    hostfile: str | None
    env: dict[str, str] = field(default_factory=dict)

    def describe(self) -> str:
        if self.hostfile:
            return (f"{self.stage}: DeepSpeed launcher, {self.world_size} ranks ({self.ranks_per_node} per node on "
                    f"{self.nodes} nodes from {self.hostfile})\n  $ {shlex.join(self.command)}")
        return (f"{self.stage}: {self.world_size} DeepSpeed ranks on this machine (trainer.local_launch)\n"
                f"  $ {shlex.join(self.command)}")


def plan(stage: str, ds: DeepSpeedConfig, spec_path: str | Path, port: int | None = None) -> LaunchPlan:
    """The launcher command for `stage`'s ranks; checks the hostfile exists. Ranks on this machine
    alone are started by trainer.local_launch (DeepSpeed's launcher's environment, without its two
    processes that import DeepSpeed first); several machines go through DeepSpeed's runner."""
    if ds.hostfile is not None and not Path(ds.hostfile).is_file():
        raise InputError(f"{stage}.deepspeed.hostfile={ds.hostfile!r} does not exist; point it at a DeepSpeed "
                         "hostfile with one 'hostname slots=N' line per machine")
    port = port or ds.master_port or free_port()
    module = ["tasks.rank_main", "--spec", str(spec_path)]
    if ds.hostfile:
        cmd = [sys.executable, "-u", "-m", "deepspeed.launcher.runner", "--hostfile", ds.hostfile,
               "--num_nodes", str(ds.nodes), "--num_gpus", str(ds.ranks_per_node), "--master_port", str(port),
               "--module", *module]
        return LaunchPlan(stage, cmd, ds.world_size, ds.ranks_per_node, ds.nodes, ds.hostfile, {})
    cmd = [sys.executable, "-u", "-m", "trainer.local_launch", "--nprocs", str(ds.ranks_per_node),
           "--master_addr", "127.0.0.1", "--master_port", str(port), "--", sys.executable, "-u", "-m", *module]
    # ranks on this machine alone meet through a file and gloo over loopback (trainer.engine)
    return LaunchPlan(stage, cmd, ds.world_size, ds.ranks_per_node, ds.nodes, None, {RENDEZVOUS: rendezvous_file()})


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGTERM the launcher's process group (the launcher passes it on to the ranks), then SIGKILL."""
    if proc.poll() is not None:
        try:  # the launcher is gone; make sure no rank outlived it
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        proc.wait(timeout=GRACE_S)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


_EXIT_CODE = re.compile(r"exits with return code = (-?\d+)")
_SPAWNED = re.compile(r"process (\d+) spawned with command: .*--local_rank=(\d+)")
_FAILED_FIRST = re.compile(r"local rank (\d+) \(pid \d+\) failed first")  # trainer.local_launch says which


STATUS_DIR = "rank_status"


def rank_status_path(work_dir: str | Path, local_rank: int, outcome: str) -> Path:
    """Where a rank records how it ended: `ok`, or `error` (with the exception's text)."""
    return Path(work_dir) / STATUS_DIR / f"rank{local_rank}.{outcome}"


class _RankWatch:
    """Which rank failed and how. The launcher reports one return code and kills the rest, so
    each rank records its own ending (ok, or error with its exception); a spawned rank that
    recorded neither was killed from outside (a signal: the OOM killer, `kill -9`)."""

    def __init__(self, work_dir: Path) -> None:
        self.work_dir = work_dir
        self.pids: dict[int, int] = {}  # local rank -> pid
        self.dead_at: dict[int, float] = {}  # local rank -> when the supervisor saw it gone
        self.cleanup_at: float | None = None  # when the launcher began killing the other ranks
        self.failed_first: int | None = None  # the local rank trainer.local_launch names as the first to fail

    def saw(self, line: str) -> None:
        if m := _SPAWNED.search(line):
            self.pids[int(m.group(2))] = int(m.group(1))
        elif m := _FAILED_FIRST.search(line):
            self.failed_first = int(m.group(1))
            self.dead_at.setdefault(self.failed_first, time.monotonic())
        elif "Killing subprocess" in line and self.cleanup_at is None:
            self.cleanup_at = time.monotonic()

    def poll(self) -> None:
        import psutil

        for local_rank, pid in list(self.pids.items()):
            if local_rank in self.dead_at:
                continue
            try:
                gone = psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
            except psutil.NoSuchProcess:
                gone = True
            if gone:
                self.dead_at[local_rank] = time.monotonic()

    def _first(self, local_rank: int) -> bool:
        """The rank the launcher names as the first to fail; without that word (DeepSpeed's own
        launcher), one that died before the launcher started its clean-up. (Timing alone misled: this
        process can see a rank the launcher stopped gone before it reads the launcher's line saying so.)"""
        if self.failed_first is not None:
            return local_rank == self.failed_first
        at = self.dead_at.get(local_rank)
        return at is not None and (self.cleanup_at is None or at < self.cleanup_at)

    def _endings(self) -> tuple[list[tuple[int, int]], list[tuple[float, int, int, str]]]:
        """The ranks that did not end well: killed (local rank, pid), and raised (when, local rank,
        pid, the exception's text)."""
        killed, errors = [], []
        for local_rank, pid in sorted(self.pids.items()):
            if rank_status_path(self.work_dir, local_rank, "ok").exists():
                continue
            err = rank_status_path(self.work_dir, local_rank, "error")
            if err.exists():
                errors.append((err.stat().st_mtime, local_rank, pid, err.read_text().strip()))
            else:
                killed.append((local_rank, pid))
        return killed, errors

    def input_error(self) -> str | None:
        """The message of the user's error (an InputError: a reward that raised, a bad row) where the
        first rank to fail raised one; the others then fail on the collective it left."""
        killed, errors = self._endings()
        if not errors or any(self._first(local_rank) for local_rank, _ in killed):
            return None
        note = rank_status_path(self.work_dir, min(errors)[1], "input")
        return note.read_text() if note.exists() else None

    def describe(self, lines: list[str]) -> str:
        codes = [int(m.group(1)) for line in lines if (m := _EXIT_CODE.search(line))]
        code = codes[-1] if codes else None
        killed, errors = self._endings()
        how = f"signal {-code}" if code is not None and code < 0 else "a signal"
        # first the rank that failed first (the launcher's word, else the one seen gone first), then
        # the ranks the launcher stopped, then those that failed on what the first left behind
        killed.sort(key=lambda rp: self.dead_at.get(rp[0], float("inf")))
        parts, stopped = [], []
        for i, (local_rank, pid) in enumerate(killed):
            if self.failed_first is not None:
                first = local_rank == self.failed_first
            else:
                first = len(killed) == 1 or (i == 0 and self._first(local_rank))
            if first:
                parts.append(f"local rank {local_rank} (pid {pid}) was killed by {how}")
            else:
                stopped.append(str(local_rank))
        errors.sort(key=lambda e: (e[1] != self.failed_first, e))
        raised = [f"local rank {local_rank} (pid {pid}) raised {text.splitlines()[-1] if text else '?'}"
                  for _, local_rank, pid, text in errors]
        if errors and errors[0][1] == self.failed_first:
            parts.append(raised.pop(0))
        if stopped:
            parts.append(f"the launcher stopped local rank {', '.join(stopped)}")
        parts += raised
        return "; then ".join(parts) if parts else f"a rank failed (launcher return code {code})"


def supervise(launch: LaunchPlan, work_dir: str | Path, on_line: Callable[[str], None],
              timeout_s: float | None = None, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run the plan to the end and return rank 0's result; raise LaunchError on any failure."""
    work_dir = Path(work_dir)
    result_path = work_dir / RESULT
    result_path.unlink(missing_ok=True)  # a result from an earlier attempt is not this one's
    child_env = {k: v for k, v in (env or os.environ).items() if k not in _STRIP_ENV}
    child_env.update(launch.env)
    child_env.setdefault("PYTHONUNBUFFERED", "1")
    tail: collections.deque[str] = collections.deque(maxlen=400)
    watch = _RankWatch(work_dir)
    shutil.rmtree(work_dir / STATUS_DIR, ignore_errors=True)
    proc = subprocess.Popen(launch.command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            errors="replace", env=child_env, start_new_session=True, cwd=os.getcwd())

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            line = line.rstrip("\n")
            tail.append(line)
            watch.saw(line)
            on_line(line)

    reader = threading.Thread(target=pump, name=f"{launch.stage}-launcher-output", daemon=True)
    reader.start()
    t0 = time.monotonic()
    try:
        try:
            while proc.poll() is None:
                if timeout_s is not None and time.monotonic() - t0 > timeout_s:
                    _kill_group(proc)
                    reader.join(timeout=5)
                    raise LaunchError(f"{launch.stage}: the {launch.world_size} DeepSpeed ranks did not finish "
                                      f"within timeout_s={timeout_s:g}s; killed them. Last lines:\n"
                                      + "\n".join(list(tail)[-20:]))
                watch.poll()
                time.sleep(0.1)
        except BaseException:  # cancellation (Prefect's TerminationSignal), KeyboardInterrupt, ...
            _kill_group(proc)
            raise
        reader.join(timeout=10)
        _kill_group(proc)  # nothing of the group may outlive the stage
    finally:  # the group is gone: its rendezvous file (in the temp folder, one per launch) goes too
        if launch.env.get(RENDEZVOUS):
            Path(launch.env[RENDEZVOUS]).unlink(missing_ok=True)
    lines = list(tail)
    if proc.returncode != 0:
        failure = (f"{launch.stage}: the launcher exited with code {proc.returncode}: {watch.describe(lines)}. "
                   "Last lines:\n" + "\n".join(lines[-30:]))
        user = watch.input_error()
        if user is not None:  # as the stage on one rank says it: the ranks' story is in the log
            on_line(failure)
            raise InputError(user)
        raise LaunchError(failure)
    if not result_path.is_file():
        raise LaunchError(f"{launch.stage}: the ranks exited 0 but rank 0 wrote no {RESULT}. Last lines:\n"
                          + "\n".join(lines[-30:]))
    return json.loads(result_path.read_text())


def write_spec(work_dir: str | Path, spec: dict[str, Any]) -> Path:
    path = Path(work_dir) / SPEC
    storage.write_json(str(path), spec)
    return path


def write_result(work_dir: str | Path, result: dict[str, Any]) -> None:
    storage.write_json(str(Path(work_dir) / RESULT), result)
