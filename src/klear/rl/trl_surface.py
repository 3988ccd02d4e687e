"""Every place klear touches TRL's PRIVATE API, named once: a TRL upgrade that breaks one fails one obvious test.

klear's trainers are thin subclasses of TRL's (``GPPOTrainer`` and ``TRLPeerTrainer`` of ``trl.GRPOTrainer``,
``KlearSFTTrainer`` of ``trl.SFTTrainer``, all three with :class:`klear.lifecycle.LifecycleMixin`). Besides TRL's
public API they rely on underscore methods they override (**hooks**), underscore attributes they read, set or call
(**attributes**) and objects they replace at run time (**patches**). None of that is covered by TRL's semantic
versioning: a minor release may rename a hook, add a parameter, stop setting an attribute or stop calling a method,
and the only guard in ``pyproject.toml`` is the version pin (``trl>=1.10,<1.17``). :data:`TRL_SURFACE` lists every
one of them, and ``tests/test_trl_surface.py`` checks each against the INSTALLED TRL (and transformers): the owner
still has the name, a hook's or called method's parameter names are still the listed ones, the TRL code klear's
use depends on (where an attribute is set, where a hook is called, the call a patch intercepts) still reads as
:attr:`TRLContact.evidence` says; and it reads klear's own source with ``ast`` so an override of a private TRL
method, a use of a private TRL attribute or a new patch that is not in this table fails too. Raising the pin is
then: run that test, and for each failing entry read the new TRL code and fix the klear function named in
:attr:`TRLContact.used_in`.

Entries whose owner is ``transformers`` (``Trainer``, ``GenerationMixin``) are on the same list because klear
reaches them through TRL's classes (``GRPOTrainer`` and ``SFTTrainer`` subclass ``transformers.Trainer``).
Checked against TRL 1.16.0 and transformers 5.25. Data only: importing this module imports nothing heavy.
"""

from __future__ import annotations

from dataclasses import dataclass

HOOK = "hook"  # a private method klear overrides (super() is called unless the ``why`` says otherwise)
ATTRIBUTE = "attribute"  # a private attribute (or method) of TRL's that klear reads, sets or calls
PATCH = "patch"  # an attribute of a TRL/transformers object klear replaces at run time
KINDS = (HOOK, ATTRIBUTE, PATCH)

GRPO = "trl.GRPOTrainer"
#: The multimodal / token-type inputs TRL 1.16's ``_get_per_token_logps_and_entropies`` takes from a micro-batch
#: (None for text models); :class:`klear.rl.trainer.GPPOTrainer` forwards exactly these.
TRL_FORWARD_KEYS = (
    "pixel_values",
    "image_grid_thw",
    "num_images",
    "pixel_attention_mask",
    "spatial_shapes",
    "num_tiles",
    "image_sizes",
    "token_type_ids",
    "mm_token_type_ids",
    "image_position_ids",
)
TRAINER = "transformers.Trainer"
VLLM_GENERATION = "trl.generation.vllm_generation.VLLMGeneration"


@dataclass(frozen=True)
class TRLContact:
    """One point of contact with TRL's private API.

    Attributes:
        kind: :data:`HOOK`, :data:`ATTRIBUTE` or :data:`PATCH`.
        owner: the dotted path of the class (or module) that defines ``name``, e.g. ``"trl.GRPOTrainer"``.
        name: the attribute's name on ``owner``.
        params: for a method (a hook, a private method klear calls, a patched method): its parameter names after
            ``self``, in order, as the installed version must have them; ``None`` where no signature applies.
        why: one line: what klear needs it for.
        used_in: where klear uses it, ``"module:qualname"`` (e.g. ``"klear.rl.trainer:GPPOTrainer._prepare_inputs"``).
        evidence: ``(function, text)`` pairs, ``function`` a dotted path into TRL/transformers: the source of that
            function must contain ``text`` (where TRL sets the attribute, calls the hook, makes the call a patch
            intercepts), so a change of behaviour behind an unchanged name fails the test too.
    """

    kind: str
    owner: str
    name: str
    params: tuple[str, ...] | None
    why: str
    used_in: tuple[str, ...]
    evidence: tuple[tuple[str, str], ...] = ()

    @property
    def qualname(self) -> str:
        """``owner.name``, e.g. ``"trl.GRPOTrainer._prepare_inputs"``."""
        return f"{self.owner}.{self.name}"


_RL = "klear.rl.trainer:GPPOTrainer"
_PEER = "klear.rl.trl_peer:TRLPeerTrainer"
_LIFE = "klear.lifecycle:LifecycleMixin"

