"""Ground-truth layouts: a code problem's tests, as ``reward_model.ground_truth`` holds them.

The paper runs a program on its problem's test cases (Sec. 3.2.4); these layouts, which cover the
public code datasets, are klear's. A ground truth is a dict or its JSON text:

``stdio`` (Codeforces, TACO, APPS, CodeContests, LiveCodeBench "stdin")::

    {"format": "stdio", "inputs": ["1 2\\n", ...], "outputs": ["3\\n", ...],
     "float_tol": 1e-6, "time_limit_s": 6, "case_insensitive": false}

  Also accepted: ``{"inputs": [...], "outputs": [...]}`` without ``fn_name`` and a list of
  ``{"input": ..., "output": ...}``. Each test is a fresh process; stdout is compared with
  :func:`klear.rewards.code.compare.outputs_match` (``float_tol``, ``case_insensitive``).

``call`` (LiveCodeBench "functional", LeetCode, TACO/APPS with ``fn_name``)::

    {"format": "call", "fn_name": "maxSum", "inputs": [[[1, 2], 3], ...], "outputs": [6, ...]}

  ``inputs[i]`` is the argument list. Calls ``Solution().fn_name(*args)`` when the program
  defines ``class Solution``, else the top-level function; results compare with
  :func:`klear.rewards.code.compare.values_match`.

``assert`` (HumanEval ``check(candidate)``, MBPP ``test_list``, rllm LeetCode ``functional``)::

    {"format": "assert", "test": "def check(candidate): ...", "entry_point": "add",
     "prefix": "<trusted code: imports, helper classes, the problem's prompt>"}
    {"format": "assert", "tests": ["assert f(1) == 2", ...], "prefix": "..."}

  ``test`` is one test, ``tests`` a list of separately counted tests. With ``entry_point`` the
  judge calls ``check(<entry_point>)`` after running the test code. ``setup`` (MBPP's
  ``test_setup_code``) runs inside the sandbox right after the program, so it may use the
  program's classes; the tests see the globals it creates. Because it runs next to the program,
  put no checking logic in ``setup`` (the program could subvert it); checking belongs in the
  tests or the ``prefix``. The tests see the program's functions and classes as proxies, except
  names the prefix defines and names that shadow builtins; ``"functions": ["sum", ...]`` lists
  names the tests call that may shadow builtins (MBPP task 126 defines ``sum``). Also accepted:
  ``{"functional": "..."}`` (rllm LeetCode; use :func:`klear.rewards.code.datasets.leetcode_ground_truth`
  for the preamble).

Every layout takes ``time_limit_s`` (seconds per test, in (0, 3600]; else the row's
``extra_info["time_limit_s"]``, else the sandbox's) and ``float_tol`` (in [0, 1));
``case_insensitive`` is for ``stdio`` and ``call`` only (``klear.data.rl_data.load_rl_file`` sets it
when the statement accepts any output case, unless the ground truth already says;
:mod:`klear.data.code_data`).
"""

from __future__ import annotations

import json
import keyword
import logging
import re
from dataclasses import dataclass
from typing import Any, TypedDict

from klear.rewards.code.compare import DEFAULT_FLOAT_TOL

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CodeTests:
    """Parsed ground truth (see the module docstring for the JSON layouts)."""

    format: str
    inputs: tuple = ()
    outputs: tuple = ()
    tests: tuple = ()
    fn_name: str | None = None
    entry_point: str | None = None
    functions: tuple | None = None
    prefix: str = ""
    setup: str = ""
    float_tol: float = DEFAULT_FLOAT_TOL
    time_limit_s: float | None = None
    case_insensitive: bool = False

    @property
    def total(self) -> int:
        return len(self.tests) if self.format == "assert" else len(self.inputs)


class _CommonFields(TypedDict):
    """The :class:`CodeTests` fields every layout takes."""

    prefix: str
    setup: str
    float_tol: float
    time_limit_s: float | None
    case_insensitive: bool


def _as_str_list(v: Any, what: str) -> tuple[str, ...]:
    if not isinstance(v, (list, tuple)):
        raise ValueError(f"ground_truth.{what} must be a list, got {type(v).__name__}")
    out = []
    for i, x in enumerate(v):
        if isinstance(x, list):  # some datasets store lines
            x = "\n".join(map(str, x)) + "\n"
        if not isinstance(x, str):
            raise ValueError(f"ground_truth.{what}[{i}] must be a string, got {type(x).__name__}")
        out.append(x)
    return tuple(out)


def _is_name(x: Any) -> bool:
    return isinstance(x, str) and x.isidentifier() and not keyword.iskeyword(x) and x not in ("None", "True", "False")


