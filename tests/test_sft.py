"""SFT core: the masked loss, data order, and DeepSpeed training that checkpoints and resumes."""

import logging

import pytest
import torch

from trainer import checkpoint
from trainer.config import load_config
from trainer.data import synthetic
from trainer.model import build_model
from trainer.sft import epoch_order, masked_lm_loss, train_sft
from trainer.tracking import ListLogger


def test_masked_loss_counts_only_masked_targets():
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 7)
    ids = torch.randint(0, 7, (2, 5))
    mask = torch.tensor([[0, 0, 1, 1, 0], [0, 1, 0, 0, 1]])
    got = masked_lm_loss(logits, ids, mask)
    terms = [torch.nn.functional.cross_entropy(logits[b, t - 1], ids[b, t])
             for b in range(2) for t in range(1, 5) if mask[b, t]]
    assert torch.allclose(got, torch.stack(terms).mean())
    # Changing logits that predict unmasked targets does not change the loss.
    logits2 = logits.clone()
    logits2[0, 0] += 100.0  # predicts ids[0, 1], whose mask is 0
    assert torch.allclose(masked_lm_loss(logits2, ids, mask), got)


def test_epoch_order_is_a_seeded_permutation():
    a, b = epoch_order(50, 1, 0), epoch_order(50, 1, 0)
    assert a == b and sorted(a) == list(range(50))
    assert epoch_order(50, 1, 1) != a and epoch_order(50, 2, 0) != a


@pytest.fixture(scope="module")
def small_run(tiny_tokenizer):
    cfg = load_config("tiny", ["model.hidden_size=32", "model.num_layers=1", "model.intermediate_size=64",
                               "sft.micro_batch_size=8", "sft.max_steps=6", "sft.checkpoint_every=3",
                               "sft.warmup_steps=2", "sft.log_every=1"])
    data = synthetic(cfg.data.synthetic.model_copy(update={"n_train": 200, "n_test": 5}), 0).train
    return cfg, data


def test_sft_trains_and_resumes_exactly(small_run, tiny_tokenizer, tmp_path):
    cfg, data = small_run
    _, full = train_sft(cfg, build_model(cfg.model, tiny_tokenizer, 0), tiny_tokenizer, data, tmp_path / "a")
    assert full.steps == 6 and full.resumed_from_step is None

    with pytest.raises(RuntimeError, match="injected fault at sft 4"):
        train_sft(cfg, build_model(cfg.model, tiny_tokenizer, 0), tiny_tokenizer, data, tmp_path / "b",
                  fault_at_step=4)
    assert checkpoint.committed_tags(tmp_path / "b" / "checkpoints") == ["step00000003"]
    _, resumed = train_sft(cfg, build_model(cfg.model, tiny_tokenizer, 0), tiny_tokenizer, data, tmp_path / "b")
    assert resumed.resumed_from_step == 3 and resumed.steps == 6
    assert resumed.state_hash == full.state_hash


def test_torn_checkpoint_is_skipped(small_run, tiny_tokenizer, tmp_path, caplog):
    cfg, data = small_run
    with pytest.raises(RuntimeError):
        train_sft(cfg, build_model(cfg.model, tiny_tokenizer, 0), tiny_tokenizer, data, tmp_path, fault_at_step=4)
    ckpts = tmp_path / "checkpoints"
    (ckpts / "step00000004").mkdir()  # a write that died before its COMMITTED marker
    (ckpts / "step00000004" / "mp_rank_00_model_states.pt").write_bytes(b"torn")
    assert checkpoint.committed_tags(ckpts) == ["step00000003"]
    assert "no COMMITTED marker" in caplog.text


