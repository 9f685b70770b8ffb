"""Start a stage's ranks on this machine, as DeepSpeed's launcher does for one node.

    python -m trainer.local_launch --nprocs N --master_port P -- python -u -m tasks.rank_main --spec FILE

A rank command `python [-u] -m MODULE ARGS` (this interpreter) whose module has `main(argv)` is run
by forking: this process imports MODULE once, calls its `preload(ARGS)` if it has one (tasks.rank_main
imports torch, DeepSpeed and the stage's code there: about 9 s of a core that every rank paid again,
on a 2-core AVX2 machine), then forks each rank, which calls `MODULE.main(ARGS + ['--local_rank=I'])`
and exits as `python -m` would. Ranks are spawned as fresh processes instead where a GPU device
exists (CUDA must not be initialized before a fork, and importing DeepSpeed asks torch about
devices), where POSTTRAIN_RANK_START=spawn, where preloading left a thread running (a fork copies
only the thread that forks), and for any other command. A launcher that spawns its ranks imports
only the standard library.

`deepspeed.launcher.runner` and the `deepspeed.launcher.launch` it starts are two processes that each
import DeepSpeed and torch (about 8 s of a core each on a 2-core AVX2 machine, 13-25 s of waiting
before any rank started when the cores were busy) to do what this does for ranks on one machine.
Several machines (a hostfile) still go through DeepSpeed's runner (trainer.launch.plan).

Each rank gets the environment DeepSpeed's launcher gives it (MASTER_ADDR, MASTER_PORT, WORLD_SIZE,
RANK, LOCAL_RANK, LOCAL_SIZE, CROSS_RANK, CROSS_SIZE) and `--local_rank=I`; CUDA_VISIBLE_DEVICES
is left as it is (each rank takes device LOCAL_RANK of what it sees). Unless OMP_NUM_THREADS is set,
each rank gets its share of this process's cores as torch threads (`rank_threads`, as torchrun
does): left alone, every rank's torch takes all the cores, N ranks' thread pools then share them N
times over, and each parallel op waits at its barrier for threads the other ranks preempted.

The lines trainer.launch's supervisor reads are printed in DeepSpeed's words: `process PID spawned
with command: [...]` for each rank; when a rank exits non-zero, `local rank I (pid PID) failed
first, ...` (which DeepSpeed's launcher does not say), `Killing subprocess PID` for each rank still
running and `[...] exits with return code = N`, and this process exits with that code (a signal's
-N as sys.exit does). SIGTERM or SIGINT stops every rank (SIGTERM, then SIGKILL after GRACE_S) and
exits 1, also when it arrives while the ranks are being started (each rank is recorded before the
signal is acted on).
"""

from __future__ import annotations

import argparse
import atexit
import glob
import importlib
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
from typing import NoReturn

GRACE_S = 5.0  # a terminated rank's time to exit before SIGKILL
START = "POSTTRAIN_RANK_START"  # "spawn": every rank a fresh process, even where forking is possible
_STOP_SIGNALS = {signal.SIGTERM, signal.SIGINT}


def _say(line: str) -> None:
    print(f"[posttrain local_launch] {line}", flush=True)


