"""Answer extraction and checking (math-verify) for GSM8K `#### n` and `\\boxed{}` answers."""

from __future__ import annotations

import logging
import re

from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

from trainer.data import extract_boxed

FINAL_RE = re.compile(r"####\s*([^\n]+?)\s*$")
NUMBER_RE = re.compile(r"^-?[\d,]*\.?\d+$")
INTEGER_RE = re.compile(r"^-?[0-9]+$")
# Without the signal timeout math-verify warns on every call; our inputs are short and bounded.
logging.getLogger("math_verify").setLevel(logging.ERROR)
MAX_ANSWER_CHARS = 100  # math-verify runs without its signal timeout (tasks may run in threads)


def extract_answer(response: str) -> str | None:
    """The final answer of a response: after a closing `####` line, else the last \\boxed{}."""
    m = FINAL_RE.search(response.strip())
    if m:
        return m.group(1).strip()
    return extract_boxed(response)


def has_format(response: str) -> bool:
    """The response ends with `#### <number>` or holds a \\boxed{} answer."""
    ans = extract_answer(response)
    return ans is not None and (bool(NUMBER_RE.match(ans.replace(" ", ""))) or "\\boxed{" in response)


def _parse(text: str):
    text = text.replace(",", "") if NUMBER_RE.match(text.replace(" ", "")) else text
    return parse(text, extraction_config=[LatexExtractionConfig(), ExprExtractionConfig()],
                 parsing_timeout=None)


def _integer(text: str) -> int | None:
    """The value of a plain integer answer (`42`, `-7`, `1,000`), as `_parse` reads it; else None."""
    digits = text.replace(",", "")
    return int(digits) if INTEGER_RE.match(digits) and NUMBER_RE.match(text) else None


def is_correct(response: str, gold: str) -> bool:
    pred = extract_answer(response)
    if pred is None or len(pred) > MAX_ANSWER_CHARS:
        return False
    # Two plain integers: math-verify compares them as sympy Integers, i.e. by value; doing that
    # here skips its parser, about a millisecond an answer (tests/test_answers.py checks the two agree)
    g, p = _integer(gold.strip()), _integer(pred)
    if g is not None and p is not None:
        return g == p
    return _verified(pred, gold)


def _verified(pred: str, gold: str) -> bool:
    gold_parsed, pred_parsed = _parse(gold), _parse(pred)
    if not gold_parsed or not pred_parsed:
        return pred.strip() == gold.strip()
    return bool(verify(gold_parsed, pred_parsed, timeout_seconds=None))
