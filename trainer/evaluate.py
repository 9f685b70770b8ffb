"""Held-out evaluation: greedy accuracy by the run's task's verdict (trainer/problems; math: math-verify
with strict extraction, the last `#### n` or \\boxed{}, what the math reward scores, beside flexible
extraction, the last number in the text), format rate, mean response length. With a multi-turn environment (rollout.environment) each problem is a
greedy episode with its tools, graded on the policy's turns; tool calls and their success are counted.

Run alone: `posttrain eval --preset tiny`.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from trainer.chat import encode_prompt
from trainer.config import EvalConfig
from trainer.data import prompt_messages, question_of
from trainer.inference.generate import context_of, generate, too_long
from trainer.problems import Task, Verdict, task_of
from trainer.progress import progress_bar

log = logging.getLogger(__name__)


@dataclass
class EvalResult:
    accuracy: float
    format_rate: float
    mean_response_tokens: float
    n: int
    seconds: float
    rows: list[dict[str, Any]] = field(default_factory=list)
    flexible_accuracy: float = float("nan")
    tools: dict[str, float] = field(default_factory=dict)  # multi-turn: tool calls and successes
    mean_score: float = float("nan")  # the grader's partial credit (a task other than math)
    lm_eval: dict[str, float] = field(default_factory=dict)  # eval.lm_eval: lm-evaluation-harness's GSM8K scores
    over_context: int = 0  # prompts as long as the model's context (or SGLang's limit): no answer, scored wrong

    def metrics(self, prefix: str = "eval/") -> dict[str, float]:
        return {f"{prefix}accuracy": self.accuracy, f"{prefix}flexible_accuracy": self.flexible_accuracy,
                f"{prefix}format_rate": self.format_rate,
                f"{prefix}mean_response_tokens": self.mean_response_tokens, f"{prefix}n": float(self.n),
                **{f"{prefix}{k}": v for k, v in self.tools.items()},
                **{f"{prefix}{k}": v for k, v in self.lm_eval.items()},
                **({f"{prefix}prompts_over_context": float(self.over_context)} if self.over_context else {}),
                **({f"{prefix}mean_score": self.mean_score} if self.mean_score == self.mean_score else {})}


def evaluate(model: torch.nn.Module | None, tok: PreTrainedTokenizerBase, examples: list[dict], cfg: EvalConfig,
             engine=None, environment=None, label: str = "eval", task: Task | None = None,
             shots: list[dict] | None = None) -> EvalResult:
    """Greedy answers to `examples`, from `model` in this process, or from a rollout engine (an
    SGLang one: the same prompts, greedy, the same token limit) when `engine` is given. With
    `environment` (a `trainer.config.EnvironmentConfig` naming a multi-turn one) each answer is a
    greedy episode with the environment's tools, at most max_new_tokens a turn. `label` names the
    eval in its progress (`eval (sft) held-out: 300/1000 answers ...`). `task` (trainer.problems;
    default math) gives each answer its verdict. `shots` (training examples) go before each question as
    earlier chat turns, its question and worked answer each (a few-shot eval; single-turn only)."""
    examples = examples[: cfg.max_examples] if cfg.max_examples else examples
    task = task or task_of()
    t0 = time.perf_counter()
    if environment is not None and environment.multi_turn:
        return _evaluate_episodes(model, tok, examples, cfg, engine, environment, t0, label, task)
    prompts = [encode_prompt(tok, with_shots(prompt_messages(ex), shots or [])) for ex in examples]
    over = _over_context(model, prompts, label, engine)
    with progress_bar(label, total=len(prompts), unit="answers") as bar:
        if engine is not None:
            from trainer.inference.engines import SamplingParams

            gens = engine.generate(prompts, SamplingParams(cfg.max_new_tokens, temperature=0.0), progress=bar)
        else:
            gens = generate(model, tok, prompts, cfg.max_new_tokens, temperature=0.0,
                            batch_size=cfg.batch_size, progress=bar, logprobs=False)
    result = _result(examples, [(g.text, len(g.token_ids), g.finish_reason, {}, None) for g in gens], t0, task,
                     cfg.lm_eval)
    result.over_context = over
    return result


def _over_context(model: torch.nn.Module | None, prompts: list[list[int]], label: str, engine=None) -> int:
    """How many prompts get no answer, as too long for the model's context (or for what the
    engine's servers take: `prompt_limit`), so score wrong; said in the log with the fix."""
    if engine is None:
        limit, what = context_of(model), "the model's whole context"
    else:
        limit = getattr(engine, "prompt_limit", None)
        what = "more than the SGLang servers take (SGLang keeps 6 of the model's positions back)"
    over = len(too_long(prompts, limit))
    if over:
        log.warning("%s: %d of %d prompts are %d tokens or longer, %s; the longest: %d tokens, chat template and "
                    "data.system_prompt included. They get no answer and score wrong. Raise model.max_position "
                    "(a model built from its config; sft.max_length too, so that SFT trains on whole answers), or "
                    "use shorter problems", label, over, len(prompts), limit, what, max(map(len, prompts)))
    return over


