"""`klear experiment`: a 2-arm x 2-seed grid on a tiny model (kills and resumes), the report's numbers
recomputed from the run files, the TRL peer arm, and the shipped experiment files."""

from __future__ import annotations

import json
import math
import os
import statistics
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml
from transformers import TrainerCallback

from conftest import rl_recipe, varied_reward, write_experiment
from klear.config import find_config
from klear.experiment import EXPERIMENT_DIR, load_experiment, plan_runs, run_experiment
from klear.rl.job import run_rl, validate_job_config
from klear.rl.trl_peer import TRLPeerConfig, TRLPeerTrainer, peer_trainer_section

T_975_DF1 = 12.706204736174707  # Student t quantile 0.975, 1 degree of freedom (tables)
Z_975 = 1.959963984540054


def _base(tmp_path, ckpt):
    base = rl_recipe(
        tmp_path,
        ckpt,
        eval_settings={"max_new_tokens": 4, "batch_size": 8, "n_samples": 2, "temperature": 1.0, "every_steps": 1},
        steps_per_generation=2,
        max_steps=2,
        learning_rate=1e-4,
        save_steps=1,
        temperature=1.0,
        loss_mode="gppo",
    )
    return {**base, "output_dir": "unused"}


def _experiment(tmp_path, ckpt):
    (tmp_path / "base.yaml").write_text(yaml.safe_dump(_base(tmp_path, ckpt)))
    arms = {"gppo": {}, "clip": {"trainer.loss_mode": "ppo_clip", "trainer.clip_ratio_c": None}}
    overrides = {"trainer.report_to": []}
    path = write_experiment(
        tmp_path / "tiny.yaml", "two arms", "base.yaml", arms, tmp_path / "exp", overrides=overrides
    )
    return load_experiment(path)


class _Kill(TrainerCallback):
    """Simulates a kill: raises KeyboardInterrupt at the end of ``step`` of the run whose directory ends in ``run``."""

    def __init__(self, run, step):
        self.run, self.step = run, step

    def on_step_end(self, args, state, control, **kwargs):
        if args.output_dir.endswith(f"{self.run}/checkpoints") and state.global_step == self.step:
            raise KeyboardInterrupt(f"simulated kill at step {self.step} of {self.run}")


def _steps(path, key="step"):
    return [json.loads(x)[key] for x in path.read_text().splitlines()]


def _parity_scorer(data_sources, solution_strs, ground_truths, extra_infos):
    """A held-out judge by the parity of the sampled text (the tiny model never answers right)."""
    return [float(sum(map(ord, s)) % 2) for s in solution_strs]


def test_grid_kill_resume_and_report(tmp_path, tiny_ckpt, monkeypatch, capsys):
    # non-zero, run-dependent numbers: a reward that differs within a group (training moves the weights) and a
    # held-out judge by the sampled text, so the accuracies change with training and the seed
    monkeypatch.setattr("klear.rl.reward_fn.make_klear_reward", lambda **kwargs: varied_reward)
    monkeypatch.setattr("klear.eval.heldout._default_scorer", lambda: _parity_scorer)
    exp = _experiment(tmp_path, tiny_ckpt)
    exp.base["trainer"]["learning_rate"] = 0.01  # 2 steps at 1e-4 leave the sampled held-out text unchanged
    out = tmp_path / "exp"
    # killed after step 1's checkpoint, during step 2 of clip/seed0
    with pytest.raises(KeyboardInterrupt, match="simulated kill at step 2 of clip/seed0"):
        run_experiment(exp, callbacks=[_Kill("clip/seed0", 2)])
    assert (out / "gppo/seed1/eval.json").is_file() and not (out / "clip/seed0/eval.json").exists()
    assert (out / "clip/seed0/checkpoints/checkpoint-1").is_dir()
    for gone in ("final", "checkpoints"):  # a finished run's model files are removed (keep_models: false)
        assert not (out / "gppo/seed0" / gone).exists() and not (out / "gppo/seed1" / gone).exists(), gone
    with pytest.raises(ValueError, match="unfinished run.*--resume"):
        run_experiment(exp)
    # resumed, then killed at step 1 of clip/seed1 before any checkpoint
    with pytest.raises(KeyboardInterrupt, match="simulated kill at step 1 of clip/seed1"):
        run_experiment(exp, resume=True, callbacks=[_Kill("clip/seed1", 1)])
    assert (out / "clip/seed0/eval.json").is_file() and not list((out / "clip/seed1").glob("checkpoints/checkpoint-*"))
    capsys.readouterr()
    report = run_experiment(exp, resume=True)  # clip/seed1 restarts from scratch, and says so
    assert "clip/seed1: no complete checkpoint to resume from; starting it again" in capsys.readouterr().out

    for run in ("gppo/seed0", "gppo/seed1", "clip/seed0", "clip/seed1"):
        metrics_steps = [s for s in _steps(out / run / "metrics.jsonl")]
        assert metrics_steps == [1, 2], run
        assert _steps(out / run / "heldout_curve.jsonl") == [0, 1, 2], run
        assert (out / run / "heldout/step_1.json").is_file()
    saved = yaml.safe_load((out / "clip/seed0/config.yaml").read_text())
    assert saved["trainer"]["seed"] == 0 and saved["trainer"]["loss_mode"] == "ppo_clip" and saved["seed"] == 0
    for name in ("report.md", "summary.json", "heldout_vs_step.png", "heldout_vs_time.png", "training_metrics.png"):
        assert (out / name).stat().st_size > 0, name
    text = report.read_text()
    assert "| gppo |" in text and "| clip |" in text and "(reference)" in text
    assert f"Experiment file `{tmp_path / 'tiny.yaml'}`" in text  # not a shipped file: its own path

    # the report's numbers, recomputed from the per-run files
    summary = json.loads((out / "summary.json").read_text())
    after = {
        run: json.loads((out / run / "eval_after.json").read_text())
        for run in ("gppo/seed0", "gppo/seed1", "clip/seed0", "clip/seed1")
    }
    assert len({a["accuracy"] for a in after.values()}) > 1 and min(a["accuracy"] for a in after.values()) > 0
    accs = [after["clip/seed0"]["accuracy"], after["clip/seed1"]["accuracy"]]
    mean, half = sum(accs) / 2, T_975_DF1 * abs(accs[0] - accs[1]) / math.sqrt(2) / math.sqrt(2)
    final = summary["arms"]["clip"]["final_accuracy"]
    assert final["mean"] == pytest.approx(mean) and final["high"] - final["mean"] == pytest.approx(half)
    start = [json.loads((out / f"clip/seed{s}/heldout_curve.jsonl").read_text().splitlines()[0]) for s in (0, 1)]
    assert [r["step"] for r in start] == [0, 0]
    start_mean = (start[0]["accuracy"] + start[1]["accuracy"]) / 2
    assert summary["arms"]["clip"]["start_accuracy"]["mean"] == pytest.approx(start_mean)
    assert start_mean != pytest.approx(mean)  # training changed it
    ref = [(a + b) / 2 for a, b in zip(after["gppo/seed0"]["correct"], after["gppo/seed1"]["correct"])]
    arm = [(a + b) / 2 for a, b in zip(after["clip/seed0"]["correct"], after["clip/seed1"]["correct"])]
    d = [a - r for a, r in zip(arm, ref)]
    paired = summary["arms"]["clip"]["paired_vs_reference"]
    # the two arms barely differ in 2 tiny steps (d is 0 here); the paired test's sign and values are checked on
    # hand-written runs in test_experiment_report.py
    assert paired["mean_diff"] == pytest.approx(sum(d) / len(d))
    sd = statistics.stdev(d) if len(set(d)) > 1 else 0.0
    assert paired["ci_high"] - paired["mean_diff"] == pytest.approx(Z_975 * sd / math.sqrt(len(d)))
    assert paired["n_improved"] == sum(x > 0 for x in d) and paired["n_worsened"] == sum(x < 0 for x in d)
    curve_rows = [json.loads(x) for x in (out / "gppo/seed0/heldout_curve.jsonl").read_text().splitlines()]
    assert curve_rows[-1]["accuracy"] == after["gppo/seed0"]["accuracy"]
    assert [r["train_s"] for r in curve_rows] == sorted(r["train_s"] for r in curve_rows)
    per_run = [
        statistics.fmean(json.loads(x)["grad_norm"] for x in (out / run / "metrics.jsonl").read_text().splitlines())
        for run in ("gppo/seed0", "gppo/seed1")
    ]
    assert summary["arms"]["gppo"]["metrics"]["grad_norm"]["mean"] == pytest.approx(sum(per_run) / 2)
    # grad_norm of clip minus gppo, paired by seed and step: per-seed mean difference, then across seeds
    diffs = []
    for seed in (0, 1):
        g = {r["step"]: r["grad_norm"] for r in map(json.loads, (out / f"gppo/seed{seed}/metrics.jsonl").open())}
        c = {r["step"]: r["grad_norm"] for r in map(json.loads, (out / f"clip/seed{seed}/metrics.jsonl").open())}
        diffs.append([c[k] - g[k] for k in (1, 2)])
    vs_ref = summary["arms"]["clip"]["metrics_vs_reference"]["grad_norm"]
    per_seed = [(a + b) / 2 for a, b in diffs]
    assert vs_ref["mean"] == pytest.approx(sum(per_seed) / 2)
    assert vs_ref["high"] - vs_ref["mean"] == pytest.approx(T_975_DF1 * abs(per_seed[0] - per_seed[1]) / 2)
    assert vs_ref["n_higher"] == sum(d > 0 for row in diffs for d in row)
    assert "## Training metrics minus `gppo`" in text and "metrics_vs_reference" not in summary["arms"]["gppo"]

    # a finished experiment re-runs no training
    monkeypatch.setattr("klear.rl.job.run_rl", lambda *a, **k: pytest.fail("a finished run was run again"))
    run_experiment(exp)


