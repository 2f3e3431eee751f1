"""Code verifications per second through the sandboxed code verifier, so a GRPO step's scoring cost is known.

Each verification is one completion scored against its row's tests, exactly as GRPO calls `code_verifier`. Measured
in one run, side by side, at 1 and 2 workers (sandboxes at once):

  * trivial    a correct two-line function, two `assert` tests: one sandbox per verification;
  * io         the same through three stdin/stdout tests: three sandboxes per verification;
  * looping    a function that never returns: each of its two tests is stopped at test_timeout_s (0.5 s);
  * hung       a solution that ignores every signal: the whole run is killed at timeout_s (1 s).

Asserts nothing; prints the CPU, the sandbox's layers on this host, and a table (and JSON with --json).

    .venv/bin/python scripts/bench_sandbox.py [--seconds 10] [--json runs/bench_sandbox.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

from rewards.code_verifier import code_verifier
from rewards.sandbox import missing_protections, run_sandboxed

ADD = "def add(a, b):\n    return a + b\n"
PROGRAM = "a, b = map(int, input().split())\nprint(a + b)\n"
LOOP = "def add(a, b):\n    while True:\n        pass\n"
HUNG = ("import signal\nfor s in (signal.SIGALRM, signal.SIGTERM, signal.SIGINT):\n    signal.signal(s, signal.SIG_IGN)\n"
        "while True:\n    try:\n        while True:\n            pass\n    except BaseException:\n        pass\n")
ASSERTS = ["assert add(1, 2) == 3", "assert add(2, 3) == 5"]
PAIRS = [{"input": "1 2\n", "output": "3\n"}, {"input": "2 3\n", "output": "5\n"}, {"input": "0 0\n", "output": "0\n"}]
CASES = {  # name -> (code, tests, expected score, verifier options)
    "trivial": (ADD, ASSERTS, 1.0, {}),
    "io": (PROGRAM, PAIRS, 1.0, {}),
    "looping": (LOOP, ASSERTS, 0.0, {"test_timeout_s": 0.5, "timeout_s": 3.0}),
    "hung": (HUNG, ASSERTS, 0.0, {"test_timeout_s": 0.5, "timeout_s": 1.0}),
}


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def rate(case: str, workers: int, seconds: float) -> dict:
    """Verifications per second for `case`, batches of `workers` rows at a time, for at least `seconds`."""
    code, tests, expected, options = CASES[case]
    completion = f"```python\n{code}```"
    done, start = 0, time.monotonic()
    while time.monotonic() - start < seconds:
        scores = code_verifier([completion] * workers, tests=[tests] * workers, max_workers=workers, **options)
        if scores != [expected] * workers:
            raise SystemExit(f"{case}: scored {scores}, expected {expected}: the benchmark measures nothing")
        done += workers
    elapsed = time.monotonic() - start
    return {"case": case, "workers": workers, "verifications": done, "seconds": round(elapsed, 2),
            "per_second": round(done / elapsed, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=10.0, help="time per case and worker count")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    layers = run_sandboxed("pass").isolation
    print(f"cpu: {cpu_name()}, {os.cpu_count()} cores; running as uid {os.geteuid()}")
    print(f"sandbox layers: {', '.join(layers)}")
    if missing := missing_protections(layers):
        print(f"missing on this host: {'; '.join(missing)}")
    rows = [rate(case, workers, args.seconds) for case in CASES for workers in (1, 2)]
    print(f"\n{'case':<10} {'workers':>7} {'verifications/s':>17} {'n':>5}")
    for row in rows:
        print(f"{row['case']:<10} {row['workers']:>7} {row['per_second']:>17.2f} {row['verifications']:>5}")
    if args.json:
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"cpu": cpu_name(), "cores": os.cpu_count(), "uid": os.geteuid(), "layers": list(layers),
                       "results": rows}, f, indent=2)


if __name__ == "__main__":
    main()
