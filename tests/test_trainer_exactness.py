"""GPPOTrainer's exactness claims, checked against the paper's equations computed here, independently.

A stub generation hands the trainer fixed completions of DIFFERENT lengths (some end on EOS, some at exactly
``max_completion_length`` with and without EOS), and a reward table by completion marks one group all-equal, so
after filtering the micro-batches of an optimizer step hold different token counts and different numbers of kept
samples. Two optimizer steps per rollout batch make the second step off-policy (the first step moved the weights,
so the ratio leaves the clip band). For each step the gradient the trainer accumulated is compared with the
gradient of ONE loss over the whole step, computed in float64 by this file's own code from the paper:

* advantages: Eq. 4 by prompt id, population std, epsilon 1e-6;
* policy loss per token: Eq. 1/5/6 (PPO, Clip-Higher), Eq. 11 (GPPO: the clip bounds written ``(1 -/+ eps) / sg(r)
  * r``), the only-high variant of Appendix A.2, Eq. 15 (CISPO), the dual clip, ERC (arXiv 2512.05591);
* aggregation: Eq. 7 token-mean (divided by the step's token count), Eq. 3 seq-mean-token-mean, seq-mean-token-sum
  (divided by the step's number of responses);
* Eq. 13/14: ``+ alpha *`` token-mean NLL of the step's correct responses.

Nothing of ``klear.rl.losses`` or the trainer's counts is used for the expected values; the log-probs come from a
plain forward of a copy of the model (``log_softmax(logits)``). The same harness checks the overlong filter, unscored
rewards and grouping without ``prompt_id``; the multi-process counts and row slicing run the trainer's methods with a
faked 2-process accelerator (a real 2-process run is in tests/test_multiprocess.py).
"""

from __future__ import annotations

import copy
import math
from collections import defaultdict

import pytest
import torch
from datasets import Dataset
from transformers import TrainerCallback

from conftest import bare_gppo_trainer
from klear.rl.losses import LOSS_AGG_MODES, LOSS_MODES
from klear.rl.trainer import GPPOConfig, GPPOTrainer

G = 5  # responses per prompt
N_PROMPTS = 4
N_ROWS = G * N_PROMPTS  # one rollout batch: per_device_train_batch_size 5 x steps_per_generation 4
T_MAX = 8  # max_completion_length
MARKER = 1000  # the first token of row j's completion is MARKER + j
EPS_ADV = 1e-6
NAN = float("nan")

# Row j = (group j // G, member j % G): completion length and whether it ends on EOS. Rows of length T_MAX without
# EOS are truncated (finish reason "length"); row 17 stops on EOS exactly at the limit (finished, not truncated).
LENGTHS = [2, 7, 5, 8, 3, 6, 4, 2, 8, 5, 3, 8, 6, 4, 2, 7, 5, 8, 3, 6]
ENDS_ON_EOS = [n < T_MAX for n in LENGTHS]
ENDS_ON_EOS[17] = True
# Raw rewards (group 1 all equal: a zero-advantage group; 1.0 is the correct score).
REWARDS = [[1.0, -1.0, -1.0, 1.0, -1.0], [1.0] * 5, [0.5, -1.0, 1.0, 0.0, 1.0], [-1.0, -1.0, -1.0, -1.0, 1.0]]


def _completion(j: int, eos: int) -> list[int]:
    filler = [300 + (37 * j + 11 * k) % 4000 for k in range(LENGTHS[j] - 2)]
    return [MARKER + j, *filler, eos if ENDS_ON_EOS[j] else 777]


class _Record(TrainerCallback):
    """Parameters at train start; parameters and accumulated gradients just before each optimizer step."""

    def __init__(self):
        self.params0: dict[str, torch.Tensor] = {}
        self.steps: list[tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]] = []

    def on_train_begin(self, args, state, control, model=None, **kw):
        self.params0 = {k: v.detach().clone() for k, v in model.named_parameters()}

    def on_pre_optimizer_step(self, args, state, control, model=None, **kw):
        params = {k: v.detach().clone() for k, v in model.named_parameters()}
        grads = {k: v.grad.detach().clone() for k, v in model.named_parameters() if v.grad is not None}
        self.steps.append((params, grads))


