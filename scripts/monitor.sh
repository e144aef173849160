#!/usr/bin/env bash
# Watch a pipeline: live terminal view, or a Prometheus endpoint when PROMETHEUS_PORT is set.
#
#   ROLLOUT_REDIS_URL=redis://redis-host:6379/0 ROLLOUT_NAMESPACE=exp1 scripts/monitor.sh
#   PROMETHEUS_PORT=9400 scripts/monitor.sh           # scrape http://<host>:9400/metrics
#   scripts/monitor.sh --json | jq .buffer_ready       # extra arguments go to `rollout monitor`
#
# Environment (all optional):
#   ROLLOUT_REDIS_URL   Redis of the pipeline (default redis://127.0.0.1:6379/0); a password in it is never printed
#   ROLLOUT_NAMESPACE   key prefix of the pipeline (default rollout)
#   ROLLOUT_CONFIG      pipeline YAML; its redis url, namespace and workers.dead_after_s are used
#   PROMETHEUS_PORT     serve Prometheus text instead of the terminal view
#   MONITOR_WANDB=1     also log every refresh to wandb (pip install 'rollout-pipeline[wandb]'; WANDB_MODE=offline works)
set -euo pipefail

if ! command -v rollout >/dev/null 2>&1; then
  echo "monitor.sh: the 'rollout' command is missing: pip install -e <repo> first" >&2
  exit 2
fi

args=()
[[ -n "${ROLLOUT_CONFIG:-}" ]] && args+=(--config "${ROLLOUT_CONFIG}")
[[ -n "${PROMETHEUS_PORT:-}" ]] && args+=(--serve "${PROMETHEUS_PORT}")
[[ "${MONITOR_WANDB:-0}" == "1" ]] && args+=(--wandb)

exec rollout monitor "${args[@]}" "$@"
