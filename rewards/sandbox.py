"""Run untrusted Python (model-written code) in a child process that is limited, isolated, and always cleaned up.

Layers, outermost first. The kernel enforces the first two groups; the last is a guard inside the child's own
interpreter, which code in that interpreter can get around, so it is defence in depth and nothing more.
`SandboxResult.isolation` names the layers that were in force for a run, as the child reported them (on a pipe it
closes) before the untrusted code started. The child's side is rewards.sandbox_child (its root: rewards.sandbox_root);
the parent's process plumbing is rewards.sandbox_process.

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

import functools
import inspect
import math
import os
import signal
import stat
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

from rewards.sandbox_child import CHILD_FUNCTIONS
from rewards.sandbox_process import end_group, pump, remove_tree, signal_name

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

    `stdin`: the program's input. `cpu_s` defaults to `timeout_s` rounded up; `tmp_mb` sizes the private /tmp.
    `kernel_isolation=False` (no namespaces, no uid drop) and `interpreter_guards=False` let tests check each layer.

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
    outer, workdir = _make_directories(drop)
    info_r, info_w = os.pipe()
    config = {
        "info_fd": info_w, "kernel": kernel_isolation, "guards": interpreter_guards, "drop": drop,
        "uid": SANDBOX_UID, "gid": SANDBOX_GID, "root_dir": os.path.join(outer, "root"), "tmp_mb": tmp_mb,
        "cpu_s": cpu_s if cpu_s is not None else max(1, math.ceil(timeout_s)), "memory_mb": memory_mb,
        "max_file_mb": max_file_mb, "max_open_files": max_open_files, "max_processes": max_processes,
    }
    start = time.monotonic()
    try:
        proc = _start_child(interpreter, config, workdir)
    except BaseException:
        os.close(info_r)
        remove_tree(outer)
        raise
    finally:
        os.close(info_w)
    output = {"stdout": bytearray(), "stderr": bytearray(), "info": bytearray()}
    killed = None
    try:
        program = source.encode("utf-8", "surrogatepass")
        data = b"%d\n" % len(program) + program + stdin  # the child reads exactly the program; the rest is its input
        killed = pump(proc, data, info_r, output, start + timeout_s, max_output_bytes)
    finally:
        info = _parse_info(bytes(output["info"]))
        try:
            cpu_time_s = end_group(proc, info.get("pid"))
        finally:
            for stream in (proc.stdin, proc.stdout, proc.stderr):
                if stream is not None and not stream.closed:
                    stream.close()
            os.close(info_r)
            remove_tree(outer)
    if kernel_isolation and not info.get("layers") and (error := _bootstrap_error(output["stderr"])):
        raise RuntimeError(f"the code sandbox could not start on this host: {error}")
    if killed is None and proc.returncode < 0:
        cpu_limited = -proc.returncode in (signal.SIGKILL, signal.SIGXCPU) and cpu_time_s >= config["cpu_s"] - 0.05
        killed = "cpu limit" if cpu_limited else signal_name(-proc.returncode)
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


def _make_directories(drop: bool) -> tuple[str, str]:
    """A run's directory: the working directory the code may write, and the mount point of the child's own root."""
    outer = tempfile.mkdtemp(prefix="posttrain-sandbox-")
    workdir = os.path.join(outer, "work")
    os.mkdir(workdir, 0o700)
    os.mkdir(os.path.join(outer, "root"), 0o700)
    if drop:
        # The parent directory stays root's: `nobody` cannot rename its working directory away and leave a
        # symlink in its place for the cleanup to follow.
        os.chmod(outer, 0o711)
        os.chown(workdir, SANDBOX_UID, SANDBOX_GID)
    return outer, workdir


def _start_child(interpreter: str, config: dict, workdir: str) -> subprocess.Popen:
    """Start the child interpreter on the bootstrap program; it isolates and limits itself before anything else
    (no preexec_fn: that is unsafe in a threaded parent, and trainers are)."""
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8"}
    return subprocess.Popen(
        [interpreter, "-I", "-S", "-B", "-c", f"{_bootstrap_source()}\n_child_main({config!r})\n"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=workdir, env=env,
        start_new_session=True, pass_fds=(config["info_fd"],),
    )


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

    return "\n\n".join(inspect.getsource(function) for function in CHILD_FUNCTIONS)
