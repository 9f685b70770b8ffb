"""Several machines, simulated: three hosts (network, mount, PID and UTS namespaces, tests/cluster.py)
on one bridge, each with its own sshd, /tmp, home and working folder; host A runs moto's S3 server,
the artifact store every host shares (no host sees another's disk). DeepSpeed's own runner fans the
ranks out over ssh/pdsh from its hostfile, gloo on eth0.

- one rank on each of two hosts gives the weights of two ranks on one host, bit for bit (SFT, GRPO);
- a rank SIGKILLed on host B, and host B's cable pulled, each fail the stage within the configured
  bound, naming the host and the rank, leave no posttrain process on any host, and a retry resumes
  from the last checkpoint committed in S3 and ends bit-identical to the uninterrupted run;
- a host that cannot run the ranks (unreachable, no Python there, another source) is refused by
  --dry-run and by the stage's preflight before anything starts;
- host B continues host A's GRPO from its checkpoint in S3;
- an SGLang server on host C (behind trainer/inference/rollout_host.py) serves the rounds of ranks on
  hosts A and B, each round's weights staged through S3.

The cluster is built once for the module (about a second); every posttrain command runs on host A.
Skipped, with the reason, where namespaces cannot be made (not root, no sshd or pdsh: `make
test-cluster` installs them).
"""

from __future__ import annotations

import json
import re
import subprocess
import threading
import time
import uuid

import pytest

from tests import cluster as cl
from tests.test_multirank import BASE

pytestmark = [pytest.mark.slow, pytest.mark.skipif(cl.unavailable() is not None, reason=f"no simulated cluster "
                                                   f"here: {cl.unavailable()} (make test-cluster installs sshd and pdsh)")]

PY = str(cl.REPO / ".venv" / "bin" / "python")
S3_PORT = 9000
PREFECT_PORT = 4300  # the module's Prefect server on host A (`make serve`'s test takes 4200 there)
BUCKET = "posttrain"
SECRET = f"cluster-{uuid.uuid4().hex}"
TIMEOUT_S = 20  # deepspeed.collective_timeout_s: how long a lost host can hold up the stage
HOSTFILE = "/srv/hostfile"
ONE_HOST = ["sft.grad_accum=1", "sft.deepspeed.ranks_per_node=2", "grpo.deepspeed.ranks_per_node=2"]
TWO_HOSTS = ["sft.grad_accum=1"] + [f"{s}.deepspeed.{k}" for s in ("sft", "grpo") for k in (
    "nodes=2", f"hostfile={HOSTFILE}", "interface=eth0", f"collective_timeout_s={TIMEOUT_S}")]
STAGES = ("prepare_data", "tokenizer", "sft")


KEYS: dict[str, str] = {}  # the S3 store's access key, made by the fixture (moto checks every request's signature)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = cl.Cluster(tmp_path_factory.mktemp("cluster"))
    c.up()
    a = c.host("a")
    try:
        # one Prefect server on host A for every posttrain command of the module, on any host, as a
        # cluster's users would have (each command would otherwise start a temporary one of its own)
        c.popen("a", [str(cl.REPO / ".venv" / "bin" / "prefect"), "server", "start", "--host", a.address, "--port",
                      str(PREFECT_PORT), "--no-ui", "--no-services", "--analytics-off"],
                log=c.root / "prefect-server.log", env={"PREFECT_HOME": "/srv/prefect-module"})
        # moto authenticates every request after the first three (the user, its key and its policy)
        c.popen("a", [PY, "-m", "moto.server", "-H", a.address, "-p", str(S3_PORT)], log=c.root / "moto.log",
                env={"INITIAL_NO_AUTH_ACTION_COUNT": "3"})
        KEYS.update(json.loads(c.run("a", [PY, "-c", _WAIT_AND_MAKE_BUCKET], env=env(c), timeout=120).stdout))
        c.run("a", [PY, "-c", _WAIT_HEALTHY, f"http://{a.address}:{PREFECT_PORT}/api/health"], timeout=300)
        for letter in c.hosts:  # the same hostfile on every host: each puts itself first
            c.run(letter, f"printf 'host-a slots=1\\nhost-b slots=1\\nhost-c slots=1\\n' > {HOSTFILE}")
        yield c
    finally:
        c.down()


