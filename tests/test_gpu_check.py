"""benchmarks/gpu_check.py: its verdicts, its guards and budget, and its CPU mode end to end on the tiny model."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check.py"
LINE = re.compile(r"^(PASS|FAIL|SKIP) [a-z_0-9]+: \S")


@pytest.fixture(scope="module")
def gc():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # dataclasses resolve the module by name
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop("gpu_check", None)


def _ctx(gc, tmp_path, budget_s=60.0, cpu=True):
    return gc.Context(out=tmp_path, work=tmp_path, cpu=cpu, budget_s=budget_s, tokenizer=None)


def test_a_raising_check_fails_alone_and_a_late_check_is_skipped(gc, tmp_path, capsys, monkeypatch):
    def boom(ctx):
        raise RuntimeError("CUDA error: out of memory\nsecond line")

    checks = {"boom": boom, "fine": lambda ctx: gc.Result("PASS", "ok 1.0"), "slow": lambda ctx: gc.Result("PASS", "x")}
    monkeypatch.setitem(gc.MIN_SECONDS, "slow", 1e6)
    summary = gc.run_checks(_ctx(gc, tmp_path), ["boom", "fine", "slow"], checks)
    lines = capsys.readouterr().out.splitlines()
    assert lines == [
        "FAIL boom: RuntimeError: CUDA error: out of memory second line",
        "PASS fine: ok 1.0",
        lines[2],
    ]
    assert lines[2].startswith("SKIP slow: time budget:")
    assert [c["status"] for c in summary["checks"]] == ["FAIL", "PASS", "SKIP"]
    assert "Traceback" in summary["checks"][0]["details"]["traceback"]


@pytest.mark.parametrize(("statuses", "code"), [(("PASS", "SKIP"), 0), (("PASS", "FAIL"), 1)])
def test_exit_status_and_json_summary(gc, tmp_path, capsys, monkeypatch, statuses, code):
    fakes = {f"c{i}": (lambda ctx, s=s: gc.Result(s, f"{s.lower()} 0.5")) for i, s in enumerate(statuses)}
    monkeypatch.setattr(gc, "CHECKS", fakes)
    assert gc.main(["--out", str(tmp_path), "--cpu", "--checks", ",".join(fakes)]) == code
    out = capsys.readouterr().out.splitlines()
    assert all(LINE.match(x) for x in out[:-1]) and len(out) == len(fakes) + 1
    saved = json.loads((tmp_path / "gpu_check.json").read_text())
    assert [c["status"] for c in saved["checks"]] == list(statuses)
    assert saved["counts"]["FAIL"] == statuses.count("FAIL") and saved["environment"]["mode"] == "cpu"


def test_unknown_check_is_refused(gc, tmp_path, capsys):
    with pytest.raises(SystemExit):
        gc.main(["--out", str(tmp_path), "--checks", "precision,nope"])
    assert "unknown check(s) ['nope']" in capsys.readouterr().err


def _evals(before, after, mean_diff=0.0, **recorded):
    report = {"mean_diff": mean_diff, **recorded}
    return report, {"accuracy": 0.0, "completions": before}, {"accuracy": 0.0, "completions": after}


def test_eval_verdict_needs_identical_completions_and_a_zero_difference(gc):
    same = gc.eval_verdict(*_evals(["a", "b"], ["a", "b"], eval_dtype="float32"))
    assert same.status == "PASS" and "0/2 completions differ" in same.summary and "eval_dtype=float32" in same.summary
    changed = gc.eval_verdict(*_evals(["a", "b"], ["a", "c"]))  # S1: the "after" ran in another precision
    assert changed.status == "FAIL" and "1/2 completions differ" in changed.summary
    assert changed.details["first_difference"] == {"index": 1, "before": ["b"], "after": ["c"]}
    assert gc.eval_verdict(*_evals(["a"], ["a"], mean_diff=0.25)).status == "FAIL"
    assert gc.eval_verdict(*_evals(["a", "b"], ["a"])).status == "FAIL"


def _row(step, ratio_max=1.0, ratio_min=1.0, kl=0.0, **timing):
    phases = ("rollout", "generate", "reward", "old_log_prob", "forward_backward", "optimizer")
    row = {"step": step, "klear/ratio_max": ratio_max, "klear/ratio_min": ratio_min, "klear/ppo_kl": kl}
    row.update({f"timing/{p}_s": timing.get(p, 0.1) for p in phases})
    return row


def test_ratio_verdict(gc):
    assert gc.ratio_verdict([_row(1), _row(2)], "float32", cpu=True).status == "PASS"
    bf16_rounding = gc.ratio_verdict([_row(1, ratio_max=1.01, ratio_min=0.99), _row(2)], "bfloat16", cpu=False)
    assert bf16_rounding.status == "PASS" and "ratio_max 1.01" in bf16_rounding.summary
    off = gc.ratio_verdict([_row(1, ratio_max=1.14), _row(2)], "bfloat16", cpu=False)
    assert off.status == "FAIL" and "off 1 by more than 0.05" in off.summary
    assert "ran in float32" in gc.ratio_verdict([_row(1), _row(2)], "float32", cpu=False).summary
    assert "1 logged steps" in gc.ratio_verdict([_row(1)], "float32", cpu=True).summary
    assert gc.ratio_verdict([_row(1, ratio_max=None), _row(2)], "float32", cpu=True).status == "FAIL"


def test_timing_verdict(gc):
    rows = [_row(1), _row(2)]  # top-level phases: 4 x 0.1 s
    walls = [{"step": 1, "wall_s": 0.5, "cuda_syncs": 6}, {"step": 2, "wall_s": 0.45, "cuda_syncs": 6}]
    assert gc.timing_verdict(rows, walls, cpu=True).status == "PASS"
    assert gc.timing_verdict(rows, walls, cpu=False).status == "PASS"
    over = gc.timing_verdict(rows, [walls[0], {"step": 2, "wall_s": 0.3, "cuda_syncs": 6}], cpu=True)
    assert over.status == "FAIL" and "step 2: phases 0.400 s > wall 0.300 s" in over.summary
    unsynced = gc.timing_verdict(rows, [{**w, "cuda_syncs": 0} for w in walls], cpu=False)
    assert unsynced.status == "FAIL" and "no torch.cuda.synchronize in the step (S6)" in unsynced.summary
    missing = _row(1)
    del missing["timing/old_log_prob_s"]
    assert "no timing/{old_log_prob}_s" in gc.timing_verdict([missing], walls, cpu=True).summary
    assert gc.timing_verdict([], [], cpu=True).status == "FAIL"


@pytest.mark.parametrize(
    ("capability", "klear_says", "status"),
    [
        ((9, 0), "bfloat16", "PASS"),
        ((7, 5), "bfloat16", "FAIL"),
        ((7, 5), "float32", "PASS"),
        ((8, 0), "float32", "FAIL"),
    ],
)
def test_precision_check_expects_native_bf16_from_capability_8(
    gc, tmp_path, monkeypatch, capability, klear_says, status
):
    import torch

    import klear.precision as precision

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Fake GPU")
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: including_emulation)
    monkeypatch.setattr(precision, "resolve_precision", lambda *a, **k: precision.Precision("cuda", klear_says))
    monkeypatch.setattr(precision, "torch_dtype", lambda *a, **k: getattr(torch, klear_says))
    result = gc.check_precision(_ctx(gc, tmp_path, cpu=False))
    expected = "bfloat16" if capability >= (8, 0) else "float32"
    assert result.status == status and f"expected {expected}" in result.summary
    assert result.summary.startswith(f"Fake GPU cc {capability[0]}.{capability[1]}, bf16 auto -> {klear_says}")


def _run_cpu_mode(tmp_path, embedded_path, checks):
    import subprocess

    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(out), "--cpu", "--tokenizer", str(embedded_path)]
        + ["--checks", ",".join(checks)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    lines = proc.stdout.splitlines()
    return proc, lines, json.loads((out / "gpu_check.json").read_text())


def test_cpu_mode_lr0_evaluation_end_to_end(tmp_path, embedded_path):
    """The CPU mode through a real ``klear rl`` child on the tiny model: float32 before and after, so S1 cannot
    arise and the lr-0 evaluation must agree exactly; the CUDA-only check is skipped."""
    proc, lines, summary = _run_cpu_mode(tmp_path, embedded_path, ["precision", "eval_lr0", "eval_cuda_rng"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert [x.split(":")[0] for x in lines[:3]] == ["PASS precision", "PASS eval_lr0", "SKIP eval_cuda_rng"]
    assert all(LINE.match(x) for x in lines[:3]) and lines[3].startswith("gpu_check: 2 PASS, 0 FAIL, 1 SKIP")
    lr0 = summary["checks"][1]["details"]
    assert lr0["mean_diff"] == 0 and lr0["completions"] == 8 and lr0["completions_differing"] == 0
    assert (tmp_path / "out" / "eval_lr0.log").is_file()


@pytest.mark.slow
def test_cpu_mode_rl_ratio_and_phase_timings(tmp_path, embedded_path):
    proc, lines, summary = _run_cpu_mode(tmp_path, embedded_path, ["precision", "rl_ratio", "phase_timings"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert [c["status"] for c in summary["checks"]] == ["PASS", "PASS", "PASS"], lines
    ratio = summary["checks"][1]["details"]
    assert ratio["dtype"] == "float32" and ratio["steps"] == [1, 2] and abs(ratio["ratio_max"] - 1) <= 1e-3
    assert ratio["timings_step1"]["old_log_prob"] > 0  # step 1 ran the separate old-log-prob pass
    steps = summary["checks"][2]["details"]["steps"]
    assert [s["step"] for s in steps] == [1, 2] and all(0 < s["sum_s"] <= s["wall_s"] + 1e-3 for s in steps)


_PLAN = """memory plan per GPU ({strategy}):
  parameters                                   30.5 GiB
  total (training phase)                      {train} GiB
  total (generation phase, vLLM awake)        198.3 GiB
  device memory                               133.2 GiB (usable 119.9 GiB after a 10% margin)
  verdict                                  {verdict}
