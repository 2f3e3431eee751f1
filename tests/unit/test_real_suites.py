"""The real-data eval suites (gsm8k, math500) read the shared test files and score by the math verifier."""

from __future__ import annotations

import json

import pytest

from posttrain.evaluation.suites import build_suite
from tests.conftest import shared_path


def test_gsm8k_suite_scores_reference_solutions_right_and_shifted_answers_wrong():
    path = shared_path("data", "gsm8k", "test.jsonl")
    suite = build_suite("gsm8k", 40, 0, path=str(path))
    assert len(suite.rows) == 40 and suite.rows[0]["messages"][0]["role"] == "user"
    gold = [json.loads(line)["answer"] for line in path.read_text().splitlines()[:40]]
    finals = [g.rsplit("####", 1)[1].strip().replace(",", "") for g in gold]
    assert suite.score([f"The answer is {f}." for f in finals]) == [1.0] * 40
    assert suite.score([f"The answer is {int(f) + 1}." for f in finals]) == [0.0] * 40


def test_math500_suite_accepts_equivalent_latex():
    path = shared_path("data", "math500", "math500_test.json")
    suite = build_suite("math500", 500, 0, path=str(path), samples=2)
    assert len(suite.rows) == 500 and suite.samples == 2 and suite.max_new_tokens == 512
    rows = json.loads(path.read_text())
    scores = suite.score([r["solution"] for r in rows])  # each reference solution ends in its \boxed answer
    assert sum(s == 1.0 for s in scores) / len(scores) > 0.95


def test_a_math_suite_row_without_an_answer_is_named(tmp_path):
    bad = tmp_path / "test.jsonl"
    bad.write_text(json.dumps({"question": "1+1?", "answer": "#### 2"}) + "\n" + json.dumps({"question": "2+2?"}) + "\n")
    with pytest.raises(ValueError, match=r"test.jsonl: row 2: fields 'question' and 'answer'"):
        build_suite("gsm8k", 5, 0, path=str(bad))
