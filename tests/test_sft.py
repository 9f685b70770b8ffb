"""SFT core: the masked loss, data order, and DeepSpeed training that checkpoints and resumes."""

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


def test_loss_is_one_per_token_mean_over_the_global_batch(tiny_tokenizer, tmp_path):
    """A micro-batch of a short answer and one of a long answer: the step's loss (and gradient)
    is the mean over all their target tokens, not the mean of the two micro-batch means."""
    from trainer.sft import collate, encode_dataset

    cfg = load_config("tiny", ["model.hidden_size=32", "model.num_layers=1", "model.intermediate_size=64",
                               "sft.micro_batch_size=1", "sft.grad_accum=2", "sft.max_steps=1", "sft.log_every=1"])
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
    per_token = float(loss)
    per_example = sum(float(masked_lm_loss(logits[i:i + 1], batch["input_ids"][i:i + 1], batch["loss_mask"][i:i + 1]))
                      for i in range(2)) / 2
    assert abs(per_token - per_example) > 1e-3  # the two rules really differ on this pair

    logger = ListLogger()
    _, result = train_sft(cfg, model, tiny_tokenizer, pair, tmp_path, logger)
    assert result.steps == 1
    assert result.final_loss == pytest.approx(per_token, rel=1e-5)
    # the gradient too (AdamW would hide a wrong scale): DeepSpeed's norm before clipping
    assert logger.metrics[0][1]["train/grad_norm"] == pytest.approx(grad_norm, rel=1e-4)
