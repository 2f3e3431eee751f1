"""The sandbox's process plumbing in the trainer's process: feed the child and read it with caps, end the whole
process group without a pid-reuse race, and remove the run's directory whatever the code did to it."""

from __future__ import annotations

import contextlib
import os
import selectors
import shutil
import signal
import stat
import subprocess
import time
import warnings


def pump(proc: subprocess.Popen, data: bytes, info_fd: int, output: dict, deadline: float, cap: int) -> str | None:
    """Feed stdin and collect stdout, stderr and the child's report until the leader exits.

    Returns why the run must be stopped early ("timeout", "output limit"), or None when the leader exited by itself.
    Never blocks past the deadline, whatever the child does with its pipes.
    """
    names = {proc.stdout.fileno(): "stdout", proc.stderr.fileno(): "stderr", info_fd: "info"}
    stdin_fd = proc.stdin.fileno()
    exit_fd = _pidfd(proc.pid)
    pending = memoryview(data)
    with selectors.DefaultSelector() as selector:
        for fd in (*names, stdin_fd):
            os.set_blocking(fd, False)
        for fd in names:
            selector.register(fd, selectors.EVENT_READ)
        selector.register(stdin_fd, selectors.EVENT_WRITE)
        if exit_fd is not None:
            selector.register(exit_fd, selectors.EVENT_READ)
        try:
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return "timeout"
                # Without a pidfd the leader's exit is only seen by polling: grandchildren may hold the pipes open.
                events = selector.select(remaining if exit_fd is not None else min(remaining, 0.01))
                exited = exit_fd is None and _leader_exited(proc)
                for key, _ in events:
                    if key.fd == exit_fd:
                        exited = True
                    elif key.fd == stdin_fd:
                        try:
                            pending = pending[os.write(stdin_fd, pending[: 1 << 16]) :]
                        except BlockingIOError:
                            continue
                        except OSError:  # the child closed its stdin or died: nothing more to send
                            pending = pending[:0]
                        if not pending:
                            selector.unregister(stdin_fd)
                            proc.stdin.close()
                    else:
                        name = names[key.fd]
                        if _read_into(key.fd, output[name], selector) and name != "info" and len(output[name]) > cap:
                            return "output limit"
                if exited:
                    # What is still buffered in the pipes belongs to the run; a grandchild still writing does not.
                    for fd, name in names.items():
                        if fd in selector.get_map():
                            while _read_into(fd, output[name], selector):
                                if name != "info" and len(output[name]) > cap:
                                    return "output limit"
                    return None
        finally:
            if exit_fd is not None:
                os.close(exit_fd)


def _read_into(fd: int, buffer: bytearray, selector: selectors.BaseSelector) -> bool:
    """Append what `fd` has now to `buffer`; False when nothing was read (nothing ready, or end of file)."""
    try:
        chunk = os.read(fd, 1 << 16)
    except BlockingIOError:
        return False
    if not chunk:
        selector.unregister(fd)
        return False
    buffer += chunk
    return True


def _pidfd(pid: int) -> int | None:
    """A descriptor that becomes readable when `pid` exits (Linux 5.3+), or None where there is none."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None


def _leader_exited(proc: subprocess.Popen) -> bool:
    """Whether the leader has exited, without reaping it: while it is an unreaped zombie its pid (the group id)
    cannot be reused, so signalling the group stays safe."""
    if proc.returncode is not None:
        return True
    if hasattr(os, "waitid"):
        return os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    return proc.poll() is not None


def end_group(proc: subprocess.Popen, init_pid: int | None) -> float:
    """Kill everything the run started, reap the leader, and return once no process of the group is alive.

    Returns the CPU seconds the run used: the leader's, with those of every descendant it reaped (the namespace's
    init, which reaped the rest), or 0.0 where the leader was already reaped by polling.
    """
    if init_pid is not None and not _leader_exited(proc):
        # The namespace's init may have left our process group. Its parent, the trusted waiter, kills it on SIGTERM:
        # race-free, as the waiter has not reaped it; the kernel then kills everything else in the namespace.
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGTERM)
        _wait_until(lambda: _leader_exited(proc), 2.0)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)  # the leader is not reaped yet, so this group id is still ours
    cpu_time_s = 0.0
    if proc.returncode is None:
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        cpu_time_s = usage.ru_utime + usage.ru_stime
    # SIGKILL is delivered asynchronously: wait until it has been, so callers (and tests) see a clean host.
    _wait_until(lambda: not _live_group_members(proc.pid), 2.0)
    return cpu_time_s


def _wait_until(condition, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    delay = 0.001
    while not condition():
        if time.monotonic() >= deadline:
            return False
        time.sleep(delay)
        delay = min(delay * 2, 0.05)
    return True


def _live_group_members(pgid: int) -> list[int]:
    """Pids of processes in group `pgid` that are not zombies (Linux /proc; [] elsewhere). Zombies are skipped:
    where the host's init does not reap orphans they linger, but they run nothing and hold nothing but a pid."""
    if not os.path.isdir("/proc"):
        return []
    members = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                data = f.read()
        except OSError:
            continue
        state, _ppid, group = data[data.rindex(b")") + 2 :].split()[:3]
        if int(group) == pgid and state not in (b"Z", b"X"):
            members.append(int(name))
    return members


def signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def remove_tree(path: str) -> None:
    """Delete a run's directory even where its code removed permissions; never follows the symlinks it left."""
    with contextlib.suppress(OSError):
        if stat.S_ISDIR(os.lstat(path).st_mode):
            os.chmod(path, 0o700)
    for dirpath, dirnames, _ in os.walk(path):
        for name in dirnames:
            child = os.path.join(dirpath, name)
            with contextlib.suppress(OSError):
                if stat.S_ISDIR(os.lstat(child).st_mode):  # lstat: a symlink to a host directory is left alone
                    os.chmod(child, 0o700)
    shutil.rmtree(path, ignore_errors=True)
    if os.path.lexists(path):
        warnings.warn(f"could not remove the sandbox directory {path}", RuntimeWarning, stacklevel=3)
