"""GSM8K worked solutions as calculator conversations: each `<<expression=value>>` annotation becomes an assistant
tool call to the calculator, then a `tool` turn holding what the calculator returns, then the reply going on.

    She sells 16 - 3 = <<16-3=13>>13 eggs.   ->   assistant: "She sells 16 - 3 = " + calculator("16-3")
                                                  tool: "13"
                                                  assistant: "13 eggs. ... The answer is 13."

The tool turn holds the calculator's own result, never the annotation's, so a solution whose annotation the
calculator disagrees with (GSM8K has rounding slips and typos) would teach the model to ignore its tool: those
rows are dropped and counted, not repaired. Messages are OpenAI's format, which every chat template with tool
support renders; the assistant-only loss then leaves the tool turns out, as it does user turns.
"""

from __future__ import annotations

import json
import re

from posttrain.tools.calculator import NAME, call

ANNOTATION = re.compile(r"<<([^<>=]+)=([^<>]*)>>")
FINAL = "####"


def same_number(result: str, annotated: str) -> bool:
    try:
        return abs(float(result) - float(annotated.replace(",", "").strip())) <= 1e-6 * max(1.0, abs(float(result)))
    except ValueError:
        return False


def tool_call_messages(question: str, solution: str, call_prefix: str = "call") -> list[dict] | None:
    """The conversation for one GSM8K row with the calculator, or None when an annotation's value is not what the
    calculator returns for its expression (or the solution has no annotation or no '#### <answer>' line)."""
    body, marker, final = solution.rpartition(FINAL)
    if not marker or not final.strip():
        return None
    body = body.rstrip()
    messages = [{"role": "user", "content": question}]
    pos = 0
    for k, match in enumerate(ANNOTATION.finditer(body)):
        expression, annotated = match.group(1).strip(), match.group(2)
        result = call({"expression": expression})
        if not same_number(result, annotated):
            return None
        call_id = f"{call_prefix}_{k}"
        messages.append({"role": "assistant", "content": body[pos:match.start()],
                         "tool_calls": [{"id": call_id, "type": "function", "function": {
                             "name": NAME, "arguments": json.dumps({"expression": expression})}}]})
        messages.append({"role": "tool", "tool_call_id": call_id, "content": result})
        pos = match.end()
    if len(messages) == 1:
        return None
    messages.append({"role": "assistant", "content": f"{body[pos:]}\nThe answer is {final.strip()}."})
    return messages


def tool_call_rows(raw: list[dict]) -> tuple[list[dict], dict]:
    """(conversation rows {messages, source: "gsm8k_tools"}, a report of what was dropped and why) for GSM8K rows
    with `question` and `answer`."""
    rows, dropped = [], {"no_annotation_or_answer": 0, "calculator_disagrees": 0}
    for i, r in enumerate(raw):
        messages = tool_call_messages(r["question"], r["answer"], call_prefix=f"call_{i}")
        if messages is None:
            _, marker, final = r["answer"].rpartition(FINAL)
            well_formed = ANNOTATION.search(r["answer"]) and marker and final.strip()
            dropped["calculator_disagrees" if well_formed else "no_annotation_or_answer"] += 1
            continue
        rows.append({"messages": messages, "source": "gsm8k_tools"})
    return rows, {"rows": len(rows), "dropped": dropped}
