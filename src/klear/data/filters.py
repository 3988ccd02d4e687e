"""Data filters of the Klear-Reasoner recipe (paper Sec. 3.1, 3.2.1, 5.1, 5.2.4), each one ``klear data filter RULE``.

================  ==========================================================================
rule              keeps a row when
================  ==========================================================================
``min-tests``     its problem has at least ``min_tests`` test cases (paper Sec. 5.2.4: 16).
``pass-at-k``     the teacher's unbiased pass@k on its problem (from a samples file) is
                  strictly greater than ``threshold`` (paper Sec. 5.2.4: pass@16 > 0.5, code).
``majority``      strictly more than ``min_fraction`` of its teacher samples are correct
                  (paper Sec. 3.2.1: a majority of 16 samples verify, math).
``difficulty``    always (it LABELS rows): pass rate >= ``easy_min`` -> ``easy``, pass rate
                  < ``hard_below`` -> ``hard``, else ``medium``; writes the label and the rate.
``sft-correct``   Table 2 policy: a response to an ``easy`` (or ``medium``) prompt is kept
                  only if correct; responses to ``hard`` prompts (``mixed_for``) are all kept.
``top-sources``   its source is among the ``k`` best of a given quality ranking (Tables 4, 5:
                  Top-1/Top-2 sources beat Top-4..10).
================  ==========================================================================

Teacher samples file (``pass-at-k``, ``majority``, ``difficulty``): JSONL/JSON/parquet, one row per
sample, with the problem id (first of ``prompt_id``, ``problem_id``, ``id``, ``extra_info.index``;
or ``sample_id_field``; ``@text`` = the normalised prompt text, as for the data rows) and either

* a verdict: ``correct`` / ``verdict`` / ``passed`` (a bool, or a word such as ``"pass"``,
  ``"accepted"``, ``"AC"``, ``"wrong"``, ``"WA"``), or a number in any of these or in ``score`` /
  ``reward`` (correct when ``>= correct_score``, default 1.0: math +1, code soft reward 1.0 = all
  tests passed, so 0/1 work too); or
* a ``response`` string, judged with :func:`klear.rewards.compute_scores` (math scorer; the code
  scorer once registered), using the sample's ``data_source`` and ``ground_truth`` /
  ``reward_model.ground_truth``, or else those of the data row with the same id.

A sample counts as correct when its verdict is true or its score is ``>= correct_score``.
n = samples of the problem, c = correct ones; pass@k is :func:`klear.stats.pass_at_k`
(Chen et al.'s unbiased estimator). With n == k == 16 pass@16 is 1 as soon as one sample
passes, so ``threshold=0.5`` then means "at least one of 16 passes"; ``k=1`` gives the plain pass
rate c/n. Rows whose problem has no sample are dropped (reason ``no_samples``) unless
``missing="keep"``/``"error"``; rows with fewer than k samples are dropped as
``too_few_samples``.

Test cases (``min-tests``): the first of ``tests``, ``test_cases``, ``input_output``,
``reward_model.ground_truth`` (or ``tests_field``). Counted as: a list -> its length; a dict with
``inputs`` (and ``outputs``) lists -> their length; ``{"functional": code}`` or a code string ->
its ``assert`` statements; a dict with ``test_list``/``tests``/``test_cases``/``input_output``/
``test`` -> recursively (so the ``klear.rewards.code_reward`` formats ``stdio``, ``call`` and
``assert`` all count); a JSON string -> decoded first.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from klear.data.difficulty import DIFFICULTY_LABELS, check_labels, difficulty_label, keep_response
from klear.data.io import DEFAULT_ID_FIELDS, Record, iter_batches, row_id
from klear.data.pipeline import Drop, run_rows, where
from klear.data.text import dedup_digest, get_path, row_text, short_repr
from klear.rewards.correctness import is_correct

logger = logging.getLogger(__name__)

__all__ = [
    "DIFFICULTY_LABELS",
    "count_tests",
    "filter_majority",
    "filter_min_tests",
    "filter_pass_at_k",
    "filter_sft_correctness",
    "filter_top_sources",
    "label_difficulty",
    "load_sample_stats",
    "read_ranking",
]

TESTS_FIELDS = ("tests", "test_cases", "input_output", "reward_model.ground_truth")
TEXT_ID = "@text"
MISSING_POLICIES = ("drop", "keep", "error")
_TRUE_WORDS = {"true", "yes", "correct", "pass", "passed", "accepted", "ac", "ok", "right"}
_FALSE_WORDS = {
    "false",
    "no",
    "wrong",
    "incorrect",
    "fail",
    "failed",
    "rejected",
    "wa",
    "tle",
    "mle",
    "re",
    "ce",
    "timeout",
    "error",
}
_ASSERT_RE = re.compile(r"^\s*assert\b", re.MULTILINE)


# ---------------------------------------------------------------------------- helpers


def _num(name: str, value: Any, lo: float | None = None, hi: float | None = None, *, integer: bool = False):
    ok = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
    if integer:
        ok = ok and isinstance(value, int)
    if not ok or (lo is not None and value < lo) or (hi is not None and value > hi):
        rng = f" in [{lo}, {hi}]" if hi is not None else (f" >= {lo}" if lo is not None else "")
        raise ValueError(f"{name} must be {'an integer' if integer else 'a number'}{rng}, got {value!r}")
    return value


def _id_fields(spec: str | Sequence[str] | None) -> tuple[str, ...]:
    if spec is None:
        return DEFAULT_ID_FIELDS
    if isinstance(spec, str):
        return tuple(s.strip() for s in spec.split(",") if s.strip())
    return tuple(spec)


def _problem_id(row: Mapping, wh: str, fields: tuple[str, ...], text_field: str | None = None) -> str:
    """The id that joins data rows and samples (``@text``: digest of the normalised prompt text)."""
    if fields == (TEXT_ID,):
        return "text:" + dedup_digest(row_text(row, wh, text_field)).hex()
    pid = row_id(row, fields)
    if pid is None:
        raise ValueError(
            f"{wh}: field '{fields[0]}' is missing (expected a problem id in one of "
            f"{', '.join(repr(f) for f in fields)}; or pass --id-field / --sample-id-field, "
            f"'{TEXT_ID}' for the prompt text)"
        )
    return pid


def _verdict(value: Any, wh: str, name: str, correct_score: float) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, float)) and math.isfinite(value):
        return is_correct(value, correct_score)
    if isinstance(value, str):
        word = value.strip().lower()
        if word in _TRUE_WORDS:
            return True
        if word in _FALSE_WORDS:
            return False
    expected = (
        "a number"
        if name in ("score", "reward")
        else "a bool, a number compared with correct_score, or a word like 'pass'/'accepted'/'AC' or "
        "'wrong'/'fail'/'WA'"
    )
    raise ValueError(f"{wh}: field '{name}' is {short_repr(value)} (expected {expected})")


def sample_correct(row: Mapping, wh: str, correct_score: float = 1.0) -> bool | None:
    """A sample's verdict: True/False from ``correct``/``verdict``/``passed``/``score``/``reward``,
    or None when it only has a ``response`` to judge.

    Raises:
        ValueError: none of these fields, or one of the wrong type (file/row/field named).
    """
    for name in ("correct", "verdict", "passed", "score", "reward"):
        if row.get(name) is not None:
            return _verdict(row[name], wh, name, correct_score)
    if isinstance(row.get("response"), str):
        return None
    raise ValueError(
        f"{wh}: field 'correct' is missing (expected a verdict 'correct'/'verdict'/'passed', a "
        f"number 'score'/'reward', or a string 'response' to judge)"
    )


def _ground_truth(row: Mapping) -> Any:
    for f in ("ground_truth", "reward_model.ground_truth", "answer"):
        v = get_path(row, f)
        if v is not None:
            return v
    return None


def load_sample_stats(
    samples: str | os.PathLike,
    *,
    sample_id_field: str | Sequence[str] | None = None,
    sample_text_field: str | None = None,
    correct_score: float = 1.0,
    problems: str | os.PathLike | None = None,
    id_field: str | Sequence[str] | None = None,
    text_field: str | None = None,
    judge_workers: int | None = None,
    judge_kwargs: Mapping[str, Any] | None = None,
    progress: bool = True,
) -> dict[str, list[int]]:
    """Per-problem ``[n, c]`` (samples, correct samples) from a teacher samples file.

    Samples with a verdict count directly; samples with only a ``response`` are judged with
    :func:`klear.rewards.compute_scores` (their ``data_source`` / ground truth, else those of the
    row with the same id in ``problems``), and count as correct when the reward is
    ``>= correct_score``.

    Args:
        samples: the samples file.
        sample_id_field: id field(s) of a sample (comma-separated or a list; ``"@text"``).
        sample_text_field: text field for ``@text`` ids of samples.
        correct_score: reward at or above which a sample is correct (default 1.0).
        problems: the data file, for responses whose sample row lacks data_source/ground truth.
        id_field, text_field: how ``problems`` rows give their id.
        judge_workers: parallelism of the judge; judge_kwargs: passed to the scorer.

    Returns:
        ``{problem_id: [n, c]}``.

    Raises:
        FileNotFoundError: no samples file.
        ValueError: a malformed sample (file/row/field named), or nothing to judge a response with.
    """
    from tqdm import tqdm

    sid = _id_fields(sample_id_field)
    stats: dict[str, list[int]] = {}
    to_judge: list[tuple[str, str, Any, Any, Any, str]] = []  # (pid, response, ds, gt, extra, where)
    for batch in iter_batches(samples):
        for rec in batch:
            wh = where(samples, rec)
            pid = _problem_id(rec.data, wh, sid, sample_text_field)
            verdict = sample_correct(rec.data, wh, correct_score)
            if verdict is None:
                to_judge.append(
                    (
                        pid,
                        rec.data["response"],
                        rec.data.get("data_source"),
                        _ground_truth(rec.data),
                        rec.data.get("extra_info"),
                        wh,
                    )
                )
                continue
            s = stats.setdefault(pid, [0, 0])
            s[0] += 1
            s[1] += int(verdict)
    if not to_judge:
        return stats
    need = {pid for pid, _, ds, gt, _, _ in to_judge if ds is None or gt is None}
    info: dict[str, tuple[Any, Any, Any]] = {}
    if need:
        if problems is None:
            raise ValueError(
                f"{to_judge[0][5]}: field 'data_source' or 'ground_truth' is missing (a response "
                f"to judge needs them, in the sample or in the data row)"
            )
        pf = _id_fields(id_field)
        for batch in iter_batches(problems):
            for rec in batch:
                pid = _problem_id(rec.data, where(problems, rec), pf, text_field)
                if pid in need:
                    info[pid] = (rec.data.get("data_source"), _ground_truth(rec.data), rec.data.get("extra_info"))
    items = []
    for pid, resp, ds, gt, extra, wh in to_judge:
        if ds is None or gt is None:
            pds, pgt, pextra = info.get(pid, (None, None, None))
            ds, gt, extra = ds if ds is not None else pds, gt if gt is not None else pgt, extra or pextra
        if not isinstance(ds, str) or not ds:
            raise ValueError(
                f"{wh}: field 'data_source' is missing (expected a string in the sample or in the "
                f"data row with id {pid!r})"
            )
        if gt is None:
            raise ValueError(
                f"{wh}: field 'ground_truth' is missing (expected 'ground_truth' or "
                f"'reward_model.ground_truth' in the sample or in the data row with id {pid!r})"
            )
        items.append((pid, resp, ds, gt, extra if isinstance(extra, dict) else None, wh))
    from klear.rewards import compute_scores, require_scored

    chunk = 512
    bar = tqdm(total=len(items), unit="samples", desc="judge", disable=not progress, mininterval=1.0)
    try:
        for a in range(0, len(items), chunk):
            part = items[a : a + chunk]
            scores = compute_scores(
                [x[2] for x in part],
                [x[1] for x in part],
                [x[3] for x in part],
                [x[4] for x in part],
                max_workers=judge_workers,
                **dict(judge_kwargs or {}),
            )
            require_scored(scores, [x[5] for x in part].__getitem__)  # an unscored sample is not a wrong one
            for (pid, *_), score in zip(part, scores):
                s = stats.setdefault(pid, [0, 0])
                s[0] += 1
                s[1] += int(is_correct(score, correct_score))
            bar.update(len(part))
    finally:
        bar.close()
    return stats


def _check_missing(missing: str) -> None:
    if missing not in MISSING_POLICIES:
        raise ValueError(f"missing must be one of {MISSING_POLICIES}, got {missing!r}")


def _stats_decider(inp, stats, id_fields, text_field, missing, judge_row):
    """A decide function for rules computed from per-problem [n, c]."""

    def decide(batch: Sequence[Record]) -> list[Drop | None]:
        out: list[Drop | None] = []
        for rec in batch:
            wh = where(inp, rec)
            pid = _problem_id(rec.data, wh, id_fields, text_field)
            s = stats.get(pid)
            if s is None:
                if missing == "error":
                    raise ValueError(f"{wh}: problem id {pid!r} has no teacher sample (missing='error')")
                out.append(None if missing == "keep" else Drop("no_samples", {"problem_id": pid}))
                continue
            out.append(judge_row(rec, pid, s[0], s[1]))
        return out

    return decide


# ---------------------------------------------------------------------------- rules


def count_tests(value: Any, wh: str, field: str) -> int:
    """Number of test cases in a tests value (module docstring for the accepted shapes).

    Raises:
        ValueError: an unrecognised shape, or ``inputs``/``outputs`` of different lengths.
    """
    if isinstance(value, str):
        s = value.strip()
        if s[:1] in ("[", "{"):
            try:
                return count_tests(json.loads(s), wh, field)
            except json.JSONDecodeError:
                pass
        if _ASSERT_RE.search(value):
            return len(_ASSERT_RE.findall(value))
        raise ValueError(
            f"{wh}: field '{field}' is the string {short_repr(value)} (expected test cases: a "
            f"list, a JSON string, {{'inputs': [...], 'outputs': [...]}} or code with assert "
            f"statements)"
        )
    if isinstance(value, (list, tuple)):
        return len(value)
    if isinstance(value, Mapping):
        if "inputs" in value:
            inputs, outputs = value["inputs"], value.get("outputs")
            if not isinstance(inputs, (list, tuple)):
                raise ValueError(f"{wh}: field '{field}.inputs' is {short_repr(inputs)} (expected a list)")
            if outputs is not None and (not isinstance(outputs, (list, tuple)) or len(outputs) != len(inputs)):
                raise ValueError(
                    f"{wh}: field '{field}.outputs' has {short_repr(outputs)} (expected a list as "
                    f"long as 'inputs', {len(inputs)})"
                )
            return len(inputs)
        if isinstance(value.get("functional"), str):
            return len(_ASSERT_RE.findall(value["functional"]))
        for key in ("test_list", "tests", "test_cases", "input_output", "test"):
            if key in value and value[key] is not None:
                return count_tests(value[key], wh, f"{field}.{key}")
    raise ValueError(
        f"{wh}: field '{field}' is {type(value).__name__} {short_repr(value)} (expected test "
        f"cases: a list, a JSON string, {{'inputs': [...], 'outputs': [...]}} or code with "
        f"assert statements)"
    )


def filter_min_tests(
    inp, out, *, min_tests: int = 16, tests_field: str | None = None, progress: bool = True, quiet: bool = False
) -> dict[str, Any]:
    """``klear data filter min-tests``: keep problems with at least ``min_tests`` test cases
    (paper Sec. 5.2.4: drop code problems with fewer than 16).

    Args:
        inp, out: files; tests_field: dotted field with the tests (default: module docstring).
        min_tests: the minimum count (int >= 0).

    Returns:
        The report; removed rows have reason ``too_few_tests`` and their ``tests`` count.

    Raises:
        ValueError: bad ``min_tests``, a row without tests or with unreadable tests (file/row/field).
    """
    started = time.perf_counter()
    _num("min_tests", min_tests, 0, integer=True)
    fields = (tests_field,) if tests_field else TESTS_FIELDS

    def decide(batch: Sequence[Record]) -> list[Drop | None]:
        res: list[Drop | None] = []
        for rec in batch:
            wh = where(inp, rec)
            name = next((f for f in fields if get_path(rec.data, f) is not None), None)
            if name is None:
                raise ValueError(
                    f"{wh}: field '{fields[0]}' is missing (expected test cases in one of "
                    f"{', '.join(repr(f) for f in fields)}; or pass --tests-field)"
                )
            count = count_tests(get_path(rec.data, name), wh, name)
            res.append(None if count >= min_tests else Drop("too_few_tests", {"tests": count}))
        return res

    return run_rows(
        inp,
        out,
        "filter min-tests",
        decide,
        params={"min_tests": min_tests, "tests_field": tests_field},
        progress=progress,
        quiet=quiet,
        started=started,
    )


def _run_sample_rule(
    inp,
    out,
    samples,
    command: str,
    judge_row,
    params: dict[str, Any],
    *,
    check=None,
    modifies: bool = False,
    extra=None,
    sample_id_field,
    id_field,
    text_field,
    correct_score,
    missing,
    judge_workers,
    progress,
    quiet,
    started,
) -> dict[str, Any]:
    """Run a rule computed from each problem's teacher-sample counts [n, c] over ``inp`` into ``out``.

    ``judge_row(rec, problem_id, n, c)`` returns a :class:`Drop` or None; ``check(stats)`` may refuse the whole
    sample set before any row is written. ``params`` are the rule's own settings, recorded in the report with
    the sample-reading ones; ``extra()`` adds to the report (default: the number of problems with samples);
    ``modifies``: the rule rewrites rows (as :func:`run_rows`).
    """
    _check_missing(missing)
    stats = load_sample_stats(
        samples,
        sample_id_field=sample_id_field,
        sample_text_field=text_field,
        correct_score=correct_score,
        problems=inp,
        id_field=id_field,
        text_field=text_field,
        judge_workers=judge_workers,
        progress=progress,
    )
    if check is not None:
        check(stats)
    return run_rows(
        inp,
        out,
        command,
        _stats_decider(inp, stats, _id_fields(id_field), text_field, missing, judge_row),
        params={
            **params,
            "samples": str(samples),
            "sample_id_field": sample_id_field,
            "id_field": id_field,
            "correct_score": correct_score,
            "missing": missing,
        },
        modifies=modifies,
        extra=extra or (lambda: {"problems_with_samples": len(stats)}),
        progress=progress,
        quiet=quiet,
        started=started,
    )


def filter_pass_at_k(
    inp,
    out,
    samples,
    *,
    k: int = 16,
    threshold: float = 0.5,
    correct_score: float = 1.0,
    id_field=None,
    sample_id_field=None,
    text_field: str | None = None,
    missing: str = "drop",
    judge_workers: int | None = None,
    progress: bool = True,
    quiet: bool = False,
) -> dict[str, Any]:
    """``klear data filter pass-at-k``: keep problems whose teacher pass@k is > ``threshold``
    (paper Sec. 5.2.4: pass@16 > 0.5 removes code problems with broken tests).

    Args:
        inp, out: files; samples: the teacher samples file (module docstring).
        k: the k of pass@k (int >= 1); threshold: keep when pass@k > threshold (in [0, 1]).
        correct_score: a judged/scored sample is correct when its reward is >= this.
        id_field, sample_id_field, text_field: how rows and samples give the problem id.
        missing: rows whose problem has no sample: ``drop`` (reason ``no_samples``), ``keep``, ``error``.

    Returns:
        The report; removed rows: ``pass_at_k_too_low`` (with n, c, pass_at_k), ``too_few_samples``
        (n < k for this problem), ``no_samples``. A ``k`` above every problem's sample count is an
        error (nothing could pass), as ``k > n`` is in ``klear eval``.

    Raises:
        ValueError: bad parameters or a malformed row or sample (file/row/field named).
    """
    from klear.stats import pass_at_k

    started = time.perf_counter()
    _num("k", k, 1, integer=True)
    _num("threshold", threshold, 0.0, 1.0)

    def check(stats):
        most = max((s[0] for s in stats.values()), default=0)
        if stats and k > most:  # as klear eval: pass@k needs k <= n; here no problem could pass
            raise ValueError(
                f"{samples}: --k {k} is larger than the samples of every problem (at most {most} per "
                f"problem); pass@k needs k <= n (use --k {most} or more samples)"
            )

    def judge(rec, pid, n, c):
        if n < k:
            return Drop("too_few_samples", {"problem_id": pid, "n": n, "k": k})
        value = pass_at_k(n, c, k)
        return (
            None
            if value > threshold
            else Drop("pass_at_k_too_low", {"problem_id": pid, "n": n, "c": c, "pass_at_k": value})
        )

    return _run_sample_rule(
        inp,
        out,
        samples,
        "filter pass-at-k",
        judge,
        {"k": k, "threshold": threshold},
        check=check,
        sample_id_field=sample_id_field,
        id_field=id_field,
        text_field=text_field,
        correct_score=correct_score,
        missing=missing,
        judge_workers=judge_workers,
        progress=progress,
        quiet=quiet,
        started=started,
    )


def filter_majority(
    inp,
    out,
    samples,
    *,
    min_fraction: float = 0.5,
    min_samples: int = 1,
    correct_score: float = 1.0,
    id_field=None,
    sample_id_field=None,
    text_field: str | None = None,
    missing: str = "drop",
    judge_workers: int | None = None,
    progress: bool = True,
    quiet: bool = False,
) -> dict[str, Any]:
    """``klear data filter majority``: keep prompts where strictly more than ``min_fraction`` of the
    teacher samples are correct (paper Sec. 3.2.1: a majority of 16 samples pass the rule-based
    validator; removes wrong answers and OCR noise in math data).

    Args:
        min_fraction: keep when c / n > min_fraction (in [0, 1); 0.5 = strict majority).
        min_samples: problems with fewer samples are dropped as ``too_few_samples``.
        Other arguments: as :func:`filter_pass_at_k`.

    Returns:
        The report; removed rows: ``no_majority`` (with n, c), ``too_few_samples``, ``no_samples``.

    Raises:
        ValueError: bad parameters or a malformed row or sample (file/row/field named).
    """
    started = time.perf_counter()
    _num("min_fraction", min_fraction, 0.0, 1.0)
    _num("min_samples", min_samples, 1, integer=True)

    def judge(rec, pid, n, c):
        if n < min_samples:
            return Drop("too_few_samples", {"problem_id": pid, "n": n, "min_samples": min_samples})
        return None if c / n > min_fraction else Drop("no_majority", {"problem_id": pid, "n": n, "c": c})

    return _run_sample_rule(
        inp,
        out,
        samples,
        "filter majority",
        judge,
        {"min_fraction": min_fraction, "min_samples": min_samples},
        sample_id_field=sample_id_field,
        id_field=id_field,
        text_field=text_field,
        correct_score=correct_score,
        missing=missing,
        judge_workers=judge_workers,
        progress=progress,
        quiet=quiet,
        started=started,
    )


def _set_path(row: dict, path: str, value: Any, wh: str) -> None:
    parts = path.split(".")
    node = row
    for part in parts[:-1]:
        nxt = node.get(part)
        if nxt is None:
            nxt = node[part] = {}
        if not isinstance(nxt, dict):
            raise ValueError(f"{wh}: field '{part}' is {type(nxt).__name__} (expected a dict to hold '{path}')")
        node = nxt
    node[parts[-1]] = value


def label_difficulty(
    inp,
    out,
    samples,
    *,
    easy_min: float = 0.5,
    hard_below: float = 0.5,
    label_field: str = "difficulty",
    rate_field: str | None = "pass_rate",
    correct_score: float = 1.0,
    id_field=None,
    sample_id_field=None,
    text_field: str | None = None,
    missing: str = "drop",
    judge_workers: int | None = None,
    progress: bool = True,
    quiet: bool = False,
) -> dict[str, Any]:
    """``klear data filter difficulty``: label each row ``easy`` / ``medium`` / ``hard`` from the
    teacher pass rate c / n of its problem (paper Sec. 3.1 labels difficulty from Qwen3-8B's answers;
    Sec. 5.1.1, Table 2).

    Args:
        easy_min: pass rate >= easy_min -> ``easy``; hard_below: pass rate < hard_below -> ``hard``;
            in between ``medium`` (0 <= hard_below <= easy_min <= 1; equal values: two labels).
        label_field, rate_field: dotted fields written (``rate_field=None``: no rate).
        Other arguments: as :func:`filter_pass_at_k`. The samples file may be the SFT file itself
            (rows with ``correct``), with ``id_field="@text"``.

    Returns:
        The report, with ``labels`` (label -> rows).

    Raises:
        ValueError: bad thresholds or a malformed row or sample.
    """
    started = time.perf_counter()
    _num("easy_min", easy_min, 0.0, 1.0)
    _num("hard_below", hard_below, 0.0, 1.0)
    if hard_below > easy_min:
        raise ValueError(f"hard_below ({hard_below}) must be <= easy_min ({easy_min})")
    labels: dict[str, int] = {}

    def judge(rec, pid, n, c):
        rate = c / n
        label = difficulty_label(rate, easy_min, hard_below)
        labels[label] = labels.get(label, 0) + 1
        _set_path(rec.data, label_field, label, where(inp, rec))
        if rate_field:
            _set_path(rec.data, rate_field, rate, where(inp, rec))
        return None

    return _run_sample_rule(
        inp,
        out,
        samples,
        "filter difficulty",
        judge,
        {"easy_min": easy_min, "hard_below": hard_below, "label_field": label_field, "rate_field": rate_field},
        modifies=True,
        extra=lambda: {"labels": labels},
        sample_id_field=sample_id_field,
        id_field=id_field,
        text_field=text_field,
        correct_score=correct_score,
        missing=missing,
        judge_workers=judge_workers,
        progress=progress,
        quiet=quiet,
        started=started,
    )


def _last_assistant(row: Mapping, wh: str) -> str:
    for name in ("messages", "prompt"):
        msgs = row.get(name)
        if isinstance(msgs, list):
            for msg in reversed(msgs):
                if isinstance(msg, Mapping) and msg.get("role") == "assistant":
                    if not isinstance(msg.get("content"), str):
                        raise ValueError(
                            f"{wh}: field '{name}[].content' of the assistant message is "
                            f"{short_repr(msg.get('content'))} (expected a string)"
                        )
                    return msg["content"]
    for name in ("response", "completion"):
        if isinstance(row.get(name), str):
            return row[name]
    raise ValueError(
        f"{wh}: field 'messages' has no assistant message (expected the response to judge, or a 'response' string)"
    )


def filter_sft_correctness(
    inp,
    out,
    *,
    mixed_for: Sequence[str] = ("hard",),
    difficulty_field: str = "difficulty",
    correct_field: str = "correct",
    judge: bool = False,
    correct_score: float = 1.0,
    judge_workers: int | None = None,
    progress: bool = True,
    quiet: bool = False,
) -> dict[str, Any]:
    """``klear data filter sft-correct``: the difficulty-dependent correctness policy of Table 2
    (paper Sec. 5.1.1): for prompts labelled ``easy`` keep only correct responses; for ``hard`` prompts
    keep every response (mixed correct and incorrect data helps there). ``medium`` follows
    ``easy`` unless listed in ``mixed_for``.

    Args:
        mixed_for: labels whose incorrect responses are kept (default ``("hard",)``).
        difficulty_field: dotted field with the label (``easy``/``medium``/``hard``; see
            :func:`label_difficulty`).
        correct_field: dotted field with the response's verdict (bool, 0/1, word, or a number
            compared with ``correct_score``), used unless ``judge``.
        judge: judge the last assistant message with :func:`klear.rewards.compute_scores`
            (``data_source`` and ``reward_model.ground_truth``/``ground_truth`` of the row).

    Returns:
        The report; removed rows have reason ``incorrect_response`` (with the difficulty).

    Raises:
        ValueError: unknown labels, or a row without a label or verdict (file/row/field named).
    """
    started = time.perf_counter()
    mixed = check_labels(mixed_for)
    kept_by: dict[str, dict[str, int]] = {lab: {"correct": 0, "incorrect": 0} for lab in DIFFICULTY_LABELS}

    def decide(batch: Sequence[Record]) -> list[Drop | None]:
        labels = []
        for rec in batch:
            wh = where(inp, rec)
            label = get_path(rec.data, difficulty_field)
            if label not in DIFFICULTY_LABELS:
                raise ValueError(
                    f"{wh}: field '{difficulty_field}' is {short_repr(label)} (expected one of "
                    f"{DIFFICULTY_LABELS}; label rows with 'klear data filter difficulty')"
                )
            labels.append(label)
        if judge:
            from klear.rewards import compute_scores, require_scored

            args = []
            for rec in batch:
                wh = where(inp, rec)
                ds, gt = rec.data.get("data_source"), _ground_truth(rec.data)
                if not isinstance(ds, str) or not ds:
                    raise ValueError(
                        f"{wh}: field 'data_source' is {short_repr(ds)} (expected a non-empty string "
                        f"to choose the judge)"
                    )
                if gt is None:
                    raise ValueError(
                        f"{wh}: field 'reward_model.ground_truth' is missing (expected the answer "
                        f"to judge the response against)"
                    )
                extra = rec.data.get("extra_info")
                args.append((ds, _last_assistant(rec.data, wh), gt, extra if isinstance(extra, dict) else None))
            scores = compute_scores(
                [a[0] for a in args],
                [a[1] for a in args],
                [a[2] for a in args],
                [a[3] for a in args],
                max_workers=judge_workers,
            )
            require_scored(scores, lambda i: where(inp, batch[i]))  # an unscored response is not a wrong one
            verdicts = [is_correct(s, correct_score) for s in scores]
        else:
            verdicts = []
            for rec in batch:
                wh = where(inp, rec)
                value = get_path(rec.data, correct_field)
                if value is None:
                    raise ValueError(
                        f"{wh}: field '{correct_field}' is missing (expected the response's verdict; or pass --judge)"
                    )
                verdicts.append(_verdict(value, wh, correct_field, correct_score))
        res: list[Drop | None] = []
        for label, ok in zip(labels, verdicts):
            kept_by[label]["correct" if ok else "incorrect"] += 1
            if keep_response(label, ok, mixed):
                res.append(None)
            else:
                res.append(Drop("incorrect_response", {"difficulty": label}))
        return res

    return run_rows(
        inp,
        out,
        "filter sft-correct",
        decide,
        params={
            "mixed_for": list(mixed),
            "difficulty_field": difficulty_field,
            "correct_field": None if judge else correct_field,
            "judge": judge,
            "correct_score": correct_score,
        },
        extra=lambda: {"responses_by_difficulty": kept_by},
        progress=progress,
        quiet=quiet,
        started=started,
    )


def read_ranking(path: str | os.PathLike) -> list[str]:
    """A source quality ranking, best first: a ``.json`` list (best first) or object
    ``{source: score}`` (higher is better; ties by name), or a text file with one source per
    line, best first (blank lines and ``#`` comments ignored).

    Raises:
        FileNotFoundError, ValueError: missing, empty, malformed, or a source listed twice.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file (ranking)")
    text = path.read_text(encoding="utf-8")
    if path.suffix.lower() == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: invalid JSON: {exc}") from exc
        if isinstance(data, dict):
            for k, v in data.items():
                if isinstance(v, bool) or not isinstance(v, (int, float)):
                    raise ValueError(f"{path}: field '{k}' is {short_repr(v)} (expected a number: higher is better)")
            ranking = [k for k, _ in sorted(data.items(), key=lambda kv: (-kv[1], kv[0]))]
        elif isinstance(data, list) and all(isinstance(x, str) and x for x in data):
            ranking = list(data)
        else:
            raise ValueError(
                f"{path}: expected a JSON list of source names (best first) or an object {{source: score}}"
            )
    else:
        ranking = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.strip().startswith("#")]
    if not ranking:
        raise ValueError(f"{path}: the ranking is empty")
    dup = sorted({s for s in ranking if ranking.count(s) > 1})
    if dup:
        raise ValueError(f"{path}: sources listed more than once: {dup}")
    return ranking


