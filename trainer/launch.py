"""Run a training stage's ranks under a launcher and supervise them.

The stage's task writes a spec (config, input manifests, MLflow run) into the work folder, then
starts `python -m trainer.local_launch --nprocs N ... -- python -m tasks.rank_main --spec <file>`
(ranks on this machine) or `python -m deepspeed.launcher.runner --hostfile ... --module trainer.hosts
rank <id>` (several machines: DeepSpeed's runner and its pdsh fan-out over ssh) in a process
group of its own. The supervisor streams the launcher's output line by line into the run's log, kills
the whole group on timeout, cancellation or any error in the caller (SIGTERM, then SIGKILL after a
grace period), and turns a rank's crash into `LaunchError` naming the failed rank and its last lines
(where the first rank to fail raised the user's error, an InputError, that error's message alone, as
on one rank). Rank 0 writes `launch_result.json`; only a run that exits 0 with that file is a success.

Several machines: rank 0 runs on this machine (the hostfile's hosts are handed to DeepSpeed with this
one first), since it writes the result this task commits. Before any rank starts, a preflight reaches
every host over ssh (`python -m trainer.hosts check`): it must answer, run this Python and the same
posttrain source, and have the interface the config names; it receives the spec and the ranks'
environment (credentials included) on its standard input. Each rank's output comes back prefixed by
its host (pdsh) and rank (trainer.hosts), ending with a line that says how the rank ended; a launch is
a success only when every rank said `ok` (pdsh's fan-out can exit 0 when a node failed,
DeepSpeed#1722). A rank that fails, or a host that goes silent, fails the stage within
`deepspeed.collective_timeout_s` (the ranks' collectives time out) and a grace period; whatever
the launch left on any host is stopped (`trainer.hosts clean`).

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
import socket
import subprocess
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
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
    hosts: list[str] = field(default_factory=list)  # several machines: where the ranks run, this one first
    launch_id: str | None = None                      # names the launch's files and processes on each host
    interface: str | None = None
    collective_timeout_s: float | None = None

    def describe(self) -> str:
        if self.hostfile:
            return (f"{self.stage}: DeepSpeed launcher, {self.world_size} ranks ({self.ranks_per_node} per node on "
                    f"{', '.join(self.hosts)} from {self.hostfile}; rank 0 on this machine)\n"
                    f"  $ {shlex.join(self.command)}")
        return (f"{self.stage}: {self.world_size} DeepSpeed ranks on this machine (trainer.local_launch)\n"
                f"  $ {shlex.join(self.command)}")


def plan(stage: str, ds: DeepSpeedConfig, spec_path: str | Path, port: int | None = None) -> LaunchPlan:
    """The launcher command for `stage`'s ranks; checks the hostfile exists. Ranks on this machine
    alone are started by trainer.local_launch (DeepSpeed's launcher's environment, without its two
    processes that import DeepSpeed first); several machines go through DeepSpeed's runner, with the
    hostfile's hosts in `hosts` order (written beside the spec when the launch starts)."""
    if ds.hostfile is not None and not Path(ds.hostfile).is_file():
        raise InputError(f"{stage}.deepspeed.hostfile={ds.hostfile!r} does not exist; point it at a DeepSpeed "
                         "hostfile with one 'hostname slots=N' line per machine")
    port = port or ds.master_port or free_port()
    module = ["tasks.rank_main", "--spec", str(spec_path)]
    if ds.hostfile:
        hosts = placement(stage, ds)
        launch_id = uuid.uuid4().hex[:16]
        cmd = [sys.executable, "-u", "-m", "deepspeed.launcher.runner", "--hostfile",
               str(Path(spec_path).parent / HOSTFILE), "--num_nodes", str(ds.nodes), "--num_gpus",
               str(ds.ranks_per_node), "--master_port", str(port)]
        master = ds.master_addr or (local_address(stage, ds.interface) if ds.interface else None)
        if master:  # else DeepSpeed's runner asks the first host (this one) with `hostname -I`
            cmd += ["--master_addr", master]
        cmd += ["--module", "trainer.hosts", "rank", launch_id]
        env = {"DS_ENV_FILE": str(Path(spec_path).parent / DS_ENV_FILE),
               # ssh notices a host that stopped answering within 15 s, as sshd does on the other side
               "PDSH_SSH_ARGS_APPEND": " ".join(SSH_OPTIONS)}
        return LaunchPlan(stage, cmd, ds.world_size, ds.ranks_per_node, ds.nodes, ds.hostfile, env, hosts,
                          launch_id, ds.interface, ds.collective_timeout_s)
    cmd = [sys.executable, "-u", "-m", "trainer.local_launch", "--nprocs", str(ds.ranks_per_node),
           "--master_addr", "127.0.0.1", "--master_port", str(port), "--", sys.executable, "-u", "-m", *module]
    # ranks on this machine alone meet through a file and gloo over loopback (trainer.engine)
    return LaunchPlan(stage, cmd, ds.world_size, ds.ranks_per_node, ds.nodes, None, {RENDEZVOUS: rendezvous_file()})


