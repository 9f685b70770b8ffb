"""Batched generation with the policy's own weights (the in-process HF engine's core).

Prompts are left-padded; generation stops at EOS, at a stop string (a tool call's end), or at
`max_new_tokens`. Returns the new token ids, their log-probabilities under the sampling
distribution, and why each sequence stopped.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass

import torch
from transformers import PreTrainedTokenizerBase

from trainer.inference.cpu import FastDecoder, left_pad, unsupported
from trainer.inference.cuda import StaticDecoder

log = logging.getLogger(__name__)
_WARNED: set[str] = set()
# a model's fixed-shape decoder lives as long as the model: its captured graphs serve every later call
_STATIC: "weakref.WeakKeyDictionary[torch.nn.Module, StaticDecoder]" = weakref.WeakKeyDictionary()


def decoder_for(model: torch.nn.Module) -> FastDecoder | None:
    """The model's fast decoder, or None with the reason logged once: on CPU the compiled one (cheap
    to make: the weights are packed at each call), on CUDA the fixed-shape one with its graphs (one
    per model, kept)."""
    cls = StaticDecoder if next(model.parameters()).device.type == "cuda" else FastDecoder
    reason = unsupported(model, devices=cls.devices)
    if reason is None:
        if cls is FastDecoder:
            return FastDecoder(model)
        if model not in _STATIC:
            _STATIC[model] = StaticDecoder(model)
        return _STATIC[model]
    if reason not in _WARNED:
        _WARNED.add(reason)
        log.info("generation uses HF generate: the fast decoder does not cover this model (%s)", reason)
    return None


class _SampledLogprobs:
    """A logits processor for HF `generate` that keeps the log-probability of each sampled token
    under softmax(logits / T), one step behind: at step t+1 the token sampled at step t is the last
    of `input_ids`. It holds one step's [B, V] log-probs, where `output_logits` would keep every
    step's (B x V x new tokens: 45 GB for 384 rollouts of 384 tokens over Qwen's 151,936-token
    vocabulary). It also holds EOS back for `min_new` tokens, after taking the log-probs, so a
    held-back EOS leaves the distribution unmasked (as the fast decoder and SGLang report it)."""

    def __init__(self, width: int, temperature: float, eos: int | None, min_new: int, keep: bool) -> None:
        self.width, self.temperature, self.eos, self.min_new, self.keep = width, temperature, eos, min_new, keep
        self.last: torch.Tensor | None = None
        self.steps: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.keep:
            if self.last is not None:
                self.steps.append(self.last.gather(-1, input_ids[:, -1:]).squeeze(-1))
            step = scores.float() / self.temperature if self.temperature > 0 else scores.float()
            self.last = torch.log_softmax(step, dim=-1)
        if self.eos is not None and input_ids.shape[1] - self.width < self.min_new:
            scores = scores.clone()
            scores[:, self.eos] = float("-inf")
        return scores

    def logprobs(self, new: torch.Tensor) -> torch.Tensor:
        """[B, new tokens] log-probs of `new`, the tokens generated."""
        if self.last is not None and new.shape[1]:
            self.steps.append(self.last.gather(-1, new[:, -1:]).squeeze(-1))
        self.last = None
        return torch.stack(self.steps, 1) if self.steps else torch.zeros(new.shape, device=new.device)


class StopStrings:
    """True once a row's new tokens' text contains one of `stops` (the token that completes it is
    kept: the policy's tokens are never cut or re-encoded). Only the last few tokens are decoded
    each step: an occurrence ending in the newest token fits in them."""

    def __init__(self, tok: PreTrainedTokenizerBase, stops: tuple[str, ...]) -> None:
        self.tok, self.stops = tok, tuple(s for s in stops if s)
        self.window = max((len(s) for s in self.stops), default=0) + 2

    def __call__(self, tokens: list[int]) -> bool:
        tail = self.tok.decode(tokens[-self.window :], skip_special_tokens=False)
        return any(s in tail for s in self.stops)

    def end(self, tokens: list[int]) -> int | None:
        """Tokens up to and including the one that completes the first stop string; None if none does."""
        for n in range(1, len(tokens) + 1):
            if self(tokens[max(0, n - self.window):n]):  # the window only: linear in the tokens
                return n
        return None


@dataclass
class Generation:
    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str  # "stop" (EOS or a stop string) or "length"
    served_by: str | None = None  # the server that generated it (None: in this process)

    @classmethod
    def no_room(cls, prompt_ids: list[int]) -> "Generation":
        """The answer to a prompt too long for the model: no token, "length" (a response cut at the
        context's end)."""
        return cls(prompt_ids=prompt_ids, token_ids=[], logprobs=[], text="", finish_reason="length")


def context_of(model: torch.nn.Module) -> int | None:
    """The model's context in tokens (its config's max_position_embeddings), or None if it names none."""
    n = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    return n if isinstance(n, int) and n > 0 else None


def too_long(prompts: list[list[int]], limit: int | None) -> set[int]:
    """The prompts (indices) of `limit` tokens or more (none without a limit): those an engine
    answers with no token, finish reason "length"."""
    return {i for i, p in enumerate(prompts) if len(p) >= limit} if limit is not None else set()


def over_context(model: torch.nn.Module, prompts: list[list[int]]) -> set[int]:
    """The prompts (indices) that fill the model's context: no position is left for a new token."""
    return too_long(prompts, context_of(model))


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
    stop: tuple[str, ...] = (),
) -> list[Generation]:
    """Greedy when temperature == 0, else sampling with temperature / top-p.

    Log-probabilities are of the tempered distribution softmax(logits / T) without top-p
    renormalisation, as SGLang returns them and as the trainer computes them (the importance
    ratios compare like with like). `logprobs=False` (greedy eval) asks `generate` for no logits
    at all: its memory then does not grow with vocabulary x new tokens. EOS is not sampled before
    `min_new_tokens` (its log-probability stays that of the unmasked distribution). A sequence
    also ends at the token that completes one of the `stop` strings (kept, as SGLang keeps it).

    Llama-family models decode through `trainer.inference.cpu` (same tokens up to float rounding): on
    CPU its compiled decoder (about 1.4x faster than `generate` on small models), on CUDA its
    fixed-shape decoder with CUDA graphs; any other model through HF `generate`."""
    was_training = model.training
    model.eval()
    out: list[Generation] = []
    generator_seed = seed
    eos = tok.eos_token_id
    pad = tok.pad_token_id if tok.pad_token_id is not None else eos  # a left pad is never attended
    # Longest prompts first keeps padding low; results are put back in input order.
    order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
    results: dict[int, Generation] = {}
    # A prompt that fills the model's context gets no token ("length", as a response cut at the
    # context's end), and the rest of its batch decodes on.
    over = over_context(model, prompts)
    for i in over:
        results[i] = Generation.no_room(prompts[i])
    order = order[len(over):]  # the longest first: those are the ones over
    if progress is not None and results:
        progress.update(len(results))
    fast = decoder_for(model)
    stopper = StopStrings(tok, stop) if stop else None
    device = next(model.parameters()).device  # HF generate: the prompts go where the weights are
    for start in range(0, len(order), batch_size):
        idx = order[start : start + batch_size]
        batch = [prompts[i] for i in idx]
        if generator_seed is not None:
            torch.manual_seed(generator_seed + start)
        if fast is not None:
            toks_all, lps_all = fast.decode(batch, max_new_tokens, eos, pad, temperature=temperature, top_p=top_p,
                                            min_new=min_new_tokens, logprobs=logprobs, stop=stopper)
            for r, i in enumerate(idx):
                body = toks_all[r]
                stopped = bool(body) and (body[-1] == eos or (stopper is not None and stopper(body)))
                results[i] = Generation(prompt_ids=prompts[i], token_ids=body, logprobs=lps_all[r],
                                        text=tok.decode(body, skip_special_tokens=True),
                                        finish_reason="stop" if stopped else "length")
            if progress is not None:
                progress.update(len(idx))
            continue
        ids, attn = left_pad(batch, pad)
        ids, attn = ids.to(device), attn.to(device)
        width = ids.shape[1]
        kwargs = dict(do_sample=temperature > 0, max_new_tokens=max_new_tokens, pad_token_id=pad,
                      eos_token_id=eos, return_dict_in_generate=True)
        if temperature > 0:
            kwargs.update(temperature=temperature, top_p=top_p, top_k=0)
        if stopper is not None:
            kwargs.update(stop_strings=list(stopper.stops), tokenizer=tok)
        # ahead of the temperature and top-p warpers, which generate adds after the processors given
        record = _SampledLogprobs(width, temperature, eos, min_new_tokens, keep=logprobs)
        gen = model.generate(input_ids=ids, attention_mask=attn, logits_processor=[record], **kwargs)
        new = gen.sequences[:, width:]
        logp = record.logprobs(new) if logprobs else None
        new, logp = new.cpu(), (logp.cpu() if logp is not None else None)  # one copy back, not one a row
        for r, i in enumerate(idx):
            toks = new[r].tolist()
            n = toks.index(eos) + 1 if eos in toks else len(toks)
            reason = "stop" if eos in toks[:n] else "length"
            at = stopper.end(toks[:n]) if stopper is not None else None
            if at is not None:  # a stop string before EOS: what follows it is padding
                n, reason = at, "stop"
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
