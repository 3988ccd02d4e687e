"""The ``klear eval`` harness: generate n samples per problem, judge them, resume, summarise.

Run directory (``--output DIR``):

* ``samples.jsonl``: one judged sample per line, appended and flushed (fsync) batch by batch:
  ``problem_id``, ``sample_index``, ``seed``, ``response``, ``extracted`` (math: the last boxed
  answer; code: the program the judge runs), ``verdict`` (``"correct"``/``"wrong"``/``"unscored"``),
  ``correct``, ``reward`` (the judge's raw reward; null when unscored), ``n_tokens``, ``finish_reason``
  (``"stop"``/``"length"``), ``data_source``;
* ``problems.jsonl``: the problems as judged (id, prompt, data source, ground truth), so that
  ``--judge-only DIR/samples.jsonl`` can re-score without the benchmark file;
* ``run.json``: the settings that must not change between resumes (model, benchmark
  fingerprint, sampling, seed, rope plan) and a log of the invocations (with wall times);
* ``summary.json`` and ``summary.md``: metrics (see :func:`klear.eval.metrics.summarize_samples`),
  settings and rope record. The summary holds no timings, so a resumed run's summary equals an
  uninterrupted one's byte for byte.

Resume: re-running with the same ``--output`` reads ``samples.jsonl`` (a torn last line from a
killed run is cut off with a warning; any other malformed line is an error naming file and
line) and generates only the missing ``(problem, sample_index)`` pairs. Every sample has its own
seed (:func:`klear.eval.backends.sample_seed`), so the regenerated samples are the ones the
interrupted run would have produced. Raising ``--n`` later adds samples; lowering it
summarises the first n.

Verdicts come from :func:`klear.rewards.compute_scores` (the RL reward): a sample is correct
when its reward is exactly 1.0 (math: +1 correct / -1 wrong; code: passed/total = 1).

Unscored samples (the judge could not score them: its worker pool kept failing after its backoff
retries; reward ``nan``, :mod:`klear.rewards.correctness`) never count as wrong. :func:`judge`
re-judges them once more; what is still unscored is written with verdict ``"unscored"`` and
re-judged when the run is resumed (run the same command again); the summary leaves them out of
every metric (each problem's n is its scored samples) and reports their number as ``n_unscored``.
"""

from __future__ import annotations

import datetime as _dt
import importlib
import json
import logging
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from klear.eval.backends import Completion, GenerationRequest, SamplingSettings, sample_seed
from klear.eval.benchmarks import (
    DEFAULT_MATH_DATA_SOURCE,
    Benchmark,
    Problem,
    get_field,
    gold_answer,
    iter_records,
)
from klear.eval.metrics import summarize_samples

logger = logging.getLogger(__name__)

SAMPLES_FILE = "samples.jsonl"
PROBLEMS_FILE = "problems.jsonl"
RUN_FILE = "run.json"
SUMMARY_FILE = "summary.json"
TABLE_FILE = "summary.md"

RESPONSE_FIELDS = ("response", "completion", "output", "generated_text")
SAMPLE_ID_FIELDS = ("problem_id", "task_id", "question_id")
SAMPLE_ANSWER_FIELDS = ("ground_truth", "answer", "gold")


# ------------------------------------------------------------------------------------ judging
def extract_answer(problem: Problem, response: str) -> str | None:
    """What the judge reads from a response, for reports and maj@n (never the verdict):
    :func:`klear.rewards.extract_answer` for the problem's ``data_source``."""
    from klear.rewards import extract_answer as judge_extract

    return judge_extract(response, problem.data_source)


def ensure_judges(problems: Sequence[Problem]) -> None:
    """Fail early when a problem's ``data_source`` has no registered reward.

    Code problems import ``klear.rewards.code_reward`` (which registers the ``code`` prefix).

    Raises:
        ValueError: a data source without a scorer (the message says which).
    """
    import klear.rewards as rewards

    if any(p.kind == "code" or p.data_source.startswith("code") for p in problems):
        try:
            importlib.import_module("klear.rewards.code_reward")
        except ImportError as e:
            raise ValueError(
                f"code problems need the code judge (klear.rewards.code_reward), which is not "
                f"available in this installation: {e}"
            ) from None
    for ds in sorted({p.data_source for p in problems}):
        try:
            rewards.get_scorer(ds)
        except ValueError as e:
            raise ValueError(f"cannot judge data_source {ds!r}: {e}") from None


