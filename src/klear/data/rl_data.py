"""RL prompt datasets in the verl RL layout.

Every dataset built or loaded here is a ``datasets.Dataset`` with (at least) these columns:

* ``prompt``: chat messages, a list of ``{"role": str, "content": str}``;
* ``data_source``: str, selects the reward function (e.g. ``"math_reasoning_gym"``);
* ``reward_model``: ``{"style": "rule", "ground_truth": str}``;
* ``extra_info``: JSON-able dict with at least ``{"index": int, "split": str, "task": str}``;
* ``prompt_id``: str, unique per problem within the dataset; the trainer groups the M
  rollouts of one prompt by it (GRPO groups, paper Eq. 4).

Two sources:

* :func:`make_reasoning_gym_dataset` / :func:`make_train_and_heldout` generate procedural
  problems with ``reasoning_gym`` (deterministic given the seed; the held-out questions are
  excluded from training so nothing leaks). By default each prompt is one worked
  demonstration turn pair (:data:`DEFAULT_FEW_SHOT`) followed by the problem: without it
  the embedded 135M model almost never boxes its answer (see ``DEFAULT_FEW_SHOT``);
* :func:`load_rl_file` reads a verl-style JSONL or parquet file and validates every row.

Ground truths are always strings. A ground truth given as a number is converted with
``str`` (``3`` -> ``"3"``, ``2.5`` -> ``"2.5"``). A math ground truth given as a LIST (several
acceptable answers) keeps its first answer in ``reward_model.ground_truth`` and all of them in
``extra_info["acceptable_answers"]`` (an Arrow column holds one type, so the list cannot stay in
``ground_truth``); the math reward accepts any of them (:mod:`klear.rewards.gold`). A row may also
give ``extra_info.acceptable_answers`` itself (a list; merged after the ground truth). A STRING
ground truth is one answer, never JSON-decoded (``"[1, 2]"`` is an interval; klear before issue 20
kept a list as its JSON text, ``'["1/2", "0.5"]'``: such a string is now one unusable answer that
the judge reports as a data error, so write the list itself).

Code rows keep their tests as JSON text; a statement that accepts any output case sets the tests'
``case_insensitive`` flag (:mod:`klear.data.code_data`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import random
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from klear.data.prompts import DEFAULT_INSTRUCTION, build_user_message
from klear.data.rows import read_rows
from klear.data.text import check_messages, short_repr

logger = logging.getLogger(__name__)

#: Share of generated questions skipped as repeats or excluded above which the kept problems no longer follow the
#: generator's distribution (its small sub-spaces run out first), and :func:`_generate_task` warns.
SKIPPED_SHARE_WARN = 0.1

DEFAULT_FEW_SHOT: tuple[dict, ...] = (
    {"question": "Calculate 2 + 3.", "answer": "2 + 3 = 5. The answer is \\boxed{5}."},
)
"""One worked demonstration, put before the problem as a user/assistant turn pair.

