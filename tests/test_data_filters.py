"""klear data filter: min-tests, pass-at-k, majority, difficulty, sft-correct, top-sources
(paper Sec. 3.2.1, 5.1, 5.2.4)."""

import json
from math import comb

import pytest

from conftest import pass_at_k_argv
from klear.cli import main
from klear.data import filters as F


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def read_jsonl(path):
    return [json.loads(x) for x in path.read_text().splitlines()]


def removed_of(out):
    path = out.with_name(out.name + ".removed.jsonl")
    return read_jsonl(path) if path.exists() else []


def code_row(pid, tests):
    return {
        "prompt": [{"role": "user", "content": f"problem {pid}"}],
        "data_source": "code_x",
        "reward_model": {"style": "rule", "ground_truth": tests},
        "extra_info": {"index": pid},
    }


# ------------------------------------------------------------------ min-tests


def test_min_tests_counts_every_shape_and_reads_the_threshold(tmp_path):
    io16 = json.dumps({"inputs": [str(i) for i in range(16)], "outputs": [str(i) for i in range(16)]})
    rows = [
        code_row(0, io16),  # 16 (JSON string)
        code_row(1, json.dumps({"inputs": ["1"] * 15, "outputs": ["1"] * 15})),  # 15
        code_row(2, [{"input": "1", "output": "2"}] * 20),  # 20 (list)
        code_row(3, {"functional": "def check(c):\n" + "    assert c(1) == 1\n" * 16}),  # 16 asserts
        {"prompt": "p", "tests": ["assert f(1) == 1"] * 3, "extra_info": {"index": 4}},  # 3, top-level field
        code_row(5, json.dumps({"format": "assert", "test": "assert f(2) == 4\n" * 17})),  # 17 (code reward)
        code_row(6, {"format": "call", "fn_name": "f", "inputs": [[1]] * 4, "outputs": [1] * 4}),  # 4
    ]
    inp = write_jsonl(tmp_path / "code.jsonl", rows)
    out = tmp_path / "out.jsonl"
    report = F.filter_min_tests(inp, out, progress=False, quiet=True)
    assert [r["extra_info"]["index"] for r in read_jsonl(out)] == [0, 2, 3, 5]
    assert [(r["row"], r["reason"], r["tests"]) for r in removed_of(out)] == [
        (1, "too_few_tests", 15),
        (4, "too_few_tests", 3),
        (6, "too_few_tests", 4),
    ]
    assert report["params"]["min_tests"] == 16
    report = F.filter_min_tests(inp, out, min_tests=3, progress=False, quiet=True)
    assert report["rows_out"] == 7 and report["removed"] == {}


def test_min_tests_malformed(tmp_path):
    inp = write_jsonl(
        tmp_path / "code.jsonl",
        [code_row(0, [1] * 16), code_row(1, json.dumps({"inputs": ["1", "2"], "outputs": ["1"]}))],
    )
    with pytest.raises(ValueError, match=r"code\.jsonl: row 1: field 'reward_model\.ground_truth\.outputs'"):
        F.filter_min_tests(inp, tmp_path / "o.jsonl", progress=False, quiet=True)
    inp = write_jsonl(tmp_path / "code.jsonl", [{"prompt": "p"}])
    with pytest.raises(ValueError, match=r"code\.jsonl: row 0: field 'tests' is missing"):
        F.filter_min_tests(inp, tmp_path / "o.jsonl", progress=False, quiet=True)


# ------------------------------------------------------------------ pass@k and majority


def samples_for(pid, n, c, key="correct"):
    return [{"problem_id": pid, key: (i < c)} for i in range(n)]


def expected_pass_at_k(n, c, k):
    return 1.0 - comb(n - c, k) / comb(n, k)


