"""A pytest process of this suite cleans up after itself: its session folder (the Prefect and MLflow
stores, caches and runs of its tests, about half a GiB after a full run) is removed when it exits.
Every `make test` left two or three behind in /tmp before (seen: 18 GiB of them on one machine)."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TESTS = ["tests/test_fixed_decoder.py::test_rows_decode_in_power_of_two_buckets",
         "tests/test_layout.py::test_the_detector_finds_a_circle_around_a_loop"]


def _pytest(tmp: Path, keep: bool, workers: int) -> subprocess.Popen:
    """TESTS in a pytest process of their own (on `workers` xdist workers, or none), TMPDIR=tmp."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env.update(TMPDIR=str(tmp), POSTTRAIN_KEEP_TEST_DIR="1" if keep else "0")
    xdist = ["-n", str(workers)] if workers else ["-p", "no:xdist"]
    return subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *xdist, *TESTS],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _watch(runs: dict[Path, subprocess.Popen]) -> dict[Path, set[str]]:
    """The session folders seen in each TMPDIR while its pytest process ran; each must pass."""
    seen: dict[Path, set[str]] = {tmp: set() for tmp in runs}
    deadline = time.monotonic() + 600
    while any(proc.poll() is None for proc in runs.values()) and time.monotonic() < deadline:
        for tmp, proc in runs.items():
            if proc.poll() is None:
                seen[tmp] |= {p.name for p in tmp.glob("posttrain-tests-*")}
        time.sleep(0.05)
    for proc in runs.values():  # past the deadline: none left running, whichever fails first
        if proc.poll() is None:
            proc.kill()
    for proc in runs.values():
        out = proc.communicate()[0]
        assert proc.returncode == 0, out[-4000:]
    return seen


@pytest.mark.slow
def test_a_pytest_process_leaves_no_session_folder_behind(tmp_path):
    """As `make test` runs (two xdist workers; a worker can end without atexit): the controller's and
    each worker's folder is made where TMPDIR says, and all three are gone when pytest has exited.
    POSTTRAIN_KEEP_TEST_DIR=1 keeps the folder (one pytest process without workers: the switch is
    the same in every process). The two pytest runs go side by side, each in its own TMPDIR."""
    cleaned, kept = tmp_path / "cleaned", tmp_path / "kept"
    cleaned.mkdir()
    kept.mkdir()
    seen = _watch({cleaned: _pytest(cleaned, keep=False, workers=2), kept: _pytest(kept, keep=True, workers=0)})
    assert len(seen[cleaned]) == 3  # xdist's controller and its two workers
    assert list(cleaned.glob("posttrain-tests-*")) == []
    assert len(seen[kept]) == 1 and [p.name for p in kept.glob("posttrain-tests-*")] == list(seen[kept])
