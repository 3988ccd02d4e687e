"""klear's verl worker side of the SFT term (paper Eq. 13, 14) on verl 0.9 itself (run with `make test-verl`).

``KlearActorRolloutRefWorker.init_model``, ``KlearTrainingWorker.train_mini_batch`` / ``train_batch`` and the
``klear_sync`` trainer run unmodified, on two data-parallel CPU ranks (forked processes, gloo), with verl's own
FSDP2 engine, ``ppo_loss`` and micro-batching.  What the tests fake is the hardware verl expects: a CPU
"platform" (verl 0.9 has none and falls back to CUDA), the FSDP engine registered for it, and the process group
a Ray worker would have.  Expected values are computed independently: a float64 forward of the same tiny
model, the token means of Eq. 7 and Eq. 13 written out, and SGD steps done by hand.
"""

from __future__ import annotations

import copy
import multiprocessing
import os
import traceback
import types
from contextlib import contextmanager
from functools import partial

import pytest
import torch

from conftest import require_or_skip

verl = require_or_skip("verl", reason="verl is not installed (make test-verl builds its venv)")

from tensordict import TensorDict  # noqa: E402
from verl.plugin.platform.platform_base import PlatformBase  # noqa: E402
from verl.single_controller.base.decorator import Dispatch, get_predefined_dispatch_fn  # noqa: E402
from verl.single_controller.base.worker_group import WorkerGroup  # noqa: E402
from verl.trainer.ppo.v1 import get_trainer_cls  # noqa: E402
from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync  # noqa: E402
from verl.workers.engine_workers import ActorRolloutRefWorker  # noqa: E402
from verl.workers.utils.losses import ppo_loss  # noqa: E402

from klear.integrations.verl.trainer import (  # noqa: E402
    KlearActorRolloutRefWorker,
    KlearPPOTrainer,
    KlearTrainingWorker,
    klear_ppo_loss,
)

pytestmark = pytest.mark.verl

ALPHA = 0.1  # sft_alpha (the paper's 0.1, Table 6)
CLIP_LOW, CLIP_HIGH = 0.2, 0.28  # the recipe's epsilon_l, epsilon_h (klear_rl.sh)
LR = 0.1  # plain SGD: a parameter moves by -LR * (the rank-averaged gradient of the summed micro-batch losses)
DP = 2
# One rollout row: prompt, response, sequence reward (on the last response token), advantage.  Rank 0 gets rows
# 0-3, rank 1 rows 4-7.  Correct (Phi, Eq. 13) = reward 1.0; 0.75 is a partly passing code response, not correct.
# Mini-batch 1 has correct tokens on rank 0 only, mini-batch 2 a different count on each rank (so a rank-local
# or a whole-batch count gives another divisor).
ROWS = [
    ("What is 2+2?", " 4, surely", 1.0, 1.0),
    ("Name a colour.", " Blue", -1.0, -1.0),
    ("Say hi", " hi there friend", 1.0, 0.5),
    ("Count to three", " one two three", 0.75, -0.5),
    ("Add 5 and 7.", " 12", -1.0, 2.0),
    ("Spell cat", " c a t", -1.0, -0.25),
    ("Why?", " because it is", 1.0, 1.5),
    ("Pick a number", " seven", 1.0, -2.0),
]


# ------------------------------------------------------------------------ the fake hardware: a CPU platform


def _zero(*args, **kwargs):
    return 0


class _CpuDeviceModule(types.ModuleType):
    """``torch.cpu`` plus the memory queries verl logs (all 0) and a device name verl's FLOPs table lacks."""

    def __getattr__(self, name):
        if hasattr(torch.cpu, name):
            return getattr(torch.cpu, name)
        if name in ("max_memory_allocated", "max_memory_reserved", "memory_allocated", "memory_reserved"):
            return _zero
        if name in ("empty_cache", "reset_peak_memory_stats", "ipc_collect"):
            return _zero
        if name == "mem_get_info":
            return lambda *a, **k: (0, 0)
        if name == "get_device_name":
            return lambda *a, **k: "CPU"
        raise AttributeError(name)


