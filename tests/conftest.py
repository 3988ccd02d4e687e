"""Shared fixtures: the embedded model's converted checkpoint (converted once per machine) and tiny models; helpers
for data files, rows, recipes, experiment files, command lines and model configs, a bare GPPOTrainer, a reward that
varies within a group, and a probe of resumed training runs."""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import json
import os
import sys
import threading
from pathlib import Path
from types import ModuleType

import pytest

# ../shared/data beside the checkout (also from mutmut's copy of the tests in mutants/tests)
SHARED_DATA = next(
    (p / "shared" / "data" for p in Path(__file__).resolve().parents[2:] if (p / "shared" / "data").is_dir()),
    Path(__file__).resolve().parents[2] / "shared" / "data",
)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _stop_tracing_in_forked_child() -> None:
    """Untrace a forked child (the reward pools' workers): `make test` measures coverage in the pytest process
    only, and a forked worker inherits the tracer without saving its data (it ends with ``os._exit``); traced,
    it only runs slower and misses its time limits (1 s per math answer)."""
    sys.settrace(None)
    threading.settrace(None)


os.register_at_fork(after_in_child=_stop_tracing_in_forked_child)


def require_or_skip(module: str, reason: str) -> ModuleType:
    """Import ``module`` for a test file that needs it: skip the file when it is missing, FAIL when it is required.

    ``KLEAR_REQUIRE`` (comma-separated, set by ``make test-verl`` / ``make test-vllm``) names the libraries
    the run exists to test; there a failed import is an error of the run (pytest exits non-zero), not a skip
    that reports success.  Elsewhere (the main suite, a venv without the library) the file is skipped.

    Raises:
        ImportError: ``module`` is named in ``KLEAR_REQUIRE`` and cannot be imported (the message names both).
    """
    required = {m.strip() for m in os.environ.get("KLEAR_REQUIRE", "").split(",") if m.strip()}
    if module not in required:
        return pytest.importorskip(module, reason=reason)
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(f"KLEAR_REQUIRE={os.environ['KLEAR_REQUIRE']} but `import {module}` failed: {e}") from e


@pytest.fixture(scope="session")
def embedded_path() -> Path:
    """Directory of the converted SmolLM2-135M-Instruct checkpoint (real tokenizer + weights)."""
    from klear.models.embedded import embedded_model_path

    return embedded_model_path()


@pytest.fixture()
def tiny_model(embedded_path):
    """(tiny random Llama, real SmolLM2 tokenizer with left padding)."""
    from klear.models.embedded import tiny_random_model

    model, tok = tiny_random_model(embedded_path)
    tok.padding_side = "left"
    return model, tok


@pytest.fixture()
def tiny_ckpt(tmp_path, tiny_model):
    """A saved checkpoint directory of :func:`tiny_model` (for job tests that take a model path)."""
    model, tok = tiny_model
    path = tmp_path / "tiny"
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def shared_file(*parts: str) -> Path:
    """A file from ../shared/data; skips the test when it is absent (the product never needs it)."""
    path = SHARED_DATA.joinpath(*parts)
    if not path.is_file():
        pytest.skip(f"{path} not available")
    return path


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    """Write ``rows`` to ``path`` as JSON lines; returns ``path``."""
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def math_rows(n: int, start: int = 0) -> list[dict]:
    """``n`` verl-layout math rows "What is i + 1?" (ground truth ``i + 1``) for i in ``start, start + n``."""
    return [
        {
            "prompt": [{"role": "user", "content": f"What is {i} + 1? Put the answer in \\boxed{{}}."}],
            "data_source": "math_test",
            "reward_model": {"style": "rule", "ground_truth": str(i + 1)},
            "extra_info": {"index": i},
        }
        for i in range(start, start + n)
    ]


# The files every finished `klear rl` / `klear sft` run writes in its output directory.
RUN_FILES = (
    "config.yaml",
    "metrics.jsonl",
    "eval_before.json",
    "eval_after.json",
    "eval.json",
    "training_curves.png",
    "final/config.json",
)


def rl_recipe(tmp_path: Path, ckpt: Path, *, eval_settings: dict, n_heldout: int = 4, **trainer) -> dict:
    """A ``klear rl`` recipe for the tiny checkpoint ``ckpt``: :func:`math_rows` written to ``tmp_path`` (8 training
    problems in train.jsonl, ``n_heldout`` held-out ones from 100 in heldout.jsonl), output in ``tmp_path / "run"``,
    seed 0, groups of 2 completions of 4 tokens, 2 rows per device and no accumulation; ``trainer`` adds or replaces
    trainer settings."""
    train = write_jsonl(tmp_path / "train.jsonl", math_rows(8))
    heldout = write_jsonl(tmp_path / "heldout.jsonl", math_rows(n_heldout, start=100))
    return {
        "model": str(ckpt),
        "output_dir": str(tmp_path / "run"),
        "seed": 0,
        "data": {"train": str(train), "heldout": str(heldout)},
        "eval": eval_settings,
        "trainer": {
            "num_generations": 2,
            "per_device_train_batch_size": 2,
            "gradient_accumulation_steps": 1,
            "max_completion_length": 4,
            **trainer,
        },
    }