class _Rollout:
    """The stub generation and reward: fixed completions, rewards looked up by the completion's marker token.

    ``table`` gives each row's reward (None: unscored); ``extra`` optionally a second reward function's values.
    The reward calls record each row's prompt and prompt id, the group key the reference uses.
    """

    def __init__(self, eos: int, table=REWARDS, extra: dict[int, float | None] | None = None):
        self.completions = [_completion(j, eos) for j in range(N_ROWS)]
        self.eos = eos
        self.table = table
        self.extra = extra
        self.prompt_of: dict[int, str] = {}

    def generate(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        assert len(prompt_ids) == N_ROWS and num_generations == G
        return [list(c) for c in self.completions], None

    def reward(self, prompts, completions, completion_ids, **kw):
        out = []
        for i, ids in enumerate(completion_ids):
            j = ids[0] - MARKER
            pid = kw["prompt_id"][i] if "prompt_id" in kw else None
            self.prompt_of[j] = pid if pid is not None else repr(prompts[i])
            out.append(self.table[j // G][j % G])
        return out

    def extra_reward(self, prompts, completions, completion_ids, **kw):
        return [self.extra.get(ids[0] - MARKER, 0.0) for ids in completion_ids]

    # ---- the reference's view of the rollout (the paper's rules, by hand)
    def scored(self, j: int) -> bool:
        values = [self.table[j // G][j % G]] + ([self.extra.get(j, 0.0)] if self.extra is not None else [])
        return all(v is not None and not math.isnan(v) for v in values)

    def reward_of(self, j: int) -> float:
        return self.table[j // G][j % G] + (self.extra.get(j, 0.0) if self.extra is not None else 0.0)

    def truncated(self, j: int) -> bool:
        return len(self.completions[j]) == T_MAX and self.completions[j][-1] != self.eos

    def advantages(self) -> tuple[dict[int, float], set[int]]:
        """Eq. 4 by prompt id over the scored members (population std); and the rows of all-equal groups (or groups
        with fewer than 2 scored members), which carry no gradient."""
        groups: dict[str, list[int]] = defaultdict(list)
        for j in range(N_ROWS):
            if self.scored(j):
                groups[self.prompt_of[j]].append(j)
        adv, zero = {}, set()
        for rows in groups.values():
            r = [self.reward_of(j) for j in rows]
            if len(set(r)) < 2:
                zero.update(rows)
                continue
            mean = sum(r) / len(r)
            std = math.sqrt(sum((x - mean) ** 2 for x in r) / len(r))
            adv.update({j: (x - mean) / (std + EPS_ADV) for j, x in zip(rows, r, strict=True)})
        return adv, zero

    def kept(self, overlong_filter: bool) -> set[int]:
        adv, zero = self.advantages()
        return {j for j in adv if j not in zero and not (overlong_filter and self.truncated(j))}


def _dataset(with_prompt_id: bool = True) -> Dataset:
    rows = []
    for i in range(N_PROMPTS):
        row = {"prompt": f"{i} + {i} ="}  # plain text: a few prompt tokens keep the forward passes cheap
        if with_prompt_id:
            row["prompt_id"] = f"p{i}"
        rows.append(row)
    return Dataset.from_list(rows)


def _train(tmp_path, tiny_model, rollout_kw=None, dataset=None, **config):
    """One rollout batch through GPPOTrainer (float64 model); returns (trainer, record, rollout, model at start)."""
    model, tok = tiny_model
    model = model.double()
    model0 = copy.deepcopy(model)
    rollout = _Rollout(tok.eos_token_id, **(rollout_kw or {}))
    base = dict(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=5,
        gradient_accumulation_steps=2,
        steps_per_generation=4,  # 2 optimizer steps per rollout batch: the second is off-policy
        num_generations=G,
        max_completion_length=T_MAX,
        max_steps=2,
        learning_rate=0.1,  # large: the second step's ratios leave the clip band
        clip_ratio_c=1.05,  # low enough that the dual clip acts too
        alpha=0.3,
        use_cpu=True,
        report_to=[],
        logging_steps=1,
        save_strategy="no",
        seed=0,
        max_grad_norm=1e9,  # no gradient clipping: the raw accumulated gradients are compared
        bf16=False,  # TRL's default is bf16 autocast; here float64 weights (TRL's log-softmax sums in float32)
        gradient_checkpointing=False,  # TRL's default; only costs time here
    )
    base.update(config)
    funcs = [rollout.reward] if rollout.extra is None else [rollout.reward, rollout.extra_reward]
    rec = _Record()
    trainer = GPPOTrainer(
        model=model,
        reward_funcs=funcs,
        args=GPPOConfig(**base),
        train_dataset=dataset if dataset is not None else _dataset(),
        processing_class=tok,
        callbacks=[rec],
    )
    trainer._generate_single_turn = rollout.generate
    trainer.train()
    return trainer, rec, rollout, model0


# ---------------------------------------------------------------------------------------- the reference
def _log_probs_and_entropies(model, prompt_ids, prompt_mask, completions):
    """(log pi (B, T), entropy (B, T), mask (B, T)) of the completion tokens, from plain logits in float64."""
    width = max(len(c) for c in completions)
    comp = torch.tensor([c + [0] * (width - len(c)) for c in completions])
    mask = torch.tensor([[1.0] * len(c) + [0.0] * (width - len(c)) for c in completions], dtype=torch.float64)
    ids = torch.cat([prompt_ids, comp], dim=1)
    attn = torch.cat([prompt_mask, mask.long()], dim=1)
    logits = model(input_ids=ids, attention_mask=attn).logits[:, prompt_ids.size(1) - 1 : -1].double()
    logp_all = torch.log_softmax(logits, dim=-1)
    logp = logp_all.gather(-1, comp.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy.detach(), mask


def _paper_token_loss(mode, lp, old, adv, ent, old_ent, args):
    """Per-token loss ``(B, T)`` of ``mode`` from the paper's equations (module docstring); minimised."""
    lo, hi, c = 1 - args.clip_ratio_low, 1 + args.clip_ratio_high, args.clip_ratio_c
    r = torch.exp(lp - old)
    sg_r = r.detach()
    a = adv.unsqueeze(1).expand_as(lp)
    base = mode.removesuffix("_erc")
    if base == "cispo":  # Eq. 15
        loss = -sg_r.clamp(lo, hi) * a * lp
    else:  # Eq. 1/5 with the clip bounds of Eq. 11 (GPPO) where the mode keeps the clipped gradient
        low = lo / sg_r * r if base == "gppo" else torch.full_like(r, lo)
        high = hi / sg_r * r if base in ("gppo", "gppo_only_high") else torch.full_like(r, hi)
        clipped = torch.where(sg_r < lo, low, torch.where(sg_r > hi, high, r))
        loss = -torch.minimum(r * a, clipped * a)
    if c is not None:  # dual clip: a negative-advantage token with r > c contributes the constant -A*c
        loss = torch.where((a < 0) & (sg_r > c), -c * a, loss)  # = min(L, -A*c) for the PPO family
    if mode.endswith("_erc"):  # ERC: no gradient where H/H_old leaves (1 - erc_low, 1 + erc_high)
        rho = (ent + 1e-8) / (old_ent + 1e-8)
        inside = (rho > 1 - args.erc_low) & (rho < 1 + args.erc_high)
        loss = torch.where(inside, loss, loss.detach())
    return loss


def _paper_loss(lp, old, adv, mask, correct, ent, old_ent, args) -> torch.Tensor:
    """``L = L_pg + alpha * L_LM`` (Eq. 14) of ONE batch holding every response of an optimizer step.

    ``lp``/``old``/``ent``/``old_ent``/``mask`` ``(B, T)``, ``adv``/``correct`` ``(B,)``; every row is kept (has
    tokens). The divisors are this batch's own counts: the step's tokens (Eq. 7), responses (Eq. 3), correct
    responses' tokens (Eq. 13).
    """
    tok = torch.where(mask.bool(), _paper_token_loss(args.loss_mode, lp, old, adv, ent, old_ent, args), 0.0)
    if args.loss_agg_mode == "token-mean":  # Eq. 7
        pg = tok.sum() / mask.sum()
    elif args.loss_agg_mode == "seq-mean-token-mean":  # Eq. 3
        pg = (tok.sum(1) / mask.sum(1)).sum() / len(mask)
    else:  # seq-mean-token-sum
        pg = tok.sum(1).sum() / len(mask)
    sft_mask = mask.bool() & correct.bool().unsqueeze(1)
    sft = -torch.where(sft_mask, lp, 0.0).sum() / sft_mask.sum().clamp(min=1)  # Eq. 13; 0 without correct tokens
    return pg + args.alpha * sft


def _load(model, params: dict[str, torch.Tensor]) -> None:
    for k, p in model.named_parameters():
        p.copy_(params[k])


def _window_rows(trainer) -> list[list[list[int]]]:
    """Row numbers (marker - MARKER) of each micro-batch of each optimizer step, as the trainer split them."""
    ga = trainer.args.gradient_accumulation_steps
    mbs = [(mb["completion_ids"][:, 0] - MARKER).tolist() for mb in trainer._buffered_inputs]
    return [mbs[i : i + ga] for i in range(0, len(mbs), ga)]


def _check_against_reference(trainer, rec, rollout, model0, tol=1e-5):
    """Compare every optimizer step's accumulated gradient with the one-batch gradient of the paper's loss over the
    step's kept rows; returns per-step statistics of the reference (token/row counts, clipped tokens)."""
    args = trainer.args
    adv, _ = rollout.advantages()
    kept = rollout.kept(args.overlong_filter)
    # The prompt tokens of each row (the tokenised prompt, as every micro-batch carries it).
    prompt = {}
    for mb in trainer._buffered_inputs:
        for row, ids, m in zip((mb["completion_ids"][:, 0] - MARKER).tolist(), mb["prompt_ids"], mb["prompt_mask"]):
            prompt[row] = (ids, m)
    windows = _window_rows(trainer)
    assert len(windows) == len(rec.steps) == args.steps_per_generation // args.gradient_accumulation_steps
    in_batches = sorted(j for w in windows for mb in w for j in mb)
    # Filtered rows are physically dropped (no placeholders needed here: more kept rows than micro-batches), and
    # every kept row is in exactly one optimizer step.
    assert in_batches == sorted(kept), (
        f"rows in the micro-batches {in_batches}, kept by the paper's rules {sorted(kept)}"
    )
    for mb in trainer._buffered_inputs:  # the trainer's advantages are Eq. 4's (stored in float32)
        got = dict(zip((mb["completion_ids"][:, 0] - MARKER).tolist(), mb["advantages"].tolist(), strict=True))
        assert got == pytest.approx({j: adv[j] for j in got}, rel=1e-6, abs=1e-7)
        assert mb["klear_keep"].all()

    ref = copy.deepcopy(model0)
    ref.train()
    stats = []
    for (params, grads), window in zip(rec.steps, windows, strict=True):
        rows = [j for mb in window for j in mb if j in kept]
        p_ids = torch.stack([prompt[j][0] for j in rows])
        p_mask = torch.stack([prompt[j][1] for j in rows])
        comps = [rollout.completions[j] for j in rows]
        with torch.no_grad():  # the rollout policy: the weights before the rollout batch's first update
            _load(ref, rec.params0)
            old, old_ent, _ = _log_probs_and_entropies(ref, p_ids, p_mask, comps)
            _load(ref, params)
        ref.zero_grad()
        lp, ent, mask = _log_probs_and_entropies(ref, p_ids, p_mask, comps)
        a = torch.tensor([adv[j] for j in rows], dtype=torch.float64)
        correct = torch.tensor([rollout.reward_of(j) >= args.correct_reward for j in rows], dtype=torch.float64)
        _paper_loss(lp, old, a, mask, correct, ent, old_ent, args).backward()
        assert grads.keys() == {k for k, p in ref.named_parameters() if p.grad is not None}
        for k, g in grads.items():
            want = dict(ref.named_parameters())[k].grad
            err = ((g - want).norm() / want.norm().clamp(min=1e-30)).item()
            assert err < tol, (k, err)
        with torch.no_grad():
            r = torch.exp(lp - old)
            m = mask.bool()
            am = a.unsqueeze(1).expand_as(r)
            rho = (ent + 1e-8) / (old_ent + 1e-8)
            stats.append(
                {
                    "tokens": [sum(len(rollout.completions[j]) for j in mb if j in kept) for mb in window],
                    "rows": [sum(j in kept for j in mb) for mb in window],
                    "ratio_off": int((m & ((r - 1).abs() > 1e-6)).sum()),
                    "above_hi": int((m & (r > 1 + args.clip_ratio_high)).sum()),
                    "below_lo": int((m & (r < 1 - args.clip_ratio_low)).sum()),
                    "clip_high": int((m & (am > 0) & (r > 1 + args.clip_ratio_high)).sum()),
                    "clip_low": int((m & (am < 0) & (r < 1 - args.clip_ratio_low)).sum()),
                    "dual": int((m & (am < 0) & (r > (args.clip_ratio_c or math.inf))).sum()),
                    "erc_out": int((m & ((rho <= 1 - args.erc_low) | (rho >= 1 + args.erc_high))).sum()),
                    "tokens_total": int(m.sum()),
                }
            )
    return stats


# ---------------------------------------------------------------------------------------- 1. exact windows
# Every loss mode once and every aggregation twice (a trainer run each; the per-token math of a mode does not depend
# on the aggregation, and tests/test_losses.py checks each mode's values and gradients in every aggregation).
MODE_CASES = [
    ("gppo", "token-mean"),  # the paper's setting
    ("ppo_clip", "token-mean"),
    ("gppo_only_high", "seq-mean-token-mean"),
    ("gppo_erc", "seq-mean-token-mean"),
    ("cispo", "seq-mean-token-sum"),
    ("ppo_erc", "seq-mean-token-sum"),
]


def test_every_loss_mode_and_aggregation_is_covered():
    assert {m for m, _ in MODE_CASES} == set(LOSS_MODES)
    assert {a for _, a in MODE_CASES} == set(LOSS_AGG_MODES)


@pytest.mark.parametrize("loss_mode, loss_agg_mode", MODE_CASES)
def test_accumulated_gradient_is_the_paper_loss_over_the_step(tmp_path, tiny_model, loss_mode, loss_agg_mode):
    """Unequal micro-batches (token counts and kept rows), an off-policy second step where the clip acts: each
    optimizer step's accumulated gradient equals that of one loss over the step (Eq. 4, 7/3, 11/15, 13, 14)."""
    # The tiny random model is near-uniform (entropy ~ ln 49152): one step moves H/H_old by ~1e-3 to 5e-3, so ERC gets a
    # band of that size to act in.
    erc = {"erc_low": 2e-3, "erc_high": 2e-3} if loss_mode.endswith("_erc") else {}
    trainer, rec, rollout, model0 = _train(
        tmp_path, tiny_model, loss_mode=loss_mode, loss_agg_mode=loss_agg_mode, **erc
    )
    stats = _check_against_reference(trainer, rec, rollout, model0)
    on, off = stats
    # What makes this bite: per-micro-batch normalisation would weigh these micro-batches differently.
    assert len(set(on["tokens"])) == 2 and len(set(off["tokens"])) == 2, stats
    assert len(set(off["rows"])) == 2, stats  # 15 kept rows over 4 micro-batches: 4, 4 | 4, 3
    assert on["ratio_off"] == 0  # the first step's weights are the rollout's (on-policy)
    # The second is off-policy, and the clip acts on both sides, the dual clip too.
    if loss_mode.startswith("cispo"):
        assert off["above_hi"] > 0 and off["below_lo"] > 0, off
    else:
        assert off["clip_high"] > 0 and off["clip_low"] > 0, off
    assert off["dual"] > 0, off
    if loss_mode.endswith("_erc"):  # ERC takes the gradient of some tokens, not of all
        assert 0 < off["erc_out"] < off["tokens_total"], off


@pytest.mark.parametrize("share_prompt_forward", [False, True])
def test_both_log_prob_passes_give_the_paper_gradient(tmp_path, tiny_model, monkeypatch, share_prompt_forward):
    """The whole-row pass (TRL's, what a GPU run uses) and the shared-prompt pass (klear.rl.shared_prompt, the CPU
    default) each give the reference gradient; the switch really switches (the shared pass runs or not)."""
    import klear.rl.trainer as trainer_module

    calls = []
    shared = trainer_module.shared_prompt_log_probs
    monkeypatch.setattr(trainer_module, "shared_prompt_log_probs", lambda *a, **k: calls.append(1) or shared(*a, **k))
    trainer, rec, rollout, model0 = _train(tmp_path, tiny_model, share_prompt_forward=share_prompt_forward)
    _check_against_reference(trainer, rec, rollout, model0)
    assert bool(calls) is share_prompt_forward


# ---------------------------------------------------------------------------------------- 2. several processes
class _Rank:
    """The accelerator of process ``process_index`` of a 2-process run. Collectives combine this process's tensor
    with the other process's, which the test supplies: ``other_counts`` for the all-reduce of the optimizer-step
    counts (other tensors are reduced as if the other process held the same), ``other_gathered`` in call order."""

    num_processes = 2
    device = torch.device("cpu")

    def __init__(self, process_index: int, other_counts=None, other_gathered=()):
        self.process_index = process_index
        self.other_counts = other_counts
        self.other_gathered = list(other_gathered)

    def reduce(self, tensor, reduction="sum"):
        assert reduction == "sum"
        counts = self.other_counts is not None and tensor.shape == self.other_counts.shape
        return tensor + (self.other_counts if counts else tensor)

    def gather(self, tensor):
        other = self.other_gathered.pop(0) if self.other_gathered else tensor
        return torch.cat([other, tensor] if self.process_index == 1 else [tensor, other])


def _random_micro_batches(gen, n_micro=4, t=6):
    """Micro-batches of one process: 2 or 3 rows of up to ``t`` tokens, some rows filtered; log-probs off-policy."""
    out = []
    for i in range(n_micro):
        b = 2 + (i % 2)
        lengths = torch.randint(1, t + 1, (b,), generator=gen)
        old = -torch.rand(b, t, generator=gen, dtype=torch.float64) - 0.5
        out.append(
            {
                "completion_mask": (torch.arange(t) < lengths[:, None]).long(),
                "klear_keep": torch.rand(b, generator=gen) < 0.8,
                "klear_is_correct": torch.rand(b, generator=gen) < 0.5,
                "advantages": torch.randn(b, generator=gen, dtype=torch.float64),
                "old_per_token_logps": old,
                "log_prob": (old + 0.4 * torch.randn(b, t, generator=gen, dtype=torch.float64)).requires_grad_(True),
                "entropies": torch.rand(b, t, generator=gen, dtype=torch.float64) + 1.0,
            }
        )
    return out


def _given_log_probs(model, inputs, compute_entropy=False):
    """Stands in for the policy forward: the micro-batch's own ``log_prob`` leaf and entropies."""
    return inputs["log_prob"], inputs["entropies"]


def _own_counts(micro_batches, ga):
    """Per optimizer step of one process: [kept tokens, kept tokens of correct rows, kept rows], by hand."""
    rows = []
    for w in range(0, len(micro_batches), ga):
        tokens = sft = seqs = 0
        for mb in micro_batches[w : w + ga]:
            for n, keep, correct in zip(
                mb["completion_mask"].sum(1).tolist(), mb["klear_keep"].tolist(), mb["klear_is_correct"].tolist()
            ):
                tokens += n * keep
                sft += n * keep * correct
                seqs += keep and n > 0
        rows.append([tokens, sft, seqs])
    return torch.tensor(rows, dtype=torch.float64)


@pytest.mark.parametrize("loss_agg_mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_two_processes_counts_make_the_averaged_gradient_the_global_one(tmp_path, loss_agg_mode):
    """Each process divides by the optimizer step's count over BOTH processes, halved because DDP averages the
    gradients: the average of the two processes' gradients is the gradient of one loss over all rows (Eq. 7/3, 13,
    14), and the logged divisors are the global counts."""
    ga = 2
    args = GPPOConfig(
        output_dir=str(tmp_path),
        use_cpu=True,
        report_to=[],
        per_device_train_batch_size=3,
        num_generations=3,
        gradient_accumulation_steps=ga,
        steps_per_generation=4,
        loss_mode="gppo",
        loss_agg_mode=loss_agg_mode,
        clip_ratio_c=3.0,
        alpha=0.3,
    )
    gen = torch.Generator().manual_seed(0)
    ranks = [_random_micro_batches(gen), _random_micro_batches(gen)]
    counts = [_own_counts(mbs, ga) for mbs in ranks]
    assert not torch.equal(counts[0], counts[1])  # the processes hold different counts
    for rank, mbs in enumerate(ranks):
        trainer = bare_gppo_trainer(args, _Rank(rank, other_counts=counts[1 - rank]))
        trainer._policy_log_probs = _given_log_probs
        trainer._annotate_optimizer_windows(mbs)
        for i, mb in enumerate(mbs):
            total = counts[0][i // ga] + counts[1][i // ga]
            assert [mb[k] for k in ("klear_num_tokens", "klear_num_sft_tokens", "klear_num_seqs")] == (
                (total / 2).tolist()
            )
            trainer._compute_loss(None, mb).backward()
        trainer._flush_metrics()  # the metrics stay on the device until the logged step reads them
        logged = trainer._metrics["train"]["klear/num_loss_tokens"]
        assert logged == [(counts[0][i // ga, 0] + counts[1][i // ga, 0]).item() for i in range(len(mbs))]

    for w in range(0, 4, ga):  # one optimizer step: its micro-batches on both processes, as one batch
        mbs = [mb for r in ranks for mb in r[w : w + ga]]
        keep = torch.cat([mb["klear_keep"] & (mb["completion_mask"].sum(1) > 0) for mb in mbs])
        lp = torch.cat([mb["log_prob"].detach() for mb in mbs])[keep].requires_grad_(True)
        cat = {
            k: torch.cat([mb[k] for mb in mbs])[keep] for k in ("old_per_token_logps", "advantages", "klear_is_correct")
        }
        mask = torch.cat([mb["completion_mask"] for mb in mbs])[keep]
        old, adv, correct = cat["old_per_token_logps"], cat["advantages"], cat["klear_is_correct"]
        _paper_loss(lp, old, adv, mask, correct, None, None, args).backward()
        averaged = torch.cat([mb["log_prob"].grad for mb in mbs])[keep] / 2  # DDP: mean over the 2 processes
        torch.testing.assert_close(averaged, lp.grad, rtol=1e-10, atol=1e-12)
        assert torch.all(torch.cat([mb["log_prob"].grad for mb in mbs])[~keep] == 0)


@pytest.mark.parametrize("process_index", [0, 1])
def test_a_process_takes_its_own_rows_of_the_gathered_rollout(tmp_path, monkeypatch, process_index):
    """2 processes x 4 rows; prompt "a" has rows on both processes (rewards 1, 0 | -1, 1), "b" is all-equal. Each
    process gets Eq. 4 advantages (group statistics over BOTH processes) of ITS rows, its rows' keep and correctness
    flags, and metrics over both processes."""
    from accelerate import utils as accelerate_utils
    from trl import GRPOTrainer

    from klear.rl.trainer import TIMING_PHASES

    ids = [["a", "a", "b", "b"], ["a", "a", "b", "b"]]  # prompt id of each row, per process
    rewards = [[1.0, 0.0, 1.0, 1.0], [-1.0, 1.0, 1.0, 1.0]]
    eos, limit = 2, 4
    # process 0: row 1 truncated (at the limit, no EOS); process 1: row 0 truncated, row 1 stops on EOS at the limit
    completions = [
        [[5, 6, eos, 0], [5, 6, 7, 8], [5, eos, 0, 0], [5, 6, 7, eos]],
        [[5, 6, 7, 8], [5, 6, 7, eos], [5, 6, eos, 0], [5, eos, 0, 0]],
    ]
    masks = [[[int(t != 0) for t in c] for c in proc] for proc in completions]
    truncated = [[False, True, False, False], [True, False, False, False]]
    # Eq. 4 by hand for group a = (1, 0, -1, 1): mean 1/4, population std sqrt(11/16).
    std_a = math.sqrt(11 / 16)
    adv = [[(r - 0.25) / (std_a + EPS_ADV) for r in (1.0, 0.0)] + [0.0, 0.0]]
    adv.append([(r - 0.25) / (std_a + EPS_ADV) for r in (-1.0, 1.0)] + [0.0, 0.0])
    keep = [[True, False, False, False], [False, True, False, False]]  # b filtered; truncated rows masked
    correct = [[r >= 1.0 for r in proc] for proc in rewards]

    me, other = process_index, 1 - process_index
    gathered = {  # what TRL gathers over processes, in process order
        "rewards": torch.tensor(rewards[0] + rewards[1]).unsqueeze(1),
        "ids": ids[0] + ids[1],
    }
    monkeypatch.setattr(GRPOTrainer, "_calculate_rewards", lambda self, *a: gathered["rewards"])
    monkeypatch.setattr(accelerate_utils, "gather_object", lambda local: gathered["ids"] if local == ids[me] else None)

    def trl_rollout(self, inputs):  # TRL's generation and scoring, as seen by this process
        self._calculate_rewards(inputs, [x["prompt"] for x in inputs], None, None)
        return {
            "completion_ids": torch.tensor(completions[me]),
            "completion_mask": torch.tensor(masks[me]),
            "advantages": torch.zeros(4),
        }

    monkeypatch.setattr(GRPOTrainer, "_generate_and_score_completions", trl_rollout)
    args = GPPOConfig(
        output_dir=str(tmp_path), use_cpu=True, report_to=[], per_device_train_batch_size=4, num_generations=4,
        max_completion_length=limit, overlong_filter=True,
    )  # fmt: skip
    other_gathered = [torch.tensor(truncated[other]), torch.tensor(keep[other])]  # gather order: truncated, keep
    trainer = bare_gppo_trainer(args, _Rank(me, other_gathered=other_gathered))
    trainer.reward_weights = torch.ones(1)
    trainer.max_completion_length = limit
    trainer.eos_token_ids = [eos]
    trainer._klear_time = dict.fromkeys(TIMING_PHASES, 0.0)
    trainer._klear_rollout = None
    out = trainer._generate_and_score_completions([{"prompt": f"q{p}", "prompt_id": p} for p in ids[me]])

    assert out["advantages"].tolist() == pytest.approx(adv[me], rel=1e-6)
    assert out["klear_keep"].tolist() == keep[me]
    assert out["klear_is_correct"].tolist() == correct[me]
    m = trainer._metrics["train"]
    assert m["klear/accuracy"] == [pytest.approx(6 / 8)]
    assert m["klear/truncated_frac"] == [pytest.approx(2 / 8)]
    assert m["klear/filtered_sample_frac"] == [pytest.approx(6 / 8)]
    assert m["klear/zero_adv_group_frac"] == [pytest.approx(1 / 2)]


# ---------------------------------------------------------------------------------------- 3-5. filters and groups
# One optimizer step on one rollout batch (2 micro-batches of the 20 rows, before filtering).
ONE_STEP = {"per_device_train_batch_size": 10, "steps_per_generation": 2, "max_steps": 1}


def _rows_in_loss(trainer) -> set[int]:
    rows = set()
    for mb in trainer._buffered_inputs:
        rows |= {j for j, k in zip((mb["completion_ids"][:, 0] - MARKER).tolist(), mb["klear_keep"].tolist()) if k}
    return rows


def _first_log(trainer) -> dict:
    return next(h for h in trainer.state.log_history if "klear/accuracy" in h)


def test_overlong_filter_takes_truncated_responses_out_of_the_loss(tmp_path, tiny_model):
    """overlong_filter=True: the responses cut at max_completion_length (rows 3, 8, 11; row 17 stops on EOS exactly at
    the limit, so it is finished) contribute no gradient and no token to the divisor; their group's advantages still
    use their rewards. The logged rollout metrics equal the counts by hand."""
    trainer, rec, rollout, model0 = _train(tmp_path, tiny_model, overlong_filter=True, **ONE_STEP)
    assert [j for j in range(N_ROWS) if rollout.truncated(j)] == [3, 8, 11]
    _check_against_reference(trainer, rec, rollout, model0)  # the reference leaves rows 3, 8, 11 out
    assert _rows_in_loss(trainer) == {0, 1, 2, 4, 10, 12, 13, 14, 15, 16, 17, 18, 19}
    log = _first_log(trainer)
    assert log["klear/truncated_frac"] == pytest.approx(3 / 20)
    # out of the loss: group 1 (rows 5-9, all rewards 1.0) and the truncated rows 3 and 11 -> 7 of 20
    assert log["klear/filtered_sample_frac"] == pytest.approx(7 / 20)
    # correct (reward 1.0) of 20 scored: rows 0, 3 | 5-9 | 12, 14 | 19 (truncation does not change correctness)
    assert log["klear/accuracy"] == pytest.approx(10 / 20)
    # kept tokens: rows 0, 1, 2, 4 (2+7+5+3) + 10, 12, 13, 14 (3+6+4+2) + 15-19 (7+5+8+3+6)
    assert log["klear/num_loss_tokens"] == 17 + 15 + 29


# Row 2 None and row 10 NaN (first reward function); row 13 None from the second function only (TRL would score it
# with the first); group 3 keeps one scored row (a group of one: no advantage).
UNSCORED_TABLE = [
    [1.0, -1.0, None, 1.0, -1.0],
    [1.0] * 5,
    [NAN, -1.0, 1.0, 0.5, 1.0],
    [None, None, None, None, 1.0],
]


def test_unscored_rewards_are_out_of_the_loss_and_of_their_groups_statistics(tmp_path, tiny_model):
    """A reward function that returns None or NaN for a row (the judge could not score it) takes that row out of the
    loss, out of its group's mean and std (Eq. 4 over the scored members) and out of the accuracy."""
    trainer, rec, rollout, model0 = _train(
        tmp_path, tiny_model, rollout_kw={"table": UNSCORED_TABLE, "extra": {13: None}}, **ONE_STEP
    )
    unscored = [j for j in range(N_ROWS) if not rollout.scored(j)]
    assert unscored == [2, 10, 13, 15, 16, 17, 18]
    _check_against_reference(trainer, rec, rollout, model0)
    assert _rows_in_loss(trainer) == {0, 1, 3, 4, 11, 12, 14}
    log = _first_log(trainer)
    assert log["klear/unscored_frac"] == pytest.approx(7 / 20)
    assert log["klear/accuracy"] == pytest.approx(10 / 13)  # rows 0, 3 | 5-9 | 12, 14 | 19 of the 13 scored
    assert log["klear/zero_adv_group_frac"] == pytest.approx(2 / 4)  # group 1 all equal, group 3 one scored row
    assert log["klear/filtered_sample_frac"] == pytest.approx(13 / 20)
    assert log["klear/num_loss_tokens"] == (2 + 7 + 8 + 3) + (8 + 6 + 2)


def test_rows_without_prompt_id_are_grouped_by_their_prompt(tmp_path, tiny_model):
    """A dataset without prompt_id: each prompt's G responses form one group (keyed by the prompt itself), so the
    advantages, the zero-advantage filter and the gradient are those of the four prompt groups."""
    trainer, rec, rollout, model0 = _train(tmp_path, tiny_model, dataset=_dataset(with_prompt_id=False), **ONE_STEP)
    groups = defaultdict(set)
    for j, prompt in rollout.prompt_of.items():
        groups[prompt].add(j // G)
    assert len(groups) == N_PROMPTS and all(len(g) == 1 for g in groups.values())  # the reference's key: the prompt
    _check_against_reference(trainer, rec, rollout, model0)
    assert _rows_in_loss(trainer) == set(range(N_ROWS)) - {5, 6, 7, 8, 9}
