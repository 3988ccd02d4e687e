#!/usr/bin/env bash
# The paper's RL stages (Sec. 4.1 and the authors' scripts) on unmodified verl 0.9 with klear's plugin:
# GPPO (Eq. 11, 12), the SFT term on correct rollouts with alpha = 0.1 (Eq. 13, 14), klear's rewards.
#   STAGE=math MODEL=/path/to/sft-model TRAIN=math_train.parquet VAL=math_val.parquet bash configs/verl/klear_rl.sh
#   STAGE=code MODEL=/path/to/math-rl-model TRAIN=code_train.parquet VAL=code_val.parquet bash configs/verl/klear_rl.sh
# NODES / GPUS_PER_NODE size the cluster (the authors used 32 nodes x 8 GPUs); extra arguments are passed
# to verl as further Hydra overrides.  Parquet rows use verl's RL layout (prompt, data_source, reward_model).
set -euo pipefail
STAGE=${STAGE:?set STAGE=math or STAGE=code}
: "${MODEL:?set MODEL}" "${TRAIN:?set TRAIN}" "${VAL:?set VAL}"
case "$STAGE" in
    math) LR=1e-6; MINI_BATCH=16 ;;   # 128 / 16 = 8 optimizer steps per rollout batch
    code) LR=5e-7; MINI_BATCH=32 ;;
    *) echo "STAGE must be math or code, got '$STAGE'" >&2; exit 2 ;;
esac
python -m klear.integrations.verl  # fails loudly if verl did not load the plugin
exec python -m verl.trainer.main_ppo \
    algorithm.adv_estimator=grpo \
    algorithm.norm_adv_by_std_in_grpo=true \
    algorithm.use_kl_in_reward=false \
    data.train_files="$TRAIN" data.val_files="$VAL" \
    data.train_batch_size=128 \
    data.max_prompt_length=4096 data.max_response_length=32768 \
    actor_rollout_ref.model.path="$MODEL" \
    actor_rollout_ref.rollout.n=8 \
    actor_rollout_ref.rollout.temperature=1.0 actor_rollout_ref.rollout.top_p=1.0 \
    actor_rollout_ref.actor.ppo_mini_batch_size=$MINI_BATCH \
    actor_rollout_ref.actor.ppo_epochs=1 \
    actor_rollout_ref.actor.use_dynamic_bsz=true actor_rollout_ref.actor.ppo_max_token_len_per_gpu=36864 \
    actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=true \
    actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=36864 \
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
    "$@"
