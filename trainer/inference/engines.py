"""Rollout engines behind one small interface, and the sampling parameters they take.

An engine turns prompts (token ids) into `Generation`s (token ids, per-token log-probs under the
sampling distribution, finish reason) and can receive new weights. `HFEngine` runs in process and
shares the policy's module, so a weight sync costs nothing; `trainer.inference.sglang.SGLangEngine` talks
to SGLang servers over HTTP.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from trainer.inference.generate import Generation, generate


@dataclass
class SamplingParams:
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    min_new_tokens: int = 0
    stop: tuple[str, ...] = ()  # strings that end a sequence (a tool call's end); the token completing one is kept


class RolloutEngine(Protocol):
    concurrent: bool  # whether generate() may be called from several threads at once

    # progress: a bar (`update(n)` as n more prompts are answered), or None
    def generate(self, prompts: list[list[int]], params: SamplingParams, progress=None) -> list[Generation]: ...
    def update_weights(self, model_dir: str | None) -> None: ...
    def close(self) -> None: ...


class HFEngine:
    """In-process generation with the policy's own module (world size 1). A LoRA policy generates with
    its adapters merged into the weights for the call (`merge`, trainer.lora.merged: no copy of the
    base), or computed at every token (merge=False)."""

    concurrent = False  # one call at a time: it computes in this process

    def __init__(self, module: torch.nn.Module, tok, batch_size: int = 512, merge: bool = True) -> None:
        from trainer.lora import inner

        self.module, self.tok, self.batch_size, self.merge = inner(module), tok, batch_size, merge

    def generate(self, prompts: list[list[int]], params: SamplingParams, progress=None) -> list[Generation]:
        from trainer.lora import merged

        with merged(self.module, self.merge):
            return generate(self.module, self.tok, prompts, params.max_new_tokens, temperature=params.temperature,
                            top_p=params.top_p, batch_size=self.batch_size, seed=params.seed,
                            min_new_tokens=params.min_new_tokens, stop=params.stop, progress=progress)

    def update_weights(self, model_dir: str | None) -> None:
        pass  # shares the trainer's parameters

    def close(self) -> None:
        pass
