"""artifact_root on S3: the tiny speedrun (small budget) end to end against a real S3 server on
loopback (moto's ThreadedMotoServer, as s3fs's own tests use), then a cached re-run that reads
its results back from S3. The credentials must not leak into MLflow or the logs."""

import json
import os
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from tests.test_pipeline import SMALL

pytestmark = pytest.mark.slow
BUCKET = "posttrain-test"
SECRET = f"s3cr3t-{uuid.uuid4().hex}"


@pytest.fixture(scope="module")
def s3_server():
    """The moto server, in a holder so that a test can stop it and start another on its port."""
    from moto.server import ThreadedMotoServer

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    holder = {"port": port, "server": ThreadedMotoServer(ip_address="127.0.0.1", port=port)}
    holder["server"].start()
    yield holder
    holder["server"].stop()


@pytest.fixture(scope="module")
def s3(s3_server):
    import boto3

    port = s3_server["port"]
    env = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "posttrain-test-key",
           "AWS_SECRET_ACCESS_KEY": SECRET, "AWS_DEFAULT_REGION": "us-east-1"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    import fsspec

    fsspec.filesystem("s3").clear_instance_cache()
    boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"]).create_bucket(Bucket=BUCKET)
    yield f"s3://{BUCKET}/runs"
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def test_speedrun_on_s3_then_cached_rerun(s3, session_dir, caplog, capsys):
    import s3fs
    from mlflow import MlflowClient

    from flows.speedrun import speedrun

    overrides = SMALL + [f"artifact_root={s3}", "tracking.experiment=s3-test"]
    first = speedrun(preset="tiny", overrides=overrides)
    assert not any(s["cache_hit"] for s in first["stages"])
    fs = s3fs.S3FileSystem()
    for s in first["stages"]:
        assert s["uri"].startswith(s3)
        assert fs.exists(s["uri"] + "/manifest.json"), s["uri"]
    sft = next(s for s in first["stages"] if s["stage"] == "sft")
    assert fs.exists(sft["uri"] + "/model/model.safetensors")
    # uploaded: what later stages and users read, and the checkpoints, each committed (marker last) as it
    # was saved, where a resume on any machine finds them; not: GRPO's per-round weight pushes to SGLang,
    # nor the launch's bookkeeping
    from trainer import storage

    for stage in ("sft", "grpo"):
        uri = next(s["uri"] for s in first["stages"] if s["stage"] == stage)
        files = storage.list_files(uri)
        assert "model/model.safetensors" in files and "manifest.json" in files, (stage, sorted(files))
        assert not [f for f in files if f.startswith(("sync/", "rank_status/", "launch_"))], (stage, sorted(files))
        markers = [f for f in files if f.startswith("checkpoints/") and f.endswith("/COMMITTED")]
        assert markers, (stage, sorted(files))
        manifest = json.loads(fs.cat(uri + "/manifest.json"))
        assert not [f for f in manifest["files"] if f.startswith("checkpoints/")]  # not part of the result
    grpo_files = storage.list_files(next(s["uri"] for s in first["stages"] if s["stage"] == "grpo"))
    assert "history.jsonl" in grpo_files

    again = speedrun(preset="tiny", overrides=overrides)
    assert all(s["cache_hit"] for s in again["stages"])
    assert again["headline"] == {**first["headline"], "wall_seconds": again["headline"]["wall_seconds"]}

    # the secret is nowhere: not in MLflow params, tags or artifacts, nor in the logs
    client = MlflowClient()
    exp = client.get_experiment_by_name("s3-test")
    for run in client.search_runs([exp.experiment_id]):
        assert SECRET not in repr(run.data.params) + repr(run.data.tags) + repr(run.inputs)
    # the prepared splits, MLflow datasets on the parent run, name their files on the store
    data = next(s for s in first["stages"] if s["stage"] == "prepare_data")
    sources = {d.dataset.name: (d.dataset.source_type, json.loads(d.dataset.source)["uri"])
               for d in client.get_run(first["mlflow_run_id"]).inputs.dataset_inputs}
    assert sources == {f"synthetic-{split}": ("s3", f"{data['uri']}/{split}.jsonl") for split in ("train", "test")}
    artifact_dir = Path(exp.artifact_location.removeprefix("file://"))
    files = [p for d in (session_dir, artifact_dir) for p in d.rglob("*") if p.is_file()]
    assert any(p.name == "config.yaml" for p in files)  # the MLflow artifacts were searched too
    leaked = [p for p in files if SECRET.encode() in p.read_bytes()]
    assert not leaked, leaked
    out = capsys.readouterr()
    assert SECRET not in caplog.text + out.out + out.err


