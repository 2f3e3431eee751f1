"""The sandboxed code verifier: scoring, the sandbox's limits, and a hostile suite that must score 0.0, stop within
its limits, and leave the host as it was (no process, file, connection, signal or secret left behind or let out)."""

from __future__ import annotations

import contextlib
import importlib
import os
import signal
import socket
import sys
import textwrap
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from rewards import REWARDS
from rewards.code_verifier import code_verifier, extract_code
from rewards.sandbox import SandboxResult, run_sandboxed

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the sandbox's host checks read Linux /proc")

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
    yield Host(
        tmp=tmp_path, tcp=tcp, udp=udp, unix=unix, unix_path=unix_path, sentinel=sentinel, keep=keep,
        outside=tmp_path / "pwned.txt", in_tmp=in_tmp, secret=secret, layers=layers, signals=signals,
    )
    signal.signal(signal.SIGUSR1, previous)
    for s in (tcp, udp, unix):
        s.close()
    with contextlib.suppress(FileNotFoundError):
        in_tmp.unlink()


# Scoring


def test_registered_and_scores_correct_code_one():
    assert REWARDS["code_verifier"] is code_verifier
    assert code_verifier([reply(CORRECT)], tests=[TESTS]) == [1.0]


def test_partially_correct_code_scores_the_fraction_passed():
    code = "def is_even(n):\n    return n % 2 == 0 or n == 3\n"
    tests = ["assert is_even(2)", "assert not is_even(3)", "assert not is_even(5)"]
    assert code_verifier([reply(code)], tests=[tests]) == [pytest.approx(2 / 3)]


def test_each_test_runs_on_its_own():
    tests = ["assert add(1, 2) == 3", "raise RuntimeError('boom')", "assert (", "while True: pass", "x = 1", "assert x"]
    start = time.monotonic()
    # `x` from one test does not leak into the next; the looping test is stopped after test_timeout_s alone.
    assert code_verifier([reply(CORRECT)], tests=[tests], **FAST) == [pytest.approx(2 / 6)]
    assert time.monotonic() - start < FAST["test_timeout_s"] + SLACK_S


@pytest.mark.parametrize(
    "completion",
    [
        "I do not know.",
        "",
        "   \n",
        reply("def add(a, b):\n    return a +"),
        "```python\n\n```",
        "<think>```python\n" + CORRECT + "```</think>",
    ],
    ids=["prose", "empty", "blank", "syntax-error", "empty-block", "code-only-in-think"],
)
def test_no_code_or_broken_code_scores_zero(completion):
    assert code_verifier([completion], tests=[TESTS]) == [0.0]


def test_rows_without_tests_are_not_applicable():
    assert code_verifier([reply(CORRECT), reply(CORRECT), reply(CORRECT)], tests=[None, [], TESTS]) == [None, None, 1.0]
    with pytest.raises(TypeError):
        code_verifier([reply(CORRECT)], tests=['["assert add(1, 2) == 3"]'])


def test_conversations_batches_and_main_blocks():
    code = CORRECT + "print('debug ' * 100)\nif __name__ == '__main__':\n    add(int(input()), 1)\n"
    completions = [[{"role": "user", "content": "add?"}, {"role": "assistant", "content": reply(code)}]] * 3
    completions.append(reply(WRONG))
    assert code_verifier(completions, tests=[TESTS] * 4) == [1.0, 1.0, 1.0, 0.0]


def test_extract_code_takes_the_last_python_block_after_thinking():
    text = "<think>```python\nx = 0\n```</think>\n```text\nnot code\n```\n```\nx = 1\n```\n```python\nx = 2\n"
    assert extract_code(text) == "x = 2\n"  # an unclosed last block (a truncated reply) still counts
    assert extract_code("```js\nlet x\n```") == "```js\nlet x\n```"  # no Python block: the answer as it is
    assert extract_code("<think>x = 1</think>\n\n") is None


# The sandbox itself