def test_pass_at_k_keeps_problems_above_threshold(tmp_path):
    rows = [code_row(i, [1] * 16) for i in range(5)]
    samples = (
        samples_for(0, 16, 1)
        + samples_for(1, 16, 0)
        + samples_for(2, 20, 1)
        + [{"problem_id": 3, "score": s} for s in [1.0] * 4 + [0.25] * 4]
    )  # 8 < k samples
    inp = write_jsonl(tmp_path / "rl.jsonl", rows)
    smp = write_jsonl(tmp_path / "samples.jsonl", samples)
    out = tmp_path / "out.jsonl"
    assert expected_pass_at_k(20, 1, 16) == pytest.approx(0.8)
    report = F.filter_pass_at_k(inp, out, smp, id_field="extra_info.index", progress=False, quiet=True)
    assert [r["extra_info"]["index"] for r in read_jsonl(out)] == [0, 2]  # pass@16: 1.0, 0.0, 0.8
    reasons = {r["row"]: r for r in removed_of(out)}
    assert reasons[1]["reason"] == "pass_at_k_too_low" and reasons[1]["pass_at_k"] == 0.0
    assert reasons[3]["reason"] == "too_few_samples" and reasons[3]["n"] == 8
    assert reasons[4]["reason"] == "no_samples"
    assert report["removed"] == {"pass_at_k_too_low": 1, "too_few_samples": 1, "no_samples": 1}
    # the threshold and k are read: 0.8 is not > 0.85; with k=1 (plain pass rate) only nothing passes 0.5
    F.filter_pass_at_k(inp, out, smp, threshold=0.85, id_field="extra_info.index", progress=False, quiet=True)
    assert [r["extra_info"]["index"] for r in read_jsonl(out)] == [0]
    report = F.filter_pass_at_k(
        inp, out, smp, k=1, threshold=0.4, id_field="extra_info.index", progress=False, quiet=True
    )
    assert [r["extra_info"]["index"] for r in read_jsonl(out)] == [3]  # 4/8 = 0.5 > 0.4 (0.25 scores: wrong)
    report = F.filter_pass_at_k(
        inp,
        out,
        smp,
        k=1,
        threshold=0.4,
        correct_score=0.25,
        id_field="extra_info.index",
        missing="keep",
        progress=False,
        quiet=True,
    )
    assert [r["extra_info"]["index"] for r in read_jsonl(out)] == [3, 4]  # all 8 correct now; 4 kept


def test_pass_at_k_judges_responses_with_the_math_scorer(tmp_path):
    rows = [
        {
            "prompt": [{"role": "user", "content": "p"}],
            "data_source": "math_dapo",
            "reward_model": {"ground_truth": "73"},
            "prompt_id": "a",
        },
        {
            "prompt": [{"role": "user", "content": "q"}],
            "data_source": "math_dapo",
            "reward_model": {"ground_truth": "5"},
            "prompt_id": "b",
        },
    ]
    samples = [
        {"prompt_id": "a", "response": "so \\boxed{73}"},
        {"prompt_id": "a", "response": "\\boxed{72}"},
        {"prompt_id": "b", "response": "\\boxed{6}"},
        {"prompt_id": "b", "response": "\\boxed{5}", "ground_truth": "4", "data_source": "math_x"},
    ]
    inp, smp = write_jsonl(tmp_path / "rl.jsonl", rows), write_jsonl(tmp_path / "s.jsonl", samples)
    stats = F.load_sample_stats(smp, problems=inp, progress=False)
    assert stats == {"a": [2, 1], "b": [2, 0]}  # the sample's own ground truth (4) wins over the row's (5)
    out = tmp_path / "o.jsonl"
    F.filter_majority(inp, out, smp, min_fraction=0.4, progress=False, quiet=True)
    assert [r["prompt_id"] for r in read_jsonl(out)] == ["a"]


def test_majority_is_strict_and_reads_min_fraction(tmp_path):
    rows = [{"problem": f"p{i}", "id": i, "answer": "1"} for i in range(3)]
    samples = samples_for(0, 16, 9, "verdict") + samples_for(1, 16, 8, "verdict") + samples_for(2, 16, 3, "verdict")
    samples = [{"id": s["problem_id"], "verdict": "AC" if s["verdict"] else "WA"} for s in samples]
    inp, smp = write_jsonl(tmp_path / "m.jsonl", rows), write_jsonl(tmp_path / "s.jsonl", samples)
    out = tmp_path / "o.jsonl"
    report = F.filter_majority(inp, out, smp, progress=False, quiet=True)
    assert [r["id"] for r in read_jsonl(out)] == [0]  # 9/16 > 0.5; 8/16 is not a majority
    assert [(r["row"], r["n"], r["c"]) for r in removed_of(out)] == [(1, 16, 8), (2, 16, 3)]
    assert report["params"]["min_fraction"] == 0.5
    F.filter_majority(inp, out, smp, min_fraction=0.15, progress=False, quiet=True)
    assert [r["id"] for r in read_jsonl(out)] == [0, 1, 2]