# ---------------------------------------------------------------- several machines

HOSTFILE = "hostfile"          # beside the spec: the hostfile as DeepSpeed gets it, this machine first
DS_ENV_FILE = "deepspeed_env"  # beside the spec: what DeepSpeed's runner exports to every host (DS_ENV_FILE)
SSH_OPTIONS = ("-o", "BatchMode=yes", "-o", "ConnectTimeout=10", "-o", "ServerAliveInterval=5",
               "-o", "ServerAliveCountMax=3")
PREFLIGHT_TIMEOUT_S = 60.0
# the environment a rank reads that its host's own login does not give it: sent to each host in the
# preflight (never on a command line); paths of this machine's own caches stay behind
FORWARDED = ("AWS_", "MLFLOW_", "POSTTRAIN_", "HF_", "TRANSFORMERS_", "TOKENIZERS_", "OMP_", "MKL_", "TORCH_")
NOT_FORWARDED = ("POSTTRAIN_CACHE", "POSTTRAIN_SGLANG_HOME", "POSTTRAIN_KERNEL_CACHE", "POSTTRAIN_TEST_DOWNLOADS",
                 "HF_HOME", "HF_HUB_CACHE", "HF_DATASETS_CACHE", RENDEZVOUS, "POSTTRAIN_ONE_RANK_GROUP_PID")


class HostError(InputError):
    """A host of the hostfile cannot run the launch's ranks (unreachable, another Python or source)."""


def read_hostfile(path: str) -> list[tuple[str, int]]:
    """DeepSpeed's hostfile: `name slots=N` a line, `#` comments and blank lines ignored."""
    hosts = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        m = re.fullmatch(r"(\S+)\s+slots=(\d+)", line)
        if not m:
            raise InputError(f"{path}, line {n}: {line!r} is not 'hostname slots=N'; write one such line per machine")
        hosts.append((m.group(1), int(m.group(2))))
    return hosts


def is_this_machine(name: str) -> bool:
    """Whether a hostfile entry names this machine: its hostname, or an address it holds."""
    if name in (socket.gethostname(), "localhost") or name.startswith("127."):
        return True
    try:
        address = socket.gethostbyname(name)
    except OSError:
        return False
    from trainer.hosts import addresses

    return address.startswith("127.") or any(address in found for found in addresses().values())


def placement(stage: str, ds: DeepSpeedConfig) -> list[str]:
    """The hosts of `stage`'s launch: this machine (rank 0, which writes the result this task commits),
    then the hostfile's others in its order, `ds.nodes` in all."""
    hosts = read_hostfile(ds.hostfile)
    where = f"{stage}.deepspeed.hostfile ({ds.hostfile})"
    small = [f"{h} slots={n}" for h, n in hosts if n < ds.ranks_per_node]
    if small:
        raise InputError(f"{where}: {', '.join(small)} has fewer slots than {stage}.deepspeed.ranks_per_node="
                         f"{ds.ranks_per_node}; give each host at least that many")
    mine = [h for h, _ in hosts if is_this_machine(h)]
    if not mine:
        raise InputError(f"{where} does not list this machine ({socket.gethostname()}): rank 0 runs where the "
                         f"stage's task runs, since it writes the result the task commits; add this machine to the "
                         f"hostfile, or run the stage on one of {', '.join(h for h, _ in hosts)} (a Prefect worker "
                         "there, or the CLI)")
    others = [h for h, _ in hosts if h != mine[0]]
    if len(others) + 1 < ds.nodes:
        raise InputError(f"{where} lists {len(hosts)} host(s), fewer than {stage}.deepspeed.nodes={ds.nodes}")
    return [mine[0], *others[:ds.nodes - 1]]


def local_address(stage: str, interface: str) -> str:
    """This machine's address on `interface` (rank 0's, which the other ranks connect to)."""
    from trainer.hosts import addresses

    found = addresses()
    if not found.get(interface):
        raise InputError(f"{stage}.deepspeed.interface={interface!r}: this machine ({socket.gethostname()}) has no "
                         f"IPv4 address on it; its interfaces: {', '.join(sorted(found)) or 'none found'}")
    return found[interface][0]


