"""Rewards: plain functions `fn(response: str, example: dict) -> float`, chosen by name or dotted path.

Built in: `task` (the default: the score of the run's task's grader, trainer/problems), `math` (1.0 when math-verify says the final answer equals the gold answer), `format`
(1.0 when the response's last `####` holds a number, or it has a \\boxed{} answer) and `reward_model`
(a HF sequence-classification model loaded from a path, scoring prompt + response). Any
other name is a dotted path `package.module:function` or `package.module.function`. The config
mixes them with weights. A reward that returns NaN/inf or raises stops the round naming it and the
example, or is counted and its sample dropped when `grpo.on_bad_reward: skip` (the first traceback
of each reward in a round goes to the log).
"""

from __future__ import annotations

import importlib
import inspect
import logging
import math
import numbers
from dataclasses import dataclass, field
from typing import Any, Callable

from trainer.answers import has_format, is_correct
from trainer.data import prompt_messages
from trainer.errors import InputError

RewardFn = Callable[[str, dict[str, Any]], float]
log = logging.getLogger(__name__)


class RewardError(InputError):
    pass


def math_reward(response: str, example: dict[str, Any]) -> float:
    return 1.0 if is_correct(response, example["answer"]) else 0.0


def format_reward(response: str, example: dict[str, Any]) -> float:
    return 1.0 if has_format(response) else 0.0


class RewardModel:
    """A HF AutoModelForSequenceClassification scoring the chat (prompt + response); logit 0."""

    MAX_TOKENS = 1024

    def __init__(self, path: str) -> None:
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        from trainer.engine import device
        from trainer.model import ModelLoadError, resolve_pretrained

        try:
            local = resolve_pretrained(path, field="grpo.rewards[].path")
        except ModelLoadError as exc:  # names the setting, the path and the fix
            raise RewardError(str(exc)) from None
        try:
            self.tok = AutoTokenizer.from_pretrained(local)
            self.model = AutoModelForSequenceClassification.from_pretrained(local).eval().to(device())
        except (OSError, ValueError) as exc:
            raise RewardError(f"grpo.rewards: reward_model path {path!r} could not be loaded: {exc}") from None
        if self.tok.pad_token is None:
            self.tok.pad_token = self.tok.eos_token
        self.model.config.pad_token_id = self.tok.pad_token_id
        # past MAX_TOKENS the conversation loses its beginning, never the response being judged
        self.tok.truncation_side = "left"

    def __call__(self, response: str, example: dict[str, Any]) -> float:
        return self.score([response], [example])[0]

    def score(self, responses: list[str], examples: list[dict[str, Any]]) -> list[float]:
        import torch

        texts = [_chat_text(self.tok, ex, r) for r, ex in zip(responses, examples)]
        enc = self.tok(texts, return_tensors="pt", padding=True, truncation=True,
                       max_length=self.MAX_TOKENS).to(self.model.device)
        with torch.no_grad():
            logits = self.model(**enc).logits
        return logits[:, 0].float().tolist()


def _chat_text(tok, example: dict[str, Any], response: str) -> str:
    msgs = prompt_messages(example) + [{"role": "assistant", "content": response}]
    if getattr(tok, "chat_template", None):
        return tok.apply_chat_template(msgs, tokenize=False)
    return "\n".join(m["content"] for m in msgs)


BUILTIN: dict[str, RewardFn] = {"math": math_reward, "format": format_reward}


def split_dotted(name: str) -> tuple[str, str]:
    """'package.module:function' or 'package.module.function' -> (module, function)."""
    module_name, sep, attr = name.partition(":")
    if not sep:
        module_name, _, attr = name.rpartition(".")
    return module_name, attr


class TaskReward:
    """The `task` reward: the score of the run's task's grader (trainer.problems; math: 1 or 0),
    a round's samples graded together (code: several sandboxes at once)."""

    def __init__(self, task) -> None:
        self.task = task

    def __call__(self, response: str, example: dict[str, Any]) -> float:
        return self.task.grade(response, example).score

    def score(self, responses: list[str], examples: list[dict[str, Any]]) -> list[float]:
        return [v.score for v in self.task.grade_all(responses, examples)]


