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
    secrets), stdin at /dev/null; the directory is removed afterwards, its permissions repaired first, its symlinks
    never followed.

Kernel-enforced where the host allows it (Linux; root, or unprivileged user namespaces):
  * new network, PID, mount, IPC and UTS namespaces via unshare(2); unprivileged, inside a new user namespace, in
    which the code then holds no capabilities. The network namespace has only a loopback that is down: no
    connection to anything, 127.0.0.1 and the host's abstract Unix sockets included;
  * the code runs as init of the PID namespace, so when it dies the kernel kills every process it started, even
    one that called setsid() to leave the process group. The parent ends a run through the trusted waiter outside
    the namespace (init's parent, leader of the group), which SIGKILLs init without any pid-reuse race;
  * in the mount namespace every mount is read-only except the working directory, which is bind-mounted writable:
    no write anywhere else, /tmp, /dev/shm and the user's home included; /proc is a fresh one that shows only the
    sandbox's own processes;
  * as root, the code runs as `nobody` with no capabilities: host files are protected by their permissions too,
    other users' processes are out of reach (signals, /proc/<pid>/environ), and RLIMIT_NPROC is enforced (the
    kernel ignores it for root), which stops fork and thread bombs. Where the interpreter is not readable by other
    users (e.g. under a 0700 /root) the process keeps CAP_DAC_READ_SEARCH, so that it can still import the
    standard library; it can then read any file, as root could, but still writes nowhere else;
  * no_new_privs: no execve can gain privileges (setuid binaries, file capabilities).

