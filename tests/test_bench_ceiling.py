"""scripts/bench/ceiling.py: the staleness bound's own throughput ceiling."""

import random
from dataclasses import replace

import pytest

from scripts.bench.ceiling import _expected_tail, binding, bound_ceiling
from scripts.bench.peer import ceiling_tokens_per_s
from scripts.bench.peer_contenders import WORKLOADS, Result, Workload

FLAT = Workload(batch=2, n=2, train_step_s=1.0, token_latency_s=0.01, max_response_len=400, model="")


def test_the_expected_longest_answer_is_the_order_statistic():
    """Three equally likely lengths, a cohort of 2: P(max = 1, 2, 3) = 1/9, 3/9, 5/9."""
    import numpy as np

    tail, time_s = _expected_tail(np.array([1.0, 2.0, 3.0]), 2, lambda x: 10 * x)
    assert tail == pytest.approx(22 / 9) and time_s == pytest.approx(220 / 9)


def test_the_period_is_the_tail_over_eta_plus_one_or_the_trainers_step():
    lengths = [10, 20, 30, 400]
    c0, c1, c9 = (bound_ceiling(FLAT, eta, lengths=lengths) for eta in (0, 1, 9))
    tail_tokens, _ = _expected_tail(__import__("numpy").array(sorted(lengths), dtype=float), 4, lambda x: x)
    assert c0.tail_tokens == pytest.approx(tail_tokens) and c0.tail_s == pytest.approx(tail_tokens * 0.01)
    assert c1.period_s == pytest.approx((1.0 + c1.tail_s) / 2) and not c1.trainer_bound
    assert c9.period_s == pytest.approx(1.0) and c9.trainer_bound  # the trainer's own step
    assert c9.tokens_per_s == pytest.approx(4 * 115 / 1.0)  # B x n x mean over tau
    assert c0.tokens_per_s < c1.tokens_per_s < c9.tokens_per_s


def test_no_schedule_with_lag_within_eta_beats_it():
    """The earliest schedule of the peer bench (`ceiling_tokens_per_s`: the max-plus recursion of
    the bound, brute-force-checked in tests/test_bench_peer.py) on cohorts drawn from the
    workload's own lengths stays under the ceiling, and comes within a few % over a long run."""
    rng = random.Random(3)
    lengths = [int(rng.lognormvariate(4.0, 1.0)) for _ in range(2000)]
    for eta in (0, 1, 2, 4):
        c = bound_ceiling(FLAT, eta, lengths=lengths)
        steps, cohort = 3000, FLAT.batch * FLAT.n
        tails, trained = [], 0
        for _ in range(steps):
            drawn = [min(rng.choice(lengths), FLAT.max_response_len) for _ in range(cohort)]
            tails.append(max(drawn) * FLAT.token_latency_s)
            trained += sum(drawn)
        run = Result("d", "sim", eta=eta, steps=steps, trained_tokens=trained, cohort_tails_s=tails,
                     step_overheads_s=[FLAT.train_step_s] * steps)
        schedule = ceiling_tokens_per_s(run)
        assert schedule <= c.tokens_per_s * 1.02, (eta, schedule, c.describe())
        assert schedule >= c.tokens_per_s * 0.8, (eta, schedule, c.describe())


def test_measured_physics_areal_7b():
    """The default workload on Qwen3-8B / H100 tables: the tail decodes near the 27K cap; the ceiling
    rises with eta until the trainer's step sets the period; a full batch decodes the tail slower."""
    wl = WORKLOADS["areal-7b"]
    ceilings = [bound_ceiling(wl, eta) for eta in (0, 1, 2, 4)]
    assert 0.9 * wl.max_response_len < ceilings[0].tail_tokens <= wl.max_response_len
    assert ceilings[0].tau_s > wl.train_step_s  # + the weight push's GPU time
    assert [c.tokens_per_s for c in ceilings] == sorted(c.tokens_per_s for c in ceilings)
    assert ceilings[-1].trainer_bound and not ceilings[1].trainer_bound
    assert bound_ceiling(wl, 1, step_batch=40).tokens_per_s < ceilings[1].tokens_per_s
    assert ceilings[1].wall_tokens_per_s == pytest.approx(50 * ceilings[1].tokens_per_s)
    assert "eta 1" in ceilings[1].describe()
    assert binding(1e9, ceilings[1]) == (ceilings[1].tokens_per_s, "bound")
    assert binding(10.0, ceilings[1]) == (10.0, "capacity")


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="eta must be >= 0"):
        bound_ceiling(FLAT, -1)
    with pytest.raises(ValueError, match="lengths"):
        bound_ceiling(FLAT, 1, lengths=[])
    with pytest.raises(ValueError, match="step_batch"):
        bound_ceiling(replace(FLAT), 1, step_batch=0)
