"""Rollout generation with each prompt prefilled once per group (transformers ``generate``, no vLLM).

GRPO samples ``num_generations`` responses per prompt, and TRL's transformers path hands ``generate`` a
batch in which every prompt appears ``num_generations`` times in a row; ``generate`` then runs the
prompt's forward (the prefill) once per ROW. On a CPU the prefill is most of the rollout's cost: in
the CPU demo (16 prompts x 8 samples, ~100 prompt tokens, ~20 response tokens) it was about 40 of the
49 seconds of one rollout batch. :func:`grouped_prefill_generate` runs the prefill once per distinct
prompt, repeats the KV cache ``num_generations`` times (``Cache.batch_repeat_interleave``) and lets
``generate`` decode from there: the documented "re-use a prompt cache" use of ``generate``, so the
sampling itself (temperature, stop tokens, logits processors, RNG) stays transformers'.

On a CPU with one process, the decoding after the prefill is klear's own loop
(:func:`klear.generation.decode.grouped_decode`: several times faster there, same distribution, another RNG
stream), also for rows that are not in groups (each row its own prompt, e.g. one sample per held-out problem);
elsewhere ``generate`` decodes.

The sampled distribution is unchanged; only the floating-point rounding of the prompt's keys and
values can differ (they are computed in a batch of distinct prompts instead of all rows). The
rollout's ``old_log_prob`` is recomputed afterwards (:class:`klear.rl.trainer.GPPOTrainer`), or, with
``old_log_prob_source="rollout"``, taken from the decode loop that sampled the tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from klear.models.cache import cache_kwarg

__all__ = ["grouped_prefill_generate"]


def grouped_prefill_generate(
    model,
    generate: Callable,
    input_ids,
    attention_mask,
    *,
    group_size: int,
    generation_config=None,
    agree: Callable[[bool], bool] | None = None,
    fast_decode: bool = True,
    log_probs: list | None = None,
    **kwargs: Any,
):
    """``generate(input_ids, attention_mask, ...)`` with the prompt prefilled once per group of identical rows.

    Args:
        model: the causal LM (its forward fills a ``DynamicCache``).
        generate: the model's original ``generate`` (bound method).
        input_ids: ``(N, L)`` int, LEFT-padded prompts in which rows ``g*G .. g*G+G-1`` are the same prompt.
        attention_mask: ``(N, L)`` 0/1.
        group_size: ``G`` (``num_generations``).
        generation_config, kwargs: passed to ``generate``.
        agree: with several processes, called once with whether THIS process can take the grouped path; returns
            whether ALL processes can (one collective, e.g. ``GPPOTrainer._prefill_agreement``). The grouped path
            adds one forward (the prefill): under sharded parameters (DeepSpeed ZeRO-3 without gathering for
            generation, FSDP) every forward is a collective, so all processes must take the same path or they
            hang. None: this process decides alone (one process, or parameters whole on every process).
        fast_decode: on a CPU, with one process (``agree`` None), decode with
            :func:`klear.generation.decode.grouped_decode` when it supports the model and ``generation_config`` (same
            distribution, fewer copies, finished rows leave the batch, cheaper sampling; a different RNG stream),
            rows not in groups of ``G`` identical prompts included (each its own group). False: always
            ``generate``.
        log_probs: a list that receives the ``(N, T)`` float32 log-probabilities of the new tokens when klear's loop
            decodes (:func:`klear.generation.decode.grouped_decode`'s ``log_probs``); left empty when ``generate``
            does.

    Returns:
        What ``generate`` returns (``(N, L + new)`` token ids).

    Without the fast loop, falls back to a plain ``generate`` call when the rows are not in groups of ``G``
    identical prompts. Always ``generate`` when extra model inputs (images, token types, logits processors) or a
    cache are given, or when ``generation_config`` asks for a cache implementation of its own (e.g. a static cache).
    """
    import torch
    from transformers import DynamicCache

    from klear.generation.decode import in_groups

    n, length = input_ids.shape
    special = length < 2 or kwargs or getattr(generation_config, "cache_implementation", None)
    plain = group_size < 2 or special or not in_groups(input_ids, attention_mask, group_size)
    if agree is not None:
        plain = not agree(not plain)
    if fast_decode and agree is None and not special:
        from klear.generation.decode import decode_supported, grouped_decode

        # rows not in groups (e.g. one sample per held-out problem) still gain the loop's own savings
        if decode_supported(model, input_ids, generation_config):
            out = grouped_decode(
                model,
                input_ids,
                attention_mask,
                group_size=1 if plain else group_size,
                generation_config=generation_config,
                log_probs=log_probs is not None,
            )
            if log_probs is None:
                return out
            log_probs.append(out[1])
            return out[0]
    if plain:
        return generate(
            input_ids=input_ids, attention_mask=attention_mask, generation_config=generation_config, **kwargs
        )
    uniq_ids, uniq_mask = input_ids[::group_size], attention_mask[::group_size]
    # the positions generate uses for left-padded prompts (cumsum of the mask, 1 on padding)
    position_ids = (uniq_mask.long().cumsum(-1) - 1).masked_fill(uniq_mask == 0, 1)
    cache, cache_kw = DynamicCache(config=model.config), cache_kwarg(model.forward)
    with torch.no_grad():  # all but the last prompt token: generate starts from the uncached last one
        model(
            input_ids=uniq_ids[:, :-1],
            attention_mask=uniq_mask[:, :-1],
            position_ids=position_ids[:, :-1],
            use_cache=True,
            logits_to_keep=1,
            **{cache_kw: cache},
        )
    cache.batch_repeat_interleave(group_size)
    return generate(
        input_ids=input_ids, attention_mask=attention_mask, generation_config=generation_config, **{cache_kw: cache}
    )
