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
    import klear.generation.vllm as vllm_integration
    from klear.rl.job import run_rl

    def reached(*a, **kw):
        raise _ReachedTheModel

    monkeypatch.setattr(vllm_integration, "build_trainer", reached)
    config, _ = load_config("rl_demo", [f"output_dir={tmp_path / 'run'}", "data.train_size=16", "data.heldout_size=4"])
    with pytest.raises(_ReachedTheModel):
        run_rl(config, source="rl_demo")


@pytest.mark.parametrize("value", ["inf", "1e400", "nan", "-1"])
def test_dry_run_refuses_a_gpu_memory_that_is_not_a_finite_positive_number(value, capsys):
    from klear.cli import main

    assert main(["rl", "--config", "rl_demo", "--dry-run", "--gpus", "1", "--gpu-memory-gb", value]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("klear rl: error: --gpu-memory-gb ") and "expected a finite number > 0" in err[-1]


@pytest.mark.parametrize("context_length", [1000, 32768])
def test_rl_context_length_must_exceed_the_response_budget(context_length):
    # rl_math_klear: max_completion_length 32768; a context that cannot hold one prompt token + the response
    # would otherwise pass --dry-run ("recipe valid") and refuse every prompt at run time
    from klear.rl.job import validate_job_config

    config, _ = load_config(
        "rl_math_klear", ["model=embedded", "data.train=x.jsonl", f"context_length={context_length}"]
    )
    with pytest.raises(ValueError) as err:
        validate_job_config(config, "rl_math_klear")
    assert f"context_length={context_length}" in str(err.value)
    assert "trainer.max_completion_length=32768" in str(err.value) and "\n" not in str(err.value)


def test_sft_context_length_must_hold_max_length():
    from klear.sft.job import validate_sft_config

    config, _ = load_config(
        "sft_klear",
        [
            "model=embedded",
            "data.train=x.jsonl",
            "context_length=1000",
            "trainer.model_init_kwargs.attn_implementation=sdpa",
        ],
    )
    with pytest.raises(ValueError, match=r"context_length=1000 .*trainer\.max_length=32768"):
        validate_sft_config(config, "sft_klear")


_LAUNCH_VARS = (
    "ACCELERATE_USE_DEEPSPEED",
    "ACCELERATE_DEEPSPEED_ZERO_STAGE",
    "ACCELERATE_DEEPSPEED_CONFIG_FILE",
    "ACCELERATE_USE_FSDP",
    "WORLD_SIZE",
)


@pytest.mark.parametrize(
    ("env", "named"),
    [
        ({"WORLD_SIZE": "abc"}, "WORLD_SIZE='abc'"),
        ({"WORLD_SIZE": "0"}, "WORLD_SIZE='0'"),
        ({"WORLD_SIZE": "-2"}, "WORLD_SIZE='-2'"),
        ({"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "garbage"}, "ZERO_STAGE='garbage'"),
        ({"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_CONFIG_FILE": "[1, 2]"}, "ds.json"),
        ({"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_CONFIG_FILE": '{"zero_optimization": 1}'}, "ds"),
        ({"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_CONFIG_FILE": "{not json"}, "ds.json"),
    ],
)
def test_launch_strategy_names_a_bad_launch_variable(env, named, monkeypatch, tmp_path):
    # garbage used to be planned as plain DDP (the guard then told a DeepSpeed user to launch with zero3.yaml),
    # or raised "invalid literal for int()" / an AttributeError traceback
    for var in _LAUNCH_VARS:
        monkeypatch.delenv(var, raising=False)
    for key, value in env.items():
        if key == "ACCELERATE_DEEPSPEED_CONFIG_FILE":
            (tmp_path / "ds.json").write_text(value)
            value = str(tmp_path / "ds.json")
        monkeypatch.setenv(key, value)
    with pytest.raises(ValueError, match=named) as err:
        runs.launch_strategy()
    assert "\n" not in str(err.value) and "expected" in str(err.value)


def test_launch_strategy_deepspeed_stage_0_is_ddp(monkeypatch):
    for var in _LAUNCH_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert runs.launch_strategy() == ("ddp", 2)


def test_an_older_eval_before_json_is_paired_only_with_a_float32_hf_after():
    # an eval_before.json written before eval_dtype/eval_backend existed was decoded by HF generate on the
    # unprepared fp32 module (issue 22 S1): pairing it with a bf16 "after" compares two precisions
    from klear.runs import eval_fields

    older = {"accuracy": 0.5, "per_problem": [1, 0]}
    with pytest.raises(ValueError, match=r"eval_before\.json .*eval_dtype.*'float32'.*'bfloat16'") as err:
        eval_fields(older, {"eval_dtype": "bfloat16", "eval_backend": "hf"})
    assert "\n" not in str(err.value)
    fp32 = {"eval_dtype": "float32", "eval_backend": "hf"}
    assert eval_fields(older, fp32) == fp32  # a CPU run resumed across the upgrade


def test_rl_caps_the_heldout_batch_for_its_own_prompts_not_the_whole_context(
    fake_gpu, embedded_path, tmp_path, monkeypatch
):
    # the held-out KV cache per sequence is its longest prompt + eval.max_new_tokens, not the 8192 positions
    from transformers import AutoTokenizer

    import klear.generation.vllm as vllm_integration
    import klear.rl.job as job

    def reached(*a, **kw):
        raise _ReachedTheModel

    seen: dict = {}
    build = job._build_datasets
    monkeypatch.setattr(job, "_build_datasets", lambda *a: seen.setdefault("data", build(*a)))
    cap = runs.cap_eval_batch_size
    monkeypatch.setattr(
        runs,
        "cap_eval_batch_size",
        lambda cfg, setup, *, tokens: seen.setdefault("tokens", tokens) and cap(cfg, setup, tokens=tokens),
    )
    monkeypatch.setattr(vllm_integration, "build_trainer", reached)
    config, _ = load_config(
        "rl_demo",
        [f"output_dir={tmp_path / 'run'}", "data.train_size=16", "data.heldout_size=4", "eval.max_new_tokens=7"],
    )
    with pytest.raises(_ReachedTheModel):
        job.run_rl(config, source="rl_demo")
    tok = AutoTokenizer.from_pretrained(embedded_path)
    heldout = seen["data"][1]
    texts = [tok.apply_chat_template(list(p), add_generation_prompt=True, tokenize=False) for p in heldout["prompt"]]
    longest = max(len(tok(t, add_special_tokens=False)["input_ids"]) for t in texts)
    assert seen["tokens"] == longest + 7
