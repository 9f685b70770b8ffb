"""Runs SGLang's own `sglang.launch_server` and takes the whole server down with its starter.

    <sglang python> trainer/sglang_server.py --parent-pid PID -- <launch_server arguments>

Runs in the SGLang environment's interpreter, so it imports nothing from posttrain (hence its own copy
of `_gone`, as in tasks/rank_main.py). The server is
started in a process group of its own (by `trainer.sglang`); a thread here polls PID and, once that
process is gone (finished, crashed or SIGKILLed, so it could not stop the server itself), kills the
whole group: the HTTP server and SGLang's scheduler and detokenizer processes. Nothing outlives the
pipeline that started it.
"""

import os
import runpy
import signal
import sys
import threading
import time


def _gone(pid: int) -> bool:
    """Whether `pid` has exited: no such process, or a zombie its own parent has not reaped yet
    (kill(pid, 0) still succeeds on a zombie)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False  # alive, under another user
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] in ("Z", "X")
    except (OSError, IndexError):
        return False  # no /proc (not Linux): kill(pid, 0) is all there is


def _watch(parent_pid: int, every_s: float = 1.0) -> None:
    while True:
        time.sleep(every_s)
        if _gone(parent_pid):
            try:  # stderr may be a pipe that died with the parent: stop however the write goes
                print(f"posttrain: the process that started this server ({parent_pid}) is gone; stopping",
                      file=sys.stderr, flush=True)
            finally:
                os.killpg(os.getpgrp(), signal.SIGKILL)


def main() -> None:
    args = sys.argv[1:]
    if len(args) < 3 or args[0] != "--parent-pid" or args[2] != "--":
        raise SystemExit("usage: sglang_server.py --parent-pid PID -- <sglang.launch_server arguments>")
    parent = int(args[1])
    # run as a script, this file's folder (trainer/) is first on sys.path: keep its modules out of
    # SGLang's imports
    if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
        sys.path.pop(0)
    threading.Thread(target=_watch, args=(parent,), daemon=True).start()
    sys.argv = ["sglang.launch_server", *args[3:]]
    runpy.run_module("sglang.launch_server", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
