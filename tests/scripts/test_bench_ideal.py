"""scripts/bench/ideal.py: the staleness bound's ideal schedule, on the simulated engine's own
scheduler and physics, against cases whose answer is known by hand."""

from __future__ import annotations

import pytest

from scripts.bench.ideal import IdealSetup, capacity_tokens_per_s, ideal, physics_of
from scripts.bench.simmodel import LengthProfile
from workers.sim.engine import SimConfig

TOKEN_S = 0.01  # a flat engine: every decode step this long, prefill free (its step samples the first token)


def flat(*, slots: int, batch: int, n: int, eta: int, lengths: list[int], train_step_s: float = 0.001,
         steps: int = 12, engines: int = 1, priority: bool = True) -> IdealSetup:
    physics = physics_of(SimConfig(token_latency_s=TOKEN_S, slots=slots, priority_scheduling=priority))
    return IdealSetup(physics=physics, lengths=LengthProfile(lengths=lengths, min_tokens=1), prompts=((1, 2, 3),),
                      batch=batch, n=n, eta=eta, train_step_s=train_step_s, engines=engines, max_new_tokens=4096,
                      steps=steps)


def test_equal_lengths_on_one_engine_reach_capacity():
    """4 slots, groups of 4 answers of 10 tokens: each wave of 4 takes 9 decode steps (the prefill
    samples the first token for free). With one group admitted ahead (eta 1) the next wave is
    queued when one ends: the engine never idles, ideal = capacity = 4 x 10 tokens / 0.09 s."""
    setup = flat(slots=4, batch=1, n=4, eta=1, lengths=[10])
    by_hand = 4 * 10 / (9 * TOKEN_S)
    # (the window's edges cut a wave: within a token)
    assert capacity_tokens_per_s(setup, outstanding=16, warmup=16, window=160) == pytest.approx(by_hand, rel=1e-3)
    r = ideal(setup)
    assert r.tokens_per_s == pytest.approx(by_hand)
    assert r.lag_max <= 1 and r.period_s == pytest.approx(9 * TOKEN_S)


def test_synchronous_steps_wait_for_the_whole_cohort_and_the_trainer():
    """eta 0: each step's group decodes alone, then the trainer trains it: period (L - 1) x step +
    the trainer's step, whatever the slots."""
    setup = flat(slots=8, batch=1, n=2, eta=0, lengths=[50], train_step_s=0.3)
    r = ideal(setup)
    assert r.period_s == pytest.approx(49 * TOKEN_S + 0.3)
    assert r.tokens_per_s == pytest.approx(2 * 50 / (49 * TOKEN_S + 0.3))
    assert r.lag_max == 0


def test_a_heavy_tail_at_small_b_is_bound_by_eta_and_more_eta_or_b_lifts_it():
    """Answers of 10 or 400 tokens at B = 1 x n = 4 on 16 slots: the engine could run 16 at once,
    but at eta 0 only the step's own group may run, so its longest answer sets the step's
    period; each larger eta lets more groups run beside the tail, up to capacity."""
    lengths = [10, 10, 10, 400]
    cap = capacity_tokens_per_s(flat(slots=16, batch=1, n=4, eta=0, lengths=lengths))
    rates = [ideal(flat(slots=16, batch=1, n=4, eta=eta, lengths=lengths, steps=40)).tokens_per_s for eta in (0, 1, 3)]
    assert rates[0] < rates[1] < rates[2] <= cap * 1.02
    assert rates[0] < 0.5 * cap  # the bound binds
    wide = ideal(flat(slots=16, batch=4, n=4, eta=1, lengths=lengths, steps=24)).tokens_per_s
    assert wide > rates[1]  # a larger B fills the engine at the same eta


def test_it_is_deterministic_and_honours_the_lag_rule():
    setup = flat(slots=8, batch=2, n=3, eta=2, lengths=[5, 30, 200], steps=20)
    a, b = ideal(setup), ideal(setup)
    assert a == b and a.lag_max <= 2
    with pytest.raises(ValueError, match="no window"):
        flat(slots=8, batch=1, n=1, eta=2, lengths=[5], steps=4)


def test_two_engines_share_the_cohort():
    """Two engines of 4 slots, equal answers: twice one engine's rate at twice its B."""
    one = ideal(flat(slots=4, batch=1, n=4, eta=1, lengths=[10]))
    two = ideal(flat(slots=4, batch=2, n=4, eta=1, lengths=[10], engines=2))
    assert two.tokens_per_s == pytest.approx(2 * one.tokens_per_s)


