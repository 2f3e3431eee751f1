"""Code verification: run the completion's Python against the row's tests in a sandbox, reward the fraction passed.

Each completion runs once, in its own sandbox (rewards.sandbox), together with a small trusted harness: the harness
loads the solution, runs every test (an `assert ...` statement or a small block) separately with a time limit, so
that one failing test does not stop the others, and reports the verdicts on the last line of stdout, prefixed with
a random nonce the parent chose for this run. The solution never sees the nonce on any channel it could simply
read (argv, environment, files, stdin), so printing "all passed", exiting early (sys.exit, os._exit), patching
builtins or os.write after the harness bound them, or flipping verdicts found through gc, all score 0 for what was
not really passed. The harness shares the solution's interpreter, so this stops printing, exiting and patching,
not an adversary that reads the nonce out of the interpreter's frames or memory. Nor does it stop hacks within the
rules of Python: an object whose `__eq__` always returns True passes `assert f(x) == y`.

Solutions run with the standard library only, and with `__name__ == "solution"`, so an `if __name__ == "__main__":`
block that reads input does not run.
"""

from __future__ import annotations

import functools
import inspect
import os
import re
import secrets
from concurrent.futures import ThreadPoolExecutor

from rewards.sandbox import run_sandboxed
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
    **kwargs,
) -> list[float | None]:
    """The fraction of the row's tests the completion's code passes; None when a row has no tests.

    `tests` holds, per row, a list of Python snippets (usually `assert` statements) or None. A completion scores 0.0
    when it has no code, does not compile, or is stopped by the sandbox (time, memory, output). `timeout_s` bounds
    a whole run, `test_timeout_s` each test (and the solution's own top level); `max_workers` sandboxes run at once.

    >>> reply = "```python\\ndef add(a, b):\\n    return a + b\\n```"
    >>> tests = [["assert add(1, 2) == 3", "assert add(2, 2) == 5"], None, ["assert add(1, 1) == 2"]]
    >>> code_verifier([reply, reply, "no code"], tests=tests)
    [0.5, None, 0.0]
    """
    rows = list(zip(map(completion_text, completions), tests, strict=True))

    def score(row: tuple[str, list[str] | None]) -> float | None:
        completion, row_tests = row
        if row_tests is None:
            return None
        if isinstance(row_tests, str) or not all(isinstance(t, str) for t in row_tests):
            # A bare string would run as one block; a JSON-encoded list would then "pass" as a mere expression.
            raise TypeError(f"tests must be a list of strings per row, got {type(row_tests).__name__}")
        if not row_tests:
            return None
        code = extract_code(completion)
        return 0.0 if code is None else _run_tests(code, list(row_tests), timeout_s, test_timeout_s, memory_mb)

    workers = max_workers or min(8, os.cpu_count() or 1)
    if workers == 1 or len(rows) <= 1:
        return [score(row) for row in rows]
    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(score, rows))


def _run_tests(code: str, tests: list[str], timeout_s: float, test_timeout_s: float, memory_mb: int) -> float:
    """Run `code` and `tests` in one sandbox; the fraction of tests the nonce-signed report says passed."""
    nonce = secrets.token_hex(16)
    program = f"{_harness_source()}\n_harness({code!r}, {tests!r}, {nonce!r}, {test_timeout_s!r})\n"
    result = run_sandboxed(program, timeout_s=timeout_s, memory_mb=memory_mb)
    last_line = result.stdout.rstrip("\n").rpartition("\n")[2]
    verdicts = last_line.removeprefix(f"{nonce} ")
    if result.returncode != 0 or result.killed or verdicts == last_line:
        return 0.0
    if len(verdicts) != len(tests) or set(verdicts) - {"0", "1"}:
        return 0.0
    return verdicts.count("1") / len(tests)


@functools.cache
def _harness_source() -> str:
    return inspect.getsource(_harness)


def _harness(solution: str, tests: list[str], nonce: str, test_timeout_s: float) -> None:
    """Runs inside the sandbox (shipped as source): load the solution, run each test, print the signed verdicts."""
    import os
    import signal

    # Everything the verdict depends on is bound here, before any untrusted code runs, so that the solution cannot
    # swap it out (builtins.exec, os.write, ...). Tests are compiled now into a tuple of code objects: immutable, so
    # they cannot be rewritten through gc either.
    write, exit_now, out = os.write, os._exit, os.dup(1)
    setitimer, timer = signal.setitimer, signal.ITIMER_REAL
    run, copy, describe, is_error = exec, dict, repr, isinstance

    class TestTimeout(BaseException):
        """A BaseException, so that an `except Exception` in the solution does not swallow the time limit."""

    def on_alarm(signum, frame):
        raise TestTimeout

    def compiled(source: str, name: str):
        try:
            return compile(source, name, "exec")
        except (SyntaxError, ValueError) as error:
            return error

    def passes(code, scope: dict) -> bool:
        error = code
        if not is_error(code, Exception):
            setitimer(timer, test_timeout_s)
            try:
                run(code, scope)
                return True
            except failures as raised:
                error = raised
            finally:
                setitimer(timer, 0)
        write(2, f"{describe(error)[:200]}\n".encode(errors="replace"))  # why it failed, for whoever debugs rewards
        return False

    failures = (Exception, TestTimeout)
    n = len(tests)
    codes = tuple(compiled(test, f"<test {i}>") for i, test in enumerate(tests))
    solution_code = compiled(solution, "<solution>")
    namespace = {"__name__": "solution"}
    signal.signal(signal.SIGALRM, on_alarm)
    verdicts = ""  # a str, not a list: immutable and not tracked by gc, so the solution cannot find and flip it
    try:
        if passes(solution_code, namespace):
            for code in codes:
                verdicts += "1" if passes(code, copy(namespace)) else "0"
    except BaseException:  # noqa: BLE001, S110 - SystemExit, KeyboardInterrupt: the remaining tests fail
        pass
    write(out, f"\n{nonce} {verdicts.ljust(n, '0')}\n".encode())
    exit_now(0)  # now, before any atexit hook, thread or buffered print of the solution can write after the verdicts
