"""Environments and tools (trainer/rl/envs.py), everything a policy can write handled in bounded time.

- the calculator: exact values, and every refusal (code, huge numbers, huge exponents, division by
  zero, long or empty input) an error message, not an exception or a hang;
- tool calls parsed from a turn: good ones, arguments as a JSON string, and each malformed shape an
  error the policy reads;
- an episode with tools: results and errors as tool messages, counted; the answer or max_turns ends it;
  a tool that raises or hangs answers with an error after its time limit;
- tools' schemas from signatures and docstrings; environments by name, as subclasses, or TRL-style
  classes; each bad spec stops with the module, class or method named.
"""

import sys
import textwrap
import time

import pytest

from tests.growth import assert_linear
from trainer.rl.envs import Calculator, EnvironmentSpecError, SingleTurn, Tool, ToolEnvironment, load_environment
from trainer.rl.tools import CalculatorError, ToolCall, calculate, parse_tool_calls

EXAMPLE = {"id": "p1", "answer": "84",
           "messages": [{"role": "user", "content": "What is (3+4)*12?"}, {"role": "assistant", "content": "84"}]}


@pytest.mark.parametrize("expr,value", [("48/2", "24"), ("(3+4)*12", "84"), ("1/3", "0.333333"), ("2**10", "1024"),
                                        ("7//2", "3"), ("-3+1", "-2"), ("1,000*3", "3000"), ("0.1+0.2", "0.3"),
                                        ("2^3", "8"), ("10 % 4", "2"), ("2**-2", "0.25"), (" 6 × 7 ", "42")])
def test_the_calculator_is_exact(expr, value):
    assert calculate(expr) == value


ADVERSARIAL = ["10**10**9", "9**9**9**9", "2**0.5", "__import__('os').system('true')", "open('/etc/passwd')",
               "1/0", "5 % 0", "0**-1", "", "1+" * 150 + "1", "9" * 40, "1e308*10", "(" * 120 + "1" + ")" * 120,
               "[1, 2]", "x + 1", "lambda: 1", "'a' * 9", "1 if 1 else 2", "1; 2"]


def test_the_calculator_refuses_what_is_not_bounded_arithmetic_quickly():
    t0 = time.perf_counter()
    for expr in ADVERSARIAL:
        with pytest.raises(CalculatorError):
            calculate(expr)
    assert time.perf_counter() - t0 < 2.0  # bounded: none of them starts an unbounded computation


def test_tool_calls_are_parsed_and_every_malformed_one_is_an_error():
    ok = '<tool_call>{"name": "calculator", "arguments": {"expression": "48/2"}}</tool_call>'
    assert parse_tool_calls("I will compute. " + ok) == [ToolCall("calculator", {"expression": "48/2"})]
    as_string = '<tool_call>{"name": "calculator", "arguments": "{\\"expression\\": \\"1+1\\"}"}</tool_call>'
    assert parse_tool_calls(as_string) == [ToolCall("calculator", {"expression": "1+1"})]
    assert parse_tool_calls("no call, the answer is #### 4") == []
    cases = {"<tool_call>{not json}</tool_call>": "not JSON", "<tool_call>[1, 2]</tool_call>": '"name"',
             '<tool_call>{"arguments": {}}</tool_call>': '"name"',
             '<tool_call>{"name": "calculator", "argu': "not closed",
             "<tool_call>" + "x" * 3000 + "</tool_call>": "at most 2000 characters"}
    for text, message in cases.items():
        out = parse_tool_calls(text)
        assert len(out) == 1 and isinstance(out[0], str) and message in out[0], (text[:40], out)
    many = parse_tool_calls(ok * 6)
    assert sum(isinstance(c, ToolCall) for c in many) == 4 and "at most 4" in many[-1]
    nested = parse_tool_calls("<tool_call>" + "[" * 1990 + "</tool_call>")  # deeper than json's decoder goes
    assert len(nested) == 1 and "not JSON" in nested[0]


