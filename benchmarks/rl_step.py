"""klear's ``GPPOTrainer`` RL step vs TRL's ``GRPOTrainer`` on the same rollout, side by side in one process.

Workload (default: the CPU demo's sizes): the embedded SmolLM2-135M-Instruct, ``--prompts`` reasoning-gym
arithmetic prompts of ``configs/rl_demo.yaml`` x 8 samples per rollout batch, 32 response tokens,
2 optimizer steps per rollout batch (``steps_per_generation=2``), float32 on CPU.

1. **Generation**: TRL's ``_generate`` (transformers ``generate``, one prefill per row) vs klear's (the same
   ``generate`` after one prefill per prompt group, :mod:`klear.generation.prefill`), same prompts, same seed.
2. **Training step on one fixed rollout**: one rollout is sampled once and replayed to every trainer
   (``_generate`` returns the recorded prompt and completion ids), so every trainer scores, normalises and
   trains on identical tokens. A "step" is TRL's own ``step_time`` metric (per optimizer step; the first
   step of a rollout batch includes scoring and the old-log-prob pass). Trainers:

   - ``trl``: ``GRPOTrainer(loss_type="dapo", epsilon=0.2, epsilon_high=0.28, beta=0)``;
   - ``klear-same-loss``: ``GPPOTrainer(loss_mode="ppo_clip", clip 0.2/0.28, no dual clip, alpha=0,
     no zero-advantage filter)``, the same loss, so the ratio is klear's trainer overhead;
   - ``klear-gppo``: the demo's GPPO settings (dual clip, alpha 0.1, zero-advantage filter on: filtered
     samples leave the micro-batches and the old-log-prob pass).

   Trainers run in turns (``--repeats`` rounds, each trainer one rollout batch per round) so drift in the
   machine's load hits all of them alike; the medians over all rounds are compared.

Peak memory: on CUDA ``torch.cuda.max_memory_allocated`` per trainer; on CPU the peak resident set size
above the process's baseline, sampled every 50 ms while each trainer runs (an upper bound: freed memory
is not always returned to the OS).

Usage: ``python benchmarks/rl_step.py [--prompts 16] [--repeats 2] [--model embedded]``.
Prints load average and CPU flags, every median, and the ratios.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import threading
import time

import torch

from _machine import cpu_flags


class PeakRSS:
    """Peak resident set size (bytes) above the value at start, sampled in a thread."""

    def __init__(self):
        import psutil

        self.proc = psutil.Process()
        self.base = self.peak = self.proc.memory_info().rss
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.wait(0.05):
            self.peak = max(self.peak, self.proc.memory_info().rss)

    def __enter__(self):
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    @property
    def delta_mb(self) -> float:
        if torch.cuda.is_available():
            return torch.cuda.max_memory_allocated() / 2**20
        return (self.peak - self.base) / 2**20


def _common(out: str, prompts: int, steps: int) -> dict:
    return dict(
        output_dir=out,
        num_generations=8,
        per_device_train_batch_size=prompts * 8 // 2,
        steps_per_generation=2,
        gradient_accumulation_steps=1,
        max_completion_length=32,
        temperature=0.7,
        max_steps=steps,
        learning_rate=5e-6,
        lr_scheduler_type="constant",
        weight_decay=0.1,
        max_grad_norm=1.0,
        bf16=torch.cuda.is_available(),
        use_cpu=not torch.cuda.is_available(),
        gradient_checkpointing=False,
        report_to=[],
        save_strategy="no",
        logging_steps=1,
        seed=0,
        disable_tqdm=True,
    )


def build(kind: str, model_path: str, dataset, tokenizer, out: str, prompts: int, steps: int):
    from trl import GRPOConfig, GRPOTrainer

    from klear.rl.reward_fn import klear_reward
    from klear.rl.trainer import GPPOConfig, GPPOTrainer

    common = _common(out, prompts, steps)
    if kind == "trl":
        args = GRPOConfig(loss_type="dapo", epsilon=0.2, epsilon_high=0.28, beta=0.0, **common)
        cls = GRPOTrainer
    elif kind == "klear-same-loss":
        args = GPPOConfig(
            loss_mode="ppo_clip",
            clip_ratio_low=0.2,
            clip_ratio_high=0.28,
            clip_ratio_c=None,
            alpha=0.0,
            filter_zero_adv_groups=False,
            **common,
        )
        cls = GPPOTrainer
    elif kind == "klear-gppo":
        args = GPPOConfig(
            loss_mode="gppo",
            clip_ratio_low=0.2,
            clip_ratio_high=0.28,
            clip_ratio_c=10.0,
            alpha=0.1,
            filter_zero_adv_groups=True,
            **common,
        )
        cls = GPPOTrainer
    else:
        raise ValueError(kind)
    from transformers import PrinterCallback

    trainer = cls(
        model=model_path, reward_funcs=klear_reward, args=args, train_dataset=dataset, processing_class=tokenizer
    )
    trainer.remove_callback(PrinterCallback)  # no per-step log dicts on stdout
    return trainer


class Replay:
    """A stand-in for ``trainer._generate``: returns the recorded samples of each requested prompt.

    ``recorded`` is what ``_generate(prompts)`` returned once; a later call with the same prompts in another
    order (TRL's sampler shuffles) gets, for each occurrence of a prompt, the next recorded sample of it.
    """

    def __init__(self, prompts, recorded):
        import json

        self.key = lambda prompt: json.dumps(prompt, sort_keys=True)
        self.recorded = recorded
        self.by_prompt: dict[str, list[int]] = {}
        for i, prompt in enumerate(prompts):
            self.by_prompt.setdefault(self.key(prompt), []).append(i)
        self.n = len(prompts)

    def __call__(self, prompts):
        queues = {k: list(v) for k, v in self.by_prompt.items()}
        order = [queues[self.key(p)].pop(0) for p in prompts]
        return tuple(
            [field[i] for i in order] if isinstance(field, list) and len(field) == self.n else field
            for field in self.recorded
        )


def step_times(trainer) -> list[float]:
    return [row["step_time"] for row in trainer.state.log_history if "step_time" in row]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="embedded", help="'embedded' or a checkpoint directory")
    p.add_argument("--prompts", type=int, default=16, help="prompts per rollout batch (x 8 samples)")
    p.add_argument("--repeats", type=int, default=2, help="rounds; each trainer trains one rollout batch per round")
    args = p.parse_args()

    from transformers import AutoTokenizer

    from klear.config import load_config
    from klear.data.rl_data import make_reasoning_gym_dataset
    from klear.models.embedded import resolve_model_path

    torch.manual_seed(0)
    model_path = resolve_model_path(args.model)
    tok = AutoTokenizer.from_pretrained(model_path, padding_side="left")
    demo, _ = load_config("rl_demo")
    data = demo["data"]
    dataset = make_reasoning_gym_dataset(
        data["tasks"], size=args.prompts, seed=0, system_prompt=data.get("system_prompt")
    )
    print(
        f"load average {os.getloadavg()}, {os.cpu_count()} CPUs, flags: {cpu_flags()}, torch threads "
        f"{torch.get_num_threads()}, device {'cuda' if torch.cuda.is_available() else 'cpu'}",
        flush=True,
    )

    kinds = ["trl", "klear-same-loss", "klear-gppo"]
    tmp = tempfile.mkdtemp(prefix="klear-rl-step-")
    trainers = {k: build(k, model_path, dataset, tok, os.path.join(tmp, k), args.prompts, 2) for k in kinds}

    # 1. generation, same prompts, same seed
    prompts = [row["prompt"] for row in dataset for _ in range(8)]
    for trainer in trainers.values():
        trainer.model.train()
    gen_times: dict[str, list[float]] = {"trl": [], "klear": []}
    recorded = None
    for _ in range(args.repeats):
        for name, trainer in (("trl", trainers["trl"]), ("klear", trainers["klear-gppo"])):
            torch.manual_seed(1)
            start = time.perf_counter()
            result = trainer._generate(prompts)
            gen_times[name].append(time.perf_counter() - start)
            if recorded is None:
                recorded = result
    print(
        f"generation of {len(prompts)} samples (median of {args.repeats}): trl "
        f"{statistics.median(gen_times['trl']):.1f} s, klear {statistics.median(gen_times['klear']):.1f} s, "
        f"ratio klear/trl {statistics.median(gen_times['klear']) / statistics.median(gen_times['trl']):.2f}",
        flush=True,
    )

    # 2. training steps on the recorded rollout (one rollout batch = 2 optimizer steps per round)
    replay = Replay(prompts, recorded)
    for trainer in trainers.values():
        trainer._generate = replay  # identical tokens for every trainer, matched to the prompts it draws
    times: dict[str, list[float]] = {k: [] for k in kinds}
    peaks: dict[str, float] = dict.fromkeys(kinds, 0.0)
    for r in range(args.repeats):
        for kind in kinds:
            trainer = trainers[kind]
            with PeakRSS() as mem:
                trainer.train()  # one rollout batch: 2 optimizer steps (the weights carry over between rounds)
            peaks[kind] = max(peaks[kind], mem.delta_mb)
            times[kind] += step_times(trainer)
            print(f"  round {r + 1} {kind}: steps {[round(t, 1) for t in step_times(trainer)]} s", flush=True)
    print(f"\nload average at the end {os.getloadavg()}")
    print(f"{'trainer':<18}{'median step s':>14}{'mean step s':>12}{'vs trl':>8}{'peak MB':>9}")
    base = statistics.median(times["trl"])
    for kind in kinds:
        med = statistics.median(times[kind])
        print(f"{kind:<18}{med:>14.2f}{statistics.mean(times[kind]):>12.2f}{med / base:>8.2f}{peaks[kind]:>9.0f}")
    same = statistics.median(times["klear-same-loss"]) / base
    gppo = statistics.median(times["klear-gppo"]) / base
    print(
        f"\nklear trainer overhead (same loss, no filter) = {same:.2f}x TRL's step; with the zero-advantage "
        f"filter (GPPO demo settings) = {gppo:.2f}x"
    )


if __name__ == "__main__":
    main()
