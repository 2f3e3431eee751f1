"""Echo / follow: did the model return the message exactly?"""

from __future__ import annotations

from rewards.text import completion_text, final_answer_text


def echo_exact_match(completions, message, **kwargs) -> list[float | None]:
    """1.0 when the reply (after any think block, whitespace stripped) equals the message, else 0.0.

    >>> echo_exact_match(["apple river stone", " apple river"], message=["apple river stone", "apple river stone"])
    [1.0, 0.0]
    >>> echo_exact_match(["<think>\\n\\n</think>\\n\\nred cold"], message=["red cold"])
    [1.0]
    """
    return [
        None if gold is None else float(final_answer_text(completion_text(c)).strip() == gold.strip())
        for c, gold in zip(completions, message, strict=True)
    ]
