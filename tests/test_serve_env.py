"""`make serve`'s environment and port check, without starting anything."""

import socket

import pytest

from deployments.serve import ROOT, PortTaken, check_port, service_env


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
