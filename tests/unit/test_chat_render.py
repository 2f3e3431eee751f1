"""Chat rendering and assistant masks, on the tiny template and the six real templates in ../shared."""

from __future__ import annotations

import json
from pathlib import Path

import jinja2
import pytest

from posttrain.chat import render
from posttrain.chat.render import (
    MaskError,
    assistant_spans,
    load_template,
    mask_fraction,
    probe_turn_markers,
    render_chat,
    tokenize_with_assistant_mask,
)

TEMPLATE_DIR = Path(__file__).resolve().parents[3] / "shared" / "data" / "reference" / "chat_templates"
THINK_EMPTY = "<think>\n\n</think>\n\n"
LLAMA_HEADER = "<|start_header_id|>assistant<|end_header_id|>\n\n"

# name, system role allowed, BOS the real tokenizer passes, assistant header, end marker, what the template writes
# before the content of the last assistant turn (Qwen3-style templates open an empty think block there).
TEMPLATES = [
    ("tiny", True, None, "<|im_start|>assistant\n", "<|im_end|>", ""),
    ("qwen3-0.6b", True, None, "<|im_start|>assistant\n", "<|im_end|>", THINK_EMPTY),
    ("qwen2.5-7b-instruct", True, None, "<|im_start|>assistant\n", "<|im_end|>", ""),
    ("llama-3.1-8b-instruct", True, "<|begin_of_text|>", LLAMA_HEADER, "<|eot_id|>", ""),
    ("llama-3.2-3b-instruct", True, "<|begin_of_text|>", LLAMA_HEADER, "<|eot_id|>", ""),
    ("gemma-2-2b-it", False, "<bos>", "<start_of_turn>model\n", "<end_of_turn>", ""),
    ("qwen3.5-4b", True, None, "<|im_start|>assistant\n", "<|im_end|>", THINK_EMPTY),
]
# Real templates need ../shared; the marker lets `-m "not shared"` deselect them.
TEMPLATE_PARAMS = [pytest.param(*t, id=t[0], marks=[] if t[0] == "tiny" else [pytest.mark.shared]) for t in TEMPLATES]
# The tiny tokenizer lacks Llama's and Gemma's control tokens; adding them as special tokens, as the real
# tokenizers have them, keeps token boundaries on the turn markers so masked text can be compared exactly.
FOREIGN_CONTROL_TOKENS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
                          "<bos>", "<start_of_turn>", "<end_of_turn>"]


def _template(name: str) -> str:
    if name == "tiny":
        return load_template("tiny")
    path = TEMPLATE_DIR / f"{name}.jinja"
    if not path.is_file():
        pytest.skip(f"{path} absent: the real chat templates live in ../shared (not checked out here)")
    return load_template(str(path))


@pytest.fixture(scope="module")
def tokenizer():
    from posttrain.data.tiny_world import build_tiny_tokenizer

    from tokenizers.processors import TemplateProcessing

    tok = build_tiny_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": FOREIGN_CONTROL_TOKENS})
    # Like Llama's tokenizer, prepend BOS when asked for special tokens, so a doubled BOS would show in the ids.
    bos_id = tok.convert_tokens_to_ids("<|begin_of_text|>")
    tok.backend_tokenizer.post_processor = TemplateProcessing(
        single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", bos_id)]
    )
    assert tok("hi")["input_ids"][0] == bos_id
    return tok


def _knobs(bos):
    return {"bos_token": bos} if bos else {}


def _masked_runs(row) -> list[tuple[int, int]]:
    """Character ranges covered by consecutive runs of masked tokens."""
    runs, current = [], None
    for (start, end), bit in zip(row["offsets"], row["assistant_masks"]):
        if bit and current:
            current[1] = end
        elif bit:
            current = [start, end]
        elif current:
            runs.append(tuple(current))
            current = None
    return runs + ([tuple(current)] if current else [])


