"""Code reward: run a model-written program on a problem's tests in the sandbox (paper Sec. 3.2.4).

The public face of the code reward; the parts live in :mod:`klear.rewards.code`:

- **Reward** (:mod:`~klear.rewards.code.score`): ``soft`` (the default) = passed / total in
  ``[0, 1]``, ``hard`` = ``+1`` if every test passes else ``-1``; every failure mode (compile
  error, crash, time-out, output flood, time budget spent) is a failed test, never an exception.
  A failed known-correct canary program raises :class:`~klear.rewards.sandbox.SandboxError`.
- **Program** (:mod:`~klear.rewards.code.extract`): the last Python-tagged fenced block (else the
  last untagged one) after the think block. The think rule is
  :mod:`klear.rewards.think_format`'s, shared with the math reward: one closed think block, and
  whether it is required comes from :func:`~klear.rewards.think_format.requires_think`.
- **Ground truth** (:mod:`~klear.rewards.code.layouts`): ``stdio``, ``call`` and ``assert``
  layouts; outputs compared by :mod:`~klear.rewards.code.compare`.
- **Who decides the verdict** (:mod:`~klear.rewards.code.run`, :mod:`~klear.rewards.code.rpc`):
  the program runs in the sandbox (:mod:`klear.rewards.sandbox`) and never sees expected values;
  the tests and every comparison run in the trusted scoring worker.
- **Packages**: programs may import the standard library and the sandbox's allowed packages
  (:data:`klear.rewards.sandbox.DEFAULT_ALLOWED_PACKAGES`; ``SandboxConfig(allowed_packages=...)``).
- **Datasets** (:mod:`~klear.rewards.code.datasets`): HumanEval, MBPP and LeetCode ground truths.
"""

from __future__ import annotations

from klear.rewards.code.compare import DEFAULT_FLOAT_TOL, outputs_match, values_match
from klear.rewards.code.datasets import (
    LEETCODE_PREFIX,
    humaneval_canonical_response,
    humaneval_ground_truth,
    leetcode_ground_truth,
    mbpp_ground_truth,
)
from klear.rewards.code.extract import extract_code
from klear.rewards.code.layouts import CodeTests, parse_ground_truth
from klear.rewards.code.rpc import RemoteError
from klear.rewards.code.run import run_tests
from klear.rewards.code.score import (
    HARD_CORRECT,
    HARD_WRONG,
    POOL_GRACE_S,
    CodeScoreResult,
    code_score,
    code_score_batch,
    code_score_batch_detailed,
    code_score_detailed,
    configure_code_pool,
    get_code_pool,
    shutdown_code_pool,
)

__all__ = [
    "DEFAULT_FLOAT_TOL",
    "HARD_CORRECT",
    "HARD_WRONG",
    "LEETCODE_PREFIX",
    "POOL_GRACE_S",
    "CodeScoreResult",
    "CodeTests",
    "RemoteError",
    "code_score",
    "code_score_batch",
    "code_score_batch_detailed",
    "code_score_detailed",
    "configure_code_pool",
    "extract_code",
    "get_code_pool",
    "humaneval_canonical_response",
    "humaneval_ground_truth",
    "leetcode_ground_truth",
    "mbpp_ground_truth",
    "outputs_match",
    "parse_ground_truth",
    "run_tests",
    "shutdown_code_pool",
    "values_match",
]
