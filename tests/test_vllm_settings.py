"""vLLM engine settings that need no vLLM: the CPU memory fraction, the CPU engine arguments, backend choice."""

from __future__ import annotations

import importlib.util

import pytest
from transformers import LlamaConfig

from klear.eval import backends
from klear.eval.backends import build_vllm_kwargs, plan_context, select_backend
from klear.integrations import vllm as kv

GIB = 2**30


def test_cpu_memory_fraction_is_half_the_free_memory_rounded_down():
    assert kv.cpu_memory_fraction(12 * GIB, 24 * GIB) == 0.25
    # 0.5 * 11.9 / 23.5 = 0.2531...: rounded DOWN, so vLLM's check (fraction * total <= free) still passes
    frac = kv.cpu_memory_fraction(int(11.9 * GIB), int(23.5 * GIB))
    assert frac == 0.25 and frac * 23.5 <= 11.9
    assert kv.cpu_memory_fraction(24 * GIB, 24 * GIB, share=1.0) == 0.99
    assert kv.cpu_memory_fraction(3 * GIB, 24 * GIB, share=0.9) == 0.11


@pytest.mark.parametrize(
    "available,total,share,match",
    [
        (0, 24 * GIB, 0.5, "0 < available <= total"),
        (25 * GIB, 24 * GIB, 0.5, "0 < available <= total"),
        (GIB, 24 * GIB, 0.0, r"share must be in \(0, 1\]"),
        (GIB // 10, 24 * GIB, 0.5, "not enough for a vLLM CPU engine"),
    ],
)
def test_cpu_memory_fraction_refusals(available, total, share, match):
    with pytest.raises(ValueError, match=match):
        kv.cpu_memory_fraction(available, total, share=share)


def test_cpu_engine_kwargs_never_split_a_prompt():
    assert kv.cpu_engine_kwargs(8192) == {
        "enforce_eager": True,
        "enable_chunked_prefill": False,
        "max_num_batched_tokens": 8192,
    }
    assert kv.cpu_engine_kwargs(512)["max_num_batched_tokens"] == 4096
    with pytest.raises(ValueError, match="max_model_len must be >= 1"):
        kv.cpu_engine_kwargs(0)


def test_build_vllm_kwargs_on_cpu_keeps_the_yarn_length():
    config = LlamaConfig(
        vocab_size=32,
        hidden_size=32,
        num_attention_heads=2,
        num_hidden_layers=1,
        max_position_embeddings=32768,
        rope_theta=1e6,
    )
    plan = plan_context(config, max_tokens=60000, max_prompt_tokens=1000, rope_scaling="yarn", rope_factor=2.5)
    gpu = build_vllm_kwargs("m", plan)
    cpu = build_vllm_kwargs("m", plan, cpu=True, gpu_memory_utilization=0.2)
    assert "enable_chunked_prefill" not in gpu and "enforce_eager" not in gpu
    assert cpu == {
        **gpu,
        "gpu_memory_utilization": 0.2,
        "enforce_eager": True,
        "enable_chunked_prefill": False,
        "max_num_batched_tokens": 81920,
    }
    assert cpu["max_model_len"] == 81920 and cpu["hf_overrides"]["max_position_embeddings"] == 81920


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