def rank_threads(nprocs: int, cores: int | None = None) -> int:
    """Torch threads for each of `nprocs` ranks on this machine: the cores this process may use,
    shared out (at least one each)."""
    cores = len(os.sched_getaffinity(0)) if cores is None else cores
    return max(1, cores // nprocs)


def fork_target(command: list[str]) -> tuple[str, list[str], bool] | None:
    """(module, its arguments, unbuffered) when `command`'s ranks may be forked from this process
    (see the module's doc), or None to spawn each rank from `command`."""
    if os.environ.get(START, "fork") == "spawn" or glob.glob("/dev/nvidia[0-9]*") or os.path.exists("/dev/kfd"):
        return None
    args = command[1:]
    unbuffered = args[:1] == ["-u"]
    args = args[1:] if unbuffered else args
    if command[:1] != [sys.executable] or len(args) < 2 or args[0] != "-m":
        return None
    return args[1], args[2:], unbuffered


class Stop(Exception):
    """SIGTERM or SIGINT arrived: stop the ranks and exit 1."""


class ForkedRank(BaseException):
    """Raised in a forked rank: it unwinds the launcher's frames, and the module's last lines run the
    rank (`run`) and exit with its code, as the interpreter of a spawned `python -m` rank would."""

    def __init__(self, module, argv: list[str], unbuffered: bool) -> None:
        super().__init__(module.__name__)
        self.module, self.argv, self.unbuffered = module, argv, unbuffered

    def run(self) -> int | None:
        if self.unbuffered:  # `python -u`: every line reaches the supervisor as it is written
            sys.stdout.reconfigure(line_buffering=True)
            sys.stderr.reconfigure(line_buffering=True)
        sys.argv = [self.module.__file__, *self.argv]
        return self.module.main(self.argv)


class Ranks:
    def __init__(self) -> None:
        self.pids: list[int] = []
        self.codes: dict[int, int] = {}  # pid -> exit code, once reaped
        self.signalled = False
        self.spawning = False
        self.stopping = False

    def start(self, command: list[str], nprocs: int, master_addr: str, master_port: int) -> None:
        """Start the ranks, forked or spawned (see the module's doc). A signal while starting is
        held until the rank being started is in `pids` (then Stop), so stopping never misses one that
        was already started."""
        env = dict(MASTER_ADDR=master_addr, MASTER_PORT=str(master_port), WORLD_SIZE=str(nprocs),
                   LOCAL_SIZE=str(nprocs), CROSS_RANK="0", CROSS_SIZE="1")
        env["OMP_NUM_THREADS"] = os.environ.get("OMP_NUM_THREADS", str(rank_threads(nprocs)))
        target = self.preload(command, env)
        module, argv, unbuffered = target or (None, [], False)
        self.spawning = True
        for i in range(nprocs):
            cmd = [*command, f"--local_rank={i}"]
            if module is None:
                pid = subprocess.Popen(cmd, env={**os.environ, **env, "RANK": str(i), "LOCAL_RANK": str(i)}).pid
                how = ""  # reaped below with os.waitpid, not through the Popen object
            else:
                pid = self.fork(ForkedRank(module, [*argv, f"--local_rank={i}"], unbuffered),
                                {"RANK": str(i), "LOCAL_RANK": str(i)})
                how = f" (forked from this process, {module.__name__} imported once)"
            self.pids.append(pid)
            _say(f"process {pid} spawned with command: {cmd}{how}")
            if self.signalled:
                break
        self.spawning = False
        if self.signalled:
            raise Stop

    @staticmethod
    def preload(command: list[str], env: dict[str, str]):
        """Import the rank module and run its `preload` here, once, with the ranks' shared environment
        set first (torch reads OMP_NUM_THREADS when it loads): (module, argv, unbuffered), or None to
        spawn."""
        target = fork_target(command)
        if target is None:
            return None
        name, argv, unbuffered = target
        os.environ.update(env)
        try:  # only a saving: whatever fails here fails again in each spawned rank, with its own message
            module = importlib.import_module(name)
            if not callable(getattr(module, "main", None)):
                return None
            if callable(getattr(module, "preload", None)):
                module.preload(argv)
        except Exception as e:
            _say(f"preloading {name} failed ({type(e).__name__}: {e}): spawning the ranks instead")
            return None
        if threading.active_count() > 1:
            _say(f"{name}.preload left {threading.active_count() - 1} thread(s) running, which a fork would "
                 "not copy: spawning the ranks instead")
            return None
        return module, argv, unbuffered

    @staticmethod
    def fork(rank: ForkedRank, env: dict[str, str]) -> int:
        """Fork one rank: the child raises `rank` with the signals' handling a fresh process has."""
        old = signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)  # acted on once the pid is recorded
        pid = os.fork()
        if pid == 0:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            signal.signal(signal.SIGINT, signal.default_int_handler)
            signal.pthread_sigmask(signal.SIG_SETMASK, old)
            os.environ.update(env)
            raise rank
        signal.pthread_sigmask(signal.SIG_SETMASK, old)
        return pid

    def on_signal(self, signum, frame) -> None:
        if self.stopping or self.signalled:
            return  # already stopping
        _say(f"received {signal.Signals(signum).name}, stopping the ranks")
        self.signalled = True
        if not self.spawning:
            raise Stop

    def alive(self) -> list[int]:
        return [p for p in self.pids if p not in self.codes]

    def reap(self, block: bool) -> int | None:
        """Reap one exited rank; its pid, or None when none has exited (without `block`)."""
        try:
            pid, status = os.waitpid(-1, 0 if block else os.WNOHANG)
        except ChildProcessError:
            return None
        if pid == 0:
            return None
        self.codes[pid] = os.waitstatus_to_exitcode(status)
        return pid

    def stop(self) -> None:
        """SIGTERM every rank still running, then SIGKILL what is left after GRACE_S (a signal
        arriving meanwhile changes nothing)."""
        self.stopping = True
        for pid in self.alive():
            _say(f"Killing subprocess {pid}")
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + GRACE_S
        while self.alive() and time.monotonic() < deadline:
            if self.reap(block=False) is None:
                time.sleep(0.05)
        for pid in self.alive():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        while self.alive() and self.reap(block=True) is not None:
            pass


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="trainer.local_launch", description=__doc__.split("\n\n")[0])
    parser.add_argument("--nprocs", type=int, required=True, help="ranks to start on this machine")
    parser.add_argument("--master_addr", default="127.0.0.1")
    parser.add_argument("--master_port", type=int, required=True)
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the rank's command line")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if args.nprocs < 1 or not command:
        parser.error("needs --nprocs >= 1 and a command after --")
    ranks = Ranks()
    signal.signal(signal.SIGTERM, ranks.on_signal)
    signal.signal(signal.SIGINT, ranks.on_signal)
    try:
        ranks.start(command, args.nprocs, args.master_addr, args.master_port)
        while ranks.alive():
            pid = ranks.reap(block=True)
            if pid is None:
                break
            code = ranks.codes[pid]
            if code != 0:
                _say(f"local rank {ranks.pids.index(pid)} (pid {pid}) failed first, with exit code {code}")
                ranks.stop()
                _say(f"{command} exits with return code = {code}")
                return code
            _say(f"Process {pid} exits successfully.")
        return 0
    except Stop:
        ranks.stop()
        return 1


