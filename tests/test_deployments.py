"""`make serve` for real: a Prefect server on loopback with its own PREFECT_HOME, the process work
pool and a worker, the MLflow UI, and the deployments from prefect.yaml. The tiny speedrun is
triggered through the API and run by the worker; a stage made to fail once is retried with
`prefect flow-run retry`, and only that stage runs again."""

import asyncio
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.test_pipeline import SMALL

pytestmark = pytest.mark.slow
DEPLOYMENTS = {"speedrun/speedrun-nightly", "speedrun/speedrun", "sft/sft", "grpo/grpo", "eval/eval"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from deployments.serve import start

    home = tmp_path_factory.mktemp("prefect-home")
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


def trigger(services, name: str, parameters: dict):
    dep = deployment(services, name)
    return api(services, lambda c: c.create_flow_run_from_deployment(dep.id, parameters=parameters))


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


def test_triggered_run_completes_then_failed_stage_alone_reruns_on_retry(served, tmp_path):
    overrides = SMALL + [f"artifact_root={tmp_path / 'artifacts'}"]
    run = trigger(served, "speedrun/speedrun", {"preset": "tiny", "overrides": overrides})
    run = wait_final(served, run.id)
    assert run.state.is_completed(), run.state
    [(parent, children)] = pipeline_runs(run.id)
    assert parent.info.status == "FINISHED"
    assert {"sft_accuracy", "final_accuracy", "wall_seconds"} <= set(parent.data.metrics)
    assert [c.data.tags["posttrain.stage"] for c in children] == ["prepare_data", "tokenizer", "sft", "eval",
                                                                     "grpo", "eval"]

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