@pytest.mark.parametrize("zero_stage", [1, 0])
def test_loss_is_one_per_token_mean_over_the_global_batch(tiny_tokenizer, tmp_path, zero_stage):
    """A micro-batch of a short answer and one of a long answer: the step's loss (and gradient)
    is the mean over all their target tokens, not the mean of the two micro-batch means. At ZeRO
    stage 0 (fp32) the gradient norm is ours (DeepSpeed keeps none there): the same number."""
    from trainer.sft import collate, encode_dataset

    cfg = load_config("tiny", ["model.hidden_size=32", "model.num_layers=1", "model.intermediate_size=64",
                               "sft.micro_batch_size=1", "sft.grad_accum=2", "sft.max_steps=1", "sft.log_every=1",
                               f"sft.deepspeed.zero_stage={zero_stage}"])
    rows = synthetic(cfg.data.synthetic.model_copy(update={"n_train": 40, "n_test": 2, "worked_fraction": 0.5}), 0).train
    encoded, _ = encode_dataset(tiny_tokenizer, rows, cfg.sft.max_length)
    lengths = [sum(e.loss_mask) for e in encoded]
    short, long = rows[lengths.index(min(lengths))], rows[lengths.index(max(lengths))]
    assert max(lengths) >= 3 * min(lengths)
    pair = [short, long]

    model = build_model(cfg.model, tiny_tokenizer, 0)
    batch = collate(encode_dataset(tiny_tokenizer, pair, cfg.sft.max_length)[0], tiny_tokenizer.pad_token_id)
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    loss = masked_lm_loss(logits, batch["input_ids"], batch["loss_mask"])
    loss.backward()
    grad_norm = float(torch.sqrt(sum((p.grad**2).sum() for p in model.parameters())))
    model.zero_grad()
    logits = logits.detach()
    per_token = float(loss.detach())
    per_example = sum(float(masked_lm_loss(logits[i:i + 1], batch["input_ids"][i:i + 1], batch["loss_mask"][i:i + 1]))
                      for i in range(2)) / 2
    assert abs(per_token - per_example) > 1e-3  # the two rules really differ on this pair

    logger = ListLogger()
    _, result = train_sft(cfg, model, tiny_tokenizer, pair, tmp_path, logger)
    assert result.steps == 1
    assert result.final_loss == pytest.approx(per_token, rel=1e-5)
    # the gradient too (AdamW would hide a wrong scale): DeepSpeed's norm before clipping
    assert logger.metrics[0][1]["train/grad_norm"] == pytest.approx(grad_norm, rel=1e-4)


def _arch(kind: str, tok) -> torch.nn.Module:
    from transformers import (GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, MistralConfig,
                              MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM)

    common = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(5)
    if kind == "llama":
        return LlamaForCausalLM(LlamaConfig(**common))
    if kind == "qwen2":  # q/k/v biases and tied embeddings, as Qwen2.5-0.5B
        return Qwen2ForCausalLM(Qwen2Config(**common, tie_word_embeddings=True))
    if kind == "qwen3":  # q/k norms and its own head_dim
        return Qwen3ForCausalLM(Qwen3Config(**common, head_dim=16))
    if kind == "mistral":
        return MistralForCausalLM(MistralConfig(**common, sliding_window=None))
    return GPT2LMHeadModel(GPT2Config(vocab_size=len(tok), n_embd=64, n_layer=2, n_head=4, n_positions=256))


def _padded_and_packed(tok, n: int = 24, width: int = 256):
    from trainer.sft import collate, encode_dataset, pack

    rows = synthetic(load_config("tiny", []).data.synthetic.model_copy(update={"n_train": 200, "n_test": 2}), 3).train
    encoded, _ = encode_dataset(tok, rows[:n], width)
    return encoded, collate(encoded, tok.pad_token_id), pack(encoded, width, tok.pad_token_id)


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3", "mistral"])
def test_packed_batches_give_the_padded_loss_and_gradients(kind, tiny_tokenizer):
    """Worked and short answers (uneven lengths) packed several to a row with padding at row ends:
    the loss and every gradient equal the padded batch's; positions that do not restart per
    example (examples attending to each other) would not."""
    from trainer.sft import lm_forward, packing_unsupported

    encoded, padded, packed = _padded_and_packed(tiny_tokenizer)
    assert packed["input_ids"].shape[0] < len(encoded) / 2  # really packed, several per row
    assert (packed["input_ids"] == tiny_tokenizer.pad_token_id).any()  # and a row ends in padding
    assert int(packed["loss_mask"].sum()) == sum(sum(e.loss_mask[1:]) for e in encoded)
    model = _arch(kind, tiny_tokenizer).train()
    assert packing_unsupported(model) is None

    def loss_and_grads(batch):
        model.zero_grad()
        loss = masked_lm_loss(lm_forward(model, batch).logits, batch["input_ids"], batch["loss_mask"])
        loss.backward()
        return float(loss), [p.grad.clone() for p in model.parameters()]

    want, want_grads = loss_and_grads(padded)
    got, got_grads = loss_and_grads(packed)
    assert got == pytest.approx(want, rel=1e-6)
    scale = max(float(g.abs().max()) for g in want_grads)
    assert max(float((a - b).abs().max()) for a, b in zip(got_grads, want_grads)) < 1e-5 * scale
    width = packed["input_ids"].shape[1]
    joined = {**packed, "position_ids": torch.arange(width).expand_as(packed["position_ids"])}
    assert loss_and_grads(joined)[0] != pytest.approx(want, rel=1e-4)


