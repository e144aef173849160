#!/usr/bin/env bash
# Off-policy GRPO with slime (Megatron backend) trained on groups from this pipeline.
#
# slime's train_async.py keeps its own SGLang engines (weights are pushed to them after every
# step) but does not generate: our worker pools call those engines through slime's router and
# push scored groups to Redis; slime pulls whole groups through
#     --data-source-path pipeline.slime.data_source.RedisDataSource
#     --rollout-function-path pipeline.slime.data_source.generate_rollout
# normalises rewards per group without the failed episodes
#     --custom-reward-post-process-path pipeline.slime.data_source.post_process_rewards
# and corrects the remaining off-policy gap with truncated importance sampling (--use-tis)
# on the log-probs the engines returned with every token.
#
# Usage:
#   scripts/run_slime_grpo.sh --check            # check prerequisites, write the config, print the command
#   scripts/run_slime_grpo.sh [extra slime flags] # launch (extra flags are appended, so they win)
#
# Then, on every rollout node:  scripts/start_workers.sh   (engine "auto" follows slime's router)
# and one producer:             rollout enqueue --config <pipeline.yaml> --tasks <tasks.jsonl>
#
# (slime in-process mode, with no Redis and no worker pool, is another launch: slime's own
# rollout with --custom-generate-function-path workers.inslime.generate and --custom-rm-path
# workers.inslime.reward; every slime path of both modes: docs/architecture.md, "slime's dotted paths".)
#
# Settings (environment variables; defaults in brackets):
#   SLIME_DIR            slime checkout holding train_async.py            [/root/slime]
#   MEGATRON_DIR         Megatron-LM checkout                             [/root/Megatron-LM]
#   MODEL_ARGS_SCRIPT    slime's model shape file, defines MODEL_ARGS     [$SLIME_DIR/scripts/models/qwen2.5-0.5B.sh]
#   HF_CHECKPOINT        HF checkpoint (tokenizer + SGLang weights)       [/root/models/Qwen2.5-0.5B-Instruct]
#   REF_LOAD             Megatron torch_dist checkpoint (initial actor)   [${HF_CHECKPOINT}_torch_dist]
#   SAVE_DIR             checkpoints; the pipeline YAML is written here   [/root/ckpt/rollout-grpo]
#   SAVE_INTERVAL        steps between checkpoints; also when consumed groups are acked in Redis [20]
#   NUM_ROLLOUT          training steps (slime requires it here)          [1000]
#   ROLLOUT_BATCH_SIZE   groups per step (B)                              [32]
#   N_SAMPLES            samples per group (n); must match the workers    [8]
#   MAX_RESPONSE_LEN     response token budget; match rollout.max_response_tokens [4096]
#   ACTOR_GPUS           training GPUs per node                           [4]
#   ACTOR_NODES          training nodes                                   [1]
#   ROLLOUT_GPUS         GPUs for slime's SGLang engines                  [4]
#   GPUS_PER_ENGINE      tensor parallel size of one engine               [1]
#   ROLLOUT_REDIS_URL    the pipeline's Redis                             [redis://127.0.0.1:6379/0]
#   ROLLOUT_NAMESPACE    the pipeline's key prefix                        [rollout]
#   ROLLOUT_ETA          staleness bound eta (steps); producers admit under the same bound [2]
#   ROLLOUT_STALE_POLICY requeue | drop | keep: what to do with a group staler than eta [requeue]
#   ROLLOUT_FILTER_ZERO_VARIANCE  drop groups whose rewards are all equal (no GRPO signal) [false]
#   ROLLOUT_PUSH_MODE    what a weight push does to running requests, SGLang's pause mode [in_place]:
#                        in_place (they keep their KV and go on; the cheapest), retract (they wait in
#                        the engine and re-prefill on the new weights; use it with slime's disk
#                        updater), abort (slime's own default: answered, the workers resend them).
#                        Installed in slime's SGLangEngine by Ray's worker_process_setup_hook
#                        (pipeline/slime/weight_push.py; docs/architecture.md "Off-policy control")
#   ROLLOUT_SIZING_ADVICE  `rollout plan --save FILE` output: said here once when ROLLOUT_BATCH_SIZE is
#                        below the B that keeps the engines full at ROLLOUT_ETA (pipeline/sizing.py) [unset]
#   RAY_ADDRESS          a running Ray cluster's dashboard; unset = start a local head [unset]
#   USE_WANDB=1          log to wandb (slime's own run; pipeline metrics land in it too)
set -euo pipefail

