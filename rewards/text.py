"""Text helpers every scorer shares: completions arrive as strings or as TRL conversational message lists."""

from __future__ import annotations


def completion_text(completion) -> str:
    """The text of one completion: a string, or the content of the last message of a conversation.

    >>> completion_text("hi")
    'hi'
    >>> completion_text([{"role": "assistant", "content": "hello"}])
    'hello'
    """
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list) and completion and isinstance(completion[-1], dict):
        return completion[-1].get("content") or ""
    raise TypeError(f"a completion is a string or a list of messages, got {type(completion).__name__}")


def final_answer_text(text: str) -> str:
    """The part of a reply after its think block (the whole reply when there is none).

    >>> final_answer_text("<think>\\n2 + 2 = 4\\n</think>\\n\\nThe answer is 4.")
    'The answer is 4.'
    """
    return text.split("</think>")[-1].lstrip("\n") if "</think>" in text else text
