"""DeepSpeed across ranks, for real: 2 CPU ranks over gloo, started by trainer.local_launch (DeepSpeed's
launcher's environment) and supervised by the stage's Prefect task.

- SFT and GRPO losses over the first steps match the one-rank run with the same global batch
  (SFT: 1 rank x 2 micro-batches of 8 vs 2 ranks x 1 of 8; GRPO: the same rollouts, shared
  out and gathered, and the same mini-batches split over the ranks);
- killing one rank fails the task cleanly (a clear error naming the rank, every process gone,
  well inside the stage's timeout), and a re-run resumes in 2 ranks from the checkpoint the 2
  ranks wrote, ending with exactly the weights of an uninterrupted 2-rank run;
- the supervisor kills a launch that overruns its timeout, children included.
"""

import json
import logging
import math
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from mlflow import MlflowClient

from tests.seeded import seed
from tests.test_pipeline import SMALL

pytestmark = pytest.mark.slow

BASE = [o for o in SMALL if not o.startswith(("sft.micro_batch_size=", "grpo.micro_batch_size="))] + [
    "sft.micro_batch_size=8", "grpo.micro_batch_size=4", "grpo.mini_batches=2",
    # 6 groups a round in chunks of 2 groups (8 sequences): 3 generate calls shared by the ranks
    "rollout.over_sample=1.5", "rollout.batch_size=8", "grpo.checkpoint_every=2",
    "sft.deepspeed.timeout_s=300", "grpo.deepspeed.timeout_s=300",
    # a 12-step SFT solves nothing yet: a dense reward gives every group a learning signal
    "grpo.rewards=[{name: tests.test_multirank.digit_share}]",
]
ONE_RANK_SFT = ["sft.grad_accum=2"]
TWO_RANK_SFT = ["sft.grad_accum=1", "sft.deepspeed.ranks_per_node=2"]
TWO_RANK_GRPO = ["grpo.deepspeed.ranks_per_node=2"]
# Stated tolerances: fp32 sums reordered by the all-reduce (SFT), identical rollouts (GRPO).
SFT_LOSS_ATOL = 1e-4
GRPO_LOSS_ATOL = 1e-5


def digit_share(response: str, example: dict) -> float:
    """A dense reward for the parity runs: the share of digits in the response."""
    return sum(c.isdigit() for c in response) / max(len(response), 1)


def stage(result: dict, name: str) -> dict:
    return next(s for s in result["stages"] if s["stage"] == name)


def manifest(result: dict, name: str) -> dict:
    return json.loads((Path(stage(result, name)["uri"]) / "manifest.json").read_text())


def sft_losses(result: dict) -> list[float]:
    from mlflow import MlflowClient

    run_id = manifest(result, "sft")["mlflow_run_id"]
    history = MlflowClient().get_metric_history(run_id, "train/loss")
    return [m.value for m in sorted(history, key=lambda m: m.step)]


def grpo_history(result: dict) -> list[dict]:
    path = Path(stage(result, "grpo")["uri"]) / "history.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def run(flow, root: Path, extra: list[str]) -> dict:
    return flow(preset="tiny", overrides=BASE + [f"artifact_root={root}"] + extra)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("multirank")


@pytest.fixture(scope="module")
def one_rank(root):
    from flows.speedrun import grpo_flow

    return run(grpo_flow, root, ONE_RANK_SFT)


SAID: dict[str, list[str]] = {}  # a launched stage's log lines (the ranks' output, as the supervisor logs it)


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def said_while(name: str, fn):
    """fn(), its flow and task runs' log lines kept in SAID[name] (GRPO logs at the flow's level)."""
    said, loggers = _Lines(), [logging.getLogger("prefect.task_runs"), logging.getLogger("prefect.flow_runs")]
    for logger in loggers:
        logger.addHandler(said)
    try:
        return fn()
    finally:
        for logger in loggers:
            logger.removeHandler(said)
        SAID[name] = said.lines


@pytest.fixture(scope="module")
def two_rank_sft(root):
    from flows.speedrun import sft_flow

    return said_while("two_rank_sft", lambda: run(sft_flow, root, TWO_RANK_SFT))


@pytest.fixture(scope="module")
def two_rank_grpo(root, one_rank):
    """GRPO on 2 ranks from the one-rank run's SFT checkpoint (a cache hit): same starting weights."""
    from flows.speedrun import grpo_flow

    return said_while("two_rank_grpo", lambda: run(grpo_flow, root, ONE_RANK_SFT + TWO_RANK_GRPO))