"""


def test_plan_verdict_reads_the_dry_run_table(gc):
    ddp = gc.plan_lines(_PLAN.format(strategy="ddp, 1 process(es)", train="142.9", verdict="does NOT fit"))
    assert ddp == {
        "total (training phase)": "142.9 GiB",
        "total (generation phase, vLLM awake)": "198.3 GiB",
        "device memory": "133.2 GiB (usable 119.9 GiB after a 10% margin)",
        "verdict": "does NOT fit",
    }
    zero3 = gc.plan_lines(_PLAN.format(strategy="zero3, 8 process(es)", train="38.5", verdict="fits"))
    ok = gc.plan_verdict({"ddp x1": ddp, "zero3 x8": zero3})
    assert ok.status == "PASS" and "ddp x1: 142.9/198.3 GiB, does NOT fit; zero3 x8: 38.5/198.3 GiB, fits" in ok.summary
    # a guard that lets plain DDP through for an 8B model, or a shipped config that does not fit: FAIL
    assert gc.plan_verdict({"ddp x1": zero3, "zero3 x8": zero3}).status == "FAIL"
    assert gc.plan_verdict({"ddp x1": ddp, "zero3 x8": ddp}).status == "FAIL"
    assert gc.plan_verdict({"ddp x1": ddp}).status == "FAIL"
