"""The CLI's early temporary Prefect server (flows/prefect_server.py), in real `posttrain` processes.

A command with no Prefect API configured starts Prefect's API app itself, before its imports, runs
its flow against it (the flow run is real: the result names it) and stops it on exit. A server named
by Prefect's own settings (here a profile) or a ban on temporary servers is left to Prefect: the
command runs as it would without posttrain's server."""

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # each test runs `posttrain` processes and their servers

ROOT = Path(__file__).resolve().parent.parent


def cli_command(tmp_path: Path, env: dict[str, str], stores) -> tuple[list[str], dict[str, str], Path]:
    """A small `posttrain prepare-data` with no Prefect API configured: command, environment, result.
    Its MLflow store and the Prefect database in PREFECT_HOME start migrated (conftest.MigratedStores)."""
    out = tmp_path / "result.json"
    stores.prefect_home(Path(env["PREFECT_HOME"]))
    mlflow_uri = stores.mlflow_db(tmp_path / "mlflow.db")
    cmd = [sys.executable, "-m", "flows.cli", "prepare-data", "--preset", "tiny", "--json", str(out),
           "--set", f"artifact_root={tmp_path / 'artifacts'}", "--set", "data.synthetic.n_train=200",
           "--set", "data.synthetic.n_test=20"]
    base = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    return cmd, {**base, "MLFLOW_TRACKING_URI": mlflow_uri, **env}, out


def run_cli(tmp_path: Path, env: dict[str, str], stores) -> tuple[subprocess.CompletedProcess, Path]:
    cmd, full_env, out = cli_command(tmp_path, env, stores)
    return subprocess.run(cmd, cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=300), out


def listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_a_command_runs_its_flow_on_its_own_early_server_and_stops_it(tmp_path, migrated_stores):
    proc, out = run_cli(tmp_path, {"PREFECT_HOME": str(tmp_path / "prefect")}, migrated_stores)
    assert proc.returncode == 0, proc.stderr[-4000:]
    m = re.search(r"temporary Prefect server on http://127\.0\.0\.1:(\d+)/api for this command", proc.stderr)
    assert m, proc.stderr[-4000:]
    # Prefect did not start a second, temporary server of its own, and links nowhere (no UI)
    assert "Starting temporary server" not in proc.stderr + proc.stdout
    assert "View at" not in proc.stderr + proc.stdout
    result = json.loads(out.read_text())
    assert result["flow_run_id"], "the flow ran without a Prefect flow run"
    # the summary links MLflow's runs table of the run's experiment (its bare page is the GenAI overview)
    from mlflow import MlflowClient

    exp = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}").get_experiment_by_name("posttrain")
    runs = f"http://127.0.0.1:5000/#/experiments/{exp.experiment_id}/runs"
    # in the model-training view, the finished speedruns best first
    table = f"{runs}?workflowType=machine_learning&searchFilter=metrics.final_accuracy%20%3E%3D%200" \
            "&orderByKey=metrics.%60final_accuracy%60&orderByAsc=false"
    assert f"MLflow runs table: {table}\n" in proc.stdout, proc.stdout[-2000:]
    assert f"this run:          {runs}/{result['mlflow_run_id']}?workflowType=machine_learning\n" in proc.stdout, \
        proc.stdout[-2000:]
    # how to open both UIs on this run: its store by path, the interpreter's own tools, the flow run's
    # page; `make serve` (run from the clone: MLFLOW_TRACKING_URI names the same store there) shows it
    bin_dir = os.path.relpath(Path(sys.executable).parent, ROOT) if Path(sys.executable).is_relative_to(ROOT) \
        else Path(sys.executable).parent  # as typed from the command's folder, the clone
    assert f"  (served by `make serve` with this MLFLOW_TRACKING_URI, or: {bin_dir}/mlflow ui --backend-store-uri " \
           f"sqlite:///{tmp_path / 'mlflow.db'} --port 5000)\n" in proc.stdout, proc.stdout[-2000:]
    assert f"Prefect:           {bin_dir}/prefect server start, then http://127.0.0.1:4200/runs/flow-run/" \
           f"{result['flow_run_id']}   (its state: {tmp_path / 'prefect'})\n" in proc.stdout, proc.stdout[-2000:]
    assert "or both, with the deployments and a worker: make serve\n" in proc.stdout
    assert not listening(int(m.group(1))), "the server outlived its command"
    import tempfile

    assert not list(Path(tempfile.gettempdir()).glob(f"posttrain-prefect-server-{m.group(1)}-*.log"))


