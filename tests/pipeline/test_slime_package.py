"""pipeline/slime/ as a package (issue 48): the flags' targets load from data_source and, for launch
scripts written before the package, from the package itself (slime's `load_function` is
`getattr(importlib.import_module(module), name)`); importing a sibling leaves data_source and samples
unimported (samples binds slime's classes, or LocalSample, at its import)."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
FLAG_TARGETS = ("RedisDataSource", "generate_rollout", "post_process_rewards")


def test_the_flag_targets_load_from_data_source_and_from_the_package():
    package = importlib.import_module("pipeline.slime")
    data_source = importlib.import_module("pipeline.slime.data_source")
    for name in FLAG_TARGETS:
        assert getattr(package, name) is getattr(data_source, name)
    with pytest.raises(AttributeError):
        package.to_trainer_group  # noqa: B018  (only the flags' targets are forwarded)


def test_a_sibling_does_not_import_the_data_source():
    code = ("import sys\n"
            "import pipeline.slime.trained_log, pipeline.slime.wait_cause, pipeline.slime.weight_push\n"
            "print(' '.join(sorted(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True).stdout
    assert "pipeline.slime.trained_log" in out.split()
    assert not {"pipeline.slime.data_source", "pipeline.slime.samples"} & set(out.split())