def test_bad_samples_and_ids_are_named(tmp_path):
    inp = write_jsonl(tmp_path / "m.jsonl", [{"problem": "p", "id": 1}])
    smp = write_jsonl(tmp_path / "s.jsonl", [{"id": 1, "correct": True}, {"id": 1, "correct": "maybe"}])
    with pytest.raises(ValueError, match=r"s\.jsonl: row 1: field 'correct' is 'maybe'"):
        F.filter_majority(inp, tmp_path / "o.jsonl", smp, progress=False, quiet=True)
    smp = write_jsonl(tmp_path / "s.jsonl", [{"id": 1}])
    with pytest.raises(ValueError, match=r"s\.jsonl: row 0: field 'correct' is missing"):
        F.filter_majority(inp, tmp_path / "o.jsonl", smp, progress=False, quiet=True)
    smp = write_jsonl(tmp_path / "s.jsonl", [{"id": 1, "correct": 1}])
    inp = write_jsonl(tmp_path / "m.jsonl", [{"problem": "p"}])
    with pytest.raises(ValueError, match=r"m\.jsonl: row 0: field 'prompt_id' is missing"):
        F.filter_majority(inp, tmp_path / "o.jsonl", smp, progress=False, quiet=True)
    with pytest.raises(ValueError, match="min_fraction must be a number in"):
        F.filter_majority(inp, tmp_path / "o.jsonl", smp, min_fraction=2, progress=False, quiet=True)


# ------------------------------------------------------------------ difficulty and the SFT policy


def sft(prompt, response, correct, **extra):
    return {
        "messages": [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}],
        "correct": correct,
        **extra,
    }


def test_difficulty_labels_from_pass_rate_with_configurable_thresholds(tmp_path):
    # the SFT file is its own samples file: 4 responses of P (3 correct), 2 of Q (0 correct), 2 of R (1)
    rows = (
        [sft("P", f"p{i}", i < 3) for i in range(4)]
        + [sft("Q", f"q{i}", False) for i in range(2)]
        + [sft("R", f"r{i}", i == 0) for i in range(2)]
    )
    inp = write_jsonl(tmp_path / "sft.jsonl", rows)
    out = tmp_path / "lab.jsonl"
    report = F.label_difficulty(inp, out, inp, id_field="@text", sample_id_field="@text", progress=False, quiet=True)
    got = [(r["messages"][0]["content"], r["difficulty"], r["pass_rate"]) for r in read_jsonl(out)]
    assert got == [("P", "easy", 0.75)] * 4 + [("Q", "hard", 0.0)] * 2 + [("R", "easy", 0.5)] * 2
    assert report["labels"] == {"easy": 6, "hard": 2}
    F.label_difficulty(
        inp,
        out,
        inp,
        id_field="@text",
        sample_id_field="@text",
        easy_min=0.7,
        hard_below=0.3,
        label_field="extra_info.level",
        rate_field=None,
        progress=False,
        quiet=True,
    )
    got = [(r["extra_info"]["level"], "pass_rate" in r) for r in read_jsonl(out)]
    assert got == [("easy", False)] * 4 + [("hard", False)] * 2 + [("medium", False)] * 2
    with pytest.raises(ValueError, match="hard_below"):
        F.label_difficulty(inp, out, inp, easy_min=0.2, hard_below=0.3, id_field="@text", progress=False)


