"""``eval.backend`` (auto | hf | vllm): the recipe rule, and the held-out evaluation on a colocated vLLM engine
(:class:`klear.eval.backends.ColocatedEval`) driven through a fake engine: no vLLM needed here (the real
engine on CPU: tests/test_vllm_rl.py, ``make test-vllm``)."""

from __future__ import annotations

import json
import sys
import types
from types import SimpleNamespace

import pytest

from klear.eval.backends import ColocatedEval, sample_seed
from klear.runs import check_eval_section, eval_backend, eval_settings, heldout_eval


def _config(eval_section=None, **trainer):
    return {"eval": eval_section or {}, "trainer": trainer}


@pytest.mark.parametrize(
    "trainer, expected",
    [
        ({}, "hf"),
        ({"use_vllm": False}, "hf"),
        ({"use_vllm": True}, "vllm"),  # TRL's default vllm_mode is colocate
        ({"use_vllm": True, "vllm_mode": "colocate"}, "vllm"),
        ({"use_vllm": True, "vllm_mode": "server"}, "hf"),  # the engine is another process's
    ],
)
def test_auto_is_vllm_exactly_when_the_run_has_a_colocated_engine(trainer, expected):
    assert eval_backend(_config(**trainer)) == expected
    assert eval_backend(_config({"backend": "auto"}, **trainer)) == expected
    assert eval_settings(_config(**trainer), max_new_tokens=8, batch_size=4, seed=0)["backend"] == expected
    check_eval_section(_config(**trainer), "r.yaml")
    assert eval_backend(_config({"backend": "hf"}, **trainer)) == "hf"  # hf is always allowed
    check_eval_section(_config({"backend": "hf"}, **trainer), "r.yaml")


@pytest.mark.parametrize(
    "section, trainer, message",
    [
        ({"backend": "vllm-cpu"}, {}, r"r.yaml: eval.backend='vllm-cpu' must be one of auto, hf, vllm$"),
        ({"backend": None}, {}, r"r.yaml: eval.backend=None must be one of auto, hf, vllm$"),
        ({"backend": "vllm"}, {}, "r.yaml: eval.backend=vllm needs the run's colocated vLLM engine"),
        ({"backend": "vllm"}, {"use_vllm": True, "vllm_mode": "server"}, "eval.backend=vllm needs"),
    ],
)
def test_bad_eval_backend_is_refused_at_plan_time_in_one_line(section, trainer, message):
    with pytest.raises(ValueError, match=message) as info:
        check_eval_section(_config(section, **trainer), "r.yaml")
    assert "\n" not in str(info.value)
    if section["backend"] == "vllm":
        assert "set eval.backend to auto or hf" in str(info.value)


def test_klear_sft_refuses_eval_backend_vllm():
    from klear.config import load_config
    from klear.sft.job import validate_sft_config

    config, _ = load_config("sft_demo")
    config["eval"] = {"backend": "vllm"}
    with pytest.raises(ValueError, match="recipe.yaml: eval.backend=vllm needs the run's colocated vLLM engine"):
        validate_sft_config(config, "recipe.yaml")


# ---------------------------------------------------------------------------------------------- fake engine
class _Params:
    def __init__(self, **kw):
        self.__dict__.update(kw)


class _FakeLLM:
    """Records calls; each "completion" is the request's seed and prompt length, as token ids of a fake tokenizer."""

    def __init__(self, log):
        self.log = log
        self.llm_engine = SimpleNamespace(model_config=SimpleNamespace(model="ckpt", dtype="torch.bfloat16"))

    def wake_up(self, tags):
        self.log.append(("wake_up", tuple(tags)))

    def sleep(self, level):
        self.log.append(("sleep", level))

    def generate(self, prompts, params, use_tqdm=False):
        self.log.append(("generate", len(prompts)))
        self.requests = list(zip(prompts, params))
        return [
            SimpleNamespace(outputs=[SimpleNamespace(token_ids=[p.seed % 97, len(x["prompt_token_ids"]), 2])])
            for x, p in self.requests
        ]


class _Tok:
    eos_token_id = 2

    def apply_chat_template(self, messages, tokenize, add_generation_prompt):
        assert not tokenize and add_generation_prompt
        return "|".join(f"{m['role']}:{m['content']}" for m in messages) + "|assistant:"

    def __call__(self, text, add_special_tokens):
        assert not add_special_tokens
        return {"input_ids": [ord(c) for c in text]}

    def decode(self, ids, skip_special_tokens):
        return " ".join(map(str, ids))


def _trainer(log, *, sleep_mode=False, synced=None, tensor_parallel=1):
    llm = _FakeLLM(log)

    def sync_weights():
        log.append(("sync_weights",))

    generation = SimpleNamespace(
        mode="colocate", llm=llm, enable_sleep_mode=sleep_mode, sync_weights=sync_weights, _llm_weights_sleeping=True
    )
    model = SimpleNamespace(generation_config=SimpleNamespace(eos_token_id=[2, 3]))
    return SimpleNamespace(
        use_vllm=True,
        vllm_generation=generation,
        model=model,
        accelerator=SimpleNamespace(unwrap_model=lambda m: m),
        args=SimpleNamespace(vllm_tensor_parallel_size=tensor_parallel),
    )


@pytest.fixture
def fake_vllm(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(SamplingParams=_Params))


ROWS = [
    {
        "prompt": [{"role": "user", "content": f"q{i}"}],
        "data_source": "x",
        "reward_model": {"ground_truth": "1"},
        "prompt_id": f"p{i}",
    }
    for i in range(3)
]


