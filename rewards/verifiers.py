"""Math answer verification: extract the final answer from a completion, normalise it, compare with the gold answer.

Extraction order: the text after `</think>` when there is one; then `#### n` (GSM8K), `\\boxed{...}`, or the last
number. Plain numbers are compared after normalisation (thousands separators, signs, decimals, fractions,
percentages); LaTeX expressions go to `math-verify`, a maintained equivalence checker, rather than a hand-written
symbolic comparer.
"""

from __future__ import annotations

import re
from fractions import Fraction

from rewards.text import completion_text, final_answer_text

_NUMBER = re.compile(r"-?\$?\d[\d,]*(?:\.\d+)?%?|-?\$?\.\d+%?")


def boxed_content(text: str) -> str | None:
    """The content of the last `\\boxed{...}` (braces balanced), or None.

    >>> boxed_content(r"so \\boxed{\\frac{1}{2}}.")
    '\\\\frac{1}{2}'
    """
    start = text.rfind("\\boxed")
    if start < 0:
        return None
    brace = text.find("{", start)
    if brace < 0:
        return None
    depth = 0
    for i in range(brace, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[brace + 1 : i]
    return None


def extract_answer(completion: str) -> str | None:
    """The final answer a completion gives, as text.

    >>> extract_answer("<think>2+2=5?</think>\\nThe answer is 4.")
    '4'
    >>> extract_answer("She makes 9 * 2 = $18.\\n#### 18")
    '18'
    >>> extract_answer(r"Thus \\boxed{\\dfrac{3}{4}}")
    '\\\\dfrac{3}{4}'
    """
    text = final_answer_text(completion)
    if "####" in text:
        tail = text.split("####")[-1].strip()
        return tail.splitlines()[0].strip() if tail else None
    boxed = boxed_content(text)
    if boxed is not None:
        return boxed.strip()
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def parse_number(text: str) -> Fraction | None:
    """A plain number, exactly: '1,234' -> 1234, '-0.5' -> -1/2, '3/4' -> 3/4, '50%' -> 1/2, '$18.00' -> 18.

    >>> parse_number("1,234.50")
    Fraction(2469, 2)
    >>> parse_number("x + 1") is None
    True
    """
    s = text.strip().replace(",", "").replace("$", "").replace(" ", "").rstrip(".")
    percent = s.endswith("%")
    s = s.rstrip("%").removeprefix("+")
    frac = re.fullmatch(r"\\d?frac\{(-?[\d.]+)\}\{(-?[\d.]+)\}", s)
    if frac:
        s = f"{frac.group(1)}/{frac.group(2)}"
    try:
        if re.fullmatch(r"-?\d+(\.\d+)?/-?\d+(\.\d+)?", s):
            num, den = s.split("/")
            value = Fraction(num) / Fraction(den)
        elif re.fullmatch(r"-?(\d+(\.\d*)?|\.\d+)", s):
            value = Fraction(s)
        else:
            return None
    except (ValueError, ZeroDivisionError):
        return None
    return value / 100 if percent else value


def answers_match(predicted: str, gold: str) -> bool:
    """Exact comparison for plain numbers; math-verify for anything else (LaTeX, tuples, expressions)."""
    p, g = parse_number(predicted), parse_number(gold)
    if p is not None and g is not None:
        return p == g
    from math_verify import parse, verify

    try:
        return bool(verify(parse(f"${gold}$"), parse(f"${predicted}$")))
    except Exception:  # math-verify raises on LaTeX it cannot parse: that answer does not verify
        return False


def math_verifier(completions, answer, **kwargs) -> list[float | None]:
    """1.0 when the completion's final answer equals the gold answer, else 0.0; None when a row has no gold.

    `answer` may be a bare gold answer or a GSM8K solution ending in `#### n`.

    >>> math_verifier(["<think>17*24 = 408</think>\\nThe answer is 408.", "The answer is 388."], answer=["408", "408"])
    [1.0, 0.0]
    >>> math_verifier([r"\\boxed{0.5}"], answer=[r"\\frac{1}{2}"])
    [1.0]
    """
    scores: list[float | None] = []
    for completion, gold in zip(completions, answer, strict=True):
        if gold is None:
            scores.append(None)
            continue
        gold_text = extract_answer(gold) if "####" in gold else gold
        predicted = extract_answer(completion_text(completion))
        scores.append(float(predicted is not None and gold_text is not None and answers_match(predicted, gold_text)))
    return scores


def think_format(completions, **kwargs) -> list[float | None]:
    """1.0 for exactly one `<think>...</think>` block at the start followed by a non-empty answer, else 0.0.

    >>> think_format(["<think>\\n4\\n</think>\\n\\nThe answer is 4.", "The answer is 4.", "<think>a</think>"])
    [1.0, 0.0, 0.0]
    """
    pattern = re.compile(r"\s*<think>(?:(?!<think>|</think>).)*</think>\s*\S.*", re.DOTALL)
    return [
        float(bool(pattern.fullmatch(t)) and t.count("</think>") == 1 and "<think>" not in t.split("</think>")[1])
        for t in map(completion_text, completions)
    ]
