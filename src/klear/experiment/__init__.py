"""``klear experiment``: a base ``klear rl`` (or ``klear sft``) recipe x named arms x seeds, run as a grid, then one
report.

An experiment file (YAML, see ``configs/experiments/``)::

    name: gppo_vs_baselines
    description: one paragraph shown at the top of report.md
    base: rl_demo                 # a klear rl recipe: a path (relative to this file) or a shipped recipe name
    overrides:                    # dotted keys applied to the base for every arm
      trainer.max_steps: 16
      eval.every_steps: 4
    arms:                         # name -> dotted-key overrides applied after `overrides`
      gppo: {}
      clip_higher: {trainer.loss_mode: ppo_clip, trainer.clip_ratio_c: null}
    reference: gppo               # the arm the others are compared with (default: the first)
    seeds: [0, 1, 2]              # default seeds (--seeds overrides)
    output_dir: runs/experiments/gppo_vs_baselines
    keep_models: false            # default: a finished run's final/ and checkpoints/ are removed
    stage: rl                     # default; ``sft``: the base is a klear sft recipe and every run a klear sft run
    jobs: 1                       # default; CPU runs side by side (--jobs overrides; see Processes below)

Each arm x seed is a normal ``klear rl`` (``klear sft``) run directory ``<output_dir>/<arm>/seed<k>``. The seed sets
``trainer.seed`` only (initialisation of the sampler, shuffling, dropout): the recipe's top-level ``seed``,
which draws the training and held-out problems and the held-out sampling seed, stays the base's, so every
run of the experiment is evaluated on the same held-out problems with the same sampling seed (common
random numbers). ``trainer.max_steps`` is required (the progress bar counts optimizer steps).

Files: ``<output_dir>/plan.json`` (every planned run's recipe), the run directories, and the report
(:mod:`klear.experiment.report`: ``report.md``, ``summary.json``, PNG plots).

Disk: a run of the embedded model writes ~0.5 GB of final weights and ~1.6 GB of checkpoints (weights and
optimizer state), and the report reads none of them, so unless ``keep_models: true`` each run's ``final/``
and ``checkpoints/`` are removed once the run has finished (its metrics, held-out files and config stay).

Processes: on a CUDA machine each run is a child process of its own (:func:`run_in_own_process`): a colocated
vLLM engine and the CUDA caching allocator give their GPU memory back only when their process ends, so a second
run in the same process would fail vLLM's free-memory check (``gpu_memory_utilization`` of the whole device
must be free when its engine starts). The child gets the run's recipe and ``callbacks`` (which must then be
picklable) and reports its progress and its error to this process; starting it costs a few seconds (Python,
torch and the libraries imported again), nothing next to a GPU run, so with ``jobs: 1`` CPU runs stay in this
process.

``jobs: N`` (N > 1, CPU runs only; ``--jobs N``) runs up to N runs side by side (never more than there are runs
to do), each in its own child process with ``torch.set_num_threads(max(1, T // N))`` for this process's T
threads: on a small CPU one run may not keep its cores busy (Python and TRL's per-step work is serial, and a
small model's matmuls scale poorly), so two 1-thread runs on 2 cores can finish a grid sooner than one 2-thread
run after another (measured in ``docs/experiments.md``: yes for the bench's tiny models, no for the embedded
135M model). Memory: N runs' worth at once. Each run's wall time (the report's "train min") is then its time
beside the others. The first error stops the other runs and is raised, naming its run; a child ends when this
process ends (killed too). A file's ``jobs`` on runs that use the GPU falls back to 1 (said); ``--jobs`` > 1
there is an error. Side by side, each run's console output (its progress bars, per-step metrics and result
lines) goes to ``<output_dir>/<arm>/seed<k>.log`` (beside its run directory) instead of interleaving on this
console, which shows the grid's bar and one line per finished (or failed) run naming its log. Callbacks must be
picklable and importable in a fresh process (not defined in a notebook or ``python -c``), and a script that calls
:func:`run_experiment` with ``jobs`` > 1 needs the usual ``if __name__ == "__main__":`` guard of the spawn start
method.

Re-running: a finished run (its ``eval.json`` exists) is skipped. An unfinished run (killed) is an error
unless ``resume=True`` (``--resume``): then a run with a checkpoint continues from its latest one
(``klear rl --resume``), and a run killed before its first checkpoint is removed and restarted. A run whose
planned recipe differs from the one recorded in ``plan.json`` is an error naming the run and the keys.
"""