Chosen with ``benchmarks/select_demo_tasks.py`` on the embedded SmolLM2-135M-Instruct
(greedy): with ANY instruction wording alone (plain "Put your final answer within
\\boxed{}.", the DeepSeek-R1 wording, "like \\boxed{5}", "The answer is \\boxed{N}", a system
prompt) the model almost never puts the number in a box: it states the answer and then
omits the box, writes an EMPTY ``\\boxed{}`` or copies the placeholder (``\\boxed{N}``), so
the strict accuracy is 0-6 % on one-digit arithmetic although the stated answer is right
about half the time. One demonstration turn makes it answer "a op b = c. The answer is
\\boxed{c}." (100 % boxed, 81 % correct on 16 one-digit +-* problems). The demo question is
excluded from the generated problems.
"""

DEFAULT_DATA_SOURCE = "math_reasoning_gym"

__all__ = [
    "DEFAULT_DATA_SOURCE",
    "DEFAULT_FEW_SHOT",
    "DEFAULT_INSTRUCTION",
    "build_user_message",
    "load_rl_dataset",
    "load_rl_file",
    "make_reasoning_gym_dataset",
    "make_train_and_heldout",
    "regenerate_entries",
]


# --------------------------------------------------------------------------- reasoning gym


def _normalise_tasks(tasks: Sequence[Mapping[str, Any]]) -> list[dict]:
    if isinstance(tasks, (str, Mapping)) or not isinstance(tasks, Sequence) or len(tasks) == 0:
        raise ValueError("tasks must be a non-empty list of {'name', 'weight', 'config'} dicts")
    out = []
    for i, task in enumerate(tasks):
        if not isinstance(task, Mapping):
            raise ValueError(f"tasks[{i}] must be a dict with 'name', optional 'weight' and 'config', got {task!r}")
        unknown = set(task) - {"name", "weight", "config"}
        if unknown:
            raise ValueError(f"tasks[{i}] has unknown keys {sorted(unknown)} (allowed: name, weight, config)")
        name = task.get("name")
        if not isinstance(name, str) or not name:
            raise ValueError(f"tasks[{i}]: 'name' must be a reasoning_gym dataset name, got {name!r}")
        weight = task.get("weight", 1.0)
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight) or weight <= 0:
            raise ValueError(f"tasks[{i}] ({name}): 'weight' must be a positive number, got {weight!r}")
        config = task.get("config") or {}
        if not isinstance(config, Mapping):
            raise ValueError(f"tasks[{i}] ({name}): 'config' must be a dict of generator kwargs, got {config!r}")
        if {"size", "seed"} & set(config):
            raise ValueError(f"tasks[{i}] ({name}): 'config' must not set 'size' or 'seed' (they are arguments)")
        out.append({"name": name, "weight": float(weight), "config": dict(config)})
    return out


def _split_counts(size: int, weights: Sequence[float]) -> list[int]:
    """Largest-remainder apportionment of ``size`` proportional to ``weights`` (ties -> earlier task)."""
    total = sum(weights)
    quotas = [size * w / total for w in weights]
    counts = [int(math.floor(q)) for q in quotas]
    rest = size - sum(counts)
    order = sorted(range(len(weights)), key=lambda i: (-(quotas[i] - counts[i]), i))
    for i in order[:rest]:
        counts[i] += 1
    return counts


def _sub_seed(seed: int, task_index: int, name: str) -> int:
    """A per-task generator seed, far apart for different (seed, task) pairs."""
    digest = hashlib.sha256(f"klear/{seed}/{task_index}/{name}".encode()).digest()
    return int.from_bytes(digest[:4], "big") & 0x7FFFFFFF


def _generate_task(name: str, config: dict, count: int, seed: int, excluded: set[str]) -> list[tuple[int, dict]]:
    """``count`` distinct reasoning-gym entries of one task whose questions are not in ``excluded``.

    Returns (generator index, entry) pairs. Adds each taken question to ``excluded``.
    """
    import reasoning_gym

    from klear.data.procedural import register_klear_tasks

    if count == 0:
        return []
    register_klear_tasks()
    budget = 20 * count + 200  # candidates tried before giving up
    try:
        generator = reasoning_gym.create_dataset(name, size=budget, seed=seed, **config)
    except Exception as exc:  # unknown name, bad config
        raise ValueError(f"reasoning_gym task {name!r} with config {config!r} could not be created: {exc}") from exc
    taken: list[tuple[int, dict]] = []
    for idx in range(budget):
        entry = generator[idx]
        question = entry["question"]
        if question in excluded:
            continue
        excluded.add(question)
        taken.append((idx, entry))
        if len(taken) == count:
            skipped = idx + 1 - count
            if skipped > SKIPPED_SHARE_WARN * (idx + 1):
                logger.warning(
                    "reasoning_gym task %r with config %r: %d of %d generated questions were repeats or excluded "
                    "(%.0f%%); the %d kept over-represent the task's larger sub-spaces (e.g. more digits) and no "
                    "longer follow its distribution: enlarge the config or ask for fewer problems",
                    name,
                    config,
                    skipped,
                    idx + 1,
                    100 * skipped / (idx + 1),
                    count,
                )
            return taken
    raise ValueError(
        f"reasoning_gym task {name!r} with config {config!r}: only {len(taken)} distinct questions "
        f"(not excluded) in {budget} generated, {count} needed; the problem space is too small "
        f"for this size: enlarge the config (more digits/terms) or ask for fewer problems"
    )


def make_reasoning_gym_dataset(
    tasks: Sequence[Mapping[str, Any]],
    *,
    size: int,
    seed: int,
    split: str = "train",
    data_source: str = DEFAULT_DATA_SOURCE,
    instruction: str | None = DEFAULT_INSTRUCTION,
    exclude_questions: Iterable[str] | None = None,
    system_prompt: str | None = None,
    few_shot: Sequence[Mapping[str, str]] | None = DEFAULT_FEW_SHOT,
):
    """Generate a procedural RL prompt set from a (weighted) mix of reasoning-gym tasks.

    Each task gets ``round(size * weight / sum(weights))`` problems (largest-remainder
    rounding, so the counts sum to exactly ``size``), generated with
    ``reasoning_gym.create_dataset(name, size=..., seed=<per-task seed derived from seed>, **config)``.
    Questions are distinct within the dataset and never in ``exclude_questions``; duplicates
    and excluded questions are skipped and more problems are generated to keep the exact
    size. Rows are shuffled (deterministically) so that tasks interleave. The same arguments
    always give the same dataset.

    Args:
        tasks: list of ``{"name": reasoning_gym dataset name (or klear's own, :mod:`klear.data.procedural`),
            "weight": float > 0 (default 1), "config": dict of the generator's kwargs (not size/seed)}``.
        size: number of problems (>= 1).
        seed: generation seed.
        split: stored in ``extra_info["split"]`` and in the ``prompt_id``.
        data_source: the ``data_source`` column (selects the reward function).
        instruction: appended to each question after a blank line (see
            :data:`DEFAULT_INSTRUCTION`); ``None``/``""`` for the bare question.
        exclude_questions: raw question strings (as reasoning-gym writes them, without the
            instruction) that must not appear, e.g. the held-out set's.
        system_prompt: if given, a system message put first (otherwise the chat template's
            default system prompt, if any, applies).
        few_shot: worked demonstrations ``{"question", "answer"}`` put before the problem as
            user/assistant turns (the user turn gets the same instruction); default
            :data:`DEFAULT_FEW_SHOT`; ``None`` or ``()`` for a single-turn prompt. Their
            questions are never generated as problems.

    Returns:
        A ``datasets.Dataset`` in the layout of this module. ``prompt`` = [system], demo turns,
        then the user message ``question + blank line + instruction``. ``reward_model.ground_truth`` is
        the reasoning-gym answer; ``extra_info`` = ``{"index", "split", "task", "question",
        "rg_seed", "rg_index"}``; ``prompt_id`` = ``"<split>/<seed>/<index>"``.

    Raises:
        ValueError: bad ``tasks``/``size``, an unknown task or config, or a problem space too
            small to give enough distinct, non-excluded questions.
    """
    import datasets

    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"size must be a positive integer, got {size!r}")
    norm = _normalise_tasks(tasks)
    counts = _split_counts(size, [t["weight"] for t in norm])
    excluded = set(exclude_questions or ())
    demo_messages: list[dict] = []
    for k, demo in enumerate(few_shot or ()):
        if not isinstance(demo, Mapping) or not all(
            isinstance(demo.get(f), str) and demo.get(f) for f in ("question", "answer")
        ):
            raise ValueError(f"few_shot[{k}] must be a dict with non-empty string 'question' and 'answer'")
        demo_messages += [
            {"role": "user", "content": build_user_message(demo["question"], instruction)},
            {"role": "assistant", "content": demo["answer"]},
        ]
        excluded.add(demo["question"])
        excluded.add(demo["question"].strip())
    if system_prompt:
        demo_messages.insert(0, {"role": "system", "content": system_prompt})

    generated: list[tuple[str, int, int, dict]] = []  # (task, rg_seed, rg_index, entry)
    for ti, (task, count) in enumerate(zip(norm, counts)):
        rg_seed = _sub_seed(seed, ti, task["name"])
        for idx, entry in _generate_task(task["name"], task["config"], count, rg_seed, excluded):
            generated.append((task["name"], rg_seed, idx, entry))
    random.Random(seed).shuffle(generated)

    rows = []
    for index, (name, rg_seed, rg_index, entry) in enumerate(generated):
        question = entry["question"]
        messages = demo_messages + [{"role": "user", "content": build_user_message(question, instruction)}]
        rows.append(
            {
                "prompt": messages,
                "data_source": data_source,
                "reward_model": {"style": "rule", "ground_truth": str(entry["answer"])},
                "extra_info": {
                    "index": index,
                    "split": split,
                    "task": name,
                    "question": question,
                    "rg_seed": rg_seed,
                    "rg_index": rg_index,
                },
                "prompt_id": f"{split}/{seed}/{index}",
            }
        )
    return datasets.Dataset.from_list(rows)


def task_indices(tasks: Sequence[Mapping[str, Any]], seed: int, extra_infos: Sequence[Mapping[str, Any]]) -> list[int]:
    """The position in ``tasks`` of each row's task (rows of :func:`make_reasoning_gym_dataset` with the same
    ``tasks`` and ``seed``; two entries of one task with different configs are told apart).

    Raises:
        ValueError: bad ``tasks``, an ``extra_info`` without integer ``rg_seed``/``rg_index`` >= 0, or one whose
            ``rg_seed`` none of ``tasks`` gives.
    """
    index = {_sub_seed(seed, ti, t["name"]): ti for ti, t in enumerate(_normalise_tasks(tasks))}
    out = []
    for row, info in enumerate(extra_infos):
        if not isinstance(info, Mapping) or not all(
            isinstance(info.get(k), int) and not isinstance(info.get(k), bool) and info[k] >= 0
            for k in ("rg_seed", "rg_index")
        ):
            raise ValueError(
                f"row {row}: extra_info {info!r} has no integer 'rg_seed' and 'rg_index' >= 0 (the reasoning-gym "
                "rows klear writes carry both)"
            )
        if info["rg_seed"] not in index:
            raise ValueError(
                f"row {row}: extra_info {dict(info)}: rg_seed {info['rg_seed']} is not from these tasks and seed"
            )
        out.append(index[info["rg_seed"]])
    return out


def regenerate_entries(
    tasks: Sequence[Mapping[str, Any]], seed: int, extra_infos: Sequence[Mapping[str, Any]]
) -> list[tuple[dict, Any]]:
    """The reasoning-gym entries behind rows of :func:`make_reasoning_gym_dataset` (same ``tasks`` and ``seed``).

    Each row's ``extra_info`` holds ``rg_seed``/``rg_index``; the task's generator is rebuilt once per seed.

    Returns:
        ``[(entry, generator_dataset)]`` in the order of ``extra_infos`` (the dataset is what
        reasoning-gym's ``score_answer`` and procedural solvers need).

    Raises:
        ValueError: bad ``tasks``, or an ``extra_info`` that is not one of their rows (:func:`task_indices`, or a
            question other than the one its ``rg_seed``/``rg_index`` give).
    """
    import reasoning_gym

    from klear.data.procedural import register_klear_tasks

    register_klear_tasks()
    norm = _normalise_tasks(tasks)
    by_seed = {info["rg_seed"]: norm[ti] for info, ti in zip(extra_infos, task_indices(tasks, seed, extra_infos))}
    needed: dict[int, int] = {}  # per-task generator seed -> entries to generate
    for info in extra_infos:
        needed[info["rg_seed"]] = max(needed.get(info["rg_seed"], 0), info["rg_index"] + 1)
    generators = {
        s: reasoning_gym.create_dataset(by_seed[s]["name"], size=size, seed=s, **by_seed[s]["config"])
        for s, size in needed.items()
    }
    out = []
    for info in extra_infos:
        gen = generators[info["rg_seed"]]
        entry = gen[info["rg_index"]]
        if entry["question"] != info.get("question"):
            raise ValueError(
                f"extra_info {dict(info)}: its question is not the problem rg_seed/rg_index give, "
                f"{entry['question']!r} (a row edited by hand, or another reasoning-gym version)"
            )
        out.append((entry, gen))
    return out


def make_train_and_heldout(
    tasks: Sequence[Mapping[str, Any]],
    train_size: int,
    heldout_size: int,
    seed: int,
    **kwargs: Any,
):
    """A training set and a disjoint held-out set from the same task mix.

    The held-out set is generated FIRST (seed ``seed + 1``, split ``"test"``), so it does not
    depend on ``train_size``; the training set (seed ``seed``, split ``"train"``) then
    excludes every held-out question.

    Args:
        tasks: task mix, as for :func:`make_reasoning_gym_dataset`.
        train_size: number of training problems.
        heldout_size: number of held-out problems.
        seed: base seed.
        **kwargs: passed to :func:`make_reasoning_gym_dataset` (``data_source``, ``instruction``,
            ``exclude_questions`` (excluded from both)).

    Returns:
        ``(train, heldout)`` datasets with no question in common.

    Raises:
        ValueError: as :func:`make_reasoning_gym_dataset`.
    """
    for key in ("size", "seed", "split"):
        if key in kwargs:
            raise ValueError(f"make_train_and_heldout sets {key!r} itself")
    base_exclude = set(kwargs.pop("exclude_questions", None) or ())
    heldout = make_reasoning_gym_dataset(
        tasks, size=heldout_size, seed=seed + 1, split="test", exclude_questions=base_exclude, **kwargs
    )
    held_q = {info["question"] for info in heldout["extra_info"]}
    train = make_reasoning_gym_dataset(
        tasks, size=train_size, seed=seed, split="train", exclude_questions=base_exclude | held_q, **kwargs
    )
    return train, heldout


# --------------------------------------------------------------------------- verl files

_GT_EXPECTED = "expected a non-empty string or number, or a non-empty list of them"


def _scalar_gt(value: Any) -> str | None:
    """String form of a scalar ground truth, or None if it is not acceptable."""
    if isinstance(value, bool):
        return None
    if isinstance(value, str):
        return value if value.strip() else None
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float) and math.isfinite(value):
        return str(value)
    return None


def _answer_items(where: str, field: str, value: Any) -> list[str]:
    """A non-empty list of acceptable answers as strings, or a ValueError naming *field*."""
    from klear.rewards.gold import answer_list

    items = answer_list(value)
    texts = [_scalar_gt(x) for x in items] if items else []
    if not texts or any(x is None for x in texts):
        raise ValueError(
            f"{where}: field '{field}' is {short_repr(value)} "
            "(expected a non-empty list of non-empty strings or numbers)"
        )
    return [x for x in texts if x is not None]


def _check_ground_truth(where: str, reward_model: Any) -> tuple[str, str, list[str] | None]:
    if reward_model is None:
        raise ValueError(f"{where}: field 'reward_model' is missing (expected a dict with 'ground_truth')")
    if not isinstance(reward_model, dict):
        raise ValueError(
            f"{where}: field 'reward_model' is {type(reward_model).__name__} {short_repr(reward_model)} "
            f"(expected a dict with 'ground_truth')"
        )
    style = reward_model.get("style", "rule")
    if style is None:
        style = "rule"
    if not isinstance(style, str):
        raise ValueError(f"{where}: field 'reward_model.style' is {short_repr(style)} (expected a string)")
    if "ground_truth" not in reward_model or reward_model["ground_truth"] is None:
        raise ValueError(f"{where}: field 'reward_model.ground_truth' is missing ({_GT_EXPECTED})")
    from klear.rewards.gold import answer_list

    gt = reward_model["ground_truth"]
    if answer_list(gt) is not None:
        items = _answer_items(where, "reward_model.ground_truth", gt)
        return items[0], style, items
    text = _scalar_gt(gt)
    if text is None:
        raise ValueError(
            f"{where}: field 'reward_model.ground_truth' is {type(gt).__name__} {short_repr(gt)} ({_GT_EXPECTED})"
        )
    return text, style, None


def _check_scorer(where: str, data_source: str) -> None:
    """A data source no reward scorer handles fails at load time, not after the first rollout."""
    from klear.rewards import get_scorer, registered_prefixes

    try:
        get_scorer(data_source)
    except ValueError:
        raise ValueError(
            f"{where}: field 'data_source' is {data_source!r}, which no reward scorer handles "
            f"(expected a name starting with one of {registered_prefixes()})"
        ) from None


def _is_code_source(data_source: str) -> bool:
    from klear.rewards import get_scorer
    from klear.rewards.code_reward import code_score

    try:
        return get_scorer(data_source) is code_score
    except ValueError:
        return False


def _check_code_ground_truth(where: str, reward_model: Any, extra_info: Any, statement: str) -> tuple[str, str]:
    """Code rows: the ground truth may be a dict/list (stored as JSON text) and must parse as one of
    the layouts of :mod:`klear.rewards.code_reward`. A statement that accepts any output case sets
    ``case_insensitive`` (:func:`klear.data.code_data.with_statement_case_rule`)."""
    from klear.data.code_data import with_statement_case_rule
    from klear.rewards.code_reward import parse_ground_truth

    if not isinstance(reward_model, dict) or reward_model.get("ground_truth") is None:
        raise ValueError(
            f"{where}: field 'reward_model.ground_truth' is missing (expected the tests of a code "
            f"problem, see klear.rewards.code_reward)"
        )
    gt = reward_model["ground_truth"]
    try:
        parse_ground_truth(gt, extra_info if isinstance(extra_info, dict) else None)
        gt = with_statement_case_rule(gt, statement)
    except ValueError as e:
        raise ValueError(f"{where}: field 'reward_model.ground_truth': {e}") from None
    style = reward_model.get("style") or "rule"
    return (gt if isinstance(gt, str) else json.dumps(gt, ensure_ascii=False)), style


def load_rl_file(path: str | os.PathLike, *, default_data_source: str | None = None, split: str = "train"):
    """Load and validate a verl-style RL prompt file (JSONL/JSON lines or parquet).

    Each row needs:

    * ``prompt``: a non-empty list of ``{"role", "content"}`` messages (role in
      system/user/assistant/tool, content a string) or a non-empty string (wrapped as one
      user message);
    * ``data_source``: a non-empty string, unless ``default_data_source`` is given;
    * ``reward_model.ground_truth``: a non-empty string, a number (converted with ``str``) or
      a non-empty list of those (the first becomes the ground truth, all of them
      ``extra_info["acceptable_answers"]``, see the module docstring); code rows: tests in a
      layout of :mod:`klear.rewards.code_reward` (``case_insensitive`` set from the statement,
      :func:`klear.data.code_data.with_statement_case_rule`); ``reward_model.style`` defaults to
      ``"rule"``;
    * ``extra_info`` (optional): a dict. Missing ``index``/``split``/``task`` keys are filled
      with the row number, ``split`` and the data source; ``acceptable_answers``, when given,
      must be a non-empty list of strings or numbers.

    ``prompt_id`` is the row's own ``prompt_id`` column when present (so a dataset written by
    this module round-trips unchanged), else ``str(extra_info["index"])`` when the file gives
    an index, else ``"<file name>:<row>"``. Other top-level columns (e.g. ``ability``) are
    kept.
    A ``.json`` file may also be one JSON array of rows. Blank lines are ignored. Row numbers
    in errors are 0-based over the rows (blank lines not counted); JSON syntax errors also
    give the 1-based line number.

    Every row is validated; nothing is silently dropped.

    Args:
        path: the file (``.jsonl``, ``.json`` or ``.parquet``).
        default_data_source: used for rows without ``data_source``.
        split: filled into ``extra_info["split"]`` where the row does not say.

    Returns:
        A ``datasets.Dataset`` in the layout of this module.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: unsupported file type, empty file, invalid JSON, or an invalid row; the
            message names the file, the row and the field, e.g.
            ``data/train.jsonl: row 3: field 'reward_model.ground_truth' is missing (expected ...)``.
            Duplicate prompt ids name both rows.
    """
    import datasets

    path = Path(path)
    rows: list[dict] = []
    seen_ids: dict[str, int] = {}
    for r, (where, rec) in enumerate(read_rows(path)):
        if "prompt" not in rec or rec["prompt"] is None:
            raise ValueError(
                f"{where}: field 'prompt' is missing (expected a non-empty list of "
                f"{{'role', 'content'}} messages, or a string)"
            )
        messages = check_messages(where, "prompt", rec["prompt"], allow_string=True, require_user=True)

        data_source = rec.get("data_source")
        if data_source is None:
            if default_data_source is None:
                raise ValueError(
                    f"{where}: field 'data_source' is missing (expected a non-empty string; "
                    f"or pass default_data_source)"
                )
            data_source = default_data_source
        if not isinstance(data_source, str) or not data_source:
            raise ValueError(f"{where}: field 'data_source' is {short_repr(data_source)} (expected a non-empty string)")

        answers: list[str] | None = None
        if _is_code_source(data_source):
            statement = next((m["content"] for m in reversed(messages) if m["role"] == "user"), "")
            ground_truth, style = _check_code_ground_truth(
                where, rec.get("reward_model"), rec.get("extra_info"), statement
            )
        else:
            ground_truth, style, answers = _check_ground_truth(where, rec.get("reward_model"))
        _check_scorer(where, data_source)

        extra = rec.get("extra_info")
        if extra is None:
            extra = {}
        if not isinstance(extra, dict):
            raise ValueError(
                f"{where}: field 'extra_info' is {type(extra).__name__} {short_repr(extra)} (expected a dict)"
            )
        try:
            json.dumps(extra)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{where}: field 'extra_info' is not JSON-serialisable ({exc})") from exc
        extra = dict(extra)
        from klear.rewards.gold import ACCEPTABLE_ANSWERS_FIELD

        if extra.get(ACCEPTABLE_ANSWERS_FIELD) is not None or answers is not None:
            field = f"extra_info.{ACCEPTABLE_ANSWERS_FIELD}"
            given = extra.get(ACCEPTABLE_ANSWERS_FIELD)
            more = [] if given is None else _answer_items(where, field, given)
            merged = list(answers or [ground_truth])
            merged += [x for x in more if x not in merged]
            extra[ACCEPTABLE_ANSWERS_FIELD] = merged
        index = extra.get("index")
        if index is not None and (isinstance(index, bool) or not isinstance(index, (int, str))):
            raise ValueError(f"{where}: field 'extra_info.index' is {short_repr(index)} (expected an int or string)")
        given_id = rec.get("prompt_id")
        if given_id is not None:
            if isinstance(given_id, bool) or not isinstance(given_id, (int, str)) or given_id == "":
                raise ValueError(
                    f"{where}: field 'prompt_id' is {short_repr(given_id)} (expected a non-empty string or an int)"
                )
            prompt_id, id_field = str(given_id), "prompt_id"
        elif index is not None:
            prompt_id, id_field = str(index), "extra_info.index"
        else:
            prompt_id, id_field = f"{path.name}:{r}", "extra_info.index"
        if index is None:
            extra["index"] = r
        extra.setdefault("split", split)
        extra.setdefault("task", data_source)
        if prompt_id in seen_ids:
            raise ValueError(
                f"{path}: rows {seen_ids[prompt_id]} and {r} have the same prompt id {prompt_id!r} "
                f"(field '{id_field}'; expected unique per problem)"
            )
        seen_ids[prompt_id] = r

        row = {
            k: v
            for k, v in rec.items()
            if k not in ("prompt", "data_source", "reward_model", "extra_info", "prompt_id")
        }
        row.update(
            {
                "prompt": messages,
                "data_source": data_source,
                "reward_model": {"style": style, "ground_truth": ground_truth},
                "extra_info": extra,
                "prompt_id": prompt_id,
            }
        )
        rows.append(row)

    columns: list[str] = []
    for row in rows:
        for key in row:
            if key not in columns:
                columns.append(key)
    try:
        return datasets.Dataset.from_dict({c: [row.get(c) for row in rows] for c in columns})
    except Exception as exc:  # pyarrow type conflicts between rows
        raise ValueError(
            f"{path}: rows disagree on the type of some field (extra_info or an extra column): {exc}"
        ) from exc


def load_rl_dataset(source, **kwargs: Any):
    """Load an RL prompt set from a file, or generate one from a reasoning-gym task mix.

    Args:
        source: a path (str / PathLike) to a ``.jsonl``/``.json``/``.parquet`` file in the verl
            RL layout -> :func:`load_rl_file`; or a list of reasoning-gym task dicts ->
            :func:`make_reasoning_gym_dataset` (then ``size`` and ``seed`` are required
            keyword arguments).
        **kwargs: passed to the function chosen.

    Returns:
        A ``datasets.Dataset`` in the layout of this module.

    Raises:
        FileNotFoundError: ``source`` looks like a path but no such file exists.
        ValueError: as the chosen loader, or ``source`` is of an unsupported kind.
    """
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        if path.is_dir():
            raise ValueError(f"{path}: is a directory (expected a .jsonl, .json or .parquet file)")
        return load_rl_file(path, **kwargs)
    if isinstance(source, Sequence) and source and all(isinstance(t, Mapping) for t in source):
        return make_reasoning_gym_dataset(source, **kwargs)
    raise ValueError(
        f"unsupported RL data source {short_repr(source)} (expected a file path or a list of reasoning-gym task dicts)"
    )
