"""Code verification: run the completion's Python against the row's tests in a sandbox, reward the fraction passed.

A row's tests are `assert` snippets, stdin/stdout pairs, or both:

* **stdin/stdout pairs** (the format of APPS, CodeContests and LiveCodeBench: `{"input": ..., "output": ...}` items,
  or APPS' `{"inputs": [...], "outputs": [...]}`) are judged outside the untrusted process. The sandbox runs the
  program, as `__main__`, once per input; the trainer's process compares what it printed with the expected output,
  as bytes, token by token (whitespace-normalised; numbers within `float_tolerance` when one is given). The
  expected output never enters the sandbox and no object the solution builds takes part in the comparison.
* **`assert` snippets** run in one sandbox with a small trusted harness: the harness loads the solution (with
  `__name__ == "solution"`, so an `if __name__ == "__main__":` block that reads input does not run), runs every
  test separately with a time limit, so that one failing test does not stop the others, and reports the verdicts
  on the last line of stdout, prefixed with a random nonce the parent chose for this run. The solution never sees
  the nonce on any channel it could simply read (argv, environment, files, stdin), so printing "all passed",
  exiting early (sys.exit, os._exit), patching builtins or os.write after the harness bound them, or flipping
  verdicts found through gc, all score 0 for what was not really passed.

The limit that remains for `assert` tests: the harness shares the solution's interpreter, so values are compared
by the solution's own objects. An object whose `__eq__` always returns True passes `assert f(x) == y`. `strict=True`
(the `code_verifier_strict` reward) closes that: every comparison in an `assert` is made on plain data (None, bool,
int, float, complex, str, bytes, and lists, tuples, dicts, sets and frozensets of them, exact types only), which
the trusted harness checks before comparing; any other value fails the test. Neither mode stops an adversary that
reaches into the harness's frames or memory from inside the interpreter; the sandbox bounds what such code can do.
"""

from __future__ import annotations

import functools
import inspect
import logging
import math
import os
import re
import secrets
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from rewards.code_harness import HARNESS_FUNCTIONS
from rewards.sandbox import missing_protections, run_sandboxed
from rewards.text import completion_text, final_answer_text

_FENCE = re.compile(r"```[ \t]*([\w+.-]*)[^\n]*\n(.*?)(?:```|\Z)", re.DOTALL)
_PYTHON_TAGS = {"", "python", "python3", "py"}


def extract_code(completion: str) -> str | None:
    """The code a reply gives: its last ```python (or bare ```) block after any think block, else the whole answer.

    None when there is nothing but whitespace.

    >>> extract_code("<think>```python\\nx = 0\\n```</think>Try:\\n```python\\nx = 1\\n```\\nor\\n```py\\nx = 2\\n```")
    'x = 2\\n'
    >>> extract_code("def f():\\n    return 1")
    'def f():\\n    return 1'
    """
    text = final_answer_text(completion)
    blocks = [code for tag, code in _FENCE.findall(text) if tag.lower() in _PYTHON_TAGS]
    code = blocks[-1] if blocks else text
    return code if code.strip() else None


def code_verifier(
    completions,
    tests,
    *,
    timeout_s: float = 10.0,
    test_timeout_s: float = 3.0,
    memory_mb: int = 1024,
    max_workers: int | None = None,
    strict: bool = False,
    float_tolerance: float | None = None,
    **kwargs,
) -> list[float | None]:
    """The fraction of the row's tests the completion's code passes; None when a row has no tests.

    `tests` holds, per row, a list of tests or None. A test is a Python snippet (usually an `assert` statement) or
    a `{"input": str, "output": str}` pair; a row may also be APPS' `{"inputs": [...], "outputs": [...]}`. A
    completion scores 0.0 when it has no code, does not compile, or is stopped by the sandbox (time, memory,
    output). `timeout_s` bounds a whole row, `test_timeout_s` each test (and the solution's own top level);
    `max_workers` rows run at once. `strict` compares `assert` values as plain data only; `float_tolerance` lets
    numbers in printed output differ by that much (relative or absolute).

    >>> reply = "```python\\ndef add(a, b):\\n    return a + b\\n```"
    >>> tests = [["assert add(1, 2) == 3", "assert add(2, 2) == 5"], None, ["assert add(1, 1) == 2"]]
    >>> code_verifier([reply, reply, "no code"], tests=tests)
    [0.5, None, 0.0]
    >>> program = "```python\\na, b = map(int, input().split())\\nprint(a + b)\\n```"
    >>> code_verifier([program], tests=[[{"input": "1 2\\n", "output": "3\\n"}, {"input": "2 2", "output": "5"}]])
    [0.5]
    """
    rows = list(zip(map(completion_text, completions), tests, strict=True))

    def score(index: int) -> float | None:
        completion, row_tests = rows[index]
        if row_tests is None:
            return None
        snippets, pairs = _split_tests(row_tests, index)
        if not snippets and not pairs:
            return None
        code = extract_code(completion)
        if code is None:
            return 0.0
        deadline = time.monotonic() + timeout_s
        passed = 0.0
        if snippets:
            passed += _run_asserts(code, snippets, deadline, test_timeout_s, memory_mb, strict)
        for given, expected in pairs:
            passed += _run_io(code, given, expected, deadline, test_timeout_s, memory_mb, float_tolerance)
        return passed / (len(snippets) + len(pairs))

    workers = max_workers or min(8, os.cpu_count() or 1)
    if workers == 1 or len(rows) <= 1:
        return [score(i) for i in range(len(rows))]
    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(score, range(len(rows))))