@pytest.mark.parametrize("name,make", [
    ("unclosed openings", lambda n: "<tool_call>" * n + "{" * n),
    ("openings, one close at the end", lambda n: "<tool_call>" * n + "</tool_call>"),
    ("closes only", lambda n: "</tool_call>" * n),
    ("long bodies", lambda n: ('<tool_call>{"name": "calculator", "arguments": {"expression": "'
                               + "1+" * n + '1"}}</tool_call>') * 8),
    ("calls and text", lambda n: ("say <tool_call>{}</tool_call> " * n)),
])
def test_parsing_tool_calls_is_linear_in_the_text(name, make):
    """Whatever a policy writes is parsed in time linear in its length (the earlier regex was
    quadratic on repeated unclosed openings: 6 s for 8,000 of them on a slow machine)."""
    # 4,000 repeats, not 1,000: at 1,000 the small input fits the CPU's caches and the large does not
    # (closes only: 12-16x, and 30x beside the other half of the suite, for linear work)
    assert_linear(parse_tool_calls, make, 4000, f"parse_tool_calls on {name}")


def call(name, **arguments):
    import json

    return f'<tool_call>{json.dumps({"name": name, "arguments": arguments})}</tool_call>'


def test_a_calculator_episode_answers_tools_counts_errors_and_ends():
    episode = Calculator(max_turns=3).reset(EXAMPLE)
    assert episode.messages == EXAMPLE["messages"][:-1] and [t.name for t in episode.tools] == ["calculator"]
    step = episode.step("First 3+4. " + call("calculator", expression="3+4"))
    assert not step.done and step.tool_calls == 1 and step.tool_errors == 0
    assert step.observation == [{"role": "tool", "name": "calculator", "content": "7"}]
    step = episode.step(call("calc", expression="1") + call("calculator", expr="1") + call("calculator", expression=5)
                        + call("calculator", expression="1/0"))
    assert step.tool_calls == 4 and step.tool_errors == 4 and not step.done
    answers = [m["content"] for m in step.observation]
    assert "no tool named 'calc'" in answers[0] and "has no argument 'expr'" in answers[1]
    assert "must be of type string" in answers[2] and "division by zero" in answers[3]
    step = episode.step(call("calculator", expression="7*12"))  # the third turn: nothing would read the answer
    assert step.done and step.reason == "max_turns" and step.observation == []
    fresh = Calculator().reset(EXAMPLE)
    assert fresh.step("The answer is #### 84").reason == "answer"
    assert SingleTurn().reset(EXAMPLE).step("anything").reason == "answer"


def test_a_tool_that_raises_or_hangs_answers_with_an_error_within_its_time_limit():
    def flaky(n: int) -> str:
        """Fails.

        Args:
            n: anything.
        """
        raise RuntimeError("boom")

    def hang(n: int) -> str:
        """Never returns.

        Args:
            n: anything.
        """
        while True:
            time.sleep(0.01)

    episode = ToolEnvironment([flaky, hang], max_turns=5, tool_timeout_s=0.3).reset(EXAMPLE)
    t0 = time.perf_counter()
    step = episode.step(call("flaky", n=1) + call("hang", n=1))
    assert time.perf_counter() - t0 < 1.5
    assert step.tool_errors == 2
    assert step.observation[0]["content"] == "error: flaky raised RuntimeError: boom"
    assert step.observation[1]["content"] == "error: hang timed out after 0.3s"


def test_tool_schemas_come_from_signatures_and_docstrings():
    tool = Tool.from_function(Calculator().tools[0].fn)
    fn = tool.schema["function"]
    assert fn["name"] == "calculator" and fn["parameters"]["required"] == ["expression"]
    assert "48/2" in fn["parameters"]["properties"]["expression"]["description"]

    def untyped(x):
        """No hints."""

    with pytest.raises(EnvironmentSpecError, match="tool 'untyped'.*type hint on every argument"):
        Tool.from_function(untyped)