def judge(problems: Sequence[Problem], responses: Sequence[str]) -> list[tuple[float, bool, str | None]]:
    """Judge ``responses[i]`` against ``problems[i]`` with :func:`klear.rewards.compute_scores`.

    Responses the judge could not score are judged once more (a second round of the pool's backoff).

    Returns:
        ``(reward, correct, extracted)`` per response; ``correct`` is :func:`klear.rewards.correctness.is_correct`;
        ``reward`` is ``nan`` (and ``correct`` False) for a response still unscored (see the module docstring).
    """
    from klear.rewards import compute_scores, is_correct, is_unscored

    if not responses:
        return []

    def score(idx: list[int]) -> list[float]:
        return [
            float(r)
            for r in compute_scores(
                [problems[i].data_source for i in idx],
                [responses[i] for i in idx],
                [problems[i].ground_truth for i in idx],
                [problems[i].extra_info for i in idx],
            )
        ]

    rewards = score(list(range(len(responses))))
    again = [i for i, r in enumerate(rewards) if is_unscored(r)]
    if again:
        logger.warning("%d sample(s) could not be scored; judging them again", len(again))
        for i, r in zip(again, score(again)):
            rewards[i] = r
    return [(r, is_correct(r), extract_answer(p, s)) for p, s, r in zip(problems, responses, rewards)]


def judged_record(reward: float, ok: bool) -> dict[str, Any]:
    """The ``verdict``/``correct``/``reward`` fields of a sample line (``reward`` null when unscored)."""
    from klear.rewards import is_unscored

    if is_unscored(reward):
        return {"verdict": "unscored", "correct": False, "reward": None}
    return {"verdict": "correct" if ok else "wrong", "correct": ok, "reward": reward}


def rejudge_unscored(records: list[dict], by_id: dict[str, Problem]) -> int:
    """Judge again, in place, the records whose verdict is ``"unscored"``; returns how many got a verdict."""
    idx = [i for i, r in enumerate(records) if r.get("verdict") == "unscored"]
    if not idx:
        return 0
    verdicts = judge([by_id[records[i]["problem_id"]] for i in idx], [records[i]["response"] for i in idx])
    fixed = 0
    for i, (reward, ok, _) in zip(idx, verdicts):
        records[i].update(judged_record(reward, ok))
        fixed += records[i]["verdict"] != "unscored"
    return fixed


# ------------------------------------------------------------------------------- sample files
_REQUIRED = {"problem_id": str, "sample_index": int, "response": str, "correct": bool}


