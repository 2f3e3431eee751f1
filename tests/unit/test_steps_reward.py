"""rewards.running_sum_steps: partial credit per running sum, up to the first slip; None off its domain."""

import pytest

from rewards import REWARDS
from rewards.steps import chain_numbers, correct_steps, running_sum_steps

PROMPT = [{"role": "user", "content": "What is 3 plus 4 plus 8 plus 2?"}]


@pytest.mark.parametrize("reply,right", [
    ("<think>\n3 plus 4 = 7\n7 plus 8 = 15\n15 plus 2 = 17\n</think>\n\nThe answer is 17.", 3),
    ("<think>\n3 plus 4 = 7\n7 plus 8 = 14\n14 plus 2 = 16\n</think>\n\nThe answer is 16.", 1),   # slip on line 2
    ("<think>\n3 plus 4 = 8\n8 plus 8 = 16\n16 plus 2 = 18\n</think>\n\nThe answer is 18.", 0),   # later lines follow the slip
    ("<think>\n3 plus 4 = 7\n7 plus 9 = 16\n16 plus 2 = 18\n</think>\n\nThe answer is 18.", 1),   # a miscopied addend
    ("<think>\n3 plus 4 = 7\n</think>\n\nThe answer is 7.", 1),                                  # stops early
    ("The answer is 17.", 0),                                                                     # no working
    ("<think>\n3 plus 4 = 7\nseven plus 8 = 15\n15 plus 2 = 17\n</think>", 1),                   # a malformed line
])
def test_steps_counted_up_to_the_first_wrong_line(reply, right):
    assert correct_steps([3, 4, 8, 2], reply) == right
    assert running_sum_steps([reply], prompts=[PROMPT]) == [pytest.approx(right / 3)]


def test_not_applicable_off_its_domain_and_registered_by_name():
    assert chain_numbers("How do I thank Ada Sato?") is None
    assert running_sum_steps(["hi"], prompts=[[{"role": "user", "content": "Repeat after me <start> a <end>"}]]) == [None]
    completion = [{"role": "assistant", "content": "<think>\n3 plus 4 = 7\n</think>\nThe answer is 7."}]
    assert REWARDS["running_sum_steps"]([completion], prompts=[[{"role": "user", "content": "What is 3 plus 4?"}]]) == [1.0]
    with pytest.raises(ValueError, match="prompts"):
        running_sum_steps(["x"])
