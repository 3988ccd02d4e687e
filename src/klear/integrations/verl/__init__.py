"""klear on unmodified verl 0.9 (Ray + FSDP/Megatron + vLLM/SGLang): GPPO, the SFT term and klear's rewards.

Installed with ``pip install -e '.[verl]'`` in the klear checkout; verl imports this package on every Ray worker
through the ``verl.plugins`` entry point ``klear`` (at ``import verl``).  Importing it

* registers the policy losses ``gppo`` and ``gppo_only_high`` (:mod:`klear.integrations.verl.losses`,
  paper Eq. 11, 12, 17, 18) and the config class :class:`GPPOLossConfig` (``beta1``, ``beta2``, ``sft_alpha``,
  ``sft_norm``);
* registers the trainer ``klear_sync`` (:mod:`klear.integrations.verl.trainer`) that adds the SFT term on
  correct rollouts (Eq. 13, 14).

Rewards: ``reward.custom_reward_function.path=pkg://klear.integrations.verl.rewards`` with
``name=compute_score`` (:mod:`klear.integrations.verl.rewards`).

verl only logs a failed plugin import at DEBUG level; :func:`check_plugin` (run by the ``klear_sync`` trainer
and by ``python -m klear.integrations.verl``) turns that into an error naming the cause.
"""

from __future__ import annotations

from klear.integrations.verl import trainer as _trainer
from klear.integrations.verl.losses import KLEAR_VERL_LOSS_MODES, GPPOLossConfig

__all__ = ["GPPOLossConfig", "KLEAR_VERL_LOSS_MODES", "check_plugin"]


def check_plugin() -> None:
    """Fail loudly unless verl's registries hold klear's losses and trainer (the plugin loaded).

    Raises:
        RuntimeError: the ``verl.plugins`` entry point ``klear`` is not installed or is disabled by
            ``VERL_USE_EXTERNAL_PLUGINS`` (then Ray workers would not load it), or a loss of
            ``KLEAR_VERL_LOSS_MODES`` or the ``klear_sync`` trainer is missing from verl's registry, or is
            another package's function under the same name.
    """
    import os
    from importlib.metadata import entry_points

    from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY
    from verl.trainer.ppo.v1.trainer_base import TRAINER_REGISTRY

    from klear.integrations.verl import losses

    if not any(ep.name == "klear" and ep.value == __name__ for ep in entry_points(group="verl.plugins")):
        raise RuntimeError(
            f"no verl.plugins entry point 'klear = {__name__}': reinstall klear "
            "(pip install -e '.[verl]' in the klear checkout) in every Ray worker's environment"
        )
    policy = os.getenv("VERL_USE_EXTERNAL_PLUGINS", "auto").strip().lower()
    if policy == "none" or (policy != "auto" and "klear" not in {p.strip() for p in policy.split(",")}):
        raise RuntimeError(f"VERL_USE_EXTERNAL_PLUGINS={policy!r} keeps verl from loading the 'klear' plugin")
    expected = {"gppo": losses.compute_policy_loss_gppo, "gppo_only_high": losses.compute_policy_loss_gppo_only_high}
    for name, fn in expected.items():
        got = POLICY_LOSS_REGISTRY.get(name)
        if got is not fn:
            raise RuntimeError(
                f"verl policy loss {name!r} is {'missing' if got is None else got!r}, not klear's: "
                "the klear verl plugin did not load (is klear[verl] installed in every worker's "
                "environment, and VERL_USE_EXTERNAL_PLUGINS unset or 'auto'?)"
            )
    if TRAINER_REGISTRY.get("klear_sync") is not _trainer.KlearPPOTrainer:
        raise RuntimeError(
            "verl trainer 'klear_sync' is not klear's KlearPPOTrainer: the klear verl plugin did not load"
        )
