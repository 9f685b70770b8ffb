"""Rollout manager: buffer, dynamic-sampling filter, carry-over; engine vs trainer logprobs."""

import pytest
import torch

from trainer.config import RewardSpec, RolloutConfig, load_config
from trainer.data import synthetic
from trainer.inference.generate import Generation
from trainer.model import build_model
from trainer.inference.engines import HFEngine, SamplingParams
from trainer.rl.logprobs import token_logprobs
from trainer.rl.orchestrator import DataBuffer, RolloutManager, keep_group
from trainer.rl.rewards import RewardError, RewardMix
from trainer.rl.trajectory import Group, Sample, pack


def test_buffer_epochs_and_state():
    b = DataBuffer(5, seed=3)
    first = b.take(5)
    assert sorted(first) == list(range(5)) and b.epoch == 0
    nxt = b.take(3)
    assert b.epoch == 1 and len(set(nxt)) == 3
    state = b.state_dict()
    rest = b.take(4)
    b2 = DataBuffer(5, seed=3)
    b2.load_state_dict(state)
    assert b2.take(4) == rest


def _sample(i, reward):
    return Sample(i, [1], [2], [-0.1], "x", "stop", reward=reward)


def test_filter_drops_groups_that_agree():
    assert keep_group(Group(0, [_sample(0, 1.0), _sample(0, 0.0)], 1), "nonzero_std")
    assert not keep_group(Group(0, [_sample(0, 1.0), _sample(0, 1.0)], 1), "nonzero_std")
    assert keep_group(Group(0, [_sample(0, 1.0), _sample(0, 1.0)], 1), "none")


class ScriptedEngine:
    """Answers prompt k's samples with scripted texts (a test double for the generator only)."""

    def __init__(self, texts_for):
        self.texts_for = texts_for

    def generate(self, prompts, params):
        return [Generation(p, [5, 6], [-0.5, -0.5], self.texts_for(i), "stop") for i, p in enumerate(prompts)]

    def update_weights(self, model_dir):
        pass

    def close(self):
        pass


def test_over_sampling_filter_and_carry_over(tiny_tokenizer):
    data = synthetic(load_config("tiny").data.synthetic.model_copy(update={"n_train": 50, "n_test": 5}), 0)
    cfg = RolloutConfig(prompts_per_round=2, n_samples_per_prompt=2, over_sample=3.0)
    # Sample 0 of every group is right, sample 1 wrong: every group has signal.
    engine = ScriptedEngine(lambda i: "#### 0")
    mgr = RolloutManager(cfg, data.train, tiny_tokenizer, engine, RewardMix.from_specs([RewardSpec(name="format")]), 0)
    batch = mgr.score(mgr.generate(1, version=0))
    assert batch.stats["rollout/generated_groups"] == 6
    # format reward is 1 for every sample: every group agrees, all filtered, nothing carried.
    assert batch.stats["rollout/groups_filtered"] == 6 and not batch.groups and not mgr.carry

    engine.texts_for = lambda i: "#### 0" if i % 2 == 0 else "no"
    batch = mgr.score(mgr.generate(2, version=1))
    # 6 groups with signal: 2 used, 2 carried (at most one round's worth), 2 dropped.
    assert len(batch.groups) == 2 and len(mgr.carry) == 2
    assert batch.stats["rollout/groups_carried"] == 2 and batch.stats["rollout/groups_dropped_stale"] == 2
    assert batch.stats["rollout/staleness_mean"] == 0.0 and {s.version for s in batch.samples} == {1}
    # Next round generates only what the carried groups do not cover, and uses carried first.
    carried = list(mgr.carry)
    nxt = mgr.generate(3, version=2)
    assert len(nxt.groups) == 6 - 2
    used = mgr.score(nxt)
    assert used.groups[:2] == carried
    # sampled by version 1, trained in round 3 by version 2: one version stale
    assert used.stats["rollout/staleness_mean"] == 1.0
    # Groups older than one round are not used.
    mgr.carry = [Group(0, [_sample(0, 1.0), _sample(0, 0.0)], round_generated=1)]
    late = mgr.score(mgr.generate(5, version=4))
    assert all(g.round_generated == 5 for g in late.groups)
    assert late.stats["rollout/groups_dropped_stale"] >= 1
    state = mgr.state_dict()
    assert state["carry"] and state["buffer"]["pos"] > 0