def resolve(name: str, path: str | None = None, task=None) -> RewardFn:
    """A reward function by built-in name, `task` (the run's task's grader: `task`, a
    trainer.problems.Task, default math), `reward_model` (with path), or dotted path."""
    if name == "task":
        from trainer.problems import task_of

        return TaskReward(task or task_of())
    if name in BUILTIN:
        return BUILTIN[name]
    if name == "reward_model":
        if not path:
            raise RewardError("grpo.rewards: reward_model needs `path` (a local folder, s3:// URI or hub name)")
        return RewardModel(path)
    module_name, attr = split_dotted(name)
    if not module_name or not attr:
        raise RewardError(f"grpo.rewards: {name!r} is not a built-in reward ({sorted(BUILTIN)}, task or "
                          "reward_model) nor a dotted path like package.module:function")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except ImportError as exc:
        raise RewardError(f"grpo.rewards: cannot import module {module_name!r} for reward {name!r} "
                          f"({exc}); check the dotted path and that the module is installed") from None
    except AttributeError:
        raise RewardError(f"grpo.rewards: module {module_name!r} has no function {attr!r}") from None
    if not callable(fn):
        raise RewardError(f"grpo.rewards: {name!r} is not callable")
    return fn


def check_rewards(specs) -> None:
    """Stop a run before any stage starts when a reward named by dotted path cannot be imported or is
    not a function (`grpo.rewards`); a `reward_model` needs its `path` (the model loads with the
    stage). Raises ConfigError naming the reward and the fix."""
    from trainer.config import ConfigError

    for spec in specs:
        if spec.name in BUILTIN or spec.name == "task" or (spec.name == "reward_model" and spec.path):
            continue
        try:
            fn = resolve(spec.name, spec.path)
        except RewardError as exc:
            raise ConfigError(str(exc)) from None
        try:
            signature = inspect.signature(fn)
        except (TypeError, ValueError):  # a callable Python cannot describe (some built-ins): called as is
            continue
        try:
            signature.bind("response", {"id": "example"})
        except TypeError as exc:
            raise ConfigError(f"grpo.rewards: {spec.name!r} cannot be called as {spec.name}(response, example) "
                              f"({exc}); a reward takes the response text and the example dict and returns a "
                              "float") from None


@dataclass
class RewardMix:
    """Weighted sum of named rewards; also reports each component."""

    names: list[str]
    fns: list[RewardFn]
    weights: list[float]
    # the last `score`'s samples whose reward raised: index -> "reward 'name' raised Error: text"
    raised: dict[int, str] = field(default_factory=dict, init=False)

    @classmethod
    def from_specs(cls, specs, task=None) -> "RewardMix":
        return cls([s.name for s in specs], [resolve(s.name, s.path, task) for s in specs], [s.weight for s in specs])

    def score(self, responses: list[str], examples: list[dict[str, Any]]) -> tuple[list[float | None], dict[str, list[float]]]:
        """(total per sample, or None where a component was not finite; components by name)."""
        parts: dict[str, list[float]] = {}
        self.raised = {}
        for name, fn in zip(self.names, self.fns):
            if isinstance(fn, RewardModel) or (isinstance(fn, TaskReward) and fn.task.grade_many is not None):
                values = fn.score(responses, examples)
            else:
                values = _called(name, fn, responses, examples, self.raised)
            parts[name] = [_number(name, v) for v in values]
        totals: list[float | None] = []
        for i in range(len(responses)):
            vals = [parts[n][i] for n in self.names]
            totals.append(None if any(not math.isfinite(v) for v in vals)
                          else sum(w * v for w, v in zip(self.weights, vals)))
        return totals, parts


def _called(name: str, fn: RewardFn, responses: list[str], examples: list[dict[str, Any]],
            raised: dict[int, str]) -> list[Any]:
    """fn(response, example) for each sample; NaN where it raises (a bad reward, as NaN is), noted in
    `raised` by sample, the first traceback logged."""
    values, logged = [], False
    for i, (r, ex) in enumerate(zip(responses, examples)):
        try:
            values.append(fn(r, ex))
        except Exception as exc:  # noqa: BLE001 - the user's reward code: named with its example
            what = f"reward {name!r} raised {type(exc).__name__}: {exc}"
            if not logged:
                log.warning("grpo.rewards: %s on example %r", what, ex.get("id"), exc_info=True)
                logged = True
            raised.setdefault(i, what)
            values.append(float("nan"))
    return values


def _number(name: str, value: Any) -> float:
    """A reward's value as a float: any real number (numpy's and 0-d tensors' included) or a bool."""
    if isinstance(value, numbers.Real):  # int, float, bool, numpy's integer and floating scalars
        return float(value)
    if getattr(value, "ndim", None) == 0 and hasattr(value, "item"):  # a 0-d numpy array or torch tensor
        item = value.item()
        if isinstance(item, numbers.Real):
            return float(item)
    raise RewardError(f"grpo.rewards: reward {name!r} returned {value!r} ({type(value).__name__}); "
                      "a reward must return a float")