def test_sft_two_ranks_match_one_rank(one_rank, two_rank_sft):
    one, two = sft_losses(one_rank), sft_losses(two_rank_sft)
    print("\nSFT train/loss  step  1 rank  2 ranks  |diff|")
    for step, (a, b) in enumerate(zip(one, two), start=1):
        print(f"  {step:>2}  {a:.6f}  {b:.6f}  {abs(a - b):.1e}")
    assert len(one) == len(two) == 12
    for step, (a, b) in enumerate(zip(one, two), start=1):
        assert math.isclose(a, b, abs_tol=SFT_LOSS_ATOL), f"step {step}: 1 rank {a} vs 2 ranks {b}"
    assert stage(two_rank_sft, "sft")["metrics"]["sft/world_size"] == 2
    assert stage(one_rank, "sft")["metrics"]["sft/world_size"] == 1


def test_rank_0_says_its_progress_and_the_other_ranks_only_their_warnings(two_rank_sft, two_rank_grpo):
    """The ranks' output reaches the task's log (the Prefect UI): rank 0's progress and notices (no
    terminal there: log lines), and no rank 1 info lines doubling rank 0's."""
    sft, grpo = SAID["two_rank_sft"], SAID["two_rank_grpo"]
    assert any(line.startswith("[rank 0] INFO trainer.progress: sft: 12/12 steps (100%), ") for line in sft), sft
    assert any(line.startswith("[rank 0] INFO trainer.kernels: compiled kernels") for line in grpo), grpo
    assert not [line for line in sft + grpo if line.startswith("[rank 1] INFO")]


def test_grpo_two_ranks_match_one_rank(one_rank, two_rank_grpo):
    assert stage(two_rank_grpo, "sft")["cache_hit"]  # both GRPO runs start from the same weights
    assert stage(two_rank_grpo, "grpo")["metrics"]["grpo/world_size"] == 2
    one, two = grpo_history(one_rank), grpo_history(two_rank_grpo)
    assert [h["round"] for h in one] == [h["round"] for h in two] == [1, 2, 3, 4]
    print("\nGRPO update/loss  round  1 rank  2 ranks  |diff|  reward/mean")
    for a, b in zip(one, two):
        print(f"  {a['round']:.0f}  {a['update/loss']:+.7f}  {b['update/loss']:+.7f}  "
              f"{abs(a['update/loss'] - b['update/loss']):.1e}  {a['reward/mean']:.3f} / {b['reward/mean']:.3f}")
    for a, b in zip(one, two):
        # the same rollouts: gathered from both ranks in the one-rank order
        for key in ("reward/mean", "reward/std", "rollout/generated_tokens", "rollout/groups_used",
                    "update/samples", "update/optimizer_steps"):
            assert a[key] == b[key], (a["round"], key, a[key], b[key])
        assert a["update/loss"] != 0.0 and a["reward/std"] > 0  # a real update, not an empty one
        for key in ("update/loss", "update/pg_loss", "update/clip_frac", "update/ratio_mean"):
            assert math.isclose(a[key], b[key], abs_tol=GRPO_LOSS_ATOL), (a["round"], key, a[key], b[key])
        # AdamW would hide a gradient scaled by the rank count; the norm (before clipping) does not
        assert math.isclose(a["update/grad_norm"], b["update/grad_norm"], rel_tol=1e-4), (
            a["round"], a["update/grad_norm"], b["update/grad_norm"])
    # rank 0 ran the periodic evals of the 2-rank run
    assert [h["round"] for h in two if "eval/accuracy" in h] == [2, 4]


def test_control_runs_on_two_ranks(root, two_rank_sft):
    """With SFT launched on 2 ranks the control is too: the sft body from the SFT policy, for the
    steps GRPO's seconds buy at the SFT stage's pace."""
    from flows.speedrun import speedrun

    result = said_while("control", lambda: run(speedrun, root, TWO_RANK_SFT + ["control.enabled=true"]))
    assert stage(result, "sft")["cache_hit"]
    assert [s["label"] for s in result["stages"]][-2:] == ["control", "eval (control)"]
    control = manifest(result, "control")
    assert control["metrics"]["sft/world_size"] == 2
    assert control["result"]["steps"] == control["metrics"]["control/steps"] >= 1
    steps = control["result"]["steps"]  # its ranks' progress, as the control's (not as SFT's)
    assert any(line.startswith(f"[rank 0] INFO trainer.progress: control: {steps}/{steps} steps (100%), ")
               for line in SAID["control"]), SAID["control"]
    first = min(MlflowClient().get_metric_history(control["mlflow_run_id"], "train/loss"), key=lambda m: m.step)
    assert first.value < sft_losses(result)[0] - 0.3  # from the SFT weights, not from scratch


