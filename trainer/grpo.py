"""The GRPO trainer on DeepSpeed: one stage's policy, optimizer, reference and orchestrator.

`GRPOTrainer` exposes each round step (rollout, score, update, publish, evaluate, save) and
`trainer.loop` drives them, the same for the Prefect tasks, the launched ranks and the tests.
`update` shards a round's trajectories into mini- and micro-batches, runs the loss of
`trainer.rl.losses` on each (several optimizer steps per round when asked), accumulates and
reduces the stats across ranks; `publish` hands the new weights to the rollout engine and records
the round. Run alone: `posttrain grpo --preset tiny` (prepare_data, tokenizer and sft come from cache).
"""

from __future__ import annotations

import copy
import logging
import math
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from transformers import get_constant_schedule_with_warmup

from trainer import checkpoint, engine as ds, lora
from trainer.chat import encode_prompt
from trainer.data import prompt_messages, question_of
from trainer.config import RunConfig
from trainer.errors import InputError
from trainer.evaluate import evaluate
from trainer.rl import losses
from trainer.inference.cuda import fuse_norms
from trainer.inference.engines import HFEngine, RolloutEngine, SamplingParams
from trainer.inference.generate import context_of
from trainer.problems import task_of
from trainer.progress import progress_bar
from trainer.rl.logprobs import response_logprobs
from trainer.rl.orchestrator import RolloutManager
from trainer.rl.rewards import RewardMix
from trainer.rl.trajectory import PackedBatch, RolloutBatch, pack, rows
from trainer.tracking import MetricLogger, NullLogger

log = logging.getLogger(__name__)


# ---------------------------------------------------------------- the trainer

