"""klear's CPU decode loop (klear.generation.decode) against transformers' ``generate``.

Greedy decoding must give ``generate``'s tokens exactly (the loop's cache, positions, masks, finished rows leaving
the batch, the end-of-sequence padding and the minimum-length processor); sampling draws from the same distribution
(chi-square tests, on the sampler and on the whole path with a tiny random model and the real tokenizer), though with a
different RNG stream than ``torch.multinomial``.
"""

from __future__ import annotations

import math

import pytest
import torch
from scipy import stats
from transformers import GenerationConfig

from klear.generation import decode
from klear.generation.decode import decode_supported, grouped_decode, sample_from_scores
from klear.generation.prefill import grouped_prefill_generate


def _batch(tok, group_size, words=(1, 6, 3)):
    prompts = [[{"role": "user", "content": "word " * k + f"number {k}"}] for k in words]
    texts = [tok.apply_chat_template(p, tokenize=False, add_generation_prompt=True) for p in prompts]
    tok.padding_side = "left"
    enc = tok(
        [t for t in texts for _ in range(group_size)], return_tensors="pt", padding=True, add_special_tokens=False
    )
    return enc["input_ids"], enc["attention_mask"]


@pytest.fixture(params=["mha", "gqa"])
def model_tok(request, tiny_model):
    model, tok = tiny_model
    if request.param == "gqa":  # 4 query heads on 2 key/value heads (sdpa's enable_gqa), as SmolLM2 and Qwen
        from transformers import LlamaConfig, LlamaForCausalLM

        from conftest import decoder_config

        torch.manual_seed(0)
        config = decoder_config(LlamaConfig, len(tok), 64, 2, 4, 2, 128, tie_word_embeddings=True)
        model = LlamaForCausalLM(config).float()
        assert model.config._attn_implementation == "sdpa"
    with torch.no_grad():  # larger weights: varied tokens instead of one repeated token
        for p in model.parameters():
            p.mul_(6.0)
    return model.eval(), tok


def _greedy_config(tok, eos, **kw):
    return GenerationConfig(max_new_tokens=12, do_sample=False, pad_token_id=tok.pad_token_id, eos_token_id=eos, **kw)


def _staggered_eos(model, tok, ids, mask):
    """End-of-sequence tokens the greedy continuations emit at different steps, so rows end at different times."""
    with torch.no_grad():
        free = model.generate(input_ids=ids, attention_mask=mask, generation_config=_greedy_config(tok, None))
    new = free[:, ids.shape[1] :]
    return sorted({int(new[0, 2]), int(new[3, 6])})


@pytest.mark.parametrize("min_new_tokens", [None, 5])
def test_greedy_tokens_equal_generate_with_rows_ending_early(model_tok, min_new_tokens):
    model, tok = model_tok
    ids, mask = _batch(tok, group_size=3)
    eos = _staggered_eos(model, tok, ids, mask)
    config = _greedy_config(tok, eos, min_new_tokens=min_new_tokens)
    assert decode_supported(model, ids, config)
    with torch.no_grad():
        ref = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
    out = grouped_decode(model, ids, mask, group_size=3, generation_config=config, compact=0.1)
    assert torch.equal(out, ref)
    ended = torch.isin(ref[:, ids.shape[1] :], torch.tensor(eos)).any(1)
    assert 0 < int(ended.sum()) < len(ref)  # some rows ended early, some ran on
    # the same with every row its own group (no shared prefill)
    assert torch.equal(grouped_decode(model, ids, mask, group_size=1, generation_config=config), ref)


def test_grouped_prefill_generate_takes_the_decode_loop_on_cpu(model_tok):
    model, tok = model_tok
    ids, mask = _batch(tok, group_size=4)
    config = GenerationConfig(
        max_new_tokens=6, do_sample=True, temperature=0.7, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id
    )
    calls = []

    def generate(**kw):
        calls.append(kw)
        return model.generate(**kw)

    out = grouped_prefill_generate(model, generate, ids, mask, group_size=4, generation_config=config)
    assert calls == [] and out.shape[0] == 12
    grouped_prefill_generate(model, generate, ids, mask, group_size=4, generation_config=config, fast_decode=False)
    assert len(calls) == 1
    # settings the loop does not handle keep generate: a repetition penalty, several processes
    unsupported = GenerationConfig(**{**config.to_diff_dict(), "repetition_penalty": 1.3})
    assert not decode_supported(model, ids, unsupported)
    grouped_prefill_generate(model, generate, ids, mask, group_size=4, generation_config=unsupported)
    grouped_prefill_generate(model, generate, ids, mask, group_size=4, generation_config=config, agree=lambda ok: ok)
    assert len(calls) == 3


