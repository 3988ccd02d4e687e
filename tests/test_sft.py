"""klear sft: response-only token-level NLL, the cosine-to-floor schedule, data loading, the job."""

from __future__ import annotations

import json
import math

import pytest
import yaml

from conftest import RUN_FILES, sft_row

PROMPTS = [
    ("What is 2+2?", "<think>2+2=4</think> \\boxed{4}"),
    ("Compute 7 * 8 please, and show your work in detail.", "<think>7*8 = 56</think>\nThe answer is \\boxed{56}."),
    ("1+1?", "2"),
    ("Name a prime number greater than ten.", "<think>11 is prime</think> \\boxed{11} and some more text here"),
]


def _pc_dataset(system: str | None = "Be brief."):
    import datasets

    rows = []
    for q, a in PROMPTS:
        prompt = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": q}]
        rows.append({"prompt": prompt, "completion": [{"role": "assistant", "content": a}]})
    return datasets.Dataset.from_list(rows)


class _Logs:
    """What a run's callback saw: ``rows``, the logs of training steps (those with a loss, and their step);
    ``steps``, with ``grads``, the accumulated gradients just before each optimizer step."""

    def __init__(self, grads: bool = False):
        from transformers import TrainerCallback

        outer = self
        self.rows: list[dict] = []
        self.steps: list[dict] = []

        class CB(TrainerCallback):
            def on_log(self, args, state, control, logs=None, **kwargs):
                if logs and "loss" in logs:
                    outer.rows.append({"step": state.global_step, **logs})

            def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
                if grads:
                    outer.steps.append({k: p.grad.detach().clone() for k, p in model.named_parameters()})

        self.callback = CB()


def _args(tmp_path, **kw):
    from klear.sft.trainer import KlearSFTConfig

    base = dict(
        output_dir=str(tmp_path / "ckpt"),
        learning_rate=0.0,
        max_steps=1,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        bf16=False,
        gradient_checkpointing=False,
        save_strategy="no",
        seed=0,
        max_length=256,
    )
    base.update(kw)
    return KlearSFTConfig(**base)


def _response_nll(model, tok, rows):
    """(sum of response-token NLL, #response tokens, sum of NLL over all tokens, #tokens), float64."""
    import torch

    resp_sum, resp_n, all_sum, all_n = 0.0, 0, 0.0, 0
    model.eval()
    for r in rows:
        p_ids = tok.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=True, return_dict=True)[
            "input_ids"
        ]
        ids = tok.apply_chat_template(r["prompt"] + r["completion"], tokenize=True, return_dict=True)["input_ids"]
        assert ids[: len(p_ids)] == p_ids
        x = torch.tensor([ids])
        with torch.no_grad():
            logp = torch.log_softmax(model(x).logits.double(), dim=-1)[0]
        token_logp = logp[:-1].gather(-1, x[0, 1:, None])[:, 0]  # log p(token t+1 | tokens <= t)
        resp = token_logp[len(p_ids) - 1 :]  # predictions of the completion tokens only
        resp_sum += -resp.sum().item()
        resp_n += resp.numel()
        all_sum += -token_logp.sum().item()
        all_n += token_logp.numel()
    return resp_sum, resp_n, all_sum, all_n


