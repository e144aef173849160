"""`rollout check-signal` (scripts/check_signal.py): the product's command runs the tiny policy
through a configuration and gives a verdict. The demo's configuration passes both stages, the
signal checks and learning; the same configuration with a bug planted in the pipeline's own code
(tests/support/signal_bugs.py) fails with exit code 4 and the check that caught it named: a loss
mask one token late, versions one older, template tokens trained by the signal checks (their
learning stage skipped: `--learn-steps 0`); GRPO advantages of the wrong sign, which no signal
check reads, by the learning stage (DOES NOT LEARN).
Real parts: a redis-server and `rollout engine --policy-path` (the simulator serving the warm
tiny LM) of the command's own, the producer and arq workers in this process; for learning,
slime's own train_async.py, RolloutManager conversion and loss (the `conformance` tests: slime's
snapshot, torch and megatron-core)."""

from __future__ import annotations

import pytest
import yaml

from tests.conformance.test_conformance_slime import slime  # noqa: F401  (slime's classes under pipeline.slime.data_source)


@pytest.fixture
def demo_config(tmp_path):
    pytest.importorskip("torch")
    from scripts.demo import PROFILES, pipeline_config

    path = tmp_path / "demo.yaml"
    path.write_text(yaml.safe_dump(pipeline_config(PROFILES["default"], "redis://unused", "demo",
                                                   "http://unused", "unused")))
    return path


def _drift_rows(text: str) -> dict[int, float]:
    """lag -> mean |dlogp| of a drift table (pipeline/learning/drift.py format_table) in `text`."""
    return {int(cells[1]): float(cells[3]) for line in text.splitlines()
            if line.startswith("| ") and (cells := [c.strip() for c in line.split("|")])[1].isdigit()}


@pytest.mark.conformance
@pytest.mark.timeout(900)
def test_check_signal_passes_on_the_demo_configuration(slime, demo_config, tmp_path, capsys):  # noqa: F811
    """Both stages: the signal checks, then 10 steps of slime's train_async.py at the demo's eta 2
    with the launcher's loss flags, which must gain the margin in greedy held-out accuracy."""
    from scripts.cli import main

    code = main(["check-signal", "--config", str(demo_config), "--workdir", str(tmp_path)])
    out = capsys.readouterr().out
    print(out)
    assert code == 0, out
    assert "VERDICT: PASS (the signal checks and learning)" in out and "two-turn none" not in out, out
    signal, _, learning = out.partition("\nlearning: ")
    # the drift per lag against version 1: the tokens version 1 made agree with it to float error,
    # version 0's (rollout 0, and rollout 1's before the push) are a lag of 1 behind it: the
    # perturbed copy moved them
    rows = _drift_rows(signal)
    assert "drift per lag" in signal and sorted(rows) == [0, 1], out
    assert rows[0] < 1e-4 < 1e-2 < rows[1], rows
    assert "train_async.py at eta 2" in learning and "--use-tis" in learning, out
    assert "LEARNS: greedy gain" in learning and "PASS every trained step's checks" in learning, out
    # the run's own drift: no token past eta, lag 0 (the first step's, before any push) the trainer's own
    lags = _drift_rows(learning)
    assert lags and set(lags) <= {0, 1, 2} and lags.get(0, 0.0) < 1e-4, lags


@pytest.mark.timeout(600)
@pytest.mark.parametrize("bug, check", [("mask-right", "model tokens untrained"), ("versions-older", "version check"),
                                        ("template-trained", "mismatch bound")])
def test_check_signal_fails_on_a_bug_planted_in_the_pipeline(demo_config, tmp_path, capsys, monkeypatch, bug, check):
    """The conversion's loss mask one token late, its versions one older (rollout 1's samples
    then recomputed under the policy before the push), the episode's template tokens trained."""
    import pipeline.slime.data_source  # noqa: F401  (the conversion the plant patches, imported as the command will)
    from scripts.check_signal import EXIT_FAIL
    from scripts.cli import main
    from tests.support.signal_bugs import BUGS

    next(b for b in BUGS if b.name == bug).plant(monkeypatch)
    code = main(["check-signal", "--config", str(demo_config), "--workdir", str(tmp_path), "--learn-steps", "0"])
    out = capsys.readouterr().out
    print(out)
    assert code == EXIT_FAIL, out
    assert f"FAIL {check}" in out and "VERDICT: FAIL (the signal checks failed; learning not checked)" in out, out