def test_rows_not_in_groups_take_the_decode_loop_each_its_own_group(model_tok):
    """One sample per prompt (the held-out evaluation's avg@1) or rows that are not groups of identical prompts: the
    loop decodes them with each row its own group (greedy: ``generate``'s tokens), not ``generate``."""
    model, tok = model_tok
    ids, mask = _batch(tok, group_size=2)
    mixed = [0, 2, 1, 3, 4, 5]  # rows 0-1 and 2-3 are not groups of 2 identical prompts
    config = _greedy_config(tok, tok.eos_token_id)
    calls = []

    def generate(**kw):
        calls.append(kw)
        return model.generate(**kw)

    with torch.no_grad():
        ref = model.generate(input_ids=ids[mixed], attention_mask=mask[mixed], generation_config=config)
    for group_size in (1, 2):
        out = grouped_prefill_generate(
            model, generate, ids[mixed], mask[mixed], group_size=group_size, generation_config=config
        )
        assert torch.equal(out, ref)
    assert calls == []
    grouped_prefill_generate(
        model, generate, ids[mixed], mask[mixed], group_size=1, generation_config=config, fast_decode=False
    )
    assert len(calls) == 1


def _chi_square_p(counts, probs):
    expected = probs * counts.sum()
    keep = expected > 0
    assert counts[~keep].sum() == 0  # nothing drawn where the probability is zero
    return stats.chisquare(counts[keep], expected[keep]).pvalue


@pytest.mark.parametrize("block", [256, 8, 5])
def test_sampler_draws_softmax(block, monkeypatch):
    """Token frequencies against softmax(scores) in float64, with one block (50 tokens) and with the two-level search
    over blocks of 8 (the last one padded) and of 5."""
    monkeypatch.setattr(decode, "SAMPLE_BLOCK", block)
    gen = torch.Generator().manual_seed(0)
    scores = torch.randn(6, 50, generator=gen) * 2
    scores[:, ::7] = -float("inf")  # impossible tokens (top-k / top-p masks, minimum length)
    scores[1, 8:16] = -float("inf")  # a whole block of 8 impossible
    probs = torch.softmax(scores.double(), -1)
    counts = torch.zeros(6, 50, dtype=torch.float64)
    kept = scores.clone()
    workspace = torch.empty(6, decode.sample_workspace_width(50))
    assert workspace.shape[1] == {256: 50, 8: 56, 5: 50}[block]
    for _ in range(600):
        token = sample_from_scores(scores, workspace=workspace, generator=gen)
        counts[torch.arange(6), token] += 1
    assert torch.equal(kept, scores)  # scores left as they are
    pooled = _chi_square_p(counts.flatten(), probs.flatten() / 6)
    assert pooled > 1e-3
    assert min(_chi_square_p(counts[r], probs[r]) for r in range(6)) > 1e-4
    # a row whose mass sits on one token always draws it, wherever it sits in its block
    for last in (49, 0, 40):
        one = torch.full((3, 50), -float("inf"))
        one[:, last] = 0.0
        assert sample_from_scores(one).tolist() == [last] * 3
    with pytest.raises(ValueError, match="workspace must be float32"):
        sample_from_scores(scores, workspace=torch.empty(6, 50, dtype=torch.float64))
    for bad in (float("nan"), float("inf")):
        broken = scores.clone()
        broken[4, 3] = bad
        with pytest.raises(ValueError, match="row 4's scores hold NaN"):
            sample_from_scores(broken)
    broken = scores.clone()
    broken[2] = -float("inf")
    with pytest.raises(ValueError, match="row 2's .* every token is -inf"):
        sample_from_scores(broken)