def _masked(tokenizer, messages, name, bos, **knobs):
    row = tokenize_with_assistant_mask(tokenizer, messages, row_id=0, template=_template(name), **_knobs(bos), **knobs)
    row["offsets"] = tokenizer(row["text"], add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    return row, [row["text"][s:e] for s, e in _masked_runs(row)]


def _conversation(with_system: bool) -> list[dict]:
    system = [{"role": "system", "content": "SYSTEM: answer tersely."}] if with_system else []
    return system + [
        {"role": "user", "content": "What is two plus two?"},
        {"role": "assistant", "content": "Four."},
        {"role": "user", "content": "And three plus three?"},
        {"role": "assistant", "content": "Six."},
    ]


@pytest.mark.parametrize("name, system_ok, bos, header, end, last_prefix", TEMPLATE_PARAMS)
def test_multi_turn_mask_is_exactly_the_assistant_turns(tokenizer, name, system_ok, bos, header, end, last_prefix):
    messages = _conversation(with_system=system_ok)
    row, masked = _masked(tokenizer, messages, name, bos)

    # Same string as the tokenizer's own apply_chat_template: rendering goes through transformers' machinery.
    template = _template(name)
    assert row["text"] == tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False, **_knobs(bos))
    if bos:  # the template writes BOS itself, and tokenizing must not add a second one
        assert row["text"].startswith(bos) and row["text"].count(bos) == 1
        assert row["input_ids"][:2].count(tokenizer.convert_tokens_to_ids(bos)) == 1
    assert probe_turn_markers(template, **_knobs(bos)) == (header, end)
    assert masked == ["Four." + end, last_prefix + "Six." + end]
    for message in messages:
        if message["role"] != "assistant":
            start = row["text"].index(message["content"])
            stop = start + len(message["content"])
            inside = [bit for (s, _), bit in zip(row["offsets"], row["assistant_masks"]) if start <= s < stop]
            assert inside and not any(inside), f"{message['role']} content masked"
    assert 0 < sum(row["assistant_masks"]) < len(row["input_ids"])


@pytest.mark.parametrize("name, system_ok, bos, header, end, last_prefix", TEMPLATE_PARAMS)
def test_echo_is_masked_on_the_assistant_side_only(tokenizer, name, system_ok, bos, header, end, last_prefix):
    # The echo task: the answer is a verbatim substring of the prompt, so a naive search would mask the user's copy.
    messages = [{"role": "user", "content": "Repeat exactly: the cat sat"},
                {"role": "assistant", "content": "the cat sat"}]
    row, masked = _masked(tokenizer, messages, name, bos)
    assert masked == [last_prefix + "the cat sat" + end]
    first, last = row["text"].index("the cat sat"), row["text"].rindex("the cat sat")
    assert first < last
    spans = assistant_spans(_template(name), messages, row["text"], **_knobs(bos))
    assert spans[0][0] <= last and spans[0][0] > first


def test_user_quoting_an_assistant_turn_is_not_masked(tokenizer):
    # A user pasting a transcript puts the assistant header and end marker in their own message; the cursor walks
    # past each message's content, so the header search starts after it.
    quoted = "What does '<|im_start|>assistant\nhello<|im_end|>' mean?"
    messages = [{"role": "user", "content": quoted}, {"role": "assistant", "content": "hello"}]
    row, masked = _masked(tokenizer, messages, "tiny", None)
    assert masked == ["hello<|im_end|>"]
    assert assistant_spans(load_template("tiny"), messages)[0][0] > row["text"].index(quoted) + len(quoted)


@pytest.mark.parametrize("name", ["tiny", pytest.param("qwen3-0.6b", marks=pytest.mark.shared),
                                  pytest.param("qwen3.5-4b", marks=pytest.mark.shared)])
def test_reasoning_rendered_in_the_turn_is_inside_the_span(tokenizer, name):
    messages = [{"role": "user", "content": "2+2?"},
                {"role": "assistant", "content": "4", "reasoning_content": "two and two make four"}]
    _, masked = _masked(tokenizer, messages, name, None)
    assert masked == ["<think>\ntwo and two make four\n</think>\n\n4<|im_end|>"]


@pytest.mark.shared
@pytest.mark.parametrize("name", ["gemma-2-2b-it", "llama-3.1-8b-instruct", "qwen3.5-4b"])
def test_trimming_templates_still_locate_padded_content(tokenizer, name):
    bos = {"gemma-2-2b-it": "<bos>", "llama-3.1-8b-instruct": "<|begin_of_text|>"}.get(name)
    messages = [{"role": "user", "content": "  hi  "}, {"role": "assistant", "content": "\n  hello there  \n"}]
    _, masked = _masked(tokenizer, messages, name, bos)
    assert masked[0].startswith("hello there") or masked[0].startswith(THINK_EMPTY + "hello there")


# --- tiny template knobs -------------------------------------------------------------------------------------------

TINY = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("enable_thinking, suffix", [
    (None, "<|im_start|>assistant\n"),
    (True, "<|im_start|>assistant\n"),
    (False, "<|im_start|>assistant\n" + THINK_EMPTY),
])
def test_enable_thinking_false_prefills_an_empty_think_block(enable_thinking, suffix):
    knobs = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
    text = render_chat(load_template("tiny"), TINY, add_generation_prompt=True, **knobs)
    assert text == "<|im_start|>user\nhi<|im_end|>\n" + suffix


