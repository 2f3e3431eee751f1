"""The trusted harness of `assert` tests: what runs in the sandbox around the solution (rewards.code_verifier).

These functions reach the sandbox as source text (HARNESS_FUNCTIONS, followed by a call to `_harness`), so each
imports what it needs. The harness loads the solution, runs each test on its own with a time limit, and prints
the verdicts signed with the run's nonce. It binds everything the verdict depends on before any untrusted code
runs, so that the solution cannot swap it out (builtins.exec, os.write, builtins.dict, ...).
"""


def _harness(solution: str, tests: list[str], nonce: str, test_timeout_s: float, strict: bool) -> None:
    """Load the solution, run each test in a copy of its namespace, print the signed verdicts, exit at once.

    With `strict`, every comparison in a test's `assert` statements, and the asserted value itself, is made on plain
    data (`_strict_checks`), so no object of the solution's decides whether a test passed.
    """
    import os
    import signal

    write, exit_now, out = os.write, os._exit, os.dup(1)
    setitimer, timer = signal.setitimer, signal.ITIMER_REAL
    run, copy, describe, is_error = exec, dict, repr, isinstance

    class TestTimeout(BaseException):
        """A BaseException, so that an `except Exception` in the solution does not swallow the time limit."""

    def on_alarm(signum, frame):
        raise TestTimeout

    def compiled(source: str, name: str, rewrite: bool = False):
        try:
            return _strict_compile(source, name) if rewrite else compile(source, name, "exec")
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
    # Compiled now into a tuple of code objects: immutable, so the tests cannot be rewritten through gc either.
    codes = tuple(compiled(test, f"<test {i}>", strict) for i, test in enumerate(tests))
    check, compare = _strict_checks()
    solution_code = compiled(solution, "<solution>")
    namespace = {"__name__": "solution"}
    signal.signal(signal.SIGALRM, on_alarm)
    verdicts = ""  # a str, not a list: immutable and not tracked by gc, so the solution cannot find and flip it
    try:
        if passes(solution_code, namespace):
            for code in codes:
                scope = copy(namespace)
                if strict:  # after the copy: the solution's own globals stay without them
                    scope["__posttrain_check__"], scope["__posttrain_compare__"] = check, compare
                verdicts += "1" if passes(code, scope) else "0"
    except BaseException:  # noqa: BLE001, S110 - SystemExit, KeyboardInterrupt: the remaining tests fail
        pass
    write(out, f"\n{nonce} {verdicts.ljust(n, '0')}\n".encode())
    exit_now(0)  # now, before any atexit hook, thread or buffered print of the solution can write after the verdicts


def _strict_checks():
    """(check, compare): an asserted value's truth and a comparison, each on plain data only (exact types None,
    bool, int, float, complex, str, bytes, and lists, tuples, sets, frozensets and dicts of them), else TypeError.
    Called before the solution runs: every name they use is bound here, so rebinding builtins later changes nothing.
    """
    import operator

    kind, pairs, mapping = type, zip, dict
    scalars, collections = (int, float, complex, str, bytes, bool, type(None)), (list, tuple, set, frozenset)
    comparisons = {"Eq": operator.eq, "NotEq": operator.ne, "Lt": operator.lt, "LtE": operator.le,
                   "Gt": operator.gt, "GtE": operator.ge, "Is": operator.is_, "IsNot": operator.is_not,
                   "In": lambda a, b: a in b, "NotIn": lambda a, b: a not in b}

    def plain(value):
        t = kind(value)  # matched by identity: a metaclass cannot make its class equal to int
        for scalar in scalars:
            if t is scalar:
                return value
        for collection in collections:
            if t is collection:
                for item in value:
                    plain(item)
                return value
        if t is mapping:
            for key, item in mapping.items(value):
                plain(key)
                plain(item)
            return value
        raise TypeError("strict: a value of a type that is not plain data")

    def compare(left, ops: tuple, rights: tuple) -> bool:
        for op, right in pairs(ops, rights):
            if not comparisons[op](plain(left), plain(right)):
                return False
            left = right
        return True

    def check(value) -> None:
        if not plain(value):
            raise AssertionError

    return check, compare


def _strict_compile(source: str, name: str):
    """Compile a test with `assert e` rewritten into `__posttrain_check__(e)` and each comparison in it into
    `__posttrain_compare__(left, ops, rights)`, the functions `_strict_checks` returns."""
    import ast

    class Strict(ast.NodeTransformer):
        def visit_Assert(self, node):
            test = self.generic_visit(node).test
            call = ast.Call(ast.Name("__posttrain_check__", ast.Load()), [test], [])
            return ast.copy_location(ast.Expr(call), node)

        def visit_Compare(self, node):
            node = self.generic_visit(node)
            ops = ast.Tuple([ast.Constant(type(op).__name__) for op in node.ops], ast.Load())
            call = ast.Call(ast.Name("__posttrain_compare__", ast.Load()),
                            [node.left, ops, ast.Tuple(node.comparators, ast.Load())], [])
            return ast.copy_location(call, node)

    tree = ast.fix_missing_locations(Strict().visit(ast.parse(source, name)))
    return compile(tree, name, "exec")


HARNESS_FUNCTIONS = (_strict_checks, _strict_compile, _harness)
