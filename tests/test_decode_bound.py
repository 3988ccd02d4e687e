"""benchmarks/decode_bound.py times "the step's matrix products": its weight lists must be exactly the decoder's
linear layers and the head (the bound it prints is only as good as that), its fused lists the same products."""

from __future__ import annotations

import pytest
import torch

from conftest import benchmark_module, decoder_config


@pytest.fixture(scope="module")
def db():
    with benchmark_module("decode_bound", siblings=("_machine", "rollout")) as module:
        yield module


@pytest.fixture(scope="module")
def model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(decoder_config(LlamaConfig, 101, 64, 3, 4, 2, 96, tie_word_embeddings=True)).eval()


def test_streamed_products_are_every_linear_weight_once(db, model):
    weights = db._weights(model, fused=False, same_layer=False)
    linears = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert len(weights) == len(linears) == 7 * 3 + 1
    # the same matrices (by value; the head is tied to the embedding), and so the same FLOPs as the model's products
    assert sorted(w.sum().item() for w in weights) == sorted(w.sum().item() for w in linears)
    assert sum(w.numel() for w in weights) == sum(w.numel() for w in linears)


def test_fused_products_equal_the_separate_ones(db, model):
    x = {64: torch.randn(5, 64, dtype=torch.float64), 96: torch.randn(5, 96, dtype=torch.float64)}
    separate = [x[w.shape[1]] @ w.double().t() for w in db._weights(model, fused=False, same_layer=False)]
    fused = [x[w.shape[1]] @ w.double().t() for w in db._weights(model, fused=True, same_layer=False)]
    assert len(fused) == 4 * 3 + 1
    regrouped = []
    for layer in range(3):
        q, k, v, o, g, u, d = separate[7 * layer : 7 * layer + 7]
        regrouped += [torch.cat([q, k, v], 1), o, torch.cat([g, u], 1), d]
    regrouped.append(separate[-1])
    for a, b in zip(fused, regrouped, strict=True):
        torch.testing.assert_close(a, b)


def test_in_cache_products_reuse_layer_zero(db, model):
    weights = db._weights(model, fused=False, same_layer=True)
    first = weights[:7]
    for layer in range(1, 3):
        for a, b in zip(weights[7 * layer : 7 * layer + 7], first, strict=True):
            assert torch.equal(a, b)
    assert not torch.equal(first[0], model.model.layers[1].self_attn.q_proj.weight)
