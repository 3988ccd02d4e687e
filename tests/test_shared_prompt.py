"""The shared-prompt log-prob pass (klear.rl.shared_prompt) against TRL's unshared one: same log-probs, entropies
and gradients to float32 rounding."""

from __future__ import annotations

import copy

import pytest
import torch
from trl.trainer.utils import add_fused_lm_head

from klear.rl.shared_prompt import distinct_prompts, shared_prompt_log_probs

TEMPERATURE = 0.7


def _micro_batch(tok, order):
    """Rows of three left-padded prompts of different lengths, in ``order`` (prompt index per row), with random
    completions right-padded to different lengths."""
    prompts = [[{"role": "user", "content": "word " * k + f"number {k}"}] for k in (1, 6, 3)]
    texts = [tok.apply_chat_template(p, tokenize=False, add_generation_prompt=True) for p in prompts]
    tok.padding_side = "left"
    enc = tok([texts[i] for i in order], return_tensors="pt", padding=True, add_special_tokens=False)
    g = torch.Generator().manual_seed(0)
    b, c = len(order), 7
    completion_ids = torch.randint(5, 1000, (b, c), generator=g)
    lengths = torch.randint(1, c + 1, (b,), generator=g)
    completion_mask = (torch.arange(c)[None, :] < lengths[:, None]).long()
    completion_ids = completion_ids.masked_fill(completion_mask == 0, tok.pad_token_id)
    return enc["input_ids"], enc["attention_mask"], completion_ids, completion_mask


def _unshared(model, prompt_ids, prompt_mask, completion_ids, completion_mask):
    """TRL's pass (``GRPOTrainer._get_per_token_logps_and_entropies``, one chunk): the whole rows, fused head."""
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
    mask = torch.cat([prompt_mask, completion_mask], dim=1)
    labels = input_ids.masked_fill(mask == 0, -100)
    c = completion_ids.size(1)
    labels[:, :-c] = -100
    out = model(input_ids=input_ids, attention_mask=mask, labels=labels, fused_lm_head=True)
    return out.log_probs[:, -c:], out.entropy[:, -c:]


@pytest.fixture(params=[torch.float64, torch.float32], ids=["float64", "float32"])
def fused(tiny_model, request):
    model, tok = tiny_model
    model = copy.deepcopy(model).to(request.param).train()
    with torch.no_grad():  # larger weights: log-probs far from uniform
        for p in model.parameters():
            p.mul_(4.0)
    add_fused_lm_head(model, temperature=TEMPERATURE, outputs=("log_probs", "entropy"))
    return model, tok


def test_distinct_prompts_in_order_of_first_appearance():
    ids = torch.tensor([[0, 5, 6], [1, 2, 3], [0, 5, 6], [0, 5, 6], [1, 2, 3], [9, 9, 9]])
    mask = torch.tensor([[0, 1, 1], [1, 1, 1], [0, 1, 1], [1, 1, 1], [1, 1, 1], [1, 1, 1]])
    first, inverse = distinct_prompts(ids, mask)
    # row 3 has row 0's ids but another mask: a prompt of its own
    assert first.tolist() == [0, 1, 3, 5]
    assert inverse.tolist() == [0, 1, 0, 2, 1, 3]


