"""benchmarks/roofline.py's analytic FLOP count against torch's FlopCounterMode, phase by phase, on a tiny Llama
run through the script's own phase functions (GQA and a head_dim that is not hidden / heads, left padding)."""

from __future__ import annotations

import math

import pytest
import torch

from conftest import benchmark_module


@pytest.fixture(scope="module")
def rf():
    with benchmark_module("roofline") as module:
        yield module


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=101,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=24,
        tie_word_embeddings=True,
        attn_implementation="eager",  # matmuls FlopCounterMode sees (CPU SDPA's fused kernel is not in its registry)
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


def counted(fn) -> int:
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as mode:
        fn()
    return mode.get_total_flops()


def test_layer_matmul_params_are_the_projection_weights_of_a_layer(rf):
    model = tiny_llama()
    layer = model.model.layers[0]
    weights = [m.weight.numel() for m in layer.modules() if isinstance(m, torch.nn.Linear)]
    assert len(weights) == 7
    assert rf.layer_matmul_params(model.config) == sum(weights)


def test_backward_is_twice_the_forward(rf):
    model = tiny_llama().train()
    ids = torch.randint(3, 101, (2, 9))
    total = counted(lambda: model(input_ids=ids).logits.sum().backward())
    assert total == 3 * rf.forward_flops(model.config, rows=2, new=9, head_positions=9)


def test_every_phase_counts_what_flop_counter_mode_sees(rf):
    from trl.trainer.utils import add_fused_lm_head

    from klear.rl.losses import LossSettings

    model = tiny_llama()
    rows, prompt, steps, micro_batch = 3, 6, 4, 2
    ids = torch.randint(3, 101, (rows, prompt))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0  # a left-padded row: the dense kernels compute its pads too
    expected = rf.step_flops(
        model.config, rows=rows, prompt=prompt, completion=steps, decode_steps=steps, micro_batch=micro_batch
    )

    with torch.no_grad():
        out: dict = {}
        assert counted(lambda: out.update(prefill=rf.prefill(model, ids, mask))) == expected["prefill"]
        logits, cache = out["prefill"]
        assert counted(lambda: out.update(tokens=rf.decode(model, logits, cache, mask, steps))) == expected["decode"]

    full = torch.cat([ids, out["tokens"]], dim=1)
    full_mask = torch.cat([mask, torch.ones_like(out["tokens"])], dim=1)
    add_fused_lm_head(model, temperature=0.7, outputs=("log_probs", "entropy"))
    assert (
        counted(lambda: out.update(old=rf.old_log_prob(model, full, full_mask, steps, micro_batch)))
        == expected["old_log_prob"]
    )

    model.train()
    settings = LossSettings(loss_mode="gppo", clip_ratio_c=10.0, alpha=0.1)
    train = counted(
        lambda: rf.train_step(
            model, full[:micro_batch], full_mask[:micro_batch], steps, out["old"][:micro_batch], settings
        )
    )
    # One pass of the fused LM head over the micro-batch. Its backward recomputes the logits (one pass more than
    # backward = 2 x forward: not in the analytic count) and runs its two gradient GEMMs as in-place addmm_, which
    # FlopCounterMode does not see (two passes fewer).
    head = 2 * model.config.hidden_size * model.config.vocab_size * micro_batch * (prompt + steps - 1)
    assert train == expected["train fwd+bwd"] + head - 2 * head
    assert all(p.grad is not None for p in model.parameters())


def test_the_shared_prompt_training_pass_counts_what_flop_counter_mode_sees(rf):
    from trl.trainer.utils import add_fused_lm_head

    from klear.rl.losses import LossSettings

    model = tiny_llama().train()
    prompt, steps = 6, 4
    prompts = torch.randint(3, 101, (2, prompt))
    ids = torch.cat([prompts[[0, 0, 1, 0, 1]], torch.randint(3, 101, (5, steps))], dim=1)  # 2 distinct prompts
    mask = torch.ones_like(ids)
    mask[[2, 4], :2] = 0  # the second prompt left-padded
    add_fused_lm_head(model, temperature=0.7, outputs=("log_probs", "entropy"))
    settings = LossSettings(loss_mode="gppo", clip_ratio_c=10.0, alpha=0.1)
    old = torch.zeros(5, steps)
    train = counted(lambda: rf.train_step(model, ids, mask, steps, old, settings, shared_prompt=True))
    expected = rf.shared_train_flops(model.config, distinct=2, micro_batch=5, prompt=prompt, completion=steps)
    # the fused head as in the whole-row test: recomputed in backward (+1 pass), gradient GEMMs unseen (-2)
    head = 2 * model.config.hidden_size * model.config.vocab_size * 5 * (steps + 1)
    assert train == expected + head - 2 * head
    assert expected < 3 * rf.forward_flops(model.config, rows=5, new=prompt + steps, head_positions=prompt + steps - 1)


def test_ratio_spread_by_hand(rf):
    old = torch.tensor([[-1.0, -2.0], [-0.5, -3.0]], dtype=torch.float64)
    new = old + torch.tensor([[0.1, -0.2], [0.0, 0.3]], dtype=torch.float64)
    got = rf.ratio_spread(new, old)
    assert got["ratio_max"] == pytest.approx(math.exp(0.3), rel=1e-12)
    assert got["ratio_min"] == pytest.approx(math.exp(-0.2), rel=1e-12)
    assert got["ppo_kl"] == pytest.approx(-(0.1 - 0.2 + 0.0 + 0.3) / 4, rel=1e-12)
