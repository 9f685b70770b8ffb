"""Multi-turn episodes through the HF engine, token in, token out (trainer/rl/multiturn.py).

- stop strings end a sequence at the token that completes one, on the fast decoder and on HF
  `generate` (a model the fast decoder does not cover);
- three-turn episodes: the policy's tokens are appended exactly as sampled, each observation is
  the template's rendering (end of turn, tool message, next header) with loss mask 0, and the
  trainer's log-probs of the whole trajectory match the engine's within 1e-4 on every policy token;
- the round's metrics (turns, tool calls, errors, how episodes ended), and the token budget;
- resume: a run killed after a checkpoint in a multi-turn GRPO stage ends with the uninterrupted
  run's weights.
"""

import pytest
import torch

from trainer.config import load_config
from trainer.data import synthetic
from trainer.inference.generate import StopStrings, generate
from trainer.model import build_model
from trainer.inference.engines import HFEngine
from trainer.rl.envs import Environment, Episode, Step
from trainer.rl.logprobs import token_logprobs
from trainer.rl.orchestrator import RolloutManager
from trainer.rl.rewards import RewardMix
from trainer.rl.trajectory import pack

MODEL = ["model.hidden_size=32", "model.num_layers=2", "model.intermediate_size=64"]


class Scripted(Environment):
    """Answers every turn with a tool message naming the turn, and ends after `turns` of them."""

    def __init__(self, turns: int = 3) -> None:
        self.turns = turns

    def reset(self, example):
        return _Counting(example["messages"][:-1], self.turns)


class _Counting(Episode):
    def __init__(self, messages, turns):
        super().__init__(messages)
        self.left = turns

    def step(self, text):
        self.left -= 1
        if self.left == 0:
            return Step(done=True, reason="answer", reward=0.5)
        return Step(observation=[{"role": "tool", "name": "counter", "content": f"{self.left} turns left"}],
                    tool_calls=1, tool_errors=int(self.left % 2 == 0))


def _gpt2(tok):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=len(tok), n_embd=32, n_layer=1, n_head=2, n_positions=256,
                                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)).eval()


@pytest.mark.parametrize("kind", ["fast decoder", "HF generate"])
def test_generation_stops_at_the_token_that_completes_a_stop_string(tiny_tokenizer, kind):
    from trainer.chat import encode_prompt
    from trainer.inference.generate import decoder_for

    cfg = load_config("tiny", MODEL)
    model = build_model(cfg.model, tiny_tokenizer, seed=0) if kind == "fast decoder" else _gpt2(tiny_tokenizer)
    assert (decoder_for(model) is not None) == (kind == "fast decoder")
    data = synthetic(cfg.data.synthetic.model_copy(update={"n_train": 8, "n_test": 1}), 0)
    prompts = [encode_prompt(tiny_tokenizer, ex["messages"][:-1]) for ex in data.train]
    # one sequence a call: the same draws with and without stops, up to the stop
    plain = generate(model, tiny_tokenizer, prompts, 24, temperature=1.0, seed=3, batch_size=1)
    # stop strings that span tokens: the text of tokens 5 and 6 of three of the free sequences
    stop = tuple(dict.fromkeys(tiny_tokenizer.decode(g.token_ids[5:7]) for g in plain[:3]))
    cut = generate(model, tiny_tokenizer, prompts, 24, temperature=1.0, seed=3, stop=stop, batch_size=1)
    stopper = StopStrings(tiny_tokenizer, stop)
    hits = 0
    for a, b in zip(plain, cut):
        assert len(b.logprobs) == len(b.token_ids) and b.logprobs == a.logprobs[: len(b.logprobs)]
        end = stopper.end(a.token_ids)
        if end is not None:
            hits += 1
            assert b.token_ids == a.token_ids[:end] and b.finish_reason == "stop"
            assert any(s in tiny_tokenizer.decode(b.token_ids) for s in stop)
        else:
            assert b.token_ids == a.token_ids
    # batched (rows stop at different steps): each ends exactly where its first stop string completes
    for g in generate(model, tiny_tokenizer, prompts * 3, 24, temperature=1.0, seed=4, stop=stop, batch_size=8):
        end = stopper.end(g.token_ids)
        assert end == len(g.token_ids) if g.finish_reason == "stop" and g.token_ids[-1] != tiny_tokenizer.eos_token_id \
            else end is None
        hits += end is not None
    assert hits >= 3  # the test saw stops


