"""Run tests that call native kernels in a child Python, so that a crash fails one test instead of the whole run.

torch's packed CPU kernels, the own C++ kernels and bitsandbytes' CPU library differ per CPU (AVX2, AVX-512,
AMX...): a kernel that reads out of bounds on one CPU kind dies by SIGSEGV and would take pytest down with it. Here
the child dies instead, and the test fails with "native crash (signal N ...) on CPU <model name> flags <...>" plus
the child's last output (faulthandler prints the Python stack at the crash).

    @isolated                      # the test body runs in a fresh interpreter; arguments (parameters and fixture
    def test_x(fmt, tmp_path): ...  # values) must pickle; a skip or failure in the child is reported as such

    run_code("import torch; ...")   # a snippet, same reporting
"""

from __future__ import annotations

import functools
import os
import pickle
import platform
import signal
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SKIP_RC = 77  # the child's exit status for "the test skipped itself"; its reason is the last stdout line
OUTPUT_TAIL = 4000  # characters of the child's output quoted in a failure
SIMD_FLAG_PARTS = ("sse4", "avx", "fma", "f16c", "amx", "vnni", "bf16", "fp16", "neon", "sve", "asimd")

_CHILD = """
import importlib, pickle, sys, traceback
import pytest
module, name = sys.argv[1], sys.argv[2]
kwargs = pickle.loads(sys.stdin.buffer.read())
test = getattr(importlib.import_module(module), name).__wrapped__
try:
    test(**kwargs)
except pytest.skip.Exception as exc:
    print(exc.msg, flush=True)
    sys.exit(SKIP_RC)
except BaseException:
    traceback.print_exc()
    sys.exit(1)
""".replace("SKIP_RC", str(SKIP_RC))


def cpu_description() -> str:
    """'<model name> flags <SIMD flags>' from /proc/cpuinfo (Linux), plus torch's kernel dispatch level."""
    model, flags = None, None
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = (part.strip() for part in line.partition(":"))
                if key == "model name" and model is None:
                    model = value
                elif key in ("flags", "Features") and flags is None:
                    flags = [flag for flag in value.split() if any(part in flag for part in SIMD_FLAG_PARTS)]
    except OSError:
        pass
    text = f"{model or platform.processor() or platform.machine()} flags {' '.join(flags or []) or '(unknown)'}"
    if "torch" in sys.modules:
        text += f" (torch CPU capability {sys.modules['torch'].backends.cpu.get_cpu_capability()})"
    return text


def _run(argv: list[str], stdin: bytes, what: str, timeout: float) -> None:
    """Run `python argv` from the repository root; turn a signal, a skip or a non-zero exit into the test's outcome."""
    env = dict(os.environ, PYTHONFAULTHANDLER="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    try:
        proc = subprocess.run([sys.executable, *argv], input=stdin, capture_output=True, cwd=REPO, env=env,
                              timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{what}: child process still running after {timeout:.0f} s on CPU {cpu_description()}\n"
                    f"{_tail(exc.stdout, exc.stderr)}", pytrace=False)
    if proc.returncode < 0:
        number = -proc.returncode
        name = signal.Signals(number).name if number in signal.Signals._value2member_map_ else "?"
        pytest.fail(f"native crash (signal {number} {name}) in {what} on CPU {cpu_description()}\n"
                    f"{_tail(proc.stdout, proc.stderr)}", pytrace=False)
    if proc.returncode == SKIP_RC:
        lines = proc.stdout.decode(errors="replace").strip().splitlines()
        pytest.skip(lines[-1] if lines else "skipped in the child process")
    if proc.returncode:
        pytest.fail(f"{what} failed in its child process (exit status {proc.returncode}):\n"
                    f"{_tail(proc.stdout, proc.stderr)}", pytrace=False)


def _tail(stdout: bytes | None, stderr: bytes | None) -> str:
    out = (stdout or b"").decode(errors="replace") + (stderr or b"").decode(errors="replace")
    return f"--- child output (last {OUTPUT_TAIL} characters) ---\n{out[-OUTPUT_TAIL:]}"


def run_code(code: str, timeout: float = 600) -> None:
    """Run a Python snippet in a child process (cwd and PYTHONPATH: the repository root); see the module doc."""
    _run(["-c", code], b"", "code snippet", timeout)


def isolated(test=None, *, timeout: float = 600):
    """Decorator: run the test function in a child process, called with the same (picklable) keyword arguments.

    pytest sees the wrapper's signature (that of the test), so parameters and fixtures work as usual; the child
    imports the test's module and calls the undecorated function.
    """
    if test is None:
        return functools.partial(isolated, timeout=timeout)

    @functools.wraps(test)
    def wrapper(**kwargs):
        _run(["-c", _CHILD, test.__module__, test.__qualname__], pickle.dumps(kwargs),
             f"{test.__module__}.{test.__qualname__}", timeout)

    return wrapper
