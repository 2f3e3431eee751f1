"""The code verifier's stdin/stdout tests (judged in the trainer's process, on bytes) and its strict mode for
`assert` tests (comparisons on plain data only): a solution that makes its values lie scores 0 on both."""

from __future__ import annotations

import sys
import textwrap
from types import SimpleNamespace

import pytest
from datasets import Dataset

from posttrain.stages.grpo import build_rewards
from rewards import REWARDS
from rewards.code_verifier import code_verifier, code_verifier_strict, outputs_match
from tests.unit.sandbox_support import FAST, reply

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the sandbox runs on Linux")

SUM = "a, b = map(int, input().split())\nprint(a + b)\n"
PAIRS = [{"input": "1 2\n", "output": "3\n"}, {"input": "10 -4\n", "output": "6"}, {"input": "0 0", "output": "0\n"}]
LIAR = textwrap.dedent("""
    class Any(int):
        def __eq__(self, other):
            return True
        __ne__ = lambda self, other: False
        __hash__ = int.__hash__
        def __str__(self):
            return "anything"
    def add(a, b):
        return Any(0)
    if __name__ == "__main__":
        print(add(0, 0))
    """)


def test_io_tests_score_the_fraction_of_outputs_that_match():
    wrong = "a, b = map(int, input().split())\nprint(a - b)\n"
    scores = code_verifier([reply(SUM), reply(wrong), reply("print(input())"), "no code"], tests=[PAIRS] * 4, **FAST)
    assert scores == [1.0, pytest.approx(1 / 3), 0.0, 0.0]  # 0 - 0 == 0 + 0: one of three by luck


def test_io_tests_as_a_grpo_reward_by_name_from_a_dataset_column():
    rows = Dataset.from_list([{"prompt": "add", "tests": PAIRS}, {"prompt": "add", "tests": PAIRS}])
    cfg = SimpleNamespace(grpo=SimpleNamespace(rewards={"code_verifier": 1.0}, reward_model=None))
    function, weight = build_rewards(cfg, SimpleNamespace(inputs={}))["code_verifier"]
    completions = [[{"role": "assistant", "content": reply(SUM)}], [{"role": "assistant", "content": reply(LIAR)}]]
    assert function(completions, tests=rows["tests"], **FAST) == [1.0, 0.0] and weight == 1.0


def test_apps_style_rows_and_mixed_rows():
    apps = {"inputs": ["1 2\n", "3 4\n"], "outputs": ["3\n", "7\n"]}
    program = "def add(a, b):\n    return a + b\nif __name__ == '__main__':\n    print(add(*map(int, input().split())))\n"
    mixed = ["assert add(1, 2) == 3", "assert add(1, 1) == 3", {"input": "2 5", "output": "7"}]
    assert code_verifier([reply(program)] * 2, tests=[apps, mixed], **FAST) == [1.0, pytest.approx(2 / 3)]


def test_a_solution_whose_values_lie_scores_zero_on_io_tests():
    tests = [{"input": "0 0\n", "output": "0\n"}]
    # Whatever it patches in its own interpreter, what it printed is compared here, as bytes.
    patcher = LIAR + "import builtins\nbuiltins.bytes = builtins.str = type(add(0, 0))\n"
    assert code_verifier([reply(LIAR), reply(patcher)], tests=[tests, tests], **FAST) == [0.0, 0.0]


def test_the_expected_output_never_enters_the_sandbox():
    token = "expected-output-4f1c9e"
    search = textwrap.dedent("""
        import os, re
        found = set()
        for path in ["/proc/self/cmdline", "/proc/self/environ", "/dev/stdin", *os.listdir(".")]:
            try:
                found |= set(re.findall(rb"expected-output-[0-9a-f]+", open(path, "rb").read()))
            except OSError:
                pass
        print(*(token.decode() for token in found))
        """)
    assert code_verifier([reply(search)], tests=[[{"input": "", "output": token}]], **FAST) == [0.0]


