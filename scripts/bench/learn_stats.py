"""The learning bench's verdicts over seeds (issue 45 item 3, docs/benchmarks.md "Learning"):
intervals from a bootstrap over seeds and the eval's problems, and the goal "eta <= 4 inside
sync's interval".

Two sources of noise move a held-out figure: the seed (the run's sampling, its task order, the
engine's timing) and the eval's problems (each round is pass@1 over a fixed set of held-out
problems, sampled at temperature 1: its standard error is printed with it). A bootstrap over
seeds alone (the earlier `_bootstrap`) forgets the second; with five seeds it is also the
coarsest part. Here each draw resamples the seeds with replacement and redraws each drawn
seed's round from its problems' sampling, a normal with that round's standard error (the eval
keeps pass@1 and its standard error, not every problem's answer; over >= 200 problems the
normal is the bootstrap's own limit).
"""

from __future__ import annotations

import math
import random
import statistics
from typing import Any

DRAWS = 4000
ETA_GOAL_MAX = 4  # the contenders "eta k", k <= this, must land inside sync's interval
LEVEL = 0.95


def interval(values: list[float], ses: list[float], *, draws: int = DRAWS, seed: int = 0) -> tuple[float, float]:
    """The 95% interval of the mean of `values` (one per seed), each with the eval's standard error."""
    rng = random.Random(seed)
    pairs = list(zip(values, [0.0 if math.isnan(s) else s for s in ses]))
    means = sorted(statistics.fmean(v + rng.gauss(0.0, se) for v, se in rng.choices(pairs, k=len(pairs)))
                   for _ in range(draws))
    return _quantiles(means)


def paired_interval(pairs: list[tuple[float, float, float, float]], *, draws: int = DRAWS,
                    seed: int = 0) -> tuple[float, float]:
    """The 95% interval of the mean paired difference contender - sync over seeds; each pair is
    (contender, its standard error, sync, its standard error) of one seed: seeds resampled together,
    both rounds redrawn from their problems."""
    rng = random.Random(seed)

    def draw(a: float, se_a: float, b: float, se_b: float) -> float:
        return (a + rng.gauss(0.0, _finite(se_a))) - (b + rng.gauss(0.0, _finite(se_b)))

    means = sorted(statistics.fmean(draw(*p) for p in rng.choices(pairs, k=len(pairs))) for _ in range(draws))
    return _quantiles(means)


def sync_intervals(sync_runs: list[Any]) -> dict[int, tuple[float, float]]:
    """Per eval step every sync seed has, sync's 95% interval (`Curve`s)."""
    steps = sorted(set.intersection(*(set(c.accuracy) for c in sync_runs))) if sync_runs else []
    return {s: interval([c.accuracy[s] for c in sync_runs], [c.accuracy_se.get(s, math.nan) for c in sync_runs])
            for s in steps}


def eta_of(name: str) -> int | None:
    """k for the plain contenders "eta k" (not their variants: TIS off, the stress rows)."""
    head, _, k = name.partition(" ")
    return int(k) if head == "eta" and k.isdigit() else None


def goal_rows(summary: dict[str, Any]) -> list[dict[str, Any]]:
    """For each "eta k" with k <= ETA_GOAL_MAX: per eval step after the start, its mean against
    sync's interval (inside, or above it: not worse than sync); MET when it holds at the last step."""
    bounds = {int(k): v for k, v in summary.get("sync_interval", {}).items()}
    rows = []
    for name, c in summary["contenders"].items():
        k = eta_of(name)
        if k is None or k > ETA_GOAL_MAX or not bounds:
            continue
        steps = [s for s in sorted(c["accuracy"]) if s in bounds and s > 0]
        where = {s: _place(c["accuracy"][s], bounds[s]) for s in steps}
        rows.append({"contender": name, "by_step": where,
                     "met": bool(steps) and where[steps[-1]] != "below"})
    return rows


def goal_table(summary: dict[str, Any]) -> str:
    """The goal's table: each eta <= 4's mean by step against sync's interval, and the verdict."""
    rows = goal_rows(summary)
    bounds = {int(k): v for k, v in summary.get("sync_interval", {}).items()}
    if not rows:
        return ""
    steps = sorted({s for r in rows for s in r["by_step"]})
    head = " | ".join(f"step {s}: sync [{bounds[s][0]:.3f}, {bounds[s][1]:.3f}]" for s in steps)
    lines = [f"eta <= {ETA_GOAL_MAX} against sync's {LEVEL:.0%} interval (bootstrap over seeds and the eval's problems):",
             "", f"| contender | {head} | goal: inside (or above) at the last step |",
             "|---|" + "---|" * len(steps) + "---|"]
    for r in rows:
        c = summary["contenders"][r["contender"]]
        cells = " | ".join(f"{c['accuracy'][s]:.3f} {r['by_step'][s]}" if s in r["by_step"] else "-" for s in steps)
        lines.append(f"| {r['contender']} | {cells} | {'MET' if r['met'] else 'NOT MET'} |")
    return "\n".join(lines)


def _place(value: float, bounds: tuple[float, float]) -> str:
    return "below" if value < bounds[0] else "above" if value > bounds[1] else "inside"


def _finite(se: float) -> float:
    return 0.0 if math.isnan(se) else se


def _quantiles(sorted_means: list[float]) -> tuple[float, float]:
    n = len(sorted_means)
    return sorted_means[int((1 - LEVEL) / 2 * n)], sorted_means[int((1 + LEVEL) / 2 * n) - 1]
