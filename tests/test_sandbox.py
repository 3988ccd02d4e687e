"""Adversarial programs against the code sandbox: each case has a bounded run time and the right
verdict, and afterwards no process of ours is left and nothing outside temp dirs changed."""

from __future__ import annotations

import dataclasses
import os
import shutil
import socket
import time
from pathlib import Path

import pytest

from klear.rewards.code_reward import parse_ground_truth, run_tests
from klear.rewards.sandbox import Sandbox, SandboxConfig

IS_ROOT = os.geteuid() == 0
needs_root = pytest.mark.skipif(not IS_ROOT, reason="uid separation needs root (see klear.rewards.sandbox docs)")

CFG = SandboxConfig(time_limit_s=1.5, program_time_limit_s=20.0, memory_bytes=1 << 30, max_output_bytes=1 << 20)


MODES = ["native"] + (["bwrap"] if shutil.which("bwrap") else [])


@pytest.fixture(scope="module", params=MODES)
def box(request):
    """A sandbox per isolation mode available here (native always; bubblewrap when installed)."""
    b = Sandbox(dataclasses.replace(CFG, isolation=request.param))
    assert ("bubblewrap" in b.isolation) == (request.param == "bwrap")
    yield b
    b.close()


def _our_processes(box: Sandbox) -> list[str]:
    """Processes (incl. zombies) owned by *box*'s pool uid (other sandboxes, e.g. concurrent test runs, hold
    other uids of the pool)."""
    assert box.uid is not None, "only called as root, where every Sandbox holds a pool uid"
    out = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            st = os.stat(f"/proc/{pid}")
            if st.st_uid == box.uid:
                with open(f"/proc/{pid}/stat") as f:
                    out.append(f.read()[:80])
        except OSError:
            continue
    return out