class _CpuPlatform(PlatformBase):
    """verl's device abstraction on the CPU: device ``cpu``, collectives over gloo."""

    device_name = property(lambda self: "cpu")
    vendor_name = property(lambda self: "cpu")
    device_module = property(lambda self: _CpuDeviceModule("klear_test_cpu"))

    def is_available(self):
        return True

    def current_device(self):
        return "cpu"  # verl moves tensors with .to(get_device_id())

    def device_count(self):
        return 1

    def set_device(self, device_index):
        pass

    def synchronize(self, device_index=None):
        pass

    def manual_seed(self, seed):
        torch.manual_seed(seed)

    def manual_seed_all(self, seed):
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings):
        pass

    def empty_cache(self):
        pass

    def get_device_capability(self, device_index=0):
        return None, None

    def communication_backend_name(self):
        return "gloo"

    def visible_devices_envvar(self):
        return "CUDA_VISIBLE_DEVICES"

    @contextmanager
    def nvtx_range(self, msg):
        yield

    def profiler_start(self):
        pass

    def profiler_stop(self):
        pass

    def ray_resource_name(self):
        return "CPU"

    def ray_noset_envvars(self):
        return []

    def is_ipc_supported(self):
        return False

    def cudart(self):
        return None


# ------------------------------------------------------------------------ the run: verl's worker on 2 ranks


def _compose(overrides: list[str]):
    from hydra import compose, initialize_config_dir

    config_dir = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        return compose("ppo_trainer", overrides=overrides)


def _actor_config(model_path, sft_norm: str, mini_batch: int, dynamic_bsz: bool, micro_batch: int):
    """The ``actor_rollout_ref`` config of a klear_sync run (klear_rl.sh's loss settings) for the tiny model."""
    return _compose(
        [
            "algorithm.adv_estimator=grpo",
            f"actor_rollout_ref.model.path={model_path}",
            "actor_rollout_ref.model.use_remove_padding=false",
            "actor_rollout_ref.model.enable_gradient_checkpointing=false",
            "+actor_rollout_ref.model.override_config.attn_implementation=sdpa",
            "actor_rollout_ref.actor.strategy=fsdp2",
            "actor_rollout_ref.actor.fsdp_config.model_dtype=fp32",
            "+actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=fp32",
            "actor_rollout_ref.actor.use_torch_compile=false",
            "actor_rollout_ref.rollout.n=1",
            f"actor_rollout_ref.actor.ppo_mini_batch_size={mini_batch}",
            f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={micro_batch}",
            f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={micro_batch}",
            f"actor_rollout_ref.actor.use_dynamic_bsz={dynamic_bsz}",
            f"actor_rollout_ref.rollout.log_prob_use_dynamic_bsz={dynamic_bsz}",
            # a token budget below two rows: uneven micro-batches
            "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=20",
            "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=20",
            "actor_rollout_ref.actor.optim.optimizer=SGD",
            f"actor_rollout_ref.actor.optim.lr={LR}",
            "actor_rollout_ref.actor.optim.weight_decay=0.0",
            "actor_rollout_ref.actor.optim.clip_grad=1e9",  # no clipping: the update is -LR * gradient
            "actor_rollout_ref.actor.loss_agg_mode=token-mean",
            f"actor_rollout_ref.actor.clip_ratio_low={CLIP_LOW}",
            f"actor_rollout_ref.actor.clip_ratio_high={CLIP_HIGH}",
            "actor_rollout_ref.actor.clip_ratio_c=10.0",
            "actor_rollout_ref.actor.policy_loss._target_=klear.integrations.verl.GPPOLossConfig",
            "actor_rollout_ref.actor.policy_loss.loss_mode=gppo",
            f"+actor_rollout_ref.actor.policy_loss.sft_alpha={ALPHA}",
            f"+actor_rollout_ref.actor.policy_loss.sft_norm={sft_norm}",
        ]
    ).actor_rollout_ref


