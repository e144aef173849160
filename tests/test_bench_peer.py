"""scripts/peer_contenders.py (the contenders of scripts/bench_peer.py) drives slime's own rollout
code (the pinned snapshot) against the simulated engine: two steps of each slime contender, counts
only (never times).

(a) sglang_rollout.generate_rollout, (b) the same with partial rollout and over-sampling, run
here in the test's process one after the other (slime's GenerateState reset between them), and
(c) fully_async_rollout.generate_rollout_fully_async in a fork of the test's process, as the benchmark
runs every slime contender (its background worker and HTTP client belong to one process).
Each contender has its own simulated engine.
"""

from __future__ import annotations

import pytest

from tests.conformance_support import require_slime

pytestmark = pytest.mark.conformance

STEPS = 2


def test_slime_contenders_train_whole_groups_with_tokens_and_log_probs(tmp_path):
    require_slime("slime.rollout.sglang_rollout", "slime.rollout.fully_async_rollout")
    from scripts.peer_contenders import (
        Workload,
        finish,
        run_contender,
        run_slime_contender,
        write_inputs,
    )
    from scripts.processes import SimEngineProcess

    wl = Workload(steps=STEPS, train_step_s=0.1, token_latency_s=0.001)
    tasks, prompts = write_inputs(tmp_path)

    def in_process(kind: str):
        (tmp_path / kind).mkdir()
        with SimEngineProcess(wl.engine_args(str(tasks)), log_path=str(tmp_path / kind / "engine.log")) as engine:
            return finish(run_slime_contender(kind, wl, engine.url, prompts, tmp_path / kind), wl)

    results = [in_process("a"), in_process("b"), finish(run_contender("c", wl, tmp_path, tasks, prompts, quiet=True), wl)]
    for r in results:
        assert r.ran, f"({r.contender}) {r.name} did not run: {r.reason}"
        assert r.groups_per_step == [wl.batch] * STEPS, (r.contender, r.groups_per_step)
        assert len(r.trained_lengths) == STEPS * wl.batch * wl.n
        assert r.samples_without_tokens == 0 and r.samples_without_log_probs == 0, r.contender
        assert len(r.lags) >= STEPS * wl.batch * wl.n and min(r.lags) >= 0, r.contender  # one per generate call
        assert r.engine_tokens >= r.trained_tokens + r.carried_tokens > 0, r.contender
    a = results[0]
    assert max(a.lags) == 0  # synchronous: every call ran on the weights of the step that trains it
    assert a.carried_tokens == 0


# ---------------------------------------------------------------- the frontier's arithmetic (issue 25)


def _result(label, rep, *, kind="d", eta=-1, tok_s=1000.0, groups_s=10.0, trained=None, planned=None, lags=(0,),
            engine=1000, trained_tokens=1000, carried=0, counters=None):
    from scripts.peer_contenders import CONTENDERS, Result

    trained = trained if trained is not None else [50] * 8
    return Result(kind, CONTENDERS[kind], label=label, eta=eta, repeat=rep, ran=True, steps=2, wall_s=1.0,
                  groups_per_s=groups_s, trained_tokens_per_s=tok_s, engine_tokens=engine, trained_tokens=trained_tokens,
                  carried_tokens=carried, untrained_tokens=engine - trained_tokens - carried, lags=list(lags),
                  trained_lengths=trained, planned_lengths=planned if planned is not None else list(trained),
                  slot_samples=[(0.0, 16), (0.1, 32), (0.6, 8)], push_times=[0.5], counters=counters or {})


def _frontier(pipeline_waste_tokens=0, pipeline_lag=2, fa_bias_short=True, discarded=0):
    rs = []
    for rep in range(3):
        rs.append(_result("slime sync", rep, kind="a", groups_s=4.0, tok_s=800.0))
        fa = _result("slime fully async 1x", rep, kind="c", groups_s=16.0, tok_s=2500.0, lags=(0, 3, 5),
                     trained=[40] * 8 if fa_bias_short else [50] * 8, planned=[50] * 8)
        fa.notes.append("best fully async of this repeat (trained tokens/s)")
        rs.append(fa)
        for eta in (2, 5):
            r = _result(f"pipeline eta {eta}", rep, eta=eta, groups_s=16.5 if eta == 5 else 12.0,
                        tok_s=3300.0 if eta == 5 else 2600.0, lags=(0, 1, min(pipeline_lag, eta)),
                        engine=1000 + pipeline_waste_tokens, counters={"discarded": discarded})
            rs.append(r)
        same = _result("pipeline eta = fully async's max lag", rep, eta=5, groups_s=16.5, tok_s=3300.0, lags=(0, 5))
        same.notes.append("eta 5")
        rs.append(same)
    return rs


