"""klear rl / klear sft refuse bad input before any run file, leave nothing behind when they fail
before training, and print no gradient-checkpointing deprecation warnings (issue 14, reliability)."""

from __future__ import annotations

import json
import warnings

import pytest
import yaml

from klear.cli import main
from klear.config import load_config


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _row(i, content=None):
    return {
        "prompt": [{"role": "user", "content": content or f"What is {i} + 1? Put the answer in \\boxed{{}}."}],
        "data_source": "math_test",
        "reward_model": {"style": "rule", "ground_truth": str(i + 1)},
        "extra_info": {"index": i},
    }


def _rl_recipe(tmp_path, ckpt, rows=None, **trainer):
    train = _jsonl(tmp_path / "train.jsonl", rows or [_row(i) for i in range(4)])
    recipe = {
        "model": str(ckpt),
        "output_dir": str(tmp_path / "run"),
        "seed": 0,
        "data": {"train": str(train), "heldout": "none"},
        "eval": {"max_new_tokens": 4, "batch_size": 4},
        "trainer": {
            "num_generations": 2,
            "per_device_train_batch_size": 2,
            "steps_per_generation": 1,
            "max_completion_length": 4,
            "max_steps": 1,
            "learning_rate": 1e-4,
            "report_to": [],
            "save_strategy": "no",
            **trainer,
        },
    }
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def _one_error_line(capsys, command):
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith(f"klear {command}: error:")]
    assert len(err) == 1, err
    return err[0]


# ------------------------------------------------------------------------------ prompt vs context
def test_rl_refuses_a_prompt_longer_than_the_context_naming_row_and_numbers(tmp_path, tiny_ckpt, capsys):
    from transformers import AutoConfig, AutoTokenizer

    long_text = "Add these numbers: " + " + ".join(str(n) for n in range(390)) + ". Box the answer."
    rows = [_row(i) for i in range(6)]
    rows[3] = _row(3, long_text)
    tok = AutoTokenizer.from_pretrained(tiny_ckpt)
    length = len(
        tok.apply_chat_template(rows[3]["prompt"], add_generation_prompt=True, tokenize=True, return_dict=True)[
            "input_ids"
        ]
    )  # independent of klear's renderer
    context = AutoConfig.from_pretrained(tiny_ckpt).max_position_embeddings
    assert context == 2048 and 1500 < length < context
    budget = context - length + 1  # one token too many
    recipe = _rl_recipe(tmp_path, tiny_ckpt, rows, max_completion_length=budget)
    assert main(["rl", "--config", str(recipe)]) == 2
    err = _one_error_line(capsys, "rl")
    assert (
        f"train.jsonl: row 3 (prompt_id '3'): the longest prompt ({length} tokens) plus "
        f"trainer.max_completion_length {budget} = {context + 1} exceeds the model's context of {context} "
        "tokens"
    ) in err, err
    assert not (tmp_path / "run").exists()  # refused before the run directory exists