def test_io_failures_score_zero():
    tests = [{"input": "1 2\n", "output": "3\n"}]
    crashes = SUM + "raise SystemExit(1)\n"
    loops = "while True:\n    pass\n"
    floods = "print('3\\n' * 10**6)\n"
    assert code_verifier([reply(crashes), reply(loops), reply(floods)], tests=[tests] * 3, **FAST) == [0.0] * 3


def test_outputs_match_whitespace_and_float_tolerance():
    assert outputs_match(b"3 4\r\n5\n", b"3 4\n5")
    assert not outputs_match(b"3 4 5 6", b"3 4 5")
    assert not outputs_match(b"3.0", b"3")  # exact unless a tolerance is asked for
    assert outputs_match(b"3.0 x", b"3 x", float_tolerance=1e-9)
    assert not outputs_match(b"3.1", b"3", float_tolerance=1e-3) and not outputs_match(b"nan", b"3", float_tolerance=1)
    program = "print(1 / 3)\n"
    tests = [{"input": "", "output": "0.333333"}]
    assert code_verifier([reply(program)], tests=[tests], **FAST) == [0.0]
    assert code_verifier([reply(program)], tests=[tests], float_tolerance=1e-6, **FAST) == [1.0]


def test_malformed_tests_name_the_row_and_item():
    with pytest.raises(TypeError, match="row 1, item 0"):
        code_verifier([reply(SUM)] * 2, tests=[PAIRS, [{"input": "1 2"}]])
    with pytest.raises(ValueError, match="row 0: a dict needs"):
        code_verifier([reply(SUM)], tests=[{"inputs": ["1"], "outputs": []}])
    with pytest.raises(ValueError, match="testtype 'functional'"):
        code_verifier([reply(SUM)], tests=[[{"input": "", "output": "", "testtype": "functional"}]])


# Strict mode for assert tests


def test_strict_mode_rejects_values_that_lie_about_equality():
    tests = ["assert add(1, 2) == 3", "assert [add(1, 2)] == [3]", "assert add(1, 2) in {3}", "assert add(1, 2)"]
    assert code_verifier([reply(LIAR)], tests=[tests[:2]], **FAST) == [1.0]  # the limit of plain assert tests
    assert code_verifier_strict([reply(LIAR)], tests=[tests], **FAST) == [0.0]
    assert REWARDS["code_verifier_strict"] is code_verifier_strict


def test_strict_mode_cannot_be_undone_by_rebinding_builtins():
    hack = LIAR + "import builtins\nbuiltins.dict = builtins.int = builtins.list = type(add(0, 0))\n"
    hack += "builtins.any = builtins.all = builtins.isinstance = lambda *a: True\n"
    assert code_verifier_strict([reply(hack)], tests=[["assert add(1, 2) == 3"]], **FAST) == [0.0]


def test_strict_mode_passes_honest_solutions_on_plain_data():
    code = textwrap.dedent("""
        def solve(n):
            if n < 0:
                return None
            return {"n": n, "squares": [i * i for i in range(n)], "pair": (n, n / 2), "set": {n}, "ok": n > 1}
        """)
    tests = [
        "assert solve(3) == {'n': 3, 'squares': [0, 1, 4], 'pair': (3, 1.5), 'set': {3}, 'ok': True}",
        "assert solve(-1) is None",
        "assert solve(2)['ok'] and not solve(1)['ok']",
        "assert 0 < solve(3)['n'] < 4 != 5",
        "assert 4 in solve(3)['squares'] and 9 not in solve(3)['squares']",
        "x = solve(2)\nassert x['pair'] == (2, 1.0), 'message is kept out'",
        "assert solve(3) == {'n': 4}",  # a wrong expectation still fails
    ]
    assert code_verifier_strict([reply(code)], tests=[tests], **FAST) == [pytest.approx(6 / 7)]
    assert code_verifier([reply(code)], tests=[tests], **FAST) == [pytest.approx(6 / 7)]
