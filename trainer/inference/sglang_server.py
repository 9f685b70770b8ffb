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


def _watch(parent_pid: int, every_s: float = 1.0) -> None:
    while True:
        time.sleep(every_s)
        if process_gone(parent_pid):
            try:  # stderr may be a pipe that died with the parent: stop however the write goes
                print(f"posttrain: the process that started this server ({parent_pid}) is gone; stopping",
                      file=sys.stderr, flush=True)
            finally:
                os.killpg(os.getpgrp(), signal.SIGKILL)


# SGLang's scheduler and detokenizer processes, as SGLang starts them: what each imports first
CHILD_MODULES = ("sglang.srt.managers.scheduler", "sglang.srt.managers.detokenizer_manager")


def _cpu_mode(launch_args: list[str]) -> bool:
    return any(a == "--device" and b == "cpu" for a, b in zip(launch_args, launch_args[1:]))


def _fork_children_from_a_preloaded_server() -> None:
    """Start SGLang's scheduler and detokenizer by forkserver, with their modules imported once.

    SGLang starts them by spawn: each child is a new interpreter that imports SGLang, torch and
    transformers again (about 10 s of a core each on a 2-core AMD Zen 3), beside this process's own
    import. A forkserver imports CHILD_MODULES once and forks each child from that clean process,
    which then runs as a spawned one would (its arguments pickled, nothing of this process's state
    inherited). A tiny model's server on a 2-core AMD Zen 3: 36 s -> 24 s of a core to healthy, and
    2,241 -> 2,057 MiB of memory in all (PSS: the children share the forkserver's pages);
    tests/test_sglang_server.py 158 -> 120 s of CPU. CPU mode only: on GPUs the start is not the cost."""
    import multiprocessing

    multiprocessing.set_forkserver_preload(list(CHILD_MODULES))
    set_start_method = multiprocessing.set_start_method

    def start_children_by_forkserver(method, force=False):  # SGLang calls set_start_method("spawn", force=True)
        set_start_method("forkserver" if method == "spawn" else method, force=force)

    multiprocessing.set_start_method = start_children_by_forkserver


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
        _fork_children_from_a_preloaded_server()
    runpy.run_module("sglang.launch_server", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
