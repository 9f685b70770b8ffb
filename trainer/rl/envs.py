"""Environments: episodes of one or more turns, with tools.

An `Environment` is reset from a dataset row and returns an `Episode`: the initial messages and
the tools offered. The rollout driver renders the conversation, lets the policy write a turn (it
stops at the end of a tool call, `TOOL_CALL_END`), and calls `Episode.step(text)` with that turn's
text; the episode answers with observation messages (a tool's result, an error the policy can
read) or ends, with a reason and optionally its own reward. The driver owns the limits on turns
and trajectory tokens, and appends the observation's tokens as rendered by the chat template,
without decoding and re-encoding the policy's own.

Tools are typed Python functions; their JSON schema comes from the signature and the Google-style
docstring (`transformers.utils.get_json_schema`, what `apply_chat_template(tools=...)` takes).
Calls are written as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (the Hermes /
Qwen format most chat templates with tools render); trainer/rl/tools.py parses them and holds the calculator.

Built in: `single_turn` (one answer, graded by the configured rewards) and `calculator` (a safe
arithmetic evaluator: no `eval`, bounded operand sizes and exponents, exact fractions). Custom:
`package.module:Class`, a subclass of `Environment`, or a TRL-style class (no-argument
constructor, `reset(**row)`, its public methods the tools), adapted by `TRLStyleEnvironment`.

Whatever the policy writes is handled in bounded time: a call that does not parse, names an
unknown tool, passes wrong arguments, raises, or runs past `tool_timeout_s` becomes an error the
policy reads as the tool's answer, counted in `Step.tool_errors`.
"""

from __future__ import annotations

import importlib
import inspect
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

from trainer.config import ConfigError, EnvironmentConfig
from trainer.data import prompt_messages
from trainer.errors import InputError
from trainer.rl.tools import calculator, parse_tool_calls

MAX_RESULT_CHARS = 500  # a tool's answer is cut here (the policy reads it as tokens)


class EnvironmentSpecError(InputError):
    """rollout.environment names something that cannot be used; raised before the run starts."""


# ---------------------------------------------------------------- records

@dataclass
class Step:
    """An environment's answer to one policy turn."""

    observation: list[dict[str, str]] = field(default_factory=list)  # messages to append
    done: bool = False
    reward: float | None = None   # the episode's reward, when the environment grades it itself
    # its verdict, what the evals count as correct (unset with a reward: correct when the reward is 1 or more)
    correct: bool | None = None
    reason: str = ""              # why it ended ("answer", "max_turns", ...), or "" while it goes on
    tool_calls: int = 0
    tool_errors: int = 0


class Episode:
    """One episode: `messages` and `tools` to start from; `step` after each policy turn."""

    def __init__(self, messages: list[dict[str, str]], tools: list[Tool] | None = None) -> None:
        self.messages = messages
        self.tools = tools or []

    def step(self, text: str) -> Step:
        raise NotImplementedError


class Environment:
    """Subclass and implement `reset(example) -> Episode`. `max_turns`: policy turns per episode."""

    max_turns: int = 1

    def reset(self, example: dict[str, Any]) -> Episode:
        raise NotImplementedError


class EnvironmentRunError(InputError):
    """An environment's own code failed in an episode: names the class, the method, the example and
    the error (its traceback, chained, is in the log)."""


def _owner(obj: Any) -> str:
    return getattr(obj, "cls", type(obj)).__name__  # a TRL-style class: the user's, not the adapter


def _guarded(where: str, call: Callable[[], Any], kind: type) -> Any:
    """call(), the user's code: what it raises, or returns other than a `kind`, named by `where`."""
    try:
        out = call()
    except Exception as exc:
        raise EnvironmentRunError(f"{where} raised {type(exc).__name__}: {exc}; fix the environment (its traceback "
                                  "is in the log)") from exc
    if not isinstance(out, kind):
        raise EnvironmentRunError(f"{where} returned {type(out).__name__}, not {'an' if kind.__name__[0] in 'AEIOU' else 'a'}"
                                  f" {kind.__name__} (trainer.rl.envs)")
    return out


def reset_episode(environment: Environment, example: dict[str, Any]) -> Episode:
    """environment.reset(example), its failures named."""
    return _guarded(f"rollout.environment: {_owner(environment)}.reset on example {example.get('id')!r}",
                    lambda: environment.reset(example), Episode)


def step_episode(episode: Episode, text: str, turn: int) -> Step:
    """episode.step(text) after the policy's turn `turn` (from 1), its failures named."""
    return _guarded(f"rollout.environment: {_owner(episode)}.step after turn {turn}", lambda: episode.step(text), Step)


# ---------------------------------------------------------------- tools

_JSON_TYPES = {"string": str, "integer": int, "number": (int, float), "boolean": bool, "array": list,
               "object": dict}


