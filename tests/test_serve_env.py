"""`make serve`'s environment, port check and store preparation, without starting its services."""

import fcntl
import socket
import sqlite3
import threading

import pytest

from deployments.serve import (ROOT, NoCredentials, PortTaken, check_port, credentials, mlflow_auth_config, prepare_store,
                               service_env)


def test_prefect_state_stays_under_the_project_unless_prefect_home_is_set():
    env = service_env({"HOME": "/home/someone"}, "http://127.0.0.1:4200/api")
    assert env["PREFECT_HOME"] == str(ROOT / ".serve" / "prefect")
    assert env["PREFECT_API_URL"] == "http://127.0.0.1:4200/api"
    assert service_env({"PREFECT_HOME": "/srv/prefect"}, "x")["PREFECT_HOME"] == "/srv/prefect"


def test_a_taken_port_is_named_with_the_fix():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(PortTaken, match=rf"port {port} on 127.0.0.1 is taken .*SERVE_ARGS='--mlflow-port <port>'"):
            check_port(port, "the MLflow UI", "--mlflow-port")
    check_port(port, "the MLflow UI", "--mlflow-port")  # free again


@pytest.mark.parametrize("env, problem", [
    ({}, "POSTTRAIN_SERVE_USER"),
    ({"POSTTRAIN_SERVE_USER": "ann"}, "POSTTRAIN_SERVE_PASSWORD"),
    ({"POSTTRAIN_SERVE_USER": "ann", "POSTTRAIN_SERVE_PASSWORD": "short"}, "at least 12 characters"),
    ({"POSTTRAIN_SERVE_USER": "a:b", "POSTTRAIN_SERVE_PASSWORD": "long-enough-password"}, "no ':'"),
])
def test_services_bound_beyond_loopback_refuse_to_start_without_credentials(env, problem):
    assert credentials("127.0.0.1", env) is None  # loopback: make serve as it always was
    with pytest.raises(NoCredentials, match=r"--host 10\.0\.0\.5: .*ask for credentials") as err:
        credentials("10.0.0.5", env)
    assert problem in str(err.value) and "docs/cluster.md" in str(err.value)
    assert credentials("10.0.0.5", {"POSTTRAIN_SERVE_USER": "ann", "POSTTRAIN_SERVE_PASSWORD": "x" * 12}) == ("ann", "x" * 12)


def test_mlflow_auth_settings_are_readable_by_their_owner_only(tmp_path):
    path = mlflow_auth_config(tmp_path, "ann", "a-long-password")
    assert path.stat().st_mode & 0o777 == 0o600
    text = path.read_text()
    assert "admin_username = ann" in text and "admin_password = a-long-password" in text
    assert "default_permission = READ" in text


@pytest.mark.slow
def test_a_new_sqlite_store_gets_its_tables_under_the_lock_before_the_mlflow_server_opens_it(tmp_path):
    """`make serve` creates a new store's tables itself, waiting on the lock a pipeline run (or
    another server) holds while it does the same: two creators at once leave one failing."""
    db = tmp_path / "mlflow.db"
    done = threading.Event()
    with open(tmp_path / "mlflow.db.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # as tasks.tracking.mlflow_client holds it
        t = threading.Thread(target=lambda: (prepare_store(f"sqlite:///{db}"), done.set()), daemon=True)
        t.start()
        assert not done.wait(1.0), "prepare_store did not wait for the store's lock"
    t.join(120)
    assert done.is_set()
    with sqlite3.connect(db) as con:
        tables = {r[0] for r in con.execute("select name from sqlite_master where type='table'")}
    assert {"experiments", "runs", "registered_models", "alembic_version"} <= tables
    prepare_store("postgresql://db.example/mlflow")  # a server-backed store: its server sets it up


@pytest.mark.slow
def test_start_prepares_a_new_store_before_it_starts_the_mlflow_server(tmp_path, monkeypatch):
    """The order inside `start`: the store's tables exist when `mlflow server` is spawned. Spawning
    is replaced here by a recorder (the real stack, processes and all, runs in
    tests/test_deployments.py); the store's preparation is the real one."""
    from deployments import serve

    db = tmp_path / "mlflow.db"
    seen = []

    class Stop(Exception):
        pass

    def record(services, name, cmd):
        tables = set()
        if db.exists():
            with sqlite3.connect(db) as con:
                tables = {r[0] for r in con.execute("select name from sqlite_master where type='table'")}
        seen.append((name, "runs" in tables))
        if name == "mlflow-ui":
            raise Stop

    monkeypatch.setattr(serve, "_spawn", record)
    ports = []
    for _ in range(2):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    with pytest.raises(Stop):
        serve.start(ports[0], ports[1], env={"HOME": str(tmp_path), "MLFLOW_TRACKING_URI": f"sqlite:///{db}"},
                    logs=tmp_path / "logs")
    assert seen == [("prefect-server", False), ("mlflow-ui", True)]
