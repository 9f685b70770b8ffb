"""The fixed-shape decoder (`trainer.inference.cuda.StaticDecoder`): the in-process engine's path on CUDA,
where each decoding step is captured once as a CUDA graph and replayed.

On CPU its step runs eagerly: the same arithmetic at the same shapes (a power-of-two bucket of
rows with filler rows, the cache's filled columns rounded up under a mask, the cache column and
positions read from tensors, the prefill in buckets of prompts and widths), checked here against HF `generate` and the trainer's forward, in fp32, on the tiny
models and on SmolLM2-135M's real weights. What only CUDA has (capture, replay, noticing weights
that moved) is tested where CUDA exists and skipped with a message where it does not: this
machine's suite cannot check it."""

from __future__ import annotations

import pytest
import torch

from tests.bench_ref import problems
from tests.test_fastgen import _hf_greedy, _model, _prompts, char_tok  # noqa: F401 (a fixture)
from trainer.chat import encode_prompt
from trainer.inference.cpu import FastDecoder
from trainer.inference.cuda import PREFILL_STEP, WIDTH_STEP, StaticDecoder, _Fixed, bucket
from trainer.inference.generate import StopStrings, decoder_for, generate
from trainer.rl.logprobs import token_logprobs
from trainer.rl.trajectory import Sample, pack

# fp32, the decoder's log-probs against the trainer's forward over the same tokens: float rounding
# alone (other products, other orders of summation). On SmolLM2 against HF's own forward, a row at a
# time: this decoder max 1.08e-5, mean 1.7e-6; the CPU's compiled decoder max 1.65e-5, mean 1.9e-6;
# against the trainer's fused passes (its own products) this decoder max 2.2e-5, mean 5.4e-6 with the
# AVX-512 kernels, max 3.8e-5, mean 1.04e-5 with the AVX2 ones forced (POSTTRAIN_KERNELS_ISA=avx2 and
# ATEN_CPU_CAPABILITY=avx2 on the same Zen 5 machine: other vector widths, other orders of summation).
MAX_GAP, MEAN_GAP = 5e-5, 2e-5

cuda = pytest.mark.skipif(not torch.cuda.is_available(),
                          reason="CUDA graph capture and replay need a CUDA device, and this machine has none "
                                 "(the tests above run the same step eagerly on CPU)")


def _trainer_gap(model, tok, prompts, toks, lps, temperature: float) -> tuple[float, float, int]:
    """Largest and mean |decoder log-prob - trainer log-prob| over the generated tokens, and their count."""
    samples = [Sample(0, p, t, lp, "", "stop") for p, t, lp in zip(prompts, toks, lps)]
    packed = pack(samples, [0.0] * len(samples), tok.pad_token_id)
    with torch.no_grad():
        dev = next(model.parameters()).device
        lp, _ = token_logprobs(model, packed.ids.to(dev), packed.attn.to(dev), temperature=temperature)
    gap = (lp.to(packed.engine_logp.device) - packed.engine_logp).abs() * packed.mask
    n = int(packed.mask.sum())
    return gap.max().item(), gap.sum().item() / max(n, 1), n


def test_rows_decode_in_power_of_two_buckets():
    assert [bucket(n) for n in (1, 2, 3, 8, 9, 21, 32, 33, 384)] == [1, 2, 4, 8, 16, 32, 32, 64, 512]


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_greedy_tokens_are_hf_generates_and_logprobs_the_trainers(char_tok, kind):
    """21 prompts of uneven lengths (a bucket of 32: 11 filler rows), rows ending at different steps."""
    model = _model(kind, char_tok)
    prompts = _prompts(char_tok, 21)
    toks, lps = StaticDecoder(model, graphs=False).decode(prompts, 40, char_tok.eos_token_id, char_tok.pad_token_id)
    assert toks == _hf_greedy(model, char_tok, prompts, 40)
    assert len({len(t) for t in toks}) >= 3
    gap, mean, n = _trainer_gap(model, char_tok, prompts, toks, lps, 1.0)
    assert n > 50 and gap < MAX_GAP and mean < MEAN_GAP, (gap, mean)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_fused_products_decode_as_the_separate_ones_and_follow_in_place_updates(char_tok, kind):
    """q, k, v as one product and gate, up as another come from buffers the decoder refills at every
    call (graphs keep their storage): an optimizer's in-place step between two calls reaches the
    second, and the fused step gives the unfused one's tokens (log-probs within float rounding)."""
    model = _model(kind, char_tok)
    prompts, eos, pad = _prompts(char_tok, 6), char_tok.eos_token_id, char_tok.pad_token_id
    fused, plain = StaticDecoder(model, graphs=False), StaticDecoder(model, graphs=False)
    plain.fuse = False
    first = None
    for _ in range(2):
        (ft, fl), (pt, pl) = fused.decode(prompts, 24, eos, pad), plain.decode(prompts, 24, eos, pad)
        first = first or [t.data_ptr() for t in fused.fused[0] if t is not None]
        assert ft == pt == _hf_greedy(model, char_tok, prompts, 24)
        assert max(abs(a - b) for x, y in zip(fl, pl) for a, b in zip(x, y)) < 1e-5
        with torch.no_grad():  # in place, as AdamW steps: the storage stays, the values change
            for name, p in model.named_parameters():
                if name.endswith(("q_proj.weight", "k_proj.bias", "up_proj.weight")):
                    p.mul_(-1.5)
    assert [t.data_ptr() for t in fused.fused[0] if t is not None] == first  # refilled, not reallocated


