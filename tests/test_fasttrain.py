"""GRPO's fused log-prob passes (`trainer.fasttrain`) against the model's own forward.

Same log-probs and the same gradient on every parameter as `trainer.rl.logprobs.hf_prefix_logits` (HF's
forward with a KV cache), on the shapes GRPO feeds them: prompts of uneven lengths shared by
uneven numbers of samples, responses of uneven lengths (right-padded), one-token responses;
for Llama with grouped-query attention and Qwen2 (q/k/v biases, tied embeddings). Each compiled op
is also held to torch's own computation, forward and backward, and refuses what it cannot read.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

from trainer import fasttrain, kernels
from trainer.inference.cpu import left_pad
from trainer.rl.logprobs import hf_prefix_logits

COMMON = dict(vocab_size=90, hidden_size=64, intermediate_size=160, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128, pad_token_id=0)


@pytest.fixture(autouse=True)
def compiled(monkeypatch):
    monkeypatch.setattr(kernels, "_state", {})
    monkeypatch.setenv("POSTTRAIN_KERNELS", "1")
    assert kernels.ops() is not None, "the kernels did not build: `python -m trainer.kernels -v`"


def _model(kind: str) -> torch.nn.Module:
    torch.manual_seed(5)
    if kind == "llama":
        return LlamaForCausalLM(LlamaConfig(**COMMON, tie_word_embeddings=False)).train()
    return Qwen2ForCausalLM(Qwen2Config(**COMMON, tie_word_embeddings=True, initializer_range=0.3)).train()


def _batch(seed: int, prompt_lengths: list[int], samples: list[int], max_response: int):
    """Distinct prompts (left-padded), which prompt each sample continues, responses (right-padded)."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, 90, (n,), generator=g).tolist() for n in prompt_lengths]
    pids, pmask = left_pad(prompts, 0)
    inverse = torch.tensor([u for u, n in enumerate(samples) for _ in range(n)])
    B = len(inverse)
    rids = torch.randint(1, 90, (B, max_response), generator=g)
    lengths = torch.randint(1, max_response + 1, (B,), generator=g)
    lengths[0] = max_response
    rmask = (torch.arange(max_response)[None] < lengths[:, None]).long()
    return pids, pmask, inverse, rids * rmask, rmask


def _logprobs_and_grads(model, passes, batch, entropy_weight: float):
    model.zero_grad(set_to_none=True)
    pids, pmask, inverse, rids, rmask = batch
    logp_all = torch.log_softmax(passes(model, pids, pmask, inverse, rids, rmask).float() / 0.7, dim=-1)
    lp = logp_all.gather(-1, rids.unsqueeze(-1)).squeeze(-1) * rmask
    entropy = -(logp_all.exp() * logp_all).sum(-1) * rmask
    # a loss of GRPO's shape: per-token weights of both signs, an entropy term
    weights = torch.linspace(-1, 1, lp.numel()).view_as(lp)
    ((lp * weights).sum() - entropy_weight * entropy.sum()).backward()
    return lp.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize("shape", [([5, 9, 3], [3, 1, 4], 7), ([6], [5], 1), ([4, 4, 8, 2], [2, 2, 2, 2], 12)],
                         ids=["uneven", "one-token-responses", "even-groups"])
def test_logprobs_and_gradients_are_the_models_own(kind, shape):
    model = _model(kind)
    assert fasttrain.unsupported(model) is None
    batch = _batch(len(shape[0]), *shape)
    want_lp, want = _logprobs_and_grads(model, hf_prefix_logits, batch, 0.05)
    got_lp, got = _logprobs_and_grads(model, fasttrain.prefix_logits, batch, 0.05)
    # two float32 summation orders (the compiled products against MKL's): log-probs up to ~12 in size
    torch.testing.assert_close(got_lp, want_lp, rtol=1e-5, atol=2e-5)
    assert set(got) == set(want) and len(want) == len(list(model.parameters()))
    for name, g in want.items():
        err = float((got[name] - g).abs().max() / g.abs().max().clamp(min=1e-12))
        assert err < 1e-4, (name, err)


def test_the_padding_tokens_embedding_gets_no_gradient():
    """HF's embedding skips padding_idx in its backward; the fused pass keeps that."""
    model = _model("llama")
    batch = _batch(1, [3, 8], [2, 2], 5)
    _, grads = _logprobs_and_grads(model, fasttrain.prefix_logits, batch, 0.0)
    emb = grads["model.embed_tokens.weight"]
    assert float(emb[0].abs().max()) == 0.0 and float(emb[1:].abs().max()) > 0


def test_what_falls_back_to_the_models_own_forward(monkeypatch):
    q3 = Qwen3ForCausalLM(Qwen3Config(**COMMON, head_dim=16))
    assert fasttrain.unsupported(q3) == "q/k norms (Qwen3)"
    llama = _model("llama")
    assert "float32" in fasttrain.unsupported(llama.to(torch.float64))
    monkeypatch.setattr(kernels, "_state", {})
    monkeypatch.setenv("POSTTRAIN_KERNELS", "0")
    assert fasttrain.unsupported(_model("llama")) == "the compiled kernels did not build"


# ---------------------------------------------------------------- each op against torch

