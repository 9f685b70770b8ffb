"""GRPO math pinned on hand-made numbers."""

import math

import pytest
import torch

from trainer.rl.losses import aggregate, clipped_objective, group_advantages, kl_estimate


def test_advantages_with_and_without_std():
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0], [2.0, 2.0, 2.0, 2.0]])
    centred = group_advantages(r, std_normalize=False)
    assert torch.allclose(centred, torch.tensor([[0.5, -0.5, -0.5, 0.5], [0.0, 0.0, 0.0, 0.0]]))
    normed = group_advantages(r, std_normalize=True)
    std = torch.tensor([1.0, 0.0, 0.0, 1.0]).std(unbiased=True)  # 0.5774
    assert torch.allclose(normed[0], torch.tensor([0.5, -0.5, -0.5, 0.5]) / (std + 1e-6))
    assert torch.equal(normed[1], torch.zeros(4))  # a group that agrees carries no signal
    assert torch.allclose(normed.sum(dim=1), torch.zeros(2), atol=1e-6)


@pytest.mark.parametrize("adv", [1.0, -1.0])
@pytest.mark.parametrize("ratio", [0.5, 0.9, 1.0, 1.1, 1.5])
def test_clipped_objective_value_and_gradient(adv, ratio):
    lo, hi = 0.2, 0.28
    logp_old = torch.tensor([-1.0])
    logp = (logp_old + math.log(ratio)).clone().requires_grad_(True)
    loss, clipped = clipped_objective(logp, logp_old, torch.tensor([adv]), lo, hi)
    expected = -min(ratio * adv, min(max(ratio, 1 - lo), 1 + hi) * adv)
    assert loss.item() == pytest.approx(expected, rel=1e-5)
    loss.sum().backward()
    # Outside the trust region on the side the advantage pushes towards, the gradient is zero;
    # otherwise minimising the loss raises logp for positive and lowers it for negative advantages.
    outside = (adv > 0 and ratio > 1 + hi) or (adv < 0 and ratio < 1 - lo)
    if outside:
        assert logp.grad.item() == 0.0 and clipped.item()
    else:
        assert not clipped.item()
        assert math.copysign(1, -logp.grad.item()) == math.copysign(1, adv)
        assert logp.grad.item() == pytest.approx(-adv * ratio, rel=1e-5)


def test_clip_higher_bounds_are_separate():
    logp_old = torch.zeros(2)
    logp = torch.log(torch.tensor([1.25, 1.25]))
    # ratio 1.25 lies inside 1 + 0.28 but outside 1 + 0.2.
    _, c_sym = clipped_objective(logp, logp_old, torch.ones(2), 0.2, 0.2)
    _, c_high = clipped_objective(logp, logp_old, torch.ones(2), 0.2, 0.28)
    assert c_sym.all() and not c_high.any()


def test_kl_estimators_match_formulas():
    logp = torch.tensor([-1.0, -2.0, -0.5])
    logp_ref = torch.tensor([-1.5, -1.0, -0.5])
    r = logp_ref - logp  # log(pi_ref / pi)
    assert torch.allclose(kl_estimate(logp, logp_ref, "k1"), -r)
    assert torch.allclose(kl_estimate(logp, logp_ref, "k2"), 0.5 * r**2)
    assert torch.allclose(kl_estimate(logp, logp_ref, "k3"), torch.exp(r) - 1 - r)
    assert (kl_estimate(logp, logp_ref, "k3") >= 0).all()
    assert kl_estimate(logp, logp_ref, "k3")[2] == 0  # same policy, zero KL


def test_kl_estimators_are_unbiased_or_low_variance_on_samples():
    torch.manual_seed(0)
    p = torch.tensor([0.5, 0.3, 0.2])
    q = torch.tensor([0.4, 0.4, 0.2])
    true_kl = float((p * (p / q).log()).sum())
    x = torch.multinomial(p, 200_000, replacement=True)
    logp, logq = p.log()[x], q.log()[x]
    assert kl_estimate(logp, logq, "k1").mean().item() == pytest.approx(true_kl, abs=2e-3)
    assert kl_estimate(logp, logq, "k3").mean().item() == pytest.approx(true_kl, abs=2e-3)
    assert kl_estimate(logp, logq, "k3").var() < kl_estimate(logp, logq, "k1").var()


