"""One precision rule (klear.precision) and what it guarantees through the `klear rl` job path on CPU."""

from __future__ import annotations

import json

import pytest
import yaml

from klear import precision as P
from klear.rewards import register_scorer, unregister_scorer
from klear.rl.job import run_rl


@pytest.mark.parametrize(
    "cuda, bf16, fp16, expected",
    [
        ((False, False), "auto", False, ("cpu", "float32")),
        ((False, False), None, None, ("cpu", "float32")),
        ((False, False), False, False, ("cpu", "float32")),
        ((True, True), "auto", False, ("cuda", "bfloat16")),
        ((True, True), True, False, ("cuda", "bfloat16")),
        ((True, True), False, False, ("cuda", "float32")),
        ((True, False), "auto", False, ("cuda", "float32")),  # a GPU without bf16 (e.g. V100): float32
        ((True, False), False, True, ("cuda", "float16")),
    ],
)
def test_resolve_precision(monkeypatch, cuda, bf16, fp16, expected):
    monkeypatch.setattr(P, "_cuda", lambda: cuda)
    got = P.resolve_precision(bf16, fp16=fp16)
    assert (got.device, got.dtype) == expected


@pytest.mark.parametrize(
    "cuda, bf16, fp16, message",
    [
        ((False, False), True, False, "bf16=true needs a CUDA GPU with bf16; none is visible"),
        ((True, False), True, False, "this GPU does not support bf16"),
        ((False, False), False, True, "fp16=true needs a CUDA GPU"),
        ((True, True), True, True, "cannot both be true"),
        ((True, True), "yes", False, "must be true, false or auto"),
    ],
)
def test_resolve_precision_refuses(monkeypatch, cuda, bf16, fp16, message):
    monkeypatch.setattr(P, "_cuda", lambda: cuda)
    with pytest.raises(ValueError, match=message):
        P.resolve_precision(bf16, fp16=fp16)


def test_trainer_section_is_made_explicit(monkeypatch):
    """TRL's configs default to bf16=True; the resolved section always says what runs."""
    monkeypatch.setattr(P, "_cuda", lambda: (False, False))
    cfg, prec = P.resolve_trainer_precision({"learning_rate": 1e-6, "gradient_checkpointing": "auto"})
    assert cfg == {
        "learning_rate": 1e-6,
        "bf16": False,
        "fp16": False,
        "use_cpu": True,
        "gradient_checkpointing": False,
    }
    assert prec.describe() == "precision: float32 on cpu (requested: auto)"
    monkeypatch.setattr(P, "_cuda", lambda: (True, True))
    cfg, prec = P.resolve_trainer_precision({"gradient_checkpointing": "auto"})
    assert cfg == {"bf16": True, "fp16": False, "gradient_checkpointing": True} and prec.dtype == "bfloat16"


def test_inference_dtype(monkeypatch):
    import torch

    monkeypatch.setattr(P, "_cuda", lambda: (False, False))
    assert P.torch_dtype("auto") is torch.float32 and P.torch_dtype("float32") is torch.float32
    with pytest.raises(ValueError, match="--dtype bfloat16 needs a CUDA GPU with bf16; none is visible"):
        P.torch_dtype("bfloat16")
    with pytest.raises(ValueError, match="--dtype float16 needs a CUDA GPU; none is visible"):
        P.torch_dtype("float16")
    monkeypatch.setattr(P, "_cuda", lambda: (True, True))
    assert P.torch_dtype("auto") is torch.bfloat16
    assert P.torch_dtype("auto", device="cpu") is torch.float32
    assert P.torch_dtype("bfloat16") is torch.bfloat16
    with pytest.raises(ValueError, match="device 'cpu'"):
        P.torch_dtype("bfloat16", device="cpu")
    with pytest.raises(ValueError, match="must be one of"):
        P.torch_dtype("bf16")


# --------------------------------------------------------------------------- through `klear rl`


def _parity_score(data_source, solution_str, ground_truth, extra_info=None, **_):
    """+1 for an even number of characters, -1 otherwise: mixed rewards within a group, so every step learns."""
    return 1.0 if len(solution_str) % 2 == 0 else -1.0


