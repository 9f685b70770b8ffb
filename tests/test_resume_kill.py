"""Exact resume after SIGKILL: the tiny speedrun (small budget) is killed at three points, re-run,
and must end with exactly the weights and metrics of an uninterrupted run, without re-running
the stages that had finished. Each run is the real CLI in its own process group (its Prefect
temporary server included), killed the way an OOM killer or a pre-empted machine would."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.seeded import seed
from tests.test_pipeline import SMALL

pytestmark = pytest.mark.slow

# 5 GRPO rounds with checkpoints at rounds 2 and 4; SFT checkpoints at steps 5 and 10 of 12.
OVERRIDES = [o for o in SMALL if not o.startswith(("grpo.rounds=", "grpo.checkpoint_every="))] + [
    "grpo.rounds=5", "grpo.checkpoint_every=2"]
ROOT = Path(__file__).resolve().parent.parent


def run_cli(root: Path, out: Path, fault: str | None = None, timeout: float = 600,
            overrides: list[str] | None = None, preset: str = "tiny", args: tuple[str, ...] = (),
            command: str = "speedrun", env: dict[str, str] | None = None) -> tuple[int, float]:
    """`posttrain COMMAND ARGS` in its own process (session); OVERRIDES unless others are given;
    `env` added to this process's environment."""
    env = {**os.environ, **(env or {})}
    env.pop("POSTTRAIN_FAULT", None)
    if fault:
        env["POSTTRAIN_FAULT"] = fault
    cmd = [sys.executable, "-m", "flows.cli", command, "--preset", preset, "--json", str(out),
           "--set", f"artifact_root={root}", *args]
    for o in OVERRIDES if overrides is None else overrides:
        cmd += ["--set", o]
    t0 = time.perf_counter()
    # Output to a file, not a pipe: the killed CLI's orphaned children would hold a pipe open.
    log = out.with_suffix(".log")
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            proc.wait(timeout=timeout)
        finally:
            try:  # the CLI's own children (Prefect's temporary server) go with it
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    seconds = time.perf_counter() - t0
    if fault is None and proc.returncode != 0:
        raise AssertionError(log.read_text()[-4000:])
    return proc.returncode, seconds


def manifest(result: dict, stage: str, index: int = 0) -> dict:
    s = [x for x in result["stages"] if x["stage"] == stage][index]
    return json.loads((Path(s["uri"]) / "manifest.json").read_text())


@pytest.fixture(scope="module")
def reference(tmp_path_factory, small_sft):
    """The uninterrupted run. Its data, tokenizer and SFT are the session's (OVERRIDES differ from
    SMALL in GRPO only): the SIGKILLed SFT below resumes to that in-process SFT's weights."""
    root = seed(small_sft, tmp_path_factory.mktemp("uninterrupted"))
    code, seconds = run_cli(root, root / "result.json")
    print(f"\nuninterrupted run: {seconds:.1f}s")
    return json.loads((root / "result.json").read_text())


# (fault point, the stage it interrupts, stages finished before it, where the resume starts)
CASES = [
    ("sft@7:kill", "sft", ["prepare_data", "tokenizer"], 5),
    ("grpo_mid_round@3:kill", "grpo", ["prepare_data", "tokenizer", "sft", "eval"], 2),
    ("grpo_after_update@4:kill", "grpo", ["prepare_data", "tokenizer", "sft", "eval"], 2),
]