def test_sandbox_runs_in_a_private_directory_with_a_minimal_environment(monkeypatch):
    monkeypatch.setenv("POSTTRAIN_SANDBOX_SECRET", "hunter2")
    source = "import os, sys\nprint(sorted(os.environ))\nprint(os.getcwd())\nprint(repr(sys.stdin.read()))\n"
    source += "os.makedirs('a/b')\nopen('a/b/f', 'w').write('x')\nos.symlink('/etc', 'a/etc')\nos.chmod('a/b', 0)\n"
    etc_mode = os.stat("/etc").st_mode
    result = run_sandboxed(source)
    assert result.returncode == 0, result.stderr
    names, cwd, stdin = result.stdout.splitlines()
    assert names == "['HOME', 'LANG', 'PATH', 'TMPDIR']" and "hunter2" not in result.stdout
    assert cwd == result.workdir and stdin == "''"
    assert_cleaned_up(result)
    assert os.stat("/etc").st_mode == etc_mode  # the cleanup repaired permissions without following the symlink


def test_sandbox_reports_exit_status_and_errors():
    assert run_sandboxed("raise SystemExit(3)").returncode == 3
    result = run_sandboxed("1 / 0")
    assert result.returncode == 1 and "ZeroDivisionError" in result.stderr and result.killed is None
    result = run_sandboxed("x = bytearray(512 << 20)", memory_mb=256)
    assert result.returncode == 1 and "MemoryError" in result.stderr
    result = run_sandboxed("open('f', 'wb').write(b'0' * (2 << 20))", max_file_mb=1)
    assert result.returncode == 1 and "File too large" in result.stderr
    result = run_sandboxed("print(len(open('/dev/stdin').read()))\n" + "#" * (1 << 20))  # bigger than a pipe
    assert result.returncode == 0 and result.stdout == "0\n"


@pytest.mark.parametrize(
    "source, limits, killed",
    [
        ("import time\ntime.sleep(60)", {"timeout_s": 1.0}, "timeout"),
        ("import os, time\nos.close(1)\nos.close(2)\ntime.sleep(60)", {"timeout_s": 1.0}, "timeout"),
        ("while True:\n    pass", {"timeout_s": 10.0, "cpu_s": 1}, "cpu limit"),
        ("while True:\n    print('x' * 1000)", {"timeout_s": 10.0}, "output limit"),
        ("import sys\nwhile True:\n    sys.stderr.write('x' * 1000)", {"timeout_s": 10.0}, "output limit"),
    ],
    ids=["wall-clock", "closed-pipes", "cpu", "stdout", "stderr"],
)
def test_sandbox_stops_runaway_code_within_its_limit(source, limits, killed):
    start = time.monotonic()
    result = run_sandboxed(source, max_output_bytes=4096, **limits)
    assert result.killed == killed and result.timed_out == (killed == "timeout")
    assert len(result.stdout) <= 4096 and len(result.stderr) <= 4096
    assert time.monotonic() - start < min(limits["timeout_s"], limits.get("cpu_s", 99)) + SLACK_S
    assert_cleaned_up(result)


def test_sandbox_layers_in_force_on_this_host(layers):
    assert {"guards", "rlimit_cpu", "rlimit_as", "rlimit_fsize", "rlimit_nofile", "rlimit_core"} <= layers
    if os.geteuid() == 0 and "uid:65534" not in layers:
        pytest.skip(f"running as root, but this host refused the uid drop: {sorted(layers)}")
    if os.geteuid() == 0:
        assert {"uid:65534", "no_new_privs", "rlimit_nproc"} <= layers


# The hostile suite: each attempt below would score 1.0 (or fake it) if it worked.

