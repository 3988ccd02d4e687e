"""Run functions in worker processes with a wall-clock limit that works from any thread.

math-verify's own timeouts use ``signal.alarm``, which only works in the main thread of
the main interpreter. Reward functions are called from reward-manager threads, Ray
actors and data-loader workers, so :class:`TimedProcessPool` instead runs each task in a
worker process of a lazily created :class:`pebble.ProcessPool`; pebble kills the worker
when a task overruns its limit (SIGTERM, then SIGKILL after 3 s) and starts a new one.

Robustness rules:

- The pool is created on first use and re-created when it is no longer usable: after
  ``os.fork()`` (a pool belongs to the process that made it), or when pebble marks it
  broken (for example every worker was killed while idle).
- A worker killed from outside (OOM killer, ``kill -9``) while it holds pebble's channel
  lock (between taking a task and acknowledging it, or while sending a result) leaves that
  lock held by a dead process: every other worker then waits on it, the task it took is
  never started, and pebble can no longer stop workers at their limit (it needs the same
  lock). Without a check, callers waited for the 900 s queue limit. So a waiter that has
  waited :data:`STALL_CHECK_S` seconds, or whose task's worker died, probes the lock (at
  most once per :data:`STALL_CHECK_S` per pool); when it cannot be taken within
  :data:`LOCK_PROBE_S` seconds the pool is declared wedged, replaced, and every task still
  waiting on it is resubmitted to the new pool.
- When pebble marks a pool broken it aborts the tasks it has registered, but a task still in its
  scheduler queue at that moment (or running while its loops stop) is never finished: a waiter
  whose pool has stopped returns ``pool_error`` :data:`ORPHAN_GRACE_S` seconds later and the task
  is resubmitted.
- Pool-level failures are retried with exponential backoff (:meth:`TimedProcessPool.run_many`):
  ``pool_error`` (the pool broke, e.g. pebble's ``BrokenProcessPool('All workers expired')``
  when a worker dies while tasks wait in the queue; the next attempt uses a fresh pool) and
  ``crashed`` (the worker died under the task: the OOM killer, ``kill -9``; pebble starts a new
  worker). The waits between attempts are :data:`RETRY_FIRST_WAIT_S`, doubling up to
  :data:`RETRY_MAX_WAIT_S` each, and add up to at most :data:`RETRY_TOTAL_WAIT_S`
  (:func:`retry_waits`); failed tasks of a batch are retried together, so a batch waits at most
  that long in total. A task still failing after the last attempt keeps its ``pool_error`` /
  ``crashed`` outcome; the reward layer reports it as unscored
  (:data:`klear.rewards.correctness.UNSCORED_REWARD`), never as a wrong answer. ``timeout``
  and ``error`` (the task ran and overran its limit, or raised) are not retried: they say
  something about the task itself.
- :meth:`TimedProcessPool.run` never raises for a task-level problem; it returns a
  :class:`TaskOutcome` whose ``status`` says what happened.
- Safe to call concurrently from many threads.

The start method defaults to ``"fork"`` where the platform has it (Linux), else ``"spawn"``.
``spawn`` and ``forkserver`` re-import the parent's ``__main__`` module in every worker, so a
user script without an ``if __name__ == "__main__":`` guard would run again inside each reward
worker; ``fork`` never does. Forking a process that runs threads (trainers do) is the same
trade-off PyTorch's DataLoader makes by default on Linux: the worker only runs math-verify,
never torch, and CPython re-initialises its own locks after ``fork``. Override with the
``start_method`` argument or the ``KLEAR_REWARD_START_METHOD`` environment variable (``fork``,
``spawn``, ``forkserver``).
"""

from __future__ import annotations

import atexit
import concurrent.futures
import logging
import multiprocessing
import multiprocessing.util
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Any, Literal

from pebble import ProcessExpired, ProcessPool

logger = logging.getLogger(__name__)

