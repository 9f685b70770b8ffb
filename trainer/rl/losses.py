"""GRPO's loss as pure functions: group advantages, the clipped objective with clip-higher,
truncated importance sampling (TIS) against the sampler's log-probs, KL to a frozen reference
(Schulman's k1/k2/k3), the entropy bonus and three aggregations.

The per-token loss is the sum of the terms in `TERMS`, in order; each term reads one micro-batch's
per-token tensors (`Tokens`) and the GRPO config, and returns its contribution (None when it is
off) and the per-token values it reports. `trainer.grpo.GRPOTrainer.update` only shards, runs
`token_loss` and `aggregate`, accumulates and reduces: a new term is a function and a row here.
Every tensor is [B, T-1], aligned with the loss mask; what the mask zeroes counts for nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from trainer.config import GRPOConfig


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


def tis_weights(logp_old: torch.Tensor, engine_logp: torch.Tensor, cap: float | None) -> torch.Tensor:
    """Truncated importance sampling: the trainer's over the sampler's probability of each sampled
    token, capped (None: no correction, weight 1)."""
    w = torch.exp(logp_old - engine_logp)
    return w.clamp(max=cap) if cap is not None else torch.ones_like(w)


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
    """Reduce [B, T] per-token losses over the masked-in tokens.

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


def normaliser(mask: torch.Tensor, mode: str) -> float:
    """What a mini-batch's loss is divided by: its trained tokens (token-mean) or its sequences."""
    return float(mask.sum().clamp(min=1)) if mode == "token-mean" else float(mask.shape[0])


# ---------------------------------------------------------------- the terms

@dataclass
class Tokens:
    """One micro-batch, per token, as the loss terms see it."""

    logp: torch.Tensor                # the policy's log-probs, with their gradient
    old: torch.Tensor                 # the sampling policy's, as the trainer computes them (no gradient)
    engine: torch.Tensor              # the sampler's own (TIS)
    adv: torch.Tensor                 # the sequence's advantage at each of its tokens
    mask: torch.Tensor                # 1 on the policy's tokens
    ref: torch.Tensor | None = None   # the frozen reference's (kl_coef > 0)
    entropy: torch.Tensor | None = None  # the policy's entropy (entropy_coef > 0)


Term = Callable[[Tokens, GRPOConfig], "tuple[torch.Tensor | None, dict[str, torch.Tensor]]"]


def policy_term(t: Tokens, g: GRPOConfig) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The clipped surrogate, weighted by TIS."""
    tis = tis_weights(t.old, t.engine, g.tis_cap)
    pg, clipped = clipped_objective(t.logp, t.old, t.adv, g.clip_low, g.clip_high)
    return pg * tis, {"pg_loss": pg.detach(), "clip_frac": clipped.float(), "tis": tis,
                      "ratio": torch.exp(t.logp.detach() - t.old), "engine_diff": (t.old - t.engine).abs()}


def kl_term(t: Tokens, g: GRPOConfig) -> tuple[torch.Tensor | None, dict[str, torch.Tensor]]:
    if t.ref is None:
        return None, {}
    kl = kl_estimate(t.logp, t.ref, g.kl_estimator)
    return g.kl_coef * kl, {"kl": kl.detach()}


def entropy_term(t: Tokens, g: GRPOConfig) -> tuple[torch.Tensor | None, dict[str, torch.Tensor]]:
    if t.entropy is None:
        return None, {}
    return -g.entropy_coef * t.entropy, {"entropy": t.entropy.detach()}


TERMS: dict[str, Term] = {"policy": policy_term, "kl": kl_term, "entropy": entropy_term}
REPORTED = ("pg_loss", "kl", "entropy", "clip_frac", "ratio", "engine_diff", "tis")  # per-token means


def token_loss(t: Tokens, g: GRPOConfig) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The per-token loss (the terms summed in table order) and every term's reported values."""
    total, report = None, {}
    for term in TERMS.values():
        part, values = term(t, g)
        report.update(values)
        if part is not None:
            total = part if total is None else total + part
    return total, report
