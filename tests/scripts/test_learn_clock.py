"""The learning bench's user's clock (scripts/bench/learn_clock.py): sync's generation against
its trainer step, the answers' lengths, and the seconds to sync's final accuracy, each goal
printed MET / NOT MET; and the engine's step-time factor (workers/sim/physics.py ScaledSteps)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from scripts.bench.learn_clock import clock_lines, length_stats, step_split
from workers.sim.physics import FlatSteps, ScaledSteps


def test_split_is_median_generation_over_median_trainer_step_in_simulated_seconds():
    """Real seconds x the time scale; medians (the first call waits for the producer's first
    tasks); a trainer step that overran counts its CPU time, not its budget."""
    generate = {0: 9.0, 1: 2.0, 2: 2.4, 3: 2.2}  # real s; rollout 0 waited for the first tasks
    trainer = [(700, 1.0, 0.3), (700, 1.0, 0.4), (700, 1.0, 1.5)]  # (tokens, budget, CPU), real s
    split = step_split(generate, trainer, time_scale=0.5)
    assert split["generate_s"] == pytest.approx(2.3 * 0.5)
    assert split["trainer_s"] == pytest.approx(1.0 * 0.5)
    assert split["ratio"] == pytest.approx(2.3)
    assert step_split({}, trainer, 0.5) == {}


def test_lengths_per_step_and_overall():
    batches = {0: [[SimpleNamespace(response_length=n) for n in (10, 20)], [SimpleNamespace(response_length=90)]],
               1: [[SimpleNamespace(response_length=n) for n in (12, 14)]]}
    stats = length_stats(batches)
    assert stats["overall"]["max"] == 90 and stats["overall"]["p50"] == 14
    assert stats["by_step"][0]["max"] == 90 and stats["by_step"][1]["max"] == 14


def _contender(gen: float, train: float, secs: float | None) -> dict:
    return {"split": [{"generate_s": gen, "trainer_s": train, "ratio": gen / train}],
            "response_tokens": [{"p50": 25, "p90": 60, "p99": 150, "max": 190, "mean": 33.0}],
            "seconds_to_sync_final": secs}


def test_goals_printed_met_and_not_met():
    met = clock_lines({"contenders": {"sync": _contender(2.5, 1.0, 100.0), "eta 2": _contender(0.3, 1.0, 55.0)}})
    assert "2.50x (goal 2-3x: MET)" in met
    assert "(the eval rounds included): eta 2 55.0 s = 0.55x of sync's 100.0 s (goal <= 0.6x): MET" in met
    assert "25 / 60 / 150 / 190 (33.0)" in met
    missed = clock_lines({"contenders": {"sync": _contender(1.2, 1.0, 100.0), "eta 2": _contender(0.3, 1.0, 70.0)}})
    assert "1.20x (goal 2-3x: NOT MET)" in missed and "(goal <= 0.6x): NOT MET" in missed
    unreached = clock_lines({"contenders": {"sync": _contender(2.5, 1.0, 100.0), "eta 2": _contender(0.3, 1.0, None)}})
    assert "eta 2 not reached" in unreached and "NOT MET" in unreached


def test_scaled_steps_stretch_every_step():
    steps = ScaledSteps(FlatSteps(0.01), 3.0)
    assert steps.decode_s(64, 1000) == pytest.approx(0.03)
    assert steps.prefill_s([(10, 0)]) == 0.0


def test_the_engine_config_applies_the_factor():
    from workers.sim.engine import SimConfig, engine_physics

    physics = engine_physics(SimConfig(token_latency_s=0.01, step_time_factor=2.5))
    assert physics is not None and physics.steps.decode_s(8, 100) == pytest.approx(0.025)
    with pytest.raises(ValueError):
        engine_physics(SimConfig(token_latency_s=0.01, step_time_factor=0.0))


def test_the_goal_is_judged_on_the_training_s_clock_where_the_eval_rounds_were_recorded():
    sync = {**_contender(2.5, 1.0, 100.0), "seconds_less_eval_to_sync_final": 80.0}
    eta2 = {**_contender(0.3, 1.0, 70.0), "seconds_less_eval_to_sync_final": 40.0}
    lines = clock_lines({"contenders": {"sync": sync, "eta 2": eta2}})
    assert "(less the eval rounds and the trainer's overruns): eta 2 40.0 s = 0.50x of sync's 80.0 s (goal <= 0.6x): MET" in lines
    assert "| 70.00 | 0.70x | 40.00 | 0.50x | not reached | - |" in lines


def test_the_training_clock_leaves_out_the_eval_rounds_and_the_trainer_s_overruns():
    from scripts.bench.learn import Curve, _training_clock

    curve = Curve("sync", 0, {0: 0.1, 4: 0.2}, seconds={0: 2.0, 4: 10.0}, clock_rate=0.5, wall_s=400.0,
                  seconds_kept={0: 2.0, 4: 9.0}, seconds_less_eval={0: 0.0, 4: 6.0})
    assert _training_clock(curve) == {0: 0.0, 4: 5.0}  # 10 s, less 4 s of evals and 1 s of overruns
