"""The bench: tiny policies that RL moves within seconds, so ``klear experiment`` can run enough seeds to decide.

A bench model is a small Llama (a normal transformers checkpoint with its own small BPE tokenizer and a ChatML
chat template, so TRL and every klear code path run on it unchanged) trained from scratch by ``klear sft`` on
worked teacher solutions (:mod:`klear.sft.teacher`) of a procedural task until its sampled held-out accuracy
sits in the bench's band. A recipe names it as ``model: bench:<name>`` (:data:`BENCH_MODELS`).

Build: on first use (``klear rl`` / ``klear sft`` / ``klear experiment`` with a ``bench:`` model, or
``klear bench build <name>``), in ``<cache>/models/bench-<name>`` (:func:`klear.models.embedded.bench_model_dir`).
The build is deterministic (fixed seeds, float32 on CPU) and keyed by its spec: a cached model whose
``bench.json`` records another spec is rebuilt. The folder is written elsewhere and renamed into place, so an
interrupted build is redone, never half-used; the ``klear sft`` run's printed output goes to
``<cache>/models/bench-<name>.build.log`` (:func:`build_log_path`). ``bench.json`` records the spec, the band and
the measured sampled accuracy (avg@n on held-out problems, as ``klear rl`` measures before training with its own n).

Errors: a build whose accuracy lands outside the band raises :class:`BenchBuildError` (the spec, not the run,
is wrong: change the SFT steps or the difficulty).
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import os
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["BENCH_MODELS", "BenchBuildError", "BenchSpec", "build_bench_model", "ensure_bench_model"]

#: The chat template of every bench tokenizer: ChatML without a default system turn.
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
#: The scorer of a bench model's held-out problems: the math reward with the think block required, as in a bench
#: RL recipe.
SELECT_DATA_SOURCE = "math_longcot_reasoning_gym"


class BenchBuildError(RuntimeError):
    """A bench model's sampled accuracy after its SFT build lies outside its band."""


@dataclass(frozen=True)
class BenchSpec:
    """How one bench model is built.

    Attributes:
        tasks: the reasoning-gym task mix its teacher data and held-out problems come from (as ``data.tasks``).
        description: one line for listings.
        vocab_size: BPE vocabulary (special tokens included); digits are always single tokens.
        hidden_size, num_layers, num_heads, intermediate_size: the Llama's shape.
        sft: ``klear sft`` settings (dotted keys over the build's base recipe, :func:`sft_config`).
        band: ``(low, high)``: the sampled held-out accuracy the built model must have.
        eval_samples, eval_temperature, heldout_size, max_new_tokens: how that accuracy is measured (avg@n at a
            temperature, completions cut at ``max_new_tokens``).
        select_every: SFT steps between the checkpoints the build chooses from (:func:`build_bench_model`).
        seed: data, initialisation and training seed.
        data_source: the rows' ``data_source`` (the scorer and think rule of the build's held-out measurement;
            a bench RL recipe uses the same).
        instruction: appended to each question (``None``: the builder's default, ``""``: the question alone).
    """

    tasks: tuple[dict[str, Any], ...]
    description: str
    vocab_size: int = 320
    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    intermediate_size: int = 384
    sft: dict[str, Any] = field(default_factory=dict)
    band: tuple[float, float] = (0.3, 0.6)
    eval_samples: int = 4
    eval_temperature: float = 1.0
    heldout_size: int = 256
    max_new_tokens: int = 128
    select_every: int = 25
    seed: int = 0
    data_source: str = SELECT_DATA_SOURCE
    instruction: str | None = None

    def key(self) -> str:
        """A short hash of everything that shapes the built model (its cache key). Fields added after the first
        bench model leave the hash alone at their defaults, so cached models stay valid."""
        record = asdict(self)
        for name, default in _LATER_FIELDS.items():
            if record[name] == default:
                del record[name]
        text = json.dumps(record, sort_keys=True, default=list)
        return hashlib.sha256(text.encode()).hexdigest()[:16]


