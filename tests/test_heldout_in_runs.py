"""The held-out evaluations of a training run (issue 22, S1/S2/H2): one compute dtype before and after training,
the caller's CPU and CUDA RNG left alone by sampled evaluation, and the problems shared out over processes."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import math_rows, rl_recipe


@pytest.fixture()
def sharp_ckpt(tmp_path, tiny_model):
    """The tiny random model with weights of std 0.3 saved as a checkpoint: its greedy completions vary by problem
    and bf16 rounding changes some of them (at the default std 0.02 every completion is newlines in any dtype)."""
    model, tok = tiny_model
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.3)
    path = tmp_path / "sharp"
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def _rl_job(tmp_path, ckpt, **trainer):
    defaults = {"steps_per_generation": 1, "max_steps": 1, "learning_rate": 0.0, "save_steps": 10, "report_to": []}
    return rl_recipe(
        tmp_path, ckpt, eval_settings={"max_new_tokens": 12, "batch_size": 8}, n_heldout=8, **{**defaults, **trainer}
    )


def test_rl_evaluates_before_and_after_in_the_training_precision(tmp_path, sharp_ckpt, monkeypatch):
    """S1: with bf16 mixed precision (faked on CPU: the precision decision says bfloat16, so the trainer's
    accelerator is ``Accelerator(cpu=True, mixed_precision="bf16")``-like and wraps the module's forward in bf16
    autocast once ``train()`` starts) and learning rate 0, "before" and "after" decode the same weights in the
    same precision: identical completions, paired difference exactly 0."""
    from transformers import TrainerCallback

    import klear.precision
    from klear.precision import Precision
    from klear.rl.job import run_rl

    monkeypatch.setattr(klear.precision, "resolve_precision", lambda *a, **k: Precision("cpu", "bfloat16", "auto"))
    seen = {}

    class Probe(TrainerCallback):
        def on_train_begin(self, args, state, control, model=None, **kwargs):
            seen["bf16"] = args.bf16
            seen["autocast_forward"] = "_original_forward" in vars(model)  # accelerate's native-AMP wrapper

    report = run_rl(_rl_job(tmp_path, sharp_ckpt), callbacks=[Probe()])
    assert seen == {"bf16": True, "autocast_forward": True}  # the condition of S1 holds
    run = tmp_path / "run"
    before = json.loads((run / "eval_before.json").read_text())
    after = json.loads((run / "eval_after.json").read_text())
    assert len(set(before["completions"])) > 1
    assert after["completions"] == before["completions"]
    assert after["rewards"] == before["rewards"]
    assert report["mean_diff"] == 0.0 and report["n_improved"] == report["n_worsened"] == 0
    for result in (before, after, report):
        assert result["eval_dtype"] == "bfloat16" and result["eval_backend"] == "hf"


class _FakeCudaRng:
    """Two fake CUDA devices' RNG states, behind the ``torch.cuda`` functions ``fork_rng`` and ``manual_seed`` call."""

    def __init__(self, monkeypatch):
        self.states = {0: torch.tensor([11], dtype=torch.uint8), 1: torch.tensor([22], dtype=torch.uint8)}
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
        monkeypatch.setattr(torch.cuda, "_is_in_bad_fork", lambda: False)
        monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device="cuda": self.states[self._index(device)].clone())
        monkeypatch.setattr(torch.cuda, "set_rng_state", self._set)
        monkeypatch.setattr(torch.cuda, "manual_seed_all", self._seed_all)

    @staticmethod
    def _index(device) -> int:
        return device if isinstance(device, int) else (torch.device(device).index or 0)

    def _set(self, state, device="cuda"):
        self.states[self._index(device)] = state.clone()

    def _seed_all(self, seed):
        for d in self.states:
            self.states[d] = torch.tensor([seed % 251], dtype=torch.uint8)

    def snapshot(self) -> dict:
        return {d: s.tolist() for d, s in self.states.items()}


def test_sampled_evaluation_leaves_every_cuda_rng_alone(tiny_model, monkeypatch):
    """S2: sampled evaluation seeds torch (CPU and every CUDA device) and restores all of them afterwards."""
    from klear.eval.heldout import evaluate

    model, tok = tiny_model
    fake = _FakeCudaRng(monkeypatch)
    before_cuda, before_cpu = fake.snapshot(), torch.get_rng_state()
    result = evaluate(
        model,
        tok,
        math_rows(3),
        max_new_tokens=3,
        batch_size=4,
        n_samples=2,
        temperature=1.0,
        seed=5,
        scorer=lambda ds, sols, gts, infos: [0.0] * len(sols),
        show_progress=False,
    )
    assert result["samples_per_problem"] == 2 and len(result["completions"]) == 6
    assert fake.snapshot() == before_cuda
    assert torch.equal(torch.get_rng_state(), before_cpu)
    fake._seed_all(1)  # the fake is live: what manual_seed does to it is visible
    assert fake.snapshot() != before_cuda


