"""Several runs on one artifact root and one MLflow store at once, as a team shares them.

Four real CLI speedruns start together on a fresh SQLite store: two identical, two with their own
seeds. Each stage key is computed exactly once (the identical run waits and takes the cache hit),
and MLflow holds four parent runs, each with its own children. Then a run is SIGKILLed while it
holds SFT, and the run waiting for it takes over from its last committed checkpoint."""

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from tests.test_resume_kill import OVERRIDES

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parent.parent


def start_cli(root: Path, out: Path, store: str, extra: list[str] = (), env: dict | None = None,
              command: str = "speedrun") -> subprocess.Popen:
    cmd = [sys.executable, "-m", "flows.cli", command, "--preset", "tiny", "--json", str(out),
           "--set", f"artifact_root={root}"]
    for o in [*OVERRIDES, *extra]:
        cmd += ["--set", o]
    env = {**os.environ, "MLFLOW_TRACKING_URI": store, **(env or {})}
    log = open(out.with_suffix(".log"), "wb")
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def finish(proc: subprocess.Popen, out: Path, timeout: float = 900) -> dict:
    try:
        proc.wait(timeout=timeout)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    log = out.with_suffix(".log").read_text()
    assert proc.returncode == 0, f"{out.name} exited {proc.returncode}:\n{log[-5000:]}"
    return json.loads(out.read_text())


def test_four_speedruns_at_once_compute_each_key_once(tmp_path):
    root = tmp_path / "artifacts"
    store = f"sqlite:///{tmp_path / 'fresh-mlflow.db'}"  # first used by all four at once
    seeds = [0, 0, 1, 2]
    t0 = time.perf_counter()
    procs = [(start_cli(root, tmp_path / f"run{i}.json", store, [f"seed={s}"]), tmp_path / f"run{i}.json")
             for i, s in enumerate(seeds)]
    results = [finish(p, out) for p, out in procs]
    wall = time.perf_counter() - t0

    ran = Counter((s["stage"], s["key"]) for r in results for s in r["stages"] if not s["cache_hit"])
    seen = {(s["stage"], s["key"]) for r in results for s in r["stages"]}
    assert all(n == 1 for n in ran.values()), f"keys computed more than once: {[k for k, n in ran.items() if n > 1]}"
    assert set(ran) == seen, f"keys nobody computed: {seen - set(ran)}"
    # the two identical runs: each stage computed by one of them and taken from cache by the other
    # (not always the same one: a run that waited on a stage's lock can reach the next stage first)
    same = [[s["cache_hit"] for s in r["stages"]] for r in results[:2]]
    assert len(same[0]) == len(same[1]) == 6 and all(a != b for a, b in zip(*same)), same
    # each distinct seed has its own keys: 3 seeds x 6 stage results (eval twice)
    assert len(seen) == 3 * 6
    for (stage, key) in seen:
        folder = next(s["uri"] for r in results for s in r["stages"] if s["key"] == key)
        manifest = json.loads((Path(folder) / "manifest.json").read_text())
        assert manifest["key"] == key and manifest["stage"] == stage
    assert not list(root.glob("*/.staging/*")), "a staging folder was left behind"

    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=store)
    exp = client.get_experiment_by_name("posttrain")
    parents = client.search_runs([exp.experiment_id], "tags.`posttrain.flow` = 'speedrun'")
    assert sorted(p.info.run_id for p in parents) == sorted(r["mlflow_run_id"] for r in results)
    for r in results:
        parent = client.get_run(r["mlflow_run_id"])
        assert parent.info.status == "FINISHED"
        children = client.search_runs([exp.experiment_id], f"tags.mlflow.parentRunId = '{r['mlflow_run_id']}'",
                                      order_by=["attributes.start_time ASC"])
        assert [c.data.tags["posttrain.stage"] for c in children] == [s["stage"] for s in r["stages"]]
        assert all(c.data.tags.get("prefect.flow_run_id") == r["flow_run_id"] for c in children)
        assert [c.data.tags["cache_hit"] == "True" for c in children] == [s["cache_hit"] for s in r["stages"]]
    hits = sum(s["cache_hit"] for r in results for s in r["stages"])
    print(f"\n4 concurrent speedruns: {wall:.1f}s wall; {len(ran)} stage results computed once each, {hits} cache hits; "
          f"per run: {[round(r['wall_seconds'], 1) for r in results]}s")