@pytest.mark.parametrize(
    "cuda, trainer, expected",
    [(True, {}, True), (True, {"use_vllm": True}, True), (True, {"use_cpu": True}, False), (False, {}, False)],
)
def test_a_run_gets_its_own_process_on_a_cuda_machine(monkeypatch, cuda, trainer, expected):
    """Issue 22 M1: a colocated vLLM engine (and the CUDA allocator) gives its GPU memory back only at process exit,
    so on CUDA every run of the grid is a child process; on CPU runs stay in the experiment's process."""
    from klear.experiment import run_in_own_process

    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    assert run_in_own_process({"trainer": {"max_steps": 1, **trainer}}) is expected


class _RecordPid(TrainerCallback):
    """Writes the process id of the run's training process to ``path`` (pickled into a run's own process)."""

    def __init__(self, path: str, fail: bool = False):
        self.path, self.fail = path, fail

    def on_train_begin(self, args, state, control, **kwargs):
        Path(self.path).write_text(str(os.getpid()))
        if self.fail:
            raise ValueError("planted failure in the run's own process")


@pytest.mark.slow  # ~40 s on 2 loaded cores: two spawned processes import torch, transformers and TRL again
def test_a_run_in_its_own_process_finishes_ticks_the_bar_and_raises_its_error_here(tmp_path, tiny_ckpt, monkeypatch):
    """The faked CUDA decision makes the grid run each run in a spawned child (not this process's run_rl): the run
    finishes, the progress bar counts its steps, the report is written, and the child's error is raised here."""
    import klear.experiment as experiment

    monkeypatch.setattr(experiment, "run_in_own_process", lambda config: True)
    monkeypatch.setattr("klear.rl.job.run_rl", lambda *a, **k: pytest.fail("the run ran in the experiment's process"))
    ticks: list[int] = []

    class Bar:
        def __init__(self, *a, total, initial, **k):
            self.n = initial

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def set_postfix_str(self, s):
            pass

        def update(self, n=1):
            ticks.append(n)

    monkeypatch.setattr("tqdm.auto.tqdm", Bar)
    exp = _experiment(tmp_path, tiny_ckpt)
    exp.arms = {"gppo": {}}
    exp.base["trainer"]["max_steps"] = 1
    pid = tmp_path / "pid"
    report = run_experiment(exp, seeds=[0], callbacks=[_RecordPid(str(pid))])
    assert int(pid.read_text()) != os.getpid()
    assert (tmp_path / "exp/gppo/seed0/eval.json").is_file() and report.is_file()
    assert sum(ticks) == 1  # one optimizer step, reported by the child
    with pytest.raises(ValueError, match="planted failure in the run's own process"):
        run_experiment(exp, seeds=[0], output_dir=tmp_path / "exp2", callbacks=[_RecordPid(str(pid), fail=True)])


def test_a_run_s_own_process_raises_its_error_here_and_a_silent_death_names_the_run(monkeypatch):
    """The child's ValueError comes back as a ValueError with its message; a child that dies without a result
    (killed, out of memory) is a RuntimeError naming the run."""
    from klear.experiment import _run_in_child

    bar = SimpleNamespace(update=lambda n=1: pytest.fail("no step ran"))
    with pytest.raises(ValueError, match="^exp.yaml: gppo/seed0: 'model' is required$"):
        _run_in_child("rl", {"output_dir": "unused"}, "exp.yaml: gppo/seed0", False, [], bar)
    monkeypatch.setattr("klear.experiment._child_run", os._exit)  # the child dies (a TypeError), nothing reported
    with pytest.raises(RuntimeError, match=r"^exp.yaml: gppo/seed0: died: its process exited with code 1 without"):
        _run_in_child("rl", {}, "exp.yaml: gppo/seed0", False, [], bar)


