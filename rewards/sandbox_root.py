"""The sandbox's own root: what the child builds in its new mount namespace before the untrusted code runs.

Like rewards.sandbox_child, these functions reach the child as source text (ROOT_FUNCTIONS), so each imports what
it needs and none relies on module globals; mount flags are spelled as numbers with their names beside them.
Never call them in the trainer's process.
"""


def _build_root(workdir: str, config: dict) -> list[str]:
    """In the new mount namespace, switch to a root that holds only what the program needs; the layers it made.

    The root is an empty tmpfs, read-only once built, holding: the interpreter and its standard library (without
    site-packages) and the shared libraries it loads, read-only, at their host paths; /etc/ld.so.cache, so that the
    standard library's extension modules find their libraries as on the host; /dev/null, zero, full, random and
    urandom; a fresh /proc (this runs in the PID namespace's init, so it shows only the sandbox's processes); a
    private, size-limited /tmp; and the working directory, writable, at its host path. Nothing else of the host:
    no home directory, no project checkout, no /etc beyond the loader's cache, no old root.

    Runs with the mount namespace's capabilities (as root, or in a user namespace). Exits the process, naming the
    step and errno, where the root cannot be built: code must not run with the host's files in view because one
    mount failed.
    """
    import ctypes
    import os

    nosuid, nodev, noexec, rdonly, remount, bind, rec, private = 2, 4, 8, 1, 32, 4096, 16384, 1 << 18
    # First make every mount private to this namespace: a mount made while one is shared would show on the host.
    _mount(None, "/", None, rec | private, step="make mounts private")
    new = config["root_dir"]
    _mount("tmpfs", new, "tmpfs", nosuid | nodev, "size=1m,nr_inodes=4096,mode=755", step="root tmpfs")
    _bind_read_only(new, _root_binds())
    _make_dev(new)
    layers = ["private_root"]
    _make_path(new, "/proc", directory=True)
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.mount(b"proc", os.fsencode(new + "/proc"), b"proc", nosuid | nodev | noexec, None) == 0:
        layers.append("private_proc")  # where refused, /proc stays an empty directory: the host's is not in view
    _make_path(new, "/tmp", directory=True)
    _mount("tmpfs", new + "/tmp", "tmpfs", nosuid | nodev, f"size={config['tmp_mb']}m,nr_inodes=4096,mode=1777",
           step="/tmp tmpfs")
    layers.append("private_tmp")
    _make_path(new, workdir, directory=True)
    _mount(workdir, new + workdir, None, bind | rec, step="bind the working directory")
    _mount(None, new, None, remount | rdonly | nosuid | nodev, step="read-only root")
    layers.append("readonly_root")
    _enter_root(new, workdir)
    return layers


def _mount(source, target: str, fstype, flags: int, data=None, step: str = "") -> None:
    """mount(2), or exit naming the step and the error."""
    import ctypes
    import os

    def encode(text):
        return None if text is None else os.fsencode(text)

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.mount(encode(source), encode(target), encode(fstype), flags, encode(data)) != 0:
        errno = ctypes.get_errno()
        raise SystemExit(f"sandbox: could not build its root: {step or f'mount {target}'}: {os.strerror(errno)} "
                         f"(errno {errno})")


def _read_only(target: str) -> None:
    """Make a mount read-only, nosuid and nodev: mount_setattr(2) (Linux 5.12+), else a bind remount."""
    import ctypes
    import os

    libc = ctypes.CDLL(None, use_errno=True)
    attr = (ctypes.c_uint64 * 4)(1 | 2 | 4, 0, 0, 0)  # MOUNT_ATTR_RDONLY | NOSUID | NODEV; clear, propagation, fd
    at_fdcwd, at_recursive = -100, 0x8000
    if libc.syscall(ctypes.c_long(442), ctypes.c_int(at_fdcwd),  # mount_setattr: 442 on every architecture
                    ctypes.c_char_p(os.fsencode(target)), ctypes.c_uint(at_recursive), attr,
                    ctypes.c_size_t(ctypes.sizeof(attr))) == 0:
        return
    # A remount must keep the flags the kernel locked on the host's mount (nosuid, noexec, atime...).
    locked = {os.ST_NOSUID: 2, os.ST_NODEV: 4, os.ST_NOEXEC: 8, os.ST_NOATIME: 1024, os.ST_NODIRATIME: 2048,
              os.ST_RELATIME: 1 << 21}
    kept = sum(flag for st, flag in locked.items() if os.statvfs(target).f_flag & st)
    _mount(None, target, None, 32 | 4096 | 1 | 2 | 4 | kept, step=f"read-only {target}")  # REMOUNT|BIND|RDONLY|..


