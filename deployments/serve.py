"""`make serve`: a Prefect server, the `posttrain-local` process work pool and a worker, the MLflow
UI, and every deployment in prefect.yaml -- on 127.0.0.1 unless told otherwise. Ctrl-C, SIGTERM or
SIGHUP stops everything it started (SIGKILL to what is left after STOP_GRACE_S).

    python -m deployments.serve [--prefect-port 4200] [--mlflow-port 5000] [--pool-limit 2]
                                [--host ADDRESS] [--queue NAME]

--host binds the services to an address other machines reach (workers there, docs/cluster.md). They
then ask for credentials, from POSTTRAIN_SERVE_USER and POSTTRAIN_SERVE_PASSWORD: the Prefect API
its auth string (`user:password`, PREFECT_SERVER_API_AUTH_STRING; clients send
PREFECT_API_AUTH_STRING), MLflow its basic-auth app (that user as admin; clients send
MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD), and the worker and its runs then track to the
MLflow server itself rather than to its database. Without both variables it refuses to start.
--queue: the worker takes runs from that work queue only (one queue a machine).

The Prefect server keeps its database under the project (`.serve/prefect`) unless PREFECT_HOME is
set, so it never writes to the user's ~/.prefect. A port that is taken stops it with a message.
The work pool runs at most --pool-limit flow runs at once; later ones wait in the queue.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from trainer.procwatch import group_gone

ROOT = Path(__file__).resolve().parent.parent
POOL = "posttrain-local"
HOST = "127.0.0.1"
POOL_LIMIT = 2
STOP_GRACE_S = 10.0  # from SIGTERM to SIGKILL when stopping the services
LOOPBACK = ("127.0.0.1", "localhost", "::1")
USER_VAR, PASSWORD_VAR = "POSTTRAIN_SERVE_USER", "POSTTRAIN_SERVE_PASSWORD"
MIN_PASSWORD = 12


class PortTaken(RuntimeError):
    pass


class NoCredentials(RuntimeError):
    pass


def credentials(host: str, env: dict[str, str]) -> tuple[str, str] | None:
    """The user and password services bound beyond loopback ask for; None on loopback. Raises
    NoCredentials naming the variables when they are missing or too weak."""
    if host in LOOPBACK:
        return None
    user, password = env.get(USER_VAR, ""), env.get(PASSWORD_VAR, "")
    if not user or not password or ":" in user or len(password) < MIN_PASSWORD:
        raise NoCredentials(
            f"--host {host}: the Prefect API and MLflow would listen beyond this machine, so they ask for "
            f"credentials: set {USER_VAR} (no ':') and {PASSWORD_VAR} (at least {MIN_PASSWORD} characters), and give "
            "the same to the machines' workers (docs/cluster.md); or leave --host out to bind 127.0.0.1 only")
    return user, password


def check_port(port: int, what: str, flag: str, host: str = HOST) -> None:
    """Raise PortTaken naming the port and the fix when something already listens on it."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: TIME_WAIT is no conflict
        try:
            s.bind((host, port))
        except OSError as exc:
            raise PortTaken(f"port {port} on {host} is taken ({exc.strerror}), so {what} cannot start there: "
                            f"another `make serve` or server is running. Stop it, or choose another port: "
                            f"make serve SERVE_ARGS='{flag} <port>'") from None


@dataclass
class Services:
    """What `start` launched; `stop` ends each process group."""

    prefect_url: str
    mlflow_url: str | None
    env: dict[str, str]
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    logs: Path | None = None

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        """SIGTERM to every service's process group (its leader may be gone while a child lives on),
        then, past `grace_s` in all, SIGKILL to every group: nothing it started outlives it."""
        groups = [proc.pid for proc in reversed(list(self.procs.values()))]
        _signal_groups(groups, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and not all(group_gone(g) for g in groups):
            for proc in self.procs.values():
                proc.poll()  # reap exited leaders, so that their groups can empty
            time.sleep(0.1)
        _signal_groups(groups, signal.SIGKILL)
        for proc in self.procs.values():
            proc.wait()

    def check(self) -> None:
        """Raise if a service died (its log says why)."""
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with code {proc.returncode}; see {self.logs / (name + '.log')}")


def _signal_groups(groups: list[int], sig: int) -> None:
    for g in groups:
        try:
            os.killpg(g, sig)
        except (ProcessLookupError, PermissionError):  # the group is empty
            pass


class _Stop(Exception):
    """A stop signal (SIGTERM, SIGHUP) arrived."""


def _on_stop_signal(signum, _frame) -> None:
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):  # one stop, not a stop interrupted by a second
        signal.signal(sig, signal.SIG_IGN)
    raise _Stop(signal.Signals(signum).name)


