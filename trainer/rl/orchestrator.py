"""Rollouts, SLIME-style: the orchestrator owns the data buffer, the engine and the rewards; it
over-samples groups, scores them, filters those without signal and carries the surplus over, and
hands the round's `RolloutBatch` of trajectories (`trainer.rl.trajectory`) to the trainer.

Every sample records the policy version that produced it (the number of updates published before
its round's generation); a carried-over group trains one version later than it was sampled, which
`rollout/staleness_mean` reports. `plan` (which prompts) and `produce` (the samples) are separate
steps: async rounds (`trainer.rl.async_rollout`) plan here, in round order, and produce beside
the trainer.
"""

from __future__ import annotations

import math
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from trainer import engine as ds
from trainer.chat import encode_prompt
from trainer.config import RolloutConfig
from trainer.data import prompt_messages
from trainer.inference.engines import RolloutEngine, SamplingParams
from trainer.rl.envs import environment_of, reset_episode
from trainer.rl.multiturn import Observations, play, tool_use
from trainer.rl.rewards import RewardError, RewardMix
from trainer.rl.trajectory import Group, RolloutBatch, Sample


MAX_CARRY_AGE = 1  # rounds a surplus group may wait before it is dropped
CHUNK_SEED_STRIDE = 10_000_019  # seed offset between a round's generation chunks


# ---------------------------------------------------------------- data buffer

class DataBuffer:
    """Prompts in a seeded order that is reshuffled every epoch; its position is checkpointed."""

    def __init__(self, n: int, seed: int) -> None:
        if n <= 0:
            raise ValueError("rollout data buffer is empty: the train split has no prompts")
        self.n, self.seed, self.epoch, self.pos = n, seed, 0, 0
        self._order = self._perm()

    def _perm(self) -> list[int]:
        g = torch.Generator().manual_seed(self.seed * 7919 + self.epoch)
        return torch.randperm(self.n, generator=g).tolist()

    def take(self, k: int) -> list[int]:
        out = []
        while len(out) < k:
            if self.pos >= self.n:
                self.epoch, self.pos = self.epoch + 1, 0
                self._order = self._perm()
            step = min(k - len(out), self.n - self.pos)
            out.extend(self._order[self.pos : self.pos + step])
            self.pos += step
        return out

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "pos": self.pos}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.pos = state["epoch"], state["pos"]
        self._order = self._perm()


# ---------------------------------------------------------------- manager

def groups_per_round(cfg: RolloutConfig) -> int:
    """Groups a round asks for before the filter: prompts_per_round x over_sample, rounded up."""
    return math.ceil(cfg.prompts_per_round * cfg.over_sample)


