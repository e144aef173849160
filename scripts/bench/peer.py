"""Against the peer, side by side (issues 17 and 25): slime's OWN rollout code next to this
pipeline, on the same simulated workload, in one run: a frontier of trained tokens/s against lag.

    python -m scripts.bench.peer [--quick] [--repeats 3] [--json out.json] [--plot peer.png]
    python -m scripts.bench.peer --contenders a,b,c,d,e       # the five single points (issue 17)

The frontier (the default, issue 25), per repeat and in this order, each on a fresh engine:
  sync      slime's synchronous generate_rollout (contender a)
  fa Nx     slime's fully_async_rollout (contender c) at sglang_server_concurrency = 1x, 2x, 4x
            the engine's slots; the best of the three by trained tokens/s is the one compared
  eta E     this pipeline (contender d) at eta 1, 2, 4, 8 and at the eta equal to the maximum lag
            the best fully-async run showed in this repeat (run again only if not in 1, 2, 4, 8)
Goals (issue 25 item 2), medians of the repeats with the worst repeat beside, printed met/missed.

The contenders and how each is run and counted: scripts/bench/peer_contenders.py.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections import Counter as Tally
from collections.abc import Callable, Sequence
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np

from scripts.bench.peer_contenders import (
    CONTENDERS,
    END_RULE,
    WORKLOADS,
    Result,
    Workload,
    finish,
    length_plan,
    run_contender,
    write_inputs,
)
from scripts.bench.peer_steady import (
    CAPACITY,
    ENGINES_LABEL,
    FLAT_SHARE,
    FLAT_STEPS,
    apply_window,
    capacities,
    capacity_run,
    capacity_summary,
    common_window,
    engines_goals,
    engines_table,
    ideal_lines,
    steady_goals,
    steady_table,
    stock_line,
    stock_opening,
    window,
)
from scripts.bench.report import Figure

FRONTIER_ETAS = (1, 2, 4, 8)
FA_SWEEP = (1, 2, 4)
# slime's --sglang-server-concurrency default (slime/backends/sglang_utils/arguments.py, pinned)
SLIME_DEFAULT_CONCURRENCY = 512  # fully async's sglang_server_concurrency, in multiples of the engine's slots
# `--quick` (under 3 minutes on 2 cores): 5 steps, one repeat, fully async at its usual best (1x)
QUICK_ETAS = (1, 2, 4)
QUICK_STEPS = 8  # a steady window needs steps past warm-up (eta + 2) and drain (2)
QUICK_SWEEP = (1,)
FCFS = "pipeline (FCFS engine) eta"  # --fcfs: the same points on an engine without priority scheduling
FA_BEST = "slime fully async, best of the sweep"
DEFAULT_WORKLOAD = "areal-7b"
AREAL_SPEEDUP = 2.77  # AReaL (Fu et al. 2025): async RL vs synchronous, same hardware
LENGTH_GOAL_PCT = 2.0
WASTE_GOAL_PCT = 1.0
SAME_LAG_TOKENS_GOAL = 1.25  # trained tokens/s at fully async's own max lag, vs fully async
AFTER_PUSH_S = 0.5  # slot use in this window after each weight push is reported apart


def _pct(values: Sequence[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def length_bias(r: Result) -> tuple[float, float]:
    """Trained vs planned response length, mean and p90, in percent."""
    if not r.trained_lengths or not r.planned_lengths:
        return float("nan"), float("nan")
    mean = 100.0 * (np.mean(r.trained_lengths) / np.mean(r.planned_lengths) - 1.0)
    p90 = 100.0 * (_pct(r.trained_lengths, 90) / _pct(r.planned_lengths, 90) - 1.0)
    return float(mean), float(p90)


def slot_use(r: Result, slots: int) -> tuple[float, float]:
    """Busy slots / slots over the loop, and in the AFTER_PUSH_S after each weight push."""
    if not r.slot_samples:
        return float("nan"), float("nan")
    busy = np.array([b for _t, b in r.slot_samples], dtype=float) / slots
    times = np.array([t for t, _b in r.slot_samples])
    after = np.zeros(len(times), dtype=bool)
    for push in r.push_times:
        after |= (times >= push) & (times < push + AFTER_PUSH_S)
    return float(busy.mean()), float(busy[after].mean()) if after.any() else float("nan")


def ceiling_tokens_per_s(r: Result, eta: int | None = None) -> float:
    """The EARLIEST SCHEDULE with lag <= eta on this run's own measured durations, in trained
    tokens/s (docs/benchmarks.md, "What limits eta 1 and 2"). Not a bound over every schedule:
    another schedule changes the durations themselves (which requests share the engine, how long
    each decode takes), and slime's sync once ran above the eta-0 figure of the same groups.

    Step k may start (S_k) only after step k-1's training and weight push (tau_k, measured):
    S_k >= S_{k-1} + tau_{k-1}. A group trained at step k has lag <= eta, so it was admitted at
    version k - eta or later, which is out at S_{k-eta-1} + tau; it cannot start earlier, and
    the step cannot start before it ends: S_k >= S_{k-eta-1} + tau + D_k, D_k the longest
    episode the step trained (measured). The earliest S_k by these two rules (a max-plus
    recursion; tests/test_bench_peer.py checks it against a brute-force search over every
    admission version and delay on small instances), plus the last step's own tau, is the
    least wall time for these steps with these durations. (The first eta + 1 steps take groups
    admitted before the clock started.) `eta` other than the run's: the same schedule for the
    same groups and overheads at that lag (eta 0: the earliest synchronous schedule)."""
    eta = r.eta if eta is None else eta
    if eta < 0 or not r.steps or len(r.cohort_tails_s) != r.steps or len(r.step_overheads_s) != r.steps:
        return float("nan")
    tau, tails = r.step_overheads_s, r.cohort_tails_s
    starts = [0.0]
    for k in range(1, r.steps):
        earliest = starts[k - 1] + tau[k - 1]
        if k > eta:
            earliest = max(earliest, starts[k - eta - 1] + tau[k - eta - 1] + tails[k])
        starts.append(earliest)
    return r.trained_tokens / (starts[-1] + tau[-1])


def waste_pct(r: Result) -> float:
    return 100.0 * r.untrained_tokens / r.engine_tokens if r.engine_tokens else 0.0


def table(results: list[Result], plan: list[int], wl: Workload) -> str:
    """Issue 17's table: one row per contender, one run each."""
    head = ("| contender | groups/s | generated tok | trained tok | carried over | never trained (share) | "
            "lag per call: mean / max / share > 0 | trained len mean / p90 | plan len mean / p90 |")
    lines = [head, "|" + "---|" * 9]
    for r in results:
        if not r.ran:
            lines.append(f"| ({r.contender}) {r.name} | could not run: {r.reason} |||||||| ")
            continue
        lags = np.array(r.lags) if r.lags else np.zeros(1)
        share = r.untrained_tokens / r.engine_tokens if r.engine_tokens else 0.0
        lines.append(
            f"| ({r.contender}) {r.name} | {r.groups_per_s:.2f} | {r.engine_tokens:,} | {r.trained_tokens:,} | "
            f"{r.carried_tokens:,} | {r.untrained_tokens:,} ({share:.1%}) | "
            f"{lags.mean():.2f} / {int(lags.max())} / {(lags > 0).mean():.0%} | "
            f"{np.mean(r.trained_lengths):.0f} / {_pct(r.trained_lengths, 90):.0f} | "
            f"{np.mean(r.planned_lengths or plan):.0f} / {_pct(r.planned_lengths or plan, 90):.0f} |")
    return "\n".join(lines)


