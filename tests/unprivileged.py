"""Run a command as a fresh, unprivileged user, the way most GPU clusters run a trainer.

Used by tests that must hold for an ordinary user as well as for root (CI runs as root). The command runs under
`setpriv` with a uid that owns nothing on the host, no supplementary groups and no capabilities, in a private mount
namespace. Where a directory on the way to the interpreter, the virtual environment or the checkout cannot be
traversed by other users (CI's interpreter sits under a 0700 /root), that namespace covers the directory with an
empty tmpfs holding only the entries on those paths, bound from the host: the fresh user reaches what it needs to
run Python and nothing else of the directory. Nothing on the host changes.
"""

from __future__ import annotations

import os
import shlex
import shutil
import stat
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

FRESH_UID = 54_321  # no account on the host: owns no file, shares no group


def missing_tools() -> list[str]:
    """What this host lacks to run a command as a fresh user (root, and util-linux's unshare and setpriv)."""
    missing = [tool for tool in ("unshare", "setpriv", "mount") if shutil.which(tool) is None]
    if os.geteuid() != 0:
        missing.append("root (to switch to a fresh user)")
    return missing


def blocked_directories(paths: list[str]) -> dict[str, set[str]]:
    """Directories on the way to `paths` that other users cannot traverse, each with the entries the paths need."""
    blocked: dict[str, set[str]] = defaultdict(set)
    for path in paths:
        parts = Path(os.path.realpath(path)).parts
        for depth in range(1, len(parts)):
            directory = os.path.join(*parts[:depth])
            if not os.stat(directory).st_mode & stat.S_IXOTH:
                blocked[directory].add(parts[depth])
        whole = os.path.realpath(path)
        if os.path.isdir(whole) and not os.stat(whole).st_mode & stat.S_IXOTH:
            # A needed directory that is itself closed (a checkout made by `mktemp -d` is 0700) is needed whole:
            # covering it with only the entries on other paths would hide the rest of it (its tests, say).
            blocked[whole].update(os.listdir(whole))
    return blocked  # covered outermost first (a parent's path sorts first), so nested ones are reached in turn


def run_as_fresh_user(argv: list[str], *, cwd: str, needs: list[str], timeout_s: float,
                      env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run `argv` in `cwd` as FRESH_UID, with HOME and TMPDIR in a directory of its own; returns what it printed."""
    home = tempfile.mkdtemp(prefix="posttrain-fresh-user-")
    os.chown(home, FRESH_UID, FRESH_UID)
    lines = ["set -eu", 'keep="$(mktemp -d)"']
    for n, (directory, entries) in enumerate(sorted(blocked_directories([*needs, cwd]).items())):
        for m, entry in enumerate(sorted(entries)):
            source = os.path.join(directory, entry)
            kind = "-d" if os.path.isdir(source) else "-f"
            lines += [f'mkdir "$keep/{n}-{m}"' if kind == "-d" else f'touch "$keep/{n}-{m}"',
                      f'mount --bind {shlex.quote(source)} "$keep/{n}-{m}"']
        lines.append(f"mount -t tmpfs -o mode=755 tmpfs {shlex.quote(directory)}")
        for m, entry in enumerate(sorted(entries)):
            target = shlex.quote(os.path.join(directory, entry))
            make = f"mkdir {target}" if os.path.isdir(os.path.join(directory, entry)) else f"touch {target}"
            lines += [make, f'mount --bind "$keep/{n}-{m}" {target}']
    user = ["setpriv", f"--reuid={FRESH_UID}", f"--regid={FRESH_UID}", "--clear-groups", "--inh-caps=-all"]
    lines.append(f"cd {shlex.quote(cwd)}")
    lines.append("exec " + shlex.join([*user, *argv]))
    environment = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": home, "TMPDIR": home,
                   "USER": "posttrain-fresh-user", "LANG": "C.UTF-8", **(env or {})}
    try:
        return subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", "\n".join(lines)],
                              env=environment, capture_output=True, text=True, timeout=timeout_s)
    finally:
        shutil.rmtree(home, ignore_errors=True)


def python_paths() -> list[str]:
    """What running this interpreter needs: the executable, its base interpreter and standard library."""
    return [sys.executable, getattr(sys, "_base_executable", sys.executable), os.path.dirname(os.__file__), sys.prefix]