from __future__ import annotations

import copy
import json
import queue
import re
import shutil
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from klear.config import CONFIG_DIR, find_config, load_config, load_yaml, set_key, yaml_error_line
from klear.recipe import check_section_keys

EXPERIMENT_DIR = CONFIG_DIR / "experiments"
_TOP_KEYS = {
    "name",
    "description",
    "base",
    "overrides",
    "arms",
    "reference",
    "seeds",
    "output_dir",
    "keep_models",
    "stage",
    "jobs",
}
#: The stages an experiment can run: ``stage`` -> (module, its recipe validator, its job runner).
STAGES = {"rl": ("klear.rl.job", "build_rl_recipe", "run_rl"), "sft": ("klear.sft.job", "build_sft_recipe", "run_sft")}
MODEL_DIRS = ("final", "checkpoints")  # what a finished run loses unless keep_models
PLAN_FILE = "plan.json"

__all__ = [
    "EXPERIMENT_DIR",
    "Experiment",
    "find_experiment",
    "load_experiment",
    "plan_runs",
    "run_experiment",
    "run_in_own_process",
]


@dataclass
class Experiment:
    """A loaded experiment file.

    Attributes:
        name, description: as in the file. source: the file's path. base: the base recipe (loaded, with
        ``overrides`` applied). arms: ``{arm: {dotted key: value}}`` in file order. reference: the reference arm.
        seeds: default seeds. output_dir: where the runs and the report go. keep_models: keep each finished
        run's ``final/`` and ``checkpoints/`` (default False: removed, see the module docstring). stage: ``rl`` or
        ``sft`` (:data:`STAGES`). jobs: runs side by side (:func:`check_jobs`). base_source: the base recipe's
        path (None: not read from a file).
    """

    name: str
    description: str
    source: Path
    base: dict[str, Any]
    arms: dict[str, dict[str, Any]]
    reference: str
    seeds: list[int]
    output_dir: Path
    keep_models: bool = False
    stage: str = "rl"
    jobs: int = 1
    base_source: Path | None = None


def _stage_function(stage: str, which: int):
    """The validator (``which`` 1) or runner (2) of ``stage`` (:data:`STAGES`)."""
    import importlib

    entry = STAGES[stage]
    return getattr(importlib.import_module(entry[0]), entry[which])


def find_experiment(name_or_path: str | Path) -> Path:
    """An experiment file: an existing path, or a name shipped in ``configs/experiments`` (``gppo_vs_baselines``).

    Raises:
        FileNotFoundError: neither exists; lists the shipped experiments.
    """
    return find_config(name_or_path, EXPERIMENT_DIR, "experiment")


def set_dotted(config: dict[str, Any], key: str, value: Any, where: str) -> None:
    """Set ``config[a][b][c] = value`` for ``key = "a.b.c"`` in place, as ``klear rl`` overrides
    (:func:`klear.config.set_key`: sections created, a mapping value merged into an existing section).

    Raises:
        ValueError: an empty key part, or a part that descends into a non-mapping value (names ``where``).
    """
    parts = str(key).split(".")
    if any(not p for p in parts):
        raise ValueError(f"{where}: key {key!r} has an empty part")
    set_key(config, parts, value, f"{where}: key {key!r}")


def _overrides(section: Any, where: str) -> dict[str, Any]:
    if section is None:
        return {}
    if not isinstance(section, dict):
        raise ValueError(f"{where} must be a mapping of dotted keys to values, got {type(section).__name__}")
    return dict(section)


#: Keys the experiment sets for each run (from ``seeds`` and ``output_dir``); an override of them would be lost.
_PER_RUN_KEYS = ("trainer.seed", "output_dir")


def _dotted_keys(key: str, value: Any) -> list[str]:
    """The dotted keys an override sets: ``key`` itself, and those inside a mapping value (``trainer: {seed: 1}``)."""
    if not isinstance(value, dict):
        return [key]
    return [key, *(k for child, sub in value.items() for k in _dotted_keys(f"{key}.{child}", sub))]


