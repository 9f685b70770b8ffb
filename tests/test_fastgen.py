"""The fast decoder (`trainer.inference.cpu`) against HF `generate` and the trainer's forward.

Greedy tokens must be identical to `generate`'s on the same weights and prompts (left padding,
uneven lengths, early EOS), for each architecture it covers: Llama with grouped-query attention,
Qwen2 (q/k/v biases, tied embeddings), Qwen3 (q/k norms, its own head_dim). Sampling's log-probabilities must be the
trainer's (the TIS ratio depends on it), and an optimizer step must reach the next generation.
Both decoding paths are held to this: the compiled kernel (`trainer/kernels.py`, built here with the
machine's compiler) and the torch-op path that runs where it cannot be built.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

from tests.bench_ref import problems, tokenizer
from trainer.chat import encode_prompt
from trainer.inference.cpu import FastDecoder, sample, unsupported
from trainer.inference.generate import generate
from trainer.rl.logprobs import token_logprobs
from trainer.rl.trajectory import pack, Sample
from trainer import kernels

COMMON = dict(hidden_size=64, intermediate_size=160, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128)


def _model(kind: str, tok) -> torch.nn.Module:
    ids = dict(vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
               pad_token_id=tok.pad_token_id)
    torch.manual_seed(3)
    if kind == "llama":
        m = LlamaForCausalLM(LlamaConfig(**COMMON, **ids, tie_word_embeddings=False))
    elif kind == "qwen2":
        m = Qwen2ForCausalLM(Qwen2Config(**COMMON, **ids, tie_word_embeddings=True,
                                                     initializer_range=0.3))  # as Qwen2.5-0.5B
    else:
        m = Qwen3ForCausalLM(Qwen3Config(**COMMON, **ids, head_dim=16, tie_word_embeddings=False))
    head = m.get_output_embeddings().weight
    with torch.no_grad():
        if not m.config.tie_word_embeddings:  # (a tied head is the embedding: it stays as it is)
            head.mul_(8.0)  # sharper than random init
        # EOS takes the place of the token greedy decoding picks most: some rows stop early, not all
        probe = sum(_hf_greedy(m.eval(), tok, _prompts(tok, 8), 12), [])
        common, original = max(set(probe), key=probe.count), head[tok.eos_token_id].clone()
        for scale in (1.01, 0.99, 0.97, 0.94, 0.9, 0.85, 0.8):
            head[tok.eos_token_id] = head[common] * scale
            if len({len(g) for g in _hf_greedy(m, tok, _prompts(tok, 24), 30)}) >= 3:
                break
        else:
            head[tok.eos_token_id] = original
    return m.eval()


@pytest.fixture(scope="module")
def char_tok(tmp_path_factory):
    return tokenizer(tmp_path_factory.mktemp("chartok"))


def _prompts(tok, n: int) -> list[list[int]]:
    """Uneven lengths: some questions carry a system turn, some are cut short."""
    out = []
    for i, p in enumerate(problems(n)):
        msgs = [{"role": "user", "content": p["question"][: 16 - (i % 6)]}]
        if i % 3 == 0:
            msgs.insert(0, {"role": "system", "content": "Be brief."})
        out.append(encode_prompt(tok, msgs))
    return out


def _hf_greedy(model, tok, prompts, max_new):
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), tok.pad_token_id)
    attn = torch.zeros_like(ids)
    for r, p in enumerate(prompts):
        ids[r, width - len(p):] = torch.tensor(p)
        attn[r, width - len(p):] = 1
    ids, attn = ids.to(model.device), attn.to(model.device)  # the fixed decoder's CUDA tests compare on the GPU
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=attn, do_sample=False, max_new_tokens=max_new,
                             pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    rows = []
    for r in range(len(prompts)):
        toks = out[r, width:].tolist()
        rows.append(toks[: toks.index(tok.eos_token_id) + 1] if tok.eos_token_id in toks else toks)
    return rows


def _against_trainer(model, tok, gens, temperature: float = 1.0) -> tuple[float, float]:
    """How many sampled tokens `gens` hold, and the largest gap between their engine log-probs and
    the trainer's forward over the same packed sequences (right padding)."""
    samples = [Sample(0, g.prompt_ids, g.token_ids, g.logprobs, g.text, g.finish_reason) for g in gens]
    packed = pack(samples, [0.0] * len(samples), tok.pad_token_id)
    with torch.no_grad():
        lp, _ = token_logprobs(model, packed.ids, packed.attn, temperature=temperature)
    return packed.mask.sum().item(), ((lp - packed.engine_logp).abs() * packed.mask).max().item()