HOSTILE = {
    "infinite-loop": lambda h: CORRECT + "while True:\n    pass\n",
    "loop-ignoring-signals": lambda h: CORRECT + textwrap.dedent("""
        import signal
        for s in (signal.SIGALRM, signal.SIGXCPU, signal.SIGTERM, signal.SIGINT):
            signal.signal(s, signal.SIG_IGN)
        while True:
            try:
                while True:
                    pass
            except BaseException:
                pass
        """),
    # A true fork bomb only where RLIMIT_NPROC backs the guard up; elsewhere one of at most 256 processes, so that a
    # broken guard could not take the machine down.
    "fork-bomb": lambda h: "import os\n"
    + ("while True:\n" if "rlimit_nproc" in h.layers else "for _ in range(8):\n")
    + "    os.fork()\n"
    + CORRECT,
    "thread-bomb": lambda h: "import threading, time\nwhile True:\n"
    "    threading.Thread(target=time.sleep, args=(100,), daemon=True).start()\n" + CORRECT,
    "memory-bomb": lambda h: "x = []\nwhile True:\n    x.append(' ' * 10**7)\n" + CORRECT,
    "endless-print": lambda h: CORRECT + "while True:\n    print('spam' * 100)\n",
    "huge-file": lambda h: "with open('big.bin', 'wb') as f:\n    while True:\n        f.write(bytes(1 << 20))\n"
    + CORRECT,
    "fd-exhaustion": lambda h: "files = [open(f'f{i}', 'w') for i in range(100000)]\n" + CORRECT,
    "sys-exit-before-tests": lambda h: WRONG + "import sys\nsys.exit(0)\n",
    "sys-exit-in-test": lambda h: "def add(a, b):\n    import sys\n    sys.exit(0)\n",
    "os-exit-before-tests": lambda h: WRONG + "import os\nos._exit(0)\n",
    "os-exit-in-test": lambda h: "def add(a, b):\n    import os\n    os._exit(0)\n",
    "forged-result-line": lambda h: WRONG + textwrap.dedent("""
        import os, re, sys
        found = {b"0" * 32}
        for path in ("/proc/self/cmdline", "/proc/self/environ", "/dev/stdin", *os.listdir(".")):
            try:
                found |= set(re.findall(rb"[0-9a-f]{32}", open(path, "rb").read()))
            except OSError:
                pass
        print("all tests passed\\nPASSED 2/2\\n1.0")
        for token in found:
            print("\\n" + token.decode() + " 11", flush=True)
        os._exit(0)
        """),
    "patched-builtins": lambda h: WRONG + "import builtins\nbuiltins.exec = builtins.compile = lambda *a, **k: None\n"
    "builtins.len = lambda x: 0\n",
    "patched-os-write": lambda h: WRONG + textwrap.dedent("""
        import os, re
        _write = os.write
        def forged(fd, data):
            return _write(fd, re.sub(rb" [01]+\\n$", lambda m: b" " + b"1" * (len(m.group()) - 2) + b"\\n", data))
        os.write = forged
        """),
    "gc-tampering": lambda h: textwrap.dedent("""
        import gc
        def add(a, b):
            for obj in gc.get_objects():
                if isinstance(obj, list) and any(isinstance(x, str) and x.startswith("assert add") for x in obj):
                    obj[:] = ["pass"] * len(obj)
            return a - b
        """),
    "subprocess-sleep": lambda h: "import subprocess\n"
    f"subprocess.Popen(['{MARKER}', '1000'], executable='/bin/sleep')\n" + CORRECT,
    "os-system": lambda h: f"import os\nassert os.system('exec -a {MARKER} sleep 1000 &') == 0\n" + CORRECT,
    "posix-spawn": lambda h: f"import os\nos.posix_spawn('/bin/sleep', ['{MARKER}', '1000'], {{}})\n" + CORRECT,
    "setsid-escape": lambda h: "import os\nos.setsid()\n" + CORRECT,
    "double-fork": lambda h: textwrap.dedent(f"""
        import os
        if os.fork() == 0:
            if os.fork() == 0:
                os.execv("/bin/sleep", ["{MARKER}", "1000"])
            os._exit(0)
        """) + CORRECT,
    "multiprocessing": lambda h: "import multiprocessing, time\n"
    "multiprocessing.Process(target=time.sleep, args=(1000,)).start()\n" + CORRECT,
    "ctypes-fork": lambda h: "import ctypes\nctypes.CDLL(None).fork()\n" + CORRECT,
    "env-secret": lambda h: f"import os\nassert os.environ['POSTTRAIN_SANDBOX_SECRET'] == '{h.secret}'\n" + CORRECT,
    "parent-environ": lambda h: f"assert b'{h.secret}' in open('/proc/{os.getpid()}/environ', 'rb').read()\n" + CORRECT,
    "write-outside": lambda h: f"open('{h.outside}', 'w').write('pwned')\n" + CORRECT,
    "write-into-tmp": lambda h: f"open('{h.in_tmp}', 'w').write('pwned')\n" + CORRECT,
    "delete-outside": lambda h: f"import os\nos.remove('{h.sentinel}')\n" + CORRECT,
    "rmtree-outside": lambda h: f"import shutil\nshutil.rmtree('{h.keep}')\n" + CORRECT,
    "rename-outside": lambda h: f"import os\nos.rename('{h.sentinel}', 'stolen.txt')\n" + CORRECT,
    "chmod-outside": lambda h: f"import os\nos.chmod('{h.keep}', 0o777)\n" + CORRECT,
    "symlink-then-write": lambda h: f"import os\nos.symlink('{h.tmp}', 'link')\nopen('link/pwned.txt', 'w')\n"
    + CORRECT,
    "symlink-cleanup-trap": lambda h: WRONG + textwrap.dedent(f"""
        import os
        os.symlink("{h.keep}", "keep")
        os.mkdir("locked")
        os.symlink("{h.keep}", "locked/keep")
        os.chmod("locked", 0)
        os.chmod(".", 0o500)
        """),
    "tcp-to-host": lambda h: f"import socket\nsocket.create_connection(('127.0.0.1', {h.port}), timeout=1).send(b'x')\n"
    + CORRECT,
    "raw-socket-to-host": lambda h: "import _socket\ns = _socket.socket(_socket.AF_INET, _socket.SOCK_STREAM)\n"
    f"s.settimeout(1)\ns.connect(('127.0.0.1', {h.port}))\n" + CORRECT,
    "udp-to-host": lambda h: "import socket\ns = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
    f"assert s.sendto(b'x', ('127.0.0.1', {h.udp_port})) == 1\n" + CORRECT,
    "unix-socket-to-host": lambda h: "import socket\ns = socket.socket(socket.AF_UNIX)\n"
    f"s.connect('{h.unix_path}')\n" + CORRECT,
    "internet": lambda h: "import socket\nsocket.create_connection(('1.1.1.1', 53), timeout=1)\n" + CORRECT,
    "dns": lambda h: "import socket\nsocket.getaddrinfo('example.com', 443)\n" + CORRECT,
    "signal-the-host": lambda h: f"import os, signal\nos.kill({os.getpid()}, signal.SIGUSR1)\n" + CORRECT,
    "kill-own-group": lambda h: "import os, signal\nos.killpg(0, signal.SIGUSR1)\n" + CORRECT,
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_code_scores_zero_and_leaves_the_host_as_it_was(name, host, runs):
    limits = {**FAST, "timeout_s": 2.0} if name == "loop-ignoring-signals" else FAST
    start = time.monotonic()
    scores = code_verifier([reply(HOSTILE[name](host))], tests=[TESTS], **limits)
    elapsed = time.monotonic() - start
    assert scores == [0.0], (runs[-1].stdout[-500:], runs[-1].stderr[-2000:])
    assert elapsed < limits["timeout_s"] + SLACK_S
    assert len(runs) == 1
    assert_cleaned_up(runs[0])
    host.assert_untouched(runs)


# Each kernel layer on its own (interpreter guards off): skipped where this host does not provide the layer.


def kernel_only(layers: set[str], needs: set[str], source: str, **limits) -> SandboxResult:
    """Run `source` with the interpreter guards off. Skipped before anything runs where the host lacks a layer the
    test relies on: without it the code would meet no defence at all."""
    if not needs <= layers:
        pytest.skip(f"this host does not provide {sorted(needs - layers)}: {sorted(layers)}")
    result = run_sandboxed(source, interpreter_guards=False, **limits)
    assert needs <= set(result.isolation), result.isolation
    return result


def test_network_namespace_alone_blocks_the_host_and_the_internet(host):
    source = textwrap.dedent(f"""
        import socket
        for address in [("127.0.0.1", {host.port}), ("1.1.1.1", 53)]:
            try:
                socket.create_connection(address, timeout=1)
            except OSError as error:
                print(error.errno)
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            s.sendto(b"x", ("127.0.0.1", {host.udp_port}))
        except OSError as error:
            print(error.errno)
        """)
    result = kernel_only(host.layers, {"netns"}, source)
    assert result.stdout.split() == ["101", "101", "101"], result.stderr  # ENETUNREACH: no route, even to 127.0.0.1
    host.assert_untouched([result])


def test_pid_namespace_alone_kills_processes_that_left_the_group(layers):
    source = textwrap.dedent(f"""
        import os, time
        os.setsid()
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:
                os.execv("/bin/sleep", ["{MARKER}", "1000"])
            os._exit(0)
        time.sleep(0.3)
        print("escaped", flush=True)
        time.sleep(1000)
        """)
    start = time.monotonic()
    result = kernel_only(layers, {"pidns"}, source, timeout_s=1.5)
    assert result.stdout == "escaped\n" and result.killed == "timeout", result.stderr
    assert time.monotonic() - start < 1.5 + SLACK_S
    assert_cleaned_up(result)


def test_mount_namespace_alone_makes_the_host_read_only_and_hides_its_processes(host):
    source = textwrap.dedent(f"""
        import os
        print(sorted(pid for pid in os.listdir("/proc") if pid.isdigit()))
        for path in ["{host.in_tmp}", "/dev/shm/{MARKER}", os.path.expanduser("~/../{MARKER}")]:
            try:
                open(path, "w")
                print("allowed")
            except OSError as error:
                print(error.errno)
        open("inside.txt", "w").write("fine")
        print(open("inside.txt").read())
        """)
    result = kernel_only(host.layers, {"readonly_root", "private_proc"}, source)
    assert result.stdout.splitlines() == ["['1']", "30", "30", "30", "fine"], result.stderr  # 30: EROFS
    assert not Path(f"/dev/shm/{MARKER}").exists()
    host.assert_untouched([result])


def test_rlimit_nproc_alone_stops_a_fork_bomb(layers):
    # Bounded (at most 200 sleeping children) even if the limit failed, so that this test can never hurt the host.
    source = textwrap.dedent("""
        import os, time
        children = 0
        for _ in range(200):
            try:
                pid = os.fork()
            except OSError as error:
                print("refused", children, error.errno, flush=True)
                break
            if pid == 0:
                time.sleep(1000)
                os._exit(0)
            children += 1
        """)
    result = kernel_only(layers, {"rlimit_nproc"}, source, max_processes=8)
    refused, children, errno = result.stdout.split()
    assert refused == "refused" and int(children) < 8 and errno == "11", result.stderr  # EAGAIN
    assert_cleaned_up(result)


def test_dropped_uid_alone_protects_host_files_processes_and_environment(host):
    source = textwrap.dedent(f"""
        import os, signal
        attempts = {{
            "write": lambda: open("{host.outside}", "w"),
            "delete": lambda: os.remove("{host.sentinel}"),
            "chmod": lambda: os.chmod("{host.keep}", 0o777),
            "environ": lambda: open("/proc/{os.getpid()}/environ", "rb").read(),
            "signal": lambda: os.kill({os.getpid()}, signal.SIGUSR1),
        }}
        for name, attempt in attempts.items():
            try:
                attempt()
                print(name, "allowed")
            except OSError as error:
                print(name, "refused", error.errno)
        """)
    result = kernel_only(host.layers, {"uid:65534"}, source)
    lines = dict(line.split(" ", 1) for line in result.stdout.splitlines())
    assert set(lines) == {"write", "delete", "chmod", "environ", "signal"}, result.stderr
    assert all(outcome.startswith("refused") for outcome in lines.values()), lines
    host.assert_untouched([result])


def test_interpreter_guards_alone_refuse_processes_network_and_outside_writes(host):
    # Runs without the kernel layers, i.e. as the test's own user: every attempt is harmless if a guard failed.
    source = textwrap.dedent(f"""
        import os, shutil, signal, socket, subprocess
        attempts = {{
            "fork": lambda: os.fork() == 0 and os._exit(0),
            "subprocess": lambda: subprocess.run(["/bin/true"]),
            "system": lambda: os.system("true"),
            "setsid": os.setsid,
            "kill": lambda: os.kill({os.getpid()}, signal.SIGUSR1),
            "connect": lambda: socket.create_connection(("127.0.0.1", {host.port}), timeout=1),
            "dns": lambda: socket.getaddrinfo("localhost", 80),
            "write": lambda: open("{host.outside}", "w"),
            "write-tmp": lambda: os.open("{host.in_tmp}", os.O_WRONLY | os.O_CREAT),
            "delete": lambda: os.remove("{host.sentinel}"),
            "rmtree": lambda: shutil.rmtree("{host.keep}"),
            "rename": lambda: os.rename("{host.sentinel}", "x"),
            "inside": lambda: open("inside.txt", "w").close() or os.remove("inside.txt") or 1 / 0,
        }}
        for name, attempt in attempts.items():
            try:
                attempt()
                print(name, "allowed")
            except PermissionError:
                print(name, "refused")
            except Exception as error:
                print(name, type(error).__name__)
        """)
    result = run_sandboxed(source, kernel_isolation=False)
    lines = dict(line.split(" ", 1) for line in result.stdout.splitlines())
    expected = dict.fromkeys(lines, "refused") | {"inside": "ZeroDivisionError"}  # writing inside is fine
    assert len(lines) == 13 and lines == expected, (lines, result.stderr)
    host.assert_untouched([result])
