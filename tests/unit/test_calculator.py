"""The calculator tool on hostile input: nothing but arithmetic runs, nothing grows without bound, and every
refusal is an error text for the model, never an exception out of the tool."""

from __future__ import annotations

import json

import pytest

from posttrain.tools.calculator import MAX_DIGITS, CalculatorError, calculate, call
from posttrain.tools.registry import TOOLS, get_tool


@pytest.mark.parametrize("expression, value", [
    ("48/2", "24"), ("2 + 3 * 4", "14"), ("(2 + 3) * 4", "20"), ("7 / 2", "3.5"), ("-3 ** 2", "-9"),
    ("2 ** -1", "0.5"), ("17 // 5", "3"), ("17 % 5", "2"), ("1,200 * 3", "3600"), ("1,234,567 - 1", "1234566"), ("0.1 + 0.2", "0.3"),
    ("10 / 3", "3.333333333"), ("2 ** 10", "1024"), ("+5", "5"), (" 12 ", "12"),
])
def test_arithmetic_as_gsm8k_writes_it(expression, value):
    assert calculate(expression) == value


@pytest.mark.parametrize("expression, says", [
    ("__import__('os').system('id')", "not Call"),
    ("x + 1", "not Name"),
    ("(1).real", "not Attribute"),
    ("[1, 2][0]", "not Subscript"),
    ("lambda: 1", "not Lambda"),
    ("'a' * 3", "not Constant"),
    ("True + 1", "not Constant"),
    ("1j * 2", "not Constant"),
    ("1 < 2", "not Compare"),
    ("1 if 1 else 2", "not IfExp"),
    ("1 << 100", "not BinOp"),
    ("9 ** 9 ** 9", "more than"),
    ("2 ** 100", "more than"),
    ("10.0 ** 400", "more than"),
    ("1e400", "finite"),
    ("9" * 40, "more than"),
    ("99999999999999 * 99999999999999 * 99999999999999", "more than"),
    ("1 / 0", "division by zero"),
    ("5 // 0", "division by zero"),
    ("5 % 0", "division by zero"),
    ("0 ** -1", "division by zero"),
    ("(-8) ** 0.5", "not a real number"),
    ("(1+" * 40 + "1" + ")" * 40, "nests deeper"),
    ("-" * 150 + "1", "nests deeper"),
    ("1 +", "not an arithmetic expression"),
    ("1; import os", "not an arithmetic expression"),
    ("1" + " + 1" * 60, "longer than"),
    ("", "empty"),
])
def test_anything_but_bounded_arithmetic_is_refused_with_a_reason(expression, says):
    with pytest.raises(CalculatorError, match=says):
        calculate(expression)


def test_a_call_answers_with_text_even_when_the_model_writes_nonsense():
    assert call('{"expression": "6 * 7"}') == "42"
    assert call({"expression": "6 * 7"}) == "42"
    assert call("{not json") == "error: the arguments are not JSON"
    assert call('{"expr": "1"}').startswith("error: the arguments must be")
    assert call('["1 + 1"]').startswith("error: the arguments must be")
    assert call('{"expression": 5}') == "error: the expression is empty"
    assert call('{"expression": "2 ** 1000"}') == f"error: the power has more than {MAX_DIGITS} digits"


def test_the_tool_is_registered_with_an_openai_schema():
    tool = get_tool("calculator")
    function = tool.schema["function"]
    assert tool.schema["type"] == "function" and function["name"] == "calculator"
    assert function["parameters"]["required"] == ["expression"]
    json.dumps(tool.schema)  # sendable as it is
    assert set(TOOLS) == {"calculator"}
    with pytest.raises(ValueError, match="unknown tool 'calc'; known: calculator"):
        get_tool("calc")