def test_sampler_stays_in_the_block_when_its_float32_sum_rounds_up(monkeypatch):
    """A block whose float32 sum exceeds its float64 cumulative weight (1 + 1.1 * 2**-24 rounds up to 1 + 2**-23),
    and a variate in that gap (u just below the total): the draw is still the block's last possible token, not the
    position past the block (token 16, out of the vocabulary)."""
    monkeypatch.setattr(decode, "SAMPLE_BLOCK", 8)
    scores = torch.full((1, 16), -float("inf"))
    scores[0, 8], scores[0, 9] = 0.0, math.log(2**-24 * 1.1)
    weights = scores[0, 8:10].exp()
    assert weights.sum().double() > weights.double().sum()  # the gap this test needs
    monkeypatch.setattr(torch, "rand", lambda *a, **k: torch.full(a[0], 1 - 1e-12, dtype=torch.float64))
    assert sample_from_scores(scores).tolist() == [9]


@pytest.mark.parametrize("top_k", [0, 6])
def test_sampled_tokens_follow_the_models_distribution(model_tok, top_k):
    """The whole loop: the first two new tokens' frequencies against the model's processed softmax (temperature,
    top-k), in a batch of 600 rows of two prompts (prefill once per group; the second token from the decode step)."""
    model, tok = model_tok
    ids, mask = _batch(tok, group_size=300, words=(1, 6))
    config = GenerationConfig(
        max_new_tokens=2,
        min_new_tokens=2,
        do_sample=True,
        temperature=0.7,
        top_k=top_k,
        top_p=1.0,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
    )
    torch.manual_seed(0)
    out = grouped_decode(model, ids, mask, group_size=300, generation_config=config)[:, ids.shape[1] :]
    with torch.no_grad():
        first = model(input_ids=ids[::300], attention_mask=mask[::300]).logits[:, -1] / 0.7
    if top_k:
        first = first.masked_fill(first < first.topk(top_k, -1).values[:, -1:], -float("inf"))
    first[:, tok.eos_token_id] = -float("inf")  # min_new_tokens
    probs = torch.softmax(first.double(), -1)
    for g in range(2):
        counts = torch.bincount(out[g * 300 : (g + 1) * 300, 0], minlength=probs.shape[1]).double()
        top = probs[g].topk(8).indices  # the likely tokens, the rest pooled
        rest = torch.ones_like(probs[g], dtype=torch.bool)
        rest[top] = False
        p = torch.cat([probs[g][top], probs[g][rest].sum()[None]])
        c = torch.cat([counts[top], counts[rest].sum()[None]])
        assert _chi_square_p(c, p) > 1e-4
    # the second token of the most common first token of group 0, against the model's next-token distribution
    tok0 = int(torch.bincount(out[:300, 0]).argmax())
    rows = (out[:300, 0] == tok0).nonzero().squeeze(-1)
    assert len(rows) >= 50
    with torch.no_grad():
        ext = torch.cat([ids[:1], torch.tensor([[tok0]])], 1)
        nxt = model(input_ids=ext, attention_mask=torch.cat([mask[:1], torch.ones(1, 1, dtype=mask.dtype)], 1))
    second = nxt.logits[0, -1] / 0.7
    if top_k:
        second = second.masked_fill(second < second.topk(top_k).values[-1], -float("inf"))
    second[tok.eos_token_id] = -float("inf")
    probs2 = torch.softmax(second.double(), -1)
    counts2 = torch.bincount(out[rows, 1], minlength=probs2.shape[0]).double()
    top = probs2.topk(5).indices
    rest = torch.ones_like(probs2, dtype=torch.bool)
    rest[top] = False
    p = torch.cat([probs2[top], probs2[rest].sum()[None]])
    c = torch.cat([counts2[top], counts2[rest].sum()[None]])
    assert _chi_square_p(c, p) > 1e-4


