"""scripts/bench/peer_contenders.py (the contenders of scripts/bench/peer.py) drives slime's own rollout
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

from tests.support.conformance_support import require_slime

pytestmark = pytest.mark.conformance

STEPS = 2


def test_slime_contenders_train_whole_groups_with_tokens_and_log_probs(tmp_path):
    require_slime("slime.rollout.sglang_rollout", "slime.rollout.fully_async_rollout")
    from scripts.bench.peer_contenders import (
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
    from scripts.bench.peer_contenders import CONTENDERS, Result

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
    from scripts.bench.peer import goals

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
    from scripts.bench.peer import Result, ceiling_tokens_per_s

    r = Result(contender="p", name="pipeline", label="pipeline eta 2", eta=2, concurrency=32, repeat=0, ran=True,
               steps=4, trained_tokens=1300, cohort_tails_s=[3.0] * 4, step_overheads_s=[1.0] * 4)
    assert ceiling_tokens_per_s(r) == pytest.approx(1300 / 5)
    assert ceiling_tokens_per_s(r, eta=0) == pytest.approx(1300 / 13)
    assert ceiling_tokens_per_s(r, eta=8) == pytest.approx(1300 / 4)  # the trainer alone
    r.cohort_tails_s = [3.0] * 3  # a step without its measured tail: no bound claimed
    assert ceiling_tokens_per_s(r) != ceiling_tokens_per_s(r)  # nan


def test_length_bias_is_trained_against_the_engines_plan_and_tables_show_it(tmp_path):
    from scripts.bench.peer import Workload, frontier_table, length_bias, plot, slot_use

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


def _brute_force_least_wall(taus, tails, eta):
    """Every schedule of the ceiling's model, searched: step k trains groups admitted at any
    version v with k - eta <= v <= k (version v >= 1 is out when step v - 1 has trained and
    pushed, S_{v-1} + tau_{v-1}; version 0 and earlier before the clock), started at that time or
    up to 1 s later, and the step starts when its longest episode is done and the previous step
    has pushed, or up to 1 s later. Returns the least wall time over all of them."""
    steps, best = len(taus), [float("inf")]

    def walk(k, starts):
        if k == steps:
            best[0] = min(best[0], starts[-1] + taus[-1])
            return
        for version in range(max(0, k - eta), k + 1):
            released = starts[version - 1] + taus[version - 1] if version >= 1 else float("-inf")
            for delay in (0, 1):
                for wait in (0, 1):
                    ready = max(starts[k - 1] + taus[k - 1] if k else 0.0, released + delay + tails[k])
                    walk(k + 1, [*starts, ready + wait])

    walk(0, [])
    return best[0]


def test_the_earliest_schedule_is_the_optimum_of_its_model_by_brute_force():
    """The max-plus recursion in ceiling_tokens_per_s against an exhaustive search over every
    admission version, start delay and step wait on small integer instances."""
    import random

    from scripts.bench.peer import Result, ceiling_tokens_per_s

    rng = random.Random(31)
    for case in range(40):
        steps, eta = rng.randint(1, 4), rng.randint(0, 3)
        taus = [float(rng.randint(1, 3)) for _ in range(steps)]
        tails = [float(rng.randint(0, 5)) for _ in range(steps)]
        r = Result(contender="d", name="pipeline", eta=eta, ran=True, steps=steps, trained_tokens=1000,
                   cohort_tails_s=tails, step_overheads_s=taus)
        least = _brute_force_least_wall(taus, tails, eta)
        assert ceiling_tokens_per_s(r) == pytest.approx(1000 / least), (case, taus, tails, eta)


def test_every_ratio_is_the_median_of_per_repeat_ratios_with_the_worst_beside():
    """Issue 31: 1.215x (ratio of medians) must not print as 1.26x in one place and 1.22x in
    another: the table's ratio column and the goals use the same per-repeat ratios."""
    from scripts.bench.peer import FA_BEST, Workload, frontier_table, goals, per_repeat_ratios, ratio_text

    rs = _frontier()
    for rep, (fa_tok, mine_tok) in enumerate([(1000.0, 1500.0), (2000.0, 2100.0), (1500.0, 1800.0)]):
        next(r for r in rs if r.repeat == rep and r.contender == "c").trained_tokens_per_s = fa_tok
        next(r for r in rs if r.repeat == rep and r.label == "pipeline eta 5").trained_tokens_per_s = mine_tok
    fa = [r for r in rs if r.contender == "c"]
    mine = [r for r in rs if r.label == "pipeline eta 5"]
    ratios = per_repeat_ratios(mine, fa, lambda r: r.trained_tokens_per_s)
    assert ratios == pytest.approx([1.5, 1.05, 1.2])  # ratio of medians would be 1800 / 1500 = 1.2
    assert ratio_text(ratios) == "1.20x (worst 1.05x)"
    row = next(line for line in frontier_table(rs, Workload()).splitlines() if line.startswith("| pipeline eta 5"))
    assert "| 1.20x (worst 1.05x) |" in row
    figure = next(f for f in goals(rs) if f.name.startswith("pipeline eta 5") and f.unit == "tok/s")
    assert figure.ratio == pytest.approx(1.2) and "1.20x (worst 1.05x)" in figure.name
    assert FA_BEST in frontier_table(rs, Workload())