@dataclass
class Tool:
    """A typed function the policy may call."""

    fn: Callable[..., Any]
    name: str
    schema: dict[str, Any]  # {"type": "function", "function": {"name", "description", "parameters"}}

    @classmethod
    def from_function(cls, fn: Callable[..., Any]) -> Tool:
        from transformers.utils import get_json_schema

        name = getattr(fn, "__name__", repr(fn))
        try:
            schema = get_json_schema(fn)
        except Exception as exc:  # transformers' TypeHintParsingException / DocstringParsingException
            raise EnvironmentSpecError(
                f"tool {name!r}: {exc}; a tool needs a type hint on every argument and a docstring "
                "with an Args: section describing each") from None
        return cls(fn, schema["function"]["name"], schema)

    def run(self, arguments: Any, timeout_s: float) -> tuple[str, bool]:
        """(the answer the policy reads, whether it is an error). Never raises, returns in
        about `timeout_s` at most: a call still running then is left to finish on its own thread
        (Python cannot stop a thread) and reported as timed out."""
        params = self.schema["function"]["parameters"]
        props, required = params.get("properties", {}), params.get("required", [])
        if not isinstance(arguments, dict):
            return f"error: {self.name} takes an object of arguments, got {type(arguments).__name__}", True
        unknown = sorted(set(arguments) - set(props))
        if unknown:
            return f"error: {self.name} has no argument {unknown[0]!r}; it takes {sorted(props)}", True
        missing = [a for a in required if a not in arguments]
        if missing:
            return f"error: {self.name} needs the argument {missing[0]!r}", True
        for key, value in arguments.items():
            want = _JSON_TYPES.get(props[key].get("type"))
            if want is not None and (not isinstance(value, want) or (want is not bool and isinstance(value, bool))):
                return f"error: {self.name}'s argument {key!r} must be of type {props[key]['type']}", True
        box: dict[str, Any] = {}

        def call() -> None:
            try:
                box["value"] = self.fn(**arguments)
            except BaseException as exc:  # anything a tool raises is the policy's observation
                box["error"] = f"{type(exc).__name__}: {exc}"

        worker = threading.Thread(target=call, name=f"tool-{self.name}", daemon=True)
        worker.start()
        worker.join(timeout_s)
        if worker.is_alive():
            return f"error: {self.name} timed out after {timeout_s:g}s", True
        if "error" in box:
            return f"error: {self.name} raised {box['error']}"[:MAX_RESULT_CHARS], True
        return str(box.get("value"))[:MAX_RESULT_CHARS], False


class ToolEpisode(Episode):
    """Tools answered until the policy writes a turn without a call (its answer) or `max_turns`."""

    def __init__(self, messages: list[dict[str, str]], tools: list[Tool], max_turns: int,
                 tool_timeout_s: float) -> None:
        super().__init__(messages, tools)
        self.max_turns, self.tool_timeout_s, self.turns = max_turns, tool_timeout_s, 0
        self._by_name = {t.name: t for t in tools}

    def step(self, text: str) -> Step:
        self.turns += 1
        calls = parse_tool_calls(text)
        if not calls:
            return Step(done=True, reason="answer")
        if self.turns >= self.max_turns:  # nothing would read the tools' answers
            return Step(done=True, reason="max_turns", tool_calls=len(calls))
        step = Step(tool_calls=len(calls))
        for call in calls:
            if isinstance(call, str):
                answer, error, name = call, True, "error"
            elif call.name not in self._by_name:
                answer, error, name = (f"error: no tool named {call.name!r}; the tools are "
                                       f"{sorted(self._by_name)}", True, call.name)
            else:
                answer, error = self._by_name[call.name].run(call.arguments, self.tool_timeout_s)
                name = call.name
            step.tool_errors += int(error)
            step.observation.append({"role": "tool", "name": name[:64], "content": answer})
        return step


# ---------------------------------------------------------------- built-in environments

class SingleTurn(Environment):
    """Today's GRPO: one answer to the prompt, graded by the configured rewards."""

    max_turns = 1

    def reset(self, example: dict[str, Any]) -> Episode:
        return _Answer(prompt_messages(example))


class _Answer(Episode):
    def step(self, text: str) -> Step:
        return Step(done=True, reason="answer")


class ToolEnvironment(Environment):
    """The row's prompt with `tools` offered; graded by the configured rewards on the final answer."""

    def __init__(self, tools: list[Callable[..., Any]], max_turns: int = 4, tool_timeout_s: float = 1.0) -> None:
        if max_turns < 1:
            raise EnvironmentSpecError(f"max_turns={max_turns}: an episode needs at least one turn")
        self.tools = [t if isinstance(t, Tool) else Tool.from_function(t) for t in tools]
        self.max_turns, self.tool_timeout_s = max_turns, tool_timeout_s

    def reset(self, example: dict[str, Any]) -> Episode:
        return ToolEpisode(prompt_messages(example), self.tools, self.max_turns, self.tool_timeout_s)


