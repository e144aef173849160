"""`rollout check-signal` (scripts/check_signal.py): the product's command runs the tiny policy
through a configuration and gives a verdict. The demo's configuration passes; the same
configuration with a bug planted in the pipeline's own code (tests/support/signal_bugs.py: a loss mask
one token late, versions one older, template tokens trained) fails, with exit code 4 and the
check that caught it named.
Real parts: a redis-server and `rollout engine --policy-path` (the simulator serving the warm
tiny LM) of the command's own, the producer and an arq worker in this process."""

from __future__ import annotations

import pytest
import yaml


@pytest.fixture
def demo_config(tmp_path):
    pytest.importorskip("torch")
    from scripts.demo import PROFILES, pipeline_config

    path = tmp_path / "demo.yaml"
    path.write_text(yaml.safe_dump(pipeline_config(PROFILES["default"], "redis://unused", "demo",
                                                   "http://unused", "unused")))
    return path


@pytest.mark.timeout(600)
def test_check_signal_passes_on_the_demo_configuration(demo_config, tmp_path, capsys):
    from scripts.cli import main

    code = main(["check-signal", "--config", str(demo_config), "--workdir", str(tmp_path)])
    out = capsys.readouterr().out
    print(out)
    assert code == 0, out
    assert "VERDICT: PASS" in out and "two-turn none" not in out, out
    # the drift per lag against version 1 (pipeline/learning/drift.py): the tokens version 1 made agree
    # with it to float error, version 0's (rollout 0, and rollout 1's before the push) are a lag
    # of 1 behind it: the perturbed copy moved them
    rows = {int(cells[1]): float(cells[3]) for line in out.splitlines()
            if line.startswith("| ") and (cells := [c.strip() for c in line.split("|")])[1].isdigit()}
    assert "drift per lag" in out and sorted(rows) == [0, 1], out
    assert rows[0] < 1e-4 < 1e-2 < rows[1], rows


@pytest.mark.timeout(600)
@pytest.mark.parametrize("bug, check", [("mask-right", "model tokens untrained"), ("versions-older", "version check"),
                                        ("template-trained", "mismatch bound")])
def test_check_signal_fails_on_a_bug_planted_in_the_pipeline(demo_config, tmp_path, capsys, monkeypatch, bug, check):
    """The conversion's loss mask one token late, its versions one older (rollout 1's samples
    then recomputed under the policy before the push), the episode's template tokens trained."""
    from scripts.check_signal import EXIT_FAIL
    from scripts.cli import main
    from tests.support.signal_bugs import BUGS

    next(b for b in BUGS if b.name == bug).plant(monkeypatch)
    code = main(["check-signal", "--config", str(demo_config), "--workdir", str(tmp_path)])
    out = capsys.readouterr().out
    print(out)
    assert code == EXIT_FAIL, out
    assert "VERDICT: FAIL" in out and f"FAIL {check}" in out, out