def test_transient_s3_outage_is_retried(s3, s3_server, caplog, monkeypatch):
    """The S3 server goes away for 8 s and comes back on the same port: the write is retried until
    it lands. botocore's own retries (up to ~15 s of randomised back-off) are turned down to one
    attempt here, so that what carries the write across the outage is posttrain's retry and the
    test does not depend on botocore's jitter. A missing object fails at once."""
    import logging
    import threading
    import time

    import fsspec
    from moto.server import ThreadedMotoServer

    from trainer import storage

    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    monkeypatch.setenv("AWS_RETRY_MODE", "standard")
    fsspec.filesystem("s3").clear_instance_cache()  # a new client reads the retry settings
    url = f"{s3}/outage/blob.txt"
    storage.write_text(url, "before")
    s3_server["server"].stop()

    def restart():
        time.sleep(8)
        server = ThreadedMotoServer(ip_address="127.0.0.1", port=s3_server["port"])
        server.start()
        s3_server["server"] = server

    thread = threading.Thread(target=restart)
    thread.start()
    t0 = time.perf_counter()
    try:
        with caplog.at_level(logging.WARNING, logger="trainer.storage"):
            storage.write_text(url, "during the outage")
        seconds = time.perf_counter() - t0
    finally:
        thread.join()
    assert seconds >= 8
    assert storage.read_text(url) == "during the outage"
    retries = caplog.text.count("transient error")
    assert retries >= 1 and "retrying in" in caplog.text
    print(f"write retried {retries} times through an 8 s outage, landed after {seconds:.1f}s")

    t0 = time.perf_counter()
    with pytest.raises(FileNotFoundError):
        storage.read_text(f"{s3}/outage/missing.txt")
    assert time.perf_counter() - t0 < 5
    fsspec.filesystem("s3").clear_instance_cache()


def test_mlflow_artifacts_on_s3(s3, tmp_path, monkeypatch):
    """tracking.artifact_location=s3://...: a new experiment keeps its MLflow artifacts on S3, its
    logged models' (the policies' weights) too, and a models:/ model.pretrained downloads them."""
    import s3fs
    from mlflow import MlflowClient

    from tasks.tracking import MlflowLogger
    from tasks.pipeline import experiment_id

    client = MlflowClient()
    location = f"{s3}/mlflow"
    exp = experiment_id(client, "s3-artifacts", location)
    assert client.get_experiment(exp).artifact_location == location
    run = client.create_run(exp)
    logger = MlflowLogger(client, run.info.run_id)
    logger.log_text("hello from posttrain", "notes/hello.txt")
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    model = logger.log_model("tiny-sft", tmp_path / "model", {}, {}, "an SFT policy")
    keys = s3fs.S3FileSystem().find(location.removeprefix("s3://"))
    assert any(k.endswith(f"{run.info.run_id}/artifacts/notes/hello.txt") for k in keys), keys
    assert any(k.endswith(f"models/{model}/artifacts/config.json") for k in keys), keys
    assert experiment_id(client, "s3-artifacts", location) == exp  # found again, not re-created

    from tasks.sources import download, lookup

    monkeypatch.setenv("POSTTRAIN_CACHE", str(tmp_path / "cache"))
    logger.finalize_model(model, ok=True)
    source = lookup(client, f"models:/{model}")
    assert source.download_uri.startswith(f"{location}/")
    folder = download(source, client.tracking_uri)
    assert (folder / "config.json").read_text() == "{}" and folder.is_relative_to(tmp_path / "cache")


LEASE_HOLDER = """
import sys, time
from tasks import lease
with lease.hold(sys.argv[1], print, {"flow_run_id": "holder"}):
    print("holding", flush=True)
    time.sleep(600)
"""