def read_samples(path: str | os.PathLike, *, repair_torn_tail: bool = False) -> list[dict]:
    """Read a ``klear eval`` ``samples.jsonl``.

    A last line without its newline that is not valid JSON is a torn write from a killed run:
    with ``repair_torn_tail`` it is cut off (warning), otherwise it is an error.

    Raises:
        ValueError: a malformed or incomplete line, or a duplicate (problem, sample) pair;
            the message names the file and the 1-based line.
    """
    p = Path(path)
    if not p.is_file():
        return []
    data = p.read_bytes()
    lines = data.split(b"\n")
    records: list[dict] = []
    seen: dict[tuple[str, int], int] = {}
    offset = 0
    for lineno, raw in enumerate(lines, start=1):
        is_tail = lineno == len(lines)  # text after the last newline (b"" for a complete file)
        line_start = offset
        offset += len(raw) + 1
        if not raw.strip():
            continue
        try:
            rec = json.loads(raw.decode("utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            if is_tail:
                if repair_torn_tail:
                    logger.warning("%s:%d: cutting off a torn last line from an interrupted run", p, lineno)
                    with open(p, "r+b") as f:
                        f.truncate(line_start)
                    break
                raise ValueError(f"{p}:{lineno}: torn last line (no newline, invalid JSON)") from None
            raise ValueError(f"{p}:{lineno}: invalid JSON ({e})") from None
        if not isinstance(rec, dict):
            raise ValueError(f"{p}:{lineno}: expected a JSON object")
        for key, typ in _REQUIRED.items():
            v = rec.get(key)
            if not isinstance(v, typ) or (typ is int and isinstance(v, bool)):
                raise ValueError(f"{p}:{lineno}: field {key!r} must be {typ.__name__}, got {v!r:.60}")
        sample = (rec["problem_id"], rec["sample_index"])
        if sample in seen:
            raise ValueError(f"{p}:{lineno}: duplicate sample {sample} (first on line {seen[sample]})")
        seen[sample] = lineno
        records.append(rec)
    else:
        if repair_torn_tail and data and not data.endswith(b"\n"):
            # a complete last record whose newline was never written: finish the line before appending
            with open(p, "ab") as f:
                f.write(b"\n")
    return records


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def _problem_row(p: Problem) -> dict:
    return {
        "problem_id": p.problem_id,
        "messages": p.messages,
        "data_source": p.data_source,
        "ground_truth": p.ground_truth,
        "extra_info": p.extra_info,
        "kind": p.kind,
        "metadata": p.metadata,
    }


def load_problems_file(path: str | os.PathLike) -> list[Problem]:
    """Read a run directory's ``problems.jsonl`` back into problems.

    Raises:
        ValueError: a malformed line (names file and line).
    """
    out = []
    for where, rec in iter_records(path):
        try:
            out.append(
                Problem(
                    str(rec["problem_id"]),
                    rec["messages"],
                    rec["data_source"],
                    rec["ground_truth"],
                    rec.get("extra_info"),
                    rec.get("kind", "math"),
                    rec.get("metadata") or {},
                )
            )
        except KeyError as e:
            raise ValueError(f"{where}: missing field {e}") from None
    return out


# ------------------------------------------------------------------------------------ reports
def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}"


def _rope_text(rope: Any) -> str:
    if not isinstance(rope, dict):
        return "-"
    plan = rope.get("plan")
    text = json.dumps({k: v for k, v in plan.items() if k != "override"}, sort_keys=True) if plan else "-"
    if rope.get("loaded"):
        text += f"; loaded model: {json.dumps(rope['loaded'], sort_keys=True)}"
    if rope.get("note"):
        text += f" ({rope['note']})"
    return text


def markdown_table(summary: dict) -> str:
    """A markdown report of a summary: the headline table, the settings, and per-problem accuracy."""
    m = summary
    ks = list(m["pass_at_k"])
    n = m["n"] if m["n"] is not None else f"{m.get('n_min')}-{m.get('n_max')}"
    avg = m["avg_at_n"]
    ci = "" if avg["ci_low"] is None else f" [{_pct(avg['ci_low'])}, {_pct(avg['ci_high'])}]"
    head = ["benchmark", "problems", "n", "avg@n (95% CI)"] + [f"pass@{k}" for k in ks]
    row = [m["benchmark"]["name"], str(m["n_problems"]), str(n), _pct(avg["mean"]) + ci]
    row += [_pct(m["pass_at_k"][k]) for k in ks]
    if "maj_at_n" in m:
        head.append("maj@n")
        row.append(_pct(m["maj_at_n"]))
    head += ["mean tokens", "truncated %"]
    tok = m["mean_response_tokens"]
    row += ["-" if tok is None else f"{tok:.0f}", _pct(m["truncation_rate"])]
    lines = [
        f"# klear eval: {m['benchmark']['name']}",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
        "| " + " | ".join(row) + " |",
        "",
    ]
    s = m.get("sampling") or {}
    rope = m.get("rope") or {}
    lines += [
        f"- model: `{m.get('model')}`, backend: {m.get('backend')}",
        f"- sampling: temperature {s.get('temperature')}, top-p {s.get('top_p')}, "
        f"max tokens {s.get('max_tokens')}, seed {m.get('seed')}",
        f"- rope: {_rope_text(rope)}",
        f"- avg@n interval: {avg['method']}",
        *([f"- unscored samples (left out of every metric): {m['n_unscored']}"] if m.get("n_unscored") else []),
        "- values in percent; pass@k is the unbiased per-problem estimator (Chen et al. 2021), averaged over problems",
        "",
    ]
    lines += ["| problem | n | correct | accuracy | mean tokens | truncated |", "|---|---|---|---|---|---|"]
    for r in m["per_problem"]:
        mt = "-" if r["mean_tokens"] is None else f"{r['mean_tokens']:.0f}"
        tr = "-" if r["truncated"] is None else str(r["truncated"])
        lines.append(f"| {r['problem_id']} | {r['n']} | {r['correct']} | {_pct(r['accuracy'])} | {mt} | {tr} |")
    return "\n".join(lines) + "\n"


def build_summary(
    problems: Sequence[Problem],
    records: Sequence[dict],
    *,
    n: int | None,
    ks: Sequence[int] | None,
    maj: bool,
    header: dict,
) -> dict:
    """Summary dict: ``header`` (benchmark, model, sampling, rope ...) + the metrics of the samples
    with ``sample_index < n`` (all samples when ``n`` is None). Unscored samples are left out of the
    metrics and counted in ``n_unscored``.

    Raises:
        ValueError: a problem whose samples are all unscored, or as :func:`summarize_samples`.
    """
    by_pid: dict[str, list[dict]] = {p.problem_id: [] for p in problems}
    n_unscored = 0
    for r in records:
        if r["problem_id"] in by_pid and (n is None or r["sample_index"] < n):
            if r.get("verdict") == "unscored":
                n_unscored += 1
                continue
            by_pid[r["problem_id"]].append(r)
    for recs in by_pid.values():
        recs.sort(key=lambda r: r["sample_index"])
    if n_unscored:
        logger.warning(
            "%d sample(s) could not be scored by the judge; they are left out of the metrics "
            "(run the same command again to re-judge them)",
            n_unscored,
        )
        empty = [pid for pid, recs in by_pid.items() if not recs]
        if empty:
            raise ValueError(
                f"every sample of problem {empty[0]!r} is unscored (the judge's reward workers kept failing); "
                "run the same command again to re-judge them"
            )
    metrics = summarize_samples([p.problem_id for p in problems], by_pid, ks=ks, maj=maj)
    judge_sources = sorted({p.data_source for p in problems})
    out = dict(header)
    out["judge"] = {"data_sources": judge_sources, "correct_if": "reward >= 1.0 (klear.rewards.correctness.is_correct)"}
    out.update(metrics)
    out["n_unscored"] = n_unscored
    return out


def write_reports(output_dir: Path, summary: dict) -> None:
    """Write ``summary.json`` and ``summary.md`` (atomically)."""
    _atomic_write(output_dir / SUMMARY_FILE, json.dumps(summary, indent=2, sort_keys=False) + "\n")
    _atomic_write(output_dir / TABLE_FILE, markdown_table(summary))


# --------------------------------------------------------------------------------------- run
def _check_run_config(run_path: Path, config: dict) -> dict:
    if not run_path.is_file():
        return {"config": config, "invocations": []}
    try:
        run = json.loads(run_path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{run_path}:{e.lineno}: invalid JSON ({e.msg})") from None
    old = run.get("config") or {}
    diff = _changed_settings(old, config)
    if diff:
        details = "; ".join(f"{k}: {a!r:.80} -> {b!r:.80}" for k, a, b in diff)
        raise ValueError(
            f"{run_path.parent} holds a run with different settings ({details}; saved -> now); "
            "resume with the same settings or choose another --output"
        )
    return run


_MISSING = "<unset>"


def _changed_settings(old: Any, new: Any, prefix: str = "") -> list[tuple[str, Any, Any]]:
    """``(dotted key, old value, new value)`` for every setting that differs, descending into mappings
    (``sampling.temperature: 0.6 -> 1.0``, not the whole ``sampling`` dict)."""
    if isinstance(old, dict) and isinstance(new, dict):
        out = []
        for k in sorted(set(old) | set(new), key=str):
            out += _changed_settings(old.get(k, _MISSING), new.get(k, _MISSING), f"{prefix}{k}.")
        return out
    return [] if old == new else [(prefix.rstrip("."), old, new)]


def run_eval(
    benchmark: Benchmark,
    backend: Any,
    output_dir: str | os.PathLike,
    *,
    n: int = 64,
    sampling: SamplingSettings | None = None,
    seed: int = 0,
    ks: Sequence[int] | None = None,
    maj: bool = False,
    model: str | None = None,
    rope: dict | None = None,
    show_progress: bool = True,
) -> dict:
    """Generate, judge and summarise *n* samples per problem, resuming from ``output_dir``.

    Args:
        benchmark: the problems (:func:`klear.eval.benchmarks.load_benchmark`).
        backend: an object with ``name``, ``chunk_size`` and
            ``generate(requests, sampling, progress=None) -> list[Completion]``
            (:class:`~klear.eval.backends.HFBackend`, :class:`~klear.eval.backends.VLLMBackend`,
            or a test double).
        output_dir: run directory (created; see the module docstring).
        n: samples per problem.
        sampling: temperature / top-p / max tokens (default: the paper's 0.6 / 0.95 / 32768).
        seed: run seed; sample seeds derive from it, the problem id and the sample index.
        ks: pass@k values (each <= n); default powers of two below n, and n.
        maj: report maj@n.
        model: model name/path recorded in the summary.
        rope: the rope record (plan and what the loaded model reports), recorded in the summary.
        show_progress: tqdm bar over samples (rate in samples/s and ETA).

    Returns:
        The summary (also written to ``summary.json``).

    Raises:
        ValueError: bad n/k, a run directory holding different settings, a malformed samples
            file, or a data source without a judge.
    """
    from tqdm.auto import tqdm

    sampling = sampling or SamplingSettings()
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be a positive int, got {n!r}")
    for k in ks or ():
        if k > n:
            raise ValueError(f"pass@{k} needs k <= n = {n} (k > n is refused, not estimated)")
    ensure_judges(benchmark.problems)
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    rope_record = rope or {"plan": None}
    config = {
        "model": model,
        "benchmark": benchmark.name,
        "benchmark_fingerprint": benchmark.fingerprint(),
        "sampling": {"temperature": sampling.temperature, "top_p": sampling.top_p, "max_tokens": sampling.max_tokens},
        "seed": seed,
        "rope": rope_record.get("plan"),
    }
    run_path = out / RUN_FILE
    run = _check_run_config(run_path, config)
    samples_path = out / SAMPLES_FILE
    records = read_samples(samples_path, repair_torn_tail=True)
    by_id = benchmark.by_id()
    for r in records:
        if r["problem_id"] not in by_id:
            raise ValueError(f"{samples_path}: sample of unknown problem {r['problem_id']!r}")
    if rejudge_unscored(records, by_id):  # a resumed run re-judges what its last invocation could not score
        _atomic_write(samples_path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
    done = {(r["problem_id"], r["sample_index"]) for r in records}
    requests = [
        GenerationRequest(p.problem_id, i, p.messages, sample_seed(seed, p.problem_id, i))
        for p in benchmark.problems
        for i in range(n)
        if (p.problem_id, i) not in done
    ]
    if not (out / PROBLEMS_FILE).is_file():
        _atomic_write(out / PROBLEMS_FILE, "".join(json.dumps(_problem_row(p)) + "\n" for p in benchmark.problems))

    started = time.time()
    wanted = {(p.problem_id, i) for p in benchmark.problems for i in range(n)}
    invocation: dict[str, Any] = {
        "started": _dt.datetime.now().isoformat(timespec="seconds"),
        "backend": getattr(backend, "name", None),
        "precision": getattr(backend, "precision", None),
        "n": n,
        "already_done": len(done & wanted),
        "to_generate": len(requests),
        "generated": 0,
    }
    run.setdefault("invocations", []).append(invocation)
    _atomic_write(run_path, json.dumps(run, indent=2) + "\n")
    if requests:
        logger.info(
            "%s: %d samples to generate (%d already done)", benchmark.name, len(requests), invocation["already_done"]
        )
    chunk = max(1, int(getattr(backend, "chunk_size", 16)))
    try:
        with (
            open(samples_path, "a", encoding="utf-8") as f,
            tqdm(
                total=len(requests),
                unit="sample",
                desc=f"eval {benchmark.name}",
                disable=not show_progress,
                smoothing=0.1,
            ) as bar,
        ):
            for start in range(0, len(requests), chunk):
                part = requests[start : start + chunk]
                comps: list[Completion] = backend.generate(part, sampling, progress=bar.update)
                if len(comps) != len(part):
                    raise RuntimeError(f"backend returned {len(comps)} completions for {len(part)} requests")
                verdicts = judge([by_id[r.problem_id] for r in part], [c.text for c in comps])
                lines = []
                for req, comp, (reward, ok, extracted) in zip(part, comps, verdicts):
                    rec = {
                        "problem_id": req.problem_id,
                        "sample_index": req.sample_index,
                        "seed": req.seed,
                        "response": comp.text,
                        "extracted": extracted,
                        **judged_record(reward, ok),
                        "n_tokens": comp.n_tokens,
                        "finish_reason": comp.finish_reason,
                        "data_source": by_id[req.problem_id].data_source,
                    }
                    records.append(rec)
                    lines.append(json.dumps(rec, ensure_ascii=False) + "\n")
                f.write("".join(lines))
                f.flush()
                os.fsync(f.fileno())
                invocation["generated"] += len(part)
    finally:
        invocation["wall_s"] = round(time.time() - started, 3)
        _atomic_write(run_path, json.dumps(run, indent=2) + "\n")

    header = {
        "benchmark": {
            "name": benchmark.name,
            "source": benchmark.source,
            "n_problems": len(benchmark.problems),
            "fingerprint": config["benchmark_fingerprint"],
            "settings": benchmark.settings,
        },
        "model": model,
        "backend": getattr(backend, "name", None),
        "seed": seed,
        "sampling": config["sampling"],
        "rope": rope_record,
    }
    summary = build_summary(benchmark.problems, records, n=n, ks=ks, maj=maj, header=header)
    write_reports(out, summary)
    return summary


# ---------------------------------------------------------------------------------- judge-only
def _judged_from(output_dir: Path, src: Path) -> bool:
    """Whether ``output_dir`` holds a judge-only result of the samples file ``src`` (re-judging it is
    idempotent: its files are rewritten from ``src``)."""
    try:
        summary = json.loads((output_dir / SUMMARY_FILE).read_text())
        done_from = (summary.get("benchmark") or {}).get("samples_file")
        return bool(summary.get("judge_only")) and done_from is not None and Path(done_from).resolve() == src.resolve()
    except (OSError, ValueError, AttributeError):
        return False


def _sample_from_line(where: str, rec: dict, *, response_field, id_field, answer_field) -> dict:
    if response_field:
        resp = get_field(rec, response_field, None)
        if resp is None:
            raise ValueError(f"{where}: no field {response_field!r}")
    else:
        resp = next((rec[f] for f in RESPONSE_FIELDS if isinstance(rec.get(f), str)), None)
        msgs = rec.get("messages")
        if (
            resp is None
            and isinstance(msgs, list)
            and msgs
            and isinstance(msgs[-1], dict)
            and msgs[-1].get("role") == "assistant"
        ):
            resp = msgs[-1].get("content")
        if resp is None:
            raise ValueError(
                f"{where}: no response (looked for {', '.join(RESPONSE_FIELDS)} and a last "
                "assistant message); pass --response-field"
            )
    if not isinstance(resp, str):
        raise ValueError(f"{where}: the response must be a string, got {type(resp).__name__}")
    if id_field:
        pid = get_field(rec, id_field, None)
    else:
        pid = next((rec[f] for f in SAMPLE_ID_FIELDS if rec.get(f) not in (None, "")), None)
    if pid is None or pid == "":
        looked = ", ".join([id_field] if id_field else SAMPLE_ID_FIELDS)
        raise ValueError(f"{where}: no problem id (looked for {looked}); pass --id-field")
    if isinstance(pid, float) and pid.is_integer():
        pid = int(pid)
    idx = rec.get("sample_index")
    if idx is not None and (isinstance(idx, bool) or not isinstance(idx, int) or idx < 0):
        raise ValueError(f"{where}: sample_index must be a non-negative int, got {idx!r}")
    answer = (
        get_field(rec, answer_field, None)
        if answer_field
        else next((rec[f] for f in SAMPLE_ANSWER_FIELDS if rec.get(f) not in (None, "")), None)
    )
    if answer_field and answer is None:
        raise ValueError(f"{where}: no field {answer_field!r}")
    n_tokens = rec.get("n_tokens")
    fin = rec.get("finish_reason")
    return {
        "problem_id": str(pid),
        "sample_index": idx,
        "response": resp,
        "answer": answer,
        "data_source": rec.get("data_source") if isinstance(rec.get("data_source"), str) else None,
        "n_tokens": n_tokens if isinstance(n_tokens, int) and not isinstance(n_tokens, bool) else None,
        "finish_reason": fin if isinstance(fin, str) else None,
        "seed": rec.get("seed"),
        "where": where,
    }


def judge_only(
    samples_path: str | os.PathLike,
    output_dir: str | os.PathLike,
    *,
    benchmark: Benchmark | None = None,
    ks: Sequence[int] | None = None,
    maj: bool = False,
    n: int | None = None,
    response_field: str | None = None,
    id_field: str | None = None,
    answer_field: str | None = None,
    data_source: str | None = None,
    on_progress: Callable[[int], None] | None = None,
) -> dict:
    """Score existing responses without a model and write the usual reports.

    Each line of *samples_path* needs a response (``response``/``completion``/``output``/
    ``generated_text``, the last assistant message, or ``response_field``) and a problem id
    (``problem_id``/``task_id``/``question_id`` or ``id_field``); ``sample_index`` is optional
    (default: order within the problem). Ground truths come from, in this order: *benchmark*;
    a ``problems.jsonl`` next to the samples file (a ``klear eval`` run directory); each line's
    ``ground_truth``/``answer``/``gold`` (or ``answer_field``) with its ``data_source`` (or
    *data_source*, default ``math_eval``).

    Writes ``samples.jsonl`` (re-judged), ``summary.json`` and ``summary.md`` to *output_dir*. An
    *output_dir* that already holds a judge-only result of the same samples file is rewritten (the
    same command twice is idempotent); one holding any other run's ``samples.jsonl`` is refused.

    Raises:
        ValueError: malformed lines (file and line named), unknown problems, benchmark problems
            without samples, duplicate samples, k larger than a problem's sample count.
    """
    src = Path(samples_path)
    out = Path(output_dir)
    if out.resolve() != src.parent.resolve() and (out / SAMPLES_FILE).is_file() and not _judged_from(out, src):
        raise ValueError(f"{out} already holds {SAMPLES_FILE} from another run; choose another --output")
    lines = [
        _sample_from_line(w, r, response_field=response_field, id_field=id_field, answer_field=answer_field)
        for w, r in iter_records(src)
    ]
    if not lines:
        raise ValueError(f"{src}: no samples")

    problems: list[Problem]
    origin: str
    sibling = src.parent / PROBLEMS_FILE
    if benchmark is not None:
        problems, origin = list(benchmark.problems), benchmark.source
    elif sibling.is_file() and answer_field is None and all(s["answer"] is None for s in lines):
        problems, origin = load_problems_file(sibling), str(sibling)
    else:
        problems, origin = [], f"ground truths in {src}"
        first: dict[str, tuple[str, Any, str]] = {}
        for s in lines:
            if s["answer"] is None:
                raise ValueError(
                    f"{s['where']}: no ground truth in the line (looked for "
                    f"{', '.join([answer_field] if answer_field else SAMPLE_ANSWER_FIELDS)}); "
                    "pass --benchmark or --answer-field"
                )
            ds = data_source or s["data_source"] or DEFAULT_MATH_DATA_SOURCE
            gt = s["answer"]
            if ds.startswith("code"):
                if isinstance(gt, str):
                    try:
                        gt = json.loads(gt)
                    except json.JSONDecodeError:
                        raise ValueError(f"{s['where']}: a code ground truth must be a JSON test layout") from None
                kind = "code"
            else:
                gt, kind = gold_answer(s["where"], gt), "math"
            pid = s["problem_id"]
            if pid in first:
                if first[pid][1] != gt or first[pid][2] != ds:
                    raise ValueError(
                        f"{s['where']}: problem {pid!r} has a different ground truth or data source "
                        f"than on {first[pid][0]}"
                    )
                continue
            first[pid] = (s["where"], gt, ds)
            problems.append(Problem(pid, [], ds, gt, kind=kind, metadata={"where": s["where"]}))
    if data_source and benchmark is None:
        for p in problems:
            p.data_source = data_source
    ensure_judges(problems)
    by_id = {p.problem_id: p for p in problems}

    counters: dict[str, int] = {}
    seen: dict[tuple[str, int], str] = {}
    for s in lines:
        if s["problem_id"] not in by_id:
            raise ValueError(f"{s['where']}: problem {s['problem_id']!r} is not in {origin}")
        if s["sample_index"] is None:
            s["sample_index"] = counters.get(s["problem_id"], 0)
        counters[s["problem_id"]] = max(counters.get(s["problem_id"], 0), s["sample_index"] + 1)
        key = (s["problem_id"], s["sample_index"])
        if key in seen:
            raise ValueError(f"{s['where']}: duplicate sample {key} (first at {seen[key]})")
        seen[key] = s["where"]
    missing = [p.problem_id for p in problems if p.problem_id not in counters]
    if missing:
        raise ValueError(
            f"{len(missing)} problem(s) of {origin} have no samples in {src} (first: {', '.join(missing[:5])})"
        )

    verdicts = judge([by_id[s["problem_id"]] for s in lines], [s["response"] for s in lines])
    if on_progress is not None:
        on_progress(len(lines))
    records = []
    for s, (reward, ok, extracted) in zip(lines, verdicts):
        records.append(
            {
                "problem_id": s["problem_id"],
                "sample_index": s["sample_index"],
                "seed": s["seed"],
                "response": s["response"],
                "extracted": extracted,
                **judged_record(reward, ok),
                "n_tokens": s["n_tokens"],
                "finish_reason": s["finish_reason"],
                "data_source": by_id[s["problem_id"]].data_source,
            }
        )
    order = {pid: i for i, pid in enumerate(by_id)}
    records.sort(key=lambda r: (order[r["problem_id"]], r["sample_index"]))

    rope: Any = {"plan": None, "note": "judge-only: the responses were not generated here"}
    model = backend = sampling = seed = None
    run_file = src.parent / RUN_FILE
    if run_file.is_file():
        try:
            cfg = json.loads(run_file.read_text()).get("config") or {}
            rope = {"plan": cfg.get("rope"), "note": f"from {run_file}"}
            model, sampling, seed = cfg.get("model"), cfg.get("sampling"), cfg.get("seed")
        except (json.JSONDecodeError, AttributeError):
            pass
    out.mkdir(parents=True, exist_ok=True)
    name = benchmark.name if benchmark is not None else src.parent.name if sibling.is_file() else src.stem
    header = {
        "benchmark": {"name": name, "source": origin, "n_problems": len(problems), "samples_file": str(src)},
        "model": model,
        "backend": backend,
        "seed": seed,
        "sampling": sampling,
        "rope": rope,
        "judge_only": True,
    }
    summary = build_summary(problems, records, n=n, ks=ks, maj=maj, header=header)
    _atomic_write(out / SAMPLES_FILE, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
    write_reports(out, summary)
    return summary
