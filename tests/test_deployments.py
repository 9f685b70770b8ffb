"""`make serve` for real: a Prefect server on loopback with its own PREFECT_HOME, the process work
pool and a worker, the MLflow UI, and the deployments from prefect.yaml. The tiny speedrun is
triggered through the API and run by the worker; a stage made to fail once is retried with
`prefect flow-run retry`, and only that stage runs again."""

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.seeded import seed
from tests.test_pipeline import SMALL

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow
DEPLOYMENTS = {"speedrun/speedrun-nightly", "speedrun/speedrun", "sft/sft", "grpo/grpo", "eval/eval"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def served(tmp_path_factory, migrated_stores):
    from deployments.serve import start

    home = migrated_stores.prefect_home(tmp_path_factory.mktemp("prefect-home"))
    env = dict(os.environ, PREFECT_HOME=str(home))
    env.pop("PREFECT_API_URL", None)
    services = start(free_port(), free_port(), env=env, logs=home / "logs")
    yield services
    services.stop()


def api(services, coro_fn):
    from prefect.client.orchestration import PrefectClient

    async def go():
        async with PrefectClient(services.prefect_url + "/api") as client:
            return await coro_fn(client)

    return asyncio.run(go())


def deployment(services, name: str):
    return api(services, lambda c: c.read_deployment_by_name(name))


def wait_final(services, run_id, timeout: float = 480):
    deadline = time.monotonic() + timeout
    while True:
        run = api(services, lambda c: c.read_flow_run(run_id))
        if run.state is not None and run.state.is_final():
            return run
        services.check()
        if time.monotonic() > deadline:
            raise AssertionError(f"flow run {run_id} still {run.state.name} after {timeout}s; "
                                 f"worker log: {(services.logs / 'prefect-worker.log').read_text()[-3000:]}")
        time.sleep(1)


def trigger(services, name: str, parameters: dict, env: dict[str, str] | None = None):
    """A flow run of deployment `name`; `env` added to its process's environment (a job variable)."""
    dep = deployment(services, name)
    job_variables = {"env": env} if env else None
    return api(services, lambda c: c.create_flow_run_from_deployment(dep.id, parameters=parameters,
                                                                     job_variables=job_variables))


def pipeline_runs(flow_run_id) -> list:
    """MLflow parent runs of one Prefect flow run, oldest first, each with its child runs."""
    from mlflow import MlflowClient

    client = MlflowClient()
    exps = [e.experiment_id for e in client.search_experiments()]
    parents = client.search_runs(exps, f"tags.`prefect.flow_run_id` = '{flow_run_id}' and tags.`posttrain.flow` = 'speedrun'",
                                 order_by=["attributes.start_time ASC"])
    out = []
    for p in parents:
        children = client.search_runs(exps, f"tags.mlflow.parentRunId = '{p.info.run_id}'",
                                      order_by=["attributes.start_time ASC"])
        out.append((p, children))
    return out


def test_serve_starts_everything_and_deploys(served):
    for url in (served.prefect_url + "/api/health", served.mlflow_url + "/health"):
        with urllib.request.urlopen(url, timeout=5) as r:
            assert r.status == 200, url
    for name in DEPLOYMENTS:
        assert deployment(served, name).work_pool_name == "posttrain-local", name
    pool = api(served, lambda c: c.read_work_pool("posttrain-local"))
    assert pool.type == "process"
    assert served.env["PREFECT_WORKER_QUERY_SECONDS"] == "2"  # a triggered run starts within about 2 s, not 10


def test_nightly_schedule_and_concurrency(served):
    dep = deployment(served, "speedrun/speedrun-nightly")
    assert len(dep.schedules) == 1
    sched = dep.schedules[0]
    assert sched.active and sched.schedule.cron == "0 3 * * *" and sched.schedule.timezone == "Europe/Berlin"
    assert dep.global_concurrency_limit is not None and dep.global_concurrency_limit.limit == 1
    assert dep.parameters == {"preset": "tiny", "nightly": True}
    assert dep.enforce_parameter_schema


@pytest.mark.parametrize("params,field", [
    ({"preset": "no-such-preset"}, "preset"),
    ({"overrides": ["sft.lr"]}, "overrides"),  # no '='
    ({"recompute": ["sfft"]}, "recompute"),
    ({"nightly": "sometimes"}, "nightly"),
])
def test_server_rejects_invalid_parameters(served, params, field):
    with pytest.raises(Exception) as exc:
        trigger(served, "speedrun/speedrun", params)
    assert "409" in str(exc.value) or "alidation" in str(exc.value), str(exc.value)
    assert field in str(exc.value) or "alidation" in str(exc.value)


def progress_lines(served, flow_run_id, wanted: list[str], wait_s: float = 30.0) -> list[str]:
    """The flow run's `trainer.progress` log lines once each of `wanted` begins one, or after
    `wait_s`: the worker's process sends its logs in batches, and a run's last ones may reach the
    server after the run's final state."""
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    deadline = time.monotonic() + wait_s
    while True:
        entries: list = []
        while len(entries) % 200 == 0:  # 200: the most the server returns per call
            page = api(served, lambda c: c.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])),
                                                     limit=200, offset=len(entries)))
            entries += page
            if not page:
                break
        said = [entry.message for entry in entries if entry.name == "trainer.progress"]
        if all(any(m.startswith(w) for m in said) for w in wanted) or time.monotonic() > deadline:
            return said
        time.sleep(0.5)


