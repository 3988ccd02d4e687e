"""Odd and bad inputs to the GPU path (issue 22): the memory guard, ``--dry-run``, ``context_length``, the launch's
variables. GPU-only conditions are faked on CPU."""

from __future__ import annotations

import types

import pytest

from klear import runs
from klear.config import load_config
from klear.precision import Precision


class _ReachedTheModel(Exception):
    """Raised in place of building the trainer: everything before the weights load has passed."""


@pytest.fixture
def fake_gpu(monkeypatch):
    """One 80 GB bf16 CUDA device under a plain (DDP) 1-process launch."""
    import torch

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: types.SimpleNamespace(total_memory=80 * 10**9))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(runs, "launch_strategy", lambda: ("ddp", 1))
    original = runs.trainer_arguments

    def on_gpu(config, **kw):
        trainer_cfg, _, args = original(config, **{**kw, "machine_checks": False})
        return trainer_cfg, Precision("cuda", "bfloat16", config["trainer"].get("bf16", "auto")), args

    monkeypatch.setattr(runs, "trainer_arguments", on_gpu)


def test_rl_guard_plans_the_runs_prompts_not_the_checkpoints_whole_context(
    fake_gpu, embedded_path, tmp_path, monkeypatch
):
    # rl_demo: 32 sequences per micro-batch of ~100-token prompts + 32 new tokens; planning them at the
    # embedded model's 8192 positions each (~150 GiB of activations) refused the demo on any GPU
    import klear.integrations.vllm as vllm_integration
    from klear.rl.job import run_rl

    def reached(*a, **kw):
        raise _ReachedTheModel

    monkeypatch.setattr(vllm_integration, "build_trainer", reached)
    config, _ = load_config(
        "rl_demo", [f"output_dir={tmp_path / 'run'}", "data.train_size=16", "data.heldout_size=4"]
    )
    with pytest.raises(_ReachedTheModel):
        run_rl(config, source="rl_demo")
