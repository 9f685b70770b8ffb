"""PPO with a critic (grpo.advantage=gae): GAE and the clipped value loss against hand-computed
numbers, the environment's tokens ignored by both, and the trainer's critic: built from the
policy's trunk, trained alone in its warm-up rounds, saved in every checkpoint (a run stopped
after round 3 and resumed from round 2 ends with the uninterrupted run's policy, critic and
optimizers), exported as a folder `grpo.critic.path` takes, and bad settings named."""

import math

import pytest
import torch

from trainer.config import ConfigError, load_config
from trainer.data import synthetic
from trainer.errors import InputError
from trainer.grpo import GRPOTrainer
from trainer.loop import run_round, run_rounds
from trainer.model import build_model
from trainer.rl import losses

OVERRIDES = ["model.hidden_size=32", "model.num_layers=2", "model.intermediate_size=64",
             "grpo.rounds=4", "grpo.checkpoint_every=2", "grpo.eval_every=100", "rollout.prompts_per_round=3",
             "rollout.n_samples_per_prompt=4", "rollout.over_sample=2", "rollout.max_response_tokens=12",
             "rollout.dynamic_filter=none", "grpo.mini_batches=2", "grpo.epochs=2", "grpo.micro_batch_size=4",
             "grpo.lr=1e-3", "grpo.advantage=gae", "grpo.critic.lr=1e-3", "grpo.critic.warmup_rounds=1",
             "grpo.rewards=[{name: tests.test_grpo_update.digit_share}]"]  # a dense reward: values to learn


# ---------------------------------------------------------------- the pure functions

def test_gae_matches_a_hand_computed_example():
    """Three policy tokens, reward 1 at the last, gamma 0.9, lambda 0.8, values 0.5 / 0.2 / 0.4:
    delta = (0 + .9*.2 - .5, 0 + .9*.4 - .2, 1 + 0 - .4) = (-.32, .16, .6);
    A3 = .6, A2 = .16 + .72*.6 = .592, A1 = -.32 + .72*.592 = .10624; R = A + V."""
    mask = torch.tensor([[0.0, 1, 1, 1, 0]])  # a prompt position before, padding after
    values = torch.tensor([[9.0, 0.5, 0.2, 0.4, 9.0]])
    rewards = losses.last_token_rewards(mask, torch.tensor([1.0]))
    assert rewards.tolist() == [[0, 0, 0, 1, 0]]
    adv, ret = losses.gae(rewards, values, mask, gamma=0.9, lam=0.8)
    assert adv[0].tolist() == pytest.approx([0, 0.10624, 0.592, 0.6, 0])
    assert ret[0].tolist() == pytest.approx([0, 0.60624, 0.792, 1.0, 0])


def test_gae_with_lambda_one_and_gamma_one_is_reward_minus_value():
    mask = torch.ones(2, 4)
    values = torch.tensor([[0.1, 0.2, 0.3, 0.4], [0.0, 0.0, 0.0, 0.0]])
    rewards = losses.last_token_rewards(mask, torch.tensor([1.0, -1.0]))
    adv, ret = losses.gae(rewards, values, mask, 1.0, 1.0)
    assert adv.flatten().tolist() == pytest.approx([0.9, 0.8, 0.7, 0.6, -1, -1, -1, -1])
    assert ret.flatten().tolist() == pytest.approx([1, 1, 1, 1, -1, -1, -1, -1])


def test_the_environments_tokens_are_skipped_by_gae_and_the_value_loss():
    """A two-turn episode: policy tokens, a tool's answer (mask 0), policy tokens. The tool's tokens
    get no advantage, and their values, whatever they are, change nothing: the next state of the
    first turn's last token is the second turn's first. Nor do they reach the value loss or its
    gradient."""
    mask = torch.tensor([[1.0, 1, 0, 0, 1, 1]])
    base = torch.tensor([[0.3, 0.1, 0.0, 0.0, 0.6, 0.2]])
    wild = base.clone()
    wild[0, 2:4] = torch.tensor([50.0, -50.0])
    rewards = losses.last_token_rewards(mask, torch.tensor([1.0]))
    assert rewards[0].tolist() == [0, 0, 0, 0, 0, 1]
    a1, r1 = losses.gae(rewards, base, mask, 0.9, 0.95)
    a2, r2 = losses.gae(rewards, wild, mask, 0.9, 0.95)
    assert torch.equal(a1, a2) and torch.equal(r1, r2)
    assert a1[0, 2:4].tolist() == [0, 0]
    # the compressed episode (the policy's four tokens alone) gives the same advantages
    a3, _ = losses.gae(torch.tensor([[0.0, 0, 0, 1]]), base[:, [0, 1, 4, 5]], torch.ones(1, 4), 0.9, 0.95)
    assert a1[0, [0, 1, 4, 5]].tolist() == pytest.approx(a3[0].tolist())

    v = wild.clone().requires_grad_(True)
    per_token, _ = losses.clipped_value_loss(v, base, r1, clip=0.2)
    loss = losses.aggregate(per_token, mask, "token-mean")
    loss.backward()
    assert v.grad[0, 2:4].tolist() == [0, 0] and bool((v.grad[0, [0, 1, 4, 5]] != 0).all())