class _RecordRun(TrainerCallback):
    """Writes ``<dir>/<run>.json``: the training process's id and thread count (pickled into a run's own process);
    raises at the start of the run whose directory ends in ``fail``. With ``meet``: a rendezvous, each run waits at
    its start until ``meet`` runs have started (so it fails when the runs go one after the other)."""

    def __init__(self, directory: str, fail: str | None = None, meet: int = 0):
        self.directory, self.fail, self.meet = Path(directory), fail, meet

    def on_train_begin(self, args, state, control, **kwargs):
        if self.fail and args.output_dir.endswith(f"{self.fail}/checkpoints"):
            raise ValueError(f"planted failure in {self.fail}")
        run = "_".join(args.output_dir.rsplit("/", 3)[-3:-1])
        record = {"pid": os.getpid(), "threads": torch.get_num_threads()}
        (self.directory / f"{run}.json").write_text(json.dumps(record))
        deadline = time.monotonic() + 60
        while len(list(self.directory.glob("*.json"))) < self.meet:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{run}: the other runs did not start while this one ran")
            time.sleep(0.1)


class _Linger(TrainerCallback):
    """At the end of training starts a non-daemon child process that sleeps, so the run's process, which joins its
    children before it exits, stays alive after reporting its result (as a stray worker pool did)."""

    def on_train_end(self, args, state, control, **kwargs):
        import multiprocessing

        multiprocessing.get_context("fork").Process(target=time.sleep, args=(30,), daemon=False).start()


def test_jobs_2_runs_side_by_side_each_with_its_share_of_the_threads(tmp_path, tiny_ckpt, monkeypatch, capsys):
    """Issue 24 item 3: ``--jobs 2`` runs two CPU runs at once, each in its own process with T // 2 threads (T = this
    process's 10 here, so 5, not the machine's default); both finish, the report says so, and a run's error stops
    the grid and is raised here. ``jobs`` > 1 with a GPU run is refused before any run starts."""
    import klear.experiment as experiment
    from klear.cli import main

    exp = _experiment(tmp_path, tiny_ckpt)
    exp.arms = {"gppo": {}}
    exp.base["trainer"]["max_steps"] = 1
    exp.base["trainer"]["save_steps"] = 10
    spec = yaml.safe_load((tmp_path / "tiny.yaml").read_text())
    (tmp_path / "tiny.yaml").write_text(yaml.safe_dump({**spec, "arms": {"gppo": {}}}))
    threads = torch.get_num_threads()
    records = tmp_path / "records"
    records.mkdir()
    try:
        torch.set_num_threads(10)
        report = run_experiment(exp, jobs=2, callbacks=[_RecordRun(str(records), meet=2)])
    finally:
        torch.set_num_threads(threads)
    runs = [json.loads((records / f"gppo_seed{k}.json").read_text()) for k in (0, 1)]
    assert {r["threads"] for r in runs} == {5}
    assert len({r["pid"] for r in runs} | {os.getpid()}) == 3  # each in its own process (the rendezvous: at once)
    assert "Runs ran up to 2 at a time" in report.read_text()
    assert json.loads((tmp_path / "exp/plan.json").read_text())["jobs"] == {"gppo/seed0": 2, "gppo/seed1": 2}
    # each run's console output in its own log, and one line here per finished run
    out = capsys.readouterr().out
    for k in (0, 1):
        log = tmp_path / f"exp/gppo/seed{k}.log"
        assert "held-out" in log.read_text() and f"gppo/seed{k}: finished; its output: {log}" in out

    with pytest.raises(ValueError, match=r"tiny.yaml: gppo/seed1: planted failure in gppo/seed1$") as failed:
        run_experiment(exp, jobs=2, output_dir=tmp_path / "exp2", callbacks=[_RecordRun(str(tmp_path), "gppo/seed1")])
    assert "on_train_begin" in str(failed.value.__cause__)  # the run process's traceback
    assert not (tmp_path / "exp2/gppo/seed1/eval.json").exists()
    log = tmp_path / "exp2/gppo/seed1.log"
    assert f"gppo/seed1: failed; its output: {log}" in capsys.readouterr().out
    assert "planted failure in gppo/seed1" in log.read_text()  # the traceback, in the log

    # one run to do: it runs alone, in this process with all its threads, and the report says nothing
    report = run_experiment(exp, jobs=2, seeds=[0], output_dir=tmp_path / "exp5")
    assert json.loads((tmp_path / "exp5/plan.json").read_text())["jobs"] == {"gppo/seed0": 1}
    assert "at a time" not in report.read_text()

    # a file's jobs on GPU runs: one at a time, said (--jobs: refused); a run whose process lingers is stopped
    monkeypatch.setattr(experiment, "run_in_own_process", lambda config: True)
    monkeypatch.setattr(experiment, "EXIT_GRACE_S", 1.0)
    exp.jobs = 2
    report = run_experiment(exp, seeds=[0], output_dir=tmp_path / "exp4", callbacks=[_Linger()])
    assert (tmp_path / "exp4/gppo/seed0/eval.json").is_file() and report.is_file()
    out = capsys.readouterr().out
    assert "tiny.yaml: jobs: 2 is for CPU runs; these use the GPU, so they run one at a time" in out
    assert "gppo/seed0: its process was alive 1 s after the run ended; stopped" in out
    with pytest.raises(ValueError, match=r"tiny.yaml: jobs=2 runs CPU runs side by side, but gppo/seed0 would use"):
        run_experiment(exp, jobs=2, output_dir=tmp_path / "exp3")
    assert not (tmp_path / "exp3").exists()
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump({**spec, "jobs": 0}))
    with pytest.raises(ValueError, match=r"bad.yaml: jobs must be a positive integer \(runs side by side\), got 0"):
        load_experiment(tmp_path / "bad.yaml")
    for bad in ("0", "1_0", "２"):
        with pytest.raises(SystemExit):
            main(["experiment", "--config", str(tmp_path / "tiny.yaml"), "--jobs", bad])


def test_a_run_whose_log_cannot_be_written_reports_why(tmp_path):
    """A side-by-side run's process whose log cannot be opened reports that error to the experiment (raised there,
    naming the run) instead of dying with it on a console nobody reads."""
    import queue

    import klear.experiment as experiment

    (tmp_path / "arm").write_text("a file where the arm's folder should be")
    ticks, result = queue.Queue(), queue.Queue()
    with pytest.raises(SystemExit):
        experiment._child_run("rl", {}, "exp.yaml: arm/seed0", False, [], None, ticks, result, tmp_path / "arm/s0.log")
    name, message, _ = result.get_nowait()
    assert name in ("FileExistsError", "NotADirectoryError") and "arm" in message