def parse_ground_truth(ground_truth: Any, extra_info: dict | None = None) -> CodeTests:
    """Read a code ground truth into :class:`CodeTests`.

    Args:
        ground_truth: dict or JSON text in one of the module docstring's layouts.
        extra_info: verl extra info; ``time_limit_s`` there overrides the sandbox default.

    Raises:
        ValueError: not JSON, unknown layout, missing or mistyped fields, no tests, or inputs
            and outputs of different lengths (the message names the field).
    """
    gt = ground_truth
    if isinstance(gt, (bytes, bytearray)):
        gt = gt.decode()
    if isinstance(gt, str):
        try:
            gt = json.loads(gt)
        except ValueError as e:
            raise ValueError(f"code ground_truth is not valid JSON: {e}") from None
    if isinstance(gt, list) and gt and all(isinstance(t, dict) and "input" in t for t in gt):
        gt = {"format": "stdio", "inputs": [t["input"] for t in gt], "outputs": [t.get("output") for t in gt]}
    if not isinstance(gt, dict):
        raise ValueError(f"code ground_truth must be a JSON object, got {type(gt).__name__}")
    fmt = gt.get("format")
    if fmt is None:
        if "functional" in gt or "test" in gt or "tests" in gt:
            fmt = "assert"
        elif "inputs" in gt:
            fmt = "call" if gt.get("fn_name") else "stdio"
        else:
            raise ValueError(f"code ground_truth has no 'format' and no known fields (keys: {sorted(gt)})")
    tol = gt.get("float_tol", DEFAULT_FLOAT_TOL)
    if not isinstance(tol, (int, float)) or isinstance(tol, bool) or not (0 <= tol < 1):
        raise ValueError(f"ground_truth.float_tol must be a number in [0, 1), got {tol!r}")
    tl = gt.get("time_limit_s", (extra_info or {}).get("time_limit_s") if isinstance(extra_info, dict) else None)
    if tl is not None and (not isinstance(tl, (int, float)) or isinstance(tl, bool) or not (0 < tl <= 3600)):
        raise ValueError(f"ground_truth.time_limit_s must be a number in (0, 3600], got {tl!r}")
    prefix = gt.get("prefix", "") or ""
    if not isinstance(prefix, str):
        raise ValueError("ground_truth.prefix must be a string")
    setup = gt.get("setup", "") or ""
    if not isinstance(setup, str):
        raise ValueError("ground_truth.setup must be a string")
    caseless = gt.get("case_insensitive", False)
    if not isinstance(caseless, bool):
        raise ValueError(f"ground_truth.case_insensitive must be true or false, got {caseless!r}")
    if caseless and fmt == "assert":
        raise ValueError("ground_truth.case_insensitive applies to 'stdio' and 'call' tests, not 'assert'")
    common = _CommonFields(
        prefix=prefix,
        setup=setup,
        float_tol=float(tol),
        time_limit_s=None if tl is None else float(tl),
        case_insensitive=caseless,
    )
    if fmt == "stdio":
        inputs = _as_str_list(gt.get("inputs"), "inputs")
        outputs = _as_str_list(gt.get("outputs"), "outputs")
        if len(inputs) != len(outputs):
            raise ValueError(f"ground_truth has {len(inputs)} inputs but {len(outputs)} outputs")
        if not inputs:
            raise ValueError("ground_truth has no tests")
        return CodeTests("stdio", inputs=inputs, outputs=outputs, **common)
    if fmt == "call":
        fn = gt.get("fn_name")
        if not _is_name(fn):
            raise ValueError(f"ground_truth.fn_name must be a function name, got {fn!r}")
        arg_lists, results = gt.get("inputs"), gt.get("outputs")
        if not isinstance(arg_lists, list) or not isinstance(results, list):
            raise ValueError("ground_truth.inputs and .outputs must be lists for format 'call'")
        if len(arg_lists) != len(results):
            raise ValueError(f"ground_truth has {len(arg_lists)} inputs but {len(results)} outputs")
        if not arg_lists:
            raise ValueError("ground_truth has no tests")
        for i, a in enumerate(arg_lists):
            if not isinstance(a, list):
                raise ValueError(f"ground_truth.inputs[{i}] must be a list of arguments, got {type(a).__name__}")
        return CodeTests("call", inputs=tuple(arg_lists), outputs=tuple(results), fn_name=fn, **common)
    if fmt == "assert":
        if "tests" in gt:
            tests = _as_str_list(gt["tests"], "tests")
        else:
            t = gt.get("test", gt.get("functional"))
            if not isinstance(t, str) or not t.strip():
                raise ValueError("ground_truth.test must be a non-empty string of Python test code")
            tests = (t,)
        if not tests:
            raise ValueError("ground_truth has no tests")
        for i, t in enumerate(tests):
            if not t.strip():
                raise ValueError(f"ground_truth.tests[{i}] is empty (an empty test would pass any program)")
        ep = gt.get("entry_point")
        if ep is not None and not _is_name(ep):
            raise ValueError(f"ground_truth.entry_point must be a function name, got {ep!r}")
        if ep is not None and not all(re.search(r"^\s*def\s+check\s*\(", t, re.M) for t in tests):
            raise ValueError("ground_truth.entry_point is set, so every test must define check(candidate)")
        functions = gt.get("functions")
        if functions is not None and (not isinstance(functions, list) or not all(_is_name(f) for f in functions)):
            raise ValueError(f"ground_truth.functions must be a list of function names, got {functions!r}")
        return CodeTests(
            "assert",
            tests=tests,
            entry_point=ep,
            functions=tuple(functions) if functions is not None else None,
            **common,
        )
    raise ValueError(f"ground_truth.format must be 'stdio', 'call' or 'assert', got {fmt!r}")


_BAD_GT_SEEN: set[str] = set()


def log_bad_ground_truth(msg: str) -> None:
    """Log *msg* (why a ground truth cannot be used; its problem scores as failed) once per
    distinct message, for the first 1000 distinct messages."""
    if msg not in _BAD_GT_SEEN and len(_BAD_GT_SEEN) < 1000:
        _BAD_GT_SEEN.add(msg)
        logger.error("code reward: invalid ground truth, scoring as failed: %s", msg)
