"""Simulated hosts on this machine, for the several-machine tests (tests/test_cluster.py) and for a
person to try by hand (`make cluster`).

Each host is a Linux network namespace with one interface (eth0, 198.18.0.1x/24) on a bridge that
lives in a namespace of its own: the hosts reach each other and nothing else (no route out, no NAT,
addresses from the benchmarking range 198.18.0.0/15 only). Each host also has its own mount, PID and
UTS namespaces (tests/cluster_host.py is its PID 1):

- its own hostname (host-a, host-b, ...), /etc/hosts naming every host, and processes: a host sees
  only its own, and killing its PID 1 kills them all;
- its own disk where a machine has one: home (/root: ssh keys, ~/.cache/posttrain, ~/.prefect, the
  Hugging Face cache), /tmp, /dev/shm and a working folder, /srv;
- shared, as a cluster's shared home or software volume would be: this checkout and its .venv, the
  Python the venv runs on, and the machine-wide software under ~/.cache/posttrain (the compiled
  kernels, SGLang's environment). Artifacts, checkpoints and weights are not: they travel through
  S3 and the network.

Each host runs its own sshd (host keys and one client key made here, every host's key in every
host's known_hosts), so DeepSpeed's runner fans out over ssh and pdsh as on real machines.

Needs root (namespaces, mounts) and iproute2, util-linux, openssh-server and pdsh; `unavailable()`
says what is missing. Everything is torn down by `Cluster.down()`, and by the kernel if the process
that built the cluster dies: each host's PID 1 exits when that process's pipe closes.

    python -m tests.cluster        # make cluster: build it, start host A's services, print how to get in
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from trainer.procwatch import process_gone

REPO = Path(__file__).resolve().parent.parent
SUBNET = "198.18.0"
PREFIX = "ptc"  # namespace names: ptc<builder pid>-<host letter>, ptc<builder pid>-sw for the bridge
TOOLS = ("ip", "unshare", "nsenter", "ssh", "ssh-keygen", "pdsh")
SSHD = "/usr/sbin/sshd"
PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


class ClusterUnavailable(RuntimeError):
    """Namespaces cannot be made here (not root, a tool missing); the message says which."""


def unavailable() -> str | None:
    """Why a cluster cannot be built on this machine, or None."""
    if sys.platform != "linux":
        return "simulated hosts need Linux namespaces"
    if os.geteuid() != 0:
        return "simulated hosts need root (network, mount and PID namespaces); run the cluster tests as root"
    missing = [t for t in TOOLS if shutil.which(t) is None] + ([] if os.path.exists(SSHD) else [SSHD])
    if missing:
        return (f"missing {', '.join(missing)}: apt-get install iproute2 util-linux openssh-server openssh-client "
                "pdsh (make test-cluster installs them)")
    probe = f"{PREFIX}{os.getpid()}-probe"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"cannot make a network namespace here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def sweep() -> None:
    """Remove the namespaces of clusters whose builder is gone (a SIGKILLed test run)."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    for line in out.splitlines():
        name = line.split()[0] if line.split() else ""
        owner = name[len(PREFIX):].partition("-")[0] if name.startswith(PREFIX) else ""
        if owner.isdigit() and process_gone(int(owner)):
            subprocess.run(["ip", "netns", "del", name], capture_output=True)


@dataclass
class Host:
    letter: str
    address: str
    netns: str
    dir: Path                  # its private folders, seen from outside
    init: subprocess.Popen | None = None
    pid: int = 0               # its PID 1, as this machine's (the builder's) PID namespace numbers it

    @property
    def name(self) -> str:
        return f"host-{self.letter}"


def _shared_software() -> list[Path]:
    """What every host sees at the same path, beside this checkout: the Python the venv runs on and the
    machine-wide software under ~/.cache/posttrain (kernels, SGLang's environments)."""
    shared = [Path(sys.base_prefix).resolve()]
    cache = Path.home() / ".cache" / "posttrain"
    if cache.is_dir():
        shared += sorted(p for p in cache.iterdir() if p.is_dir() and (p.name == "kernels" or p.name.startswith("sglang-")))
    return shared