def _manager(tok, model, *extra):
    cfg = load_config("tiny", MODEL + ["rollout.prompts_per_round=3", "rollout.n_samples_per_prompt=2",
                                       "rollout.over_sample=1", "rollout.max_response_tokens=10",
                                       "rollout.temperature=0.9", "rollout.dynamic_filter=none",
                                       "rollout.environment.name=tests.test_multiturn:Scripted",
                                       "rollout.environment.max_turns=5", "rollout.environment.max_tokens=200", *extra])
    data = synthetic(cfg.data.synthetic.model_copy(update={"n_train": 12, "n_test": 1}), 0)
    mgr = RolloutManager(cfg.rollout, data.train, tok, HFEngine(model, tok, batch_size=4),
                         RewardMix.from_specs(cfg.grpo.rewards), seed=0)
    return cfg, mgr


def test_three_turn_trajectories_are_token_in_token_out_and_match_the_trainer(tiny_tokenizer):
    cfg = load_config("tiny", MODEL)
    model = build_model(cfg.model, tiny_tokenizer, seed=0)
    cfg, mgr = _manager(tiny_tokenizer, model)
    batch = mgr.score(mgr.generate(1, version=0))
    samples = batch.samples
    assert len(samples) == 6
    header = tiny_tokenizer.decode(mgr.observations.end_of_turn)
    for s in samples:
        if s.finish_reason != "answer":
            continue  # a turn that ran out of tokens ends its episode early
        assert [t["role"] for t in s.turns] == ["assistant", "tool", "assistant", "tool", "assistant"]
        # three policy segments, two observations between them, each rendered by the template
        segments, cur = [], [s.loss_mask[0]]
        for a, b in zip(s.loss_mask, s.loss_mask[1:]):
            if a != b:
                segments.append(cur[0])
                cur = [b]
        segments.append(cur[0])
        assert segments == [1, 0, 1, 0, 1]
        obs = [i for i, m in zip(s.response_ids, s.loss_mask) if not m]
        text = tiny_tokenizer.decode(obs, skip_special_tokens=False)
        assert text.count("<|tool|>") == 2 and "2 turns left" in text and "1 turns left" in text
        assert text.startswith(header) and text.endswith("<|assistant|>")
        assert all(lp == 0.0 for lp, m in zip(s.engine_logprobs, s.loss_mask) if not m)
        assert s.components["environment"] == 0.5 and s.tool_calls == 2
    assert sum(s.finish_reason == "answer" for s in samples) >= 3
    assert batch.stats["rollout/tool_calls_mean"] > 1 and batch.stats["rollout/turns_mean"] > 2
    assert batch.stats["rollout/episode_end/answer"] >= 3
    # the trainer's forward over the whole trajectory: the engine's log-probs on every policy token
    packed = pack(samples, [0.0] * len(samples), tiny_tokenizer.pad_token_id)
    with torch.no_grad():
        lp, _ = token_logprobs(model, packed.ids, packed.attn, temperature=cfg.rollout.temperature)
    assert packed.mask.sum() > 40
    assert ((lp - packed.engine_logp).abs() * packed.mask).max().item() < 1e-4


def test_the_token_budget_ends_an_episode_before_its_observation(tiny_tokenizer):
    cfg = load_config("tiny", MODEL)
    model = build_model(cfg.model, tiny_tokenizer, seed=0)
    cfg, mgr = _manager(tiny_tokenizer, model, "rollout.environment.max_tokens=14", "rollout.min_response_tokens=10")
    batch = mgr.score(mgr.generate(1, version=0))
    for s in batch.samples:  # 10 policy tokens, then no room for an observation and another turn
        assert s.finish_reason == "token_budget" and len(s.response_ids) == 10 and s.trained_tokens == 10
    assert batch.stats["rollout/episode_end/token_budget"] == 6