def _ranks_left(spec_marker: str) -> list[psutil.Process]:
    """The live processes whose command line names `spec_marker`."""
    left = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if any(spec_marker in part for part in (p.info["cmdline"] or [])):
                left.append(p)
        except psutil.Error:
            pass
    return left


def _ranks_left_after(spec_marker: str, wait_s: float = 10.0) -> list[psutil.Process]:
    """The processes still alive `wait_s` after a failure was reported (none, at once, if all are
    gone: a SIGKILLed process leaves the table a moment after the signal, not at it)."""
    deadline = time.monotonic() + wait_s
    while (left := _ranks_left(spec_marker)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


@pytest.mark.parametrize("stage_name, fault, resumed_key, resumed_at, extra", [
    ("sft", "sft@7:kill:1", "resumed_from_step", 5, TWO_RANK_SFT),
    ("grpo", "grpo_after_update@3:kill:1", "resumed_from_round", 2, ONE_RANK_SFT + TWO_RANK_GRPO),
])
def test_killing_one_rank_fails_cleanly_then_resumes(tmp_path, root, two_rank_sft, two_rank_grpo, monkeypatch,
                                                     stage_name, fault, resumed_key, resumed_at, extra):
    from flows.speedrun import grpo_flow, sft_flow

    flow = sft_flow if stage_name == "sft" else grpo_flow
    reference = two_rank_sft if stage_name == "sft" else two_rank_grpo
    if stage_name == "grpo":  # from the module's data, tokenizer and one-rank SFT (cache hits)
        seed(root, tmp_path)
    monkeypatch.setenv("POSTTRAIN_FAULT", fault)
    t0 = time.perf_counter()
    with pytest.raises(Exception) as failure:
        run(flow, tmp_path, extra)
    seconds = time.perf_counter() - t0
    message = str(failure.value)
    assert "local rank 1 (pid" in message and "was killed by signal 9" in message, message
    assert "local rank 0" not in message.split("; then")[0], message
    assert seconds < 300  # the stage's timeout_s: the launcher noticed the dead rank by itself
    assert not _ranks_left_after(str(tmp_path)), "a rank outlived the failed task"
    print(f"{stage_name}: killed rank 1, task failed after {seconds:.1f}s")

    monkeypatch.delenv("POSTTRAIN_FAULT")
    resumed = run(flow, tmp_path, extra)
    got, want = manifest(resumed, stage_name), manifest(reference, stage_name)
    if stage_name == "sft":
        assert got["result"][resumed_key] == resumed_at
        assert got["result"]["state_hash"] == want["result"]["state_hash"]
    else:
        assert got[resumed_key] == resumed_at
        assert got["state_hash"] == want["state_hash"]
        assert grpo_history(resumed) == grpo_history(reference) or _same_but_timings(
            grpo_history(resumed), grpo_history(reference))
        assert stage(resumed, "sft")["cache_hit"]


def _same_but_timings(a: list[dict], b: list[dict]) -> bool:
    def strip(h):
        return {k: v for k, v in h.items() if not k.startswith("time/") and "per_second" not in k}

    return [strip(h) for h in a] == [strip(h) for h in b]


def test_supervisor_kills_an_overrunning_launch(tmp_path):
    """A launch that never finishes: the whole process group is killed at the timeout."""
    from trainer.launch import LaunchError, LaunchPlan, supervise

    child = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)', sys.argv[1]]); " \
            "print('started', flush=True); time.sleep(600)"
    marker = f"overrun-{os.getpid()}"
    plan = LaunchPlan("sft", [sys.executable, "-c", child, marker], world_size=2, ranks_per_node=2, nodes=1,
                      hostfile=None)
    lines: list[str] = []
    t0 = time.perf_counter()
    with pytest.raises(LaunchError, match="did not finish within timeout_s=3s"):
        supervise(plan, tmp_path, lines.append, timeout_s=3)
    assert time.perf_counter() - t0 < 3 + 15
    assert lines == ["started"]
    assert not _ranks_left_after(marker)
    assert subprocess.run(["pgrep", "-f", marker], capture_output=True).returncode == 1