def _rank_batch(rows, old, pad_id) -> TensorDict:
    """verl's actor batch for one rank: left-padded prompts, right-padded responses -> verl's no-padding layout."""
    from verl.workers.utils.padding import left_right_2_no_padding

    b = len(rows)
    p_len = max(len(p) for p, *_ in rows)
    r_len = max(len(r) for _, r, *_ in rows)
    prompts, responses = torch.full((b, p_len), pad_id), torch.full((b, r_len), pad_id)
    p_mask, r_mask = torch.zeros(b, p_len, dtype=torch.long), torch.zeros(b, r_len, dtype=torch.long)
    old_lp, adv, scores = torch.zeros(b, r_len), torch.zeros(b, r_len), torch.zeros(b, r_len)
    for i, ((p, r, reward, a), o) in enumerate(zip(rows, old)):
        prompts[i, p_len - len(p) :], p_mask[i, p_len - len(p) :] = torch.tensor(p), 1
        responses[i, : len(r)], r_mask[i, : len(r)] = torch.tensor(r), 1
        old_lp[i, : len(r)], adv[i, : len(r)], scores[i, len(r) - 1] = o, a, reward
    mask = torch.cat([p_mask, r_mask], 1)
    td = TensorDict(
        {
            "prompts": prompts,
            "responses": responses,
            "input_ids": torch.cat([prompts, responses], 1),
            "attention_mask": mask,
            "position_ids": (mask.cumsum(1) - 1).clamp(min=0),
            "response_mask": r_mask,
            "old_log_probs": old_lp,
            "advantages": adv,
            "rm_scores": scores,  # verl v1's token-level reward field
        },
        batch_size=[b],
    )
    return left_right_2_no_padding(td)