def _waiting_job(config, *, source, resume, callbacks) -> None:
    """A stand-in stage runner: writes its process id, then trains "forever"."""
    Path(config["pid_file"]).write_text(str(os.getpid()))
    time.sleep(120)


def _watched_run(pid_file: str) -> None:
    """A stand-in for a run's process: klear.experiment's child entry point with a stage that waits."""
    import queue

    import klear.experiment as experiment

    experiment.STAGES["wait"] = (__name__, "", "_waiting_job")
    ticks, result = queue.Queue(), queue.Queue()
    experiment._child_run("wait", {"pid_file": pid_file}, "exp.yaml: run", False, [], None, ticks, result)


def _experiment_process(pid_file: str) -> None:
    """A stand-in for `klear experiment`: starts one run process and waits for it."""
    import multiprocessing

    run = multiprocessing.get_context("spawn").Process(target=_watched_run, args=(pid_file,))
    run.start()
    run.join()


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/status").read_text().split("State:")[1].split()[0] in ("Z", "X")
    except (FileNotFoundError, IndexError):
        return True


def test_a_run_process_ends_when_the_experiment_process_is_killed(tmp_path):
    """A killed (SIGKILL, SIGTERM, SIGHUP) `klear experiment` must not leave its runs training as orphans that write
    into run directories a `--resume` then takes over: each run's process ends with its parent."""
    import multiprocessing
    import signal

    pid_file = tmp_path / "pid"
    parent = multiprocessing.get_context("spawn").Process(target=_experiment_process, args=(str(pid_file),))
    parent.start()
    deadline = time.monotonic() + 60
    while not pid_file.is_file() and time.monotonic() < deadline:
        time.sleep(0.1)
    run_pid = int(pid_file.read_text())
    os.kill(parent.pid, signal.SIGKILL)
    parent.join()
    deadline = time.monotonic() + 30
    while not _gone(run_pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    alive = not _gone(run_pid)
    if alive:
        os.kill(run_pid, signal.SIGKILL)
    assert not alive, "the run's process outlived the experiment's"


def test_keep_models_keeps_final_and_checkpoints(tmp_path, tiny_ckpt):
    exp = _experiment(tmp_path, tiny_ckpt)
    exp.keep_models = True
    exp.arms = {"gppo": {}}
    run_experiment(exp, seeds=[0])
    run = tmp_path / "exp/gppo/seed0"
    assert (run / "eval.json").is_file() and (run / "final/config.json").is_file()
    assert (run / "checkpoints/checkpoint-2").is_dir()
    spec = yaml.safe_load((tmp_path / "tiny.yaml").read_text())
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump({**spec, "keep_models": "yes"}))
    with pytest.raises(ValueError, match=r"bad.yaml: keep_models must be true or false, got 'yes'"):
        load_experiment(tmp_path / "bad.yaml")


def test_changed_recipe_of_a_started_run_is_refused(tmp_path, tiny_ckpt):
    exp = _experiment(tmp_path, tiny_ckpt)
    out = tmp_path / "exp"
    (out / "gppo/seed0").mkdir(parents=True)
    runs = plan_runs(exp, [0], out)
    (out / "plan.json").write_text(json.dumps({"runs": {"gppo/seed0": {**runs["gppo/seed0"], "seed": 5}}}))
    with pytest.raises(ValueError, match=r"gppo/seed0: this run was started with another recipe \(changed: seed\)"):
        run_experiment(exp, seeds=[0], resume=True)


def test_trl_peer_arm_one_step(tmp_path, tiny_ckpt):
    cfg = _base(tmp_path, tiny_ckpt)
    cfg.update(output_dir=str(tmp_path / "peer"), trainer_impl="trl_grpo")
    cfg["trainer"].update(
        max_steps=1,
        loss_mode="ppo_clip",
        clip_ratio_high=0.28,
        clip_ratio_c=None,
        alpha=0.0,
        filter_zero_adv_groups=False,
        report_to=[],
    )
    report = run_rl(cfg)
    run = tmp_path / "peer"
    assert report["steps"] == 1
    row = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
    assert "clip_ratio/high_mean" in row and "klear/policy_loss" not in row  # TRL's own loss ran
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert saved["trainer_impl"] == "trl_grpo" and saved["trainer"]["epsilon_high"] == 0.28
    assert "clip_ratio_high" not in saved["trainer"]
    assert _steps(run / "heldout_curve.jsonl") == [0, 1]
    validate_job_config({**saved, "output_dir": str(tmp_path / "again")})  # the saved recipe runs again


def test_peer_settings_mapped_or_refused():
    mapped = peer_trainer_section(
        {
            "clip_ratio_low": 0.2,
            "clip_ratio_high": 0.28,
            "loss_mode": "ppo_clip",
            "alpha": 0,
            "beta1": 1.0,
            "learning_rate": 1e-6,
        },
        "x.yaml",
    )
    assert mapped == {"epsilon": 0.2, "epsilon_high": 0.28, "learning_rate": 1e-6}
    cases = [
        ({"alpha": 0.1}, "trainer.alpha=0.1 is a GPPO setting"),
        ({"loss_mode": "gppo"}, "'ppo_clip'"),
        ({"filter_zero_adv_groups": True}, "filter_zero_adv_groups"),
        ({"clip_ratio_c": 10.0}, "clip_ratio_c"),
        ({"beta2": 0.5}, "remove it"),
        ({"clip_ratio_high": 0.3, "epsilon_high": 0.28}, "disagree"),
    ]
    for section, message in cases:
        with pytest.raises(ValueError, match=message):
            peer_trainer_section(section, "x.yaml")
    with pytest.raises(ValueError, match="adv_std"):
        TRLPeerConfig(output_dir="/tmp/x", adv_std="pop", use_cpu=True)


def _table_reward(table: dict[str, list[float]], seen: list | None = None):
    """A reward function giving the k-th completion of prompt ``pid`` (in call order) ``table[pid][k % len]``;
    each (prompt id, reward) is appended to ``seen`` when given."""
    counters: dict[str, int] = {}

    def reward(prompts, completions, prompt_id, **kw):
        out = []
        for pid in prompt_id:
            i = counters.get(pid, 0)
            counters[pid] = i + 1
            out.append(table[pid][i % len(table[pid])])
            if seen is not None:
                seen.append((pid, out[-1]))
        return out

    return reward