def test_training_loss_is_token_mean_nll_of_response_tokens_over_the_optimizer_batch(tiny_model, tmp_path):
    """One optimizer step = 2 micro-batches of 2 examples: loss = sum NLL(response) / #response tokens of ALL 4."""
    from klear.sft.trainer import KlearSFTTrainer

    model, tok = tiny_model
    ds = _pc_dataset()
    logs = _Logs()
    trainer = KlearSFTTrainer(
        model=model,
        args=_args(
            tmp_path, per_device_train_batch_size=2, gradient_accumulation_steps=2, train_sampling_strategy="sequential"
        ),
        train_dataset=ds,
        processing_class=tok,
        callbacks=[logs.callback],
    )
    # prompt tokens are labelled -100, response tokens (incl. <|im_end|>) keep their ids
    for i, ex in enumerate(trainer.train_dataset):
        p_len = len(
            tok.apply_chat_template(ds[i]["prompt"], add_generation_prompt=True, tokenize=True, return_dict=True)[
                "input_ids"
            ]
        )
        assert all(lab == -100 for lab in ex["labels"][:p_len])
        assert ex["labels"][p_len:] == ex["input_ids"][p_len:]
        assert tok.eos_token_id in ex["labels"][p_len:]
    trainer.train()
    logged = logs.rows[0]["loss"]

    resp_sum, resp_n, all_sum, all_n = _response_nll(model, tok, ds.to_list())
    expected = resp_sum / resp_n
    assert logged == pytest.approx(expected, rel=2e-6, abs=2e-6)
    # what other averagings would give, far outside the tolerance
    assert abs(all_sum / all_n - expected) > 1e-3  # prompt tokens included
    per_example = [_response_nll(model, tok, [r]) for r in ds.to_list()]
    micro_means = [
        (per_example[0][0] + per_example[1][0]) / (per_example[0][1] + per_example[1][1]),
        (per_example[2][0] + per_example[3][0]) / (per_example[2][1] + per_example[3][1]),
    ]
    assert abs(sum(micro_means) / 2 - expected) > 1e-3  # mean of micro-batch means


@pytest.mark.parametrize("transformers_version", ["installed", "5.17.0"])
def test_accumulated_gradient_is_the_one_batch_gradient(tiny_model, tmp_path, monkeypatch, transformers_version):
    """2 micro-batches x 2 examples accumulate the gradient of ONE batch of 4 (token-mean over the step), on the
    installed transformers and on one before 5.19 (faked: TRL 1.16 reads ``transformers.__version__`` and then, for
    a trainer that sets ``loss_is_scaled_for_ga``, replaces ``compute_loss_func`` by a string; with that version
    ``Trainer`` ignores ``loss_is_scaled_for_ga``, which a trainer that leaves it None cannot tell apart)."""
    import copy

    import transformers

    from klear.sft.trainer import KlearSFTTrainer

    if transformers_version != "installed":
        monkeypatch.setattr(transformers, "__version__", transformers_version)
    model, tok = tiny_model
    grads, losses = [], []
    for batch, accumulation in ((2, 2), (4, 1)):
        recorder = _Logs(grads=True)
        trainer = KlearSFTTrainer(
            model=copy.deepcopy(model),
            args=_args(
                tmp_path,
                per_device_train_batch_size=batch,
                gradient_accumulation_steps=accumulation,
                train_sampling_strategy="sequential",
                max_grad_norm=0.0,  # no clipping: it would hide a scale error
            ),
            train_dataset=_pc_dataset(),
            processing_class=tok,
            callbacks=[recorder.callback],
        )
        trainer.train()
        assert len(recorder.steps) == 1
        grads.append(recorder.steps[0])
        losses.append(recorder.rows[0]["loss"])
    assert losses[0] == pytest.approx(losses[1], rel=1e-5)
    for name, one_batch in grads[1].items():
        assert float(one_batch.abs().max()) > 0, name
        assert torch_allclose(grads[0][name], one_batch), name


def torch_allclose(a, b) -> bool:
    import torch

    return bool(torch.allclose(a, b, rtol=1e-4, atol=1e-7))


def test_packing_gives_the_same_loss(tiny_model, tmp_path, embedded_path):
    """Best-fit packing keeps attention inside each example: the same loss as the padded batch."""
    from klear.models.embedded import tiny_random_model
    from klear.sft.trainer import KlearSFTTrainer

    losses = []
    for packing in (False, True):
        model, tok = tiny_random_model(embedded_path)
        logs = _Logs()
        args = _args(tmp_path, packing=packing, per_device_train_batch_size=1 if packing else 4, max_length=512)
        trainer = KlearSFTTrainer(
            model=model, args=args, train_dataset=_pc_dataset(), processing_class=tok, callbacks=[logs.callback]
        )
        if packing:
            assert len(trainer.train_dataset) == 1  # all four examples in one row
        trainer.train()
        losses.append(logs.rows[0]["loss"])
    assert losses[1] == pytest.approx(losses[0], rel=1e-5)


