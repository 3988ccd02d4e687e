"""GPPOTrainer's GPU-only paths, faked on CPU (issue 22): CUDA-synchronised phase timings, one metric collective per
micro-batch and one host sync per logged step, minimal-cost filler samples, and one grouped-prefill decision for all
processes when the parameters are sharded during generation."""

from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
from trl import GRPOTrainer

import klear.rl.trainer as trainer_module
from klear.rl.trainer import TIMING_PHASES, GPPOConfig, GPPOTrainer, _PhaseTimer


def _args(tmp_path, **kw) -> GPPOConfig:
    base = dict(
        output_dir=str(tmp_path), use_cpu=True, report_to=[], per_device_train_batch_size=2, num_generations=2,
        gradient_accumulation_steps=2, steps_per_generation=2,
    )  # fmt: skip
    base.update(kw)
    return GPPOConfig(**base)


def _bare_trainer(args, accelerator) -> GPPOTrainer:
    """A GPPOTrainer without model or data: only what the timing, metric and generation methods read."""
    trainer = GPPOTrainer.__new__(GPPOTrainer)
    trainer.args = args
    trainer.accelerator = accelerator
    trainer.model = torch.nn.Module()  # .training: True
    trainer._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
    trainer._klear_time = dict.fromkeys(TIMING_PHASES, 0.0)
    trainer._klear_window_end = 0.0
    return trainer


# ---------------------------------------------------------------------------------------- S6: synchronised timings
@pytest.fixture()
def clock_events(monkeypatch):
    """Every ``torch.cuda.synchronize`` ("sync") and clock read ("clock") of klear.rl.trainer, in order."""
    events: list[str] = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: events.append("sync"))

    def perf_counter() -> float:
        events.append("clock")
        return float(len(events))

    monkeypatch.setattr(trainer_module, "time", SimpleNamespace(perf_counter=perf_counter))
    return events


@pytest.mark.parametrize("device, synced", [("cuda", True), ("cpu", False)])
def test_every_phase_boundary_synchronises_cuda_before_reading_the_clock(
    tmp_path, monkeypatch, clock_events, device, synced
):
    """On CUDA, each phase boundary (a timed phase's start and end, a micro-batch's start and end, the optimizer
    step's end) waits for the queued kernels, THEN reads the clock; on CPU nothing is synchronised."""
    trainer = _bare_trainer(_args(tmp_path), SimpleNamespace(device=torch.device(device), num_processes=1))
    monkeypatch.setattr(GRPOTrainer, "training_step", lambda self, *a: clock_events.append("work") or torch.zeros(()))
    boundary = ["sync", "clock"] if synced else ["clock"]

    trainer._timed("reward", lambda: clock_events.append("work"))
    assert clock_events == [*boundary, "work", *boundary]
    clock_events.clear()
    trainer.training_step(None, {}, None)
    assert clock_events == [*boundary, "work", *boundary]
    clock_events.clear()
    _PhaseTimer(trainer).on_step_end(None, None, None)
    assert clock_events == boundary
    assert all(trainer._metrics["train"][f"timing/{p}_s"] for p in TIMING_PHASES)