def test_the_ceiling_is_printed_as_what_it_is_not_as_a_bound():
    from scripts.bench.peer import Workload, frontier_table, goals

    rs = _frontier()
    for r in rs:
        if r.contender == "d":
            r.cohort_tails_s, r.step_overheads_s = [0.5, 0.5], [0.1, 0.1]
    head = frontier_table(rs, Workload()).splitlines()[0]
    assert "earliest schedule" in head and "measured durations" in head and "ceiling" not in head
    for figure in goals(rs):
        assert "no schedule with lag" not in figure.name and "ceiling" not in figure.name


def test_the_summary_is_compact_and_the_raw_dump_goes_where_asked(tmp_path):
    """docs/ keeps a summary (lags as a distribution, no slot samples); --raw gets every record,
    and --from-raw rebuilds the same summary from it."""
    import json

    from scripts.bench.peer import Workload, load_raw, report, summary

    rs = _frontier()
    for r in rs:  # a long run's records: 4,000 slot samples, 3,000 lags
        r.slot_samples = [(i * 0.05, 16) for i in range(4_000)]
        r.lags = [i % 3 for i in range(3_000)]
    raw, compact = tmp_path / "raw.json", tmp_path / "summary.json"
    report(rs, Workload(), repeats=3, seconds=12.0, plot_path=None, json_path=str(compact), raw_path=str(raw),
           command="python -m scripts.bench.peer --repeats 3")
    assert compact.stat().st_size < 100_000 < raw.stat().st_size
    data = json.loads(compact.read_text())
    assert data["command"] == "python -m scripts.bench.peer --repeats 3"
    assert data["runs"][0]["lag_calls"] == {"0": 1000, "1": 1000, "2": 1000} and "slot_samples" not in data["runs"][0]
    again, wl, repeats, _ = load_raw(raw)
    assert summary(again, wl, repeats=repeats, seconds=12.0, figures=[], command="x")["table"] == data["table"]
    # two invocations' dumps read as one run: the second's repeats follow the first's
    both, _, repeats, seconds = load_raw(raw, raw)
    assert repeats == 6 and seconds == 24.0 and sorted({r.repeat for r in both}) == [0, 1, 2, 3, 4, 5]


def test_docs_hold_no_file_over_200_kb():
    from pathlib import Path

    docs = Path(__file__).resolve().parents[2] / "docs"
    big = {p.name: p.stat().st_size for p in docs.rglob("*") if p.is_file() and p.stat().st_size > 200_000}
    assert not big, f"regenerable dumps belong outside docs/: {big}"