def test_cosine_to_floor_function():
    from klear.sft.trainer import cosine_to_floor_lr

    kw = dict(max_lr=8e-5, min_lr=4e-5, warmup_steps=10, total_steps=110)
    assert cosine_to_floor_lr(0, **kw) == 0.0
    assert cosine_to_floor_lr(5, **kw) == pytest.approx(4e-5, rel=1e-12)
    assert cosine_to_floor_lr(10, **kw) == pytest.approx(8e-5, rel=1e-12)
    assert cosine_to_floor_lr(60, **kw) == pytest.approx(6e-5, rel=1e-12)  # half way: the mean
    assert cosine_to_floor_lr(110, **kw) == pytest.approx(4e-5, rel=1e-12)
    assert cosine_to_floor_lr(500, **kw) == pytest.approx(4e-5, rel=1e-12)
    assert cosine_to_floor_lr(1, max_lr=1.0, min_lr=0.0, warmup_steps=0, total_steps=4) == pytest.approx(
        0.5 * (1 + math.cos(math.pi / 4))
    )
    for bad, message in (
        (dict(min_lr=9e-5), r"min_lr must be in \[0, max_lr=8e-05\], got 9e-05"),
        (dict(warmup_steps=111), r"warmup_steps must be in \[0, total_steps=110\], got 111"),
        (dict(total_steps=0, warmup_steps=0), "total_steps must be >= 1, got 0"),
    ):
        with pytest.raises(ValueError, match=message):
            cosine_to_floor_lr(1, **{**kw, **bad})


def test_paper_schedule_8e5_at_end_of_warmup_4e5_at_last_step(tiny_model, tmp_path):
    """The LR each optimizer step runs with, under configs/sft_klear.yaml's trainer settings."""
    from klear.config import load_config
    from klear.precision import resolve_trainer_precision
    from klear.sft.trainer import KlearSFTConfig, KlearSFTTrainer

    config, _ = load_config("sft_klear")
    cfg, _ = resolve_trainer_precision(config["trainer"])
    cfg.update(
        output_dir=str(tmp_path / "ckpt"),
        report_to=[],
        max_length=256,
        packing=False,
        gradient_checkpointing=False,
        dataset_num_proc=None,
    )  # the schedule does not depend on these
    args = KlearSFTConfig(**cfg)
    assert (args.learning_rate, args.lr_floor, args.num_train_epochs) == (8e-5, 4e-5, 4)
    model, tok = tiny_model
    trainer = KlearSFTTrainer(model=model, args=args, train_dataset=_pc_dataset(), processing_class=tok)
    total = 1000
    trainer.create_optimizer_and_scheduler(num_training_steps=total)
    warmup = args.get_warmup_steps(total)
    assert warmup >= 1
    used = []  # LR of optimizer step k = 1..total, read from the optimizer before the step
    for _ in range(total):
        used.append(trainer.optimizer.param_groups[0]["lr"])
        trainer.optimizer.step()
        trainer.lr_scheduler.step()
    assert used[warmup - 1] == pytest.approx(8e-5, rel=1e-12)
    assert used[-1] == pytest.approx(4e-5, rel=1e-12)
    assert max(used) == pytest.approx(8e-5, rel=1e-12)
    assert all(a <= b for a, b in zip(used[:warmup], used[1:warmup]))  # warm-up rises
    assert all(a >= b for a, b in zip(used[warmup - 1 :], used[warmup:]))  # then decays to the floor
    assert min(used[warmup:]) == pytest.approx(4e-5, rel=1e-12)


