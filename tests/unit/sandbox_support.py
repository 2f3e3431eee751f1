"""What the sandbox tests share: hostile-code helpers, the host a hostile program might reach for, and the checks
that it left the host as it was (no process, file, connection, signal or secret left behind or let out).

Test modules import the fixtures they use by name from here.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import signal
import socket
import sys
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from rewards.sandbox import SandboxResult, run_sandboxed

verifier_module = importlib.import_module("rewards.code_verifier")  # `rewards.code_verifier` is also the function

MARKER = f"posttrain-sandbox-test-{uuid.uuid4().hex}"  # in the argv of every process a hostile test tries to leave
SLACK_S = 3.0  # interpreter startup and teardown, on a loaded machine
FAST = {"timeout_s": 3.0, "test_timeout_s": 1.0, "memory_mb": 256}
CORRECT = "def add(a, b):\n    return a + b\n"
WRONG = "def add(a, b):\n    return a - b\n"
TESTS = ["assert add(1, 2) == 3", "assert add(2, 3) == 5"]


def reply(code: str) -> str:
    return f"<think>\nWrite add.\n</think>\n\nHere it is:\n```python\n{code}\n```\n"


def live_processes(match) -> list[str]:
    """Live (non-zombie) processes, other than this one, for which match(cmdline, environ) holds."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        if int(pid) == os.getpid():
            continue
        try:
            stat = Path(f"/proc/{pid}/stat").read_bytes()
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if stat[stat.rindex(b")") + 2 :][:1] in (b"Z", b"X"):
            continue
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            environ = []
        if match(cmdline, environ):
            found.append(pid)
    return found


def marker_processes() -> list[str]:
    return live_processes(lambda cmdline, environ: MARKER.encode() in cmdline)


def run_processes(result: SandboxResult) -> list[str]:
    """Processes of one sandbox run: each inherits HOME=<its working directory> (readable to root, as in CI)."""
    home = f"HOME={result.workdir}".encode()
    return live_processes(lambda cmdline, environ: home in environ or MARKER.encode() in cmdline)


def assert_cleaned_up(result: SandboxResult) -> None:
    leftovers = run_processes(result)
    for pid in leftovers:  # never leave one behind, even when the test fails
        with contextlib.suppress(OSError):
            os.kill(int(pid), signal.SIGKILL)
    assert not leftovers, "a process of the sandbox run outlived it"
    assert not os.path.lexists(result.workdir) and not os.path.lexists(os.path.dirname(result.workdir))


@pytest.fixture(autouse=True)
def no_stray_processes():
    yield
    strays = marker_processes()
    for pid in strays:  # never leave one behind, even when the test fails
        with contextlib.suppress(OSError):
            os.kill(int(pid), signal.SIGKILL)
    assert not strays, f"processes outlived their sandbox: {strays}"


@pytest.fixture
def runs(monkeypatch) -> list[SandboxResult]:
    """The SandboxResult of every run code_verifier makes."""
    results: list[SandboxResult] = []

    def spy(*args, **kwargs):
        results.append(run_sandboxed(*args, **kwargs))
        return results[-1]

    monkeypatch.setattr(verifier_module, "run_sandboxed", spy)
    return results


@dataclass
class Host:
    """What hostile code might reach for, and the checks that it did not get it."""

    tmp: Path
    tcp: socket.socket
    udp: socket.socket
    unix: socket.socket
    unix_path: Path
    sentinel: Path
    keep: Path
    outside: Path
    in_tmp: Path
    secret: str
    secret_file: Path
    layers: set[str]
    signals: list = field(default_factory=list)

    @property
    def port(self) -> int:
        return self.tcp.getsockname()[1]

    @property
    def udp_port(self) -> int:
        return self.udp.getsockname()[1]

    def assert_untouched(self, results: list[SandboxResult]) -> None:
        for listener in (self.tcp, self.unix):
            with pytest.raises(BlockingIOError):
                listener.accept()
        with pytest.raises(BlockingIOError):
            self.udp.recvfrom(100)
        assert self.sentinel.read_text() == "keep me"
        assert (self.keep / "file.txt").read_text() == "keep me too" and (self.keep.stat().st_mode & 0o777) == 0o755
        assert not self.outside.exists() and not self.in_tmp.exists()
        assert self.signals == []
        for result in results:
            assert self.secret not in result.stdout + result.stderr


@pytest.fixture(scope="session")
def layers() -> set[str]:
    """The isolation layers this host provides."""
    return set(run_sandboxed("pass").isolation)


@pytest.fixture
def host(tmp_path, monkeypatch, layers):
    secret = f"secret-{uuid.uuid4().hex}"
    monkeypatch.setenv("POSTTRAIN_SANDBOX_SECRET", secret)
    tcp = socket.create_server(("127.0.0.1", 0))
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.bind(("127.0.0.1", 0))
    unix_path = tmp_path / "host.sock"
    unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    unix.bind(str(unix_path))
    unix.listen()
    for s in (tcp, udp, unix):
        s.setblocking(False)
    sentinel = tmp_path / "sentinel.txt"
    sentinel.write_text("keep me")
    keep = tmp_path / "keep"
    keep.mkdir(mode=0o755)
    keep.chmod(0o755)
    (keep / "file.txt").write_text("keep me too")
    signals: list = []
    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: signals.append(signum))
    in_tmp = Path("/tmp") / f"{MARKER}-pwned.txt"
    secret_file = tmp_path / "token"  # where a W&B key or a hub token sits: its owner's alone (root's, in CI)
    secret_file.write_text(secret)
    secret_file.chmod(0o600)
    yield Host(
        tmp=tmp_path, tcp=tcp, udp=udp, unix=unix, unix_path=unix_path, sentinel=sentinel, keep=keep,
        outside=tmp_path / "pwned.txt", in_tmp=in_tmp, secret=secret, secret_file=secret_file, layers=layers, signals=signals,
    )
    signal.signal(signal.SIGUSR1, previous)
    for s in (tcp, udp, unix):
        s.close()
    with contextlib.suppress(FileNotFoundError):
        in_tmp.unlink()
