"""Split a chat reply into reasoning, content and tool calls, as a whole or while it streams.

Qwen3-style output: `<think>reasoning</think>` first (or only `reasoning</think>` when the chat template already
opened the think block in the generation prompt), then the answer, then any number of
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks. The reasoning comes back as
`reasoning_content`, the calls as OpenAI `tool_calls`, the rest as `content`.

Streaming: `ReplyParser.feed(text_so_far)` returns only what is new since the last call and holds back a tail that
could still become a tag (`<thi` may be the start of `<think>`), so a delta never has to be taken back. Tool-call
text is buffered and parsed when the reply ends (a half-written JSON object is not a call yet). The text so far
comes from `IncrementalText`, which decodes only the newest tokens.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"
TAGS = (THINK_OPEN, THINK_CLOSE, TOOL_OPEN)
TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def opens_thinking(prompt: str) -> bool:
    """True when the generation prompt ends inside an open think block (the reply starts with reasoning)."""
    tail = prompt.rstrip()
    return tail.endswith(THINK_OPEN)


def partial_tag_len(text: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of a tag (held back while streaming)."""
    best = 0
    for tag in TAGS:
        for k in range(min(len(tag) - 1, len(text)), best, -1):
            if text.endswith(tag[:k]):
                best = k
                break
    return best


def split_reasoning(text: str, thinking: bool) -> tuple[str | None, str, bool]:
    """(reasoning or None, the rest, whether the think block is still open at the end of `text`)."""
    if not thinking:
        stripped = text.lstrip()
        if not stripped.startswith(THINK_OPEN):
            return None, text, False
        text = stripped[len(THINK_OPEN):]
    if THINK_CLOSE not in text:
        return text.strip("\n"), "", True
    reasoning, rest = text.split(THINK_CLOSE, 1)
    return reasoning.strip("\n"), rest.lstrip("\n"), False


def parse_tool_calls(content: str) -> tuple[str, list[dict]]:
    """(content without the well-formed tool-call blocks, OpenAI tool_calls). A block whose JSON does not parse
    into a name and arguments stays in the content as text, so nothing the model wrote is lost."""
    calls = []

    def take(match: re.Match) -> str:
        try:
            obj = json.loads(match.group(1))
        except json.JSONDecodeError:
            return match.group(0)
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return match.group(0)
        arguments = obj.get("arguments", {})
        calls.append({
            "id": f"call_{uuid.uuid4().hex[:24]}",
            "type": "function",
            "function": {"name": obj["name"],
                         "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments)},
        })
        return ""

    rest = TOOL_CALL.sub(take, content)
    return ("" if calls and not rest.strip() else rest), calls


@dataclass
class Reply:
    content: str | None
    reasoning_content: str | None
    tool_calls: list[dict] = field(default_factory=list)


def parse_reply(text: str, thinking: bool = False, tools: bool = True) -> Reply:
    """The whole reply at once (non-streaming responses, and the end of a stream)."""
    reasoning, content, _ = split_reasoning(text, thinking)
    calls: list[dict] = []
    if tools:
        content, calls = parse_tool_calls(content)
    return Reply(content if content or not calls else None, reasoning, calls)


class ReplyParser:
    """Incremental `parse_reply`: feed the decoded text so far, get (reasoning delta, content delta)."""

    def __init__(self, thinking: bool = False, tools: bool = True):
        self.thinking, self.tools = thinking, tools
        self.sent_reasoning = self.sent_content = 0

    def feed(self, text: str) -> tuple[str, str]:
        safe = text[: len(text) - partial_tag_len(text)]
        if not self.thinking and THINK_OPEN.startswith(safe.lstrip()) and safe.strip():
            return "", ""  # could still be the opening tag
        reasoning, content, _ = split_reasoning(safe, self.thinking)
        if self.tools and TOOL_OPEN in content:
            content = content[: content.index(TOOL_OPEN)]  # calls are parsed at the end
        return self._delta(reasoning or "", content)

    def finish(self, text: str) -> tuple[str, str, list[dict]]:
        """The last deltas and the tool calls, from the complete text."""
        reply = parse_reply(text, self.thinking, self.tools)
        # the held-back tail, and any content after the tool-call blocks, go out now
        reasoning_delta, content_delta = self._delta(reply.reasoning_content or "", reply.content or "")
        return reasoning_delta, content_delta, reply.tool_calls

    def _delta(self, reasoning: str, content: str) -> tuple[str, str]:
        # reasoning is stripped of trailing newlines only at the end, so it can shrink by a newline: never resend
        r = reasoning[self.sent_reasoning:] if len(reasoning) > self.sent_reasoning else ""
        c = content[self.sent_content:] if len(content) > self.sent_content else ""
        self.sent_reasoning += len(r)
        self.sent_content += len(c)
        return r, c


class IncrementalText:
    """A stream's text so far, decoded a few tokens at a time rather than whole at every token (what TGI and vLLM
    do): the tokens since `prefix` are decoded twice, with and without the newest ones, and the difference is the
    new text. Starting a token early keeps what a tokenizer does at a word's start (SentencePiece's leading space)
    out of the difference. A difference that ends in U+FFFD (part of a multi-byte character) waits for the next
    token."""

    def __init__(self, tokenizer):
        self.tokenizer, self.text, self.prefix, self.read = tokenizer, "", 0, 0

    def update(self, tokens: list[int]) -> str:
        decode = self.tokenizer.decode
        before = decode(tokens[self.prefix:self.read], skip_special_tokens=True)
        after = decode(tokens[self.prefix:], skip_special_tokens=True)
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.text += after[len(before):]
            self.prefix, self.read = self.read, len(tokens)
        return self.text