MODULE = textwrap.dedent('''
    from trainer.rl.envs import Environment, Episode, ToolEpisode, Tool

    class Notes:
        """TRL-style: no-argument constructor, reset(**row), public methods are the tools."""

        def __init__(self):
            self.notes = []

        def reset(self, **row) -> str:
            self.gold = row["answer"]
            return "You may write notes."

        def write(self, text: str) -> str:
            """Keep a note.

            Args:
                text: the note.
            """
            self.notes.append(text)
            return f"{len(self.notes)} notes"

    class NoReset:
        def write(self, text: str) -> str:
            """Args:
                text: t.
            """

    class NeedsArgs:
        def __init__(self, path):
            pass

        def reset(self, **row):
            pass

        def look(self, q: str) -> str:
            """Look.

            Args:
                q: what.
            """

    class Half(Environment):
        pass

    class Careless(Environment):
        """Its reset raises on one row; its episodes' step raises after the first turn."""
        max_turns = 3

        def reset(self, example):
            if example["id"] == "bad-row":
                raise KeyError("difficulty")
            return CarelessEpisode([dict(m) for m in example["messages"][:1]])

    class CarelessEpisode(Episode):
        def step(self, text):
            raise ZeroDivisionError("division by zero")

    class Sloppy(Environment):
        def reset(self, example):
            return {"messages": example["messages"][:1]}  # not an Episode

    class TrlCareless:
        def reset(self, **row):
            raise RuntimeError("no sandbox")

        def look(self, q: str) -> str:
            """Look.

            Args:
                q: what.
            """
''')


