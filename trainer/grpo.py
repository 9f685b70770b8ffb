"""GRPO on DeepSpeed: group-relative advantages, the clipped objective with clip-higher, KL to a
frozen reference (k1/k2/k3), entropy bonus, three loss aggregations, several optimizer steps per
round, and truncated importance sampling (TIS) against the rollout engine's logprobs.

`GRPOTrainer` holds one stage's state and exposes each round step (rollout, score, update, sync,
evaluate, checkpoint) so that an orchestrator can show them as separate tasks. Run alone:
`posttrain grpo --preset tiny` (prepare_data, tokenizer and sft come from cache).
"""

from __future__ import annotations

import copy
import logging
import math
import time
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from transformers import get_constant_schedule_with_warmup

from trainer import checkpoint, engine as ds, fasttrain
from trainer.answers import is_correct
from trainer.chat import encode_prompt
from trainer.data import prompt_messages
from trainer.config import RunConfig
from trainer.evaluate import evaluate
from trainer.fastgen import distinct, left_pad
from trainer.rollout import HFEngine, RolloutBatch, RolloutEngine, RolloutManager, Sample, SamplingParams
from trainer.rewards import RewardMix
from trainer.tracking import MetricLogger, NullLogger

log = logging.getLogger(__name__)


# ---------------------------------------------------------------- the math

def group_advantages(rewards: torch.Tensor, std_normalize: bool, eps: float = 1e-6) -> torch.Tensor:
    """rewards [G, n] -> advantages [G, n]: r - mean(group), divided by the group's std if asked."""
    centred = rewards - rewards.mean(dim=1, keepdim=True)
    if not std_normalize:
        return centred
    return centred / (rewards.std(dim=1, keepdim=True, unbiased=True).nan_to_num(0.0) + eps)


def clipped_objective(logp: torch.Tensor, logp_old: torch.Tensor, adv: torch.Tensor,
                      clip_low: float, clip_high: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token PPO loss (to minimise) and whether the clipped branch was taken."""
    ratio = torch.exp(logp - logp_old)
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) * adv
    loss = -torch.minimum(unclipped, clipped)
    return loss, (clipped < unclipped)


def kl_estimate(logp: torch.Tensor, logp_ref: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from samples of pi (Schulman's k1, k2, k3)."""
    log_ratio = logp_ref - logp
    if estimator == "k1":
        return -log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio**2
    if estimator == "k3":
        return torch.exp(log_ratio) - 1.0 - log_ratio
    raise ValueError(f"unknown kl estimator {estimator!r}; use k1, k2 or k3")


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, mode: str, normaliser: float | None = None) -> torch.Tensor:
    """Reduce [B, T] per-token losses over response tokens.

    token-mean: sum / number of tokens; seq-mean-token-sum: per-sequence sums, averaged over
    sequences; seq-mean-token-mean: per-sequence means, averaged over sequences. `normaliser`
    replaces the local count (tokens or sequences) so micro-batches add up to the mini-batch value."""
    mask = mask.to(per_token.dtype)
    if mode == "token-mean":
        return (per_token * mask).sum() / (normaliser if normaliser is not None else mask.sum().clamp(min=1))
    lengths = mask.sum(dim=1)
    if mode == "seq-mean-token-sum":
        per_seq = (per_token * mask).sum(dim=1)
    elif mode == "seq-mean-token-mean":
        per_seq = (per_token * mask).sum(dim=1) / lengths.clamp(min=1)
    else:
        raise ValueError(f"unknown loss aggregation {mode!r}")
    return per_seq.sum() / (normaliser if normaliser is not None else max(per_token.shape[0], 1))