#: Extra seconds a *running* task may take past its limit before the caller gives up on
#: pebble and cancels it itself (pebble needs up to ~3 s to kill a stuck worker).
KILL_GRACE_S = 10.0
#: Longest a task may wait in the queue before it starts (safety net, should never hit).
DEFAULT_QUEUE_LIMIT_S = 900.0
#: A waiter that has waited this long checks whether the pool's channel lock is wedged.
STALL_CHECK_S = 2.0
#: How long the check waits for the lock before declaring it held by a dead worker (live
#: workers hold it for microseconds).
LOCK_PROBE_S = 2.0
#: Backoff before the first retry of a pool-level failure (``pool_error``, ``crashed``), seconds.
RETRY_FIRST_WAIT_S = 0.5
#: Longest single wait between two attempts; the waits double up to it.
RETRY_MAX_WAIT_S = 8.0
#: The waits between attempts add up to at most this (with the defaults: 0.5, 1, 2, 4, 8, 8 s, i.e.
#: 7 attempts over about 24 s plus the attempts' own run time). Long enough to outlast a pool that
#: keeps breaking for a while; short enough that a scorer that cannot work fails within a minute.
RETRY_TOTAL_WAIT_S = 30.0
#: A task whose pool has stopped (pebble marked it broken) and that is still unfinished this many
#: seconds later is orphaned: pebble's abort runs right after the status change, so only tasks it
#: missed are left.
ORPHAN_GRACE_S = 1.0
_POLL_S = 0.25

OutcomeStatus = Literal["ok", "timeout", "crashed", "error", "pool_error"]
#: Outcomes retried with backoff: the failure is the pool's, not the task's.
RETRIED_STATUSES: frozenset[str] = frozenset({"pool_error", "crashed"})


def retry_waits(total_wait_s: float | None = None) -> list[float]:
    """The backoff schedule: seconds to wait before each retry of a pool-level failure.

    ``RETRY_FIRST_WAIT_S`` doubling, each at most ``RETRY_MAX_WAIT_S``, while their sum stays within
    *total_wait_s* (default ``RETRY_TOTAL_WAIT_S``; 0 means no retry). The number of attempts is
    ``len(retry_waits()) + 1``.
    """
    total = RETRY_TOTAL_WAIT_S if total_wait_s is None else float(total_wait_s)
    waits: list[float] = []
    wait, spent = RETRY_FIRST_WAIT_S, 0.0
    while wait > 0 and spent + wait <= total:
        waits.append(wait)
        spent += wait
        wait = min(wait * 2, RETRY_MAX_WAIT_S)
    return waits


@dataclass(frozen=True)
class TaskOutcome:
    """Result of one task run in the pool.

    ``status``: ``"ok"`` (``value`` holds the return value), ``"timeout"`` (killed at its
    limit), ``"crashed"`` (the worker process died: signal, segfault, OOM killer),
    ``"error"`` (the function raised; ``detail`` holds ``repr`` of the exception) or
    ``"pool_error"`` (the pool itself failed; the pool is rebuilt on next use).
    """

    status: OutcomeStatus
    value: Any = None
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.status == "ok"


def default_max_workers() -> int:
    """Pool size: ``KLEAR_REWARD_WORKERS`` if set, else ``min(8, cpu_count)``."""
    env = os.environ.get("KLEAR_REWARD_WORKERS")
    if env:
        try:
            n = int(env)
            if n > 0:
                return n
        except ValueError:
            logger.warning("ignoring invalid KLEAR_REWARD_WORKERS=%r", env)
    return max(1, min(8, os.cpu_count() or 1))