def test_loss_aggregation_modes():
    per_tok = torch.tensor([[1.0, 2.0, 3.0, 0.0], [4.0, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]])
    assert aggregate(per_tok, mask, "token-mean").item() == pytest.approx((1 + 2 + 3 + 4) / 4)
    assert aggregate(per_tok, mask, "seq-mean-token-sum").item() == pytest.approx((6 + 4) / 2)
    assert aggregate(per_tok, mask, "seq-mean-token-mean").item() == pytest.approx((2 + 4) / 2)
    # Micro-batches with the mini-batch normaliser add up to the whole.
    whole = aggregate(per_tok, mask, "token-mean")
    parts = aggregate(per_tok[:1], mask[:1], "token-mean", 4.0) + aggregate(per_tok[1:], mask[1:], "token-mean", 4.0)
    assert torch.allclose(whole, parts)
    with pytest.raises(ValueError):
        aggregate(per_tok, mask, "sum")


# ---------------------------------------------------------------- one prompt pass per group

@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_shared_prompt_passes_give_the_per_sequence_logprobs_and_gradients(kind, tmp_path):
    """`shared_prefix_logprobs` runs each distinct prompt once and the responses on its copied KV
    cache: log-probs, entropies and the gradients of both match one full pass per sequence within
    float rounding, on shuffled groups of uneven size with uneven prompt and response lengths."""
    import random

    from tests.bench_ref import tokenizer
    from tests.test_fastgen import _model, _prompts
    from trainer.rl.logprobs import shared_prefix_logprobs, token_logprobs
    from trainer.rl.trajectory import pack, Sample

    tok = tokenizer(tmp_path / "tok")
    model = _model(kind, tok).train()
    rng = random.Random(0)
    samples = []
    for g, prompt in enumerate(_prompts(tok, 6)):
        for _ in range(rng.randint(1, 5)):
            r = rng.randint(1, 12)
            samples.append(Sample(g, prompt, [rng.randrange(7, 80) for _ in range(r)], [0.0] * r, "", "length"))
    rng.shuffle(samples)
    b = pack(samples, [0.0] * len(samples), tok.pad_token_id)
    full, full_ent = token_logprobs(model, b.ids, b.attn, with_entropy=True, temperature=0.7)
    shared, shared_ent = shared_prefix_logprobs(model, b.ids, b.attn, b.prompt_len, with_entropy=True,
                                                temperature=0.7)
    # two float32 summation orders (the compiled products against MKL's), log-probs up to ~17 in size
    assert (((full - shared).abs() - 1e-5 * full.abs()) * b.mask).max() < 2e-5
    assert (((full_ent - shared_ent).abs() - 1e-5 * full_ent.abs()) * b.mask).max() < 2e-5
    assert (shared * (1 - b.mask)).abs().max() == 0  # nothing outside the responses
    params = list(model.parameters())
    g_full = torch.autograd.grad(((full + 0.1 * full_ent) * b.mask).sum(), params)
    g_shared = torch.autograd.grad(((shared + 0.1 * shared_ent) * b.mask).sum(), params)
    for a, c in zip(g_full, g_shared):
        # each float32 path lands up to ~1e-5 of the largest entry from the float64 gradient (measured:
        # HF's 6.7e-6, the compiled products' 9.5e-6 on qwen2's k_proj), so they differ by up to twice that
        assert torch.allclose(a, c, rtol=1e-4, atol=3e-5 * a.abs().max())


