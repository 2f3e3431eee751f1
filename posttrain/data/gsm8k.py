"""GSM8K worked solutions as SFT conversations: the train split's question as the user turn, its reference solution
as the assistant's reply.

The reference solutions carry the calculator annotations the GSM8K authors used to check the arithmetic
(`48/2 = <<48/2=24>>24`): they are stripped, since a model that learns them writes them into its answers. The last
line, `#### 24`, becomes "The answer is 24.", a sentence the math verifier reads like the marker.

SFT takes the *last* `n` problems of the split that pass the `max_calculations` filter, so that GRPO's prompts (the
first `grpo.prompts.n` that pass the same filter) are problems SFT has not seen. The test split is never read here:
it is the eval suite's.
"""

from __future__ import annotations

import re
from pathlib import Path

from posttrain.artifacts import sha256_json
from posttrain.data.dolly import DataError, read_rows


def calculations(solution: str) -> int:
    """The <<expression=result>> annotations of a GSM8K reference solution: one per arithmetic step.

    >>> calculations("She has 3+4=<<3+4=7>>7 apples, 7*2=<<7*2=14>>14 in all.\\n#### 14")
    2
    """
    return solution.count("<<")


_ANNOTATION = re.compile(r"<<[^<>]*>>")
FINAL = "####"


def solution_reply(solution: str) -> str:
    """A reference solution as the assistant's reply: annotations out, the '#### n' line as a sentence.

    >>> solution_reply("She sells 16 - 3 = <<16-3=13>>13 eggs.\\n#### 13")
    'She sells 16 - 3 = 13 eggs.\\nThe answer is 13.'
    """
    body, marker, final = solution.rpartition(FINAL)
    if not marker or not final.strip():
        raise ValueError("the solution has no '#### <answer>' last line")
    return f"{_ANNOTATION.sub('', body).rstrip()}\nThe answer is {final.strip()}."


def solution_rows(gsm8k_cfg) -> tuple[list[dict], list[dict], dict]:
    """(conversation rows, the raw rows they came from, the dataset record) for `data.gsm8k`.

    Each conversation row has `messages` and `source: "gsm8k"`; the raw rows (question, answer) are what the
    start-up data check reads against the GSM8K card.
    """
    if gsm8k_cfg.path:
        source, raw = str(gsm8k_cfg.path), read_rows(Path(gsm8k_cfg.path))
    else:
        from datasets import load_dataset

        source, raw = "openai/gsm8k:train", list(load_dataset("openai/gsm8k", "main", split="train"))
    limit = gsm8k_cfg.max_calculations
    picked = []
    for i, row in enumerate(raw, start=1):
        for name in ("question", "answer"):
            if not isinstance(row, dict) or not isinstance(row.get(name), str) or not row[name].strip():
                raise DataError(f"{source}: row {i}: field '{name}' is missing or not a non-empty string")
        if limit is None or 1 <= calculations(row["answer"]) <= limit:
            picked.append((i, row))
    if len(picked) < gsm8k_cfg.n:
        raise DataError(f"{source}: data.gsm8k.n={gsm8k_cfg.n} but only {len(picked)} problems have 1 to {limit} "
                        f"calculations")
    picked = picked[len(picked) - gsm8k_cfg.n :]
    rows = []
    for i, row in picked:
        try:
            reply = solution_reply(row["answer"])
        except ValueError as err:
            raise DataError(f"{source}: row {i}: field 'answer': {err}") from None
        rows.append({"messages": [{"role": "user", "content": row["question"]},
                                  {"role": "assistant", "content": reply}], "source": "gsm8k"})
    record = {"id": f"{source} (the last {len(rows)} problems with 1 to {limit} calculations)"
              if limit is not None else f"{source} (the last {len(rows)} problems)",
              "card": "data_cards/gsm8k.md", "rows": len(rows), "first_row": picked[0][0] if picked else None,
              "content_sha256": sha256_json([r["messages"] for r in rows])}
    return rows, [row for _, row in picked], record