def limit_worker_memory(extra_mb: int | None = None) -> None:
    """Cap this process's address space at its current size plus *extra_mb* MiB.

    Meant for worker initializers: a runaway computation then gets ``MemoryError``
    (turned into a failed task) instead of swapping or waking the OOM killer. The cap
    is relative to the size after start-up, so whatever the worker imported first does
    not count. Default headroom: ``KLEAR_REWARD_WORKER_MEMORY_MB`` or 4096; ``0``
    disables the cap. Linux only; silently does nothing elsewhere.
    """
    if extra_mb is None:
        try:
            extra_mb = int(os.environ.get("KLEAR_REWARD_WORKER_MEMORY_MB", "4096"))
        except ValueError:
            extra_mb = 4096
    if extra_mb <= 0:
        return
    try:
        import resource

        with open("/proc/self/statm") as f:
            current = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        limit = current + extra_mb * 1024 * 1024
        soft, hard = resource.getrlimit(resource.RLIMIT_AS)
        if hard != resource.RLIM_INFINITY:
            limit = min(limit, hard)
        if soft == resource.RLIM_INFINITY or limit < soft:
            resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    except (ImportError, OSError, ValueError):  # pragma: no cover - non-Linux
        pass


def _resolve_start_method(start_method: str | None) -> str:
    default = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
    method = start_method or os.environ.get("KLEAR_REWARD_START_METHOD") or default
    if method not in multiprocessing.get_all_start_methods():
        logger.warning(
            "start method %r is not available here (choose from %s); using 'spawn'",
            method,
            multiprocessing.get_all_start_methods(),
        )
        method = "spawn"
    return method


def _join_in_background(pool: ProcessPool) -> None:
    """Let a retired pool finish its queued tasks, then reap it, off the caller's thread."""

    def _reap() -> None:
        try:
            pool.join(timeout=DEFAULT_QUEUE_LIMIT_S)
        except Exception:
            try:
                pool.stop()
                pool.join(timeout=10)
            except Exception:
                pass

    threading.Thread(target=_reap, name="klear-reward-pool-reaper", daemon=True).start()


_LIVE_POOLS: weakref.WeakSet[TimedProcessPool] = weakref.WeakSet()


@atexit.register
def _shutdown_all() -> None:  # pragma: no cover - exercised at interpreter exit
    for p in list(_LIVE_POOLS):
        try:
            p.shutdown(wait_s=2.0)
        except Exception:
            pass


_EXIT_HOOK_PID: int | None = None


def _shutdown_at_process_exit() -> None:
    """Shut the pools down when this process ends, also as a multiprocessing child: there atexit handlers never
    run, and the child joins its non-daemon children (pebble's workers) before exiting, so without this it
    never exits. A ``multiprocessing.util.Finalize`` with an exit priority runs before that join."""
    global _EXIT_HOOK_PID
    if _EXIT_HOOK_PID != os.getpid():
        multiprocessing.util.Finalize(None, _shutdown_all, exitpriority=100)
        _EXIT_HOOK_PID = os.getpid()


def _reset_after_fork() -> None:  # pragma: no cover - runs in forked children
    # A forked child inherits the parent's pool object but none of its threads, and a
    # lock that another parent thread held at fork time would stay locked forever.
    for p in list(_LIVE_POOLS):
        p._lock = threading.Lock()
        p._probe_lock = threading.Lock()
        p._pool = None
        p._pool_pid = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_after_fork)


def _channel_lock_is_wedged(pool: ProcessPool, timeout_s: float = LOCK_PROBE_S) -> bool:
    """True when pebble's worker-channel lock cannot be taken within *timeout_s*.

    Live workers hold it only to take one task off the pipe or to write one result, so a
    lock that stays held belongs to a worker that died holding it. Uses pebble internals
    (5.x); when they are missing the check says "not wedged" and the queue limit remains.
    """
    try:
        channel = pool._pool_manager.worker_manager.workers_channel
        if channel is None:
            return False
        mutex = channel.mutex
        acquired = mutex.acquire(block=True, timeout=timeout_s)
    except Exception:
        return False
    if acquired:
        mutex.release()
        return False
    return True


def _pool_is_running(pool: ProcessPool | None) -> bool:
    """False once *pool* has left pebble's running/closing states (broken, or stopped)."""
    if pool is None:
        return True
    try:
        return bool(pool.active)
    except Exception:
        return False