def code_verifier_strict(completions, tests, **kwargs) -> list[float | None]:
    """`code_verifier` with `strict=True`: `assert` tests compare plain data only, so no `__eq__` of the
    solution's can make a wrong value pass.

    >>> liar = "```python\\nclass Any:\\n    def __eq__(self, other):\\n        return True\\ndef add(a, b):\\n    return Any()\\n```"
    >>> code_verifier([liar], tests=[["assert add(1, 2) == 3"]]), code_verifier_strict([liar], tests=[["assert add(1, 2) == 3"]])
    ([1.0], [0.0])
    """
    return code_verifier(completions, tests, **{**kwargs, "strict": True})


def outputs_match(actual: bytes, expected: bytes, float_tolerance: float | None = None) -> bool:
    """Whether a program's output matches the expected one, token by token (any run of whitespace, line breaks
    included, separates tokens); with `float_tolerance`, numeric tokens may differ by that much, relative or absolute.

    >>> outputs_match(b"1 2\\n3  \\n\\n", b"1 2\\n3")
    True
    >>> outputs_match(b"0.3333333", b"0.333333333", float_tolerance=1e-6), outputs_match(b"0.3333333", b"0.333333333")
    (True, False)
    """
    got, want = actual.split(), expected.split()
    if len(got) != len(want):
        return False
    for a, b in zip(got, want):
        if a == b:
            continue
        if float_tolerance is None:
            return False
        try:
            if not math.isclose(float(a), float(b), rel_tol=float_tolerance, abs_tol=float_tolerance):
                return False
        except ValueError:
            return False
    return True


def _split_tests(row_tests, row: int) -> tuple[list[str], list[tuple[bytes, bytes]]]:
    """A row's tests as (assert snippets, (stdin, expected stdout) pairs); a clear error naming the row otherwise."""
    if isinstance(row_tests, dict):  # APPS: {"inputs": [...], "outputs": [...]}
        inputs, outputs = row_tests.get("inputs"), row_tests.get("outputs")
        if not isinstance(inputs, list) or not isinstance(outputs, list) or len(inputs) != len(outputs):
            raise ValueError(f"tests of row {row}: a dict needs 'inputs' and 'outputs' lists of the same length")
        row_tests = [{"input": i, "output": o} for i, o in zip(inputs, outputs)]
    if isinstance(row_tests, str) or not isinstance(row_tests, (list, tuple)):
        # A bare string would run as one block; a JSON-encoded list would then "pass" as a mere expression.
        raise TypeError(f"tests of row {row} must be a list of tests, got {type(row_tests).__name__}")
    snippets, pairs = [], []
    for i, test in enumerate(row_tests):
        if isinstance(test, str):
            snippets.append(test)
        elif isinstance(test, dict) and isinstance(test.get("input"), str) and isinstance(test.get("output"), str):
            if test.get("testtype", "stdin") != "stdin":
                raise ValueError(f"tests of row {row}, item {i}: testtype {test['testtype']!r} is not supported")
            pairs.append((test["input"].encode(), test["output"].encode()))
        else:
            raise TypeError(f"tests of row {row}, item {i}: expected a snippet or an input/output pair of strings, "
                            f"got {test!r:.80}")
    return snippets, pairs


def _run_asserts(code: str, tests: list[str], deadline: float, test_timeout_s: float, memory_mb: int,
                 strict: bool) -> int:
    """Run `code` and `tests` in one sandbox; the number of tests the nonce-signed report says passed."""
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        return 0
    nonce = secrets.token_hex(16)
    program = f"{_harness_source()}\n_harness({code!r}, {tests!r}, {nonce!r}, {test_timeout_s!r}, {strict!r})\n"
    result = run_sandboxed(program, timeout_s=remaining, memory_mb=memory_mb)
    _say_once(result.isolation)
    last_line = result.stdout.rstrip("\n").rpartition("\n")[2]
    verdicts = last_line.removeprefix(f"{nonce} ")
    if result.returncode != 0 or result.killed or verdicts == last_line:
        return 0
    if len(verdicts) != len(tests) or set(verdicts) - {"0", "1"}:
        return 0
    return verdicts.count("1")


def _run_io(code: str, given: bytes, expected: bytes, deadline: float, test_timeout_s: float, memory_mb: int,
            float_tolerance: float | None) -> int:
    """Run `code` as a program on `given`; 1 when it exits cleanly having printed `expected`, judged here."""
    remaining = min(test_timeout_s, deadline - time.monotonic())
    if remaining <= 0:
        return 0
    result = run_sandboxed(code, stdin=given, timeout_s=remaining, memory_mb=memory_mb,
                           max_output_bytes=max(64 << 10, 2 * len(expected) + 4096))
    _say_once(result.isolation)
    if result.returncode != 0 or result.killed:
        return 0
    return int(outputs_match(result.stdout_bytes, expected, float_tolerance))


_announced: set[tuple[str, ...]] = set()
_announce_lock = threading.Lock()


def _say_once(isolation: tuple[str, ...]) -> None:
    """Log, once per process and set of layers, which kernel protections the sandbox lacks on this host."""
    with _announce_lock:
        if isolation in _announced:
            return
        _announced.add(isolation)
    if missing := missing_protections(isolation):
        logging.getLogger("posttrain").warning(
            "code sandbox: this host does not provide %s; running model-written code with: %s",
            "; ".join(missing), ", ".join(isolation) or "nothing but the parent's timeout",
        )


@functools.cache
def _harness_source() -> str:
    return "\n\n".join(inspect.getsource(function) for function in HARNESS_FUNCTIONS)
