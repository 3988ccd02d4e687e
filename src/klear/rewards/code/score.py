"""Code scoring: the reward of a response, in parallel and guarded by canaries (paper Sec. 3.2.4).

**Reward.** ``soft`` (the paper's default; it beats ``hard`` on LiveCodeBench, Fig. 3) =
passed / total, in ``[0, 1]`` (4 of 16 -> 0.25); ``hard`` = :data:`HARD_CORRECT` (``+1``) if
every test passes, else :data:`HARD_WRONG` (``-1``). Every test counts in the denominator: a
compile error, crash, time-out, output flood or a test skipped after the program's time budget
ran out is a failed test, never an exception in the trainer. A response without a usable program
(:func:`~klear.rewards.code.extract.extract_code`; this includes a response that breaks the think
format) scores like one that fails every test.

**Pool.** Responses are scored in worker processes (:func:`get_code_pool`, klear's design), each
with its own sandbox. A scoring task that overran its limit or raised fails its response's tests. A
task lost to the pool (the pool broke, or the worker was killed under it) is retried with backoff
(:meth:`klear.rewards._timeout.TimedProcessPool.run_many`); if it still fails the response is
UNSCORED: reward ``nan`` (:data:`klear.rewards.correctness.UNSCORED_REWARD`), status ``"unscored"``,
never a failed test.

**Canary.** Every batch also scores known-correct programs (stdin, call, and numpy when it is
installed and allowed) under the same limits; if one fails,
:class:`~klear.rewards.sandbox.SandboxError` is raised instead of silently returning zeros (e.g.
an address-space limit the interpreter cannot live with). An unscored canary proves nothing either
way and is not checked.
"""

from __future__ import annotations

import dataclasses
import signal
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from importlib.util import find_spec
from typing import Any

from klear.rewards._timeout import RETRIED_STATUSES, TaskOutcome, TimedProcessPool, limit_worker_memory
from klear.rewards.code.extract import extract_code
from klear.rewards.code.layouts import log_bad_ground_truth, parse_ground_truth
from klear.rewards.code.run import run_tests
from klear.rewards.correctness import UNSCORED_REWARD
from klear.rewards.sandbox import SandboxConfig, SandboxError, get_sandbox
from klear.rewards.think_format import requires_think

HARD_CORRECT = 1.0
HARD_WRONG = -1.0
#: Extra seconds the pool gives a program beyond its own time budget (sandbox start, tear-down).
POOL_GRACE_S = 30.0

# ------------------------------------------------------------------------------ results


@dataclass
class CodeScoreResult:
    """Verdict for one response.

    Attributes:
        reward: soft ``passed / total`` or hard ``+1 / -1``; ``nan`` when unscored.
        passed, total: tests passed / all tests of the problem.
        status: ``"ok"`` (tests ran), ``"no_code"`` (no usable code block), ``"invalid_ground_truth"``,
            ``"load_error"`` (the program failed to compile or import for call/assert tests),
            ``"worker_timeout"`` / ``"worker_error"`` (the scoring task overran its limit or raised; every
            test counts as failed), ``"unscored"`` (the pool could not run the scoring task after its
            retries; reward ``nan``, see the module docstring).
        test_status: one entry per test: ``pass``, ``wrong_answer``, ``runtime_error``, ``timeout``,
            ``signal``, ``output_limit``, ``load_error``, ``not_run`` (after the first failure in
            stop-first mode, or the program's time budget ran out).
        program: the extracted code (``None`` if none).
        detail: a short error text (stderr tail, exception), for debugging.
    """

    reward: float
    passed: int
    total: int
    status: str
    test_status: list[str] = field(default_factory=list)
    program: str | None = None
    detail: str = ""

    @property
    def pass_rate(self) -> float:
        return self.passed / self.total if self.total else 0.0

    def __float__(self) -> float:
        return float(self.reward)


