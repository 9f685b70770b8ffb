"""Start a stage's ranks on this machine, as DeepSpeed's launcher does for one node, from a process
that imports only the standard library.

    python -m trainer.local_launch --nprocs N --master_port P -- python -u -m tasks.rank_main --spec FILE

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
import os
import signal
import subprocess
import sys
import time

GRACE_S = 5.0  # a terminated rank's time to exit before SIGKILL


def _say(line: str) -> None:
    print(f"[posttrain local_launch] {line}", flush=True)


def rank_threads(nprocs: int, cores: int | None = None) -> int:
    """Torch threads for each of `nprocs` ranks on this machine: the cores this process may use,
    shared out (at least one each)."""
    cores = len(os.sched_getaffinity(0)) if cores is None else cores
    return max(1, cores // nprocs)


class Stop(Exception):
    """SIGTERM or SIGINT arrived: stop the ranks and exit 1."""


class Ranks:
    def __init__(self) -> None:
        self.pids: list[int] = []
        self.codes: dict[int, int] = {}  # pid -> exit code, once reaped
        self.signalled = False
        self.spawning = False
        self.stopping = False

    def start(self, command: list[str], nprocs: int, master_addr: str, master_port: int) -> None:
        """Spawn the ranks. A signal while spawning is held until the rank being spawned is in
        `pids` (then Stop), so stopping never misses one that was already started."""
        env = dict(os.environ, MASTER_ADDR=master_addr, MASTER_PORT=str(master_port), WORLD_SIZE=str(nprocs),
                   LOCAL_SIZE=str(nprocs), CROSS_RANK="0", CROSS_SIZE="1")
        env.setdefault("OMP_NUM_THREADS", str(rank_threads(nprocs)))
        self.spawning = True
        for i in range(nprocs):
            cmd = [*command, f"--local_rank={i}"]
            proc = subprocess.Popen(cmd, env={**env, "RANK": str(i), "LOCAL_RANK": str(i)})
            self.pids.append(proc.pid)  # reaped below with os.waitpid, not through the Popen object
            _say(f"process {proc.pid} spawned with command: {cmd}")
            if self.signalled:
                break
        self.spawning = False
        if self.signalled:
            raise Stop

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


if __name__ == "__main__":
    sys.exit(main())