def test_the_time_scale_speeds_the_engine_and_the_trainer_alike():
    from scripts.bench.peer_contenders import WORKLOADS, Workload

    wl = WORKLOADS["areal-7b"]
    args = wl.engine_args("tasks.jsonl")
    if wl.measured_physics:  # the engine runs its own clock that much faster
        assert float(args[args.index("--time-scale") + 1]) == wl.time_scale and "--model" in args
    else:
        token_s = float(args[args.index("--token-latency-s") + 1])
        assert token_s == pytest.approx(wl.token_latency_s / wl.time_scale)
    assert wl.train_sleep_s == pytest.approx(wl.train_step_s / wl.time_scale)
    assert f"time scale {wl.time_scale:g}x" in wl.describe()
    assert wl.max_response_len == wl.max_filler_tokens == 27 * 1024 and wl.n == 16  # AReaL's, never scaled
    with pytest.raises(ValueError, match="time_scale"):
        Workload(time_scale=0)


def test_engine_counters_are_shown_where_the_engine_keeps_them():
    from scripts.bench.peer import Workload, frontier_table

    rs = _frontier()
    stats = {"max_kv_used": 300.0, "kv_pool_tokens": 400.0, "kv_used_token_s": 100.0, "busy_s": 1.0,
             "preemptions": 3.0, "retractions": 2.0, "prefill_tokens": 5000.0, "cached_tokens": 1200.0}
    for r in rs:
        if r.label == "pipeline eta 2":
            r.engine_stats = dict(stats)
            r.clock_rates = [50.0] * 9 + [25.0]  # one busy window at half the scale
    lines = frontier_table(rs, Workload(time_scale=50)).splitlines()
    assert "| KV pool use max / mean busy | preemptions | retractions | prefill tok computed / cached |" in lines[0]
    row = next(line for line in lines if line.startswith("| pipeline eta 2 "))
    assert "| 0.75 (0.75-0.75) / 0.25 (0.25-0.25) | 3 (3-3) | 2 (2-2) | 5000 (5000-5000) / 1200 (1200-1200) |" in row
    assert "| 1.00 (0.95) |" in row  # the engine's clock against the time scale: median (p10)
    sync = next(line for line in lines if line.startswith("| slime sync"))
    assert sync.count("not kept") == 5  # an engine without the counters (and clock): said so, never 0
    assert all(line.count("|") == lines[0].count("|") for line in lines)


# ---------------------------------------------------------------- steady state, capacity (issue 38)


def _marked(label, rep, *, kind="d", eta=-1, per_step=1000, step_s=1.0, warm_steps=2, steps=10, idle_share=0.0,
            generated_per_step=1200, scale=50.0):
    """A run whose steps 0..warm_steps-1 are slow (warm-up) and last two train nothing extra:
    marks every step_s wall seconds; the engine clock moves step_s x scale x (1 - idle_share)
    a step and idles the rest (slot samples at 0)."""
    r = _result(label, rep, kind=kind, eta=eta)
    r.steps, r.groups_per_step = steps, [2] * steps
    r.step_marks, r.slot_samples = [[0.0, 0, 0, 0.0, 0.0, 0.0]], []
    wall = sim = 0.0
    trained = generated = 0
    for k in range(steps):
        slow = 3.0 if k < warm_steps else 1.0
        busy_wall = step_s * slow * (1 - idle_share)
        r.slot_samples += [(wall, 16), (wall + busy_wall, 0)] if idle_share else [(wall, 16)]
        half, busy = sim + busy_wall * scale / 2, sim + busy_wall * scale
        # the simulated clock jumps (a push syncing it to the wall): busy seconds do not
        r.clock_samples += [[wall + busy_wall / 2, half + 7.0, half], [wall + busy_wall, busy + 7.0, busy]]
        wall += step_s * slow
        sim += busy_wall * scale
        trained += per_step
        generated += generated_per_step
        r.step_marks.append([wall, trained, generated, sim, sim + 7.0 * (k + 1), sim])
    r.slot_samples.append((wall, 16))
    return r


