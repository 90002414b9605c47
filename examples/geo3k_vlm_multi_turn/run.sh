#!/usr/bin/env bash
# slime's geo3k multi-turn VLM run (examples/geo3k_vlm_multi_turn in THUDM/slime) with Turnstile as
# the rollout: the same model, data, env and training flags; the rollout is Turnstile's
# (turn-level scheduling, partial rollout with live envs, retries, Prometheus metrics).
#
# Run from a slime checkout (its train.py, scripts/models/ and examples/geo3k_vlm_multi_turn/env_geo3k.py),
# with Turnstile installed beside slime's torch and transformers (`pip install /path/to/turnstile`: it
# replaces none of the image's packages; the README's "Under slime"):
#   TURNSTILE_DIR=/path/to/turnstile bash $TURNSTILE_DIR/examples/geo3k_vlm_multi_turn/run.sh
set -euo pipefail

TURNSTILE_DIR=${TURNSTILE_DIR:?set TURNSTILE_DIR to the Turnstile checkout}
NUM_GPUS=${NUM_GPUS:-8}
MODEL=${MODEL:-/root/models/Qwen3.5-35B-A3B}
DATA=${DATA:-/root/datasets/geo3k_imgurl_processed/train.parquet}

source scripts/models/qwen3.5-35B-A3B-vl.sh   # MODEL_ARGS for Megatron

CKPT_ARGS=(--hf-checkpoint "$MODEL" --load "$MODEL")

ROLLOUT_ARGS=(
  --prompt-data "$DATA" --input-key problem --label-key answer
  --multimodal-keys '{"image": "images"}' --apply-chat-template --rm-type math
  --rollout-shuffle --num-rollout 3000
  --rollout-batch-size 64 --n-samples-per-prompt 8
  --rollout-max-response-len 4096 --rollout-temperature 1
  --global-batch-size 512

  # Turnstile replaces slime's rollout function; the eval path defaults to the same function.
  --rollout-function-path bridge.slime.generate_rollout
  --custom-config-path "$TURNSTILE_DIR/examples/geo3k_vlm_multi_turn/turnstile.yaml"

  # Partial rollout: a step ends when 64 groups are done; 96 are kept in flight (turnstile.yaml's
  # over_sampling wins over this ratio when both are set), the rest wait paused, envs alive.
  --partial-rollout --over-sampling-batch-size 96
  --mask-offpolicy-in-partial-rollout
)

GRPO_ARGS=(
  --advantage-estimator grpo --kl-loss-coef 0.00 --kl-loss-type low_var_kl --kl-coef 0.00
  --entropy-coef 0.00 --eps-clip 0.2 --eps-clip-high 0.28
)

OPTIMIZER_ARGS=(
  --optimizer adam --lr 1e-6 --lr-decay-style constant --weight-decay 0.1
  --adam-beta1 0.9 --adam-beta2 0.98
)

SGLANG_ARGS=(
  --rollout-num-gpus-per-engine "$NUM_GPUS" --sglang-ep-size "$NUM_GPUS"
  --sglang-mem-fraction-static 0.6
)

BACKEND_ARGS=(
  --train-backend megatron --tensor-model-parallel-size 2 --sequence-parallel
  --pipeline-model-parallel-size 1 --context-parallel-size 1
  --expert-model-parallel-size "$NUM_GPUS" --expert-tensor-parallel-size 1
  --recompute-granularity full --recompute-method uniform --recompute-num-layers 1
  --micro-batch-size 1 --attention-dropout 0.0 --hidden-dropout 0.0
  --accumulate-allreduce-grads-in-fp32 --attention-softmax-in-fp32 --attention-backend flash
)

export MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
ray start --head --node-ip-address "$MASTER_ADDR" --num-gpus "$NUM_GPUS" --disable-usage-stats \
  --dashboard-host=0.0.0.0 --dashboard-port=8265

# Optional: start the rollout service ahead of training (it is created on first use otherwise).
# turnstile serve --config "$TURNSTILE_DIR/examples/geo3k_vlm_multi_turn/turnstile.yaml" --detach

RUNTIME_ENV_JSON="{\"env_vars\": {\"PYTHONPATH\": \"/root/Megatron-LM/:$PWD:$TURNSTILE_DIR\", \"CUDA_DEVICE_MAX_CONNECTIONS\": \"1\"}}"

ray job submit --address="http://127.0.0.1:8265" --runtime-env-json="$RUNTIME_ENV_JSON" \
  -- python3 train.py \
  --actor-num-nodes 1 --actor-num-gpus-per-node "$NUM_GPUS" --rollout-num-gpus "$NUM_GPUS" --colocate \
  "${MODEL_ARGS[@]}" "${CKPT_ARGS[@]}" "${ROLLOUT_ARGS[@]}" "${GRPO_ARGS[@]}" \
  "${OPTIMIZER_ARGS[@]}" "${SGLANG_ARGS[@]}" "${BACKEND_ARGS[@]}"
