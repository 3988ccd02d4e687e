"""The launch-time memory guard, the GPU recipes on a 32K-context 8B checkpoint, the shipped accelerate configs and
``klear rl|sft --dry-run`` (issue 22: H1, H3, H4/H5), all on CPU with a faked GPU."""

from __future__ import annotations

import json
import types
from pathlib import Path

import pytest

from conftest import decoder_config
from klear import runs
from klear.config import CONFIG_DIR, load_config
from klear.precision import Precision
from test_memory import qwen3_8b_config

GPU_RECIPES = ("rl_math_klear", "rl_code_klear", "rl_math_cegppo", "rl_math_erc", "sft_klear")
ACCELERATE = Path(__file__).resolve().parents[1] / "src" / "klear" / "configs" / "accelerate"


@pytest.fixture
def checkpoint(tmp_path, monkeypatch):
    """A Qwen3-8B-Base-like checkpoint folder (config.json only: 32K context) and klear's cache in tmp."""
    monkeypatch.setenv("KLEAR_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "qwen3-8b"
    qwen3_8b_config().save_pretrained(path)
    (path / "model.safetensors").write_text("not read")
    return path


@pytest.fixture
def fake_gpu(monkeypatch):
    """An 80 GB CUDA device (bf16) under an 8-process launch; ``launch(strategy)`` fakes the launch's strategy."""
    import torch

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: types.SimpleNamespace(total_memory=80 * 10**9))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    original = runs.trainer_arguments

    def on_gpu(config, **kw):  # the trainer arguments as built here, the precision a bf16 GPU resolves
        trainer_cfg, _, args = original(config, **{**kw, "machine_checks": False})
        return trainer_cfg, Precision("cuda", "bfloat16", config["trainer"].get("bf16", "auto")), args

    monkeypatch.setattr(runs, "trainer_arguments", on_gpu)
    # accelerate's variables (launch_strategy reads them: test_launch_strategy_reads_accelerate_launch_variables)
    # would make the trainer arguments need DeepSpeed and a rendezvous here: the launch is faked one level up

    def launch(strategy: str) -> None:
        monkeypatch.setattr(runs, "launch_strategy", lambda: (strategy, 8))

    return launch


def _prepare(recipe: str, checkpoint: Path, tmp_path: Path):
    from klear.rl.job import trainer_config
    from klear.sft.job import SFT_TRAINER_DEFAULTS
    from klear.sft.trainer import KlearSFTConfig

    config, _ = load_config(recipe, [f"model={checkpoint}", f"output_dir={tmp_path / 'run'}", "data.train=x.jsonl"])
    if recipe.startswith("sft"):
        kw = {"config_cls": KlearSFTConfig, "trainer_defaults": SFT_TRAINER_DEFAULTS}
    else:
        config_cls, trainer = trainer_config(config, recipe)
        config, kw = {**config, "trainer": trainer}, {"config_cls": config_cls}
    return config, runs.prepare_run(config, source=recipe, resume=False, **kw)


class WordTokenizer:
    """A tokenizer whose tokens are words (check_prompt_context renders, then counts)."""

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True, **kw):
        return " ".join(m["content"] for m in messages)

    def __call__(self, texts, add_special_tokens=False):
        return {"input_ids": [t.split() for t in texts]}


@pytest.mark.parametrize("recipe", ("rl_math_klear", "sft_klear"))
def test_guard_refuses_plain_ddp_for_the_8b_recipes(recipe, checkpoint, fake_gpu, tmp_path):
    fake_gpu("ddp")
    with pytest.raises(ValueError) as err:
        _prepare(recipe, checkpoint, tmp_path)
    message = str(err.value)
    assert "\n" not in message
    assert "with ddp on 8 process(es)" in message and "74.5 GiB" in message  # the device: 80 GB
    assert message.endswith("launch with --config_file configs/accelerate/zero3.yaml (DeepSpeed ZeRO-3)")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("recipe", GPU_RECIPES)