class GRPOTrainer:
    """One GRPO stage in one process (the DeepSpeed launcher runs one of these per rank)."""

    def __init__(self, cfg: RunConfig, model: torch.nn.Module, tok, train: list[dict], test: list[dict],
                 work_dir: str | Path, logger: MetricLogger | None = None,
                 engine: RolloutEngine | None = None) -> None:
        g = cfg.grpo
        self.cfg, self.tok, self.test = cfg, tok, test
        self.logger = logger if logger is not None and ds.rank() == 0 else NullLogger()
        self.work_dir = Path(work_dir)
        self.ckpt_dir = self.work_dir / "checkpoints"
        torch.manual_seed(cfg.seed)
        ds.fp32_matmul(cfg.model.tf32)
        self.reference = None
        lc = cfg.model.lora
        # on a GPU the norms take torch's fused kernel (the policy, and the reference copied from it)
        fuse_norms(model)
        if g.gradient_checkpointing and not getattr(lora.inner(model), "supports_gradient_checkpointing", False):
            raise InputError(f"grpo.gradient_checkpointing: {type(lora.inner(model)).__name__} cannot recompute "
                             "its layers (transformers does not support checkpointing it); set "
                             "grpo.gradient_checkpointing=false")
        # the reference is loaded only when the KL term is on; under LoRA it is the policy with its
        # adapters switched off (no copy)
        if g.kl_coef > 0 and lc is None:
            self.reference = copy.deepcopy(model).eval().requires_grad_(False)
        # PPO (grpo.advantage=gae): the critic, built from the policy's trunk before DeepSpeed (ZeRO-3)
        # partitions it, trained by its own engine and optimizer; saved in the policy's checkpoints
        self.critic = None
        if g.advantage == "gae":
            from trainer.rl.critic import build_critic

            critic = build_critic(model, g.critic)
            fuse_norms(critic)
            c_opt = torch.optim.AdamW(critic.parameters(), lr=g.critic.lr, weight_decay=0.0, betas=(0.9, 0.99),
                                      fused=next(critic.parameters()).device.type in ("cpu", "cuda"))
            self.critic = ds.initialize(critic, c_opt, get_constant_schedule_with_warmup(c_opt, 0),
                                        ds.ds_config(g.deepspeed, g.micro_batch_size, 1, g.grad_clip))[0]
        if lc is not None:  # after the critic copied the trunk: the critic trains in full
            model = lora.wrap(model, lc)
        self.merge = lc.merge if lc is not None else True
        steps_per_round = g.mini_batches * g.epochs
        # fused: AdamW's ~10 elementwise passes over the weights in one (torch's CPU and CUDA kernels);
        # the trainable weights only (under LoRA: the adapters)
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=g.lr,
                                      weight_decay=g.weight_decay, betas=(0.9, 0.99),
                                      fused=next(model.parameters()).device.type in ("cpu", "cuda"))
        scheduler = get_constant_schedule_with_warmup(optimizer, g.warmup_rounds * steps_per_round)
        self.ds = ds.initialize(model, optimizer, scheduler,
                                ds.ds_config(g.deepspeed, g.micro_batch_size, 1, g.grad_clip))[0]
        if self.reference is not None:  # beside the policy, which DeepSpeed placed on the rank's device
            self.reference.to(self.ds.device)
        self.engine = engine or HFEngine(self.ds.module, tok, cfg.rollout.batch_size, merge=self.merge)
        self.task = task_of(cfg.task)
        self.rewards = RewardMix.from_specs(g.rewards, self.task)
        # the longest prompt + 1 the policy can answer: its context, or less where SGLang's servers take less
        context, served = context_of(lora.inner(self.ds.module)), getattr(self.engine, "prompt_limit", None)
        if served is not None:
            context = served if context is None else min(context, served)
        self.manager = RolloutManager(cfg.rollout, train, tok, self.engine, self.rewards, cfg.seed, g.on_bad_reward,
                                      context=context)
        # async rounds (rollout.async_steps = k): batches generated beside the update by a producer,
        # each from the policy k versions behind the one it trains (trainer.rl.async_rollout)
        self.async_steps = cfg.rollout.async_steps
        self.producer = None
        self.consumed: list[tuple[int, int]] = []  # (round, version that generated its batch), in order
        self.round = 0
        self.history: list[dict[str, float]] = []
        self.started = time.perf_counter()
        self.last_checkpoint = self.started  # (perf_counter) for grpo.checkpoint_min_seconds
        self.seconds_before_resume = 0.0
        self.resumed_from: int | None = None
        # one optimizer step a round: old log-probs from the training forward (False: a separate pass,
        # the pre-0.2 behaviour, kept for the parity test)
        self.reuse_training_logprobs = True
        # weight_sync=store: each round's weights go to servers on other machines through the store
        self.weight_store = None
        if (cfg.rollout.engine == "sglang" and cfg.rollout.sglang.weight_sync == "store" and ds.rank() == 0
                and not isinstance(self.engine, HFEngine)):
            from trainer.inference.store_sync import WeightStore

            self.weight_store = WeightStore(cfg.artifact_root, self.stage_name())
        state = checkpoint.load_latest(self.ds, self.ckpt_dir, extra=self._extra_engines())
        self.checkpointed: int | None = None  # the round of the newest checkpoint (every rank agrees)
        if state is not None:
            self.round = self.checkpointed = state["step"]
            self.manager.load_state_dict(state["manager"])
            self.history = state["history"]
            self.seconds_before_resume = state.get("seconds", 0.0)
            self.consumed = [tuple(x) for x in state.get("consumed", [])]
            self.resumed_from = self.round
            log.info("grpo: resumed at round %d", self.round)
        # servers start on the SFT weights, or whatever weights servers run elsewhere last loaded: the
        # first rollout comes from this round's policy, loaded under a version every reply is checked against
        self.push_weights()
        self.last_publish = time.perf_counter()
        if self.async_steps:
            self._start_producer(train, None if state is None else state.get("pending"))

    def _extra_engines(self) -> dict[str, Any]:
        """The engines a checkpoint holds beside the policy's."""
        return {"critic": self.critic} if self.critic is not None else {}

    # -- async rounds
    def _start_producer(self, train: list[dict], pending: dict[int, RolloutBatch] | None) -> None:
        from trainer.rl.async_rollout import ProcessProducer, ThreadProducer

        if isinstance(self.engine, HFEngine):
            self.producer = ProcessProducer(self.cfg, train, self.tok, self.ds.module, self.cfg.seed)
        else:
            self.producer = ThreadProducer(self.manager)
        if self.resumed_from is not None:
            if pending is None:
                self.producer.close()
                raise checkpoint.CheckpointError(
                    f"{self.ckpt_dir}: the checkpoint of round {self.round} holds no generated batches, so it was "
                    f"not written by a run with rollout.async_steps={self.async_steps}; resume it with the "
                    "async_steps it was written with, or start the stage afresh")
            self.producer.restore(pending)
        for r in range(self.round + 1, self._last_request() + 1):
            if r not in self.producer.in_flight():
                self._request(r)

    def _last_request(self) -> int:
        """The last round whose batch may be requested now: k + 1 ahead. Past grpo.rounds too: the
        stage's last checkpoint then holds the batches a longer run would train next, so raising
        grpo.rounds later continues exactly where an uninterrupted longer run would be."""
        return self.round + self.async_steps + 1

    def _request(self, r: int) -> None:
        """Plan round r's prompts now (round order) and have the producer generate them from the
        policy published last, `self.round`: with requests made as each version is published,
        that is `version_for(r, k)`."""
        indices, too_long = self.manager.plan()
        self.producer.request(r, self.round, indices, too_long, self.ds.module)

    def take(self, fetch) -> RolloutBatch:
        """The next round's batch from the producer (`fetch()` returns it, waiting while it generates),
        checked against the schedule, recorded as consumed and timed."""
        from trainer.rl.async_rollout import ProducerError, version_for

        r, t0 = self.round + 1, time.perf_counter()
        batch = fetch()
        waited = time.perf_counter() - t0
        if batch is None:
            raise ProducerError(f"round {r}: the rollout producer closed before its batch arrived")
        version = version_for(r, self.async_steps)
        found = sorted({s.version for s in batch.samples})
        if batch.round != r or found != [version]:
            raise ProducerError(f"round {r} received the batch of round {batch.round}, versions {found}; "
                                f"the schedule says version {version}")
        self.producer.release(r)
        self.consumed.append((r, version))
        batch.stats["rollout/queue_wait_seconds"] = waited
        batch.stats["rollout/version_lag"] = self.round - version
        return batch

    # -- schedule
    def done(self) -> bool:
        g = self.cfg.grpo
        if self.round >= g.rounds:
            return True
        # ranks must agree: the time budget counts as spent once any rank's clock says so
        return g.max_seconds is not None and ds.any_rank(self.elapsed() >= g.max_seconds)

    def elapsed(self) -> float:
        return self.seconds_before_resume + time.perf_counter() - self.started

    def should_eval(self) -> bool:
        return self.round % self.cfg.grpo.eval_every == 0 or self.done()

    def should_checkpoint(self) -> bool:
        g = self.cfg.grpo
        if self.round % g.checkpoint_every or self.done():
            return False
        if g.checkpoint_min_seconds <= 0:
            return True
        # a checkpoint is collective: the ranks agree, as for done()
        return ds.any_rank(time.perf_counter() - self.last_checkpoint >= g.checkpoint_min_seconds)

    # -- round steps
    def rollout(self) -> RolloutBatch:
        """The next round's trajectories: sampled now by the policy published last (version = round),
        or with async rounds the producer's batch for it (waiting for it when it is not ready)."""
        if self.producer is None:
            return self.manager.generate(self.round + 1, version=self.round)
        return self.take(lambda: self.producer.collect(self.round + 1))

    def score(self, batch: RolloutBatch) -> RolloutBatch:
        return self.manager.score(batch)

    def update(self, batch: RolloutBatch) -> dict[str, float]:
        """Optimizer steps over the round's trajectories; advances the round counter and returns the
        round's stats (the batch's own, then the update's), which `publish` records."""
        g = self.cfg.grpo
        t0 = time.perf_counter()
        self.round = batch.round
        stats: dict[str, float] = dict(batch.stats)
        samples, advs = [], []
        for group in batch.groups:
            if self.critic is not None:  # gae: the critic's values, not the group, say what to expect
                a = [0.0] * len(group.samples)
            elif len(group.samples) > 1:
                r = torch.tensor([group.rewards()], dtype=torch.float32)
                a = losses.group_advantages(r, g.std_normalize)[0].tolist()
            else:
                a = [0.0]
            for s, adv in zip(group.samples, a):
                if s.trained_tokens:  # a trajectory without a token of the policy's has nothing to train
                    samples.append(s)
                    advs.append(adv)
        if not samples:
            log.warning("grpo round %d: no usable samples after filtering; skipping the update", self.round)
            stats.update({"time/update_seconds": time.perf_counter() - t0, "update/skipped": 1.0,
                          "update/optimizer_steps": 0})
            return stats
        packed = pack(samples, advs, self.tok.pad_token_id)
        group_of = [s.example_index for s in samples]
        n = len(samples)
        # gae: per-token advantages and returns from the critic's values before this round's steps
        token_adv = returns = old_values = None
        if self.critic is not None:
            token_adv, returns, old_values = self._gae(packed, [s.reward for s in samples], stats)
        # the critic's warm-up rounds train the critic alone
        train_policy = self.critic is None or self.round > g.critic.warmup_rounds
        # With one optimizer step a round the policy that sampled is the one being updated: its
        # log-probs are the training forward's own, detached (the ratio is exactly 1, its gradient
        # that of log p), so the separate no-grad pass over the batch is skipped. With more steps
        # the old log-probs must be taken before the first one changes the weights.
        single_step = g.epochs * g.mini_batches == 1 and self.reuse_training_logprobs
        before = None if single_step else self._old_logprobs(packed)
        gen = torch.Generator().manual_seed(self.cfg.seed * 1_000_003 + self.round)
        sums = dict.fromkeys(("loss", *losses.REPORTED, *losses.CRITIC_REPORTED), 0.0)
        steps, tokens = 0, 0.0
        grad_norms, critic_norms = [], []
        rank, world = ds.rank(), ds.world_size()
        for _ in range(g.epochs):
            order = torch.randperm(n, generator=gen).tolist()
            size = math.ceil(n / g.mini_batches)
            for m in range(g.mini_batches):
                # a group's samples side by side, so that micro-batches share their prompt passes
                idx = sorted(order[m * size : (m + 1) * size], key=lambda i: (group_of[i], i))
                if not idx:
                    continue
                # Every rank holds the whole batch and takes a contiguous share of each mini-batch; all
                # take the same number of micro-batches (an empty one is a zero-weight pass) so that
                # DeepSpeed's gradient all-reduce meets at the same step.
                share = math.ceil(len(idx) / world)
                mine = idx[rank * share : (rank + 1) * share]
                n_micro = max(1, math.ceil(share / g.micro_batch_size))
                micro = [mine[i * g.micro_batch_size : (i + 1) * g.micro_batch_size] for i in range(n_micro)]
                # DeepSpeed scales each backward by 1 / its accumulation steps, and left alone it
                # steps when its never-reset micro-step counter hits a multiple of them: with a
                # micro-batch count that changes between mini-batches that lands mid-mini-batch.
                # The boundary is set explicitly so the step falls on this mini-batch's last one.
                self.ds.set_train_batch_size(g.micro_batch_size * n_micro * world)
                if self.critic is not None:
                    self.critic.set_train_batch_size(g.micro_batch_size * n_micro * world)
                norm = losses.normaliser(packed.mask[torch.tensor(idx)], g.loss_agg)
                for k, part_idx in enumerate(micro):
                    weight = 1.0 if part_idx else 0.0
                    use = part_idx or idx[:1]
                    if train_policy:
                        self.ds.set_gradient_accumulation_boundary(k == n_micro - 1)
                        loss, report, mask = self._micro_loss(packed, use, before, norm, token_adv)
                        loss = loss * weight
                        # DeepSpeed divides by its accumulation steps and averages over ranks; we
                        # normalised by the whole mini-batch.
                        self.ds.backward(loss * n_micro * world)
                        ds.step(self.ds)
                        sums["loss"] += float(loss.detach())
                        for name, values in report.items():
                            sums[name] += weight * float((values * mask).sum())
                    if self.critic is not None:
                        self.critic.set_gradient_accumulation_boundary(k == n_micro - 1)
                        closs, report, mask = self._critic_loss(packed, use, old_values, returns, norm)
                        self.critic.backward(closs * weight * n_micro * world)
                        ds.step(self.critic)
                        for name, values in report.items():
                            sums[name] += weight * float((values * mask).sum())
                    tokens += weight * float(packed.mask[torch.tensor(use)].sum())
                if train_policy:
                    grad_norms.append(ds.grad_norm(self.ds))
                    steps += 1
                if self.critic is not None:
                    critic_norms.append(ds.grad_norm(self.critic))
        keys = list(sums)
        *totals, tokens = ds.sum_across_ranks([sums[k] for k in keys] + [tokens])
        sums = dict(zip(keys, totals))
        t = max(tokens, 1.0)
        stats.update({
            "update/loss": sums["loss"] / max(steps, 1), "update/pg_loss": sums["pg_loss"] / t,
            "update/kl": sums["kl"] / t, "update/entropy": sums["entropy"] / t,
            "update/clip_frac": sums["clip_frac"] / t, "update/ratio_mean": sums["ratio"] / t,
            "update/grad_norm": sum(grad_norms) / len(grad_norms) if grad_norms else 0.0,
            "update/optimizer_steps": steps,
            "update/lr": self.ds.get_lr()[0], "update/samples": n, "update/trained_tokens": t,
            "update/tis_weight_mean": sums["tis"] / t, "update/engine_logprob_abs_diff": sums["engine_diff"] / t,
            "time/update_seconds": time.perf_counter() - t0,
        })
        if self.critic is not None:
            stats.update({"critic/value_loss": sums["value_loss"] / t, "critic/value_clip_frac": sums["value_clip_frac"] / t,
                          "critic/grad_norm": sum(critic_norms) / len(critic_norms),
                          "critic/optimizer_steps": len(critic_norms), "critic/policy_trained": float(train_policy)})
        return stats

    def _values(self, packed: PackedBatch) -> torch.Tensor:
        """The critic's values over the whole batch, [n, T-1], before this round's steps change it."""
        from trainer.rl.critic import values

        mb, dev = self.cfg.grpo.micro_batch_size, self.critic.device
        n, width = packed.mask.shape
        out = []
        with torch.no_grad():
            for i in range(0, n, mb):
                part = rows(packed, list(range(i, min(i + mb, n)))).to(dev)
                v = values(self.critic.module, part.ids, part.attn)
                out.append(F.pad(v, (0, width - v.shape[1])).cpu())
        return torch.cat(out) * packed.mask

    def _gae(self, packed: PackedBatch, rewards: list[float], stats: dict[str, float],
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per-token advantages (GAE over the critic's values, whitened over the batch's policy tokens),
        returns and the values they came from; the critic's view of the batch goes to `stats`."""
        g = self.cfg.grpo
        old = self._values(packed)
        r = losses.last_token_rewards(packed.mask, torch.tensor(rewards, dtype=torch.float32))
        adv, ret = losses.gae(r, old, packed.mask, g.gamma, g.lam)
        m = packed.mask > 0
        stats.update({"critic/values_mean": float(old[m].mean()), "critic/returns_mean": float(ret[m].mean()),
                      "critic/explained_variance": losses.explained_variance(old, ret, packed.mask),
                      "critic/advantage_abs_mean": float(adv[m].abs().mean())})
        return losses.whiten(adv, packed.mask), ret, old

    def _critic_loss(self, packed: PackedBatch, idx: list[int], old: torch.Tensor, returns: torch.Tensor,
                     norm: float) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
        """One micro-batch's aggregated value loss, its per-token reports, and its loss mask."""
        from trainer.rl.critic import values

        dev = self.critic.device
        part = rows(packed, idx).to(dev)
        w = part.mask.shape[1]
        sel = torch.tensor(idx)
        v = losses.Values(values=values(self.critic.module, part.ids, part.attn), old=old[sel, :w].to(dev),
                          returns=returns[sel, :w].to(dev), mask=part.mask)
        per_token, report = losses.critic_token_loss(v, self.cfg.grpo)
        return losses.aggregate(per_token, part.mask, self.cfg.grpo.loss_agg, normaliser=norm), report, part.mask

    def _old_logprobs(self, packed: PackedBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The sampling policy's (and the reference's) log-probs over the whole batch, before the
        first optimizer step changes the weights."""
        g, temp, dev = self.cfg.grpo, self.cfg.rollout.temperature, self.ds.device
        mb = g.micro_batch_size
        n, width = packed.mask.shape
        old, ref = [], []
        with torch.no_grad():
            for i in range(0, n, mb):
                part = rows(packed, list(range(i, min(i + mb, n)))).to(dev)
                lp, _ = response_logprobs(self.ds.module, part, temp)
                old.append(F.pad(lp, (0, width - lp.shape[1])))
                if g.kl_coef > 0:
                    rp = self._reference_logprobs(part)
                    ref.append(F.pad(rp, (0, width - rp.shape[1])))
        return torch.cat(old), (torch.cat(ref) if ref else None)

    def _reference_logprobs(self, part: PackedBatch) -> torch.Tensor:
        """The reference policy's log-probs (the KL term's): its own copy, or under LoRA the policy
        with its adapters switched off."""
        temp = self.cfg.rollout.temperature
        with torch.no_grad():
            if self.reference is not None:
                return response_logprobs(self.reference, part, temp)[0]
            with self.ds.module.disable_adapter():
                return response_logprobs(self.ds.module, part, temp)[0]

    def _micro_loss(self, packed: PackedBatch, idx: list[int],
                    before: tuple[torch.Tensor, torch.Tensor | None] | None, norm: float,
                    token_adv: torch.Tensor | None = None,
                    ) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
        """One micro-batch's aggregated loss, the terms' per-token reports, and its loss mask.
        `before`: the old and reference log-probs of the whole batch (None: one step a round, the
        old ones are this forward's own, the reference's are taken here). `token_adv`: the whole
        batch's per-token advantages (gae), else each sequence's advantage at all its tokens."""
        g, temp, dev = self.cfg.grpo, self.cfg.rollout.temperature, self.ds.device
        part = rows(packed, idx).to(dev)
        lp, ent = response_logprobs(self.ds.module, part, temp, with_entropy=g.entropy_coef > 0,
                                    checkpoint=g.gradient_checkpointing)
        w = part.mask.shape[1]
        if before is None:
            old, ref = lp.detach(), None
            if g.kl_coef > 0:
                ref = self._reference_logprobs(part)
        else:
            sel = torch.tensor(idx, device=dev)
            old = before[0][sel, :w]
            ref = before[1][sel, :w] if before[1] is not None else None
        if token_adv is not None:
            adv = token_adv[torch.tensor(idx), :w].to(dev)
        else:
            adv = part.adv.unsqueeze(1).expand_as(lp)
        tokens = losses.Tokens(logp=lp, old=old, engine=part.engine_logp, adv=adv, mask=part.mask, ref=ref, entropy=ent)
        per_token, report = losses.token_loss(tokens, g)
        return losses.aggregate(per_token, part.mask, g.loss_agg, normaliser=norm), report, part.mask

    def stage_name(self) -> str:
        """The stage's folder name (its key), the same on every rank and machine: from the checkpoints'
        mirror where there is one (each machine's work folder is a scratch folder of its own)."""
        mirror = checkpoint.current_mirror()
        return mirror.rstrip("/").split("/")[-2] if mirror else self.work_dir.name

    def weight_version(self) -> str:
        """The name the rollout servers load this round's weights under (the same on every rank):
        the stage's folder and the round."""
        return f"{self.stage_name()}@{self.round}"

    def push_weights(self) -> dict[str, float]:
        """Give an out-of-process rollout engine the policy's current weights (the HF engine shares
        them), as version `weight_version()`. Returns the seconds of a store sync's parts."""
        if isinstance(self.engine, HFEngine):
            return {}
        version, seconds = self.weight_version(), {}
        # the ranks share the servers: rank 0 reloads them once, the others wait for it
        if getattr(self.engine, "tensor_sync", False):
            with ds.full_weights(self.ds) as weights:  # no folder: the servers copy from this process
                if weights is not None:
                    self.engine.update_weights_from_tensors(weights, version)
        else:
            model_dir = self.work_dir / "sync"
            ds.export_model(self.ds, self.tok, model_dir)
            if ds.rank() == 0:
                if self.cfg.rollout.sglang.weight_sync == "store":
                    seconds = self.weight_store.publish(model_dir, version, self.engine)
                else:
                    self.engine.update_weights(str(model_dir), version)
        ds.barrier()
        self.engine.version = version  # every rank checks the replies it gets
        return seconds

    def publish(self, stats: dict[str, float]) -> dict[str, float]:
        """Publish the round's weights (the policy version `self.round`) to the rollout engine, then
        record the round: its stats with the seconds the push took go to the history and the logger."""
        t0 = time.perf_counter()
        if self.producer is not None:
            self.producer.drain()  # servers serve one version: the rounds in flight finish on theirs
            stats["time/drain_seconds"] = time.perf_counter() - t0
        stats.update({f"time/{k}" if k.endswith("seconds") else f"rollout/{k}": v
                      for k, v in self.push_weights().items()})
        if self.producer is not None:
            self._request(self._last_request())  # version self.round's batch: k + 1 rounds ahead
        stats = {**stats, "time/sync_seconds": time.perf_counter() - t0}
        # the trainer's seconds in the round: with async rounds it waits for generation, not runs it
        first = "rollout/queue_wait_seconds" if self.producer is not None else "time/generate_seconds"
        stats["time/round_seconds"] = stats.get(first, 0.0) + sum(
            stats.get(f"time/{k}_seconds", 0.0) for k in ("reward", "update", "sync"))
        now = time.perf_counter()
        stats["time/round_wall_seconds"] = now - self.last_publish
        self.last_publish = now
        stats["time/grpo_elapsed"] = self.elapsed()
        self.history.append({"round": float(self.round), **stats})
        self.logger.log_metrics(stats, step=self.round)
        return stats

    def evaluate(self) -> dict[str, float]:
        """Greedy accuracy and pass@k on the first grpo.eval_examples held-out problems."""
        g = self.cfg.grpo
        if ds.rank() != 0:  # rank 0 evaluates (the weights are the same everywhere); the rest wait
            ds.barrier()
            return {}
        t0 = time.perf_counter()
        examples = self.test[: g.eval_examples]
        ecfg = self.cfg.eval.model_copy(update={"max_examples": None})
        # through the rollout engine when it is a server (SGLang): the weights it serves are this round's
        served = None if isinstance(self.engine, HFEngine) else self.engine
        env = self.cfg.rollout.environment
        policy = lora.inner(self.ds.module)
        with lora.merged(policy, self.merge and served is None):
            greedy = evaluate(policy, self.tok, examples, ecfg, engine=served, environment=env,
                              label=f"round {self.round} eval", task=self.task)
        metrics = {"eval/accuracy": greedy.accuracy, "eval/flexible_accuracy": greedy.flexible_accuracy,
                   "eval/format_rate": greedy.format_rate, **{f"eval/{k}": v for k, v in greedy.tools.items()}}
        if g.pass_k > 1 and not env.multi_turn:  # pass@k samples single answers
            prompts = [encode_prompt(self.tok, prompt_messages(ex)) for ex in examples]
            params = SamplingParams(self.cfg.eval.max_new_tokens, self.cfg.rollout.temperature, self.cfg.rollout.top_p,
                                    seed=self.cfg.seed + 17 * self.round)
            with progress_bar(f"round {self.round} pass@{g.pass_k}", total=len(prompts) * g.pass_k,
                              unit="answers") as bar:
                gens = self.engine.generate([p for p in prompts for _ in range(g.pass_k)], params, progress=bar)
            hits = 0
            for i, ex in enumerate(examples):
                chunk = gens[i * g.pass_k : (i + 1) * g.pass_k]
                hits += any(self.task.grade(x.text, ex).correct for x in chunk)
            metrics[f"eval/pass_at_{g.pass_k}"] = hits / max(len(examples), 1)
        metrics["time/eval_seconds"] = time.perf_counter() - t0
        self.logger.log_metrics(metrics, step=self.round)
        if self.history:
            self.history[-1].update(metrics)
        ds.barrier()
        return metrics

    def sample_table(self, batch: RolloutBatch, k: int = 16) -> list[dict[str, Any]]:
        rows = []
        for s in batch.samples[:k]:
            ex = self.manager.examples[s.example_index]
            row = {"round": self.round, "prompt": question_of(ex), "response": s.text,
                   "reward": s.reward, "gold": ex["answer"]}
            if s.turns:  # a multi-turn episode: each turn, whether it is trained on, the tools' answers
                row.update({"turns": "\n".join(f"[{t['role']}{'' if t['trained'] else ', not trained'}] {t['text']}"
                                                for t in s.turns),
                            "tool_calls": s.tool_calls, "tool_errors": s.tool_errors, "ended": s.finish_reason})
            rows.append(row)
        return rows

    def save(self) -> None:
        state = {"manager": self.manager.state_dict(), "history": self.history, "seconds": self.elapsed(),
                 "consumed": self.consumed}
        if self.producer is not None:  # the batches generated for the next rounds, waited for
            state["pending"] = self.producer.pending()
        checkpoint.save(self.ds, self.ckpt_dir, self.round, state, extra=self._extra_engines())
        self.checkpointed = self.round
        self.last_checkpoint = time.perf_counter()

    def close(self) -> None:
        """Stop the rollout producer and the engine (servers this stage launched); idempotent."""
        try:
            if self.producer is not None:
                self.producer.close()
        finally:
            try:
                if self.weight_store is not None:
                    self.weight_store.clear()
            finally:
                self.engine.close()

    def export(self, out_dir: str | Path, adapter_dir: str | Path | None = None) -> None:
        """The policy as a save_pretrained folder (merged under LoRA; the adapter alone into adapter_dir)."""
        ds.export_model(self.ds, self.tok, out_dir, adapter_dir)

    def export_critic(self, out_dir: str | Path) -> None:
        """The critic as a save_pretrained token classifier (what grpo.critic.path takes)."""
        ds.export_model(self.critic, self.tok, out_dir)

    def state_hash(self) -> str:
        """The policy's weights, and the critic's when there is one."""
        h = ds.state_dict_hash(self.ds.module)
        if self.critic is None:
            return h
        import hashlib

        return hashlib.sha256(f"{h}:{ds.state_dict_hash(self.critic.module)}".encode()).hexdigest()