def test_load_sft_file_layouts_and_errors(tmp_path):
    from klear.sft.data import load_sft_file

    path = tmp_path / "sft.jsonl"
    rows = [
        {
            "messages": [{"role": "user", "content": "1+1?"}, {"role": "assistant", "content": "<think>x</think>2"}],
            "ground_truth": 2,
        },
        {"prompt": "2+2?", "response": "4", "difficulty": "easy"},
        {
            "prompt": [{"role": "system", "content": "s"}, {"role": "user", "content": "3+3?"}],
            "completion": [{"role": "assistant", "content": "6"}],
            "reward_model": {"ground_truth": "6"},
            "pass_rate": 0.25,
        },
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    ds = load_sft_file(path)
    assert ds[0]["prompt"] == [{"role": "user", "content": "1+1?"}]
    assert ds[0]["completion"] == [{"role": "assistant", "content": "<think>x</think>2"}]
    assert ds["ground_truth"] == ["2", None, "6"]
    assert ds[1]["prompt"] == [{"role": "user", "content": "2+2?"}] and ds[1]["difficulty"] == "easy"
    assert ds[2]["prompt"][0]["role"] == "system" and ds[2]["pass_rate"] == 0.25
    pq_path = tmp_path / "sft.parquet"
    ds.to_parquet(str(pq_path))
    assert load_sft_file(pq_path)["completion"] == ds["completion"]

    bad_rows = [
        ({"prompt": "q"}, "row 1: field 'response' is missing"),
        ({"messages": [{"role": "user", "content": "q"}]}, "row 1: field 'messages[0].role' is 'user'"),
        (
            {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": 3}]},
            "row 1: field 'messages[1].content' is int",
        ),
        ({"prompt": "q", "response": "  "}, "row 1: field 'response' is empty"),
        ({"question": "q"}, "row 1: no 'messages' and no 'prompt'"),
        ({"prompt": "q", "response": "a", "difficulty": "trivial"}, "row 1: field 'difficulty' is 'trivial'"),
    ]
    for rec, message in bad_rows:
        path.write_text(json.dumps(rows[1]) + "\n" + json.dumps(rec) + "\n")
        with pytest.raises(ValueError, match=str(path).replace(".", r"\.") + ": " + _re(message)):
            load_sft_file(path)
    with pytest.raises(FileNotFoundError, match=r"missing\.jsonl: no such file"):
        load_sft_file(tmp_path / "missing.jsonl")


def _re(text: str) -> str:
    import re

    return re.escape(text)


def test_filter_keeps_correct_easy_and_all_hard():
    import datasets

    from klear.sft.data import filter_sft_dataset

    ds = datasets.Dataset.from_list(
        [
            sft_row("\\boxed{4}", "4", "easy"),
            sft_row("no box", "4", "easy"),
            sft_row("no box", "5", "hard"),
            sft_row("\\boxed{5}", "5", "hard"),
        ]
    )
    kept, stats = filter_sft_dataset(ds, "by_difficulty")
    assert [r["completion"][0]["content"] for r in kept] == ["\\boxed{4}", "no box", "\\boxed{5}"]
    assert stats["removed_wrong"] == 1 and stats["n_easy"] == 2 and stats["n_hard"] == 2
    kept, stats = filter_sft_dataset(ds, "correct")
    assert len(kept) == 2 and stats["n_correct"] == 2
    assert filter_sft_dataset(ds, "none")[0] is ds
    with pytest.raises(ValueError, match="row 0: filter 'correct' needs field 'ground_truth'"):
        filter_sft_dataset(datasets.Dataset.from_list([sft_row("\\boxed{4}", None, None)]), "correct")


def test_format_compliance():
    from klear.sft.job import format_compliant

    assert format_compliant("<think>\n2+2=4\n</think>\nThe answer is \\boxed{4}.")
    assert format_compliant("reasoning</think> \\boxed{x}")  # the opening tag may sit in the prompt
    assert not format_compliant("The answer is \\boxed{4}.")  # no think block
    assert not format_compliant("<think>\\boxed{4}</think> so 4")  # box only inside the think block
    assert not format_compliant("<think>2+2</think>\\boxed{}")  # empty box
    assert not format_compliant("<think>a</think><think>b \\boxed{4}")  # unclosed second think


def test_greedy_generate_drops_finished_rows_and_matches_model_generate(tiny_model):
    """Same completions as ``model.generate`` on the same left-padded batch when sequences stop at different steps."""
    import torch

    from klear.eval.heldout import generate, greedy_generate

    model, tok = tiny_model
    with torch.no_grad():  # larger weights: varied argmax tokens instead of one repeated token
        for p in model.parameters():
            p.mul_(8.0)
    prompts = [[{"role": "user", "content": f"Q{i} " + "word " * (i % 5)}] for i in range(9)]
    enc = tok.apply_chat_template(
        prompts[0], add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt"
    )
    with torch.no_grad():
        free = model.generate(**enc, max_new_tokens=12, do_sample=False)[0, enc["input_ids"].shape[1] :].tolist()
    # end-of-sequence: <|im_end|> and the 3rd token prompt 0 generates, so some rows stop early
    model.generation_config.eos_token_id = [tok.eos_token_id, free[2]]
    texts = [tok.apply_chat_template(p, tokenize=False, add_generation_prompt=True) for p in prompts]
    tok.padding_side = "left"
    batch = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    model.eval()
    with torch.no_grad():  # the reference: transformers' own greedy decoding, one batch
        out = model.generate(
            **batch,
            max_new_tokens=12,
            do_sample=False,
            pad_token_id=tok.pad_token_id,
            temperature=None,
            top_p=None,
            top_k=None,
        )
    ref = tok.batch_decode(out[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)
    from klear.eval.heldout import _common_prefix_length

    shared = _common_prefix_length(tok(texts, add_special_tokens=False)["input_ids"], limit=10**6)
    assert shared >= 16  # the chat template's system prompt: the shared-prefix prefill path runs
    mine = greedy_generate(model, tok, prompts, max_new_tokens=12, batch_size=9, show_progress=False)
    assert mine == ref
    lengths = [len(tok(c, add_special_tokens=False)["input_ids"]) for c in ref]
    assert min(lengths) < 6 < max(lengths)  # rows did stop at different steps
    assert greedy_generate(model, tok, prompts[:3], max_new_tokens=12, batch_size=2, show_progress=False) == ref[:3]
    assert generate(model, tok, prompts, max_new_tokens=12, batch_size=4, show_progress=False) == ref  # greedy path
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1, got 0"):
        greedy_generate(model, tok, prompts, max_new_tokens=0)


def _tiny_checkpoint(tmp_path, embedded_path):
    from klear.models.embedded import tiny_random_model

    model, tok = tiny_random_model(embedded_path)
    path = tmp_path / "tiny"
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def test_tiny_sft_job_runs_resumes_and_reports(tmp_path, embedded_path, capsys, monkeypatch):
    from klear.config import load_config
    from klear.sft.job import run_sft

    model_dir = _tiny_checkpoint(tmp_path, embedded_path)
    out = tmp_path / "run"
    overrides = [
        f"model={model_dir}",
        f"output_dir={out}",
        "data.train_size=24",
        "data.heldout_size=6",
        "eval.max_new_tokens=4",
        "eval.batch_size=6",
        "trainer.max_steps=3",
        "trainer.save_steps=2",
        "trainer.per_device_train_batch_size=2",
        "trainer.max_length=384",
        "trainer.report_to=[]",
        "trainer.warmup_steps=1",
    ]
    config, _ = load_config("sft_demo", overrides)
    report = run_sft(config)
    assert report["steps"] == 3 and report["train_examples"] == 24
    for key in ("accuracy", "format"):
        assert set(report[key]) >= {"before", "after", "mean_diff", "ci_low", "ci_high", "mcnemar_p"}
    for name in (
        *RUN_FILES,
        "sft_data.jsonl",
        "final/tokenizer_config.json",
        "checkpoints/checkpoint-2/trainer_state.json",
    ):
        assert (out / name).is_file(), name
    first = json.loads((out / "sft_data.jsonl").read_text().splitlines()[0])
    assert first["completion"][0]["content"].startswith("<think>\n")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if "loss" in r]
    assert [r["step"] for r in train_rows] == [1, 2, 3]
    # the logged LR is the one each step used: 1 warm-up step at the max, then cosine to the floor at step 3
    assert train_rows[0]["learning_rate"] == pytest.approx(2e-4)
    assert train_rows[2]["learning_rate"] == pytest.approx(1e-4)
    out_text = capsys.readouterr().out
    assert "held-out format compliance" in out_text
    # one precision rule: sft_demo says bf16: auto, which is float32 on this CPU (written and printed)
    assert json.loads((out / "run.json").read_text())["precision"]["dtype"] == "float32"
    assert yaml.safe_load((out / "config.yaml").read_text())["trainer"]["bf16"] is False
    assert "precision: float32 on cpu" in out_text

    # --resume continues from checkpoint-3 (the last step is saved too) with step 4, reusing the "before"
    # evaluation; steps 1-3 are not trained again (a restart from step 0 would rewrite them, with the LRs of a
    # 4-step schedule)
    assert (out / "checkpoints" / "checkpoint-3" / "trainer_state.json").is_file()
    from conftest import ResumeProbe

    before_resume = (out / "metrics.jsonl").read_text().splitlines()
    probe = ResumeProbe(monkeypatch)
    config, _ = load_config("sft_demo", overrides + ["trainer.max_steps=4"])
    report = run_sft(config, resume=True)
    assert report["steps"] == 4
    assert probe.begin_steps == [3] and probe.logged_steps == [4]
    lines = (out / "metrics.jsonl").read_text().splitlines()
    assert lines[:3] == before_resume
    steps = [json.loads(line)["step"] for line in lines if "loss" in json.loads(line)]
    assert steps == [1, 2, 3, 4]

    # the SFT -> RL chain: `klear rl` starts from <output_dir>/final with the SFT prompts and the think requirement
    from klear.rl.job import _build_datasets, run_rl

    rl_config, _ = load_config(
        "rl_demo",
        [
            f"model={out / 'final'}",
            f"output_dir={tmp_path / 'rl'}",
            "data.few_shot=null",
            "data.data_source=math_longcot_reasoning_gym",
            "data.train_size=24",
            "data.heldout_size=6",
            "eval.max_new_tokens=4",
            "eval.batch_size=6",
            "trainer.num_generations=2",
            "trainer.per_device_train_batch_size=2",
            "trainer.steps_per_generation=2",
            "trainer.max_completion_length=8",
            "trainer.max_steps=1",
            "trainer.report_to=[]",
            "trainer.save_steps=10",
        ],
    )
    rl_train, _ = _build_datasets(rl_config["data"], 0)
    sft_prompts = [json.loads(line)["prompt"] for line in (out / "sft_data.jsonl").read_text().splitlines()]
    assert rl_train["prompt"] == sft_prompts  # RL sees exactly the prompt format SFT trained
    assert run_rl(rl_config)["steps"] == 1
    assert (tmp_path / "rl" / "final" / "config.json").is_file()


def test_resume_continues_the_killed_run_exactly(tmp_path, embedded_path, monkeypatch):
    """`klear sft --resume` after a kill at step 2 of 4 starts at global step 2 with the optimizer (Adam moments),
    cosine-to-floor scheduler and RNG states of the uninterrupted run, logs only steps 3-4, and ends with its
    exact weights (the data order after the skipped batches included)."""

    from conftest import ResumeProbe, assert_same_final_weights, assert_same_training_state
    from klear.cli import main

    model_dir = _tiny_checkpoint(tmp_path, embedded_path)
    # attention dropout: every step draws from the torch RNG, so a resume that did not restore it would differ
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "attention_dropout": 0.5}))
    rows = [
        {"prompt": f"What is {i} + 1?", "response": f"<think>{i} + 1</think> \\boxed{{{i + 1}}}"} for i in range(16)
    ]
    (tmp_path / "sft.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    common = [
        f"model={model_dir}",
        f"data.train={tmp_path / 'sft.jsonl'}",
        "data.heldout=none",
        "trainer.max_steps=4",
        "trainer.save_steps=1",
        "trainer.per_device_train_batch_size=2",
        "trainer.max_length=64",
        "trainer.report_to=[]",
        "trainer.warmup_steps=1",
    ]
    probe = ResumeProbe(monkeypatch, watch_step=2)
    assert main(["sft", *common, f"output_dir={tmp_path / 'whole'}"]) == 0
    whole = probe.at_watch
    assert probe.begin_steps == [0, 1, 2, 3] and whole is not None

    killed = tmp_path / "killed"
    probe.reset()
    probe.kill_at = 2
    with pytest.raises(KeyboardInterrupt):
        main(["sft", *common, f"output_dir={killed}"])
    before_resume = (killed / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(r)["step"] for r in before_resume] == [1, 2]

    probe.reset()
    probe.kill_at = None
    assert main(["sft", *common, f"output_dir={killed}", "--resume"]) == 0
    # the resumed process starts at global step 2 and trains and logs steps 3 and 4 only
    assert probe.begin_steps == [2, 3]
    assert probe.logged_steps == [3, 4]
    after = (killed / "metrics.jsonl").read_text().splitlines()
    assert after[:2] == before_resume and [json.loads(r)["step"] for r in after] == [1, 2, 3, 4]
    # at the start of step 3: the same Adam moments, scheduler and RNG states as the run that was never killed
    assert probe.at_watch is not None
    assert_same_training_state(probe.at_watch, whole)
    assert any(bool(s["exp_avg"].abs().sum() > 0) for s in whole["optimizer"]["state"].values())
    # the same losses at steps 3-4 (same batches, same weights) and the same final weights, bit for bit
    whole_rows = (tmp_path / "whole" / "metrics.jsonl").read_text().splitlines()
    for mine, ref in zip(after[2:], whole_rows[2:], strict=True):
        mine, ref = json.loads(mine), json.loads(ref)
        assert (mine["step"], mine["loss"], mine["learning_rate"]) == (ref["step"], ref["loss"], ref["learning_rate"])
    assert_same_final_weights(tmp_path / "whole", killed, model_dir)


