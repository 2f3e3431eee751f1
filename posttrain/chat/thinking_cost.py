"""What kept thinking costs: tokens and KV-cache bytes per turn of a multi-turn chat whose assistant turns think.

Qwen3-style templates drop the think blocks of turns before the last user message, so a conversation's context
grows by the questions and answers only. Kept thinking (`preserve_thinking` in templates that have the knob, or a
server that keeps the generated cache) grows it by every turn's thinking as well. `thinking_cost` renders the same
conversation turn by turn through the model's own template, counts tokens with its tokenizer and multiplies by the
planner's KV bytes per token (`posttrain.planner.memory.kv_report`).

When a template has no `preserve_thinking` knob (the renderings with and without it are equal), the kept context
is computed instead: the dropped rendering plus, for each earlier turn, the tokens its reasoning adds to the last
turn's rendering (where every template keeps it) over an empty reasoning; tags a template writes around even an
empty think block are then not counted again.
"""

from __future__ import annotations

from dataclasses import dataclass

from posttrain.chat.render import render_chat

QUESTION = "Here is the next part of the problem. What follows from it?"
ANSWER = "It follows that the total is 42."


@dataclass
class TurnCost:
    turn: int
    dropped_tokens: int  # context after the turn's reply, earlier think blocks dropped
    kept_tokens: int  # the same with every turn's think block kept
    dropped_kv_bytes: int
    kept_kv_bytes: int


def thinking_text(tokenizer, tokens: int) -> str:
    """Reasoning text of exactly `tokens` tokens for this tokenizer (a word repeated), checked by encoding it."""
    for word in (" step", " think", " so", " a", "a"):
        text = (word * tokens).strip() if word.startswith(" ") else word * tokens
        if len(tokenizer(text, add_special_tokens=False)["input_ids"]) == tokens:
            return text
    raise ValueError(f"no repeated word encodes to exactly {tokens} tokens with this tokenizer")


def conversation(turns: int, reasoning: str) -> list[dict]:
    messages = []
    for _ in range(turns):
        messages += [{"role": "user", "content": QUESTION},
                     {"role": "assistant", "content": ANSWER, "reasoning_content": reasoning}]
    return messages


def thinking_cost(template: str, tokenizer, turns: int, thinking_tokens: int, kv_bytes_per_token: int,
                  state_bytes: int = 0) -> tuple[list[TurnCost], bool]:
    """Per turn, the context tokens and KV bytes (kv_bytes_per_token per token, plus `state_bytes` of fixed
    linear-attention state) with earlier think blocks dropped and kept; and whether the template has the knob."""
    specials = dict(tokenizer.special_tokens_map)
    count = lambda text: len(tokenizer(text, add_special_tokens=False)["input_ids"])  # noqa: E731
    reasoning = thinking_text(tokenizer, thinking_tokens)
    messages = conversation(turns, reasoning)
    one_turn = conversation(1, reasoning)
    block = count(render_chat(template, one_turn, **specials)) - count(
        render_chat(template, conversation(1, ""), **specials))  # the think block as the template writes it
    has_knob = render_chat(template, messages, preserve_thinking=True, **specials) != render_chat(
        template, messages, preserve_thinking=False, **specials)
    rows = []
    for turn in range(1, turns + 1):
        shown = messages[: 2 * turn]
        dropped = count(render_chat(template, shown, preserve_thinking=False, **specials))
        if has_knob:
            kept = count(render_chat(template, shown, preserve_thinking=True, **specials))
        else:
            kept = dropped + (turn - 1) * block
        rows.append(TurnCost(turn, dropped, kept, dropped * kv_bytes_per_token + state_bytes,
                             kept * kv_bytes_per_token + state_bytes))
    return rows, has_knob


def render_cost(rows: list[TurnCost], has_knob: bool, thinking_tokens: int, formula: str) -> str:
    mb = lambda n: f"{n / 2**20:,.1f}"  # noqa: E731
    how = ("the template's preserve_thinking knob" if has_knob else
           "computed: the template has no preserve_thinking knob, so each earlier turn's think block is added")
    lines = [f"{len(rows)} turns, {thinking_tokens} thinking tokens each; KV per token: {formula}",
             f"kept: {how}",
             "| turn | tokens, thinking dropped | KV MiB | tokens, thinking kept | KV MiB | kept / dropped |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r.turn} | {r.dropped_tokens:,} | {mb(r.dropped_kv_bytes)} | {r.kept_tokens:,} | "
                     f"{mb(r.kept_kv_bytes)} | {r.kept_tokens / r.dropped_tokens:.2f} |")
    return "\n".join(lines)