REPO_DIR="$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")/.." &>/dev/null && pwd)"
SLIME_DIR=${SLIME_DIR:-/root/slime}
MEGATRON_DIR=${MEGATRON_DIR:-/root/Megatron-LM}
MODEL_ARGS_SCRIPT=${MODEL_ARGS_SCRIPT:-${SLIME_DIR}/scripts/models/qwen2.5-0.5B.sh}
HF_CHECKPOINT=${HF_CHECKPOINT:-/root/models/Qwen2.5-0.5B-Instruct}
REF_LOAD=${REF_LOAD:-${HF_CHECKPOINT}_torch_dist}
SAVE_DIR=${SAVE_DIR:-/root/ckpt/rollout-grpo}
SAVE_INTERVAL=${SAVE_INTERVAL:-20}
NUM_ROLLOUT=${NUM_ROLLOUT:-1000}
ROLLOUT_BATCH_SIZE=${ROLLOUT_BATCH_SIZE:-32}
N_SAMPLES=${N_SAMPLES:-8}
MAX_RESPONSE_LEN=${MAX_RESPONSE_LEN:-4096}
ACTOR_GPUS=${ACTOR_GPUS:-4}
ACTOR_NODES=${ACTOR_NODES:-1}
ROLLOUT_GPUS=${ROLLOUT_GPUS:-4}
GPUS_PER_ENGINE=${GPUS_PER_ENGINE:-1}
export ROLLOUT_REDIS_URL=${ROLLOUT_REDIS_URL:-redis://127.0.0.1:6379/0}
ROLLOUT_NAMESPACE=${ROLLOUT_NAMESPACE:-rollout}
ROLLOUT_ETA=${ROLLOUT_ETA:-2}
ROLLOUT_STALE_POLICY=${ROLLOUT_STALE_POLICY:-requeue}
ROLLOUT_FILTER_ZERO_VARIANCE=${ROLLOUT_FILTER_ZERO_VARIANCE:-false}
export ROLLOUT_PUSH_MODE=${ROLLOUT_PUSH_MODE:-in_place}
PYTHON=${PYTHON:-python3}

CHECK_ONLY=0
if [[ "${1:-}" == "--check" ]]; then CHECK_ONLY=1; shift; fi

missing=()
need() { missing+=("$1"); }

check_prerequisites() {
  if ! command -v "${PYTHON}" >/dev/null 2>&1; then
    need "python: '${PYTHON}' is not on PATH (set PYTHON=...)"
    return
  fi
  "${PYTHON}" -c "import pipeline.slime.data_source" 2>/dev/null \
    || need "this pipeline: 'import pipeline.slime.data_source' fails; run: pip install -e ${REPO_DIR}"
  case "${ROLLOUT_PUSH_MODE}" in  # pipeline.slime.weight_push.PushMode
    abort|retract|in_place) ;;
    *) need "ROLLOUT_PUSH_MODE: unknown weight-push mode '${ROLLOUT_PUSH_MODE}'; one of abort, retract, in_place" ;;
  esac
  [[ -f "${SLIME_DIR}/train_async.py" ]] \
    || need "slime: ${SLIME_DIR}/train_async.py not found (git clone https://github.com/THUDM/slime; set SLIME_DIR)"
  PYTHONPATH="${SLIME_DIR}:${MEGATRON_DIR}:${PYTHONPATH:-}" "${PYTHON}" -c "import slime.utils.arguments" 2>/dev/null \
    || need "slime: 'import slime.utils.arguments' fails with SLIME_DIR=${SLIME_DIR} (install slime's requirements)"
  PYTHONPATH="${MEGATRON_DIR}:${PYTHONPATH:-}" "${PYTHON}" -c "import megatron.core" 2>/dev/null \
    || need "Megatron: 'import megatron.core' fails with MEGATRON_DIR=${MEGATRON_DIR}"
  command -v ray >/dev/null 2>&1 || need "ray: the 'ray' command is missing (pip install 'ray[default]')"
  [[ -f "${MODEL_ARGS_SCRIPT}" ]] || need "model args: MODEL_ARGS_SCRIPT=${MODEL_ARGS_SCRIPT} not found"
  [[ -f "${HF_CHECKPOINT}/config.json" ]] || need "model: HF_CHECKPOINT=${HF_CHECKPOINT} has no config.json"
  [[ -d "${REF_LOAD}" ]] \
    || need "model: REF_LOAD=${REF_LOAD} missing (convert with slime's tools/convert_hf_to_torch_dist.py)"
  local redis_problem
  if ! redis_problem=$("${PYTHON}" - <<'EOF' 2>&1
import os, sys
try:
    import redis
    from pipeline.store.redis_conn import redact
except ImportError as exc:
    sys.exit(f"cannot import {exc.name}")
url = os.environ["ROLLOUT_REDIS_URL"]
try:
    redis.Redis.from_url(url, socket_connect_timeout=3).ping()
except Exception as exc:
    sys.exit(f"{redact(url)}: {type(exc).__name__}: {exc}")
EOF
  ); then
    need "redis: not reachable: ${redis_problem}"
  fi
  if command -v nvidia-smi >/dev/null 2>&1; then
    local gpus
    gpus=$(nvidia-smi -L | wc -l)
    (( gpus >= ACTOR_GPUS + ROLLOUT_GPUS )) || [[ -n "${RAY_ADDRESS:-}" ]] \
      || need "GPUs: this node has ${gpus}, ACTOR_GPUS + ROLLOUT_GPUS = $((ACTOR_GPUS + ROLLOUT_GPUS)) (or join a Ray cluster: RAY_ADDRESS)"
  else
    [[ -n "${RAY_ADDRESS:-}" ]] || need "GPUs: nvidia-smi not found on this node and no RAY_ADDRESS given"
  fi
}