def _grads(f, *xs):
    xs = [x.detach().clone().requires_grad_(True) for x in xs]
    y = f(*xs)
    torch.manual_seed(0)
    (y * torch.randn_like(y)).sum().backward()
    return y.detach(), [x.grad for x in xs]


def test_rms_norm_matches_torch():
    x, w = torch.randn(37, 48) * 3, torch.randn(48)
    want = _grads(lambda a, b: F.rms_norm(a, (48,), b, 1e-5), x, w)
    got = _grads(lambda a, b: fasttrain._RMSNorm.apply(a, b, 1e-5), x, w)
    torch.testing.assert_close(got[0], want[0])
    for g, e in zip(got[1], want[1]):
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-5)


def test_rotary_matches_hf_rotate_half():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    R, heads, kv, hd = 23, 4, 2, 16
    qkv = torch.randn(R, (heads + 2 * kv) * hd)
    angle = torch.rand(R, hd // 2) * 6
    cos, sin = torch.cat([angle.cos()] * 2, -1), torch.cat([angle.sin()] * 2, -1)
    signed = torch.cat([-sin[:, : hd // 2], sin[:, hd // 2:]], -1)

    def hf(x):
        q, k, v = x.view(R, heads + 2 * kv, hd).split([heads, kv, kv], dim=1)
        q, k = apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)  # [R, heads, hd] against [R, 1, hd]
        return torch.cat([q, k, v], 1).reshape(R, -1)

    want = _grads(hf, qkv)
    got = _grads(lambda x: fasttrain._Rotary.apply(x, cos, signed, heads + kv, hd), qkv)
    torch.testing.assert_close(got[0], want[0])
    torch.testing.assert_close(got[1][0], want[1][0])


def test_swiglu_matches_torch():
    gu = torch.randn(29, 2 * 40) * 4
    want = _grads(lambda x: F.silu(x[:, :40]) * x[:, 40:], gu)
    got = _grads(fasttrain._SwiGLU.apply, gu)
    torch.testing.assert_close(got[0], want[0])
    torch.testing.assert_close(got[1][0], want[1][0])


def test_the_ops_refuse_what_they_cannot_read():
    ops = kernels.ops()
    x = torch.randn(4, 8)
    with pytest.raises(RuntimeError, match="rms_norm_fwd: x must be a contiguous float32"):
        ops.rms_norm_fwd(x.double(), torch.ones(8), 1e-6)
    with pytest.raises(RuntimeError, match="rms_norm_fwd: shapes disagree"):
        ops.rms_norm_fwd(x, torch.ones(9), 1e-6)
    with pytest.raises(RuntimeError, match="rms_norm_bwd: shapes disagree"):
        ops.rms_norm_bwd(torch.randn(4, 7), x, torch.ones(8), torch.ones(4))
    with pytest.raises(RuntimeError, match="rotary: x must be a contiguous float32"):
        ops.rotary(x.t(), torch.ones(8, 4), torch.ones(8, 4), 1, 4, False)
    with pytest.raises(RuntimeError, match="rotary: shapes disagree"):
        ops.rotary(x, torch.ones(4, 4), torch.ones(4, 4), 3, 4, False)  # 3 heads of 4 in a row of 8
    with pytest.raises(RuntimeError, match=r"swiglu_fwd: gu must be \[rows, 2 \* intermediate\]"):
        ops.swiglu_fwd(torch.randn(4, 7))
    with pytest.raises(RuntimeError, match="swiglu_bwd: shapes disagree"):
        ops.swiglu_bwd(torch.randn(4, 3), x)


@pytest.mark.slow
def test_zero3_partitioned_weights_run_through_the_models_own_forward(tmp_path):
    """ZeRO-3 keeps every weight partitioned outside the modules' own forward hooks: the fused passes
    and the fast decoder, which read weights directly, step aside (one rank on CPU once crashed in the
    decoder on an empty embedding), and a round runs through the model's forward and HF generate."""
    from tests.bench_ref import SHAPES, model, posttrain_config, problems, tokenizer
    from trainer.inference.cpu import unsupported as decoder_unsupported
    from trainer.grpo import GRPOTrainer

    shape = SHAPES["ref"]
    tok = tokenizer(tmp_path / "tok")
    rows = [{"id": r["id"], "answer": r["answer"],
             "messages": [{"role": "user", "content": r["question"]}, {"role": "assistant", "content": ""}]}
            for r in problems(16)]
    cfg = posttrain_config(shape)
    cfg = cfg.model_copy(update={"grpo": cfg.grpo.model_copy(update={
        "deepspeed": cfg.grpo.deepspeed.model_copy(update={"zero_stage": 3})})})
    trainer = GRPOTrainer(cfg, model(shape, tok), tok, rows, rows[:4], tmp_path / "grpo")
    module = trainer.ds.module
    assert fasttrain.unsupported(module) == decoder_unsupported(module) == "DeepSpeed ZeRO-3 partitions the weights"
    stats = trainer.update(trainer.score(trainer.rollout()))
    assert stats["rollout/generated_tokens"] == shape.batch * shape.new_tokens
    assert stats["update/optimizer_steps"] == 1 and math.isfinite(stats["update/loss"])
