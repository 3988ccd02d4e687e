"""benchmarks/decode_bound.py times "the step's matrix products": its weight lists must be exactly the decoder's
linear layers and the head (the bound it prints is only as good as that), its fused lists the same products."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture(scope="module")
def db():
    sys.path.insert(0, str(BENCH))  # the script imports its siblings _machine and rollout, as when run from benchmarks/
    environ = dict(os.environ)  # the script sets klear's OpenMP wait policy on import: not for the other tests
    try:
        spec = importlib.util.spec_from_file_location("decode_bound", BENCH / "decode_bound.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        yield module
    finally:
        os.environ.clear()
        os.environ.update(environ)
        sys.path.remove(str(BENCH))
        for name in ("_machine", "rollout"):
            sys.modules.pop(name, None)


@pytest.fixture(scope="module")
def model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=101,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    return LlamaForCausalLM(config).eval()


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