def _check_not_per_run(key: Any, value: Any, where: str) -> None:
    """Refuse an override of a key :func:`plan_runs` sets for every run (dotted, or inside a mapping value)."""
    for k in _dotted_keys(str(key), value):
        if k in _PER_RUN_KEYS:
            raise ValueError(
                f"{where}: {k} is set by the experiment for each run (from its seeds / output_dir), not by an override"
            )


def _seeds(value: Any, where: str) -> list[int]:
    if (
        not isinstance(value, list)
        or not value
        or any(isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in value)
    ):
        raise ValueError(f"{where} must be a non-empty list of integers >= 0, got {value!r}")
    if len(set(value)) != len(value):
        raise ValueError(f"{where} lists a seed twice: {value!r}")
    return list(value)


def parse_seeds(text: str) -> list[int]:
    """``"0,1,2"`` -> ``[0, 1, 2]``.

    Raises:
        ValueError: an entry that is not an integer >= 0, or a repeated seed.
    """
    entries = [s.strip() for s in text.split(",")]
    if not all(re.fullmatch(r"[0-9]+", s, flags=re.ASCII) for s in entries):
        raise ValueError(f"--seeds {text!r} must be comma-separated integers >= 0, e.g. 0,1,2")
    return _seeds([int(s) for s in entries], "--seeds")