def _committed_steps(folder: Path) -> list[int]:
    return sorted(int(t.parent.name[4:]) for t in folder.glob("checkpoints/step*/COMMITTED"))


def test_a_waiting_run_takes_over_from_a_killed_holder(tmp_path):
    """Two runs of one SFT key: the second waits; the first is SIGKILLed mid-SFT (as an OOM kill
    would), and the waiter takes over from the holder's last committed checkpoint instead of
    waiting forever or starting again. The holder stalls after step 20's checkpoint (an injected
    hang) until it is killed, so it cannot finish SFT first however fast the machine is."""
    root = tmp_path / "artifacts"
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    longer = ["sft.max_steps=400", "sft.checkpoint_every=10"]  # as many steps as 2 epochs hold: 75
    holder = start_cli(root, tmp_path / "holder.json", store, longer, env={"POSTTRAIN_FAULT": "sft@21:hang"})
    waiter = None
    try:
        deadline = time.monotonic() + 300
        while not any(root.glob(".locks/sft/*.holder")):
            assert holder.poll() is None, (tmp_path / "holder.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "the first run never started SFT"
            time.sleep(0.2)
        waiter = start_cli(root, tmp_path / "waiter.json", store, longer)
        while "is computing it" not in (tmp_path / "waiter.log").read_text():
            assert waiter.poll() is None, (tmp_path / "waiter.log").read_text()[-3000:]
            assert holder.poll() is None, (tmp_path / "holder.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "the second run never waited"
            time.sleep(0.2)
        [folder] = root.glob("sft/*")
        while "injected hang at sft 21" not in (tmp_path / "holder.log").read_text():
            assert holder.poll() is None, (tmp_path / "holder.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "the first run never reached SFT step 21"
            time.sleep(0.2)
        os.killpg(holder.pid, signal.SIGKILL)
        holder.wait()
    except BaseException:  # a failed check must not leave the hung holder, or the waiter, running
        for proc in (holder, waiter):
            if proc is not None and proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait()
        raise
    assert _committed_steps(folder) == [10, 20]
    result = finish(waiter, tmp_path / "waiter.json")
    sft = next(s for s in result["stages"] if s["stage"] == "sft")
    assert not sft["cache_hit"]
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["result"]["resumed_from_step"] == 20, manifest["result"]
    assert sft["metrics"]["sft/steps"] == 75


def test_four_runs_at_once_on_a_fresh_server_backed_store(tmp_path):
    """The same with MLflow behind `mlflow server` (its fresh database set up by the server): four
    prepare-data runs at once, one computes, three take the cache hit, four parent runs."""
    import socket
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    from deployments.serve import mlflow_server_cmd

    server = subprocess.Popen(mlflow_server_cmd(f"sqlite:///{tmp_path / 'server.db'}", port, "--default-artifact-root",
                                                str(tmp_path / "mlartifacts")),
                              env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"},
                              stdout=open(tmp_path / "mlflow.log", "wb"), stderr=subprocess.STDOUT,
                              start_new_session=True)
    store = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(f"{store}/health", timeout=2):
                    break
            except OSError:
                assert server.poll() is None and time.monotonic() < deadline, (tmp_path / "mlflow.log").read_text()
                time.sleep(0.5)
        root = tmp_path / "artifacts"
        procs = [(start_cli(root, tmp_path / f"p{i}.json", store, command="prepare-data"), tmp_path / f"p{i}.json")
                 for i in range(4)]
        results = [finish(p, out) for p, out in procs]
        assert sorted(r["stages"][0]["cache_hit"] for r in results) == [False, True, True, True]
        from mlflow import MlflowClient

        client = MlflowClient(tracking_uri=store)
        exp = client.get_experiment_by_name("posttrain")
        parents = client.search_runs([exp.experiment_id], "tags.`posttrain.flow` = 'prepare_data'")
        assert sorted(p.info.run_id for p in parents) == sorted(r["mlflow_run_id"] for r in results)
        for r in results:
            [child] = client.search_runs([exp.experiment_id], f"tags.mlflow.parentRunId = '{r['mlflow_run_id']}'")
            assert child.data.tags["cache_hit"] == str(r["stages"][0]["cache_hit"])
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=30)