TRL_SURFACE: tuple[TRLContact, ...] = (
    # ------------------------------------------------------------------ hooks: private methods klear overrides
    TRLContact(
        HOOK,
        GRPO,
        "_generate",
        ("prompts",),
        "times the sampling of a rollout batch (timing/generate_s)",
        (f"{_RL}._generate",),
        ((f"{GRPO}._generate_and_score_completions", "self._generate("),),
    ),
    TRLContact(
        HOOK,
        GRPO,
        "_generate_single_turn",
        ("prompt_ids", "images", "multimodal_fields", "num_generations", "has_tool_images"),
        "one prefill per prompt group (see the generate patch); returns the decode loop's log-probs as TRL's logprobs",
        (f"{_RL}._generate_single_turn",),
        (
            (f"{GRPO}._generate", "self._generate_single_turn("),
            (f"{GRPO}._generate_single_turn", "return completion_ids, logprobs"),
            (
                f"{GRPO}._generate_and_score_completions",
                'output["sampling_per_token_logps"] = sampling_per_token_logps',
            ),
        ),
    ),
    TRLContact(
        HOOK,
        GRPO,
        "_get_per_token_logps_and_entropies",
        (
            "model",
            "input_ids",
            "attention_mask",
            "logits_to_keep",
            "batch_size",
            "compute_entropy",
            "compute_aux_loss",
            *TRL_FORWARD_KEYS,
        ),
        "skips TRL's old-log-prob pass over the whole rollout (redone on the kept samples); the loss's log-probs",
        (f"{_RL}._get_per_token_logps_and_entropies", f"{_RL}._policy_log_probs"),
        (
            (f"{GRPO}._generate_and_score_completions", "self._get_per_token_logps_and_entropies("),
            (f"{GRPO}._get_per_token_logps_and_entropies", "return logps, entropies, aux_loss"),
        ),
    ),
    TRLContact(
        HOOK,
        GRPO,
        "_calculate_rewards",
        ("inputs", "prompts", "completions", "completion_ids_list"),
        "keeps the gathered (N, F) rewards and the prompt ids for Eq. 4 by prompt id; the peer's population std",
        (f"{_RL}._calculate_rewards", f"{_PEER}._calculate_rewards"),
        ((f"{GRPO}._generate_and_score_completions", "self._calculate_rewards("),),
    ),
    TRLContact(
        HOOK,
        GRPO,
        "_generate_and_score_completions",
        ("inputs",),
        "replaces TRL's advantages by Eq. 4's, adds the keep/correct flags and the rollout metrics",
        (f"{_RL}._generate_and_score_completions", f"{_PEER}._generate_and_score_completions"),
        ((f"{GRPO}._prepare_inputs", "self._generate_and_score_completions("),),
    ),
    TRLContact(
        HOOK,
        GRPO,
        "_prepare_inputs",
        ("generation_batch",),
        "drops filtered samples from a fresh rollout's micro-batches, annotates exact step divisors, old log-probs",
        (f"{_RL}._prepare_inputs",),
        ((f"{TRAINER}.training_step", "self._prepare_inputs("),),
    ),
    TRLContact(
        HOOK,
        GRPO,
        "_compute_loss",
        ("model", "inputs"),
        "the GPPO loss (klear.rl.losses.total_loss, Eq. 14) in place of TRL's; TRL's is not called",
        (f"{_RL}._compute_loss",),
        ((f"{GRPO}.compute_loss", "self._compute_loss("),),
    ),
    TRLContact(
        HOOK,
        TRAINER,
        "_save_checkpoint",
        ("model", "trial"),
        "complete-checkpoint marker, one-line error and cleanup on a failed save, rotation after the marker",
        (f"{_LIFE}._save_checkpoint",),
        ((f"{TRAINER}._maybe_log_save_evaluate", "self._save_checkpoint("),),
    ),
    TRLContact(
        HOOK,
        TRAINER,
        "_run_epoch",
        (
            "model",
            "epoch",
            "train_dataloader",
            "steps_in_epoch",
            "num_update_steps_per_epoch",
            "trial",
            "ignore_keys_for_eval",
            "start_time",
            "resume_from_checkpoint",
            "epochs_trained",
            "steps_trained_in_current_epoch",
        ),
        "a run resumed at max_steps trains nothing (transformers would run one more step)",
        (f"{_LIFE}._run_epoch",),
        ((f"{TRAINER}._inner_training_loop", "self._run_epoch("),),
    ),
    TRLContact(
        HOOK,
        TRAINER,
        "_maybe_log_save_evaluate",
        ("tr_loss", "grad_norm", "model", "trial", "epoch", "ignore_keys_for_eval", "start_time", "learning_rate"),
        "stops a run whose loss or parameters are not finite before that step is logged or checkpointed",
        (f"{_LIFE}._maybe_log_save_evaluate",),
        ((f"{TRAINER}._run_epoch", "self._maybe_log_save_evaluate("),),
    ),
    # ------------------------------------------------------------------ attributes: read, set or called
    TRLContact(
        ATTRIBUTE,
        GRPO,
        "_metrics",
        None,
        "klear's metrics (klear/*, timing/*, entropy) are appended where TRL's log averages its own",
        (f"{_RL}._generate_and_score_completions", f"{_RL}._flush_metrics", "klear.rl.trainer:_PhaseTimer.on_step_end"),
        (
            (f"{GRPO}.__init__", 'self._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}'),
            (f"{GRPO}.log", "self._metrics[mode]"),
        ),
    ),
    TRLContact(
        ATTRIBUTE,
        GRPO,
        "_buffered_inputs",
        None,
        "the fresh rollout's micro-batches, replaced by the filtered and annotated ones TRL then serves",
        (f"{_RL}._prepare_inputs",),
        (
            (f"{GRPO}.__init__", "self._buffered_inputs = None"),
            (f"{GRPO}._prepare_inputs", "self._buffered_inputs[self._step % self.args.steps_per_generation]"),
        ),
    ),
    TRLContact(
        ATTRIBUTE,
        GRPO,
        "_step",
        None,
        "picks the micro-batch of the replaced buffer that TRL's own indexing would have returned",
        (f"{_RL}._prepare_inputs",),
        ((f"{GRPO}.__init__", "self._step = 0"), (f"{GRPO}.training_step", "self._step += 1")),
    ),
    TRLContact(
        ATTRIBUTE,
        GRPO,
        "_tag_names",
        None,
        "class attribute klear sets: the model tags TRL adds (gppo, klear)",
        ("klear.rl.trainer:GPPOTrainer",),
        ((f"{GRPO}.__init__", "self.model.add_model_tags(self._tag_names)"),),
    ),
    TRLContact(
        ATTRIBUTE,
        GRPO,
        "_name",
        None,
        "class attribute klear sets: the trainer name of TRL's model card (GPPO)",
        ("klear.rl.trainer:GPPOTrainer",),
        ((f"{GRPO}.create_model_card", "self._name"),),
    ),
    TRLContact(
        ATTRIBUTE,
        TRAINER,
        "_get_output_dir",
        ("trial",),
        "called: the run directory the save writes into, to mark and rotate the checkpoint",
        (f"{_LIFE}._save_checkpoint",),
        ((f"{TRAINER}._save_checkpoint", "self._get_output_dir("),),
    ),
    TRLContact(
        ATTRIBUTE,
        TRAINER,
        "_created_lr_scheduler",
        None,
        "set as Trainer.create_scheduler sets it, so a second train() rebuilds the cosine-to-floor scheduler",
        ("klear.sft.trainer:KlearSFTTrainer.create_scheduler",),
        (
            (f"{TRAINER}.__init__", "self._created_lr_scheduler = False"),
            (f"{TRAINER}._prepare_for_training", "if self._created_lr_scheduler:"),
        ),
    ),
    TRLContact(
        ATTRIBUTE,
        VLLM_GENERATION,
        "_iter_named_params",
        (),
        "called: TRL's parameter walk (ZeRO-3/FSDP gathers, PEFT merges) feeding the CPU engine's weight load",
        ("klear.generation.vllm:install_weight_sync",),
        ((f"{VLLM_GENERATION}.sync_weights", "self._iter_named_params()"),),
    ),
    TRLContact(
        ATTRIBUTE,
        VLLM_GENERATION,
        "_llm_weights_sleeping",
        None,
        "set True after the held-out eval puts the engine back to sleep, so TRL re-syncs before its next rollout",
        ("klear.eval.backends:ColocatedEval.complete",),
        (
            (f"{VLLM_GENERATION}._init_vllm", "self._llm_weights_sleeping = self.enable_sleep_mode"),
            (f"{VLLM_GENERATION}.generate", "self._llm_weights_sleeping"),
        ),
    ),
    # ------------------------------------------------------------------ runtime patches
    TRLContact(
        PATCH,
        "trl.generation.vllm_generation",
        "LLM",
        None,
        "module global replaced while TRL builds the colocated engine on CPU: adds dtype and eager/no-chunking",
        ("klear.generation.vllm:colocated_engine",),
        ((f"{VLLM_GENERATION}._init_vllm", "self.llm = LLM("), (f"{VLLM_GENERATION}._init_vllm", "max_model_len=")),
    ),
    TRLContact(
        PATCH,
        VLLM_GENERATION,
        "sync_weights",
        (),
        "instance attribute replaced on vLLM's CPU backend: weights go through klear's load_weights",
        ("klear.generation.vllm:install_weight_sync",),
        ((f"{GRPO}._generate", "self.vllm_generation.sync_weights()"),),
    ),
    TRLContact(
        PATCH,
        "transformers.GenerationMixin",
        "generate",
        None,
        "instance attribute of the policy during TRL's transformers generation: the grouped prefill",
        (f"{_RL}._generate_single_turn",),
        (
            (f"{GRPO}._generate_single_turn", "unwrapped_model.generate("),
            (f"{GRPO}._generate_single_turn", "**generate_inputs, generation_config=self.generation_config"),
        ),
    ),
)