class _SecondOfTwo:
    is_main_process, num_processes, process_index = False, 2, 1


def _fake_trainer(distributed_type, model):
    import types

    accelerator = types.SimpleNamespace(distributed_type=distributed_type)
    args = types.SimpleNamespace(bf16=False, fp16=False, gradient_checkpointing_kwargs={"use_reentrant": False})
    return types.SimpleNamespace(accelerator=accelerator, args=args, model_wrapped=model)


def test_multi_process_fsdp_evaluation_is_refused(tmp_path, monkeypatch):
    """H2: under FSDP every forward pass gathers shards, so processes decoding different batches would hang: refused
    with one line, before any decoding."""
    import accelerate
    from accelerate.utils import DistributedType

    from klear.runs import heldout_eval

    monkeypatch.setattr(accelerate, "PartialState", _SecondOfTwo)
    trainer = _fake_trainer(DistributedType.FSDP, torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="cannot run under FSDP on several processes"):
        heldout_eval(
            None,
            None,
            [],
            {"max_new_tokens": 1, "batch_size": 1},
            path=tmp_path / "e.json",
            reuse=False,
            trainer=trainer,
        )


def test_trainer_evaluation_decodes_the_model_unwrapped_for_generation(tmp_path, tiny_model, monkeypatch):
    """H2: with a trainer, the evaluation decodes inside TRL's ``unwrap_model_for_generation`` of the trainer's
    wrapped model (which gathers ZeRO-3 parameters on every process), not the module passed in."""
    import contextlib

    import trl.models.utils
    from accelerate.utils import DistributedType

    from klear.runs import heldout_eval

    model, tok = tiny_model
    entered = []

    @contextlib.contextmanager
    def unwrap(wrapped, accelerator, gradient_checkpointing_kwargs=None, **kwargs):
        entered.append((wrapped, accelerator, gradient_checkpointing_kwargs))
        yield model

    monkeypatch.setattr(trl.models.utils, "unwrap_model_for_generation", unwrap)
    wrapped = object()  # stands for a DeepSpeed engine: calling it would fail
    trainer = _fake_trainer(DistributedType.DEEPSPEED, wrapped)
    result = heldout_eval(
        None,
        tok,
        math_rows(2),
        {"max_new_tokens": 2, "batch_size": 2},
        path=tmp_path / "e.json",
        reuse=False,
        trainer=trainer,
    )
    assert entered == [(wrapped, trainer.accelerator, {"use_reentrant": False})]
    assert result["n"] == 2 and result["eval_dtype"] == "float32" and result["eval_backend"] == "hf"


def test_a_failing_process_fails_every_process():
    """H2: an error in one process's batch reaches every process at the round's gather (no process is left waiting
    for the others until ddp_timeout)."""
    from klear.eval.heldout import decode_in_rounds

    rounds = []

    def gather(items):  # process 0's view: process 1's batch of this round raised
        rounds.append(items)
        return [*items, (items[0][0] + 1, None, "ValueError: judge crashed")]

    with pytest.raises(RuntimeError, match=r"batch 1: ValueError: judge crashed"):
        decode_in_rounds(4, lambda j: [f"text {j}"], process_index=0, num_processes=2, gather=gather)
    assert rounds == [[(0, ["text 0"], None)]]  # stopped after the first round

    def ok(items):  # process 1 takes batches 1, 3 (round-robin); process 0's items arrive with its own
        return [(items[0][0] - 1, [f"text {items[0][0] - 1}"], None), *items]

    assert decode_in_rounds(4, lambda j: [f"text {j}"], process_index=1, num_processes=2, gather=ok) == [
        [f"text {j}"] for j in range(4)
    ]


def test_before_and_after_in_different_precisions_are_not_paired():
    """S1: a resumed run's saved "before" decoded in another dtype is an error, never a paired difference."""
    from klear.runs import eval_fields

    after = {"eval_dtype": "bfloat16", "eval_backend": "hf"}
    # a "before" saved before these fields existed was decoded in float32 (tests/test_gpu_bad_inputs.py)
    assert eval_fields({}, {"eval_dtype": "float32", "eval_backend": "hf"})["eval_dtype"] == "float32"
    assert eval_fields(dict(after), after) == after
    with pytest.raises(ValueError, match="eval_before.json has eval_dtype='float32' but the evaluation after"):
        eval_fields({"eval_dtype": "float32", "eval_backend": "hf"}, after)