def test_an_mlflow_server_that_does_not_answer_stops_the_command_naming_it(tmp_path, migrated_stores):
    """MLFLOW_TRACKING_URI names a server that is down: exit 2 with the URI and the fix, before any
    stage (MLflow's own client retried it for about 4 minutes, then failed with a traceback). The
    command checks it while its temporary Prefect server starts; a run on a configured Prefect
    server, as from the Prefect UI, checks it when the flow starts (the in-process run below)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens on it once closed
    down = f"http://127.0.0.1:{port}"
    cmd, env, out = cli_command(tmp_path, {"PREFECT_HOME": str(tmp_path / "prefect")}, migrated_stores)
    proc = subprocess.run(cmd, cwd=ROOT, env={**env, "MLFLOW_TRACKING_URI": down}, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 2, proc.stderr[-4000:]
    assert f"posttrain: MLflow tracking server {down} (MLFLOW_TRACKING_URI) does not answer" in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "artifacts").exists()

    from flows.cli import main

    os.environ["MLFLOW_TRACKING_URI"], saved = down, os.environ["MLFLOW_TRACKING_URI"]
    try:
        assert main(["prepare-data", "--set", f"artifact_root={tmp_path / 'in-process'}"]) == 2
    finally:
        os.environ["MLFLOW_TRACKING_URI"] = saved
    assert not (tmp_path / "in-process").exists()


def test_the_server_of_a_sigkilled_command_stops_too(tmp_path, migrated_stores):
    """SIGKILL runs no exit handler: the server notices that its command is gone and shuts down."""
    import signal
    import tempfile
    import time

    cmd, env, _ = cli_command(tmp_path, {"PREFECT_HOME": str(tmp_path / "prefect")}, migrated_stores)
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    port = None
    for line in proc.stderr:  # printed once the server answers
        m = re.search(r"temporary Prefect server on http://127\.0\.0\.1:(\d+)/api", line)
        if m:
            port = int(m.group(1))
            proc.send_signal(signal.SIGKILL)
            break
    assert port is not None and proc.wait(timeout=60) == -signal.SIGKILL
    deadline = time.monotonic() + 30
    while listening(port) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not listening(port), "the server outlived its SIGKILLed command"
    while list(Path(tempfile.gettempdir()).glob(f"posttrain-prefect-server-{port}-*.log")) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not list(Path(tempfile.gettempdir()).glob(f"posttrain-prefect-server-{port}-*.log"))


def test_a_server_in_the_prefect_profile_is_used_instead(tmp_path, migrated_stores):
    home = tmp_path / "prefect"
    home.mkdir()
    # port 9 (discard) has no Prefect API: the command must fail trying to reach exactly this URL
    (home / "profiles.toml").write_text('active = "team"\n\n[profiles.team]\n'
                                        'PREFECT_API_URL = "http://127.0.0.1:9/api"\n')
    proc, out = run_cli(tmp_path, {"PREFECT_HOME": str(home)}, migrated_stores)
    assert proc.returncode != 0
    assert "temporary Prefect server" not in proc.stderr
    assert "127.0.0.1:9/api" in proc.stderr + proc.stdout, proc.stderr[-4000:]
    assert not out.exists()


def test_a_ban_on_temporary_servers_is_prefects_error(tmp_path, migrated_stores):
    proc, out = run_cli(tmp_path, {"PREFECT_HOME": str(tmp_path / "prefect"),
                                   "PREFECT_SERVER_ALLOW_EPHEMERAL_MODE": "false"}, migrated_stores)
    assert proc.returncode != 0
    assert "temporary Prefect server" not in proc.stderr
    assert "No Prefect API URL provided" in proc.stderr + proc.stdout, proc.stderr[-4000:]


def test_the_flows_import_neither_torch_nor_transformers():
    """A fully cached command never trains or generates: the stage bodies import torch and
    transformers when they run, so a cached run does not pay their seconds of import."""
    code = "import sys, flows.cli, flows.speedrun; print(sorted({'torch', 'transformers', 'deepspeed'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_a_tracking_server_behind_a_certificate_this_check_does_not_trust_still_answers(tmp_path):
    """A self-signed https server answers the check (MLflow's own TLS settings decide whether to
    trust it); a port where nothing listens does not."""
    import ssl
    import threading
    from http.server import BaseHTTPRequestHandler, HTTPServer

    from tasks.tracking import TrackingError, check_server

    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "1", "-subj", "/CN=localhost"], check=True, capture_output=True)

    class Health(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"OK")

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), Health)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        check_server(f"https://127.0.0.1:{server.server_address[1]}")
    finally:
        server.shutdown()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(TrackingError, match=rf"MLflow tracking server http://127.0.0.1:{port} .* does not answer"):
        check_server(f"http://127.0.0.1:{port}", attempts=1)


def test_an_unusable_sqlite_store_or_json_path_stops_the_command_naming_it(tmp_path, capsys, monkeypatch):
    """A SQLite MLFLOW_TRACKING_URI under a file, naming a folder or a file that is not a database,
    and a --json PATH under a file or naming a folder: exit 2 naming the setting and the fix, before
    any stage (were tracebacks; --json's only after the whole run). A --json PATH in folders that do
    not exist yet gets them, and the result whole."""
    from flows.cli import main

    afile, folder, garbage = tmp_path / "afile", tmp_path / "folder", tmp_path / "garbage.db"
    afile.write_text(""), folder.mkdir(), garbage.write_text("not a database")
    art = ["--set", f"artifact_root={tmp_path / 'art'}", "--set", "data.synthetic.n_train=200",
           "--set", "data.synthetic.n_test=20"]
    fix = "point it at a SQLite file in a folder you can write in"
    for uri, named in [(f"sqlite:///{afile}/mlflow.db", f"{afile} is a file, not a folder"),
                       (f"sqlite:///{folder}", f"{folder} is a folder, not a SQLite file"),
                       (f"sqlite:///{garbage}", f"cannot open {garbage} as an MLflow SQLite store (file is not a "
                                                "database)")]:
        monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
        assert main(["prepare-data", *art]) == 2
        err = capsys.readouterr().err
        assert f"posttrain: MLFLOW_TRACKING_URI={uri}: " in err and named in err and fix in err, err[-2000:]
    monkeypatch.undo()
    for out, named in [(afile / "r.json", f"--json {afile / 'r.json'}: {afile} is a file, not a folder"),
                       (folder, f"--json {folder}: is a folder; name a file")]:
        assert main(["prepare-data", *art, "--json", str(out)]) == 2
        assert f"posttrain: {named}" in capsys.readouterr().err
    assert not (tmp_path / "art").exists() and afile.read_text() == ""
    # a store another process holds locked is nothing wrong with the path: raised as it is
    from sqlalchemy.exc import OperationalError

    from tasks.tracking import _store_problem

    locked = OperationalError("PRAGMA", {}, Exception("database is locked"))
    assert _store_problem(garbage, locked) is None
    assert _store_problem(garbage, OperationalError("x", {}, Exception("file is not a database"))) is not None
    out = tmp_path / "new" / "folders" / "r.json"
    assert main(["prepare-data", *art, "--json", str(out)]) == 0
    assert json.loads(out.read_text())["stages"][0]["stage"] == "prepare_data"
    assert [p.name for p in out.parent.iterdir()] == ["r.json"]  # no part file left beside it


def test_the_summary_says_how_to_open_this_run_from_wherever_it_ran(tmp_path, monkeypatch):
    """Run outside the clone, the default store is a file there: `make serve` (which opens the clone's)
    is not offered for it, the commands name the interpreter's own tools and the store's path, and
    `make serve`'s Prefect, whose state is its own, is not said to show a run of the temporary server.
    A Prefect server of the user's own is linked directly."""
    from flows.cli import where_to_look

    for var in ("MLFLOW_TRACKING_URI", "PREFECT_HOME", "PREFECT_API_URL"):
        monkeypatch.delenv(var, raising=False)
    bin_dir = Path(sys.executable).parent
    monkeypatch.chdir(tmp_path)
    lines = where_to_look("f-1", temporary_prefect=True)
    assert lines[0] == f"  (served by: {bin_dir / 'mlflow'} ui --backend-store-uri sqlite:///mlflow.db --port 5000)"
    assert lines[1].startswith(f"Prefect:           {bin_dir / 'prefect'} server start, "
                               "then http://127.0.0.1:4200/runs/flow-run/f-1   (its state: ")
    assert lines[2] == (f"make -C {ROOT} serve: the MLflow UI, and Prefect with the deployments and a worker; its "
                        f"Prefect keeps its own state ({ROOT / '.serve' / 'prefect'}), with the runs started from it")
    monkeypatch.chdir(ROOT)  # in the clone: the store `make serve` opens, the paths as typed there
    lines = where_to_look("f-1", temporary_prefect=True)
    assert lines[0] == "  (served by `make serve`, or: .venv/bin/mlflow ui --backend-store-uri sqlite:///mlflow.db " \
                       "--port 5000)" or not (ROOT / ".venv").is_dir()
    assert lines[2].startswith("make serve: ")
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings(updates={PREFECT_API_URL: "http://team.example:4200/api"}):
        assert where_to_look("f-1", temporary_prefect=False)[1:] == [
            "Prefect:           http://team.example:4200/runs/flow-run/f-1"]


def test_json_to_standard_output_holds_the_result_alone(tmp_path, migrated_stores):
    """`--json -`: standard output is the result's JSON and nothing else (for `| jq`), though DeepSpeed
    prints its notices there; the summary and the log (progress included) go to standard error."""
    cmd, env, _ = cli_command(tmp_path, {"PREFECT_HOME": str(tmp_path / "prefect")}, migrated_stores)
    cmd[cmd.index("--json") + 1] = "-"
    cmd[cmd.index("prepare-data")] = "sft"
    gsm8k = ROOT / "tests" / "data" / "gsm8k"  # real rows, read through `datasets` (into a cache of its own)
    env["HF_DATASETS_CACHE"] = str(tmp_path / "datasets")
    cmd += ["--set", "sft.max_steps=2", "--set", "model.hidden_size=32", "--set", "model.num_layers=1",
            "--set", "model.intermediate_size=64", "--set", "sft.micro_batch_size=8", "--set", "data.source=files",
            "--set", f"data.train={gsm8k / 'train.jsonl'}", "--set", f"data.test={gsm8k / 'test.jsonl'}",
            "--set", "data.max_train=64", "--set", "data.max_test=8"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout)
    assert [s["stage"] for s in result["stages"]] == ["prepare_data", "tokenizer", "sft"]
    assert "posttrain summary" in proc.stderr and "Setting accelerator to CPU" in proc.stderr
    assert "sft: 2/2 steps (100%)" in proc.stderr  # progress off a terminal: log lines, the last when it ends
    for bar in ("Writing model shards", "Generating train split"):  # nor transformers' or datasets' bars,
        assert bar not in proc.stderr, bar                          # carriage-return debris in a log
    assert not (ROOT / "-").exists() and not (tmp_path / "-").exists()