def test_clipped_value_loss_by_hand():
    """old 0, return 1, clip 0.2: V = 0.5 is clipped to 0.2, whose loss (.5 * .8^2 = .32) is the larger;
    V = 0.1 is inside the clip (.5 * .9^2); V = -0.5 is clipped to -0.2 (.5 * 1.2^2 = .72), but the
    unclipped .5 * 1.5^2 = 1.125 is larger and counts."""
    v = torch.tensor([0.5, 0.1, -0.5])
    loss, clipped = losses.clipped_value_loss(v, torch.zeros(3), torch.ones(3), 0.2)
    assert loss.tolist() == pytest.approx([0.32, 0.405, 1.125])
    assert clipped.tolist() == [True, False, False]
    unclipped, _ = losses.clipped_value_loss(v, torch.zeros(3), torch.ones(3), None)
    assert unclipped.tolist() == pytest.approx([0.125, 0.405, 1.125])


def test_whiten_and_explained_variance_read_only_the_policys_tokens():
    x = torch.tensor([[1.0, 2.0, 100.0], [3.0, 4.0, -100.0]])
    mask = torch.tensor([[1.0, 1, 0], [1, 1, 0]])
    w = losses.whiten(x, mask)
    on = w[mask > 0]
    assert float(on.mean()) == pytest.approx(0, abs=1e-6) and float(on.pow(2).mean()) == pytest.approx(1, rel=1e-4)
    assert w[:, 2].tolist() == [0, 0]
    returns = torch.tensor([[1.0, 2.0, 0.0], [3.0, 4.0, 0.0]])
    assert losses.explained_variance(returns + torch.tensor([[0, 0, 7.0], [0, 0, -7.0]]), returns, mask) == 1.0
    assert losses.explained_variance(torch.full_like(returns, 2.5), returns, mask) == pytest.approx(0.0)
    assert math.isnan(losses.explained_variance(returns, torch.ones_like(returns), mask))


def test_last_token_rewards_of_a_row_without_policy_tokens_is_zero():
    mask = torch.tensor([[0.0, 0, 0], [0, 1, 0]])
    assert losses.last_token_rewards(mask, torch.tensor([5.0, 2.0])).tolist() == [[0, 0, 0], [0, 2, 0]]


def test_gae_time_grows_linearly_with_the_length():
    """One pass over T: doubling the length at most about doubles the time (a margin of 3x)."""
    import time

    def seconds(T):
        mask = torch.ones(8, T)
        r = losses.last_token_rewards(mask, torch.ones(8))
        v = torch.rand(8, T)
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            losses.gae(r, v, mask, 1.0, 0.95)
            best = min(best, time.perf_counter() - t0)
        return best

    seconds(256)
    assert seconds(4096) < 3 * 2 * seconds(2048)


# ---------------------------------------------------------------- the trainer's critic

def _run(cfg, tok, data, work, crash_after=None):
    trainer = GRPOTrainer(cfg, build_model(cfg.model, tok, 0), tok, data.train, data.test, work)
    while not trainer.done():
        run_round(trainer)
        if crash_after == trainer.round:
            return None
    return trainer


@pytest.fixture(scope="module")
def data():
    cfg = load_config("tiny", OVERRIDES)
    return synthetic(cfg.data.synthetic.model_copy(update={"n_train": 40, "n_test": 4}), 0)