@pytest.fixture(params=["compiled", "torch-ops"])
def decoder_path(request, monkeypatch):
    """Each test below runs once through the compiled decoding step and once through torch ops."""
    monkeypatch.setattr(kernels, "_state", {})
    monkeypatch.setenv("POSTTRAIN_KERNELS", "1" if request.param == "compiled" else "0")
    if request.param == "compiled":
        assert kernels.decode_layer() is not None, "the decoding kernel did not build: `python -m trainer.kernels -v`"
    return request.param


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_greedy_tokens_identical_to_hf_generate(char_tok, kind, decoder_path):
    model = _model(kind, char_tok)
    assert unsupported(model) is None
    prompts = _prompts(char_tok, 48)
    want = _hf_greedy(model, char_tok, prompts, 40)
    got = generate(model, char_tok, prompts, 40, temperature=0.0, batch_size=20, logprobs=False)
    assert [g.token_ids for g in got] == want
    lengths = [len(w) for w in want]
    assert len(set(lengths)) >= 3  # rows stop at different steps: the batch shrinks mid-decode
    assert all(g.finish_reason == ("stop" if g.token_ids[-1] == char_tok.eos_token_id else "length") for g in got)


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("temperature, top_p", [(1.0, 1.0), (0.7, 0.8)])
def test_sampled_logprobs_are_the_trainers(char_tok, kind, temperature, top_p, decoder_path):
    """Per-token log-probs of sampled tokens against the trainer's full forward (right padding):
    within 1e-4; groups of identical prompts share their prefill."""
    model = _model(kind, char_tok)
    prompts = [p for p in _prompts(char_tok, 6) for _ in range(4)]
    gens = generate(model, char_tok, prompts, 24, temperature=temperature, top_p=top_p, seed=5)
    tokens, gap = _against_trainer(model, char_tok, gens, temperature)
    assert tokens > 150  # enough sampled tokens to compare
    assert gap < 1e-4
    # the samples of one prompt differ (each row draws its own tokens)
    assert len({tuple(g.token_ids) for g in gens[:4]}) > 1


def _shot_prompts(tok, n: int) -> list[list[int]]:
    """Prompts that all open with the same two worked examples as earlier turns (a few-shot eval's
    layout), then questions of uneven length; two of them twice (a group's samples)."""
    shots = [{"role": "user", "content": "What is 12 + 30?"}, {"role": "assistant", "content": "#### 42"},
             {"role": "user", "content": "What is 50 + 7?"}, {"role": "assistant", "content": "#### 57"}]
    out = [encode_prompt(tok, shots + [{"role": "user", "content": p["question"][: 16 - (i % 6)]}])
           for i, p in enumerate(problems(n))]
    return out + out[:2]


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_a_prefix_every_prompt_shares_is_prefilled_once_and_decodes_as_alone(char_tok, kind, decoder_path,
                                                                            monkeypatch):
    """Few-shot prompts: the shared examples prefilled once and copied to every row decode the
    greedy tokens HF `generate` gives each prompt whole, and sample log-probs that are the
    trainer's."""
    from trainer.inference import cpu

    monkeypatch.setattr(cpu, "SHARED_PREFIX_MIN", 16)  # the tiny models' context holds 128 positions
    shared, real = [], cpu.shared_prefix
    monkeypatch.setattr(cpu, "shared_prefix", lambda seqs: shared.append(real(seqs)) or shared[-1])
    model = _model(kind, char_tok)
    prompts = _shot_prompts(char_tok, 18)
    want = _hf_greedy(model, char_tok, prompts, 30)
    got = generate(model, char_tok, prompts, 30, temperature=0.0, batch_size=20, logprobs=False)
    assert shared and shared[0] >= 40  # the examples and the question's turn header
    assert [g.token_ids for g in got] == want
    gens = generate(model, char_tok, prompts, 24, temperature=1.0, seed=5, min_new_tokens=8)
    tokens, gap = _against_trainer(model, char_tok, gens)
    assert tokens >= 20 * 9
    assert gap < 1e-4