@pytest.mark.parametrize("level, line", [
    ("low", "Reasoning effort: low. Think briefly before answering."),
    ("medium", "Reasoning effort: medium. Think step by step before answering."),
    ("high", "Reasoning effort: high. Think carefully, check every step, then answer."),
])
def test_reasoning_effort_sets_the_system_line(level, line):
    messages = [{"role": "system", "content": "Be kind."}] + TINY
    text = render_chat(load_template("tiny"), messages, reasoning_effort=level)
    assert text.startswith(f"<|im_start|>system\nBe kind.\n\n{line}<|im_end|>\n")


def test_reasoning_effort_rejects_an_unknown_level():
    with pytest.raises(jinja2.TemplateError, match="reasoning_effort must be one of low, medium, high; got extreme"):
        render_chat(load_template("tiny"), TINY, reasoning_effort="extreme")


@pytest.mark.parametrize("preserve, kept", [(False, ["second"]), (True, ["first", "second"])])
def test_preserve_thinking_keeps_earlier_think_blocks(tokenizer, preserve, kept):
    messages = [{"role": "user", "content": "q1"},
                {"role": "assistant", "content": "a1", "reasoning_content": "first"},
                {"role": "user", "content": "q2"},
                {"role": "assistant", "content": "a2", "reasoning_content": "second"}]
    text = render_chat(load_template("tiny"), messages, preserve_thinking=preserve)
    assert [r for r in ("first", "second") if f"<think>\n{r}\n</think>" in text] == kept
    _, masked = _masked(tokenizer, messages, "tiny", None, preserve_thinking=preserve)
    assert masked[0] == ("<think>\nfirst\n</think>\n\na1<|im_end|>" if preserve else "a1<|im_end|>")


def test_tools_go_to_the_system_turn_and_tool_calls_render_as_tool_call(tokenizer):
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    call = {"type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}
    messages = [{"role": "user", "content": "1+2?"}, {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "content": "3"}, {"role": "assistant", "content": "3"}]
    text = render_chat(load_template("tiny"), messages, tools=tools)
    system = text.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\n# Tools") and json.dumps(tools[0]) in system
    rendered_call = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    _, masked = _masked(tokenizer, messages, "tiny", None, tools=tools)
    assert masked == [rendered_call + "<|im_end|>", "3<|im_end|>"]


# --- errors and helpers ----------------------------------------------------------------------------------------------

def test_prompt_only_row_is_refused_naming_the_row(tokenizer):
    with pytest.raises(MaskError, match=r"^row 17: assistant mask is empty"):
        tokenize_with_assistant_mask(tokenizer, TINY, row_id=17)


def test_all_ones_mask_is_refused_naming_the_row(tokenizer, monkeypatch):
    # Real templates always leave the header unmasked; a span bug that covered everything must still be caught.
    monkeypatch.setattr(render, "assistant_spans", lambda template, messages, rendered, **k: [(0, len(rendered))])
    with pytest.raises(MaskError, match=r"^row 3: assistant mask covers every token"):
        tokenize_with_assistant_mask(tokenizer, _conversation(True), row_id=3)


def test_unlocatable_assistant_content_is_refused_naming_the_row(tokenizer):
    shouting = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content | upper }}<|im_end|>\n{% endfor %}"
    with pytest.raises(MaskError, match=r"^row 5: message 1 \(assistant\): content 'Four\.' not found"):
        tokenize_with_assistant_mask(tokenizer, _conversation(False)[:2], row_id=5, template=shouting)


def test_mask_fraction_counts_trained_tokens_over_all_rows():
    assert mask_fraction([{"assistant_masks": [1, 0, 0, 1]}, {"assistant_masks": [0, 1]}]) == 0.5
    assert mask_fraction([]) == 0.0


def test_load_template_accepts_tiny_files_and_tokenizer_dirs(tmp_path):
    tiny = load_template("tiny")
    assert "<|im_start|>" in tiny
    (tmp_path / "t.jinja").write_text(tiny)
    assert load_template(str(tmp_path / "t.jinja")) == tiny
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "tokenizer_config.json").write_text(json.dumps({"chat_template": tiny}))
    assert load_template(str(tmp_path / "hf")) == tiny
    (tmp_path / "hf" / "chat_template.jinja").write_text("{{ messages }}")
    assert load_template(str(tmp_path / "hf")) == "{{ messages }}"  # the .jinja file wins, as in transformers
    with pytest.raises(FileNotFoundError, match="missing.jinja"):
        load_template(str(tmp_path / "missing.jinja"))