_WAIT_HEALTHY = """
import sys, time, urllib.request
for _ in range(1200):
    try:
        if urllib.request.urlopen(sys.argv[1], timeout=2).status == 200:
            break
    except OSError:
        pass
    time.sleep(0.25)
else:
    raise SystemExit(sys.argv[1] + " did not answer")
"""

_WAIT_AND_MAKE_BUCKET = f"""
import json, time, boto3
iam = boto3.client("iam")
for _ in range(600):
    try:
        iam.create_user(UserName="posttrain")
        break
    except Exception:
        time.sleep(0.1)
else:
    raise SystemExit("moto did not start")
key = iam.create_access_key(UserName="posttrain")["AccessKey"]
policy = {{"Version": "2012-10-17", "Statement": [{{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}}]}}
iam.put_user_policy(UserName="posttrain", PolicyName="s3", PolicyDocument=json.dumps(policy))
boto3.client("s3", aws_access_key_id=key["AccessKeyId"], aws_secret_access_key=key["SecretAccessKey"]).create_bucket(
    Bucket="{BUCKET}")
print(json.dumps({{"id": key["AccessKeyId"], "secret": key["SecretAccessKey"]}}))
"""


def env(c: cl.Cluster, extra: dict[str, str] | None = None) -> dict[str, str]:
    """What a user's shell on host A holds: the S3 store's address and keys, one thread a rank (as two
    local ranks on a 2-core host get: the same numerics on one host and on two), the tests importable
    (the module's reward)."""
    return {"AWS_ENDPOINT_URL": f"http://{c.host('a').address}:{S3_PORT}",
            "AWS_ACCESS_KEY_ID": KEYS.get("id", "bootstrap"), "AWS_SECRET_ACCESS_KEY": KEYS.get("secret", SECRET),
            "AWS_DEFAULT_REGION": "us-east-1", "OMP_NUM_THREADS": "1",
            "PYTHONPATH": str(cl.REPO), "MLFLOW_TRACKING_URI": "sqlite:////srv/mlflow.db",
            "PREFECT_API_URL": f"http://{c.host('a').address}:{PREFECT_PORT}/api", **(extra or {})}


class Run:
    """A posttrain command on host A, its output read line by line as it comes (each with the time it
    came), so that a test can act at a point of the run."""

    def __init__(self, c: cl.Cluster, args: list[str], extra_env: dict[str, str] | None = None,
                 on: str = "a") -> None:
        self.lines: list[tuple[float, str]] = []
        self.json = f"/srv/result-{uuid.uuid4().hex[:8]}.json"
        self.on = on
        cmd = [str(cl.REPO / ".venv" / "bin" / "posttrain"), *args, "--json", self.json]
        self.proc = subprocess.Popen(c.enter(on) + cmd, env=c.env(env(c, extra_env)), stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True,
                                     start_new_session=True)
        self.c = c
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append((time.monotonic(), line.rstrip("\n")))

    def wait_for(self, pattern: str, timeout: float = 900) -> float:
        """The time the first line matching `pattern` came."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for t, line in list(self.lines):
                if re.search(pattern, line):
                    return t
            if self.proc.poll() is not None and not self._reader.is_alive():
                raise AssertionError(f"the run ended before {pattern!r}:\n{self.text()[-6000:]}")
            time.sleep(0.1)
        raise AssertionError(f"no line matching {pattern!r} within {timeout:.0f}s:\n{self.text()[-6000:]}")

    def finish(self, timeout: float = 1500) -> int:
        code = self.proc.wait(timeout=timeout)
        self._reader.join(timeout=30)
        self.ended = time.monotonic()
        return code

    def text(self) -> str:
        return "\n".join(line for _, line in self.lines)

    def result(self) -> dict:
        return json.loads(self.c.run(self.on, ["cat", self.json]).stdout)


def posttrain(c: cl.Cluster, command: str, root: str, extra: list[str], env_extra: dict | None = None,
              expect_ok: bool = True, flags: tuple[str, ...] = (), on: str = "a") -> Run:
    sets = [a for o in BASE + [f"artifact_root=s3://{BUCKET}/{root}"] + extra for a in ("--set", o)]
    run = Run(c, [command, "--preset", "tiny", *flags, *sets], env_extra, on=on)
    code = run.finish()
    if expect_ok:
        assert code == 0, f"posttrain {command} on {root} exited with code {code}:\n{run.text()[-8000:]}"
    else:
        assert code != 0, f"posttrain {command} on {root} should have failed:\n{run.text()[-4000:]}"
    return run


def s3_json(c: cl.Cluster, url: str) -> dict:
    code = f"import json, s3fs; print(json.dumps(json.loads(s3fs.S3FileSystem().cat({url!r}))))"
    return json.loads(c.run("a", [PY, "-c", code], env=env(c)).stdout)


def s3_list(c: cl.Cluster, url: str) -> list[str]:
    code = f"import json, s3fs; print(json.dumps(s3fs.S3FileSystem().find({url!r})))"
    return json.loads(c.run("a", [PY, "-c", code], env=env(c)).stdout)


def seed(c: cl.Cluster, source: str, dest: str) -> None:
    """Copy the committed upstream results (data, tokenizer, SFT) of one root to another, each
    manifest's uri pointing at its copy: a run on `dest` finds them as cache hits."""
    code = f"""
import json, s3fs
fs = s3fs.S3FileSystem()
src, dst = "{BUCKET}/{source}", "{BUCKET}/{dest}"
for stage in {STAGES!r}:
    for m in fs.glob(f"{{src}}/{{stage}}/*/manifest.json"):
        folder = m.rsplit("/", 1)[0]
        for f in fs.find(folder):
            if "/checkpoints/" not in f:
                fs.copy(f, dst + f[len(src):])
        copy = dst + m[len(src):]
        manifest = json.loads(fs.cat(copy))
        fs.pipe(copy, json.dumps({{**manifest, "uri": "s3://" + copy.rsplit("/", 1)[0]}}).encode())
"""
    c.run("a", [PY, "-c", code], env=env(c), timeout=300)


