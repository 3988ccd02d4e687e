"""vLLM engine settings that need no vLLM: the CPU memory fraction, the CPU engine arguments, backend choice."""

from __future__ import annotations

import importlib.util
import math

import pytest
from transformers import LlamaConfig

from conftest import decoder_config, small_llama_config
from klear.eval import backends
from klear.eval.backends import build_vllm_kwargs, plan_context, select_backend
from klear.generation import vllm as kv

GIB = 2**30


# SmolLM2-135M-Instruct (the embedded model): 30 layers, 3 KV heads of 64 dims; KV cache per token in float32
SMOL_KV_PER_TOKEN = 2 * 30 * 3 * 64 * 4  # = 46080 bytes


def test_kv_cache_bytes_per_token_by_hand():
    assert kv.kv_cache_bytes_per_token(num_layers=30, num_kv_heads=3, head_dim=64, dtype_bytes=4) == 46080
    config = LlamaConfig(
        hidden_size=576, num_attention_heads=9, num_key_value_heads=3, num_hidden_layers=30, intermediate_size=1536
    )
    assert kv.model_kv_bytes_per_token(config, 4) == SMOL_KV_PER_TOKEN
    assert kv.model_kv_bytes_per_token(config, 2) == SMOL_KV_PER_TOKEN // 2


def test_engine_context_is_the_runs_need_not_the_models_context():
    # the eval of issue 20: prompts of up to 200 tokens + 32 new tokens on a model with an 8192-token context
    assert kv.engine_max_model_len(232, 8192, what="need", setting="--max-model-len") == 232
    with pytest.raises(ValueError, match=r"need = 9000 tokens exceeds the model's context of 8192 tokens"):
        kv.engine_max_model_len(9000, 8192, what="need", setting="--max-model-len")
    assert kv.engine_max_model_len(9000, None, what="need", setting="--max-model-len") == 9000  # limit unknown


def test_engine_context_set_by_the_user_wins():
    assert kv.engine_max_model_len(232, 8192, user=8192, what="need", setting="--max-model-len") == 8192
    assert kv.engine_max_model_len(232, 8192, user=232, what="need", setting="--max-model-len") == 232
    # below the need, responses would be cut short: refused, naming both numbers
    with pytest.raises(ValueError, match=r"--max-model-len 100 is less than need = 232 tokens"):
        kv.engine_max_model_len(232, 8192, user=100, what="need", setting="--max-model-len")


def test_cpu_engine_memory_by_hand():
    # runtime 1.5 GiB, weights 0.5 GiB, KV cache 46080 B x 264 tokens x 32 sequences = 389,283,840 B,
    # margin 1 GiB + (0.5 GiB + 389,283,840 B) / 4 = 1,073,741,824 + 231,538,688 B
    need = kv.cpu_engine_memory(
        base_bytes=3 * GIB // 2,
        weight_bytes=GIB // 2,
        kv_bytes_per_token=SMOL_KV_PER_TOKEN,
        max_model_len=264,
        max_num_seqs=32,
    )
    assert need.kv_cache == 389_283_840
    assert need.margin == 1_305_280_512
    assert need.total == 1_610_612_736 + 536_870_912 + 389_283_840 + 1_305_280_512 == 3_842_048_000
    # 3,842,048,000 B of a 23.5 GiB host = 0.1523: rounded UP to 0.16 (the worker may hold at least the need)
    total = int(23.5 * GIB)
    assert kv.cpu_memory_fraction(need, 16 * GIB, total, setting="--gpu-memory-utilization") == 0.16
    # 0.16 x 23.5 GiB = 3.76 GiB reserved: 3.7 GiB free is not enough, even though the need itself (3.58) is less
    with pytest.raises(
        ValueError,
        match=r"needs 3\.58 GiB .*KV cache 0\.36 for 32 sequences x 264 tokens.*3\.70 of "
        r"23\.50 GiB is free.*--gpu-memory-utilization",
    ):
        kv.cpu_memory_fraction(need, int(3.7 * GIB), total, setting="--gpu-memory-utilization")
    assert kv.cpu_memory_fraction(need, int(3.77 * GIB), total, setting="x") == 0.16


