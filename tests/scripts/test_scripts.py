"""The launch scripts: prerequisite checks that say what is missing, the slime settings file
they write (read back the way slime's --custom-config-path applies it), and monitor.sh."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import yaml

from pipeline.config import TrainerSettings
from pipeline.staleness import StalePolicy
from pipeline.store.local_redis import free_port

REPO = Path(__file__).resolve().parents[2]


def _run(script: str, *argv: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "PYTHON": sys.executable, **env}
    full_env["PATH"] = f"{Path(sys.executable).parent}:{full_env['PATH']}"
    return subprocess.run(["bash", str(REPO / "scripts" / script), *argv], env=full_env, text=True,
                          capture_output=True, timeout=60)


def _slime_env(tmp_path: Path, redis_url: str, **extra: str) -> dict[str, str]:
    return {
        "SAVE_DIR": str(tmp_path / "ckpt"), "SLIME_DIR": str(tmp_path / "no-slime"),
        "MEGATRON_DIR": str(tmp_path / "no-megatron"), "HF_CHECKPOINT": str(tmp_path / "no-model"),
        "ROLLOUT_REDIS_URL": redis_url, "ROLLOUT_NAMESPACE": "exp7", "ROLLOUT_ETA": "3",
        "ROLLOUT_STALE_POLICY": "drop", "RAY_ADDRESS": "", **extra,
    }


def test_check_lists_every_missing_prerequisite(tmp_path, redis_url):
    result = _run("run_slime_grpo.sh", "--check", env=_slime_env(tmp_path, redis_url, ROLLOUT_PUSH_MODE="inplace"))
    assert result.returncode == 2
    err = result.stderr
    assert "missing prerequisites" in err
    assert f"{tmp_path}/no-slime/train_async.py not found" in err
    # the conformance extra installs megatron-core from PyPI: then Megatron is not missing
    assert ("import megatron.core" in err) == (importlib.util.find_spec("megatron") is None)
    assert f"HF_CHECKPOINT={tmp_path}/no-model has no config.json" in err
    assert f"REF_LOAD={tmp_path}/no-model_torch_dist missing" in err
    assert "redis" not in err.split("missing prerequisites")[1]  # the fixture's redis answers
    assert "import pipeline.slime.data_source" not in err  # this package is installed
    assert "ROLLOUT_PUSH_MODE: unknown weight-push mode 'inplace'; one of abort, retract, in_place" in err


def test_unreachable_redis_is_named_without_its_password(tmp_path):
    url = f"redis://:s3cret@127.0.0.1:{free_port()}/0"
    result = _run("run_slime_grpo.sh", "--check", env=_slime_env(tmp_path, url))
    assert result.returncode == 2
    assert "redis: not reachable: redis://:***@127.0.0.1" in result.stderr
    assert "s3cret" not in result.stderr + result.stdout
    assert "s3cret" not in (tmp_path / "ckpt" / "pipeline_slime.yaml").read_text()


def test_written_settings_reach_the_data_source_as_slime_applies_them(tmp_path, redis_url):
    result = _run("run_slime_grpo.sh", "--check", env=_slime_env(tmp_path, redis_url, ROLLOUT_FILTER_ZERO_VARIANCE="true"))
    assert "ROLLOUT_PUSH_MODE" not in result.stderr  # the default, in_place
    data = yaml.safe_load((tmp_path / "ckpt" / "pipeline_slime.yaml").read_text())
    args = SimpleNamespace(rollout_batch_size=32, n_samples_per_prompt=8)  # slime's own flags
    for key, value in data.items():  # slime_validate_args: setattr(args, k, v) for every YAML key
        setattr(args, key, value)
    settings = TrainerSettings.from_args(args)
    assert settings.redis_url == redis_url and settings.namespace == "exp7"
    assert settings.eta == 3 and settings.stale_policy is StalePolicy.DROP
    assert settings.filter_zero_variance is True and settings.publish_engine is True
    assert (settings.rollout_batch_size, settings.n_samples_per_prompt) == (32, 8)


def test_monitor_script_reads_the_env(redis_url):
    result = _run("monitor.sh", "--json", env={"ROLLOUT_REDIS_URL": redis_url, "ROLLOUT_NAMESPACE": "ops9"})
    assert result.returncode == 0, result.stderr
    snap = json.loads(result.stdout)
    assert snap["namespace"] == "ops9" and snap["queue"]["ready"] == 0