@pytest.mark.slow
def test_a_multi_turn_grpo_stage_resumes_to_the_uninterrupted_runs_weights(tiny_tokenizer, tmp_path, caplog):
    """Three-turn episodes through rollout, reward, update and checkpoint (trainer.loop): a run
    stopped after round 3 and resumed from its round-2 checkpoint ends bitwise where the
    uninterrupted run does. (The SIGKILL variant of this on the CLI is tests/test_resume_kill.py's.)
    The last round's eval says its progress and its metrics by name."""
    import logging

    from trainer.grpo import GRPOTrainer
    from trainer.loop import run_round, run_rounds

    cfg = load_config("tiny", MODEL + [
        "grpo.rounds=4", "grpo.checkpoint_every=2", "grpo.eval_every=100", "rollout.prompts_per_round=3",
        "rollout.n_samples_per_prompt=4", "rollout.over_sample=1", "rollout.max_response_tokens=8",
        "rollout.dynamic_filter=none", "grpo.mini_batches=2", "grpo.micro_batch_size=4", "grpo.lr=1e-3",
        "rollout.environment.name=tests.test_multiturn:Scripted", "rollout.environment.max_tokens=120",
        "grpo.rewards=[{name: tests.test_grpo_update.digit_share}]"])
    data = synthetic(cfg.data.synthetic.model_copy(update={"n_train": 30, "n_test": 2}), 0)

    def trainer(work):
        return GRPOTrainer(cfg, build_model(cfg.model, tiny_tokenizer, 0), tiny_tokenizer, data.train, data.test, work)

    full = trainer(tmp_path / "full")
    caplog.set_level(logging.INFO, logger="trainer")
    run_rounds(full)
    assert full.history[-1]["rollout/turns_mean"] > 2 and full.history[-1]["update/optimizer_steps"] == 2
    said = [r.getMessage() for r in caplog.records]
    assert [m for m in said if m.startswith("round 4 eval: 2/2 episodes (100%), ")], said
    assert [m.split(":")[0] for m in said if m.startswith("round ") and ": reward " in m] == [
        "round 1/4", "round 2/4", "round 3/4", "round 4/4"]  # and how long the rest should take
    assert all(", about 0:" in m for m in said if m.startswith(("round 1/4:", "round 3/4:"))), said
    assert not [m for m in said if m.startswith("round 4/4:") and " left" in m], said
    line = next(m for m in said if m.startswith("round 4 eval: accuracy "))
    assert " format_rate " in line and " turns_mean " in line and line.endswith("s)"), line
    first = trainer(tmp_path / "crash")
    for _ in range(3):
        run_round(first)
    resumed = trainer(tmp_path / "crash")
    assert resumed.resumed_from == 2
    run_rounds(resumed)
    assert resumed.state_hash() == full.state_hash()


class ScriptedPolicy:
    """Writes scripted turns (a test double for the generator only): turn k of every episode is
    `turns[k]`, tokenized; log-probs -1."""

    concurrent = False

    def __init__(self, tok, turns):
        self.tok, self.turns, self.calls = tok, turns, 0

    def generate(self, prompts, params):
        from trainer.inference.generate import Generation

        text = self.turns[min(self.calls, len(self.turns) - 1)]
        self.calls += 1
        assert "</tool_call>" in params.stop
        ids = self.tok(text, add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id]
        ids = ids[: params.max_new_tokens]
        return [Generation(p, list(ids), [-1.0] * len(ids), self.tok.decode(ids, skip_special_tokens=True), "stop")
                for p in prompts]

    def update_weights(self, model_dir):
        pass

    def close(self):
        pass