def test_cli_errors_name_the_key(tmp_path, capsys):
    from klear.cli import main

    assert main(["sft", f"output_dir={tmp_path}", "trainer.learnig_rate=1e-5"]) == 2
    err = capsys.readouterr().err
    assert "klear sft: error:" in err and "'learnig_rate' (did you mean 'learning_rate'?)" in err
    assert main(["sft", f"output_dir={tmp_path}", "data.trian=x.jsonl"]) == 2
    assert "unknown key(s) 'trian' (did you mean 'train'?) in 'data'" in capsys.readouterr().err
    assert main(["sft", f"output_dir={tmp_path}", "data.train=nope.jsonl", "data.heldout=none"]) == 2
    assert "nope.jsonl: no such file" in capsys.readouterr().err
    assert main(["sft", f"output_dir={tmp_path}", "--resume"]) == 2
    assert "no checkpoint found" in capsys.readouterr().err


def test_warmup_longer_than_max_steps_fails_before_any_work():
    from klear.config import load_config
    from klear.sft.job import validate_sft_config

    config, path = load_config("sft_demo", ["trainer.max_steps=1"])  # the recipe warms up for 2 steps
    with pytest.raises(ValueError, match=r"trainer.warmup_steps=2 exceeds trainer.max_steps=1"):
        validate_sft_config(config, str(path))
    validate_sft_config(load_config("sft_demo", ["trainer.max_steps=2"])[0], str(path))


