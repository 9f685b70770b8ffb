"""What a killed process leaves in the temp folder, and who removes it (trainer/procwatch.py)."""

import os
import signal
import subprocess
import sys
from pathlib import Path

from trainer.procwatch import MP_TEMP_PREFIX, note_mp_temp_dir, sweep_dead

ROOT = Path(__file__).resolve().parent.parent
NOTE = "from trainer.procwatch import note_mp_temp_dir; note_mp_temp_dir()"


def _python(code: str, temp: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env={**os.environ, "TMPDIR": str(temp)},
                            stdout=subprocess.PIPE, text=True)


def test_the_multiprocessing_folder_goes_at_exit_and_after_a_sigkill_at_the_next_start(tmp_path):
    clean = _python(NOTE, tmp_path)
    assert clean.wait(timeout=60) == 0
    assert not list(tmp_path.iterdir())  # the folder and its link, both gone at a clean exit

    killed = _python(NOTE + "; print('noted', flush=True); import time; time.sleep(600)", tmp_path)
    assert killed.stdout.readline() == "noted\n"
    [link] = tmp_path.glob(f"{MP_TEMP_PREFIX}*")
    assert link.name.split("-")[3] == str(killed.pid) and (tmp_path / os.readlink(link)).is_dir()
    killed.send_signal(signal.SIGKILL)
    killed.wait(timeout=60)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([link.name, os.readlink(link)])  # both left

    alive = _python(NOTE + "; print('noted', flush=True); import time; time.sleep(600)", tmp_path)
    try:
        assert alive.stdout.readline() == "noted\n"
        [mine] = tmp_path.glob(f"{MP_TEMP_PREFIX}*")  # the dead one's link and folder went as this one began
        assert mine.name.split("-")[3] == str(alive.pid)
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted([mine.name, os.readlink(mine)])
        sweep_dead(tmp_path, MP_TEMP_PREFIX)  # a live process's folder stays
        assert (tmp_path / os.readlink(mine)).is_dir()
    finally:
        alive.kill()
        alive.wait(timeout=60)


def test_a_dead_process_link_takes_only_a_folder_beside_it(tmp_path):
    """A link that points out of the temp folder (or into a folder within it) goes alone."""
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    pid = int(gone.stdout)
    outside = tmp_path / "keep"
    (outside / "data").mkdir(parents=True)
    temp = tmp_path / "temp"
    (temp / "sub" / "deep").mkdir(parents=True)
    far, deep = temp / f"{MP_TEMP_PREFIX}h-{pid}-far", temp / f"{MP_TEMP_PREFIX}h-{pid}-deep"
    far.symlink_to("../keep")
    deep.symlink_to("sub/deep")
    sweep_dead(temp, f"{MP_TEMP_PREFIX}h-")
    assert not far.is_symlink() and not deep.is_symlink()
    assert (outside / "data").is_dir() and (temp / "sub" / "deep").is_dir()


def _note_then_die() -> None:
    note_mp_temp_dir()
    os._exit(0)  # as a SIGKILL: no clean-up


def test_a_child_that_inherited_its_parents_folder_never_has_it_removed(tmp_path):
    """A process started by multiprocessing inherits its parent's temp folder; its link would have
    had the live parent's folder removed (seen in the suite: the parent's next tensor send failed,
    its socket's path gone)."""
    code = ("import multiprocessing as mp, os\nfrom multiprocessing import util\n"
            "from trainer.procwatch import note_mp_temp_dir\nfrom tests.test_procwatch import _note_then_die\n"
            "note_mp_temp_dir()\nmine = util.get_temp_dir()\n"
            "child = mp.get_context('spawn').Process(target=_note_then_die)\nchild.start()\nchild.join()\n"
            "note_mp_temp_dir()\nprint(child.exitcode, os.path.isdir(mine), flush=True)\n")
    proc = _python(code, tmp_path)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0 and out == "0 True\n", out
    assert not list(tmp_path.iterdir())  # and at the parent's clean exit, its folder and link went
