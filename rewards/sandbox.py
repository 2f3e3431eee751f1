"""Run untrusted Python (model-written code) in a child process that is limited, isolated, and always cleaned up.

Layers, outermost first. The kernel enforces the first two groups; the last is a guard inside the child's own
interpreter, which code in that interpreter can get around, so it is defence in depth and nothing more.
`SandboxResult.isolation` names the layers that were in force for a run, as the child reported them (on a pipe it
closes) before the untrusted code started.

Kernel-enforced, always:
  * a fresh session and process group (`start_new_session`); at the end of every run, whether the code exited,
    timed out or overflowed its output, the parent SIGKILLs the whole group before it reaps the leader (so the group
    id cannot have been reused), then waits until no live member is left;
  * a wall-clock timeout in the parent, and rlimits set in the child before any untrusted byte runs: RLIMIT_CPU,
    RLIMIT_AS, RLIMIT_FSIZE, RLIMIT_NOFILE, RLIMIT_CORE=0, and RLIMIT_NPROC where it counts (see below);
  * stdout and stderr read with a cap, never into unbounded memory: a child that writes more than
    `max_output_bytes` to either is killed;
  * a private working directory (HOME and TMPDIR point into it), a minimal environment (nothing inherited, so no
    secrets), stdin holding only the input the caller gave (none by default); the directory is removed afterwards, its permissions repaired first, its symlinks
    never followed.

Kernel-enforced where the host allows it (Linux; root, or unprivileged user namespaces):
  * new network, PID, mount, IPC and UTS namespaces via unshare(2); unprivileged, inside a new user namespace, in
    which the code then holds no capabilities. The network namespace has only a loopback that is down: no
    connection to anything, 127.0.0.1 and the host's abstract Unix sockets included;
  * the code runs as init of the PID namespace, so when it dies the kernel kills every process it started, even
    one that called setsid() to leave the process group. The parent ends a run through the trusted waiter outside
    the namespace (init's parent, leader of the group), which SIGKILLs init without any pid-reuse race;
  * in the mount namespace the code gets a root of its own (pivot_root onto a fresh tmpfs, the host's root
    detached): read-only, it holds the interpreter, its standard library (without site-packages) and the shared
    libraries it loads, at their host paths, /etc/ld.so.cache, the usual /dev nodes, a fresh /proc that shows only
    the sandbox's own processes, a private size-limited /tmp, and the working directory, the only writable host
    path. Nothing else of the host is there to read: no home directory, no project checkout or virtual
    environment, no /etc/shadow or /etc/passwd. Where the root cannot be built the run fails, naming the step;
  * no capabilities at all: the bounding and ambient sets are emptied, then, as root, the code runs as `nobody`
    (host files are protected by their permissions too, other users' processes are out of reach, and
    RLIMIT_NPROC, which the kernel ignores for root, stops fork and thread bombs); unprivileged, it drops every
    capability it holds in its user namespace. `no_capabilities` is reported only when /proc/self/status shows
    all five sets empty;
  * no_new_privs: no execve can gain privileges (setuid binaries, file capabilities).

In-interpreter guards (same process as the untrusted code; a determined program undoes them, e.g. through a
wrapper's closure or `type(sys.stdout.buffer.raw)`):
  * process creation and escape refused: os.fork/forkpty/system/popen/exec*/spawn*/posix_spawn*, the subprocess
    machinery (_posixsubprocess.fork_exec), setsid/setpgid, kill/killpg; ctypes cannot be imported;
  * networking refused: socket creation and name resolution raise PermissionError (the only network defence on a
    host that allows no namespaces);
  * writes, deletes, renames, chmods and the like outside the working directory (and the sandbox's own /tmp, where
    it has one) raise PermissionError.

What this is not: a security boundary against a determined human attacker. There is no seccomp filter (the whole
kernel interface is reachable) and no cgroup (RLIMIT_AS is per process, so N processes may use N times the memory,
bounded by RLIMIT_NPROC). On a host that refuses namespaces (e.g. a container without CAP_SYS_ADMIN and without
user namespaces) only the rlimits, the group kill, the uid drop when root, and the guards remain: a program that
gets past the guards could then read what its user may read, write wherever its user may, reach the network, or
call setsid() and outlive the run; `missing_protections` names what is absent and the code verifier says so once.
It is sized for model-written code during RL: runaway loops, fork and memory bombs, accidental or reward-hacking
file, network and process mischief.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
import os
import selectors
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass

# The unprivileged user the code runs as when the parent is root (uid and gid of `nobody` on Debian and Red Hat).
SANDBOX_UID = 65534
SANDBOX_GID = 65534


# What each kernel layer protects, in the words `missing_protections` uses when a host does not provide it.
PROTECTIONS = {
    "netns": "no network (the code could reach the network and the host's loopback services)",
    "pidns": "a PID namespace (a process that calls setsid() could outlive the run)",
    "private_root": "a root of its own (the code could read every host file its user can read)",
    "readonly_root": "a read-only root (the code could write wherever its user can)",
    "private_proc": "a private /proc (the code could see the host's processes)",
    "no_capabilities": "an empty capability set",
    "no_new_privs": "no_new_privs (a setuid program could gain privileges)",
    "rlimit_nproc": "a process limit (fork bombs are stopped only by the interpreter guards)",
}


def missing_protections(isolation: tuple[str, ...] | list[str]) -> list[str]:
    """The kernel protections a run's `isolation` lacks, described; [] when every one was in force.

    >>> missing_protections(["netns", "pidns", "private_root", "readonly_root", "private_proc", "no_capabilities",
    ...                      "no_new_privs", "rlimit_nproc"])
    []
    >>> missing_protections(["netns", "pidns", "rlimit_cpu", "guards"])[0]
    'a root of its own (the code could read every host file its user can read)'
    """
    return [text for layer, text in PROTECTIONS.items() if layer not in isolation]


@dataclass(frozen=True)
class SandboxResult:
    """How one sandboxed run ended. `killed` is why it was stopped: "timeout", "output limit" or "cpu limit", else
    the name of the signal that ended it, else None. `cpu_time_s` is the CPU time the run used, all processes
    together. `isolation` lists the layers in force, as the child reported them before the untrusted code started.
    """

    returncode: int
    stdout: str
    stdout_bytes: bytes
    stderr: str
    timed_out: bool
    killed: str | None
    wall_s: float
    cpu_time_s: float
    isolation: tuple[str, ...]
    workdir: str


def run_sandboxed(
    source: str,
    *,
    timeout_s: float = 10.0,
    cpu_s: int | None = None,
    memory_mb: int = 1024,
    max_output_bytes: int = 64 * 1024,
    max_file_mb: int = 16,
    max_open_files: int = 64,
    max_processes: int = 32,
    tmp_mb: int = 16,
    stdin: bytes = b"",
    kernel_isolation: bool = True,
    interpreter_guards: bool = True,
) -> SandboxResult:
    """Run Python `source` in a fresh, limited, isolated child interpreter (standard library only) and clean up.

    `stdin` is what the program reads from its standard input. `cpu_s` defaults to `timeout_s` rounded up; `tmp_mb`
    sizes the private /tmp. `kernel_isolation=False` skips namespaces and the uid drop and
    `interpreter_guards=False` skips the guards; both exist so that tests can check each layer on its own.

    >>> result = run_sandboxed("print(6 * 7)")
    >>> result.returncode, result.stdout, result.killed
    (0, '42\\n', None)
    >>> run_sandboxed("while True: pass", timeout_s=0.5).killed
    'timeout'
    """
    interpreter = _interpreter()
    drop = kernel_isolation and hasattr(os, "geteuid") and os.geteuid() == 0
    if drop:
        _check_readable_by_others(interpreter)
    outer = tempfile.mkdtemp(prefix="posttrain-sandbox-")
    workdir = os.path.join(outer, "work")
    os.mkdir(workdir, 0o700)
    os.mkdir(os.path.join(outer, "root"), 0o700)  # where the child mounts its own root
    if drop:
        # The parent directory stays root's: `nobody` cannot rename its working directory away and leave a
        # symlink in its place for the cleanup to follow.
        os.chmod(outer, 0o711)
        os.chown(workdir, SANDBOX_UID, SANDBOX_GID)
    info_r, info_w = os.pipe()
    config = {
        "info_fd": info_w,
        "kernel": kernel_isolation,
        "guards": interpreter_guards,
        "drop": drop,
        "uid": SANDBOX_UID,
        "gid": SANDBOX_GID,
        "root_dir": os.path.join(outer, "root"),
        "tmp_mb": tmp_mb,
        "cpu_s": cpu_s if cpu_s is not None else max(1, math.ceil(timeout_s)),
        "memory_mb": memory_mb,
        "max_file_mb": max_file_mb,
        "max_open_files": max_open_files,
        "max_processes": max_processes,
    }
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8"}
    start = time.monotonic()
    try:
        # No preexec_fn: it is unsafe in a threaded parent (trainers are); the child limits itself before anything else.
        proc = subprocess.Popen(
            [interpreter, "-I", "-S", "-B", "-c", f"{_bootstrap_source()}\n_child_main({config!r})\n"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=workdir,
            env=env,
            start_new_session=True,
            pass_fds=(info_w,),
        )
    except BaseException:
        os.close(info_r)
        _remove_tree(outer)
        raise
    finally:
        os.close(info_w)
    output = {"stdout": bytearray(), "stderr": bytearray(), "info": bytearray()}
    killed = None
    try:
        program = source.encode("utf-8", "surrogatepass")
        data = b"%d\n" % len(program) + program + stdin  # the child reads exactly the program; the rest is its input
        killed = _pump(proc, data, info_r, output, start + timeout_s, max_output_bytes)
    finally:
        info = _parse_info(bytes(output["info"]))
        try:
            cpu_time_s = _end_group(proc, info.get("pid"))
        finally:
            for stream in (proc.stdin, proc.stdout, proc.stderr):
                if stream is not None and not stream.closed:
                    stream.close()
            os.close(info_r)
            _remove_tree(outer)
    if kernel_isolation and not info.get("layers") and (error := _bootstrap_error(output["stderr"])):
        raise RuntimeError(f"the code sandbox could not start on this host: {error}")
    if killed is None and proc.returncode < 0:
        cpu_limited = -proc.returncode in (signal.SIGKILL, signal.SIGXCPU) and cpu_time_s >= config["cpu_s"] - 0.05
        killed = "cpu limit" if cpu_limited else _signal_name(-proc.returncode)
    return SandboxResult(
        returncode=proc.returncode,
        stdout=bytes(output["stdout"][:max_output_bytes]).decode("utf-8", "replace"),
        stdout_bytes=bytes(output["stdout"][:max_output_bytes]),
        stderr=bytes(output["stderr"][:max_output_bytes]).decode("utf-8", "replace"),
        timed_out=killed == "timeout",
        killed=killed,
        wall_s=time.monotonic() - start,
        cpu_time_s=cpu_time_s,
        isolation=tuple(info.get("layers", ())),
        workdir=workdir,
    )


def _pump(proc: subprocess.Popen, data: bytes, info_fd: int, output: dict, deadline: float, cap: int) -> str | None:
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


def _end_group(proc: subprocess.Popen, init_pid: int | None) -> float:
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


def _parse_info(data: bytes) -> dict:
    """The child's report, written before the untrusted code ran: `pid N` (the namespace's init), `layers a,b`."""
    info: dict = {}
    for line in data.decode("ascii", "replace").splitlines():
        key, _, value = line.partition(" ")
        if key == "pid" and value.isdigit():
            info["pid"] = int(value)
        elif key == "layers":
            info["layers"] = [layer for layer in value.split(",") if layer]
    return info


def _bootstrap_error(stderr: bytearray) -> str | None:
    """The child's own message where it stopped before reporting its layers (before any untrusted code ran)."""
    lines = bytes(stderr[-4096:]).decode("utf-8", "replace").strip().splitlines()
    return lines[-1] if lines and lines[-1].startswith("sandbox: ") else None


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _remove_tree(path: str) -> None:
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