def test_sft_correctness_policy_of_table_2(tmp_path):
    rows = [
        sft("e", "1", True, difficulty="easy"),
        sft("e", "2", False, difficulty="easy"),
        sft("m", "3", False, difficulty="medium"),
        sft("m", "4", 1.0, difficulty="medium"),
        sft("h", "5", False, difficulty="hard"),
        sft("h", "6", True, difficulty="hard"),
        sft("h", "7", -1, difficulty="hard"),
    ]
    inp = write_jsonl(tmp_path / "sft.jsonl", rows)
    out = tmp_path / "o.jsonl"
    report = F.filter_sft_correctness(inp, out, progress=False, quiet=True)
    assert [r["messages"][1]["content"] for r in read_jsonl(out)] == ["1", "4", "5", "6", "7"]
    assert [(r["row"], r["difficulty"]) for r in removed_of(out)] == [(1, "easy"), (2, "medium")]
    assert report["responses_by_difficulty"]["hard"] == {"correct": 1, "incorrect": 2}
    F.filter_sft_correctness(inp, out, mixed_for=("hard", "medium"), progress=False, quiet=True)
    assert [r["messages"][1]["content"] for r in read_jsonl(out)] == ["1", "3", "4", "5", "6", "7"]
    F.filter_sft_correctness(inp, out, mixed_for=(), progress=False, quiet=True)
    assert [r["messages"][1]["content"] for r in read_jsonl(out)] == ["1", "4", "6"]
    bad = write_jsonl(tmp_path / "bad.jsonl", [sft("e", "1", True, difficulty="easy"), sft("x", "2", True)])
    with pytest.raises(ValueError, match=r"bad\.jsonl: row 1: field 'difficulty' is None"):
        F.filter_sft_correctness(bad, out, progress=False, quiet=True)


def test_sft_correctness_with_the_judge(tmp_path):
    rows = [
        sft("e", "\\boxed{4}", None, difficulty="easy", data_source="math_x", reward_model={"ground_truth": "4"}),
        sft("e", "\\boxed{5}", None, difficulty="easy", data_source="math_x", reward_model={"ground_truth": "4"}),
    ]
    inp = write_jsonl(tmp_path / "sft.jsonl", rows)
    report = F.filter_sft_correctness(inp, tmp_path / "o.jsonl", judge=True, progress=False, quiet=True)
    assert report["rows_out"] == 1 and report["removed"] == {"incorrect_response": 1}


# ------------------------------------------------------------------ top sources


def test_top_sources_by_ranking(tmp_path):
    rows = [{"problem": str(i), "data_source": src} for i, src in enumerate(["a", "b", "c", "a", "z"])]
    inp = write_jsonl(tmp_path / "in.jsonl", rows)
    ranking = tmp_path / "rank.json"
    ranking.write_text(json.dumps({"a": 0.9, "b": 0.95, "c": 0.1}))
    out = tmp_path / "o.jsonl"
    report = F.filter_top_sources(inp, out, ranking, k=1, progress=False, quiet=True)
    assert [r["problem"] for r in read_jsonl(out)] == ["1"]  # b scores best
    assert report["kept_sources"] == ["b"]
    assert report["removed"] == {"below_top_k": 3, "unranked_source": 1}
    F.filter_top_sources(inp, out, ranking, k=2, progress=False, quiet=True)
    assert [r["problem"] for r in read_jsonl(out)] == ["0", "1", "3"]
    txt = tmp_path / "rank.txt"
    txt.write_text("# best first\nc\n\na\n")
    F.filter_top_sources(inp, out, txt, k=1, progress=False, quiet=True)
    assert [r["problem"] for r in read_jsonl(out)] == ["2"]
    with pytest.raises(ValueError, match=r"in\.jsonl: row 0: field 'source' is None"):
        F.filter_top_sources(inp, out, txt, k=1, source_field="source", progress=False, quiet=True)