@pytest.fixture()
def parity_reward():
    register_scorer("klear_test_parity", _parity_score)
    yield "klear_test_parity"
    unregister_scorer("klear_test_parity")


def _rl_job(tmp_path, ckpt, data_source, **trainer):
    rows = [
        {
            "prompt": [{"role": "user", "content": f"Say something about {i}."}],
            "data_source": data_source,
            "reward_model": {"style": "rule", "ground_truth": "x"},
            "extra_info": {"index": i},
        }
        for i in range(16)
    ]
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {
        "model": str(ckpt),
        "output_dir": str(tmp_path / "run"),
        "seed": 0,
        "data": {"train": str(train)},
        "trainer": {
            "num_generations": 4,
            "per_device_train_batch_size": 8,
            "gradient_accumulation_steps": 1,
            "steps_per_generation": 2,
            "max_completion_length": 8,
            "max_steps": 6,
            "learning_rate": 3e-3,
            "temperature": 1.0,
            "filter_zero_adv_groups": False,
            "save_strategy": "no",
            "report_to": [],
            **trainer,
        },
    }


def _reference_log_probs(ckpt, micro_batches, temperature):
    """Completion-token log-probs of the sampler's policy (the checkpoint's weights), one sample at a time, in
    float64 and without autocast: an independent computation of what ``old_log_prob`` must be."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float64).eval()
    out = []
    with torch.no_grad():
        for mb in micro_batches:
            for i in range(mb["completion_ids"].size(0)):
                prompt = mb["prompt_ids"][i][mb["prompt_mask"][i].bool()]
                n = int(mb["completion_mask"][i].sum())
                completion = mb["completion_ids"][i, :n]
                ids = torch.cat([prompt, completion]).unsqueeze(0)
                logits = model(input_ids=ids).logits[0, prompt.numel() - 1 : -1] / temperature
                ref = torch.log_softmax(logits, dim=-1).gather(1, completion.unsqueeze(1)).squeeze(1)
                out.append((mb["old_per_token_logps"][i, :n].double(), ref))
    return out


def test_rl_job_first_step_of_every_rollout_is_on_policy_in_float32(tmp_path, tiny_ckpt, parity_reward, monkeypatch):
    """3 rollout batches x 2 optimizer steps: step 1 of each batch has ratio 1 on every token (|r - 1| <= 1e-5)
    and |ppo_kl| <= 1e-6; step 2 (after an update, off-policy) does not, which shows the check can fail. And the
    first rollout's ``old_log_prob`` equals the sampling policy's log-probs computed independently in float64
    (so the ratio is the true pi_theta / pi_old, not a ratio of two equally rounded bf16 passes)."""
    from transformers import AutoTokenizer

    from klear.rl.trainer import GPPOTrainer

    recorded = []
    original = GPPOTrainer._old_log_probs

    def record(self, micro_batches):
        original(self, micro_batches)
        recorded.append(
            [
                {
                    k: v.detach().clone()
                    for k, v in mb.items()
                    if k in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "old_per_token_logps")
                }
                for mb in micro_batches
            ]
        )

    monkeypatch.setattr(GPPOTrainer, "_old_log_probs", record)
    run_rl(_rl_job(tmp_path, tiny_ckpt, parity_reward))
    pairs = _reference_log_probs(tiny_ckpt, recorded[0], temperature=1.0)
    assert len(pairs) == 16  # 4 prompts x 4 samples per rollout batch, none filtered
    gap = max(float((old - ref).abs().max()) for old, ref in pairs)
    print(f"old_log_prob vs float64 reference: max |diff| = {gap:.2e}")
    assert gap <= 1e-5, gap
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = {r["step"]: r for r in rows if "klear/ratio_max" in r}
    assert sorted(steps) == [1, 2, 3, 4, 5, 6]
    worst = 0.0
    assert len(recorded) == 3 and all(len(mbs) == 2 for mbs in recorded)  # 3 rollouts x 2 micro-batches of 8
    tokenizer = AutoTokenizer.from_pretrained(tiny_ckpt)
    for step, r in steps.items():
        rollout = recorded[(step - 1) // 2]
        # every token of the step's micro-batch (nothing is filtered), counted here
        assert r["klear/num_loss_tokens"] == int(rollout[(step - 1) % 2]["completion_mask"].sum())
        if step % 2 == 1:  # the rollout's accuracy: the share of even-length completion texts (the parity reward)
            texts = [
                tokenizer.decode(ids[mask.bool()], skip_special_tokens=True)
                for mb in rollout
                for ids, mask in zip(mb["completion_ids"], mb["completion_mask"], strict=True)
            ]
            assert r["klear/accuracy"] == pytest.approx(sum(len(t) % 2 == 0 for t in texts) / 16)
    for step in (1, 3, 5):  # the first optimizer step on each fresh rollout batch
        r = steps[step]
        dev = max(r["klear/ratio_max"] - 1.0, 1.0 - r["klear/ratio_min"])
        worst = max(worst, dev)
        assert dev <= 1e-5, (step, r["klear/ratio_max"], r["klear/ratio_min"])
        assert abs(r["klear/ppo_kl"]) <= 1e-6, (step, r["klear/ppo_kl"])
        assert r["klear/clip_frac_high"] == 0.0 and r["klear/clip_frac_low"] == 0.0
    off_policy = max(max(steps[s]["klear/ratio_max"] - 1.0, 1.0 - steps[s]["klear/ratio_min"]) for s in (2, 4, 6))
    assert off_policy > 1e-3, off_policy
    for step, r in steps.items():  # where the time goes, per optimizer step
        phases = [r[f"timing/{p}_s"] for p in ("rollout", "old_log_prob", "forward_backward", "optimizer")]
        assert all(x >= 0 for x in phases) and r["timing/forward_backward_s"] > 0
        assert (r["timing/rollout_s"] > 0) == (step % 2 == 1)  # a rollout only on the first step of a batch
        assert (r["timing/old_log_prob_s"] > 0) == (step % 2 == 1)
        assert r["timing/generate_s"] + r["timing/reward_s"] <= r["timing/rollout_s"]
        assert sum(phases) <= r["step_time"] + r["timing/optimizer_s"] + 0.05


def test_rl_job_on_cpu_resolves_to_float32(tmp_path, tiny_ckpt, parity_reward, capsys):
    """No trainer.bf16 in the recipe: float32, written to config.yaml and run.json and printed at start."""
    import torch

    assert not torch.cuda.is_available()
    cfg = _rl_job(tmp_path, tiny_ckpt, parity_reward, max_steps=1, steps_per_generation=1)
    run_rl(cfg)
    run = tmp_path / "run"
    assert json.loads((run / "run.json").read_text())["precision"] == {
        "device": "cpu",
        "dtype": "float32",
        "requested": "auto",
    }
    trainer = yaml.safe_load((run / "config.yaml").read_text())["trainer"]
    assert (trainer["bf16"], trainer["fp16"], trainer["use_cpu"]) == (False, False, True)
    assert "precision: float32 on cpu" in capsys.readouterr().out
    # an explicit bf16 without a GPU fails before anything is written
    cfg = _rl_job(tmp_path, tiny_ckpt, parity_reward, bf16=True)
    cfg["output_dir"] = str(tmp_path / "bf16")
    with pytest.raises(ValueError, match="bf16=true needs a CUDA GPU"):
        run_rl(cfg)
    assert not (tmp_path / "bf16").exists()


def test_klear_eval_refuses_bf16_on_cpu_before_loading(tmp_path, capsys):
    from conftest import shared_file
    from klear.cli import main

    bench = shared_file("math", "aime24.qs.jsonl")
    code = main(
        [
            "eval",
            "--model",
            str(tmp_path / "no-model-here"),
            "--benchmark",
            str(bench),
            "--n",
            "1",
            "--dtype",
            "bfloat16",
            "--output",
            str(tmp_path / "out"),
        ]
    )
    assert code == 2
    assert "--dtype bfloat16 needs a CUDA GPU with bf16; none is visible" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