@pytest.mark.parametrize("fault,stage,finished,resumed_at", CASES, ids=[c[0].split(":")[0] for c in CASES])
def test_sigkill_then_rerun_is_exact(reference, small_sft, tmp_path, fault, stage, finished, resumed_at):
    """A kill in GRPO starts from the session's data, tokenizer and SFT (cache hits of the killed run
    too); a kill in SFT computes everything."""
    if stage != "sft":
        seed(small_sft, tmp_path)
    code, killed_s = run_cli(tmp_path, tmp_path / "killed.json", fault)
    assert code == -signal.SIGKILL, f"expected the run to die of SIGKILL, got exit code {code}"
    assert not (tmp_path / "killed.json").exists()
    # the interrupted stage left checkpoints but no manifest: it is not a finished result
    stage_dirs = list((tmp_path / stage).iterdir())
    assert len(stage_dirs) == 1 and not (stage_dirs[0] / "manifest.json").exists()
    assert list((stage_dirs[0] / "checkpoints").glob("step*/COMMITTED"))

    _, resumed_s = run_cli(tmp_path, tmp_path / "resumed.json")
    print(f"\n{fault}: killed run {killed_s:.1f}s, resumed run {resumed_s:.1f}s")
    result = json.loads((tmp_path / "resumed.json").read_text())
    status = [(s["stage"], s["cache_hit"]) for s in result["stages"]]
    n = len(finished)
    assert status[:n] == [(s, True) for s in finished]  # finished stages were not re-executed
    assert not any(hit for _, hit in status[n:])

    if stage == "sft":
        assert manifest(result, "sft")["result"]["resumed_from_step"] == resumed_at
    else:
        assert manifest(result, "grpo")["resumed_from_round"] == resumed_at
    # exactly the uninterrupted run's weights and metrics
    assert manifest(result, "sft")["result"]["state_hash"] == manifest(reference, "sft")["result"]["state_hash"]
    assert manifest(result, "grpo")["state_hash"] == manifest(reference, "grpo")["state_hash"]
    assert manifest(result, "grpo")["metrics"] == manifest(reference, "grpo")["metrics"] | {
        k: manifest(result, "grpo")["metrics"][k] for k in ("grpo/seconds", "grpo/train_seconds")}
    assert result["headline"]["sft_accuracy"] == reference["headline"]["sft_accuracy"]
    assert result["headline"]["final_accuracy"] == reference["headline"]["final_accuracy"]
    history = [json.loads(x) for x in (Path(manifest(result, "grpo")["uri"]) / "history.jsonl").read_text().splitlines()]
    ref_history = [json.loads(x) for x in
                   (Path(manifest(reference, "grpo")["uri"]) / "history.jsonl").read_text().splitlines()]
    assert [h["round"] for h in history] == [1, 2, 3, 4, 5]
    assert [h["reward/mean"] for h in history] == [h["reward/mean"] for h in ref_history]


# three-turn episodes (tests/test_multiturn.py's scripted environment: every turn answered with a
# tool message until the third), through the real CLI, trained by PPO: a critic's values on the
# policy's tokens only (the tool's answers between turns are masked), its weights and optimizer in
# the checkpoints
MULTI_TURN = OVERRIDES + ["rollout.environment.name=tests.test_multiturn:Scripted",
                          "rollout.environment.max_tokens=200", "grpo.advantage=gae",
                          "grpo.rewards=[{name: tests.test_multirank.digit_share}]", "model.lora.rank=4",
                          "model.lora.target_modules=[q_proj, v_proj, down_proj]", "sft.lr=3e-3", "grpo.lr=1e-3"]


def test_sigkill_mid_round_of_a_multi_turn_ppo_lora_stage_then_rerun_is_exact(tmp_path, small_sft):
    """Long: three runs of the multi-turn GRPO stage with grpo.advantage=gae and LoRA adapters
    (uninterrupted, killed, resumed), from the session's data and tokenizer; the SFT trains adapters
    too (model.lora applies to every training stage). The resumed run ends with the uninterrupted
    run's policy (base and adapters) and critic (the manifest's state_hash covers both, and the
    optimizers' steps made them) and the same critic metrics. The uninterrupted run is also the
    test of LoRA through the CLI, Prefect and MLflow: both training stages log the merged model and
    the adapter, and the registered version says which it is."""
    ref, killed = seed(small_sft, tmp_path / "uninterrupted"), seed(small_sft, tmp_path / "killed")
    run_cli(ref, ref / "result.json", overrides=MULTI_TURN)
    reference = json.loads((ref / "result.json").read_text())
    check_lora_lineage(reference)
    history = [json.loads(x) for x in
               (Path(manifest(reference, "grpo")["uri"]) / "history.jsonl").read_text().splitlines()]
    assert min(h["rollout/turns_mean"] for h in history) > 2  # the episodes really had three turns
    assert all(h["critic/value_loss"] > 0 for h in history) and history[-1]["critic/values_mean"] != 0
    assert (Path(manifest(reference, "grpo")["uri"]) / "critic" / "config.json").is_file()
    code, _ = run_cli(killed, killed / "killed.json", "grpo_mid_round@3:kill", overrides=MULTI_TURN)
    assert code == -signal.SIGKILL
    run_cli(killed, killed / "resumed.json", overrides=MULTI_TURN)
    result = json.loads((killed / "resumed.json").read_text())
    assert manifest(result, "grpo")["resumed_from_round"] == 2
    assert manifest(result, "grpo")["state_hash"] == manifest(reference, "grpo")["state_hash"]
    assert result["headline"]["final_accuracy"] == reference["headline"]["final_accuracy"]
    resumed = [json.loads(x) for x in (Path(manifest(result, "grpo")["uri"]) / "history.jsonl").read_text().splitlines()]
    assert [h["critic/value_loss"] for h in resumed] == [h["critic/value_loss"] for h in history]