def test_trls_fused_head_patch_keeps_the_loop_and_accelerates_autocast_wrapper_does_not(model_tok):
    """GRPOTrainer patches every policy's forward with TRL's fused LM head (an instance ``forward``); that patch
    computes the same logits, so the loop stays; accelerate's mixed-precision wrapper (``_original_forward``) keeps
    ``generate`` unless the caller runs the loop in a bf16 autocast region; unknown wrappers keep ``generate``."""
    import functools
    import types

    from trl.trainer.utils import add_fused_lm_head

    model, tok = model_tok
    ids, _ = _batch(tok, group_size=2)
    config = GenerationConfig(max_new_tokens=4, do_sample=True, pad_token_id=tok.pad_token_id)
    add_fused_lm_head(model)
    assert "forward" in vars(model)
    assert decode_supported(model, ids, config)
    model._original_forward = model.forward  # what accelerate's prepare_model does under native AMP
    model.forward = types.MethodType(functools.partial(type(model).forward), model)
    assert not decode_supported(model, ids, config)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the caller's region of the wrapper's own autocast
        assert decode_supported(model, ids, config)
    with torch.autocast("cpu", dtype=torch.float16):  # only bf16 autocast is decoded by the loop
        assert not decode_supported(model, ids, config)
    del model._original_forward
    assert not decode_supported(model, ids, config)  # some other wrapper of forward: keep generate


