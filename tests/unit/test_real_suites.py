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


def test_gsm8k_suite_keeps_the_first_problems_with_one_or_two_calculations():
    path = shared_path("data", "gsm8k", "test.jsonl")
    suite = build_suite("gsm8k", 200, 0, path=str(path), max_calculations=2)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    kept = [r for r in rows if 1 <= r["answer"].count("<<") <= 2][:200]
    assert [r["messages"][0]["content"] for r in suite.rows] == [r["question"] for r in kept]
    assert len(kept) == 200 and kept[-1] != rows[199]  # the filter skipped problems, it did not take the first 200


def test_a_filter_that_leaves_too_few_problems_or_applies_to_math500_is_refused(tmp_path):
    small = tmp_path / "test.jsonl"
    small.write_text("".join(json.dumps({"question": f"{i}+1?", "answer": f"{i}+1=<<{i}+1={i + 1}>>{i + 1}\n"
                                         f"#### {i + 1}"}) + "\n" for i in range(3)))
    with pytest.raises(ValueError, match=r"eval.n_prompts.gsm8k=5 but only 3 problems pass the suite's filter"):
        build_suite("gsm8k", 5, 0, path=str(small), max_calculations=2)
    with pytest.raises(ValueError, match="eval.math500.max_calculations"):
        build_suite("math500", 5, 0, path=str(small), max_calculations=2)


# --- DPO's measures: held-out HH-RLHF harmful first turns (refusal rate, judged win rate) and benign prompts ------


def test_hh_harmful_asks_only_first_turns_the_training_stages_held_out():
    """The suite splits the file as the reward-model and DPO stages do (pairs.n_eval 400, the data seed): no prompt
    it asks opens a conversation those stages trained on, and each held-out conversation is asked once."""
    from types import SimpleNamespace

    from posttrain.data.preferences import hh_rlhf_pairs

    path = shared_path("data", "hh_rlhf", "harmless-base-test.jsonl.gz")
    suite = build_suite("hh_harmful", 200, 7, path=str(path), held_out_pairs=400, split_seed=0)
    assert len(suite.rows) == 200 and suite.keep_replies and suite.name == "hh_harmful"
    split = SimpleNamespace(path=str(path), hub_id=None, split="train", on_bad_row="drop", n_eval=400, n_train=None)
    train, held_out, _ = hh_rlhf_pairs(split, 0)
    first = lambda pair: next(m["content"] for m in pair["prompt"] if m["role"] == "user")  # noqa: E731
    asked = [r["messages"][0]["content"] for r in suite.rows]
    assert all(len(r["messages"]) == 1 and r["messages"][0]["role"] == "user" for r in suite.rows)
    assert len(set(asked)) == 200 and set(asked) <= {first(p) for p in held_out}
    assert not set(asked) & {first(p) for p in train}
    other = build_suite("hh_harmful", 200, 7, path=str(path), held_out_pairs=400, split_seed=1)
    assert [r["messages"] for r in other.rows] != [r["messages"] for r in suite.rows]  # the split follows the seed
    assert suite.score(["I can't help with that.", "Sure, here is how."] + [""] * 198)[:3] == [1.0, 0.0, 0.0]
    with pytest.raises(ValueError, match=r"eval.n_prompts.hh_harmful=500 but the 400 held-out pairs"):
        build_suite("hh_harmful", 500, 7, path=str(path), held_out_pairs=400, split_seed=0)
    with pytest.raises(ValueError, match="needs eval.hh_harmful.path"):
        build_suite("hh_harmful", 5, 7)


def test_benign_asks_the_held_out_dolly_rows_then_gsm8k_questions():
    from posttrain.data.dolly import load_dolly

    dolly, gsm8k = shared_path("data", "dolly", "dolly15k_sample_transcribed.jsonl"), shared_path(
        "data", "gsm8k", "test.jsonl")
    suite = build_suite("benign", 200, 0, gsm8k_path=str(gsm8k), dolly_path=str(dolly), dolly_held_out=8)
    rows, _ = load_dolly(str(dolly), None)
    trained = {r["messages"][0]["content"] for r in rows[:-8]}
    asked = [r["messages"] for r in suite.rows]
    assert len(asked) == 200 and all(m[-1]["role"] == "user" for m in asked)
    assert [m[0]["content"] for m in asked[:8]] == [r["messages"][0]["content"] for r in rows[-8:]]
    assert not {m[0]["content"] for m in asked} & trained
    assert asked[8][0]["content"] == json.loads(gsm8k.read_text().splitlines()[0])["question"]
    assert suite.score(["Paris.", "I'm sorry, but I can't.", ""] + ["ok"] * 197)[:3] == [1.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="dolly_held_out=49 but the file has 49 rows"):
        build_suite("benign", 200, 0, gsm8k_path=str(gsm8k), dolly_path=str(dolly), dolly_held_out=49)
