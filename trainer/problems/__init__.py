"""What is learned and how it is judged: a task, declared once (`task:` in the config) and asked by
data prep, the rewards, every eval, the summary, McNemar, `posttrain compare` and the registry.

A grader returns a `Verdict(score, correct)`: `score` in [0, 1] (partial credit, what the `task`
reward gives) and `correct` (what every accuracy, McNemar pair and comparison counts). Built in:

- `math`: the final number (`#### n` or `\\boxed{}`) checked by math-verify (strict), beside the
  last number of the response (flexible, `correct_flexible`); rows' answers must end in `#### n`.
- `exact`: the response's answer (the text after its last `####`, else its last non-empty line),
  stripped, equals the gold answer (the answer column, after its last `####` when it has one).
- `code`: the response's last fenced block defines the row's `entry` function; it runs in the
  sandbox (`trainer.problems.sandbox`) against the row's hidden `tests` (trainer/problems/code.py).

Anything else is a dotted path `package.module:function`: `fn(response, example)` returning a
`Verdict`, a bool, or a number in [0, 1] (1 counts as correct). The example is the prepared row:
`id`, `messages`, `answer` (the answer column's text) and every other column of the row as it was.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import math
import numbers
from dataclasses import dataclass
from typing import Any, Callable

from trainer.config import BUILTIN_GRADERS  # noqa: F401 - the names the config accepts, built below
from trainer.errors import InputError
from trainer.problems.verdict import Verdict


class TaskError(InputError):
    pass


@dataclass(frozen=True)
class Task:
    """A task's grader and what data prep and the eval table ask of it."""

    name: str
    grader: str
    grade: Callable[[str, dict[str, Any]], Verdict]
    # math's second verdict (the last number of the response); None: the task has one verdict
    lenient: Callable[[str, dict[str, Any]], Verdict] | None = None
    predicted: Callable[[str], str | None] = lambda response: None  # what the eval table shows as the answer
    format_ok: Callable[[str], bool] | None = None  # None: the task asks for no format
    # data prep: the gold answer from the answer column's text (raises DataError naming where and the fix)
    answer_of: Callable[[str, str, str], str] = lambda text, where, field_name: text.strip()
    check_row: Callable[[dict[str, Any], str], None] = lambda example, where: None
    # many at once (code: several sandboxes in parallel); None: one after another
    grade_many: Callable[[list[str], list[dict[str, Any]]], list[Verdict]] | None = None

    @property
    def is_math(self) -> bool:
        return self.grader == "math"

    def grade_all(self, responses: list[str], examples: list[dict[str, Any]]) -> list[Verdict]:
        if self.grade_many is not None:
            return self.grade_many(responses, examples)
        return [self.grade(r, ex) for r, ex in zip(responses, examples)]


# ---------------------------------------------------------------- math

def _math_task(name: str) -> Task:
    from trainer.answers import extract_answer, has_format, is_correct
    from trainer.data import final_answer

    def grade(response: str, ex: dict[str, Any]) -> Verdict:
        ok = is_correct(response, ex["answer"])
        return Verdict(float(ok), ok)

    def lenient(response: str, ex: dict[str, Any]) -> Verdict:
        ok = is_correct(response, ex["answer"], "flexible")
        return Verdict(float(ok), ok)

    return Task(name, "math", grade, lenient, extract_answer, has_format, final_answer)


# ---------------------------------------------------------------- exact

def exact_answer(text: str) -> str:
    """The text after the last `####`, else the last non-empty line, stripped (a linear scan)."""
    at = text.rfind("####")
    if at >= 0:
        return text[at + 4 :].strip()
    for line in reversed(text.splitlines()):
        if line.strip():
            return line.strip()
    return ""


def _exact_task(name: str) -> Task:
    from trainer.data import DataError

    def grade(response: str, ex: dict[str, Any]) -> Verdict:
        ok = exact_answer(response) == ex["answer"]
        return Verdict(float(ok), ok)

    def answer_of(text: str, where: str, field_name: str) -> str:
        gold = exact_answer(text) if "####" in text else text.strip()
        if not gold:
            raise DataError(f"{where}: field {field_name!r} has no answer after its '####'; put the answer "
                            "there, or drop the '####'")
        return gold

    return Task(name, "exact", grade, predicted=exact_answer, answer_of=answer_of)


# ---------------------------------------------------------------- code

def _code_task(name: str) -> Task:
    from trainer.problems import code

    def check_row(example: dict[str, Any], where: str) -> None:
        from trainer.data import DataError

        try:
            code.check_row(example, where)
        except code.CodeRowError as exc:
            raise DataError(str(exc)) from None

    return Task(name, "code", code.grade, format_ok=lambda r: code.FENCE in r, check_row=check_row,
                grade_many=code.grade_all)


# ---------------------------------------------------------------- a function of the user's

def _function(grader: str) -> Callable[..., Any]:
    module_name, _, attr = grader.partition(":")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except ImportError as exc:
        raise TaskError(f"task.grader={grader!r}: cannot import module {module_name!r} ({exc}); check the "
                        "dotted path and that the module is on the path (the run's working folder is)") from None
    except AttributeError:
        raise TaskError(f"task.grader={grader!r}: module {module_name!r} has no function {attr!r}") from None
    try:
        inspect.signature(fn).bind("response", {"id": "example"})
    except TypeError as exc:
        raise TaskError(f"task.grader={grader!r} cannot be called as {attr}(response, example) ({exc}); a "
                        "grader takes the response text and the example dict") from None
    except ValueError:  # a callable Python cannot describe: called as is
        pass
    return fn


def as_verdict(value: Any, grader: str) -> Verdict:
    """A grader's return value as a Verdict: a Verdict or (score, correct), a bool, or a number in [0, 1]."""
    if isinstance(value, tuple) and len(value) == 2:
        score, correct = value
        if isinstance(correct, bool) and isinstance(score, numbers.Real) and 0.0 <= float(score) <= 1.0:
            return Verdict(float(score), correct)
    elif isinstance(value, bool):
        return Verdict(float(value), value)
    elif isinstance(value, numbers.Real) and math.isfinite(float(value)) and 0.0 <= float(value) <= 1.0:
        return Verdict(float(value), float(value) >= 1.0)
    raise TaskError(f"task.grader={grader!r} returned {value!r:.200} ({type(value).__name__}); a grader returns "
                    "a Verdict(score, correct), a bool, or a number between 0 and 1 (1: correct)")


def _custom_task(name: str, grader: str) -> Task:
    fn = _function(grader)

    def grade(response: str, ex: dict[str, Any]) -> Verdict:
        return as_verdict(fn(response, ex), grader)

    return Task(name, grader, grade)


# ---------------------------------------------------------------- lookup

@functools.lru_cache(maxsize=16)
def _task(grader: str, name: str) -> Task:
    if grader == "math":
        return _math_task(name)
    if grader == "exact":
        return _exact_task(name)
    if grader == "code":
        return _code_task(name)
    return _custom_task(name, grader)


def task_of(spec=None) -> Task:
    """The task a `trainer.config.TaskConfig` declares (None: math, posttrain's default)."""
    if spec is None:
        return _task("math", "math")
    return _task(spec.grader, spec.label)


def check_task(spec) -> None:
    """Stop a run before any stage starts when its grader cannot be imported or called (ConfigError)."""
    from trainer.config import ConfigError

    try:
        task_of(spec)
    except TaskError as exc:
        raise ConfigError(str(exc)) from None
