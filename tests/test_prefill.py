"""Rollout generation with one prefill per prompt group (klear.generation.prefill) against plain ``generate``."""

from __future__ import annotations

import pytest
import torch
from transformers import GenerationConfig

from klear.generation.prefill import grouped_prefill_generate


def _batch(tok, group_size):
    prompts = [[{"role": "user", "content": "word " * k + f"number {k}"}] for k in (1, 6, 3)]
    texts = [tok.apply_chat_template(p, tokenize=False, add_generation_prompt=True) for p in prompts]
    tok.padding_side = "left"
    enc = tok(
        [t for t in texts for _ in range(group_size)], return_tensors="pt", padding=True, add_special_tokens=False
    )
    return enc["input_ids"], enc["attention_mask"]


@pytest.fixture()
def model_tok(tiny_model):
    model, tok = tiny_model
    with torch.no_grad():  # larger weights: varied tokens instead of one repeated token
        for p in model.parameters():
            p.mul_(6.0)
    return model.eval(), tok


@pytest.mark.parametrize("do_sample", [False, True])
def test_same_tokens_as_plain_generate(model_tok, do_sample):
    model, tok = model_tok
    ids, mask = _batch(tok, group_size=4)
    config = GenerationConfig(
        max_new_tokens=10,
        do_sample=do_sample,
        temperature=1.0 if do_sample else None,
        top_k=0 if do_sample else None,
        top_p=None,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
    )
    calls = []
    original = model.generate

    def generate(**kw):
        cache = kw.get("cache", kw.get("past_key_values"))
        calls.append((cache.get_seq_length(), cache.layers[0].keys.shape[0]) if cache is not None else None)
        return original(**kw)

    torch.manual_seed(3)
    ref = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
    torch.manual_seed(3)
    # transformers' generate after the grouped prefill (klear's CPU decode loop is tests/test_decode.py's)
    out = grouped_prefill_generate(
        model, generate, ids, mask, group_size=4, generation_config=config, fast_decode=False
    )
    assert torch.equal(out, ref)
    # the grouped path ran: L - 1 prompt tokens prefilled, repeated to all 12 rows
    assert calls == [(ids.shape[1] - 1, 12)]
    if do_sample:  # the samples of one group differ: the cache copies are independent rows
        assert len({tuple(r.tolist()) for r in out[:4, ids.shape[1] :]}) > 1


def test_falls_back_when_rows_are_not_groups(model_tok):
    model, tok = model_tok
    ids, mask = _batch(tok, group_size=2)
    seen = []

    def generate(**kw):
        seen.append(sorted(kw))
        return kw["input_ids"]

    grouped_prefill_generate(model, generate, ids, mask, group_size=3, generation_config=None)  # 6 rows, not groups
    grouped_prefill_generate(model, generate, ids[[0, 2, 1, 3, 4, 5]], mask, group_size=2, generation_config=None)
    grouped_prefill_generate(
        model, generate, ids, mask, group_size=2, generation_config=GenerationConfig(cache_implementation="static")
    )
    assert seen == [["attention_mask", "generation_config", "input_ids"]] * 3


def test_all_processes_take_the_same_path_when_one_cannot_group(model_tok):
    """Issue 22 (low): under sharded parameters every forward is a collective. Process 0's rows are groups, process
    1's are not; with the agreement (an all-reduce, simulated) both skip the grouped prefill, so both run the same
    forwards (none here: generate is a stub). Without it process 0 alone would run the prefill forward and hang."""
    model, tok = model_tok
    ids, mask = _batch(tok, group_size=2)
    rows = {0: ids, 1: ids[[0, 2, 1, 3, 4, 5]]}  # process 1: the rows are not groups of identical prompts
    can_group = {0: True, 1: False}
    forwards = {0: 0, 1: 0}
    asked = []
    for rank in (0, 1):
        hook = model.register_forward_pre_hook(lambda *a, rank=rank: forwards.__setitem__(rank, forwards[rank] + 1))

        def agree(local: bool, rank=rank) -> bool:  # the sum of both processes' flags == the number of processes
            asked.append((rank, local))
            return local and can_group[1 - rank]

        try:
            grouped_prefill_generate(
                model, lambda **kw: kw["input_ids"], rows[rank], mask, group_size=2, generation_config=None, agree=agree
            )
        finally:
            hook.remove()
    assert asked == [(0, True), (1, False)]  # each process asked once, with its own decision
    assert forwards == {0: 0, 1: 0}


def test_the_grouped_path_runs_when_every_process_agrees(model_tok):
    model, tok = model_tok
    ids, mask = _batch(tok, group_size=2)
    calls = []
    out = grouped_prefill_generate(
        model,
        lambda **kw: calls.append(kw.get("past_key_values", kw.get("cache"))) or kw["input_ids"],
        ids,
        mask,
        group_size=2,
        agree=lambda local: local,
    )
    assert torch.equal(out, ids) and calls[0] is not None  # decoding started from the prefilled cache
