"""Held-out evaluation: greedy accuracy (math-verify) with strict extraction (the last `#### n` or
\\boxed{}, what the math reward scores) and flexible extraction (the last number in the text), format
rate, mean response length.

Run alone: `posttrain eval --preset tiny`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from trainer.answers import extract_answer, has_format, is_correct
from trainer.chat import encode_prompt
from trainer.config import EvalConfig
from trainer.data import prompt_messages
from trainer.generate import generate
from trainer.progress import progress_bar


@dataclass
class EvalResult:
    accuracy: float
    format_rate: float
    mean_response_tokens: float
    n: int
    seconds: float
    rows: list[dict[str, Any]] = field(default_factory=list)
    flexible_accuracy: float = float("nan")

    def metrics(self, prefix: str = "eval/") -> dict[str, float]:
        return {f"{prefix}accuracy": self.accuracy, f"{prefix}flexible_accuracy": self.flexible_accuracy,
                f"{prefix}format_rate": self.format_rate,
                f"{prefix}mean_response_tokens": self.mean_response_tokens, f"{prefix}n": float(self.n)}


def evaluate(model: torch.nn.Module | None, tok: PreTrainedTokenizerBase, examples: list[dict], cfg: EvalConfig,
             engine=None) -> EvalResult:
    """Greedy answers to `examples`, from `model` in this process, or from a rollout engine (an
    SGLang one: the same prompts, greedy, the same token limit) when `engine` is given."""
    examples = examples[: cfg.max_examples] if cfg.max_examples else examples
    prompts = [encode_prompt(tok, prompt_messages(ex)) for ex in examples]
    t0 = time.perf_counter()
    if engine is not None:
        from trainer.rl.engines import SamplingParams

        gens = engine.generate(prompts, SamplingParams(cfg.max_new_tokens, temperature=0.0))
    else:
        with progress_bar("eval", total=len(prompts)) as bar:
            gens = generate(model, tok, prompts, cfg.max_new_tokens, temperature=0.0,
                            batch_size=cfg.batch_size, progress=bar, logprobs=False)
    rows = []
    for ex, g in zip(examples, gens):
        ok = is_correct(g.text, ex["answer"])
        rows.append({"id": ex["id"], "question": ex["messages"][-2]["content"], "gold": ex["answer"],
                     "response": g.text, "predicted": extract_answer(g.text), "correct": ok,
                     "correct_flexible": is_correct(g.text, ex["answer"], "flexible"),
                     "format_ok": has_format(g.text), "response_tokens": len(g.token_ids),
                     "finish_reason": g.finish_reason})
    n = max(len(rows), 1)
    return EvalResult(
        accuracy=sum(r["correct"] for r in rows) / n,
        flexible_accuracy=sum(r["correct_flexible"] for r in rows) / n,
        format_rate=sum(r["format_ok"] for r in rows) / n,
        mean_response_tokens=sum(r["response_tokens"] for r in rows) / n,
        n=len(rows), seconds=time.perf_counter() - t0, rows=rows,
    )
