"""One smoke test on the real embedded model: conversion, the demo recipe's prompt format, one GPPO step."""

from __future__ import annotations

import json

import pytest

from klear.config import apply_overrides, load_config
from klear.rl.job import run_rl


def test_embedded_model_one_gppo_step(tmp_path, embedded_path):
    assert (embedded_path / "model.safetensors").is_file()
    cfg, _ = load_config("rl_demo")
    cfg = apply_overrides(
        cfg,
        [
            f"output_dir={tmp_path / 'run'}",
            "data.train_size=8",
            "data.heldout_size=4",
            "trainer.num_generations=4",
            "trainer.per_device_train_batch_size=8",
            "trainer.steps_per_generation=1",
            "trainer.max_steps=1",
            "trainer.max_completion_length=32",
            "trainer.save_steps=100",
            "eval.max_new_tokens=32",
        ],
    )
    report = run_rl(cfg)
    assert report["steps"] == 1 and report["n"] == 4
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    step = next(r for r in rows if "klear/accuracy" in r)
    assert 0.0 <= step["klear/accuracy"] <= 1.0
    assert step["completions/mean_length"] > 0
    before = json.loads((tmp_path / "run" / "eval_before.json").read_text())
    # the real model answers with a box (the prompt's worked example teaches the format)
    assert sum("\\boxed{" in c for c in before["completions"]) >= 2
    assert (tmp_path / "run" / "final" / "model.safetensors").is_file()
    # the report's paired numbers, recomputed from the per-problem files
    after = json.loads((tmp_path / "run" / "eval_after.json").read_text())
    assert report["before"] == pytest.approx(sum(before["correct"]) / 4)
    assert report["after"] == pytest.approx(sum(after["correct"]) / 4)
    assert report["mean_diff"] == pytest.approx(report["after"] - report["before"])
    assert report["n_improved"] == sum(a and not b for a, b in zip(after["correct"], before["correct"]))


def test_embedded_conversion_is_cached(embedded_path):
    from klear.models.embedded import embedded_model_path

    assert embedded_model_path() == embedded_path  # second call: no re-conversion
    assert (embedded_path / ".klear-converted").is_file()
