"""Weights do not depend on what else runs on the machine. A resumed run always runs under other
load than the run it resumes, so exact resume needs every run of a config to end with the same
bytes, busy machine or quiet.

Each case runs the real CLI (its own process, Prefect's temporary server, MLflow on SQLite) once
quietly and once squeezed: the same threads (OMP_NUM_THREADS=2 in both) on one core, as on a
machine whose other cores are taken, so the scheduler preempts the run's own threads in the middle
of its threaded ops. It compares the weights' hashes bit for bit: a run SIGKILLed mid-round squeezed
and resumed squeezed (SFT and every GRPO round trained so), and GRPO alone with kernels off, ZeRO-3
on one rank, ZeRO-2 on two gloo ranks and async rounds. The shapes are big enough that torch's
threaded code paths run (its CPU `index_put_` with accumulate, for one, goes multi-threaded with
atomics past 32,768 elements): without `trainer.engine.deterministic` and the `index_select` gathers of the
shared-prompt passes, loaded runs ended with other weights than the quiet ones (docs/reproducibility.md).

The squeeze replaced processes that kept every core busy beside the run (a Python busy loop and a
torch matmul loop): those spent about 500 s of CPU per suite and slowed every test beside them. The
squeeze costs no CPU beyond the run's own and still catches the fault: with
POSTTRAIN_DETERMINISTIC=0 and kernels off, the squeezed GRPO re-run ended with other weights than the
quiet one (same rewards), and with the default, the same (docs/testing.md).
"""

import json
import os
import signal
from contextlib import contextmanager, nullcontext
from pathlib import Path

import pytest

from tests.test_resume_kill import manifest, run_cli

pytestmark = pytest.mark.slow

# The tiny preset's model and micro-batch: 16 prompts x 8 samples a round, two mini-batches of 64,
# which a group straddles wherever the random split puts it. Smaller shapes (2 layers, micro-batches
# of 32) let the unfixed code pass the torch-op case by luck: the atomics' order flips only when the
# thread adding the second half of a group is held up past the first. A dense reward gives every
# group a gradient (the math reward after 12 SFT steps is 0 everywhere, and zero advantages would
# hide any difference).
OVERRIDES = ["data.synthetic.n_train=600", "data.synthetic.n_test=40", "sft.max_steps=12", "sft.checkpoint_every=5",
             "sft.micro_batch_size=16", "eval.max_new_tokens=24", "eval.seen_examples=20",
             "grpo.rounds=4", "rollout.prompts_per_round=16", "rollout.n_samples_per_prompt=8",
             "rollout.max_response_tokens=24", "rollout.dynamic_filter=none", "grpo.mini_batches=2",
             "grpo.micro_batch_size=64", "grpo.eval_every=2", "grpo.eval_examples=10", "grpo.pass_k=2",
             "grpo.checkpoint_every=2", "grpo.sample_table_every=2", "control.enabled=false",
             "sft.deepspeed.timeout_s=400", "grpo.deepspeed.timeout_s=400",
             "grpo.rewards=[{name: tests.test_multirank.digit_share}]"]

THREADS = "2"  # every run's torch threads, quiet or squeezed (the numerics a resume must match)


@contextmanager
def squeezed():
    """The CLI runs started in this block (and their ranks and servers) run their THREADS threads on
    one core: they inherit this process's CPU affinity."""
    cpus = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(cpus)})
    try:
        yield
    finally:
        os.sched_setaffinity(0, cpus)


def run(root: Path, name: str, overrides: list[str] = (), args: tuple[str, ...] = (), fault: str | None = None,
        loaded: bool = False) -> tuple[int, dict | None]:
    """The CLI on `root`, quiet or squeezed (`loaded`); its exit code and result."""
    out = root / f"{name}.json"
    with squeezed() if loaded else nullcontext():
        code, _ = run_cli(root, out, fault, timeout=900, overrides=OVERRIDES + list(overrides), args=args,
                          env={"OMP_NUM_THREADS": THREADS})
    return code, (json.loads(out.read_text()) if out.exists() else None)


