"""GSM8K solutions as calculator conversations: each annotation a tool call, the calculator's own result in the tool
turn, rows it disagrees with dropped; rendered through a template with tools, the tool results carry no loss."""

from __future__ import annotations

import json
import re

from posttrain.chat.render import load_template, tokenize_with_assistant_mask
from posttrain.data.tool_calls import tool_call_messages, tool_call_rows
from posttrain.tools.calculator import SCHEMA

SOLUTION = ("She eats 3 and bakes 4, so she uses 3 + 4 = <<3+4=7>>7 eggs.\n"
            "She sells 16 - 7 = <<16-7=9>>9 eggs for 9 * 2 = $<<9*2=18>>18.\n#### 18")


def test_each_annotation_becomes_a_call_then_the_calculators_result():
    messages = tool_call_messages("How much does she make?", SOLUTION)
    roles = [m["role"] for m in messages]
    assert roles == ["user", "assistant", "tool", "assistant", "tool", "assistant", "tool", "assistant"]
    calls = [json.loads(m["tool_calls"][0]["function"]["arguments"]) for m in messages if m.get("tool_calls")]
    assert calls == [{"expression": "3+4"}, {"expression": "16-7"}, {"expression": "9*2"}]
    assert [m["content"] for m in messages if m["role"] == "tool"] == ["7", "9", "18"]
    assert messages[1]["content"] == "She eats 3 and bakes 4, so she uses 3 + 4 = "
    assert messages[3]["content"] == "7 eggs.\nShe sells 16 - 7 = "
    assert messages[-1]["content"] == "18.\nThe answer is 18."
    ids = [m["tool_calls"][0]["id"] for m in messages if m.get("tool_calls")]
    assert ids == [m["tool_call_id"] for m in messages if m["role"] == "tool"] and len(set(ids)) == 3
    text = "".join(m["content"] for m in messages if m["role"] == "assistant")  # the solution, annotations out
    assert text.replace("\nThe answer is 18.", "") == re.sub(r"<<[^>]*>>", "", SOLUTION.split("\n####")[0])


def test_rows_the_calculator_disagrees_with_are_dropped_and_counted():
    raw = [{"question": "q1", "answer": SOLUTION},
           {"question": "q2", "answer": "Half of 5 is 5 / 2 = <<5/2=2>>2.\n#### 2"},  # a rounding slip
           {"question": "q3", "answer": "No arithmetic here.\n#### 4"},
           {"question": "q4", "answer": "It is 2 + 2 = <<2+2=4>>4."}]  # no final answer line
    rows, report = tool_call_rows(raw)
    assert [r["messages"][0]["content"] for r in rows] == ["q1"]
    assert report == {"rows": 1, "dropped": {"no_annotation_or_answer": 2, "calculator_disagrees": 1}}
    assert tool_call_messages("q", "It costs 1,200 / 4 = <<1200/4=300>>300.\n#### 300") is not None


def test_rendered_with_tools_the_tool_results_carry_no_loss(tiny_tokenizer):
    messages = tool_call_messages("How much does she make?", SOLUTION)
    template = load_template("tiny")
    out = tokenize_with_assistant_mask(tiny_tokenizer, messages, template=template, tools=[SCHEMA])
    text, ids, mask = out["text"], out["input_ids"], out["assistant_masks"]
    assert '"name": "calculator"' in text.split("<|im_end|>")[0]  # the tool schema in the system turn
    encoded = tiny_tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    trained = "".join(text[s:e] for (s, e), m in zip(encoded, mask) if m)
    untrained = "".join(text[s:e] for (s, e), m in zip(encoded, mask) if not m)
    assert trained.count("<tool_call>") == 3 and '{"expression": "16-7"}' in trained
    for response in re.findall(r"<tool_response>\n(.*?)\n</tool_response>", text):
        assert f"<tool_response>\n{response}\n</tool_response>" in untrained  # every tool result masked
    assert "How much does she make?" in untrained and "The answer is 18." in trained
    assert len(ids) == len(mask)
