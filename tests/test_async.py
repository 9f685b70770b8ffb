"""Async rounds (rollout.async_steps = k): the hf engine's rollouts in a process of their own, each
round's batch from the policy k versions behind the one it trains, on a schedule fixed by the round
number, so that an async run is reproducible and resumes exactly."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from trainer.config import ConfigError, load_config
from trainer.data import synthetic
from trainer.grpo import GRPOTrainer
from trainer.loop import run_round, run_rounds
from trainer.model import build_model
from trainer.procwatch import MP_TEMP_PREFIX, process_gone
from trainer.rl.async_rollout import ProducerError, version_for

from tests.test_procwatch import NOTE

ROOT = Path(__file__).resolve().parent.parent

OVERRIDES = ["model.hidden_size=32", "model.num_layers=1", "model.intermediate_size=64",
             "grpo.rounds=6", "grpo.checkpoint_every=2", "grpo.eval_every=100", "rollout.prompts_per_round=3",
             "rollout.n_samples_per_prompt=4", "rollout.over_sample=2", "rollout.max_response_tokens=12",
             "rollout.dynamic_filter=none", "grpo.mini_batches=1", "grpo.micro_batch_size=4", "grpo.lr=1e-3",
             "grpo.warmup_rounds=0"]


def _cfg(k: int, *extra: str):
    return load_config("tiny", OVERRIDES + [f"rollout.async_steps={k}", *extra])


def _data(cfg):
    return synthetic(cfg.data.synthetic.model_copy(update={"n_train": 60, "n_test": 4}), 0)


def _trainer(cfg, tok, work):
    data = _data(cfg)
    return GRPOTrainer(cfg, build_model(cfg.model, tok, 0), tok, data.train, data.test, work)


def _run(cfg, tok, work, stop_after=None):
    trainer = _trainer(cfg, tok, work)
    try:
        if stop_after is None:
            run_rounds(trainer)
            return trainer
        while trainer.round < stop_after:
            run_round(trainer)
        return trainer
    finally:
        trainer.close()


@pytest.mark.slow
@pytest.mark.parametrize("k", [1, 2])
def test_no_trained_sample_is_more_than_k_versions_old(tiny_tokenizer, tmp_path, k):
    """over_sample=2 leaves a surplus every round: a carried group would be k + 1 versions old, so
    async rounds drop it; every batch comes from exactly the scheduled version."""
    trainer = _run(_cfg(k), tiny_tokenizer, tmp_path)
    assert trainer.round == 6
    assert trainer.consumed == [(r, version_for(r, k)) for r in range(1, 7)]
    assert [r - 1 - v for r, v in trainer.consumed] == [0, 1, 2, 3, 4, 5][: k + 1] + [k] * (5 - k)
    for h in trainer.history:
        r = int(h["round"])
        assert h["rollout/staleness_max"] == min(r - 1, k)
        assert h["rollout/staleness_mean"] == min(r - 1, k)
        assert h["rollout/version_lag"] == min(r - 1, k)
        assert h["rollout/groups_carried"] == 0 and h["rollout/groups_dropped_stale"] == 3
        assert h["rollout/queue_wait_seconds"] >= 0 and h["rollout/batch_idle_seconds"] >= 0
    assert process_gone(trainer.producer.pid)  # closed with the run


@pytest.mark.slow
def test_sync_rounds_still_carry_over(tiny_tokenizer, tmp_path):
    """async_steps=0 is the synchronous schedule, carry-over included (staleness 1 on carried groups)."""
    trainer = _run(_cfg(0), tiny_tokenizer, tmp_path)
    assert trainer.producer is None and trainer.consumed == []
    assert max(h["rollout/staleness_max"] for h in trainer.history) == 1
    assert all(h["rollout/groups_carried"] == 3 for h in trainer.history)


@pytest.mark.slow
def test_an_async_run_is_reproducible_and_resumes_exactly(tiny_tokenizer, tmp_path):
    """Twice the same weights; and a run stopped after round 3 (its pending batches in the round-2
    checkpoint) and resumed ends on them too, having trained on the same batches in the same order."""
    cfg = _cfg(1)
    full = _run(cfg, tiny_tokenizer, tmp_path / "full")
    again = _run(cfg, tiny_tokenizer, tmp_path / "again")
    assert again.state_hash() == full.state_hash()
    _run(cfg, tiny_tokenizer, tmp_path / "crash", stop_after=3)
    resumed = _run(cfg, tiny_tokenizer, tmp_path / "crash")
    assert resumed.resumed_from == 2
    assert resumed.consumed == full.consumed
    assert resumed.state_hash() == full.state_hash()
    assert [h["reward/mean"] for h in resumed.history] == [h["reward/mean"] for h in full.history]


@pytest.mark.slow
def test_raising_grpo_rounds_continues_an_async_run_exactly(tiny_tokenizer, tmp_path):
    """The last checkpoint of a 4-round async stage holds the batches of rounds 5 and 6 (generated
    past the schedule), so the same stage asked for 6 rounds ends on the 6-round run's weights."""
    full = _run(_cfg(1), tiny_tokenizer, tmp_path / "full")
    short = _trainer(_cfg(1, "grpo.rounds=4"), tiny_tokenizer, tmp_path / "extended")
    try:
        run_rounds(short)
        short.save()  # what the stage's finish() does at its last round
        assert short.producer.in_flight() == [5, 6]
    finally:
        short.close()
    longer = _run(_cfg(1), tiny_tokenizer, tmp_path / "extended")
    assert longer.resumed_from == 4 and longer.consumed == full.consumed
    assert longer.state_hash() == full.state_hash()