def _leftovers(box: Sandbox, grace_s: float = 2.0) -> list[str]:
    """:func:`_our_processes` once they are gone, else after *grace_s* seconds: the zygote SIGKILLs what a run
    left behind before it reports the exit, but a killed process needs a moment to leave the process table."""
    deadline = time.monotonic() + grace_s
    while (left := _our_processes(box)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


def stdio(program: str, inputs=("",), outputs=("ok\n",), **kw):
    gt = {"format": "stdio", "inputs": list(inputs), "outputs": list(outputs), **kw}
    return program, parse_ground_truth(gt)


def verdicts(box, program, tests, **kw):
    t0 = time.monotonic()
    statuses, detail = run_tests(program, tests, sandbox=box, **kw)
    return statuses, time.monotonic() - t0


# ----------------------------------------------------------------------------- resource abuse

ADVERSARIAL = {
    "infinite_loop": ("while True:\n    pass\n", "timeout"),
    "ignores_sigterm": (
        "import signal\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\nwhile True:\n    pass\n",
        "timeout",
    ),
    "fork_bomb": ("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n", None),
    "memory_bomb": ("x = []\nwhile True:\n    x.append(bytearray(50 << 20))\n", None),
    "output_flood_1gb": (
        "import sys\nfor _ in range(16384):\n    sys.stdout.write('x' * 65536)\nprint('ok')\n",
        "output_limit",
    ),
    "deep_recursion": ("import sys\nsys.setrecursionlimit(10**8)\ndef f(n):\n    return f(n + 1)\nf(0)\n", None),
    "daemon_escapes_group": (
        "import os, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n        time.sleep(60)\n"
        "    os._exit(0)\nprint('ok')\n",
        "pass",
    ),
}


@pytest.mark.parametrize("name", sorted(ADVERSARIAL))
def test_adversarial_resource_abuse(box, name):
    program, expected = ADVERSARIAL[name]
    prog, tests = stdio(program)
    statuses, wall = verdicts(box, prog, tests)
    if expected == "pass":  # a correct answer from a program that leaves a daemon behind
        assert statuses == ["pass"]
    else:
        assert statuses[0] != "pass", statuses
        if expected:
            assert statuses == [expected]
    assert wall < CFG.time_limit_s + 8, f"{name} took {wall:.1f} s"
    if IS_ROOT:
        assert _leftovers(box) == []


# ---------------------------------------------------------------------------- escape attempts


def test_environment_is_scrubbed(box, monkeypatch):
    monkeypatch.setenv("KLEAR_TEST_SECRET", "s3cr3t-token")
    prog, tests = stdio("import os\nprint(os.environ.get('KLEAR_TEST_SECRET'))\n", outputs=["s3cr3t-token\n"])
    assert verdicts(box, prog, tests)[0] == ["wrong_answer"]
    prog, tests = stdio(
        "import os\nprint(sorted(os.environ))\n",
        outputs=[
            str(
                sorted(
                    [
                        "HOME",
                        "LANG",
                        "LC_ALL",
                        "MKL_NUM_THREADS",
                        "NUMEXPR_NUM_THREADS",
                        "OMP_NUM_THREADS",
                        "OPENBLAS_NUM_THREADS",
                        "PATH",
                        "PYTHONHASHSEED",
                        "TMPDIR",
                        "VECLIB_MAXIMUM_THREADS",
                    ]
                )
            )
            + "\n"
        ],
    )
    assert verdicts(box, prog, tests)[0] == ["pass"]


def _host_file(directory: Path, dir_mode: int, name: str, text: str) -> Path:
    """A file of the host outside the sandbox: ``directory / name`` holding ``text``, in a new directory of mode
    ``dir_mode``."""
    directory.mkdir(mode=dir_mode)
    path = directory / name
    path.write_text(text)
    return path


@needs_root
def test_cannot_read_files_outside(box, tmp_path):
    secret = _host_file(tmp_path / "private", 0o700, "answer.txt", "42\n")
    os.chmod(secret, 0o600)
    prog, tests = stdio(f"print(open({str(secret)!r}).read().strip())\n", outputs=["42\n"])
    assert verdicts(box, prog, tests)[0] == ["runtime_error"]
    # the home of root (where pyenv/conda interpreters often live) is hidden too: a child sees in it only the
    # entries that hold the interpreter, and no /root at all when the interpreter lives elsewhere
    visible = _interpreter_entries_under("/root")
    program = (
        "import os\ntry:\n    print(sorted(os.listdir('/root')))\nexcept FileNotFoundError:\n    print('absent')\n"
    )
    prog, tests = stdio(program, outputs=[f"{visible}\n" if visible else "absent\n"])
    assert verdicts(box, prog, tests)[0] == ["pass"]
    hidden = sorted(e for e in os.listdir("/root") if e not in visible and os.path.isfile(f"/root/{e}"))
    if hidden:  # a file of root's home that the host has: not there for the child
        prog, tests = stdio(f"print(len(open('/root/{hidden[0]}').read()))\n", outputs=["x\n"])
        statuses, detail = run_tests(prog, tests, sandbox=box)
        assert statuses == ["runtime_error"] and "FileNotFoundError" in detail, (statuses, detail)


def _interpreter_entries_under(home: str) -> list[str]:
    """Top-level entries of *home* holding the interpreter (prefixes, site-packages) or klear's sandbox zygote:
    the only host paths outside the system directories that the sandbox's minimal root binds."""
    import site
    import sys

    import klear.rewards

    paths = [
        sys.prefix,
        sys.base_prefix,
        sys.exec_prefix,
        *site.getsitepackages(),
        os.path.dirname(klear.rewards.__file__),
    ]
    entries = set()
    for p in paths:
        rel = os.path.relpath(os.path.realpath(p), home)
        if rel != "." and not rel.startswith(".."):
            entries.add(rel.split(os.sep)[0])
    return sorted(entries)


@needs_root
def test_cannot_write_or_delete_outside(box, tmp_path):
    keep = _host_file(tmp_path / "shared", 0o755, "keep.txt", "original")
    target_dir = keep.parent
    program = (
        "import os\n"
        f"d = {str(target_dir)!r}\n"
        "errors = 0\n"
        "for action in (lambda: open(os.path.join(d, 'pwned.txt'), 'w').write('x'),\n"
        "               lambda: os.remove(os.path.join(d, 'keep.txt')),\n"
        "               lambda: open(os.path.join(d, 'keep.txt'), 'w').write('changed'),\n"
        f"               lambda: open({str(Path.cwd() / 'pwned.txt')!r}, 'w').write('x')):\n"
        "    try:\n        action()\n    except OSError:\n        errors += 1\n"
        "print(errors)\n"
    )
    prog, tests = stdio(program, outputs=["4\n"])
    assert verdicts(box, prog, tests)[0] == ["pass"]  # all four attempts were refused
    assert keep.read_text() == "original"
    assert sorted(p.name for p in target_dir.iterdir()) == ["keep.txt"]
    assert not (Path.cwd() / "pwned.txt").exists()


def test_no_network(box):
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    srv.settimeout(0.3)
    port = srv.getsockname()[1]
    program = f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=1)\nprint('connected')\n"
    prog, tests = stdio(program, outputs=["connected\n"])
    statuses, _ = verdicts(box, prog, tests)
    try:
        conn, _ = srv.accept()
        conn.close()
        reached = True
    except TimeoutError:
        reached = False
    srv.close()
    if "NOT isolated" in box.isolation:
        pytest.skip(f"network isolation unavailable here: {box.isolation}")
    assert statuses == ["runtime_error"] and not reached