def test_cpu_memory_fraction_refusals():
    need = kv.cpu_engine_memory(base_bytes=0, weight_bytes=0, kv_bytes_per_token=1, max_model_len=1, max_num_seqs=1)
    with pytest.raises(ValueError, match="0 <= available <= total"):
        kv.cpu_memory_fraction(need, 25 * GIB, 24 * GIB, setting="x")
    with pytest.raises(ValueError, match="lengths >= 1"):
        kv.cpu_engine_memory(base_bytes=0, weight_bytes=0, kv_bytes_per_token=1, max_model_len=0, max_num_seqs=1)
    # more than the whole host
    big = kv.cpu_engine_memory(
        base_bytes=30 * GIB, weight_bytes=0, kv_bytes_per_token=1, max_model_len=1, max_num_seqs=1
    )
    with pytest.raises(ValueError, match="of host memory, but 24.00 of 24.00 GiB is free"):
        kv.cpu_memory_fraction(big, 24 * GIB, 24 * GIB, setting="x")


def test_parameter_count_from_safetensors_headers_and_from_the_config(tiny_ckpt, tiny_model):
    from transformers import AutoConfig, LlamaForCausalLM

    model, _ = tiny_model
    config = AutoConfig.from_pretrained(tiny_ckpt)
    assert kv.parameter_count(str(tiny_ckpt), config) == sum(p.numel() for p in model.parameters())
    # without weight files: the config's estimate, exact for a Llama (tied and untied head)
    for tied in (True, False):
        cfg = decoder_config(LlamaConfig, 100, 64, 3, 4, 2, 96, tie_word_embeddings=tied)
        expected = sum(p.numel() for p in LlamaForCausalLM(cfg).parameters())
        assert kv.parameter_count("no-such-dir", cfg) == expected


def test_cpu_engine_kwargs_never_split_a_prompt():
    assert kv.cpu_engine_kwargs(8192) == {
        "enforce_eager": True,
        "enable_chunked_prefill": False,
        "max_num_batched_tokens": 8192,
    }
    assert kv.cpu_engine_kwargs(512)["max_num_batched_tokens"] == 4096
    with pytest.raises(ValueError, match="max_model_len must be >= 1"):
        kv.cpu_engine_kwargs(0)


def test_build_vllm_kwargs_sizes_the_context_from_the_need_and_keeps_the_yarn_length():
    config = small_llama_config()
    plan = plan_context(config, max_tokens=60000, max_prompt_tokens=1000, rope_scaling="yarn", rope_factor=2.5)
    gpu = build_vllm_kwargs("m", plan)
    cpu = build_vllm_kwargs("m", plan, cpu=True, gpu_memory_utilization=0.2)
    assert "enable_chunked_prefill" not in gpu and "enforce_eager" not in gpu and "max_num_seqs" not in gpu
    assert gpu["gpu_memory_utilization"] == 0.9
    assert cpu == {
        **gpu,
        "gpu_memory_utilization": 0.2,
        "enforce_eager": True,
        "enable_chunked_prefill": False,
        "max_num_batched_tokens": 61000,
    }
    # the engine's context is the need (1000 + 60000), the model's (YaRN) context stays 32768 x 2.5
    assert cpu["max_model_len"] == 61000 and cpu["hf_overrides"]["max_position_embeddings"] == 81920
    plain = plan_context(config, max_tokens=32, max_prompt_tokens=200)
    assert build_vllm_kwargs("m", plain)["max_model_len"] == 232


