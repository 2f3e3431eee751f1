"""Run the posttrain CLI in a subprocess, as a user would."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def cli_env(**extra) -> dict:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    env.update(extra)
    return env


def posttrain(*args: str, timeout: float = 900, **env) -> subprocess.CompletedProcess:
    """`python -m posttrain ARGS` from the repository root; output captured."""
    return subprocess.run(
        [sys.executable, "-m", "posttrain", *args], cwd=REPO, env=cli_env(**env), capture_output=True, text=True,
        timeout=timeout,
    )


def popen(*args: str, log: Path, **env) -> subprocess.Popen:
    """Start `python -m posttrain ARGS` in its own process group (so a test can SIGKILL all of it)."""
    return subprocess.Popen(
        [sys.executable, "-m", "posttrain", *args], cwd=REPO, env=cli_env(**env), stdout=open(log, "w"),
        stderr=subprocess.STDOUT, start_new_session=True,
    )
