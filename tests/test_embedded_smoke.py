"""One smoke test on the real embedded model: conversion, the demo recipe's prompt format, one GPPO step."""

from __future__ import annotations

import json

import pytest

from klear.config import apply_overrides, load_config
from klear.rl.job import run_rl


def test_embedded_model_one_gppo_step(tmp_path, embedded_path, monkeypatch):
    from klear.rewards import compute_scores
    from klear.rl import reward_fn

    rollouts = []  # what the trainer's reward function was asked to score (not what it answered)
    make_reward = reward_fn.make_klear_reward

    def recording_make_klear_reward(**options):
        reward = make_reward(**options)

        def recording_reward(prompts, completions, **columns):
            rollouts.append((list(completions), list(columns["data_source"]), list(columns["reward_model"])))
            return reward(prompts, completions, **columns)

        return recording_reward

    monkeypatch.setattr(reward_fn, "make_klear_reward", recording_make_klear_reward)
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
    # the logged accuracy and reward, recomputed by judging the rollout's completions again
    ((completions, sources, reward_models),) = rollouts
    texts = [c if isinstance(c, str) else "".join(m["content"] for m in c) for c in completions]
    scores = compute_scores(sources, texts, [rm["ground_truth"] for rm in reward_models])
    assert len(scores) == 8
    assert step["klear/accuracy"] == pytest.approx(sum(s >= 1.0 for s in scores) / 8)
    assert step["reward"] == pytest.approx(sum(scores) / 8)
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
