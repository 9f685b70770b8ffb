"""The tiny pipeline's GRPO stage with `rollout.engine=sglang`: the real CLI, Prefect, MLflow, and
SGLang servers (CPU mode) that the grpo task launches itself. However the run ends (success, an
exception in a round, SIGKILL of the task's process), no server process is left and its port is
free; after the SIGKILL a re-run resumes from the last checkpoint."""

from __future__ import annotations

import json
import shutil
import signal
import time
from pathlib import Path

import pytest
from mlflow import MlflowClient

from tests.seeded import seed
from tests.test_pipeline import SMALL
from tests.test_resume_kill import run_cli as _run_cli
from tests.test_sglang_server import STANDIN, free_base_port
from trainer.inference.sglang import port_taken

pytestmark = pytest.mark.slow

PORT = free_base_port(1)
OVERRIDES = [o for o in SMALL if not o.startswith(("grpo.rounds=", "grpo.checkpoint_every="))] + [
    "grpo.rounds=3", "grpo.checkpoint_every=1", "rollout.engine=sglang", "rollout.sglang.device=cpu",
    f"rollout.sglang.base_port={PORT}", f"rollout.sglang.env={{PYTHONPATH: {STANDIN}}}",
    "rollout.sglang.startup_timeout_s=300",
    # the eval stages answer by HF generate: a server start (about 40 s alone on 2 cores) per eval stage
    # would double these tests; the first test keeps its one on SGLang and checks it was answered there
    "eval.engine=hf"]


def run_cli(root: Path, out: Path, fault: str | None = None, extra: tuple[str, ...] = (),
            command: str = "speedrun") -> int:
    return _run_cli(root, out, fault, overrides=OVERRIDES + list(extra), command=command)[0]