def test_the_steady_window_excludes_warm_up_and_drain_and_runs_on_the_engine_clock():
    from scripts.bench.peer_contenders import Workload
    from scripts.bench.peer_steady import apply_window, per_busy_s, trained_share, window

    assert window(24, 2) == (4, 21)  # steps eta + 2 .. N - 3: the last two are the drain
    assert window(8, 2) == (2, 5)  # too short for that: its middle third
    wl = Workload(time_scale=50.0)
    r = _marked("pipeline eta 2", 0, eta=2)
    apply_window(r, 4, 7, wl)
    # 4 steps of 1,000 trained tokens in 4 wall s = 200 engine-clock s: warm-up's slow steps outside
    assert r.trained_tokens_per_s == pytest.approx(1000 / 50)
    assert r.window["wall_tokens_per_s"] == pytest.approx(1000) and r.window["clock_rate"] == pytest.approx(1.0)
    assert r.run_tokens_per_s == 1000.0  # the whole run's figure kept beside (here the fixture's)
    assert per_busy_s(r) == pytest.approx(1200 / 50) and trained_share(r) == pytest.approx(1000 / 1200)
    # an engine idle half of each step (sync while it trains): its idle wall time counts x the scale
    sync = _marked("slime sync", 0, kind="a", idle_share=0.5)
    apply_window(sync, 4, 7, wl)
    assert sync.window["played_s"] == pytest.approx(200.0) and sync.trained_tokens_per_s == pytest.approx(20.0)
    assert per_busy_s(sync) == pytest.approx(1200 / 25)  # per BUSY engine-second: twice the batch's rate
    # a step loop at half the scale while busy: the engine's clock, not the wall, sets the rate
    slow = _marked("pipeline eta 2", 0, eta=2, scale=25.0)
    apply_window(slow, 4, 7, wl)
    assert slow.trained_tokens_per_s == pytest.approx(1000 / 25) and slow.window["clock_rate"] == pytest.approx(0.5)


def _steady_frontier(eta2_tok=(20.0, 20.0, 19.0), fa_tok=(20.0, 19.0, 19.0), cap_tok=20.0):
    from scripts.bench.peer_contenders import CONTENDERS, Result
    from scripts.bench.peer_steady import CAPACITY

    rs = []
    for rep in range(3):
        cap = Result("cap", CAPACITY, label=CAPACITY, repeat=rep, ran=True, steps=1, trained_tokens_per_s=cap_tok,
                     window={"generated_tokens": 100, "busy_s": 5.0, "clock_rate": 0.9})
        fa = _result("slime fully async 1x", rep, kind="c", tok_s=fa_tok[rep])
        fa.notes.append("best fully async of this repeat (trained tokens/s)")
        eta2 = _result("pipeline eta 2", rep, eta=2, tok_s=eta2_tok[rep], lags=(0, 1, 2))
        for r in (fa, eta2):
            r.window = {"first": 4, "last": 21, "generated_tokens": 120, "trained_tokens": 100, "busy_s": 6.0,
                        "clock_rate": 0.95, "wall_tokens_per_s": 900.0}
        rs += [cap, fa, eta2]
    del CONTENDERS
    return rs


