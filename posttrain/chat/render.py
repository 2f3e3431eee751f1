"""Render chats with a model's own Jinja chat template and mark the characters and tokens the assistant produces.

Most published templates have no `{% generation %}` tags, so the assistant mask is recovered from the rendered text:
the template is probed with sentinel conversations to learn its assistant header and end-of-turn marker, then the
real conversation is walked message by message with a cursor. Walking in order matters: a user message may contain
the assistant's answer verbatim (the echo task), and a plain substring search would mask the user's copy.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from posttrain.models.tiny import tiny_chat_template


class MaskError(ValueError):
    """An assistant mask that cannot be computed or would train on nothing / on everything."""


def load_template(name_or_path: str) -> str:
    """'tiny' -> the packaged tiny template; else a .jinja file, a tokenizer_config.json, or a tokenizer directory."""
    if name_or_path == "tiny":
        return tiny_chat_template()
    path = Path(name_or_path)
    if path.is_dir():
        if (path / "chat_template.jinja").is_file():
            return (path / "chat_template.jinja").read_text()
        if (path / "tokenizer_config.json").is_file():
            return _template_from_tokenizer_config(path / "tokenizer_config.json")
        raise FileNotFoundError(f"{path}: directory has neither chat_template.jinja nor tokenizer_config.json")
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such chat template (expected 'tiny', a .jinja file or a tokenizer dir)")
    if path.suffix == ".json":
        return _template_from_tokenizer_config(path)
    return path.read_text()


def _template_from_tokenizer_config(path: Path) -> str:
    template = json.loads(path.read_text()).get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        template = {t["name"]: t["template"] for t in template}.get("default")
    if not isinstance(template, str):
        raise ValueError(f"{path}: no string 'chat_template' (or 'default' named template) in tokenizer config")
    return template


def render_chat(template: str, messages: list[dict], *, add_generation_prompt=False, tools=None, **knobs) -> str:
    """The text `tokenizer.apply_chat_template(messages, tokenize=False, ...)` gives, rendered by the same code.

    Knobs are template variables: enable_thinking, reasoning_effort, preserve_thinking, and bos_token / eos_token
    (apply_chat_template passes the tokenizer's special tokens; here the caller does).
    """
    # transformers takes about a second to import: the error types here (MaskError) and `data check --model none`
    # must not pay for it
    from transformers.utils.chat_template_utils import render_jinja_template

    # apply_chat_template drops None-valued keys first: many templates render a literal "None" otherwise
    messages = [{k: v for k, v in m.items() if v is not None} for m in messages]
    rendered, _ = render_jinja_template(
        conversations=[messages],
        tools=tools,
        chat_template=template,
        add_generation_prompt=add_generation_prompt,
        **knobs,
    )
    return rendered[0]


# Sentinels survive trimming (no whitespace) and cannot collide with template text.
_PROBE = [
    {"role": "user", "content": "PROBEUSER1"},
    {"role": "assistant", "content": "PROBEASSISTANT1"},
    {"role": "user", "content": "PROBEUSER2"},
    {"role": "assistant", "content": "PROBEASSISTANT2"},
]


_MARKERS: dict[tuple[str, str], tuple[str, str]] = {}


def probe_turn_markers(template: str, **knobs) -> tuple[str, str]:
    """(assistant header, end-of-turn marker) of a template, learned from sentinel conversations.

    Header: what the template writes between a user turn and the assistant's content, for an early turn, for the
    last turn and as the generation prompt; their common prefix drops what differs (Qwen3 writes an empty think
    block only after the last query, Qwen3.5 opens `<think>` in the generation prompt).
    End marker: what follows the assistant's content in every turn, up to the first whitespace.
    """
    knobs = {k: v for k, v in knobs.items() if k not in ("tools", "add_generation_prompt")}
    # Probing costs five renders, more than the row itself; a dataset reuses one template and one set of knobs.
    key = (template, json.dumps(knobs, sort_keys=True, default=repr))
    if key not in _MARKERS:
        _MARKERS[key] = _probe(template, knobs)
    return _MARKERS[key]


def _probe(template: str, knobs: dict) -> tuple[str, str]:
    full = render_chat(template, _PROBE, **knobs)
    between, after = [], []
    for i in (1, 3):
        prompt = render_chat(template, _PROBE[:i], **knobs)
        content = full.find(_PROBE[i]["content"], len(prompt))
        if full.startswith(prompt) and content >= 0:
            between.append(full[len(prompt) : content])
            after.append(full[content + len(_PROBE[i]["content"]) :])
        generation = render_chat(template, _PROBE[:i], add_generation_prompt=True, **knobs)
        if generation.startswith(prompt) and len(generation) > len(prompt):  # some templates ignore the flag
            between.append(generation[len(prompt) :])
    header = os.path.commonprefix(between)
    marker = re.match(r"\s*\S+", os.path.commonprefix(after))  # e.g. "<|im_end|>" out of "<|im_end|>\n<|im_start|>"
    end = marker.group(0) if marker else ""
    if not header or not end:
        raise MaskError(f"cannot probe the template's assistant header ({header!r}) or end-of-turn marker ({end!r})")
    return header, end


def _located_text(message: dict) -> str:
    """The part of a message's content the template is expected to render verbatim (templates may trim it, and
    Qwen-style templates move an inline `<think>...</think>` into a reasoning block before the answer)."""
    content = message.get("content")
    if not isinstance(content, str):
        return ""
    if message.get("role") == "assistant" and "</think>" in content:
        content = content.split("</think>")[-1]
    return content.strip()


def assistant_spans(template: str, messages: list[dict], rendered: str | None = None, **knobs) -> list[tuple[int, int]]:
    """Character spans [start, end) of `rendered` the assistant produces, one per assistant message.

    Each span runs from right after the assistant header through the end-of-turn marker, which is included so the
    model learns to stop; reasoning or tool calls the template writes in the turn fall inside the span.
    """
    if rendered is None:
        rendered = render_chat(template, messages, **knobs)
    header, end = probe_turn_markers(template, **knobs)
    spans, cursor = [], 0
    for index, message in enumerate(messages):
        text = _located_text(message)
        if message.get("role") != "assistant":
            # Consume the message's own text so a later search cannot land inside it; a message the template
            # does not render verbatim (non-string content, tool payloads) leaves the cursor where it is.
            found = rendered.find(text, cursor) if text else -1
            cursor = found + len(text) if found >= 0 else cursor
            continue
        head = rendered.find(header, cursor)
        if head < 0:
            raise MaskError(f"message {index} (assistant): header {header!r} not found after character {cursor}")
        start = head + len(header)
        content_end = start
        if text:
            found = rendered.find(text, start)
            if found < 0 or end in rendered[start:found]:
                raise MaskError(f"message {index} (assistant): content {text[:40]!r} not found in its rendered turn")
            content_end = found + len(text)
        stop = rendered.find(end, content_end)
        if stop < 0:
            raise MaskError(f"message {index} (assistant): end-of-turn marker {end!r} not found after its content")
        spans.append((start, stop + len(end)))
        cursor = stop + len(end)
    return spans


def tokenize_with_assistant_mask(tokenizer, messages: list[dict], *, row_id=None, template=None, **knobs) -> dict:
    """{input_ids, assistant_masks, text}: mask 1 on tokens whose first character lies inside an assistant span."""
    label = f"row {row_id}" if row_id is not None else "conversation"
    template = template or tokenizer.chat_template
    # Same template variables as apply_chat_template: the tokenizer's special tokens, overridden by explicit knobs.
    knobs = {**tokenizer.special_tokens_map, **knobs}
    try:
        text = render_chat(template, messages, **knobs)
        spans = assistant_spans(template, messages, rendered=text, **knobs)
    except MaskError as err:
        raise MaskError(f"{label}: {err}") from err
    # The template writes BOS itself where the model wants one; add_special_tokens would double it.
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    masks = [int(any(s <= tok_start < e for s, e in spans)) for tok_start, _ in encoded["offset_mapping"]]
    if not any(masks):
        raise MaskError(f"{label}: assistant mask is empty ({len(masks)} tokens, no assistant turn to train on)")
    if all(masks):
        raise MaskError(f"{label}: assistant mask covers every token ({len(masks)}), so prompts would be trained on")
    return {"input_ids": list(encoded["input_ids"]), "assistant_masks": masks, "text": text}


def mask_fraction(rows) -> float:
    """Fraction of all tokens in `rows` (dicts with assistant_masks) that are trained on."""
    total = sum(len(row["assistant_masks"]) for row in rows)
    return sum(sum(row["assistant_masks"]) for row in rows) / total if total else 0.0
