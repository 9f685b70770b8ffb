"""`model.tf32`: every stage's float32 matrix products on TF32 tensor cores on a CUDA GPU.

Without a GPU what can be checked is where the switch is set (each stage from its own config, so a
process that runs several stages runs each as configured) and that a CPU's numbers do not move. The
speed and the GPU's numbers are a GPU's to show: `make bench`'s "fp32, TF32" rows against TRL's
`tf32=True` (tests/gpu_session.sh with TF32=1; docs/gpu.md)."""

import torch
import torch.nn.functional as F

from trainer import engine as ds
from trainer.config import load_config

MODEL = ["model.hidden_size=32", "model.num_layers=1", "model.intermediate_size=64", "model.num_heads=2"]


def cuda_switch() -> str:
    return torch.backends.cuda.matmul.fp32_precision


def test_the_switch_is_cudas_and_leaves_the_cpus_products_to_the_bit():
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(257, 129, generator=g), torch.randn(65, 129, generator=g, requires_grad=True)

    def products():
        w.grad = None
        y = F.linear(x, w)
        (y.square().sum() + (x @ x.T).sum()).backward()
        return y.detach().clone(), w.grad.clone()

    cpu_switch = torch.backends.mkldnn.matmul.fp32_precision
    try:
        ds.fp32_matmul(False)
        assert cuda_switch() == "ieee"
        exact = products()
        ds.fp32_matmul(True)
        assert cuda_switch() == "tf32"
        assert torch.backends.mkldnn.matmul.fp32_precision == cpu_switch  # the CPU's own switch is not touched
        for a, b in zip(exact, products()):
            assert torch.equal(a, b)
    finally:
        ds.fp32_matmul(False)


def test_each_training_stage_sets_it_from_its_own_config(tiny_tokenizer, tmp_path):
    """The GRPO trainer and SFT set the switch as their config says, on and then off again in the same
    process (a worker that runs one run's stages after another's)."""
    from trainer.data import synthetic
    from trainer.grpo import GRPOTrainer
    from trainer.model import build_model
    from trainer.sft import train_sft

    def grpo(tf32: bool) -> None:
        cfg = load_config("tiny", MODEL + [f"model.tf32={str(tf32).lower()}", "grpo.eval_every=1000"])
        data = synthetic(cfg.data.synthetic.model_copy(update={"n_train": 20, "n_test": 2}), 0)
        GRPOTrainer(cfg, build_model(cfg.model, tiny_tokenizer, 0), tiny_tokenizer, data.train, data.test,
                    tmp_path / f"grpo-{tf32}")

    def sft(tf32: bool) -> None:
        cfg = load_config("tiny", MODEL + [f"model.tf32={str(tf32).lower()}", "sft.micro_batch_size=8",
                                           "sft.max_steps=1"])
        rows = synthetic(cfg.data.synthetic.model_copy(update={"n_train": 16, "n_test": 2}), 0).train
        _, result = train_sft(cfg, build_model(cfg.model, tiny_tokenizer, 0), tiny_tokenizer, rows,
                              tmp_path / f"sft-{tf32}")
        assert result.steps == 1

    try:
        for stage in (grpo, sft):
            stage(True)
            assert cuda_switch() == "tf32", stage.__name__
            stage(False)
            assert cuda_switch() == "ieee", stage.__name__
    finally:
        ds.fp32_matmul(False)


def test_the_dry_run_says_what_the_switch_does_on_this_machine(tmp_path, capsys):
    from flows.cli import main

    code = main(["speedrun", "--preset", "tiny", "--dry-run", "--set", f"artifact_root={tmp_path / 'art'}",
                 "--set", "model.tf32=true"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "note: model.tf32: float32 products take TF32 tensor cores on a CUDA GPU" in out
    assert ("this machine has none, so nothing changes here" in out) != torch.cuda.is_available()
    assert not (tmp_path / "art").exists()