def test_packing_picks_the_row_width_of_fewest_flops(tiny_tokenizer):
    """Rows as wide as sft.max_length make each token attend (masked) to a whole row of other
    examples; the width is chosen per batch by FLOPs, weights counted as the model has them."""
    from trainer.sft import _first_fit, pack_width, slot_flops

    for kind in ("qwen2", "llama", "qwen3"):  # tied head, untied head, a head_dim of its own
        model = _arch(kind, tiny_tokenizer)
        n = sum(p.numel() for p in model.parameters())
        emb = model.get_input_embeddings().weight.numel()
        linear, per_key = slot_flops(model)
        assert linear == 2 * (n if kind == "qwen2" else n - emb), kind
        assert per_key == 4 * 2 * 4 * (16 if kind in ("llama", "qwen2", "qwen3") else 0), kind

    import random

    rng = random.Random(0)  # 64 examples like the tiny preset's with its own tokenizer: 38 tokens on average, at most 59
    lengths = [rng.randint(17, 59) for _ in range(64)]
    cost = (1_804_544, 2048)  # the tiny preset's model

    def flops(w):
        return len(_first_fit(lengths, w)[0]) * w * (cost[0] + cost[1] * w)

    w = pack_width(lengths, 128, cost)
    candidates = {max(lengths)} | {x for x in range(16, 129, 16) if x >= max(lengths)}
    assert max(lengths) <= w < 128 and flops(w) == min(flops(x) for x in candidates)
    assert flops(w) < flops(128)
    assert pack_width([128, 5, 7], 128, cost) == 128  # an example of max_length: no other width holds it
    assert pack_width([30] * 10 + [41], 256, (1, 10**6)) == 41  # attention dominating: the narrowest


def test_sft_packs_where_it_can_and_pads_elsewhere(tiny_tokenizer, tmp_path, caplog):
    """train_sft through DeepSpeed: packed and padded runs take the same steps to the same loss;
    GPT-2 (no packed-sequence masks verified) is padded, and says so."""
    import logging

    from trainer.sft import packing_unsupported

    rows = synthetic(load_config("tiny", []).data.synthetic.model_copy(update={"n_train": 200, "n_test": 2}), 1).train
    results = {}
    for packing in (True, False):
        cfg = load_config("tiny", ["model.hidden_size=32", "model.num_layers=2", "model.intermediate_size=64",
                                   "sft.micro_batch_size=16", "sft.max_steps=4", "sft.log_every=1",
                                   f"sft.packing={str(packing).lower()}"])
        _, results[packing] = train_sft(cfg, build_model(cfg.model, tiny_tokenizer, 0), tiny_tokenizer, rows,
                                        tmp_path / str(packing))
    assert results[True].steps == results[False].steps == 4
    assert results[True].final_loss == pytest.approx(results[False].final_loss, rel=1e-4)

    gpt2 = _arch("gpt2", tiny_tokenizer)
    assert "gpt2" in packing_unsupported(gpt2)
    cfg = load_config("tiny", ["sft.micro_batch_size=8", "sft.max_steps=1"])
    with caplog.at_level(logging.INFO, logger="trainer.sft"):
        _, res = train_sft(cfg, gpt2, tiny_tokenizer, rows, tmp_path / "gpt2")
    assert res.steps == 1
    assert "padded batches, not packed" in caplog.text


def test_a_hub_model_this_machine_cannot_fetch_is_named_with_the_way_round(monkeypatch, tmp_path, caplog,
                                                                           tiny_tokenizer):
    """A hub name in model.pretrained this machine cannot fetch (offline mode; a hub that cannot be
    reached, here a port nothing listens on): the model and, with tokenizer.train false, its tokenizer
    fail naming the field, the reason and how to run without the hub, at once: the hub client alone
    retries for about 25 s a file first (a minute before the SFT stage failed), not with transformers'
    bare OSError. A hub name in this machine's hub cache loads from it with no hub at all."""
    import huggingface_hub.constants

    from tasks.sft import train_and_export
    from trainer.model import ModelLoadError

    name = "posttrain-tests/no-such-model"
    cfg = load_config("tiny", [f"model.pretrained={name}", "tokenizer.train=false"])
    fix = f"download the model where you can (`hf download {name} --local-dir DIR`) and set model.pretrained=DIR"
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    offline = rf"^model.pretrained: could not load '{name}': it is not in this machine's hub cache, and HF_HUB_OFFLINE " \
              "is set"
    with pytest.raises(ModelLoadError, match=offline) as err:
        train_and_export(cfg, {}, None, tmp_path / "out", logger=None)
    assert fix in str(err.value)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    for const, value in (("ENDPOINT", "http://127.0.0.1:9"),  # refused
                         ("HUGGINGFACE_CO_URL_TEMPLATE", "http://127.0.0.1:9/{repo_id}/resolve/{revision}/{filename}")):
        monkeypatch.setattr(huggingface_hub.constants, const, value)
    unreachable = rf"^model.pretrained: could not load '{name}': it is not in this machine's hub cache, and the hub " \
                  "cannot be reached from here \\(ConnectError"
    with caplog.at_level(logging.WARNING):
        with pytest.raises(ModelLoadError, match=unreachable) as err:
            build_model(cfg.model, None, 0)
        assert fix in str(err.value)
        with pytest.raises(ModelLoadError, match=unreachable):
            train_and_export(cfg, {}, None, tmp_path / "out", logger=None)
    assert "Retrying" not in caplog.text, "the hub client was left to retry"
    assert not (tmp_path / "out").exists()

    # the same name in the hub cache (as `hf download` leaves it): loaded from there, the hub unreachable
    snapshot = tmp_path / "hub" / "models--posttrain-tests--no-such-model" / "snapshots" / ("0" * 40)
    model = _arch("llama", tiny_tokenizer)
    model.save_pretrained(snapshot)
    tiny_tokenizer.save_pretrained(snapshot)
    (snapshot.parent.parent / "refs").mkdir()
    (snapshot.parent.parent / "refs" / "main").write_text("0" * 40)
    with caplog.at_level(logging.INFO):
        loaded = build_model(cfg.model, tiny_tokenizer, 0)
    assert torch.equal(loaded.lm_head.weight, model.lm_head.weight)
    assert f"model.pretrained: {name} comes from this machine's hub cache ({snapshot})" in caplog.text
    assert "Retrying" not in caplog.text, "the hub client was left to retry"