@pytest.mark.parametrize("devices", [("cpu",), ()], ids=["logsumexp", "fused"])
@pytest.mark.parametrize("T", [0.7, 1.0])
@pytest.mark.parametrize("with_entropy", [True, False])
def test_head_logprobs_match_the_log_softmax_block_by_block(with_entropy, T, devices, monkeypatch):
    """`head_logprobs` (the head's log-probs a block of rows at a time, the logits made again in the
    backward pass) gives log_softmax's values, entropies and gradients in the hidden states and the
    head's weight: blocks of 8 rows over 37 rows (a remainder of 5), at temperature 1 (no division)
    and another, no rows at all; both ways of a block: the CPU's logsumexp and, with the device rule
    emptied (CUDA is not here), the fused passes an accelerator takes."""
    from trainer.rl import logprobs

    torch.manual_seed(0)
    N, H, V = 37, 16, 50
    x = torch.randn(N, H, dtype=torch.float64).float().requires_grad_(True)
    w = torch.randn(V, H).requires_grad_(True)
    t = torch.randint(0, V, (N,))
    ga, gb = torch.randn(N), torch.randn(N)
    monkeypatch.setattr(logprobs, "HEAD_BLOCK_ELEMENTS", 8 * V)
    monkeypatch.setattr(logprobs, "LOGSUMEXP_DEVICES", devices)
    lp, ent = logprobs.head_logprobs(x, w, t, T, with_entropy=with_entropy)
    assert (ent is not None) == with_entropy
    got = torch.autograd.grad((lp * ga + (ent * gb if with_entropy else 0)).sum(), [x, w])
    ls = torch.log_softmax(x.double() @ w.double().t() / T, -1)
    want_lp, want_ent = ls.gather(-1, t[:, None]).squeeze(-1), -(ls.exp() * ls).sum(-1)
    want = torch.autograd.grad((want_lp * ga + (want_ent * gb if with_entropy else 0)).sum(), [x, w])
    assert torch.allclose(lp.double(), want_lp, atol=1e-5)
    if with_entropy:
        assert torch.allclose(ent.double(), want_ent, atol=1e-5)
    for g, g_want in zip(got, want):
        assert torch.allclose(g, g_want, atol=1e-5 * g_want.abs().max().item())
    empty = logprobs.head_logprobs(x[:0], w, t[:0], T, with_entropy=True)
    assert empty[0].shape == empty[1].shape == (0,)


@pytest.mark.parametrize("T", [0.6, 1.0])
def test_head_logprobs_in_bf16_agree_between_the_two_ways_of_a_block(T, monkeypatch):
    """In bf16 (the GPU's precision; torch's bf16 products run on the CPU too) the fused block and
    the logsumexp block start from the same bf16 logits: the log-probs agree to float32 rounding,
    and the gradients, each rounded to bf16 once, to a bf16 step. SmolLM2's vocabulary, blocks of
    300 rows over 700, logits of SmolLM2's size (a spread of about 30)."""
    from trainer.rl import logprobs

    torch.manual_seed(1)
    N, H, V = 700, 64, 49152
    x = torch.randn(N, H).bfloat16()
    w = (torch.randn(V, H) * 0.6).bfloat16()
    t = torch.randint(0, V, (N,))
    g = torch.randn(N)
    monkeypatch.setattr(logprobs, "HEAD_BLOCK_ELEMENTS", 300 * V)
    out = {}
    for way, devices in (("logsumexp", ("cpu",)), ("fused", ())):
        monkeypatch.setattr(logprobs, "LOGSUMEXP_DEVICES", devices)
        xs, ws = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
        lp, _ = logprobs.head_logprobs(xs, ws, t, T)
        out[way] = (lp, *torch.autograd.grad((lp * g).sum(), [xs, ws]))
    (lp_a, dx_a, dw_a), (lp_b, dx_b, dw_b) = out["logsumexp"], out["fused"]
    assert lp_a.dtype == lp_b.dtype == torch.float32 and dx_b.dtype == dw_b.dtype == torch.bfloat16
    assert (lp_a - lp_b).abs().max() < 1e-6 * lp_a.abs().max()
    for a, b in ((dx_a, dx_b), (dw_a, dw_b)):
        assert (a.float() - b.float()).abs().max() <= 2 ** -7 * a.float().abs().max()


def test_one_writer_each_turns_the_deterministic_mode_off_inside_and_puts_it_back(monkeypatch):
    """`one_writer_each` (the head's one-hot add and the decoder's cache write, whose deterministic
    CUDA forms synchronise with the host) runs its body with torch's deterministic mode off and
    leaves the mode as it found it: strict, warn-only, or off, after an exception too. The fused
    head's backward, run under the mode, ends with the mode on and the same gradients."""
    from trainer.engine import one_writer_each
    from trainer.rl import logprobs

    was = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    try:
        for strict, warn_only in ((True, False), (True, True), (False, False)):
            torch.use_deterministic_algorithms(strict, warn_only=warn_only)
            with one_writer_each():
                assert not torch.are_deterministic_algorithms_enabled()
            assert (torch.are_deterministic_algorithms_enabled(),
                    torch.is_deterministic_algorithms_warn_only_enabled()) == (strict, warn_only)
            with pytest.raises(KeyError), one_writer_each():
                raise KeyError("inside")
            assert (torch.are_deterministic_algorithms_enabled(),
                    torch.is_deterministic_algorithms_warn_only_enabled()) == (strict, warn_only)
        torch.manual_seed(0)
        x, w, t = torch.randn(37, 16, requires_grad=True), torch.randn(50, 16, requires_grad=True), torch.randint(0, 50, (37,))
        monkeypatch.setattr(logprobs, "LOGSUMEXP_DEVICES", ())
        grads = []
        for strict in (False, True):
            torch.use_deterministic_algorithms(strict)
            lp, _ = logprobs.head_logprobs(x, w, t, 0.7)
            grads.append(torch.autograd.grad(lp.sum(), [x, w]))
            assert torch.are_deterministic_algorithms_enabled() == strict
        assert all(torch.equal(a, b) for a, b in zip(*grads))
    finally:
        torch.use_deterministic_algorithms(was[0], warn_only=was[1])


