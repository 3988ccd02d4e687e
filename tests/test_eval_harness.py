"""klear.eval.harness and the `klear eval` CLI: judge-only exact metrics, resume, torn lines, errors."""

from __future__ import annotations

import json

import pytest

from conftest import assert_error_names_file_and_line, eval_argv
from klear.cli import main
from klear.eval.backends import Completion, SamplingSettings
from klear.eval.benchmarks import load_benchmark
from klear.eval.harness import judge_only, read_samples, run_eval


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _boxed(x):
    return f"Let me think. The answer is \\boxed{{{x}}}."


# --------------------------------------------------------------------------------- judge-only
def synthetic_samples(tmp_path):
    """3 problems x 4 samples: p1 4/4, p2 1/4, p3 0/4 correct."""
    rows = []
    plan = {"p1": [True] * 4, "p2": [False, True, False, False], "p3": [False] * 4}
    gold = {"p1": "12", "p2": "\\frac{1}{2}", "p3": "7"}
    for pid, flags in plan.items():
        for i, ok in enumerate(flags):
            answer = ("0.5" if pid == "p2" else gold[pid]) if ok else "99"
            rows.append(
                {
                    "problem_id": pid,
                    "response": _boxed(answer),
                    "ground_truth": gold[pid],
                    "n_tokens": 10 * (i + 1),
                    "finish_reason": "length" if i == 3 else "stop",
                }
            )
    return _jsonl(tmp_path / "samples_in.jsonl", rows)


def test_judge_only_exact_avg_and_pass_at_k(tmp_path):
    src = synthetic_samples(tmp_path)
    s = judge_only(src, tmp_path / "out", maj=True)
    assert s["n"] == 4 and s["n_problems"] == 3
    assert s["avg_at_n"]["mean"] == pytest.approx(5 / 12)
    # p1: 1, 1, 1; p2: 1/4, 1 - C(3,2)/C(4,2) = 1/2, 1; p3: 0, 0, 0
    assert s["pass_at_k"] == pytest.approx({"1": 5 / 12, "2": 1.5 / 3, "4": 2 / 3})
    assert s["maj_at_n"] == pytest.approx(1 / 3)
    assert s["mean_response_tokens"] == pytest.approx(25.0)
    assert s["truncation_rate"] == pytest.approx(0.25)
    assert [r["correct"] for r in s["per_problem"]] == [4, 1, 0]
    out = read_samples(tmp_path / "out" / "samples.jsonl")
    assert len(out) == 12 and out[4]["extracted"] == "99" and out[5]["verdict"] == "correct"
    md = (tmp_path / "out" / "summary.md").read_text()
    assert "| p1 | 4 | 4 | 100.0 |" in md and "| p3 | 4 | 0 | 0.0 |" in md
    with pytest.raises(ValueError, match="pass@8 needs at least 8"):
        judge_only(src, tmp_path / "out2", ks=[8])


def test_judge_only_cli_and_k_greater_than_n_refused(tmp_path, capsys):
    src = synthetic_samples(tmp_path)
    assert main(["eval", "--judge-only", str(src), "--output", str(tmp_path / "o"), "--k", "1,3"]) == 0
    s = json.loads((tmp_path / "o" / "summary.json").read_text())
    assert set(s["pass_at_k"]) == {"1", "3"}
    assert s["rope"]["plan"] is None and "judge-only" in s["rope"]["note"]
    assert main(["eval", "--judge-only", str(src), "--output", str(tmp_path / "o2"), "--k", "5"]) == 2
    assert "k > n is refused" in capsys.readouterr().err


def test_eval_extracts_only_what_the_judge_reads(tmp_path):
    """samples.jsonl's ``extracted`` and maj@n follow the judge's own rule for the data source: a long-CoT
    source needs the think block, so a boxed answer without one is neither extracted nor voted (the judge
    scores it -1); the same response under a plain source is read; a code response's program likewise."""
    no_think = "The answer is \\boxed{5}"
    with_think = "<think>2+3</think> The answer is \\boxed{5}"
    rows = [
        {"problem_id": "a", "response": no_think, "ground_truth": "5", "data_source": "math_longcot_math_verify"},
        {"problem_id": "b", "response": with_think, "ground_truth": "5", "data_source": "math_longcot_math_verify"},
        {"problem_id": "c", "response": no_think, "ground_truth": "5", "data_source": "math_eval"},
    ]
    s = judge_only(_jsonl(tmp_path / "in.jsonl", rows), tmp_path / "out", maj=True)
    out = {r["problem_id"]: r for r in read_samples(tmp_path / "out" / "samples.jsonl")}
    assert [out[p]["reward"] for p in "abc"] == [-1.0, 1.0, 1.0]
    assert [out[p]["extracted"] for p in "abc"] == [None, "5", "5"]
    assert s["maj_at_n"] == pytest.approx(2 / 3)  # "a" has no vote, so no majority answer

    from klear.rewards import extract_answer

    program = "```python\nprint(1)\n```"
    assert extract_answer(program, "code") == "print(1)\n"
    assert extract_answer(program, "coder1_longcot") is None  # long-CoT code: no think block, no program
    assert extract_answer("<think>x</think>" + program, "coder1_longcot") == "print(1)\n"


