"""GRPO's and PPO's losses as pure functions: group advantages or GAE over a critic's values, the
clipped objective with clip-higher, truncated importance sampling (TIS) against the sampler's
log-probs, KL to a frozen reference (Schulman's k1/k2/k3), the entropy bonus, the critic's clipped
value loss and three aggregations.

The per-token loss is the sum of the terms in `TERMS`, in order; each term reads one micro-batch's
per-token tensors (`Tokens`) and the GRPO config, and returns its contribution (None when it is
off) and the per-token values it reports. `trainer.grpo.GRPOTrainer.update` only shards, runs
`token_loss` and `aggregate`, accumulates and reduces: a new term is a function and a row here.
The critic's terms (`CRITIC_TERMS`, `critic_token_loss`) read `Values` the same way.
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


def summed(table: dict, x, g: GRPOConfig) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """A table's terms on `x`, summed in table order, and every term's reported values."""
    total, report = None, {}
    for term in table.values():
        part, values = term(x, g)
        report.update(values)
        if part is not None:
            total = part if total is None else total + part
    return total, report


def token_loss(t: Tokens, g: GRPOConfig) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The per-token loss (the terms summed in table order) and every term's reported values."""
    return summed(TERMS, t, g)


# ---------------------------------------------------------------- PPO: GAE and the critic (grpo.advantage=gae)

def last_token_rewards(mask: torch.Tensor, rewards: torch.Tensor) -> torch.Tensor:
    """[B, T] mask, [B] rewards -> [B, T]: each trajectory's reward at its last policy token, 0
    elsewhere (the outcome reward is given when the policy's last token ends the episode)."""
    B, T = mask.shape
    pos = torch.arange(T, device=mask.device).expand(B, T)
    last = torch.where(mask > 0, pos, torch.full_like(pos, -1)).max(dim=1).values
    out = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    has = last >= 0
    out[has.nonzero().squeeze(1), last[has]] = rewards.to(out.dtype)[has]
    return out


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float,
        lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimates and returns, [B, T] each, over each row's policy tokens.

    delta_t = r_t + gamma * V(next) - V_t and A_t = delta_t + gamma * lam * A(next), where "next" is
    the row's next *policy* token: the environment's tokens between two turns (mask 0) are part of
    the transition, not states the critic is asked about, and the row's end is terminal (value 0).
    One backward pass over T; masked positions get 0. Returns = A + V on the policy's tokens."""
    B, T = mask.shape
    adv = torch.zeros(B, T, dtype=torch.float32, device=mask.device)
    running = torch.zeros(B, dtype=torch.float32, device=mask.device)
    next_value = torch.zeros(B, dtype=torch.float32, device=mask.device)
    values = values.float()
    for t in range(T - 1, -1, -1):
        on = mask[:, t] > 0
        a = rewards[:, t] + gamma * next_value - values[:, t] + gamma * lam * running
        adv[:, t] = torch.where(on, a, 0.0)
        running = torch.where(on, a, running)
        next_value = torch.where(on, values[:, t], next_value)
    m = mask.to(adv.dtype)
    return adv, (adv + values) * m


def whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """x shifted and scaled to mean 0, variance 1 over the masked-in entries (0 elsewhere)."""
    m = mask.to(x.dtype)
    n = m.sum().clamp(min=1)
    mean = (x * m).sum() / n
    var = (((x - mean) * m) ** 2).sum() / n
    return (x - mean) * torch.rsqrt(var + eps) * m


def clipped_value_loss(values: torch.Tensor, old: torch.Tensor, returns: torch.Tensor,
                       clip: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token 0.5 * max((V - R)^2, (V_clipped - R)^2), V_clipped = old + clamp(V - old, +-clip)
    (PPO's value clipping: the critic may not move far from the values the advantages came from),
    and whether the clipped branch was the larger."""
    unclipped = (values - returns) ** 2
    if clip is None:
        return 0.5 * unclipped, torch.zeros_like(unclipped, dtype=torch.bool)
    clipped = (old + (values - old).clamp(-clip, clip) - returns) ** 2
    return 0.5 * torch.maximum(unclipped, clipped), clipped > unclipped


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    """1 - Var(R - V) / Var(R) over the masked-in tokens: 1 when the values predict the returns, 0
    when they do no better than their mean, negative when worse (nan when the returns are constant)."""
    m = mask > 0
    r, v = returns[m].double(), values[m].double()
    if r.numel() < 2 or float(r.var()) == 0.0:
        return float("nan")
    return float(1.0 - (r - v).var() / r.var())


@dataclass
class Values:
    """One micro-batch, per token, as the critic's terms see it."""

    values: torch.Tensor      # the critic's values, with their gradient
    old: torch.Tensor         # its values when the round's advantages were computed (no gradient)
    returns: torch.Tensor     # the GAE returns
    mask: torch.Tensor        # 1 on the policy's tokens


CriticTerm = Callable[[Values, GRPOConfig], "tuple[torch.Tensor | None, dict[str, torch.Tensor]]"]


def value_term(v: Values, g: GRPOConfig) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The clipped value loss."""
    loss, clipped = clipped_value_loss(v.values, v.old, v.returns, g.critic.value_clip)
    return loss, {"value_loss": loss.detach(), "value_clip_frac": clipped.float()}


CRITIC_TERMS: dict[str, CriticTerm] = {"value": value_term}
CRITIC_REPORTED = ("value_loss", "value_clip_frac")


def critic_token_loss(v: Values, g: GRPOConfig) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The critic's per-token loss (its terms summed in table order) and their reported values."""
    return summed(CRITIC_TERMS, v, g)
