"""What is learned and how it is judged: the families of problems posttrain grades.

`Verdict(score, correct)` is what a grader returns: `score` in [0, 1] (partial credit, what a
reward may use) and `correct` (the verdict every accuracy, McNemar pair and comparison counts).
`sandbox` runs policy-written code; `code` grades a Python function against a row's hidden tests.
"""

from __future__ import annotations

from typing import NamedTuple


class Verdict(NamedTuple):
    score: float
    correct: bool