def _rank_main(rank: int, store: str, configs, batches, mini_batches, out: str) -> None:
    """One data-parallel rank: verl's worker, init_model and update_actor per config; results to ``out``."""
    try:
        torch.set_num_threads(1)
        from verl.plugin.platform.platform_manager import set_platform

        set_platform(_CpuPlatform())
        # what Ray gives a worker: its rank and an initialised process group
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(DP), MASTER_ADDR="127.0.0.1", MASTER_PORT="0")
        torch.distributed.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=DP)
        from verl.workers.engine import EngineRegistry
        from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

        EngineRegistry.register(model_type="language_model", backend=["fsdp", "fsdp2"], device="cpu")(
            FSDPEngineWithLMHead
        )
        # verl 0.9's model patch imports trl's AutoModelForCausalLMWithValueHead, which trl 1.x (klear's) no
        # longer has: skip that value-head patch (an actor has no value head).
        import verl.models.transformers.monkey_patch as verl_patch

        verl_patch.is_trl_available = lambda: False
        results = []
        for config, mini_batch in zip(configs, mini_batches):
            worker = KlearActorRolloutRefWorker(config=config, role="actor")
            worker.init_model()
            data = batches[rank].clone()
            extra = {  # what verl's trainer (_update_actor) sends with the batch
                "mini_batch_size": mini_batch,
                "global_batch_size": mini_batch,
                "epochs": 1,
                "seed": 0,
                "dataloader_kwargs": {"shuffle": False},
                "temperature": 1.0,
                "calculate_entropy": False,
                "distillation_use_topk": False,
                "distillation_only": False,
            }
            for key, value in extra.items():
                data.set_non_tensor(key, value)
            metrics = worker.update_actor(data)["metrics"]
            params = {
                k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().double().clone()
                for k, v in worker.actor.engine.module.state_dict().items()
            }
            loss_fn = worker.actor.loss_fn
            base = getattr(loss_fn, "keywords", {}).get("base_loss_fn")
            wiring = {
                "actor_cls": type(worker.actor).__name__,
                "actor_loss_is_worker_loss": loss_fn is worker.loss_fn,
                "loss_fn": getattr(loss_fn, "func", loss_fn).__name__,
                "base_loss_fn": getattr(getattr(base, "func", None), "__name__", None),
            }
            floats = {k: [float(x) for x in v] if isinstance(v, list) else float(v) for k, v in metrics.items()}
            results.append({"metrics": floats, "params": params, "wiring": wiring})
        if rank == 0:
            torch.save(results, os.path.join(out, "results.pt"))
        torch.distributed.destroy_process_group()
    except BaseException:
        with open(os.path.join(out, f"rank{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
        raise


def _hand_log_probs(model, rows) -> list[torch.Tensor]:
    """Per row, ``(len(response),)`` float64 log p of each response token given everything before it."""
    out = []
    for p, r, *_ in rows:
        seq = torch.tensor(p + r)
        logp = torch.log_softmax(model(input_ids=seq[None]).logits[0].double(), -1)
        out.append(logp[torch.arange(len(p) - 1, len(seq) - 1), seq[len(p) :]])
    return out


@pytest.fixture(scope="module")
def verl_run(tmp_path_factory, embedded_path):
    """Both configs through verl's worker on 2 ranks; returns (rows, old log-probs, float64 model, results)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from klear.models.embedded import tiny_random_model

    tmp = tmp_path_factory.mktemp("verl_worker")
    model, tok = tiny_random_model(embedded_path)
    model.save_pretrained(tmp / "tiny")
    tok.save_pretrained(tmp / "tiny")
    tok = AutoTokenizer.from_pretrained(tmp / "tiny")
    hand = AutoModelForCausalLM.from_pretrained(tmp / "tiny", dtype=torch.float64, attn_implementation="eager")
    rows = [(tok(p).input_ids, tok(r).input_ids, reward, a) for p, r, reward, a in ROWS]
    with torch.no_grad():  # verl's old log-probs: the policy's own before the update (float32 in the batch)
        old = [lp.float() for lp in _hand_log_probs(hand, rows)]
    per = len(rows) // DP
    shards = [slice(r * per, (r + 1) * per) for r in range(DP)]
    batches = [_rank_batch(rows[s], old[s], tok.pad_token_id) for s in shards]
    configs = [
        # the recipe's settings: Eq. 13's divisor, micro-batches by token budget; 2 mini-batches of 2 rows per rank
        _actor_config(tmp / "tiny", "mini_batch", mini_batch=4, dynamic_bsz=True, micro_batch=1),
        # the authors' per-micro-batch mean: 1 mini-batch of 4 rows per rank in 2 micro-batches of 2
        _actor_config(tmp / "tiny", "micro_batch", mini_batch=8, dynamic_bsz=False, micro_batch=2),
    ]
    out = tmp / "out"
    out.mkdir()
    ctx = multiprocessing.get_context("fork")  # the children reuse this process's imports (verl takes ~20 s)
    procs = [
        ctx.Process(target=_rank_main, args=(r, str(tmp / "store"), configs, batches, [4, 8], str(out)))
        for r in range(DP)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=600)
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    errors = "\n".join(f.read_text() for f in sorted(out.glob("rank*.err")))
    assert not errors and all(p.exitcode == 0 for p in procs), f"exit codes {[p.exitcode for p in procs]}\n{errors}"
    return rows, old, hand, torch.load(out / "results.pt", weights_only=False)


def _sgd_step(model, loss) -> None:
    model.zero_grad()
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= LR * p.grad


def _pg_loss(lps, old, rows, idx) -> torch.Tensor:
    """Eq. 7's token mean over the mini-batch of the surrogate -r * A (every ratio inside the clip range)."""
    n_tokens = sum(len(lps[i]) for i in idx)
    ratios = [torch.exp(lps[i] - old[i].double()) for i in idx]
    inside = all(((r > 1 - CLIP_LOW) & (r < 1 + CLIP_HIGH)).all() for r in ratios)
    assert inside, f"setup: a ratio left the clip range: {ratios}"
    return -sum((r * rows[i][3]).sum() for r, i in zip(ratios, idx)) / n_tokens


def _assert_params(got: dict[str, torch.Tensor], model, start: dict[str, torch.Tensor]) -> None:
    """The update verl's worker made equals the hand SGD update (per parameter tensor)."""
    want = model.state_dict()
    assert set(got) == set(want)
    for name in want:
        # verl's parameters are float32: allow a few of their ulps on top of the float64 hand update
        atol = 4 * torch.finfo(torch.float32).eps * start[name].abs().max().item()
        got_step, want_step = got[name] - start[name], want[name] - start[name]
        torch.testing.assert_close(got_step, want_step, rtol=1e-4, atol=atol, msg=lambda m, n=name: f"{n}: {m}")


def test_worker_adds_alpha_times_eq13_sft_over_ranks_per_mini_batch(verl_run):
    """sft_norm=mini_batch (the recipe's): loss = L_GPPO + 0.1 * (NLL of correct tokens / their count over all ranks
    in the mini-batch), value and gradient, through verl's micro-batching, FSDP averaging and SGD."""
    rows, old, hand, results = verl_run
    res = results[0]
    assert res["wiring"] == {
        "actor_cls": KlearTrainingWorker.__name__,
        "actor_loss_is_worker_loss": True,
        "loss_fn": klear_ppo_loss.__name__,
        "base_loss_fn": ppo_loss.__name__,
    }
    model = copy.deepcopy(hand)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    per = len(rows) // DP
    want_loss, want_sft = [], []
    for k in range(2):  # mini-batch k: rows 2k, 2k+1 of each rank, no shuffle
        idx = [r * per + 2 * k + j for r in range(DP) for j in range(2)]
        lps = dict(zip(idx, _hand_log_probs(model, [rows[i] for i in idx])))
        correct = [i for i in idx if rows[i][2] == 1.0]
        n_correct = sum(len(lps[i]) for i in correct)
        assert n_correct > 0
        sft = -sum(lps[i].sum() for i in correct) / n_correct  # Eq. 13
        loss = _pg_loss(lps, old, rows, idx) + ALPHA * sft  # Eq. 14
        want_loss.append(loss.item())
        want_sft.append(sft.item())
        _sgd_step(model, loss)
    m = res["metrics"]
    assert m["loss"] == pytest.approx(want_loss, rel=1e-5)
    # the SFT part alone: the loss minus verl's own policy-loss metric
    assert [a - b for a, b in zip(m["loss"], m["actor/pg_loss"])] == pytest.approx(
        [ALPHA * s for s in want_sft], rel=1e-4
    )
    _assert_params(res["params"], model, start)


def test_worker_micro_batch_norm_divides_each_micro_batch_mean_by_their_number(verl_run):
    """sft_norm=micro_batch (the authors' scripts): each micro-batch's own token mean / micro-batches per rank,
    averaged over ranks (train_batch sets the number of micro-batches: 4 rows / 2 per micro-batch)."""
    rows, old, hand, results = verl_run
    res = results[1]
    model = copy.deepcopy(hand)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    idx = list(range(len(rows)))
    lps = dict(zip(idx, _hand_log_probs(model, rows)))
    sft = 0.0
    for micro in ([0, 1], [2, 3], [4, 5], [6, 7]):  # rank 0: rows 0-3, rank 1: rows 4-7; 2 micro-batches each
        correct = [i for i in micro if rows[i][2] == 1.0]
        if correct:
            sft = sft - sum(lps[i].sum() for i in correct) / sum(len(lps[i]) for i in correct) / 2
    sft = sft / DP
    loss = _pg_loss(lps, old, rows, idx) + ALPHA * sft
    m = res["metrics"]
    assert m["loss"] == pytest.approx([loss.item()], rel=1e-5)
    assert m["loss"][0] - m["actor/pg_loss"][0] == pytest.approx(ALPHA * sft.item(), rel=1e-4)
    _sgd_step(model, loss)
    _assert_params(res["params"], model, start)


# ------------------------------------------------------------------------ klear_sync and verl's dispatch


@pytest.mark.parametrize(
    "overrides,hybrid",
    [
        ([], True),  # GRPO, no reference model: ActorRollout
        (["actor_rollout_ref.actor.use_kl_loss=true"], True),  # ActorRolloutRef
        (["actor_rollout_ref.actor.use_kl_loss=true"], False),  # separate Actor and RefPolicy workers
        (["algorithm.adv_estimator=gae"], True),  # plus verl's critic, left as it is
    ],
)
def test_klear_sync_is_verls_sync_trainer_with_klear_actor_workers(overrides, hybrid):
    """verl's `trainer.v1.trainer_mode=klear_sync` lookup gives KlearPPOTrainer, whose worker map is verl's with
    every ActorRolloutRefWorker (actor, rollout, reference) replaced by KlearActorRolloutRefWorker."""
    cfg = _compose(["algorithm.adv_estimator=grpo", "trainer.v1.trainer_mode=klear_sync", *overrides])
    cls = get_trainer_cls(cfg.trainer.v1.trainer_mode)  # what verl.trainer.main_ppo does
    assert cls is KlearPPOTrainer and issubclass(cls, PPOTrainerSync)
    verls, klears = PPOTrainerSync.__new__(PPOTrainerSync), cls.__new__(cls)
    for t in (verls, klears):
        t.config = copy.deepcopy(cfg)
        t._enable_hybrid_replicas = hybrid
        t._init_resource_pool_mgr()
    assert set(klears.role_worker_mapping) == set(verls.role_worker_mapping)
    assert klears.mapping == verls.mapping
    replaced = 0
    for role, verl_cls in verls.role_worker_mapping.items():
        got = klears.role_worker_mapping[role].__ray_actor_class__
        if verl_cls.__ray_actor_class__ is ActorRolloutRefWorker:
            assert got is KlearActorRolloutRefWorker, role
            replaced += 1
        else:
            assert got is verl_cls.__ray_actor_class__, role
    assert replaced == (1 if hybrid else 2)


class _LocalWorkerGroup(WorkerGroup):
    """verl's WorkerGroup whose workers are local objects (Ray's remote call replaced by a plain call)."""

    def __init__(self, workers):
        super().__init__(resource_pool=None)
        self._workers = workers

    def execute_all(self, method_name, *args, **kwargs):
        n = len(self._workers)
        split = all(isinstance(a, list) and len(a) == n for a in (*args, *kwargs.values()))
        return [
            getattr(w, method_name)(
                *(a[i] if split else a for a in args), **{k: v[i] if split else v for k, v in kwargs.items()}
            )
            for i, w in enumerate(self._workers)
        ]

    def execute_rank_zero(self, method_name, *args, **kwargs):
        return getattr(self._workers[0], method_name)(*args, **kwargs)


def _local_method(group, method_name, dispatch_fn, collect_fn, execute_fn, blocking):
    """verl's Ray func_generator without Ray: dispatch, execute on every worker, collect."""

    def call(*args, **kwargs):
        args, kwargs = dispatch_fn(group, *args, **kwargs)
        return collect_fn(group, execute_fn(method_name, *args, **kwargs))

    call.dispatch_fn = dispatch_fn
    return call


def test_driver_init_model_reaches_klears_init_model_on_every_worker(monkeypatch):
    """The trainer calls ``actor_rollout_wg.init_model()``: verl binds it (ONE_TO_ALL) from the worker class, and
    each worker runs klear's override, which wraps the actor's loss only on actor roles."""
    from omegaconf import OmegaConf

    class _Actor:  # the inner TrainingWorker, as far as init_model uses it
        loss_fn = None

        def set_loss_fn(self, fn):
            self.loss_fn = fn

    base_config = OmegaConf.create({"policy_loss": {"sft_alpha": ALPHA}})

    def verls_init_model(self):  # verl's init_model, actor part (the rest needs a cluster)
        if "actor" in self.role:
            self.loss_fn = partial(ppo_loss, config=base_config)
            self.actor = _Actor()
            self.actor.set_loss_fn(self.loss_fn)

    monkeypatch.setattr(ActorRolloutRefWorker, "init_model", verls_init_model)
    workers = []
    for role in ("actor_rollout", "actor", "rollout"):
        w = KlearActorRolloutRefWorker.__new__(KlearActorRolloutRefWorker)
        w.role, w.loss_fn, w.actor = role, None, None
        workers.append(w)
    group = _LocalWorkerGroup(workers)
    bound = group._bind_worker_method(KlearActorRolloutRefWorker, _local_method)
    assert "init_model" in bound and "update_actor" in bound
    assert group.init_model.dispatch_fn is get_predefined_dispatch_fn(Dispatch.ONE_TO_ALL)["dispatch_fn"]
    group.init_model()
    for w in workers[:2]:
        assert w.loss_fn.func is klear_ppo_loss and w.actor.loss_fn is w.loss_fn, w.role
        base = w.loss_fn.keywords["base_loss_fn"]
        assert base.func is ppo_loss and w.loss_fn.args == (base_config,)
    assert workers[2].loss_fn is None and workers[2].actor is None
