"""`make test`: the suite in two tiers, the fast one first, each against a stated time budget.

    python scripts/run_tests.py                 both tiers on 2 workers; exit non-zero when a tier fails
    python scripts/run_tests.py --strict        also fail a tier that ran past its budget
    python scripts/run_tests.py --tier fast     one tier (fast | slow); extra arguments go to pytest

- fast: the unit tests and the doctests of `rewards` (pure logic, seconds each). A broken unit fails here, before
  anything trains.
- slow: integration and end-to-end tests (a stage, a launcher, a server, the tiny pipeline, SmolLM2). Tests that
  read one trained run share it (a module or session fixture; tests/conftest.py keeps such files on one worker).

Each tier runs under pytest-xdist on two workers with one torch thread each: most tests use one core (a training
subprocess on one thread, a server waiting on a client), so one pytest process leaves the second core idle, while
two threads per worker on two cores would spin against each other. Each tier prints its slowest tests; the summary
prints each tier's wall time beside its budget. The budget is reported, not asserted, unless --strict: timings on
shared machines vary up to twofold, and a run that lands over budget on a slow machine is not a broken one.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# (name, pytest targets, budget in seconds) in the order they run; the budgets add up to make test's 15 minutes.
# Measured on 2026-12-03 (2-core Intel Xeon with AVX-512, llama.cpp built, nothing else running): fast 149 s, slow
# 708 s.
TIERS = (
    ("fast", ["--doctest-modules", "rewards", "tests/unit"], 180),
    ("slow", ["tests/integration", "tests/e2e"], 720),
)
WORKERS = 2


def run_tier(name: str, targets: list[str], extra: list[str]) -> tuple[int, float]:
    command = [sys.executable, "-m", "pytest", "-q", "-ra", "--durations=15", "-n", str(WORKERS),
               "--dist", "loadgroup", *targets, *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    print(f"== tier {name}: {' '.join(command[3:])}", flush=True)
    started = time.monotonic()
    code = subprocess.call(command, cwd=REPO, env=env)
    return code, time.monotonic() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tier", choices=[name for name, _, _ in TIERS], help="run one tier only")
    parser.add_argument("--strict", action="store_true", help="fail a tier that ran past its budget")
    args, extra = parser.parse_known_args()
    results = []
    for name, targets, budget in TIERS:
        if args.tier and name != args.tier:
            continue
        code, seconds = run_tier(name, targets, extra)
        results.append((name, code, seconds, budget))
        if code != 0:
            break  # a failing fast tier stops here: nothing trains on top of a broken unit
    print("\ntier     result   wall s   budget s")
    for name, code, seconds, budget in results:
        verdict = "passed" if code == 0 else f"exit {code}"
        over = "   OVER BUDGET" if seconds > budget else ""
        print(f"{name:<8} {verdict:<8} {seconds:6.0f}   {budget:6d}{over}")
    total = sum(seconds for _, _, seconds, _ in results)
    print(f"total    {'':<8} {total:6.0f}   {sum(b for _, _, _, b in results):6d}")
    failed = next((code for _, code, _, _ in results if code != 0), 0)
    if failed:
        return failed
    if args.strict and any(seconds > budget for _, _, seconds, budget in results):
        print("a tier ran past its budget (--strict)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