def test_the_steady_goals_divide_by_the_bounds_ideal_by_measured_capacity_and_fully_async_per_repeat():
    from scripts.bench.ideal import bound_ideal
    from scripts.bench.peer import FA_BEST, _rows, steady_text
    from scripts.bench.peer_contenders import Workload
    from scripts.bench.peer_steady import capacities, steady_goals

    wl = Workload()  # no measured model: a flat 4 ms a token, 32 slots; the ideal far above the fixture's 20 tok/s
    caps = capacities(_steady_frontier())
    rows = _rows(_steady_frontier())
    ideal, cap, vs_fa = steady_goals(rows, caps, wl, rows[FA_BEST])
    assert "bound's ideal" in ideal.name and ideal.baseline_value == pytest.approx(bound_ideal(wl, 2)[0].tokens_per_s)
    assert ideal.ratio == pytest.approx(20 / ideal.baseline_value) and not ideal.met
    assert cap.ratio == pytest.approx(1.0) and cap.met  # 20, 20, 19 of 20: median 1.00, worst 0.95
    assert "0.95" in cap.name and vs_fa.met and vs_fa.ratio == pytest.approx(1.0)
    rows = _rows(_steady_frontier(eta2_tok=(18.0, 20.0, 18.5)))
    _ideal, cap, vs_fa = steady_goals(rows, caps, wl, rows[FA_BEST])
    assert not cap.met  # 0.925 of capacity
    assert not vs_fa.met  # 0.90x, 1.05x, 0.97x: the median 0.97x < 1
    rows = _rows(_steady_frontier(eta2_tok=(21.0, 20.0, 18.0)))
    assert not steady_goals(rows, caps, wl, rows[FA_BEST])[2].met  # median 1.05x, worst 0.95x: the worst misses it
    beside = steady_goals(rows, caps, wl, rows[FA_BEST], bias_of=lambda r: -2.5 if r.contender == "c" else 0.0)[2]
    # lag and length bias printed beside the ratio, for both sides, with the window they were read over
    assert "pipeline: lag mean 1.00 max 2, length bias +0.0 (+0.0-+0.0) %, steps 4..21" in beside.name
    assert "fully async: lag mean" in beside.name and "length bias -2.5 (-2.5--2.5) %" in beside.name
    text = steady_text(_steady_frontier(), wl)
    cap_row = next(line for line in text.splitlines() if line.startswith("| engine capacity"))
    assert "| 20 (20-20) (generated) | - | 1.00 | - | 20 (20-20) |" in cap_row  # 100 tokens / 5 busy s
    row = next(line for line in text.splitlines() if line.startswith("| pipeline eta 2 "))
    assert "| 1.00 (worst 0.95) |" in row and "| 0.83 (0.83-0.83) |" in row  # efficiency; trained / generated
    assert "bound's ideal at eta 2, B 8 x n 4" in text and "of N x the simulated capacity" in text


def test_engines_per_trainer_are_read_against_n_times_capacity_and_the_trainer():
    from scripts.bench.peer import _rows
    from scripts.bench.peer_contenders import Workload
    from scripts.bench.peer_steady import capacities, engines_table

    rs = _steady_frontier()  # capacity 20 tok/s a repeat; pipeline eta 2 at 20, 20, 19
    for n, tok in ((2, 36.0), (4, 41.0)):
        r = _result(f"pipeline eta 2, {n} engines", 0, eta=2, tok_s=tok)
        r.window = {"first": 4, "last": 21}
        rs.append(r)
    wl = Workload(batch=2, n=4, train_step_s=10.0)
    text = engines_table(_rows(rs), capacities(rs), wl)
    lines = text.splitlines()
    assert "pipeline eta 2: trained tok/s" in lines[0] and len(lines) == 5  # head, rule, 1, 2, 4 engines
    # 8 answers of 50 planned tokens a step / a 10 s trainer step: 40 tok/s, whatever the engines
    assert lines[2].startswith("| 1 | 20 | 40 | 20 (19-20) (1.00 (0.95-1.00)) |")
    assert lines[3] == "| 2 | 40 | 40 | 36 (0.90) | - (-) |  |" and lines[4] == "| 4 | 80 | 40 | 41 (0.51) | - (-) |  |"