def test_what_the_hub_answers_for_a_model_is_named(monkeypatch):
    """The hub's answers for a model's config.json, as the hub client reads them (a local server
    answers as the hub does, with its error headers): gated, unknown, not a transformers model are
    named; a busy hub (503) is left to the hub client's own retries; an answer is no problem."""
    import http.server
    import threading

    import huggingface_hub.constants

    from trainer.model import hub_problem

    answers = {"gated": (401, "GatedRepo"), "missing": (401, "RepoNotFound"), "no-config": (404, "EntryNotFound"),
               "busy": (503, None), "fine": (200, None)}

    class Hub(http.server.BaseHTTPRequestHandler):
        def do_HEAD(self):  # /posttrain-tests/<name>/resolve/main/config.json
            status, code = answers[self.path.split("/")[2]]
            self.send_response(status)
            if code:
                self.send_header("X-Error-Code", code)
            if status == 200:
                self.send_header("ETag", '"abc"')
                self.send_header("X-Repo-Commit", "0" * 40)
                self.send_header("Content-Length", "2")
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Hub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    hub = f"http://127.0.0.1:{server.server_address[1]}"
    for const, value in (("ENDPOINT", hub), ("HUGGINGFACE_CO_URL_TEMPLATE", hub + "/{repo_id}/resolve/{revision}/{filename}")):
        monkeypatch.setattr(huggingface_hub.constants, const, value)
    try:
        said = {name: hub_problem(f"posttrain-tests/{name}") for name in answers}
    finally:
        server.shutdown()
    assert said["gated"].startswith("the hub holds it gated: accept its terms")
    assert said["missing"].startswith("the hub has no model of that name (or it is private")
    assert said["no-config"] == "its hub repository has no config.json: it is not a transformers model"
    assert said["busy"] is None and said["fine"] is None


def test_truncation_says_how_many_examples_lost_their_whole_answer(tiny_tokenizer, tmp_path, caplog):
    """Real GSM8K under the tiny preset: most examples are cut at sft.max_length, and half keep no
    answer token at all; they are left out, and the plan's step count follows what is left."""
    rows = synthetic(load_config("tiny", []).data.synthetic.model_copy(update={"n_train": 40, "n_test": 2}), 3).train
    long = "Dee has 6 coins. " * 10
    for i in range(0, 40, 2):  # every other question fills the 128 tokens before its answer starts
        rows[i] = {**rows[i], "messages": [{**m, "content": long + m["content"]} if m["role"] == "user" else m
                                           for m in rows[i]["messages"]]}
    cfg = load_config("tiny", ["model.hidden_size=32", "model.num_layers=1", "model.intermediate_size=64",
                               "sft.micro_batch_size=4", "sft.epochs=1"])
    with caplog.at_level(logging.WARNING, logger="trainer.sft"):
        _, res = train_sft(cfg, build_model(cfg.model, tiny_tokenizer, 0), tiny_tokenizer, rows, tmp_path)
    [said] = [r.getMessage() for r in caplog.records if r.name == "trainer.sft"]
    assert said.startswith("sft: ") and "of 40 examples truncated to max_length=128; 20 of them kept no answer " \
        "token and are left out, 20 train (raise sft.max_length)" in said, said
    assert res.n_examples == 20 and res.steps == 5