class Calculator(ToolEnvironment):
    """A calculator tool beside the row's prompt; the configured rewards grade the final answer."""

    def __init__(self, max_turns: int = 4, tool_timeout_s: float = 1.0) -> None:
        super().__init__([calculator], max_turns, tool_timeout_s)


# ---------------------------------------------------------------- TRL-style classes

class TRLStyleEnvironment(Environment):
    """A class written for TRL's `environment_factory`: constructed with no argument for each
    episode, `reset(**row)` with the dataset row (a string it returns is added to the last user
    message), and its public methods are the tools. TRL itself is not needed."""

    def __init__(self, cls: type, max_turns: int = 4, tool_timeout_s: float = 1.0) -> None:
        where = f"{cls.__module__}.{cls.__qualname__}"
        if not callable(getattr(cls, "reset", None)):
            raise EnvironmentSpecError(f"rollout.environment.name: {where} has no reset method; a TRL-style "
                                       "environment defines reset(**row) and its tools as public methods")
        required = [p.name for p in inspect.signature(cls).parameters.values()
                    if p.default is inspect.Parameter.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        if required:
            raise EnvironmentSpecError(f"rollout.environment.name: {where}() needs the arguments {required}; an "
                                       "environment class is constructed with none (give them defaults)")
        self.names = [n for n, v in inspect.getmembers(cls, inspect.isfunction)
                      if not n.startswith("_") and n != "reset"]
        if not self.names:
            raise EnvironmentSpecError(f"rollout.environment.name: {where} has no public method to offer as a tool")
        for n in self.names:  # schemas checked now, not in the first round
            Tool.from_function(getattr(cls, n).__get__(object.__new__(cls)))
        self.cls, self.max_turns, self.tool_timeout_s = cls, max_turns, tool_timeout_s

    def reset(self, example: dict[str, Any]) -> Episode:
        instance = self.cls()
        extra = instance.reset(**{k: v for k, v in example.items() if k != "messages"})
        messages = [dict(m) for m in prompt_messages(example)]
        if isinstance(extra, str) and extra:
            messages[-1]["content"] = f"{messages[-1]['content']}\n\n{extra}"
        tools = [Tool.from_function(getattr(instance, n)) for n in self.names]
        return ToolEpisode(messages, tools, self.max_turns, self.tool_timeout_s)


# ---------------------------------------------------------------- by name

# name -> (max_turns, tool_timeout_s) -> the environment; trainer.config.BUILTIN_ENVIRONMENTS lists these names
BUILTIN: dict[str, Callable[[int, float], Environment]] = {
    "calculator": lambda max_turns, tool_timeout_s: Calculator(max_turns, tool_timeout_s),
    "single_turn": lambda max_turns, tool_timeout_s: SingleTurn(),
}


def load_environment(spec: str, max_turns: int = 4, tool_timeout_s: float = 1.0,
                     options: dict[str, Any] | None = None) -> Environment:
    """`single_turn`, `calculator`, or `package.module:Class` (an `Environment` subclass, built with
    `options`; or a TRL-style class); checked before the run starts."""
    if spec in BUILTIN:
        return BUILTIN[spec](max_turns, tool_timeout_s)
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise EnvironmentSpecError(f"rollout.environment.name={spec!r}: use {sorted(BUILTIN)} or 'package.module:Class'")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:
        raise EnvironmentSpecError(f"rollout.environment.name={spec!r}: module {module_name!r} failed to import "
                                   f"({type(exc).__name__}: {exc}); check it is on the path of every worker") from None
    cls = getattr(module, attr, None)
    if not isinstance(cls, type):
        raise EnvironmentSpecError(f"rollout.environment.name={spec!r}: module {module_name!r} has no class {attr!r}")
    if issubclass(cls, Environment):
        if cls.reset is Environment.reset:
            raise EnvironmentSpecError(f"rollout.environment.name={spec!r}: {attr} does not implement reset(example)")
        try:
            return cls(**(options or {}))
        except TypeError as exc:
            raise EnvironmentSpecError(f"rollout.environment.name={spec!r}: {attr}(**rollout.environment.options) "
                                       f"failed: {exc}") from None
    return TRLStyleEnvironment(cls, max_turns, tool_timeout_s)


def environment_of(cfg: EnvironmentConfig) -> Environment:
    """The environment `rollout.environment` names, built with its settings."""
    return load_environment(cfg.name, cfg.max_turns, cfg.tool_timeout_s, cfg.options)


def check_environment(cfg: EnvironmentConfig) -> None:
    """Build the configured environment once, so that a spec that cannot be used stops the run
    before any stage starts. Raises ConfigError naming the module, class or method."""
    try:
        environment_of(cfg)
    except EnvironmentSpecError as exc:
        raise ConfigError(str(exc)) from None
