"""GRPOTrainer.update() checked from outside, on batches built by hand.

- optimizer steps land on the last micro-batch of every mini-batch whatever a round's group count
  (DeepSpeed's own step counter), and resume stays exact across rounds with different counts;
- a skipped round records its own stats, once;
- the loss, its gradient norm and the direction of the first AdamW step match a per-sequence
  computation written here independently of pack/rows/micro-batching: TIS, every loss
  aggregation, the entropy term and each KL estimator;
- a problem small enough to learn in seconds: the reward rises.
"""

import copy
import gc
import math
import random

import pytest
import torch

from trainer.config import load_config
from trainer.data import synthetic
from trainer.grpo import GRPOTrainer
from trainer.loop import run_round
from trainer.model import build_model
from trainer.rl.trajectory import Group, RolloutBatch, Sample

MODEL = ["model.hidden_size=32", "model.num_layers=1", "model.intermediate_size=64", "model.num_heads=2"]


def make_cfg(*extra: str):
    return load_config("tiny", MODEL + ["grpo.eval_every=1000", "grpo.checkpoint_every=1000",
                                        "rollout.temperature=0.7", *extra])


def make_trainer(cfg, tok, work, seed: int = 0) -> GRPOTrainer:
    data = synthetic(cfg.data.synthetic.model_copy(update={"n_train": 20, "n_test": 2}), 0)
    return GRPOTrainer(cfg, build_model(cfg.model, tok, seed), tok, data.train, data.test, work)


def make_batch(round_: int, n_groups: int, group_size: int, vocab: int, seed: int, turns: int = 1) -> RolloutBatch:
    """Groups of random prompts/responses of uneven lengths with rewards that differ in each group.
    With turns > 1 each response is that many policy segments with an observation (the
    environment's tokens: loss mask 0, no sampler log-prob) between each two."""
    rng = random.Random(seed)
    groups = []
    for g in range(n_groups):
        samples = []
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(3, 8))]
        for _ in range(group_size):
            ids, mask, logprobs = [], [], []
            for t in range(turns):
                if t:
                    k = rng.randint(1, 5)
                    ids += [rng.randrange(3, vocab) for _ in range(k)]
                    mask += [0] * k
                    logprobs += [0.0] * k
                r = rng.randint(1, 7)
                ids += [rng.randrange(3, vocab) for _ in range(r)]
                mask += [1] * r
                logprobs += [rng.uniform(-7.0, -4.0) for _ in range(r)]
            samples.append(Sample(example_index=g, prompt_ids=prompt, response_ids=ids, engine_logprobs=logprobs,
                                  text="", finish_reason="length", reward=rng.random(), loss_mask=mask))
        groups.append(Group(g, samples, round_))
    return RolloutBatch(round_, groups, {})


def step_pattern(n_samples: int, mini_batches: int, micro: int) -> list[bool]:
    """For each backward pass: should an optimizer step follow it (one rank, one epoch)."""
    size = math.ceil(n_samples / mini_batches)
    out = []
    for m in range(mini_batches):
        k = len(range(n_samples)[m * size:(m + 1) * size])
        if k:
            n_micro = max(1, math.ceil(k / micro))
            out += [False] * (n_micro - 1) + [True]
    return out


# ---------------------------------------------------------------- accumulation boundaries

GROUP_COUNTS = [3, 2, 3, 5, 1]  # 12, 8, 12, 20, 4 samples: 3, 2, 3, 5, 1 micro-batches per mini-batch


def saved_after_3_then_resumed(cfg, tok, work) -> GRPOTrainer:
    """GROUP_COUNTS' first 3 rounds (3 + 2 + 3 micro-batches per mini-batch), a checkpoint, then a
    new trainer that resumes from it and runs the rest."""
    vocab = len(tok)
    first = make_trainer(cfg, tok, work)
    for r, groups in enumerate(GROUP_COUNTS[:3], start=1):
        first.publish(first.update(make_batch(r, groups, 4, vocab, seed=r)))
    first.save()
    resumed = make_trainer(cfg, tok, work)
    assert resumed.resumed_from == 3
    for r, groups in enumerate(GROUP_COUNTS[3:], start=4):
        resumed.publish(resumed.update(make_batch(r, groups, 4, vocab, seed=r)))
    return resumed