def test_gpu_recipes_fit_8x80gb_with_zero3_on_a_32k_checkpoint(recipe, checkpoint, fake_gpu, tmp_path):
    from datasets import Dataset

    fake_gpu("zero3")
    config, setup = _prepare(recipe, checkpoint, tmp_path)
    assert setup.memory_plan.fits and setup.memory_plan.strategy == "zero3"
    assert setup.memory_plan.processes == 8
    if recipe.startswith("sft"):
        assert setup.context == 32768 and setup.model_path == str(checkpoint)  # sft_klear keeps the 32K context
        return
    # 4K prompt + 32K response on a checkpoint with 32768 positions: the run's context is raised
    assert setup.context == 36864
    assert setup.model_config.max_position_embeddings == 36864
    assert json.loads((Path(setup.model_path) / "config.json").read_text())["max_position_embeddings"] == 36864
    assert (Path(setup.model_path) / "model.safetensors").resolve() == (checkpoint / "model.safetensors").resolve()
    prompts = Dataset.from_dict({"prompt": ["w " * 4096]})
    budget = setup.args.max_completion_length
    assert budget == 32768
    common = dict(budget=budget, budget_name="trainer.max_completion_length", where="data.train")
    assert runs.check_prompt_context(WordTokenizer(), prompts, context=setup.context, **common) == 4096
    with pytest.raises(ValueError, match="exceeds the model's context of 36864"):
        runs.check_prompt_context(
            WordTokenizer(), Dataset.from_dict({"prompt": ["w " * 4097]}), context=setup.context, **common
        )
    # the GPU vLLM engine's context: prompt + response, within the raised positions
    from klear.generation.vllm import rollout_engine_settings

    engine = rollout_engine_settings(
        setup.args,
        config["trainer"],
        model_path=setup.model_path,
        config=setup.model_config,
        longest_prompt=4096,
        on_cpu=False,
    )
    assert engine["vllm_max_model_length"] == 36864


@pytest.mark.parametrize("recipe", ("rl_math_klear", "rl_code_klear"))
def test_gpu_rl_recipes_refused_with_ddp_too(recipe, checkpoint, fake_gpu, tmp_path):
    fake_gpu("ddp")
    with pytest.raises(ValueError, match=r"zero3\.yaml"):
        _prepare(recipe, checkpoint, tmp_path)


def test_guard_names_the_micro_batch_fix(checkpoint, fake_gpu, tmp_path, monkeypatch):
    fake_gpu("zero3")
    original = runs.trainer_arguments

    def bigger(config, **kw):
        config = {**config, "trainer": {**config["trainer"], "per_device_train_batch_size": 4}}
        return original(config, **kw)

    monkeypatch.setattr(runs, "trainer_arguments", bigger)
    with pytest.raises(ValueError, match="lower trainer.per_device_train_batch_size"):
        _prepare("rl_math_klear", checkpoint, tmp_path)


def test_cpu_runs_are_not_planned(checkpoint, tmp_path, monkeypatch, capsys):
    config, _ = load_config(
        "sft_klear",
        [
            f"model={checkpoint}",
            f"output_dir={tmp_path / 'run'}",
            "data.train=x.jsonl",
            "trainer.bf16=auto",
            "trainer.model_init_kwargs.attn_implementation=sdpa",
        ],  # flash-attention needs a GPU
    )
    from klear.sft.job import SFT_TRAINER_DEFAULTS
    from klear.sft.trainer import KlearSFTConfig

    setup = runs.prepare_run(
        config, source="sft_klear", resume=False, config_cls=KlearSFTConfig, trainer_defaults=SFT_TRAINER_DEFAULTS
    )
    assert setup.memory_plan is None and "memory plan" not in capsys.readouterr().out


@pytest.mark.parametrize(
    ("name", "distributed", "field", "value"),
    [
        ("zero3.yaml", "DEEPSPEED", "deepspeed_config", 3),
        ("fsdp2.yaml", "FSDP", "fsdp_config", 2),
    ],
)
def test_shipped_accelerate_configs_load_with_accelerates_loader(name, distributed, field, value):
    from accelerate.commands.config.config_args import ClusterConfig
    from accelerate.utils import DistributedType

    config = ClusterConfig.from_yaml_file(str(ACCELERATE / name))
    assert config.distributed_type == DistributedType(distributed)
    assert config.mixed_precision == "bf16" and config.num_processes == 8 and not config.use_cpu
    section = getattr(config, field)
    if field == "deepspeed_config":
        assert section["zero_stage"] == value
        assert section["offload_optimizer_device"] == "none"
    else:
        assert section["fsdp_version"] == value
        assert section["fsdp_activation_checkpointing"] is False  # the recipe's gradient_checkpointing decides


def test_packaged_accelerate_configs():
    import tomllib

    data = tomllib.loads((ACCELERATE.parents[3] / "pyproject.toml").read_text())
    assert "configs/accelerate/*.yaml" in data["tool"]["setuptools"]["package-data"]["klear"]


def test_launch_strategy_reads_accelerate_launch_variables(monkeypatch, tmp_path):
    for var in ("ACCELERATE_USE_DEEPSPEED", "ACCELERATE_DEEPSPEED_ZERO_STAGE", "ACCELERATE_USE_FSDP", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    assert runs.launch_strategy() == ("ddp", 1)
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    assert runs.launch_strategy() == ("fsdp2", 8)
    monkeypatch.delenv("ACCELERATE_USE_FSDP")
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"zero_optimization": {"stage": 2}}))
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", str(ds))
    assert runs.launch_strategy() == ("zero2", 8)
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", "3")
    assert runs.launch_strategy() == ("zero3", 8)


