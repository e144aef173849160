#!/usr/bin/env bash
# Start a rollout worker pool on this node. Settings from environment variables:
#   ROLLOUT_CONFIG       pipeline YAML (required on a cluster; embedded defaults otherwise)
#   ROLLOUT_PROCESSES    worker processes (default: number of CPUs / 2, at least 1)
#   ROLLOUT_CONCURRENCY  groups per process (default: workers.concurrency from the config)
#   ROLLOUT_REDIS_URL    Redis URL (read by the pipeline itself; never put passwords in flags)
#   ROLLOUT_NAMESPACE    overrides redis.namespace
#   ROLLOUT_ENGINE_URL   overrides engine.url ("auto" follows {ns}:engine)
#   ROLLOUT_TOKENIZER    overrides engine.tokenizer
# SIGTERM drains: running groups finish (or are handed back) within workers.drain_grace_s.
set -euo pipefail

cpus=$(getconf _NPROCESSORS_ONLN 2>/dev/null || echo 2)
args=(workers --processes "${ROLLOUT_PROCESSES:-$(( cpus / 2 > 0 ? cpus / 2 : 1 ))}")
[[ -n "${ROLLOUT_CONFIG:-}" ]] && args+=(--config "$ROLLOUT_CONFIG")
[[ -n "${ROLLOUT_CONCURRENCY:-}" ]] && args+=(--concurrency "$ROLLOUT_CONCURRENCY")
[[ -n "${ROLLOUT_NAMESPACE:-}" ]] && args+=(--namespace "$ROLLOUT_NAMESPACE")
[[ -n "${ROLLOUT_ENGINE_URL:-}" ]] && args+=(--engine-url "$ROLLOUT_ENGINE_URL")
[[ -n "${ROLLOUT_TOKENIZER:-}" ]] && args+=(--tokenizer "$ROLLOUT_TOKENIZER")

# exec: the pool gets the signals of whoever supervises this script.
exec python -m scripts.cli "${args[@]}" "$@"
