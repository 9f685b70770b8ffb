"""Runs SGLang's own `sglang.launch_server` and takes the whole server down with its starter.

    <sglang python> trainer/inference/sglang_server.py --parent-pid PID -- <launch_server arguments>

Runs in the SGLang environment's interpreter, so it imports nothing from posttrain but the
standard-library-only `trainer/procwatch.py`, loaded by its path. The server is
started in a process group of its own (by `trainer.inference.sglang`); a thread here polls PID and, once that
process is gone (finished, crashed or SIGKILLed, so it could not stop the server itself), kills the
whole group: the HTTP server and SGLang's scheduler and detokenizer processes. Nothing outlives the
pipeline that started it.
"""

import importlib.util
import os
import runpy
import signal
import sys
import threading
import time

_spec = importlib.util.spec_from_file_location(
    "posttrain_procwatch", os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "procwatch.py"))
_procwatch = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_procwatch)
process_gone = _procwatch.process_gone
SCRATCH_PREFIX = "posttrain-sglang-"  # trainer.inference.sglang's temp folder of one server (its TMPDIR)
SHM_PREFIX = "sglang_"  # SGLang's shared memory in /dev/shm


def _scratch() -> str | None:
    """The temp folder posttrain made for this server (CPU mode), or None."""
    tmp = os.environ.get("TMPDIR", "").rstrip("/")
    return tmp if os.path.basename(tmp).startswith(SCRATCH_PREFIX) else None


def _leave_nothing() -> None:
    """Remove what SGLang leaves behind when it is killed: its shared memory in /dev/shm, and its
    ZMQ socket files, in the temp folder posttrain made for this server."""
    _procwatch.remove_folder(_scratch(), _procwatch.group_shared_memory(os.getpgrp(), SHM_PREFIX))


def _watch(parent_pid: int, every_s: float = 1.0) -> None:
    noted = _scratch() is None  # CPU mode: note this server's shared memory in its folder, once it has some
    while True:
        time.sleep(every_s)
        if not noted:
            noted = _procwatch.note_shared_memory(_scratch(), SHM_PREFIX)
        if process_gone(parent_pid):
            try:
                _leave_nothing()
                # stderr may be a pipe that died with the parent: stop however the write goes
                print(f"posttrain: the process that started this server ({parent_pid}) is gone; stopping",
                      file=sys.stderr, flush=True)
            finally:
                os.killpg(os.getpgrp(), signal.SIGKILL)


def _cpu_mode(launch_args: list[str]) -> bool:
    return any(a == "--device" and b == "cpu" for a, b in zip(launch_args, launch_args[1:]))


def _fork_children_from_this_process() -> None:
    """Start SGLang's scheduler and detokenizer by fork, from this process's imports.

    SGLang starts them by spawn: each child is a new interpreter that imports SGLang, torch and
    transformers again (about 10 s of a core each on a 2-core AMD Zen 3), although this process has
    already imported them all (SGLang's engine imports the scheduler's and detokenizer's entry points)
    by the time it starts them. Forked, they begin where this process is. What else a fork inherits
    is harmless here: SGLang starts them before this process opens its HTTP socket or its ZMQ
    context, and the only other threads then are the parent watch below (asleep, holding no lock)
    and numpy's and scipy's OpenBLAS pools (which stop themselves before a fork). A tiny model's
    server on a 2-core AMD Zen 3: 22 s -> 13 s to healthy, 21.5 -> 12.4 s of CPU, 2,026 -> 1,310 MiB
    of memory in all (PSS: the children share this process's pages). A preloaded forkserver, the
    step before this, saved a third as much: it imported everything once more.
    CPU mode only: on a GPU, CUDA may not be forked and the start is not the cost."""
    import multiprocessing

    set_start_method = multiprocessing.set_start_method

    def start_children_by_fork(method, force=False):  # SGLang calls set_start_method("spawn", force=True)
        set_start_method("fork" if method == "spawn" else method, force=force)

    multiprocessing.set_start_method = start_children_by_fork


def main() -> None:
    args = sys.argv[1:]
    if len(args) < 3 or args[0] != "--parent-pid" or args[2] != "--":
        raise SystemExit("usage: sglang_server.py --parent-pid PID -- <sglang.launch_server arguments>")
    parent = int(args[1])
    # run as a script, this file's folder (trainer/rl/) is first on sys.path: keep its modules out of
    # SGLang's imports
    if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
        sys.path.pop(0)
    threading.Thread(target=_watch, args=(parent,), daemon=True).start()
    cpus = os.environ.get("POSTTRAIN_SERVER_CPUS")
    if cpus:  # rollout.sglang.cpus: SGLang sizes its thread pools from the cores it may use
        os.sched_setaffinity(0, {int(c) for c in cpus.split(",")})
    sys.argv = ["sglang.launch_server", *args[3:]]
    if _cpu_mode(args[3:]):
        _fork_children_from_this_process()
    try:
        runpy.run_module("sglang.launch_server", run_name="__main__", alter_sys=True)
    finally:  # exiting on its own (its port taken, an error): noted now, whenever the watch last looked
        if _scratch() is not None:
            _procwatch.note_shared_memory(_scratch(), SHM_PREFIX)


if __name__ == "__main__":
    main()