def _reward(passed: int, total: int, reward_mode: str) -> float:
    if reward_mode == "soft":
        return passed / total if total else 0.0
    return HARD_CORRECT if total and passed == total else HARD_WRONG


def _check_mode(reward_mode: str) -> str:
    if reward_mode not in ("soft", "hard"):
        raise ValueError(f"reward_mode must be 'soft' or 'hard', got {reward_mode!r}")
    return reward_mode


def _score_one(
    solution_str: Any,
    ground_truth: Any,
    extra_info: Any,
    reward_mode: str,
    require_think: bool,
    stop_first: bool | None,
    config: SandboxConfig | None,
) -> CodeScoreResult:
    try:
        tests = parse_ground_truth(ground_truth, extra_info if isinstance(extra_info, dict) else None)
    except ValueError as e:
        log_bad_ground_truth(str(e))
        return CodeScoreResult(_reward(0, 0, reward_mode), 0, 0, "invalid_ground_truth", detail=str(e))
    program = extract_code(solution_str, require_think=require_think)
    if program is None:
        return CodeScoreResult(
            _reward(0, tests.total, reward_mode), 0, tests.total, "no_code", ["not_run"] * tests.total
        )
    if stop_first is None:
        stop_first = reward_mode == "hard"
    statuses, detail = run_tests(program, tests, sandbox=get_sandbox(config), stop_on_first_failure=stop_first)
    passed = statuses.count("pass")
    status = "load_error" if statuses and all(s == "load_error" for s in statuses) else "ok"
    return CodeScoreResult(
        _reward(passed, tests.total, reward_mode), passed, tests.total, status, statuses, program, detail
    )


# --------------------------------------------------------------------------------- canary

_CANARY_STDIO = (
    "import sys\nimport math\ndata = sys.stdin.buffer.read().split()\n"
    "print(sum(int(x) for x in data) + 10 ** 5000 - 10 ** 5000)\n"
)
_CANARY_CALL = "class Solution:\n    def add(self, a, b):\n        return a + b\n"
_CANARY_NUMPY = "import numpy as np\na = np.arange(64.0).reshape(8, 8)\nprint(int((a @ a).trace()))\n"


def _canaries(config: SandboxConfig) -> list[tuple[str, str, dict[str, Any]]]:
    out: list[tuple[str, str, dict[str, Any]]] = [
        ("stdio", f"```python\n{_CANARY_STDIO}```", {"format": "stdio", "inputs": ["3 4\n"], "outputs": ["7\n"]}),
        (
            "call",
            f"```python\n{_CANARY_CALL}```",
            {"format": "call", "fn_name": "add", "inputs": [[2, 3], [[1], [2]]], "outputs": [5, [1, 2]]},
        ),
    ]
    numpy_allowed = config.allowed_packages is None or "numpy" in config.allowed_packages
    if numpy_allowed and find_spec("numpy") is not None:
        import numpy as np

        a = np.arange(64.0).reshape(8, 8)
        out.append(
            (
                "numpy",
                f"```python\n{_CANARY_NUMPY}```",
                {"format": "stdio", "inputs": [""], "outputs": [str(int((a @ a).trace()))]},
            )
        )
    return out


def _check_canaries(results: Sequence[CodeScoreResult], names: Sequence[str]) -> None:
    bad = [(n, r) for n, r in zip(names, results) if r.status != "unscored" and (r.passed != r.total or r.total == 0)]
    if bad:
        desc = "; ".join(f"{n}: {r.status} {r.test_status} {r.detail[-300:]!r}" for n, r in bad)
        raise SandboxError(
            "code reward: a known-correct canary program failed in the sandbox, so every score of this "
            f"batch would be wrong (limits too tight for the interpreter? broken environment?): {desc}"
        )


# ---------------------------------------------------------------------------------- pool

_POOL: TimedProcessPool | None = None
_POOL_LOCK = threading.Lock()


def _worker_init() -> None:  # pragma: no cover - runs in pool workers
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # the trusted side decodes what programs return: cap it like the math workers
    limit_worker_memory()