def groups_per_chunk(cfg: RolloutConfig) -> int:
    """Groups per generate call (a chunk): the unit of work the ranks share out."""
    return max(1, cfg.batch_size // cfg.n_samples_per_prompt)


def keep_group(group: Group, mode: str) -> bool:
    """The dynamic-sampling filter: `nonzero_std` drops groups whose rewards all agree."""
    if mode == "none":
        return True
    r = group.rewards()
    return max(r) - min(r) > 1e-9


def episode_stats(samples: list[Sample]) -> dict[str, float]:
    """Per-round metrics of multi-turn episodes: turns, tool calls and errors, and how episodes ended."""
    if not samples:
        return {}
    stats = {f"rollout/{k}": v for k, v in tool_use(samples).items()}
    stats["rollout/observation_tokens_mean"] = statistics.fmean(len(s.response_ids) - s.trained_tokens for s in samples)
    for s in samples:
        key = f"rollout/episode_end/{s.finish_reason}"
        stats[key] = stats.get(key, 0.0) + 1.0
    return stats


class RolloutManager:
    def __init__(self, cfg: RolloutConfig, examples: list[dict[str, Any]], tok, engine: RolloutEngine | None,
                 rewards: RewardMix | None, seed: int, on_bad_reward: str = "error", context: int | None = None) -> None:
        self.cfg, self.examples, self.tok, self.engine, self.rewards = cfg, examples, tok, engine, rewards
        self.seed, self.on_bad_reward = seed, on_bad_reward
        # the policy's context (max_position_embeddings): a prompt that fills it leaves no room for a
        # response, so it is skipped and counted as too long, as one over rollout.max_prompt_tokens is
        self.context = context
        # async rounds (rollout.async_steps > 0) train every group on the round it was generated for:
        # a carried group would be one version older than the bound allows, so the surplus is dropped
        self.carry_over = cfg.async_steps == 0
        self.buffer = DataBuffer(len(examples), seed)
        self.carry: list[Group] = []
        self._prompt_cache: dict[int, list[int]] = {}
        env = cfg.environment
        self.environment = environment_of(env) if env.multi_turn else None
        self.max_tokens = env.token_budget(cfg.max_response_tokens)
        self.observations = Observations(tok) if env.multi_turn else None

    def _prompt(self, i: int) -> list[int]:
        if i not in self._prompt_cache:
            self._prompt_cache[i] = encode_prompt(self.tok, prompt_messages(self.examples[i]))
        return self._prompt_cache[i]

    def plan(self) -> tuple[list[int], int]:
        """The next round's prompts (example indices) from the data buffer, enough to fill a round
        after filtering (over-sampling) less the carried-over groups; and how many were skipped as
        too long. Advances the buffer: plans are made in round order."""
        cfg = self.cfg
        want = max(0, groups_per_round(cfg) - len(self.carry))
        longest = cfg.max_prompt_tokens if self.context is None else min(cfg.max_prompt_tokens, self.context - 1)
        indices, too_long = [], 0
        while len(indices) < want:
            for i in self.buffer.take(want - len(indices)):
                if len(self._prompt(i)) > longest:
                    too_long += 1
                    if too_long > 10 * max(want, 1):
                        if longest < cfg.max_prompt_tokens:
                            raise RewardError(f"rollout: almost every prompt fills the policy's context of "
                                              f"{self.context} tokens; raise model.max_position (a model built "
                                              "from its config) or use shorter problems")
                        raise RewardError(f"rollout.max_prompt_tokens={cfg.max_prompt_tokens}: almost every "
                                          "prompt is longer; raise it")
                else:
                    indices.append(i)
        return indices, too_long

    def generate(self, round_: int, version: int) -> RolloutBatch:
        """The round's groups from the policy at `version` (updates published so far)."""
        indices, too_long = self.plan()
        return self.produce(round_, version, indices, too_long)

    def produce(self, round_: int, version: int, indices: list[int], too_long: int = 0) -> RolloutBatch:
        """n samples for each planned prompt from the engine's policy (`version`), unscored. Runs
        in the trainer's process, or beside it (`trainer.rl.async_rollout`) for async rounds."""
        cfg = self.cfg
        t0 = time.perf_counter()
        # Groups are generated in chunks of up to rollout.batch_size sequences, each with its own seed,
        # and the ranks share the chunks out (chunk c on rank c % world): the samples do not depend on
        # how many ranks there are. `score` gathers every rank's groups back in chunk order. An engine
        # that serves several calls at once (SGLang) gets all of this rank's chunks together: the
        # round is in flight at once, not one chunk's longest sample after another.
        n = cfg.n_samples_per_prompt
        per_chunk = groups_per_chunk(cfg)
        chunks = [indices[i : i + per_chunk] for i in range(0, len(indices), per_chunk)]
        mine = list(range(ds.rank(), len(chunks), ds.world_size()))

        def generate_chunk(c: int) -> list[Sample]:
            params = SamplingParams(cfg.max_response_tokens, cfg.temperature, cfg.top_p,
                                    seed=self.seed * 100_003 + round_ + CHUNK_SEED_STRIDE * c,
                                    min_new_tokens=cfg.min_response_tokens)
            examples = [i for i in chunks[c] for _ in range(n)]
            if self.environment is None:  # one turn: the prompt, the policy's answer
                gens = self.engine.generate([self._prompt(i) for i in examples], params)
                return [Sample(i, g.prompt_ids, g.token_ids, g.logprobs, g.text, g.finish_reason, version=version)
                        for i, g in zip(examples, gens)]
            episodes = [reset_episode(self.environment, self.examples[i]) for i in examples]
            trajs = play(self.engine, self.tok, episodes, params, cfg.environment.max_turns, self.max_tokens,
                         self.observations, cfg.environment.describe_tools)
            return [Sample(i, t.prompt, t.ids, t.logprobs, "\n".join(t.texts), t.reason, loss_mask=t.mask,
                           version=version, turns=t.turns, tool_calls=t.tool_calls, tool_errors=t.tool_errors,
                           env_reward=t.reward) for i, t in zip(examples, trajs)]

        if getattr(self.engine, "concurrent", False) and len(mine) > 1:
            with ThreadPoolExecutor(len(mine), thread_name_prefix="rollout-chunk") as pool:
                generated = list(pool.map(generate_chunk, mine))
        else:
            generated = [generate_chunk(c) for c in mine]
        groups, chunk_of, n_tokens = [], [], 0
        for c, samples in zip(mine, generated):
            n_tokens += sum(s.trained_tokens for s in samples)
            for g_i, ex_i in enumerate(chunks[c]):
                groups.append(Group(ex_i, samples[g_i * n : (g_i + 1) * n], round_))
                chunk_of.append(c)
        seconds = time.perf_counter() - t0
        return RolloutBatch(round_, groups, {
            "rollout/prompts_skipped_too_long": too_long, "rollout/generated_groups": len(groups),
            "rollout/generated_tokens": n_tokens, "time/generate_seconds": seconds,
        }, chunk_of)

    def _gather(self, batch: RolloutBatch, bad: int) -> tuple[list[Group], int]:
        """Every rank's scored groups, in chunk order (the one-rank order); sums the per-rank counts."""
        parts = ds.gather_objects((batch.chunks, batch.groups, batch.stats, bad))
        if len(parts) == 1:
            return batch.groups, bad
        ordered = sorted((c, r, k, g) for r, (chunks, groups, _, _) in enumerate(parts)
                         for k, (c, g) in enumerate(zip(chunks, groups)))
        stats = [p[2] for p in parts]
        batch.stats["rollout/generated_groups"] = sum(s["rollout/generated_groups"] for s in stats)
        batch.stats["rollout/generated_tokens"] = sum(s["rollout/generated_tokens"] for s in stats)
        batch.stats["time/generate_seconds"] = max(s["time/generate_seconds"] for s in stats)
        return [g for *_, g in ordered], sum(p[3] for p in parts)

    def score(self, batch: RolloutBatch) -> RolloutBatch:
        """Rewards, the filter, and carry-over: returns the round's training batch."""
        cfg = self.cfg
        t0 = time.perf_counter()
        samples = batch.samples
        totals, parts = self.rewards.score([s.text for s in samples], [self.examples[s.example_index] for s in samples])
        bad = 0
        for k, (s, total) in enumerate(zip(samples, totals)):
            s.components = {name: parts[name][k] for name in parts}
            if s.env_reward is not None:  # an environment that grades its episodes adds its reward to the mix
                s.components["environment"] = s.env_reward
                total = total + s.env_reward if total is not None and math.isfinite(s.env_reward) else None
            if total is None:
                if self.on_bad_reward == "error" and k in self.rewards.raised:
                    raise RewardError(f"grpo.rewards: {self.rewards.raised[k]} on example "
                                      f"{self.examples[s.example_index]['id']!r} (its traceback is in the log); fix "
                                      "the reward, or set grpo.on_bad_reward=skip to drop such samples")
                if self.on_bad_reward == "error":
                    raise RewardError(f"grpo.rewards: a reward returned a non-finite value {s.components} for "
                                      f"example {self.examples[s.example_index]['id']!r}; fix the reward or set "
                                      "grpo.on_bad_reward=skip")
                bad += 1
                s.reward = float("nan")
            else:
                s.reward = total
        scored, bad = self._gather(batch, bad)
        groups = []
        for g in scored:
            g.samples = [s for s in g.samples if math.isfinite(s.reward)]
            if g.samples:
                groups.append(g)
        kept = [g for g in groups if keep_group(g, cfg.dynamic_filter)]
        # Carried groups come first (they waited longest) but only from the previous round: older
        # ones are too far off-policy. The carry never holds more than one round's worth.
        fresh_carry = [g for g in self.carry if batch.round - g.round_generated <= MAX_CARRY_AGE]
        stale = len(self.carry) - len(fresh_carry)
        pool = fresh_carry + kept
        use = pool[: cfg.prompts_per_round]
        surplus = pool[cfg.prompts_per_round :]
        self.carry = surplus[: cfg.prompts_per_round] if self.carry_over else []
        stale += len(surplus) - len(self.carry)
        all_rewards = [s.reward for g in groups for s in g.samples]
        samples_used = [s for g in use for s in g.samples]
        lengths = [len(s.response_ids) for s in samples_used] or [0]
        stats = dict(batch.stats)
        graded = "task" if "task" in parts else "math"
        stats["rollout/tokens_per_second"] = stats["rollout/generated_tokens"] / max(stats["time/generate_seconds"], 1e-9)
        stats.update({
            "reward/mean": statistics.fmean(all_rewards) if all_rewards else 0.0,
            "reward/std": statistics.pstdev(all_rewards) if len(all_rewards) > 1 else 0.0,
            # the share of samples the task's grader (the `task` reward, else `math`) gives full marks
            "rollout/accuracy": statistics.fmean(float(s.components.get(graded, 0.0) >= 1.0) for g in groups
                                                 for s in g.samples) if all_rewards else 0.0,
            "rollout/groups_kept": len(kept), "rollout/groups_filtered": len(groups) - len(kept),
            "rollout/groups_used": len(use), "rollout/groups_carried": len(self.carry),
            "rollout/groups_dropped_stale": stale,
            "rollout/bad_rewards_skipped": bad,
            "rollout/empty_responses": sum(1 for s in samples_used if not s.response_ids),
            # versions between the policy that sampled and the one this round trains (round - 1)
            "rollout/staleness_mean": statistics.fmean(batch.round - 1 - s.version for s in samples_used)
            if samples_used else 0.0,
            "rollout/staleness_max": max((batch.round - 1 - s.version for s in samples_used), default=0),
            "rollout/truncated_responses": sum(1 for s in samples_used if s.finish_reason == "length"),
            "rollout/response_length": statistics.fmean(lengths),
            "time/reward_seconds": time.perf_counter() - t0,
        })
        for name in parts:
            vals = [v for v in parts[name] if math.isfinite(v)]
            stats[f"reward/{name}"] = statistics.fmean(vals) if vals else 0.0
        if self.environment is not None:
            stats.update(episode_stats([s for g in groups for s in g.samples]))
        return RolloutBatch(batch.round, use, stats)

    def state_dict(self) -> dict[str, Any]:
        return {"buffer": self.buffer.state_dict(), "carry": self.carry}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.buffer.load_state_dict(state["buffer"])
        self.carry = state["carry"]