def test_build_vllm_kwargs_sizes_cpu_memory_from_the_need(tiny_ckpt, tiny_model, monkeypatch):
    from transformers import AutoConfig

    model, _ = tiny_model
    config = AutoConfig.from_pretrained(tiny_ckpt)
    assert config.dtype is not None and str(config.dtype).endswith("float32")
    plan = plan_context(config, max_tokens=32, max_prompt_tokens=100)
    monkeypatch.setattr(kv, "host_memory", lambda: (16 * GIB, 32 * GIB))
    got = build_vllm_kwargs(str(tiny_ckpt), plan, cpu=True, dtype="float32", max_num_seqs=8)
    # by hand: float32 weights, KV cache 2 x layers x KV heads x head dim x 4 B per token, 132 tokens x 8 sequences
    heads = config.num_attention_heads
    per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * (config.hidden_size // heads) * 4
    weights = 4 * sum(p.numel() for p in model.parameters())
    kv_cache = per_token * 132 * 8
    need = 3 * GIB // 2 + weights + kv_cache + GIB + math.ceil((weights + kv_cache) / 4)
    assert got["max_model_len"] == 132 and got["max_num_seqs"] == 8
    assert got["gpu_memory_utilization"] == math.ceil(100 * need / (32 * GIB)) / 100
    # a busy host is refused before any engine starts, naming the override
    monkeypatch.setattr(kv, "host_memory", lambda: (GIB, 32 * GIB))
    with pytest.raises(ValueError, match="GiB is free: .*or set --gpu-memory-utilization"):
        build_vllm_kwargs(str(tiny_ckpt), plan, cpu=True, dtype="float32", max_num_seqs=8)


def test_build_vllm_kwargs_user_settings_win(tiny_ckpt, monkeypatch):
    from transformers import AutoConfig

    plan = plan_context(AutoConfig.from_pretrained(tiny_ckpt), max_tokens=32, max_prompt_tokens=100)
    monkeypatch.setattr(kv, "host_memory", lambda: (GIB // 100, 32 * GIB))  # the sizing would refuse
    got = build_vllm_kwargs(str(tiny_ckpt), plan, cpu=True, gpu_memory_utilization=0.12, max_model_len=4096)
    assert got["gpu_memory_utilization"] == 0.12 and got["max_model_len"] == 4096
    assert got["max_num_batched_tokens"] == 4096


def test_select_backend_auto_uses_vllm_cpu_without_a_gpu(monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        backends.importlib.util, "find_spec", lambda name, *a: object() if name == "vllm" else real_find_spec(name, *a)
    )
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    monkeypatch.setattr(kv, "vllm_distribution", lambda: "vllm-cpu")
    assert select_backend("auto") == "vllm"
    monkeypatch.setattr(kv, "vllm_distribution", lambda: "vllm")  # the CUDA build without a GPU
    assert select_backend("auto") == "hf"
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    assert select_backend("auto") == "vllm"


@pytest.mark.parametrize(
    "installed,expected",
    [((), None), (("vllm",), "vllm"), (("vllm-cpu",), "vllm-cpu"), (("vllm", "vllm-cpu"), "vllm-cpu")],
)
def test_vllm_distribution_reads_package_metadata(monkeypatch, installed, expected):
    import importlib.metadata

    def version(name):
        if name not in installed:
            raise importlib.metadata.PackageNotFoundError(name)
        return "0.32.0"

    monkeypatch.setattr(kv.importlib.metadata, "version", version)
    assert kv.vllm_distribution() == expected


def _rl_args(**over):
    from types import SimpleNamespace

    fields = {
        "use_vllm": True,
        "vllm_mode": "colocate",
        "max_completion_length": 12,
        "per_device_train_batch_size": 8,
        "vllm_tensor_parallel_size": 1,
        "steps_per_generation": 2,
        "bf16": False,
        "fp16": False,
    }
    return SimpleNamespace(**{**fields, **over})


def test_rollout_engine_sized_from_the_data(tiny_ckpt, tiny_model, monkeypatch):
    from transformers import AutoConfig

    model, _ = tiny_model
    config = AutoConfig.from_pretrained(tiny_ckpt)
    monkeypatch.setattr(kv, "host_memory", lambda: (16 * GIB, 32 * GIB))
    monkeypatch.setattr(kv, "process_memory", lambda: 2 * GIB)
    got = kv.rollout_engine_settings(
        _rl_args(), {}, model_path=str(tiny_ckpt), config=config, longest_prompt=40, on_cpu=True
    )
    # by hand: 40 + 12 tokens; TRL decodes 8 x 1 x 2 = 16 sequences at once; the engine runs in this process
    # (2 GiB resident) next to the float32 training model
    heads = config.num_attention_heads
    per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * (config.hidden_size // heads) * 4
    weights = 4 * sum(p.numel() for p in model.parameters())
    kv_cache = per_token * 52 * 16
    need = 3 * GIB // 2 + 2 * GIB + weights + weights + kv_cache + GIB + math.ceil((weights + kv_cache) / 4)
    assert got == {
        "vllm_max_model_length": 52,
        "vllm_gpu_memory_utilization": math.ceil(100 * need / (32 * GIB)) / 100,
    }
    # on a GPU only the context is sized (vllm_gpu_memory_utilization is a share of GPU memory there)
    assert kv.rollout_engine_settings(
        _rl_args(), {}, model_path=str(tiny_ckpt), config=config, longest_prompt=40, on_cpu=False
    ) == {"vllm_max_model_length": 52}
    # not colocated: TRL's server owns its engine
    assert (
        kv.rollout_engine_settings(
            _rl_args(vllm_mode="server"), {}, model_path=str(tiny_ckpt), config=config, longest_prompt=40, on_cpu=True
        )
        == {}
    )
    # a need beyond the model's context, and a host without the memory: one line each
    limit = config.max_position_embeddings
    with pytest.raises(
        ValueError,
        match=rf"longest prompt \({limit} tokens\) plus trainer.max_completion_length 12 = "
        rf"{limit + 12} tokens exceeds the model's context of {limit} tokens",
    ):
        kv.rollout_engine_settings(
            _rl_args(), {}, model_path=str(tiny_ckpt), config=config, longest_prompt=limit, on_cpu=True
        )
    monkeypatch.setattr(kv, "host_memory", lambda: (GIB, 32 * GIB))
    with pytest.raises(ValueError, match="GiB is free: .*or set trainer.vllm_gpu_memory_utilization"):
        kv.rollout_engine_settings(
            _rl_args(), {}, model_path=str(tiny_ckpt), config=config, longest_prompt=40, on_cpu=True
        )


def test_rollout_engine_settings_of_the_recipe_win(tiny_ckpt, monkeypatch):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(tiny_ckpt)
    monkeypatch.setattr(kv, "host_memory", lambda: (GIB // 100, 32 * GIB))  # the sizing would refuse
    user = {"vllm_max_model_length": 256, "vllm_gpu_memory_utilization": 0.15}
    got = kv.rollout_engine_settings(
        _rl_args(), user, model_path=str(tiny_ckpt), config=config, longest_prompt=40, on_cpu=True
    )
    assert got == {"vllm_max_model_length": 256}  # the recipe's memory fraction is left as it is
    with pytest.raises(ValueError, match=r"trainer.vllm_max_model_length 50 is less than .* = 52 tokens"):
        kv.rollout_engine_settings(
            _rl_args(),
            {"vllm_max_model_length": 50},
            model_path=str(tiny_ckpt),
            config=config,
            longest_prompt=40,
            on_cpu=False,
        )


def test_rollout_engine_holds_the_heldout_evaluation_it_runs(tiny_ckpt):
    """eval.backend vllm: the engine's context holds the longest held-out prompt + eval.max_new_tokens too."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(tiny_ckpt)
    kw = dict(model_path=str(tiny_ckpt), config=config, longest_prompt=40, on_cpu=False)
    assert kv.rollout_engine_settings(_rl_args(), {}, eval_need=(60, 30), **kw) == {"vllm_max_model_length": 90}
    assert kv.rollout_engine_settings(_rl_args(), {}, eval_need=(10, 5), **kw) == {"vllm_max_model_length": 52}
    with pytest.raises(
        ValueError,
        match=r"^trainer.vllm_max_model_length 64 is less than the longest held-out prompt \(60 tokens\) plus "
        r"eval.max_new_tokens 30 = 90 tokens: raise it or leave it unset$",
    ):
        kv.rollout_engine_settings(_rl_args(), {"vllm_max_model_length": 64}, eval_need=(60, 30), **kw)


def test_klear_eval_passes_the_engine_settings_of_the_user(tmp_path, embedded_path, monkeypatch):
    """`klear eval --backend vllm`: --max-model-len and --gpu-memory-utilization reach the engine as given;
    unset, the engine sizes them itself; it decodes at most the run's samples at once."""
    import json

    from klear.cli import main

    class Built(Exception):
        pass

    seen = []

    def engine(model_path, plan, **kwargs):
        seen.append((plan, kwargs))
        raise Built("engine built")

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        backends.importlib.util, "find_spec", lambda name, *a: object() if name == "vllm" else real_find_spec(name, *a)
    )
    monkeypatch.setattr(backends, "VLLMBackend", engine)
    bench = tmp_path / "b.jsonl"
    bench.write_text(
        "".join(json.dumps({"id": f"q{i}", "question": f"{i} + 1?", "answer": str(i + 1)}) + "\n" for i in range(3))
    )
    base = ["eval", "--model", "embedded", "--benchmark", str(bench), "--n", "2", "--max-tokens", "16"]
    base += ["--backend", "vllm", "--dtype", "float32", "--output", str(tmp_path / "out")]
    for extra, want_len, want_memory in (
        ([], None, None),
        (["--max-model-len", "4096", "--gpu-memory-utilization", "0.2"], 4096, 0.2),
    ):
        with pytest.raises(Built, match="engine built"):
            main([*base, *extra])
        plan, kwargs = seen.pop()
        assert (kwargs["max_model_len"], kwargs["gpu_memory_utilization"]) == (want_len, want_memory)
        assert kwargs["max_num_seqs"] == 6  # 3 problems x 2 samples
        assert plan["needed_len"] < 200 and plan["engine_max_len"] == 8192


def test_colocated_engine_needs_the_training_model_free_too():
    """vLLM checks its reservation after the training model is loaded, and counts that model in it (its process)."""
    need = kv.cpu_engine_memory(base_bytes=GIB, weight_bytes=GIB, kv_bytes_per_token=0, max_model_len=1, max_num_seqs=1)
    # need = 1 + 1 + 0 + (1 + 0.25) = 3.25 GiB: 0.33 of 10 GiB, i.e. 3.3 GiB; with 2 GiB of training model first: 5.3
    assert need.total == 13 * GIB // 4
    assert kv.cpu_memory_fraction(need, int(5.31 * GIB), 10 * GIB, setting="x", loaded_first_bytes=2 * GIB) == 0.33
    with pytest.raises(
        ValueError, match=r"needs 3\.25 GiB .*, plus 2\.00 GiB the training model takes first, .*5\.29 "
    ):
        kv.cpu_memory_fraction(need, int(5.29 * GIB), 10 * GIB, setting="x", loaded_first_bytes=2 * GIB)
    assert kv.cpu_memory_fraction(need, int(3.31 * GIB), 10 * GIB, setting="x") == 0.33  # a fresh worker process


def test_colocated_engine_never_splits_a_prompt_on_cpu(monkeypatch):
    """TRL builds its colocated engine with chunked prefill and 4096 batched tokens; on CPU a split prompt crashes
    seeded requests (the sampled held-out evaluation's), so klear turns chunked prefill off there."""
    import trl.generation.vllm_generation as trl_vllm

    built = []
    monkeypatch.setattr(trl_vllm, "LLM", lambda **kw: built.append(kw), raising=False)
    monkeypatch.setattr(kv, "engine_on_cpu", lambda: True)
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    with kv.colocated_engine("float32"):
        for length in (300, 5000):
            trl_vllm.LLM(model="m", max_model_len=length, max_num_batched_tokens=4096, seed=0)
    assert built == [
        {"model": "m", "max_model_len": n, "seed": 0, "dtype": "float32", **kv.cpu_engine_kwargs(n)}
        for n in (300, 5000)
    ]
    assert built[1]["max_num_batched_tokens"] == 5000 and built[0]["enable_chunked_prefill"] is False
