"""Running a program on its tests in the sandbox: one status per test (paper Sec. 3.2.4).

``stdio`` tests: one sandboxed process per test, stdin = the test's input, stdout compared with
:func:`~klear.rewards.code.compare.outputs_match`. ``call`` and ``assert`` tests: the program runs
once as a server (:mod:`klear.rewards.code.rpc`), restarted after a test that kills it, and the
test code, the trusted prefix and every comparison run here, in the scoring worker, so
``exit(0)`` before the tests, printing fake markers, or redefining ``print`` / ``exit`` /
``__eq__`` or a test helper cannot make a test pass (klear's design). The test code comes from
the dataset, like the expected outputs, and is trusted; only model-written code is confined.

Statuses: ``pass``, ``wrong_answer``, ``runtime_error``, ``timeout``, ``signal``,
``output_limit``, ``load_error`` (the program does not compile or load), ``not_run`` (after the
first failure with ``stop_on_first_failure``, or once the program's time budget is spent).
"""

from __future__ import annotations

import builtins
import signal
import threading
import time
from pathlib import Path
from typing import Any

from klear.rewards.code.compare import outputs_match, values_match
from klear.rewards.code.layouts import CodeTests, log_bad_ground_truth
from klear.rewards.code.rpc import Remote, RemoteError, Session
from klear.rewards.sandbox import Sandbox, get_sandbox

_BUILTIN_NAMES = frozenset(vars(builtins))