@pytest.mark.parametrize("temperature, top_p", [(1.0, 1.0), (0.7, 0.8)])
def test_sampled_groups_share_a_prefill_and_their_logprobs_are_the_trainers(char_tok, temperature, top_p):
    model = _model("qwen2", char_tok)
    prompts = [p for p in _prompts(char_tok, 6) for _ in range(4)]  # 6 groups of 4: 24 rows, bucket 32
    torch.manual_seed(5)
    toks, lps = StaticDecoder(model, graphs=False).decode(prompts, 24, char_tok.eos_token_id, char_tok.pad_token_id,
                                                          temperature=temperature, top_p=top_p)
    gap, mean, n = _trainer_gap(model, char_tok, prompts, toks, lps, temperature)
    assert n > 150 and gap < MAX_GAP and mean < MEAN_GAP, (gap, mean)
    assert len({tuple(t) for t in toks[:4]}) > 1  # a group's samples differ: each row draws its own


def test_min_new_tokens_holds_back_eos(char_tok):
    model = _model("llama", char_tok)
    with torch.no_grad():
        model.lm_head.weight[char_tok.eos_token_id] += 50 * model.lm_head.weight.std()  # EOS nearly certain
    prompts, eos = _prompts(char_tok, 6), char_tok.eos_token_id
    dec = StaticDecoder(model, graphs=False)
    torch.manual_seed(1)
    free, _ = dec.decode(prompts, 12, eos, char_tok.pad_token_id, temperature=1.0)
    held, _ = dec.decode(prompts, 12, eos, char_tok.pad_token_id, temperature=1.0, min_new=5)
    assert all(t == [eos] for t in free)
    assert all(len(t) >= 6 and t[-1] == eos and eos not in t[:5] for t in held)


def test_three_turn_continuation_is_one_pass_over_the_same_tokens(char_tok):
    """Each turn continues the conversation token in token out (the last turn's tokens, then an
    environment's reply, become the next prompt); every turn's log-probs are those of one forward
    pass over the whole three-turn sequence at the policy's positions."""
    model = _model("llama", char_tok)
    dec = StaticDecoder(model, graphs=False)
    eos, pad = char_tok.eos_token_id, char_tok.pad_token_id
    reply = [t for t in _prompts(char_tok, 1)[0][-6:] if t != eos]  # an environment's tokens
    convo = _prompts(char_tok, 5)
    policy = [[] for _ in convo]  # (position, log-prob) of every policy token
    for turn in range(3):
        torch.manual_seed(turn)
        toks, lps = dec.decode(convo, 10, eos, pad, temperature=0.8)
        for r, (t, lp) in enumerate(zip(toks, lps)):
            policy[r] += [(len(convo[r]) + i, x) for i, x in enumerate(lp)]
            convo[r] = convo[r] + t + (reply if turn < 2 else [])
    with torch.no_grad():
        for r, seq in enumerate(convo):
            logits = model(input_ids=torch.tensor([seq])).logits[0].float() / 0.8
            whole = torch.log_softmax(logits, -1)
            got = torch.tensor([x for _, x in policy[r]])
            want = torch.stack([whole[pos - 1, seq[pos]] for pos, _ in policy[r]])
            assert len(policy[r]) >= 12 and (got - want).abs().max().item() < MAX_GAP