def leave(code: int | str | None) -> NoReturn:
    """Exit as the interpreter does (non-daemon threads joined, atexit handlers run, output flushed,
    SystemExit's code), without tearing down every module: in a forked rank, or a launcher that
    imported a rank module, that teardown touches every object and so copies every page the fork
    shared (2.5 s of a core for a rank of 7,000 modules on the 2-core AVX2 machine)."""
    # what the interpreter's own exit runs first, as multiprocessing's forked children do: the
    # threading module's exit hooks (concurrent.futures stops its pools' workers), then the join of
    # every non-daemon thread
    threading._shutdown()
    atexit._run_exitfuncs()
    if not isinstance(code, int):
        if code is not None:
            print(code, file=sys.stderr)
        code = 0 if code is None else 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # the reader is gone: nothing left to tell it
            pass
    os._exit(code & 0xFF)


def _run_forked(rank: ForkedRank) -> NoReturn:
    """The rest of a forked rank's life: `python -m MODULE` would print an uncaught exception's
    traceback and exit 1."""
    try:
        code = rank.run()
    except SystemExit as e:
        code = e.code
    except BaseException:
        traceback.print_exc()
        code = 1
    leave(code)


if __name__ == "__main__":
    forked: ForkedRank | None = None
    try:
        code = main()
    except ForkedRank as rank:
        forked = rank.with_traceback(None)
    if forked is not None:  # this process is a rank now, outside the launcher's frames
        _run_forked(forked)
    leave(code)