def test_a_calculator_episode_through_the_orchestrator(tiny_tokenizer):
    """The calculator's answer reaches the trajectory as observation tokens, the final turn is
    graded by the configured rewards, and the tool metrics count the calls and their errors."""
    cfg = load_config("tiny", MODEL + ["rollout.prompts_per_round=2", "rollout.n_samples_per_prompt=2",
                                       "rollout.over_sample=1", "rollout.max_response_tokens=128",
                                       "rollout.dynamic_filter=none", "rollout.environment.name=calculator",
                                       "rollout.environment.max_tokens=1000"])
    data = synthetic(cfg.data.synthetic.model_copy(update={"n_train": 6, "n_test": 1}), 0)
    policy = ScriptedPolicy(tiny_tokenizer, [
        '<tool_call>{"name": "calculator", "arguments": {"expression": "48/2"}}</tool_call>',
        '<tool_call>{"name": "calculator", "arguments": {"expression": "1/0"}}</tool_call>',
        "so #### 24"])
    mgr = RolloutManager(cfg.rollout, data.train, tiny_tokenizer, policy, RewardMix.from_specs(cfg.grpo.rewards), 0)
    prompt_text = tiny_tokenizer.decode(mgr.generate(1, version=0).samples[0].prompt_ids)
    assert "Tools: calculator(expression: string)" in prompt_text and "Call one as <tool_call>" in prompt_text
    policy.calls = 0
    batch = mgr.score(mgr.generate(2, version=1))
    for s in batch.samples:
        assert s.finish_reason == "answer" and s.tool_calls == 2 and s.tool_errors == 1
        obs = tiny_tokenizer.decode([i for i, m in zip(s.response_ids, s.loss_mask) if not m])
        assert "<|tool|>24<|end|>" in obs and "division by zero" in obs
        assert s.text.endswith("so #### 24") and set(s.components) == {"task"}
        assert [t["role"] for t in s.turns] == ["assistant", "tool", "assistant", "tool", "assistant"]
    assert batch.stats["rollout/tool_calls_mean"] == 2.0 and batch.stats["rollout/tool_errors"] == 4.0
    assert batch.stats["rollout/tool_success_rate"] == 0.5 and batch.stats["rollout/turns_mean"] == 3.0


@pytest.mark.slow
def test_three_turns_on_smollm2_real_weights_and_chat_template(smollm2):
    """SmolLM2-135M-Instruct (real weights, tokenizer, ChatML template): each observation is
    `<|im_end|>\\n<|im_start|>tool\\n...<|im_end|>\\n<|im_start|>assistant\\n` as the template renders
    it, and the trainer's log-probs over the three-turn trajectories match the engine's."""
    _, model, tok = smollm2
    cfg = load_config("smollm2-135m", ["rollout.prompts_per_round=2", "rollout.n_samples_per_prompt=2",
                                       "rollout.over_sample=1", "rollout.max_response_tokens=12",
                                       "rollout.temperature=0.9", "rollout.dynamic_filter=none",
                                       "rollout.environment.name=tests.test_multiturn:Scripted",
                                       "rollout.environment.max_tokens=200"])
    examples = [{"id": f"q{i}", "answer": "1", "messages": [{"role": "user", "content": q},
                                                             {"role": "assistant", "content": ""}]}
                for i, q in enumerate(["What is 2+2?", "Name a colour."])]
    mgr = RolloutManager(cfg.rollout, examples, tok, HFEngine(model, tok, batch_size=4),
                         RewardMix.from_specs(cfg.grpo.rewards), 0)
    batch = mgr.score(mgr.generate(1, version=0))
    assert tok.decode(mgr.observations.end_of_turn) == "<|im_end|>\n"
    full = [s for s in batch.samples if s.finish_reason == "answer"]
    assert full, [s.finish_reason for s in batch.samples]
    for s in full:
        obs = tok.decode([i for i, m in zip(s.response_ids, s.loss_mask) if not m])
        assert obs == ("<|im_end|>\n<|im_start|>tool\n2 turns left<|im_end|>\n<|im_start|>assistant\n"
                       "<|im_end|>\n<|im_start|>tool\n1 turns left<|im_end|>\n<|im_start|>assistant\n")
    packed = pack(batch.samples, [0.0] * len(batch.samples), tok.pad_token_id)
    with torch.no_grad():
        lp, _ = token_logprobs(model, packed.ids, packed.attn, temperature=0.9)
    diff = ((lp - packed.engine_logp).abs() * packed.mask).max().item()
    print(f"\nSmolLM2 three-turn trajectories: trainer vs engine log-prob max |diff| {diff:.2e}")
    assert diff < 1e-3


