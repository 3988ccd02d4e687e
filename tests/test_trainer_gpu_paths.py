"""GPPOTrainer's GPU-only paths, faked on CPU (issue 22): CUDA-synchronised phase timings, one metric collective per
micro-batch and one host sync per logged step, minimal-cost filler samples, and one grouped-prefill decision for all
processes when the parameters are sharded during generation."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch
from trl import GRPOTrainer

import klear.rl.trainer as trainer_module
from conftest import bare_gppo_trainer
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
    trainer = bare_gppo_trainer(args, accelerator)
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


# ------------------------------------------------------------------- metrics: one collective, one host sync per log
class _CountingRank:
    """Process 0 of a 2-process run whose other process holds the same tensors; counts the collectives."""

    num_processes = 2
    process_index = 0
    device = torch.device("cpu")

    def __init__(self):
        self.collectives = 0

    def gather(self, tensor):
        self.collectives += 1
        return torch.cat([tensor, tensor])

    def reduce(self, tensor, reduction="sum"):
        assert reduction == "sum"
        self.collectives += 1
        return tensor + tensor


def _micro_batches(gen, n_micro=2, b=3, t=5):
    out = []
    for _ in range(n_micro):
        lengths = torch.randint(1, t + 1, (b,), generator=gen)
        old = -torch.rand(b, t, generator=gen) - 0.5
        out.append(
            {
                "completion_mask": (torch.arange(t) < lengths[:, None]).long(),
                "klear_keep": torch.tensor([True, True, False]),
                "klear_is_correct": torch.tensor([True, False, True]),
                "advantages": torch.randn(b, generator=gen),
                "old_per_token_logps": old,
                "log_prob": (old + 0.3 * torch.randn(b, t, generator=gen)).requires_grad_(True),
                "entropies": torch.rand(b, t, generator=gen) + 1.0,
            }
        )
    return out


@pytest.fixture()
def host_syncs(monkeypatch):
    """Counts the host syncs (``item``, ``tolist``, ``bool``/``float``/``int`` of a tensor), except while
    ``in_loss`` is set (the test's own reading of the loss metrics)."""
    count = {"syncs": 0, "in_loss": False}
    for name in ("item", "tolist", "__bool__", "__float__", "__int__"):
        original = getattr(torch.Tensor, name)

        def counted(self, *a, _original=original, **k):
            if not count["in_loss"]:
                count["syncs"] += 1
            return _original(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, counted)
    return count


def test_a_micro_batch_s_metrics_cost_one_collective_and_a_logged_step_one_host_sync(tmp_path, monkeypatch, host_syncs):
    """Issue 22 (low): the entropy and every loss metric of a micro-batch are combined over processes by ONE gather
    (was one reduce plus one gather per metric, ~16) and stay on the device; the loss itself validates its inputs
    without a host sync (the step's counts are python numbers, the mask bool); ``log`` reads all of a logged step's
    values with ONE host sync (was 3 + one per metric per micro-batch). The values are those of the loss."""
    rank = _CountingRank()
    trainer = _bare_trainer(_args(tmp_path, loss_mode="gppo", alpha=0.1), rank)
    trainer._policy_log_probs = lambda model, inputs, compute_entropy=False: (inputs["log_prob"], inputs["entropies"])
    returned: list[dict[str, float]] = []
    real_total_loss = trainer_module.total_loss

    def total_loss(batch, settings):
        loss, metrics = real_total_loss(batch, settings)  # its syncs count: the loss validates its inputs
        host_syncs["in_loss"] = True
        try:
            returned.append({k: float(v) for k, v in metrics.items()})
            return loss, metrics
        finally:
            host_syncs["in_loss"] = False

    monkeypatch.setattr(trainer_module, "total_loss", total_loss)
    mbs = _micro_batches(torch.Generator().manual_seed(0))
    trainer._annotate_optimizer_windows(mbs)  # once per rollout batch: not counted below
    rank.collectives, host_syncs["syncs"] = 0, 0

    for mb in mbs:  # one optimizer step (gradient_accumulation_steps=2)
        trainer._compute_loss(None, mb).backward()
    assert (rank.collectives, host_syncs["syncs"]) == (len(mbs), 0)
    assert len(returned[0]) >= 10  # the loss metrics that used to cost one gather each

    logged = {}
    monkeypatch.setattr(GRPOTrainer, "log", lambda self, logs, start_time=None: logged.update(self._metrics["train"]))
    trainer.log({})
    assert host_syncs["syncs"] == 1 and rank.collectives == len(mbs)
    for key in returned[0]:  # the other process holds the same values: mean, max and min are the value itself
        assert logged[f"klear/{key}"] == [r[key] for r in returned], key
    entropy = [float((mb["entropies"] * mb["completion_mask"]).sum() / mb["completion_mask"].sum()) for mb in mbs]
    assert logged["entropy"] == pytest.approx(entropy, rel=1e-6)
    tokens = [float((mb["completion_mask"] * mb["klear_keep"][:, None]).sum()) for mb in mbs]
    assert logged["klear/num_loss_tokens"] == [2 * sum(tokens)] * 2  # the step's count over both processes
    assert not trainer._klear_pending_metrics


# ------------------------------------------------------------------- grouped prefill: one decision for all processes
class _TwoRanks:
    """Process 0 of 2; the other process's "can group" flag is ``other`` (the all-reduce sums both)."""

    num_processes = 2
    device = torch.device("cpu")

    def __init__(self, other: bool):
        self.other, self.reductions = other, 0

    def reduce(self, tensor, reduction="sum"):
        assert reduction == "sum"
        self.reductions += 1
        return tensor + float(self.other)

    def unwrap_model(self, model):
        return model

    def autocast(self):  # Accelerator.autocast without mixed precision
        return contextlib.nullcontext()


@pytest.mark.parametrize("other_can_group, grouped", [(True, True), (False, False)])
def test_the_trainer_s_grouped_prefill_is_decided_by_all_processes(tmp_path, monkeypatch, other_can_group, grouped):
    """Issue 22 (low): with 2 processes, the trainer hands grouped_prefill_generate an agreement that takes the
    other process's flag into account with one all-reduce: this process's groups are prefilled only when the
    other's are too (under ZeRO-3/FSDP a prefill forward on one process alone would hang the other)."""
    import klear.generation.prefill as prefill

    ranks = _TwoRanks(other=other_can_group)
    trainer = _bare_trainer(_args(tmp_path), ranks)
    trainer.use_vllm = trainer.use_transformers_continuous_batching = False
    model = torch.nn.Module()
    model.generate = lambda **kw: kw["input_ids"]
    trainer.model_wrapped = model
    decided = []

    def grouped_prefill_generate(model, generate, input_ids, attention_mask, *, group_size, agree=None, **kw):
        decided.append(agree(True))  # this process's rows are groups
        return generate(input_ids=input_ids, attention_mask=attention_mask)

    monkeypatch.setattr(prefill, "grouped_prefill_generate", grouped_prefill_generate)

    def trl_generate(self, prompt_ids, *args):  # TRL's transformers path calls the (patched) model.generate
        return model.generate(input_ids=prompt_ids, attention_mask=torch.ones_like(prompt_ids)), None

    monkeypatch.setattr(GRPOTrainer, "_generate_single_turn", trl_generate)
    ids = torch.tensor([[5, 6], [5, 6]])
    out, _ = trainer._generate_single_turn(ids, None, {}, 2)
    assert torch.equal(out, ids) and decided == [grouped] and ranks.reductions == 1


def test_one_process_decides_alone(tmp_path):
    trainer = _bare_trainer(_args(tmp_path), SimpleNamespace(num_processes=1, device=torch.device("cpu")))
    assert trainer._prefill_agreement() is None