def sft_row(resp: str, gt: str, difficulty: str | None = None, pass_rate: float | None = None) -> dict:
    """One SFT row (prompt "q", ``resp`` as the assistant's completion) with its ground truth and difficulty."""
    return {
        "prompt": [{"role": "user", "content": "q"}],
        "completion": [{"role": "assistant", "content": resp}],
        "data_source": "math",
        "ground_truth": gt,
        "difficulty": difficulty,
        "pass_rate": pass_rate,
    }


def cpu_gppo_config(output_dir: Path, **kw):
    """A GPPOConfig for a run on CPU writing to ``output_dir``: seed 0, metrics logged every step, no checkpoints,
    no report backend; ``kw`` sets the rest."""
    from klear.rl.trainer import GPPOConfig

    common = dict(use_cpu=True, seed=0, logging_steps=1, save_strategy="no", report_to=[])
    return GPPOConfig(output_dir=str(output_dir), **{**common, **kw})


def bare_gppo_trainer(args, accelerator):
    """A GPPOTrainer without model or data: only what the counting, slicing, loss, timing and metric methods read."""
    from collections import defaultdict

    import torch

    from klear.rl.trainer import GPPOTrainer

    trainer = GPPOTrainer.__new__(GPPOTrainer)
    trainer.args = args
    trainer.accelerator = accelerator
    trainer.model = torch.nn.Module()  # .training: True
    trainer._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
    return trainer


def assert_error_names_file_and_line(read, path: Path, content: str, needle: str) -> None:
    """``read(path)`` of a file holding ``content`` raises a ValueError whose message holds ``str(path) + needle``."""
    path.write_text(content)
    with pytest.raises(ValueError) as e:
        read(path)
    assert str(path) + needle in str(e.value)