@pytest.mark.slow
def test_head_logprobs_hold_no_rows_by_vocabulary_tensor(tmp_path):
    """The memory of `head_logprobs` does not grow with rows x vocabulary: 4,096 rows over a
    65,536-token vocabulary (1 GiB of float32 logits; log_softmax's pass holds three such tensors
    at its peak) take forward and backward within a quarter of that above what the inputs hold."""
    import subprocess
    import sys

    code = """
import resource, torch
from trainer.rl.logprobs import head_logprobs
torch.manual_seed(0)
x = torch.randn(4096, 64, requires_grad=True); w = torch.randn(65536, 64, requires_grad=True)
t = torch.randint(0, 65536, (4096,))
x.grad = torch.zeros_like(x); w.grad = torch.zeros_like(w)  # the gradients' own memory, before the baseline
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
lp, ent = head_logprobs(x, w, t, 0.8, with_entropy=True)
(lp.sum() + ent.sum()).backward()
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    grew = int(out.stdout.split()[-1])
    assert grew < 4096 * 65536 * 4 / 4, f"grew {grew / 2**20:.0f} MiB"


def test_off_the_cpu_the_update_runs_each_layer_once_a_micro_batch(tmp_path, monkeypatch):
    """`response_logprobs` takes the shared-prompt layout on a CPU (each layer runs twice: the prompts'
    pass, the responses' pass) and one pass per sequence elsewhere (each layer once: a GPU's update
    waits on the operators it issues, docs/gpu.md). CUDA is not here: the device rules are emptied
    instead (SHARED_PREFIX_DEVICES, and LOGSUMEXP_DEVICES for the head's blocks), on a model the
    fused CPU passes do not take (Qwen3's q/k norms), and both give the same log-probs and entropies."""
    import random

    from tests.bench_ref import tokenizer
    from tests.test_fastgen import _model, _prompts
    from trainer.rl import logprobs
    from trainer.rl.trajectory import pack, Sample

    tok = tokenizer(tmp_path / "tok")
    model = _model("qwen3", tok).train()
    assert logprobs.fasttrain.unsupported(model) is not None
    rng = random.Random(2)
    samples = [Sample(g, p, r, [0.0] * len(r), "", "length")
               for g, p in enumerate(_prompts(tok, 3)) for r in
               ([rng.randrange(7, 80) for _ in range(rng.randint(1, 9))] for _ in range(4))]
    b = pack(samples, [0.0] * len(samples), tok.pad_token_id)
    calls = []
    model.model.layers[0].register_forward_hook(lambda *_: calls.append(1))
    results = {}
    for devices in (("cpu",), ()):
        monkeypatch.setattr(logprobs, "SHARED_PREFIX_DEVICES", devices)
        monkeypatch.setattr(logprobs, "LOGSUMEXP_DEVICES", devices)
        calls.clear()
        results[devices] = logprobs.response_logprobs(model, b, 0.8, with_entropy=True)
        assert len(calls) == (2 if devices else 1), devices
    (lp_a, ent_a), (lp_b, ent_b) = results.values()
    assert torch.allclose(lp_a * b.mask, lp_b * b.mask, atol=2e-5)
    assert torch.allclose(ent_a * b.mask, ent_b * b.mask, atol=2e-5)


def test_shared_prompt_passes_give_the_same_logprobs_with_the_head_in_blocks_or_whole(tmp_path, monkeypatch):
    """A model whose logits are not just its head's product (PLAIN_HEAD_MODELS emptied here) takes
    the whole-logits path: it gives the blocked path's log-probs, entropies and gradients."""
    import random

    from tests.bench_ref import tokenizer
    from tests.test_fastgen import _model, _prompts
    from trainer.rl import logprobs
    from trainer.rl.trajectory import pack, Sample

    tok = tokenizer(tmp_path / "tok")
    model = _model("llama", tok).train()
    rng = random.Random(1)
    responses = [(g, p, [rng.randrange(7, 80) for _ in range(rng.randint(1, 9))])
                 for g, p in enumerate(_prompts(tok, 4)) for _ in range(3)]
    samples = [Sample(g, p, r, [0.0] * len(r), "", "length") for g, p, r in responses]
    b = pack(samples, [0.0] * len(samples), tok.pad_token_id)
    params = list(model.parameters())
    results = []
    for plain in (logprobs.PLAIN_HEAD_MODELS, ()):
        monkeypatch.setattr(logprobs, "PLAIN_HEAD_MODELS", plain)
        assert (logprobs.output_head(model) is None) == (plain == ())
        lp, ent = logprobs.shared_prefix_logprobs(model, b.ids, b.attn, b.prompt_len, with_entropy=True,
                                                  temperature=0.9)
        results.append((lp, ent, torch.autograd.grad(((lp + 0.1 * ent) * b.mask).sum(), params)))
    (lp_a, ent_a, g_a), (lp_b, ent_b, g_b) = results
    assert torch.allclose(lp_a, lp_b, atol=2e-5) and torch.allclose(ent_a, ent_b, atol=2e-5)
    for a, c in zip(g_a, g_b):
        assert torch.allclose(a, c, rtol=1e-4, atol=3e-5 * a.abs().max())


@pytest.mark.parametrize("kind", ["llama", "qwen3"], ids=["fused-passes", "model-own-layers"])
def test_gradient_checkpointing_gives_the_same_logprobs_and_gradients_and_keeps_less(kind, tmp_path):
    """grpo.gradient_checkpointing: the layers run again in the backward pass instead of keeping their
    activations. Log-probs and gradients are the unchecked pass's (Llama through trainer.fasttrain's
    fused passes, bitwise; Qwen3 through its own layers, one pass per sequence, within rounding);
    what the pass keeps for the backward (counted by autograd's saved-tensor hooks) falls to under
    half on a 4-layer model."""
    import random

    from tests.bench_ref import tokenizer
    from tests.test_fastgen import _model, _prompts
    from trainer import fasttrain
    from trainer.rl.logprobs import response_logprobs
    from trainer.rl.trajectory import pack, Sample

    tok = tokenizer(tmp_path / "tok")
    model = _model(kind, tok).train()
    assert (fasttrain.unsupported(model) is None) == (kind == "llama")
    rng = random.Random(2)
    responses = [(g, p, [rng.randrange(7, 80) for _ in range(rng.randint(1, 12))])
                 for g, p in enumerate(_prompts(tok, 4)) for _ in range(rng.randint(1, 4))]
    b = pack([Sample(g, p, r, [0.0] * len(r), "", "length") for g, p, r in responses],
             [0.0] * len(responses), tok.pad_token_id)
    params = list(model.parameters())
    out = {}
    for checkpoint in (False, True):
        kept = []

        def keep(t):
            kept.append(t.numel() * t.element_size())
            return t

        with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
            lp, ent = response_logprobs(model, b, 0.8, with_entropy=True, checkpoint=checkpoint)
        grads = torch.autograd.grad(((lp + 0.1 * ent) * b.mask).sum(), params)
        out[checkpoint] = (lp, ent, grads, sum(kept))
    (lp, ent, grads, kept), (lp_c, ent_c, grads_c, kept_c) = out[False], out[True]
    assert kept_c < kept / 2, (kept_c, kept)
    if kind == "llama":
        assert torch.equal(lp, lp_c) and torch.equal(ent, ent_c)
        assert all(torch.equal(a, c) for a, c in zip(grads, grads_c))
    else:
        assert ((lp - lp_c).abs() * b.mask).max() < 2e-5 and ((ent - ent_c).abs() * b.mask).max() < 2e-5
        for a, c in zip(grads, grads_c):
            assert torch.allclose(a, c, rtol=1e-4, atol=3e-5 * a.abs().max())
    assert not any(getattr(m, "gradient_checkpointing", False) for m in model.modules())  # switched off again
