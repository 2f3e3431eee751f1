"""The sandbox's child side: what runs inside the child process before the untrusted code (rewards.sandbox).

The child receives these functions as source text (rewards.sandbox builds its `-c` program from CHILD_FUNCTIONS),
so each imports what it needs itself and nothing here may rely on module globals. Never call them in the
trainer's process: they unshare namespaces, drop privileges and patch the standard library. The root the child
builds for itself is in rewards.sandbox_root.
"""

from rewards.sandbox_root import ROOT_FUNCTIONS

def _child_main(config: dict) -> None:
    """Read the program from stdin, isolate and limit this process, report the layers in force, run the program.

    Stdin starts with the program's length in bytes on a line of its own, then the program; whatever follows is the
    program's own input (empty unless the parent sent some).
    """
    import os
    import resource

    header = b""
    while not header.endswith(b"\n") and len(header) < 24:
        header += os.read(0, 1)
    size, chunks = int(header), []
    while size > 0 and (chunk := os.read(0, min(size, 1 << 16))):
        chunks.append(chunk)
        size -= len(chunk)
    source = b"".join(chunks).decode("utf-8", "surrogatepass")
    chunks = []
    while chunk := os.read(0, 1 << 16):  # the parent closes the pipe after the input
        chunks.append(chunk)
    stdin = b"".join(chunks)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    info = config["info_fd"]
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    layers = _unshare_namespaces(allow_userns=not config["drop"]) if config["kernel"] else []
    if "pidns" in layers:
        _fork_namespace_init(info)  # returns only in the namespace's init; its parent waits outside
    if "mountns" in layers:
        layers += _build_root(os.getcwd(), config)
    if config["kernel"]:
        layers += _drop_capability_bounds()  # while this process may still change them: before the uid drop
    if config["drop"]:
        dropped = _drop_privileges(config["uid"], config["gid"])
        if not dropped:  # the host refused: take the directory back, and still shed the capabilities
            os.chown(".", os.getuid(), os.getgid())
        layers += dropped
    if config["kernel"] or config["drop"]:
        layers += _drop_capabilities()  # those left (in a user namespace: all of them within it)
    if config["kernel"]:
        layers += _no_new_privs()
    if "pidns" in layers:
        layers += _die_with_waiter()  # after the uid drop, which would clear it
    if stdin:
        _input_on_stdin(stdin)  # now: the descriptor belongs to the user the program runs as
    # RLIMIT_NPROC counts all processes of the user: meaningful for `nobody` or a fresh user namespace only.
    counted = "userns" in layers or f"uid:{config['uid']}" in layers
    layers += _set_limits(config, nproc=counted)
    if config["guards"]:
        _install_guards(os.getcwd(), private_tmp="private_tmp" in layers)
        layers.append("guards")
    os.write(info, f"layers {','.join(layers)}\n".encode())
    os.close(info)  # from here on nothing the program does can add to the report
    code = compile(source, "<sandbox>", "exec")
    del chunks, source, stdin, config
    exec(code, {"__name__": "__main__", "__builtins__": __builtins__})  # noqa: S102 - running it is the point


def _input_on_stdin(data: bytes) -> None:
    """Put `data` on file descriptor 0, in an anonymous file this process owns, so `open("/dev/stdin")` works too."""
    import os

    fd = os.memfd_create("stdin")
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
    os.lseek(fd, 0, os.SEEK_SET)
    os.dup2(fd, 0)
    os.close(fd)


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


def _drop_privileges(uid: int, gid: int) -> list[str]:
    """Become `uid`:`gid` with no supplementary groups, which clears every capability; [] if that is refused."""
    import os

    try:
        os.setgroups([])
        os.setgid(gid)
        os.setuid(uid)
    except OSError:
        return []
    return [f"uid:{uid}"]


def _drop_capability_bounds() -> list[str]:
    """Empty the capability bounding set and the ambient set: no later execve can regain a capability.

    Needs CAP_SETPCAP (root, or the owner of a user namespace); an ordinary user without namespaces holds no
    capabilities to begin with, and then this reports nothing.
    """
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    pr_capbset_drop, pr_cap_ambient, pr_cap_ambient_clear_all, einval = 24, 47, 4, 22
    try:
        with open("/proc/sys/kernel/cap_last_cap") as f:
            last = int(f.read())
    except (OSError, ValueError):
        last = 63  # past the last one the kernel knows, dropping fails with EINVAL, which is fine
    for cap in range(last + 1):
        if libc.prctl(pr_capbset_drop, cap, 0, 0, 0) != 0 and ctypes.get_errno() != einval:
            return []
    libc.prctl(pr_cap_ambient, pr_cap_ambient_clear_all, 0, 0, 0)
    return ["empty_bounding_set"]


def _drop_capabilities() -> list[str]:
    """Clear the effective, permitted and inheritable sets; reports `no_capabilities` only when /proc/self/status
    then shows all five sets (effective, permitted, inheritable, bounding, ambient) empty."""
    import ctypes

    header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
    if ctypes.CDLL(None, use_errno=True).capset(header, (ctypes.c_uint32 * 6)()) != 0:
        raise SystemExit("sandbox: could not drop capabilities")
    try:
        with open("/proc/self/status") as f:
            sets = {line.split(":")[0]: int(line.split()[1], 16) for line in f if line.startswith("Cap")}
    except OSError:
        return []
    return ["no_capabilities"] if len(sets) == 5 and not any(sets.values()) else []


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


def _install_guards(workdir: str, private_tmp: bool) -> None:
    """Refuse process creation, networking, and writes outside `workdir` (and the sandbox's own /tmp where it has
    one), from inside Python (defence in depth)."""
    import _posixsubprocess
    import _socket
    import os
    import posix
    import socket
    import sys

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

    _guard_files(workdir, private_tmp)


def _guard_files(workdir: str, private_tmp: bool) -> None:
    """Refuse, from inside Python, opening another process's /proc entries and writing outside `workdir` (and the
    sandbox's own /tmp where it has one): open, os.open, and the calls that delete, rename, chmod or link."""
    import builtins
    import io
    import os
    import posix

    writable = (os.path.realpath(workdir), "/tmp") if private_tmp else (os.path.realpath(workdir),)
    realpath, join, getcwd, readlink, fspath, fsdecode = (
        os.path.realpath, os.path.join, os.getcwd, os.readlink, os.fspath, os.fsdecode)
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
        if write and not any(real == place or real.startswith(place + "/") for place in writable):
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


CHILD_FUNCTIONS = (_child_main, _input_on_stdin, _unshare_namespaces, *ROOT_FUNCTIONS, _fork_namespace_init,
                   _drop_privileges, _drop_capability_bounds, _drop_capabilities, _die_with_waiter, _no_new_privs,
                   _set_limits, _install_guards, _guard_files)
