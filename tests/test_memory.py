"""klear.memory: parameter counts, KV cache, the eval batch cap and the per-GPU plan, on sizes computed by hand."""

from __future__ import annotations

import pytest
from transformers import LlamaConfig, Qwen2Config, Qwen3Config

from conftest import decoder_config
from klear import memory

GIB = 2**30


def qwen3_8b_config(max_position_embeddings: int = 32768) -> Qwen3Config:
    """Qwen3-8B(-Base)'s shapes (config.json on the hub), no weights."""
    context = dict(max_position_embeddings=max_position_embeddings)
    return decoder_config(
        Qwen3Config, 151936, 4096, 36, 32, 8, 12288, head_dim=128, tie_word_embeddings=False, **context
    )


def test_qwen3_8b_parameter_count_by_hand():
    # embedding and lm_head: 151936 x 4096 = 622,329,856 each
    # per layer: q 4096x4096 + k, v 2 x 4096x1024 + o 4096x4096 = 41,943,040; MLP 3 x 4096 x 12288 = 150,994,944;
    # norms 2 x 4096 + q/k norms 2 x 128 = 8,448 -> 192,946,432; x 36 = 6,946,071,552; final norm 4096
    expected = 2 * 622_329_856 + 36 * 192_946_432 + 4096
    assert expected == 8_190_735_360
    assert memory.parameter_count(qwen3_8b_config()) == expected


def test_small_config_by_hand_and_against_transformers_on_meta():
    import torch
    from transformers import AutoModelForCausalLM

    small = decoder_config(Qwen3Config, 100, 16, 2, 4, 2, 24, head_dim=8, tie_word_embeddings=False)
    # q 16x32 + k,v 2 x 16x16 + o 32x16 = 1536; MLP 3 x 16 x 24 = 1152; norms 32 + 16 = 48 -> 2736 per layer
    assert memory.parameter_count(small) == 2 * 100 * 16 + 2 * 2736 + 16
    for config in (
        small,
        decoder_config(Qwen2Config, 90, 32, 2, 4, 2, 40, tie_word_embeddings=True),
        decoder_config(LlamaConfig, 70, 24, 3, 6, 3, 30, tie_word_embeddings=False),
    ):
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        assert memory.parameter_count(config) == sum(p.numel() for p in model.parameters()), type(config).__name__


def test_kv_cache_and_eval_batch_size_by_hand():
    config = qwen3_8b_config()
    # 2 (k, v) x 36 layers x 8 heads x 128 x 2 bytes = 147,456 bytes per token
    assert memory.kv_cache_bytes(config, 1, 2) == 147_456
    assert memory.kv_cache_bytes(config, 32768, 4) == 2 * 147_456 * 32768
    per_sequence = memory.kv_cache_bytes(config, 32768, 4) + 151936 * 4  # + one position's fp32 logits
    free = 80 * 10**9
    expected = int(memory.EVAL_MEMORY_SHARE * free) // per_sequence
    assert 1 <= expected < 16
    assert memory.eval_batch_size(config, tokens=32768, batch_size=16, free_bytes=free, dtype_bytes=4) == expected
    assert memory.eval_batch_size(config, tokens=128, batch_size=16, free_bytes=free, dtype_bytes=4) == 16
    assert memory.eval_batch_size(config, tokens=32768, batch_size=16, free_bytes=0, dtype_bytes=4) == 1


def test_plan_components_by_hand():
    config = qwen3_8b_config()
    n = 8_190_735_360
    kw = dict(
        processes=8, device_bytes=80 * 10**9, micro_batch=1, seq_tokens=36864, logit_tokens=32768, checkpointing=True
    )
    ddp = memory.plan_memory(config, strategy="ddp", **kw)
    assert (
        ddp.components["parameters"] + ddp.components["gradients"] + ddp.components["optimizer state (AdamW)"] == 16 * n
    )
    assert not ddp.fits
    zero3 = memory.plan_memory(config, strategy="zero3", **kw)
    assert zero3.components["parameters"] == 2 * n // 8
    assert zero3.components["optimizer state (AdamW)"] == 12 * n // 8
    # checkpointed: 36 layer inputs x 4096 + one layer (4h + 2q + 2kv + 4I = 81,920) + 2h, bf16, per token
    per_token = 36 * 4096 + (4 * 4096 + 2 * 4096 + 2 * 1024 + 4 * 12288) + 2 * 4096
    assert zero3.components["activations (36864 tokens, with ckpt)"] == per_token * 36864 * 2
    assert zero3.fits
    full = memory.logits_bytes(memory.model_shape(config), tokens=32768, dtype_bytes=2, fused=False)
    assert full == 32768 * 151936 * 8 and full > 37 * GIB  # what TRL's fused LM head avoids
    sleepy = memory.plan_memory(config, strategy="zero3", vllm_share=0.55, vllm_sleep=True, **kw)
    awake = memory.plan_memory(config, strategy="zero3", vllm_share=0.55, vllm_sleep=False, **kw)
    assert sleepy.generation == 16 * n // 8 + memory.RUNTIME_BYTES + int(0.55 * 80 * 10**9)
    assert sleepy.fits and not awake.fits
    with pytest.raises(ValueError, match="strategy 'tp'"):
        memory.plan_memory(config, strategy="tp", **kw)


def test_hf_eval_backend_caps_its_batch_on_cuda(tiny_model, monkeypatch, capsys):
    """klear eval --backend hf at batch 16 x 32K on 80 GB (issue 22, low): the batch is lowered to what fits."""
    import torch

    from klear.eval.backends import HFBackend, plan_context

    model, tok = tiny_model
    backend = HFBackend(
        "tiny",
        plan_context(model.config, max_tokens=8, max_prompt_tokens=50),
        tokenizer=tok,
        model=model,
        batch_size=16,
    )
    assert backend.fitting_batch_size(32768) == 16  # CPU: as asked
    per_sequence = memory.kv_cache_bytes(model.config, 32768, 4) + model.config.vocab_size * 4
    free = int(3.5 * per_sequence / memory.EVAL_MEMORY_SHARE)  # room for 3 sequences
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, 2 * free))
    backend.device = torch.device("cuda")
    assert backend.fitting_batch_size(32768) == 3
    assert "batch size 16 -> 3" in capsys.readouterr().out
    assert backend.fitting_batch_size(64) == 16
