#!/usr/bin/env bash
# The conformance tests (marker `conformance`): upstream slime, SGLang, NeMo-RL, NeMo-Skills and
# NeMo Gym code run against this pipeline's outputs, required (a missing part fails, never skips).
#
#   scripts/run_conformance.sh [pytest args]    set up, then run them
#   scripts/run_conformance.sh --setup-only     set up only (.ci/run does this, then runs them its way)
#
# Set-up, into the current Python ($PYTHON, default python3): CPU torch pinned first (an unpinned
# one pulls GBs of CUDA), SGLang without its GPU serving stack, the extras `test` and `conformance`;
# the pinned upstream snapshots that are missing (scripts/upstream.py: ../shared/third_party beside
# the checkout, or $ROLLOUT_THIRD_PARTY; `git fetch` from GitHub); NeMo Gym's resources servers in a
# venv of their own on Python 3.13 ($ROLLOUT_NEMO_GYM_VENV, cached).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

install_started=$(date +%s)
"$PY" -m pip install --quiet "torch==2.13.0"
# SGLang without its requirements (the GPU serving stack); the extra `conformance` lists what its
# request classes and slime's modules need to import.
"$PY" -m pip install --quiet --no-deps "sglang==0.5.23"
"$PY" -m pip install --quiet -e ".[test,conformance]"
echo "conformance: install took $(( $(date +%s) - install_started ))s"
"$PY" -c 'import torch, sys; v = torch.__version__; print("conformance: torch", v); sys.exit(0 if v.startswith("2.13.0") else "torch was replaced: " + v)'

"$PY" -m scripts.upstream where >/dev/null || "$PY" -m scripts.upstream fetch
"$PY" -m scripts.upstream where

# NeMo Gym (tests/conformance/test_conformance_nemo_gym.py) declares Python >= 3.13.14 and runs on an earlier
# 3.13 with --ignore-requires-python, in its own venv.
NG_VENV=${ROLLOUT_NEMO_GYM_VENV:-$HOME/.cache/rollout-conformance/nemo-gym-venv}
if [ ! -x "$NG_VENV/bin/gym" ]; then
  ng_started=$(date +%s)
  PY313=$(ls -d "$HOME"/.pyenv/versions/3.13*/bin/python3 2>/dev/null | sort -V | tail -1)
  PY313=${PY313:-$(command -v python3.13 || true)}
  [ -n "$PY313" ] || { echo "conformance: no Python 3.13 for NeMo Gym (pyenv install 3.13)" >&2; exit 1; }
  rm -rf "$NG_VENV" && "$PY313" -m venv "$NG_VENV"
  "$NG_VENV/bin/pip" install --quiet --ignore-requires-python nemo-gym==0.7.0 math-verify==0.8.0 numpy==2.2.6
  echo "conformance: NeMo Gym venv took $(( $(date +%s) - ng_started ))s"
fi
[ "${1:-}" = "--setup-only" ] && exit 0

ROLLOUT_NEMO_GYM_VENV="$NG_VENV" ROLLOUT_REQUIRE_CONFORMANCE=1 "$PY" -m pytest -q -n 2 --dist loadfile -m conformance "$@"