def stage(result: dict, name: str) -> dict:
    return next(s for s in result["stages"] if s["stage"] == name)


def manifest(c: cl.Cluster, result: dict, name: str) -> dict:
    return s3_json(c, stage(result, name)["uri"] + "/manifest.json")


def state_hash(c: cl.Cluster, result: dict, name: str) -> str:
    m = manifest(c, result, name)
    return m["result"]["state_hash"] if name == "sft" else m["state_hash"]


def posttrain_processes(c: cl.Cluster, letter: str, wait_s: float = 30.0) -> list[tuple[int, str]]:
    """Host `letter`'s posttrain processes (ranks, launchers, wrappers), waited for up to `wait_s`: a
    killed process leaves the table a moment after its signal. Host A's S3 and Prefect servers are not."""
    deadline = time.monotonic() + wait_s
    services = ("moto.server", "prefect server start", "uvicorn", "prefect.server")
    while True:
        left = [(pid, args) for pid, args in c.processes(letter)
                if "python" in args and not any(s in args for s in services) or "pdsh" in args or "deepspeed" in args]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.5)


# ---------------------------------------------------------------- the cluster itself


def test_hosts_are_separate_machines_on_an_isolated_network(cluster):
    for letter, host in cluster.hosts.items():
        assert cluster.run(letter, ["hostname"]).stdout.strip() == host.name
        routes = cluster.run(letter, ["ip", "-4", "route"]).stdout.strip().splitlines()
        assert routes == [f"198.18.0.0/24 dev eth0 proto kernel scope link src {host.address}"], routes
        # its own /srv: what one host writes there, no other sees
        cluster.run(letter, f"echo {letter} > /srv/mine")
    for letter in cluster.hosts:
        assert cluster.run(letter, ["cat", "/srv/mine"]).stdout.strip() == letter
    # the hosts reach each other over ssh (keys only), and nothing beyond the bridge
    assert cluster.run("a", ["ssh", "host-b", "hostname"]).stdout.strip() == "host-b"
    assert cluster.run("a", ["pdsh", "-R", "ssh", "-w", "host-b,host-c", "hostname"]).stdout.count("host-") == 4
    probe = "import socket; socket.create_connection(('1.1.1.1', 80), timeout=5)"
    out = cluster.run("b", [PY, "-c", probe], check=False)
    assert out.returncode != 0 and "Network is unreachable" in out.stderr, out.stderr


