"""The sandbox's layers one at a time (interpreter guards off), the root it builds, its capabilities, and the whole
hostile suite run again as a fresh unprivileged user. Tests skip, naming the layer, where the host lacks one."""

from __future__ import annotations

import os
import re
import shutil
import sys
import textwrap
import time
from pathlib import Path

import pytest

from rewards.sandbox import SandboxResult, run_sandboxed
from tests.unit.sandbox_support import (  # noqa: F401 - fixtures are used by name
    MARKER,
    SLACK_S,
    assert_cleaned_up,
    host,
    layers,
    no_stray_processes,
    verifier_module,
)
from tests.unprivileged import missing_tools, python_paths, run_as_fresh_user

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the sandbox's host checks read Linux /proc")

REPO = Path(__file__).resolve().parents[2]


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
        import os, sys, time
        os.setsid()
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:
                os.execv(sys.executable, [sys.executable, "-c", "import time  # {MARKER}\\ntime.sleep(1000)"])
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


def test_mount_namespace_alone_gives_a_read_only_root_of_its_own(host):
    source = textwrap.dedent(f"""
        import os
        print(sorted(pid for pid in os.listdir("/proc") if pid.isdigit()))
        for path in ["/{MARKER}", "/usr/lib/{MARKER}", "{host.outside}", "/dev/shm/{MARKER}"]:
            try:
                open(path, "w")
                print("allowed")
            except OSError as error:
                print(error.errno)
        open("{host.in_tmp}", "w").write("private")
        open("inside.txt", "w").write("fine")
        print(open("inside.txt").read(), open("{host.in_tmp}").read())
        """)
    result = kernel_only(host.layers, {"private_root", "readonly_root", "private_proc", "private_tmp"}, source)
    # 30: EROFS (the root and what is bound into it are read-only); 2: ENOENT (the host's paths are not there)
    assert result.stdout.splitlines() == ["['1']", "30", "30", "2", "2", "fine private"], result.stderr
    assert not Path(f"/dev/shm/{MARKER}").exists() and not Path(f"/{MARKER}").exists()
    host.assert_untouched([result])  # the write to /tmp landed in the sandbox's own /tmp


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


# The root the sandbox builds


def test_the_root_holds_only_the_interpreter_its_libraries_and_private_directories(layers):
    if "private_root" not in layers:
        pytest.skip(f"this host gives the sandbox no root of its own: {sorted(layers)}")
    source = textwrap.dedent("""
        import os, sys
        print(sorted(os.listdir("/")))
        print(sorted(os.listdir("/etc")))
        print(sorted(os.listdir("/dev")))
        print(sorted(os.listdir(os.path.join(os.path.dirname(os.__file__), "site-packages"))))
        home = os.path.realpath(sys.executable).split("/")[1]
        print(sorted(os.listdir("/" + home)))
        """)
    result = run_sandboxed(source)
    top, etc, dev, site_packages, home = result.stdout.splitlines()
    interpreter = os.path.realpath(sys.executable).split("/")[1]  # e.g. usr, or root for an interpreter under /root
    allowed = {"dev", "etc", "proc", "tmp", "usr", "lib", "lib64", "lib32", "libx32", interpreter}
    assert set(eval(top)) <= allowed and "old_root" not in top, top
    assert eval(etc) == ["ld.so.cache"]
    assert eval(dev) == sorted(["fd", "full", "null", "random", "stderr", "stdin", "stdout", "urandom", "zero"])
    assert eval(site_packages) == []  # the base interpreter's installed packages are not the standard library
    if interpreter not in {"usr", "lib", "lib64"}:  # a home directory: only the way to the interpreter shows
        assert len(eval(home)) == 1, home


def test_the_child_holds_no_capabilities_at_all(layers):
    if os.geteuid() != 0 and "userns" not in layers:
        pytest.skip("an ordinary user without user namespaces cannot empty its bounding set (it holds no capability)")
    result = run_sandboxed("print(open('/proc/self/status').read())")
    status = dict(re.findall(r"^(\w+):\s*(\S*)", result.stdout, re.MULTILINE))
    assert {key: status[key] for key in ("CapEff", "CapPrm", "CapBnd", "CapAmb", "CapInh")} == dict.fromkeys(
        ("CapEff", "CapPrm", "CapBnd", "CapAmb", "CapInh"), "0000000000000000"), result.stdout
    assert status["NoNewPrivs"] == "1" and "no_capabilities" in result.isolation