_ADDITION = {
    "name": "basic_arithmetic",
    "config": {
        "min_terms": 2,
        "max_terms": 2,
        "min_digits": 3,
        "max_digits": 3,
        "operators": ["+"],
        "allow_parentheses": False,
        "allow_negation": False,
    },
}

_LATER_FIELDS = {"data_source": SELECT_DATA_SOURCE, "instruction": None}

#: ``sums_code`` (:mod:`klear.data.procedural`): three 2-digit additions, returned by a Python function checked on
#: one test per sum in the sandbox.
_SUMS_CODE = {"name": "sums_code", "config": {"n_sums": 3, "min_digits": 2, "max_digits": 2}}

#: The bench models a recipe can name as ``bench:<name>``.
BENCH_MODELS: dict[str, BenchSpec] = {
    "arith": BenchSpec(
        tasks=(_ADDITION,),
        description="a+b with 3-digit operands, column addition in a think block (0.9M parameters)",
        sft={"data.train_size": 12000, "trainer.num_train_epochs": 2},
    ),
    "sums_code": BenchSpec(
        tasks=(_SUMS_CODE,),
        description="f(i) returning the i-th of three 2-digit sums, one sandbox test per sum (soft and hard code "
        "rewards differ), column addition in a think block",
        sft={"data.train_size": 20000, "trainer.num_train_epochs": 2, "trainer.max_length": 320},
        band=(0.2, 0.6),  # all three sums right; each sum is right about 60% of the time at 0.24
        max_new_tokens=224,
        data_source="code_longcot_bench",
        instruction="",
    ),
}


def _spec(name: str) -> BenchSpec:
    if name not in BENCH_MODELS:
        raise ValueError(f"unknown bench model {name!r}; the bench has: {', '.join(sorted(BENCH_MODELS))}")
    return BENCH_MODELS[name]


def sft_config(spec: BenchSpec, model_path: str, output_dir: str) -> dict[str, Any]:
    """The ``klear sft`` recipe that trains a bench model (``spec.sft`` applied over a base suited to tiny models)."""
    from klear.experiment import set_dotted

    config: dict[str, Any] = {
        "model": model_path,
        "output_dir": output_dir,
        "seed": spec.seed,
        "data": {
            "train": "teacher",
            "heldout": "reasoning_gym",
            "tasks": [copy.deepcopy(t) for t in spec.tasks],
            "system_prompt": None,
            "data_source": spec.data_source,
            "train_size": 2000,
            "heldout_size": spec.heldout_size,  # excluded from the teacher's problems
        },
        "eval": {"enabled": False},  # the build measures its checkpoints itself (select_checkpoint)
        "trainer": {
            "num_train_epochs": 1,
            "packing": False,
            "max_length": 256,
            "per_device_train_batch_size": 32,
            "gradient_accumulation_steps": 1,
            "learning_rate": 3.0e-3,
            "lr_floor": 3.0e-4,
            "warmup_steps": 10,
            "weight_decay": 0.0,
            "max_grad_norm": 1.0,
            "bf16": False,
            "gradient_checkpointing": False,
            "save_strategy": "steps",
            "save_steps": spec.select_every,
            "save_total_limit": None,
            "logging_steps": 25,
        },
    }
    if spec.instruction is not None:
        config["data"]["instruction"] = spec.instruction
    for key, value in spec.sft.items():
        set_dotted(config, key, value, f"bench spec sft.{key}")
    return config


def _corpus(spec: BenchSpec) -> list[str]:
    """Texts the tokenizer is trained on: teacher solutions and prompts of the bench's own task mix."""
    from klear.sft.data import make_teacher_sft_dataset

    train, _ = make_teacher_sft_dataset(
        list(spec.tasks),
        train_size=500,
        heldout_size=2,
        seed=spec.seed + 1000,
        system_prompt=None,
        instruction=spec.instruction,
    )
    return [m["content"] for row in train for m in row["prompt"] + row["completion"]]