# ---------------------------------------------------------------- stages across hosts


@pytest.fixture(scope="module")
def one_host(cluster):
    """SFT and GRPO with two ranks on host A: the reference."""
    run = posttrain(cluster, "grpo", "one", ONE_HOST)
    return run.result()


@pytest.fixture(scope="module")
def two_hosts(cluster):
    """SFT and GRPO with one rank on host A and one on host B."""
    run = posttrain(cluster, "grpo", "two", TWO_HOSTS)
    return run, run.result()


def test_two_hosts_train_the_weights_of_two_ranks_on_one_host(cluster, one_host, two_hosts):
    run, result = two_hosts
    for name in ("sft", "grpo"):
        assert not stage(result, name)["cache_hit"]
        assert state_hash(cluster, result, name) == state_hash(cluster, one_host, name), name
    # each rank's output reaches the task's log, prefixed by its host (pdsh) and rank (trainer.hosts)
    text = run.text()
    assert re.search(r"host-b: \[rank 1\] ", text), text[-4000:]
    assert re.search(r"posttrain-rank-status rank=1 host=host-b ok", text), text[-4000:]
    # the checkpoints travel through S3 (marker last); host B keeps nothing of the launch
    files = s3_list(cluster, stage(result, "grpo")["uri"] + "/checkpoints")
    assert [f for f in files if f.endswith("/COMMITTED")], files
    assert not posttrain_processes(cluster, "b")
    assert cluster.run("b", "ls /root/.cache/posttrain/launches 2>/dev/null | wc -l").stdout.strip() == "0"
    timings = {k: round(stage(r, "grpo")["wall_seconds"], 1) for k, r in
               (("one host", one_host), ("two hosts", result))}
    print(f"GRPO stage seconds: {timings}")


def test_a_cached_result_is_the_same_on_one_host_or_two(cluster, two_hosts):
    """Where the ranks run is not part of the key: two ranks on host A hit two hosts' results."""
    run = posttrain(cluster, "grpo", "two", ONE_HOST)
    assert all(s["cache_hit"] for s in run.result()["stages"]), run.result()["stages"]


# ---------------------------------------------------------------- a lost host costs a retry


def _failed_cleanly(c: cl.Cluster, run: Run, fault_at: float, root: str) -> float:
    seconds = run.ended - fault_at
    text = run.text()
    assert "rank 1 on host-b" in text, text[-6000:]
    # within the bound: the collective timeout, the launcher's grace and ssh's dead-peer check
    assert seconds < TIMEOUT_S + 30 + 60, seconds
    for letter in ("a", "b"):
        assert not posttrain_processes(c, letter, wait_s=TIMEOUT_S + 30), (letter, c.processes(letter))
    # in S3 no result, and only committed checkpoints (each marker lists what is there)
    ckpts = f"{BUCKET}/{root}/grpo"
    files = s3_list(c, ckpts)
    assert not [f for f in files if f.endswith("/manifest.json")], files
    return seconds


def test_a_lost_host_fails_the_stage_and_a_retry_resumes_bit_identical(cluster, one_host, two_hosts):
    """Two faults in a row on one root, each failing the stage: the rank on host B SIGKILLed after
    round 3's update (before its checkpoint), then, in the retry (resumed from round 2), host B's
    cable pulled as round 3 starts. The third try resumes from round 2 and ends on the
    uninterrupted run's weights."""
    root = "fault"
    seed(cluster, "two", root)
    sets = [a for o in BASE + [f"artifact_root=s3://{BUCKET}/{root}"] + TWO_HOSTS for a in ("--set", o)]

    def faulted(env: dict, fault) -> tuple[Run, float]:
        """A try of the stage, `fault` done to it once it is under way; how long after the fault it
        failed (cleanly: `_failed_cleanly`)."""
        run = Run(cluster, ["grpo", "--preset", "tiny", *sets], env)
        try:
            fault_at = fault(run)
            code = run.finish()
        finally:
            cluster.link("b", True)
        assert code != 0, run.text()[-4000:]
        return run, _failed_cleanly(cluster, run, fault_at, root)

    def pull_cable(run: Run) -> float:
        run.wait_for(r"round 3")
        cluster.link("b", False)
        return time.monotonic()

    _, killed = faulted({"POSTTRAIN_FAULT": "grpo_after_update@3:kill:1"},
                        lambda run: run.wait_for(r"rank=1 host=host-b killed by signal 9"))
    run, pulled = faulted({}, pull_cable)
    assert "resumed" in run.text(), run.text()[-4000:]  # it had resumed from the kill's last checkpoint

    retry = posttrain(cluster, "grpo", root, TWO_HOSTS)
    result = retry.result()
    assert "resumed" in retry.text(), retry.text()[-4000:]
    m = manifest(cluster, result, "grpo")
    assert m["resumed_from_round"] == 2, m
    assert state_hash(cluster, result, "grpo") == state_hash(cluster, one_host, "grpo")
    print(f"failed {killed:.1f}s after a SIGKILLed rank, {pulled:.1f}s after a pulled cable; the retry "
          f"resumed from round 2, state {state_hash(cluster, result, 'grpo')} = uninterrupted")