RANK_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_SIZE", "MASTER_ADDR", "MASTER_PORT", "CROSS_RANK", "CROSS_SIZE")


def test_the_local_launcher_gives_each_rank_its_place_and_stops_the_rest_when_one_fails(tmp_path):
    """trainer.local_launch: each rank gets DeepSpeed's launcher environment and `--local_rank`;
    when rank 1 exits 3, the others are stopped (rank 0 would sleep for 10 minutes), the launcher
    says so in the words the supervisor reads, and exits 3. A launch whose ranks all exit 0 exits 0."""
    from trainer.launch import _RankWatch

    # each rank records its arguments and environment; rank 1 fails once all three have
    rank = ("import json, os, sys, time; "
            f"d = {str(tmp_path)!r}; "
            "open(os.path.join(d, 'rank' + os.environ['LOCAL_RANK']), 'w').write(json.dumps("
            f"[sys.argv[1:], {{k: os.environ[k] for k in {RANK_ENV!r}}}])); "
            "t = time.monotonic(); "
            "[time.sleep(0.05) for _ in iter(lambda: len([f for f in os.listdir(d) if f.startswith('rank')]) < 3 "
            "and time.monotonic() - t < 60, False)]; "
            "sys.exit(int(sys.argv[2])) if os.environ['RANK'] == '1' else time.sleep(float(sys.argv[3]))")
    launch = [sys.executable, "-m", "trainer.local_launch", "--nprocs", "3", "--master_port", "29999", "--",
              sys.executable, "-c", rank]
    t0 = time.perf_counter()
    out = subprocess.run([*launch, "x", "3", "600"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 3, out.stdout + out.stderr
    assert time.perf_counter() - t0 < 60  # not rank 0's 600 s: it was stopped
    for i in range(3):
        args, env = json.loads((tmp_path / f"rank{i}").read_text())
        assert args == ["x", "3", "600", f"--local_rank={i}"]
        assert env == {"RANK": str(i), "LOCAL_RANK": str(i), "WORLD_SIZE": "3", "LOCAL_SIZE": "3",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999", "CROSS_RANK": "0", "CROSS_SIZE": "1"}
    watch = _RankWatch(tmp_path)
    for line in out.stdout.splitlines():
        watch.saw(line)
    assert sorted(watch.pids) == [0, 1, 2] and watch.cleanup_at is not None
    assert "exits with return code = 3" in out.stdout
    # the launcher names the rank that failed first: the supervisor need not have seen it go
    assert watch.describe(out.stdout.splitlines()).startswith(f"local rank 1 (pid {watch.pids[1]})")
    assert not [p for p in watch.pids.values() if psutil.pid_exists(p)]

    ok = subprocess.run([*launch, "x", "0", "0"], capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0 and ok.stdout.count("exits successfully") == 3, ok.stdout + ok.stderr


def test_each_local_rank_gets_its_share_of_the_cores_as_threads_unless_omp_num_threads_is_set(tmp_path):
    """N ranks each taking every core oversubscribe them N times over: the launcher gives each rank
    cores // N torch threads (at least one), and an OMP_NUM_THREADS the user set is left alone."""
    from trainer.local_launch import rank_threads

    assert [rank_threads(n, 16) for n in (1, 2, 3, 16, 32)] == [16, 8, 5, 1, 1]
    rank = (f"import os, torch; open(os.path.join({str(tmp_path)!r}, os.environ['RANK']), 'w')"
            ".write(str(torch.get_num_threads()))")
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    # two ranks share the cores; one rank told to take 1 thread takes 1 (torch caps threads at the cores)
    for nprocs, omp, want in ((2, None, rank_threads(2)), (1, None, rank_threads(1)), (1, "1", 1)):
        out = subprocess.run([sys.executable, "-m", "trainer.local_launch", "--nprocs", str(nprocs), "--master_port",
                              "29998", "--", sys.executable, "-c", rank], capture_output=True, text=True, timeout=300,
                             env=env if omp is None else {**env, "OMP_NUM_THREADS": omp})
        assert out.returncode == 0, out.stdout + out.stderr
        assert [(tmp_path / str(i)).read_text() for i in range(nprocs)] == [str(want)] * nprocs, (nprocs, omp)


@pytest.mark.parametrize("after_lines", [1, 4], ids=["while-spawning", "once-spawned"])
def test_the_local_launcher_stops_its_ranks_on_sigterm(tmp_path, after_lines):
    """SIGTERM stops every rank the launcher started, also one that arrives while it is still
    starting them (after the first `spawned` line of four, usually before the second): a rank
    started before the signal was acted on is never left running."""
    import signal

    marker = f"sigterm-{os.getpid()}-{after_lines}"
    proc = subprocess.Popen([sys.executable, "-m", "trainer.local_launch", "--nprocs", "4", "--master_port", "29999",
                             "--", sys.executable, "-c", "import time; time.sleep(600)", marker],
                            stdout=subprocess.PIPE, text=True)
    try:
        spawned = [proc.stdout.readline() for _ in range(after_lines)]
        proc.send_signal(signal.SIGTERM)
        assert all("spawned with command" in line for line in spawned), spawned
        assert proc.wait(timeout=60) == 1
        orphans = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True).stdout.split()
        assert orphans == [], f"ranks left running after the launcher exited: {orphans}"
        out = "".join(spawned) + proc.stdout.read()  # no rank left to hold the pipe open
        started = re.findall(r"process (\d+) spawned with command", out)
        assert started and sorted(re.findall(r"Killing subprocess (\d+)", out)) == sorted(started), out
    finally:
        proc.kill()
        subprocess.run(["pkill", "-9", "-f", marker])


def test_a_launch_takes_its_rendezvous_file_with_it(tmp_path):
    """The ranks of a launch on one machine meet through a file in the temp folder; once the launch
    ends (here: its one rank wrote the store and no result) the file is gone, not left per run."""
    from trainer.engine import RENDEZVOUS
    from trainer.launch import LaunchError, LaunchPlan, supervise

    store, seen = tmp_path / "posttrain-rendezvous-test", tmp_path / "seen"
    child = (f"import os, shutil; open(os.environ['{RENDEZVOUS}'], 'w').write('store'); "
             f"shutil.copy(os.environ['{RENDEZVOUS}'], {str(seen)!r})")
    plan = LaunchPlan("sft", [sys.executable, "-c", child], 1, 1, 1, None, {RENDEZVOUS: str(store)})
    with pytest.raises(LaunchError, match="wrote no"):
        supervise(plan, tmp_path, lambda line: None, timeout_s=60)
    assert seen.read_text() == "store" and not store.exists()


def test_a_killed_launchs_rendezvous_file_goes_at_the_next_one(tmp_path, monkeypatch):
    """A launcher killed outright leaves its file; the next rendezvous on the machine removes the
    files whose process is gone, never a live one's nor another machine's."""
    import tempfile

    from trainer.engine import rendezvous_file

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    dead = subprocess.Popen(["true"])
    dead.wait()
    host = socket.gethostname()
    stale = tmp_path / f"posttrain-rendezvous-{host}-{dead.pid}-0123"
    live = tmp_path / f"posttrain-rendezvous-{host}-{os.getpid()}-4567"
    elsewhere = tmp_path / f"posttrain-rendezvous-{host}x-{dead.pid}-89ab"  # another machine's name
    for f in (stale, live, elsewhere):
        f.write_text("store")
    fresh = Path(rendezvous_file())
    assert fresh.parent == tmp_path and not fresh.exists()
    assert not stale.exists() and live.exists() and elsewhere.exists()


def test_ranks_exit_when_the_supervising_process_is_killed(tmp_path):
    """The task's process killed outright (SIGKILL: no chance to clean up): the ranks notice their
    supervisor is gone and exit, and the launcher takes the rest down. Nothing is left running."""
    import signal

    root = tmp_path / "art"
    cmd = [sys.executable, "-m", "flows.cli", "sft", "--set", f"artifact_root={root}", "--set", "sft.max_steps=100000",
           "--set", "sft.max_seconds=600"]
    for o in BASE + TWO_RANK_SFT:
        if not o.startswith("sft.max_steps="):
            cmd += ["--set", o]
    log = tmp_path / "cli.log"
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, cwd=Path(__file__).resolve().parent.parent, stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while len([p for p in _ranks_left(str(root)) if "tasks.rank_main" in " ".join(p.info["cmdline"] or [])]) < 2:
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)
        time.sleep(3)  # the ranks are training
        os.kill(proc.pid, signal.SIGKILL)
        t0 = time.perf_counter()
        while _ranks_left(str(root)) and time.perf_counter() - t0 < 30:
            time.sleep(0.5)
        left = _ranks_left(str(root))
        assert not left, [p.cmdline() for p in left]
        print(f"every rank gone {time.perf_counter() - t0:.1f}s after the supervisor was killed")
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the CLI's own Prefect server
        except ProcessLookupError:
            pass


def test_failure_message_names_the_rank_that_died_first(tmp_path):
    """The launcher reports one return code; the message comes from what each rank recorded and
    from when the supervisor saw each one go."""
    from trainer.launch import _RankWatch, rank_status_path

    watch = _RankWatch(tmp_path)
    for rank, pid in ((0, 100), (1, 101), (2, 102)):
        watch.saw(f"[INFO] [launch.py:245:main] process {pid} spawned with command: ['python', '-u', '-m', "
                  f"'tasks.rank_main', '--local_rank={rank}', '--spec', 'x']")
    rank_status_path(tmp_path, 2, "error").parent.mkdir(parents=True)
    rank_status_path(tmp_path, 2, "error").write_text("RuntimeError: Connection closed by peer")
    watch.dead_at = {1: 5.0, 0: 7.0, 2: 6.0}  # rank 1 went first; the launcher stopped rank 0 at 6.5
    watch.cleanup_at = 6.5
    lines = ["['python', ...] exits with return code = -9"]
    assert watch.describe(lines) == ("local rank 1 (pid 101) was killed by signal 9; then the launcher stopped "
                                     "local rank 0; then local rank 2 (pid 102) raised RuntimeError: Connection "
                                     "closed by peer")
    watch.dead_at = {}  # the supervisor saw none go before the clean-up: it does not guess
    assert watch.describe(lines).startswith("the launcher stopped local rank 0, 1")


def test_the_rank_the_launcher_names_first_is_first_whenever_the_others_were_seen_to_go(tmp_path):
    """A user's error on rank 0 (a reward that raised) is the run's error, exit 2 with its words, even
    where this process saw rank 1, which the launcher then stopped, gone before it read the
    launcher's lines: on a loaded machine the suite's two-rank reward test got the launcher's
    failure (exit 1, 'local rank 1 was killed by a signal; then local rank 0 raised ...')."""
    from trainer.launch import _RankWatch, rank_status_path

    watch = _RankWatch(tmp_path)
    for rank, pid in ((0, 100), (1, 101)):
        watch.saw(f"[posttrain local_launch] process {pid} spawned with command: ['python', '-u', '-m', "
                  f"'tasks.rank_main', '--local_rank={rank}', '--spec', 'x']")
    rank_status_path(tmp_path, 0, "error").parent.mkdir(parents=True)
    rank_status_path(tmp_path, 0, "error").write_text("RewardError: grpo.rewards: reward 'r' raised TypeError")
    rank_status_path(tmp_path, 0, "input").write_text("grpo.rewards: reward 'r' raised TypeError on example 'syn-4'")
    watch.dead_at = {1: 5.0}  # seen gone by the poll before the pump thread read a line of the clean-up
    lines = ["[posttrain local_launch] local rank 0 (pid 100) failed first, with exit code 1",
             "[posttrain local_launch] Killing subprocess 101",
             "[posttrain local_launch] ['python', ...] exits with return code = 1"]
    for line in lines:
        watch.saw(line)
    assert watch.input_error() == "grpo.rewards: reward 'r' raised TypeError on example 'syn-4'"
    assert watch.describe(lines) == ("local rank 0 (pid 100) raised RewardError: grpo.rewards: reward 'r' raised "
                                     "TypeError; then the launcher stopped local rank 1")


def test_what_killed_processes_leave_behind_stalls_no_group_and_is_cleaned_up(tmp_path):
    """A process killed while DeepSpeed JIT-built an op leaves torch's lock file behind; a later
    run must still start (this hung CI for 90 minutes before DeepSpeed's shm op was skipped). A
    process killed with its group up leaves the group's rendezvous file in the temp folder; the
    next group removes it (each CI run used to leave about 35 there), and no other machine's."""
    (tmp_path / "deepspeed_shm_comm").mkdir()
    (tmp_path / "deepspeed_shm_comm" / "lock").touch()
    temp = tmp_path / "temp"  # the one-rank group's rendezvous file: made here, gone when the process ends
    temp.mkdir()
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path), "TMPDIR": str(temp)}
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    killed = "import os, signal; from trainer import engine; engine.init_distributed(); os.kill(os.getpid(), signal.SIGKILL)"
    out = subprocess.run([sys.executable, "-c", killed], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == -signal.SIGKILL, out.stderr[-2000:]
    left = list(temp.glob("posttrain-rendezvous-*"))
    assert len(left) == 1, "a SIGKILLed group leaves its file (no destructor runs): the next group removes it"
    # another machine's (a container sharing the temp folder): its process is not ours to see
    elsewhere = temp / f"posttrain-rendezvous-not-{socket.gethostname()}-{2 ** 22 + 1}-0f0f"
    elsewhere.touch()
    code = "from trainer import engine; engine.init_distributed(); print('group', engine.world_size())"
    try:
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail("init_distributed waited on a stale lock in TORCH_EXTENSIONS_DIR")
    assert out.returncode == 0, out.stderr[-2000:]
    assert "group 1" in out.stdout
    assert list(temp.glob("posttrain-rendezvous-*")) == [elsewhere], "a group's rendezvous file outlived its process"


def test_a_zombie_supervisor_counts_as_gone():
    """A SIGKILLed supervisor that its own parent has not reaped yet is a zombie: kill(pid, 0) still
    succeeds on it, so the watchers look at its state too."""
    from trainer.procwatch import process_gone

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert not process_gone(child.pid)
        os.kill(child.pid, 9)
        deadline = time.monotonic() + 10
        while Path(f"/proc/{child.pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z":
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert process_gone(child.pid)  # not reaped yet: a zombie
    finally:
        child.wait()
    assert process_gone(child.pid)


def _probe(tmp_path: Path, nprocs: int, *args: str, start: str = "fork", omp: str | None = None,
           timeout: float = 300) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "POSTTRAIN_RANK_START")}
    env["POSTTRAIN_RANK_START"] = start
    if omp is not None:
        env["OMP_NUM_THREADS"] = omp
    return subprocess.run([sys.executable, "-u", "-m", "trainer.local_launch", "--nprocs", str(nprocs), "--master_port",
                           "29997", "--", sys.executable, "-u", "-m", "tests.rank_probe", str(tmp_path), *args],
                          capture_output=True, text=True, timeout=timeout, env=env)