def filter_top_sources(
    inp,
    out,
    ranking: str | os.PathLike | Sequence[str],
    *,
    k: int = 1,
    source_field: str = "data_source",
    progress: bool = True,
    quiet: bool = False,
) -> dict[str, Any]:
    """``klear data filter top-sources``: keep rows from the ``k`` best sources of a quality ranking
    (paper Sec. 5.1.3, Tables 4 and 5: few high-quality sources beat many).

    Args:
        ranking: a ranking file (:func:`read_ranking`) or a list of sources, best first.
        k: how many of the best sources to keep (int >= 1).
        source_field: dotted field holding a row's source (default ``data_source``).

    Returns:
        The report with ``kept_sources`` and ``rows_by_source``; removed rows have reason
        ``below_top_k`` (ranked lower) or ``unranked_source``.

    Raises:
        ValueError: bad k or ranking, or a row without a string source (file/row/field named).
    """
    started = time.perf_counter()
    _num("k", k, 1, integer=True)
    order = read_ranking(ranking) if isinstance(ranking, (str, os.PathLike)) else list(ranking)
    if not order:
        raise ValueError("the ranking is empty")
    rank = {s: i for i, s in enumerate(order)}
    top = set(order[:k])
    by_source: dict[str, int] = {}

    def decide(batch: Sequence[Record]) -> list[Drop | None]:
        res: list[Drop | None] = []
        for rec in batch:
            src = get_path(rec.data, source_field)
            if not isinstance(src, str) or not src:
                raise ValueError(
                    f"{where(inp, rec)}: field '{source_field}' is {short_repr(src)} (expected a non-empty source name)"
                )
            by_source[src] = by_source.get(src, 0) + 1
            if src in top:
                res.append(None)
            elif src in rank:
                res.append(Drop("below_top_k", {"source": src, "rank": rank[src] + 1}))
            else:
                res.append(Drop("unranked_source", {"source": src}))
        return res

    return run_rows(
        inp,
        out,
        "filter top-sources",
        decide,
        params={
            "k": k,
            "source_field": source_field,
            "ranking": str(ranking) if isinstance(ranking, (str, os.PathLike)) else order,
        },
        extra=lambda: {"kept_sources": order[:k], "rows_by_source": by_source},
        progress=progress,
        quiet=quiet,
        started=started,
    )
