"""Trajectories: the loss mask from the record to the loss.

- `pack` puts each trajectory's mask and sampler log-probs at its next-token targets, 0 on the
  environment's tokens, and a record whose three per-token lists disagree is refused by name;
- every term of the loss table, and every aggregation, ignores what the mask zeroes: any value there
  leaves the loss unchanged and its gradient there is 0;
- through the trainer's update (real model, DeepSpeed, micro-batches): changing the environment's
  trailing tokens, the targets of masked positions, leaves the loss, every stat and the weights
  bitwise unchanged.
"""

import copy

import pytest
import torch

from trainer.config import load_config
from trainer.rl import losses
from trainer.rl.trajectory import Sample, pack, rows


def test_pack_puts_the_loss_mask_and_sampler_logprobs_at_the_targets():
    # prompt 3 tokens; policy 2, tool answer 3, policy 1
    s = Sample(0, [11, 12, 13], [21, 22, 31, 32, 33, 23], [-1.0, -2.0, 0.0, 0.0, 0.0, -3.0], "", "stop",
               loss_mask=[1, 1, 0, 0, 0, 1])
    short = Sample(1, [11, 14], [24], [-0.5], "", "stop")
    assert short.loss_mask == [1] and s.trained_tokens == 3
    b = pack([s, short], [1.0, -1.0], pad_id=0)
    # target t is token t + 1: the first response token is predicted at the prompt's last position
    assert b.mask[0].tolist() == [0, 0, 1, 1, 0, 0, 0, 1]
    assert b.engine_logp[0].tolist() == [0, 0, -1.0, -2.0, 0, 0, 0, -3.0]
    assert b.mask[1].tolist() == [0, 1, 0, 0, 0, 0, 0, 0]
    assert b.ids[1].tolist() == [11, 14, 24, 0, 0, 0, 0, 0, 0]
    part = rows(b, [1])
    assert part.ids.shape == (1, 3) and part.mask.tolist() == [[0, 1]]


def test_a_record_whose_lists_disagree_is_refused_by_name():
    with pytest.raises(ValueError, match="example 7: 3 response tokens but 2 loss-mask entries"):
        Sample(7, [1], [2, 3, 4], [0.0, 0.0, 0.0], "", "stop", loss_mask=[1, 0])
    with pytest.raises(ValueError, match="1 sampler log-probs"):
        Sample(7, [1], [2, 3], [0.0], "", "stop")


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
@pytest.mark.parametrize("kl", ["k1", "k2", "k3"])
def test_every_loss_term_ignores_masked_tokens(agg, kl):
    g = load_config("tiny", [f"grpo.loss_agg={agg}", "grpo.kl_coef=0.3", f"grpo.kl_estimator={kl}",
                             "grpo.entropy_coef=0.05", "grpo.tis_cap=2.0"]).grpo
    gen = torch.Generator().manual_seed(0)
    B, T = 4, 9
    mask = (torch.rand(B, T, generator=gen) > 0.4).float()
    mask[:, 0] = 1  # every row trains on something

    def tensors(noise: float) -> dict[str, torch.Tensor]:
        """Fixed values where the mask is 1; elsewhere random ones scaled by `noise`."""
        base = torch.Generator().manual_seed(1)
        junk = torch.Generator().manual_seed(2)
        out = {}
        for name in ("logp", "old", "engine", "ref", "entropy"):
            v = -torch.rand(B, T, generator=base) * 3 if name != "entropy" else torch.rand(B, T, generator=base) * 4
            out[name] = torch.where(mask.bool(), v, noise * (torch.rand(B, T, generator=junk) - 0.5) * 40)
        out["adv"] = torch.where(mask.bool(), torch.linspace(-1, 1, B)[:, None].expand(B, T),
                                 noise * torch.rand(B, T, generator=junk) * 9)
        return out

    results = []
    for noise in (0.0, 1.0):
        v = tensors(noise)
        logp = v["logp"].clone().requires_grad_(True)
        ent = v["entropy"].clone().requires_grad_(True)
        t = losses.Tokens(logp=logp, old=v["old"], engine=v["engine"], adv=v["adv"], mask=mask, ref=v["ref"],
                          entropy=ent)
        per_token, report = losses.token_loss(t, g)
        loss = losses.aggregate(per_token, mask, agg, losses.normaliser(mask, agg))
        loss.backward()
        assert float(logp.grad.abs().mul(1 - mask).max()) == 0.0  # no gradient through a masked token
        assert float(ent.grad.abs().mul(1 - mask).max()) == 0.0
        assert set(report) == set(losses.REPORTED)
        results.append((float(loss.detach()), {k: float((x * mask).sum()) for k, x in report.items()}, logp.grad, ent.grad))
    (l0, r0, g0, e0), (l1, r1, g1, e1) = results
    assert l0 == l1 and r0 == r1 and torch.equal(g0, g1) and torch.equal(e0, e1)
    assert l0 != 0.0 and float(g0.abs().max()) > 0


def test_the_update_ignores_the_targets_of_masked_positions(tiny_tokenizer, tmp_path):
    """Two rounds' batches that differ only in the environment's trailing tokens of every trajectory
    (what follows the policy's last turn, e.g. a tool's answer the episode ended on) and in the
    sampler log-probs recorded for observation tokens: the update's loss, stats and weights agree
    bitwise. Two mini-batches, uneven micro-batches, KL and entropy on."""
    from tests.test_grpo_update import make_batch, make_cfg, make_trainer

    cfg = make_cfg("grpo.mini_batches=2", "grpo.micro_batch_size=3", "grpo.lr=1e-3", "grpo.kl_coef=0.1",
                   "grpo.entropy_coef=0.01")
    vocab = len(tiny_tokenizer)
    batch = make_batch(1, 3, 4, vocab, seed=5, turns=2)
    other = copy.deepcopy(batch)
    for k, (s, o) in enumerate(zip(batch.samples, other.samples)):
        n = 2 + k % 3  # the same tail length on both sides (the same padding), other ids
        s.response_ids += [3 + (k + j) % (vocab - 3) for j in range(n)]
        o.response_ids += [3 + (k * 7 + j + 5) % (vocab - 3) for j in range(n)]
        for x in (s, o):
            x.loss_mask += [0] * n
            x.engine_logprobs += [0.0] * n
        for j, m in enumerate(o.loss_mask):  # junk where the sampler did not sample
            if not m:
                o.engine_logprobs[j] = 123.0
    assert [s.response_ids for s in batch.samples] != [o.response_ids for o in other.samples]
    weights = []
    stats = []
    for b, name in ((batch, "a"), (other, "b")):
        trainer = make_trainer(cfg, tiny_tokenizer, tmp_path / name)
        stats.append(trainer.update(b))
        weights.append(trainer.state_hash())
    drop = ("time/update_seconds", "update/trained_tokens")
    assert {k: v for k, v in stats[0].items() if k not in drop} == {k: v for k, v in stats[1].items() if k not in drop}
    assert stats[0]["update/trained_tokens"] == stats[1]["update/trained_tokens"]
    assert weights[0] == weights[1]