def forwarded_env(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(FORWARDED) and k not in NOT_FORWARDED}


def _ssh(host: str, args: list[str], stdin: str = "", timeout_s: float = PREFLIGHT_TIMEOUT_S) -> tuple[int, str, str]:
    try:
        out = subprocess.run(["ssh", *SSH_OPTIONS, host, shlex.join(args)], input=stdin, capture_output=True,
                             text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return -1, "", f"no answer within {timeout_s:.0f} s"
    except FileNotFoundError:
        return -2, "", "there is no ssh client on this machine (apt-get install openssh-client)"
    return out.returncode, out.stdout, out.stderr


def check_host(host: str, request: dict, interface: str | None) -> tuple[dict | None, str | None]:
    """(the host's answer, None), or (None, what failed there and the fix)."""
    python = [sys.executable, "-m", "trainer.hosts", "check"]
    code, out, err = _ssh(host, python, json.dumps(request))
    last = (err.strip().splitlines() or [""])[-1][:300]
    if code < 0:  # no answer in time, or no ssh client here
        return None, f"{host}: ssh: {err}"
    if code == 255:
        return None, (f"{host}: ssh failed ({last or 'exit 255'}); check that `ssh {host}` works from this machine "
                      "without a password or prompt (keys, known_hosts; docs/cluster.md)")
    if code == 127 or "No such file or directory" in err and sys.executable in err:
        return None, (f"{host}: there is no Python at {sys.executable} there; every host runs this machine's "
                      "interpreter at the same path (the same checkout and venv on every host)")
    if code != 0:
        return None, f"{host}: {sys.executable} there cannot run posttrain ({last}); install the same checkout there"
    try:
        answer = json.loads(out.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return None, f"{host}: an unreadable answer from posttrain there: {out[-300:]!r}"
    if answer.get("version") != request["version"]:
        return None, (f"{host} runs posttrain source {answer.get('version')}, this machine {request['version']}: "
                      "every host must run the same checkout (the same commit, no local edits)")
    if interface and not answer.get("addresses", {}).get(interface):
        return None, (f"{host} has no IPv4 address on interface {interface!r} (deepspeed.interface); its "
                      f"interfaces: {', '.join(sorted(answer.get('addresses', {}))) or 'none'}")
    return answer, None


def check_hosts(stage: str, hosts: list[str], interface: str | None, requests: dict[str, dict] | None = None
                ) -> dict[str, dict]:
    """The preflight: every host answers (`check_host`, in parallel); raises HostError naming each host
    that cannot run the launch and why. `requests`: what each host gets (the launch's files)."""
    from trainer.hosts import source_version

    version = source_version()
    requests = requests or {h: {} for h in hosts}
    with ThreadPoolExecutor(max(1, len(hosts))) as pool:
        results = dict(zip(hosts, pool.map(lambda h: check_host(h, {"version": version, **requests[h]}, interface),
                                           hosts)))
    problems = [problem for _, problem in results.values() if problem]
    if problems:
        raise HostError(f"{stage}: {len(problems)} of the launch's {len(hosts)} hosts cannot run its ranks, so "
                        "nothing was started:\n  " + "\n  ".join(problems))
    return {h: answer for h, (answer, _) in results.items()}


def prepare_hosts(launch: LaunchPlan, work_dir: Path, env: dict[str, str]) -> None:
    """Before the runner starts: the hostfile in placement order and DeepSpeed's exports beside the spec,
    then the preflight, which also hands each host the spec and the ranks' environment."""
    slots = dict(read_hostfile(launch.hostfile))
    (work_dir / HOSTFILE).write_text("".join(f"{h} slots={slots[h]}\n" for h in launch.hosts))
    exports = {"POSTTRAIN_LAUNCH_ID": launch.launch_id}
    if launch.interface:  # what gloo (CPU) and NCCL (GPU) bind to, on every host
        exports.update(GLOO_SOCKET_IFNAME=launch.interface, NCCL_SOCKET_IFNAME=launch.interface)
    (work_dir / DS_ENV_FILE).write_text("".join(f"{k}={v}\n" for k, v in exports.items()))
    spec = json.loads((work_dir / SPEC).read_text())
    files = {"spec": spec, "env": forwarded_env(env), "launch": launch.launch_id,
             "supervisor_host": socket.gethostname()}
    check_hosts(launch.stage, launch.hosts, launch.interface, {h: files for h in launch.hosts})


def clean_hosts(launch: LaunchPlan, say: Callable[[str], None]) -> None:
    """Stop whatever the launch left on each host (in parallel; a host that cannot be reached is named:
    its ranks stop by themselves once their collectives time out)."""
    def one(host: str) -> None:
        code, out, err = _ssh(host, [sys.executable, "-m", "trainer.hosts", "clean", launch.launch_id], timeout_s=30)
        if code != 0:
            say(f"{launch.stage}: could not reach {host} to stop what is left of the launch ({(err or out).strip()[-200:]}); "
                f"its ranks stop by themselves within deepspeed.collective_timeout_s={launch.collective_timeout_s:g}s")

    with ThreadPoolExecutor(max(1, len(launch.hosts))) as pool:
        list(pool.map(one, launch.hosts))


_STATUS = re.compile(r"posttrain-rank-status rank=(\d+) host=(\S+) (.*)$")


class _HostWatch:
    """How each rank of a several-machine launch ended, from the line its wrapper (trainer.hosts) prints."""

    def __init__(self, launch: LaunchPlan) -> None:
        self.launch = launch
        self.ended: dict[int, tuple[str, str]] = {}  # global rank -> (host, how)
        self.first_failure_at: float | None = None

    def saw(self, line: str) -> None:
        if m := _STATUS.search(line):
            self.ended[int(m.group(1))] = (m.group(2), m.group(3))
            if m.group(3) != "ok" and self.first_failure_at is None:
                self.first_failure_at = time.monotonic()

    def rank_host(self, r: int) -> str:
        return self.launch.hosts[r // self.launch.ranks_per_node]

    def all_ok(self) -> bool:
        return all(self.ended.get(r, ("", ""))[1] == "ok" for r in range(self.launch.world_size))

    def describe(self) -> str:
        failed = [f"rank {r} on {host} {how}" for r, (host, how) in sorted(self.ended.items()) if how != "ok"]
        silent = [f"rank {r} on {self.rank_host(r)} did not report how it ended (its host may be unreachable, or "
                  "its process was killed)" for r in range(self.launch.world_size) if r not in self.ended]
        return "; ".join(failed + silent) or "every rank reported ok"


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
    """Run the plan to the end and return rank 0's result; raise LaunchError on any failure (HostError,
    before anything starts, when a host of a several-machine launch cannot run its ranks)."""
    work_dir = Path(work_dir)
    result_path = work_dir / RESULT
    result_path.unlink(missing_ok=True)  # a result from an earlier attempt is not this one's
    env = dict(env or os.environ)
    child_env = {k: v for k, v in env.items() if k not in _STRIP_ENV}
    hosts = _HostWatch(launch) if launch.hosts else None
    if hosts is not None:
        prepare_hosts(launch, work_dir, env)
        # DeepSpeed's runner exports MLFLOW_* on the command line it logs: the ranks get them from the
        # preflight instead
        child_env = {k: v for k, v in child_env.items() if not k.startswith("MLFLOW_")}
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
            if hosts is not None:
                hosts.saw(line)
            on_line(line)

    reader = threading.Thread(target=pump, name=f"{launch.stage}-launcher-output", daemon=True)
    reader.start()
    t0 = time.monotonic()
    # once a rank has failed, the others fail on their next collective (at once where the failed rank's
    # process is gone, after the collective time-out where its host went silent), and ssh gives up on a
    # silent host within 15 s: past that, the launcher is waiting on nothing
    settle_s = (launch.collective_timeout_s or 0.0) + 30.0
    try:
        try:
            while proc.poll() is None:
                if timeout_s is not None and time.monotonic() - t0 > timeout_s:
                    _kill_group(proc)
                    reader.join(timeout=5)
                    raise LaunchError(f"{launch.stage}: the {launch.world_size} DeepSpeed ranks did not finish "
                                      f"within timeout_s={timeout_s:g}s; killed them. Last lines:\n"
                                      + "\n".join(list(tail)[-20:]))
                if hosts is not None and hosts.first_failure_at is not None \
                        and time.monotonic() - hosts.first_failure_at > settle_s:
                    on_line(f"{launch.stage}: a rank failed {settle_s:.0f} s ago and the launcher is still waiting "
                            f"({hosts.describe()}); stopping it")
                    _kill_group(proc)
                    break
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
        if hosts is not None:  # ... and whatever the launch left on each host, with its credentials
            clean_hosts(launch, on_line)
    lines = list(tail)
    if hosts is not None and (proc.returncode != 0 or not hosts.all_ok()):
        raise LaunchError(f"{launch.stage}: the launch across {', '.join(launch.hosts)} failed (launcher exit code "
                          f"{proc.returncode}): {hosts.describe()}. Last lines:\n" + "\n".join(lines[-30:]))
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