def test_a_host_that_cannot_run_the_ranks_is_refused_before_anything_starts(cluster, two_hosts):
    """Host B unreachable, host C without the Python or with other sources: --dry-run names each,
    and the stage's own preflight refuses before it starts a rank."""
    c = cluster
    c.run("a", f"printf 'host-a slots=1\\nhost-b slots=1\\n' > /srv/hostfile-ab; "
               f"printf 'host-a slots=1\\nhost-c slots=1\\n' > /srv/hostfile-ac")
    ab = [o.replace(HOSTFILE, "/srv/hostfile-ab") for o in TWO_HOSTS]
    ac = [o.replace(HOSTFILE, "/srv/hostfile-ac") for o in TWO_HOSTS]
    c.link("b", False)
    try:
        dry = posttrain(c, "grpo", "two", ab, expect_ok=False, flags=("--dry-run",))
        assert re.search(r"host-b: ssh failed", dry.text()), dry.text()[-3000:]
        root = "unreachable"
        seed(c, "two", root)
        t0 = time.monotonic()
        run = posttrain(c, "grpo", root, ab, expect_ok=False)
        assert re.search(r"host-b: ssh failed.*nothing was started|nothing was started[\s\S]*host-b: ssh failed",
                         run.text()), run.text()[-3000:]
        assert not [f for f in s3_list(c, f"{BUCKET}/{root}/grpo") if "/checkpoints/" in f]
        print(f"unreachable host refused in {time.monotonic() - t0:.1f}s")
    finally:
        c.link("b", True)
    # host C runs other sources (one file edited there), then has no Python at this path
    c.run("c", f"cp -r {cl.REPO}/trainer /tmp/trainer && echo '# edited' >> /tmp/trainer/hosts.py && "
               f"mount --bind /tmp/trainer {cl.REPO}/trainer")
    try:
        dry = posttrain(c, "grpo", "two", ac, expect_ok=False, flags=("--dry-run",))
        assert re.search(r"host-c runs posttrain source \w+, this machine \w+", dry.text()), dry.text()[-3000:]
    finally:
        c.run("c", f"umount {cl.REPO}/trainer")
    c.run("c", f"mkdir -p /tmp/empty && mount --bind /tmp/empty {cl.REPO}/.venv")
    try:
        dry = posttrain(c, "grpo", "two", ac, expect_ok=False, flags=("--dry-run",))
        assert re.search(r"host-c: there is no Python at \S+ there", dry.text()), dry.text()[-3000:]
    finally:
        c.run("c", f"umount {cl.REPO}/.venv")


# ---------------------------------------------------------------- any host runs any stage