def check_lora_lineage(result: dict) -> None:
    """A LoRA run's stages: the merged model and the adapter in each training stage's folder; in
    MLflow, the merged model as the stage run's logged model and the adapter among the run's
    artifacts; the tags naming the adapter, and the registered version pointing at both."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient()
    for stage in ("sft", "grpo"):
        m = manifest(result, stage)
        assert m["adapter_subdir"] == "adapter" and (Path(m["uri"]) / "adapter" / "adapter_config.json").is_file()
        assert json.loads((Path(m["uri"]) / "adapter" / "adapter_config.json").read_text())["r"] == 4
        config = json.loads((Path(m["uri"]) / "model" / "config.json").read_text())
        assert config["architectures"] == ["LlamaForCausalLM"]  # a plain model, the adapter merged in
        run = client.get_run(m["mlflow_run_id"])
        assert run.data.tags["posttrain.lora"].startswith("merged (rank 4")
        assert "adapter" in {a.path for a in client.list_artifacts(run.info.run_id)}
        model = client.get_logged_model(m["mlflow_model_id"])  # the merged model: the run's logged model
        assert model.source_run_id == run.info.run_id and model.tags["posttrain.lora"].startswith("merged (rank 4")
    assert manifest(result, "sft")["metrics"]["sft/trainable_params"] < manifest(result, "sft")["metrics"]["sft/n_params"] / 5
    name, version = result["registered_model"].split("/")
    tags = client.get_model_version(name, version).tags
    assert tags["posttrain.lora"].startswith("merged (rank 4") and tags["posttrain.adapter_uri"].endswith("/adapter")


def test_ctrl_c_stops_the_command_at_once_then_rerun_resumes(tmp_path, migrated_stores):
    """Ctrl-C in a terminal (SIGINT to the command's whole process group) during SFT: the command
    exits 130 within seconds, with a line saying how to go on, no traceback; the flow run and the
    MLflow runs end as stopped (KILLED), and the same command again resumes SFT from its checkpoint.
    The temporary Prefect server stays out of the terminal's group: before, the Ctrl-C stopped it
    too, and the command then retried it at exit for minutes, reporting its crash to nobody."""
    import re

    from mlflow.tracking import MlflowClient

    cmd = [sys.executable, "-m", "flows.cli", "sft", "--preset", "tiny", "--set", f"artifact_root={tmp_path}"]
    for o in OVERRIDES:
        cmd += ["--set", o]
    log = tmp_path / "interrupted.log"
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}  # the command's own temporary server
    env.update(POSTTRAIN_FAULT="sft@7:hang", PREFECT_HOME=str(migrated_stores.prefect_home(tmp_path / "prefect")))
    with open(log, "wb") as f:  # a foreground job's signals as a shell sets them (a test runner may ignore SIGINT)
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=f,
                                stderr=subprocess.STDOUT, start_new_session=True,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        try:
            deadline = time.monotonic() + 300
            while "injected hang at sft 7" not in log.read_text(errors="replace"):
                assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
                time.sleep(0.2)
            os.killpg(proc.pid, signal.SIGINT)
            code = proc.wait(timeout=60)  # about a second here
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    text = log.read_text(errors="replace")
    assert code == 130, text[-3000:]
    assert "posttrain: interrupted. The stages that finished are cached" in text and "Traceback" not in text
    port = re.search(r"temporary Prefect server on http://127\.0\.0\.1:(\d+)/api", text).group(1)
    from tests.test_cli_server import listening

    assert not listening(int(port)), "the temporary Prefect server outlived its command"
    client = MlflowClient()
    pipeline = re.search(r"MLflow run ([0-9a-f]{32}) ", text).group(1)
    sft = re.search(r"sft: running \(key \w+\) in \S+; MLflow child run ([0-9a-f]{32})", text).group(1)
    assert client.get_run(pipeline).info.status == client.get_run(sft).info.status == "KILLED"

    code, _ = run_cli(tmp_path, tmp_path / "resumed.json", command="sft")
    result = json.loads((tmp_path / "resumed.json").read_text())
    assert manifest(result, "sft")["result"]["resumed_from_step"] == 5