def test_early_exit_and_fake_markers_never_pass(box):
    # stdio: a crash with an empty expected output is a failure, not a pass
    prog, tests = stdio("import sys\nsys.stdout.flush()\nraise SystemExit(3)\n", outputs=[""])
    assert verdicts(box, prog, tests)[0] == ["runtime_error"]
    prog, tests = stdio("import os\nos.kill(os.getpid(), 9)\n", outputs=[""])
    assert verdicts(box, prog, tests)[0] == ["signal"]
    # assert-style: exit before the tests / inside the function / fake success output
    gt = {"format": "assert", "test": "def check(candidate):\n    assert candidate(2) == 4\n", "entry_point": "f"}
    cases = {
        "sys_exit_on_load": "import sys\nsys.exit(0)\ndef f(x):\n    return x * x\n",
        "os_exit_in_call": "import os\ndef f(x):\n    os._exit(0)\n",
        "print_markers": "print('ALL TESTS PASSED')\nprint('PASSED')\ndef f(x):\n    return 0\n",
        "override_builtins": (
            "import builtins\nbuiltins.print = lambda *a, **k: None\nbuiltins.exit = lambda *a: None\n"
            "builtins.AssertionError = type('AE', (Exception,), {})\n"
            "def f(x):\n    return 5\n"
        ),
        "always_equal": (
            "class Liar:\n    def __eq__(self, other):\n        return True\n    __hash__ = None\n"
            "def f(x):\n    return Liar()\n"
        ),
        "int_subclass_liar": (
            "class L(int):\n    def __eq__(self, other):\n        return True\ndef f(x):\n    return L(7)\n"
        ),
        "write_result_fd": (
            "import os, json, struct\n"
            "def f(x):\n    d = json.dumps({'ok': True, 'verdict': 'pass', 'passed': 1, 'total': 1}).encode()\n"
            "    os.write(4, struct.pack('>I', len(d)) + d)\n    os._exit(0)\n"
        ),
        "rpc_lie_then_crash": (
            "import os, json, struct\n"
            "d = json.dumps({'op': 'loaded', 'ok': True, 'names': {'f': 'function'}}).encode()\n"
            "os.write(4, struct.pack('>I', len(d)) + d)\n"
            "d = json.dumps({'ok': True, 'value': {'$t': 'obj', 'cls': 'object', 'id': 1, 'v': {}}}).encode()\n"
            "os.write(4, struct.pack('>I', len(d)) + d)\nos._exit(0)\n"
        ),
    }
    tests = parse_ground_truth(gt)
    for name, program in cases.items():
        statuses, wall = verdicts(box, program, tests)
        assert statuses != ["pass"], name
        assert wall < 8, name
    # and the honest program passes, so the harness itself works
    assert verdicts(box, "def f(x):\n    return x * x\n", tests)[0] == ["pass"]


def test_cannot_hijack_test_helpers_or_builtins(box):
    prefix = "def poly(xs, x):\n    return sum(c * x ** i for i, c in enumerate(xs))\n"
    gt = {
        "format": "assert",
        "prefix": prefix,
        "entry_point": "find_zero",
        "test": "def check(candidate):\n    assert abs(poly([-6, 1], candidate([-6, 1]))) < 1e-6\n",
    }
    tests = parse_ground_truth(gt)
    cheat = "def poly(xs, x):\n    return 0\ndef abs(x):\n    return 0\ndef find_zero(xs):\n    return 123.0\n"
    assert verdicts(box, cheat, tests)[0] == ["wrong_answer"]
    assert verdicts(box, "def find_zero(xs):\n    return 6.0\n", tests)[0] == ["pass"]


def test_cannot_read_the_test_data(box):
    """Expected outputs never reach the sandbox: a program that dumps everything it can find
    (its directory, parent dirs, /proc of other processes, stdin) still cannot print them."""
    expected = "klear-expected-" + os.urandom(8).hex()
    program = (
        "import os, sys\n"
        "found = []\n"
        "data = sys.stdin.read()\n"
        "for root in ('.', '..', '/tmp'):\n"
        "    try:\n        names = os.listdir(root)\n    except OSError:\n        continue\n"
        "    for n in names:\n"
        "        try:\n            found.append(open(os.path.join(root, n), errors='replace').read(100000))\n"
        "        except OSError:\n            pass\n"
        "for pid in os.listdir('/proc'):\n"
        "    for part in ('cmdline', 'environ'):\n"
        "        try:\n            found.append(open(f'/proc/{pid}/{part}', errors='replace').read())\n"
        "        except OSError:\n            pass\n"
        "blob = ' '.join(found)\n"
        "import re\n"
        "m = re.search(r'klear-expected-[0-9a-f]{16}', blob)\n"
        "print(m.group(0) if m else 'nothing')\n"
    )
    prog, tests = stdio(program, inputs=["hello\n"], outputs=[expected + "\n"])
    statuses, wall = verdicts(box, prog, tests)
    assert statuses == ["wrong_answer"]