def test_engines_goals_hold_each_count_to_n_times_capacity_until_the_trainer_binds():
    """Issue 46 item 4: >= 0.9 of N x capacity in the median, or of the trainer's limit where that
    is lower; B as the runs took it (`--engines-scale-batch`: B x N groups a step)."""
    from scripts.bench.peer import _rows
    from scripts.bench.peer_contenders import Workload
    from scripts.bench.peer_steady import capacities, engines_goals

    wl = Workload(batch=2, n=4, train_step_s=10.0)  # 8 answers of 50 planned tokens / 10 s: 40 tok/s at B 2

    def goals(runs: list[tuple[int, float, int]]) -> list[str]:
        rs = _steady_frontier()  # capacity 20 tok/s a repeat
        for rep, (n, tok, batch) in enumerate(runs):
            r = _result(f"pipeline eta 2, {n} engines", rep, eta=2, tok_s=tok)
            r.window, r.groups_per_step = {"first": 4, "last": 21}, [batch] * 3
            rs.append(r)
        return [f.line() for f in engines_goals(_rows(rs), capacities(rs), wl)]

    # 2 engines at B 2: 36 of 40 (N x capacity; the trainer's 40 is not below it): 0.90, met
    assert goals([(2, 36.0, 2)]) == [
        "[peer] pipeline eta 2, 2 engines: trained tokens/s 36 (median of 1 run(s), worst 0.90) against N x capacity: "
        "36 tok/s | N x capacity: 40 tok/s | ratio 0.9x | goal >= 0.9 in the median: MET"]
    # 4 engines at B 2: the trainer's 40 tok/s binds before 80 of capacity; 41 is all of it
    (line,) = goals([(4, 41.0, 2)])
    assert "against the trainer's limit (it binds first)" in line and line.endswith("ratio 1.02x | goal >= 0.9 in the median: MET")
    # 4 engines at B 8 (B x N): the trainer's limit 160 no longer binds: 41 of 80, missed; two runs, the median
    (line,) = goals([(4, 41.0, 8), (4, 79.0, 8)])
    assert "median of 2 run(s), worst 0.51) against N x capacity" in line and line.endswith("ratio 0.75x | goal >= 0.9 in the median: NOT MET")

def _two_engines():
    """Two engines over 4 steps of 1 wall s at 50x: engine 0 busy 0.2 s of each (10 engine-s, 100
    tokens) and idle the rest; engine 1 busy throughout at half the scale (25 engine-s, 1,000 tokens)."""
    r = _result("pipeline eta 2, 2 engines", 0, eta=2)
    r.steps, r.groups_per_step = 4, [2] * 4
    r.step_marks = [[float(k), 1100 * k, 1100 * k, 35.0 * k, 50.0 * k, 10.0 * k, 100 * k, 10.0 * k, 1000 * k, 25.0 * k]
                    for k in range(5)]
    r.slot_samples = [x for k in range(4) for x in ((float(k), 16), (k + 0.2, 0))] + [(4.0, 16)]
    r.clock_samples = [[k + 0.2, 50.0 * k + 10, 10.0 * (k + 1)] for k in range(4)]
    r.engine_slot_samples = [[(float(k), 16) for k in range(5)]]
    r.engine_clock_samples = [[[k + 0.5, 50.0 * k + 12.5, 25.0 * k + 12.5] for k in range(4)]]
    return r


def test_each_engine_counts_on_its_own_clock_never_the_first_engines_idle_time():
    from scripts.bench.peer import _rows
    from scripts.bench.peer_contenders import Workload
    from scripts.bench.peer_steady import (
        apply_window,
        capacities,
        engines_table,
        fleet_generated_per_s,
        per_engine_busy_rates,
        played_s,
    )

    wl = Workload(time_scale=50.0)
    r = _two_engines()
    # the old reading: 4,400 tokens over the first engine's clock, 200 s (its idle wall x 50): 22 tok/s
    assert played_s(r, wl, r.step_marks[0], r.step_marks[4]) == pytest.approx(200.0)
    apply_window(r, 0, 3, wl)
    # each engine on its own: 400 tokens / 200 s + 4,000 / 100 s = 42 tok/s, the trained 4,400 on that clock too
    assert fleet_generated_per_s(r) == pytest.approx(42.0)
    assert r.trained_tokens_per_s == pytest.approx(42.0)
    assert per_engine_busy_rates(r) == pytest.approx([10.0, 40.0])  # per each engine's own busy second
    rs = [*_steady_frontier(), r]
    line = engines_table(_rows(rs), capacities(rs), Workload(batch=2, n=4, train_step_s=10.0)).splitlines()[3]
    assert line == "| 2 | 40 | 40 | 42 (1.05) | 42 (1.05) | 10 / 40 |"