def test_more_rounds_asked_on_host_b_continue_from_host_a_checkpoint(cluster, two_hosts):
    """Host B (its own disk, its own MLflow store) asks the same GRPO for 6 rounds: the upstream
    stages are cache hits read from S3, and GRPO continues from round 4's checkpoint, which host A's
    rank 0 committed there; rank 0 now runs on host B, rank 1 on host A."""
    _, before = two_hosts
    grpo_uri = stage(before, "grpo")["uri"]
    history_before = s3_json(cluster, grpo_uri + "/manifest.json")
    run = posttrain(cluster, "grpo", "two", TWO_HOSTS + ["grpo.rounds=6"], on="b")
    result = run.result()
    assert all(stage(result, s)["cache_hit"] for s in STAGES), result["stages"]
    assert not stage(result, "grpo")["cache_hit"] and stage(result, "grpo")["uri"] == grpo_uri
    assert re.search(r"continuing the result at \S+ from 4 to 6, from the checkpoint step\w+ committed at s3://",
                     run.text()), run.text()[-4000:]
    assert re.search(r"host-a: \[rank 1\] ", run.text()), run.text()[-4000:]
    m = manifest(cluster, result, "grpo")
    assert m["resumed_from_round"] == 4 and m["state_hash"] != history_before["state_hash"], m
    code = f"import s3fs; print(s3fs.S3FileSystem().cat({grpo_uri + '/history.jsonl'!r}).decode())"
    rounds = [json.loads(line) for line in cluster.run("b", [PY, "-c", code], env=env(cluster)).stdout.splitlines()
              if line.strip()]
    assert [h["round"] for h in rounds] == list(range(1, 7)) or len(rounds) == 6, rounds


# ---------------------------------------------------------------- rollouts on another host


def test_rollouts_on_host_c_get_each_rounds_weights_through_s3(cluster, two_hosts):
    """GRPO's ranks on hosts A and B, its SGLang server on host C behind posttrain's front
    (trainer/inference/rollout_host.py): host C shares no disk with them, so each round's weights go
    up to S3 (READY marker last) and host C's front downloads and loads them under the round's
    version, which every reply is checked against. Nothing is left in the store afterwards."""
    c = cluster
    _, result = two_hosts
    sft = manifest(c, result, "sft")
    front_url = f"http://{c.host('c').address}:30000"
    standin = cl.REPO / "tests" / "sglang_cpu"
    front = c.popen("c", [PY, "-m", "trainer.inference.rollout_host", "--model",
                          f"{sft['uri']}/{sft['model_subdir']}", "--listen", f"{c.host('c').address}:30000",
                          "--device", "cpu", "--dtype", "float32"],
                    env=env(c, {"PYTHONPATH": f"{cl.REPO}:{standin}", "OMP_NUM_THREADS": "2"}),
                    log=c.root / "rollout-host-c.log")
    try:
        c.run("a", [PY, "-c", _WAIT_HEALTHY, f"{front_url}/health"], timeout=400)
        root = "rollouts-c"
        seed(c, "two", root)
        run = posttrain(c, "grpo", root, TWO_HOSTS + [
            "rollout.engine=sglang", f'rollout.sglang.urls=["{front_url}"]', "rollout.sglang.weight_sync=store",
            "rollout.sglang.request_timeout_s=300", "eval.engine=hf"])
        out = run.result()
        code = f"import s3fs; print(s3fs.S3FileSystem().cat({stage(out, 'grpo')['uri'] + '/history.jsonl'!r}).decode())"
        rounds = [json.loads(x) for x in c.run("a", [PY, "-c", code], env=env(c)).stdout.splitlines() if x.strip()]
        assert len(rounds) == 4 and all(r["time/weights_upload_seconds"] > 0 and r["rollout/weights_mb"] > 0
                                        for r in rounds), rounds
        log = (c.root / "rollout-host-c.log").read_text()
        loaded = re.findall(r"loaded (\S+@\d+) from s3://", log)
        assert [v.rsplit("@", 1)[1] for v in loaded] == ["0", "1", "2", "3", "4"][-len(loaded):] and len(loaded) >= 4, log
        # no round's folder stays in the store
        assert not s3_list(c, f"{BUCKET}/{root}/rollout-weights"), s3_list(c, f"{BUCKET}/{root}/rollout-weights")
        parts = {k: sorted(r[f"time/weights_{k}_seconds"] for r in rounds) for k in ("upload", "download", "load")}
        print(f"weights to host C per round ({rounds[0]['rollout/weights_mb']:.2f} MB): " + ", ".join(
            f"{k} median {v[len(v) // 2]:.2f}s" for k, v in parts.items())
              + f"; sync {sorted(r['time/sync_seconds'] for r in rounds)[2]:.2f}s")
    finally:
        c.run("c", "pkill -TERM -f 'trainer[.]inference[.]rollout_host' || true")  # not this shell's own line
        front.wait(timeout=60)
    # the front stopped its SGLang server with itself, and left no scratch folder
    assert not [p for p in c.processes("c") if "sglang" in p[1] or "rollout_host" in p[1]], c.processes("c")
    assert c.run("c", "ls -d /tmp/posttrain-rollout-host-* 2>/dev/null | wc -l").stdout.strip() == "0"