def test_prompt_context_check_boundary(tiny_ckpt):
    import datasets
    from transformers import AutoTokenizer

    from klear.runs import check_prompt_context

    tok = AutoTokenizer.from_pretrained(tiny_ckpt)
    ds = datasets.Dataset.from_list(
        [
            {"prompt": [{"role": "user", "content": "hi"}]},
            {"prompt": [{"role": "user", "content": "a longer question, with words"}]},
        ]
    )
    longest = max(
        len(tok.apply_chat_template(p, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"])
        for p in ds["prompt"]
    )
    kw = dict(budget_name="trainer.max_completion_length", context=100, where="data.train=x")
    assert check_prompt_context(tok, ds, budget=100 - longest, **kw) == longest  # exactly fits
    with pytest.raises(ValueError, match=rf"data.train=x: row 1: the longest prompt \({longest} tokens\)"):
        check_prompt_context(tok, ds, budget=101 - longest, **kw)


# ------------------------------------------------------------------------- resume another model
def test_resume_from_a_checkpoint_of_another_model_is_one_line(tmp_path, tiny_ckpt, embedded_path, capsys):
    from klear.models.embedded import tiny_random_model

    other, tok = tiny_random_model(embedded_path, hidden_size=32, num_layers=1)
    ckpt = tmp_path / "elsewhere" / "checkpoint-5"
    other.save_pretrained(ckpt)  # a checkpoint trained from another (narrower, shallower) model
    (ckpt / "trainer_state.json").write_text(json.dumps({"global_step": 5}))
    recipe = _rl_recipe(tmp_path, tiny_ckpt)
    assert main(["rl", "--config", str(recipe), "--resume-from", str(ckpt)]) == 2
    err = _one_error_line(capsys, "rl")
    assert f"--resume-from {ckpt}: a checkpoint of another model than model={tiny_ckpt}" in err, err
    assert "hidden_size 32 vs 64" in err and "num_hidden_layers 1 vs 2" in err
    assert not (tmp_path / "run").exists()


# ----------------------------------------------------------------------------- sft max_length=0
def _sft_overrides(tmp_path, ckpt):
    return [
        f"model={ckpt}",
        f"output_dir={tmp_path / 'sft'}",
        "data.train_size=4",
        "data.heldout=none",
        "trainer.max_steps=1",
        "trainer.warmup_steps=0",
        "trainer.per_device_train_batch_size=2",
        "trainer.max_length=256",
        "trainer.report_to=[]",
        "trainer.save_strategy=no",
    ]


@pytest.mark.parametrize("value", ["0", "-3", "1.5"])
def test_sft_max_length_below_one_is_one_line_before_any_work(tmp_path, tiny_ckpt, capsys, value):
    assert main(["sft", *_sft_overrides(tmp_path, tiny_ckpt), f"trainer.max_length={value}"]) == 2
    err = _one_error_line(capsys, "sft")
    assert f"trainer.max_length={yaml.safe_load(value)!r} must be an integer >= 1 (or null)" in err, err
    assert not (tmp_path / "sft").exists()


# ---------------------------------------------------------------- run directories of failed runs
def test_rl_bad_dataset_row_writes_nothing(tmp_path, tiny_ckpt, capsys):
    rows = [_row(i) for i in range(4)]
    del rows[1]["reward_model"]
    assert main(["rl", "--config", str(_rl_recipe(tmp_path, tiny_ckpt, rows))]) == 2
    assert "train.jsonl: row 1" in _one_error_line(capsys, "rl")
    assert not (tmp_path / "run").exists()  # the dataset is validated before start_run


@pytest.mark.parametrize("stage", ["rl", "sft"])
def test_failure_before_training_removes_only_a_new_run_directory(tmp_path, tiny_ckpt, monkeypatch, stage):
    import shutil

    from klear.lifecycle import mark_complete
    from klear.rl.job import run_rl
    from klear.rl.trainer import GPPOTrainer
    from klear.sft.job import run_sft
    from klear.sft.trainer import KlearSFTTrainer

    def boom(self, *a, **k):
        raise RuntimeError("model failed to load")

    monkeypatch.setattr(GPPOTrainer if stage == "rl" else KlearSFTTrainer, "__init__", boom)
    if stage == "rl":
        config = yaml.safe_load(_rl_recipe(tmp_path, tiny_ckpt).read_text())
        run, out = run_rl, tmp_path / "run"
    else:
        config, _ = load_config("sft_demo", _sft_overrides(tmp_path, tiny_ckpt))
        run, out = run_sft, tmp_path / "sft"
    with pytest.raises(RuntimeError, match="model failed to load"):
        run(config)
    assert not out.exists()  # created by this run: removed

    out.mkdir()
    (out / "keep.txt").write_text("x")
    with pytest.raises(RuntimeError, match="model failed to load"):
        run(config)
    assert (out / "keep.txt").is_file() and (out / "config.yaml").is_file()  # existed before: kept

    shutil.rmtree(out)
    ckpt = out / "checkpoints" / "checkpoint-1"  # a resumed run (checkpoint of the same model)
    ckpt.mkdir(parents=True)
    shutil.copy(tiny_ckpt / "config.json", ckpt / "config.json")
    mark_complete(ckpt, 1)
    with pytest.raises(RuntimeError, match="model failed to load"):
        run(config, resume=True)
    assert (out / "config.yaml").is_file() and ckpt.is_dir()


# ------------------------------------------------------------ gradient-checkpointing FutureWarning
def _checkpointing_warnings(record):
    return [str(w.message) for w in record if "checkpointing" in str(w.message)]


def test_jobs_print_no_gradient_checkpointing_deprecation(tmp_path, tiny_ckpt):
    from klear.rl.job import run_rl
    from klear.sft.job import run_sft

    config = yaml.safe_load(_rl_recipe(tmp_path, tiny_ckpt, gradient_checkpointing=True).read_text())
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        assert run_rl(config)["steps"] == 1  # rollouts toggle checkpointing around generate (TRL)
        sft_config, _ = load_config(
            "sft_demo", _sft_overrides(tmp_path, tiny_ckpt) + ["trainer.gradient_checkpointing=true"]
        )
        assert run_sft(sft_config)["steps"] == 1
    assert _checkpointing_warnings(record) == []


def test_the_filter_is_narrow():
    from klear.runs import silence_checkpointing_deprecations

    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        silence_checkpointing_deprecations()
        for old, new in (
            ("gradient_checkpointing", "activation_checkpointing"),
            ("is_gradient_checkpointing", "is_activation_checkpointing"),
            ("gradient_checkpointing_enable", "activation_checkpointing_enable"),
        ):
            warnings.warn(
                f"`{old}` is deprecated and will be removed in v6. Use `{new}` instead.", FutureWarning, stacklevel=1
            )
        warnings.warn(
            "`gradient_checkpointing` is deprecated and will be removed in v6. Use `activation_checkpointing` instead.",
            UserWarning,
            stacklevel=1,
        )  # another category: kept
        # another message: kept
        warnings.warn("`use_cache` is deprecated and will be removed in v6.", FutureWarning, stacklevel=1)
    assert [(w.category, str(w.message)[:13]) for w in record] == [
        (UserWarning, "`gradient_che"),
        (FutureWarning, "`use_cache` i"),
    ]


def test_rl_on_a_trl_older_than_its_hooks_is_one_line_before_any_work(tmp_path, tiny_ckpt, capsys, monkeypatch):
    """The klear[verl] environment pins TRL < 1.13 (verl imports trl.experimental.ppo); klear rl's trainers subclass
    TRL 1.16's hooks, so there it must refuse in one line, not fail inside TRL after the model loaded."""
    import trl

    monkeypatch.setattr(trl, "__version__", "1.12.0")
    assert main(["rl", "--config", str(_rl_recipe(tmp_path, tiny_ckpt))]) == 2
    line = _one_error_line(capsys, "rl")
    assert "TRL >= 1.16" in line and "1.12.0" in line
    assert not (tmp_path / "run").exists()