# The planner's advice (issue 46: the groups per step that keep the engines full), printed when B
# is below it; an unreadable file is a missing prerequisite.
check_sizing() {
  [[ -n "${ROLLOUT_SIZING_ADVICE:-}" ]] || return 0
  "${PYTHON}" -m pipeline.sizing "${ROLLOUT_SIZING_ADVICE}" --batch "${ROLLOUT_BATCH_SIZE}" --eta "${ROLLOUT_ETA}" \
    --n "${N_SAMPLES}" >&2 \
    || need "sizing advice: ROLLOUT_SIZING_ADVICE=${ROLLOUT_SIZING_ADVICE} is not readable \`rollout plan --save\` output"
}

# Our settings reach pipeline.slime.data_source through slime's --custom-config-path: slime sets every key
# of this YAML as an attribute of `args` (pipeline/config.py TrainerSettings reads pipeline_*).
# rollout_batch_size / n_samples_per_prompt are slime's own flags below, not repeated here.
write_pipeline_config() {
  mkdir -p "${SAVE_DIR}"
  PIPELINE_YAML="${SAVE_DIR}/pipeline_slime.yaml"
  {
    echo "# written by scripts/run_slime_grpo.sh; read by pipeline.slime.data_source (TrainerSettings)"
    # A URL with a password stays out of files: Ray actors read ROLLOUT_REDIS_URL from the env.
    if [[ "${ROLLOUT_REDIS_URL}" != *@* ]]; then echo "pipeline_redis_url: ${ROLLOUT_REDIS_URL}"; fi
    echo "pipeline_namespace: ${ROLLOUT_NAMESPACE}"
    echo "pipeline_consumer: trainer      # stable: a restarted trainer finds its pending groups"
    echo "pipeline_eta: ${ROLLOUT_ETA}"
    echo "pipeline_stale_policy: ${ROLLOUT_STALE_POLICY}"
    echo "pipeline_filter_zero_variance: ${ROLLOUT_FILTER_ZERO_VARIANCE}"
    echo "pipeline_wait_log_s: 30.0"
    echo "pipeline_wait_timeout_s: 0.0   # 0 = wait for workers forever"
    echo "pipeline_publish_engine: true  # workers with engine 'auto' follow slime's router"
    echo "pipeline_trainer_loop: async   # train_async.py: engines hold step r-1's weights while r is generated"
  } >"${PIPELINE_YAML}"
}