def test_shared_prefix_leaves_each_prompt_a_token_of_its_own():
    from trainer.inference.cpu import shared_prefix

    assert shared_prefix([[1, 2, 3], [1, 2, 3]]) == 2
    assert shared_prefix([[1, 2, 3, 4], [1, 2, 5], [1, 2, 3]]) == 2
    assert shared_prefix([[7], [7, 8]]) == 0
    assert shared_prefix([[1, 2], [3, 2]]) == 0


def _free_and_held(kind: str, tok, eos_boost: float):
    """A model made to favour EOS, and its samples without and with min_new_tokens=5."""
    model = _model(kind, tok)
    with torch.no_grad():
        model.lm_head.weight[tok.eos_token_id] += eos_boost * model.lm_head.weight.std()
    prompts = _prompts(tok, 8)
    free = generate(model, tok, prompts, 12, temperature=1.0, seed=1)
    held = generate(model, tok, prompts, 12, temperature=1.0, seed=1, min_new_tokens=5)
    return model, free, held


def test_min_new_tokens_holds_back_eos(char_tok):
    _, free, held = _free_and_held("llama", char_tok, 50)  # EOS nearly certain at every step
    assert all(g.token_ids == [char_tok.eos_token_id] for g in free)
    assert all(len(g.token_ids) >= 6 and g.token_ids[-1] == char_tok.eos_token_id for g in held)
    assert all(char_tok.eos_token_id not in g.token_ids[:5] for g in held)


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_compiled_step_agrees_with_the_torch_op_step(char_tok, kind, monkeypatch):
    """The same seed through both paths: the same sampled tokens and log-probs within 1e-4 (the
    tolerance against the trainer above; the large-weight Qwen2 model differs by ~2e-5), with
    rows finishing early (the batch compacts) and groups sharing a prefill."""
    model = _model(kind, char_tok)
    prompts = [p for p in _prompts(char_tok, 10) for _ in range(3)]
    runs = {}
    for flag in ("1", "0"):
        monkeypatch.setattr(kernels, "_state", {})
        monkeypatch.setenv("POSTTRAIN_KERNELS", flag)
        runs[flag] = generate(model, char_tok, prompts, 30, temperature=1.0, seed=11)
    fast, slow = runs["1"], runs["0"]
    assert [g.token_ids for g in fast] == [g.token_ids for g in slow]
    assert len({len(g.token_ids) for g in fast}) >= 3
    diff = max(abs(a - b) for f, s in zip(fast, slow) for a, b in zip(f.logprobs, s.logprobs))
    assert diff < 1e-4, diff


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_compiled_step_equals_the_torch_op_step_at_every_cache_fill(char_tok, kind, monkeypatch):
    """One decoding step, kernel against torch ops, on the same random caches, for every number of
    filled columns of caches of several widths: the kernel sweeps keys in blocks of vector width, and
    each fill ends its last block at another place (a fill of exactly four vectors once went unscored)."""
    monkeypatch.setattr(kernels, "_state", {})
    monkeypatch.setenv("POSTTRAIN_KERNELS", "1")
    dec = FastDecoder(_model(kind, char_tok))
    dec._pack()
    kernel = dec._kernel()
    assert kernel is not None
    B, hd, worst = 3, dec.head_dim, 0.0
    for T in (17, 40, 64, 71):
        for col in range(T):
            torch.manual_seed(col)
            caches = [(torch.randn(B, dec.kv_heads, hd, T), torch.randn(B, dec.kv_heads, T, hd)) for _ in dec.layers]
            valid = torch.zeros(B, T, dtype=torch.bool)
            valid[:, : col + 1] = True
            valid[0, : min(3, col)] = False  # a left-padded row
            ids, pos = torch.tensor([5, 9, 11]), torch.tensor([col, col + 1, col + 2]).clamp(max=dec.max_positions - 1)
            dec.kernel = kernel
            fast = dec._step_compiled(ids, pos, [(k.clone(), v.clone()) for k, v in caches], col, valid)
            mask = torch.zeros(B, dec.heads, col + 1).masked_fill_(~valid[:, None, : col + 1], float("-inf"))
            slow = dec._forward(ids[:, None], pos[:, None], caches, col, mask.view(B * dec.kv_heads, dec.groups, col + 1))
            worst = max(worst, float((fast - slow).abs().max() / slow.abs().max()))
    assert worst < 1e-5, worst