@pytest.mark.parametrize("zero_stage", [0, 2])
def test_optimizer_steps_land_at_mini_batch_ends_whatever_the_group_count(tiny_tokenizer, tmp_path, zero_stage):
    cfg = make_cfg("grpo.mini_batches=2", "grpo.micro_batch_size=2", "grpo.lr=1e-3",
                   f"grpo.deepspeed.zero_stage={zero_stage}")
    trainer = make_trainer(cfg, tiny_tokenizer, tmp_path)
    stepped: list[bool] = []
    step = trainer.ds.step

    def spy():
        before = trainer.ds.global_steps
        step()
        stepped.append(trainer.ds.global_steps == before + 1)

    trainer.ds.step = spy
    for r, groups in enumerate(GROUP_COUNTS, start=1):
        stepped.clear()
        stats = trainer.publish(trainer.update(make_batch(r, groups, 4, len(tiny_tokenizer), seed=r)))
        assert stepped == step_pattern(groups * 4, 2, 2), f"round {r} ({groups} groups)"
        assert stats["update/optimizer_steps"] == 2
    assert trainer.ds.global_steps == 2 * len(GROUP_COUNTS)


def test_zero_stage_0_clips_and_reports_the_gradient_norm_as_stage_1_does(tiny_tokenizer, tmp_path):
    """At ZeRO stage 0 in fp32 DeepSpeed clips without keeping the norm, so posttrain clips there
    itself (trainer.engine.step): the same norm before clipping and the same clipped step as stage 1's,
    round after round, with the clip active (grad_clip far under the norm), for the policy and a critic."""
    common = ["grpo.mini_batches=2", "grpo.micro_batch_size=2", "grpo.lr=1e-3", "grpo.grad_clip=0.05",
              "grpo.advantage=gae", "grpo.critic.lr=1e-3", "grpo.critic.warmup_rounds=0"]
    runs = {}
    for stage in (1, 0):
        cfg = make_cfg(*common, f"grpo.deepspeed.zero_stage={stage}")
        trainer = make_trainer(cfg, tiny_tokenizer, tmp_path / str(stage))
        stats = [trainer.publish(trainer.update(make_batch(r, g, 4, len(tiny_tokenizer), seed=r)))
                 for r, g in enumerate(GROUP_COUNTS[:3], start=1)]
        runs[stage] = stats, {n: p.detach().clone() for n, p in trainer.ds.module.named_parameters()}
    (s1, w1), (s0, w0) = runs[1], runs[0]
    for a, b in zip(s1, s0):
        for key in ("update/grad_norm", "critic/grad_norm"):
            assert math.isfinite(b[key]) and b[key] > 0.05, (key, b[key])  # the clip was active
            assert b[key] == pytest.approx(a[key], rel=1e-4), key
    for n, p in w1.items():
        assert torch.allclose(w0[n], p, rtol=1e-4, atol=1e-6), n