# ------------------------------------------------------------------ the frontier (issue 25)


def max_lag(r: Result) -> int:
    return max(r.lags) if r.lags else 0


def run_frontier(wl: Workload, workdir: Path, tasks: Path, prompts: Path, *, repeats: int,
                 etas: tuple[int, ...] = FRONTIER_ETAS, sweep: tuple[int, ...] = FA_SWEEP,
                 fcfs: bool = False, syncs: tuple[int, ...] = (SLIME_DEFAULT_CONCURRENCY,), same_lag: bool = True,
                 engines: tuple[int, ...] = (), checkpoint: Callable[[list[Result]], None] | None = None,
                 pipeline_push_modes: tuple[str, ...] = ("abort",), engines_scale_batch: bool = False,
                 engines_only: bool = False) -> list[Result]:
    """Per repeat: the engine's capacity (the workload alone), the pipeline at eta 2, fully async
    at the first multiple in `sweep`, slime sync at each concurrency in `syncs`, fully async at the
    other multiples, the other etas (and the pipeline at the best fully-async run's max lag, `same_lag`): the goal's points
    first, so a run cut short keeps them. After the first repeat, once: the pipeline at eta 2 and
    fully async at that repeat's best multiple with each engine count in `engines` (> 1) behind
    one router. Every run on fresh engines, one after the other, read over the same steady
    window; `checkpoint(results)` after each run (the raw dump, so a cut run can be reported).
    `engines_scale_batch`: the engines runs take B x N groups a step (the planner's advice for N
    engines fed by one trainer, `rollout plan`); `engines_only`: each repeat is the capacity run and
    the engines runs alone (fully async at the sweep's first multiple), in every repeat."""
    results: list[Result] = []
    first, last = window(wl.steps, max(etas, default=2))
    print(f"[peer] provisional window: steps {first}..{last} of 0..{wl.steps - 1}; after each repeat every contender "
          f"is read again over the window its stock sets (peer_steady.common_window)", flush=True)

    def one(kind: str, label: str, run_wl: Workload, rep: int) -> Result:
        t0 = time.monotonic()
        r = finish(run_contender(kind, run_wl, workdir, tasks, prompts, quiet=True, label=f"r{rep} {label}"), run_wl)
        apply_window(r, first, last, run_wl)
        r.label, r.repeat = label, rep
        bias = length_bias(r)[0]
        print(f"[peer] repeat {rep + 1}/{repeats} {label}: " + (
            f"steady {r.groups_per_s:.4f} groups/s, {r.trained_tokens_per_s:.0f} trained tok/s per engine-clock s "
            f"(per wall s: window {r.window.get('wall_tokens_per_s', float('nan')):.0f}, whole run "
            f"{r.run_tokens_per_s:.0f}; window clock {r.window.get('clock_rate', float('nan')):.2f} of the scale), length {bias:+.1f}%, lag mean {np.mean(r.lags) if r.lags else 0:.2f} max "
            f"{max_lag(r)}, never trained {waste_pct(r):.1f}%, slot use {slot_use(r, wl.slots)[0]:.2f}, "
            f"engine clock {clock_cell([r], wl)} of the time scale "
            f"({time.monotonic() - t0:.0f} s)" if r.ran else f"could not run: {r.reason}"), flush=True)
        results.append(r)
        if checkpoint is not None:
            checkpoint(results)
        return r

    best_ks: list[int] = []
    for rep in range(repeats):
        t0 = time.monotonic()
        cap = capacity_run(wl, workdir, tasks, label=f"r{rep} capacity")
        cap.repeat = rep
        results.append(cap)
        print(f"[peer] repeat {rep + 1}/{repeats} {CAPACITY}: " + (
            f"{cap.trained_tokens_per_s:.0f} generated tok/s per engine-clock s ({cap.run_tokens_per_s:.0f} per wall s), "
            f"window clock {cap.window.get('clock_rate', float('nan')):.2f} of the scale; {cap.notes[-1]} "
            f"({time.monotonic() - t0:.0f} s)" if cap.ran else f"could not run: {cap.reason}"), flush=True)
        if engines_only:
            engines_runs(one, wl, engines, sweep[0], pipeline_push_modes[-1], rep, engines_scale_batch)
            window_by_stock([r for r in results if r.repeat == rep], wl)
            continue
        by_eta = {eta: one("d", f"pipeline eta {eta}", replace(wl, eta=eta), rep) for eta in etas if eta == 2}
        for mode in (m for m in pipeline_push_modes if m != "abort"):  # the pipeline's own default push
            one("d", f"pipeline eta 2{push_suffix(mode)}", replace(wl, eta=2, push_mode=mode), rep)
        fa = [one("c", f"slime fully async {k}x", replace(wl, concurrency=k * wl.slots), rep) for k in sweep[:1]]
        for concurrency in syncs:
            one("a", sync_label(concurrency, wl), replace(wl, concurrency=concurrency), rep)
        fa += [one("c", f"slime fully async {k}x", replace(wl, concurrency=k * wl.slots), rep) for k in sweep[1:]]
        ran = [r for r in fa if r.ran]
        best = max(ran, key=lambda r: r.trained_tokens_per_s) if ran else None
        if best is not None:
            best.notes.append("best fully async of this repeat (trained tokens/s)")
            best_ks.append(best.concurrency // wl.slots)
        by_eta.update({eta: one("d", f"pipeline eta {eta}", replace(wl, eta=eta), rep) for eta in etas if eta != 2})
        if fcfs:  # the ablation: what the requests' priority buys (issue 25 item 3)
            for eta in etas:
                one("d", f"{FCFS} {eta}", replace(wl, eta=eta, priority_scheduling=False), rep)
        if best is not None and same_lag:
            target = max(1, max_lag(best))
            same = by_eta.get(target) or one("d", f"pipeline eta {target}", replace(wl, eta=target), rep)
            twin = replace(same, label="pipeline eta = fully async's max lag", notes=[*same.notes, f"eta {target}"])
            results.append(twin)
        if rep == 0:  # after the first repeat: a run cut short keeps them
            engines_runs(one, wl, engines, best_ks[0] if best_ks else 1, pipeline_push_modes[-1], 0, engines_scale_batch)
        window_by_stock([r for r in results if r.repeat == rep], wl)  # the repeat's engines runs too
        if checkpoint is not None:
            checkpoint(results)
    return results


def engines_runs(one: Callable[[str, str, Workload, int], Result], wl: Workload, engines: tuple[int, ...], k: int,
                 mode: str, rep: int, scale_batch: bool) -> None:
    """The pipeline at eta 2 and fully async at k x slots, with each engine count (> 1) behind one
    router; with `scale_batch`, B x N groups a step (fully async's concurrency is per engine already, as
    slime multiplies --sglang-server-concurrency by the engines)."""
    for n in (n for n in engines if n > 1):
        batch = wl.batch * n if scale_batch else wl.batch
        one("d", f"pipeline eta 2{push_suffix(mode)}, {n}{ENGINES_LABEL}",
            replace(wl, eta=2, engines=n, push_mode=mode, batch=batch), rep)
        one("c", f"slime fully async {k}x, {n}{ENGINES_LABEL}",
            replace(wl, concurrency=k * wl.slots, engines=n, batch=batch), rep)


def push_suffix(mode: str) -> str:
    return "" if mode == "abort" else f" ({mode} push)"


def sync_label(concurrency: int, wl: Workload) -> str:
    if concurrency == SLIME_DEFAULT_CONCURRENCY:
        return f"slime sync, concurrency {concurrency} (slime's default)"
    return f"slime sync, concurrency {concurrency}" + (" (the KV pool's)" if concurrency == wl.slots else "")


def _rows(results: list[Result]) -> dict[str, list[Result]]:
    rows: dict[str, list[Result]] = {}
    for r in results:
        if r.contender != "cap":  # the capacity runs: a row of the steady table of their own
            rows.setdefault(r.label, []).append(r)
    best = [r for r in results if "best fully async of this repeat (trained tokens/s)" in r.notes]
    if best:
        rows[FA_BEST] = best
    order = sorted(rows, key=lambda label: (not label.startswith("slime sync"), not label.startswith("slime fully"),
                                            label.startswith("pipeline eta ="), _eta_of(label)))
    return {label: rows[label] for label in order}


def _eta_of(label: str) -> int:
    tail = label.rsplit(" ", 1)[-1]
    return int(tail) if tail.isdigit() else 0


def _mid(values: list[float]) -> tuple[float, float, float]:
    return statistics.median(values), min(values), max(values)


def _fmt(values: list[float], spec: str = ".2f") -> str:
    mid, lo, hi = _mid(values)
    return f"{mid:{spec}} ({lo:{spec}}-{hi:{spec}})" if len(values) > 1 else f"{mid:{spec}}"


def _stat(r: Result, key: str) -> float | None:
    return r.engine_stats.get(key)


def _kv_max(r: Result) -> float | None:
    used, pool = _stat(r, "max_kv_used"), _stat(r, "kv_pool_tokens")
    return used / pool if used is not None and pool else None


def _kv_mean(r: Result) -> float | None:
    """KV tokens in use averaged over the engine's busy simulated time, over the pool."""
    token_s, busy, pool = _stat(r, "kv_used_token_s"), _stat(r, "busy_s"), _stat(r, "kv_pool_tokens")
    return token_s / busy / pool if token_s is not None and busy and pool else None


# the engine's own counters (GET /sim/stats and /server_info at the end of each run); an engine
# that does not keep one (the per-request-speed simulator keeps none) prints "not kept"
ENGINE_COUNTERS: tuple[tuple[str, Callable[[Result], float | None], str], ...] = (
    ("KV pool use max / mean busy", _kv_max, ".2f"),
    ("", _kv_mean, ".2f"),
    ("preemptions", lambda r: _stat(r, "preemptions"), ".0f"),
    ("retractions", lambda r: _stat(r, "retractions"), ".0f"),
    ("prefill tok computed / cached", lambda r: _stat(r, "prefill_tokens"), ".0f"),
    ("", lambda r: _stat(r, "cached_tokens"), ".0f"),
)


def _counter_cell(ran: list[Result], counter: Callable[[Result], float | None], spec: str) -> str:
    values = [counter(r) for r in ran]
    return "not kept" if any(v is None for v in values) else _fmt([float(v) for v in values if v is not None], spec)


def _counter_cells(ran: list[Result]) -> str:
    """The engine counters, a column each; a title "" joins its value to the column before."""
    cells: list[str] = []
    for title, counter, spec in ENGINE_COUNTERS:
        cell = _counter_cell(ran, counter, spec)
        if title or not cells:
            cells.append(cell)
        elif cells[-1] != cell or cell != "not kept":
            cells[-1] += f" / {cell}"
    return " | ".join(cells)


ENGINE_TITLES = [title for title, _c, _s in ENGINE_COUNTERS if title]


def clock_cell(ran: list[Result], wl: Workload) -> str:
    """How well the engine's step loop kept the time scale (1.00: exactly): the median and p10 of
    its simulated seconds per wall second over busy windows, over the scale, worst repeat shown."""
    rates = [r.clock_rates for r in ran if r.clock_rates]
    if len(rates) < len(ran):
        return "not kept"
    p50 = min(_pct(x, 50) for x in rates) / wl.time_scale
    p10 = min(_pct(x, 10) for x in rates) / wl.time_scale
    return f"{p50:.2f} ({p10:.2f})"


def frontier_table(results: list[Result], wl: Workload) -> str:
    head = ("| contender | groups/s, steady | trained response tok/s, steady, engine clock | vs best fully async, same repeat | trained len mean / p90 "
            "| plan len mean / p90 | length bias mean / p90 | engine slot use (after pushes) | lag mean / max | "
            "lag distribution (calls) | tokens never trained | re-prefilled tok per push | "
            + " | ".join(ENGINE_TITLES) +
            " | engine clock / time scale, busy windows p50 (p10) | earliest schedule tok/s at lag <= eta, on this run's "
            "measured durations, whole run, capped at the measured capacity |")
    lines = [head, "|" + "---|" * (14 + len(ENGINE_TITLES))]
    rows = _rows(results)
    fa_runs = rows.get(FA_BEST, [])
    caps = capacities(results)
    for label, runs in rows.items():
        ran = [r for r in runs if r.ran]
        if not ran:
            lines.append(f"| {label} | could not run: {runs[0].reason} |" + " |" * (12 + len(ENGINE_TITLES)))
            continue
        tl = [float(np.mean(r.trained_lengths)) for r in ran]
        tp = [_pct(r.trained_lengths, 90) for r in ran]
        pl = [float(np.mean(r.planned_lengths)) if r.planned_lengths else float("nan") for r in ran]
        pp = [_pct(r.planned_lengths, 90) for r in ran]
        bias = [length_bias(r) for r in ran]
        use = [slot_use(r, wl.slots) for r in ran]
        lags = Tally(lag for r in ran for lag in r.lags)
        dist = " ".join(f"{k}:{v}" for k, v in sorted(lags.items()))
        etas = sorted({e for r in ran for e in [_eta_note(r)] if e})
        shown = label + (f" ({', '.join(map(str, etas))})" if label.startswith("pipeline eta =") else "")
        vs_fa = ratio_text(per_repeat_ratios(ran, fa_runs, lambda r: r.trained_tokens_per_s))
        lines.append(
            f"| {shown} | {_fmt([r.groups_per_s for r in ran])} | {_fmt([r.trained_tokens_per_s for r in ran], '.0f')} | "
            f"{vs_fa} | {_fmt(tl, '.1f')} / {_fmt(tp, '.0f')} | {_fmt(pl, '.1f')} / {_fmt(pp, '.0f')} | "
            f"{_fmt([b[0] for b in bias], '+.1f')} % / {_fmt([b[1] for b in bias], '+.1f')} % | "
            f"{_fmt([u[0] for u in use])} ({_fmt([u[1] for u in use])}) | "
            f"{_fmt([float(np.mean(r.lags)) if r.lags else 0.0 for r in ran])} / {max(max_lag(r) for r in ran)} | {dist} | "
            f"{_fmt([waste_pct(r) for r in ran], '.1f')} % | "
            f"{_fmt([r.resumed_input_tokens / max(1, len(r.push_times)) for r in ran], '.0f')} | "
            + _counter_cells(ran) + f" | {clock_cell(ran, wl)} | "
            f"{_fmt([capped_earliest(r, caps) for r in ran], '.0f') if ran[0].eta >= 0 else '-'} |")
    return "\n".join(lines)


def capped_earliest(r: Result, caps: dict[int, Result]) -> float:
    """The earliest schedule's tokens/s (whole run, on its own durations), never above the engine's
    measured capacity of the same repeat: that schedule packs the groups tighter while keeping their
    durations, which assumes engine throughput the capacity run shows is not there."""
    earliest = ceiling_tokens_per_s(r)
    cap = caps.get(r.repeat)
    return min(earliest, cap.trained_tokens_per_s) if cap is not None else earliest


def _eta_note(r: Result) -> int:
    for note in r.notes:
        if note.startswith("eta ") and note[4:].isdigit():
            return int(note[4:])
    return 0


def cpu_table(results: list[Result], wl: Workload) -> str:
    """CPU per trained group, per process (medians over repeats)."""
    lines = ["| contender | CPU ms per trained group, per process (median over repeats) |", "|---|---|"]
    for label, runs in _rows(results).items():
        ran = [r for r in runs if r.ran and r.cpu_s]
        if not ran:
            continue
        names = list(ran[0].cpu_s)
        parts = [f"{name} {statistics.median(r.cpu_s.get(name, float('nan')) * 1e3 / (r.steps * wl.batch) for r in ran):.1f}"
                 for name in names]
        lines.append(f"| {label} | {', '.join(parts)} |")
    return "\n".join(lines)
def _by_repeat(runs: list[Result]) -> dict[int, Result]:
    return {r.repeat: r for r in runs if r.ran}



def per_repeat_ratios(mine: list[Result], base: list[Result], value) -> list[float]:
    """value(mine) / value(base) for every repeat both ran, in repeat order. THE aggregation rule
    of every ratio this bench prints (tables, goals, docs): the median of these per-repeat
    ratios with the worst beside it (`ratio_text`), never a ratio of medians."""
    a, b = _by_repeat(mine), _by_repeat(base)
    return [value(a[k]) / value(b[k]) for k in sorted(set(a) & set(b)) if value(b[k])]


def ratio_text(ratios: list[float]) -> str:
    if not ratios:
        return "-"
    med = statistics.median(ratios)
    return f"{med:.2f}x (worst {min(ratios):.2f}x)" if len(ratios) > 1 else f"{med:.2f}x"


def goals(results: list[Result]) -> list[Figure]:
    """Issue 25 item 2, each printed met or missed: ratios are medians of the per-repeat ratios
    (`per_repeat_ratios`), the worst repeat beside."""
    rows = _rows(results)
    fa_runs = rows.get(FA_BEST, [])
    sync_runs = rows.get("slime sync") or next((v for k, v in rows.items() if k.startswith("slime sync")), [])
    fa = _by_repeat(fa_runs)
    figures: list[Figure] = []
    if not fa:
        return [Figure(section="peer", name="slime fully async did not run: no goal can be checked", value=float("nan"),
                       unit="", goal="fully async runs", met=False)]
    fa_tok = statistics.median(r.trained_tokens_per_s for r in fa.values())
    fa_bias = statistics.median(length_bias(r)[0] for r in fa.values())
    for label, runs in rows.items():
        if not label.startswith("pipeline") or ENGINES_LABEL in label:
            continue
        mine = _by_repeat(runs)
        common = sorted(set(mine) & set(fa))
        if not common:
            continue
        ratios = per_repeat_ratios(runs, fa_runs, lambda r: r.trained_tokens_per_s)
        tok = statistics.median(mine[k].trained_tokens_per_s for k in common)
        biases = [length_bias(mine[k])[0] for k in common]
        worst_bias = max(biases, key=abs)
        same_lag = label.startswith("pipeline eta =")
        want = SAME_LAG_TOKENS_GOAL if same_lag else 1.0
        figures.append(Figure(
            section="peer", name=f"{label}: trained response tokens/s {tok:.0f} (median, steady state), vs fully async "
            f"{ratio_text(ratios)} (median of per-repeat ratios); trained length vs plan median "
            f"{statistics.median(biases):+.1f} % (worst {worst_bias:+.1f} %; fully async {fa_bias:+.1f} %)",
            value=tok, unit="tok/s", baseline="slime fully async, best concurrency, same run (median)",
            baseline_value=fa_tok, ratio=statistics.median(ratios),
            goal=f">= {want:g}x fully async's trained tokens/s, length within {LENGTH_GOAL_PCT:g} % of the plan",
            met=statistics.median(ratios) >= want and abs(statistics.median(biases)) <= LENGTH_GOAL_PCT))
        if same_lag:
            g = per_repeat_ratios(runs, fa_runs, lambda r: r.groups_per_s)
            figures.append(Figure(
                section="peer", name=f"{label}: groups/s vs fully async {ratio_text(g)} (median of per-repeat ratios)",
                value=statistics.median(mine[k].groups_per_s for k in common), unit="groups/s",
                baseline="slime fully async, best concurrency (median)",
                baseline_value=statistics.median(r.groups_per_s for r in fa.values()),
                ratio=statistics.median(g), goal=">= 1x fully async's groups/s", met=statistics.median(g) >= 1.0))
        waste = max(waste_pct(r) for r in mine.values())
        skipped = sum(r.counters.get("stale", 0) + r.counters.get("discarded", 0) for r in mine.values())
        over = [r for r in mine.values() if r.eta >= 0 and max_lag(r) > r.eta]
        figures.append(Figure(
            section="peer", name=f"{label}: tokens not trained by the end (no contender drained: finished answers of "
            f"groups still running count), worst repeat {waste:.2f} %; groups discarded or stale "
            f"(a due group skipped) {skipped}; runs with lag over eta {len(over)}", value=waste, unit="%",
            goal=f"<= {WASTE_GOAL_PCT:g} %, no due group skipped, lag <= eta, every repeat",
            met=waste <= WASTE_GOAL_PCT and skipped == 0 and not over))
    eta2_runs = rows.get("pipeline eta 2", [])
    speed = per_repeat_ratios(eta2_runs, sync_runs, lambda r: r.groups_per_s)
    if speed:
        eta2 = _by_repeat(eta2_runs)
        figures.append(Figure(
            section="peer", name=f"pipeline eta 2 vs slime sync, groups/s {ratio_text(speed)} (median of per-repeat "
            f"ratios; each repeat: {', '.join(f'{x:.2f}x' for x in speed)})",
            value=statistics.median(r.groups_per_s for r in eta2.values()), unit="groups/s",
            baseline="slime sync, same repeats (median)",
            baseline_value=statistics.median(r.groups_per_s for r in _by_repeat(sync_runs).values()),
            ratio=statistics.median(speed), goal=f">= {AREAL_SPEEDUP}x in the worst repeat (AReaL)",
            met=min(speed) >= AREAL_SPEEDUP))
    return figures


def plot(results: list[Result], path: Path) -> Path | None:
    """Trained tokens/s (median) against max lag, one line per contender, length bias by each point."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("[peer] no plot: matplotlib is not installed (pip install -e '.[bench]')", file=sys.stderr)
        return None
    lines: dict[str, list[tuple[float, float, float, str]]] = {}
    for label, runs in _rows(results).items():
        ran = [r for r in runs if r.ran]
        if not ran or label == FA_BEST or label.startswith("pipeline eta =") or ENGINES_LABEL in label:
            continue  # repeats of points drawn already (the best concurrency; the per-repeat etas)
        family = ("slime sync" if label.startswith("slime sync") else "slime fully async (1x, 2x, 4x slots)"
                  if label.startswith("slime fully") else "this pipeline, due-first, FCFS engine" if label.startswith(FCFS)
                  else "this pipeline, in_place push" if "(in_place push)" in label
                  else "this pipeline, due-first, engine with priority scheduling")
        x = statistics.median(max_lag(r) for r in ran)
        y = statistics.median(r.trained_tokens_per_s for r in ran)
        bias = statistics.median(length_bias(r)[0] for r in ran)
        lines.setdefault(family, []).append((x, y, bias, label))
    fig, ax = plt.subplots(figsize=(8, 5))
    for family, points in lines.items():
        points.sort()
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=family)
        for x, y, bias, _label in points:
            ax.annotate(f"{bias:+.1f}%", (x, y), textcoords="offset points", xytext=(4, 6), fontsize=8)
    caps = capacities(results)
    if caps:
        ax.axhline(statistics.median(r.trained_tokens_per_s for r in caps.values()), color="grey", linestyle="--",
                   label="the engine's capacity (workload alone, saturated; generated)")
    ax.set_xlabel("max lag of a trained generate call (policy versions)")
    ax.set_ylabel("trained response tokens / s, steady, engine clock (median of repeats)")
    ax.set_title("Trained tokens/s vs max lag (label: trained length vs the engine's plan)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def run_summary(r: Result, wl: Workload) -> dict:
    """One run, compact (a few hundred bytes): what the tables and goals are computed from, with
    the per-call lags as a distribution and the lengths as means and p90s."""
    bias, use = length_bias(r), slot_use(r, wl.slots)
    keep = ("contender", "label", "repeat", "eta", "concurrency", "ran", "reason", "steps", "wall_s", "groups_per_s",
            "trained_tokens_per_s", "engine_tokens", "trained_tokens", "carried_tokens", "untrained_tokens",
            "resumed_requests", "resumed_input_tokens", "samples_without_tokens", "samples_without_log_probs",
            "cpu_s", "counters", "engine_stats", "window", "run_tokens_per_s", "run_groups_per_s", "step_marks")
    out = {k: getattr(r, k) for k in keep}
    out.update(
        lag_calls={str(k): v for k, v in sorted(Tally(r.lags).items())},
        trained_len_mean=round(float(np.mean(r.trained_lengths)), 1) if r.trained_lengths else None,
        trained_len_p90=_pct(r.trained_lengths, 90) if r.trained_lengths else None,
        plan_len_mean=round(float(np.mean(r.planned_lengths)), 1) if r.planned_lengths else None,
        plan_len_p90=_pct(r.planned_lengths, 90) if r.planned_lengths else None,
        length_bias_pct=[round(x, 2) for x in bias], slot_use=[round(x, 3) for x in use], pushes=len(r.push_times),
        earliest_schedule_tok_s=round(ceiling_tokens_per_s(r), 1) if r.eta >= 0 else None,
        engine_clock_rate_p10_p50=[_pct(r.clock_rates, 10), _pct(r.clock_rates, 50)] if r.clock_rates else None,
        notes=[note[:200] for note in r.notes])
    return out


def summary(results: list[Result], wl: Workload, *, repeats: int, seconds: float, figures: list[Figure],
            command: str) -> dict:
    """What docs/ keeps of a run (well under 100 kB); the raw per-record dump (`--raw`) is
    regenerated by running `command` again."""
    return {"command": command, "workload": asdict(wl), "workload_text": wl.describe(), "repeats": repeats,
            "seconds": round(seconds, 1), "aggregation": "median of the repeats (min-max); every ratio: median of "
            "per-repeat ratios, worst repeat beside", "runs": [run_summary(r, wl) for r in results],
            "goals": [f.line() for f in figures], "table": frontier_table(results, wl),
            "steady_table": steady_text(results, wl), "capacity": [capacity_summary(r, wl) for r in results
                                                                   if r.contender == "cap" and r.ran]}


def _lag_text(ran: list[Result]) -> str:
    return f"{_fmt([float(np.mean(r.lags)) if r.lags else 0.0 for r in ran])} / {max(max_lag(r) for r in ran)}"


def steady_text(results: list[Result], wl: Workload) -> str:
    """The steady-state table, the bound's ideal against capacity, the engines-per-trainer table."""
    rows = _rows(results)
    etas = sorted({r.eta for r in results if r.contender == "d" and r.eta >= 0} | {2})
    windows = {(r.window["first"], r.window["last"]) for r in results if "first" in r.window}
    head = (f"Steady state over steps {', '.join(f'{a}..{b}' for a, b in sorted(windows))} of 0..{wl.steps - 1} "
            f"(every contender alike: from the latest step at which a contender's stock went flat, where it did, to "
            f"the drain; warm-up and drain outside); rates per second of the engine's clock; {END_RULE}.")
    caps = capacities(results)
    parts = [head, steady_table(rows, caps, rows.get(FA_BEST, []), lag_text=_lag_text,
                                bias_of=lambda r: length_bias(r)[0], waste_of=waste_pct),
             *ideal_lines(wl, etas, caps)]
    stocked = [r for r in results if r.ran and r.stocks]
    if stocked:
        parts += ["Stock per step (tokens generated or generating, not yet trained: the engines' held requests plus "
                  f"the contender's finished and requeued groups; flat: least-squares slope over {FLAT_STEPS} steps "
                  f"within +-{FLAT_SHARE:.0%} of the tokens trained a step):", *(stock_line(r) for r in stocked)]
    engines = engines_table(rows, caps, wl)
    if engines:
        parts += ["Engines per trainer (one router in front; 1 engine: the repeats' median, more: one run each):", engines]
    return "\n".join(parts)


def report(results: list[Result], wl: Workload, *, repeats: int, seconds: float, plot_path: Path | None,
           json_path: str, raw_path: str, command: str) -> list[Figure]:
    """Tables, goals, plot; the compact summary to json_path, every record to raw_path."""
    print(f"\n{wl.describe()}; the pipeline due-first, {wl.pipeline_groups()} groups in flight; {repeats} repeat(s), "
          f"median (min-max); every ratio the median of per-repeat ratios (worst beside). Run took {seconds:.0f} s.")
    print(steady_text(results, wl))
    print("\nThe frontier, steady state (columns as in issue 25's table):")
    print(frontier_table(results, wl))
    print(cpu_table(results, wl))
    rows = _rows(results)
    figures = steady_goals(rows, capacities(results), wl, rows.get(FA_BEST, []),
                           bias_of=lambda r: length_bias(r)[0]) + engines_goals(rows, capacities(results), wl) + goals(results)
    path = plot(results, plot_path) if plot_path else None
    if path is not None:
        print(f"[peer] plot: {path}")
    if json_path:
        Path(json_path).write_text(json.dumps(summary(results, wl, repeats=repeats, seconds=seconds, figures=figures,
                                                      command=command), indent=1))
    if raw_path:
        dump_raw(results, wl, raw_path, repeats, seconds, command)
    return figures


def dump_raw(results: list[Result], wl: Workload, raw_path: str, repeats: int, seconds: float, command: str) -> None:
    begun = len({r.repeat for r in results}) or 1  # a cut run: the repeats it began
    Path(raw_path).write_text(json.dumps({"command": command, "workload": asdict(wl), "repeats": min(repeats, begun),
                                          "seconds": round(seconds, 1), "results": [asdict(r) for r in results]}))


def load_raw(*paths: Path) -> tuple[list[Result], Workload, int, float]:
    """Raw dumps (`--raw`, or an earlier bench's `--json`, which held every record); several
    runs of the same workload are read as consecutive repeats of one (their repeat numbers
    shifted), so repeats run one invocation at a time add up."""
    results: list[Result] = []
    workloads: list[Workload] = []
    repeats, seconds = 0, 0.0
    for path in paths:
        data = json.loads(path.read_text())
        known = set(Workload.__dataclass_fields__)
        workloads.append(replace(Workload(**{k: v for k, v in data["workload"].items() if k in known})))
        fields = set(Result.__dataclass_fields__)
        for row in data["results"]:
            r = Result(**{k: v for k, v in row.items() if k in fields})
            r.slot_samples = [(float(t), int(b)) for t, b in r.slot_samples]
            if "first" in r.window:  # the steady state again, by this code's rule
                apply_window(r, int(r.window["first"]), int(r.window["last"]), replace(workloads[-1], eta=r.eta))
            r.repeat += repeats
            results.append(r)
        for rep in range(repeats, repeats + int(data.get("repeats", 1))):  # by the stock, where recorded
            window_by_stock([r for r in results if r.repeat == rep], workloads[-1], quiet=True)
        repeats += int(data.get("repeats", 1))
        seconds += float(data.get("seconds", 0.0))
    if any(asdict(w) != asdict(workloads[0]) for w in workloads):
        raise ValueError(f"--from-raw: the dumps ran different workloads ({', '.join(map(str, paths))})")
    mark_best_fully_async(results)
    return results, workloads[0], repeats, seconds


BEST_NOTE = "best fully async of this repeat (trained tokens/s)"


def window_by_stock(runs: list[Result], wl: Workload, *, quiet: bool = False) -> None:
    """One repeat's contenders (single engine; capacity aside) read again over the window their
    stocks set (`common_window`: from the latest step a contender's stock went flat to the common
    end); runs with several engines over the same window; the best fully async picked again.
    Prints each contender's stock per step and its opening. Runs without recorded stocks (older
    dumps) keep their window."""
    contenders = [r for r in runs if r.ran and r.contender != "cap" and r.stocks and ENGINES_LABEL not in r.label]
    if not contenders:
        return
    first, last, openings = common_window(contenders, wl.steps)
    for r in (r for r in runs if r.ran and r.contender != "cap" and r.stocks):
        apply_window(r, first, last, wl)
        opening = stock_opening(r)
        r.window["flat_from"] = -1 if opening is None else opening  # -1: its stock never went flat
    if not quiet:
        for r in contenders:
            print(f"[peer] {stock_line(r)}", flush=True)
        late = {label: s for label, s in openings.items() if s is not None}
        never = [label for label, s in openings.items() if s is None]
        print(f"[peer] repeat {contenders[0].repeat + 1}: window by the stock: steps {first}..{last} "
              f"(opened by {max(late, key=lambda k: late[k]) if late else 'no flat stock: the step rule'}"
              f"{'; never flat, read over it all the same: ' + ', '.join(never) if never else ''})", flush=True)
    mark_best_fully_async(runs)


def mark_best_fully_async(results: list[Result]) -> None:
    """The best fully-async run of each repeat by its (steady) trained tokens/s, among the sweep's
    single-engine runs that repeat has: a dump cut short in a repeat has its best of what ran."""
    by_repeat: dict[int, list[Result]] = {}
    for r in results:
        if r.contender == "c" and r.ran and ENGINES_LABEL not in r.label:
            r.notes = [n for n in r.notes if n != BEST_NOTE]
            by_repeat.setdefault(r.repeat, []).append(r)
    for runs in by_repeat.values():
        max(runs, key=lambda r: r.trained_tokens_per_s).notes.append(BEST_NOTE)


def bench_peer(*, quick: bool, repeats: int | None = None, steps: int | None = None, plot_path: Path | None = None,
               json_path: str = "", raw_path: str = "", keep: str = "", etas: tuple[int, ...] | None = None,
               sweep: tuple[int, ...] | None = None, fcfs: bool = False, workload: str = DEFAULT_WORKLOAD,
               time_scale: float | None = None, command: str = "", batch: int | None = None,
               syncs: tuple[int, ...] | None = None, same_lag: bool = True,
               engines: tuple[int, ...] = (), pipeline_push_modes: tuple[str, ...] = ("abort",),
               engines_scale_batch: bool = False, engines_only: bool = False) -> list[Figure]:
    """The frontier section (`rollout bench --sections peer`): tables, plot, goals as figures."""
    wl = replace(WORKLOADS[workload], steps=steps or (QUICK_STEPS if quick else WORKLOADS[workload].steps))
    if time_scale:
        wl = replace(wl, time_scale=time_scale)
    if batch:
        wl = replace(wl, batch=batch)
    syncs = (SLIME_DEFAULT_CONCURRENCY,) if syncs is None else syncs  # (): no sync run
    repeats = repeats or (1 if quick else 3)
    etas = etas or (QUICK_ETAS if quick else FRONTIER_ETAS)
    sweep = sweep or (QUICK_SWEEP if quick else FA_SWEEP)
    command = command or "python -m scripts.bench.peer " + " ".join(sys.argv[1:])
    started = time.monotonic()
    print(f"[peer] {wl.describe()}", flush=True)
    with tempfile.TemporaryDirectory(prefix="bench-peer-") as tmp:
        workdir = Path(keep or tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        tasks, prompts = write_inputs(workdir)
        results = run_frontier(wl, workdir, tasks, prompts, repeats=repeats, etas=etas, sweep=sweep, fcfs=fcfs,
                               syncs=syncs, same_lag=same_lag, engines=engines, pipeline_push_modes=pipeline_push_modes,
                               engines_scale_batch=engines_scale_batch, engines_only=engines_only,
                               checkpoint=(lambda rs: dump_raw(rs, wl, raw_path, repeats, time.monotonic() - started,
                                                               command)) if raw_path else None)
    return report(results, wl, repeats=repeats, seconds=time.monotonic() - started,
                  plot_path=plot_path or Path("bench-peer-frontier.png"), json_path=json_path, raw_path=raw_path,
                  command=command)


def _ints(text: str) -> tuple[int, ...] | None:
    return tuple(int(x) for x in text.split(",") if x.strip()) or None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m scripts.bench.peer", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="8 steps, 1 repeat (the workload's steps, 3 repeats without)")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--json", default="", help="the compact summary (tables, goals, per-run figures; for docs/)")
    p.add_argument("--raw", default="", help="every record (slot samples, per-call lags, lengths): keep out of docs/")
    p.add_argument("--from-raw", default="",
                   help="no run: tables, goals, plot and --json summary from raw dumps (a,b: one run's repeats after another's)")
    p.add_argument("--workload", default=DEFAULT_WORKLOAD, choices=sorted(WORKLOADS),
                   help="areal-7b: from AReaL's published 7B run (default); issue25: the earlier toy workload")
    p.add_argument("--time-scale", type=float, default=None,
                   help="divide the engine's token time and the trainer's step alike (default: the workload's)")
    p.add_argument("--plot", default="bench-peer-frontier.png", help="the frontier plot (PNG)")
    p.add_argument("--contenders", default="", help="issue 17's single points instead of the frontier: a,b,c,d,e")
    p.add_argument("--keep", default="", help="run in this folder and keep the logs (engine, child, workers)")
    p.add_argument("--etas", default="", help="the pipeline's points, e.g. 2,8 (default 1,2,4,8; quick 1,2,4)")
    p.add_argument("--sweep", default="", help="fully async's concurrency in slots, e.g. 1,2 (default 1,2,4; quick 1)")
    p.add_argument("--batch", type=int, default=None, help="groups (prompts) per step (default: the workload's)")
    p.add_argument("--syncs", default="", help=f"slime sync's concurrencies, e.g. {SLIME_DEFAULT_CONCURRENCY},36 "
                   f"(default {SLIME_DEFAULT_CONCURRENCY}, slime's own; none: no sync run)")
    p.add_argument("--no-same-lag", action="store_true", help="skip the pipeline at fully async's max lag")
    p.add_argument("--pipeline-push-modes", default="abort",
                   help="the pipeline at eta 2 with each weight-push mode (abort: slime's, every contender's; "
                   "in_place: the pipeline launcher's default), e.g. abort,in_place; engines runs use the last")
    p.add_argument("--engines", default="", help="also run pipeline eta 2 and fully async with these engine counts "
                   "behind one router, e.g. 2,4 (once, after the repeats)")
    p.add_argument("--engines-scale-batch", action="store_true",
                   help="the engines runs take B x N groups a step (the planner's B for N engines), not B")
    p.add_argument("--engines-only", action="store_true",
                   help="each repeat: the capacity run and the engines runs only (in every repeat)")
    p.add_argument("--fcfs", action="store_true",
                   help="also run each pipeline point on an engine without priority scheduling (the ablation)")
    opts = p.parse_args(argv)

    if opts.from_raw:
        paths = [Path(x) for x in opts.from_raw.split(",") if x.strip()]
        results, wl, repeats, seconds = load_raw(*paths)
        commands = [json.loads(path.read_text()).get("command", "(not recorded)") for path in paths]
        figures = report(results, wl, repeats=repeats, seconds=seconds, plot_path=Path(opts.plot) if opts.plot else None,
                         json_path=opts.json, raw_path="", command=" ; ".join(dict.fromkeys(commands)))
        for figure in figures:
            print(figure.line())
        return 0
    if not opts.contenders:
        figures = bench_peer(quick=opts.quick, repeats=opts.repeats, steps=opts.steps, plot_path=Path(opts.plot),
                             json_path=opts.json, raw_path=opts.raw, keep=opts.keep, etas=_ints(opts.etas),
                             sweep=_ints(opts.sweep), fcfs=opts.fcfs, workload=opts.workload, time_scale=opts.time_scale,
                             batch=opts.batch, syncs=() if opts.syncs == "none" else _ints(opts.syncs), same_lag=not opts.no_same_lag,
                             engines=_ints(opts.engines) or (), engines_scale_batch=opts.engines_scale_batch,
                             engines_only=opts.engines_only,
                             pipeline_push_modes=tuple(m.strip() for m in opts.pipeline_push_modes.split(",") if m.strip()))
        for figure in figures:
            print(figure.line())
        return 0

    wl = replace(WORKLOADS[opts.workload], steps=opts.steps or (4 if opts.quick else 12))
    if opts.time_scale:
        wl = replace(wl, time_scale=opts.time_scale)
    kinds = [k.strip() for k in opts.contenders.split(",") if k.strip()]
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="bench-peer-") as tmp:
        workdir = Path(opts.keep or tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        tasks, prompts = write_inputs(workdir)
        plan = length_plan(wl, tasks)
        results = []
        for kind in kinds:
            t0 = time.monotonic()
            results.append(finish(run_contender(kind, wl, workdir, tasks, prompts, quiet=False), wl))
            print(f"# ({kind}) {CONTENDERS[kind]}: {time.monotonic() - t0:.1f} s", file=sys.stderr, flush=True)
    text = table(results, plan, wl)
    print(f"{wl.describe()}; concurrency {wl.concurrency} requests; pipeline eta={wl.eta}. "
          f"Run took {time.monotonic() - started:.0f} s.")
    print(text)
    if opts.json:
        Path(opts.json).write_text(json.dumps({"workload": asdict(wl), "plan_lengths": plan,
                                               "results": [asdict(r) for r in results], "table": text}, indent=1))
    return 0 if all(r.ran for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
