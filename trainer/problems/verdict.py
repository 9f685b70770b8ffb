"""A grader's answer: `score` in [0, 1] (partial credit, what a reward may use) and `correct` (the
verdict every accuracy, McNemar pair and comparison counts)."""

from __future__ import annotations

from typing import NamedTuple


class Verdict(NamedTuple):
    score: float
    correct: bool