@pytest.mark.parametrize("zero_stage", [0, 1])
@pytest.mark.slow
def test_bf16_steps_on_flat_fp32_masters_with_few_operators_and_resumes_exactly(tiny_tokenizer, tmp_path, zero_stage):
    """bf16 at ZeRO stage 0 or 1 runs DeepSpeed's BF16_Optimizer (trainer.engine.ds_config): bf16
    weights, fp32 gradient accumulation and master weights, one flat step. Its optimizer step issues
    a few operators a parameter, where DeepSpeed's own stage-0 choice (its unfused fp16 optimizer)
    issued about 25, each a device synchronisation on a GPU; the gradient over several micro-batches
    is the fp32 run's (its norm, before clipping), steps land at mini-batch ends over uneven rounds,
    and resume is exact."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Ops.count += 1
            return func(*args, **(kwargs or {}))

    common = ["grpo.mini_batches=2", "grpo.micro_batch_size=2", "grpo.lr=1e-3", "grpo.grad_clip=0.05"]
    cfg = make_cfg(*common, "grpo.deepspeed.precision=bf16", f"grpo.deepspeed.zero_stage={zero_stage}")
    vocab = len(tiny_tokenizer)
    # the gradients the fp32 run takes from the same first round: several micro-batches a step
    fp32 = make_trainer(make_cfg(*common, "grpo.deepspeed.zero_stage=0"), tiny_tokenizer, tmp_path / "fp32")
    want = fp32.publish(fp32.update(make_batch(1, GROUP_COUNTS[0], 4, vocab, seed=1)))["update/grad_norm"]
    collections = gc.get_stats()[2]["collections"]
    full = make_trainer(cfg, tiny_tokenizer, tmp_path / "full")
    assert type(full.ds.optimizer).__name__ == "BF16_Optimizer"
    # DeepSpeed's forced memory reports ran a full collection each, 4 here (trainer.engine skips them)
    assert gc.get_stats()[2]["collections"] - collections <= 2
    params = list(full.ds.module.parameters())
    assert {p.dtype for p in params} == {torch.bfloat16}
    step, counts = full.ds.step, []

    def counted():
        Ops.count = 0
        with Ops():
            step()
        counts.append(Ops.count)

    full.ds.step = counted
    for r, groups in enumerate(GROUP_COUNTS, start=1):
        stats = full.publish(full.update(make_batch(r, groups, 4, vocab, seed=r)))
        assert stats["update/optimizer_steps"] == 2
        assert math.isfinite(stats["update/grad_norm"]) and stats["update/grad_norm"] > 0.05  # the clip acted
        if r == 1:
            # bf16 rounding apart, the same gradients: each micro-batch's added to the fp32 sum once
            # (DeepSpeed's deferred accumulation added the earlier micro-batches' again: 1.8x here)
            assert stats["update/grad_norm"] == pytest.approx(want, rel=0.02), (stats["update/grad_norm"], want)
    assert full.ds.global_steps == 2 * len(GROUP_COUNTS)
    # the boundary micro-batch's step is the optimizer's: a few dozen operators whatever the number of
    # parameters (DeepSpeed's BF16_Optimizer alone: 2 a parameter more, 101 for these 11; its unfused
    # fp16 optimizer at stage 0: 286); test_lean_bf16_optimizer_... counts them against DeepSpeed's
    assert max(counts) <= 80, (counts, len(params))
    assert saved_after_3_then_resumed(cfg, tiny_tokenizer, tmp_path / "crash").state_hash() == full.state_hash()


@pytest.mark.slow
def test_lean_bf16_optimizer_adds_the_same_gradients_with_a_constant_number_of_operators(
        tiny_tokenizer, tmp_path, monkeypatch):
    """trainer.engine.lean_bf16_optimizer against DeepSpeed's BF16_Optimizer as DeepSpeed makes it,
    on the same rounds (several micro-batches a step), for 1 layer (11 parameters) and 4 (38):

    - with a clip that never acts the fp32 gradient sums before every step and the fp32 master weights after
      the rounds are the same to the bit, and the gradient norms equal up to float rounding (the same
      sum of squares in another order);
    - each backward issues at least 3 fewer operators a parameter (the cast, its view, two detaches),
      and the optimizer step the same few dozen for both sizes, where DeepSpeed's takes 2 more a
      parameter (each gradient's norm and a detach);
    - with the clip acting, the first step's gradients are the same bits, and the norms and master
      weights after a round agree up to that rounding (which then moves a bf16 weight now and then)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    import trainer.engine as E

    class Ops(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Ops.count += 1
            return func(*args, **(kwargs or {}))

    def counted(f, into):
        def run(*a, **k):
            Ops.count = 0
            with Ops():
                out = f(*a, **k)
            into.append(Ops.count)
            return out
        return run

    lean_on = E.lean_bf16_optimizer

    def run(layers: int, lean: bool, clip: float, rounds: int) -> dict:
        monkeypatch.setattr(E, "lean_bf16_optimizer", lean_on if lean else (lambda opt: False))
        cfg = make_cfg(f"model.num_layers={layers}", "grpo.mini_batches=2", "grpo.micro_batch_size=2",
                       "grpo.lr=1e-3", f"grpo.grad_clip={clip}", "grpo.deepspeed.precision=bf16",
                       "grpo.deepspeed.zero_stage=0")
        t = make_trainer(cfg, tiny_tokenizer, tmp_path / f"{layers}-{lean}-{clip}")
        opt = t.ds.optimizer
        out = dict(grads=[], norms=[], backward=[], step=[])
        step = opt.step

        def step_seen(*a, **k):
            out["grads"].append(torch.cat([g.clone() for g in opt.fp32_groups_gradients_flat]))
            return step(*a, **k)

        opt.step = step_seen
        t.ds.backward = counted(t.ds.backward, out["backward"])
        t.ds.step = counted(t.ds.step, out["step"])
        for r, groups in enumerate(GROUP_COUNTS[:rounds], start=1):
            stats = t.publish(t.update(make_batch(r, groups, 4, len(tiny_tokenizer), seed=r)))
            out["norms"].append(stats["update/grad_norm"])
        out["n"] = sum(1 for p in t.ds.module.parameters() if p.requires_grad)
        out["masters"] = torch.cat([m.detach().clone() for m in opt.fp32_groups_flat_partition])
        return out

    lean_steps = {}
    for layers in (1, 4):
        ds, lean = run(layers, False, 1e6, 3), run(layers, True, 1e6, 3)
        assert len(lean["grads"]) == len(ds["grads"]) == 6
        for i, (a, b) in enumerate(zip(ds["grads"], lean["grads"])):
            assert torch.equal(a, b), (i, (a - b).abs().max())  # each micro-batch's added: the same bits
        assert torch.equal(lean["masters"], ds["masters"])
        assert lean["norms"] == pytest.approx(ds["norms"], rel=1e-5)
        n = lean["n"]
        for a, b in zip(ds["backward"], lean["backward"]):
            assert a - b >= 3 * n, (a, b, n)
        # the last step of a round is a boundary's, where the optimizer stepped (the first one's also
        # sets up the optimizer's state, 2 operators a parameter, once); one norm instead of n
        assert ds["step"][-1] - lean["step"][-1] >= 2 * (n - 1), (ds["step"][-1], lean["step"][-1], n)
        lean_steps[layers] = lean["step"][-1]
    assert lean_steps[1] == lean_steps[4] <= 40, lean_steps
    ds, lean = run(1, False, 0.05, 1), run(1, True, 0.05, 1)
    assert torch.equal(ds["grads"][0], lean["grads"][0])
    assert lean["norms"][0] > 0.05 and lean["norms"] == pytest.approx(ds["norms"], rel=1e-5)  # the clip acted
    assert torch.allclose(lean["masters"], ds["masters"], rtol=1e-5, atol=1e-7)


def test_a_due_checkpoint_waits_for_checkpoint_min_seconds_since_the_last(tiny_tokenizer, tmp_path):
    """grpo.checkpoint_min_seconds: a round that checkpoint_every makes due is saved only when that
    long has passed since the stage's last checkpoint (or its start); 0 keeps every due round."""
    trainer = make_trainer(make_cfg("grpo.checkpoint_every=2", "grpo.checkpoint_min_seconds=30", "grpo.rounds=10"),
                           tiny_tokenizer, tmp_path / "min")
    trainer.round = 3
    assert not trainer.should_checkpoint()  # not due
    trainer.round = 4
    assert not trainer.should_checkpoint()  # due, but the stage started under 30 s ago
    trainer.last_checkpoint -= 31
    assert trainer.should_checkpoint()
    trainer.save()
    assert trainer.ckpt_dir.joinpath("step00000004", "COMMITTED").is_file()
    trainer.round = 6
    assert not trainer.should_checkpoint()  # 30 s are counted from that save
    trainer.last_checkpoint -= 31
    assert trainer.should_checkpoint()
    trainer.round = 10
    assert not trainer.should_checkpoint()  # the last round: the stage saves it itself (tasks/grpo.py)
    every = make_trainer(make_cfg("grpo.checkpoint_every=2", "grpo.rounds=10"), tiny_tokenizer, tmp_path / "every")
    every.round = 4
    assert every.should_checkpoint()


def test_resume_is_exact_across_rounds_with_different_group_counts(tiny_tokenizer, tmp_path):
    cfg = make_cfg("grpo.mini_batches=2", "grpo.micro_batch_size=2", "grpo.lr=1e-3", "grpo.epochs=2")
    vocab = len(tiny_tokenizer)
    full = make_trainer(cfg, tiny_tokenizer, tmp_path / "full")
    for r, groups in enumerate(GROUP_COUNTS, start=1):
        full.publish(full.update(make_batch(r, groups, 4, vocab, seed=r)))
    assert saved_after_3_then_resumed(cfg, tiny_tokenizer, tmp_path / "crash").state_hash() == full.state_hash()


# ---------------------------------------------------------------- a skipped round

def test_a_skipped_round_logs_its_own_stats_once(tiny_tokenizer, tmp_path):
    trainer = make_trainer(make_cfg("grpo.micro_batch_size=4"), tiny_tokenizer, tmp_path)
    trainer.publish(trainer.update(make_batch(1, 2, 4, len(tiny_tokenizer), seed=1)))
    empty = RolloutBatch(2, [], {"rollout/groups_used": 0.0})
    stats = trainer.publish(trainer.update(empty))
    assert [h["round"] for h in trainer.history] == [1.0, 2.0]
    second = trainer.history[1]
    assert second["update/skipped"] == 1.0 and second["update/optimizer_steps"] == 0
    assert second["rollout/groups_used"] == 0.0
    assert "update/loss" not in second  # not round 1's numbers again
    assert stats is not trainer.history[0]


# ---------------------------------------------------------------- the objective, computed apart

def expected_loss(model, reference, batch: RolloutBatch, g, temperature: float) -> torch.Tensor:
    """The round's loss at its first step (policy == old policy), one sequence at a time, on the
    model's device (the trainer's GPU where there is one)."""
    dev = next(model.parameters()).device
    per_seq, per_seq_len = [], []
    for group in batch.groups:
        rewards = torch.tensor(group.rewards())
        adv = rewards - rewards.mean()
        if g.std_normalize:
            adv = adv / (rewards.std() + 1e-6)
        for s, a in zip(group.samples, adv.tolist()):
            ids = torch.tensor([s.prompt_ids + s.response_ids], device=dev)
            p, r = len(s.prompt_ids), len(s.response_ids)
            pos = torch.arange(p - 1, p - 1 + r, device=dev)
            target = torch.tensor(s.response_ids, device=dev)
            logits = model(input_ids=ids).logits[0].float() / temperature
            logp_all = torch.log_softmax(logits, -1)[pos]
            logp = logp_all[torch.arange(r, device=dev), target]
            old = logp.detach()
            tis = torch.exp(old - torch.tensor(s.engine_logprobs, device=dev))
            tis = torch.clamp(tis, max=g.tis_cap) if g.tis_cap is not None else torch.ones_like(tis)
            tok = -a * torch.exp(logp - old) * tis  # ratio 1: inside the clip range
            if reference is not None:
                with torch.no_grad():
                    ref_logits = reference(input_ids=ids).logits[0].float() / temperature
                ref = torch.log_softmax(ref_logits, -1)[pos][torch.arange(r, device=dev), target]
                d = ref - logp  # log(pi_ref / pi)
                kl = {"k1": -d, "k2": 0.5 * d**2, "k3": torch.exp(d) - 1 - d}[g.kl_estimator]
                tok = tok + g.kl_coef * kl
            if g.entropy_coef:
                ent = -(logp_all.exp() * logp_all).sum(-1)
                tok = tok - g.entropy_coef * ent
            # only the policy's own tokens count (an observation's position is dropped, not zeroed)
            keep = torch.tensor(s.loss_mask, device=dev).bool()
            per_seq.append(tok[keep])
            per_seq_len.append(int(keep.sum()))
    if g.loss_agg == "token-mean":
        return torch.cat(per_seq).sum() / sum(per_seq_len)
    if g.loss_agg == "seq-mean-token-sum":
        return torch.stack([t.sum() for t in per_seq]).mean()
    return torch.stack([t.mean() for t in per_seq]).mean()


CASES = [
    ["grpo.loss_agg=token-mean"],
    ["grpo.loss_agg=seq-mean-token-sum", "grpo.tis_cap=null"],
    ["grpo.loss_agg=seq-mean-token-mean", "grpo.entropy_coef=0.05"],
    ["grpo.kl_coef=0.5", "grpo.kl_estimator=k1"],
    ["grpo.kl_coef=0.5", "grpo.kl_estimator=k2", "grpo.std_normalize=false"],
    ["grpo.kl_coef=0.5", "grpo.kl_estimator=k3", "grpo.entropy_coef=0.05", "grpo.loss_agg=seq-mean-token-mean"],
]


@pytest.mark.parametrize("turns", [1, 3], ids=["single-turn", "3-turn"])
@pytest.mark.parametrize("extra", CASES, ids=lambda e: ",".join(o.split(".", 1)[1] for o in e))
def test_update_matches_a_per_sequence_computation(tiny_tokenizer, tmp_path, extra, turns):
    # one mini-batch in 3 uneven micro-batches; no weight decay or clipping, so AdamW's first step
    # is -lr * g / (|g| + eps) on every weight whose gradient is not tiny. Three turns: the observations
    # between them are context, and the loss counts the policy's tokens only.
    lr = 1e-3
    cfg = make_cfg("grpo.mini_batches=1", "grpo.micro_batch_size=3", f"grpo.lr={lr}", "grpo.grad_clip=1e6",
                   "grpo.weight_decay=0", "grpo.warmup_rounds=0", *extra)
    trainer = make_trainer(cfg, tiny_tokenizer, tmp_path)
    if trainer.reference is not None:  # a reference that differs from the policy: KL is not 0
        torch.manual_seed(1)
        with torch.no_grad():
            for p in trainer.reference.parameters():
                p.add_(0.05 * torch.randn_like(p))
    batch = make_batch(1, 2, 4, len(tiny_tokenizer), seed=7, turns=turns)  # 8 sequences: 3 + 3 + 2
    model = copy.deepcopy(trainer.ds.module).train()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    loss = expected_loss(model, trainer.reference, batch, cfg.grpo, cfg.rollout.temperature)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    norm = torch.sqrt(sum((g_**2).sum() for g_ in grads.values()))

    stats = trainer.update(batch)
    assert stats["update/optimizer_steps"] == 1
    assert stats["update/loss"] == pytest.approx(float(loss.detach()), rel=1e-4, abs=1e-6)
    assert stats["update/grad_norm"] == pytest.approx(float(norm), rel=1e-3)
    after = dict(trainer.ds.module.named_parameters())
    checked = 0
    for n, g_ in grads.items():
        big = g_.abs() > 1e-3 * g_.abs().max()
        delta = (after[n].detach() - before[n])[big]
        # AdamW's first step: -lr * g / (|g| + eps), eps = 1e-8 (torch's default)
        assert torch.allclose(delta, -lr * g_[big] / (g_[big].abs() + 1e-8), rtol=0.02, atol=lr * 0.02), n
        checked += int(big.sum())
    assert checked > 1000


@pytest.mark.parametrize("extra", [[], ["grpo.kl_coef=0.5", "grpo.entropy_coef=0.05"],
                                   ["grpo.loss_agg=seq-mean-token-mean", "grpo.tis_cap=null"]],
                         ids=["plain", "kl+entropy", "seq-mean"])
def test_one_step_rounds_reuse_the_training_forward_with_the_same_loss_and_gradients(tiny_tokenizer, tmp_path,
                                                                                      extra):
    """With one optimizer step a round the old log-probs come from the training forward itself
    (detached) instead of a separate no-grad pass: the loss, gradient norm, every stat and the
    weights after the step match the two-pass computation within float rounding."""
    cfg = make_cfg("grpo.mini_batches=1", "grpo.micro_batch_size=3", "grpo.lr=1e-3", "rollout.temperature=0.9",
                   *extra)
    results = []
    for reuse in (False, True):
        trainer = make_trainer(cfg, tiny_tokenizer, tmp_path / str(reuse))
        trainer.reuse_training_logprobs = reuse
        if trainer.reference is not None:
            torch.manual_seed(1)
            with torch.no_grad():
                for p in trainer.reference.parameters():
                    p.add_(0.05 * torch.randn_like(p))
        stats = trainer.update(make_batch(1, 3, 5, len(tiny_tokenizer), seed=11))  # 15 sequences: 3 x 5 micro
        results.append((stats, {n: p.detach().clone() for n, p in trainer.ds.module.named_parameters()}))
    (two_pass, w_two), (reused, w_reused) = results
    for key in ("update/loss", "update/pg_loss", "update/kl", "update/entropy", "update/grad_norm",
                "update/ratio_mean", "update/tis_weight_mean", "update/engine_logprob_abs_diff"):
        assert reused[key] == pytest.approx(two_pass[key], rel=1e-5, abs=1e-7), key
    assert reused["update/ratio_mean"] == 1.0
    for n in w_two:
        assert torch.allclose(w_reused[n], w_two[n], rtol=1e-5, atol=1e-7), n


# ---------------------------------------------------------------- it learns

def digit_share(response: str, example: dict) -> float:
    """Reward for the learning test: the share of the response's characters that are digits."""
    return sum(c.isdigit() for c in response) / max(len(response), 1)


def test_reward_rises_on_a_problem_learnable_in_seconds(tiny_tokenizer, tmp_path):
    cfg = make_cfg("grpo.rounds=20", "grpo.lr=1e-2", "grpo.mini_batches=1", "grpo.micro_batch_size=32",
                   "rollout.prompts_per_round=4", "rollout.n_samples_per_prompt=8", "rollout.over_sample=1",
                   "rollout.dynamic_filter=none", "rollout.max_response_tokens=8", "rollout.temperature=1.0",
                   "grpo.rewards=[{name: tests.test_grpo_update.digit_share}]")
    trainer = make_trainer(cfg, tiny_tokenizer, tmp_path)
    rewards = []
    while not trainer.done():
        rewards.append(run_round(trainer)["reward/mean"])
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    assert last > first + 0.2, rewards


def test_exported_weights_are_host_copies_untied():
    """export_model's state dict (trainer.lora.plain_state): every tensor its own CPU copy (equal values, no storage shared with
    the parameters or with each other, tied embeddings untied for safetensors). On a GPU the same
    `.to("cpu", copy=True)` puts the copy in host memory instead of a second model on the device;
    CUDA itself cannot run here."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from trainer.lora import plain_state

    model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True))
    state = model.state_dict()
    assert state["lm_head.weight"].data_ptr() == state["model.embed_tokens.weight"].data_ptr()  # tied
    copied = plain_state(model)
    ptrs = {t.data_ptr() for t in copied.values()}
    assert len(ptrs) == len(copied) and not ptrs & {p.data_ptr() for p in model.parameters()}
    assert all(t.device.type == "cpu" and torch.equal(t, state[k]) for k, t in copied.items())
