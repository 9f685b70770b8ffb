"""Tool calls and the calculator: what a policy's turn is parsed into, and the one tool built in.

Calls are written as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (the Hermes / Qwen
format most chat templates with tools render). Parsing is linear in the turn's text, and the
calculator evaluates bounded arithmetic only (no `eval`, bounded operand sizes and exponents,
exact fractions), so whatever a policy writes is answered in bounded time. The environments
(trainer/rl/envs.py) and the SFT data that calls the calculator (trainer/data.py) both use them.
"""

from __future__ import annotations

import ast
import json
import operator
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

TOOL_CALL_START, TOOL_CALL_END = "<tool_call>", "</tool_call>"
MAX_CALLS_PER_TURN = 4
MAX_CALL_CHARS = 2000  # a call's JSON; longer is an error, not parsed


@dataclass
class ToolCall:
    name: str
    arguments: dict[str, Any]


def _call_bodies(text: str):
    """What stands between each opening tag and the first closing tag after it, left to right.

    Linear in the text: each search starts where the last one ended (a lazy regex restarts its
    scan for a closing tag at every opening tag, quadratic on `<tool_call>` repeated unclosed)."""
    pos = 0
    while (start := text.find(TOOL_CALL_START, pos)) >= 0:
        start += len(TOOL_CALL_START)
        end = text.find(TOOL_CALL_END, start)
        if end < 0:
            return
        yield text[start:end]
        pos = end + len(TOOL_CALL_END)


def parse_tool_calls(text: str) -> list[ToolCall | str]:
    """The tool calls in a policy turn, in order; each one that cannot be used is an error string."""
    out: list[ToolCall | str] = []
    for body in _call_bodies(text):
        body = body.strip()
        if len(out) >= MAX_CALLS_PER_TURN:
            out.append(f"error: at most {MAX_CALLS_PER_TURN} tool calls a turn")
            break
        if len(body) > MAX_CALL_CHARS:
            out.append(f"error: a tool call is at most {MAX_CALL_CHARS} characters")
            continue
        try:
            call = json.loads(body)
        except (ValueError, RecursionError) as exc:  # RecursionError: nesting deeper than the decoder goes
            out.append(f"error: the tool call is not JSON ({str(exc)[:80]})")
            continue
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            out.append('error: a tool call is {"name": ..., "arguments": {...}}')
            continue
        args = call.get("arguments", {})
        if isinstance(args, str):  # some templates write the arguments as a JSON string
            try:
                args = json.loads(args)
            except (ValueError, RecursionError):
                pass
        out.append(ToolCall(call["name"], args))
    # an opening tag the turn never closed (the engine stops on the closing one, or ran out of tokens)
    if text.count(TOOL_CALL_START) > text.count(TOOL_CALL_END):
        out.append("error: the tool call is not closed with " + TOOL_CALL_END)
    return out


# ---------------------------------------------------------------- the calculator

MAX_EXPRESSION_CHARS = 200
MAX_DIGITS = 30     # an operand or result with more digits (numerator or denominator) is refused
MAX_EXPONENT = 64

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class CalculatorError(ValueError):
    pass


def _bounded(x: Fraction) -> Fraction:
    if len(str(abs(x.numerator))) > MAX_DIGITS or len(str(x.denominator)) > MAX_DIGITS:
        raise CalculatorError(f"a number has more than {MAX_DIGITS} digits")
    return x


def _eval(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _bounded(Fraction(str(node.value)))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow):
            # checked before computing: 10 ** 10 ** 9 must not start
            if right.denominator != 1 or abs(right) > MAX_EXPONENT:
                raise CalculatorError(f"exponents are whole numbers up to {MAX_EXPONENT}")
            if left == 0 and right < 0:
                raise CalculatorError("division by zero")
        elif isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mod)) and right == 0:
            raise CalculatorError("division by zero")
        return _bounded(Fraction(_BINARY[type(node.op)](left, right)))
    raise CalculatorError("only numbers, + - * / // % ** and parentheses")


def calculate(expression: str) -> str:
    """The exact value of an arithmetic expression: an integer, or a decimal rounded to 6 places."""
    text = expression.strip().replace(",", "").replace("×", "*").replace("÷", "/").replace("^", "**")
    if not text or len(text) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"an expression is 1 to {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError:
        raise CalculatorError(f"cannot read {expression[:40]!r} as arithmetic") from None
    value = _eval(tree)
    if value.denominator == 1:
        return str(value.numerator)
    return f"{float(value):.6f}".rstrip("0").rstrip(".")


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression exactly.

    Args:
        expression: numbers with + - * / // % ** and parentheses, e.g. "48/2" or "(3+4)*12".
    """
    return calculate(expression)
