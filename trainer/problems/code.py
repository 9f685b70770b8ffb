"""The code family: the policy writes a Python function, the grader runs it in the sandbox against
the row's hidden tests.

A row names the function and its tests: `{"entry": "f", "tests": [{"args": [...], "expected": v},
...]}` (JSON values; `args` a list, one element per parameter). The response's code is its last
fenced block (```python ... ``` or ``` ... ```; an unclosed last fence, as a cut-off answer leaves
it, counts), else the whole response. The verdict: every test passes; the score: the share that
pass (partial credit for a reward). Found in time linear in the response's length.
"""

from __future__ import annotations

import logging
from typing import Any

from trainer.errors import InputError
from trainer.problems.verdict import Verdict
from trainer.problems.sandbox import Limits, run

FENCE = "```"
log = logging.getLogger(__name__)


class CodeRowError(InputError):
    pass


def code_of(response: str) -> str:
    """The program in a response: the last fenced block (its language tag dropped), else all of it."""
    parts = response.split(FENCE)
    if len(parts) < 2:
        return response
    # parts[1], parts[3], ... lie inside fences; an odd count of fences leaves the last one open
    inside = parts[1::2]
    block = inside[-1]
    first, nl, rest = block.partition("\n")
    if nl and (not first.strip() or first.strip().isidentifier()):  # "python", "py", "" : a tag, not code
        block = rest
    return block


def check_row(row: dict[str, Any], where: str) -> None:
    """A code row's tests as the grader needs them; else an error naming `where` and the fix."""
    fix = ('give it "entry" (the function\'s name) and "tests": a list of {"args": [...], "expected": value}')
    entry, tests = row.get("entry"), row.get("tests")
    if not isinstance(entry, str) or not entry.isidentifier():
        raise CodeRowError(f"{where}: field 'entry' is {entry!r}, not a function name; {fix}")
    if not isinstance(tests, list) or not tests:
        raise CodeRowError(f"{where}: field 'tests' is {type(tests).__name__}, not a non-empty list; {fix}")
    for i, t in enumerate(tests):
        if not isinstance(t, dict) or not isinstance(t.get("args"), list) or "expected" not in t:
            raise CodeRowError(f"{where}: tests[{i}] is {str(t)[:80]!r}; {fix}")


_said: set[str] = set()


def grade(response: str, row: dict[str, Any], limits: Limits = Limits()) -> Verdict:
    tests = row["tests"]
    execution = run(code_of(response), row["entry"], [t["args"] for t in tests], limits)
    if execution.isolation not in _said:  # once a process: which isolation the policy's code gets
        _said.add(execution.isolation)
        (log.info if execution.isolation == "root" else log.warning)(
            "code is graded in a sandbox with %s isolation%s", execution.isolation,
            {"root": " (namespaces, a user of its own, a read-only root)",
             "userns": " (a user namespace: namespaces without a user of its own)"}.get(
                execution.isolation, ": resource limits only; the program can read what this user can and reach "
                "the network. Run as root, or allow unprivileged user namespaces"))
    passed = execution.passed([t["expected"] for t in tests])
    return Verdict(sum(passed) / len(tests), all(passed))


def reward(response: str, example: dict[str, Any]) -> float:
    """A GRPO reward (`grpo.rewards: [{name: trainer.problems.code:reward}]`): the share of tests passed."""
    return grade(response, example).score