In-interpreter guards (same process as the untrusted code; a determined program undoes them, e.g. through a
wrapper's closure or `type(sys.stdout.buffer.raw)`):
  * process creation and escape refused: os.fork/forkpty/system/popen/exec*/spawn*/posix_spawn*, the subprocess
    machinery (_posixsubprocess.fork_exec), setsid/setpgid, kill/killpg; ctypes cannot be imported;
  * networking refused: socket creation and name resolution raise PermissionError (the only network defence on a
    host that allows no namespaces);
  * writes, deletes, renames, chmods and the like outside the working directory raise PermissionError.

What this is not: a security boundary against a determined human attacker. There is no seccomp filter (the whole
kernel interface is reachable), no cgroup (RLIMIT_AS is per process, so N processes may use N times the memory,
bounded by RLIMIT_NPROC), and reads are not confined: whatever the sandbox's user can read on the host stays
readable. On a host that refuses namespaces (e.g. a container without CAP_SYS_ADMIN and without user namespaces)
only the rlimits, the group kill, the uid drop when root, and the guards remain: a program that gets past the
guards could then write wherever its user may, reach the network, or call setsid() and outlive the run. It is sized
for model-written code during RL: runaway loops, fork and memory bombs, accidental or reward-hacking file, network
and process mischief.
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


@dataclass(frozen=True)
class SandboxResult:
    """How one sandboxed run ended. `killed` is why it was stopped: "timeout", "output limit" or "cpu limit", else
    the name of the signal that ended it, else None. `cpu_time_s` is the CPU time the run used, all processes
    together. `isolation` lists the layers in force, as the child reported them before the untrusted code started.
    """

    returncode: int
    stdout: str
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
    kernel_isolation: bool = True,
    interpreter_guards: bool = True,
) -> SandboxResult:
    """Run Python `source` in a fresh, limited, isolated child interpreter (standard library only) and clean up.

    `cpu_s` defaults to `timeout_s` rounded up. `kernel_isolation=False` skips namespaces and the uid drop and
    `interpreter_guards=False` skips the guards; both exist so that tests can check each layer on its own.

    >>> result = run_sandboxed("print(6 * 7)")
    >>> result.returncode, result.stdout, result.killed
    (0, '42\\n', None)
    >>> run_sandboxed("while True: pass", timeout_s=0.5).killed
    'timeout'
    """
    outer = tempfile.mkdtemp(prefix="posttrain-sandbox-")
    workdir = os.path.join(outer, "work")
    os.mkdir(workdir, 0o700)
    drop = kernel_isolation and hasattr(os, "geteuid") and os.geteuid() == 0
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
        "keep_read_search": drop and not _others_can_run_python(),
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
            [sys.executable, "-I", "-S", "-B", "-c", f"{_bootstrap_source()}\n_child_main({config!r})\n"],
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
        data = source.encode("utf-8", "surrogatepass")
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
    if killed is None and proc.returncode < 0:
        cpu_limited = -proc.returncode in (signal.SIGKILL, signal.SIGXCPU) and cpu_time_s >= config["cpu_s"] - 0.05
        killed = "cpu limit" if cpu_limited else _signal_name(-proc.returncode)
    return SandboxResult(
        returncode=proc.returncode,
        stdout=bytes(output["stdout"][:max_output_bytes]).decode("utf-8", "replace"),
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


def _others_can_run_python() -> bool:
    """Whether a user without privileges can start this interpreter and read its standard library."""
    checks = [(sys.executable, stat.S_IXOTH), (os.path.dirname(os.__file__), stat.S_IXOTH | stat.S_IROTH)]
    for path, needed in checks:
        path = os.path.realpath(path)
        while True:
            try:
                if os.stat(path).st_mode & needed != needed:
                    return False
            except OSError:
                return False
            parent = os.path.dirname(path)
            if parent == path:
                break
            path, needed = parent, stat.S_IXOTH
    return True


@functools.cache
def _bootstrap_source() -> str:
    """The child's program: the source of the functions below, each of which imports what it needs itself."""
    return "\n\n".join(inspect.getsource(function) for function in _CHILD_FUNCTIONS)


# Everything below runs only inside the child, which gets it as source (see _bootstrap_source). Never call these
# functions in the trainer's process: they unshare namespaces, drop privileges and patch the standard library.


def _child_main(config: dict) -> None:
    """Read the program from stdin, isolate and limit this process, report the layers in force, run the program."""
    import os
    import resource

    chunks = []
    while chunk := os.read(0, 1 << 16):
        chunks.append(chunk)
    source = b"".join(chunks).decode("utf-8", "surrogatepass")
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    info = config["info_fd"]
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    layers = _unshare_namespaces(allow_userns=not config["drop"]) if config["kernel"] else []
    if "pidns" in layers:
        _fork_namespace_init(info)  # returns only in the namespace's init; its parent waits outside
    if "mountns" in layers:
        layers += _seal_filesystem(os.getcwd())
    if config["drop"]:
        dropped = _drop_privileges(config["uid"], config["gid"], config["keep_read_search"])
        if not dropped:  # the host refused: take the directory back, and still shed the capabilities
            os.chown(".", os.getuid(), os.getgid())
            dropped = _drop_capabilities()
        layers += dropped
    elif "userns" in layers:
        layers += _drop_capabilities()  # those it holds inside its user namespace, which could undo the mounts
    if config["kernel"]:
        layers += _no_new_privs()
    if "pidns" in layers:
        layers += _die_with_waiter()  # after the uid drop, which would clear it
    # RLIMIT_NPROC counts all processes of the user: meaningful for `nobody` or a fresh user namespace only.
    counted = "userns" in layers or f"uid:{config['uid']}" in layers
    layers += _set_limits(config, nproc=counted)
    if config["guards"]:
        _install_guards(os.getcwd())
        layers.append("guards")
    os.write(info, f"layers {','.join(layers)}\n".encode())
    os.close(info)  # from here on nothing the program does can add to the report
    code = compile(source, "<sandbox>", "exec")
    del chunks, source, config
    exec(code, {"__name__": "__main__", "__builtins__": __builtins__})  # noqa: S102 - running it is the point


def _unshare_namespaces(allow_userns: bool) -> list[str]:
    """New network, PID, mount, IPC and UTS namespaces (in a new user namespace when unprivileged); [] if refused."""
    import ctypes
    import os

    newnet, newpid, newns, newipc, newuts, newuser = 0x40000000, 0x20000000, 0x20000, 0x08000000, 0x04000000, 0x10000000
    try:
        unshare = ctypes.CDLL(None, use_errno=True).unshare
    except AttributeError:  # not Linux
        return []
    flags = newnet | newpid | newns | newipc | newuts
    if unshare(flags) == 0:
        return ["netns", "pidns", "mountns", "ipcns", "utsns"]
    uid, gid = os.getuid(), os.getgid()
    if not allow_userns or unshare(newuser | flags) != 0:
        return []
    # Map our own ids into the new namespace; unmapped, files this process creates could belong to no one.
    for path, text in (("/proc/self/setgroups", "deny"), ("/proc/self/uid_map", f"{uid} {uid} 1"),
                       ("/proc/self/gid_map", f"{gid} {gid} 1")):
        try:
            with open(path, "w") as f:
                f.write(text)
        except OSError:
            pass
    return ["userns", "netns", "pidns", "mountns", "ipcns", "utsns"]


def _seal_filesystem(workdir: str) -> list[str]:
    """In the new mount namespace: every mount read-only except the working directory, and a /proc of our own.

    Runs in the PID namespace's init, so that the new /proc shows only the sandbox's processes.
    """
    import ctypes
    import os

    ms_nosuid, ms_nodev, ms_noexec, ms_bind, ms_rec, ms_private = 2, 4, 8, 4096, 16384, 1 << 18
    mount_attr_rdonly, at_recursive, at_fdcwd, sys_mount_setattr = 1, 0x8000, -100, 442
    libc = ctypes.CDLL(None, use_errno=True)
    # First make every mount private to this namespace: a mount made while one is shared would show on the host.
    if libc.mount(None, b"/", None, ms_rec | ms_private, None) != 0:
        return []
    layers = ["private_mounts"]

    def set_attributes(path: bytes, set_: int, clear: int) -> bool:
        attr = (ctypes.c_uint64 * 4)(set_, clear, 0, 0)  # struct mount_attr: set, clear, propagation, userns_fd
        return libc.syscall(ctypes.c_long(sys_mount_setattr), ctypes.c_long(at_fdcwd), ctypes.c_char_p(path),
                            ctypes.c_uint(at_recursive), attr, ctypes.c_size_t(ctypes.sizeof(attr))) == 0

    work = os.fsencode(workdir)
    if libc.mount(work, work, None, ms_bind | ms_rec, None) == 0:
        os.chdir(workdir)  # onto the new mount: the old working directory still belongs to the read-only one
        if set_attributes(b"/", mount_attr_rdonly, 0):  # mount_setattr(2), Linux 5.12+
            if set_attributes(work, 0, mount_attr_rdonly):
                layers.append("readonly_root")
            else:  # a sandbox that cannot write its own directory is broken, not safer
                set_attributes(b"/", 0, mount_attr_rdonly)
    if libc.mount(b"proc", b"/proc", b"proc", ms_nosuid | ms_nodev | ms_noexec, None) == 0:
        layers.append("private_proc")
    return layers


def _fork_namespace_init(info: int) -> None:
    """Fork the new PID namespace's init, which returns to run the program, and stay outside as its waiter.

    The waiter mirrors init's exit, and on SIGTERM (the parent ending the run) SIGKILLs init, after which the kernel
    kills every process in the namespace, setsid() or not. Only the waiter can do that without a pid-reuse race: it
    is init's parent and has not reaped it. Being outside the namespace, it is out of the program's reach.
    """
    import contextlib
    import os
    import signal

    init = 0

    def stop(signum, frame):
        if init:
            os.kill(init, signal.SIGKILL)

    signal.signal(signal.SIGTERM, stop)
    init = os.fork()
    if init == 0:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        return
    os.write(info, f"pid {init}\n".encode())
    os.close(info)
    status = os.waitpid(init, 0)[1]
    if os.WIFSIGNALED(status):
        with contextlib.suppress(OSError, ValueError):  # SIGKILL and SIGSTOP have no handler to reset
            signal.signal(os.WTERMSIG(status), signal.SIG_DFL)
        os.kill(os.getpid(), os.WTERMSIG(status))
    os._exit(os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 1)


def _drop_privileges(uid: int, gid: int, keep_read_search: bool) -> list[str]:
    """Become `uid`:`gid` with no capabilities (CAP_DAC_READ_SEARCH kept if asked); [] if that is refused."""
    import ctypes
    import os

    cap_dac_read_search, pr_set_keepcaps = 2, 8
    libc = ctypes.CDLL(None, use_errno=True)
    if keep_read_search:
        with open("/proc/self/status") as f:
            effective = next((int(line.split()[1], 16) for line in f if line.startswith("CapEff:")), 0)
        # Without the capability, `nobody` could not read the interpreter's own library: better not to drop at all.
        if not effective >> cap_dac_read_search & 1 or libc.prctl(pr_set_keepcaps, 1, 0, 0, 0) != 0:
            return []
    try:
        os.setgroups([])
        os.setgid(gid)
        os.setuid(uid)
    except OSError:
        return []
    layers = [f"uid:{uid}"]
    if keep_read_search:
        header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
        bit = 1 << cap_dac_read_search
        if libc.capset(header, (ctypes.c_uint32 * 6)(bit, bit, 0, 0, 0, 0)) != 0:  # effective, permitted, inheritable
            raise SystemExit("sandbox: capset failed after the uid drop")
        libc.prctl(pr_set_keepcaps, 0, 0, 0, 0)
        layers.append("cap_dac_read_search")
    return layers


def _drop_capabilities() -> list[str]:
    """Clear every capability this process holds (in a user namespace: all of them, within it)."""
    import ctypes

    header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
    if ctypes.CDLL(None, use_errno=True).capset(header, (ctypes.c_uint32 * 6)()) != 0:
        raise SystemExit("sandbox: could not drop capabilities")
    return ["no_capabilities"]


def _die_with_waiter() -> list[str]:
    """Have the kernel SIGKILL this process (the namespace's init, and so everything in it) if the waiter dies."""
    import ctypes
    import signal

    return ["pdeathsig"] if ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0) == 0 else []


