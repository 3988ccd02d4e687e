"""klear.runs.run_job: every training stage goes through the same fixed sequence of hooks."""

from types import SimpleNamespace

import pytest

from klear.precision import Precision
from klear.runs import RunSetup, Stage, run_job


class _Trainer:
    def __init__(self, log):
        self.log = log
        self.state = SimpleNamespace(global_step=3)

    def train(self, resume_from_checkpoint=None):
        self.log.append(("train", resume_from_checkpoint))

    def save_model(self, path):
        self.log.append(("save_model",))


class _Tokenizer:
    def save_pretrained(self, path):
        pass


class _Recorder(Stage):
    name = "probe"

    def __init__(self, tmp_path, *, fail_in=None, evaluate=True):
        self.log, self.tmp_path, self.fail_in, self.do_eval = [], tmp_path, fail_in, evaluate

    def _step(self, name, *extra):
        self.log.append((name, *extra))
        if name == self.fail_in:
            raise ValueError(f"refused in {name}")

    def build_recipe(self, config, source):
        self._step("build_recipe", source)
        return {"typed": True}

    def prepare(self, job, resume):
        self._step("prepare", job.recipe)
        return RunSetup(
            out=self.tmp_path / "run",
            resume=False,
            seed=0,
            trainer_cfg={},
            precision=Precision(device="cpu", dtype="float32", requested="auto"),
            args=None,
            model_path="m",
            model_config=None,
        )

    def load_data(self, job):
        self._step("load_data", (job.setup.out / "run.json").exists())
        job.do_eval, job.train = self.do_eval, ["row"]

    def build_trainer(self, job):
        self._step("build_trainer", (job.setup.out / "run.json").exists())
        job.trainer, job.tokenizer = _Trainer(self.log), _Tokenizer()

    def evaluate(self, job, path, *, reuse):
        self._step("evaluate", path.name, reuse)
        return {"accuracy": 0.5}

    def before_training(self, job, before):
        self._step("before_training", before)

    def after_training(self, job):
        self._step("after_training")

    def report(self, job, before, after):
        self._step("report", before, after)
        return {"steps": job.trainer.state.global_step}

    def report_text(self, report):
        self._step("report_text")
        return "done"

    def finished(self, job):
        self._step("finished")


def test_the_hooks_run_in_the_fixed_order(tmp_path):
    stage = _Recorder(tmp_path)
    assert run_job(stage, {"model": "m"}, source="r.yaml") == {"steps": 3}
    result = {"accuracy": 0.5}
    assert stage.log == [
        ("build_recipe", "r.yaml"),
        ("prepare", {"typed": True}),
        ("load_data", False),  # before the run directory exists
        ("build_trainer", True),
        ("evaluate", "eval_before.json", False),
        ("before_training", result),
        ("train", None),
        ("after_training",),
        ("evaluate", "eval_after.json", False),
        ("report", result, result),
        ("report_text",),
        ("save_model",),  # finish_run: final/, eval.json, the printed report
        ("finished",),
    ]
    assert (tmp_path / "run" / "eval.json").is_file()


def test_without_a_heldout_set_nothing_is_evaluated(tmp_path):
    stage = _Recorder(tmp_path, evaluate=False)
    run_job(stage, {"model": "m"})
    assert [s for s in stage.log if s[0] in ("evaluate", "report_text")] == []
    assert ("before_training", None) in stage.log and ("report", None, None) in stage.log


@pytest.mark.parametrize("step", ["load_data", "build_trainer", "before_training"])
def test_a_run_refused_before_training_leaves_no_directory(tmp_path, step):
    with pytest.raises(ValueError, match=f"refused in {step}"):
        run_job(_Recorder(tmp_path, fail_in=step), {"model": "m"})
    assert not (tmp_path / "run").exists()


def test_a_stage_without_its_required_hooks_cannot_be_built():
    with pytest.raises(TypeError, match="abstract"):
        type("Half", (Stage,), {"build_recipe": lambda self, c, s: c})()