def test_compiled_step_rejects_what_it_cannot_read(char_tok, monkeypatch):
    """The kernel reads raw float32 memory: anything else is refused by name, not misread."""
    monkeypatch.setattr(kernels, "_state", {})
    monkeypatch.setenv("POSTTRAIN_KERNELS", "1")
    op = kernels.decode_layer()
    assert op is not None
    B, H, hd, T = 2, 8, 4, 6
    f = lambda *s: torch.zeros(*s)  # noqa: E731
    positions = torch.tensor([1, 2])
    # weights as a Linear stores them, [out, in]: q 2 heads, k and v 1 KV head, MLP 8 wide
    args = [f(B, H), f(H), 1e-6, f(2 * hd, H), f(hd, H), f(hd, H), None, None, None, f(H, 2 * hd), None, f(H), 1e-6,
            f(8, H), f(8, H), f(H, 8), None, 0.0, None, 0.0, f(T, hd), f(T, hd), positions, f(B, 1, hd, T),
            f(B, 1, T, hd), 2, torch.ones(B, T, dtype=torch.bool), 0.5, 2, 1]
    op(*args)  # well-formed: runs
    refused = {
        0: (f(B, H).double(), "h must be a contiguous float32 CPU tensor"),
        3: (f(2 * hd, H).T, "wq must be a contiguous float32"),
        15: (f(8, H + 1), "shapes disagree"),
        6: (f(3), "shapes disagree"),
        23: (f(B, 1, T, hd).transpose(2, 3), "kc must be a contiguous float32"),
        25: (T, "shapes disagree"),
        22: (torch.tensor([1, T]), f"position {T} is past the rotary table"),
        26: (torch.ones(B, T, dtype=torch.int64), "valid must be contiguous bool"),
    }
    for i, (value, message) in refused.items():
        bad = list(args)
        bad[i] = value
        with pytest.raises(RuntimeError, match=message):
            op(*bad)
    x = torch.randn(3, H)
    w = torch.randn(H)
    torch.testing.assert_close(torch.ops.posttrain.rms_norm_fwd(x, w, 1e-6)[0], torch.nn.functional.rms_norm(x, (H,), w, 1e-6))
    with pytest.raises(RuntimeError, match="shapes disagree"):
        torch.ops.posttrain.rms_norm_fwd(x, torch.ones(H + 1), 1e-6)


def test_without_a_compiler_decoding_runs_on_torch_ops(char_tok, tmp_path, monkeypatch, caplog):
    """A machine that cannot build the kernel (here: a compiler that always fails, and an empty
    kernel cache) still decodes, through torch ops, and says why once."""
    monkeypatch.setattr(kernels, "_state", {})
    monkeypatch.setenv("POSTTRAIN_KERNELS", "1")
    monkeypatch.setenv("POSTTRAIN_KERNEL_CACHE", str(tmp_path / "kernels"))
    monkeypatch.setenv("CXX", "false")
    model = _model("llama", char_tok)
    prompts = _prompts(char_tok, 6)
    with caplog.at_level("WARNING", logger="trainer.kernels"):
        got = generate(model, char_tok, prompts, 12, logprobs=False)
        generate(model, char_tok, prompts, 12, logprobs=False)
    assert [g.token_ids for g in got] == _hf_greedy(model, char_tok, prompts, 12)
    warnings = [r.getMessage() for r in caplog.records if "could not build the compiled kernel" in r.getMessage()]
    assert len(warnings) == 1, warnings