def test_teacher_slip_rate_is_checked_before_any_work():
    from klear.config import load_config
    from klear.sft.job import validate_sft_config

    for value, message in (
        ("1.0", r"data.teacher_slip_rate=1.0 must be a number in \[0, 1\)"),
        ("-0.1", r"data.teacher_slip_rate=-0.1 must be a number in \[0, 1\)"),
        ("yes", r"data.teacher_slip_rate='yes' must be a number in \[0, 1\)"),
        (".nan", r"data.teacher_slip_rate=nan must be a number in \[0, 1\)"),
    ):
        config, path = load_config("sft_demo", [f"data.teacher_slip_rate={value}"])
        with pytest.raises(ValueError, match=message):
            validate_sft_config(config, str(path))
    config, path = load_config("sft_demo", ["data.teacher_slip_rate=0.2", "data.train=x.jsonl", "data.heldout=none"])
    with pytest.raises(ValueError, match="data.teacher_slip_rate=0.2 applies to data.train=teacher only"):
        validate_sft_config(config, str(path))


def test_flawed_teacher_through_klear_sft_filter_correct_drops_the_wrong_rows(tmp_path, embedded_path):
    """``klear sft`` with a flawed teacher: ``filter: none`` trains on its wrong solutions too, ``correct`` on the
    right ones only, and the report counts what was dropped."""
    from klear.cli import main

    model_dir = _tiny_checkpoint(tmp_path, embedded_path)

    def run(name, mode):
        out = tmp_path / name
        args = [f"model={model_dir}", f"output_dir={out}", "data.train_size=40", "data.heldout_size=2",
                "data.teacher_slip_rate=0.3", f"data.filter={mode}", "eval.enabled=false", "trainer.max_steps=1",
                "trainer.warmup_steps=0", "trainer.per_device_train_batch_size=2", "trainer.report_to=[]",
                "trainer.save_strategy=no"]  # fmt: skip
        assert main(["sft", *args]) == 0
        rows = [json.loads(line) for line in (out / "sft_data.jsonl").read_text().splitlines()]
        wrong = sum(f"\\boxed{{{r['ground_truth']}}}" not in r["completion"][-1]["content"] for r in rows)
        return rows, wrong, json.loads((out / "eval.json").read_text())  # the run's report

    mixed, wrong_mixed, _ = run("mixed", "none")
    correct, wrong_correct, summary = run("correct", "correct")
    assert len(mixed) == 40 and wrong_mixed > 0 and wrong_correct == 0
    assert len(correct) == 40 - wrong_mixed
    assert summary["filter"]["removed_wrong"] == wrong_mixed