def _root_binds() -> dict[str, str]:
    """Path in the new root -> host path: the interpreter, the directories on its path, the shared libraries."""
    import os
    import sys

    binds = {os.path.realpath(sys.executable): os.path.realpath(sys.executable)}
    for entry in sys.path:
        if os.path.isdir(entry):
            binds[entry] = os.path.realpath(entry)
    with open("/proc/self/maps") as f:
        mapped = {line.split(None, 5)[5].strip() for line in f if len(line.split(None, 5)) == 6}
    library_dirs = {os.path.dirname(path) for path in mapped if path.startswith("/") and ".so" in path}
    for path in ("/lib", "/lib64", "/lib32", "/libx32", "/usr/lib", "/usr/lib64", "/usr/lib32", *library_dirs):
        if os.path.isdir(path):
            binds[path] = os.path.realpath(path)
    if os.path.isfile("/etc/ld.so.cache"):
        binds["/etc/ld.so.cache"] = "/etc/ld.so.cache"
    return binds


def _bind_read_only(new: str, binds: dict[str, str]) -> None:
    """Bind each host path into the new root, read-only; hide the site-packages of the directories on sys.path."""
    import os
    import sys

    covered: list[str] = []
    for target in sorted(binds):  # a parent sorts before what it holds
        if any(target == done or target.startswith(done.rstrip("/") + "/") for done in covered):
            continue
        if os.path.islink(target) and os.path.dirname(target) == "/":  # /lib -> usr/lib on merged-/usr hosts
            os.symlink(os.readlink(target), new + target)
            covered.append(target)  # what the link points to is bound on its own
            continue
        _make_path(new, target, directory=os.path.isdir(binds[target]))
        _mount(binds[target], new + target, None, 4096 | 16384)  # MS_BIND | MS_REC
        _read_only(new + target)
        covered.append(target)
    for entry in sys.path:  # installed packages are not the standard library
        for name in ("site-packages", "dist-packages"):
            if os.path.isdir(os.path.join(entry, name)):
                _mount("tmpfs", new + os.path.join(entry, name), "tmpfs", 2 | 4 | 1,  # NOSUID | NODEV | RDONLY
                       "size=4k,nr_inodes=1,mode=555")


def _make_dev(new: str) -> None:
    """/dev with null, zero, full, random and urandom (bound from the host: a user namespace cannot mknod), and
    the usual links into /proc/self/fd."""
    import os

    _make_path(new, "/dev", directory=True)
    for name in ("null", "zero", "full", "random", "urandom"):
        _make_path(new, f"/dev/{name}", directory=False)
        _mount(f"/dev/{name}", new + f"/dev/{name}", None, 4096)  # MS_BIND
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
                         ("stderr", "/proc/self/fd/2")):
        os.symlink(target, new + f"/dev/{name}")


def _make_path(new: str, path: str, directory: bool) -> None:
    """Create `path` inside the new root: a directory, or an empty file to bind a file onto."""
    import os

    os.makedirs(new + path if directory else os.path.dirname(new + path), mode=0o755, exist_ok=True)
    if not directory and not os.path.exists(new + path):
        os.close(os.open(new + path, os.O_WRONLY | os.O_CREAT, 0o644))


def _enter_root(new: str, workdir: str) -> None:
    """Make `new` the root and leave nothing of the host's above it; then go to the working directory."""
    import ctypes
    import os

    libc = ctypes.CDLL(None, use_errno=True)
    os.chdir(new)
    # pivot_root(".", ".") stacks the old root on the new one; detaching it leaves nothing of the host above us.
    # (The syscall number by machine: os.uname, not the platform module, whose import costs more than all this.)
    pivot = {"x86_64": 155, "aarch64": 41, "riscv64": 41, "ppc64le": 203, "s390x": 217}.get(os.uname().machine)
    if pivot is not None and libc.syscall(ctypes.c_long(pivot), b".", b".") == 0:
        if libc.umount2(b".", 2) != 0:  # MNT_DETACH
            errno = ctypes.get_errno()
            raise SystemExit(f"sandbox: could not build its root: detach the old root: {os.strerror(errno)}")
    else:  # no pivot_root here: move the new root over / and chroot into it (what switch_root does)
        _mount(".", "/", None, 8192, step="move the root")  # MS_MOVE
        if libc.chroot(b".") != 0:
            raise SystemExit(f"sandbox: could not build its root: chroot: {os.strerror(ctypes.get_errno())}")
    os.chdir(workdir)


ROOT_FUNCTIONS = (_build_root, _mount, _read_only, _root_binds, _bind_read_only, _make_dev, _make_path, _enter_root)
