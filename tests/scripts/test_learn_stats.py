"""The learning bench's verdicts (scripts/bench/learn_stats.py): intervals over seeds and the
eval's problems, and "eta <= 4 inside sync's interval" printed MET / NOT MET."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from scripts.bench.learn_stats import eta_of, goal_rows, goal_table, interval, paired_interval, sync_intervals


def _curve(acc: dict[int, float], se: float = 0.02) -> SimpleNamespace:
    return SimpleNamespace(accuracy=acc, accuracy_se={s: se for s in acc})


def test_the_eval_s_problems_widen_the_interval_beyond_the_seeds_alone():
    seeds = [0.30, 0.31, 0.29, 0.30, 0.32]
    low0, high0 = interval(seeds, [0.0] * 5)
    low, high = interval(seeds, [0.025] * 5)
    assert low0 >= 0.29 and high0 <= 0.32
    assert high - low > 1.5 * (high0 - low0)
    assert low < 0.304 < high


def test_a_paired_difference_of_zero_sits_inside_and_a_real_one_outside():
    same = [(0.30 + d, 0.02, 0.30, 0.02) for d in (-0.01, 0.0, 0.01, 0.0, 0.005)]
    low, high = paired_interval(same)
    assert low < 0 < high
    worse = [(0.20 + d, 0.02, 0.30, 0.02) for d in (-0.01, 0.0, 0.01, 0.0, 0.005)]
    assert paired_interval(worse)[1] < 0


def test_eta_up_to_4_is_judged_at_the_last_step_against_sync_s_interval():
    sync = [_curve({0: 0.17, 4: 0.20, 12: 0.30 + d}) for d in (-0.01, 0.0, 0.01, 0.02, -0.02)]
    bounds = sync_intervals(sync)
    summary = {"sync_interval": {s: list(b) for s, b in bounds.items()}, "contenders": {
        "sync": {"accuracy": {0: 0.17, 4: 0.20, 12: 0.30}},
        "eta 2": {"accuracy": {4: 0.21, 12: 0.301}},
        "eta 4": {"accuracy": {4: 0.19, 12: 0.22}},
        "eta 8": {"accuracy": {4: 0.10, 12: 0.10}},  # past the goal's eta: not judged
        "eta 2, lr 1e-3 (stress)": {"accuracy": {12: 0.0}},  # a variant: not judged
    }}
    rows = {r["contender"]: r for r in goal_rows(summary)}
    assert set(rows) == {"eta 2", "eta 4"}
    assert rows["eta 2"]["met"] and rows["eta 2"]["by_step"][12] == "inside"
    assert not rows["eta 4"]["met"] and rows["eta 4"]["by_step"][12] == "below"
    text = goal_table(summary)
    assert "| eta 2 |" in text and "| MET |" in text and "NOT MET" in text
    assert eta_of("eta 8, TIS off") is None and eta_of("eta 1") == 1 and eta_of("sync") is None


def test_an_async_contender_s_gain_counts_from_sync_s_step_0_round_of_its_seed():
    from scripts.bench.learn import Curve, summarize

    def curve(name: str, seed: int, acc: dict[int, float]) -> Curve:
        return Curve(name, seed, acc, {k: float(k) for k in acc}, 0.5, 1.0, accuracy_se={k: 0.02 for k in acc})

    runs = [curve("sync", 0, {0: 0.10, 4: 0.30}), curve("sync", 1, {0: 0.20, 4: 0.30}),
            curve("eta 2", 0, {4: 0.25}), curve("eta 2", 1, {4: 0.35})]  # train_async.py: no round at step 0
    eta2 = summarize(runs)["contenders"]["eta 2"]
    assert eta2["gain_per_seed"] == pytest.approx([0.15, 0.15])