# ---------------------------------------------------------------- any host runs any flow


_DEPLOYMENT_RUN = """
import asyncio, json, subprocess, sys, time
from mlflow import MlflowClient
from prefect.client.orchestration import get_client

args = json.loads(sys.argv[1])

async def final(client, run_id):
    for _ in range(1200):
        run = await client.read_flow_run(run_id)
        if run.state is not None and run.state.is_final():
            return run
        await asyncio.sleep(1)
    raise SystemExit(f"flow run {run_id} not final after 20 min: {run.state}")

async def main():
    async with get_client() as client:
        if args.get("retry"):
            out = subprocess.run([sys.executable.replace("python", "prefect"), "flow-run", "retry", args["retry"]],
                                 capture_output=True, text=True)
            assert out.returncode == 0, out.stdout + out.stderr
            run_id = args["retry"]
        else:
            dep = await client.read_deployment_by_name(args["deployment"])
            run = await client.create_flow_run_from_deployment(dep.id, parameters=args["parameters"],
                                                               work_queue_name=args["queue"])
            run_id = run.id
        run = await final(client, run_id)
    ml = MlflowClient()
    exps = [e.experiment_id for e in ml.search_experiments()]
    # the flow run's parent MLflow run and its stages' children carry its id; a retry adds a newer parent
    tagged = ml.search_runs(exps, f"tags.`prefect.flow_run_id` = '{run_id}'", order_by=["attributes.start_time DESC"])
    parents = [r for r in tagged if "mlflow.parentRunId" not in r.data.tags]
    children = [r for r in tagged if parents and r.data.tags.get("mlflow.parentRunId") == parents[0].info.run_id]
    print(json.dumps({"id": str(run_id), "state": run.state.type.value, "run_count": run.run_count,
                      "queue": run.work_queue_name,
                      "stages": {c.data.tags["posttrain.stage"]: {k: c.data.tags.get(k) for k in (
                          "cache_hit", "resumed_from_round")} for c in children}}))

asyncio.run(main())
"""

_REFUSED_WITHOUT_CREDENTIALS = """
import base64, json, sys, urllib.request
a, auth, s3_object = sys.argv[1], sys.argv[2], sys.argv[3]

def status(url, data=None, user=None):
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    if user:
        req.add_header("Authorization", "Basic " + base64.b64encode(user.encode()).decode())
    try:
        return urllib.request.urlopen(req, timeout=20).status
    except urllib.error.HTTPError as e:
        return e.code

print(json.dumps({
    "prefect": status(f"http://{a}:4200/api/flows/filter", b"{}"),
    "prefect_wrong": status(f"http://{a}:4200/api/flows/filter", b"{}", "posttrain:not-the-password"),
    "prefect_ok": status(f"http://{a}:4200/api/flows/filter", b"{}", auth),
    "mlflow": status(f"http://{a}:5000/api/2.0/mlflow/experiments/search?max_results=5"),
    "mlflow_ok": status(f"http://{a}:5000/api/2.0/mlflow/experiments/search?max_results=5", user=auth),
    "s3": status(f"http://{a}:9000/{s3_object}"),
}))
"""