def check_jobs(value: Any, where: str) -> int:
    """``jobs`` (runs side by side, module docstring) as an int.

    Raises:
        ValueError: not a positive integer (the message starts with ``where``).
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{where} must be a positive integer (runs side by side), got {value!r}")
    return value


def load_experiment(name_or_path: str | Path) -> Experiment:
    """Read an experiment file (module docstring) and its base recipe.

    Raises:
        FileNotFoundError: the file or its base recipe does not exist.
        ValueError: not YAML, an unknown top-level key, no arms, an arm name that is not a plain name, an
            unknown ``reference``, bad ``seeds``, overrides that are not mappings, a ``keep_models`` that is not
            a boolean, an unknown ``stage``, a ``jobs`` that is not a positive integer (each names the file and key).
    """
    path = find_experiment(name_or_path)
    try:
        spec = load_yaml(path.read_text())
    except yaml.YAMLError as e:
        raise ValueError(f"{path}: not valid YAML: {yaml_error_line(e)}") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not valid UTF-8 ({e.reason} at byte {e.start})") from None
    if spec is None:
        raise ValueError(
            f"{path}: the file is empty (an experiment needs base, arms and seeds; see docs/experiments.md)"
        )
    if not isinstance(spec, dict):
        raise ValueError(f"{path}: expected a YAML mapping at the top level, got {type(spec).__name__}")
    check_section_keys(spec, _TOP_KEYS, "the top level", str(path))
    stage = spec.get("stage", "rl")
    if stage not in STAGES:
        raise ValueError(f"{path}: stage={stage!r} is unknown; expected one of {sorted(STAGES)}")
    if not spec.get("base"):
        raise ValueError(f"{path}: 'base' (a klear {stage} recipe) is required")
    if not isinstance(spec["base"], str):
        raise ValueError(f"{path}: base must be a recipe's name or path, got {spec['base']!r}")
    local = (path.parent / spec["base"]).resolve()
    try:
        base, base_source = load_config(local if local.is_file() else find_config(spec["base"]))
    except FileNotFoundError as e:
        raise FileNotFoundError(f"{path}: base: {e}") from None
    for key, value in _overrides(spec.get("overrides"), f"{path}: 'overrides'").items():
        _check_not_per_run(key, value, f"{path}: overrides")
        set_dotted(base, key, value, f"{path}: overrides")
    arms_spec = spec.get("arms")
    if not isinstance(arms_spec, dict) or not arms_spec:
        raise ValueError(f"{path}: 'arms' must be a non-empty mapping of arm name -> overrides")
    arms = {}
    for arm, section in arms_spec.items():
        if not isinstance(arm, str) or not arm.replace("_", "").replace("-", "").isalnum():
            raise ValueError(f"{path}: arm name {arm!r} must be letters, digits, '_' or '-' (it names a directory)")
        arms[arm] = _overrides(section, f"{path}: arms.{arm}")
        for key, value in arms[arm].items():
            _check_not_per_run(key, value, f"{path}: arms.{arm}")
    reference = spec.get("reference", next(iter(arms)))
    if not isinstance(reference, str) or reference not in arms:
        raise ValueError(f"{path}: reference={reference!r} is not an arm (arms: {list(arms)})")
    for key in ("name", "description", "output_dir"):
        if spec.get(key) is not None and not isinstance(spec[key], str):
            raise ValueError(f"{path}: {key} must be a string, got {spec[key]!r}")
    name = str(spec.get("name") or path.stem)
    if not name.replace("_", "").replace("-", "").replace(".", "").isalnum() or name.startswith("."):
        raise ValueError(f"{path}: name {name!r} must be letters, digits, '_', '-' or '.' (it names a directory)")
    keep_models = spec.get("keep_models", False)
    if not isinstance(keep_models, bool):
        raise ValueError(f"{path}: keep_models must be true or false, got {keep_models!r}")
    jobs = check_jobs(spec.get("jobs", 1), f"{path}: jobs")
    return Experiment(
        name=name,
        description=str(spec.get("description") or "").strip(),
        source=path,
        base=base,
        arms=arms,
        reference=reference,
        seeds=_seeds(spec.get("seeds", [0, 1, 2]), f"{path}: seeds"),
        output_dir=Path(spec.get("output_dir") or f"runs/experiments/{name}"),
        keep_models=keep_models,
        stage=stage,
        jobs=jobs,
        base_source=base_source,
    )


def _check_run(validate_job_config, config: dict[str, Any], where: str) -> None:
    """``klear rl`` (``klear sft``)'s check of one run's recipe, and an integer ``trainer.max_steps`` >= 1."""
    validate_job_config(config, where)
    steps = config["trainer"].get("max_steps")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(
            f"{where}: trainer.max_steps={steps!r} must be an integer >= 1 (the grid counts optimizer steps)"
        )


def plan_runs(exp: Experiment, seeds: list[int], output_dir: Path) -> dict[str, dict[str, Any]]:
    """Every run's recipe: ``{"<arm>/seed<k>": config}`` (arm order, then seed order), each validated.

    Raises:
        ValueError: a run's recipe ``klear rl`` (``klear sft``) rejects, or no ``trainer.max_steps``; named with the
            base recipe when the base with the file's ``overrides`` is rejected on its own and the run for the same
            reason (or the arm's overrides cannot be applied to it), else with the arm and seed (and what is wrong
            with the base, if anything).
    """
    validate_job_config = _stage_function(exp.stage, 1)
    base_problem = None  # what is wrong with the base and the file's overrides on their own, if anything
    base_where = (
        f"{exp.source}: {'base ' + str(exp.base_source) if exp.base_source else 'base'} with the file's overrides"
    )
    if seeds:
        config = copy.deepcopy(exp.base)
        config["output_dir"] = str(output_dir)
        try:
            set_dotted(config, "trainer.seed", seeds[0], "")
            _check_run(validate_job_config, config, "")
        except ValueError as e:
            base_problem = str(e).removeprefix(": ")

    runs = {}
    for arm, overrides in exp.arms.items():
        for seed in seeds:
            run = f"{arm}/seed{seed}"
            where = f"{exp.source}: arm {arm}, seed {seed}"
            config = copy.deepcopy(exp.base)
            try:
                for key, value in overrides.items():
                    set_dotted(config, key, value, f"{exp.source}: arms.{arm}")
            except ValueError:
                if base_problem is not None:  # e.g. eval.n_samples into a base whose eval is not a section
                    raise ValueError(f"{base_where}: {base_problem}") from None
                raise
            config["output_dir"] = str(output_dir / arm / f"seed{seed}")
            try:
                set_dotted(config, "trainer.seed", seed, where)
                _check_run(validate_job_config, config, where)
            except ValueError as e:
                if base_problem is None:
                    raise
                if str(e) == f"{where}: {base_problem}":  # the base's own fault, which the arm did not mend
                    raise ValueError(f"{base_where}: {base_problem}") from None
                raise ValueError(f"{e} (and on its own, {base_where}: {base_problem})") from None
            runs[run] = config
    return runs


def _diff_keys(a: Any, b: Any, prefix: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for key in sorted(set(a) | set(b), key=str):
            out += _diff_keys(a.get(key), b.get(key), f"{prefix}{key}.")
        return out
    return [] if a == b else [prefix.rstrip(".")]


def _check_plan(out: Path, runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The saved plan merged with ``runs``; raises ``ValueError`` when an existing run's recipe changed."""
    path = out / PLAN_FILE
    saved: Any = {"runs": {}}
    if path.exists():
        try:
            saved = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise ValueError(
                f"{path}: not a readable experiment plan ({e}); remove it or use another --output"
            ) from None
        if not isinstance(saved, dict) or not isinstance(saved.get("runs"), dict):
            raise ValueError(f"{path}: not an experiment plan (no 'runs' mapping); remove it or use another --output")
    for run, config in runs.items():
        old = saved["runs"].get(run)
        planned = json.loads(json.dumps(config))
        if old is not None and (out / run).exists() and old != planned:
            keys = ", ".join(_diff_keys(old, planned)[:8])
            raise ValueError(
                f"{out / run}: this run was started with another recipe (changed: {keys}); use another "
                "--output, or remove the run directory"
            )
        saved["runs"][run] = planned
    return saved