@pytest.mark.parametrize("order", [[0, 0, 0, 1, 1, 2, 2, 2], [2, 0, 1, 0, 2, 1, 0, 2], [1, 2, 0]])
def test_log_probs_entropies_and_gradients_match_the_unshared_pass(fused, order):
    """Grouped, shuffled and all-distinct rows: every completion position's log-prob and entropy, and the gradient of
    a weighted sum of them (it reaches the prompt's computation only through the shared keys and values), agree with
    the whole-row pass to float32 rounding."""
    model, tok = fused
    batch = _micro_batch(tok, order)
    weights = torch.randn(batch[2].shape, generator=torch.Generator().manual_seed(1)) * batch[3]

    def grads(fn):
        model.zero_grad()
        log_prob, entropies = fn(model, *batch)
        ((log_prob * weights).sum() + (entropies * weights).sum()).backward()
        return log_prob.detach(), entropies.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    ref_lp, ref_ent, ref_grad = grads(_unshared)
    lp, ent, grad = grads(lambda m, *b: shared_prompt_log_probs(m, *b, compute_entropy=True))
    mask = batch[3].bool()
    exact = lp.dtype == torch.float64  # float64: the same numbers to 1e-10; float32: to its rounding
    tol = 1e-10 if exact else 2e-5
    assert lp.shape == ref_lp.shape == batch[2].shape
    torch.testing.assert_close(lp[mask], ref_lp[mask], rtol=tol, atol=tol)
    torch.testing.assert_close(ent[mask], ref_ent[mask], rtol=tol, atol=tol)
    assert ref_lp[mask].abs().mean() > 1.0  # not a degenerate, near-uniform model
    for name, g in ref_grad.items():
        # relative to the tensor's norm: float32 sums of many terms round differently in the two passes
        error = (grad[name] - g).norm() / g.norm()
        assert error < (1e-10 if exact else 1e-5), f"{name}: relative error {error:.2e}"
    # the prompt's own computation is in the gradient: the first layer's key projection receives some
    assert ref_grad["model.layers.0.self_attn.k_proj.weight"].abs().sum() > 0


def test_fewer_positions_computed_than_the_unshared_pass(fused):
    """8 rows of 3 prompts: the backbone sees 3 prompt rows of P - 1 tokens and 8 rows of C + 1, not 8 of P + C."""
    model, tok = fused
    prompt_ids, prompt_mask, completion_ids, completion_mask = _micro_batch(tok, [0, 0, 0, 1, 1, 2, 2, 2])
    seen = []
    hook = model.model.embed_tokens.register_forward_hook(lambda m, i, o: seen.append(tuple(i[0].shape)))
    try:
        shared_prompt_log_probs(model, prompt_ids, prompt_mask, completion_ids, completion_mask)
    finally:
        hook.remove()
    p, c = prompt_ids.size(1), completion_ids.size(1)
    assert seen == [(3, p - 1), (8, c + 1)]


def test_too_short_prompts_are_refused(fused):
    model, _ = fused
    with pytest.raises(ValueError, match="P >= 2"):
        shared_prompt_log_probs(
            model,
            torch.ones(2, 1, dtype=torch.long),
            torch.ones(2, 1),
            torch.ones(2, 3, dtype=torch.long),
            torch.ones(2, 3),
        )


@pytest.mark.parametrize(
    "setting, device, processes, checkpointing, extras, wrapped, expected",
    [
        (None, "cpu", 1, False, False, False, True),  # auto: a CPU with one process
        (None, "cuda", 1, False, False, False, False),  # auto keeps the GPU path as TRL has it
        (None, "cpu", 2, False, False, False, False),
        (True, "cuda", 1, False, False, False, True),  # asked for explicitly
        (False, "cpu", 1, False, False, False, False),
        (True, "cpu", 1, True, False, False, False),  # gradient checkpointing recomputes without a cache
        (True, "cpu", 1, False, True, False, False),  # per-token model extras (images, token types)
        (None, "cpu", 1, False, False, True, False),  # DDP with one process (a colocated vLLM's process group)
    ],
)
def test_when_the_trainer_shares_the_prompt_forward(
    setting, device, processes, checkpointing, extras, wrapped, expected
):
    from types import SimpleNamespace

    from klear.rl.trainer import GPPOTrainer
    from klear.rl.trl_surface import TRL_FORWARD_KEYS

    inner = SimpleNamespace(is_gradient_checkpointing=checkpointing)
    model = SimpleNamespace(module=inner, is_gradient_checkpointing=checkpointing) if wrapped else inner
    fake = SimpleNamespace(
        args=SimpleNamespace(share_prompt_forward=setting),
        accelerator=SimpleNamespace(
            device=torch.device(device), num_processes=processes, unwrap_model=lambda m: getattr(m, "module", m)
        ),
    )
    inputs = {"prompt_ids": torch.ones(4, 5, dtype=torch.long)}
    if extras:
        inputs[TRL_FORWARD_KEYS[0]] = torch.ones(4, 5)
    assert GPPOTrainer._shares_prompt_forward(fake, model, inputs) is expected