def server_processes() -> list[int]:
    """Pids of any posttrain-launched SGLang server (the wrapper's command line) still alive."""
    pids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                cmd = (d / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if any(c.endswith(b"sglang_server.py") for c in cmd) and str(PORT).encode() in cmd:
                pids.append(int(d.name))
    return pids


def assert_no_server_left(within_s: float = 15.0) -> float:
    t0 = time.perf_counter()
    while server_processes() or port_taken("127.0.0.1", PORT):
        assert time.perf_counter() - t0 < within_s, f"SGLang server still up: pids {server_processes()}"
        time.sleep(0.5)
    return time.perf_counter() - t0


def grpo_manifest(result: dict) -> dict:
    s = next(x for x in result["stages"] if x["stage"] == "grpo")
    return json.loads((Path(s["uri"]) / "manifest.json").read_text())


def test_grpo_stage_on_sglang_through_prefect_and_mlflow(tmp_path, small_sft):
    """`posttrain grpo` (the pipeline up to GRPO: the SFT policy's eval stage, then GRPO) with the
    eval stages on SGLang too: two server launches, one per stage."""
    seed(small_sft, tmp_path)  # the session's data, tokenizer and SFT: this file tests GRPO on SGLang
    assert run_cli(tmp_path, tmp_path / "result.json", extra=("eval.engine=rollout",), command="grpo") == 0
    assert_no_server_left(within_s=5)
    result = json.loads((tmp_path / "result.json").read_text())
    m = grpo_manifest(result)
    assert m["metrics"]["grpo/rounds"] == 3
    client = MlflowClient()
    parent = client.get_run(result["mlflow_run_id"])
    runs = client.search_runs([parent.info.experiment_id],
                              f"tags.mlflow.parentRunId = '{parent.info.run_id}' and tags.`posttrain.stage` = 'grpo'")
    assert len(runs) == 1
    run = runs[0]
    syncs = client.get_metric_history(run.info.run_id, "time/sync_seconds")
    assert [h.step for h in syncs] == [1, 2, 3] and all(h.value > 0 for h in syncs)  # weights pushed each round
    gen_tps = client.get_metric_history(run.info.run_id, "rollout/tokens_per_second")
    assert len(gen_tps) == 3 and all(h.value > 0 for h in gen_tps)
    evals = client.search_runs([parent.info.experiment_id], f"tags.mlflow.parentRunId = '{parent.info.run_id}' "
                               "and tags.`posttrain.stage` LIKE 'eval%'")
    assert len(evals) == 1 and evals[0].data.tags["posttrain.answered_by"] == "sglang"  # not HF generate
    periodic = client.get_metric_history(run.info.run_id, "eval/accuracy")
    assert periodic  # the periodic evals ran (through the servers: trainer.evaluate passes the engine)
    print("\nSGLang rounds: " + ", ".join(
        f"{k.split('/')[1]} {sum(h.value for h in client.get_metric_history(run.info.run_id, k)) / 3:.2f}s"
        for k in ("time/generate_seconds", "time/reward_seconds", "time/update_seconds", "time/sync_seconds",
                  "time/round_seconds")))
    # the same run asking for GPU servers on this machine (no CUDA device): the stages that would launch
    # them are cached, so it needs none; with a new eval setting it would, and stops before any stage
    from tasks import stages
    from trainer.config import ConfigError, load_config
    from trainer.inference.sglang import has_cuda_device

    if not has_cuda_device():
        gpu = OVERRIDES + ["eval.engine=rollout", f"artifact_root={tmp_path}", "rollout.sglang.device=cuda"]
        stages.check_servers(load_config("tiny", gpu), stages.until_for("grpo"))
        with pytest.raises(ConfigError, match="rollout.sglang.device=cuda: this machine has no CUDA device"):
            stages.check_servers(load_config("tiny", gpu + ["eval.max_new_tokens=20"]), stages.until_for("grpo"))


def test_exception_mid_round_stops_the_servers(tmp_path, small_sft):
    seed(small_sft, tmp_path)
    code = run_cli(tmp_path, tmp_path / "result.json", fault="grpo_mid_round@2:raise")
    assert code != 0
    assert "injected fault at grpo_mid_round 2" in (tmp_path / "result.log").read_text()
    assert_no_server_left(within_s=5)


def test_sigkill_mid_grpo_leaves_no_server_and_rerun_resumes(tmp_path, small_sft):
    """The killed CLI's server stops itself and removes its temp folder (its ZMQ sockets); the
    re-run resumes from the last committed round."""
    import tempfile

    seed(small_sft, tmp_path)
    temp = Path(tempfile.mkdtemp(prefix="t", dir="/tmp"))  # the CLI's TMPDIR (short: socket paths)
    code = _run_cli(tmp_path, tmp_path / "killed.json", "grpo_after_update@2:kill", overrides=OVERRIDES,
                    env={"TMPDIR": str(temp)})[0]
    assert code == -signal.SIGKILL
    seconds = assert_no_server_left(within_s=15)
    print(f"\nservers gone {seconds:.1f}s after the CLI's SIGKILL")
    assert not list(temp.glob("posttrain-sglang-*")), sorted(temp.iterdir())
    shutil.rmtree(temp, ignore_errors=True)
    work = next((tmp_path / "grpo").iterdir())
    assert not (work / "manifest.json").exists()
    from trainer import checkpoint

    assert checkpoint.committed_tags(work / "checkpoints")[-1].endswith("1")
    state = torch_load_client_state(work / "checkpoints" / checkpoint.committed_tags(work / "checkpoints")[-1])

    assert run_cli(tmp_path, tmp_path / "resumed.json") == 0
    assert_no_server_left(within_s=5)
    m = grpo_manifest(json.loads((tmp_path / "resumed.json").read_text()))
    assert m["resumed_from_round"] == 1 and m["metrics"]["grpo/rounds"] == 3
    history = [json.loads(x) for x in (work / "history.jsonl").read_text().splitlines()]
    assert [h["round"] for h in history] == [1, 2, 3]  # round 1 from the checkpoint, 2 and 3 re-run once
    # round 1 is the checkpoint's record, not a re-run of it; the checkpoint held the data position
    assert state["step"] == 1 and history[:1] == state["history"]
    assert state["manager"]["buffer"]["pos"] > 0


def torch_load_client_state(tag_dir: Path) -> dict:
    """The client state (round, data position, carry, history) a GRPO checkpoint holds."""
    import torch

    files = sorted(tag_dir.glob("*client*")) + sorted(tag_dir.glob("*model_states.pt"))
    for f in files:
        blob = torch.load(f, map_location="cpu", weights_only=False)
        if isinstance(blob, dict) and "manager" in blob:
            return blob
    raise AssertionError(f"no client state in {tag_dir}: {[f.name for f in tag_dir.iterdir()]}")


def test_async_rounds_on_two_ranks_failed_then_resumed_train_each_batch_once(tmp_path, small_sft):
    """async_steps=1 with two DeepSpeed ranks sharing the task's SGLang server: failed after round
    2's update (its checkpoint not written), the re-run resumes from round 1's checkpoint with the
    batches it held, and trains rounds 2 and 3 once each, from the scheduled versions."""
    overrides = OVERRIDES + ["rollout.async_steps=1", "grpo.deepspeed.ranks_per_node=2", "rollout.batch_size=8"]
    seed(small_sft, tmp_path)
    code = _run_cli(tmp_path, tmp_path / "killed.json", "grpo_after_update@2:raise", overrides=overrides)[0]
    assert code != 0
    assert_no_server_left(within_s=15)
    _run_cli(tmp_path, tmp_path / "result.json", overrides=overrides)
    assert_no_server_left(within_s=5)
    m = grpo_manifest(json.loads((tmp_path / "result.json").read_text()))
    assert m["resumed_from_round"] == 1 and m["metrics"]["grpo/world_size"] == 2
    history = [json.loads(x) for x in (Path(m["uri"]) / "history.jsonl").read_text().splitlines()]
    assert [h["round"] for h in history] == [1, 2, 3]
    assert [h["rollout/version_lag"] for h in history] == [0, 1, 1]
    assert all(h["rollout/staleness_max"] <= 1 for h in history)