def _bin(name: str) -> str:
    return str(Path(sys.executable).parent / name)


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def _wait(url: str, what: str, services: Services, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not _healthy(url):
        services.check()
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not answer on {url} within {timeout:.0f}s; see {services.logs}")
        time.sleep(0.5)


def mlflow_server_cmd(store: str, port: int, *extra: str, host: str = HOST) -> list[str]:
    """`mlflow server` for one user on this machine: one web worker (MLflow's default is four, each a
    process of about 250 MB), and no job runner (its queue consumers are for GenAI evaluation jobs,
    which posttrain never submits: MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false in `service_env`)."""
    return [_bin("mlflow"), "server", "--backend-store-uri", store, "--host", host, "--port", str(port),
            "--workers", "1", *extra]


def mlflow_auth_config(folder: Path, user: str, password: str) -> Path:
    """MLflow's basic-auth app's settings (an ini file only this user reads): `user` its admin, any
    other user it knows reads only, and its users in a SQLite file beside it."""
    path = folder / "mlflow-auth.ini"
    text = (f"[mlflow]\ndefault_permission = READ\ndatabase_uri = sqlite:///{folder / 'mlflow-auth.db'}\n"
            f"admin_username = {user}\nadmin_password = {password}\n"
            "authorization_function = mlflow.server.auth:authenticate_request_basic_auth\n")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    return path


def prepare_store(uri: str) -> None:
    """Create (or migrate) a SQLite tracking store's tables before `mlflow server` opens it, under the
    file lock every posttrain process takes for that (tasks.tracking.mlflow_client): a server and a
    pipeline run, or two servers, meeting a new store at once would otherwise both create its tables
    and one fail. A relative path is the server's, under the project. Other stores: nothing to do."""
    if not uri.startswith("sqlite:///"):
        return
    from tasks.tracking import mlflow_client

    mlflow_client("sqlite:///" + str(ROOT / Path(uri[len("sqlite:///"):]).expanduser()))


def _spawn(services: Services, name: str, cmd: list[str]) -> None:
    log = open(services.logs / f"{name}.log", "ab")
    services.procs[name] = subprocess.Popen(cmd, cwd=ROOT, env=services.env, stdout=log, stderr=subprocess.STDOUT,
                                            start_new_session=True)


def _run(services: Services, cmd: list[str], what: str) -> str:
    out = subprocess.run(cmd, cwd=ROOT, env=services.env, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"{what} failed ({' '.join(cmd)}):\n{out.stdout}\n{out.stderr}")
    return out.stdout


def service_env(env: dict[str, str], api: str) -> dict[str, str]:
    """The services' environment: Prefect state under the project unless PREFECT_HOME is set."""
    env = dict(env)
    env.setdefault("PREFECT_HOME", str(ROOT / ".serve" / "prefect"))
    env.update({"PREFECT_API_URL": api, "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
                "PREFECT_LOGGING_EXTRA_LOGGERS": "trainer", "PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW": "ignore"})
    env.setdefault("MLFLOW_TRACKING_URI", "sqlite:///mlflow.db")
    env.setdefault("MLFLOW_SERVER_ENABLE_JOB_EXECUTION", "false")  # see mlflow_server_cmd
    # the worker asks for runs to start every 2 s (Prefect's default, 10 s, left a run clicked in the
    # UI or triggered by the API waiting 5 s on average before its process started)
    env.setdefault("PREFECT_WORKER_QUERY_SECONDS", "2")
    return env


def start(prefect_port: int = 4200, mlflow_port: int | None = 5000, env: dict[str, str] | None = None,
          logs: Path | None = None, pool_limit: int = POOL_LIMIT, host: str = HOST,
          queue: str | None = None) -> Services:
    env = dict(os.environ if env is None else env)
    creds = credentials(host, env)
    api = f"http://{host}:{prefect_port}/api"
    check_port(prefect_port, "the Prefect server", "--prefect-port", host)
    if mlflow_port:
        check_port(mlflow_port, "the MLflow UI", "--mlflow-port", host)
    env = service_env(env, api)
    logs = logs or ROOT / ".serve"
    logs.mkdir(parents=True, exist_ok=True)
    mlflow_url = f"http://{host}:{mlflow_port}" if mlflow_port else None
    store, mlflow_extra = env["MLFLOW_TRACKING_URI"], []
    if creds is not None:
        user, password = creds
        env.update({"PREFECT_SERVER_API_AUTH_STRING": f"{user}:{password}", "PREFECT_API_AUTH_STRING": f"{user}:{password}",
                    "MLFLOW_TRACKING_USERNAME": user, "MLFLOW_TRACKING_PASSWORD": password})
        if mlflow_port:
            env["MLFLOW_AUTH_CONFIG_PATH"] = str(mlflow_auth_config(logs, user, password))
            env.setdefault("MLFLOW_FLASK_SERVER_SECRET_KEY", os.urandom(24).hex())
            # MLflow answers only the Host headers it allows (DNS rebinding): by default localhost and
            # private addresses; its clients here name the bound address
            mlflow_extra = ["--app-name", "basic-auth", "--allowed-hosts", f"{host},{host}:{mlflow_port}"]
    services = Services(f"http://{host}:{prefect_port}", mlflow_url, env, logs=logs)
    try:
        _spawn(services, "prefect-server",
               [_bin("prefect"), "server", "start", "--host", host, "--port", str(prefect_port)])
        if mlflow_port:  # starts beside the Prefect server; waited for once the deployments are in
            prepare_store(store)
            _spawn(services, "mlflow-ui", mlflow_server_cmd(store, mlflow_port, *mlflow_extra, host=host))
            if creds is not None:  # runs on any machine track through the server, which checks who asks
                services.env = env = {**env, "MLFLOW_TRACKING_URI": mlflow_url}
        _wait(f"{api}/health", "the Prefect server", services)
        _run(services, [_bin("prefect"), "work-pool", "create", POOL, "--type", "process", "--overwrite"],
             "creating the work pool")
        _run(services, [_bin("prefect"), "work-pool", "set-concurrency-limit", POOL, str(pool_limit)],
             "limiting the work pool")
        _run(services, [_bin("prefect"), "--no-prompt", "deploy", "--all", "--prefect-file", str(ROOT / "prefect.yaml")],
             "prefect deploy --all")
        _spawn(services, "prefect-worker", [_bin("prefect"), "worker", "start", "--pool", POOL, "--type", "process",
                                            *(["--work-queue", queue] if queue else [])])
        if mlflow_port:
            _wait(f"{services.mlflow_url}/health", "the MLflow UI", services)
        services.check()
    except BaseException:
        services.stop()
        raise
    return services


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m deployments.serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prefect-port", type=int, default=4200)
    p.add_argument("--mlflow-port", type=int, default=5000)
    p.add_argument("--pool-limit", type=int, default=POOL_LIMIT,
                   help="flow runs the work pool runs at once (later ones wait)")
    p.add_argument("--host", default=HOST, help=f"address to bind (default {HOST}); another needs "
                   f"{USER_VAR} and {PASSWORD_VAR}")
    p.add_argument("--queue", default=None, help="the work queue this machine's worker takes runs from")
    p.add_argument("--logs", type=Path, default=None, help="the services' logs (default: .serve/ in the checkout)")
    args = p.parse_args(argv)
    # a process manager stops services with SIGTERM (systemd, supervisord, docker stop), a closed
    # terminal with SIGHUP: both stop everything, as Ctrl-C does
    signal.signal(signal.SIGTERM, _on_stop_signal)
    signal.signal(signal.SIGHUP, _on_stop_signal)
    services = None
    try:
        services = start(args.prefect_port, args.mlflow_port, pool_limit=args.pool_limit, host=args.host,
                         queue=args.queue, logs=args.logs)
        print(f"Prefect UI:   {services.prefect_url}   (API {services.prefect_url}/api)")
        print(f"MLflow UI:    {services.mlflow_url}   (tracking {services.env['MLFLOW_TRACKING_URI']})")
        if services.mlflow_url:
            print(f"MLflow runs:  {runs_table(services)}")
        print(f"work pool:    {POOL} (process, at most {args.pool_limit} runs at once), worker running; "
              f"logs in {services.logs}")
        print(f"Prefect home: {services.env['PREFECT_HOME']}")
        print("deployments:  speedrun/speedrun-nightly (03:00 Europe/Berlin), speedrun/speedrun, sft/sft, grpo/grpo, "
              "eval/eval")
        print(f"run one:      PREFECT_API_URL={services.prefect_url}/api .venv/bin/prefect deployment run speedrun/speedrun")
        print("Ctrl-C (or SIGTERM, SIGHUP) stops everything.", flush=True)
        while True:
            services.check()
            time.sleep(2)
    except (PortTaken, NoCredentials) as exc:
        print(f"make serve: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("stopping (Ctrl-C) ...", flush=True)
    except _Stop as sig:  # a stop signal, at any point after the handlers were installed
        print(f"stopping ({sig}) ...", flush=True)
    finally:
        for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):  # let the stop finish
            signal.signal(sig, signal.SIG_IGN)
        if services is not None:  # (a failed `start` stopped what it had started)
            services.stop()
    return 0


def runs_table(services: Services, experiment: str = "posttrain") -> str:
    """The served MLflow UI's runs table of `experiment`; before its first run (the pipeline creates
    it, with the run's tracking settings), the list of experiments."""
    from mlflow import MlflowClient

    from tasks.pipeline import mlflow_ui_urls

    # the server's credentials, where it asks for them (MLflow's client reads them from the environment)
    creds = {k: services.env[k] for k in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD") if k in services.env}
    before = {k: os.environ.get(k) for k in creds}
    os.environ.update(creds)
    try:
        exp = MlflowClient(tracking_uri=services.mlflow_url).get_experiment_by_name(experiment)
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    if exp is None:
        return f"{services.mlflow_url}/#/experiments   (experiment {experiment!r}: created by the first run)"
    return mlflow_ui_urls(exp.experiment_id, ui=services.mlflow_url)[0]


if __name__ == "__main__":
    sys.exit(main())