@pytest.mark.parametrize("adv_std", ["sample", "population"])
def test_peer_advantages_are_trls_and_the_population_switch_gives_eq4(tmp_path, tiny_model, adv_std):
    """TRL's own rollout code computes the advantages (a real TRLPeerTrainer step); checked per row against float64
    formulas written here: ``sample`` is TRL's ``(r - mean) / (sample std + 1e-4)``, ``population`` is the paper's
    Eq. 4 ``(r - mean) / (population std + eps)`` (up to TRL's epsilon: rel 1e-3, while sample vs population std
    differ by sqrt(8/7), 7%)."""
    from datasets import Dataset

    model, tok = tiny_model
    table = {"p0": [1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0], "p1": [1.0, -1.0, 0.5, 0.5, 0.0, 1.0, -1.0, 0.25]}
    seen: list[tuple[str, float]] = []  # (prompt id, reward) of each row, in the rollout's order
    reward = _table_reward(table, seen)

    ds = Dataset.from_list([{"prompt": f"{i} + {i} =", "prompt_id": f"p{i}"} for i in range(2)])
    args = _one_step_peer_args(tmp_path, group=8, steps_per_generation=2, adv_std=adv_std)
    trainer = TRLPeerTrainer(model=model, reward_funcs=reward, args=args, train_dataset=ds, processing_class=tok)
    produced = []
    rollout = trainer._generate_and_score_completions

    def keep_advantages(inputs):  # the rollout's advantages in row order, before TRL shuffles them
        out = rollout(inputs)
        produced.append(out["advantages"].double().clone())
        return out

    trainer._generate_and_score_completions = keep_advantages
    trainer.train()
    assert len(produced) == 1 and len(seen) == 16
    by_prompt: dict[str, list[float]] = {}
    for pid, r in seen:
        by_prompt.setdefault(pid, []).append(r)
    expected, other = [], []
    for pid, r in seen:
        group = by_prompt[pid]
        mean = sum(group) / 8
        pop = math.sqrt(sum((x - mean) ** 2 for x in group) / 8)  # Eq. 4: population std
        sample = math.sqrt(sum((x - mean) ** 2 for x in group) / 7)
        want, alt = ((r - mean) / (sample + 1e-4), (r - mean) / (pop + 1e-6))
        if adv_std == "population":
            want, alt = alt, want
        expected.append(want)
        other.append(alt)
    assert produced[0].tolist() == pytest.approx(expected, rel=1e-3, abs=1e-6)
    assert produced[0].tolist() != pytest.approx(other, rel=1e-3, abs=1e-6)  # the two scales are told apart


def test_peer_handles_unscored_rewards_as_trl_does_and_population_std_counts_scored_members(tmp_path, tiny_model):
    """The klear reward returns nan for a response its judge could not score; plain TRL (1.16) treats it as a
    reward of None: advantage 0, group statistics over the scored members. With adv_std=population the peer's
    advantages then equal klear's Eq. 4 over the scored members (compute_group_advantages, up to TRL's 1e-4
    epsilon): the rescale uses each group's scored count (3 in p0), not the group size."""
    from datasets import Dataset

    from klear.rl.advantages import compute_group_advantages

    model, tok = tiny_model
    nan = float("nan")
    table = {"p0": [1.0, -1.0, nan, 1.0], "p1": [1.0, -1.0, -1.0, 0.5], "p2": [nan, nan, nan, 1.0]}
    reward = _table_reward(table)

    ds = Dataset.from_list(
        [{"prompt": [{"role": "user", "content": f"What is {i} + {i}?"}], "prompt_id": f"p{i}"} for i in range(3)]
    )
    args = _one_step_peer_args(tmp_path, group=4, steps_per_generation=3, adv_std="population")
    trainer = TRLPeerTrainer(model=model, reward_funcs=reward, args=args, train_dataset=ds, processing_class=tok)
    trainer.train()
    got = torch.cat([b["advantages"] for b in trainer._buffered_inputs]).double()
    rewards = torch.tensor([table[f"p{g}"][j] for g in range(3) for j in range(4)], dtype=torch.float64)
    expected, _ = compute_group_advantages(rewards, [g for g in range(3) for _ in range(4)], epsilon=0.0)
    assert sorted(got.tolist()) == pytest.approx(sorted(expected.tolist()), rel=1e-3, abs=1e-6)
    assert int((got == 0).sum()) == 5  # the 4 unscored samples, and p2's only scored one


def test_every_steps_is_checked(tmp_path, tiny_ckpt):
    cfg = _base(tmp_path, tiny_ckpt)
    cfg["eval"]["every_steps"] = 0
    with pytest.raises(ValueError, match="eval.every_steps=0 must be an integer >= 1"):
        validate_job_config(cfg, "r.yaml")


@pytest.mark.parametrize("path", sorted(EXPERIMENT_DIR.glob("*.yaml")), ids=lambda p: p.stem)
def test_shipped_experiments_are_valid(path, tmp_path):
    exp = load_experiment(path.stem)
    runs = plan_runs(exp, exp.seeds, tmp_path)
    assert len(runs) == len(exp.arms) * len(exp.seeds) and exp.reference in exp.arms


def test_no_arm_of_the_gpu_comparison_masks_vllm_samples(tmp_path):
    """Issue 22 S3: TRL's default vllm_importance_sampling_correction (True: sequence masking of off-policy vLLM
    samples) would act on the TRL peer arm only (klear's trainer has no such correction); every arm of
    gppo_vs_baselines_gpu is built with it off, and the peer's own default is off."""
    import dataclasses

    from trl import GRPOConfig

    from klear.rl.job import trainer_config
    from klear.runs import trainer_arguments

    exp = load_experiment("gppo_vs_baselines_gpu")
    for run, config in plan_runs(exp, [0], tmp_path).items():
        config_cls, section = trainer_config(config, run)
        _, _, args = trainer_arguments(
            {**config, "trainer": section}, source=run, config_cls=config_cls, machine_checks=False
        )
        assert args.use_vllm and args.vllm_importance_sampling_correction is False, run
    assert "trainer.vllm_importance_sampling_correction" in exp.arms["trl_grpo"]  # stated in the report's arm table
    trl_default = {f.name: f.default for f in dataclasses.fields(GRPOConfig)}["vllm_importance_sampling_correction"]
    assert trl_default is True  # what the peer would inherit
    assert TRLPeerConfig(output_dir=str(tmp_path), use_cpu=True).vllm_importance_sampling_correction is False


def test_report_names_a_shipped_file_by_its_repository_path():
    from klear.experiment.report import _shown_path

    assert _shown_path(EXPERIMENT_DIR / "alpha_sweep.yaml") == "configs/experiments/alpha_sweep.yaml"


def test_a_later_arm_that_cannot_run_fails_before_any_run(tmp_path, tiny_ckpt, monkeypatch):
    monkeypatch.setattr("klear.generation.vllm.vllm_distribution", lambda: None)
    exp = _experiment(tmp_path, tiny_ckpt)
    exp.arms = {"gppo": {}, "vllm": {"trainer.use_vllm": True}}
    with pytest.raises(ValueError, match=r"arm vllm, seed 0: trainer.use_vllm=true: vLLM is not installed"):
        run_experiment(exp, seeds=[0])
    assert not (tmp_path / "exp" / "gppo").exists()  # the first arm did not run either