def _no_new_privs() -> list[str]:
    """Set no_new_privs: no later execve (setuid binaries, file capabilities) can gain privileges."""
    import ctypes

    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except AttributeError:  # not Linux
        return []
    return ["no_new_privs"] if prctl(38, 1, 0, 0, 0) == 0 else []  # PR_SET_NO_NEW_PRIVS


def _set_limits(config: dict, nproc: bool) -> list[str]:
    """Lower this process's rlimits (never raising one it inherited lower); names the layers that took effect."""
    import resource

    limits = {
        # Soft = hard: SIGKILL at the limit. A soft limit's SIGXCPU would be ignored by a PID namespace's init.
        "cpu": (resource.RLIMIT_CPU, config["cpu_s"], config["cpu_s"]),
        "as": (resource.RLIMIT_AS, config["memory_mb"] << 20, config["memory_mb"] << 20),
        "fsize": (resource.RLIMIT_FSIZE, config["max_file_mb"] << 20, config["max_file_mb"] << 20),
        "nofile": (resource.RLIMIT_NOFILE, config["max_open_files"], config["max_open_files"]),
        "core": (resource.RLIMIT_CORE, 0, 0),
    }
    if nproc:
        limits["nproc"] = (resource.RLIMIT_NPROC, config["max_processes"], config["max_processes"])
    applied = []
    for name, (which, soft, hard) in limits.items():
        current = resource.getrlimit(which)[1]
        if current != resource.RLIM_INFINITY:
            hard = min(hard, current)
            soft = min(soft, hard)
        try:
            resource.setrlimit(which, (soft, hard))
        except (ValueError, OSError):
            continue
        applied.append(f"rlimit_{name}")
    return applied