@contextlib.contextmanager
def benchmark_module(name: str, siblings: tuple[str, ...] = ("_machine",)):
    """``benchmarks/<name>.py`` imported as a module, with ``benchmarks/`` on ``sys.path`` as when the script runs from
    there (it imports its ``siblings`` by name); ``sys.path``, ``os.environ`` (a script may set OpenMP variables on
    import) and the siblings' modules are restored on exit."""
    bench = Path(__file__).resolve().parents[1] / "benchmarks"
    sys.path.insert(0, str(bench))
    environ = dict(os.environ)
    try:
        spec = importlib.util.spec_from_file_location(name, bench / f"{name}.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        yield module
    finally:
        os.environ.clear()
        os.environ.update(environ)
        sys.path.remove(str(bench))
        for sibling in siblings:
            sys.modules.pop(sibling, None)


def small_llama_config(**kw):
    """A one-layer Llama config (32 dims, 2 heads, vocab 32) with Qwen-like 32K context and rope_theta 1e6; ``kw``
    replaces fields."""
    from transformers import LlamaConfig

    shape = dict(vocab_size=32, hidden_size=32, num_attention_heads=2, num_hidden_layers=1)
    return LlamaConfig(**{**shape, "max_position_embeddings": 32768, "rope_theta": 1e6, **kw})


def decoder_config(cls, vocab: int, hidden: int, layers: int, heads: int, kv_heads: int, mlp: int, **kw):
    """A transformers decoder config of class ``cls`` (no weights) by its shape, in this order: vocabulary size,
    hidden size, layers, attention heads, key/value heads, MLP (intermediate) size; ``kw`` sets other fields."""
    return cls(
        vocab_size=vocab,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        intermediate_size=mlp,
        **kw,
    )


def eval_argv(model, benchmark, output, options: str = "") -> list[str]:
    """The ``klear eval`` command line of ``model`` on ``benchmark`` writing to ``output``, with ``options`` (words
    split at white space) in between."""
    return ["eval", "--model", str(model), "--benchmark", str(benchmark), *options.split(), "--output", str(output)]


def pass_at_k_argv(inp, out, samples, *options: str) -> list[str]:
    """The ``klear data filter pass-at-k`` command line from ``inp`` to ``out`` with the ``samples`` file, rows keyed
    by ``extra_info.index``, no progress bar, then ``options``."""
    command = ["data", "filter", "pass-at-k", str(inp), str(out), "--samples", str(samples)]
    return [*command, "--id-field", "extra_info.index", "--no-progress", *options]


def write_experiment(path: Path, description: str, base: str, arms: dict, output_dir: Path, **more) -> Path:
    """Write a ``klear experiment`` file to ``path`` (the experiment is named after its stem): ``arms`` on the recipe
    ``base``, seeds 0 and 1, the arm ``gppo`` the reference; ``more`` adds fields (``overrides``)."""
    import yaml

    spec = {"name": path.stem, "description": description, "base": base, "reference": "gppo", "seeds": [0, 1]}
    spec.update(more, arms=arms, output_dir=str(output_dir))
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def varied_reward(prompts, completions, **columns) -> list[float]:
    """A reward in [0, 1] from the characters of each sampled completion (chat messages), so the completions of
    a group differ: a tiny random model never answers right, klear's math reward is then the same for every
    completion and no gradient flows. Install with ``monkeypatch.setattr("klear.rl.reward_fn.make_klear_reward",
    lambda **kwargs: varied_reward)``."""
    return [(sum(map(ord, c[-1]["content"])) % 11) / 10 for c in completions]


class ResumeProbe:
    """Watch a ``klear rl`` / ``klear sft`` run through transformers' callback hooks (patched with ``monkeypatch``).

    * ``kill_at``: when set, the run dies (``KeyboardInterrupt``) right after its checkpoint of that step is saved
      and marked complete, as a process killed between two steps would.
    * ``watch_step``: at the start of optimizer step ``watch_step + 1`` (global step still ``watch_step``),
      :attr:`at_watch` records what a resume must restore: the global step, the optimizer's ``state_dict()``
      (Adam's ``exp_avg``, ``exp_avg_sq``, ``step``), the LR scheduler's ``state_dict()`` and the torch / numpy /
      Python RNG states.
    * :attr:`begin_steps` / :attr:`logged_steps`: the global step at each step start and at each log of this
      process (reset by :meth:`reset`).
    """

    def __init__(self, monkeypatch, *, watch_step: int | None = None):
        import copy
        import random

        import numpy as np
        import torch
        from transformers.trainer_callback import CallbackHandler

        self.watch_step = watch_step
        self.kill_at: int | None = None
        self.reset()
        probe = self
        real_begin, real_log, real_save = (
            CallbackHandler.on_step_begin,
            CallbackHandler.on_log,
            CallbackHandler.on_save,
        )

        def on_step_begin(handler, args, state, control):
            probe.begin_steps.append(state.global_step)
            if state.global_step == probe.watch_step:
                probe.at_watch = {
                    "global_step": state.global_step,
                    "optimizer": copy.deepcopy(handler.optimizer.state_dict()),
                    "scheduler": copy.deepcopy(handler.lr_scheduler.state_dict()),
                    "torch_rng": torch.get_rng_state().clone(),
                    "numpy_rng": np.random.get_state(),
                    "python_rng": random.getstate(),
                }
            return real_begin(handler, args, state, control)

        def on_log(handler, args, state, control, logs):
            if "train_runtime" not in logs:  # the end-of-train summary is not a step
                probe.logged_steps.append(state.global_step)
            return real_log(handler, args, state, control, logs)

        def on_save(handler, args, state, control):
            control = real_save(handler, args, state, control)
            if state.global_step == probe.kill_at:
                raise KeyboardInterrupt  # killed after checkpoint-<kill_at> is complete
            return control

        monkeypatch.setattr(CallbackHandler, "on_step_begin", on_step_begin)
        monkeypatch.setattr(CallbackHandler, "on_log", on_log)
        monkeypatch.setattr(CallbackHandler, "on_save", on_save)

    def reset(self) -> None:
        self.at_watch: dict | None = None
        self.begin_steps: list[int] = []
        self.logged_steps: list[int] = []


def assert_same_final_weights(uninterrupted_run: Path, resumed_run: Path, start_checkpoint: Path) -> None:
    """Both runs' ``final/model.safetensors`` are float32 and equal bit for bit, and training moved them away from
    ``start_checkpoint``'s weights."""
    import torch
    from safetensors.torch import load_file

    final_whole = load_file(uninterrupted_run / "final" / "model.safetensors")
    final_resumed = load_file(resumed_run / "final" / "model.safetensors")
    start = load_file(start_checkpoint / "model.safetensors")
    assert final_whole.keys() == final_resumed.keys()
    for key, value in final_whole.items():
        assert value.dtype == torch.float32 and torch.equal(final_resumed[key], value), key
    assert any(not torch.equal(start[k], v) for k, v in final_whole.items() if k in start)


def assert_same_training_state(resumed: dict, uninterrupted: dict) -> None:
    """The state :class:`ResumeProbe` recorded at the same step of a resumed and an uninterrupted run is equal:
    global step, every optimizer tensor (bit for bit), the LR scheduler's state and the three RNG states."""
    import numpy as np
    import torch

    assert resumed["global_step"] == uninterrupted["global_step"]
    opt_r, opt_u = resumed["optimizer"], uninterrupted["optimizer"]
    assert opt_r["state"].keys() == opt_u["state"].keys() and opt_u["state"], "optimizer state missing"
    for index, slots in opt_u["state"].items():
        assert slots.keys() == opt_r["state"][index].keys(), index
        for name, value in slots.items():
            assert torch.equal(opt_r["state"][index][name], value), f"optimizer state {index}.{name} differs"
    assert opt_r["param_groups"] == opt_u["param_groups"]
    assert resumed["scheduler"] == uninterrupted["scheduler"]
    assert torch.equal(resumed["torch_rng"], uninterrupted["torch_rng"]), "torch RNG state not restored"
    np_r, np_u = resumed["numpy_rng"], uninterrupted["numpy_rng"]
    assert np_r[0] == np_u[0] and np.array_equal(np_r[1], np_u[1]) and np_r[2:] == np_u[2:], "numpy RNG state"
    assert resumed["python_rng"] == uninterrupted["python_rng"], "Python RNG state not restored"