def test_an_arm_the_trainer_would_refuse_fails_when_the_grid_is_planned(tmp_path, tiny_ckpt, monkeypatch):
    """TRL's own check (the generation batch divisible by num_generations) runs at plan time, not after the
    earlier arms trained."""
    monkeypatch.setattr("klear.rl.job.run_rl", lambda *a, **k: pytest.fail("a run started"))
    exp = _experiment(tmp_path, tiny_ckpt)
    exp.arms = {"gppo": {}, "odd": {"trainer.per_device_train_batch_size": 3, "trainer.steps_per_generation": 1}}
    expected = r"arm odd, seed 0: trainer: generation_batch_size \(3\) must be divisible by num_generations \(2\)"
    with pytest.raises(ValueError, match=expected):
        run_experiment(exp, seeds=[0])
    assert not (tmp_path / "exp").exists()


def _one_step_peer_args(tmp_path, *, group: int, steps_per_generation: int, adv_std: str) -> TRLPeerConfig:
    """One CPU optimizer step of the TRL peer, one group of ``group`` completions per micro-batch, no saving."""
    return TRLPeerConfig(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=group,
        gradient_accumulation_steps=1,
        steps_per_generation=steps_per_generation,
        num_generations=group,
        max_completion_length=4,
        max_steps=1,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        seed=0,
        adv_std=adv_std,
    )


def test_an_sft_experiment_runs_klear_sft_arms_through_the_cli(tmp_path, tiny_ckpt, capsys):
    """``stage: sft``: the base is a ``klear sft`` recipe, every arm x seed a ``klear sft`` run (its own trainer seed,
    the same held-out problems), and the report compares the arms with the seed as the unit."""
    from klear.cli import main

    base = yaml.safe_load(find_config("sft_demo").read_text())
    base.update(model=str(tiny_ckpt))
    base["data"].update(train_size=16, heldout_size=6)
    base["eval"].update(max_new_tokens=4, batch_size=6)
    base["trainer"].update(
        max_steps=2, per_device_train_batch_size=4, max_length=384, warmup_steps=1, save_strategy="no", report_to=[]
    )
    (tmp_path / "base.yaml").write_text(yaml.safe_dump(base))
    arms = {"gppo": {}, "high_lr": {"trainer.learning_rate": 1e-2}}  # the reference arm keeps conftest's name
    path = write_experiment(tmp_path / "sft_arms.yaml", "sft arms", "base.yaml", arms, tmp_path / "exp", stage="sft")
    assert main(["experiment", "--config", str(path)]) == 0
    out = tmp_path / "exp"
    for run in ("gppo/seed0", "gppo/seed1", "high_lr/seed0", "high_lr/seed1"):
        assert (out / run / "eval.json").is_file() and (out / run / "sft_data.jsonl").is_file(), run
        config = yaml.safe_load((out / run / "config.yaml").read_text())
        assert config["trainer"]["seed"] == int(run[-1])
    lrs = [json.loads(x)["learning_rate"] for x in (out / "high_lr/seed0/metrics.jsonl").read_text().splitlines()[:1]]
    assert lrs == [pytest.approx(1e-2)]
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["arms"]) == {"gppo", "high_lr"}
    assert "mde" in summary["arms"]["high_lr"]["seeds_vs_reference"]
    report = (out / "report.md").read_text()
    assert "| SD of diffs | MDE |" in report
    # the start is each run's "before" evaluation (same model, problems and sampling seed: one value), the curve
    # its two points; SFT's own metrics are tabulated, the RL ones (never logged here) left out
    before = json.loads((out / "gppo/seed0/eval_before.json").read_text())["accuracy"]
    assert summary["arms"]["high_lr"]["start_accuracy"]["mean"] == pytest.approx(before)
    assert [p["step"] for p in summary["arms"]["gppo"]["curve"]] == [0, 2]
    assert "| token_accuracy | loss |" in report and "clip_frac_low" not in report


def test_an_unknown_stage_is_refused_with_the_file(tmp_path, tiny_ckpt):
    (tmp_path / "base.yaml").write_text(yaml.safe_dump(_base(tmp_path, tiny_ckpt)))
    path = write_experiment(tmp_path / "bad.yaml", "x", "base.yaml", {"gppo": {}}, tmp_path / "exp", stage="dpo")
    with pytest.raises(ValueError, match=r"bad.yaml: stage='dpo' is unknown; expected one of \['rl', 'sft'\]"):
        load_experiment(path)