def test_workers_on_two_hosts_share_results_through_services_that_ask_for_credentials(cluster, two_hosts):
    """`make serve` on host A bound to its address (Prefect server, MLflow's basic-auth app, the work
    pool and a worker on queue host-a), a worker on host B (queue host-b), one S3 root:
    - from host B, the Prefect API, MLflow and S3 refuse a request without credentials;
    - GRPO run by host A's worker; host B's worker asked for the same with 6 rounds, failing once
      after round 5: every stage before GRPO a cache hit, and the Prefect run's retry continues
      from round 4's checkpoint, which host A's worker committed."""
    c = cluster
    a = c.host("a").address
    user, password = "posttrain", f"pw-{uuid.uuid4().hex}"
    clients = {"PREFECT_API_URL": f"http://{a}:4200/api", "PREFECT_API_AUTH_STRING": f"{user}:{password}",
               "MLFLOW_TRACKING_URI": f"http://{a}:5000", "MLFLOW_TRACKING_USERNAME": user,
               "MLFLOW_TRACKING_PASSWORD": password}
    serve = c.popen("a", [PY, "-m", "deployments.serve", "--host", a, "--queue", "host-a", "--logs", "/srv/serve"],
                    env=env(c, {"POSTTRAIN_SERVE_USER": user, "POSTTRAIN_SERVE_PASSWORD": password,
                                "PREFECT_HOME": "/srv/prefect", "MLFLOW_TRACKING_URI": "sqlite:////srv/served.db"}),
                    log=c.root / "serve-a.log")
    worker = None
    try:
        deadline = time.monotonic() + 300
        while "work pool:" not in (c.root / "serve-a.log").read_text():
            assert serve.poll() is None and time.monotonic() < deadline, (c.root / "serve-a.log").read_text()[-3000:]
            time.sleep(1)
        # an object that exists (moto answers an unsigned request for a missing key or a listing with a 500,
        # a bug of its own; S3 refuses it with a 403)
        s3_object = stage(two_hosts[1], "sft")["uri"].removeprefix("s3://") + "/manifest.json"
        codes = json.loads(c.run("b", [PY, "-c", _REFUSED_WITHOUT_CREDENTIALS, a, f"{user}:{password}",
                                       s3_object]).stdout)
        assert codes == {"prefect": 401, "prefect_wrong": 401, "prefect_ok": 200, "mlflow": 401, "mlflow_ok": 200,
                         "s3": 403}, codes
        worker = c.popen("b", [str(cl.REPO / ".venv" / "bin" / "prefect"), "worker", "start", "--pool",
                               "posttrain-local", "--type", "process", "--work-queue", "host-b"],
                         env=env(c, clients), log=c.root / "worker-b.log")
        root = "workers"
        seed(c, "two", root)
        overrides = BASE + ONE_HOST + [f"artifact_root=s3://{BUCKET}/{root}"]

        def deployment_run(on: str, queue: str, parameters: dict | None = None, retry: str | None = None) -> dict:
            spec = {"deployment": "grpo/grpo", "queue": queue, "parameters": parameters, "retry": retry}
            out = c.run(on, [PY, "-c", _DEPLOYMENT_RUN, json.dumps(spec)], env=env(c, clients), timeout=1300)
            return json.loads(out.stdout.strip().splitlines()[-1])

        first = deployment_run("a", "host-a", {"preset": "tiny", "overrides": overrides})
        assert first["state"] == "COMPLETED" and first["queue"] == "host-a", first
        assert first["stages"]["grpo"]["cache_hit"] == "False", first
        longer = deployment_run("b", "host-b", {"preset": "tiny", "overrides": overrides + ["grpo.rounds=6"],
                                                "fault": {"grpo_round": 5}})
        assert longer["state"] == "FAILED" and longer["queue"] == "host-b", longer
        assert longer["id"] in (c.root / "worker-b.log").read_text()  # host B's worker ran it
        # what host A's worker committed, host B's read: every stage before GRPO a cache hit
        assert all(longer["stages"][s]["cache_hit"] == "True" for s in STAGES), longer
        retried = deployment_run("b", "host-b", retry=longer["id"])
        assert retried["state"] == "COMPLETED" and retried["run_count"] == 2, retried
        assert retried["stages"]["grpo"] == {"cache_hit": "False", "resumed_from_round": "4"}, retried
    finally:
        for p in (worker, serve):
            if p is not None:
                p.terminate()  # the host's enter wrapper passes it on; what is left the teardown sweeps
        c.run("a", "pkill -TERM -f 'deployments[.]serve' || true")
        c.run("b", "pkill -TERM -f 'prefect [w]orker' || true")
        for p in (worker, serve):
            if p is not None:
                p.wait(timeout=60)
