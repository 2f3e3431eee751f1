"""A process reward for chains of additions: partial credit for each worked step that is right.

The tiny world's arithmetic replies think one running sum per line ("3 plus 4 = 7", "7 plus 8 = 15") before they
answer. An outcome-only 0/1 reward blames every token of a reply for one slipped sum; this reward credits the
reply for each line that is right, counted up to the first one that is not, so the advantage points at where the
reply went wrong. It reads the problem's numbers from the prompt, and is not applicable (None) to a prompt that is
not a chain of additions.
"""

from __future__ import annotations

import re

from rewards.text import completion_text

_CHAIN = re.compile(r"What is (\d+(?: plus \d+)+)\?")
_LINE = re.compile(r"(-?\d+) plus (-?\d+) = (-?\d+)")


def chain_numbers(prompt) -> list[int] | None:
    """The addends of a "What is a plus b plus c?" prompt (a string or a conversation), or None.

    >>> chain_numbers([{"role": "user", "content": "What is 3 plus 4 plus 8?"}])
    [3, 4, 8]
    >>> chain_numbers("Repeat after me") is None
    True
    """
    text = prompt if isinstance(prompt, str) else (prompt[-1].get("content") or "")
    match = _CHAIN.search(text)
    return [int(n) for n in match.group(1).split(" plus ")] if match else None


def correct_steps(numbers: list[int], reply: str) -> int:
    """How many running-sum lines of `reply`'s think block are right before the first wrong or missing one.

    >>> correct_steps([3, 4, 8], "<think>\\n3 plus 4 = 7\\n7 plus 8 = 15\\n</think>\\nThe answer is 15.")
    2
    >>> correct_steps([3, 4, 8], "<think>\\n3 plus 4 = 8\\n8 plus 8 = 16\\n</think>\\nThe answer is 16.")
    0
    """
    think = reply.split("</think>")[0] if "</think>" in reply else reply
    lines = [line.strip() for line in think.replace("<think>", "").strip().splitlines() if line.strip()]
    total, right = numbers[0], 0
    for line, addend in zip(lines, numbers[1:]):
        match = _LINE.fullmatch(line)
        if match is None or [int(g) for g in match.groups()] != [total, addend, total + addend]:
            break
        total += addend
        right += 1
    return right


def running_sum_steps(completions, prompts=None, **kwargs) -> list[float | None]:
    """Fraction of a chain's running sums worked right, up to the first slip (None: not a chain prompt).

    >>> running_sum_steps(["<think>\\n1 plus 2 = 3\\n3 plus 3 = 7\\n</think>\\nThe answer is 7."],
    ...                   prompts=[[{"role": "user", "content": "What is 1 plus 2 plus 3?"}]])
    [0.5]
    """
    if prompts is None:
        raise ValueError("running_sum_steps reads the problem from `prompts`, which TRL passes to reward functions")
    out: list[float | None] = []
    for prompt, completion in zip(prompts, completions):
        numbers = chain_numbers(prompt)
        if numbers is None or len(numbers) < 2:
            out.append(None)
            continue
        out.append(correct_steps(numbers, completion_text(completion)) / (len(numbers) - 1))
    return out
