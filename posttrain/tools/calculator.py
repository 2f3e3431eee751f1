"""The calculator tool: arithmetic on numbers, evaluated by walking Python's parse tree over a whitelist.

Why by hand: `eval` (even with empty builtins) runs attribute access and calls, and the maintained expression
libraries either allow names and functions (numexpr, simpleeval's defaults) or lack limits on the size of what a
power or a product builds. A model's tool call is untrusted input: only numbers, + - * / // % **, unary signs and
parentheses are allowed; the expression's length, nesting and every intermediate number are bounded, and a power
is refused before it is computed when its result would be too large. Every refusal is a short error text, which
goes back to the model as the tool's result, as a tool error does in the OpenAI protocol.
"""

from __future__ import annotations

import ast
import json
import math
import operator
import re

MAX_CHARS = 200  # of the expression
MAX_DEPTH = 32  # nesting of the parse tree
MAX_DIGITS = 30  # of any intermediate or final number (integer digits)
NAME = "calculator"
SCHEMA = {"type": "function", "function": {
    "name": NAME,
    "description": "Evaluate an arithmetic expression: numbers, + - * / // % ** and parentheses.",
    "parameters": {"type": "object", "properties": {
        "expression": {"type": "string", "description": "for example (12 + 30) / 7"}},
        "required": ["expression"]}}}
OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
             ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
SIGNS = {ast.UAdd: operator.pos, ast.USub: operator.neg}
THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")


class CalculatorError(ValueError):
    """An expression the calculator refuses or cannot evaluate; its message is what the model is told."""


def check_size(value: int | float) -> int | float:
    if isinstance(value, float) and not math.isfinite(value):
        raise CalculatorError("the result is not a finite number")
    if abs(value) >= 10 ** MAX_DIGITS:
        raise CalculatorError(f"a number in the calculation has more than {MAX_DIGITS} digits")
    return value


def power(base: int | float, exponent: int | float) -> int | float:
    if base == 0 and exponent < 0:
        raise CalculatorError("division by zero")
    if abs(base) > 1 and exponent > 0 and exponent * math.log10(abs(base)) >= MAX_DIGITS:
        raise CalculatorError(f"the power has more than {MAX_DIGITS} digits")
    if base < 0 and not float(exponent).is_integer():
        raise CalculatorError("a negative number to a fractional power is not a real number")
    return base ** exponent


def evaluate(node: ast.AST, depth: int = 0) -> int | float:
    if depth > MAX_DEPTH:
        raise CalculatorError(f"the expression nests deeper than {MAX_DEPTH} levels")
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):  # not bool, str, complex or None
        return check_size(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in SIGNS:
        return SIGNS[type(node.op)](evaluate(node.operand, depth + 1))
    if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
        left, right = evaluate(node.left, depth + 1), evaluate(node.right, depth + 1)
        if isinstance(node.op, ast.Pow):
            return check_size(power(left, right))
        if isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mod)) and right == 0:
            raise CalculatorError("division by zero")
        return check_size(OPERATORS[type(node.op)](left, right))
    raise CalculatorError(f"only numbers and + - * / // % ** ( ) are allowed, not {type(node).__name__}")


def render(value: int | float) -> str:
    """An integer as itself; a float that is whole as an integer; else up to 10 significant digits."""
    if isinstance(value, float):
        if value.is_integer():
            return str(int(value))
        return f"{value:.10g}"
    return str(value)


def calculate(expression: str) -> str:
    """The value of `expression` as text; raises CalculatorError saying what is wrong."""
    if not isinstance(expression, str) or not expression.strip():
        raise CalculatorError("the expression is empty")
    text = THOUSANDS.sub("", expression.strip())  # 1,200 -> 1200
    if len(text) > MAX_CHARS:
        raise CalculatorError(f"the expression is longer than {MAX_CHARS} characters")
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        raise CalculatorError(f"not an arithmetic expression: {expression[:60]!r}") from None
    return render(evaluate(tree.body))


def call(arguments: str | dict) -> str:
    """The tool's reply to one call: the value, or "error: ..." (arguments as the model wrote them, JSON text or
    already parsed)."""
    try:
        args = json.loads(arguments) if isinstance(arguments, str) else arguments
    except json.JSONDecodeError:
        return "error: the arguments are not JSON"
    if not isinstance(args, dict) or set(args) != {"expression"}:
        return 'error: the arguments must be {"expression": "<arithmetic>"}'
    try:
        return calculate(args["expression"])
    except CalculatorError as err:
        return f"error: {err}"
