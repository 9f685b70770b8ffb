"""A GRPO checkpoint holds everything (weights, optimizer, scheduler, RNG, data buffer, carried
groups, round): a run killed after round 3 and resumed from its round-2 checkpoint ends with the
same weights as an uninterrupted run."""

import pytest

from trainer.config import load_config
from trainer.data import synthetic
from trainer.grpo import GRPOTrainer
from trainer.loop import run_round, run_rounds
from trainer.model import build_model

OVERRIDES = ["model.hidden_size=32", "model.num_layers=1", "model.intermediate_size=64",
             "grpo.rounds=4", "grpo.checkpoint_every=2", "grpo.eval_every=100", "rollout.prompts_per_round=3",
             "rollout.n_samples_per_prompt=4", "rollout.over_sample=2", "rollout.max_response_tokens=12",
             "rollout.dynamic_filter=none", "grpo.mini_batches=2", "grpo.epochs=2", "grpo.micro_batch_size=4",
             "grpo.lr=1e-3", "grpo.kl_coef=0.05", "grpo.entropy_coef=0.01", "grpo.warmup_rounds=2"]


def _run(cfg, tok, data, work, crash_after=None):
    trainer = GRPOTrainer(cfg, build_model(cfg.model, tok, 0), tok, data.train, data.test, work)
    while not trainer.done():
        run_round(trainer)  # rollout, reward, update, publish, checkpoint when due
        if crash_after == trainer.round:
            return None
    return trainer


def test_grpo_resume_is_exact(tiny_tokenizer, tmp_path):
    cfg = load_config("tiny", OVERRIDES)
    data = synthetic(cfg.data.synthetic.model_copy(update={"n_train": 40, "n_test": 4}), 0)
    full = _run(cfg, tiny_tokenizer, data, tmp_path / "full")
    assert full.round == 4 and len(full.history) == 4
    assert all(h["update/optimizer_steps"] == 4 for h in full.history)  # 2 mini-batches x 2 epochs
    assert full.history[-1]["update/kl"] > 0  # the reference model is in use

    assert _run(cfg, tiny_tokenizer, data, tmp_path / "crash", crash_after=3) is None
    resumed = GRPOTrainer(cfg, build_model(cfg.model, tiny_tokenizer, 0), tiny_tokenizer, data.train, data.test,
                          tmp_path / "crash")
    assert resumed.resumed_from == 2
    run_rounds(resumed)
    assert resumed.state_hash() == full.state_hash()
    assert [h["reward/mean"] for h in resumed.history] == pytest.approx([h["reward/mean"] for h in full.history])


@pytest.mark.parametrize("gpu", [False, True], ids=["cpu", "gpu"])
def test_every_process_asks_for_deterministic_kernels(monkeypatch, gpu):
    """torch's switch is patched (its effect on a real run is what tests/test_determinism_load.py
    measures): a process asks for deterministic kernels once, on the CPU as on a GPU, unless turned
    off. CUDA cannot run here, so on the GPU branch torch.cuda.is_available is patched; that the
    settings suffice there was measured on one H100 (docs/reproducibility.md)."""
    import os

    import torch

    from trainer import engine

    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpu)
    monkeypatch.setattr(torch, "use_deterministic_algorithms", lambda on, warn_only=False: calls.append((on, warn_only)))
    monkeypatch.setattr(torch.utils.deterministic, "fill_uninitialized_memory", True)
    monkeypatch.setattr(engine, "_determinism_set", False)
    monkeypatch.setattr(os, "environ", {engine.DETERMINISTIC: "0"})
    engine.deterministic()
    assert calls == [] and "CUBLAS_WORKSPACE_CONFIG" not in os.environ
    del os.environ[engine.DETERMINISTIC]
    engine.deterministic()
    engine.deterministic()
    assert calls == [(True, False)]
    assert (os.environ.get("CUBLAS_WORKSPACE_CONFIG") == ":4096:8") == gpu
    # the NaN fill of new allocations (a debugging aid, one more kernel per new tensor) is off on both
    assert torch.utils.deterministic.fill_uninitialized_memory is False


def test_a_resume_with_another_thread_count_says_it_will_not_be_exact(tiny_tokenizer, tmp_path, caplog):
    """The thread count splits every threaded reduction: a resume with another count is close to
    the uninterrupted run, not bit-identical, and says so with the way back."""
    import logging

    import torch

    from trainer import checkpoint

    cfg = load_config("tiny", OVERRIDES)
    data = synthetic(cfg.data.synthetic.model_copy(update={"n_train": 40, "n_test": 4}), 0)
    assert _run(cfg, tiny_tokenizer, data, tmp_path, crash_after=2) is None
    threads = torch.get_num_threads()
    with caplog.at_level(logging.WARNING, logger="trainer.checkpoint"):
        GRPOTrainer(cfg, build_model(cfg.model, tiny_tokenizer, 0), tiny_tokenizer, data.train, data.test, tmp_path)
    assert not [r for r in caplog.records if "other numerics" in r.getMessage()]
    torch.set_num_threads(threads + 1)
    try:
        with caplog.at_level(logging.WARNING, logger="trainer.checkpoint"):
            GRPOTrainer(cfg, build_model(cfg.model, tiny_tokenizer, 0), tiny_tokenizer, data.train, data.test, tmp_path)
    finally:
        torch.set_num_threads(threads)
    said = [r.getMessage() for r in caplog.records if "other numerics" in r.getMessage()]
    assert len(said) == 1 and f"threads {threads} then, {threads + 1} now" in said[0] and "OMP_NUM_THREADS" in said[0]
    assert checkpoint.numerics_differences(None, checkpoint.numerics()) == []  # checkpoints from before the record