def _backoff_sleep(seconds: float) -> None:
    """The wait between two attempts of :meth:`TimedProcessPool.run_many` (one name, so tests can record it)."""
    time.sleep(seconds)


class TimedProcessPool:
    """A lazily created, self-healing process pool with per-task wall-clock limits.

    Args:
        max_workers: number of worker processes (default :func:`default_max_workers`).
        start_method: multiprocessing start method (see module docstring).
        initializer, initargs: run once in every worker when it starts; must be
            importable module-level callables (they are pickled for ``spawn``).
        name: label used in log messages.
    """

    def __init__(
        self,
        *,
        max_workers: int | None = None,
        start_method: str | None = None,
        initializer: Callable[..., Any] | None = None,
        initargs: Iterable[Any] = (),
        name: str = "klear-reward",
    ) -> None:
        if max_workers is not None and max_workers < 1:
            raise ValueError(f"max_workers must be >= 1, got {max_workers}")
        self._max_workers = max_workers
        self._start_method = start_method
        self._initializer = initializer
        self._initargs = tuple(initargs)
        self.name = name
        self._lock = threading.Lock()
        self._pool: ProcessPool | None = None
        self._pool_pid: int | None = None
        self.pools_created = 0  # how many pebble pools this object has built (for tests)
        self._retired: weakref.WeakSet[ProcessPool] = weakref.WeakSet()  # stopped: tasks must be resubmitted
        self._probe_lock = threading.Lock()
        self._last_probe = 0.0
        _LIVE_POOLS.add(self)

    # ------------------------------------------------------------------ pool life cycle
    @property
    def max_workers(self) -> int:
        return self._max_workers or default_max_workers()

    def _new_pool(self) -> ProcessPool:
        ctx = multiprocessing.get_context(_resolve_start_method(self._start_method))
        pool = ProcessPool(
            max_workers=self.max_workers,
            initializer=self._initializer,
            initargs=self._initargs,
            context=ctx,
        )
        self.pools_created += 1
        return pool

    def _get_pool(self) -> ProcessPool:
        with self._lock:
            pool = self._pool
            if pool is not None and self._pool_pid != os.getpid():
                # Inherited through fork: its threads and pipes belong to the parent.
                pool = None
            elif pool is not None and not pool.active:
                logger.warning("%s: worker pool is broken; starting a new one", self.name)
                try:
                    pool.stop()
                    _join_in_background(pool)
                except Exception:
                    pass
                pool = None
            if pool is None:
                _shutdown_at_process_exit()
                pool = self._new_pool()
                self._pool = pool
                self._pool_pid = os.getpid()
            return pool

    def _discard(self, pool: ProcessPool) -> None:
        """Forget *pool* (if still current) so the next call builds a fresh one.

        The pool is stopped, so its queued tasks never run: it is marked retired, and every thread still
        waiting on one of its futures gets ``pool_error`` from :meth:`wait` and resubmits (:meth:`run`)
        instead of waiting for the queue limit.
        """
        with self._lock:
            if self._pool is pool:
                self._pool = None
        self._retired.add(pool)
        if self._pool_pid == os.getpid():
            try:
                pool.stop()
                _join_in_background(pool)
            except Exception:
                pass

    def resize(self, max_workers: int) -> None:
        """Use *max_workers* workers from now on.

        A pool of another size is retired: it accepts no new tasks but finishes the ones
        already queued (other threads' results are not lost).
        """
        if max_workers < 1:
            raise ValueError(f"max_workers must be >= 1, got {max_workers}")
        with self._lock:
            if max_workers == self.max_workers:
                self._max_workers = max_workers
                return
            old, self._pool = self._pool, None
            self._max_workers = max_workers
        if old is not None and self._pool_pid == os.getpid():
            old.close()
            _join_in_background(old)

    def shutdown(self, wait_s: float = 5.0) -> None:
        """Stop the workers now (running tasks are abandoned). Next use starts a new pool."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None and self._pool_pid == os.getpid():
            try:
                pool.stop()
                pool.join(timeout=wait_s)
            except Exception:
                pass

    def _check_wedged(self, pool: ProcessPool | None, *, force: bool = False) -> bool:
        """Probe *pool*'s channel lock (rate-limited); replace the pool when it is wedged.

        Returns True when *pool* is (now) retired as wedged, so its tasks must be resubmitted.
        """
        if pool is None:
            return False
        if pool in self._retired:
            return True
        now = time.monotonic()
        if not force and now - self._last_probe < STALL_CHECK_S:
            return False
        if not self._probe_lock.acquire(blocking=False):
            return pool in self._retired  # another thread is probing
        try:
            if pool in self._retired:
                return True
            if self._pool is not pool or self._pool_pid != os.getpid():
                return False  # already replaced for another reason; its waiters still finish
            wedged = _channel_lock_is_wedged(pool)
            self._last_probe = time.monotonic()
            if wedged:
                logger.warning(
                    "%s: a worker died holding the pool's channel lock; starting a new pool "
                    "and resubmitting the waiting tasks",
                    self.name,
                )
                self._retired.add(pool)
                self._discard(pool)
            return wedged
        finally:
            self._probe_lock.release()

    # ------------------------------------------------------------------------- tasks
    def submit(self, fn: Callable[..., Any], args: tuple = (), *, timeout_s: float) -> concurrent.futures.Future:
        """Schedule ``fn(*args)`` with a limit of *timeout_s* seconds of run time.

        The limit starts when a worker picks the task up (queue time is not counted).
        Retries once on a fresh pool when the current one refuses the task.

        Raises:
            ValueError: ``timeout_s`` is not positive.
            RuntimeError: no pool could accept the task (two attempts).
        """
        if not timeout_s or timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
        last: Exception | None = None
        for _ in range(2):
            pool = None
            try:
                pool = self._get_pool()
                future = pool.schedule(fn, args=args, timeout=timeout_s)
                future._klear_pool = pool  # type: ignore[attr-defined]  # for wait()
                return future
            except Exception as exc:
                last = exc
                if pool is not None:
                    self._discard(pool)
        raise RuntimeError(f"{self.name}: could not schedule a task: {last}") from last

    def wait(
        self,
        future: concurrent.futures.Future,
        *,
        timeout_s: float,
        queue_limit_s: float = DEFAULT_QUEUE_LIMIT_S,
    ) -> TaskOutcome:
        """Wait for a future from :meth:`submit` and classify its outcome; never raises.

        pebble enforces the limit itself; as a safety net the wait also gives up (and
        cancels the task) once the task has run ``timeout_s + KILL_GRACE_S`` seconds or
        has waited ``queue_limit_s`` seconds without starting.
        """
        t_submit = time.monotonic()
        t_running: float | None = None
        t_stopped: float | None = None
        pool = getattr(future, "_klear_pool", None)
        while True:
            try:
                value = future.result(timeout=_POLL_S)
                return TaskOutcome("ok", value)
            except concurrent.futures.TimeoutError:
                # Either pebble's "Task timeout" (future done) or our poll slice expired.
                if future.done():
                    return TaskOutcome("timeout", detail=f"exceeded {timeout_s:g} s")
            except concurrent.futures.CancelledError:
                return TaskOutcome("timeout", detail="cancelled")
            except ProcessExpired as exc:
                # A worker that died while sending its result may hold the channel lock.
                self._check_wedged(pool, force=True)
                return TaskOutcome("crashed", detail=f"worker died (exit code {exc.exitcode})")
            except BrokenProcessPool as exc:
                return TaskOutcome("pool_error", detail=repr(exc))
            except BaseException as exc:
                return TaskOutcome("error", detail=repr(exc)[:500])
            now = time.monotonic()
            if now - t_submit > STALL_CHECK_S and self._check_wedged(pool):
                future.cancel()
                return TaskOutcome("pool_error", detail="pool wedged by a dead worker; replaced")
            if not _pool_is_running(pool):
                # pebble aborts the tasks it registered when its pool breaks; one still in its
                # scheduler queue then, or running while its loops stop, is never finished.
                if t_stopped is None:
                    t_stopped = now
                if now - t_stopped > ORPHAN_GRACE_S:
                    future.cancel()
                    return TaskOutcome("pool_error", detail="pool stopped before the task finished")
            if future.running():
                if t_running is None:
                    t_running = now
                if now - t_running > timeout_s + KILL_GRACE_S:
                    future.cancel()
                    return TaskOutcome("timeout", detail=f"exceeded {timeout_s:g} s (not reaped)")
            elif now - t_submit > queue_limit_s:
                future.cancel()
                return TaskOutcome("pool_error", detail=f"not started within {queue_limit_s:g} s")

    def run_many(
        self,
        fn: Callable[..., Any],
        args_list: Sequence[tuple],
        *,
        timeout_s: float,
        retry_wait_s: float | None = None,
    ) -> list[TaskOutcome]:
        """Run ``fn(*args)`` for every ``args`` of *args_list* in parallel; outcomes in input order.

        Tasks whose outcome is a pool-level failure (:data:`RETRIED_STATUSES`) are resubmitted
        together after each wait of :func:`retry_waits` (*retry_wait_s* caps the total wait, default
        :data:`RETRY_TOTAL_WAIT_S`); a broken pool is replaced first. What still fails after the last
        attempt keeps its ``pool_error``/``crashed`` outcome (its ``detail`` says how many attempts).

        Raises:
            ValueError: ``timeout_s`` is not positive. Nothing else.
        """
        if not timeout_s or timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
        outcomes: list[TaskOutcome] = [TaskOutcome("pool_error", detail="not run")] * len(args_list)
        todo = list(range(len(args_list)))
        waits = retry_waits(retry_wait_s)
        for attempt in range(len(waits) + 1):
            futures: dict[int, concurrent.futures.Future] = {}
            for i in todo:
                try:
                    futures[i] = self.submit(fn, args_list[i], timeout_s=timeout_s)
                except RuntimeError as exc:
                    outcomes[i] = TaskOutcome("pool_error", detail=str(exc))
            broken: list[ProcessPool] = []
            for i, future in futures.items():
                outcomes[i] = self.wait(future, timeout_s=timeout_s)
                pool = getattr(future, "_klear_pool", None)
                if outcomes[i].status == "pool_error" and pool is not None and pool not in broken:
                    broken.append(pool)
            for pool in broken:
                if pool not in self._retired:
                    self._discard(pool)
            todo = [i for i in todo if outcomes[i].status in RETRIED_STATUSES]
            if not todo:
                break
            if attempt < len(waits):
                logger.warning(
                    "%s: %d task(s) lost to a pool failure (%s); retrying in %.1f s (attempt %d of %d)",
                    self.name,
                    len(todo),
                    outcomes[todo[0]].detail,
                    waits[attempt],
                    attempt + 2,
                    len(waits) + 1,
                )
                _backoff_sleep(waits[attempt])
        for i in todo:
            o = outcomes[i]
            outcomes[i] = TaskOutcome(o.status, o.value, f"{o.detail} (after {len(waits) + 1} attempts)")
        return outcomes

    def run(
        self, fn: Callable[..., Any], args: tuple = (), *, timeout_s: float, retry_wait_s: float | None = None
    ) -> TaskOutcome:
        """``submit`` + ``wait`` for one task, pool-level failures retried with backoff (:meth:`run_many`).

        Never raises except ``ValueError`` for a non-positive ``timeout_s``.
        """
        return self.run_many(fn, [args], timeout_s=timeout_s, retry_wait_s=retry_wait_s)[0]