@pytest.mark.slow
def test_a_sync_checkpoint_is_not_resumed_async(tiny_tokenizer, tmp_path):
    _run(_cfg(0, "grpo.rounds=6"), tiny_tokenizer, tmp_path, stop_after=3)
    with pytest.raises(Exception, match="async_steps=1"):
        _run(_cfg(1), tiny_tokenizer, tmp_path)


@pytest.mark.slow
def test_the_rollout_process_stops_when_the_trainer_is_killed(tmp_path):
    """A SIGKILLed trainer cannot close its producer: the rollout process sees its parent gone. The
    temp folder the trainer's weights went through is removed by the next trainer to start. The
    trainer is a fresh interpreter with a temp folder of its own (one started by multiprocessing
    would share this process's, and other tests' trainers would sweep /tmp meanwhile)."""
    temp = tmp_path / "temp"
    temp.mkdir()
    env = {**os.environ, "TMPDIR": str(temp)}
    code = f"from tests.test_async import _trainer_then_wait; _trainer_then_wait({str(tmp_path)!r})"
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
    try:
        for line in proc.stdout:
            if line.startswith("rollout pid "):
                worker = int(line.split()[-1])
                break
        else:
            raise AssertionError(f"the trainer exited with code {proc.wait()} before its rollout process started")
        assert not process_gone(worker)
        # the two talk through pipes: no named semaphore in /dev/shm, which a SIGKILL of them both (a
        # process group's) would leave behind with Python's resource tracker, the one that removes them
        for pid in (proc.pid, worker):
            assert "/dev/shm/sem." not in Path(f"/proc/{pid}/maps").read_text(), pid
        # the trainer's multiprocessing temp folder (weights go by file descriptor, through a socket
        # in it), and the link that names it after the trainer's process
        [link] = temp.glob(f"{MP_TEMP_PREFIX}*")
        assert link.name.split("-")[3] == str(proc.pid)
        folder = temp / os.readlink(link)
        assert folder.name.startswith("pymp-") and folder.is_dir()
    finally:
        proc.kill()
        proc.wait(10)
    deadline = time.monotonic() + 5
    while not process_gone(worker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert process_gone(worker), "the rollout process outlived its trainer by 5 s"
    assert folder.is_dir() and link.is_symlink()  # a SIGKILL leaves them: Python's own clean-up never ran
    assert subprocess.run([sys.executable, "-c", NOTE], cwd=ROOT, env=env, timeout=120).returncode == 0  # the next trainer
    assert not folder.exists() and not link.is_symlink()  # (its rendezvous file goes at the next launch)


def _trainer_then_wait(work):
    from trainer.config import SyntheticData
    from trainer.tokenizer import train_tokenizer

    data = synthetic(SyntheticData(n_train=300, n_test=10), seed=0)
    tok = train_tokenizer([m["content"] for ex in data.train for m in ex["messages"]], 200, os.path.join(work, "tok"))
    trainer = _trainer(_cfg(1), tok, os.path.join(work, "run"))
    print(f"rollout pid {trainer.producer.pid}", flush=True)  # DeepSpeed prints to stdout too
    time.sleep(600)


@pytest.mark.slow
def test_a_rollout_process_that_dies_fails_the_round_in_bounded_time(tiny_tokenizer, tmp_path):
    trainer = _trainer(_cfg(1), tiny_tokenizer, tmp_path)
    try:
        run_round(trainer)
        os.kill(trainer.producer.pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(ProducerError, match="rollout process .* exited"):
            while True:
                run_round(trainer)
        assert time.monotonic() - t0 < 10
    finally:
        trainer.close()


@pytest.mark.parametrize("overrides,field", [
    (["rollout.async_steps=5"], "rollout.async_steps=5: at most 4"),
    (["rollout.async_steps=1", "grpo.deepspeed.ranks_per_node=2"], "rollout.engine=sglang"),
    (["rollout.async_steps=3", "grpo.rounds=3"], "lower async_steps below grpo.rounds"),
    (["rollout.async_steps=-1"], "async_steps"),
])
def test_bad_async_settings_stop_before_the_run(overrides, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.").replace("=", "=")):
        load_config("tiny", overrides)


# ---------------------------------------------------------------- through the real CLI

@pytest.mark.slow
def test_sigkill_at_a_random_point_of_an_async_run_then_rerun_is_exact(tmp_path, small_sft):
    """`posttrain speedrun` with async_steps=1, SIGKILLed (with its process group: the rollout
    process, Prefect's temporary server) at a random moment after its first GRPO round (a round, a
    checkpoint waiting for the batches in flight, the export), then run again: the same weights
    and per-round rewards as the uninterrupted async run, bitwise. The moment's seed is printed."""
    import json
    import random
    import subprocess
    import sys
    from pathlib import Path

    from tests.test_resume_kill import OVERRIDES as SMALL, ROOT, manifest, run_cli

    # rounds long enough (128 samples of 64 tokens) that a random moment often falls inside one
    overrides = [o for o in SMALL if not o.startswith(("grpo.rounds=", "grpo.micro_batch_size="))] + [
        "grpo.rounds=6", "rollout.async_steps=1", "rollout.over_sample=2", "rollout.prompts_per_round=16",
        "rollout.n_samples_per_prompt=8", "rollout.max_response_tokens=64", "rollout.min_response_tokens=64",
        "grpo.micro_batch_size=64"]
    from tests.seeded import seed as copy_results

    ref, killed = tmp_path / "uninterrupted", tmp_path / "killed"
    copy_results(small_sft, ref), copy_results(small_sft, killed)  # both start from the session's SFT: GRPO is what is compared
    run_cli(ref, ref / "result.json", overrides=overrides)
    reference = json.loads((ref / "result.json").read_text())
    ref_history = [json.loads(x) for x in
                   (Path(manifest(reference, "grpo")["uri"]) / "history.jsonl").read_text().splitlines()]
    # from round 1's line to the stage's end: rounds 2..6, their checkpoints, the final save and export
    span = ref_history[-1]["time/grpo_elapsed"] - ref_history[0]["time/grpo_elapsed"] + 0.5

    seed = random.randrange(1 << 30)
    delay = random.Random(seed).uniform(0.0, span)
    cmd = [sys.executable, "-m", "flows.cli", "speedrun", "--preset", "tiny", "--json", str(killed / "killed.json"),
           "--set", f"artifact_root={killed}"] + [x for o in overrides for x in ("--set", o)]
    log = killed / "killed.log"
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            deadline = time.monotonic() + 600
            while b"round 1/" not in log.read_bytes() and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(delay)
        finally:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    print(f"\nkilled {delay:.2f}s after round 1 (random seed {seed}; rounds 2-6 took {span - 0.5:.1f}s uninterrupted)")
    run_cli(killed, killed / "resumed.json", overrides=overrides)
    result = json.loads((killed / "resumed.json").read_text())
    print(f"resumed from round {manifest(result, 'grpo').get('resumed_from_round')}")

    assert manifest(result, "grpo")["state_hash"] == manifest(reference, "grpo")["state_hash"]
    h = [json.loads(x) for x in (Path(manifest(result, "grpo")["uri"]) / "history.jsonl").read_text().splitlines()]
    h_ref = ref_history
    assert [x["round"] for x in h] == list(range(1, 7))  # no round lost or trained twice
    assert [x["reward/mean"] for x in h] == [x["reward/mean"] for x in h_ref]
    assert [x["rollout/version_lag"] for x in h] == [0] + [1] * 5
    assert result["headline"]["final_accuracy"] == reference["headline"]["final_accuracy"]


@pytest.mark.slow
def test_a_failed_async_stage_leaves_no_rollout_process(tmp_path, small_sft):
    """An exception mid-round through the real CLI: the stage fails, and the rollout process it
    started (its pid from the stage's log) is gone with it."""
    import re

    from tests.seeded import seed
    from tests.test_resume_kill import OVERRIDES as SMALL, run_cli

    seed(small_sft, tmp_path)
    code, _ = run_cli(tmp_path, tmp_path / "failed.json", "grpo_mid_round@3:raise",
                      overrides=SMALL + ["rollout.async_steps=1"])
    log = (tmp_path / "failed.log").read_text()
    assert code != 0 and "injected fault at grpo_mid_round 3" in log
    pid = int(re.search(r"rollout process (\d+) started", log).group(1))
    deadline = time.monotonic() + 5
    while not process_gone(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert process_gone(pid)