def test_judge_only_with_benchmark_lookup_and_errors(tmp_path):
    bench = _jsonl(
        tmp_path / "b.jsonl",
        [{"id": "a", "problem": "1+1?", "answer": "2"}, {"id": "b", "problem": "2+2?", "answer": "4"}],
    )
    b = load_benchmark(str(bench))
    samples = _jsonl(
        tmp_path / "s.jsonl",
        [
            {"id": "a", "output": _boxed(2)},
            {"id": "a", "output": _boxed(3)},
            {"id": "b", "output": _boxed(4)},
            {"id": "b", "output": "no box"},
        ],
    )
    s = judge_only(samples, tmp_path / "o", benchmark=b, id_field="id")
    assert s["avg_at_n"]["mean"] == 0.5 and s["pass_at_k"]["2"] == 1.0
    bad = _jsonl(tmp_path / "s2.jsonl", [{"id": "zzz", "output": "x"}])
    with pytest.raises(ValueError, match=r"s2\.jsonl: row 0: problem 'zzz' is not in"):
        judge_only(bad, tmp_path / "o2", benchmark=b, id_field="id")
    partial = _jsonl(tmp_path / "s3.jsonl", [{"id": "a", "output": "x"}])
    with pytest.raises(ValueError, match="have no samples"):
        judge_only(partial, tmp_path / "o3", benchmark=b, id_field="id")


def test_interval_golds_are_one_answer_in_eval(tmp_path):
    """A gold "[1, 2]" is the closed interval in every eval path (issue 20: it was JSON-decoded into
    the answers 1 and 2); several answers come from a real list or extra_info.acceptable_answers."""
    rows = [
        {"id": "i1", "problem": "Range?", "answer": "[1, 2]"},
        {"id": "i2", "problem": "Range?", "answer": "[-2, 7]"},
        {"id": "i3", "problem": "Range?", "answer": "[0.5, 1]"},
        {"id": "l", "problem": "Half?", "answer": ["1/2", "0.5"]},
        {"id": "x", "problem": "Half?", "answer": "1/2", "extra_info": {"acceptable_answers": ["0.5"]}},
    ]
    b = load_benchmark(str(_jsonl(tmp_path / "b.jsonl", rows)))
    assert [p.ground_truth for p in b.problems] == ["[1, 2]", "[-2, 7]", "[0.5, 1]", ["1/2", "0.5"], "1/2"]
    responses = {
        "i1": ["1", "2", "[1, 2]", "[1, 2)"],
        "i2": ["-2", "7", "[-2, 7]", "[-2,7]"],
        "i3": ["0.5", "1", "[0.5, 1]", r"\left[\frac12, 1\right]"],
        "l": ["0.5", "1/2", "2", "0.25"],
        "x": ["0.5", "1/2", "2", "0.25"],
    }
    expected = {pid: [False, False, True, pid != "i1"] for pid in ("i1", "i2", "i3")}
    expected.update({"l": [True, True, False, False], "x": [True, True, False, False]})
    samples = [{"id": pid, "output": _boxed(r)} for pid, rs in responses.items() for r in rs]
    s = judge_only(_jsonl(tmp_path / "s.jsonl", samples), tmp_path / "o", benchmark=b, id_field="id")
    got = {r["problem_id"]: r["correct"] for r in s["per_problem"]}
    assert got == {pid: sum(v) for pid, v in expected.items()}
    out = read_samples(tmp_path / "o" / "samples.jsonl")
    assert [r["correct"] for r in out] == [ok for pid in responses for ok in expected[pid]]
    # judge-only with the ground truth on each sample line (no benchmark file)
    lines = [{"problem_id": "i1", "response": _boxed(r), "ground_truth": "[1, 2]"} for r in responses["i1"]]
    judge_only(_jsonl(tmp_path / "s2.jsonl", lines), tmp_path / "o2")
    assert [r["correct"] for r in read_samples(tmp_path / "o2" / "samples.jsonl")] == expected["i1"]