def test_frontier_goals_are_met_or_missed_by_the_counts():
    from scripts.bench_peer import goals

    met = {f.name.split(":")[0] + f.goal: f.met for f in goals(_frontier())}
    assert all(v for k, v in met.items() if "vs slime sync" not in k), met
    # eta 2 vs sync: 12 / 4 = 3.0x >= 2.77 in every repeat
    assert [f.met for f in goals(_frontier()) if "vs slime sync" in f.name] == [True]
    # the same-lag point: 3300 / 2500 = 1.32x >= 1.25x, groups 16.5 / 16 >= 1x
    same = [f for f in goals(_frontier()) if f.name.startswith("pipeline eta =") and f.unit == "tok/s"]
    assert same and same[0].ratio == pytest.approx(1.32) and same[0].met

    # 2 % of the tokens never trained: the waste goal is missed at every eta
    wasted = [f for f in goals(_frontier(pipeline_waste_tokens=25)) if f.unit == "%" and "eta =" not in f.name]
    assert len(wasted) == 2 and not any(f.met for f in wasted)
    # a discarded group (a due group skipped) misses it too, as does a lag over eta
    assert not any(f.met for f in goals(_frontier(discarded=1)) if f.unit == "%" and "eta 2" in f.name)
    over = _frontier()
    over[2].lags.append(3)  # eta 2's first repeat trained a call 3 versions old
    assert [f.met for f in goals(over) if f.unit == "%" and f.name.startswith("pipeline eta 2")] == [False]


def test_the_ceiling_is_the_earliest_schedule_the_lag_bound_allows():
    """Four steps, each 1 s of trainer step + push and a 3 s longest episode: at eta 0 every step
    waits for its own decode (S = 0, 4, 8, 12, end 13); at eta 2 step 3 waits only for step 0's
    push plus its decode (S = 0, 1, 2, 4, end 5)."""
    from scripts.bench_peer import Result, ceiling_tokens_per_s

    r = Result(contender="p", name="pipeline", label="pipeline eta 2", eta=2, concurrency=32, repeat=0, ran=True,
               steps=4, trained_tokens=1300, cohort_tails_s=[3.0] * 4, step_overheads_s=[1.0] * 4)
    assert ceiling_tokens_per_s(r) == pytest.approx(1300 / 5)
    assert ceiling_tokens_per_s(r, eta=0) == pytest.approx(1300 / 13)
    assert ceiling_tokens_per_s(r, eta=8) == pytest.approx(1300 / 4)  # the trainer alone
    r.cohort_tails_s = [3.0] * 3  # a step without its measured tail: no bound claimed
    assert ceiling_tokens_per_s(r) != ceiling_tokens_per_s(r)  # nan


def test_length_bias_is_trained_against_the_engines_plan_and_tables_show_it(tmp_path):
    from scripts.bench_peer import Workload, frontier_table, length_bias, plot, slot_use

    rs = _frontier()
    fa = rs[1]
    assert length_bias(fa) == (pytest.approx(-20.0), pytest.approx(-20.0))
    assert slot_use(fa, 32) == (pytest.approx((16 + 32 + 8) / 3 / 32), pytest.approx(8 / 32))
    text = frontier_table(rs, Workload())
    row = next(line for line in text.splitlines() if line.startswith("| slime fully async, best of the sweep"))
    assert "-20.0 (-20.0--20.0) %" in row and "0:3 3:3 5:3" in row
    assert "(5)" in next(line for line in text.splitlines() if line.startswith("| pipeline eta ="))
    pytest.importorskip("matplotlib")
    out = plot(rs, tmp_path / "frontier.png")
    assert out is not None and out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