def test_the_window_opens_where_the_stock_stops_growing_and_never_on_a_growing_stock():
    from scripts.bench.peer_steady import FLAT_STEPS, flat_from

    trained = [1000.0] * 30
    # a stock that grows by 10 % of a step's trained tokens every step never opens it, however large it gets
    assert flat_from([100.0 * i for i in range(30)], trained) is None
    assert flat_from([5000.0 + 100.0 * i for i in range(30)], trained) is None
    # flat from the start: step 0; filling for 8 steps, then flat: the first k-step run clear of the fill
    assert flat_from([3000.0] * 30, trained) == 0
    filling = [min(i, 8) * 400.0 for i in range(30)]
    assert flat_from(filling, trained) == 8
    # noise of +-2 % of a step's tokens around a flat stock opens it; one spike does not hold it shut for long
    noisy = [3000.0 + (20.0 if i % 2 else -20.0) for i in range(30)]
    assert flat_from(noisy, trained) == 0
    spiked = [3000.0] * 30
    spiked[2] = 9000.0
    assert flat_from(spiked, trained) == 3
    # a stock drawn down (shrinking) is not flat either: it lends the window tokens generated before it
    assert flat_from([9000.0 - 200.0 * i for i in range(30)], trained) is None
    assert flat_from([1.0] * (FLAT_STEPS - 1), trained[:FLAT_STEPS - 1]) is None  # too short to fit
    with pytest.raises(ValueError, match="stock readings"):
        flat_from([1.0] * 10, trained)


def _stocked(label: str, stocks: list[float], rep: int = 0, kind: str = "d"):
    r = _marked(label, rep, kind=kind, eta=2 if kind == "d" else -1, steps=len(stocks))
    r.stocks = stocks
    return r


def test_every_contender_is_read_from_the_latest_opening_to_the_common_end():
    from scripts.bench.peer import window_by_stock
    from scripts.bench.peer_contenders import Workload
    from scripts.bench.peer_steady import common_window

    steps = 20
    pipeline = _stocked("pipeline eta 2", [2000.0] * steps)
    fa = _stocked("slime fully async 1x", [min(i, 7) * 500.0 for i in range(steps)], kind="c")
    first, last, openings = common_window([pipeline, fa], steps)
    assert openings == {"pipeline eta 2": 0, "slime fully async 1x": 7}
    assert (first, last) == (7, steps - 3)  # the latest opening; the last two steps are the drain
    growing = _stocked("slime fully async 4x", [300.0 * i for i in range(steps)], kind="c")
    assert common_window([pipeline, fa, growing], steps)[2]["slime fully async 4x"] is None
    window_by_stock([pipeline, fa, growing], Workload(time_scale=50.0, steps=steps), quiet=True)
    assert all((r.window["first"], r.window["last"]) == (7, steps - 3) for r in (pipeline, fa, growing))
    assert growing.window["flat_from"] == -1 and fa.window["flat_from"] == 7


def test_the_engine_reports_the_output_its_held_requests_made_so_far():
    """The engine's part of a contender's stock (`held_output_tokens`): what its running and
    waiting requests produced and have not yet answered; a finished request leaves it."""
    from workers.sim.engine import SimConfig, SimEngine
    from workers.sim.scheduler import SimReq

    engine = SimEngine(SimConfig(token_latency_s=0.004))
    sch = engine.scheduler
    assert sch is not None
    sch.on_token = None  # stepped here, not served: no HTTP caller waits on the tokens
    for i, length in enumerate((3, 9)):
        sch.add(SimReq(f"r{i}", [1, 2, 3], [7] * length, 16))
    held = []
    for _ in range(5):
        sch.step()
        held.append(engine.physics_stats()["held_output_tokens"])
    assert held == [2, 4, 3, 4, 5]  # both make a token a step; the 3-token answer leaves with its third