@pytest.mark.parametrize("group_size", [1, 3])
def test_under_bf16_autocast_greedy_tokens_equal_generate_under_autocast(model_tok, group_size):
    """In the caller's bf16 autocast region the loop computes as ``generate`` does there (bf16 matrix products,
    keys and values rounded to bf16 as its sdpa rounds them, bf16 logits scored in float32): the same greedy tokens,
    which differ from float32's (bf16 rounding changes some of them, so running the loop in float32 fails this)."""
    model, tok = model_tok
    ids, mask = _batch(tok, group_size=3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        eos = _staggered_eos(model, tok, ids, mask)  # finished rows leave the batch
    config = _greedy_config(tok, eos)
    with torch.no_grad():
        float32 = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            ref = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert decode_supported(model, ids, config)
        out = grouped_decode(model, ids, mask, group_size=group_size, generation_config=config, compact=0.1)
    ended = torch.isin(ref[:, ids.shape[1] :], torch.tensor(eos)).any(1)
    assert 0 < int(ended.sum()) < len(ref)
    assert not torch.equal(ref, float32)
    assert torch.equal(out, ref)


def test_shared_prompt_attention_matches_each_row_attending_its_own_copy(model_tok):
    """Groups share one copy of their prompt's keys (``_shared_prompt_attention``); rows that keep their own copy
    (``group_size=1``, sdpa) draw the same tokens from the same RNG stream, also after some rows of a group and a
    whole group have finished and left the batch (top-3 sampling: a float32 rounding difference between the two
    attentions cannot move a draw across a token's share of the mass)."""
    model, tok = model_tok
    ids, mask = _batch(tok, group_size=6)
    config = GenerationConfig(
        max_new_tokens=12, do_sample=True, temperature=2.0, top_k=3, top_p=1.0, pad_token_id=tok.pad_token_id
    )
    torch.manual_seed(1)
    first = grouped_decode(model, ids, mask, group_size=1, generation_config=config)[:, ids.shape[1]].view(3, 6)
    # end-of-sequence tokens: every first token of group 0 (the whole group ends at once) and one first token of
    # group 1 that some of its rows did not draw (those rows go on)
    partial = next(t for t in first[1].tolist() if (first[1] != t).any())
    config.eos_token_id = sorted(set(first[0].tolist()) | {partial})
    outs = []
    for group_size in (1, 6):
        torch.manual_seed(1)  # the same first tokens as above
        outs.append(grouped_decode(model, ids, mask, group_size=group_size, generation_config=config, compact=0.01))
    assert torch.equal(outs[0], outs[1])
    ended = torch.isin(outs[1][:, ids.shape[1] :], torch.tensor(config.eos_token_id))
    length = torch.where(ended.any(1), ended.float().argmax(1) + 1, outs[1].shape[1] - ids.shape[1]).view(3, 6)
    assert (length[0] == 1).all() and length.max() > 3  # group 0 left the batch after one token, others went on
    assert length[1].min() == 1 < length[1].max()  # some rows of group 1 ended at once, others went on


def test_shared_prompt_attention_against_float64():
    from klear.generation.decode import _shared_prompt_attention

    gen = torch.Generator().manual_seed(0)
    groups, group, kv_heads, rep, dim, length, new = 3, 4, 2, 3, 8, 5, 4
    q = torch.randn(groups * group, kv_heads * rep, 1, dim, generator=gen)
    pk, pv = (torch.randn(groups, kv_heads, length, dim, generator=gen) for _ in range(2))
    k, v = (torch.randn(groups * group, kv_heads, new, dim, generator=gen) for _ in range(2))
    bias = torch.zeros(groups, 1, 1, length)
    bias[1, ..., :2] = -float("inf")  # group 1's prompt is left-padded by 2
    # the rows left after some finished: group 0 whole, group 1 two rows, group 2 none (its prompt dropped)
    rows = torch.tensor([0, 1, 2, 3, 5, 7])
    slot = torch.tensor([0, 1, 2, 3, 5, 7])
    out = _shared_prompt_attention(q[rows], pk[:2], pv[:2], bias[:2], k[rows], v[rows], slot, group, dim**-0.5)
    for i, r in enumerate(rows.tolist()):
        g = r // group
        keys = torch.cat([pk[g], k[r]], 1).double().repeat_interleave(rep, 0)  # (heads, L + T, dim)
        values = torch.cat([pv[g], v[r]], 1).double().repeat_interleave(rep, 0)
        scores = q[r].double() @ keys.transpose(-1, -2) * dim**-0.5 + torch.cat([bias[g, 0], torch.zeros(1, new)], 1)
        ref = torch.softmax(scores, -1) @ values
        assert torch.allclose(out[i].double(), ref, atol=1e-6), r


@pytest.mark.parametrize("group_size", [1, 3])
def test_log_probs_are_the_full_softmax_of_the_sampling_forward(model_tok, group_size):
    """``log_probs=True``: each new token's log-probability under ``log_softmax(logits / T)`` over the whole
    vocabulary (before top-k and minimum-length masking), as a full forward over prompt + response computes it
    (float64 reference); 0 after a row's end."""
    model, tok = model_tok
    ids, mask = _batch(tok, group_size=3)
    config = GenerationConfig(
        max_new_tokens=8,
        min_new_tokens=2,
        do_sample=True,
        temperature=0.7,
        top_k=5,
        top_p=1.0,
        pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(0)
    free = grouped_decode(model, ids, mask, group_size=group_size, generation_config=config)[:, ids.shape[1] :]
    config.eos_token_id = int(free[0, 3])  # row 0 ends after 4 tokens, others later or not at all
    torch.manual_seed(0)
    out, log_probs = grouped_decode(
        model, ids, mask, group_size=group_size, generation_config=config, log_probs=True, compact=0.01
    )
    new = out[:, ids.shape[1] :]
    assert log_probs.shape == new.shape and log_probs.dtype == torch.float32
    import copy

    with torch.no_grad():  # float64 reference: the float32 rounding of this model (logits ~40) is ~1e-4
        logits = copy.deepcopy(model).double()(input_ids=out, attention_mask=torch.cat([mask, torch.ones_like(new)], 1))
    ref = torch.log_softmax(logits.logits[:, ids.shape[1] - 1 : -1] / 0.7, -1).gather(-1, new[:, :, None]).squeeze(-1)
    ended = torch.cumsum(new == config.eos_token_id, 1) - (new == config.eos_token_id).long() > 0  # after the end
    assert bool(ended[0, 4:].all()) and int(ended.sum()) > 0
    assert torch.allclose(log_probs[~ended].double(), ref[~ended], atol=5e-4)  # a wrong normaliser: off by >= 1e-2
    assert bool((log_probs[ended] == 0).all())


def test_short_prompts_keep_a_copy_per_row(model_tok, monkeypatch):
    """The shared-prompt attention runs only when the prompt is long against ``max_new_tokens``
    (``SHARED_PROMPT_MIN_LENGTH``); otherwise each row keeps its copy and sdpa, with the same greedy tokens."""
    import klear.generation.decode as decode

    model, tok = model_tok
    ids, mask = _batch(tok, group_size=3)
    calls = []
    shared = decode._shared_prompt_attention
    monkeypatch.setattr(decode, "_shared_prompt_attention", lambda *a: calls.append(1) or shared(*a))
    for max_new, expect_shared in ((ids.shape[1] // 2, True), (3 * ids.shape[1], False)):
        calls.clear()
        config = GenerationConfig(max_new_tokens=max_new, min_new_tokens=4, do_sample=False, pad_token_id=0)
        out = grouped_decode(model, ids, mask, group_size=3, generation_config=config)
        assert bool(calls) == expect_shared, max_new
        assert torch.equal(
            out[:, : ids.shape[1] + 4],
            grouped_decode(model, ids, mask, group_size=1, generation_config=config)[:, : ids.shape[1] + 4],
        )


def test_rows_and_groups_leaving_in_turns_keep_their_prompts():
    """``_State.select`` over several steps: rows of one group leave first, then a whole other group, then more rows;
    after each, every row still attends to its own group's prompt (float64 reference over the original rows)."""
    from klear.generation.decode import _shared_prompt_attention, _State

    gen = torch.Generator().manual_seed(1)
    groups, group, kv_heads, rep, dim, length, new = 4, 3, 2, 2, 8, 5, 3
    n = groups * group
    q = torch.randn(n, kv_heads * rep, 1, dim, generator=gen)
    pk, pv = (torch.randn(groups, kv_heads, length, dim, generator=gen) for _ in range(2))
    k, v = (torch.randn(n, kv_heads, new, dim, generator=gen) for _ in range(2))
    bias = torch.zeros(groups, 1, 1, length)
    bias[2, ..., :3] = -float("inf")
    state = _State(1, n, length + new, group, bias.clone())
    state.prompt_keys, state.prompt_values, state.keys, state.values = [pk], [pv], [k], [v]
    state.start_decoding(length)
    state.pos += new  # the buffers hold `new` tokens per row, as after `new` decode steps
    rows = torch.arange(n)
    for leaving in ([4, 5], [0, 1, 2], [9], [6, 7, 8]):  # part of group 1, all of group 0, part of 3, all of 2
        kept = torch.tensor([i for i, r in enumerate(rows.tolist()) if r not in leaving])
        state.select(kept, rows[kept])
        rows = rows[kept]
        out = _shared_prompt_attention(
            q[rows],
            state.prompt_keys[0],
            state.prompt_values[0],
            state.prompt_bias,
            state.keys[0],
            state.values[0],
            state.slot,
            group,
            dim**-0.5,
        )
        for i, r in enumerate(rows.tolist()):
            g = r // group
            keys = torch.cat([pk[g], k[r]], 1).double().repeat_interleave(rep, 0)
            values = torch.cat([pv[g], v[r]], 1).double().repeat_interleave(rep, 0)
            mask = torch.cat([bias[g, 0], torch.zeros(1, new)], 1)
            ref = torch.softmax(q[r].double() @ keys.transpose(-1, -2) * dim**-0.5 + mask, -1) @ values
            assert torch.allclose(out[i].double(), ref, atol=1e-6), (leaving, r)
    assert rows.tolist() == [3, 10, 11]


def test_inputs_the_loop_cannot_decode_raise_a_clear_error(model_tok):
    """Rows that are not groups, a bad group size, a missing or misshapen mask and right padding are refused with
    a ValueError naming the problem (before: a row's prompt silently replaced by its group's first, ZeroDivisionError,
    AttributeError, or garbage)."""
    model, tok = model_tok
    ids, mask = _batch(tok, group_size=2)
    config = _greedy_config(tok, tok.eos_token_id)
    with pytest.raises(ValueError, match="not groups of group_size=2 identical prompts"):
        grouped_decode(model, ids[[0, 2, 1, 3, 4, 5]], mask[[0, 2, 1, 3, 4, 5]], group_size=2, generation_config=config)
    for size in (0, -2, 4):
        with pytest.raises(ValueError, match=f"not groups of group_size={size}"):
            grouped_decode(model, ids, mask, group_size=size, generation_config=config)
    with pytest.raises(ValueError, match="attention_mask must be"):
        grouped_decode(model, ids, None, group_size=2, generation_config=config)
    with pytest.raises(ValueError, match="attention_mask must be"):
        grouped_decode(model, ids, mask[:, 1:], group_size=2, generation_config=config)
    assert not bool(mask[:, 0].all())  # some rows are padded
    right_ids = torch.stack([torch.cat([r[m.bool()], r[~m.bool()]]) for r, m in zip(ids, mask)])
    right_mask = mask.sort(dim=1, descending=True).values
    with pytest.raises(ValueError, match="does not end with a prompt token"):
        grouped_decode(model, right_ids, right_mask, group_size=2, generation_config=config)


def test_without_max_new_tokens_generate_keeps_its_own_length_rules(model_tok):
    """No ``max_new_tokens``: ``generate`` applies its defaults (20 new tokens when ``max_length`` is its default),
    so the loop steps aside and ``grouped_prefill_generate`` returns what ``generate`` does (before: the loop ran
    ``max_length - prompt length`` steps, a shorter output)."""
    model, tok = model_tok
    tok.padding_side = "left"
    enc = tok(["word number", "word number", "one word more"], return_tensors="pt", padding=True)
    ids, mask = enc["input_ids"][[0, 1, 2, 2]], enc["attention_mask"][[0, 1, 2, 2]]
    assert ids.shape[1] < 20  # shorter than the default max_length, which generate then counts as new tokens
    config = GenerationConfig(do_sample=False, pad_token_id=tok.pad_token_id, eos_token_id=None)
    with torch.no_grad():
        ref = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
    assert not decode_supported(model, ids, config)
    with pytest.raises(ValueError, match="does not support"):
        grouped_decode(model, ids, mask, group_size=2, generation_config=config)
    out = grouped_prefill_generate(model, model.generate, ids, mask, group_size=2, generation_config=config)
    assert out.shape == ref.shape and torch.equal(out, ref)


def test_minimum_length_masks_only_end_of_sequence_ids_in_the_vocabulary():
    """``_process``'s in-place minimum-length masking against transformers' processors themselves, with
    end-of-sequence ids outside the vocabulary (negative, too large): they match no entry (before: a negative id
    masked the token counted from the end, a large one raised IndexError)."""
    from transformers.generation.logits_process import (
        MinLengthLogitsProcessor,
        MinNewTokensLengthLogitsProcessor,
    )

    from klear.generation.decode import _process

    eos = [-3, 2, 500]
    for processor in (MinLengthLogitsProcessor(9, eos), MinNewTokensLengthLogitsProcessor(4, 5, eos)):
        scores = torch.randn(3, 50)
        ref = processor(torch.zeros(3, 8, dtype=torch.long), scores.clone())
        out = _process([processor], scores.clone(), 8, torch.tensor(eos), torch.zeros(1, 1, dtype=torch.long))
        assert torch.equal(out, ref)
        assert torch.isinf(out[:, 2]).all() and torch.isfinite(out[:, 47]).all()


def test_compaction_copies_only_the_written_part_of_the_buffers(monkeypatch):
    """``_State.select`` copies each kept row's written entries, not the buffers' whole capacity (which
    ``max_new_tokens`` sets: 200 000 new tokens made every compaction copy gigabytes for a few written entries)."""
    from klear.generation.decode import _State

    rows, kv_heads, capacity, dim, length, written = 6, 2, 1000, 4, 5, 3
    state = _State(1, rows, capacity, 1)
    keys = torch.randn(rows, kv_heads, capacity, dim)
    values = torch.randn(rows, kv_heads, capacity, dim)
    state.keys, state.values = [keys], [values]
    state.start_decoding(length)
    state.pos += written  # prompt + 3 new tokens written
    widths = []
    select = torch.index_select

    def spy(source, *args, **kwargs):
        widths.append(source.shape[2])
        return select(source, *args, **kwargs)

    monkeypatch.setattr(torch, "index_select", spy)
    kept = torch.tensor([0, 2, 5])
    state.select(kept, kept)
    assert widths == [length + written] * 2
    assert state.keys[0].shape == (3, kv_heads, capacity, dim)
    assert torch.equal(state.keys[0][:, :, : length + written], keys[kept, :, : length + written])
    assert torch.equal(state.values[0][:, :, : length + written], values[kept, :, : length + written])
