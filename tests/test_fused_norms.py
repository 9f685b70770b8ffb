"""RMSNorm layers through torch's fused kernel (`trainer.inference.cuda.fuse_norms`), the GPU update's norm.

Only CUDA builds of torch have the fused kernel, so on a GPU the norm is one operator each way in
place of transformers' eight forward and about ten backward. Off the GPU the model's own norm runs,
to the bit. The CPU tests put the CPU among `FUSED_NORM_DEVICES` to run the GPU's code (torch's CPU
`rms_norm` computes the same thing in separate operators): the same log-probs and gradients as the
model's own norm, for Llama and Qwen3 (whose attention has q/k norms too), fp32 and bf16, with
transformers' gradient checkpointing, on SmolLM2-135M's real weights, and through a whole GRPO update
with the KL term's reference and PPO's critic. On the CPU the two agree to the bit (its rms_norm is
transformers' sequence of operators); the tolerances are the GPU's, whose fused kernel sums the
squares in its own order. The operator count is checked where CUDA exists.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.nn.functional as F
from transformers import GemmaConfig, GemmaForCausalLM, LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from trainer.inference import cuda
from trainer.rl.logprobs import hf_checkpointing

COMMON = dict(vocab_size=90, hidden_size=64, intermediate_size=160, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128, pad_token_id=0)


def _model(kind: str, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    torch.manual_seed(3)
    if kind == "llama":
        m = LlamaForCausalLM(LlamaConfig(**COMMON))
    else:
        m = Qwen3ForCausalLM(Qwen3Config(**COMMON, head_dim=16))
    return m.to(dtype).train()


def _norms(model: torch.nn.Module) -> int:
    return sum(type(m).__name__.endswith("RMSNorm") for m in model.modules())


@pytest.fixture
def fused_calls(monkeypatch) -> list[int]:
    """How many times the fused norm ran (in a forward, or in a checkpointed layer's recomputation)."""
    calls, fast = [0], cuda._fast_rms

    def counted(*a):
        calls[0] += 1
        return fast(*a)

    monkeypatch.setattr(cuda, "_fast_rms", counted)
    return calls


def _batch(vocab: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Uneven rows, left-padded as the update's prompts are."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (4, 19), generator=g)
    mask = torch.ones_like(ids)
    for r, pad in enumerate((0, 5, 11, 2)):
        mask[r, :pad] = 0
    return ids * mask, mask


def _loss_and_grads(model, ids, mask, checkpointed: bool = False):
    model.zero_grad(set_to_none=True)
    with hf_checkpointing(model) if checkpointed else contextlib.nullcontext():
        logits = model(input_ids=ids, attention_mask=mask).logits
    lp = torch.log_softmax(logits.float()[:, :-1] / 0.7, -1).gather(-1, ids[:, 1:, None])[..., 0]
    loss = -(lp * mask[:, 1:]).sum() / mask[:, 1:].sum()
    loss.backward()
    return lp.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_off_the_gpu_the_models_own_norm_runs_to_the_bit(fused_calls, kind):
    own, fused = _model(kind), _model(kind)
    assert cuda.fuse_norms(fused) == _norms(fused) == (2 * 3 + 1 if kind == "llama" else 4 * 3 + 1)
    ids, mask = _batch(COMMON["vocab_size"])
    want_lp, want_g = _loss_and_grads(own, ids, mask)
    lp, g = _loss_and_grads(fused, ids, mask)
    assert fused_calls[0] == 0  # the CPU is not among FUSED_NORM_DEVICES: transformers' own norm ran
    assert torch.equal(lp, want_lp)
    assert set(g) == set(want_g) and all(torch.equal(g[n], want_g[n]) for n in want_g)
    assert set(fused.state_dict()) == set(own.state_dict())  # nothing added to what is saved


@pytest.mark.parametrize("checkpointed", [False, True], ids=["plain", "checkpointed"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_the_fused_norm_gives_the_models_log_probs_and_gradients(monkeypatch, fused_calls, kind, dtype,
                                                                 checkpointed):
    own, fused = _model(kind, dtype), _model(kind, dtype)
    cuda.fuse_norms(fused)
    monkeypatch.setattr(cuda, "FUSED_NORM_DEVICES", ("cpu",))
    ids, mask = _batch(COMMON["vocab_size"], seed=1)
    want_lp, want_g = _loss_and_grads(own, ids, mask, checkpointed)
    assert fused_calls[0] == 0
    lp, g = _loss_and_grads(fused, ids, mask, checkpointed)
    # every norm ran fused, once a forward, and the layers' again in the backward's recomputation
    # (which must take the same path as the forward: non-reentrant checkpointing checks what it saves)
    layers_norms = _norms(fused) - 1
    assert fused_calls[0] == _norms(fused) + (layers_norms if checkpointed else 0)
    if dtype == torch.float32:
        torch.testing.assert_close(lp, want_lp, rtol=0, atol=2e-6)
        for n in want_g:
            torch.testing.assert_close(g[n], want_g[n], rtol=1e-4, atol=1e-6, msg=n)
    else:  # bf16: the casts where transformers puts them; the sums of squares in another order
        assert (lp - want_lp).abs().max() < 0.05
        for n in want_g:
            rel = (g[n].float() - want_g[n].float()).norm() / want_g[n].float().norm().clamp_min(1e-12)
            assert rel < 0.02, (n, float(rel))


@pytest.mark.slow
def test_smollm2_real_weights_bf16(monkeypatch, fused_calls, smollm2):
    """SmolLM2-135M-Instruct in bf16 as the GPU update runs it: 61 norms, real activations (the
    residual stream grows to hundreds), against its own norm."""
    _folder, base, tok = smollm2
    own = copy.deepcopy(base).to(torch.bfloat16).train()
    fused = copy.deepcopy(own)
    assert cuda.fuse_norms(fused) == 61
    monkeypatch.setattr(cuda, "FUSED_NORM_DEVICES", ("cpu",))
    text = ["Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May.",
            "What is 17 * 23? Think step by step, then give the answer after ####."]
    enc = tok(text, return_tensors="pt", padding=True)
    want_lp, want_g = _loss_and_grads(own, enc.input_ids, enc.attention_mask)
    lp, g = _loss_and_grads(fused, enc.input_ids, enc.attention_mask)
    assert fused_calls[0] == 61
    real = enc.attention_mask[:, 1:].bool()
    gap = (lp - want_lp)[real].abs()
    assert gap.mean() < 0.02 and gap.max() < 0.25, (float(gap.mean()), float(gap.max()))
    for n in ("model.norm.weight", "model.layers.0.input_layernorm.weight", "model.layers.29.mlp.down_proj.weight"):
        rel = (g[n].float() - want_g[n].float()).norm() / want_g[n].float().norm()
        assert rel < 0.05, (n, float(rel))


def test_copies_keep_the_fused_norm_bound_to_themselves():
    fused = _model("llama")
    cuda.fuse_norms(fused)
    twin = copy.deepcopy(fused)
    norm = twin.model.layers[1].input_layernorm
    assert norm.forward.__func__ is cuda._fused_norm_forward and norm.forward.__self__ is norm
    with torch.no_grad():
        norm.weight.mul_(2.0)  # the copy's weight, not the original's, scales the copy's output
    x = torch.randn(2, 5, COMMON["hidden_size"])
    assert torch.equal(norm(x), 2.0 * fused.model.layers[1].input_layernorm(x))


def test_under_lora_adapters_the_norms_are_fused_too(monkeypatch, fused_calls):
    """SFT and GRPO with model.lora fuse the peft-wrapped model: the norms are found inside it."""
    from trainer.config import LoRAConfig
    from trainer.lora import wrap

    wrapped = wrap(_model("llama"), LoRAConfig(rank=4))
    assert cuda.fuse_norms(wrapped) == 7
    monkeypatch.setattr(cuda, "FUSED_NORM_DEVICES", ("cpu",))
    ids, mask = _batch(COMMON["vocab_size"])
    _lp, grads = _loss_and_grads(wrapped, ids, mask)
    assert fused_calls[0] == 7 and any("lora_A" in n for n in grads)


def test_models_outside_the_llama_family_keep_their_norms():
    gemma = GemmaForCausalLM(GemmaConfig(**{**COMMON, "head_dim": 16}))  # its norm scales by 1 + weight
    assert cuda.fuse_norms(gemma) == 0
    assert all("forward" not in vars(m) for m in gemma.modules())


@pytest.mark.parametrize("extra", [["grpo.kl_coef=0.5"], ["grpo.advantage=gae", "grpo.critic.warmup_rounds=0"]],
                         ids=["kl-reference", "ppo-critic"])
def test_a_grpo_update_on_the_gpus_path_is_the_same_update(monkeypatch, fused_calls, tiny_tokenizer, tmp_path,
                                                           extra):
    """The policy, the KL term's reference and PPO's critic all get the fused norm (the trainer sets it
    up), and an update through the GPU's path (transformers' forward, not the CPU's compiled passes)
    gives the loss and gradient norm of the model's own norm."""
    from tests.test_grpo_update import make_batch, make_cfg, make_trainer
    from trainer.rl import logprobs

    cfg = make_cfg(*extra)
    monkeypatch.setattr(logprobs.fasttrain, "unsupported", lambda _m: "a GPU (emulated)")
    stats = {}
    for fused in (False, True):
        monkeypatch.setattr(cuda, "FUSED_NORM_DEVICES", ("cpu",) if fused else ("cuda",))
        trainer = make_trainer(cfg, tiny_tokenizer, tmp_path / str(fused))
        models = [trainer.ds.module] + [m for m in (trainer.reference, getattr(trainer.critic, "module", None)) if m]
        assert len(models) == 2
        for m in models:
            assert all(n.forward.__func__ is cuda._fused_norm_forward
                       for n in m.modules() if type(n).__name__.endswith("RMSNorm"))
        before = fused_calls[0]
        stats[fused] = trainer.update(make_batch(0, 3, 4, len(tiny_tokenizer), seed=7))
        assert (fused_calls[0] > before) == fused
    for key in ("update/loss", "update/grad_norm"):
        assert stats[True][key] == pytest.approx(stats[False][key], rel=1e-4, abs=1e-6), key


def test_sft_trains_its_model_with_the_fused_norm(monkeypatch, fused_calls, tiny_tokenizer, tmp_path):
    from trainer.config import load_config
    from trainer.data import synthetic
    from trainer.model import build_model
    from trainer.sft import train_sft

    cfg = load_config("tiny", ["model.hidden_size=32", "model.num_layers=2", "model.intermediate_size=64",
                               "sft.micro_batch_size=8", "sft.max_steps=2", "sft.packing=false"])
    rows = synthetic(cfg.data.synthetic.model_copy(update={"n_train": 40, "n_test": 2}), 1).train
    monkeypatch.setattr(cuda, "FUSED_NORM_DEVICES", ("cpu",))
    model = build_model(cfg.model, tiny_tokenizer, 0)
    _, result = train_sft(cfg, model, tiny_tokenizer, rows, tmp_path)
    assert result.steps == 2 and fused_calls[0] >= 2 * 5  # two steps' forwards, 5 norms each
    assert model.model.norm.forward.__func__ is cuda._fused_norm_forward


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="the fused RMSNorm kernel exists in CUDA builds of torch only, and this machine has no "
                           "CUDA device (the tests above run the same code on CPU)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_on_cuda_the_norm_is_fewer_operators_with_the_same_numbers(dtype):
    from tests.gpu_profile import _Ops

    own, fused = _model("llama", dtype).cuda(), _model("llama", dtype).cuda()
    cuda.fuse_norms(fused)
    ids, mask = (t.cuda() for t in _batch(COMMON["vocab_size"], seed=2))
    counts = {}
    for name, m in (("own", own), ("fused", fused)):
        with _Ops() as ops:
            lp, _grads = _loss_and_grads(m, ids, mask)
        counts[name] = (lp, ops.row()["operators"])
    assert counts["fused"][1] < counts["own"][1] - 4 * _norms(fused), (counts["fused"][1], counts["own"][1])
    tol = 2e-6 if dtype == torch.float32 else 0.05
    assert (counts["fused"][0] - counts["own"][0]).abs().max() < tol


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="the fused RMSNorm kernel exists in CUDA builds of torch only, and this machine has no "
                           "CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_on_cuda_the_fused_norm_runs_under_the_deterministic_mode_the_same_each_time(dtype):
    """posttrain trains under torch's strict deterministic mode (`trainer.engine.deterministic`): the
    fused norm's backward must neither refuse it nor differ run to run, the weight's gradient (a sum
    over rows) included. The mode is put back afterwards (no products here, so cuBLAS's workspace
    setting does not matter)."""
    before = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        g = torch.Generator(device="cuda").manual_seed(0)
        x0 = (torch.randn(3000, 576, device="cuda", generator=g) * 40).to(dtype)
        w0 = torch.rand(576, device="cuda", generator=g).to(dtype)
        runs = []
        for _ in range(2):
            x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
            y = cuda._fast_rms(x, w, 1e-5)
            (y.float() * torch.linspace(-1, 1, 576, device="cuda")).sum().backward()
            runs.append((y.detach(), x.grad, w.grad))
        assert all(torch.equal(a, b) for a, b in zip(*runs))
    finally:
        torch.use_deterministic_algorithms(before, warn_only=warn_only)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device on this machine: the CPU case above ran the same code"))])
def test_in_bf16_the_norm_rounds_where_the_models_own_rounds(device):
    """In bf16 `_fast_rms` hands rms_norm the bf16 values (it computes in float32 and rounds once) and
    multiplies by the weight after: two kernels where casting to float32 first and back after takes
    four. The same bits as that order (transformers' casts), forward and backward, on rows as wide
    as SmolLM2's and Qwen's, with a residual stream's large values."""
    g = torch.Generator(device=device).manual_seed(0)
    for width in (64, 576, 896):
        x0 = (torch.randn(777, width, device=device, generator=g) * 40).bfloat16()
        w0 = torch.rand(width, device=device, generator=g).bfloat16()
        grad = torch.randn(777, width, device=device, generator=g).bfloat16()
        out = []
        for f in (cuda._fast_rms, lambda x, w, eps: w * F.rms_norm(x.float(), w.shape, None, eps).to(x.dtype)):
            x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
            y = f(x, w, 1e-5)
            y.backward(grad)
            out.append((y.detach(), x.grad, w.grad))
        assert all(torch.equal(a, b) for a, b in zip(*out)), width