def test_sft_tool_rows_and_calculator_episodes_are_the_same_tokens(tmp_path):
    """tiny-calculator's SFT conversations (data.synthetic.tool_fraction) and the calculator
    environment's episodes agree token for token: a policy that writes an SFT row's assistant turns
    gets exactly the row's tokens back (the prompt, its call, the tool's answer,
    the end-of-turn and role markers), so what SFT teaches is what RL samples."""
    import json

    from trainer.chat import encode_chat
    from trainer.rl.envs import Calculator
    from trainer.rl.multiturn import Observations, prompt_ids
    from trainer.tokenizer import train_tokenizer

    cfg = load_config("tiny-calculator")
    data = synthetic(cfg.data.synthetic.model_copy(update={"n_train": 400, "n_test": 5}), 0)
    tok = train_tokenizer((m["content"] for ex in data.train for m in ex["messages"]), 384, tmp_path / "tok",
                          cfg.tokenizer.added_tokens)
    tool_rows = [ex for ex in data.train if len(ex["messages"]) == 4]
    assert 80 < len(tool_rows) < 160  # tool_fraction 0.3 of 400
    obs = Observations(tok)
    env = Calculator()
    for ex in tool_rows[:20]:
        sft = encode_chat(tok, ex["messages"], 512).input_ids
        episode = env.reset(ex)
        ids = prompt_ids(tok, episode, cfg.rollout.environment.describe_tools)
        call, final = ex["messages"][1]["content"], ex["messages"][3]["content"]
        ids += tok(call, add_special_tokens=False)["input_ids"]  # the policy's first turn, stopped at </tool_call>
        step = episode.step(call)
        assert step.observation[0]["content"] == ex["messages"][2]["content"]  # the calculator agrees with the data
        ids += obs(step.observation)
        ids += tok(final, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        assert episode.step(final).reason == "answer"
        assert ids == sft, (tok.decode(ids), tok.decode(sft))
        assert json.loads(call[len("<tool_call>"):-len("</tool_call>")])["name"] == "calculator"
    # the markers are one token each and stay in decoded text
    for marker in ("<tool_call>", "</tool_call>", "<|tool|>"):
        assert len(tok(marker, add_special_tokens=False)["input_ids"]) == 1
    assert "<tool_call>" in tok.decode(tok("<tool_call>{}", add_special_tokens=False)["input_ids"], skip_special_tokens=True)


class Counted:
    """A progress bar that records each `update`."""

    def __init__(self) -> None:
        self.updates: list[int] = []

    def update(self, n: int = 1) -> None:
        self.updates.append(n)


@pytest.mark.parametrize("max_turns, per_turn", [(3, [0, 3]), (1, [0, 3])])
def test_episodes_are_counted_as_they_end(tiny_tokenizer, caplog, max_turns, per_turn):
    """A multi-turn eval says how many episodes have ended: each turn counts the episodes it ended
    (a tool call ends none; the answer after it ends all three), and those play cuts at its
    max_turns count when it stops; the eval's last progress line has them all."""
    import logging

    from trainer.config import EvalConfig
    from trainer.evaluate import evaluate
    from trainer.rl.multiturn import Observations, play
    from trainer.inference.engines import SamplingParams
    from trainer.rl.envs import environment_of

    cfg = load_config("tiny", ["rollout.environment.name=calculator", "rollout.environment.max_tokens=1000",
                               "rollout.environment.max_turns=3"])
    examples = synthetic(cfg.data.synthetic.model_copy(update={"n_train": 3, "n_test": 1}), 0).train
    turns = ['<tool_call>{"name": "calculator", "arguments": {"expression": "48/2"}}</tool_call>', "so #### 24"]
    env = cfg.rollout.environment
    bar = Counted()
    trajs = play(ScriptedPolicy(tiny_tokenizer, turns), tiny_tokenizer, [environment_of(env).reset(ex) for ex in examples],
                 SamplingParams(64, temperature=0.0), max_turns, env.token_budget(64), Observations(tiny_tokenizer),
                 progress=bar)
    assert all(t.done for t in trajs) and bar.updates == per_turn
    caplog.set_level(logging.INFO, logger="trainer.progress")
    evaluate(None, tiny_tokenizer, examples, EvalConfig(max_new_tokens=64), engine=ScriptedPolicy(tiny_tokenizer, turns),
             environment=env, label="eval (sft) held-out")
    said = [r.getMessage() for r in caplog.records if r.name == "trainer.progress"]
    assert len(said) == 1 and said[0].startswith("eval (sft) held-out: 3/3 episodes (100%), "), said