@pytest.mark.parametrize("start", ["fork", "spawn"])
def test_forked_ranks_import_their_module_once_and_live_and_exit_as_spawned_ones(tmp_path, start):
    """`python -u -m MODULE` ranks are forked from the launcher after it imported MODULE and ran its
    preload once (POSTTRAIN_RANK_START=spawn: fresh processes, the module imported by each). Either
    way each rank gets the same arguments, environment and share of the cores as torch threads, runs
    a parallel product on them, and exits as `python -m` does: an idle thread pool and a non-daemon
    thread waited for, atexit handlers run, its return code, an exception's traceback and exit 1."""
    from trainer.local_launch import rank_threads

    out = _probe(tmp_path, 2, "ok", start=start)
    assert out.returncode == 0, out.stdout + out.stderr
    launcher = [int(m) for m in re.findall(r"process (\d+) spawned", out.stdout)]
    assert len(launcher) == 2
    ranks = [json.loads((tmp_path / f"rank{i}.json").read_text()) for i in range(2)]
    for i, r in enumerate(ranks):
        assert r["argv"] == r["sys_argv"] == [str(tmp_path), "ok", f"--local_rank={i}"]
        assert r["env"] == {"RANK": str(i), "LOCAL_RANK": str(i), "WORLD_SIZE": "2", "LOCAL_SIZE": "2",
                            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29997", "CROSS_RANK": "0", "CROSS_SIZE": "1"}
        assert r["threads"] == rank_threads(2) and r["product_ok"]
        assert (tmp_path / f"late{i}").exists()  # the non-daemon thread ran to its end
        assert (tmp_path / f"atexit{i}").read_text() == "False"  # after the thread was joined
    if start == "fork":
        preload = json.loads((tmp_path / "preload.json").read_text())
        assert preload["argv"] == [str(tmp_path), "ok"]
        assert all(r["ppid"] == preload["pid"] and r["preloaded"] for r in ranks)
        assert out.stdout.count("forked from this process, tests.rank_probe imported once") == 2
    else:
        assert not (tmp_path / "preload.json").exists() and not any(r["preloaded"] for r in ranks)
        assert "forked from this process" not in out.stdout
    assert sorted(r["pid"] for r in ranks) == sorted(launcher)

    for f in tmp_path.iterdir():
        f.unlink()
    failed = _probe(tmp_path, 2, "exit", "7", start=start, omp="2")
    assert failed.returncode == 7 and "exits with return code = 7" in failed.stdout, failed.stdout + failed.stderr
    assert [json.loads((tmp_path / f"rank{i}.json").read_text())["threads"] for i in range(2)] == [min(2, os.cpu_count())] * 2
    raised = _probe(tmp_path, 1, "raise", start=start)
    assert raised.returncode == 1, raised.stdout + raised.stderr
    assert "RuntimeError: rank 0 raised on purpose" in raised.stderr and "ForkedRank" not in raised.stderr


def test_the_local_launcher_stops_forked_ranks_on_sigterm(tmp_path):
    """SIGTERM to a launcher that forked its ranks stops every one of them, as spawned ones are."""
    proc = subprocess.Popen([sys.executable, "-u", "-m", "trainer.local_launch", "--nprocs", "2", "--master_port",
                             "29997", "--", sys.executable, "-u", "-m", "tests.rank_probe", str(tmp_path), "sleep",
                             "600"], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "POSTTRAIN_RANK_START": "fork"})
    try:
        lines = [proc.stdout.readline() for _ in range(2)]
        pids = [int(re.search(r"process (\d+) spawned", line).group(1)) for line in lines]
        assert all("forked from this process" in line for line in lines), lines
        deadline = time.monotonic() + 120
        while not all((tmp_path / f"rank{i}.json").exists() for i in range(2)) and time.monotonic() < deadline:
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 1
        rest = proc.stdout.read()
        assert sorted(int(p) for p in re.findall(r"Killing subprocess (\d+)", rest)) == sorted(pids), rest
        assert not [p for p in pids if psutil.pid_exists(p)]
    finally:
        proc.kill()