@pytest.fixture
def env_module(tmp_path, monkeypatch):
    (tmp_path / "my_envs.py").write_text(MODULE)
    (tmp_path / "broken_envs.py").write_text("import not_a_module_anywhere\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "my_envs"
    for name in ("my_envs", "broken_envs"):
        sys.modules.pop(name, None)


def test_environments_by_name_and_trl_style_classes(env_module):
    assert isinstance(load_environment("single_turn"), SingleTurn)
    assert isinstance(load_environment("calculator", max_turns=2), Calculator)
    env = load_environment("my_envs:Notes", max_turns=3)
    a, b = env.reset(EXAMPLE), env.reset(EXAMPLE)  # an instance per episode
    assert a.messages[-1]["content"] == "What is (3+4)*12?\n\nYou may write notes."
    assert EXAMPLE["messages"][0]["content"] == "What is (3+4)*12?"  # the row is not changed
    assert a.step(call("write", text="x")).observation[0]["content"] == "1 notes"
    assert a.step(call("write", text="y")).observation[0]["content"] == "2 notes"
    assert b.step(call("write", text="z")).observation[0]["content"] == "1 notes"


@pytest.mark.parametrize("spec,message", [
    ("calculater", "use \\['calculator', 'single_turn'\\] or 'package.module:Class'"),
    ("no_such_pkg.envs:Env", "module 'no_such_pkg.envs' failed to import \\(ModuleNotFoundError"),
    ("broken_envs:Env", "module 'broken_envs' failed to import"),
    ("my_envs:Missing", "module 'my_envs' has no class 'Missing'"),
    ("my_envs:NoReset", "my_envs.NoReset has no reset method"),
    ("my_envs:NeedsArgs", r"my_envs.NeedsArgs\(\) needs the arguments \['path'\]"),
    ("my_envs:Half", "Half does not implement reset"),
])
def test_a_bad_environment_spec_names_what_is_wrong(env_module, spec, message):
    with pytest.raises(EnvironmentSpecError, match=message):
        load_environment(spec)


def test_a_bad_environment_stops_the_run_before_any_stage(env_module, capsys):
    """The config checks the name's shape; the CLI (and the flows, through the same call) build the
    environment once right after the config loads, before a server or a stage starts."""
    from flows.cli import main
    from trainer.config import ConfigError, load_config
    from trainer.rl.envs import check_environment, environment_of

    with pytest.raises(ConfigError, match="rollout.environment.name='calculater': use"):
        load_config("tiny", ["rollout.environment.name=calculater"])
    cfg = load_config("tiny", ["rollout.environment.name=no_such_pkg:Env"])  # a well-formed name loads ...
    with pytest.raises(ConfigError, match="rollout.environment.*module 'no_such_pkg' failed to import"):
        check_environment(cfg.rollout.environment)  # ... and stops here
    assert main(["grpo", "--preset", "tiny", "--dry-run", "--set", "rollout.environment.name=my_envs:NoReset"]) == 2
    assert "my_envs.NoReset has no reset method" in capsys.readouterr().err
    cfg = load_config("tiny", ["rollout.environment.name=my_envs:Notes", "rollout.environment.max_turns=2"])
    check_environment(cfg.rollout.environment)
    assert cfg.rollout.environment.multi_turn and environment_of(cfg.rollout.environment).max_turns == 2


@pytest.mark.slow
def test_an_environment_whose_own_code_fails_is_named_with_the_example_or_turn(env_module, tmp_path, capsys):
    """A custom environment's reset or step raising, or returning the wrong thing: an error naming
    the class, the method, the example or turn and the error, the traceback chained (was a traceback
    from inside the rollout, exit 1); through the CLI, exit 2."""
    from flows.cli import main
    from trainer.rl.envs import EnvironmentRunError, reset_episode, step_episode

    careless = load_environment("my_envs:Careless")
    with pytest.raises(EnvironmentRunError, match=r"^rollout.environment: Careless.reset on example 'bad-row' raised "
                                                  r"KeyError: 'difficulty'; fix the environment") as err:
        reset_episode(careless, {**EXAMPLE, "id": "bad-row"})
    assert isinstance(err.value.__cause__, KeyError)
    episode = reset_episode(careless, EXAMPLE)
    with pytest.raises(EnvironmentRunError, match=r"^rollout.environment: CarelessEpisode.step after turn 2 raised "
                                                  r"ZeroDivisionError: division by zero"):
        step_episode(episode, "#### 84", 2)
    with pytest.raises(EnvironmentRunError, match=r"Sloppy.reset on example 'p1' returned dict, not an Episode"):
        reset_episode(load_environment("my_envs:Sloppy"), EXAMPLE)
    with pytest.raises(EnvironmentRunError, match=r"TrlCareless.reset on example 'p1' raised RuntimeError: no sandbox"):
        reset_episode(load_environment("my_envs:TrlCareless"), EXAMPLE)
    small = ["--set", f"artifact_root={tmp_path / 'art'}", "--set", "sft.max_steps=5", "--set",
             "data.synthetic.n_train=300", "--set", "grpo.rounds=1", "--set", "rollout.prompts_per_round=4",
             "--set", "rollout.environment.name=my_envs:Careless"]
    assert main(["grpo", *small]) == 2
    err = capsys.readouterr().err
    assert "posttrain: rollout.environment: CarelessEpisode.step after turn 1 raised ZeroDivisionError" in err, \
        err[-3000:]


def test_the_configs_builtin_environments_are_the_ones_built():
    from trainer.config import BUILTIN_ENVIRONMENTS
    from trainer.rl.envs import BUILTIN

    assert sorted(BUILTIN_ENVIRONMENTS) == sorted(BUILTIN)


def test_finding_a_stop_string_is_linear_in_the_tokens(tiny_tokenizer):
    """The HF path cuts a generation at the token that completes a stop string; looking for it
    decodes a window of tokens per position, never the whole prefix."""
    from trainer.inference.generate import StopStrings

    stops = StopStrings(tiny_tokenizer, ("</tool_call>", "####"))
    ids = tiny_tokenizer.encode("3 + 4 = 7 and 12 apples ")
    assert stops.end(ids * 3 + tiny_tokenizer.encode("#### 7")) is not None
    assert_linear(stops.end, lambda n: (ids * n)[:n], 200, "StopStrings.end")
