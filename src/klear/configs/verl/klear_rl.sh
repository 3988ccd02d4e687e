#!/usr/bin/env bash
# The paper's RL stages (Sec. 4.1 and the authors' scripts) on unmodified verl 0.9 with klear's plugin:
# GPPO (Eq. 11, 12), the SFT term on correct rollouts with alpha = 0.1 (Eq. 13, 14), klear's rewards.
#   STAGE=math MODEL=/path/to/sft-model TRAIN=math_train.parquet VAL=math_val.parquet bash configs/verl/klear_rl.sh
#   STAGE=code MODEL=/path/to/math-rl-model TRAIN=code_train.parquet VAL=code_val.parquet bash configs/verl/klear_rl.sh
# NODES / GPUS_PER_NODE size the cluster (the authors used 32 nodes x 8 GPUs); extra arguments are passed
# to verl as further Hydra overrides.  Parquet rows use verl's RL layout (prompt, data_source, reward_model).
#
# Context: 4K prompts + 32K responses (the authors' scripts) need 36864 positions. verl sizes vLLM's
# max_model_len from the checkpoint's max_position_embeddings and caps every response at max_model_len - prompt,
# so on a 32K-context checkpoint (Qwen3-8B-Base) responses would silently stop at 28672 tokens. This script
# therefore raises the context to CONTEXT_LENGTH (default prompt + response = 36864) when the checkpoint has
# fewer positions (model.override_config and vLLM's hf_overrides: max_position_embeddings, as the klear recipes'
# context_length), and refuses a CONTEXT_LENGTH below prompt + response. RESPONSE_LENGTH (default 32768) sets
# the response budget, e.g. RESPONSE_LENGTH=28672 CONTEXT_LENGTH=32768 keeps a 32K checkpoint's positions.
set -euo pipefail
STAGE=${STAGE:?set STAGE=math or STAGE=code}
: "${MODEL:?set MODEL}" "${TRAIN:?set TRAIN}" "${VAL:?set VAL}"
case "$STAGE" in
    math) LR=1e-6; MINI_BATCH=16 ;;   # 128 / 16 = 8 optimizer steps per rollout batch
    code) LR=5e-7; MINI_BATCH=32 ;;
    *) echo "STAGE must be math or code, got '$STAGE'" >&2; exit 2 ;;
esac
PROMPT_LENGTH=4096
RESPONSE_LENGTH=${RESPONSE_LENGTH:-32768}
NEED=$((PROMPT_LENGTH + RESPONSE_LENGTH))
CONTEXT_LENGTH=${CONTEXT_LENGTH:-$NEED}
if ((CONTEXT_LENGTH < NEED)); then
    echo "klear_rl.sh: CONTEXT_LENGTH=$CONTEXT_LENGTH < $PROMPT_LENGTH prompt + $RESPONSE_LENGTH response tokens" \
        "= $NEED: verl would cap responses at $((CONTEXT_LENGTH - PROMPT_LENGTH)); raise CONTEXT_LENGTH to $NEED" \
        "or lower RESPONSE_LENGTH to $((CONTEXT_LENGTH - PROMPT_LENGTH))" >&2
    exit 2
fi
# the checkpoint's positions, read as verl reads them (max_position_embeddings, else text_config's)
POSITIONS=$(python - "$MODEL" <<'PY'
import json
import sys
from pathlib import Path

model = sys.argv[1]
path = Path(model) / "config.json"
try:
    config = json.loads(path.read_text()) if path.is_file() else None
    if config is None:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(model).to_dict()
except Exception as e:  # one line, not a traceback
    sys.exit(f"klear_rl.sh: MODEL={model}: cannot read its config ({type(e).__name__}: {e})")
n = config.get("max_position_embeddings") or (config.get("text_config") or {}).get("max_position_embeddings")
if not isinstance(n, int) or n < 1:
    sys.exit(f"klear_rl.sh: MODEL={model}: its config has no max_position_embeddings (expected a positive integer)")
print(n)
PY
)
CONTEXT_OVERRIDES=()
if ((POSITIONS < CONTEXT_LENGTH)); then
    echo "klear_rl.sh: $MODEL has max_position_embeddings=$POSITIONS < $CONTEXT_LENGTH ($PROMPT_LENGTH prompt +" \
        "$RESPONSE_LENGTH response tokens): raising it to $CONTEXT_LENGTH for training and vLLM" >&2
    CONTEXT_OVERRIDES=(
        +actor_rollout_ref.model.override_config.max_position_embeddings="$CONTEXT_LENGTH"
        +actor_rollout_ref.rollout.engine_kwargs.vllm.hf_overrides.max_position_embeddings="$CONTEXT_LENGTH"
    )
fi
python -m klear.integrations.verl  # fails loudly if verl did not load the plugin
exec python -m verl.trainer.main_ppo \
    algorithm.adv_estimator=grpo \
    algorithm.norm_adv_by_std_in_grpo=true \
    algorithm.use_kl_in_reward=false \
    data.train_files="$TRAIN" data.val_files="$VAL" \
    data.train_batch_size=128 \
    data.max_prompt_length=$PROMPT_LENGTH data.max_response_length=$RESPONSE_LENGTH \
    actor_rollout_ref.model.path="$MODEL" \
    actor_rollout_ref.rollout.max_model_len=$CONTEXT_LENGTH \
    actor_rollout_ref.rollout.n=8 \
    actor_rollout_ref.rollout.temperature=1.0 actor_rollout_ref.rollout.top_p=1.0 \
    actor_rollout_ref.actor.ppo_mini_batch_size=$MINI_BATCH \
    actor_rollout_ref.actor.ppo_epochs=1 \
    actor_rollout_ref.actor.use_dynamic_bsz=true actor_rollout_ref.actor.ppo_max_token_len_per_gpu=$NEED \
    actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=true \
    actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=$NEED \
    actor_rollout_ref.actor.optim.lr=$LR \
    actor_rollout_ref.actor.optim.lr_warmup_steps=10 \
    actor_rollout_ref.actor.optim.weight_decay=0.1 \
    actor_rollout_ref.actor.grad_clip=1.0 \
    actor_rollout_ref.actor.clip_ratio_low=0.2 actor_rollout_ref.actor.clip_ratio_high=0.28 \
    actor_rollout_ref.actor.clip_ratio_c=10.0 \
    actor_rollout_ref.actor.loss_agg_mode=token-mean \
    actor_rollout_ref.actor.use_kl_loss=false actor_rollout_ref.actor.entropy_coeff=0 \
    actor_rollout_ref.actor.policy_loss._target_=klear.integrations.verl.GPPOLossConfig \
    actor_rollout_ref.actor.policy_loss.loss_mode=gppo \
    +actor_rollout_ref.actor.policy_loss.beta1=1.0 +actor_rollout_ref.actor.policy_loss.beta2=1.0 \
    +actor_rollout_ref.actor.policy_loss.sft_alpha=0.1 \
    +actor_rollout_ref.actor.policy_loss.sft_norm=mini_batch \
    trainer.v1.trainer_mode=klear_sync \
    reward.custom_reward_function.path=pkg://klear.integrations.verl.rewards \
    reward.custom_reward_function.name=compute_score \
    trainer.nnodes="${NODES:-1}" trainer.n_gpus_per_node="${GPUS_PER_NODE:-8}" \
    trainer.project_name=klear trainer.experiment_name="klear_${STAGE}_gppo" \
    "${CONTEXT_OVERRIDES[@]}" \
    "$@"