def test_one_teacher_slip_rate_per_task_is_checked_against_the_tasks():
    from klear.config import load_config
    from klear.sft.job import validate_sft_config

    config, path = load_config("sft_demo", ["data.teacher_slip_rate=[0.1, 0.2]"])  # sft_demo has 3 tasks
    with pytest.raises(ValueError, match="data.teacher_slip_rate lists 2 rates for 3 data.tasks"):
        validate_sft_config(config, str(path))
    config, path = load_config("sft_demo", ["data.teacher_slip_rate=[0.1, 0.2, 1.5]"])
    with pytest.raises(ValueError, match=r"data.teacher_slip_rate\[2\]=1.5 must be a number in \[0, 1\)"):
        validate_sft_config(config, str(path))
    validate_sft_config(load_config("sft_demo", ["data.teacher_slip_rate=[0.1, 0.2, 0.0]"])[0], str(path))


def test_sft_job_drops_to_one_thread_when_other_work_shares_a_spinning_cpu(
    tmp_path, embedded_path, monkeypatch, caplog
):
    """Through `klear sft`'s job: with spinning waits (GOMP_SPINCOUNT) on 2 threads, other work that takes a core
    (here: any measurement counts, CONTENDED_BUSY_CORES = -inf: over a 0 s window the other work measured can fall
    below -1 core) puts the run on one thread at a step's end (klear.precision.CpuShareGuard)."""
    import logging

    import torch

    from klear import precision
    from klear.config import load_config
    from klear.sft.job import run_sft

    threads = torch.get_num_threads()
    monkeypatch.setenv("GOMP_SPINCOUNT", "10000")
    monkeypatch.setattr(precision, "CONTENDED_BUSY_CORES", float("-inf"))
    monkeypatch.setattr(precision.CpuShareGuard, "MIN_INTERVAL_S", 0.0)
    overrides = [
        f"model={_tiny_checkpoint(tmp_path, embedded_path)}",
        f"output_dir={tmp_path / 'run'}",
        "data.train_size=8",
        "data.heldout_size=2",
        "eval.max_new_tokens=2",
        "trainer.max_steps=2",
        "trainer.per_device_train_batch_size=2",
        "trainer.max_length=384",
        "trainer.report_to=[]",
        "trainer.save_strategy=no",
    ]
    torch.set_num_threads(2)
    try:
        with caplog.at_level(logging.INFO, logger="klear.callbacks"):
            run_sft(load_config("sft_demo", overrides)[0])
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(threads)
    assert "step 1: other work shares the CPU; computing on 1 thread until it stops" in caplog.text
