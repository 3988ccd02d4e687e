"""Per-token log-probs of a micro-batch with each distinct prompt's forward computed once and shared by its rows.

GRPO trains on ``num_generations`` completions per prompt, and TRL's log-prob pass
(``GRPOTrainer._get_per_token_logps_and_entropies``) runs the whole ``prompt + completion`` row through the
model for every completion: a prompt of ``P`` tokens is recomputed once per row. Here the rows of a micro-batch
with the same (left-padded) prompt share one forward of that prompt's first ``P - 1`` tokens: its keys and values
(a transformers ``DynamicCache``) are indexed out to the rows, and each row's forward runs over its last prompt
token and its completion on top of them. Gradients flow back through the shared keys and values into the prompt's
computation (indexing a tensor sums the gradients of its copies), so the log-probs and every gradient are those of
the unshared pass up to float32 rounding (same positions: the cache continues the row's ``0 .. P + C - 1``; same
attention mask; same fused LM head and temperature, TRL's ``fused_lm_head=True``, through ``shift_labels``).

The saving is the prompt's share of the tokens times the share of repeated rows: a micro-batch of ``B`` rows with
``U`` distinct prompts computes ``U * (P - 1) + B * (C + 1)`` token positions instead of ``B * (P + C)``.
"""

from __future__ import annotations

from typing import Any

import torch

from klear.models.cache import cache_kwarg

__all__ = ["distinct_prompts", "shared_prompt_log_probs"]


def distinct_prompts(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The distinct rows of a left-padded prompt batch and, for each row, the index of its distinct prompt.

    Args:
        prompt_ids: ``(B, P)`` int token ids. prompt_mask: ``(B, P)`` 0/1 (two rows are the same prompt when both
            their ids and their masks are equal).

    Returns:
        ``(first, inverse)``: ``first`` ``(U,)`` int64, the first row of each distinct prompt in order of first
        appearance; ``inverse`` ``(B,)`` int64 with ``prompt_ids[first[inverse]] == prompt_ids``.
    """
    key = torch.cat([prompt_ids.long(), prompt_mask.long()], dim=1)
    _, inverse = torch.unique(key, dim=0, return_inverse=True)
    # torch.unique sorts; renumber by first appearance so the distinct prompts keep the batch's order
    b = key.size(0)
    first_of = torch.full((int(inverse.max()) + 1,), b, dtype=torch.long, device=key.device)
    first_of.scatter_reduce_(0, inverse, torch.arange(b, device=key.device), reduce="amin")
    order = torch.argsort(first_of)
    rank = torch.empty_like(order)
    rank[order] = torch.arange(order.numel(), device=key.device)
    return first_of[order], rank[inverse]


def shared_prompt_log_probs(
    model,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    *,
    compute_entropy: bool = False,
    autocast: Any = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Completion log-probs (and entropies) of a micro-batch, each distinct prompt's forward shared by its rows.

    Args:
        model: a causal LM patched with TRL's fused LM head (``trl.trainer.utils.add_fused_lm_head``, as
            ``GRPOTrainer`` patches it; its temperature applies), without gradient checkpointing.
        prompt_ids, prompt_mask: ``(B, P)``, LEFT-padded, ``P >= 2``.
        completion_ids, completion_mask: ``(B, C)``, right-padded.
        compute_entropy: also return the per-token entropies (the head must have been patched to compute them).
        autocast: a context manager factory wrapped around the forwards (the trainer's ``accelerator.autocast``);
            None: none.

    Returns:
        ``(log_prob, entropies)``: ``(B, C)`` float32 (the head's dtype), ``entropies`` None unless
        ``compute_entropy``; positions after a completion's end hold whatever the unshared pass would score there
        (the loss masks them).

    Raises:
        ValueError: ``P < 2`` or rows that disagree in number.
    """
    import contextlib

    from transformers import DynamicCache

    b, p = prompt_ids.shape
    if p < 2 or completion_ids.size(0) != b or prompt_mask.shape != prompt_ids.shape:
        raise ValueError(
            f"shared_prompt_log_probs needs prompts (B, P >= 2) and completions of the same B rows; got prompt "
            f"{tuple(prompt_ids.shape)}, mask {tuple(prompt_mask.shape)}, completion {tuple(completion_ids.shape)}"
        )
    c = completion_ids.size(1)
    first, inverse = distinct_prompts(prompt_ids, prompt_mask)
    cache, cache_kw = DynamicCache(config=model.config), cache_kwarg(model.forward)
    ctx = autocast if autocast is not None else contextlib.nullcontext
    with ctx():
        # the distinct prompts' first P - 1 tokens, keys and values kept with their autograd graph
        model(
            input_ids=prompt_ids[first, :-1],
            attention_mask=prompt_mask[first, :-1],
            use_cache=True,
            logits_to_keep=1,
            **{cache_kw: cache},
        )
        cache.batch_select_indices(inverse)
        # each row: its last prompt token and its completion, on the shared keys and values; the position before
        # completion token j scores it (pre-shifted labels), the last position scores nothing
        input_ids = torch.cat([prompt_ids[:, -1:], completion_ids], dim=1)
        labels = torch.cat([completion_ids, completion_ids.new_full((b, 1), -100)], dim=1)
        labels = labels.masked_fill(torch.cat([completion_mask, completion_mask.new_zeros(b, 1)], dim=1) == 0, -100)
        out = model(
            input_ids=input_ids,
            attention_mask=torch.cat([prompt_mask, completion_mask], dim=1),
            shift_labels=labels,
            fused_lm_head=True,
            **{cache_kw: cache},
        )
    log_prob = out.log_probs[:, :c]
    entropies = out.entropy[:, :c] if compute_entropy else None
    return log_prob, entropies