def build_tokenizer(spec: BenchSpec):
    """A byte-level BPE tokenizer (``tokenizers``) trained on the bench's task texts, digits split one per token,
    with :data:`CHAT_TEMPLATE`; returned as a ``PreTrainedTokenizerFast`` (eos ``<|im_end|>``, pad
    ``<|endoftext|>``)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(spec), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        unk_token="<|endoftext|>",
        pad_token="<|endoftext|>",
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def init_model(spec: BenchSpec, tokenizer):
    """The randomly initialised ``LlamaForCausalLM`` of ``spec`` (seeded by ``spec.seed``; float32)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_heads,
        max_position_embeddings=1024,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=True,
    )
    torch.manual_seed(spec.seed)
    model = LlamaForCausalLM(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


def heldout_problems(spec: BenchSpec):
    """The held-out problems a bench model's accuracy is measured on (RL layout): those of ``klear sft``'s teacher
    split (seed ``spec.seed + 1``), so none was trained on; a bench RL recipe with the same top-level seed and
    ``heldout_size`` draws the same problems."""
    from klear.data.rl_data import make_train_and_heldout

    _, heldout = make_train_and_heldout(
        list(spec.tasks),
        train_size=1,
        heldout_size=spec.heldout_size,
        seed=spec.seed,
        few_shot=None,
        system_prompt=None,
        data_source=spec.data_source,
        **({} if spec.instruction is None else {"instruction": spec.instruction}),
    )
    return heldout


def _accuracy(checkpoint: Path, heldout, spec: BenchSpec) -> float:
    """Sampled held-out accuracy (avg@``eval_samples`` at ``eval_temperature``) of one checkpoint."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from klear.eval.heldout import evaluate

    model = AutoModelForCausalLM.from_pretrained(checkpoint)
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    result = evaluate(
        model,
        tokenizer,
        heldout,
        max_new_tokens=spec.max_new_tokens,
        batch_size=256,
        n_samples=spec.eval_samples,
        temperature=spec.eval_temperature,
        seed=spec.seed,
        show_progress=False,
    )
    return float(result["accuracy"])


def select_checkpoint(steps: list[int], accuracy_at, band: tuple[float, float]) -> tuple[int, dict[int, float]]:
    """The checkpoint step whose accuracy is nearest the band's centre, found by bisection (accuracy rises with
    SFT steps), and every accuracy measured on the way.

    Args:
        steps: checkpoint steps, ascending. accuracy_at: ``fn(step) -> accuracy``. band: ``(low, high)``.

    Returns:
        ``(step, {step: accuracy})``; the chosen step's accuracy may lie outside the band (the caller checks).
    """
    centre = (band[0] + band[1]) / 2
    seen: dict[int, float] = {}
    lo, hi = 0, len(steps) - 1
    while lo <= hi:
        mid = (lo + hi) // 2
        seen[steps[mid]] = accuracy_at(steps[mid])
        if seen[steps[mid]] < centre:
            lo = mid + 1
        else:
            hi = mid - 1
    best = min(seen, key=lambda s: (abs(seen[s] - centre), s))
    return best, seen


def build_log_path(name: str, target: Path) -> Path:
    """Where a build of bench model ``name`` into ``target`` writes its ``klear sft`` run's printed output (beside
    the model folder, kept after the build, failed or not)."""
    return target.parent / f"bench-{name}.build.log"


def build_lock_path(name: str, target: Path) -> Path:
    """The lock a build of bench model ``name`` into ``target`` holds (beside the model folder): one build at a time
    per model across processes, and ``klear bench list`` says "building" while it is held."""
    return target.parent / f"bench-{name}.lock"


def _building(name: str, target: Path) -> bool:
    """Whether another process holds ``name``'s build lock now.

    Raises:
        ValueError: the lock file cannot be used (e.g. a folder in its place), naming it.
    """
    from filelock import FileLock, Timeout

    path = build_lock_path(name, target)
    if not path.exists():
        return False
    try:
        with FileLock(str(path), timeout=0):
            return False
    except Timeout:
        return True
    except OSError as e:
        raise ValueError(f"bench model {name!r}: cannot use the build lock {path}: {e.strerror or e}") from None


def build_bench_model(name: str, target: Path, *, work_dir: Path | None = None, check_band: bool = True) -> dict:
    """Build bench model ``name`` into ``target`` (atomically) and return its ``bench.json`` record.

    ``klear sft`` trains from scratch, saving a checkpoint every ``spec.select_every`` steps; the checkpoint kept
    is the one whose sampled held-out accuracy is nearest the centre of ``spec.band`` (:func:`select_checkpoint`),
    so the model lands in its band on any CPU even though float rounding differs between them.

    Raises:
        ValueError: an unknown name.
        BenchBuildError: ``check_band`` and no checkpoint's accuracy is inside the spec's band.
    """
    from klear.lifecycle import checkpoint_step, complete_checkpoints
    from klear.models.embedded import BENCH_MARKER
    from klear.sft.job import run_sft

    spec = _spec(name)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".bench-{name}-", dir=work_dir or target.parent))
    start = time.perf_counter()
    try:
        tokenizer = build_tokenizer(spec)
        init_dir = tmp / "init"
        model = init_model(spec, tokenizer)
        parameters = sum(p.numel() for p in model.parameters())
        model.save_pretrained(init_dir)
        tokenizer.save_pretrained(init_dir)
        # the SFT run's printed output (loss lines, its temporary paths) goes to the build log; progress stays
        with open(build_log_path(name, target), "w") as log, contextlib.redirect_stdout(log):
            run_sft(sft_config(spec, str(init_dir), str(tmp / "sft")), source=f"bench:{name}")
        sft_seconds = time.perf_counter() - start
        complete, _ = complete_checkpoints(tmp / "sft" / "checkpoints")
        checkpoints = {step: p for p in complete if (step := checkpoint_step(p)) is not None}
        heldout = heldout_problems(spec)
        step, measured = select_checkpoint(
            sorted(checkpoints), lambda s: _accuracy(checkpoints[s], heldout, spec), spec.band
        )
        accuracy = measured[step]
        record = {
            "name": name,
            "key": spec.key(),
            "spec": asdict(spec),
            "accuracy": accuracy,
            "accuracy_measure": f"avg@{spec.eval_samples} at temperature {spec.eval_temperature} on "
            f"{spec.heldout_size} held-out problems",
            "sft_step": step,
            "accuracy_by_step": {str(s): measured[s] for s in sorted(measured)},
            "parameters": parameters,
            "sft_seconds": round(sft_seconds, 1),
            "build_seconds": round(time.perf_counter() - start, 1),
        }
        low, high = spec.band
        if check_band and not low <= accuracy <= high:
            curve = ", ".join(f"step {s}: {measured[s]:.3f}" for s in sorted(measured))
            raise BenchBuildError(
                f"bench model {name!r}: no SFT checkpoint has its sampled held-out accuracy inside the band "
                f"[{low}, {high}] (measured {curve}); change BENCH_MODELS[{name!r}].sft or its tasks"
            )
        final = checkpoints[step]
        for extra in final.iterdir():  # keep the weights, config and tokenizer; drop the optimizer state
            if extra.name.startswith(("optimizer", "scheduler", "rng_state", "trainer_state", "training_args")):
                extra.unlink()
        (final / BENCH_MARKER).write_text(json.dumps(record, indent=2) + "\n")
        if target.exists():
            shutil.rmtree(target)
        os.replace(final, target)
        return record
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _built_record(marker: Path) -> dict | None:
    """The ``bench.json`` record of a built model; None when missing or unreadable (then the model is rebuilt)."""
    try:
        record = json.loads(marker.read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def ensure_bench_model(name: str, *, force: bool = False) -> Path:
    """The folder of bench model ``name``, built first unless it is cached with its current spec. Prints a line
    before and after building. One process builds a model at a time (:func:`build_lock_path`); another that needs it
    meanwhile waits, then takes the model that process built. Holding the lock it removes what killed builds of
    ``name`` left (their temporary folders). ``force``: remove the model and build it again (under the lock).

    Raises:
        ValueError: an unknown name, or a cache whose ``models`` path or lock file cannot be used (named).
        BenchBuildError: as :func:`build_bench_model`.
    """
    from filelock import FileLock, Timeout

    from klear.models.embedded import BENCH_MARKER, bench_model_dir

    spec = _spec(name)
    target = bench_model_dir(name)
    marker = target / BENCH_MARKER
    record = _built_record(marker)
    if not force and record is not None and record.get("key") == spec.key():
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(
            f"bench model {name!r}: cannot use {target.parent} as the models folder: {e.strerror or e}"
        ) from None
    lock_path = build_lock_path(name, target)
    lock = FileLock(str(lock_path))
    waited = False
    try:
        try:
            lock.acquire(timeout=0)
        except Timeout:
            print(
                f"waiting for another process building bench model {name!r} ({build_log_path(name, target)})",
                flush=True,
            )
            lock.acquire()
            waited = True
    except OSError as e:
        raise ValueError(f"bench model {name!r}: cannot use the build lock {lock_path}: {e.strerror or e}") from None
    try:
        prefix = f".bench-{name}-"  # build_bench_model's work folders: this prefix and mkdtemp's suffix (no '-')
        for stale in target.parent.glob(f"{prefix}*"):  # a killed build's (none runs now: the lock is ours)
            if "-" not in stale.name[len(prefix) :]:
                shutil.rmtree(stale, ignore_errors=True)
        if force:
            shutil.rmtree(target, ignore_errors=True)
        record = _built_record(marker)  # built by the process we waited for
        if record is not None and record.get("key") == spec.key():
            if waited:
                print(f"bench model {name!r}: built by the other process; using {target}", flush=True)
            return target
        print(
            f"building bench model {name!r} in {target} (once; klear sft from scratch, its output in "
            f"{build_log_path(name, target)})",
            flush=True,
        )
        record = build_bench_model(name, target)
    finally:
        lock.release()
    print(
        f"bench model {name!r}: sampled held-out accuracy {record['accuracy']:.3f} ({record['accuracy_measure']}), "
        f"{record['parameters']:,} parameters, built in {record['build_seconds']:.0f} s",
        flush=True,
    )
    return target


def _register() -> None:
    from klear.models.embedded import set_bench_builder

    set_bench_builder(ensure_bench_model)


_register()


def add_parser(subparsers) -> None:
    """Add the ``bench`` subcommand (``klear bench list`` / ``klear bench build <name>``)."""
    p = subparsers.add_parser(
        "bench",
        help="list or build the bench's tiny policies (recipes name them as model: bench:<name>)",
        description="Bench models are tiny Llamas trained from scratch by klear sft on a procedural task until their "
        "sampled accuracy lies in a band; klear rl/sft/experiment build one on first use. This command lists them "
        "or builds one ahead of time.",
    )
    p.add_argument("action", choices=["list", "build"])
    p.add_argument("name", nargs="?", default=None, help="the bench model to build (klear bench list names them)")
    p.add_argument("--force", action="store_true", help="rebuild even when the cached model matches its spec")
    p.set_defaults(func=_run_cli)


def _run_cli(ns) -> int:
    from klear.models.embedded import BENCH_MARKER, BENCH_PREFIX, bench_model_dir

    if ns.action == "list":
        if ns.name is not None or ns.force:
            extra = f"the name {ns.name!r}" if ns.name is not None else "--force"
            raise ValueError(
                f"klear bench list takes no model name or --force (got {extra}); to build: klear bench build NAME"
            )
        for name, spec in sorted(BENCH_MODELS.items()):
            marker = bench_model_dir(name) / BENCH_MARKER
            record = _built_record(marker)
            state = "not built"
            if _building(name, marker.parent):
                state = f"building now, by another process (its output in {build_log_path(name, marker.parent)})"
            elif record is not None and record.get("key") == spec.key():
                state = f"built, accuracy {record.get('accuracy', float('nan')):.3f}"
            elif record is not None:
                state = "stale (spec changed; rebuilt on next use)"
            elif marker.exists():
                state = f"unreadable {marker} (rebuilt on next use)"
            print(f"bench:{name}  {spec.description}  [{state}]")
        return 0
    if ns.name is None:
        raise ValueError("klear bench build needs a model name (klear bench list names them)")
    name = ns.name.removeprefix(BENCH_PREFIX)  # as recipes name it: bench:arith
    print(ensure_bench_model(name, force=ns.force))
    return 0