@pytest.mark.parametrize("before, after", [(2, 1), (1, 2)])
def test_a_grpo_checkpoint_resumes_on_another_rank_count(tmp_path, root, one_rank, two_rank_grpo, monkeypatch,
                                                          before, after):
    """A GRPO run that failed on `before` ranks, run again on `after`: it resumes from the round-2
    checkpoint the failed run committed (ZeRO-1's optimizer state, partitioned by rank, re-split by
    DeepSpeed's elastic checkpoint) and ends close to, not bit-identical with, an uninterrupted run
    on `after` ranks: the same rollouts and rewards every round, losses within the 1-vs-2-rank bound."""
    from flows.speedrun import grpo_flow

    ranks = {1: [], 2: TWO_RANK_GRPO}
    seed(root, tmp_path)  # the module's data, tokenizer and one-rank SFT (cache hits)
    monkeypatch.setenv("POSTTRAIN_FAULT", "grpo_after_update@3")  # round 3 updated, its checkpoint not written
    with pytest.raises(Exception):
        run(grpo_flow, tmp_path, ONE_RANK_SFT + ranks[before])
    monkeypatch.delenv("POSTTRAIN_FAULT")
    resumed = said_while(f"resumed-{before}-{after}", lambda: run(grpo_flow, tmp_path, ONE_RANK_SFT + ranks[after]))
    said = "\n".join(SAID[f"resumed-{before}-{after}"])
    assert re.search(rf"resuming from the checkpoint step0*2 that {before} rank\(s\) committed at \S+ .*"
                     rf"close to, not bit-identical with", said), said[-3000:]
    got = manifest(resumed, "grpo")
    assert got["resumed_from_round"] == 2 and got["metrics"]["grpo/world_size"] == after
    assert got["checkpoint_from"]["world_size"] == before
    reference = manifest(one_rank if after == 1 else two_rank_grpo, "grpo")
    other = manifest(one_rank if before == 1 else two_rank_grpo, "grpo")
    history, ref_history = grpo_history(resumed), grpo_history(one_rank if after == 1 else two_rank_grpo)
    assert [h["round"] for h in history] == [1, 2, 3, 4]
    for a, b in zip(history, ref_history):
        for key in ("reward/mean", "rollout/generated_tokens", "update/samples"):
            assert a[key] == b[key], (a["round"], key, a[key], b[key])
        assert math.isclose(a["update/loss"], b["update/loss"], abs_tol=GRPO_LOSS_ATOL), (a["round"], a, b)
    exact = {name: got["state_hash"] == m["state_hash"] for name, m in (("after", reference), ("before", other))}
    print(f"\nGRPO checkpoint of {before} rank(s) resumed on {after}: state equal to the uninterrupted "
          f"{after}-rank run: {exact['after']}; to the {before}-rank run: {exact['before']}")