@pytest.mark.parametrize(("command", "recipe"), [("rl", "rl_math_klear"), ("sft", "sft_klear")])
def test_cli_dry_run_prints_the_plan(command, recipe, checkpoint, tmp_path, capsys):
    from klear.cli import main

    common = [command, "--config", recipe, "--dry-run", "--gpus", "8", "--gpu-memory-gb", "80"]
    overrides = [f"model={checkpoint}", f"output_dir={tmp_path / 'run'}", "data.train=x.jsonl"]
    assert main([*common, "--strategy", "zero3", *overrides]) == 0
    out = capsys.readouterr().out
    assert "memory plan per GPU (zero3, 8 process(es))" in out and "optimizer state (AdamW)" in out
    assert "74.5 GiB" in out and "fits" in out and "does NOT fit" not in out
    if command == "rl":
        assert "context 36864 tokens (raised from the checkpoint's 32768)" in out
        # the paper (Sec. 4.1): 128 prompts x 8 responses per rollout batch, 16 prompts per optimizer step
        assert "128 rollouts (16 prompts x 8) per optimizer step, 1024 (128 prompts) per rollout batch" in out
        assert main([*common, "--strategy", "zero3", "--prompt-tokens", "1000", *overrides]) == 0
        assert "sequences planned at 33768 tokens (--prompt-tokens 1000" in capsys.readouterr().out  # 1000 + 32768
    else:  # 1 packed row x 8 accumulation x 8 processes (the recipe's comment)
        assert "batch on 8 process(es): 64 rows per optimizer step" in out
    assert main([*common, "--strategy", "ddp", *overrides]) == 0
    out = capsys.readouterr().out
    assert "does NOT fit" in out and "fix: launch with --config_file configs/accelerate/zero3.yaml" in out
    # klear rl plans the whole context unless told the prompts' length: the verdict of an upper bound says so
    hint = "or first plan your data's longest prompt with --prompt-tokens N (this plan is the whole context)"
    assert (hint in out) == (command == "rl")
    assert not (tmp_path / "run").exists()  # nothing written, no weights loaded (the safetensors file is text)


def test_cli_dry_run_without_a_gpu_needs_the_memory(checkpoint, tmp_path, capsys):
    from klear.cli import main

    code = main(["rl", "--config", "rl_math_klear", "--dry-run", f"model={checkpoint}", "data.train=x.jsonl"])
    assert code == 2 and "--gpu-memory-gb" in capsys.readouterr().err


def test_accelerate_config_file_relative_in_a_checkout_absolute_elsewhere(tmp_path, monkeypatch):
    from klear.config import CONFIG_DIR, accelerate_config_file

    monkeypatch.chdir(ACCELERATE.parents[3])  # the repository root: configs/ links to src/klear/configs
    assert accelerate_config_file("zero3") == "configs/accelerate/zero3.yaml"
    monkeypatch.chdir(tmp_path)  # a pip user's working directory: no configs/ here
    path = Path(accelerate_config_file("fsdp2"))
    assert path.is_absolute() and path.is_file() and path == CONFIG_DIR / "accelerate" / "fsdp2.yaml"
    (tmp_path / "configs" / "accelerate").mkdir(parents=True)  # a user's own file of that name is not klear's
    (tmp_path / "configs" / "accelerate" / "zero3.yaml").write_text("distributed_type: MULTI_GPU\n")
    assert Path(accelerate_config_file("zero3")).is_absolute()
    with pytest.raises(
        FileNotFoundError, match=r"accelerate config 'zero2' not found \(shipped: \['fsdp2', 'zero3'\]\)"
    ):
        accelerate_config_file("zero2")


def test_cli_dry_run_outside_a_checkout_names_the_installed_accelerate_config(
    checkpoint, tmp_path, monkeypatch, capsys
):
    from klear.cli import main
    from klear.config import CONFIG_DIR

    monkeypatch.chdir(tmp_path)
    common = ["sft", "--config", "sft_klear", "--dry-run", "--gpu-memory-gb", "80", f"model={checkpoint}"]
    common += ["data.train=x.jsonl"]
    zero3 = CONFIG_DIR / "accelerate" / "zero3.yaml"
    assert main([*common, "--gpus", "8", "--strategy", "ddp"]) == 0
    assert f"fix: launch with --config_file {zero3} (DeepSpeed ZeRO-3)" in capsys.readouterr().out
    assert main([*common, "--gpus", "8", "--strategy", "zero3"]) == 0  # the shipped file's 8 processes
    assert f"launch: accelerate launch --config_file {zero3} -m klear.cli sft (" in capsys.readouterr().out
    assert main([*common, "--gpus", "4", "--strategy", "fsdp2"]) == 0
    fsdp2 = CONFIG_DIR / "accelerate" / "fsdp2.yaml"
    assert f"--config_file {fsdp2} --num_processes 4 -m klear.cli sft (" in capsys.readouterr().out