def test_the_program_reads_the_input_it_is_given():
    source = "import sys\nprint(repr(input()), repr(sys.stdin.read()), len(open('/dev/stdin').read()))"
    result = run_sandboxed(source, stdin=b"first line\nsecond\n")
    # /dev/stdin opens the input anew, from its start, as it would for a file redirected to stdin
    assert result.stdout == "'first line' 'second\\n' 18\n", result.stderr
    assert run_sandboxed("import sys\nprint(repr(sys.stdin.read()))").stdout == "''\n"


# The hostile suite again, as a user with no privileges at all


def test_the_hostile_suite_holds_for_a_fresh_unprivileged_user():
    if os.geteuid() != 0:
        pytest.skip("already running as an ordinary user: this run of the suite is that test")
    if missing := missing_tools():
        pytest.skip(f"cannot switch to a fresh user here: no {', '.join(missing)}")
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
               f"--basetemp={os.path.join('/tmp', f'posttrain-fresh-user-{os.getpid()}')}",
               "tests/unit/test_code_sandbox.py", "tests/unit/test_sandbox_layers.py", "tests/unit/test_code_io.py"]
    result = run_as_fresh_user(command, cwd=str(REPO), needs=[*python_paths(), str(REPO)], timeout_s=600,
                               env={"PYTHONDONTWRITEBYTECODE": "1"})
    shutil.rmtree(os.path.join("/tmp", f"posttrain-fresh-user-{os.getpid()}"), ignore_errors=True)
    summary = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else ""
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    passed = int(re.search(r"(\d+) passed", summary).group(1))
    from tests.unit.test_code_sandbox import HOSTILE

    assert passed >= len(HOSTILE), summary


def test_the_verifier_says_once_which_protections_are_missing(caplog):
    with caplog.at_level("WARNING", logger="posttrain"):
        for _ in range(3):
            verifier_module._say_once(("rlimit_cpu", "guards", f"test-{MARKER}"))
    warnings = [r.getMessage() for r in caplog.records if "code sandbox" in r.getMessage()]
    assert len(warnings) == 1 and "a root of its own" in warnings[0] and "no network" in warnings[0], warnings
    caplog.clear()
    with caplog.at_level("WARNING", logger="posttrain"):
        verifier_module._say_once((*run_sandboxed("pass").isolation, f"full-{MARKER}"))
    if os.geteuid() == 0:  # root gets every protection, so there is nothing to say
        assert not [r for r in caplog.records if "code sandbox" in r.getMessage()]


def test_a_sandbox_that_cannot_isolate_itself_fails_loudly(monkeypatch):
    import rewards.sandbox as sandbox

    failing = 'def _child_main(config):\n    raise SystemExit("sandbox: could not build its root: /tmp tmpfs: ' \
              'Operation not permitted (errno 1)")\n'
    monkeypatch.setattr(sandbox, "_bootstrap_source", lambda: failing)
    with pytest.raises(RuntimeError, match="could not start on this host: sandbox: could not build its root: /tmp"):
        run_sandboxed("print('never runs')")


def test_a_closed_checkout_is_exposed_whole_to_the_fresh_user(tmp_path):
    """A checkout made by `mktemp -d` is 0700: the fresh user must see all of it, not only the entries on the
    interpreter's path (that hid tests/ and ran nothing)."""
    from tests.unprivileged import blocked_directories

    checkout = tmp_path / "checkout"
    (checkout / ".venv" / "bin").mkdir(parents=True)
    (checkout / ".venv" / "bin" / "python").touch()
    (checkout / "tests").mkdir()
    (checkout / "README.md").touch()
    os.chmod(tmp_path, 0o755)
    os.chmod(checkout, 0o700)
    needs = [str(checkout / ".venv" / "bin" / "python"), str(checkout)]
    assert blocked_directories(needs)[str(checkout.resolve())] == {".venv", "tests", "README.md"}
    os.chmod(checkout, 0o755)
    assert str(checkout.resolve()) not in blocked_directories(needs)