def test_prompts_too_long_are_skipped_and_counted(tiny_tokenizer):
    data = synthetic(load_config("tiny").data.synthetic.model_copy(update={"n_train": 40, "n_test": 5}), 0)
    from trainer.chat import encode_prompt

    lengths = sorted(len(encode_prompt(tiny_tokenizer, ex["messages"][:-1])) for ex in data.train)
    limit = lengths[len(lengths) // 2]
    cfg = RolloutConfig(prompts_per_round=4, n_samples_per_prompt=1, over_sample=1.0, max_prompt_tokens=limit)
    mgr = RolloutManager(cfg, data.train, tiny_tokenizer, ScriptedEngine(lambda i: "#### 1"),
                         RewardMix.from_specs([RewardSpec(name="math")]), 0)
    batch = mgr.generate(1, version=0)
    assert len(batch.groups) == 4 and all(len(g.samples[0].prompt_ids) <= limit for g in batch.groups)
    assert batch.stats["rollout/prompts_skipped_too_long"] > 0


def test_prompts_that_fill_the_policys_context_are_skipped_and_counted(tiny_tokenizer):
    """A prompt as long as the policy's context (model.max_position) leaves no room for a response:
    skipped and counted like one over rollout.max_prompt_tokens (it was generated into an empty
    response, reward 0); a policy almost no prompt fits is told so, naming its context."""
    data = synthetic(load_config("tiny").data.synthetic.model_copy(update={"n_train": 40, "n_test": 5}), 0)
    from trainer.chat import encode_prompt

    lengths = sorted(len(encode_prompt(tiny_tokenizer, ex["messages"][:-1])) for ex in data.train)
    limit = lengths[len(lengths) // 2]
    cfg = RolloutConfig(prompts_per_round=4, n_samples_per_prompt=1, over_sample=1.0)
    assert cfg.max_prompt_tokens > lengths[-1]  # the setting alone skips none
    mgr = RolloutManager(cfg, data.train, tiny_tokenizer, ScriptedEngine(lambda i: "#### 1"),
                         RewardMix.from_specs([RewardSpec(name="math")]), 0, context=limit + 1)
    batch = mgr.generate(1, version=0)
    assert len(batch.groups) == 4 and all(len(g.samples[0].prompt_ids) <= limit for g in batch.groups)
    assert batch.stats["rollout/prompts_skipped_too_long"] > 0
    mgr = RolloutManager(cfg, data.train, tiny_tokenizer, ScriptedEngine(lambda i: "#### 1"),
                         RewardMix.from_specs([RewardSpec(name="math")]), 0, context=lengths[0])
    with pytest.raises(RewardError, match=f"almost every prompt fills the policy's context of {lengths[0]} tokens; "
                                          "raise model.max_position"):
        mgr.generate(1, version=0)


@pytest.mark.parametrize("temperature, top_p", [(1.0, 1.0), (0.7, 0.8)])
def test_hf_engine_logprobs_match_trainer_logprobs(tiny_tokenizer, temperature, top_p):
    """Generation (KV cache, left padding, batched) and the trainer's full forward (right padding)
    give the same per-token logprobs on the same weights: within 1e-4 in fp32.

    Under top-p they are the tempered distribution's, not renormalised over the nucleus: what SGLang
    returns (its sampler's log(softmax(logits / T))) and what the trainer computes, so the TIS
    ratio compares like with like."""
    cfg = load_config("tiny", ["model.hidden_size=32", "model.num_layers=2", "model.intermediate_size=64"])
    model = build_model(cfg.model, tiny_tokenizer, seed=0)
    data = synthetic(cfg.data.synthetic.model_copy(update={"n_train": 20, "n_test": 2}), 0)
    from trainer.chat import encode_prompt

    prompts = [encode_prompt(tiny_tokenizer, ex["messages"][:-1]) for ex in data.train[:6]]
    engine = HFEngine(model, tiny_tokenizer, batch_size=4)
    gens = engine.generate(prompts, SamplingParams(max_new_tokens=12, temperature=temperature, top_p=top_p, seed=1))
    samples = [Sample(0, g.prompt_ids, g.token_ids, g.logprobs, g.text, g.finish_reason) for g in gens]
    packed = pack(samples, [0.0] * len(samples), tiny_tokenizer.pad_token_id)
    with torch.no_grad():
        lp, _ = token_logprobs(model, packed.ids, packed.attn, temperature=temperature)
    diff = ((lp - packed.engine_logp).abs() * packed.mask).max().item()
    assert packed.mask.sum() > 20
    assert diff < 1e-4, diff