def test_s3_lease_one_holder_then_takeover_after_expiry(s3, tmp_path, monkeypatch):
    """A real process holds an S3 lease and renews it; a waiter waits. SIGKILLed, the holder cannot
    release it: the waiter takes it over once it expires (POSTTRAIN_LEASE_TTL_S), with a conditional
    write. A holder whose lease was taken over cannot commit."""
    import signal
    import subprocess
    import sys
    import threading
    import time

    from tasks import lease

    ttl = 4.0
    monkeypatch.setenv("POSTTRAIN_LEASE_TTL_S", str(ttl))
    folder = f"{s3}/sft/leasekey{uuid.uuid4().hex[:6]}"
    env = {**os.environ, "POSTTRAIN_LEASE_TTL_S": str(ttl)}
    holder = subprocess.Popen([sys.executable, "-c", LEASE_HOLDER, folder], env=env, stdout=subprocess.PIPE,
                              text=True, cwd=Path(__file__).resolve().parent.parent)
    try:
        assert holder.stdout.readline().strip() == "holding"
        said: list[str] = []
        got = threading.Event()

        def wait_for_it():
            with lease.hold(folder, said.append) as held:
                got.set()
                held.check()

        waiter = threading.Thread(target=wait_for_it, daemon=True)
        waiter.start()
        time.sleep(3 * ttl)  # several lifetimes: the holder's renewals keep it
        assert not got.is_set(), "the lease was taken from a live holder"
        assert any("is computing it" in s and "flow run holder" in s for s in said), said
        holder.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        assert got.wait(timeout=ttl + 15), "the waiter never took over the expired lease"
        took = time.monotonic() - killed
        waiter.join(timeout=10)
        assert took <= ttl + 5, took
        assert any("took over an expired lease" in s for s in said), said
        print(f"\ntakeover {took:.1f}s after the holder's SIGKILL (ttl {ttl:g}s)")
    finally:
        holder.kill()
        holder.wait()
    # the lease is released once the block ends: the next run takes it at once
    with lease.hold(folder, said.append) as held:
        # a launched rank checks (and so renews) the same lease with its holder's token while the
        # holder's renewer runs: neither takes the other for a taker
        rank_check = lease.checker(held.for_ranks())
        until = time.monotonic() + 2 * ttl
        while time.monotonic() < until:
            rank_check()
            time.sleep(0.05)
        held.check()
        # another process overwrites it (as a taker would after expiry): this holder must not commit
        lease_url, _ = lease.lock_paths(folder)
        from trainer import storage

        storage.write_json(lease_url, {"token": "someone-else", "expires": time.time() + 60})
        with pytest.raises(lease.LeaseLost, match="another run took it over"):
            held.check()
        with pytest.raises(lease.LeaseLost, match="another run took it over"):
            rank_check()


def test_s3_downloads_once_per_version_under_concurrency(s3, tmp_path):
    """Several threads (each its own lock file handle, as separate runs are) download one s3://
    folder at once: one downloads, the others wait and get the same complete copy. A new version of
    the result (a recompute at the same URL) is downloaded again, not served stale."""
    from concurrent.futures import ThreadPoolExecutor

    from trainer import storage

    url = f"{s3}/sft/dl{uuid.uuid4().hex[:6]}/model"
    for i in range(20):
        storage.write_bytes(f"{url}/part{i}.bin", bytes([i]) * 50_000)
    cache = tmp_path / "cache"
    with ThreadPoolExecutor(6) as pool:
        dirs = list(pool.map(lambda _: storage.local_dir(url, cache, version="run-a"), range(6)))
    assert len(set(dirs)) == 1 and len(list(dirs[0].glob("part*.bin"))) == 20
    assert not [p for p in cache.iterdir() if p.is_dir() and p != dirs[0]], "a partial download was left"
    storage.write_bytes(f"{url}/part0.bin", b"recomputed")
    fresh = storage.local_dir(url, cache, version="run-b")
    assert fresh != dirs[0] and (fresh / "part0.bin").read_bytes() == b"recomputed"


def test_a_csv_data_file_on_s3_gives_what_the_local_one_does(s3, tmp_path):
    """data.train as an s3:// CSV (real GSM8K rows, multi-line answers quoted): read through s3fs
    as the local file is, the same examples."""
    from tests.test_data import _gsm8k_as
    from trainer import storage
    from trainer.config import DataConfig
    from trainer.data import prepare

    local = _gsm8k_as(tmp_path / "g.csv", 30)
    url = f"{s3}/data/{uuid.uuid4().hex[:6]}/g.csv"
    storage.write_bytes(url, Path(local).read_bytes())
    want = prepare(DataConfig(source="files", train=local, test=local), seed=0)
    got = prepare(DataConfig(source="files", train=url, test=url), seed=0)
    assert (got.train, got.test) == (want.train, want.test) and len(got.train) == 30


UPLOAD_PEAK = """
import json, os, resource, sys, time
from trainer import storage
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
t0 = time.perf_counter()
storage.put_dir(sys.argv[1], sys.argv[2])
print(json.dumps({"growth_mib": (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024,
                  "seconds": time.perf_counter() - t0}))
"""