@pytest.mark.slow
def test_a_kernel_build_killed_midway_does_not_block_the_next(tmp_path):
    """A build SIGKILLed while compiling (its compilers with it, as when a machine is stopped) leaves
    torch's builder lock behind (it would make every later build wait forever); the next build, in a
    fresh process, goes ahead and completes. The compilers' temporary files stay inside the build
    folder, and the next build clears them: none left in the user's TMPDIR."""
    (tmp_path / "t").mkdir()
    env = {**os.environ, "POSTTRAIN_KERNEL_CACHE": str(tmp_path / "k"), "POSTTRAIN_KERNELS": "1",
           "TMPDIR": str(tmp_path / "t")}
    cmd = [sys.executable, "-m", "trainer.kernels"]
    root = Path(__file__).resolve().parent.parent
    first = subprocess.Popen(cmd, env=env, cwd=root, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             start_new_session=True)
    deadline = time.monotonic() + 120
    while not list((tmp_path / "k").glob("*/lock")):  # torch's builder holds its lock: compiling
        assert first.poll() is None, "the first build ended before it could be killed"
        assert time.monotonic() < deadline, "the first build never started compiling"
        time.sleep(0.05)
    time.sleep(1.0)
    # the compilers too: ninja starts each in a process group of its own, so killing the build's
    # group alone leaves them compiling on (beside the second build) until they finish
    import psutil

    compilers = psutil.Process(first.pid).children(recursive=True)
    os.killpg(first.pid, signal.SIGKILL)
    for p in compilers:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    first.wait()
    assert list((tmp_path / "k").glob("*/lock")) and not list((tmp_path / "k").glob("*/.complete"))
    assert not list((tmp_path / "t").iterdir()), "the killed compilers left files in TMPDIR"
    second = subprocess.run(cmd, env=env, cwd=root, capture_output=True, text=True, timeout=300)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "kernels:" in second.stdout and list((tmp_path / "k").glob("*/.complete"))
    assert not list((tmp_path / "k").glob("*/tmp")) and not list((tmp_path / "t").iterdir())


def test_sampling_draws_each_token_at_its_softmax_probability():
    """The decoder's sampler against the distribution it claims: 400,000 draws over scores with a
    -inf entry (a masked EOS, a top-p cut) and one dominant and several rare tokens."""
    torch.manual_seed(0)
    scores = torch.tensor([2.0, 0.5, float("-inf"), -1.0, -4.0, 1.0, float("-inf")])
    probs = scores.softmax(-1).double()
    counts = torch.zeros(len(scores), dtype=torch.float64)
    for _ in range(20):
        counts += torch.bincount(sample(scores.expand(20_000, -1)), minlength=len(scores)).double()
    n = counts.sum()
    assert counts[2] == 0 and counts[6] == 0, "a token of probability 0 was drawn"
    sigma = (n * probs * (1 - probs)).sqrt()
    assert ((counts - n * probs).abs() <= 5 * sigma + 1e-9).all(), (counts / n, probs)
    # a row whose mass sits on its last finite token, and a one-token row: nothing past the end
    edge = torch.tensor([[float("-inf"), float("-inf"), 0.0], [0.0, float("-inf"), float("-inf")]])
    assert sample(edge.repeat(1000, 1)).view(1000, 2).tolist() == [[2, 0]] * 1000