def _last_checkpoint_step(run_dir: Path) -> int | None:
    """The step of the run's newest complete checkpoint (:func:`klear.lifecycle.latest_complete_checkpoint`)."""
    from klear.lifecycle import checkpoint_step, latest_complete_checkpoint

    last = latest_complete_checkpoint(run_dir / "checkpoints")
    return checkpoint_step(last) if last else None


def _progress_callback(bar):
    """A ``TrainerCallback`` advancing the tqdm ``bar`` over the whole grid, one tick per optimizer step."""
    from transformers import TrainerCallback

    class Progress(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            bar.update(1)

    return Progress()


def run_in_own_process(config: dict[str, Any]) -> bool:
    """Whether ``klear experiment`` runs this run's recipe in a child process (module docstring): CUDA is
    available and the recipe does not set ``trainer.use_cpu``."""
    import torch

    return bool(torch.cuda.is_available()) and not (config.get("trainer") or {}).get("use_cpu", False)


class _QueueBar:
    """Stands in for the parent's progress bar in a child process: each ``update(n)`` is put on ``ticks``."""

    def __init__(self, ticks):
        self.ticks = ticks

    def update(self, n: int = 1) -> None:
        self.ticks.put(n)


# Errors a child process's run re-raises in the parent with the same type (anything else: RuntimeError).
_CHILD_ERRORS = {e.__name__: e for e in (ValueError, FileNotFoundError, RuntimeError, KeyboardInterrupt)}


def _exit_with_parent() -> None:
    """In a child process: end it as soon as its parent process ends (killed, SIGTERM, SIGHUP), so no run trains
    on as an orphan writing into a run directory that a ``--resume`` may take over."""
    import multiprocessing
    import os
    import threading

    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        parent.join()  # waits on the parent's sentinel: returns when the parent has ended
        os._exit(1)

    threading.Thread(target=watch, name="klear-exit-with-parent", daemon=True).start()


def _child_run(stage, config, source, resume, callbacks, threads, ticks, result, log=None) -> None:
    """A child process's run (:class:`_Child`): ``torch.set_num_threads(threads)`` unless ``threads`` is None, the
    stage's job runner, then ``None`` or ``(type, message, traceback)`` on ``result``. The child ends with its
    parent (:func:`_exit_with_parent`). ``log``: a file that gets the process's stdout and stderr (appended)."""
    _exit_with_parent()
    try:
        if log is not None:
            _output_to(log)
            # a header per start: a run restarted by --resume appends to the killed run's log
            started = time.strftime("%Y-%m-%d %H:%M:%S")
            print(f"\n==== {source}: {'resumed' if resume else 'started'} {started} ====", flush=True)
        if threads is not None:
            import torch

            torch.set_num_threads(threads)
        run_job = _stage_function(stage, 2)
        run_job(config, source=source, resume=resume, callbacks=[_progress_callback(_QueueBar(ticks)), *callbacks])
    except BaseException as e:  # every error goes to the parent, which raises it
        if log is not None:
            traceback.print_exc()  # the log tells the whole story
        result.put((type(e).__name__, str(e), traceback.format_exc()))
        raise SystemExit(1) from None
    result.put(None)


def _output_to(log: Path) -> None:
    """This process's stdout and stderr, the file descriptors too (C-level output, subprocesses), appended to
    ``log`` (its folder made)."""
    import os
    import sys

    log.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    for stream, target in ((sys.stdout, 1), (sys.stderr, 2)):
        stream.flush()
        os.dup2(fd, target)
        stream.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    os.close(fd)


class RunProcessTraceback(Exception):
    """The traceback (text) of an error in a run's own process: the cause of the error raised for it here."""


_NO_RESULT = object()
EXIT_GRACE_S = 30.0  # a child still alive this long after reporting its result is stopped (it has nothing left to do)


class _Child:
    """The ``stage``'s run (``run_rl`` / ``run_sft``) of ``source`` in a fresh (spawned) process, started at once."""

    def __init__(
        self,
        stage: str,
        config: dict[str, Any],
        source: str,
        resume: bool,
        callbacks: list,
        threads=None,
        log: Path | None = None,
    ):
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")  # never fork a process that may hold CUDA state
        self.source, self.log = source, log
        self.ticks, self.result = ctx.Queue(), ctx.Queue()
        args = (stage, config, source, resume, callbacks, threads, self.ticks, self.result, log)
        self.proc = ctx.Process(target=_child_run, args=args, daemon=False)
        self.proc.start()
        self.outcome: Any = _NO_RESULT
        self.reported_at = 0.0

    def forward_ticks(self, bar, timeout: float = 0.0) -> None:
        """Move the child's optimizer-step ticks to ``bar`` (waiting up to ``timeout`` s for the first)."""
        try:
            bar.update(self.ticks.get(timeout=timeout) if timeout else self.ticks.get_nowait())
            while True:
                bar.update(self.ticks.get_nowait())
        except queue.Empty:
            pass

    def done(self) -> bool:
        """Whether the child has ended, or reported its result more than :data:`EXIT_GRACE_S` ago."""
        import time

        if self.outcome is _NO_RESULT:
            try:
                self.outcome, self.reported_at = self.result.get_nowait(), time.monotonic()
            except queue.Empty:
                pass
        if not self.proc.is_alive():
            return True
        return self.outcome is not _NO_RESULT and time.monotonic() - self.reported_at > EXIT_GRACE_S

    def finish(self, bar) -> None:
        """Wait for the child to end (stopping one that reported its result but does not exit), flush its ticks to
        ``bar``, and raise its error here.

        Raises:
            ValueError, FileNotFoundError, RuntimeError, KeyboardInterrupt: the child's, with its message; any other
                error of the child (or a child that died without reporting, e.g. killed) as a ``RuntimeError``
                naming the run's ``source``.
        """
        if self.outcome is not _NO_RESULT and self.proc.is_alive():
            print(f"{self.source}: its process was alive {EXIT_GRACE_S:.0f} s after the run ended; stopped", flush=True)
            self.stop()
        self.proc.join()
        self.forward_ticks(bar)  # ticks sent after the last poll
        outcome = self.outcome
        if outcome is _NO_RESULT:
            try:
                outcome = self.result.get(timeout=5)
            except queue.Empty:
                where = f"in {self.log}" if self._has_log() else "above"
                outcome = (
                    "died",
                    f"its process exited with code {self.proc.exitcode} without a result (its output {where} says why)",
                    "",
                )
        if outcome is None:
            return
        name, message, child_traceback = outcome
        if self._has_log() and name != "died":
            print(f"{self.source}: failed; its output: {self.log}", flush=True)
        error = _CHILD_ERRORS.get(name)
        if error is not None:
            if message.startswith(self.source):  # klear's own one-line errors name the run already
                raise error(message)
            # others (a callback's, torch's): the run, and the child's traceback as the cause
            raise error(f"{self.source}: {message}") from RunProcessTraceback(child_traceback.rstrip())
        raise RuntimeError(f"{self.source}: {name}: {message} (in the run's own process)\n{child_traceback}".rstrip())

    def _has_log(self) -> bool:
        return self.log is not None and Path(self.log).is_file()

    def stop(self) -> None:
        """End the child now (another run failed, or Ctrl-C here)."""
        self.proc.terminate()
        self.proc.join()


def _run_in_child(stage: str, config: dict[str, Any], source: str, resume: bool, callbacks: list, bar) -> None:
    """The ``stage``'s run in a fresh (spawned) process, its optimizer steps ticking ``bar``; raises its error here
    (:meth:`_Child.finish`)."""
    child = _Child(stage, config, source, resume, callbacks)
    try:
        while not child.done():
            child.forward_ticks(bar, timeout=0.5)
    except BaseException:  # e.g. Ctrl-C here: stop the child too
        child.stop()
        raise
    child.finish(bar)


def _run_side_by_side(stage: str, todo: list, jobs: int, source_of, callbacks: list, bar, on_done, log_of) -> None:
    """Every ``(run, config, resume)`` of ``todo`` in its own process, up to ``jobs`` at a time (callers pass at most
    ``len(todo)``), each with ``max(1, T // jobs)`` threads (module docstring) and its output in the file
    ``log_of(run)``; ``on_done(run)`` after each finished run.

    Raises:
        the first failed run's error (:meth:`_Child.finish`); the other runs are stopped first.
    """
    import time

    import torch

    threads = max(1, torch.get_num_threads() // jobs)
    pending, running = list(todo), dict[str, _Child]()
    try:
        while pending or running:
            while pending and len(running) < jobs:
                run, config, resume_run = pending.pop(0)
                running[run] = _Child(stage, config, source_of(run), resume_run, callbacks, threads, log_of(run))
                bar.set_postfix_str(", ".join(running))
            time.sleep(0.2)
            for run, child in list(running.items()):
                child.forward_ticks(bar)
                if child.done():
                    del running[run]
                    child.finish(bar)
                    on_done(run)
                    bar.set_postfix_str(", ".join(running))
    except BaseException:
        for child in running.values():
            child.stop()
        raise


def run_experiment(
    exp: Experiment,
    *,
    seeds: list[int] | None = None,
    resume: bool = False,
    output_dir: str | Path | None = None,
    callbacks: list | None = None,
    jobs: int | None = None,
) -> Path:
    """Run every arm x seed of ``exp`` (skipping finished runs), then write the report.

    Args:
        exp: the experiment (:func:`load_experiment`).
        seeds: the seeds (default ``exp.seeds``).
        resume: continue unfinished (killed) runs (module docstring); without it an unfinished run is an error.
        output_dir: where the runs and report go (default ``exp.output_dir``).
        callbacks: extra ``TrainerCallback`` objects given to every run (picklable when a run has its own process,
            :func:`run_in_own_process`, or ``jobs`` > 1).
        jobs: runs side by side (default ``exp.jobs``; module docstring).

    Returns:
        The path of ``report.md``.

    Raises:
        ValueError: an invalid run recipe (before any run starts), ``jobs`` > 1 with runs that use a GPU, an
            unfinished run without ``resume``, a run whose recipe changed since it started, or a report error
            (:func:`klear.experiment.report.write_report`). FileNotFoundError: a run's ``model`` that is a missing
            local folder. Building a missing ``bench:`` model, once before any run starts, raises as
            :func:`klear.experiment.bench.ensure_bench_model`.
    """
    from tqdm.auto import tqdm

    import klear.experiment.bench  # noqa: F401  (registers the builder of bench: models, built on first use)
    from klear.experiment.report import write_report
    from klear.models.embedded import resolve_model_path

    run_job = _stage_function(exp.stage, 2)

    out = Path(output_dir or exp.output_dir)
    seeds = list(seeds or exp.seeds)
    asked = jobs is not None
    jobs = check_jobs(jobs if asked else exp.jobs, "jobs")
    runs = plan_runs(exp, seeds, out)
    gpu = [run for run, config in runs.items() if run_in_own_process(config)]
    if jobs > 1 and gpu:
        if asked:
            raise ValueError(
                f"{exp.source}: jobs={jobs} runs CPU runs side by side, but {gpu[0]} would use the GPU "
                "(one GPU run at a time: use jobs 1, or trainer.use_cpu: true)"
            )
        print(f"{exp.source}: jobs: {jobs} is for CPU runs; these use the GPU, so they run one at a time", flush=True)
        jobs = 1
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # a file in the way: before any model is resolved (or built)
        raise ValueError(f"{out}: cannot create the experiment's output directory ({e.strerror})") from None
    plan = _check_plan(out, runs)
    todo, done_steps = [], 0
    for run, config in runs.items():
        run_dir = out / run
        if run_dir.exists() and not run_dir.is_dir():
            raise ValueError(f"{run_dir}: a run's folder is not a directory; remove it or use another --output")
        steps = config["trainer"]["max_steps"]
        if (run_dir / "eval.json").is_file():
            done_steps += steps
            continue
        resume_run = False
        if run_dir.exists():
            if not resume:
                raise ValueError(f"{run_dir}: an unfinished run (killed?); pass --resume to continue it, or remove it")
            step = _last_checkpoint_step(run_dir)
            if step is None:  # killed before its first checkpoint (or it saves none): start it again
                print(f"{run_dir}: no complete checkpoint to resume from; starting it again", flush=True)
                shutil.rmtree(run_dir)
            else:
                resume_run, done_steps = True, done_steps + step
        todo.append((run, config, resume_run))
    # each run's model once, here, before any run starts: runs side by side (spawned processes) would each build a
    # missing bench: model or convert the embedded one into the same cache folder
    first_run: dict[str, str] = {}
    for run, config, _ in todo:
        first_run.setdefault(str(config["model"]), run)
    for model, run in first_run.items():
        try:
            resolve_model_path(model)
        except FileNotFoundError as e:
            raise FileNotFoundError(f"{exp.source}: {run}: model: {e}") from None
        except ValueError as e:  # an unknown bench: name, a bench build outside its band
            raise ValueError(f"{exp.source}: {run}: model: {e}") from None
    plan.update(experiment=exp.name, source=str(exp.source), reference=exp.reference, arms=list(exp.arms))
    plan["seeds"] = seeds
    jobs = min(jobs, max(1, len(todo)))  # runs at a time: never more than there are runs to do
    recorded: dict = plan["jobs"] if isinstance(plan.get("jobs"), dict) else {}  # per run, as it last ran
    side_by_side = plan["jobs"] = {**recorded, **{run: jobs for run, _, _ in todo}}
    (out / PLAN_FILE).write_text(json.dumps(plan, indent=1))
    total = sum(c["trainer"]["max_steps"] for c in runs.values())

    def source_of(run: str) -> str:
        return f"{exp.source}: {run}"

    def drop_models(run: str) -> None:
        if not exp.keep_models:
            for name in MODEL_DIRS:
                shutil.rmtree(out / run / name, ignore_errors=True)

    def log_of(run: str) -> Path:
        return out / f"{run}.log"

    def finished(run: str) -> None:
        drop_models(run)
        bar.write(f"{run}: finished; its output: {log_of(run)}")

    with tqdm(total=total, initial=done_steps, desc=f"experiment {exp.name}", unit="step", dynamic_ncols=True) as bar:
        if jobs > 1:
            _run_side_by_side(exp.stage, todo, jobs, source_of, list(callbacks or []), bar, finished, log_of)
            todo = []
        for run, config, resume_run in todo:
            bar.set_postfix_str(run)
            if run_in_own_process(config):
                _run_in_child(exp.stage, config, source_of(run), resume_run, list(callbacks or []), bar)
            else:
                run_job(
                    config,
                    source=source_of(run),
                    resume=resume_run,
                    callbacks=[_progress_callback(bar), *(callbacks or [])],
                )
            drop_models(run)
    run_jobs = {run: n if isinstance(n, int) and n >= 1 else 1 for run in runs for n in [side_by_side.get(run, 1)]}
    return write_report(out, exp, {run: out / run for run in runs}, seeds, jobs=run_jobs)