@pytest.mark.slow
def test_the_critic_warms_up_then_both_train_and_a_resume_is_exact(tiny_tokenizer, data, tmp_path):
    cfg = load_config("tiny", OVERRIDES)
    full = _run(cfg, tiny_tokenizer, data, tmp_path / "full")
    h = full.history
    assert [x["critic/policy_trained"] for x in h] == [0, 1, 1, 1]  # one warm-up round
    assert h[0]["update/optimizer_steps"] == 0 and all(x["update/optimizer_steps"] == 4 for x in h[1:])
    assert all(x["critic/optimizer_steps"] == 4 for x in h)
    assert h[0]["critic/values_mean"] == 0.0  # the value head starts at zero
    assert all(x["critic/value_loss"] > 0 and math.isfinite(x["critic/grad_norm"]) for x in h)
    assert h[-1]["critic/values_mean"] != 0.0
    for key in ("critic/explained_variance", "critic/returns_mean", "critic/value_clip_frac"):
        assert key in h[-1]

    assert _run(cfg, tiny_tokenizer, data, tmp_path / "crash", crash_after=3) is None
    tag = tmp_path / "crash" / "checkpoints" / "step00000002"
    assert (tag / "critic").is_dir()  # the critic's weights and optimizer, in the policy's checkpoint
    resumed = GRPOTrainer(cfg, build_model(cfg.model, tiny_tokenizer, 0), tiny_tokenizer, data.train, data.test,
                          tmp_path / "crash")
    assert resumed.resumed_from == 2
    run_rounds(resumed)
    from trainer import engine as ds

    assert ds.state_dict_hash(resumed.critic.module) == ds.state_dict_hash(full.critic.module)
    assert ds.state_dict_hash(resumed.ds.module) == ds.state_dict_hash(full.ds.module)
    assert resumed.state_hash() == full.state_hash()
    assert [x["critic/value_loss"] for x in resumed.history] == [x["critic/value_loss"] for x in full.history]

    # the exported critic is a folder grpo.critic.path takes, with the trained values
    full.export_critic(tmp_path / "critic")
    again = load_config("tiny", OVERRIDES + [f"grpo.critic.path={tmp_path / 'critic'}"])
    from trainer.rl.critic import build_critic

    loaded = build_critic(full.ds.module, again.grpo.critic)
    assert ds.state_dict_hash(loaded) == ds.state_dict_hash(full.critic.module)


def test_a_checkpoint_without_a_critic_is_not_resumed_with_one(tiny_tokenizer, data, tmp_path):
    """A GRPO checkpoint (no critic) in a gae stage's folder: nothing loads, and the error says why."""
    group = load_config("tiny", [o for o in OVERRIDES if not o.startswith(("grpo.advantage", "grpo.critic"))])
    assert _run(group, tiny_tokenizer, data, tmp_path, crash_after=2) is None
    cfg = load_config("tiny", OVERRIDES)
    from trainer.checkpoint import CheckpointError

    with pytest.raises(CheckpointError, match="holds no critic"):
        GRPOTrainer(cfg, build_model(cfg.model, tiny_tokenizer, 0), tiny_tokenizer, data.train, data.test, tmp_path)


def test_bad_critic_settings_are_named_before_the_run(tiny_tokenizer, tmp_path):
    with pytest.raises(ConfigError, match="grpo.critic.layers"):
        load_config("tiny", OVERRIDES + ["grpo.critic.layers=0"])
    with pytest.raises(ConfigError, match="grpo.advantage"):
        load_config("tiny", ["grpo.advantage=ppo"])
    from trainer.rl.critic import build_critic

    policy = build_model(load_config("tiny", OVERRIDES).model, tiny_tokenizer, 0)
    cfg = load_config("tiny", OVERRIDES + ["grpo.critic.layers=3"])
    with pytest.raises(InputError, match=r"grpo.critic.layers=3, but the policy has 2 layers"):
        build_critic(policy, cfg.grpo.critic)
    policy.save_pretrained(tmp_path / "lm")  # a causal LM: no value head
    cfg = load_config("tiny", OVERRIDES + [f"grpo.critic.path={tmp_path / 'lm'}"])
    with pytest.raises(InputError, match="grpo.critic.path: .* has no value head: its architecture is LlamaForCausalLM"):
        build_critic(policy, cfg.grpo.critic)
    cfg = load_config("tiny", OVERRIDES + [f"grpo.critic.path={tmp_path / 'nothing'}"])
    with pytest.raises(InputError, match="has no config.json"):
        build_critic(policy, cfg.grpo.critic)


def test_the_cli_refuses_a_critic_path_without_a_value_head_before_anything_runs(tiny_tokenizer, tmp_path, capsys):
    from flows.cli import main

    build_model(load_config("tiny", OVERRIDES).model, tiny_tokenizer, 0).save_pretrained(tmp_path / "lm")
    code = main(["speedrun", "--preset", "tiny", "--set", f"artifact_root={tmp_path / 'art'}",
                 "--set", "grpo.advantage=gae", "--set", f"grpo.critic.path={tmp_path / 'lm'}"])
    assert code == 2
    err = capsys.readouterr().err
    assert "grpo.critic.path:" in err and "has no value head" in err and "leave grpo.critic.path unset" in err
    assert not (tmp_path / "art").exists()  # nothing ran, nothing was written
