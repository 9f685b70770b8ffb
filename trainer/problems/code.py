"""The code family: the policy writes a Python function, the grader runs it in the sandbox against
the row's hidden tests.

A row names the function and its tests: `{"entry": "f", "tests": [{"args": [...], "expected": v},
...]}` (JSON values; `args` a list, one element per parameter). The response's code is its last
fenced block (```python ... ``` or ``` ... ```; an unclosed last fence, as a cut-off answer leaves
it, counts), else the whole response. The verdict: every test passes; the score: the share that
pass (partial credit for a reward). Found in time linear in the response's length.
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
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
# verdicts of programs already run against the same tests: a round's samples often repeat a program
_memo: OrderedDict[str, Verdict] = OrderedDict()
_memo_lock = threading.Lock()
MEMO_SIZE = 8192


def grade(response: str, row: dict[str, Any], limits: Limits = Limits()) -> Verdict:
    program = code_of(response)
    key = hashlib.sha256(json.dumps([program, row["entry"], row["tests"], limits.__dict__]).encode()).hexdigest()
    with _memo_lock:
        if key in _memo:
            _memo.move_to_end(key)
            return _memo[key]
    verdict = _graded(program, row, limits)
    with _memo_lock:
        _memo[key] = verdict
        while len(_memo) > MEMO_SIZE:
            _memo.popitem(last=False)
    return verdict


def grade_all(responses: list[str], rows: list[dict[str, Any]], workers: int | None = None) -> list[Verdict]:
    """Each response graded against its row, several sandboxes at once (one per core: each is a
    process of its own that mostly waits on the interpreter's start)."""
    import os

    workers = workers or max(1, len(os.sched_getaffinity(0)))
    if workers == 1 or len(responses) < 2:
        return [grade(r, row) for r, row in zip(responses, rows)]
    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(grade, responses, rows))


def _graded(program: str, row: dict[str, Any], limits: Limits) -> Verdict:
    tests = row["tests"]
    execution = run(program, row["entry"], [t["args"] for t in tests], limits)
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


# ---------------------------------------------------------------- synthetic problems (data.synthetic.family=code)

STEPS = {"+": ("adds {n} to {v}", "increases {v} by {n}"), "-": ("subtracts {n} from {v}", "takes {n} away from {v}"),
         "*": ("multiplies {v} by {n}", "scales {v} by {n}")}
NAMES = ("f", "g", "h", "calc", "step")
TEST_INPUTS = range(-5, 11)


def generate_problem(rng: random.Random, cfg) -> tuple[str, str, str, tuple, dict[str, Any]]:
    """One function to write: (question, worked answer (a statement a step), direct answer (one
    expression, its constants worked out), equation, its row's fields).
    The equation is (("+", 3), ("*", 2), ...): what the function computes from its argument, whatever
    its name and wording; the row's `tests` call it on 4 arguments."""
    lo, hi = (1 if cfg.digits == 1 else 10 ** (cfg.digits - 1)), 10**cfg.digits - 1
    name = rng.choice(NAMES)
    ops = [(rng.choice(cfg.ops), 0) for _ in range(rng.randint(cfg.min_ops, cfg.max_ops))]
    ops = [(op, rng.randint(max(lo, 2) if op == "*" else lo, hi)) for op, _ in ops]
    clauses = [rng.choice(STEPS[op]).format(n=n, v="x" if i == 0 else "the result") for i, (op, n) in enumerate(ops)]
    question = f"Write a Python function {name}(x) that {', then '.join(clauses)}."
    steps = "".join(f"    y = {'x' if i == 0 else 'y'} {op} {n}\n" for i, (op, n) in enumerate(ops))
    worked = f"```python\ndef {name}(x):\n{steps}    return y\n```"
    direct = f"```python\ndef {name}(x):\n    return {_simplified(ops)}\n```"
    args = sorted(rng.sample(TEST_INPUTS, 4))
    tests = [{"args": [a], "expected": _apply(ops, a)} for a in args]
    return question, worked, direct, tuple(ops), {"entry": name, "tests": tests}


def _simplified(ops: list[tuple[str, int]]) -> str:
    """The chain as one linear expression with its constants worked out in the head ("adds 3, then
    multiplies by 2" -> "2 * x + 6"): what a terse answer writes, and where a small model errs."""
    a, b = 1, 0
    for op, n in ops:
        a, b = (a * n, b * n) if op == "*" else (a, b + n if op == "+" else b - n)
    text = "x" if a == 1 else f"{a} * x"
    return text if b == 0 else f"{text} {'+' if b > 0 else '-'} {abs(b)}"


def _apply(ops: list[tuple[str, int]], x: int) -> int:
    for op, n in ops:
        x = x + n if op == "+" else x - n if op == "-" else x * n
    return x