def test_triggered_run_completes_then_failed_stage_alone_reruns_on_retry(served, tmp_path, small_sft):
    """Long: three flow runs through the real worker (each a process of its own that imports torch,
    DeepSpeed, Prefect and MLflow), what a user's Run and Retry buttons do. The data, tokenizer and
    SFT are the session's (cache hits): the runs compute the evals and GRPO."""
    overrides = SMALL + [f"artifact_root={seed(small_sft, tmp_path / 'artifacts')}"]
    run = trigger(served, "speedrun/speedrun", {"preset": "tiny", "overrides": overrides})
    run = wait_final(served, run.id)
    assert run.state.is_completed(), run.state
    [(parent, children)] = pipeline_runs(run.id)
    assert parent.info.status == "FINISHED"
    assert {"sft_accuracy", "final_accuracy", "wall_seconds"} <= set(parent.data.metrics)
    assert [c.data.tags["posttrain.stage"] for c in children] == ["prepare_data", "tokenizer", "sft", "eval",
                                                                     "grpo", "eval"]
    # the ML core's progress reaches the flow run's log in the Prefect UI (no terminal here: log lines)
    wanted = [f"eval ({stage}) held-out: 40/40 answers (100%), " for stage in ("sft", "grpo")]  # as the summary names them
    said = progress_lines(served, run.id, wanted)
    assert [sum(m.startswith(w) for m in said) for w in wanted] == [1, 1], said
    # what `make serve` prints for MLflow: the runs table of the experiment the run went to
    from deployments.serve import runs_table

    assert runs_table(served).startswith(f"{served.mlflow_url}/#/experiments/{parent.info.experiment_id}/runs"
                                         "?workflowType=machine_learning&")
    assert runs_table(served, "no-such-experiment").startswith(f"{served.mlflow_url}/#/experiments   (")

    # Same data and SFT, a new GRPO setting; GRPO fails once after round 3 (its checkpoint: round 2).
    params = {"preset": "tiny", "overrides": overrides + ["grpo.lr=2e-3"], "fault": {"grpo_round": 3}}
    run = wait_final(served, trigger(served, "speedrun/speedrun", params).id)
    assert run.state.is_failed(), run.state
    out = subprocess.run([str(Path(sys.executable).parent / "prefect"), "flow-run", "retry", str(run.id)],
                         env=served.env, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    run = wait_final(served, run.id)
    assert run.state.is_completed(), run.state
    assert run.run_count == 2
    (failed, failed_children), (retried, children) = pipeline_runs(run.id)
    assert failed.info.status == "FAILED" and retried.info.status == "FINISHED"
    ran = [(c.data.tags["posttrain.stage"], c.data.tags["cache_hit"]) for c in children]
    assert ran == [("prepare_data", "True"), ("tokenizer", "True"), ("sft", "True"), ("eval", "True"),
                   ("grpo", "False"), ("eval", "False")]
    grpo = next(c for c in children if c.data.tags["posttrain.stage"] == "grpo")
    assert grpo.data.tags["resumed_from_round"] == "2"


def test_nightly_triggered_twice_at_once_runs_one_at_a_time(served, tmp_path, small_sft):
    """The nightly deployment's concurrency limit (1, ENQUEUE): the second run waits for a slot while
    the first runs (its evals and GRPO; the data, tokenizer and SFT are the session's), then completes
    with every stage from cache."""
    root = seed(small_sft, tmp_path / "artifacts")
    params = {"preset": "tiny", "nightly": True, "overrides": SMALL + [f"artifact_root={root}"]}
    first = trigger(served, "speedrun/speedrun-nightly", params)
    second = trigger(served, "speedrun/speedrun-nightly", params)
    waited = set()
    deadline = time.monotonic() + 480
    while True:
        a, b = (api(served, lambda c, i=r.id: c.read_flow_run(i)) for r in (first, second))
        if a.state.is_final() and b.state.is_final():
            break
        running = [r for r in (a, b) if r.state.is_running()]
        assert len(running) <= 1, "both nightly runs ran at once"
        for r in (a, b):
            if r.state.name == "AwaitingConcurrencySlot":
                waited.add(r.id)
        assert time.monotonic() < deadline, f"nightly runs not done: {a.state.name}, {b.state.name}"
        time.sleep(0.5)
    assert a.state.is_completed() and b.state.is_completed(), (a.state, b.state)
    assert waited, "neither run waited for the concurrency slot"
    later = max((a, b), key=lambda r: r.start_time)
    [(parent, children)] = pipeline_runs(later.id)
    assert [c.data.tags["cache_hit"] for c in children] == ["True"] * 6
    assert parent.data.tags["posttrain.nightly"] == "true"


def run_processes(marker: str) -> list[int]:
    """Pids of processes whose command line mentions `marker` (a test's own folder)."""
    import psutil

    pids = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if any(marker in c for c in p.info["cmdline"] or []):
                pids.append(p.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return pids


def assert_loopback_only(pids: list[int]) -> None:
    """Every socket these processes (and their children) listen on is bound to 127.0.0.1."""
    import psutil

    listening = set()
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            for p in [proc, *proc.children(recursive=True)]:
                listening |= {(p.pid, " ".join(p.cmdline())[:80], c.laddr.ip) for c in p.net_connections(kind="inet")
                              if c.status == psutil.CONN_LISTEN}
        except psutil.NoSuchProcess:
            continue
    # The one known exception: SGLang's scheduler joins its own torch process group through a TCP
    # store, and torch's store has no bind address (it listens on every interface). Its HTTP API,
    # the only thing posttrain talks to, is on rollout.sglang.host (127.0.0.1).
    exposed = {x for x in listening if x[2] != "127.0.0.1" and not x[1].startswith("sglang::scheduler")}
    assert not exposed, exposed


def cancel_when(served, run_id, ready, marker: str, timeout: float = 480) -> tuple[float, float]:
    """Once `ready()`, cancel the flow run through the API; return (seconds until Prefect reports it
    Cancelled, seconds until no process of it is left)."""
    from prefect.states import Cancelling

    deadline = time.monotonic() + timeout
    while not ready():
        run = api(served, lambda c: c.read_flow_run(run_id))
        assert not run.state.is_final(), f"the run ended before it could be cancelled: {run.state}"
        assert time.monotonic() < deadline, "the run never got to the point of cancelling"
        time.sleep(0.3)
    run = api(served, lambda c: c.read_flow_run(run_id))
    pid = int(str(run.infrastructure_pid).rsplit(":", 1)[-1])
    assert run_processes(marker), "nothing of the run is running"
    assert_loopback_only([pid, *run_processes(marker)])
    t0 = time.monotonic()
    api(served, lambda c: c.set_flow_run_state(run_id, Cancelling(), force=True))
    cancelled = gone = None
    while cancelled is None or gone is None:
        if cancelled is None and api(served, lambda c: c.read_flow_run(run_id)).state.is_cancelled():
            cancelled = time.monotonic() - t0
        import psutil

        if gone is None and not run_processes(marker) and not psutil.pid_exists(pid):
            gone = time.monotonic() - t0
        assert time.monotonic() - t0 < 90, f"still alive 90 s after cancelling: {run_processes(marker)}"
        time.sleep(0.2)
    return cancelled, gone


def committed(folder_glob) -> list[int]:
    return sorted(int(p.parent.name[4:]) for p in folder_glob if p.name == "COMMITTED")


def cancel_mid_stage(served, deployment_name: str, stage: str, root: Path, overrides: list[str],
                     env: dict[str, str] | None = None):
    """Trigger the deployment, cancel it once its stage has a committed checkpoint; return the stop
    times, the stage folder and its committed checkpoints. Nothing may be committed."""
    run = trigger(served, deployment_name, {"preset": "tiny", "overrides": overrides}, env)

    def ready():
        return bool(committed(root.glob(f"{stage}/*/checkpoints/step*/COMMITTED")))

    cancelled, gone = cancel_when(served, run.id, ready, str(root))
    [folder] = root.glob(f"{stage}/*")
    assert not (folder / "manifest.json").exists()
    return cancelled, gone, folder, committed(folder.glob("checkpoints/step*/COMMITTED"))


def test_cancel_mid_sft_stops_the_launcher_and_ranks_then_rerun_resumes(served, tmp_path):
    """Long: a 2-rank SFT launched by a worker's flow run, cancelled through the API once a
    checkpoint commits, then run again; only a real launch shows every rank gone. The ranks hang
    after step 7 (POSTTRAIN_FAULT, in the flow run's environment), past the checkpoint of step 5:
    however late the cancel lands, they are still running, and the re-run trains steps 6-12 only."""
    root = tmp_path / "artifacts"
    overrides = SMALL + [f"artifact_root={root}", "sft.deepspeed.ranks_per_node=2", "sft.checkpoint_every=5",
                         "sft.micro_batch_size=8"]
    cancelled, gone, folder, steps = cancel_mid_stage(served, "sft/sft", "sft", root, overrides,
                                                      env={"POSTTRAIN_FAULT": "sft@7:hang"})
    assert steps == [5]
    print(f"\nmid-SFT (2 ranks): Cancelled after {cancelled:.1f}s, every process gone after {gone:.1f}s; "
          f"checkpoints {steps}")
    again = wait_final(served, trigger(served, "sft/sft", {"preset": "tiny", "overrides": overrides}).id)
    assert again.state.is_completed(), again.state
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["result"]["resumed_from_step"] == steps[-1]


def test_cancel_mid_grpo_stops_its_sglang_servers_then_rerun_resumes(served, tmp_path, small_sft):
    """Long: two SGLang CPU server starts (about a minute each on 2 cores) inside worker flow runs;
    a server outliving its cancelled run is what this guards against, and only a real one shows it."""
    from tests.test_sglang_pipeline import OVERRIDES as SGLANG

    root = seed(small_sft, tmp_path / "artifacts")  # the session's data, tokenizer and SFT: GRPO is tested here
    overrides = [o for o in SGLANG if not o.startswith("grpo.rounds=")] + [f"artifact_root={root}", "grpo.rounds=50"]
    cancelled, gone, folder, rounds = cancel_mid_stage(served, "grpo/grpo", "grpo", root, overrides)
    print(f"\nmid-GRPO (SGLang server): Cancelled after {cancelled:.1f}s, every process gone after {gone:.1f}s; "
          f"checkpoints at rounds {rounds}")
    # the re-run asks for one round more than the last checkpoint holds (rounds do not change the key)
    params = {"preset": "tiny", "overrides": overrides + [f"grpo.rounds={rounds[-1] + 1}"]}
    again = wait_final(served, trigger(served, "grpo/grpo", params).id)
    assert again.state.is_completed(), again.state
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["resumed_from_round"] == rounds[-1]


def test_serve_refuses_a_taken_port_and_binds_loopback(served, tmp_path):
    from deployments.serve import PortTaken, start

    port = int(served.prefect_url.rsplit(":", 1)[1])
    with pytest.raises(PortTaken, match=rf"port {port} on 127.0.0.1 is taken .*--prefect-port"):
        start(port, None, env=dict(served.env), logs=tmp_path)
    assert_loopback_only([proc.pid for proc in served.procs.values()])
    pool = api(served, lambda c: c.read_work_pool("posttrain-local"))
    assert pool.concurrency_limit == 2


def test_serve_stops_everything_on_sigterm_and_sighup(tmp_path, migrated_stores):
    """`make serve` under a process manager: SIGTERM (systemd, supervisord, docker stop) or SIGHUP
    to the serve process stops the Prefect server, the worker and the MLflow server, within the
    grace period plus a margin, and frees their ports. The two stacks start side by side (a start
    is about 30 s on the 2-core Zen 3 machine, alone), then each gets its signal in turn."""
    stacks = []
    try:
        for sig in (signal.SIGTERM, signal.SIGHUP):
            ports = [free_port(), free_port()]
            env = dict(os.environ, PREFECT_HOME=str(migrated_stores.prefect_home(tmp_path / f"home-{sig.name}")))
            env.pop("PREFECT_API_URL", None)
            env["MLFLOW_TRACKING_URI"] = migrated_stores.mlflow_db(tmp_path / f"mlflow-{sig.name}.db")  # a store each
            proc = subprocess.Popen([sys.executable, "-m", "deployments.serve", "--prefect-port", str(ports[0]),
                                     "--mlflow-port", str(ports[1])], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True, start_new_session=True)
            stacks.append((sig, ports, proc, []))
        for sig, ports, proc, groups in stacks:
            lines = []
            for line in proc.stdout:
                lines.append(line)
                if "stops everything" in line:
                    break
            else:
                raise AssertionError("make serve did not come up:\n" + "".join(lines)[-3000:])
            groups += _child_groups(proc.pid)
            assert len(groups) == 3, (groups, "".join(lines))  # prefect server, worker, mlflow server
        for sig, ports, proc, groups in stacks:
            t0 = time.monotonic()
            proc.send_signal(sig)
            rest = proc.communicate(timeout=60)[0]
            stopped = time.monotonic() - t0
            assert proc.returncode == 0, rest
            assert f"stopping ({sig.name})" in rest, rest
            print(f"make serve: {sig.name} -> everything stopped in {stopped:.1f} s")
            assert stopped < 15, stopped  # the 10 s grace, then SIGKILL
            deadline = time.monotonic() + 3  # SIGKILLed processes take a moment to exit, and init to reap them
            while (alive := {g: _members(g) for g in groups if _members(g)}) and time.monotonic() < deadline:
                time.sleep(0.1)
            assert not alive, f"process groups still alive after {sig.name}: {alive}"
            for port in ports:
                with socket.socket() as s:
                    assert s.connect_ex(("127.0.0.1", port)) != 0, f"port {port} still listening"
    finally:
        for _, _, proc, groups in stacks:
            for g in [proc.pid] + groups:  # only after a failed check: nothing is left running
                try:
                    os.killpg(g, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            proc.wait()


def _child_groups(pid: int) -> list[int]:
    """Process groups led by children of `pid` (each service runs in its own session)."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid and int(fields[2]) == int(d.name):
                out.append(int(d.name))
    return out


def _members(pgid: int) -> list[str]:
    """The processes in a group: "pid state command"."""
    from trainer.procwatch import group_members

    out = []
    for pid in group_members(pgid):
        try:
            head, tail = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)
        except OSError:
            continue
        out.append(f"{pid} {tail.split()[0]} {head.split('(', 1)[1]}")
    return out