def test_cli_dry_run_unreadable_model_config_is_one_line(monkeypatch, capsys):
    import transformers

    from klear.cli import main

    def offline(*args, **kwargs):  # transformers' message for a hub id with no network and no cache
        raise OSError(
            "We couldn't connect to 'https://huggingface.co' to load the files, and couldn't find them in the "
            "cached files.\nCheck your internet connection or see how to run the library in offline mode."
        )

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", offline)
    args = ["sft", "--config", "sft_klear", "--dry-run", "--gpus", "8", "--gpu-memory-gb", "80", "data.train=x"]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("klear sft: error: model 'Qwen/Qwen3-8B-Base': cannot read its")
    assert "We couldn't connect" in err and "Check your internet" not in err


def test_eval_batch_cap_on_cuda_only(checkpoint, fake_gpu, tmp_path, capsys):
    fake_gpu("zero3")
    _, setup = _prepare("rl_math_klear", checkpoint, tmp_path)
    eval_cfg = {"enabled": True, "batch_size": 32, "max_new_tokens": 32768}
    capped = runs.cap_eval_batch_size(eval_cfg, setup, tokens=setup.context)
    assert 1 <= capped["batch_size"] < 32 and eval_cfg["batch_size"] == 32
    assert f"eval.batch_size 32 -> {capped['batch_size']}" in capsys.readouterr().out
    cpu = runs.RunSetup(**{**vars(setup), "precision": Precision("cpu", "float32")})
    assert runs.cap_eval_batch_size(eval_cfg, cpu, tokens=setup.context) is eval_cfg


def test_gpu_experiments_fit_one_80gb_gpu_on_their_checkpoints_context(tmp_path, monkeypatch, capsys):
    """The *_gpu experiments (one GPU, Qwen2.5-1.5B-Instruct / -Coder, 32K positions, 1-2K-token responses): every
    arm plans under plain DDP on one 80 GB GPU at 512-token prompts, and keeps the checkpoint's context (their base,
    rl_math_klear, raises it to 4K + 32K)."""
    from transformers import Qwen2Config

    from klear.experiment import load_experiment, plan_runs
    from klear.rl.job import plan_rl

    monkeypatch.setenv("KLEAR_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "qwen2.5-1.5b"
    config = decoder_config(
        Qwen2Config, 151936, 1536, 28, 12, 2, 8960, tie_word_embeddings=True, max_position_embeddings=32768
    )
    config.save_pretrained(path)
    files = sorted(CONFIG_DIR.glob("experiments/*_gpu.yaml"))
    assert len(files) == 5
    for file in files:
        for run, config in plan_runs(load_experiment(file), [0], tmp_path / "xp").items():
            plan = plan_rl(
                {**config, "model": str(path)},
                source=f"{file.stem} {run}",
                gpus=1,
                gpu_memory_gb=80,
                strategy="ddp",
                prompt_tokens=512,
            )
            out = capsys.readouterr().out
            assert plan.fits, (file.stem, run, out)
            assert "context 32768 tokens; no weights loaded" in out and "raised" not in out, (file.stem, run)
            tokens = 512 + config["trainer"]["max_completion_length"]
            assert f"sequences planned at {tokens} tokens (--prompt-tokens 512 + max_completion_length)" in out


def test_dry_run_on_an_empty_cache_writes_nothing_and_plans_as_after_conversion(tmp_path, monkeypatch, capsys):
    """`--dry-run` (its help: "nothing is written") converted the embedded model into the cache (517 MB) and, for a
    bench recipe, started the bench model's 5-minute build."""
    from klear.cli import main
    from klear.models.embedded import embedded_model_path

    argv = ["rl", "--config", "rl_demo", "--dry-run", "--gpus", "1", "--gpu-memory-gb", "80"]
    embedded_model_path()  # the session's cache, converted (as the other tests use it)
    assert main([*argv, f"output_dir={tmp_path / 'run1'}"]) == 0
    converted = capsys.readouterr().out
    empty = tmp_path / "cache"
    empty.mkdir()
    monkeypatch.setenv("KLEAR_CACHE", str(empty))
    assert main([*argv, f"output_dir={tmp_path / 'run2'}"]) == 0  # the config read from the GGUF file
    from_gguf = capsys.readouterr().out
    assert "memory plan per GPU" in from_gguf and from_gguf.replace("run2", "run1") == converted
    assert main(["rl", "--config", "rl_bench_arith", "--dry-run", "--gpus", "1", "--gpu-memory-gb", "80"]) == 2
    err = capsys.readouterr().err
    assert "model 'bench:arith' is not built" in err and "a dry run builds nothing): klear bench build arith" in err
    assert list(empty.iterdir()) == [] and not (tmp_path / "run2").exists()