@dataclass
class Cluster:
    root: Path
    letters: tuple[str, ...] = ("a", "b", "c")
    hosts: dict[str, Host] = field(default_factory=dict)
    _watch_w: int | None = None

    @property
    def tag(self) -> str:
        return f"{PREFIX}{os.getpid()}"

    def __post_init__(self) -> None:
        for i, letter in enumerate(self.letters):
            self.hosts[letter] = Host(letter, f"{SUBNET}.{11 + i}", f"{self.tag}-{letter}", self.root / f"host-{letter}")

    # ------------------------------------------------------------------ building and tearing down

    def up(self) -> Cluster:
        problem = unavailable()
        if problem:
            raise ClusterUnavailable(problem)
        sweep()
        try:
            self._keys()
            self._network()
            watch_r, self._watch_w = os.pipe()
            try:
                for host in self.hosts.values():
                    self._start(host, watch_r)
                for host in self.hosts.values():
                    self._wait_ready(host)
            finally:
                os.close(watch_r)
        except BaseException:
            self.down()
            raise
        return self

    def _keys(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        keys = self.root / "keys"
        keys.mkdir(exist_ok=True)
        gen = lambda path: subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", path.name, "-f", str(path)],  # noqa: E731
                                          check=True, capture_output=True)
        gen(keys / "client")
        known = []
        hosts_file = "127.0.0.1 localhost\n" + "".join(f"{h.address} {h.name}\n" for h in self.hosts.values())
        for host in self.hosts.values():
            gen(keys / f"{host.name}-hostkey")
            pub = (keys / f"{host.name}-hostkey.pub").read_text().split()[:2]
            known.append(f"{host.name},{host.address} {' '.join(pub)}\n")
        for host in self.hosts.values():
            home = host.dir / "home"
            for sub in ("tmp", "srv", "home/.ssh", "home/.sshd", "home/.cache/posttrain", "home/.prefect"):
                (host.dir / sub).mkdir(parents=True, exist_ok=True)
            os.chmod(host.dir / "tmp", 0o1777)
            ssh = home / ".ssh"
            shutil.copy(keys / "client", ssh / "id_ed25519")
            os.chmod(ssh / "id_ed25519", 0o600)
            shutil.copy(keys / "client.pub", ssh / "authorized_keys")
            (ssh / "known_hosts").write_text("".join(known))
            # as a cluster's ssh set-up would be: keys only, the known hosts checked, and a dead peer
            # noticed within 15 s (both ways: ClientAlive* below)
            (ssh / "config").write_text(
                "Host *\n  BatchMode yes\n  StrictHostKeyChecking yes\n  IdentityFile ~/.ssh/id_ed25519\n"
                "  ConnectTimeout 5\n  ServerAliveInterval 5\n  ServerAliveCountMax 3\n  LogLevel ERROR\n")
            sshd = home / ".sshd"
            shutil.copy(keys / f"{host.name}-hostkey", sshd / "host_key")
            os.chmod(sshd / "host_key", 0o600)
            (sshd / "sshd_config").write_text(
                f"ListenAddress {host.address}\nPort 22\nHostKey /root/.sshd/host_key\nPidFile none\n"
                "PermitRootLogin prohibit-password\nPasswordAuthentication no\nKbdInteractiveAuthentication no\n"
                "UsePAM no\nStrictModes no\nAuthorizedKeysFile /root/.ssh/authorized_keys\nX11Forwarding no\n"
                "ClientAliveInterval 5\nClientAliveCountMax 3\nMaxStartups 100\nMaxSessions 100\n"
                "LogLevel ERROR\n")
            (host.dir / "hosts").write_text(hosts_file)

    def _network(self) -> None:
        sw = f"{self.tag}-sw"
        ip = lambda *args: subprocess.run(["ip", *args], check=True, capture_output=True, text=True)  # noqa: E731
        ip("netns", "add", sw)
        ip("-n", sw, "link", "add", "br0", "type", "bridge")
        ip("-n", sw, "link", "set", "br0", "up")
        for i, host in enumerate(self.hosts.values()):
            ip("netns", "add", host.netns)
            # both ends made inside the namespaces: nothing of the cluster ever appears on this machine's own
            ip("-n", sw, "link", "add", f"port{i}", "type", "veth", "peer", "name", "eth0", "netns", host.netns)
            ip("-n", sw, "link", "set", f"port{i}", "master", "br0")
            ip("-n", sw, "link", "set", f"port{i}", "up")
            ip("-n", host.netns, "addr", "add", f"{host.address}/24", "dev", "eth0")
            ip("-n", host.netns, "link", "set", "eth0", "up")
            ip("-n", host.netns, "link", "set", "lo", "up")

    def _start(self, host: Host, watch_r: int) -> None:
        binds = [[str(host.dir / "home"), "/root", "dir"], [str(host.dir / "tmp"), "/tmp", "dir"],
                 [str(host.dir / "srv"), "/srv", "dir"], [str(host.dir / "hosts"), "/etc/hosts", "file"]]
        for shared in [REPO, *_shared_software()]:
            binds.append([str(shared), str(shared), "dir"])
        spec = {"hostname": host.name, "binds": binds, "tmpfs": ["/dev/shm"], "address": host.address,
                "sshd": [SSHD, "-D", "-e", "-f", "/root/.sshd/sshd_config"], "watch_fd": watch_r}
        log = open(host.dir / "init.log", "ab")
        host.init = subprocess.Popen(
            ["ip", "netns", "exec", host.netns, "unshare", "--mount", "--uts", "--pid", "--fork", "--mount-proc",
             "--propagation", "private", sys.executable, str(REPO / "tests" / "cluster_host.py"), json.dumps(spec)],
            stdout=subprocess.PIPE, stderr=log, stdin=subprocess.DEVNULL, pass_fds=(watch_r,), start_new_session=True)

    def _wait_ready(self, host: Host) -> None:
        assert host.init is not None and host.init.stdout is not None
        line = host.init.stdout.readline().decode().strip()
        if line != "ready":
            raise RuntimeError(f"{host.name} did not start ({line or 'no word'}); see {host.dir / 'init.log'}:\n"
                               + (host.dir / "init.log").read_text()[-2000:])
        # its PID 1: the child of `unshare` (which `ip netns exec` became)
        children = Path(f"/proc/{host.init.pid}/task/{host.init.pid}/children").read_text().split()
        host.pid = int(children[0])

    def down(self) -> None:
        """Kill every host (its PID 1, and with it everything it ran), remove the namespaces and folders."""
        if self._watch_w is not None:
            os.close(self._watch_w)  # each PID 1 sees it and exits
            self._watch_w = None
        for host in self.hosts.values():
            if host.pid:
                try:
                    os.kill(host.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            if host.init is not None:
                try:
                    host.init.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    host.init.kill()
                    host.init.wait()
        for ns in [h.netns for h in self.hosts.values()] + [f"{self.tag}-sw"]:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        shutil.rmtree(self.root, ignore_errors=True)

    # ------------------------------------------------------------------ using it

    def host(self, letter: str) -> Host:
        return self.hosts[letter]

    def enter(self, letter: str, cwd: str = "/srv") -> list[str]:
        """The command prefix that runs a command on host `letter` (its network, mounts, PIDs, name)."""
        return ["nsenter", "-t", str(self.hosts[letter].pid), "-n", "-m", "-u", "-p", f"--wd={cwd}", "--"]

    def env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        """A host's login environment (as sshd gives one), plus `extra`: nothing of this process's own."""
        return {"HOME": "/root", "USER": "root", "LOGNAME": "root", "PATH": f"{REPO / '.venv' / 'bin'}:{PATH}",
                "LANG": "C.UTF-8", **(extra or {})}

    def run(self, letter: str, cmd: list[str] | str, env: dict[str, str] | None = None, timeout: float = 120,
            check: bool = True, cwd: str = "/srv", input: str | None = None) -> subprocess.CompletedProcess:
        args = ["bash", "-c", cmd] if isinstance(cmd, str) else cmd
        out = subprocess.run(self.enter(letter, cwd) + args, env=self.env(env), capture_output=True, text=True,
                             timeout=timeout, input=input)
        if check and out.returncode != 0:
            raise RuntimeError(f"on host-{letter}: {shlex.join(args)} exited with code {out.returncode}:\n"
                               f"{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
        return out

    def popen(self, letter: str, cmd: list[str], env: dict[str, str] | None = None, log: Path | None = None,
              cwd: str = "/srv") -> subprocess.Popen:
        out = open(log, "ab") if log else subprocess.DEVNULL
        return subprocess.Popen(self.enter(letter, cwd) + cmd, env=self.env(env), stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)

    def processes(self, letter: str) -> list[tuple[int, str]]:
        """(pid, command line) of every process on host `letter` but its PID 1 and its sshd's listener."""
        out = self.run(letter, ["ps", "-eo", "pid=,args="], timeout=30).stdout
        procs = []
        for line in out.splitlines():
            pid, _, args = line.strip().partition(" ")
            if pid == "1" or args.startswith((f"{SSHD} -D", "sshd: /usr/sbin/sshd -D", "ps -eo")):
                continue
            procs.append((int(pid), args.strip()))
        return procs

    def link(self, letter: str, up: bool) -> None:
        """Plug host `letter`'s cable in or pull it out (its eth0 up or down)."""
        subprocess.run(["ip", "-n", self.hosts[letter].netns, "link", "set", "eth0", "up" if up else "down"],
                       check=True, capture_output=True)


def main() -> int:
    root = Path(tempfile.mkdtemp(prefix="posttrain-cluster-", dir="/var/tmp"))
    cluster = Cluster(root)
    try:
        cluster.up()
    except ClusterUnavailable as exc:
        print(f"make cluster: {exc}", file=sys.stderr)
        return 2
    try:
        a = cluster.host("a")
        python = str(REPO / ".venv" / "bin" / "python")
        # host A's shared service: an S3 store (moto) every host reaches at its address
        cluster.popen("a", [python, "-m", "moto.server", "-H", a.address, "-p", "9000"], log=root / "moto.log")
        s3 = {"AWS_ENDPOINT_URL": f"http://{a.address}:9000", "AWS_ACCESS_KEY_ID": "cluster",
              "AWS_SECRET_ACCESS_KEY": "cluster", "AWS_DEFAULT_REGION": "us-east-1"}
        make_bucket = ("import time, boto3\nfor _ in range(600):\n    try:\n        boto3.client('s3').create_bucket("
                       "Bucket='posttrain'); break\n    except Exception: time.sleep(0.1)\n")
        cluster.run("a", [python, "-c", make_bucket], env=s3)
        cluster.run("a", "printf 'host-a slots=1\\nhost-b slots=1\\nhost-c slots=1\\n' > /srv/hostfile")
        print(f"cluster up ({root}):")
        for h in cluster.hosts.values():
            print(f"  {h.name}  {h.address}   shell: nsenter -t {h.pid} -n -m -u -p --wd=/srv -- bash -l")
        print(f"host A serves S3 (moto, bucket 'posttrain'); in a host's shell:\n  export "
              + " ".join(f"{k}={v}" for k, v in s3.items()))
        print("  posttrain sft --set artifact_root=s3://posttrain/runs --set sft.deepspeed.nodes=2 "
              "--set sft.deepspeed.hostfile=/srv/hostfile --set sft.deepspeed.interface=eth0   # on host A")
        print("from a host: ssh host-b, pdsh -R ssh -w host-a,host-b hostname; Ctrl-C tears it all down.", flush=True)
        while all(h.init is not None and h.init.poll() is None for h in cluster.hosts.values()):
            time.sleep(1)
        print("a host's PID 1 exited; tearing down", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        cluster.down()


if __name__ == "__main__":
    sys.exit(main())