def test_the_bench_workload_is_bound_by_eta_at_b_2_and_fills_more_at_b_4():
    """The bench's own workload (areal-7b: Qwen3-8B on an H100, lengths median 5,336 capped at
    27K): at B = 2 eta 2 the bound binds well below capacity; B = 4 comes closer to it."""
    from scripts.bench.peer_contenders import WORKLOADS

    wl = WORKLOADS["areal-7b"]
    small = IdealSetup.for_workload(wl, eta=2, batch=2, steps=10)
    cap = capacity_tokens_per_s(small)
    b2 = ideal(small).tokens_per_s
    b4 = ideal(IdealSetup.for_workload(wl, eta=2, batch=4, steps=10)).tokens_per_s
    # (10 steps: the window's groups' lengths vary, so B = 4 lands within a few % of capacity either side)
    assert b2 < 0.8 * cap and b2 < b4 and 0.9 * cap < b4 <= 1.1 * cap


@pytest.mark.conformance
def test_the_real_pipeline_trains_no_faster_than_the_ideal_on_a_short_run(tmp_path):
    """The pipeline contender of the bench (redis, `rollout workers`, `rollout enqueue --follow`,
    slime's data source; a fresh simulated engine) on a short flat workload, read over the bench's
    steady window: its trained tokens per engine-clock second stay at or below the ideal of the
    same engine, eta and B on the lengths that engine planned."""
    import dataclasses
    import math

    from tests.support.conformance_support import require_slime

    require_slime("slime.rollout.sglang_rollout")
    from scripts.bench.peer_contenders import Workload, finish, run_contender, write_inputs
    from scripts.bench.peer_steady import apply_window, window

    wl = Workload(name="short", steps=8, batch=2, n=4, eta=1, train_step_s=0.3, token_latency_s=0.005,
                  latency_sigma=0.0, length_mu=math.log(40), length_sigma=0.6, max_filler_tokens=400,
                  max_response_len=512, slots=8, concurrency=8)
    tasks, prompts = write_inputs(tmp_path)
    r = finish(run_contender("d", wl, tmp_path, tasks, prompts, quiet=True), wl)
    assert r.ran, r.reason
    apply_window(r, *window(wl.steps, wl.eta), wl)
    setup = dataclasses.replace(IdealSetup.for_workload(wl, steps=16),
                                lengths=LengthProfile(lengths=list(r.planned_lengths), min_tokens=1))
    best = ideal(setup)
    assert 0 < r.trained_tokens_per_s <= best.tokens_per_s, (r.trained_tokens_per_s, best.describe())


def test_a_run_of_decode_steps_is_the_steps_one_by_one():
    """`BatchScheduler.decode_many` (the simulation's shortcut where nothing can join or leave)
    ends where the same steps through `step()` end: tokens, KV, clock, new_token_ratio."""
    import asyncio

    from workers.sim.physics import load_table
    from workers.sim.scheduler import BatchScheduler, SchedulerConfig, SimReq

    table = load_table("Qwen/Qwen3-8B", "h100_sxm")

    def loaded() -> BatchScheduler:
        sch = BatchScheduler(SchedulerConfig(kv_pool_tokens=200_000, max_running_requests=64), table, asyncio.Event())
        for i in range(6):
            sch.add(SimReq(f"r{i}", [1, 2, 3, 100 + i], [7 + i] * (300 + 50 * i), 4096))
        while sch.waiting:
            sch.step()
        return sch

    bulk, single = loaded(), loaded()
    steps, seconds = bulk.decode_many(10_000) or (0, 0.0)
    assert steps == min(r.target - r.produced for r in single.running) - 1  # the finishing step is left to step()
    by_one = sum(single.step() or 0.0 for _ in range(steps))
    assert seconds == pytest.approx(by_one)
    assert [r.produced for r in bulk.running] == [r.produced for r in single.running]
    assert bulk.kv_used == single.kv_used and bulk.new_token_ratio == pytest.approx(single.new_token_ratio)
    assert bulk.decode_many(10_000) is None  # one step from a finish: through step()
    early = loaded()
    count, within = early.decode_many(10_000, within_s=0.5) or (0, 0.0)
    assert 0.5 <= within < 0.5 + table.decode_s(6, 6 * 700) and count < steps