def test_experiment_help_names_every_shipped_cpu_experiment(capsys):
    """``klear experiment --help`` lists the shipped files from ``configs/experiments`` (a hand-kept list drifted)."""
    from klear.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["experiment", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    names = sorted(p.stem for p in EXPERIMENT_DIR.glob("*.yaml") if not p.stem.endswith("_gpu"))
    assert names and f"(configs/experiments: {', '.join(names)}, *_gpu)" in text


def test_the_embedded_check_trains_on_one_rollout_batch_and_holds_out_disjoint_products(tmp_path):
    """Issue 24 item 7: `embedded_gppo_vs_clip_higher` as its description says: one rollout batch is the whole
    training set (32 prompts x 8 samples, 16 optimizer steps of 2 groups), and the 96 held-out problems share no
    question with it, though together they take 96 of the 100 unsigned one-digit products."""
    import re

    from klear.data.rl_data import make_train_and_heldout

    exp = load_experiment("embedded_gppo_vs_clip_higher")
    config = plan_runs(exp, [0], tmp_path)["gppo/seed0"]
    data, trainer = config["data"], config["trainer"]
    samples = trainer["per_device_train_batch_size"] * trainer["steps_per_generation"]
    assert (samples // trainer["num_generations"], trainer["steps_per_generation"]) == (data["train_size"], 16)
    assert trainer["max_steps"] == trainer["steps_per_generation"]  # one rollout batch
    train, heldout = make_train_and_heldout(
        data["tasks"], data["train_size"], data["heldout_size"], config["seed"], system_prompt=data["system_prompt"]
    )

    def products(rows):
        found = [re.search(r"multiplication: (-?\d) \* (-?\d)\.", row[-1]["content"]) for row in rows["prompt"]]
        assert all(found), "every prompt is a one-digit product"
        return [(int(m[1]), int(m[2])) for m in found]

    train_q, heldout_q = products(train), products(heldout)
    assert (len(train_q), len(heldout_q)) == (32, 96)
    assert not set(train_q) & set(heldout_q) and len(set(train_q)) == 32 and len(set(heldout_q)) == 96
    unsigned = [q for q in train_q + heldout_q if min(q) >= 0]
    assert 96 <= len(unsigned) <= 100  # the unsigned task's 24 + 72 (the signed task's draws may add a few)


def test_an_interrupted_experiment_says_how_to_continue(monkeypatch, capsys):
    """Ctrl-C during `klear experiment`: one line saying finished runs are kept and the --resume command (was a raw
    KeyboardInterrupt traceback), exit code 130."""
    from klear.cli import main

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr("klear.experiment.run_experiment", interrupted)
    assert main(["experiment", "--config", "bench_alpha"]) == 130
    out = capsys.readouterr().out
    assert "klear experiment: interrupted; finished runs are kept: continue the others with " in out
    assert out.rstrip().endswith("klear experiment --config bench_alpha --resume")
    assert main(["experiment", "--config", "bench_alpha", "--seeds", "0,1", "--output", "runs/a"]) == 130
    assert (
        capsys.readouterr()
        .out.rstrip()
        .endswith("klear experiment --config bench_alpha --seeds 0,1 --output runs/a --resume")
    )


def test_held_out_plot_title_fits_the_figure_with_ten_seeds(tmp_path, monkeypatch):
    """The held-out curve's title names the seeds compactly and stays inside the figure (a 10-seed experiment's
    title, written as the seeds' list, ran off both edges)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    from klear.experiment import report

    assert report._seed_list(list(range(10))) == "0-9"
    assert report._seed_list([3, 7]) == "3, 7"
    assert report._seed_list(list(range(0, 20, 2))) == "0, 2, 4, 6, 8, 10, ..., 18"
    seen = {}
    save = Figure.savefig

    def grab(fig, *args, **kwargs):
        fig.canvas.draw()
        seen.update(title=fig.axes[0].title.get_window_extent(), figure=fig.bbox, text=fig.axes[0].get_title())
        return save(fig, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", grab)
    curve = [{"step": s, "accuracy_mean": 0.5, "accuracy_low": 0.45, "accuracy_high": 0.55} for s in (0, 40, 80)]
    summary = {"experiment": "bench_gppo_vs_baselines", "seeds": list(range(10)), "arms": {"gppo": {"curve": curve}}}
    report._plot_curves(summary, "step", "optimizer step", tmp_path / "curve.png")
    assert "over 10 seeds (0-9)" in seen["text"]
    assert seen["figure"].x0 <= seen["title"].x0 and seen["title"].x1 <= seen["figure"].x1


@pytest.fixture
def unbuilt_bench(tmp_path, monkeypatch):
    """An empty cache and a bench builder that fails the test: an error that must come before any model is
    resolved (or built: ~6 min) fails loudly otherwise."""
    import klear.experiment.bench  # noqa: F401  (registers the real builder when first imported: import it first)
    from klear.models import embedded

    monkeypatch.setenv("KLEAR_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(embedded, "_bench_builder", lambda name: pytest.fail(f"bench:{name} resolved before the error"))
    return tmp_path


def _bench_experiment(tmp_path, arms=None, **more):
    arms = arms or {"gppo": {}, "clip_higher": {"trainer.loss_mode": "ppo_clip"}}
    return write_experiment(tmp_path / "exp.yaml", "errors", "rl_bench_arith", arms, tmp_path / "out", **more)


def _one_line_error(capsys, argv) -> str:
    from klear.cli import main as klear_main

    assert klear_main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def test_a_mapping_arm_override_keeps_the_base_sections_other_keys(unbuilt_bench):
    path = _bench_experiment(unbuilt_bench, arms={"gppo": {}, "b": {"trainer": {"loss_mode": "ppo_clip"}}})
    exp = load_experiment(path)
    runs = plan_runs(exp, [0], unbuilt_bench / "out")
    base, arm = runs["gppo/seed0"]["trainer"], runs["b/seed0"]["trainer"]
    assert arm["loss_mode"] == "ppo_clip" and base.get("loss_mode") != "ppo_clip"
    assert {k: v for k, v in arm.items() if k != "loss_mode"} == {k: v for k, v in base.items() if k != "loss_mode"}


@pytest.mark.parametrize(
    "where, overrides",
    [
        ("arms", {"trainer.seed": 7}),
        ("arms", {"output_dir": "/tmp/elsewhere"}),
        ("arms", {"trainer": {"seed": 7, "loss_mode": "ppo_clip"}}),
        ("overrides", {"trainer.seed": 7}),
    ],
)
def test_overrides_of_what_the_experiment_sets_per_run_are_refused(unbuilt_bench, capsys, where, overrides):
    """An arm's `trainer.seed` or `output_dir` was silently replaced by the seed's and the run's own."""
    if where == "arms":
        path = _bench_experiment(unbuilt_bench, arms={"gppo": {}, "b": overrides})
    else:
        path = _bench_experiment(unbuilt_bench, overrides=overrides)
    err = _one_line_error(capsys, ["experiment", "--config", str(path)])
    key = "output_dir" if "output_dir" in overrides else "trainer.seed"
    assert f"{path}: {'arms.b' if where == 'arms' else 'overrides'}: {key} is set by the experiment" in err


def test_a_scalar_arm_override_of_a_section_names_the_arm_and_section(unbuilt_bench, capsys):
    """`arms: {b: {trainer: 5}}` was taken, then failed on the experiment's own key ('trainer.seed': trainer is not
    a section), which the file never mentions."""
    path = _bench_experiment(unbuilt_bench, arms={"gppo": {}, "b": {"trainer": 5}})
    err = _one_line_error(capsys, ["experiment", "--config", str(path)])
    assert f"{path}: arms.b: key 'trainer': trainer is a section: give it a mapping" in err and "seed" not in err


def test_a_fault_in_the_base_recipe_is_named_with_the_base_not_an_arm(unbuilt_bench, capsys):
    """An unknown key in the base recipe was reported as the first arm's ("arm gppo, seed 0: unknown key(s) ...")."""
    from klear.config import find_config

    text = find_config("rl_bench_arith").read_text()
    base = unbuilt_bench / "mybase.yaml"
    base.write_text(text.replace("\ntrainer:\n", "\ntrainer:\n  bogus_key: 1\n", 1))
    path = write_experiment(unbuilt_bench / "exp.yaml", "d", str(base), {"gppo": {}}, unbuilt_bench / "out")
    err = _one_line_error(capsys, ["experiment", "--config", str(path)])
    assert err.startswith(f"klear experiment: error: {path}: base {base} with the file's overrides: unknown key(s) ")
    assert "'bogus_key' in 'trainer'" in err and "arm gppo" not in err
    # a fault the arms do not share stays the arm's; one that every arm mends is no fault
    path = _bench_experiment(unbuilt_bench, arms={"gppo": {}, "b": {"trainer.bogus": 1}})
    assert f"{path}: arm b, seed 0: unknown key(s) 'bogus' in 'trainer'" in _one_line_error(
        capsys, ["experiment", "--config", str(path)]
    )
    assert "  num_generations: 8\n" in text
    base.write_text(text.replace("  num_generations: 8\n", "  num_generations: 1\n"))  # below klear rl's minimum 2
    arms = {"gppo": {"trainer.num_generations": 4}}
    exp = load_experiment(write_experiment(unbuilt_bench / "exp2.yaml", "d", str(base), arms, unbuilt_bench / "o"))
    assert plan_runs(exp, [0], unbuilt_bench / "o")["gppo/seed0"]["trainer"]["num_generations"] == 4


@pytest.mark.parametrize(
    "edit, arms, expected",
    [
        # an arm override that cannot be applied because the base's section is not one
        (r"\neval:\n(  .*\n)+", {"gppo": {"eval.n_samples": 1}, "b": {}}, "'eval' must be a mapping"),
        # no max_steps: every run lacks it; or one below 1
        (r"\n  max_steps: 200 .*\n", {"gppo": {}}, "trainer.max_steps=None must be an integer >= 1"),
        (r"\n  max_steps: 200 .*\n", {"gppo": {}}, "trainer.max_steps=-1 must be an integer >= 1"),
    ],
)
def test_base_faults_an_arm_cannot_cause_are_named_with_the_base(unbuilt_bench, capsys, edit, arms, expected):
    import re

    from klear.config import find_config

    text = find_config("rl_bench_arith").read_text()
    replacement = {"eval": "\neval: 5\n", "None": "\n", "-1": "\n  max_steps: -1\n"}
    key = next(k for k in replacement if k in expected)
    edited, count = re.subn(edit, replacement[key], text, count=1)
    assert count == 1
    base = unbuilt_bench / "mybase.yaml"
    base.write_text(edited)
    path = write_experiment(unbuilt_bench / "exp.yaml", "d", str(base), arms, unbuilt_bench / "out")
    err = _one_line_error(capsys, ["experiment", "--config", str(path)])
    assert err.startswith(f"klear experiment: error: {path}: base {base} with the file's overrides: "), err
    assert expected in err and "arm gppo" not in err and "arms." not in err, err


def test_an_arm_fault_beside_a_different_base_fault_names_both(unbuilt_bench, capsys):
    """The base has two faults; arm gppo mends the first, so its run fails on the second: that is reported with the
    arm, and the base's own first fault is named too."""
    from klear.config import find_config

    text = find_config("rl_bench_arith").read_text()
    base = unbuilt_bench / "mybase.yaml"
    base.write_text(
        text.replace("  learning_rate: 3.0e-5 ", "  learning_rate: abc ").replace(
            "  max_grad_norm: 1.0", "  max_grad_norm: xyz"
        )
    )
    arms = {"gppo": {"trainer.learning_rate": 1.0e-5}, "b": {}}
    path = write_experiment(unbuilt_bench / "exp.yaml", "d", str(base), arms, unbuilt_bench / "out")
    err = _one_line_error(capsys, ["experiment", "--config", str(path)])
    assert f"{path}: arm gppo, seed 0: trainer.max_grad_norm='xyz'" in err, err
    assert f"(and on its own, {path}: base {base} with the file's overrides: trainer.learning_rate='abc'" in err, err


@pytest.mark.parametrize("seeds", ["1,,2", ",1", "", "+1", "1_0", "\u0663", "1, x"])
def test_seeds_on_the_command_line_drop_or_reinterpret_nothing(unbuilt_bench, capsys, seeds):
    path = _bench_experiment(unbuilt_bench)
    err = _one_line_error(capsys, ["experiment", "--config", str(path), "--seeds", seeds])
    assert f"--seeds {seeds!r} must be comma-separated integers >= 0" in err


def test_output_problems_are_one_line_errors_before_any_model(unbuilt_bench, capsys):
    path = _bench_experiment(unbuilt_bench)
    afile = unbuilt_bench / "afile"
    afile.write_text("x")
    for output in (afile, afile / "sub"):
        err = _one_line_error(capsys, ["experiment", "--config", str(path), "--output", str(output)])
        assert str(output) in err and ("not a directory" in err or "cannot create" in err), err
    out = unbuilt_bench / "out"
    (out / "gppo").mkdir(parents=True)
    (out / "gppo" / "seed0").write_text("x")  # a run's folder that is a file
    err = _one_line_error(capsys, ["experiment", "--config", str(path), "--resume"])
    assert f"{out / 'gppo' / 'seed0'}: a run's folder is not a directory" in err
    (out / "gppo" / "seed0").unlink()
    for plan in ("{", "[1, 2]", None):
        (out / "plan.json").unlink(missing_ok=True)
        if plan is None:
            (out / "plan.json").mkdir()
        else:
            (out / "plan.json").write_text(plan)
        err = _one_line_error(capsys, ["experiment", "--config", str(path)])
        assert err.startswith(f"klear experiment: error: {out / 'plan.json'}: not ") and "another --output" in err


def test_a_missing_model_is_named_with_the_experiment_and_run(unbuilt_bench, capsys):
    recipe = yaml.safe_load(find_config("rl_bench_arith").read_text())
    (unbuilt_bench / "base.yaml").write_text(yaml.safe_dump({**recipe, "model": "./does/not/exist"}))
    path = write_experiment(unbuilt_bench / "exp.yaml", "errors", "base.yaml", {"gppo": {}}, unbuilt_bench / "out")
    err = _one_line_error(capsys, ["experiment", "--config", str(path)])
    assert f"{path}: gppo/seed0: model: model './does/not/exist'" in err


@pytest.mark.parametrize(
    "base, needle", [("nosuch_recipe", ": base: config 'nosuch_recipe' not found"), ("[a]", ": base must be a recipe")]
)
def test_a_bad_base_is_named_with_its_file_and_key(tmp_path, capsys, base, needle):
    path = tmp_path / "exp.yaml"
    path.write_text(f"base: {base}\narms: {{gppo: {{}}}}\n")
    err = _one_line_error(capsys, ["experiment", "--config", str(path)])
    assert err.startswith(f"klear experiment: error: {path}") and needle in err, err


@pytest.mark.parametrize(
    "text, needle",
    [
        ("", "the file is empty"),
        ("name: x\narms: [1\n", "not valid YAML: line 3, column 1: "),
        ("arms: {a: {}}\narms: {b: {}}\n", "not valid YAML: line 2, column 1: key 'arms' is given twice"),
    ],
)
def test_an_experiment_file_that_is_not_one_says_why_and_where(tmp_path, capsys, text, needle):
    path = tmp_path / "exp.yaml"
    path.write_text(text)
    assert needle in _one_line_error(capsys, ["experiment", "--config", str(path)])
