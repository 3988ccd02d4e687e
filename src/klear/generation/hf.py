"""The one transformers sampling loop of klear's evaluations: the held-out evaluator's sampled path
(:func:`klear.eval.heldout.generate`) and ``klear eval``'s HF backend (:class:`klear.eval.backends.HFBackend`).

Each batch goes through :func:`klear.generation.prefill.grouped_prefill_generate`: on a CPU (in float32, or in a bf16
autocast region), with one process and no extra logits processors (the held-out evaluator), klear's decode loop
decodes it (:mod:`klear.generation.decode`); otherwise (``klear eval``'s processors, a GPU) ``model.generate``.
Greedy held-out decoding has its own faster loop (:func:`klear.eval.heldout.greedy_generate`: finished rows leave the
batch); the RL rollouts are TRL's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["generate_token_ids"]


def generate_token_ids(
    model,
    tokenizer,
    texts: Sequence[str],
    *,
    generation_config,
    batch_size: int,
    group_size: int = 1,
    lengths: Sequence[int] | None = None,
    logits_processor: Callable[[list[int]], list] | None = None,
    on_batch: Callable[[int], Any] | None = None,
) -> list[list[int]]:
    """Sampling (``generate``'s, or klear's CPU decode loop: module docstring) over rendered prompts, batched in order
    of prompt length with LEFT padding.

    Args:
        model: a causal LM (``transformers`` ``PreTrainedModel``).
        tokenizer: its tokenizer (a pad token set); ``padding_side`` is restored afterwards, even on error.
        texts: prompts already rendered with the chat template (they hold their special tokens).
        generation_config: passed to ``generate`` for every batch.
        batch_size: prompts per ``generate`` call (>= 1).
        group_size: ``texts`` holds each prompt ``group_size`` times in a row; each group's prompt is prefilled
            once (:func:`klear.generation.prefill.grouped_prefill_generate`). Keep ``batch_size`` a multiple of it.
        lengths: the prompts' token counts, when the caller has them (else counted here).
        logits_processor: given a batch's indices into ``texts``, the logits processors for that batch.
        on_batch: called with the number of prompts finished after each batch.

    Returns:
        Per prompt, in the order of ``texts``: the new token ids as ``generate`` returned them (up to the
        batch's longest, padded after an end-of-sequence token).

    Raises:
        ValueError: ``batch_size`` < 1.

    Runs under ``torch.no_grad()`` in eval mode; the model's training flag is restored afterwards.
    """
    import torch

    from klear.generation.prefill import grouped_prefill_generate

    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if lengths is None:
        lengths = [len(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts]
    order = sorted(range(len(texts)), key=lambda i: (lengths[i], i))
    results: list[list[int]] = [[] for _ in texts]
    old_side, was_training = tokenizer.padding_side, model.training
    device = next(model.parameters()).device
    try:
        tokenizer.padding_side = "left"
        model.eval()
        with torch.no_grad():
            for start in range(0, len(order), batch_size):
                idx = order[start : start + batch_size]
                enc = tokenizer(
                    [texts[i] for i in idx], return_tensors="pt", padding=True, add_special_tokens=False
                ).to(device)
                extra: dict[str, Any] = {} if logits_processor is None else {"logits_processor": logits_processor(idx)}
                out = grouped_prefill_generate(
                    model,
                    model.generate,
                    enc["input_ids"],
                    enc["attention_mask"],
                    group_size=group_size,
                    generation_config=generation_config,
                    **extra,
                )
                for i, row in zip(idx, out[:, enc["input_ids"].shape[1] :].cpu().tolist()):
                    results[i] = row
                if on_batch is not None:
                    on_batch(len(idx))
    finally:
        tokenizer.padding_side = old_side
        model.train(was_training)
    return results
