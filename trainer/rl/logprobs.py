"""Per-token log-probs of a packed batch under a model: the update's forward passes.

`response_logprobs` picks the pass: prompts that several samples of a group share run once
(`shared_prefix_logprobs`, through `trainer.fasttrain`'s fused passes on Llama-family models on CPU,
else the model's own forward with a KV cache), otherwise one pass per sequence (`token_logprobs`).
Every position after the prompt gets its log-prob, the environment's tokens included: the loss
mask, not this module, decides what is trained on.
"""

from __future__ import annotations

import torch

from trainer import fasttrain
from trainer.fastgen import distinct, left_pad
from trainer.rl.trajectory import PackedBatch


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


def response_logprobs(module: torch.nn.Module, part: PackedBatch, temperature: float,
                      with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (and entropy) of a packed batch's response tokens: prompts that several samples
    share run once (`shared_prefix_logprobs`), else one pass per sequence (`token_logprobs`); the
    fused passes of `trainer.fasttrain` always take the shared layout (no padding computed)."""
    plen = part.prompt_len.tolist()
    if (fasttrain.unsupported(module) is None
            or len({tuple(part.ids[i, : plen[i]].tolist()) for i in range(len(plen))}) < len(plen)):
        return shared_prefix_logprobs(module, part.ids, part.attn, part.prompt_len, with_entropy, temperature)
    return token_logprobs(module, part.ids, part.attn, with_entropy=with_entropy, temperature=temperature)
