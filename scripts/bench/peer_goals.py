"""The peer benchmark's goals (issue 25 item 2), medians of the repeats with the worst repeat
beside, as Figures (scripts/bench/report.py) printed met or NOT MET."""

from __future__ import annotations

import statistics

from scripts.bench.peer_contenders import (
    Result,
)
from scripts.bench.peer_steady import (
    ENGINES_LABEL,
)
from scripts.bench.peer_tables import (
    AREAL_SPEEDUP,
    FA_BEST,
    LENGTH_GOAL_PCT,
    SAME_LAG_TOKENS_GOAL,
    WASTE_GOAL_PCT,
    _by_repeat,
    _rows,
    length_bias,
    max_lag,
    per_repeat_ratios,
    ratio_text,
    waste_pct,
)
from scripts.bench.report import Figure


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
