"""The bench (klear.experiment.bench): a tiny policy built by klear sft from scratch, cached by its spec, named by a
recipe as ``model: bench:<name>`` and run by ``klear experiment`` through the CLI."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from dataclasses import replace

import pytest
import yaml

import klear.experiment.bench as bench
from klear.cli import main as klear_main
from klear.config import find_config
from klear.models import embedded

# A spec small enough to build in seconds: a 2-layer Llama, 96 teacher examples, checkpoints every 3 steps.
TINY = bench.BenchSpec(
    tasks=bench.BENCH_MODELS["arith"].tasks,
    description="tiny test spec",
    hidden_size=32,
    num_layers=2,
    num_heads=2,
    intermediate_size=64,
    sft={"data.train_size": 96, "trainer.per_device_train_batch_size": 16, "trainer.warmup_steps": 1},
    band=(0.0, 1.0),
    eval_samples=1,
    heldout_size=8,
    max_new_tokens=24,
    select_every=3,
)


@pytest.fixture
def tiny_bench(tmp_path, monkeypatch):
    monkeypatch.setenv("KLEAR_CACHE", str(tmp_path / "cache"))
    monkeypatch.setitem(bench.BENCH_MODELS, "tiny", TINY)
    monkeypatch.setattr(embedded, "_bench_builder", bench.ensure_bench_model)
    return tmp_path


def test_select_checkpoint_bisects_to_the_step_nearest_the_band_centre():
    accuracy = {25: 0.0, 50: 0.1, 75: 0.3, 100: 0.44, 125: 0.52, 150: 0.7, 175: 0.8, 200: 0.9}
    calls = []

    def measure(step):
        calls.append(step)
        return accuracy[step]

    step, seen = bench.select_checkpoint(sorted(accuracy), measure, (0.3, 0.6))
    assert step == 100  # |0.44 - 0.45| is the smallest distance to the centre
    assert len(calls) <= 4 and seen == {s: accuracy[s] for s in calls}
    # never in band: the nearest is returned, the caller refuses it
    step, _ = bench.select_checkpoint([1, 2, 3], lambda s: 0.01 * s, (0.3, 0.6))
    assert step == 3


def test_build_caches_by_spec_and_rebuilds_a_stale_model(tiny_bench, monkeypatch):
    folder = bench.ensure_bench_model("tiny")
    record = json.loads((folder / embedded.BENCH_MARKER).read_text())
    assert folder == embedded.bench_model_dir("tiny") and record["key"] == TINY.key()
    assert record["sft_step"] in {3, 6} and str(record["sft_step"]) in record["accuracy_by_step"]
    assert record["accuracy"] == record["accuracy_by_step"][str(record["sft_step"])]
    assert (folder / "tokenizer.json").is_file() and (folder / "config.json").is_file()
    assert not list(folder.glob("optimizer*")) and not list(folder.parent.glob(".bench-*"))  # no leftovers
    assert embedded.resolve_model_path("bench:tiny") == str(folder)

    # cached: the same spec is not rebuilt
    monkeypatch.setattr(bench, "build_bench_model", lambda *a, **k: pytest.fail("a current model was rebuilt"))
    assert bench.ensure_bench_model("tiny") == folder
    # stale: another spec under the same name is rebuilt
    built = []
    monkeypatch.setattr(
        bench,
        "build_bench_model",
        lambda name, target: (
            built.append(name) or {"accuracy": 0.5, "accuracy_measure": "m", "parameters": 1, "build_seconds": 0}
        ),
    )
    monkeypatch.setitem(bench.BENCH_MODELS, "tiny", replace(TINY, seed=1))
    bench.ensure_bench_model("tiny")
    assert built == ["tiny"]


def test_a_build_outside_its_band_raises_and_leaves_nothing(tiny_bench, monkeypatch):
    monkeypatch.setitem(
        bench.BENCH_MODELS, "tiny", replace(TINY, band=(0.99, 1.0), sft={**TINY.sft, "data.train_size": 32})
    )
    with pytest.raises(bench.BenchBuildError, match=r"'tiny'.*band \[0.99, 1.0\].*step 2: 0.000"):
        bench.ensure_bench_model("tiny")
    assert not embedded.bench_model_dir("tiny").exists()
    assert not list(embedded.bench_model_dir("tiny").parent.glob(".bench-*"))


def test_a_corrupt_bench_json_is_listed_as_unreadable_and_rebuilt(tiny_bench, capsys):
    """A damaged `bench.json` made `klear bench list` and every use of the model end in a traceback."""
    marker = embedded.bench_model_dir("tiny") / embedded.BENCH_MARKER
    marker.parent.mkdir(parents=True)
    for text in ("[1]", "{"):
        marker.write_text(text)
        capsys.readouterr()
        assert klear_main(["bench", "list"]) == 0
        assert f"bench:tiny  tiny test spec  [unreadable {marker} (rebuilt on next use)]" in capsys.readouterr().out
    assert klear_main(["bench", "build", "bench:tiny"]) == 0  # the name as a recipe writes it
    assert "building bench model 'tiny'" in capsys.readouterr().out
    assert json.loads(marker.read_text())["key"] == TINY.key()


def test_bench_list_refuses_a_name_or_force(tiny_bench, capsys):
    """`klear bench list arith` listed everything and ignored the name (as if it had been built or checked)."""
    for argv, got in ((["bench", "list", "tiny"], "the name 'tiny'"), (["bench", "list", "--force"], "--force")):
        assert klear_main(argv) == 2
        err = capsys.readouterr().err
        assert f"klear bench: error: klear bench list takes no model name or --force (got {got})" in err
        assert err.count("\n") == 1
    assert not embedded.bench_model_dir("tiny").exists()


def test_a_model_another_process_is_building_is_waited_for_and_listed_as_building(tiny_bench, monkeypatch, capsys):
    """Two processes that needed the same unbuilt model (e.g. two `klear rl` runs started together on a fresh cache)
    each built it, 5 minutes apiece, into the same folder; `klear bench list` said "not built" meanwhile."""
    target = embedded.bench_model_dir("tiny")
    lock = bench.build_lock_path("tiny", target)
    target.parent.mkdir(parents=True)
    holder = subprocess.Popen(  # another process: holds the build lock, "builds" (writes bench.json) when told
        [
            sys.executable,
            "-c",
            "import json, pathlib, sys; from filelock import FileLock\n"
            f"lock = FileLock({str(lock)!r}); lock.acquire(); print('held', flush=True); sys.stdin.readline()\n"
            f"target = pathlib.Path({str(target)!r}); target.mkdir()\n"
            f"(target / {embedded.BENCH_MARKER!r}).write_text(json.dumps({{'key': {TINY.key()!r}}}))\n"
            "lock.release()",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        assert klear_main(["bench", "list"]) == 0
        listed = capsys.readouterr().out
        assert "bench:tiny  tiny test spec  [building now, by another process (its output in " in listed
        monkeypatch.setattr(bench, "build_bench_model", lambda *a, **k: pytest.fail("built a second time"))
        threading.Timer(1.0, lambda: (holder.stdin.write("go\n"), holder.stdin.flush())).start()
        assert bench.ensure_bench_model("tiny") == target  # waits, then takes the other process's model
        out = capsys.readouterr().out
        assert "waiting for another process building bench model 'tiny'" in out
        assert f"bench model 'tiny': built by the other process; using {target}" in out
        assert holder.wait(timeout=30) == 0
    finally:
        holder.kill()
    assert klear_main(["bench", "list"]) == 0
    assert "bench:tiny  tiny test spec  [built, accuracy " in capsys.readouterr().out  # the lock is free again


def test_force_rebuilds_under_the_lock_and_a_killed_builds_work_folder_is_removed(tiny_bench, monkeypatch, capsys):
    """`klear bench build --force` removed the model before taking the lock (while another process might be using or
    building it); a build killed by SIGTERM left its `.bench-<name>-*` work folder behind for good."""
    target = embedded.bench_model_dir("tiny")
    target.mkdir(parents=True)
    (target / embedded.BENCH_MARKER).write_text(json.dumps({"key": TINY.key()}))
    stale = target.parent / ".bench-tiny-abc123_x"
    other = target.parent / ".bench-tiny-other-abc123"  # another model's (a name with '-'): not ours to remove
    for folder in (stale, other):
        (folder / "sft").mkdir(parents=True)
    lock = bench.build_lock_path("tiny", target)
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"from filelock import FileLock; held = FileLock({str(lock)!r}); held.acquire(); input()",
        ],
        stdin=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 30
        while not bench._building("tiny", target):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        built = []
        record = {"accuracy": 0.5, "parameters": 1, "build_seconds": 1, "accuracy_measure": "m"}
        monkeypatch.setattr(bench, "build_bench_model", lambda name, t: built.append(t.exists()) or record)
        done = threading.Event()
        worker = threading.Thread(target=lambda: (klear_main(["bench", "build", "tiny", "--force"]), done.set()))
        worker.start()
        time.sleep(1.0)
        assert not done.is_set() and target.exists() and stale.exists()  # waiting: nothing removed yet
        holder.stdin.write("\n")
        holder.stdin.flush()
        worker.join(timeout=30)
        assert done.is_set()
    finally:
        holder.kill()
    assert built == [False]  # rebuilt, from an empty place, once the lock was ours
    assert not stale.exists() and other.exists()
    assert "waiting for another process building bench model 'tiny'" in capsys.readouterr().out


def test_an_unusable_cache_or_lock_is_a_one_line_error(tiny_bench, capsys):
    models = embedded.bench_model_dir("tiny").parent
    models.parent.mkdir(parents=True)
    models.write_text("not a folder")
    assert klear_main(["bench", "build", "tiny"]) == 2
    assert f"bench model 'tiny': cannot use {models} as the models folder: " in capsys.readouterr().err
    models.unlink()
    lock = bench.build_lock_path("tiny", embedded.bench_model_dir("tiny"))
    lock.mkdir(parents=True)  # a folder where the lock file goes
    for argv in (["bench", "build", "tiny"], ["bench", "list"]):
        assert klear_main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"bench model 'tiny': cannot use the build lock {lock}: " in err[0], err


def test_unknown_and_unbuilt_bench_models_name_the_fix(tiny_bench, monkeypatch):
    with pytest.raises(ValueError, match="unknown bench model 'nope'; the bench has: arith, sums_code"):
        embedded.resolve_model_path("bench:nope")
    monkeypatch.setattr(embedded, "_bench_builder", None)  # klear.experiment.bench not imported
    with pytest.raises(FileNotFoundError, match="klear bench build tiny"):
        embedded.resolve_model_path("bench:tiny")


@pytest.mark.parametrize("recipe", ["rl_bench_arith", "rl_bench_sums_code"])
def test_the_shipped_recipe_measures_what_the_build_measured(recipe):
    """The RL recipe's step-0 held-out evaluation is the build's measurement: the same problems, scorer, token
    budget and sampling, so the band the model was built into is where RL starts."""
    from klear.data.rl_data import make_train_and_heldout

    config = yaml.safe_load(find_config(recipe).read_text())
    spec = bench.BENCH_MODELS[config["model"].removeprefix("bench:")]
    assert config["data"]["tasks"] == [dict(t) for t in spec.tasks]
    assert config["data"]["data_source"] == spec.data_source
    assert config["data"].get("instruction") == spec.instruction
    assert config["data"]["heldout_size"] == spec.heldout_size and config.get("seed", 0) == spec.seed
    assert config["eval"]["max_new_tokens"] == config["trainer"]["max_completion_length"] == spec.max_new_tokens
    assert config["eval"]["temperature"] == spec.eval_temperature
    prompt = {} if spec.instruction is None else {"instruction": config["data"]["instruction"]}
    _, rl_heldout = make_train_and_heldout(
        config["data"]["tasks"],
        train_size=1,
        heldout_size=spec.heldout_size,
        seed=config.get("seed", 0),
        few_shot=None,
        system_prompt=None,
        data_source=config["data"]["data_source"],
        **prompt,
    )
    assert rl_heldout["prompt"] == bench.heldout_problems(spec)["prompt"]


def test_fields_added_to_the_spec_keep_cached_models_valid():
    """``data_source`` and ``instruction`` joined BenchSpec after models were cached: at their defaults they leave
    the key (the cache key) what it was, and set to anything else they change it."""
    import hashlib
    from dataclasses import asdict

    arith = bench.BENCH_MODELS["arith"]
    old = {k: v for k, v in asdict(arith).items() if k not in ("data_source", "instruction")}
    expected = hashlib.sha256(json.dumps(old, sort_keys=True, default=list).encode()).hexdigest()[:16]
    assert arith.key() == expected
    assert replace(arith, instruction="").key() != expected
    assert replace(arith, data_source="math_reasoning_gym").key() != expected


def _write_tiny_base(folder, recipe, spec, *, train_size):
    """A shipped bench recipe shrunk to 2 steps on ``bench:tiny`` (built from ``spec``), as ``folder/base.yaml``."""
    base = yaml.safe_load(find_config(recipe).read_text())
    base["model"] = "bench:tiny"
    base["data"].update(tasks=[dict(t) for t in spec.tasks], train_size=train_size, heldout_size=spec.heldout_size)
    base["eval"].update(max_new_tokens=spec.max_new_tokens, every_steps=2)
    base["trainer"].update(
        max_steps=2,
        steps_per_generation=1,
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=spec.max_new_tokens,
    )
    (folder / "base.yaml").write_text(yaml.safe_dump(base))


def test_experiment_on_a_bench_model_through_the_cli(tiny_bench, capsys):
    """`klear experiment` with a recipe naming `bench:tiny`: the model is built on first use, once, before two runs
    start side by side in their own processes (as the shipped bench experiments run: jobs 2), 2 arms x 2 seeds run,
    and the report gives the seed-unit comparison with its minimum detectable effect."""
    _write_tiny_base(tiny_bench, "rl_bench_arith", TINY, train_size=32)
    exp = {
        "name": "tiny_bench",
        "description": "bench smoke",
        "base": "base.yaml",
        "reference": "gppo",
        "seeds": [0, 1],
        "output_dir": str(tiny_bench / "exp"),
        "jobs": 2,
        "arms": {"gppo": {}, "clip_higher": {"trainer.loss_mode": "ppo_clip"}},
    }
    (tiny_bench / "exp.yaml").write_text(yaml.safe_dump(exp))
    assert klear_main(["experiment", "--config", str(tiny_bench / "exp.yaml")]) == 0
    out = capsys.readouterr().out
    assert out.count("building bench model 'tiny'") == 1
    log = bench.build_log_path("tiny", embedded.bench_model_dir("tiny"))
    assert "SFT model:" not in out and "SFT model:" in log.read_text()  # the build's temporary paths stay in its log
    summary = json.loads((tiny_bench / "exp" / "summary.json").read_text())
    assert set(summary["arms"]) == {"gppo", "clip_higher"}
    report = (tiny_bench / "exp" / "report.md").read_text()
    assert "| SD of diffs | MDE |" in report and "mde" in summary["arms"]["clip_higher"]["seeds_vs_reference"]
    for run in ("gppo/seed0", "gppo/seed1", "clip_higher/seed0", "clip_higher/seed1"):
        assert (tiny_bench / "exp" / run / "eval.json").is_file(), run
        log = (tiny_bench / "exp" / f"{run}.log").read_text()
        assert log.startswith(f"\n==== {tiny_bench / 'exp.yaml'}: {run}: started "), log[:200]
    assert klear_main(["bench", "list"]) == 0
    assert "bench:tiny  tiny test spec  [built, accuracy" in capsys.readouterr().out


def test_soft_and_hard_rewards_reach_a_multi_test_bench_model_through_the_cli(tiny_bench, monkeypatch, capsys):
    """`klear experiment` on a tiny `sums_code` bench model (code rows, one sandbox test per sum): the soft arm's
    rewards lie in [0, 1] (passed / total) and the hard arm's are -1 or +1, so the recipe's reward_mode reaches
    the scorer of the rollouts."""
    spec = replace(TINY, tasks=bench.BENCH_MODELS["sums_code"].tasks, data_source="code_longcot_bench", instruction="")
    spec = replace(spec, sft={**spec.sft, "trainer.max_length": 320})
    monkeypatch.setitem(bench.BENCH_MODELS, "tiny", spec)
    _write_tiny_base(tiny_bench, "rl_bench_sums_code", spec, train_size=16)
    exp = {
        "name": "tiny_soft_vs_hard",
        "description": "bench smoke",
        "base": "base.yaml",
        "reference": "soft",
        "seeds": [0],
        "output_dir": str(tiny_bench / "exp"),
        "arms": {"soft": {"reward.reward_mode": "soft"}, "hard": {"reward.reward_mode": "hard"}},
    }
    (tiny_bench / "exp.yaml").write_text(yaml.safe_dump(exp))
    assert klear_main(["experiment", "--config", str(tiny_bench / "exp.yaml")]) == 0
    for arm, allowed in (("soft", lambda r: 0.0 <= r <= 1.0), ("hard", lambda r: r in (-1.0, 1.0))):
        rows = [json.loads(x) for x in (tiny_bench / "exp" / arm / "seed0" / "metrics.jsonl").read_text().splitlines()]
        rewards = [r["reward"] for r in rows if "reward" in r]
        assert rewards and all(allowed(r) for r in rewards), (arm, rewards)


def test_the_sft_bench_recipe_evaluates_on_the_build_held_out_problems():
    """`sft_bench_arith` starts from `bench:arith` and measures it on the problems its build measured (never in any
    SFT data of the build or of this recipe)."""
    from klear.sft.data import make_teacher_sft_dataset

    config = yaml.safe_load(find_config("sft_bench_arith").read_text())
    spec = bench.BENCH_MODELS["arith"]
    assert config["model"] == "bench:arith" and config["data"]["tasks"] == [dict(t) for t in spec.tasks]
    train, heldout = make_teacher_sft_dataset(
        config["data"]["tasks"],
        train_size=8,
        heldout_size=config["data"]["heldout_size"],
        seed=config["seed"],
        data_source=config["data"]["data_source"],
    )
    assert heldout["prompt"] == bench.heldout_problems(spec)["prompt"]
    assert not {m[-1]["content"] for m in train["prompt"]} & {m[-1]["content"] for m in heldout["prompt"]}


@pytest.mark.parametrize(
    "name", ["bench_sft_filter_easy", "bench_sft_filter_hard", "bench_sft_filter_hard_scarce", "bench_sft_sources"]
)
def test_shipped_sft_bench_experiments_plan_valid_runs(name):
    from klear.experiment import load_experiment, plan_runs
    from klear.sft.job import validate_sft_config

    exp = load_experiment(name)
    assert exp.stage == "sft" and exp.base["model"] == "bench:arith"
    runs = plan_runs(exp, exp.seeds, exp.output_dir)
    assert len(runs) == len(exp.arms) * len(exp.seeds) >= 10
    for config in runs.values():
        validate_sft_config(config, name)


def test_sft_experiment_with_a_flawed_teacher_on_a_bench_model_through_the_cli(tiny_bench):
    """`klear experiment` with `stage: sft` on `bench:tiny`: the shipped Table 2 arms, shrunk; the mixed arm trains on
    the teacher's wrong solutions, the correct-only arm on none, and the report compares them with the seed as the
    unit."""
    from klear.experiment import EXPERIMENT_DIR as bench_experiments

    base = yaml.safe_load(find_config("sft_bench_arith").read_text())
    base["model"] = "bench:tiny"
    base["data"].update(tasks=[dict(t) for t in TINY.tasks], train_size=48, heldout_size=8, teacher_slip_rate=0.3)
    base["eval"].update(max_new_tokens=TINY.max_new_tokens, n_samples=1)
    base["trainer"].update(max_steps=2, warmup_steps=1, per_device_train_batch_size=8)
    (tiny_bench / "base.yaml").write_text(yaml.safe_dump(base))
    shipped = yaml.safe_load(find_config("bench_sft_filter_easy", bench_experiments).read_text())
    exp = dict(shipped, base="base.yaml", seeds=[0, 1], output_dir=str(tiny_bench / "exp"))
    (tiny_bench / "exp.yaml").write_text(yaml.safe_dump(exp))
    assert klear_main(["experiment", "--config", str(tiny_bench / "exp.yaml")]) == 0

    def wrong(run):
        rows = [json.loads(x) for x in (tiny_bench / "exp" / run / "sft_data.jsonl").read_text().splitlines()]
        return len(rows), sum(f"\\boxed{{{r['ground_truth']}}}" not in r["completion"][-1]["content"] for r in rows)

    n_mixed, wrong_mixed = wrong("mixed/seed0")
    n_correct, wrong_correct = wrong("correct_only/seed0")
    assert wrong_mixed > 0 and wrong_correct == 0 and n_correct == n_mixed - wrong_mixed == 48 - wrong_mixed
    summary = json.loads((tiny_bench / "exp" / "summary.json").read_text())
    assert "mde" in summary["arms"]["correct_only"]["seeds_vs_reference"]