class _Alarm:
    """Wall-clock guard for trusted test code running in this process (main thread only)."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.active = threading.current_thread() is threading.main_thread() and hasattr(signal, "setitimer")

    def __enter__(self) -> _Alarm:
        if self.active:

            def _raise(*_: Any) -> None:
                raise TimeoutError("time limit exceeded")

            self.old = signal.signal(signal.SIGALRM, _raise)
            signal.setitimer(signal.ITIMER_REAL, max(self.seconds, 0.001))
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.active:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, self.old)


def _run_stdio_tests(
    box: Sandbox, wd: Path, prog: Path, tests: CodeTests, limit: float, budget_end: float, stop_first: bool
) -> tuple[list[str], str]:
    statuses: list[str] = []
    detail = ""
    for inp, exp in zip(tests.inputs, tests.outputs):
        remaining = budget_end - time.monotonic()
        if remaining <= 0 or (stop_first and statuses and statuses[-1] != "pass"):
            statuses.append("not_run")
            continue
        r = box.run_stdio(wd, prog, inp.encode("utf-8", "surrogatepass"), time_limit_s=min(limit, remaining))
        if r.status != "ok":
            statuses.append(r.status)
            detail = detail or r.stderr.decode("utf-8", "replace")[-500:]
        elif outputs_match(r.stdout, exp, tests.float_tol, tests.case_insensitive):
            statuses.append("pass")
        else:
            statuses.append("wrong_answer")
    return statuses, detail


def _prefix_namespace(prefix: str) -> dict:
    ns: dict[str, Any] = {"__name__": "__klear_test__", "__builtins__": builtins}
    if prefix:
        exec(compile(prefix, "prefix.py", "exec"), ns)
    return ns


def _run_rpc_tests(
    box: Sandbox, wd: Path, prog: Path, tests: CodeTests, limit: float, budget_end: float, stop_first: bool
) -> tuple[list[str], str]:
    prefix_path = box.write_file(wd, "prefix.py", tests.prefix) if tests.prefix else None
    setup_path = box.write_file(wd, "setup.py", tests.setup) if tests.setup else None
    try:
        base_ns = _prefix_namespace(tests.prefix)
    except Exception as e:
        log_bad_ground_truth(f"ground_truth.prefix raises {type(e).__name__}: {e}")
        return ["load_error"] * tests.total, f"ground_truth.prefix raises {type(e).__name__}: {e}"[:500]
    value_classes = {k: v for k, v in base_ns.items() if isinstance(v, type) and not k.startswith("_")}
    n = tests.total
    statuses: list[str] = []
    detail = ""
    session: Session | None = None
    try:
        for i in range(n):
            now = time.monotonic()
            if now >= budget_end or (stop_first and statuses and statuses[-1] != "pass"):
                statuses.append("not_run")
                continue
            deadline = min(now + limit, budget_end)
            if session is None or not session.alive:
                try:
                    session = Session(box, wd, prog, prefix_path, setup_path, value_classes, deadline)
                except RemoteError as e:
                    # The program does not load: no test can pass.
                    return statuses + ["load_error"] * (n - len(statuses)), str(e)[:500]
                except (TimeoutError, EOFError, ValueError, RecursionError) as e:
                    statuses.append("timeout" if isinstance(e, TimeoutError) else "runtime_error")
                    detail = detail or f"{type(e).__name__}: {e}"
                    continue
            session.chan.deadline = deadline
            try:
                with _Alarm(deadline - time.monotonic()):
                    ok = _one_rpc_test(session, tests, i, base_ns)
                statuses.append("pass" if ok else "wrong_answer")
            except TimeoutError:
                statuses.append("timeout")
                session.close()
            except EOFError:
                statuses.append("runtime_error")
                detail = detail or "the program exited during the test"
                session.close()
            except AssertionError:
                statuses.append("wrong_answer")
            except Exception as e:
                statuses.append("runtime_error")
                detail = detail or f"{type(e).__name__}: {e}"[:500]
    finally:
        if session is not None:
            session.close()
    return statuses, detail


def _one_rpc_test(session: Session, tests: CodeTests, i: int, base_ns: dict) -> bool:
    names = session.names
    if tests.format == "call":
        fn = tests.fn_name
        assert fn is not None, "parse_ground_truth gives every 'call' ground truth a fn_name"
        if names.get("Solution") == "class":
            target = session.proxy("Solution")()
            if not isinstance(target, Remote):
                return False
            func = getattr(target, fn)
        elif fn in names:
            func = session.proxy(fn)
        else:
            raise RemoteError(f"the program defines neither class Solution nor {fn}()")
        result = func(*tests.inputs[i])
        return values_match(result, tests.outputs[i], tests.float_tol, tests.case_insensitive)
    # assert-style: trusted test code, proxies for what the program defines
    # Which of the program's names the (trusted) test code sees, as proxies:
    # - the entry point, and the ``functions`` the ground truth lists when the program defines them
    #   (these may shadow builtins, e.g. MBPP's ``def sum(a, b)``);
    # - without a ``functions`` list: any other function/class the program defines, unless the
    #   trusted prefix defines that name (a test helper such as HumanEval's ``poly``) or it shadows a
    #   builtin (``abs``, ``set``: ``assert abs(f(x) - y) < 1e-6`` must keep the real ``abs``);
    # - values only when the ground truth's ``setup`` code made them (MBPP's ``root = Node(1)``).
    # With an entry point, ``check`` always comes from the test.
    code = tests.tests[i]
    ns = dict(base_ns)
    listed = set(tests.functions) if tests.functions is not None else None
    for name, kind in names.items():
        if name == tests.entry_point or (listed is not None and name in listed):
            ns[name] = session.proxy(name)
        elif name in base_ns or name in _BUILTIN_NAMES or (tests.entry_point and name == "check"):
            continue
        elif kind == "value":
            if name in session.setup_names:
                ns[name] = session.proxy(name)
        elif listed is None:
            ns[name] = session.proxy(name)
    if tests.entry_point and tests.entry_point not in names:
        raise RemoteError(f"the program does not define {tests.entry_point}()")
    exec(compile(code, "test.py", "exec"), ns)
    if tests.entry_point:
        check = ns.get("check")
        if not callable(check):
            raise ValueError("ground_truth has an entry_point but its test defines no check()")
        check(ns[tests.entry_point])
    return True


def run_tests(
    program: str, tests: CodeTests, *, sandbox: Sandbox | None = None, stop_on_first_failure: bool = False
) -> tuple[list[str], str]:
    """Run *program* on every test in the sandbox; returns (one status per test, detail text).

    Per-test wall clock: ``tests.time_limit_s`` or the sandbox's ``time_limit_s``; all tests
    together get ``program_time_limit_s``, after which the remaining tests are ``not_run``.

    Raises:
        SandboxError: the sandbox itself failed (never for anything the program does).
    """
    box = sandbox or get_sandbox()
    limit = tests.time_limit_s or box.config.time_limit_s
    budget_end = time.monotonic() + box.config.program_time_limit_s
    wd = box.workdir()
    try:
        prog = box.write_file(wd, "solution.py", program)
        if tests.format == "stdio":
            return _run_stdio_tests(box, wd, prog, tests, limit, budget_end, stop_on_first_failure)
        return _run_rpc_tests(box, wd, prog, tests, limit, budget_end, stop_on_first_failure)
    finally:
        box.remove(wd)