def token_logprobs(module: torch.nn.Module, ids: torch.Tensor, attn: torch.Tensor,
                   with_entropy: bool = False, temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(ids[t] | ids[<t]) for t >= 1, shape [B, T-1]; and the per-position entropy.

    Under the sampling temperature: the policy being optimised is the one rollouts came from."""
    # the last position's logits would predict past the end: it is not run
    logits = module(input_ids=ids[:, :-1], attention_mask=attn[:, :-1]).logits.float() / temperature
    logp_all = torch.log_softmax(logits, dim=-1)
    logp = logp_all.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1) if with_entropy else None
    return logp, entropy


def hf_prefix_logits(module: torch.nn.Module, pids: torch.Tensor, pmask: torch.Tensor, inverse: torch.Tensor,
                     rids: torch.Tensor, rmask: torch.Tensor) -> torch.Tensor:
    """`trainer.fasttrain.prefix_logits` through the model's own forward: the prompts' pass with a KV
    cache, copied out to the samples, then the responses' pass on it (any model, any device)."""
    R = rids.shape[1]
    dev = pids.device
    out = module(input_ids=pids, attention_mask=pmask, position_ids=(pmask.cumsum(-1) - 1).clamp(min=0),
                 use_cache=True, logits_to_keep=1)
    cache = out.past_key_values
    cache.batch_select_indices(inverse)
    first = out.logits[:, -1:].index_select(0, inverse)  # see fasttrain.prefix_logits
    if R == 1:
        return first
    positions = pmask.sum(1)[inverse][:, None] + torch.arange(R - 1, device=dev)[None]
    resp = module(input_ids=rids[:, :-1], attention_mask=torch.cat([pmask[inverse], rmask[:, :-1]], 1),
                  position_ids=positions, past_key_values=cache, use_cache=True).logits
    return torch.cat([first, resp], 1)


def shared_prefix_logprobs(module: torch.nn.Module, ids: torch.Tensor, attn: torch.Tensor, prompt_len: torch.Tensor,
                           with_entropy: bool = False, temperature: float = 1.0,
                           ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`token_logprobs` at the response positions (0 elsewhere), each distinct prompt run once.

    The samples of a group share their prompt, and a prompt token never attends to what follows,
    so its hidden states are the same in every sample: the prompts go through the model once
    (left-padded), their keys and values reach the samples, and the responses run on them. The
    gradient reaches the prompt pass through them, summed over the group's samples: the same
    loss and gradients as one pass per sample, without the repeated prompt tokens (a third of a
    GRPO batch's tokens on the reference workload). Llama-family models on CPU run the passes
    through `trainer.fasttrain` (fused ops, same results up to rounding), others the model's own."""
    B, W = ids.shape
    plen = prompt_len.tolist()
    rlen = (attn.sum(1) - prompt_len).tolist()
    prompts = [ids[i, : plen[i]].tolist() for i in range(B)]
    rows, inverse = distinct(prompts)
    R = max(max(rlen), 1)
    pad = 0  # any id: padded positions are masked out
    dev = ids.device
    pids, pmask = left_pad([prompts[r] for r in rows], pad)
    pids, pmask, inverse = pids.to(dev), pmask.to(dev, attn.dtype), inverse.to(dev)
    rids = torch.full((B, R), pad, dtype=ids.dtype, device=dev)
    rmask = torch.zeros((B, R), dtype=attn.dtype, device=dev)
    for i in range(B):
        rids[i, : rlen[i]] = ids[i, plen[i] : plen[i] + rlen[i]]
        rmask[i, : rlen[i]] = 1
    # Response token j is predicted at the prompt's last position (j = 0) or the response's j - 1.
    passes = fasttrain.prefix_logits if fasttrain.unsupported(module) is None else hf_prefix_logits
    logits = passes(module, pids, pmask, inverse, rids, rmask).float() / temperature
    logp_all = torch.log_softmax(logits, dim=-1)
    lp = logp_all.gather(-1, rids.unsqueeze(-1)).squeeze(-1) * rmask
    entropy = -(logp_all.exp() * logp_all).sum(-1) * rmask if with_entropy else None
    # back to the packed layout: response token j of sample i sits at position plen[i] - 1 + j
    index = prompt_len[:, None] - 1 + torch.arange(R, device=dev)[None]

    def unpack(x: torch.Tensor) -> torch.Tensor:
        return torch.zeros((B, W - 1 + R), dtype=x.dtype, device=dev).scatter(1, index, x)[:, : W - 1]

    return unpack(lp), (unpack(entropy) if entropy is not None else None)


def response_logprobs(module: torch.nn.Module, part: "PackedBatch", temperature: float,
                      with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (and entropy) of a packed batch's response tokens: prompts that several samples
    share run once (`shared_prefix_logprobs`), else one pass per sequence (`token_logprobs`); the
    fused passes of `trainer.fasttrain` always take the shared layout (no padding computed)."""
    plen = part.prompt_len.tolist()
    if (fasttrain.unsupported(module) is None
            or len({tuple(part.ids[i, : plen[i]].tolist()) for i in range(len(plen))}) < len(plen)):
        return shared_prefix_logprobs(module, part.ids, part.attn, part.prompt_len, with_entropy, temperature)
    return token_logprobs(module, part.ids, part.attn, with_entropy=with_entropy, temperature=temperature)


@dataclass
class PackedBatch:
    ids: torch.Tensor        # [B, T] prompt + response, right padded
    attn: torch.Tensor       # [B, T]
    mask: torch.Tensor       # [B, T-1] 1 where the target token is a response token
    adv: torch.Tensor        # [B] advantage per sequence
    engine_logp: torch.Tensor  # [B, T-1] aligned with mask
    prompt_len: torch.Tensor   # [B]

    def to(self, device: torch.device) -> "PackedBatch":
        return PackedBatch(*(getattr(self, f.name).to(device) for f in fields(self)))


def pack(samples: list[Sample], advantages: list[float], pad_id: int) -> PackedBatch:
    width = max(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    n = len(samples)
    # built as Python lists and converted once: a tensor op a row costs more than the rows' data
    ids = [s.prompt_ids + s.response_ids + [pad_id] * (width - len(s.prompt_ids) - len(s.response_ids))
           for s in samples]
    attn = [[1] * (len(s.prompt_ids) + len(s.response_ids)) + [0] * (width - len(s.prompt_ids) - len(s.response_ids))
            for s in samples]
    mask, elp = [], []
    for s in samples:
        p, r = len(s.prompt_ids), len(s.response_ids)
        after = width - 1 - (p - 1 + r)
        mask.append([0.0] * (p - 1) + [1.0] * r + [0.0] * after)
        elp.append([0.0] * (p - 1) + list(s.engine_logprobs[:r]) + [0.0] * after)
    return PackedBatch(torch.tensor(ids, dtype=torch.long), torch.tensor(attn, dtype=torch.long),
                       torch.tensor(mask, dtype=torch.float32).view(n, width - 1),
                       torch.tensor(advantages, dtype=torch.float32), torch.tensor(elp, dtype=torch.float32).view(n, width - 1),
                       torch.tensor([len(s.prompt_ids) for s in samples]))


def _slice(b: PackedBatch, idx: list[int]) -> PackedBatch:
    sel = torch.tensor(idx)
    width = int(b.attn[sel].sum(dim=1).max())  # trim shared padding
    return PackedBatch(b.ids[sel, :width], b.attn[sel, :width], b.mask[sel, : width - 1], b.adv[sel],
                       b.engine_logp[sel, : width - 1], b.prompt_len[sel])


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
        self.reference = None
        if g.kl_coef > 0:  # the reference is loaded only when the KL term is on
            self.reference = copy.deepcopy(model).eval().requires_grad_(False)
        steps_per_round = g.mini_batches * g.epochs
        # fused: AdamW's ~10 elementwise passes over the weights in one (torch's CPU and CUDA kernels)
        optimizer = torch.optim.AdamW(model.parameters(), lr=g.lr, weight_decay=g.weight_decay, betas=(0.9, 0.99),
                                      fused=next(model.parameters()).device.type in ("cpu", "cuda"))
        scheduler = get_constant_schedule_with_warmup(optimizer, g.warmup_rounds * steps_per_round)
        self.ds = ds.initialize(model, optimizer, scheduler,
                                ds.ds_config(g.deepspeed, g.micro_batch_size, 1, g.grad_clip))[0]
        if self.reference is not None:  # beside the policy, which DeepSpeed placed on the rank's device
            self.reference.to(self.ds.device)
        self.engine = engine or HFEngine(self.ds.module, tok, cfg.rollout.batch_size)
        self.rewards = RewardMix.from_specs(g.rewards)
        self.manager = RolloutManager(cfg.rollout, train, tok, self.engine, self.rewards, cfg.seed, g.on_bad_reward)
        self.round = 0
        self.history: list[dict[str, float]] = []
        self.started = time.perf_counter()
        self.seconds_before_resume = 0.0
        self.resumed_from: int | None = None
        self._pending: dict[str, float] = {}  # the last update's stats, recorded by sync()
        # one optimizer step a round: old log-probs from the training forward (False: a separate pass,
        # the pre-0.2 behaviour, kept for the parity test)
        self.reuse_training_logprobs = True
        state = checkpoint.load_latest(self.ds, self.ckpt_dir)
        if state is not None:
            self.round = state["step"]
            self.manager.load_state_dict(state["manager"])
            self.history = state["history"]
            self.seconds_before_resume = state.get("seconds", 0.0)
            self.resumed_from = self.round
            log.info("grpo: resumed at round %d", self.round)
            # servers were started on the SFT weights: the next rollout must come from the checkpoint's
            self.push_weights()

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
        return self.round % self.cfg.grpo.checkpoint_every == 0 and not self.done()

    # -- round steps
    def rollout(self) -> RolloutBatch:
        return self.manager.generate(self.round + 1)

    def score(self, batch: RolloutBatch) -> RolloutBatch:
        return self.manager.score(batch)

    def update(self, batch: RolloutBatch) -> dict[str, float]:
        """Optimizer steps over the round's batch; advances the round counter."""
        g = self.cfg.grpo
        t0 = time.perf_counter()
        self.round = batch.round
        stats: dict[str, float] = dict(batch.stats)
        samples, advs = [], []
        for group in batch.groups:
            r = torch.tensor([group.rewards()], dtype=torch.float32)
            a = group_advantages(r, g.std_normalize)[0].tolist() if len(group.samples) > 1 else [0.0]
            for s, adv in zip(group.samples, a):
                if s.response_ids:  # an empty completion has no token to train on
                    samples.append(s)
                    advs.append(adv)
        if not samples:
            log.warning("grpo round %d: no usable samples after filtering; skipping the update", self.round)
            stats.update({"time/update_seconds": time.perf_counter() - t0, "update/skipped": 1.0,
                          "update/optimizer_steps": 0})
            self._pending = stats  # sync() records the round, this one's own stats
            return stats
        packed = pack(samples, advs, self.tok.pad_token_id)
        group_of = [s.example_index for s in samples]
        module = self.ds.module
        dev = self.ds.device  # each micro-batch goes to the rank's GPU (or stays on the CPU)
        mb = g.micro_batch_size
        temp = self.cfg.rollout.temperature
        n = len(samples)
        # With one optimizer step a round the policy that sampled is the one being updated: its
        # log-probs are the training forward's own, detached (the ratio is exactly 1, its gradient
        # that of log p), so the separate no-grad pass over the batch is skipped. With more steps
        # the old log-probs must be taken before the first one changes the weights.
        single_step = g.epochs * g.mini_batches == 1 and self.reuse_training_logprobs
        logp_old = logp_ref = None
        if not single_step:
            with torch.no_grad():
                old, ref = [], []
                for i in range(0, n, mb):
                    part = _slice(packed, list(range(i, min(i + mb, n)))).to(dev)
                    lp, _ = response_logprobs(module, part, temp)
                    old.append(F.pad(lp, (0, packed.mask.shape[1] - lp.shape[1])))
                    if self.reference is not None:
                        rp, _ = response_logprobs(self.reference, part, temp)
                        ref.append(F.pad(rp, (0, packed.mask.shape[1] - rp.shape[1])))
                logp_old = torch.cat(old)
                logp_ref = torch.cat(ref) if ref else None
        mask = packed.mask
        gen = torch.Generator().manual_seed(self.cfg.seed * 1_000_003 + self.round)
        sums = {"loss": 0.0, "pg_loss": 0.0, "kl": 0.0, "entropy": 0.0, "clip_frac": 0.0, "ratio": 0.0,
                "engine_diff": 0.0, "tis": 0.0}
        steps, tokens = 0, 0.0
        grad_norms = []
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
                n_micro = max(1, math.ceil(share / mb))
                micro = [mine[i * mb : (i + 1) * mb] for i in range(n_micro)]
                # DeepSpeed scales each backward by 1 / its accumulation steps, and left alone it
                # steps when its never-reset micro-step counter hits a multiple of them: with a
                # micro-batch count that changes between mini-batches that lands mid-mini-batch.
                # The boundary is set explicitly so the step falls on this mini-batch's last one.
                self.ds.set_train_batch_size(mb * n_micro * world)
                sel = torch.tensor(idx)
                if g.loss_agg == "token-mean":
                    norm = float(mask[sel].sum().clamp(min=1))
                else:
                    norm = float(len(idx))
                for k, part_idx in enumerate(micro):
                    self.ds.set_gradient_accumulation_boundary(k == n_micro - 1)
                    weight = 1.0 if part_idx else 0.0
                    part_idx = part_idx or idx[:1]
                    part = _slice(packed, part_idx).to(dev)
                    sel_p = torch.tensor(part_idx, device=dev)
                    w = part.mask.shape[1]
                    lp, ent = response_logprobs(module, part, temp, with_entropy=g.entropy_coef > 0)
                    adv = part.adv.unsqueeze(1).expand_as(lp)
                    old_p = lp.detach() if single_step else logp_old[sel_p, :w]
                    # truncated importance sampling: trainer over engine probability of each sampled token
                    tis = torch.exp(old_p - part.engine_logp)
                    tis = tis.clamp(max=g.tis_cap) if g.tis_cap is not None else torch.ones_like(tis)
                    pg, clipped = clipped_objective(lp, old_p, adv, g.clip_low, g.clip_high)
                    per_tok = pg * tis
                    ref_p = None
                    if self.reference is not None:
                        if single_step:
                            with torch.no_grad():
                                ref_p, _ = response_logprobs(self.reference, part, temp)
                        else:
                            ref_p = logp_ref[sel_p, :w]
                    if ref_p is not None:
                        kl = kl_estimate(lp, ref_p, g.kl_estimator)
                        per_tok = per_tok + g.kl_coef * kl
                        sums["kl"] += weight * float((kl.detach() * part.mask).sum())
                    if ent is not None:
                        per_tok = per_tok - g.entropy_coef * ent
                        sums["entropy"] += weight * float((ent.detach() * part.mask).sum())
                    loss = aggregate(per_tok, part.mask, g.loss_agg, normaliser=norm) * weight
                    # DeepSpeed divides by its accumulation steps and averages over ranks; we
                    # normalised by the whole mini-batch.
                    self.ds.backward(loss * n_micro * world)
                    self.ds.step()
                    sums["loss"] += float(loss.detach())
                    sums["pg_loss"] += weight * float((pg.detach() * part.mask).sum())
                    sums["clip_frac"] += weight * float((clipped.float() * part.mask).sum())
                    sums["ratio"] += weight * float((torch.exp(lp.detach() - old_p) * part.mask).sum())
                    sums["engine_diff"] += weight * float(((old_p - part.engine_logp).abs() * part.mask).sum())
                    sums["tis"] += weight * float((tis * part.mask).sum())
                    tokens += weight * float(part.mask.sum())
                gn = self.ds.get_global_grad_norm()
                grad_norms.append(float(gn) if gn is not None else float("nan"))
                steps += 1
        keys = list(sums)
        *totals, tokens = ds.sum_across_ranks([sums[k] for k in keys] + [tokens])
        sums = dict(zip(keys, totals))
        t = max(tokens, 1.0)
        stats.update({
            "update/loss": sums["loss"] / max(steps, 1), "update/pg_loss": sums["pg_loss"] / t,
            "update/kl": sums["kl"] / t, "update/entropy": sums["entropy"] / t,
            "update/clip_frac": sums["clip_frac"] / t, "update/ratio_mean": sums["ratio"] / t,
            "update/grad_norm": sum(grad_norms) / len(grad_norms), "update/optimizer_steps": steps,
            "update/lr": self.ds.get_lr()[0], "update/samples": n,
            "update/tis_weight_mean": sums["tis"] / t, "update/engine_logprob_abs_diff": sums["engine_diff"] / t,
            "time/update_seconds": time.perf_counter() - t0,
        })
        self._pending = stats
        return stats

    def push_weights(self) -> None:
        """Give an out-of-process rollout engine the policy's current weights (the HF engine shares them)."""
        if isinstance(self.engine, HFEngine):
            return
        model_dir = self.work_dir / "sync"
        ds.export_model(self.ds, self.tok, model_dir)
        # the ranks share the servers: rank 0 reloads them once, the others wait for it
        if ds.rank() == 0:
            self.engine.update_weights(str(model_dir))
        ds.barrier()

    def sync(self) -> float:
        """Push the new weights to the rollout engine; returns seconds spent."""
        t0 = time.perf_counter()
        self.push_weights()
        seconds = time.perf_counter() - t0
        stats, self._pending = self._pending, {}
        stats["time/sync_seconds"] = seconds
        stats["time/round_seconds"] = sum(stats.get(f"time/{k}_seconds", 0.0) for k in ("generate", "reward", "update", "sync"))
        stats["time/grpo_elapsed"] = self.elapsed()
        self.history.append({"round": float(self.round), **stats})
        self.logger.log_metrics(stats, step=self.round)
        return seconds

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
        greedy = evaluate(self.ds.module, self.tok, examples, ecfg, engine=served)
        metrics = {"eval/accuracy": greedy.accuracy, "eval/flexible_accuracy": greedy.flexible_accuracy,
                   "eval/format_rate": greedy.format_rate}
        if g.pass_k > 1:
            prompts = [encode_prompt(self.tok, prompt_messages(ex)) for ex in examples]
            params = SamplingParams(self.cfg.eval.max_new_tokens, self.cfg.rollout.temperature, self.cfg.rollout.top_p,
                                    seed=self.cfg.seed + 17 * self.round)
            gens = self.engine.generate([p for p in prompts for _ in range(g.pass_k)], params)
            hits = 0
            for i, ex in enumerate(examples):
                chunk = gens[i * g.pass_k : (i + 1) * g.pass_k]
                hits += any(is_correct(x.text, ex["answer"]) for x in chunk)
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
            rows.append({"round": self.round, "prompt": ex["messages"][-2]["content"], "response": s.text,
                         "reward": s.reward, "gold": ex["answer"]})
        return rows

    def save(self) -> None:
        checkpoint.save(self.ds, self.ckpt_dir, self.round, {
            "manager": self.manager.state_dict(), "history": self.history, "seconds": self.elapsed()})

    def export(self, out_dir: str | Path) -> None:
        ds.export_model(self.ds, self.tok, out_dir)

    def state_hash(self) -> str:
        return ds.state_dict_hash(self.ds.module)