def test_a_large_file_is_uploaded_in_parts_not_read_whole(s3, tmp_path):
    """A 192 MiB file (a checkpoint's size class, scaled down) goes up in s3fs's parts: the
    uploading process grows by far less than the file (it read files whole before)."""
    import s3fs

    folder = tmp_path / "big"
    folder.mkdir()
    size = 192 << 20
    with open(folder / "model.safetensors", "wb") as f:
        for _ in range(size >> 20):
            f.write(os.urandom(1 << 20))
    url = f"{s3}/upload-test"
    out = subprocess.run([sys.executable, "-c", UPLOAD_PEAK, str(folder), url], capture_output=True, text=True,
                         env=os.environ, cwd=Path(__file__).resolve().parent.parent, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    measured = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"upload of {size >> 20} MiB: the process grew {measured['growth_mib']:.0f} MiB in {measured['seconds']:.1f} s")
    assert s3fs.S3FileSystem().size(f"{url}/model.safetensors".removeprefix("s3://")) == size
    assert measured["growth_mib"] < 96, measured


def _stopped(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("where", ["same_machine", "other_machine"])
def test_a_holder_that_lost_its_lease_stops_before_its_next_save(s3, tmp_path, where):
    """With real processes: the SFT stage's holder (the CLI) is SIGSTOPped after step 6 (its
    checkpoint at step 5 committed) past a 2 s lease; a second run takes the lease over and commits:
    on the same machine it resumes from that checkpoint (linked into a scratch folder of its own), on
    another (its own cache) from the same checkpoint, committed on the store. SIGCONT lets the holder go on, and
    it stops at its next save (step 10) with the reason, having written nothing more."""
    import signal
    import time

    from tests.test_resume_kill import ROOT

    root = f"{s3}/lease-{uuid.uuid4().hex[:6]}"
    overrides = [o for o in SMALL if not o.startswith("sft.max_steps=")] + ["sft.max_steps=15"]
    cache = tmp_path / "cache"  # one machine: both runs share its scratch area
    env = {**os.environ, "POSTTRAIN_LEASE_TTL_S": "2", "POSTTRAIN_CACHE": str(cache)}
    cmd = [sys.executable, "-m", "flows.cli", "sft", "--preset", "tiny", "--set", f"artifact_root={root}"]
    for o in overrides:
        cmd += ["--set", o]

    def start(name: str, **extra):
        log = open(tmp_path / f"{name}.log", "wb")
        return subprocess.Popen(cmd, cwd=ROOT, env={**env, **extra}, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True), tmp_path / f"{name}.log"

    holder, holder_log = start("holder", POSTTRAIN_FAULT="sft@6:stop")
    taker = None
    try:
        deadline = time.monotonic() + 400
        while not _stopped(holder.pid):
            assert holder.poll() is None, holder_log.read_text()[-3000:]
            assert time.monotonic() < deadline, "the holder never reached SFT step 6"
            time.sleep(0.2)
        [mine] = [p.parent for p in (cache / "work").glob("*/*/holder.json")
                  if json.loads(p.read_text())["pid"] == holder.pid and (p.parent / "checkpoints").is_dir()]
        assert (mine / "checkpoints" / "step00000005" / "COMMITTED").is_file()
        time.sleep(3)  # past the lease's 2 s
        other = {"POSTTRAIN_CACHE": str(tmp_path / "other-cache")} if where == "other_machine" else {}
        taker, taker_log = start("taker", **other)
        while "took over an expired lease" not in taker_log.read_text():
            assert taker.poll() is None, taker_log.read_text()[-3000:]
            assert time.monotonic() < deadline, "the second run never took the lease over"
            time.sleep(0.2)
        os.kill(holder.pid, signal.SIGCONT)
        assert holder.wait(timeout=300) != 0, holder_log.read_text()[-3000:]
        assert taker.wait(timeout=400) == 0, taker_log.read_text()[-3000:]
    finally:
        for p in (holder, taker):
            if p is not None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
    said_holder, said_taker = holder_log.read_text(), taker_log.read_text()
    assert "LeaseLost" in said_holder and "another run took it over" in said_holder, said_holder[-3000:]
    # the holder wrote nothing after it lost the lease: no step-10 checkpoint, no result
    assert sorted(p.name for p in (mine / "checkpoints").glob("step*")) == ["step00000005"]
    from trainer import storage

    [sft] = [p for p in storage.list_files(f"{root}/sft") if p.endswith("/manifest.json")]
    result = storage.read_json(f"{root}/sft/{sft}")["result"]
    assert result["steps"] == 15, result
    if where == "other_machine":  # the holder's checkpoint, committed on the store, is every machine's
        assert f"resuming from the checkpoint step00000005 committed at {root}/sft/" in said_taker, said_taker[-3000:]
        assert result["resumed_from_step"] == 5, result
        return
    assert f"resuming from the checkpoint step00000005 left on this machine by pid {holder.pid}" in said_taker, \
        said_taker[-3000:]
    [theirs] = [p.parent for p in mine.parent.glob("*/holder.json") if json.loads(p.read_text())["pid"] == taker.pid]
    assert theirs != mine and (theirs / "checkpoints" / "step00000010" / "COMMITTED").is_file()
    assert result["resumed_from_step"] == 5, result


def test_a_missing_bucket_or_missing_credentials_stop_the_run_naming_the_fix(s3, tmp_path, monkeypatch, capsys):
    """Not retried, no traceback: the CLI exits 2 at the run's first write naming the URL and the fix,
    and the dry run lists the same as a problem. Missing credentials are botocore's own finding with
    every source of them emptied for the test."""
    import fsspec

    from flows.cli import main

    missing = "s3://no-such-bucket-here/runs"
    assert main(["prepare-data", "--set", f"artifact_root={missing}"]) == 2
    assert "its bucket does not exist (NoSuchBucket); create the bucket, or fix the URL" in capsys.readouterr().err
    assert main(["speedrun", "--dry-run", "--set", f"artifact_root={missing}"]) == 2
    assert "PROBLEM: artifact_root: s3://no-such-bucket-here/runs: its bucket does not exist" in capsys.readouterr().out

    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    fsspec.filesystem("s3").clear_instance_cache()
    try:
        assert main(["prepare-data", "--set", f"artifact_root={s3}/no-credentials"]) == 2
        err = capsys.readouterr().err
        assert "no usable AWS credentials" in err and "export AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY" in err
        assert "Traceback" not in err
        assert main(["speedrun", "--dry-run", "--set", f"artifact_root={s3}/no-credentials"]) == 2
        assert "PROBLEM: artifact_root:" in capsys.readouterr().out
    finally:
        monkeypatch.undo()
        fsspec.filesystem("s3").clear_instance_cache()


def test_a_stage_that_fails_before_writing_leaves_no_scratch_folder(s3, tmp_path, capsys):
    """On an s3:// root a stage writes in a scratch folder of this machine, kept for the checkpoints a
    resume reads; a stage that failed before writing anything leaves none (it held only holder.json)."""
    from flows.cli import main
    from trainer import storage

    def holders() -> set[Path]:
        return set((storage.posttrain_cache() / "work").glob("*/*/holder.json"))

    before = holders()
    assert main(["prepare-data", "--set", f"artifact_root={s3}/early-failure", "--set", "data.source=files",
                 "--set", f"data.train={tmp_path}/missing.jsonl"]) == 2
    assert "missing.jsonl" in capsys.readouterr().err
    assert holders() == before


def test_an_mlflow_artifact_store_that_cannot_be_used_stops_the_run_failed(s3, capsys):
    """tracking.artifact_location in a bucket that does not exist: exit 2 naming the setting and the
    fix at the run's first artifact, before any stage, and the MLflow run ends FAILED (not RUNNING).
    The dry run lists it as a problem, and passes a location in a bucket that exists."""
    from mlflow import MlflowClient

    from flows.cli import main

    missing = ["--set", "tracking.artifact_location=s3://no-such-mlflow-bucket/mlflow"]
    assert main(["speedrun", "--dry-run", "--set", f"artifact_root={s3}/art-store", *missing]) == 2
    out = capsys.readouterr().out
    assert ("PROBLEM: tracking.artifact_location (the experiment's artifact store): "
            "s3://no-such-mlflow-bucket/mlflow: its bucket does not exist (NoSuchBucket)") in out, out[-2000:]
    assert main(["speedrun", "--dry-run", "--set", f"artifact_root={s3}/art-store",
                 "--set", f"tracking.artifact_location={s3}/mlflow-not-yet-written"]) == 0
    assert "PROBLEM" not in capsys.readouterr().out
    name = f"missing-bucket-{uuid.uuid4().hex[:8]}"
    assert main(["prepare-data", "--set", f"artifact_root={s3}/art-store", "--set", f"tracking.experiment={name}",
                 "--set", "tracking.artifact_location=s3://no-such-mlflow-bucket/mlflow"]) == 2
    err = capsys.readouterr().err
    assert "posttrain: tracking.artifact_location (the experiment's artifact store): s3://no-such-mlflow-bucket/mlflow/" in err
    assert "its bucket does not exist" in err, err[-2000:]
    client = MlflowClient()
    [run] = client.search_runs([client.get_experiment_by_name(name).experiment_id])
    assert run.info.status == "FAILED"