def test_no_stray_processes_and_workdirs_emptied():
    with Sandbox(CFG) as b:
        prog, tests = stdio(
            "import os, time\nfor _ in range(3):\n    if os.fork() == 0:\n        time.sleep(30)\n"
            "open('junk.txt', 'w').write('x')\nos.mkdir('sub')\nos.symlink('/etc/passwd', 'link')\n"
            "print('ok')\n"
        )
        assert verdicts(b, prog, tests)[0] == ["pass"]
        wd = b._workdir
        assert wd is not None and list(wd.iterdir()) == []  # emptied after the program
        assert Path("/etc/passwd").exists()
        if IS_ROOT:
            assert _leftovers(b) == []
    assert not wd.exists()  # close() removes it


def test_sandbox_config_rejects_bad_values():
    with pytest.raises(ValueError, match="time_limit_s"):
        SandboxConfig(time_limit_s=0)
    with pytest.raises(ValueError, match="memory_bytes"):
        SandboxConfig(memory_bytes=-1)


@needs_root
def test_world_readable_host_files_and_leftovers_are_invisible(box):
    """Only system dirs and the interpreter are visible: not the repository, data sets or /tmp;
    and nothing a program leaves in /tmp, /dev/shm or its work dir reaches the next program."""
    secret = Path.cwd() / ".klear-test-visible-secret"
    secret.write_text("42\n")
    os.chmod(secret, 0o644)
    try:
        prog, tests = stdio(f"print(open({str(secret)!r}).read().strip())\n", outputs=["42\n"])
        assert verdicts(box, prog, tests)[0] == ["runtime_error"]
    finally:
        secret.unlink()
    writer = (
        "import os\nfor d in ('/tmp', '/dev/shm', '.'):\n    open(os.path.join(d, 'left.txt'), 'w').write('x')\n"
        "print('ok')\n"
    )
    prog, tests = stdio(writer)
    assert verdicts(box, prog, tests)[0] == ["pass"]
    reader = "import os\nprint(sum(os.path.exists(os.path.join(d, 'left.txt')) for d in ('/tmp', '/dev/shm', '.')))\n"
    prog, tests = stdio(reader, outputs=["0\n"])
    assert verdicts(box, prog, tests)[0] == ["pass"]


@needs_root
def test_scratch_space_is_bounded():
    cfg = dataclasses.replace(CFG, scratch_bytes=8 << 20)
    with Sandbox(cfg) as b:
        prog, tests = stdio(
            "with open('big', 'wb') as f:\n    for _ in range(32):\n        f.write(b'x' * (1 << 20))\nprint('ok')\n"
        )
        assert verdicts(b, prog, tests)[0] == ["runtime_error"]  # ENOSPC after 8 MiB


def test_syscall_filter_blocks_namespaces_and_memfd_but_not_threads(box):
    if "seccomp filter (" not in box.isolation:
        pytest.skip(f"no seccomp filter here: {box.isolation}")
    program = (
        "import ctypes, os, threading, subprocess\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "out = [libc.unshare(0x10000000) == -1]\n"  # CLONE_NEWUSER refused
        "try:\n    os.memfd_create('ram')\n    out.append(False)\nexcept OSError:\n    out.append(True)\n"
        "r = []\nt = threading.Thread(target=lambda: r.append(1))\nt.start()\nt.join()\nout.append(r == [1])\n"
        "out.append(subprocess.run(['true']).returncode == 0)\n"
        "print(out)\n"
    )
    prog, tests = stdio(program, outputs=["[True, True, True, True]\n"])
    assert verdicts(box, prog, tests)[0] == ["pass"]


@needs_root
def test_memory_cap_covers_all_processes_of_a_program():
    cfg = dataclasses.replace(CFG, memory_bytes=400 << 20, scratch_bytes=8 << 20, time_limit_s=10.0)
    with Sandbox(cfg) as b:
        if "cgroup memory" not in b.isolation:
            pytest.skip(f"no memory cgroup here: {b.isolation}")
        program = (
            "import os, time\nkids = []\nfor _ in range(3):\n    pid = os.fork()\n    if pid == 0:\n"
            "        x = bytearray(300 << 20)\n        for j in range(0, len(x), 4096):\n            x[j] = 1\n"
            "        time.sleep(1)\n        os._exit(0)\n    kids.append(pid)\n"
            "print(sum(os.waitpid(k, 0)[1] == 0 for k in kids))\n"
        )
        r = b.run_stdio(b.workdir(), b.write_file(b.workdir(), "m.py", program), b"")
        assert r.status == "ok" and int(r.stdout) < 3, (r.status, r.stdout, r.stderr[-300:])