def get_code_pool() -> TimedProcessPool:
    """The process pool code scoring runs in (created on first use; ``KLEAR_REWARD_WORKERS``)."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = TimedProcessPool(name="klear-code-reward", initializer=_worker_init)
        return _POOL


def configure_code_pool(*, max_workers: int | None = None) -> None:
    """Resize the code-scoring pool (workers keep their sandboxes between tasks)."""
    if max_workers is not None:
        get_code_pool().resize(max_workers)


def shutdown_code_pool() -> None:
    """Stop the code-scoring workers (and their sandboxes)."""
    with _POOL_LOCK:
        pool = _POOL
    if pool is not None:
        pool.shutdown()


def _task(args: tuple) -> CodeScoreResult:  # runs in a pool worker
    return _score_one(*args)


def _lost(outcome: TaskOutcome, total_hint: int, reward_mode: str, program: str | None) -> CodeScoreResult:
    unscored = outcome.status in RETRIED_STATUSES
    status = "unscored" if unscored else "worker_timeout" if outcome.status == "timeout" else "worker_error"
    return CodeScoreResult(
        UNSCORED_REWARD if unscored else _reward(0, total_hint, reward_mode),
        0,
        total_hint,
        status,
        ["not_run"] * total_hint,
        program,
        outcome.detail[:500],
    )


def code_score_batch_detailed(
    solution_strs: Sequence[str],
    ground_truths: Sequence[Any],
    extra_infos: Sequence[dict | None] | None = None,
    *,
    reward_mode: str = "soft",
    require_think: bool | Sequence[bool] = False,
    stop_on_first_failure: bool | None = None,
    sandbox_config: SandboxConfig | None = None,
    max_workers: int | None = None,
    canary: bool = True,
) -> list[CodeScoreResult]:
    """Score many responses in parallel on the worker pool; results in input order.

    Args:
        solution_strs, ground_truths: equal-length sequences (see module docstring for layouts).
        extra_infos: optional verl extra infos (``time_limit_s`` honoured).
        reward_mode: ``"soft"`` (passed/total) or ``"hard"`` (+1 / -1).
        require_think: one bool, or one per item.
        stop_on_first_failure: skip the remaining tests after a failure (default: only for hard).
        sandbox_config: limits (default :class:`SandboxConfig`).
        max_workers: pool size (default ``KLEAR_REWARD_WORKERS`` or ``min(8, cpus)``).
        canary: also score known-correct programs and raise if one fails.

    Returns:
        One :class:`CodeScoreResult` per item (reward ``nan`` when unscored, see the module docstring).
        The scores do not depend on the pool size.

    Raises:
        ValueError: bad ``reward_mode`` or mismatched lengths.
        SandboxError: a canary failed (the sandbox cannot run correct programs here).
    """
    _check_mode(reward_mode)
    n = len(solution_strs)
    if len(ground_truths) != n or (extra_infos is not None and len(extra_infos) != n):
        raise ValueError("solution_strs, ground_truths and extra_infos must have the same length")
    extra_infos = list(extra_infos) if extra_infos is not None else [None] * n
    thinks = [bool(require_think)] * n if isinstance(require_think, bool) else [bool(t) for t in require_think]
    if len(thinks) != n:
        raise ValueError("require_think must be a bool or have one entry per item")
    config = sandbox_config or SandboxConfig()
    items = [
        (s, g, e, reward_mode, t, stop_on_first_failure, config)
        for s, g, e, t in zip(solution_strs, ground_truths, extra_infos, thinks)
    ]
    canaries = _canaries(config) if canary else []
    items += [(resp, gt, None, "soft", False, False, config) for _, resp, gt in canaries]
    pool = get_code_pool()
    if max_workers is not None:
        pool.resize(max_workers)
    timeout = config.program_time_limit_s + POOL_GRACE_S
    results = []
    for it, outcome in zip(items, pool.run_many(_task, [(it,) for it in items], timeout_s=timeout)):
        if outcome.ok:
            results.append(outcome.value)
        else:
            try:
                total = parse_ground_truth(it[1]).total
            except ValueError:
                total = 0
            results.append(_lost(outcome, total, it[3], extract_code(it[0], require_think=it[4])))
    if canaries:
        _check_canaries(results[n:], [c[0] for c in canaries])
    return results[:n]


def code_score_detailed(
    data_source: str,
    solution_str: str,
    ground_truth: Any,
    extra_info: dict | None = None,
    *,
    reward_mode: str = "soft",
    require_think: bool | None = None,
    stop_on_first_failure: bool | None = None,
    sandbox_config: SandboxConfig | None = None,
    canary: bool = True,
) -> CodeScoreResult:
    """Score one response (see :func:`code_score_batch_detailed`); ``require_think`` defaults to
    :func:`~klear.rewards.think_format.requires_think` of *data_source*."""
    think = requires_think(data_source, require_think)
    return code_score_batch_detailed(
        [solution_str],
        [ground_truth],
        [extra_info],
        reward_mode=reward_mode,
        require_think=think,
        stop_on_first_failure=stop_on_first_failure,
        sandbox_config=sandbox_config,
        canary=canary,
    )[0]


def _config_from_kwargs(
    sandbox_config: SandboxConfig | None, time_limit_s: float | None, timeout_s: float | None
) -> SandboxConfig | None:
    if time_limit_s is None and timeout_s is None:
        return sandbox_config
    base = sandbox_config or SandboxConfig()
    return dataclasses.replace(
        base,
        time_limit_s=base.time_limit_s if time_limit_s is None else float(time_limit_s),
        program_time_limit_s=base.program_time_limit_s if timeout_s is None else float(timeout_s),
    )


def code_score(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None, **options: Any
) -> float:
    """verl-style scorer registered for data sources starting with ``"code"``: :func:`code_score_batch` on one
    response.

    Args:
        data_source: e.g. ``"code"``, ``"coder1_longcot"``; whether it requires a think block is
            :func:`~klear.rewards.think_format.requires_think`'s decision (unless ``require_think``).
        solution_str: the response; ground_truth: see module docstring; extra_info: verl's.
        options: :func:`code_score_batch`'s keywords: ``reward_mode`` (``"soft"``, the default: passed/total
            in [0, 1]; ``"hard"``: +1 / -1), ``require_think``, ``stop_on_first_failure``, ``time_limit_s``
            (per-test wall clock), ``timeout_s`` (per-program wall clock), ``sandbox_config``; others are ignored.

    Returns:
        The reward (float).

    Raises:
        SandboxError: the sandbox cannot run known-correct programs.
    """
    return code_score_batch([data_source], [solution_str], [ground_truth], [extra_info], **options)[0]


def code_score_batch(
    data_sources: Sequence[str],
    solution_strs: Sequence[str],
    ground_truths: Sequence[Any],
    extra_infos: Sequence[dict | None] | None = None,
    *,
    max_workers: int | None = None,
    reward_mode: str = "soft",
    require_think: bool | None = None,
    stop_on_first_failure: bool | None = None,
    time_limit_s: float | None = None,
    timeout_s: float | None = None,
    sandbox_config: SandboxConfig | None = None,
    **_ignored: Any,
) -> list[float]:
    """Batch form of :func:`code_score` (the registry's ``batch_fn``); one canary set per call."""
    thinks = [requires_think(ds, require_think) for ds in data_sources]
    cfg = _config_from_kwargs(sandbox_config, time_limit_s, timeout_s)
    res = code_score_batch_detailed(
        solution_strs,
        ground_truths,
        extra_infos,
        reward_mode=reward_mode,
        require_think=thinks,
        stop_on_first_failure=stop_on_first_failure,
        sandbox_config=cfg,
        max_workers=max_workers,
    )
    return [r.reward for r in res]