def test_stop_strings_end_rows_where_the_cpu_decoder_ends_them(char_tok):
    model = _model("qwen2", char_tok)  # (its rows run longest)
    prompts, eos, pad = _prompts(char_tok, 20), char_tok.eos_token_id, char_tok.pad_token_id
    dec = StaticDecoder(model, graphs=False)
    free, _ = dec.decode(prompts, 30, eos, pad)
    stops = tuple(dict.fromkeys(char_tok.decode(t[4:6]) for t in free if len(t) > 8))[:3]
    assert stops
    stopper = StopStrings(char_tok, stops)
    got, lps = dec.decode(prompts, 30, eos, pad, stop=stopper)
    want, _ = FastDecoder(model).decode(prompts, 30, eos, pad, stop=stopper)
    assert got == want
    assert sum(len(g) < len(f) for g, f in zip(got, free)) >= 3
    assert all(len(lp) == len(g) for lp, g in zip(lps, got))


@pytest.mark.slow
def test_smollm2_greedy_tokens_are_hf_generates_and_logprobs_the_trainers(smollm2):
    """The real SmolLM2-135M-Instruct weights and tokenizer, its chat template, 6 questions (a
    bucket of 8)."""
    _, model, tok = smollm2
    prompts = [encode_prompt(tok, [{"role": "user", "content": p["question"]}]) for p in problems(6)]
    toks, lps = StaticDecoder(model, graphs=False).decode(prompts, 48, tok.eos_token_id, tok.pad_token_id)
    assert toks == _hf_greedy(model, tok, prompts, 48)
    gap, mean, n = _trainer_gap(model, tok, prompts, toks, lps, 1.0)
    print(f"\nSmolLM2 fixed-shape decoder: {n} tokens, |log-prob - trainer's| max {gap:.2e} mean {mean:.2e}")
    assert n > 150 and gap < MAX_GAP and mean < MEAN_GAP, (gap, mean)


def test_one_hot_column_writes_decode_as_index_copy_does(char_tok):
    """The write CUDA graphs use under deterministic mode (torch.where over the cache) and index_copy_
    store the same values: the same tokens and the same log-probs, to the bit."""
    model = _model("qwen3", char_tok)
    prompts = [p for p in _prompts(char_tok, 5) for _ in range(3)]
    got = {}
    for masked in (False, True):
        dec = StaticDecoder(model, graphs=False)
        dec.masked_writes = masked
        torch.manual_seed(3)
        got[masked] = dec.decode(prompts, 30, char_tok.eos_token_id, char_tok.pad_token_id, temperature=0.9)
    assert got[True] == got[False]
    assert sum(len(t) for t in got[True][0]) > 150