@pytest.mark.parametrize(
    "content,needle",
    [
        (
            '{"problem_id": "a", "response": "x", "answer": "1"}\n{"problem_id": "a", "response": \n',
            ": line 2 (row 1): invalid JSON",
        ),
        (
            '{"problem_id": "a", "response": "x", "answer": "1"}\n{"problem_id": "a", "answer": "1"}\n',
            ": row 1: no response",
        ),
        (
            '{"problem_id": "a", "response": "x", "answer": "1"}\n{"response": "x", "answer": "1"}\n',
            ": row 1: no problem id",
        ),
        ('{"problem_id": "a", "response": "x"}\n', ": row 0: no ground truth"),
        (
            '{"problem_id": "a", "response": "x", "answer": "1"}\n'
            '{"problem_id": "a", "response": "y", "answer": "2"}\n',
            ": row 1: problem 'a' has a different ground truth",
        ),
        (
            '{"problem_id": "a", "sample_index": 0, "response": "x", "answer": "1"}\n'
            '{"problem_id": "a", "sample_index": 0, "response": "y", "answer": "1"}\n',
            ": row 1: duplicate sample",
        ),
    ],
)
def test_malformed_sample_lines_name_file_and_line(tmp_path, content, needle):
    samples = tmp_path / "samples.in.jsonl"
    assert_error_names_file_and_line(lambda f: judge_only(f, tmp_path / "o"), samples, content, needle)


# ------------------------------------------------------------------------------------ run_eval
class FakeBackend:
    """Deterministic in each sample's seed, like the real backends; can 'crash' after some calls."""

    name = "fake"

    def __init__(self, answers, chunk_size=4, crash_after=None):
        self.answers, self.chunk_size, self.crash_after = answers, chunk_size, crash_after
        self.calls, self.generated = 0, []

    def generate(self, requests, sampling, progress=None):
        if self.crash_after is not None and self.calls >= self.crash_after:
            raise KeyboardInterrupt(f"simulated kill after {self.crash_after} generate calls")
        self.calls += 1
        out = []
        for r in requests:
            self.generated.append((r.problem_id, r.sample_index))
            ok = r.seed % 3 != 0
            text = _boxed(self.answers[r.problem_id] if ok else "-1")
            out.append(Completion(text, 5 + r.seed % 11, "length" if r.seed % 5 == 0 else "stop"))
        if progress:
            progress(len(requests))
        return out


@pytest.fixture()
def small_bench(tmp_path):
    rows = [{"id": f"q{i}", "problem": f"What is {i} + {i}?", "answer": str(2 * i)} for i in range(5)]
    return load_benchmark(str(_jsonl(tmp_path / "bench.jsonl", rows)))


def test_resume_after_interruption_gives_the_same_summary(tmp_path, small_bench):
    answers = {p.problem_id: p.ground_truth for p in small_bench.problems}
    kw = dict(n=6, sampling=SamplingSettings(0.6, 0.95, 64), seed=3, maj=True, model="fake-model", show_progress=False)
    full = run_eval(small_bench, FakeBackend(answers), tmp_path / "full", **kw)

    with pytest.raises(KeyboardInterrupt, match="simulated kill after 3 generate calls"):
        run_eval(small_bench, FakeBackend(answers, crash_after=3), tmp_path / "resumed", **kw)
    first = read_samples(tmp_path / "resumed" / "samples.jsonl")
    assert len(first) == 12
    # a torn line from the killed process: cut off on resume
    with open(tmp_path / "resumed" / "samples.jsonl", "a") as f:
        f.write('{"problem_id": "q3", "sample_ind')
    again = FakeBackend(answers, chunk_size=7)  # different batching must not matter
    resumed = run_eval(small_bench, again, tmp_path / "resumed", **kw)
    assert len(again.generated) == 30 - 12  # finished samples are never redone
    assert not set(again.generated) & {(r["problem_id"], r["sample_index"]) for r in first}
    assert resumed == full
    assert (tmp_path / "resumed" / "summary.json").read_text() == (tmp_path / "full" / "summary.json").read_text()
    assert sorted(map(json.dumps, read_samples(tmp_path / "resumed" / "samples.jsonl"))) == sorted(
        map(json.dumps, read_samples(tmp_path / "full" / "samples.jsonl"))
    )
    # a third run has nothing left to do
    idle = FakeBackend(answers)
    assert run_eval(small_bench, idle, tmp_path / "resumed", **kw) == full and idle.generated == []
    run = json.loads((tmp_path / "resumed" / "run.json").read_text())
    assert [i["generated"] for i in run["invocations"]] == [12, 18, 0]


