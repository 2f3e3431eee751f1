"""The sandboxed code verifier: scoring, the sandbox's limits, and a hostile suite that must score 0.0, stop within
its limits, and leave the host as it was (no process, file, connection, signal or secret left behind or let out).

tests/unit/test_sandbox_layers.py runs this module again as a fresh unprivileged user.
"""

from __future__ import annotations

import os
import sys
import textwrap
import time
from pathlib import Path

import pytest

from rewards import REWARDS
from rewards.code_verifier import code_verifier, extract_code
from rewards.sandbox import run_sandboxed
from tests.unit.sandbox_support import (  # noqa: F401 - fixtures are used by name
    CORRECT,
    FAST,
    MARKER,
    SLACK_S,
    TESTS,
    WRONG,
    assert_cleaned_up,
    host,
    layers,
    no_stray_processes,
    reply,
    runs,
)

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the sandbox's host checks read Linux /proc")

CHECKOUT_FILE = Path(__file__).resolve()  # the project checkout: its eval sets, configs and code
VENV_FILE = Path(sys.prefix, "pyvenv.cfg") if sys.prefix != sys.base_prefix else Path(sys.prefix, "bin", "python3")
BASE_SITE_PACKAGES = Path(os.path.dirname(os.__file__), "site-packages")


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
    confined = {"netns", "pidns", "mountns", "private_root", "readonly_root", "private_proc", "private_tmp",
                "empty_bounding_set", "no_capabilities", "no_new_privs", "rlimit_nproc"}
    if os.geteuid() == 0:  # root can always unshare and drop to nobody
        assert confined | {"uid:65534"} <= layers
    elif "userns" not in layers:
        pytest.skip(f"this host refuses unprivileged user namespaces: {sorted(layers)}")
    else:
        assert confined <= layers


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
    # Reads of the host: each solution defines its function only if the read returned the host's data.
    "read-owner-only-file": lambda h: f"assert open('{h.secret_file}').read() == '{h.secret}'\n" + CORRECT,
    "read-etc-shadow": lambda h: "assert 'root:' in open('/etc/shadow').read()\n" + CORRECT,
    "read-etc-passwd": lambda h: "assert 'root:' in open('/etc/passwd').read()\n" + CORRECT,
    "read-checkout": lambda h: f"assert 'read-checkout' in open('{CHECKOUT_FILE}').read()\n" + CORRECT,
    "list-checkout": lambda h: f"import os\nassert os.listdir('{CHECKOUT_FILE.parents[2]}')\n" + CORRECT,
    "read-venv": lambda h: f"assert open('{VENV_FILE}', 'rb').read()\n" + CORRECT,
    "list-site-packages": lambda h: f"import os\nassert os.listdir('{BASE_SITE_PACKAGES}')\n" + CORRECT,
    "read-a-home": lambda h: "import os\nhomes = ['/root', '/home', *('/home/' + u for u in os.listdir('/home'))]\n"
    "assert any(n.startswith('.') for d in homes if os.path.isdir(d) for n in os.listdir(d) if n != '.pyenv')\n"
    + CORRECT,
    "host-init-cmdline": lambda h: f"assert open('/proc/1/cmdline', 'rb').read() == {Path('/proc/1/cmdline').read_bytes()!r}\n"
    + CORRECT,
    "host-init-environ": lambda h: "assert b'posttrain-sandbox-' not in open('/proc/1/environ', 'rb').read()\n"
    + CORRECT,  # pid 1 is the sandbox's own init (HOME is its working directory), not the host's
    "host-processes": lambda h: f"import os\nassert '{os.getpid()}' in os.listdir('/proc')\n" + CORRECT,
    "host-root-listing": lambda h: "import os\nassert {'boot', 'home', 'sbin', 'var'} & set(os.listdir('/')) or "
    "'old_root' in os.listdir('/')\n" + CORRECT,
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_code_scores_zero_and_leaves_the_host_as_it_was(name, host, runs):
    limits = {**FAST, "timeout_s": 2.0} if name == "loop-ignoring-signals" else FAST
    start = time.monotonic()
    # The sandbox's own /tmp is writable and private: the write succeeds there, and the host's /tmp is untouched.
    expected = 1.0 if name == "write-into-tmp" and "private_tmp" in host.layers else 0.0
    scores = code_verifier([reply(HOSTILE[name](host))], tests=[TESTS], **limits)
    elapsed = time.monotonic() - start
    assert scores == [expected], (runs[-1].stdout[-500:], runs[-1].stderr[-2000:])
    assert elapsed < limits["timeout_s"] + SLACK_S
    assert len(runs) == 1
    assert_cleaned_up(runs[0])
    host.assert_untouched(runs)