def test_steps_attend_the_filled_columns_and_decode_as_the_whole_width_does(char_tok):
    """A step attends the cache's first columns, a multiple of WIDTH_STEP that holds every column
    written so far (one graph a width on CUDA), and adds each residual in its product's epilogue:
    the same greedy tokens as attending the whole cache with separate adds (and as HF generate),
    log-probs within float rounding, across two widths, and the prefill with them."""
    model = _model("qwen2", char_tok)  # biases on q, k, v: the products that keep their separate add
    prompts, eos, pad = _prompts(char_tok, 9), char_tok.eos_token_id, char_tok.pad_token_id
    width = max(len(p) for p in prompts)
    new = WIDTH_STEP + 8 - width  # a cache 2 steps wide (the tiny model's 128 positions); steps cross into the 2nd
    got = {}
    for lean in (True, False):
        dec = StaticDecoder(model, graphs=False)
        dec.width_graphs = dec.residual_in_product = lean
        widths, step = [], dec._step
        dec._step = lambda st, w, _step=step: widths.append(w) or _step(st, w)
        got[lean] = dec.decode(prompts, new, eos, pad), widths
    (toks, lps), widths = got[True]
    (whole_toks, whole_lps), whole_widths = got[False]
    steps = len(widths)
    assert width < WIDTH_STEP and whole_widths == [2 * WIDTH_STEP] * steps
    assert widths == [((width + t) // WIDTH_STEP + 1) * WIDTH_STEP for t in range(steps)]
    assert set(widths) == {WIDTH_STEP, 2 * WIDTH_STEP}
    assert toks == whole_toks == _hf_greedy(model, char_tok, prompts, new)
    assert max(abs(a - b) for x, y in zip(lps, whole_lps) for a, b in zip(x, y)) < 1e-5
    gap, mean, n = _trainer_gap(model, char_tok, prompts, toks, lps, 1.0)
    assert n > 100 and gap < MAX_GAP and mean < MEAN_GAP, (gap, mean)


def test_the_prefill_runs_in_buckets_and_the_cache_keeps_the_prompts_width(char_tok):
    """A group's prompt is prefilled once, in a bucket of distinct prompts (a power of two, filler
    prompts beside them) and at a width rounded up to PREFILL_STEP by more left padding (one graph a
    prefill shape on CUDA); the cache and the steps keep the prompts' own width. The same tokens as
    HF generate, log-probs the trainer's, for groups of samples and for prompts that nearly fill the
    model's context (the rounded width capped at it)."""
    model = _model("llama", char_tok)
    eos, pad = char_tok.eos_token_id, char_tok.pad_token_id
    groups = _prompts(char_tok, 5)
    prompts = [p for p in groups for _ in range(3)]  # 5 distinct prompts: a bucket of 8
    dec = StaticDecoder(model, graphs=False)
    widths, step = [], dec._step
    dec._step = lambda st, w, _step=step: widths.append(w) or _step(st, w)
    toks, lps = dec.decode(prompts, 20, eos, pad)
    width = max(len(p) for p in prompts)
    assert list(dec.prefills) == [(8, PREFILL_STEP)] and width < PREFILL_STEP
    assert widths[0] == WIDTH_STEP and list(dec.shapes) == [(16, WIDTH_STEP)]  # the prompts' width, not 64
    assert toks == _hf_greedy(model, char_tok, prompts, 20)
    gap, mean, n = _trainer_gap(model, char_tok, prompts, toks, lps, 1.0)
    assert n > 40 and gap < MAX_GAP and mean < MEAN_GAP, (gap, mean)
    context = model.config.max_position_embeddings
    long = [(p * 20)[: context - 3 - i] for i, p in enumerate(groups[:3])]  # 125, 124, 123 tokens
    toks, lps = dec.decode(long, 8, eos, pad)
    assert (4, context) in dec.prefills
    assert toks == [t[:3] for t in _hf_greedy(model, char_tok, long, 3)] and all(len(t) <= 3 for t in toks)


@pytest.mark.parametrize("decoder", ["fixed", "cpu"])
@pytest.mark.parametrize("top_p", [1.0, 0.8])
def test_a_steps_draws_follow_the_kept_head_of_the_distribution(char_tok, top_p, decoder):
    """Both decoders choose through `pick`: the fixed-shape one in `_advance`, in tensor ops only (it
    is captured on CUDA), drawing by a Gumbel-max race; the CPU one in `_choose`, by inverse CDF.
    With top_p each draws in sorted order and maps the draw back by a gather. Over 8,192 rows of
    the same logits the tokens' frequencies are softmax(logits / T) renormalised over the head HF's
    TopPLogitsWarper keeps, a dropped token is never drawn, each log-prob is the unmasked one, and
    the fixed decoder's state moved one step."""
    model = _model("llama", char_tok)  # (the decoder holds it weakly)
    dec = StaticDecoder(model, graphs=False)
    dec._pack()
    rows, V, T, eos = 8192, 40, 0.7, 3
    logits = torch.randn(V, generator=torch.Generator().manual_seed(0)) * 2
    torch.manual_seed(0)
    if decoder == "fixed":
        st = _Fixed(dec, rows, 8)
        st.col.fill_(4)
        st.temperature.fill_(T)
        st.top_p.fill_(top_p)
        dec._advance(st, logits.expand(rows, V).clone(), (False, top_p < 1, True, eos, False))
        drawn, lp = st.out_tok[:, 0], st.out_lp[:, 0]
        assert (st.tok == drawn).all() and (st.ended == (drawn == eos)).all()
        assert (st.t.item(), st.col.item()) == (1, 5) and st.valid[:, 5].all() and not st.valid[:, 6].any()
    else:
        drawn, lp = FastDecoder._choose(logits.expand(rows, V).clone(), 0, eos, T, top_p, 0, True)
    p = torch.softmax(logits / T, -1)
    ordered, order = p.sort()
    keep = torch.ones(V, dtype=torch.bool)
    if top_p < 1:
        drop = ordered.cumsum(-1) <= 1 - top_p
        drop[-1] = False
        keep[order[drop]] = False
    want = torch.where(keep, p, 0) / p[keep].sum()
    freq = torch.bincount(drawn, minlength=V) / rows
    assert (top_p < 1) == bool((~keep).any())
    assert freq[~keep].sum() == 0
    assert (freq - want).abs().max() < 0.03, (freq - want).abs().max()  # the largest's sd is about 0.005
    assert torch.allclose(lp, torch.log_softmax(logits / T, -1)[drawn])


def test_on_cpu_generation_keeps_the_compiled_decoder(char_tok):
    assert type(decoder_for(_model("llama", char_tok))) is FastDecoder


def test_the_gpu_profiles_variants_run_on_a_small_shape():
    """`python -m tests.gpu_profile variants` is run where a GPU is lent, minutes at a time: its
    code (each change undone through the decoder's switches, the timed prefill) runs here first,
    eagerly on the CPU at a small shape, in a process of its own (it turns the deterministic mode on)."""
    import subprocess
    import sys

    code = ("from tests import gpu_profile as P; r = P.decode_variants('cpu', rounds=1, calls=1, small=True); "
            "print('ROWS', sorted((k, len(v)) for k, v in r.items()))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "ROWS [('bf16', 6), ('fp32', 6)]" in proc.stdout
    lines = [line for line in proc.stdout.splitlines() if line.startswith("variants ")]
    assert len(lines) == 12 and all("prefill_seconds" in line for line in lines if "as shipped" in line)


# ---------------------------------------------------------------- CUDA only

@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_graph_replay_gives_the_eager_steps_tokens_and_logprobs(char_tok, dtype):
    model = _model("qwen2", char_tok).to("cuda", dtype)
    prompts, eos, pad = _prompts(char_tok, 21), char_tok.eos_token_id, char_tok.pad_token_id
    eager = StaticDecoder(model, graphs=False).decode(prompts, 40, eos, pad)
    dec = StaticDecoder(model, graphs=True)
    first = dec.decode(prompts, 40, eos, pad)
    (st,) = dec.shapes.values()
    assert st.graphs and set(st.graphs) <= {64, 128}  # a graph a width the steps attended
    assert [pf.graph is not None for pf in dec.prefills.values()] == [True] and dec.graph_prefill
    again = dec.decode(prompts, 40, eos, pad)  # the captured graph, replayed
    for got in (first, again):  # the same kernels at the same shapes: the same tokens, log-probs to rounding
        assert got[0] == eager[0]
        assert max(abs(a - b) for x, y in zip(got[1], eager[1]) for a, b in zip(x, y)) < 1e-5
    if dtype == torch.float32:
        assert first[0] == _hf_greedy(model, char_tok, prompts, 40)


@cuda
def test_graph_sampled_logprobs_are_the_trainers(char_tok):
    model = _model("llama", char_tok).to("cuda")
    prompts = [p for p in _prompts(char_tok, 6) for _ in range(4)]
    gens = generate(model, char_tok, prompts, 24, temperature=0.7, seed=5)
    assert decoder_for(model).shapes  # generate went through the fixed-shape decoder, captured
    gap, mean, n = _trainer_gap(model, char_tok, prompts, [g.token_ids for g in gens], [g.logprobs for g in gens], 0.7)
    assert n > 150 and gap < 1e-4, gap  # CUDA's fp32 products (TF32 off) round differently from the trainer's


@cuda
def test_weights_that_move_are_captured_again(char_tok):
    model = _model("llama", char_tok).to("cuda")
    prompts = _prompts(char_tok, 12)
    dec = decoder_for(model)
    assert isinstance(dec, StaticDecoder) and decoder_for(model) is dec  # one per model, graphs kept
    generate(model, char_tok, prompts, 16, logprobs=False)
    with torch.no_grad():
        for p in model.parameters():
            p.data = p.data * 1.5  # new storage: the captured graph would read the old
    got = generate(model, char_tok, prompts, 16, logprobs=False)
    assert [g.token_ids for g in got] == _hf_greedy(model, char_tok, prompts, 16)


@cuda
def test_graphs_capture_under_deterministic_mode(char_tok, monkeypatch):
    """The default run (POSTTRAIN_DETERMINISTIC unset) decodes from graphs too: index_copy_'s
    deterministic form syncs with the host, so the step is captured with the mode off (the plain
    kernel: one writer per element), and the mode is back on after the capture."""
    model = _model("llama", char_tok).to("cuda")
    prompts, eos, pad = _prompts(char_tok, 9), char_tok.eos_token_id, char_tok.pad_token_id
    eager = StaticDecoder(model, graphs=False).decode(prompts, 24, eos, pad)
    was = torch.are_deterministic_algorithms_enabled()
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # what trainer.engine.deterministic sets; torch checks it
    torch.use_deterministic_algorithms(True)
    try:
        dec = StaticDecoder(model, graphs=True)
        got = [dec.decode(prompts, 24, eos, pad) for _ in range(2)]
        (st,) = dec.shapes.values()
        assert st.graphs and dec.use_graphs
        # the prefill captured under the mode itself (it has no op whose deterministic form syncs)
        assert dec.graph_prefill and all(pf.graph is not None for pf in dec.prefills.values())
        assert torch.are_deterministic_algorithms_enabled()
    finally:
        torch.use_deterministic_algorithms(was)
    assert got[0] == got[1]  # replayed: the same tokens and log-probs, to the bit
    assert got[0][0] == eager[0]


@cuda
def test_captured_sampling_draws_the_same_whichever_call_captured(char_tok):
    """Sampling, EOS, min_new and the step's bookkeeping are captured too (`_advance`, one graph per
    sampling mode). A capture's warm-up draws random numbers; the generator's state is put back
    after it, so a decoder that captured in an earlier call (an uninterrupted run) and a fresh one
    (a resumed run, which captures at another round) draw the same tokens from the same seed."""
    model = _model("llama", char_tok).to("cuda")
    prompts = [p for p in _prompts(char_tok, 6) for _ in range(4)]
    eos, pad = char_tok.eos_token_id, char_tok.pad_token_id

    def run(dec, seed):
        torch.manual_seed(seed)
        return dec.decode(prompts, 24, eos, pad, temperature=0.9, top_p=0.9, min_new=3)

    old = StaticDecoder(model, graphs=True)
    run(old, 1)
    (st,) = old.shapes.values()
    assert st.graphs and list(st.advances) and all(g is not None for g in st.advances.values())
    again, fresh = run(old, 2), run(StaticDecoder(model, graphs=True), 2)
    assert again == fresh
    toks, lps = again
    assert all(eos not in t[:3] for t in toks) and len({tuple(t) for t in toks[:4]}) > 1
    gap, _, n = _trainer_gap(model, char_tok, prompts, toks, lps, 0.9)
    assert n > 150 and gap < 1e-4, gap


@cuda
def test_stop_strings_end_rows_in_graphs_where_they_end_eagerly(char_tok):
    model = _model("qwen2", char_tok).to("cuda")
    prompts, eos, pad = _prompts(char_tok, 20), char_tok.eos_token_id, char_tok.pad_token_id
    eager = StaticDecoder(model, graphs=False)
    free, _ = eager.decode(prompts, 30, eos, pad)
    stopper = StopStrings(char_tok, tuple(dict.fromkeys(char_tok.decode(t[4:6]) for t in free if len(t) > 8))[:3])
    want = eager.decode(prompts, 30, eos, pad, stop=stopper)
    dec = StaticDecoder(model, graphs=True)
    got = [dec.decode(prompts, 30, eos, pad, stop=stopper) for _ in range(2)]
    assert got[0][0] == got[1][0] == want[0]
    assert sum(len(g) < len(f) for g, f in zip(want[0], free)) >= 3


def test_a_tokenizer_without_a_pad_token_generates_as_with_eos_for_pad(char_tok):
    """A tokenizer loaded as it ships (AutoTokenizer, no pad token: SmolLM2's on transformers 5.17,
    seen on a GPU host) pads the prompts with EOS: a left pad is never attended."""
    import copy

    model = _model("llama", char_tok)
    prompts = _prompts(char_tok, 7)
    bare = copy.deepcopy(char_tok)
    bare.pad_token = None
    assert bare.pad_token_id is None
    got = generate(model, bare, prompts, 12, logprobs=False)
    assert [g.token_ids for g in got] == _hf_greedy(model, char_tok, prompts, 12)