def weights(result: dict) -> dict:
    """What must be equal: each trained stage's weights and the GRPO rewards round by round."""
    grpo = manifest(result, "grpo")
    history = [json.loads(x) for x in (Path(grpo["uri"]) / "history.jsonl").read_text().splitlines()]
    return {"sft": manifest(result, "sft")["result"]["state_hash"], "grpo": grpo["state_hash"],
            "rewards": [h["reward/mean"] for h in history], "final_accuracy": result["headline"]["final_accuracy"]}


@pytest.fixture(scope="module")
def quiet_run(tmp_path_factory):
    """The quiet run: its folder (the variants below reuse its data, tokenizer and SFT) and weights."""
    root = tmp_path_factory.mktemp("quiet")
    _, result = run(root, "quiet")
    return root, weights(result)


def test_a_run_killed_and_resumed_squeezed_ends_with_the_quiet_runs_weights(quiet_run, tmp_path):
    """Long by design (a whole CLI run squeezed onto one core, SIGKILLed in GRPO's round 3, then
    resumed squeezed): the threaded code paths only order their work differently when their threads
    contend for cores. The killed run trained SFT and GRPO's first rounds squeezed, the resumed one
    the rest: SFT's weights are checked as the killed run left them, the rest at the end."""
    _, quiet = quiet_run
    code, _ = run(tmp_path, "killed", fault="grpo_mid_round@3:kill", loaded=True)
    assert code == -signal.SIGKILL, f"expected the run to die of SIGKILL, got exit code {code}"
    [sft] = (tmp_path / "sft").glob("*/manifest.json")
    assert json.loads(sft.read_text())["result"]["state_hash"] == quiet["sft"]  # SFT squeezed
    _, result = run(tmp_path, "resumed", loaded=True)
    assert manifest(result, "grpo")["resumed_from_round"] == 2
    assert weights(result) == quiet


# (id, overrides, environment): each variant's quiet run against its own squeezed re-run of GRPO.
# "async": the HF engine's rollout process generates round r + 1 while round r updates, on the same
# squeezed core, its own 2 threads preempted with the trainer's; which process gets ahead changes
# from run to run, the batch each round trains on must not (with POSTTRAIN_DETERMINISTIC=0 and the
# kernels off, its squeezed re-run ended with other weights than the quiet run).
VARIANTS = [
    ("torch-ops", [], {"POSTTRAIN_KERNELS": "0"}),
    ("zero3", ["grpo.deepspeed.zero_stage=3"], {}),
    ("two-ranks-zero2", ["grpo.deepspeed.ranks_per_node=2", "grpo.deepspeed.zero_stage=2"], {}),
    ("async", ["rollout.async_steps=1", "rollout.worker_threads=2"], {}),
]


@pytest.mark.parametrize("overrides,env", [v[1:] for v in VARIANTS], ids=[v[0] for v in VARIANTS])
def test_grpo_squeezed_matches_quiet(quiet_run, monkeypatch, overrides, env):
    """Long by design: a quiet run and a squeezed re-run of GRPO per variant, at the tiny preset's
    model and micro-batch (smaller shapes let the unfixed code pass by luck, see above). Data,
    tokenizer and SFT come from the quiet run's folder; both GRPO runs are recomputed (a variant's
    settings may share the quiet run's GRPO key: the torch-op kernels are not keyed), for 2 rounds
    (2 updates of 2 mini-batches each) where the quiet run trains 4: the variants' quiet/squeezed pairs
    differ in how threads and ranks order their sums, which every update exercises."""
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    overrides = [*overrides, "grpo.rounds=2"]
    root, _ = quiet_run
    _, first = run(root, "quiet", overrides, args=("--recompute", "grpo"))
    expected = weights(first)  # read now: the re-run commits its GRPO result to the same key
    _, again = run(root, "loaded", overrides, args=("--recompute", "grpo"), loaded=True)
    for ran in (first, again):  # only GRPO and what follows ran again
        assert [(s["stage"], s["cache_hit"]) for s in ran["stages"]][:5] == [
            ("prepare_data", True), ("tokenizer", True), ("sft", True), ("eval", True), ("grpo", False)]
    assert weights(again) == expected
