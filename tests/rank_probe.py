"""A rank module for trainer.local_launch's tests: `python -m tests.rank_probe DIR ACTION [SECONDS]`.

`preload` records the process that ran it; each rank (`main`) records its process, parent,
arguments, environment and torch threads into DIR/rank<LOCAL_RANK>.json after a parallel product
on its threads (an OpenMP pool broken by a fork would hang there), leaves behind what the
interpreter's exit must wait for or run (a thread pool's idle worker, a non-daemon thread that
finishes late, an atexit handler), then does ACTION: `ok`, `exit N`, `raise`, or `sleep` SECONDS.
"""

from __future__ import annotations

import atexit
import json
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_SIZE", "MASTER_ADDR", "MASTER_PORT", "CROSS_RANK", "CROSS_SIZE")


def preload(argv: list[str]) -> None:
    import torch  # noqa: F401  (what a rank module preloads; no parallel op before the fork)

    Path(argv[0], "preload.json").write_text(json.dumps({"pid": os.getpid(), "argv": argv}))


def main(argv: list[str]) -> int:
    import torch

    out, action, rank = Path(argv[0]), argv[1], os.environ["LOCAL_RANK"]
    a = torch.randn(256, 256)
    product_ok = bool(torch.allclose(a @ a, torch.mm(a, a)))
    record = {"pid": os.getpid(), "ppid": os.getppid(), "argv": argv, "sys_argv": sys.argv[1:],
              "env": {k: os.environ.get(k) for k in ENV}, "threads": torch.get_num_threads(),
              "product_ok": product_ok, "preloaded": "tests.rank_probe" in sys.modules and __name__ != "__main__"}
    (out / f"rank{rank}.json").write_text(json.dumps(record))
    pool = ThreadPoolExecutor(1)
    pool.submit(int).result()  # its worker idles until the interpreter's exit hooks stop it
    late = threading.Thread(target=lambda: (time.sleep(1.0), (out / f"late{rank}").touch()))
    late.start()  # not a daemon: the exit waits for it
    atexit.register(lambda: (out / f"atexit{rank}").write_text(str(late.is_alive())))
    if action == "exit":
        return int(argv[2])
    if action == "raise":
        raise RuntimeError(f"rank {rank} raised on purpose")
    if action == "sleep":
        time.sleep(float(argv[2]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
