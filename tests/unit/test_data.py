"""Tiny-world generators and the Dolly adapter's row validation."""

from __future__ import annotations

import json

import pytest

from posttrain.data.dolly import DataError, load_dolly
from posttrain.data.tiny_world import make_arith, plain_text, sft_rows, take_split, make_echo
from tests.conftest import shared_path


def test_generators_are_deterministic():
    counts = {"echo": 20, "arith": 10, "qa": 10}
    assert sft_rows("train", counts, 3) == sft_rows("train", counts, 3)
    assert sft_rows("train", counts, 3) != sft_rows("train", counts, 4)


@pytest.mark.parametrize("family", ["echo", "arith", "qa"])
def test_held_out_prompts_never_appear_in_training(family):
    train = sft_rows("train", {family: 600}, 0)
    test = sft_rows("test", {family: 150}, 0)
    user = lambda rows: {r["messages"][0]["content"] for r in rows}  # noqa: E731
    assert not user(train) & user(test)
    if family == "echo":
        assert not {r["message"] for r in train} & {r["message"] for r in test}


def test_echo_rows_answer_with_the_message():
    for row in take_split(make_echo, 50, "train", 0, "echo"):
        assert f"<start> {row['message']} <end>" in row["messages"][0]["content"]
        assert row["messages"][1]["content"] == row["message"]


@pytest.mark.parametrize("slip_rate", [0.0, 0.3])
def test_arithmetic_steps_are_right_unless_they_slip(slip_rate):
    rows = take_split(make_arith(slip_rate), 400, "train", 0, "arith")
    slipped = sum(r["slipped"] for r in rows)
    for r in rows:
        shown = int(r["messages"][1]["content"].split()[-1].rstrip("."))
        assert (shown != int(r["answer"])) == r["slipped"]
        assert r["messages"][1]["reasoning_content"].endswith(f"= {shown}")
        numbers = [int(n) for n in r["messages"][0]["content"].removeprefix("What is ").rstrip("?").split(" plus ")]
        lines = [line.replace(" plus ", " ").replace(" = ", " ").split() for line in
                 r["messages"][1]["reasoning_content"].splitlines()]
        assert [int(b) for _, b, _ in lines] == numbers[1:]  # each line adds the next number of the question
        wrong_lines = sum(int(a) + int(b) != int(c) for a, b, c in lines)
        assert wrong_lines == int(r["slipped"])  # a slip is one wrong running sum, carried to the end
    assert slipped == 0 if slip_rate == 0 else 0.2 < slipped / len(rows) < 0.4


def test_miscopied_answers_follow_right_sums_and_leave_other_prompts_alone():
    rows = take_split(make_arith(0.0, miscopy_rate=0.4), 400, "train", 0, "arith")
    for r in rows:
        shown = int(r["messages"][1]["content"].split()[-1].rstrip("."))
        last = int(r["messages"][1]["reasoning_content"].split()[-1])
        assert last == int(r["answer"])  # every running sum is right
        assert shown - last in ((-1, 1) if r["slipped"] else (0,))  # the answer copies it, or misses by one
    assert 0.3 < sum(r["slipped"] for r in rows) / len(rows) < 0.5
    # without miscopies no extra random draw is made: the held-out and GRPO prompts stay the same rows
    assert take_split(make_arith(0.0, 0.0), 50, "test", 0, "arith") == take_split(make_arith(0.0), 50, "test", 0, "arith")


def test_plain_text_has_no_chat_tokens_or_instructions():
    text = " ".join(plain_text(500, 0))
    for marker in ("<|im_start|>", "<think>", "<start>", "Return the following"):
        assert marker not in text


def write_jsonl(path, rows):
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")


GOOD = {"instruction": "Say hi", "context": "", "response": "hi", "category": "open_qa"}


@pytest.mark.parametrize(
    "bad, field, why",
    [
        ({k: v for k, v in GOOD.items() if k != "response"}, "response", "missing"),
        (dict(GOOD, context=3), "context", "must be a string, got int"),
        (dict(GOOD, category=None), "category", "missing"),
    ],
)
def test_bad_dolly_row_names_file_row_and_field(tmp_path, bad, field, why):
    path = tmp_path / "dolly.jsonl"
    write_jsonl(path, [GOOD, GOOD, bad, GOOD])
    with pytest.raises(DataError) as err:
        load_dolly(str(path), None)
    assert str(path) in str(err.value) and "row 3" in str(err.value)
    assert f"'{field}'" in str(err.value) and why in str(err.value)


def test_invalid_json_line_is_named(tmp_path):
    path = tmp_path / "dolly.jsonl"
    path.write_text(json.dumps(GOOD) + "\n{not json\n")
    with pytest.raises(DataError, match=r"dolly\.jsonl: row 2: not valid JSON"):
        load_dolly(str(path), None)


def test_shared_dolly_rows_load_as_conversations():
    path = shared_path("data", "dolly", "dolly15k_sample_transcribed.jsonl")
    rows, source = load_dolly(str(path), None)
    assert len(rows) == 49 and source == str(path)
    with_context = [r for r in rows if r["context"]]
    assert with_context and all(r["context"] in r["messages"][0]["content"] for r in with_context)
    assert all(r["messages"][1]["content"] == r["response"] for r in rows)
