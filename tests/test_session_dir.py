"""A pytest process of this suite cleans up after itself: its session folder (the Prefect and MLflow
stores, caches and runs of its tests, about half a GiB after a full run) is removed when it exits.
Every `make test` left two or three behind in /tmp before (seen: 18 GiB of them on one machine)."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _one_test(tmp: Path, keep: bool) -> None:
    """Two tests on two xdist workers, as `make test` runs them (a worker can end without atexit)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env.update(TMPDIR=str(tmp), POSTTRAIN_KEEP_TEST_DIR="1" if keep else "0")
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2",
                          "tests/test_fixed_decoder.py::test_rows_decode_in_power_of_two_buckets",
                          "tests/test_layout.py::test_the_detector_finds_a_circle_around_a_loop"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]


def test_a_pytest_process_leaves_no_session_folder_behind(tmp_path):
    kept, cleaned = tmp_path / "kept", tmp_path / "cleaned"
    kept.mkdir()
    cleaned.mkdir()
    _one_test(kept, keep=True)  # the folder is made where TMPDIR says, and kept when asked
    assert len(list(kept.glob("posttrain-tests-*"))) == 3  # xdist's controller and its two workers
    _one_test(cleaned, keep=False)
    assert list(cleaned.glob("posttrain-tests-*")) == []
