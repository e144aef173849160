"""The peer benchmark's arithmetic and tables (scripts/bench/peer.py): per-run figures (length
bias, slot use, the ceiling, waste), the frontier, steady, CPU and contender tables, and the
constants the frontier is run and judged with."""

from __future__ import annotations

import statistics
from collections import Counter as Tally
from collections.abc import Callable, Sequence

import numpy as np

from scripts.bench.peer_contenders import (
    END_RULE,
    Result,
    Workload,
)
from scripts.bench.peer_steady import (
    FLAT_SHARE,
    FLAT_STEPS,
    capacities,
    engines_table,
    ideal_lines,
    steady_table,
    stock_line,
)

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
    recursion; tests/conformance/test_bench_peer.py checks it against a brute-force search over every
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


def max_lag(r: Result) -> int:
    return max(r.lags) if r.lags else 0


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