def _scorer(sources, completions, truths, extras):
    return [1.0 if int(c.split()[0]) % 2 else -1.0 for c in completions]


@pytest.mark.parametrize("sleep_mode", [False, True])
def test_heldout_eval_syncs_then_generates_on_the_colocated_engine(tmp_path, monkeypatch, fake_vllm, sleep_mode):
    import klear.eval.heldout as heldout

    log: list = []
    trainer = _trainer(log, sleep_mode=sleep_mode)
    backend = ColocatedEval(trainer, _Tok())
    monkeypatch.setattr(heldout, "_default_scorer", lambda: _scorer)
    cfg = {"max_new_tokens": 7, "batch_size": 2, "n_samples": 2, "temperature": 0.6, "seed": 5}
    model = SimpleNamespace()  # never used: generation is the engine's
    got = heldout_eval(model, _Tok(), ROWS, cfg, path=tmp_path / "eval_before.json", reuse=False, backend=backend)

    # the current weights reach the engine first; a sleeping engine is woken and put back to sleep (level 2)
    calls = [c[0] for c in log]
    if sleep_mode:
        assert log == [("sync_weights",), ("wake_up", ("kv_cache",)), ("generate", 6), ("sleep", 2)]
        assert trainer.vllm_generation._llm_weights_sleeping is True  # TRL re-syncs before its next rollout
    else:
        assert calls == ["sync_weights", "generate"]
    llm = trainer.vllm_generation.llm
    # one request per sample, problem-major, each with the HF path's seed rule, stops and prompt rendering
    tok = _Tok()
    for (prompt, params), (i, j) in zip(llm.requests, [(i, j) for i in range(3) for j in range(2)]):
        assert params.seed == sample_seed(5, f"p{i}", j)
        assert (params.temperature, params.top_p, params.max_tokens, params.n) == (0.6, 1.0, 7, 1)
        assert params.stop_token_ids == [2, 3] and params.ignore_eos is True
        rendered = tok.apply_chat_template(ROWS[i]["prompt"], tokenize=False, add_generation_prompt=True)
        assert prompt["prompt_token_ids"] == tok(rendered, add_special_tokens=False)["input_ids"]
    # the stop token (2) is cut off: "<seed % 97> <prompt length>"
    assert got["completions"] == [f"{sample_seed(5, f'p{i}', j) % 97} 18" for i in range(3) for j in range(2)]
    assert got["eval_backend"] == "vllm" and got["eval_dtype"] == "bfloat16"
    assert got["samples_per_problem"] == 2 and got["prompt_ids"] == ["p0", "p1", "p2"]
    assert json.loads((tmp_path / "eval_before.json").read_text()) == got


def _on_processes(n: int, fn):
    """``fn(process_index, gather)`` on ``n`` threads in lockstep; ``gather`` behaves as ``gather_object``."""
    import threading

    barrier, box, results, errors = threading.Barrier(n), [None] * n, [None] * n, []

    def gather_for(p):
        def gather(items):
            box[p] = items
            barrier.wait()
            out = [x for b in box for x in b]
            barrier.wait()
            return out

        return gather

    def run(p):
        try:
            results[p] = fn(p, gather_for(p))
        except BaseException as e:
            errors.append(e)
            barrier.abort()

    threads = [threading.Thread(target=run, args=(p,)) for p in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    return results


@pytest.mark.parametrize(("processes", "tensor_parallel"), [(2, 1), (4, 2)])
def test_each_engine_completes_its_share_and_every_process_gets_the_whole_result(fake_vllm, processes, tensor_parallel):
    """Every process syncs once; the processes of one tensor-parallel engine send it the same requests; the
    engines' shares are disjoint and cover every sample; every process returns the 1-process result."""
    from klear.eval.heldout import evaluate

    rows = [{**ROWS[i % 3], "prompt_id": f"p{i}"} for i in range(5)]
    settings = {"max_new_tokens": 7, "n_samples": 2, "temperature": 0.6, "seed": 5, "scorer": _scorer}
    single = evaluate(None, _Tok(), rows, backend=ColocatedEval(_trainer([]), _Tok()), show_progress=False, **settings)
    logs: list[list] = [[] for _ in range(processes)]
    backends = [ColocatedEval(_trainer(logs[p], tensor_parallel=tensor_parallel), _Tok()) for p in range(processes)]

    def one(p, gather):
        return evaluate(
            None,
            _Tok(),
            rows,
            backend=backends[p],
            process_index=p,
            num_processes=processes,
            gather=gather,
            show_progress=False,
            **settings,
        )

    results = _on_processes(processes, one)
    assert all(r == single for r in results)
    assert all([c[0] for c in log] == ["sync_weights", "generate"] for log in logs)
    seeds = [[params.seed for _, params in b.generation.llm.requests] for b in backends]
    groups = [seeds[g : g + tensor_parallel] for g in range(0, processes, tensor_parallel)]
    assert all(all(s == group[0] for s in group) for group in groups)  # one engine: the same requests
    drawn = sorted(x for group in groups for x in group[0])
    assert drawn == sorted(sample_seed(5, f"p{i}", j) for i in range(5) for j in range(2))  # disjoint, complete
    assert all(group[0] for group in groups)  # every engine had work


def test_colocated_eval_needs_a_colocated_engine():
    trainer = SimpleNamespace(use_vllm=True, vllm_generation=SimpleNamespace(mode="server"))
    with pytest.raises(ValueError, match="eval.backend=vllm needs the run's colocated vLLM engine"):
        ColocatedEval(trainer, _Tok())
