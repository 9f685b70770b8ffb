"""One rank of a launched stage (see trainer.launch):

    python -m trainer.local_launch --nprocs N ... -- python -u -m tasks.rank_main --spec <work>/launch_spec.json
      (the launcher calls `preload` once, then forks the ranks, each running `main`; see its doc)
    python -m deepspeed.launcher.runner --hostfile H ... --module tasks.rank_main --spec <work>/launch_spec.json

Every rank runs the same stage body as the one-rank path; rank 0 logs to the stage's MLflow run
and writes `launch_result.json` last, which the supervising task reads.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import socket
import sys
import threading
import time
from pathlib import Path

from trainer.procwatch import process_gone


def _watch_supervisor(pid: int, every_s: float = 2.0) -> None:
    """Exit if the supervising task's process is gone (killed outright, so it could not stop us):
    the launcher then sees this rank fail and stops the others. No rank outlives its task."""
    while True:
        time.sleep(every_s)
        if process_gone(pid):
            try:  # stderr may be a pipe that died with the supervisor: exit however the write goes
                print(f"the supervising process {pid} is gone; this rank exits", file=sys.stderr, flush=True)
            finally:
                os._exit(3)


def run_body(stage: str, cfg, inputs: dict, work: Path, logger) -> dict:
    """The rank body of `stage` (a kind in tasks/stages.py's table)."""
    from tasks import stages

    row = stages.of_kind(stage)
    if row.rank_body is None:
        raise ValueError(f"stage {stage!r} has no rank body in tasks/stages.py; the launcher runs "
                         f"{[s.kind for s in stages.STAGES if s.rank_body]}")
    return stages.load(row.rank_body)(cfg, inputs, work, logger)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tasks.rank_main")
    parser.add_argument("--spec", required=True, help="launch_spec.json written by the stage's task")
    parser.add_argument("--local_rank", type=int, default=None, help="set by the launcher")
    return parser


def preload(argv: list[str]) -> None:
    """What every rank of the spec's stage imports, imported once by trainer.local_launch before it
    forks the ranks: torch, DeepSpeed (with what its `initialize` imports on first use: the ZeRO
    optimizers' Muon check loads TorchInductor), MLflow's store and the stage's rank body with the
    modules it names in RANK_IMPORTS. Nothing here starts a thread or touches a device."""
    spec = json.loads(Path(_parser().parse_known_args(argv)[0].spec).read_text())
    import deepspeed  # noqa: F401
    import deepspeed.runtime.zero.muon.muon_optimizer  # noqa: F401

    from tasks import lease, stages, tracking  # noqa: F401
    from trainer import checkpoint, engine, launch  # noqa: F401

    if spec.get("mlflow"):
        import mlflow.store.tracking.sqlalchemy_store  # noqa: F401
    row = stages.of_kind(spec["stage"])
    if row.rank_body is not None:
        body = sys.modules[stages.load(row.rank_body).__module__]
        for name in getattr(body, "RANK_IMPORTS", ()):
            importlib.import_module(name)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    spec = json.loads(Path(args.spec).read_text())

    from trainer import engine as ds, launch
    from trainer.config import RunConfig
    from trainer.tracking import NullLogger

    if spec.get("ranks_lock"):
        # held until this process exits: a run taking over the stage waits for it (tasks/lease.py)
        from tasks.lease import hold_ranks_lock

        hold_ranks_lock(spec["ranks_lock"])
    # the supervising task's process, where it is on this host (a rank on another host is stopped by its
    # wrapper, trainer.hosts, when the launching host closes its ssh session)
    here = spec.get("supervisor_host") in (None, socket.gethostname())
    if here and spec.get("supervisor_pid") and process_gone(spec["supervisor_pid"]):
        return 3  # its task died before this rank started: another run may own the folder now
    if here and spec.get("supervisor_pid"):
        threading.Thread(target=_watch_supervisor, args=(spec["supervisor_pid"],), daemon=True).start()
    ds.init_distributed(spec.get("collective_timeout_s"))
    rank = ds.rank()
    level = logging.INFO if rank == 0 else logging.WARNING
    # on another host trainer.hosts prefixes each line with the rank itself (and pdsh with the host)
    prefix = "" if os.environ.get("POSTTRAIN_LAUNCH_ID") else f"[rank {rank}] "
    logging.basicConfig(level=level, stream=sys.stdout, force=True,
                        format=f"{prefix}%(levelname)s %(name)s: %(message)s")
    logging.getLogger("trainer").setLevel(level)  # (tasks/__init__ set INFO for the in-process stages)
    cfg = RunConfig.model_validate(spec["config"])
    work = Path(spec["work_dir"])
    work.mkdir(parents=True, exist_ok=True)  # a host's own scratch copy of the stage's folder (trainer.hosts)
    inputs = spec["inputs"]
    logger = NullLogger()
    if rank == 0 and spec.get("mlflow"):
        from tasks.tracking import MlflowLogger, mlflow_client

        logger = MlflowLogger(mlflow_client(spec["mlflow"]["tracking_uri"]), spec["mlflow"]["run_id"])
    local_rank = int(os.environ.get("LOCAL_RANK", args.local_rank or 0))
    status = launch.rank_status_path(work, local_rank, "error")
    status.parent.mkdir(parents=True, exist_ok=True)
    from tasks.lease import checker
    from trainer.checkpoint import guarded, mirrored

    try:
        # an s3:// stage's lease: checked (and renewed) before every checkpoint, as its task does; and
        # its checkpoints committed to the stage's folder there too, where any host resumes them
        with guarded(checker(spec["lease"]) if spec.get("lease") else None), mirrored(spec.get("checkpoint_mirror")):
            result = run_body(spec["stage"], cfg, inputs, work, logger)
        ds.barrier()
    except BaseException as e:  # recorded for the supervisor's message, then raised as usual
        from trainer.errors import InputError

        if isinstance(e, InputError):  # the user's to fix: the stage fails with this message alone
            launch.rank_status_path(work, local_rank, "input").write_text(str(e))
        status.write_text(f"{type(e).__name__}: {e}")
        raise
    launch.rank_status_path(work, local_rank, "ok").touch()
    if rank == 0:
        launch.write_result(work, result)
    import torch.distributed as dist

    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
