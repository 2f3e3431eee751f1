"""Rewards: answer extraction and normalisation, the math verifier on real GSM8K / MATH-500 rows, group advantages."""

from __future__ import annotations

import json
import random

import pytest

from rewards import REWARDS
from rewards.advantages import equal_reward_fraction, group_advantages
from rewards.verifiers import extract_answer, math_verifier, parse_number, think_format
from tests.conftest import shared_path


@pytest.mark.parametrize(
    "completion, expected",
    [
        ("<think>\n17 times 24 = 388\n</think>\n\nThe answer is 408.", "408"),
        ("Step one.\n#### 1,234", "1,234"),
        (r"We get \boxed{\frac{a}{b}} at last", r"\frac{a}{b}"),
        (r"\boxed{\left( 3, \frac{\pi}{2} \right)}", r"\left( 3, \frac{\pi}{2} \right)"),
        ("It costs $12.50 in total.", "$12.50"),
        ("no number here", None),
    ],
)
def test_extract_answer(completion, expected):
    assert extract_answer(completion) == expected


@pytest.mark.parametrize(
    "text, value",
    [("1,234", 1234), ("-7", -7), ("+7", 7), ("0.25", 0.25), ("3/4", 0.75), (r"\frac{3}{4}", 0.75),
     (r"\dfrac{-1}{2}", -0.5), ("50%", 0.5), ("$18.00", 18), ("18.", 18), ("x+1", None), ("1/0", None)],
)
def test_parse_number(text, value):
    parsed = parse_number(text)
    assert (parsed is None) if value is None else (float(parsed) == value)


@pytest.mark.parametrize(
    "completion, gold, score",
    [
        ("The answer is 408.", "408", 1.0),
        ("The answer is 388.", "408", 0.0),
        ("#### 1,000", "1000", 1.0),
        (r"\boxed{\dfrac{14}{3}}", r"\frac{14}{3}", 1.0),
        (r"\boxed{(3, \frac{\pi}{2})}", r"\left( 3, \frac{\pi}{2} \right)", 1.0),
        (r"\boxed{p - q}", "q - p", 0.0),
        ("<think>\nthe answer is 5\n</think>\n\nNo idea.", "5", 0.0),  # only the text after </think> counts
    ],
)
def test_math_verifier_table(completion, gold, score):
    assert math_verifier([completion], answer=[gold]) == [score]


def test_rewards_are_registered_by_name():
    assert REWARDS["math_verifier"] is math_verifier and REWARDS["think_format"] is think_format
    assert math_verifier(["1"], answer=[None]) == [None]


def test_every_gsm8k_test_solution_verifies_and_a_wrong_number_does_not():
    path = shared_path("data", "gsm8k", "test.jsonl")
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(rows) == 1319
    solutions = [r["answer"] for r in rows]
    assert math_verifier(solutions, answer=solutions) == [1.0] * len(rows)
    wrong = [f"The answer is {parse_number(extract_answer(s)) + 1}." for s in solutions]
    assert math_verifier(wrong, answer=solutions) == [0.0] * len(rows)


def math500_agreement(name):
    pairs = json.loads(shared_path("data", "math500", name).read_text())
    verified = math_verifier([p["prediction"] for p in pairs], answer=[p["answer"] for p in pairs])
    literal = [float((extract_answer(p["prediction"]) or "").replace(" ", "") == p["answer"].replace(" ", ""))
               for p in pairs]
    shuffled_gold = [p["answer"] for p in pairs]
    random.Random(0).shuffle(shuffled_gold)
    mismatched = math_verifier([p["prediction"] for p in pairs], answer=shuffled_gold)
    return len(pairs), sum(verified) / len(pairs), sum(literal) / len(pairs), sum(mismatched) / len(pairs)


@pytest.mark.parametrize("name", ["math500_qwen3_answers.json", "math500_gpt_answers.json"])
def test_math500_agreement_table(name):
    n, verified, literal, mismatched = math500_agreement(name)
    print(f"\n{name}: n={n} verifier-equal={verified:.3f} string-equal={literal:.3f} shuffled-gold={mismatched:.3f}")
    assert n == 500
    assert verified >= literal  # equivalence checking never accepts fewer than exact string equality
    assert mismatched < 0.1  # and it is not accepting everything


def test_math500_gold_solutions_verify_against_their_answers():
    rows = json.loads(shared_path("data", "math500", "math500_test.json").read_text())
    scores = math_verifier([r["solution"] for r in rows], answer=[r["answer"] for r in rows])
    failures = [r["unique_id"] for r, s in zip(rows, scores) if s != 1.0]
    print(f"\nMATH-500 gold solutions verified: {500 - len(failures)}/500; not: {failures[:10]}")
    assert len(failures) <= 10


@pytest.mark.parametrize(
    "completion, score",
    [("<think>\nsteps\n</think>\n\nThe answer is 4.", 1.0), ("The answer is 4.", 0.0),
     ("<think>a</think>", 0.0), ("<think>a</think><think>b</think> 4", 0.0), ("<think>a</think> 4 </think>", 0.0)],
)
def test_think_format(completion, score):
    assert think_format([completion]) == [score]


@pytest.mark.parametrize(
    "rewards, size, scale, expected",
    [
        ([1, 0, 1, 0], 4, "none", [0.5, -0.5, 0.5, -0.5]),
        # the std is Bessel-corrected over the group (TRL's nanstd): 4 rewards 1, 0, 1, 0 have std sqrt(1/3)
        ([1, 0, 1, 0], 4, "group", [0.5 / (0.57735 + 1e-4), -0.5 / (0.57735 + 1e-4)] * 2),
        ([1, 1, 1, 1], 4, "group", [0.0, 0.0, 0.0, 0.0]),  # an all-equal group teaches nothing, and never divides by 0
        ([1, 0, 0, 0, 2, 2], 2, "none", [0.5, -0.5, 0.0, 0.0, 0.0, 0.0]),
        ([1, 0, 3, 3], 2, "batch", [0.5 / (1.5 + 1e-4), -0.5 / (1.5 + 1e-4), 0.0, 0.0]),
        # unscorable completions (None) are out of the mean and the std, and get 0
        ([1, None, 0, 0], 4, "none", [2 / 3, 0.0, -1 / 3, -1 / 3]),
        ([1, None, None, None], 4, "group", [0.0, 0.0, 0.0, 0.0]),  # one scored reward: no std, no signal
        ([None, None, 1, 0], 2, "group", [0.0, 0.0, 0.5 / (0.70711 + 1e-4), -0.5 / (0.70711 + 1e-4)]),
    ],
)
def test_group_advantages(rewards, size, scale, expected):
    assert group_advantages(rewards, size, scale=scale) == pytest.approx(expected, abs=1e-3)


def test_group_advantages_rejects_bad_shapes():
    with pytest.raises(ValueError, match="groups of 3"):
        group_advantages([1, 0, 1, 0], 3)
    with pytest.raises(ValueError, match="scale"):
        group_advantages([1, 0], 2, scale="std")
    assert equal_reward_fraction([1, 1, 0, 1], 2) == 0.5