def test_summary_contents_and_settings_guard(tmp_path, small_bench):
    answers = {p.problem_id: p.ground_truth for p in small_bench.problems}
    rope = {"plan": {"source": "none", "rope_type": "default", "engine_max_len": 2048}}
    s = run_eval(small_bench, FakeBackend(answers), tmp_path / "r", n=4, seed=0, rope=rope, show_progress=False)
    assert s["rope"] == rope and s["sampling"] == {"temperature": 0.6, "top_p": 0.95, "max_tokens": 32768}
    assert set(s["pass_at_k"]) == {"1", "2", "4"}
    recs = read_samples(tmp_path / "r" / "samples.jsonl")
    assert set(recs[0]) >= {
        "problem_id",
        "sample_index",
        "response",
        "extracted",
        "verdict",
        "n_tokens",
        "finish_reason",
        "reward",
    }
    expected = sum(r["correct"] for r in recs) / len(recs)
    assert s["avg_at_n"]["mean"] == pytest.approx(expected)
    with pytest.raises(ValueError, match="different settings"):
        run_eval(
            small_bench,
            FakeBackend(answers),
            tmp_path / "r",
            n=4,
            seed=0,
            rope=rope,
            show_progress=False,
            sampling=SamplingSettings(1.0, 0.95, 32768),
        )
    with pytest.raises(ValueError, match="k <= n"):
        run_eval(small_bench, FakeBackend(answers), tmp_path / "r", n=4, ks=[8], show_progress=False)
    # more samples later: only the new indices are generated
    more = FakeBackend(answers)
    run_eval(small_bench, more, tmp_path / "r", n=6, seed=0, rope=rope, show_progress=False)
    assert sorted({i for _, i in more.generated}) == [4, 5]
    # judge-only on the run's own samples finds problems.jsonl and reproduces the metrics
    rejudged = judge_only(tmp_path / "r" / "samples.jsonl", tmp_path / "rj", n=4)
    assert rejudged["avg_at_n"] == s["avg_at_n"] and rejudged["pass_at_k"] == s["pass_at_k"]
    assert rejudged["rope"]["plan"] == rope["plan"]


def test_malformed_line_in_a_run_directory_is_an_error(tmp_path, small_bench):
    answers = {p.problem_id: p.ground_truth for p in small_bench.problems}
    run_eval(small_bench, FakeBackend(answers), tmp_path / "r", n=2, show_progress=False)
    path = tmp_path / "r" / "samples.jsonl"
    lines = path.read_text().splitlines(keepends=True)
    lines[2] = "{not json}\n"
    path.write_text("".join(lines))
    with pytest.raises(ValueError, match=r"samples\.jsonl:3: invalid JSON"):
        run_eval(small_bench, FakeBackend(answers), tmp_path / "r", n=2, show_progress=False)
    lines[2] = '{"problem_id": "q1", "sample_index": "0", "response": "", "correct": true}\n'
    path.write_text("".join(lines))
    with pytest.raises(ValueError, match=r"samples\.jsonl:3: field 'sample_index'"):
        run_eval(small_bench, FakeBackend(answers), tmp_path / "r", n=2, show_progress=False)


def test_cli_user_errors_exit_2(tmp_path, capsys):
    bench = _jsonl(tmp_path / "b.jsonl", [{"problem": "1+1?", "answer": "2"}])
    assert main(["eval", "--model", "embedded", "--benchmark", "aime25", "--output", str(tmp_path / "o")]) == 2
    assert "nothing can be downloaded" in capsys.readouterr().err
    assert main(eval_argv("x", bench, tmp_path / "o", "--n 2 --k 1,4")) == 2
    assert "k <= n" in capsys.readouterr().err
    assert main(["eval", "--benchmark", str(bench), "--output", str(tmp_path / "o")]) == 2


def test_resume_when_the_last_newline_was_never_written(tmp_path, small_bench):
    answers = {p.problem_id: p.ground_truth for p in small_bench.problems}
    with pytest.raises(KeyboardInterrupt, match="simulated kill after 1 generate calls"):
        run_eval(small_bench, FakeBackend(answers, crash_after=1), tmp_path / "r", n=2, show_progress=False)
    path = tmp_path / "r" / "samples.jsonl"
    path.write_text(path.read_text().rstrip("\n"))  # complete JSON, newline lost
    rest = FakeBackend(answers)
    s = run_eval(small_bench, rest, tmp_path / "r", n=2, show_progress=False)
    assert len(rest.generated) == 10 - 4 and s["n_samples"] == 10
    assert len(read_samples(path)) == 10