build_command() {
  MODEL_ARGS=()
  if [[ -f "${MODEL_ARGS_SCRIPT}" ]]; then
    set +u  # slime's model files are not written for `set -u`
    # shellcheck disable=SC1090
    source "${MODEL_ARGS_SCRIPT}"  # defines MODEL_ARGS (layers, hidden size, rotary base, ...)
    set -u
  fi
  CMD=(
    "${PYTHON}" "${SLIME_DIR}/train_async.py"
    --train-backend megatron
    --actor-num-nodes "${ACTOR_NODES}" --actor-num-gpus-per-node "${ACTOR_GPUS}"
    --rollout-num-gpus "${ROLLOUT_GPUS}" --rollout-num-gpus-per-engine "${GPUS_PER_ENGINE}"
    "${MODEL_ARGS[@]}"
    # checkpoints: data_source.save(rid) runs with each checkpoint (rollout_global_dataset stays on,
    # the default) and is when Redis drops the groups trained up to rid.
    --hf-checkpoint "${HF_CHECKPOINT}" --ref-load "${REF_LOAD}" --load "${SAVE_DIR}"
    --save "${SAVE_DIR}" --save-interval "${SAVE_INTERVAL}"
    # the pipeline: whole groups from Redis, no generation inside slime
    --data-source-path pipeline.slime.data_source.RedisDataSource
    --rollout-function-path pipeline.slime.data_source.generate_rollout
    --custom-config-path "${PIPELINE_YAML}"
    --num-rollout "${NUM_ROLLOUT}"                    # required: our source has no epoch length
    --rollout-batch-size "${ROLLOUT_BATCH_SIZE}"      # groups per step = producers' B
    --n-samples-per-prompt "${N_SAMPLES}"             # = rollout.n_samples_per_prompt of the workers
    --global-batch-size "$((ROLLOUT_BATCH_SIZE * N_SAMPLES))"  # one optimizer step per rollout
    --rollout-max-response-len "${MAX_RESPONSE_LEN}"
    --update-weights-interval 1                       # push weights every step (eta must be >= the interval)
    --rollout-top-p 1.0                               # slime asserts top-p replay ids below 1.0; workers sample
    # GRPO with off-policy correction from the engines' per-token log-probs
    --advantage-estimator grpo
    # group mean/std over the kept samples: a failed episode (remove_sample) shifts no baseline
    --custom-reward-post-process-path pipeline.slime.data_source.post_process_rewards
    --use-tis --tis-clip 2.0
    --use-kl-loss --kl-loss-coef 0.0 --kl-loss-type low_var_kl
    --entropy-coef 0.0 --eps-clip 0.2 --eps-clip-high 0.28
    # optimizer (Megatron flags)
    --optimizer adam --lr 1e-6 --lr-decay-style constant --weight-decay 0.1
    --adam-beta1 0.9 --adam-beta2 0.98
    # parallelism and memory (Megatron flags)
    --tensor-model-parallel-size 1 --sequence-parallel --pipeline-model-parallel-size 1
    --context-parallel-size 1 --use-dynamic-batch-size --max-tokens-per-gpu 8192
    --attention-dropout 0.0 --hidden-dropout 0.0 --accumulate-allreduce-grads-in-fp32
    --attention-softmax-in-fp32 --attention-backend flash
    # slime's SGLang engines (our workers call them through slime's router)
    --sglang-mem-fraction-static 0.7
  )
  if [[ "${USE_WANDB:-0}" == "1" ]]; then
    CMD+=(--use-wandb --wandb-project "${WANDB_PROJECT:-rollout-grpo}" --wandb-group "${ROLLOUT_NAMESPACE}")
  fi
  CMD+=("$@")
}

check_prerequisites
check_sizing
write_pipeline_config
build_command "$@"

if (( ${#missing[@]} )); then
  echo "run_slime_grpo.sh: missing prerequisites:" >&2
  printf '  - %s\n' "${missing[@]}" >&2
  (( CHECK_ONLY )) && echo "pipeline settings written to ${PIPELINE_YAML}" >&2
  exit 2
fi
echo "prerequisites ok; pipeline settings in ${PIPELINE_YAML}"
if (( CHECK_ONLY )); then
  printf '%q ' "${CMD[@]}"; echo
  exit 0
fi

export PYTHONUNBUFFERED=1 CUDA_DEVICE_MAX_CONNECTIONS=1 ROLLOUT_NAMESPACE
export PYTHONPATH="${REPO_DIR}:${SLIME_DIR}:${MEGATRON_DIR}:${PYTHONPATH:-}"
if [[ -z "${RAY_ADDRESS:-}" ]]; then
  # Actors inherit this environment (ROLLOUT_REDIS_URL included) from the local head.
  ray start --head --node-ip-address "${MASTER_ADDR:-127.0.0.1}" --num-gpus "$((ACTOR_GPUS + ROLLOUT_GPUS))" \
    --disable-usage-stats
  RAY_ADDRESS="http://127.0.0.1:8265"
fi
# The job's actors on an existing cluster do not inherit this shell: ROLLOUT_REDIS_URL (and the
# namespace) travel in the job's runtime env, never in the YAML above (a password stays out of
# files). Ray keeps a job's runtime env in its job record: use a Redis user with only the rights
# the pipeline needs. JSON built by Python, so no character of the URL breaks the quoting.
# ROLLOUT_PUSH_MODE reaches slime's SGLangEngine actors through Ray's worker_process_setup_hook, which
# every worker process of the job runs before its actor (pipeline.slime.weight_push.ray_worker_setup).
RUNTIME_ENV=$("${PYTHON}" -c 'import json, os
keys = ("PYTHONPATH", "CUDA_DEVICE_MAX_CONNECTIONS", "ROLLOUT_REDIS_URL", "ROLLOUT_NAMESPACE", "ROLLOUT_PUSH_MODE")
print(json.dumps({"env_vars": {k: os.environ[k] for k in keys if k in os.environ},
                  "worker_process_setup_hook": "pipeline.slime.weight_push.ray_worker_setup"}))')
exec ray job submit --address="${RAY_ADDRESS}" --runtime-env-json="${RUNTIME_ENV}" -- "${CMD[@]}"