@pytest.mark.parametrize("temperature, block_eos", [(1.0, False), (0.7, True)])
def test_the_compiled_sampler_draws_what_the_torch_op_sampler_draws(monkeypatch, temperature, block_eos):
    """The compiled path's one-op sampling step against `sample` on the same uniform draws: the same
    tokens, EOS never drawn while held back, and log-probs of the unmasked tempered softmax."""
    monkeypatch.setattr(kernels, "_state", {})
    monkeypatch.setenv("POSTTRAIN_KERNELS", "1")
    assert kernels.ops() is not None
    torch.manual_seed(4)
    logits = torch.randn(4000, 84) * 3
    eos = int(logits[:, 5].argmax()) % 84  # any id; row maxima make it likely
    logits[:, eos] += 4.0  # EOS often the likeliest token: holding it back must show
    torch.manual_seed(9)
    u = torch.rand((logits.shape[0],), dtype=torch.float64)
    got, got_lp = torch.ops.posttrain.sample_rows(logits, temperature, eos, block_eos, u)
    scores = logits / temperature
    want_lp_all = torch.log_softmax(scores, -1)
    if block_eos:
        scores[:, eos] = float("-inf")
    torch.manual_seed(9)
    want = sample(scores)
    assert torch.equal(got, want)
    assert (int((got == eos).sum()) == 0) if block_eos else (int((got == eos).sum()) > 100)
    torch.testing.assert_close(got_lp, want_lp_all.gather(1, want[:, None]).squeeze(1), rtol=0, atol=1e-5)
    with pytest.raises(RuntimeError, match="temperature must be > 0"):
        torch.ops.posttrain.sample_rows(logits, 0.0, eos, False, u)
    with pytest.raises(RuntimeError, match="u must be contiguous float64"):
        torch.ops.posttrain.sample_rows(logits, 1.0, eos, False, u.float())
    with pytest.raises(RuntimeError, match="eos 84 is outside the vocabulary"):
        torch.ops.posttrain.sample_rows(logits, 1.0, 84, False, u)


def test_an_optimizer_step_reaches_the_next_generation(char_tok):
    """The packed weights follow in-place updates (the trainer's AdamW) and whole-tensor swaps (a resume)."""
    model = _model("llama", char_tok)
    prompts = _prompts(char_tok, 12)
    generate(model, char_tok, prompts, 16)
    opt = torch.optim.AdamW(model.parameters(), lr=5e-2)
    ids = torch.tensor([prompts[0]])
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    got = generate(model, char_tok, prompts, 16, logprobs=False)
    assert [g.token_ids for g in got] == _hf_greedy(model, char_tok, prompts, 16)
    model.load_state_dict({k: v * 1.5 for k, v in model.state_dict().items()})
    got = generate(model, char_tok, prompts, 16, logprobs=False)
    assert [g.token_ids for g in got] == _hf_greedy(model, char_tok, prompts, 16)


def test_other_models_fall_back_to_hf_generate(char_tok):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=len(char_tok), n_embd=32, n_layer=1, n_head=2, n_positions=64,
                                       eos_token_id=char_tok.eos_token_id, pad_token_id=char_tok.pad_token_id)).eval()
    assert "gpt2" in unsupported(model)
    with pytest.raises(ValueError, match="gpt2"):
        FastDecoder(model)
    prompts = _prompts(char_tok, 4)
    got = generate(model, char_tok, prompts, 8, logprobs=False)
    assert [g.token_ids for g in got] == _hf_greedy(model, char_tok, prompts, 8)


# ---------------------------------------------------------------- the HF generate path (GPUs, other models)

@pytest.fixture
def hf_path(monkeypatch):
    """Generation through HF `generate`, as on a GPU (the fast decoder is CPU-only): the same models
    and prompts as above, only the decoder differs."""
    import trainer.inference.generate as G

    monkeypatch.setattr(G, "decoder_for", lambda model: None)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize("temperature, top_p", [(1.0, 1.0), (0.7, 0.8)])
def test_hf_path_sampled_logprobs_are_the_trainers(char_tok, hf_path, kind, temperature, top_p):
    """HF `generate`'s sampled tokens carry the trainer's log-probs (tempered, not renormalised
    over the top-p nucleus), recorded a step at a time rather than from every step's logits."""
    model = _model(kind, char_tok)
    prompts = [p for p in _prompts(char_tok, 6) for _ in range(4)]
    gens = generate(model, char_tok, prompts, 24, temperature=temperature, top_p=top_p, seed=5, batch_size=10)
    tokens, gap = _against_trainer(model, char_tok, gens, temperature)
    assert tokens > 150  # enough sampled tokens to compare
    assert all(len(g.logprobs) == len(g.token_ids) for g in gens)
    assert gap < 1e-4
    assert len({len(g.token_ids) for g in gens}) > 1  # rows stopped at different steps