# ------------------------------------------------------------- resume refusals, judge-only re-runs (issue 14)
def test_resume_refusal_names_each_changed_setting_with_old_and_new_values(tmp_path, small_bench):
    answers = {p.problem_id: p.ground_truth for p in small_bench.problems}
    rope = {
        "plan": {
            "source": "none",
            "rope_type": "default",
            "engine_max_len": 2048,
            "needed_len": 100,
            "native_context": 2048,
            "override": None,
            "config_key": "rope_parameters",
        }
    }
    kw = dict(n=2, seed=0, show_progress=False, model="m")
    run_eval(
        small_bench, FakeBackend(answers), tmp_path / "r", rope=rope, sampling=SamplingSettings(0.6, 0.95, 64), **kw
    )
    changed = {"plan": {**rope["plan"], "engine_max_len": 4096}}
    with pytest.raises(ValueError) as info:
        run_eval(
            small_bench,
            FakeBackend(answers),
            tmp_path / "r",
            rope=changed,
            sampling=SamplingSettings(1.0, 0.95, 64),
            **kw,
        )
    msg = str(info.value)
    assert "rope.engine_max_len: 2048 -> 4096; sampling.temperature: 0.6 -> 1.0; saved -> now" in msg, msg
    assert "top_p" not in msg and "native_context" not in msg and "\n" not in msg  # only what changed


def test_identical_judge_only_rerun_into_the_same_output_works(tmp_path, capsys):
    src = synthetic_samples(tmp_path)
    argv = ["eval", "--judge-only", str(src), "--output", str(tmp_path / "o"), "--k", "1,2"]
    assert main(argv) == 0
    first = (tmp_path / "o" / "summary.json").read_text()
    assert main(argv) == 0, capsys.readouterr().err  # the same command again: idempotent
    assert (tmp_path / "o" / "summary.json").read_text() == first
    other = _jsonl(tmp_path / "other.jsonl", [{"problem_id": "x", "response": _boxed(1), "ground_truth": "1"}])
    assert main(["eval", "--judge-only", str(other), "--output", str(tmp_path / "o")]) == 2  # another run's output
    assert "already holds samples.jsonl from another run" in capsys.readouterr().err


def test_unscored_samples_are_rejudged_and_never_count_as_wrong(tmp_path, small_bench, monkeypatch):
    """While the judge cannot score q1's wrong answers (nan: its workers keep failing), they are written as
    "unscored", left out of every metric (q1 is 100% over its scored samples, not c/n) and counted; running the same
    command once the judge works re-judges them, and the summary then equals an undisturbed run's."""
    import math

    import klear.rewards

    answers = {p.problem_id: p.ground_truth for p in small_bench.problems}
    kw = dict(n=6, sampling=SamplingSettings(0.6, 0.95, 64), seed=3, model="fake-model", show_progress=False)
    full = run_eval(small_bench, FakeBackend(answers), tmp_path / "full", **kw)
    real = klear.rewards.compute_scores
    down = {"on": True, "calls": 0}

    def flaky(data_sources, responses, golds, extra_infos, **k):
        scores = real(data_sources, responses, golds, extra_infos, **k)
        down["calls"] += 1
        bad = [down["on"] and g == "2" and r == _boxed("-1") for r, g in zip(responses, golds)]
        return [math.nan if b else s for s, b in zip(scores, bad)]

    monkeypatch.setattr(klear.rewards, "compute_scores", flaky)
    s = run_eval(small_bench, FakeBackend(answers), tmp_path / "run", **kw)
    lines = read_samples(tmp_path / "run" / "samples.jsonl")
    q1 = [r for r in lines if r["problem_id"] == "q1"]
    unscored = [r for r in q1 if r["verdict"] == "unscored"]
    assert unscored and len(unscored) < len(q1)
    assert all(r["reward"] is None and r["correct"] is False for r in unscored)
    assert s["n_unscored"] == len(unscored) and full["n_unscored"] == 0
    row = next(r for r in s["per_problem"] if r["problem_id"] == "q1")
    assert (row["n"], row["correct"], row["accuracy"]) == (len(q1) - len(unscored), len(q1) - len(unscored), 1.0)
    assert (
        f"unscored samples (left out of every metric): {len(unscored)}" in (tmp_path / "run" / "summary.md").read_text()
    )
    calls = down["calls"]
    down["on"] = False  # the judge works again: the same command re-judges and completes the run
    again = run_eval(small_bench, FakeBackend(answers), tmp_path / "run", **kw)
    assert down["calls"] > calls and again == full
    assert not [r for r in read_samples(tmp_path / "run" / "samples.jsonl") if r["verdict"] == "unscored"]
