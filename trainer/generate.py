"""Batched generation with the policy's own weights (the in-process HF engine's core).

Prompts are left-padded; generation stops at EOS or `max_new_tokens`. Returns the new token ids,
their log-probabilities under the sampling distribution, and why each sequence stopped.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from transformers import PreTrainedTokenizerBase

from trainer.fastgen import FastDecoder, left_pad, unsupported

log = logging.getLogger(__name__)
_WARNED: set[str] = set()


def decoder_for(model: torch.nn.Module) -> FastDecoder | None:
    """A fast decoder for the model (cheap to make: the weights are packed at each call), or None
    with the reason logged once."""
    reason = unsupported(model)
    if reason is None:
        return FastDecoder(model)
    if reason not in _WARNED:
        _WARNED.add(reason)
        log.info("generation uses HF generate: the fast decoder does not cover this model (%s)", reason)
    return None


@dataclass
class Generation:
    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str  # "stop" (EOS) or "length"


@torch.no_grad()
def generate(
    model: torch.nn.Module,
    tok: PreTrainedTokenizerBase,
    prompts: list[list[int]],
    max_new_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    batch_size: int = 256,
    seed: int | None = None,
    progress=None,
    logprobs: bool = True,
    min_new_tokens: int = 0,
) -> list[Generation]:
    """Greedy when temperature == 0, else sampling with temperature / top-p.

    Log-probabilities are of the tempered distribution softmax(logits / T) without top-p
    renormalisation, as SGLang returns them and as the trainer computes them (the importance
    ratios compare like with like). `logprobs=False` (greedy eval) asks `generate` for no logits
    at all: its memory then does not grow with vocabulary x new tokens. EOS is not sampled before
    `min_new_tokens` (its log-probability stays that of the unmasked distribution).

    Llama-family models on CPU decode through `trainer.fastgen` (same tokens up to float rounding,
    about 1.4x faster on small models); any other model through HF `generate`."""
    was_training = model.training
    model.eval()
    out: list[Generation] = []
    generator_seed = seed
    eos, pad = tok.eos_token_id, tok.pad_token_id
    # Longest prompts first keeps padding low; results are put back in input order.
    order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
    results: dict[int, Generation] = {}
    fast = decoder_for(model)
    for start in range(0, len(order), batch_size):
        idx = order[start : start + batch_size]
        batch = [prompts[i] for i in idx]
        if generator_seed is not None:
            torch.manual_seed(generator_seed + start)
        if fast is not None:
            toks_all, lps_all = fast.decode(batch, max_new_tokens, eos, pad, temperature=temperature, top_p=top_p,
                                            min_new=min_new_tokens, logprobs=logprobs)
            for r, i in enumerate(idx):
                body = toks_all[r]
                results[i] = Generation(prompt_ids=prompts[i], token_ids=body, logprobs=lps_all[r],
                                        text=tok.decode(body, skip_special_tokens=True),
                                        finish_reason="stop" if body and body[-1] == eos else "length")
            if progress is not None:
                progress.update(len(idx))
            continue
        ids, attn = left_pad(batch, pad)
        width = ids.shape[1]
        kwargs = dict(do_sample=temperature > 0, max_new_tokens=max_new_tokens, pad_token_id=pad,
                      eos_token_id=eos, return_dict_in_generate=True, output_logits=logprobs,
                      min_new_tokens=min_new_tokens or None)
        if temperature > 0:
            kwargs.update(temperature=temperature, top_p=top_p, top_k=0)
        gen = model.generate(input_ids=ids, attention_mask=attn, **kwargs)
        new = gen.sequences[:, width:]
        logp = torch.zeros(new.shape, dtype=torch.float32)
        if logprobs:  # one step at a time: no [B, T, V] copy beside the raw logits generate keeps
            for t, step in enumerate(gen.logits):
                step = step.float() / temperature if temperature > 0 else step.float()
                logp[:, t] = torch.log_softmax(step, dim=-1).gather(-1, new[:, t : t + 1]).squeeze(-1)
        for r, i in enumerate(idx):
            toks = new[r].tolist()
            n = toks.index(eos) + 1 if eos in toks else len(toks)
            reason = "stop" if eos in toks[:n] else "length"
            body = toks[:n]
            results[i] = Generation(
                prompt_ids=prompts[i], token_ids=body, logprobs=logp[r, :n].tolist() if logprobs else [],
                text=tok.decode(body, skip_special_tokens=True), finish_reason=reason,
            )
        if progress is not None:
            progress.update(len(idx))
    out = [results[i] for i in range(len(prompts))]
    model.train(was_training)
    return out