def test_hf_path_min_new_tokens_holds_back_eos_and_keeps_the_unmasked_logprobs(char_tok, hf_path):
    model, free, held = _free_and_held("qwen2", char_tok, 5)  # EOS likely early
    assert sum(len(g.token_ids) <= 5 for g in free) >= 4
    assert all(len(g.token_ids) >= 6 and char_tok.eos_token_id not in g.token_ids[:5] for g in held)
    assert _against_trainer(model, char_tok, held)[1] < 1e-4


# ---------------------------------------------------------------- prompts the model's context cannot hold

def _with_overlong(tok, context: int) -> tuple[list[list[int]], set[int]]:
    """Short prompts with, among them, three that fill the context or run past it (real data does
    this: GSM8K's problems under the tiny preset's 384-token BPE and 256 positions)."""
    prompts = _prompts(tok, 9)
    filler = tok.encode(" and then some more words", add_special_tokens=False)
    long = {1: context, 4: context + 7, 8: 2 * context}
    for i, n in long.items():
        prompts[i] = (prompts[i] + filler * n)[:n]
    return prompts, set(long)


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_prompts_the_context_cannot_hold_get_no_tokens_and_the_rest_decode_as_alone(char_tok, kind, monkeypatch):
    """It raised IndexError (the fast decoder's position table; GPT-2's through HF generate) and
    took the eval stage down with it, after SFT had trained."""
    if kind == "llama":
        model = _model("llama", char_tok)
    else:
        from transformers import GPT2Config, GPT2LMHeadModel

        torch.manual_seed(0)
        model = GPT2LMHeadModel(GPT2Config(vocab_size=len(char_tok), n_embd=32, n_layer=1, n_head=2, n_positions=64,
                                           eos_token_id=char_tok.eos_token_id,
                                           pad_token_id=char_tok.pad_token_id)).eval()
    context = model.config.max_position_embeddings
    prompts, long = _with_overlong(char_tok, context)
    got = generate(model, char_tok, prompts, 12, temperature=0.0, batch_size=4, logprobs=False)
    short = [i for i in range(len(prompts)) if i not in long]
    alone = generate(model, char_tok, [prompts[i] for i in short], 12, temperature=0.0, batch_size=4, logprobs=False)
    assert [got[i].token_ids for i in short] == [g.token_ids for g in alone]
    assert all(got[i].token_ids and got[i].prompt_ids == prompts[i] for i in short)
    for i in long:
        assert (got[i].token_ids, got[i].text, got[i].finish_reason) == ([], "", "length"), i


def test_eval_scores_what_the_context_cannot_hold_as_wrong_and_says_so(char_tok, caplog):
    from trainer.config import EvalConfig
    from trainer.evaluate import evaluate

    model = _model("llama", char_tok)
    examples = [{"id": p["id"], "answer": f"#### {p['answer']}", "messages": [
        {"role": "user", "content": p["question"] + (" Think." * 40 if i in (2, 5) else "")}]}  # 2, 5: past 128
        for i, p in enumerate(problems(9))]
    result = evaluate(model, char_tok, examples, EvalConfig(max_new_tokens=8, batch_size=4))
    assert result.n == 9 and result.over_context == 2
    assert result.metrics()["eval/prompts_over_context"] == 2.0
    assert [r["response_tokens"] for r in result.rows if r["id"] in ("add-2", "add-5")] == [0, 0]
    assert not any(r["correct"] for r in result.rows if r["id"] in ("add-2", "add-5"))
    [warning] = [r.getMessage() for r in caplog.records if r.name == "trainer.evaluate"]
    assert warning.startswith("eval: 2 of 9 prompts are 128 tokens or longer, the model's whole context") \
        and "Raise model.max_position" in warning, warning
    short = evaluate(model, char_tok, examples[:2], EvalConfig(max_new_tokens=8, batch_size=4))
    assert "eval/prompts_over_context" not in short.metrics()