@pytest.mark.conformance
@pytest.mark.timeout(900)
def test_check_signal_fails_on_learning_where_no_signal_check_looks(slime, demo_config, tmp_path, capsys,  # noqa: F811
                                                                    monkeypatch):
    """GRPO advantages of the wrong sign in the pipeline's own reward post-processing (the
    launcher's --custom-reward-post-process-path, the learning stage's default): every sample
    still says what the policy did, so every signal check passes; the policy unlearns."""
    from scripts.check_signal import EXIT_FAIL
    from scripts.cli import main
    from tests.support.signal_bugs import LEARNING_BUGS

    LEARNING_BUGS[0].plant(monkeypatch)
    code = main(["check-signal", "--config", str(demo_config), "--workdir", str(tmp_path), "--groups", "4"])
    out = capsys.readouterr().out
    print(out)
    assert code == EXIT_FAIL, out
    assert not [line for line in out.splitlines() if line.startswith("FAIL ")], out  # every signal check passed
    assert "PASS every trained step's checks" in out, out
    assert "DOES NOT LEARN" in out and "VERDICT: FAIL (the signal checks passed; the policy DOES NOT LEARN)" in out, out


def test_without_slime_the_learning_stage_says_so_and_checks_nothing(demo_config, tmp_path, capsys, monkeypatch):
    """No slime snapshot: exit 5 and what is missing, before anything runs (never a silent pass)."""
    from scripts.check_signal import EXIT_UNCHECKED
    from scripts.cli import main

    monkeypatch.setenv("SLIME_PATH", str(tmp_path / "no-slime"))
    code = main(["check-signal", "--config", str(demo_config), "--workdir", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == EXIT_UNCHECKED, err
    assert "no slime snapshot" in err and "--learn-steps 0" in err and "VERDICT: NOT RUN" in err, err


def test_the_default_loss_flags_are_the_launchers():
    """check-signal's default --slime-args is what scripts/run_slime_grpo.sh trains with."""
    import re
    from pathlib import Path

    from scripts.oracle.slime_flags import LAUNCHER_LOSS_FLAGS

    launcher = " ".join(Path("scripts/run_slime_grpo.sh").read_text().split())
    for flag in re.findall(r"--\S+(?: [^-\s]\S*)?", LAUNCHER_LOSS_FLAGS):
        assert flag in launcher, f"{flag!r} is not scripts/run_slime_grpo.sh's"


@pytest.mark.conformance
def test_loss_flags_are_read_with_slimes_parser_on_slimes_defaults(slime):  # noqa: F811
    from pipeline.config import ConfigError
    from scripts.oracle.slime_flags import loss_flags

    flags = loss_flags("--use-rollout-logprobs --eps-clip 0.3 --lr 1e-6 --rollout-batch-size 32 --optimizer adam")
    assert flags.values["use_rollout_logprobs"] and not flags.values["use_tis"]  # slime's default: no TIS
    assert flags.values["eps_clip"] == flags.values["eps_clip_high"] == 0.3  # slime_validate_args' rule
    assert flags.values["kl_loss_type"] == "k1" and flags.values["custom_reward_post_process_path"] is None
    assert flags.given == ["--use-rollout-logprobs", "--eps-clip 0.3"]
    assert flags.ignored == ["--lr", "--rollout-batch-size"] and flags.unknown == ["--optimizer", "adam"]
    with pytest.raises(ConfigError, match="use_tis cannot be set"):
        loss_flags("--use-tis --use-rollout-logprobs")
    with pytest.raises(ConfigError, match="--eps-clip: invalid float"):
        loss_flags("--eps-clip abc")