def test_cli_filters(tmp_path, capsys):
    rows = [code_row(i, [1] * (16 if i else 2)) for i in range(3)]
    inp = write_jsonl(tmp_path / "rl.jsonl", rows)
    out = tmp_path / "o.jsonl"
    assert main(["data", "filter", "min-tests", str(inp), str(out), "--no-progress"]) == 0
    assert "3 rows in, 2 rows out, 1 removed (too_few_tests: 1)" in capsys.readouterr().out
    assert main(["data", "filter", "min-tests", str(inp), str(out), "--min", "1", "--no-progress"]) == 0
    assert "3 rows in, 3 rows out, 0 removed" in capsys.readouterr().out
    smp = write_jsonl(tmp_path / "s.jsonl", samples_for(1, 16, 16) + samples_for(2, 16, 0))
    assert main(pass_at_k_argv(inp, out, smp)) == 0
    assert "3 rows in, 1 rows out, 2 removed (no_samples: 1, pass_at_k_too_low: 1)" in capsys.readouterr().out
    assert main(["data", "filter", "pass-at-k", str(inp), str(out), "--samples", str(smp), "--k", "0"]) == 2
    assert "k must be an integer >= 1" in capsys.readouterr().err


def test_pass_at_k_stats_refuse_an_unscored_sample(tmp_path, monkeypatch):
    """A sample the judge could not score (nan) is an error naming its line, not a wrong sample in the pass rate."""
    import klear.rewards

    monkeypatch.setattr(klear.rewards, "compute_scores", lambda ds, responses, *a, **k: [float("nan")] * len(ds))
    rows = [
        {
            "prompt": [{"role": "user", "content": "p"}],
            "data_source": "math_dapo",
            "reward_model": {"ground_truth": "73"},
            "prompt_id": "a",
        }
    ]
    samples = [{"prompt_id": "a", "response": "\\boxed{73}"}, {"prompt_id": "a", "response": "\\boxed{72}"}]
    inp, smp = write_jsonl(tmp_path / "rl.jsonl", rows), write_jsonl(tmp_path / "s.jsonl", samples)
    with pytest.raises(RuntimeError, match=r"s\.jsonl: row 0: the reward judge could not score this response \(2 of 2"):
        F.load_sample_stats(smp, problems=inp, progress=False)


def test_cli_passes_every_rule_option_to_its_function(tmp_path, capsys):
    """Each rule's CLI options reach the function under their parameter names (the CLI dispatches by name)."""
    rows = [sft("P", f"p{i}", i < 3, difficulty="easy" if i else "medium", data_source="s") for i in range(4)]
    rows += [sft("Q", f"q{i}", False, difficulty="hard", data_source="t") for i in range(2)]
    inp = write_jsonl(tmp_path / "sft.jsonl", rows)
    out = tmp_path / "o.jsonl"

    def cli(*argv):
        assert main(["data", "filter", *argv[:1], str(inp), str(out), *argv[1:], "--no-progress"]) == 0
        capsys.readouterr()
        return read_jsonl(out), json.loads(out.with_name(out.name + ".report.json").read_text())

    kept, report = cli(
        *("difficulty", "--samples", str(inp), "--id-field", "@text", "--sample-id-field", "@text"),
        *("--easy-min", "0.7", "--hard-below", "0.3", "--label-field", "level", "--rate-field", ""),
    )
    assert [(r["level"], "pass_rate" in r) for r in kept] == [("easy", False)] * 4 + [("hard", False)] * 2
    assert report["params"]["easy_min"] == 0.7 and report["params"]["hard_below"] == 0.3
    kept, _ = cli("sft-correct", "--mixed-for", "medium, hard")  # the medium row 0 (correct) and every hard row
    assert [r["messages"][1]["content"] for r in kept] == ["p0", "p1", "p2", "q0", "q1"]
    kept, _ = cli("sft-correct", "--mixed-for", "", "--correct-field", "correct")  # correct responses only
    assert [r["messages"][1]["content"] for r in kept] == ["p0", "p1", "p2"]
    kept, _ = cli(
        *("majority", "--samples", str(inp), "--id-field", "@text", "--sample-id-field", "@text"),
        *("--min-fraction", "0.6", "--min-samples", "3"),
    )
    assert [r["messages"][1]["content"] for r in kept] == ["p0", "p1", "p2", "p3"]  # P: 3/4 > 0.6; Q: 2 samples
    ranking = tmp_path / "rank.txt"
    ranking.write_text("t\ns\n")
    kept, _ = cli("top-sources", "--ranking", str(ranking), "--k", "1", "--source-field", "data_source")
    assert {r["data_source"] for r in kept} == {"t"}