def _install_guards(workdir: str) -> None:
    """Refuse process creation, networking, and writes outside `workdir`, from inside Python (defence in depth)."""
    import _posixsubprocess
    import _socket
    import builtins
    import io
    import os
    import posix
    import socket
    import sys

    root = os.path.realpath(workdir)
    realpath, join, getcwd, readlink, fspath, fsdecode = (
        os.path.realpath, os.path.join, os.getcwd, os.readlink, os.fspath, os.fsdecode)

    def refuse(what):
        def refused(*args, **kwargs):
            raise PermissionError(f"sandbox: {what} is not allowed")

        return refused

    for name in ("fork", "forkpty", "system", "popen", "posix_spawn", "posix_spawnp", "execv", "execve", "execl",
                 "execle", "execlp", "execlpe", "execvp", "execvpe", "spawnv", "spawnve", "spawnvp", "spawnvpe",
                 "spawnl", "spawnle", "spawnlp", "spawnlpe", "setsid", "setpgid", "setpgrp", "kill", "killpg",
                 "pidfd_open", "unshare", "setns"):
        for module in (os, posix):
            if hasattr(module, name):
                setattr(module, name, refuse(f"os.{name}"))
    _posixsubprocess.fork_exec = refuse("starting a process")
    for name in ("socket", "SocketType", "socketpair", "fromfd", "create_connection", "create_server", "getaddrinfo",
                 "gethostbyname", "gethostbyname_ex", "gethostbyaddr", "getnameinfo"):
        for module in (socket, _socket):
            if hasattr(module, name):
                setattr(module, name, refuse(f"network access ({name})"))
    for name in ("ctypes", "_ctypes"):
        sys.modules[name] = None  # `import ctypes` now raises ImportError

    own_proc = f"/proc/{os.getpid()}"

    def check(path, dir_fd=None, write=True) -> None:
        if path is None or isinstance(path, int):  # None: the call fails by itself; an int: a descriptor already open
            return
        path = fsdecode(fspath(path))
        if path in ("/dev/null", "/dev/stdout", "/dev/stderr"):
            return
        real = realpath(join(getcwd() if dir_fd is None else readlink(f"/proc/self/fd/{dir_fd}"), path))
        # Other processes' /proc entries (environ, cmdline, mem) may hold the parent's secrets where no private
        # /proc and no uid drop hide them.
        parts = real.split("/")
        if len(parts) > 2 and parts[1] == "proc" and parts[2].isdigit() and not real.startswith(own_proc):
            raise PermissionError(f"sandbox: cannot open {path!r}, another process's")
        if write and real != root and not real.startswith(root + "/"):
            raise PermissionError(f"sandbox: cannot modify {path!r}, outside the working directory")

    real_open, real_os_open = io.open, os.open
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND

    def guarded_open(file, mode="r", *args, **kwargs):
        check(file, write=not isinstance(mode, str) or any(c in mode for c in "wax+"))
        return real_open(file, mode, *args, **kwargs)

    def guarded_os_open(path, flags, mode=0o777, *, dir_fd=None):
        check(path, dir_fd, write=bool(flags & write_flags))
        return real_os_open(path, flags, mode, dir_fd=dir_fd)

    builtins.open = io.open = guarded_open
    os.open = posix.open = guarded_os_open

    def guard(real, params):
        def guarded(*args, **kwargs):
            for i, (param, dir_fd) in enumerate(params):
                if param is not None:
                    check(args[i] if i < len(args) else kwargs.get(param), kwargs.get(dir_fd))
            return real(*args, **kwargs)

        return guarded

    one = (("path", "dir_fd"),)
    two = (("src", "src_dir_fd"), ("dst", "dst_dir_fd"))
    for name, params in {"remove": one, "unlink": one, "rmdir": one, "mkdir": one, "chmod": one, "chown": one,
                         "lchown": one, "truncate": one, "utime": one, "mkfifo": one, "mknod": one, "setxattr": one,
                         "removexattr": one, "rename": two, "replace": two, "link": two,
                         "symlink": ((None, None), ("dst", "dir_fd"))}.items():
        if hasattr(os, name):
            setattr(os, name, guard(getattr(os, name), params))
            setattr(posix, name, getattr(os, name))


_CHILD_FUNCTIONS = (_child_main, _unshare_namespaces, _seal_filesystem, _fork_namespace_init, _drop_privileges,
                    _drop_capabilities, _die_with_waiter, _no_new_privs, _set_limits, _install_guards)
