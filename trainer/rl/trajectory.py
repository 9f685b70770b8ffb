"""What a rollout is, from the engine to the update: a trajectory of tokens after a prompt.

A `Sample` holds the prompt's ids, then every token that followed it — the policy's and, in a
multi-turn episode, the environment's (a tool's answer, a user turn, the chat template's markers
around them) — with, per token, a loss mask (1: the policy sampled it and is trained on it; 0: the
environment wrote it) and the sampler's log-prob (0 where the mask is 0). A single-turn rollout is
the one-segment case: every token after the prompt is the policy's. The peers' shared contract
(TRL, verl, SkyRL, OpenRLHF): prompt ids, response ids, loss mask, sampler log-probs, reward.

`pack` lays a round's samples out for the update (`PackedBatch`, right padded, the mask and the
sampler's log-probs aligned with the next-token targets) and `rows` takes a micro-batch of it.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch


@dataclass
class Sample:
    """One trajectory for one prompt, and its reward."""

    example_index: int
    prompt_ids: list[int]
    response_ids: list[int]        # every token after the prompt, the policy's and the environment's
    engine_logprobs: list[float]   # the sampler's log-prob of each response token (0 on the environment's)
    text: str                      # what the reward reads: the policy's turns
    finish_reason: str             # "stop", "length", or why the environment ended the episode
    reward: float = 0.0
    components: dict[str, float] = field(default_factory=dict)
    loss_mask: list[int] | None = None  # 1 on the policy's tokens, 0 on the environment's; None: all 1
    version: int = 0               # the policy version (updates published before it) that sampled it
    # multi-turn episodes (trainer.rl.multiturn): every turn as {"role", "text", "trained"}, the tool
    # calls made and how many failed, and the environment's own reward when it gives one
    turns: list[dict] = field(default_factory=list)
    tool_calls: int = 0
    tool_errors: int = 0
    env_reward: float | None = None

    def __post_init__(self) -> None:
        r = len(self.response_ids)
        if self.loss_mask is None:
            self.loss_mask = [1] * r
        if len(self.loss_mask) != r or len(self.engine_logprobs) < r:
            raise ValueError(f"trajectory of example {self.example_index}: {r} response tokens but "
                             f"{len(self.loss_mask)} loss-mask entries and {len(self.engine_logprobs)} "
                             "sampler log-probs; the three must line up token for token")

    @property
    def trained_tokens(self) -> int:
        """Tokens the update learns from (the policy's own)."""
        return sum(self.loss_mask)


@dataclass
class Group:
    """n samples for one prompt; GRPO's advantages are relative within a group."""

    example_index: int
    samples: list[Sample]
    round_generated: int

    def rewards(self) -> list[float]:
        return [s.reward for s in self.samples]


@dataclass
class RolloutBatch:
    round: int
    groups: list[Group]
    stats: dict[str, float] = field(default_factory=dict)
    chunks: list[int] = field(default_factory=list)  # each group's generation chunk (see the orchestrator)

    @property
    def samples(self) -> list[Sample]:
        return [s for g in self.groups for s in g.samples]


@dataclass
class PackedBatch:
    ids: torch.Tensor          # [B, T] prompt + response, right padded
    attn: torch.Tensor         # [B, T]
    mask: torch.Tensor         # [B, T-1] the loss mask at each next-token target (0 on the prompt and padding)
    adv: torch.Tensor          # [B] advantage per sequence
    engine_logp: torch.Tensor  # [B, T-1] the sampler's log-prob at each target, aligned with mask
    prompt_len: torch.Tensor   # [B]

    def to(self, device: torch.device) -> "PackedBatch":
        return PackedBatch(*(getattr(self, f.name).to(device) for f in fields(self)))


def pack(samples: list[Sample], advantages: list[float], pad_id: int) -> PackedBatch:
    """Samples side by side, right padded; target t of row i is token t + 1."""
    width = max(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    n = len(samples)
    # built as Python lists and converted once: a tensor op a row costs more than the rows' data
    ids, attn, mask, elp = [], [], [], []
    for s in samples:
        p, r = len(s.prompt_ids), len(s.response_ids)
        pad = width - p - r
        ids.append(s.prompt_ids + s.response_ids + [pad_id] * pad)
        attn.append([1] * (p + r) + [0] * pad)
        mask.append([0.0] * (p - 1) + [float(m) for m in s.loss_mask] + [0.0] * pad)
        elp.append([0.0] * (p - 1) + [lp if m else 0.0 for lp, m in zip(s.engine_logprobs, s.loss_mask)] + [0.0] * pad)
    return PackedBatch(torch.tensor(ids, dtype=torch.long), torch.tensor(attn, dtype=torch.long),
                       torch.tensor(mask, dtype=torch.float32).view(n, width - 1),
                       torch.tensor(advantages, dtype=torch.float32),
                       torch.tensor(elp, dtype=torch.float32).view(n, width - 1),
                       torch.tensor([len(s.prompt_ids) for s in samples]))


def rows(b: PackedBatch, idx: list[int]) -> PackedBatch:
    """The rows `idx` of a packed batch, with the padding they all share trimmed."""
    sel = torch.tensor(idx)
    width = int(b.attn[sel].sum(dim=1).max())
    return PackedBatch(b.ids[sel, :width], b.attn[sel, :width], b.mask[sel, : width - 1], b.adv[sel],
                       b.engine_logp[sel, : width - 1], b.prompt_len[sel])