def _interpreter() -> str:
    """The interpreter the sandbox runs: the base one under a virtual environment (it runs with -I -S, standard
    library only, so the environment's packages would not be used anyway)."""
    base = getattr(sys, "_base_executable", "") or ""
    return base if os.path.isfile(base) and os.access(base, os.X_OK) else sys.executable


@functools.cache
def _check_readable_by_others(interpreter: str) -> None:
    """As root the code runs as `nobody`, which must be able to read the interpreter and its standard library in the
    sandbox's root (where their host directories' own permissions, such as a 0700 home, no longer stand between)."""
    library = os.path.dirname(os.__file__)
    for path, needed in ((os.path.realpath(interpreter), stat.S_IXOTH | stat.S_IROTH),
                         (library, stat.S_IXOTH | stat.S_IROTH), (os.__file__, stat.S_IROTH)):
        if os.stat(path).st_mode & needed != needed:
            raise PermissionError(
                f"the code sandbox runs untrusted code as nobody (uid {SANDBOX_UID}), which cannot read {path}: "
                f"make the interpreter readable by other users (chmod -R o+rX {os.path.dirname(library)}) or run "
                "the trainer as an ordinary user"
            )


@functools.cache
def _bootstrap_source() -> str:
    """The child's program: the source of rewards.sandbox_child's functions, each importing what it needs."""
    from rewards.sandbox_child import CHILD_FUNCTIONS

    return "\n\n".join(inspect.getsource(function) for function in CHILD_FUNCTIONS)