def _evaluate_episodes(model, tok, examples, cfg: EvalConfig, engine, environment, t0: float,
                       label: str, task: Task) -> EvalResult:
    from trainer.inference.engines import HFEngine, SamplingParams
    from trainer.rl.envs import environment_of
    from trainer.rl.multiturn import Observations, play, tool_use

    env = environment_of(environment)
    engine = engine or HFEngine(model, tok, cfg.batch_size)
    with progress_bar(label, total=len(examples), unit="episodes") as bar:
        trajs = play(engine, tok, [env.reset(ex) for ex in examples],
                     SamplingParams(cfg.max_new_tokens, temperature=0.0), environment.max_turns,
                     environment.token_budget(cfg.max_new_tokens), Observations(tok), environment.describe_tools,
                     progress=bar)
    # an environment that grades its own episodes gives their verdicts; the task grades the others
    answers = [("\n".join(t.texts), sum(t.mask), t.reason,
                {"tool_calls": t.tool_calls, "tool_errors": t.tool_errors,
                 "turns": sum(x["role"] == "assistant" for x in t.turns)},
                None if t.reward is None else Verdict(t.reward, t.reward >= 1.0 if t.correct is None else t.correct))
               for t in trajs]
    result = _result(examples, answers, t0, task, cfg.lm_eval)
    result.tools = tool_use(trajs)
    return result


def with_shots(messages: list[dict[str, str]], shots: list[dict]) -> list[dict[str, str]]:
    """A prompt's messages with each shot's question and worked answer as earlier user and assistant
    turns, after the system prompt (lm-evaluation-harness's few-shot as multi-turn chat)."""
    if not shots:
        return messages
    system = [m for m in messages[:1] if m["role"] == "system"]
    turns = [m for shot in shots for m in shot["messages"] if m["role"] in ("user", "assistant")]
    return system + turns + messages[len(system):]


def _result(examples: list[dict], answers: list[tuple[str, int, str, dict, Verdict | None]], t0: float,
            task: Task, lm_eval: bool = False) -> EvalResult:
    """Rows and scores of (text, response tokens, finish reason, extra columns, the environment's own
    verdict or None) per example; the task grades where the environment did not. `lm_eval`: each row is
    also scored as lm-evaluation-harness's gsm8k task scores it (trainer/lm_eval_gsm8k.py)."""
    from trainer import lm_eval_gsm8k

    rows = []
    todo = [i for i, a in enumerate(answers) if a[4] is None]  # what the environment did not grade
    graded = dict(zip(todo, task.grade_all([answers[i][0] for i in todo], [examples[i] for i in todo])))
    for i, (ex, (text, n_tokens, reason, extra, own)) in enumerate(zip(examples, answers)):
        verdict = own if own is not None else graded[i]
        row = {"id": ex["id"], "question": question_of(ex), "gold": ex["answer"], "response": text,
               "predicted": task.predicted(text), "correct": verdict.correct}
        if task.lenient is not None and own is None:
            row["correct_flexible"] = task.lenient(text, ex).correct
        elif task.lenient is not None:  # graded by the environment: one verdict
            row["correct_flexible"] = verdict.correct
        if not task.is_math or own is not None:
            row["score"] = verdict.score
        if lm_eval:
            for mode in ("strict", "flexible"):
                answer, row[f"correct_lm_{mode}"] = lm_eval_gsm8k.scored(text, ex["answer"], mode)
                row[f"lm_{mode}"] = answer[:100]
        row.update({"format_ok": task.format_ok(text) if task.format_ok else None, "response_tokens": n_tokens,
                    "finish_reason": reason, **extra})
        rows.append(row)
    n = max(len(rows), 1)
    formats = [r["format_ok"] for r in rows if r["format_ok"] is not None]
    scores = [r["score"] for r in rows if "score" in r]
    return EvalResult(
        accuracy=sum(r["correct"] for r in rows) / n,
        flexible_accuracy=(sum(r["correct_flexible"] for r in rows) / n) if task.lenient else float("nan"),
        format_rate=sum(formats) / len(formats) if formats else float("nan"),
        mean_response_tokens=sum(r["response_tokens"] for r in rows) / n,
        n=len(rows), seconds=time.perf_counter() - t0, rows=rows,
        mean_score=sum(scores) / len(scores) if scores and not task.is_math else float("nan"),
        lm_eval={f"lm_{mode}_accuracy": sum(r[f"correct_lm_{mode}"] for r in rows) / n
                 for mode in ("strict", "flexible")} if lm_eval else {},
    )
