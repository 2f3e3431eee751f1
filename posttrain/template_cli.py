"""`posttrain template render`: show exactly what a chat template feeds the model.

    posttrain template render --template ../shared/data/reference/chat_templates/qwen3-0.6b.jinja --no-enable-thinking

Prints the rendered string, its token count, the control tokens in it with their ids, and the fraction of tokens
the assistant mask trains on. `python -m posttrain.template_cli ...` runs the same thing.

    posttrain template cost --template <jinja> --tokenizer <dir> --config <config.json> --turns 10 --thinking-tokens 2000

Prints, per turn of a chat whose replies think, the context tokens and KV-cache bytes with earlier think blocks
dropped and kept (`posttrain.chat.thinking_cost`).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import jinja2

from posttrain.chat.render import MaskError, load_template, render_chat, tokenize_with_assistant_mask
from posttrain.chat.thinking_cost import render_cost, thinking_cost
from posttrain.data.tiny_world import build_tiny_tokenizer
from posttrain.planner.config import load_config, parse_arch
from posttrain.planner.memory import kv_report

EXAMPLE_MESSAGES = [
    {"role": "system", "content": "You are a careful assistant. Answer with the final number only."},
    {"role": "user", "content": "What is 17 + 25?"},
    {"role": "assistant", "content": "42"},
    {"role": "user", "content": "And doubled?"},
    # Reasoning on the last turn: templates that follow Qwen3 drop it from turns before the last user message.
    {"role": "assistant", "content": "84", "reasoning_content": "Doubling 42: 2 x 40 = 80, 2 x 2 = 4, so 84."},
]

# Strings a template writes that look like control tokens when the tokenizer at hand lacks them: <|im_start|>,
# <|eot_id|>, <start_of_turn>. Plain tags such as <tools> stay out: real tokenizers treat them as ordinary text.
_CONTROL_LIKE = re.compile(r"<\|[^<>|\s]+\|>|</?[A-Za-z]+(?:_[A-Za-z]+)+>")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="posttrain template render", description=__doc__.splitlines()[0])
    parser.add_argument("--template", default="tiny", help="tiny | a .jinja file | a tokenizer dir (default: tiny)")
    parser.add_argument("--tokenizer", help="HF tokenizer dir (default: the tiny tokenizer)")
    parser.add_argument("--messages", type=Path, help="JSON file holding a list of {role, content} messages")
    parser.add_argument("--add-generation-prompt", action="store_true")
    parser.add_argument("--enable-thinking", action=argparse.BooleanOptionalAction, default=None)
    parser.add_argument("--reasoning-effort", choices=["low", "medium", "high"])
    parser.add_argument("--preserve-thinking", action="store_true")
    parser.add_argument("--tools", type=Path, help="JSON file holding a list of tool schemas")
    return parser


def control_tokens_in(text: str, template: str, tokenizer) -> list[str]:
    """Control tokens in `text`, in order of first appearance: the tokenizer's added tokens, plus control-like tags
    the template itself writes (so a `<b>` typed by a user is not listed)."""
    added = [t for t in tokenizer.added_tokens_encoder if t in text and not t.isspace()]
    written = [t for t in _CONTROL_LIKE.findall(text) if t in template]
    return sorted(set(added) | set(written), key=text.index)


def _read_json_list(path: Path, what: str) -> list:
    data = json.loads(path.read_text())
    if not isinstance(data, list):
        raise ValueError(f"{path}: expected a JSON list of {what}, got {type(data).__name__}")
    return data


def _load_tokenizer(name: str | None):
    if name is None:
        return build_tiny_tokenizer()
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(name)


def render_report(args: argparse.Namespace) -> str:
    template = load_template(args.template)
    if args.tokenizer is None and args.template != "tiny":
        print("note: no --tokenizer given, using the tiny tokenizer; control tokens it lacks are listed as "
              "not in vocabulary")
    tokenizer = _load_tokenizer(args.tokenizer)
    if "bos_token" in template and tokenizer.bos_token is None:
        print("note: the tokenizer has no bos_token, so the template's {{ bos_token }} renders empty")
    messages = _read_json_list(args.messages, "messages") if args.messages else EXAMPLE_MESSAGES
    knobs = {"add_generation_prompt": args.add_generation_prompt}
    if args.tools:
        knobs["tools"] = _read_json_list(args.tools, "tool schemas")
    if args.enable_thinking is not None:
        knobs["enable_thinking"] = args.enable_thinking
    if args.reasoning_effort:
        knobs["reasoning_effort"] = args.reasoning_effort
    if args.preserve_thinking:
        knobs["preserve_thinking"] = True

    # Same variables apply_chat_template would pass: the tokenizer's special tokens, then the knobs.
    text = render_chat(template, messages, **{**tokenizer.special_tokens_map, **knobs})
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    vocab = tokenizer.get_vocab()
    lines = [f"--- rendered ({args.template}) ---", text, "--- end ---", f"tokens: {len(ids)}", "control tokens:"]
    for token in control_tokens_in(text, template, tokenizer):
        where = f"id {vocab[token]}" if token in vocab else "not in vocabulary (split into ordinary tokens)"
        lines.append(f"  {token}  {where}  x{text.count(token)}")
    try:
        row = tokenize_with_assistant_mask(tokenizer, messages, template=template, **knobs)
        trained, total = sum(row["assistant_masks"]), len(row["input_ids"])
        lines.append(f"assistant mask: {trained}/{total} tokens ({trained / total:.3f})")
    except MaskError as err:  # e.g. a prompt-only conversation: still worth rendering
        lines.append(f"assistant mask: unavailable: {err}")
    return "\n".join(lines)


def build_cost_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="posttrain template cost",
                                     description="tokens and KV-cache bytes per turn, thinking dropped vs kept")
    parser.add_argument("--template", default="tiny", help="tiny | a .jinja file | a tokenizer dir (default: tiny)")
    parser.add_argument("--tokenizer", help="HF tokenizer dir (default: the tiny tokenizer)")
    parser.add_argument("--config", required=True, help="the model's config.json, model dir or hub id (planner)")
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--thinking-tokens", type=int, default=2000)
    parser.add_argument("--kv-dtype", default="bf16")
    return parser


def cost_report(args: argparse.Namespace) -> str:
    if args.turns < 1 or args.thinking_tokens < 1:
        raise ValueError(f"--turns and --thinking-tokens must be positive, got {args.turns}, {args.thinking_tokens}")
    kv = kv_report(parse_arch(load_config(args.config)), args.kv_dtype, [1], [1])
    rows, has_knob = thinking_cost(load_template(args.template), _load_tokenizer(args.tokenizer), args.turns,
                                   args.thinking_tokens, kv.bytes_per_token, kv.state_bytes_per_request)
    state = f"; plus {kv.state_bytes_per_request:,} B of linear-attention state" if kv.state_bytes_per_request else ""
    return render_cost(rows, has_knob, args.thinking_tokens, f"{kv.formula} = {kv.bytes_per_token:,} B{state}")


def main(argv: list[str], command: str = "render") -> int:
    try:
        args = (build_cost_parser() if command == "cost" else build_parser()).parse_args(argv)
    except SystemExit as exit_:  # argparse already printed usage; keep main() returning a code
        return int(exit_.code or 0)
    try:
        print(cost_report(args) if command == "cost" else render_report(args))
    except (OSError, ValueError, TypeError, KeyError, jinja2.TemplateError) as err:
        print(f"error: template {args.template}: {type(err).__name__}: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
