"""Steady state and the engine's own capacity (issue 38 items 1, 2 and 4): what the frontier
(scripts/bench/peer.py) divides by and where it reads each contender.

- **The window.** Every contender records a mark at the start of its trainer loop and after
  each step's rollout returned (`Result.step_marks`: wall seconds since the loop began, trained
  tokens so far, the engines' generated tokens and busy simulated seconds so far, each engine's
  too) and its stock (`Result.stocks`). Its steady state is read between the mark before step
  `first` and the mark after step `last`, the SAME steps for every contender of a repeat
  (`common_window`, issue 46): from the latest step at which a contender's stock stopped growing
  (`flat_from`) to the drain (the last two steps); no stock flat: the step rule (`window`: from
  the largest eta + 2).
- **Each engine on its own clock** (issue 46 item 4): with several engines the window's length
  is the clock at which they generated, each engine's tokens over its own busy seconds plus its
  own idle wall time x the scale (`per_engine`, `fleet_played_s`).
- **Capacity.** The same engine (same arguments, fresh process, same time scale) saturated with
  the workload's requests and nothing else: no trainer, no weight push, `outstanding` requests
  kept in flight (a new one as each finishes) so the waiting queue never empties. Its generated
  tokens per wall second over a window after a warm-up is the physical limit every contender's
  trained tokens/s is divided by (efficiency); its tokens per busy engine-second beside
  (scripts/bench/peer_capacity.py runs it).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from scripts.bench.ideal import IdealResult, bound_ideal
from scripts.bench.peer_measure import PER_ENGINE_COLUMN
from scripts.bench.peer_workload import Result, Workload
from scripts.bench.report import Figure

CAPACITY = "engine capacity (workload alone, saturated)"
WARMUP_STEPS_PAST_ETA = 2  # steps eta + 2 .. N - 2: the example window
DRAIN_STEPS = 2


@dataclass
class Steady:
    """One run's figures over its window: rates per second of the ENGINE's clock (`played_s`),
    the wall-clock ones (at the run's time scale) beside."""

    first: int
    last: int
    wall_s: float
    trained_tokens: int
    groups: int
    generated_tokens: int
    busy_s: float
    played_s: float
    engines: list[EngineWindow] = field(default_factory=list)  # each engine on its own clock

    @property
    def tokens_per_s(self) -> float:
        return self.trained_tokens / self.played_s if self.played_s > 0 else float("nan")

    @property
    def groups_per_s(self) -> float:
        return self.groups / self.played_s if self.played_s > 0 else float("nan")

    @property
    def wall_tokens_per_s(self) -> float:
        return self.trained_tokens / self.wall_s if self.wall_s > 0 else float("nan")

    @property
    def clock_rate(self) -> float:
        """Engine-clock seconds per wall second over the window, over the scale (1.00: kept it)."""
        return self.played_s / self.wall_s if self.wall_s > 0 else float("nan")

    @property
    def generated_per_busy_s(self) -> float:
        """Generated tokens per busy engine-second (simulated): how full the batch ran, not what trained."""
        return self.generated_tokens / self.busy_s if self.busy_s > 0 else float("nan")

    @property
    def trained_share(self) -> float:
        """Trained / generated over the window: in steady state what is carried in equals what is
        carried out, so 1 - this is what the contender generates and never trains."""
        return self.trained_tokens / self.generated_tokens if self.generated_tokens else float("nan")


def window(steps: int, max_eta: int) -> tuple[int, int]:
    """The steps (0-based, inclusive) every contender of a run is read over: from max_eta + 2
    (the pipeline's warm-up at its largest eta; fully async's queue fills sooner) to the third
    from last (the last two steps are the drain). Too short a run: its middle third."""
    first, last = max(1, max_eta) + WARMUP_STEPS_PAST_ETA, steps - 1 - DRAIN_STEPS
    if last - first < 2:
        first, last = steps // 3, max(steps // 3, steps - 1 - steps // 3)
    return first, last


# ------------------------------------------------------------------ the window by the stock (issue 46 item 1)

# The stock: what a contender holds generated or generating and not yet trained, in tokens, read
# after each step's rollout (`Result.stocks`). While it grows, part of what the engine makes goes
# into it instead of into training, so a window over those steps understates the contender's
# steady trained rate (fully async's queue filling) or overstates it (a stock drawn down).
FLAT_STEPS = 6  # k: the trailing steps the slope is fitted over (a multiple of 1, 2 and 3 steps: eta 2's cohorts)
FLAT_SHARE = 0.05  # x: the stock may grow or shrink by at most 5 % of a step's trained tokens per step


def stock_slope(stock: Sequence[float]) -> float:
    """Least-squares slope of the stock against the step index (tokens per step)."""
    steps = np.arange(len(stock), dtype=float)
    values = np.asarray(stock, dtype=float)
    centred = steps - steps.mean()
    return float((centred * (values - values.mean())).sum() / (centred * centred).sum())


def flat_from(stock: Sequence[float], trained: Sequence[float], *, k: int = FLAT_STEPS,
              share: float = FLAT_SHARE) -> int | None:
    """The first step s at which the stock is flat: the least-squares slope of stock[s..s+k-1]
    lies within +-share x the mean of trained[s..s+k-1] (tokens trained per step). None: it
    never is. `stock[i]` is read after step i, `trained[i]` is what step i trained.

    Why the slope against the trained tokens a step, not against the stock itself: a stock that
    grows by g a step takes g of each step's generation away from training, so g / trained per
    step is exactly the share by which a window over those steps misreads the steady rate. A
    linear growth therefore never opens the window however large the stock gets (against the
    stock's own size it would, once the stock is large enough); the fit over k steps, not the
    running maximum, so that one noisy step neither opens nor holds it shut."""
    if len(stock) != len(trained):
        raise ValueError(f"flat_from: {len(stock)} stock readings against {len(trained)} steps trained")
    if k < 2:
        raise ValueError(f"flat_from: k must be >= 2 steps to fit a slope, got {k}")
    for s in range(len(stock) - k + 1):
        per_step = float(np.mean(trained[s:s + k]))
        if per_step > 0 and abs(stock_slope(stock[s:s + k])) <= share * per_step:
            return s
    return None


def trained_per_step(r: Result) -> list[float]:
    """Tokens trained by each step, from the step marks (marks[k + 1] - marks[k])."""
    return [b[1] - a[1] for a, b in zip(r.step_marks, r.step_marks[1:], strict=False)]


def stock_opening(r: Result) -> int | None:
    """The step at which `r`'s stock stopped growing (`flat_from`), None if it never did or
    was not recorded."""
    trained = trained_per_step(r)
    n = min(len(r.stocks), len(trained))
    return flat_from(r.stocks[:n], trained[:n]) if n >= FLAT_STEPS else None


def common_window(runs: Sequence[Result], steps: int) -> tuple[int, int, dict[str, int | None]]:
    """The one window every contender of `runs` is read over: from the latest step at which a
    contender's stock went flat to the common end (the drain outside); each run's own opening
    beside (None: never flat; it is read over the same window and flagged). No run flat: the
    step rule (`window`)."""
    openings = {r.label: stock_opening(r) for r in runs if r.ran}
    last = steps - 1 - DRAIN_STEPS
    flat = [s for s in openings.values() if s is not None]
    if not flat or max(flat) >= last - 1:
        first, last = window(steps, 2)
        return first, last, openings
    return max(flat), last, openings


def stock_line(r: Result) -> str:
    """`r`'s stock per step, thousands of tokens, and where it went flat."""
    opening = stock_opening(r)
    cells = " ".join(f"{x / 1000:.0f}" for x in r.stocks)
    return (f"{r.label} (repeat {r.repeat + 1}): stock per step (k tokens) {cells}; "
            + (f"flat from step {opening}" if opening is not None else "never flat"))


def steady(r: Result, first: int, last: int, wl: Workload) -> Steady | None:
    """`r` over steps first..last (marks[k] is taken before step k, marks[k + 1] after it)."""
    marks = r.step_marks
    if not r.ran or len(marks) < last + 2 or first < 0:
        return None
    a, b = marks[first], marks[last + 1]
    groups = sum(r.groups_per_step[first:last + 1])
    engines = per_engine(r, wl, a, b)
    played = fleet_played_s(engines) if len(engines) > 1 else played_s(r, wl, a, b)
    return Steady(first=first, last=last, wall_s=b[0] - a[0], trained_tokens=int(b[1] - a[1]), groups=groups,
                  generated_tokens=int(b[2] - a[2]), busy_s=b[3] - a[3], played_s=played, engines=engines)


def idle_wall_s(samples: Sequence[Sequence[float]], t0: float, t1: float) -> float:
    """Wall seconds in [t0, t1] an engine had nothing running (its slot samples: (t, running))."""
    idle = 0.0
    for (t, busy), (t_next, _b) in zip(samples, samples[1:], strict=False):
        if busy == 0:
            idle += max(0.0, min(t_next, t1) - max(t, t0))
    return idle


def engine_played_s(slots: Sequence[Sequence[float]], points: Sequence[tuple[float, float]], scale: float) -> float:
    """One engine's clock over a window: `points` are (wall s, its busy simulated seconds) from the
    window's start to its end; between two of them its busy seconds count as they moved (never
    ahead of the scale), its own idle wall time (from its own slot samples) x the scale."""
    total = 0.0
    for (t0, s0), (t1, s1) in zip(points, points[1:], strict=False):
        moved, wall = max(0.0, s1 - s0), t1 - t0
        if wall <= 0:
            total += moved
            continue
        idle = min(wall, idle_wall_s(slots, t0, t1))
        total += min(moved, (wall - idle) * scale) + idle * scale
    return total


def played_s(r: Result, wl: Workload, a: list[float], b: list[float]) -> float:
    """The window's length on the FIRST engine's clock (the GPU and trainer played), interval by
    interval between its clock samples (and the marks a, b at the ends): while it runs requests,
    its busy seconds (the forward passes' simulated durations) move as the step loop gets through
    them (slower than the scale on a loaded machine); while nothing runs they do not move, and that
    idle wall time counts x the scale (the trainer sleeps its step on the wall clock then). Busy
    seconds, not `sim_time_s`: the simulated clock also jumps to the wall clock x the scale where a
    push syncs it, which would count a slow loop's lag as engine time. The weight pushes' own GPU
    time (about 0.7 s a push) is left out. Rates on this clock do not depend on how well the step
    loop kept the scale; wall-clock latency while the engine idles is scaled like the trainer's
    sleep. Several engines: `fleet_played_s`."""
    col = 5 if len(a) > 5 and len(b) > 5 else 4  # the first engine's busy seconds (older dumps: its clock)
    if len(a) <= col or a[col] != a[col] or b[col] != b[col]:
        return float("nan")
    inside = [(x[0], x[col - 3]) for x in r.clock_samples if len(x) > col - 3 and a[0] < x[0] < b[0]]
    return engine_played_s(r.slot_samples, [(a[0], a[col]), *inside, (b[0], b[col])], wl.time_scale)


@dataclass
class EngineWindow:
    """One engine over a window: its generated tokens, busy simulated seconds and own clock."""

    generated: int
    busy_s: float
    played_s: float


def per_engine(r: Result, wl: Workload, a: list[float], b: list[float]) -> list[EngineWindow]:
    """Each engine of the run over the window between marks a and b, on its OWN clock (its busy
    seconds and its own idle wall time x the scale). Empty where the marks carry no per-engine
    columns (older dumps) or an engine's samples are missing."""

    count = (min(len(a), len(b)) - PER_ENGINE_COLUMN) // 2
    if count < 1 or count - 1 > len(r.engine_slot_samples) or count - 1 > len(r.engine_clock_samples):
        return []
    slots = [r.slot_samples, *r.engine_slot_samples[:count - 1]]
    clocks = [r.clock_samples, *r.engine_clock_samples[:count - 1]]
    out = []
    for i in range(count):
        tok, busy = PER_ENGINE_COLUMN + 2 * i, PER_ENGINE_COLUMN + 2 * i + 1
        inside = [(x[0], x[2]) for x in clocks[i] if len(x) > 2 and a[0] < x[0] < b[0]]
        played = engine_played_s(slots[i], [(a[0], a[busy]), *inside, (b[0], b[busy])], wl.time_scale)
        out.append(EngineWindow(generated=int(b[tok] - a[tok]), busy_s=b[busy] - a[busy], played_s=played))
    return out


def fleet_played_s(engines: Sequence[EngineWindow]) -> float:
    """The window's length on the engines' clocks, each engine's tokens on its own clock: the
    clock at which sum(generated) / it = sum(generated_i / played_i), so no engine's idle time
    (or slowness) stands for another's. One engine: its own clock."""
    rate = sum(e.generated / e.played_s for e in engines if e.played_s > 0)
    total = sum(e.generated for e in engines)
    if len(engines) == 1 or total == 0 or rate <= 0:
        return engines[0].played_s if engines else float("nan")
    return total / rate


# ------------------------------------------------------------------ applying the window, tables, goals

EFFICIENCY_GOAL = 0.95  # pipeline eta 2: of the bound's ideal, and of capacity
FA_GOAL, FA_WORST_GOAL = 1.0, 0.95  # pipeline eta 2 vs the best fully async: median, worst repeat
ENGINES_LABEL = " engines"  # "pipeline eta 2, 4 engines"


def apply_window(r: Result, first: int, last: int, wl: Workload) -> None:
    """The run's figures become its steady state over first..last on the engine's clock (the
    whole run's, per wall second, kept beside in run_*)."""
    s = steady(r, first, last, wl)
    if s is None:
        return
    if r.wall_s > 0:  # from the run's own counts: applying it again (`--from-raw`) gives the same
        r.run_tokens_per_s, r.run_groups_per_s = r.trained_tokens / r.wall_s, sum(r.groups_per_step) / r.wall_s
    r.trained_tokens_per_s, r.groups_per_s = s.tokens_per_s, s.groups_per_s
    r.window = {"first": first, "last": last, "wall_s": round(s.wall_s, 2), "played_s": round(s.played_s, 2),
                "trained_tokens": s.trained_tokens, "groups": s.groups, "generated_tokens": s.generated_tokens,
                "busy_s": round(s.busy_s, 2), "wall_tokens_per_s": round(s.wall_tokens_per_s, 1),
                "clock_rate": round(s.clock_rate / wl.time_scale, 3)}
    if len(s.engines) > 1:  # each engine on its own clock (engines_table)
        for i, e in enumerate(s.engines):
            r.window |= {f"engine{i}_generated": e.generated, f"engine{i}_busy_s": round(e.busy_s, 2),
                         f"engine{i}_played_s": round(e.played_s, 2)}


def per_busy_s(r: Result) -> float:
    """Generated tokens per busy engine-second (simulated) over the window (capacity: its run)."""
    w = r.window
    return w["generated_tokens"] / w["busy_s"] if w and w.get("busy_s") else float("nan")


def trained_share(r: Result) -> float:
    w = r.window
    return w["trained_tokens"] / w["generated_tokens"] if w and w.get("generated_tokens") else float("nan")


def window_clock(runs: Sequence[Result]) -> str:
    """The engine clock over the window per wall second, over the time scale: median (min-max)."""
    rates = [r.window["clock_rate"] for r in runs if r.window and "clock_rate" in r.window]
    return _cell(rates, ".2f") if rates else "-"


def capacities(results: Sequence[Result]) -> dict[int, Result]:
    return {r.repeat: r for r in results if r.contender == "cap" and r.ran}


def efficiency(r: Result, caps: dict[int, Result], engines: int = 1) -> float:
    """Steady trained tokens/s over the same repeat's measured capacity (x engines)."""
    cap = caps.get(r.repeat) or (next(iter(caps.values())) if caps else None)
    return r.trained_tokens_per_s / (engines * cap.trained_tokens_per_s) if cap and cap.trained_tokens_per_s else float("nan")


def bound_ideals(wl: Workload, etas: Sequence[int]) -> dict[int, tuple[IdealResult, float]]:
    """The staleness bound's ideal at each eta (scripts/bench/ideal.py: the most any scheduler
    trains at that eta and the workload's B), with the simulated capacity of one engine beside."""
    return {eta: bound_ideal(wl, eta) for eta in etas}


def _cell(values: list[float], spec: str = ".0f") -> str:
    values = [v for v in values if v == v]
    if not values:
        return "-"
    mid = statistics.median(values)
    return f"{mid:{spec}} ({min(values):{spec}}-{max(values):{spec}})" if len(values) > 1 else f"{mid:{spec}}"


def _ratio_cell(ratios: list[float]) -> str:
    ratios = [x for x in ratios if x == x]
    if not ratios:
        return "-"
    return f"{statistics.median(ratios):.2f} (worst {min(ratios):.2f})" if len(ratios) > 1 else f"{ratios[0]:.2f}"


def steady_table(rows: dict[str, list[Result]], caps: dict[int, Result], fa_best: list[Result], *, lag_text,
                 bias_of, waste_of) -> str:
    """One row per contender: the steady state against capacity, per busy engine-second, lag,
    length bias, never trained; medians of the repeats (min-max), ratios per repeat (worst)."""
    fa = {r.repeat: r for r in fa_best}
    head = ("| contender | trained tok/s, steady, per engine-clock s | groups/s, steady | efficiency: / measured "
            "capacity, same repeat | vs best fully async, same repeat | generated tok per busy engine-s | trained / "
            "generated in the window | lag mean / max | length bias mean | not trained by the end (end rule) | engine clock / "
            "time scale over the window | trained tok/s per wall s (at the time scale): window / whole run |")
    lines = [head, "|" + "---|" * 12]
    cap_runs = list(caps.values())
    if cap_runs:
        lines.append(f"| {CAPACITY} | {_cell([r.trained_tokens_per_s for r in cap_runs])} (generated) | - | 1.00 | - | "
                     f"{_cell([per_busy_s(r) for r in cap_runs])} | - | - | - | - | {window_clock(cap_runs)} | "
                     f"{_cell([r.run_tokens_per_s for r in cap_runs])} (generated) / - |")
    for label, runs in rows.items():
        ran = [r for r in runs if r.ran and r.window]
        if not ran or ENGINES_LABEL in label:
            continue
        vs_fa = [r.trained_tokens_per_s / fa[r.repeat].trained_tokens_per_s for r in ran
                 if r.repeat in fa and fa[r.repeat].trained_tokens_per_s]
        lines.append(
            f"| {label} | {_cell([r.trained_tokens_per_s for r in ran])} | {_cell([r.groups_per_s for r in ran], '.3f')} | "
            f"{_ratio_cell([efficiency(r, caps) for r in ran])} | {_ratio_cell(vs_fa)} | "
            f"{_cell([per_busy_s(r) for r in ran])} | {_cell([trained_share(r) for r in ran], '.2f')} | "
            f"{lag_text(ran)} | {_cell([bias_of(r) for r in ran], '+.1f')} % | "
            f"{_cell([waste_of(r) for r in ran], '.1f')} % | {window_clock(ran)} | "
            f"{_cell([r.window.get('wall_tokens_per_s', float('nan')) for r in ran])} / "
            f"{_cell([r.run_tokens_per_s for r in ran])} |")
    return "\n".join(lines)


def ideal_lines(wl: Workload, etas: Sequence[int], caps: dict[int, Result]) -> list[str]:
    cap = statistics.median(r.trained_tokens_per_s for r in caps.values()) if caps else float("nan")
    out = []
    for ideal, simulated in bound_ideals(wl, etas).values():
        engines = ideal.setup.engines
        out.append(f"{ideal.describe()}; {ideal.tokens_per_s / (engines * simulated):.2f} of N x the simulated capacity "
                   f"({simulated:,.0f} tok/s an engine), {ideal.tokens_per_s / (engines * cap):.2f} of N x the measured "
                   f"capacity ({cap:,.0f})")
    return out


def window_engines(r: Result) -> list[EngineWindow]:
    """The engines of `r`'s window, each on its own clock (`apply_window`); one engine: the run's own."""
    w = r.window
    n = sum(1 for key in w if key.startswith("engine") and key.endswith("_played_s"))
    if n == 0:
        return [EngineWindow(int(w.get("generated_tokens", 0)), float(w.get("busy_s", 0.0)),
                             float(w["played_s"]))] if "played_s" in w else []
    return [EngineWindow(int(w[f"engine{i}_generated"]), float(w[f"engine{i}_busy_s"]), float(w[f"engine{i}_played_s"]))
            for i in range(n)]


def fleet_generated_per_s(r: Result) -> float:
    """Generated tokens per second, each engine's tokens over its own clock, summed: against N x capacity."""
    engines = window_engines(r)
    return sum(e.generated / e.played_s for e in engines if e.played_s > 0) if engines else float("nan")


def per_engine_busy_rates(r: Result) -> list[float]:
    """Each engine's generated tokens per ITS busy engine-second (how full its batch ran)."""
    return [e.generated / e.busy_s if e.busy_s > 0 else float("nan") for e in window_engines(r)]


def _per_engines(rows: dict[str, list[Result]]) -> dict[tuple[str, int], list[Result]]:
    """(contender without its engine count, engines) -> its runs with a window."""
    per_engines: dict[tuple[str, int], list[Result]] = {}
    for label, runs in rows.items():
        base, _, tail = label.partition(", ")
        count = int(tail.split()[0]) if tail.endswith(ENGINES_LABEL) else 1
        for r in runs:
            if r.ran and r.window:
                per_engines.setdefault((base, count), []).append(r)
    return per_engines


def _trainer_limit(per_engines: dict[tuple[str, int], list[Result]], bases: list[str], n: int, wl: Workload) -> float:
    """B x n x the median planned answer / the trainer's step, B as the N-engine runs took it
    (`--engines-scale-batch`: B x N), else the workload's."""
    plans = [float(np.mean(r.planned_lengths)) for runs in per_engines.values() for r in runs if r.planned_lengths]
    taken = [max(r.groups_per_step) for b in bases for r in per_engines.get((b, n), []) if r.groups_per_step]
    batch = max(taken) if taken else wl.batch
    return batch * wl.n * (statistics.median(plans) if plans else float("nan")) / wl.train_step_s


def engines_table(rows: dict[str, list[Result]], caps: dict[int, Result], wl: Workload) -> str:
    """Tokens/s against engines behind one router: each contender at 1 engine (its repeats'
    median) and at each larger count (each run), against N x capacity and the trainer's limit."""
    cap = statistics.median(r.trained_tokens_per_s for r in caps.values()) if caps else float("nan")
    per_engines = _per_engines(rows)
    bases = sorted({b for b, n in per_engines if n > 1})
    counts = sorted({n for b, n in per_engines if b in bases})
    if not bases:
        return ""
    head = ("| engines | N x measured capacity (tok/s, engine clock) | trainer limit: B x n x mean plan length / trainer step "
            "(B as the runs took it) | "
            + " | ".join(f"{b}: trained tok/s (efficiency vs N x capacity) | {b}: generated tok/s, each engine on its "
                         f"own clock, summed (vs N x capacity) | {b}: generated tok per busy engine-s, each engine"
                         for b in bases) + " |")
    lines = [head, "|" + "---|" * (3 + 3 * len(bases))]
    for n in counts:
        cells = []
        for b in bases:
            runs = per_engines.get((b, n), [])
            tok = [r.trained_tokens_per_s for r in runs]
            generated = [fleet_generated_per_s(r) for r in runs]
            cells += ([f"{_cell(tok)} ({_cell([t / (n * cap) for t in tok], '.2f')})",
                       f"{_cell(generated)} ({_cell([g / (n * cap) for g in generated], '.2f')})",
                       " / ".join(_cell(list(x)) for x in zip(*(per_engine_busy_rates(r) for r in runs), strict=False))]
                      if runs else ["-", "-", "-"])
        lines.append(f"| {n} | {n * cap:,.0f} | {_trainer_limit(per_engines, bases, n, wl):,.0f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


ENGINES_GOAL = 0.9  # issue 46: >= 0.9 of N x capacity until the trainer binds


def engines_goals(rows: dict[str, list[Result]], caps: dict[int, Result], wl: Workload) -> list[Figure]:
    """Per contender and engine count > 1: trained tokens/s (median of its runs, worst beside)
    against N x the measured capacity, or against the trainer's limit where that is lower (the
    trainer binds first): goal >= 0.9 in the median."""
    if not caps:
        return []
    cap = statistics.median(r.trained_tokens_per_s for r in caps.values())
    per_engines = _per_engines(rows)
    bases = sorted({b for b, n in per_engines if n > 1})
    figures = []
    for (base, n), runs in sorted(per_engines.items()):
        if n == 1 or base not in bases:
            continue
        limit = _trainer_limit(per_engines, bases, n, wl)
        ref, ref_name = (limit, "the trainer's limit (it binds first)") if limit < n * cap else (n * cap, "N x capacity")
        ratios = [r.trained_tokens_per_s / ref for r in runs]
        tok = statistics.median(r.trained_tokens_per_s for r in runs)
        figures.append(Figure(
            section="peer", name=f"{base}, {n}{ENGINES_LABEL}: trained tokens/s {tok:.0f} (median of {len(runs)} run(s), "
            f"worst {min(ratios):.2f}) against {ref_name}", value=tok, unit="tok/s", baseline=ref_name, baseline_value=ref,
            ratio=statistics.median(ratios), goal=f">= {ENGINES_GOAL} in the median", met=statistics.median(ratios) >= ENGINES_GOAL))
    return figures


def steady_goals(rows: dict[str, list[Result]], caps: dict[int, Result], wl: Workload,
                 fa_best: list[Result], bias_of: Callable[[Result], float] | None = None) -> list[Figure]:
    """Issue 38's and 46's goals, met or missed: pipeline eta 2's steady trained tokens/s >= 0.95
    of the bound's ideal at its eta and B, >= 0.95 of measured capacity, and >= 1x the best fully
    async's (same repeat; median of per-repeat ratios, worst repeat >= 0.95x)."""
    labels = [k for k in rows if k.startswith("pipeline eta 2") and ENGINES_LABEL not in k] or ["pipeline eta 2"]
    return [f for label in labels for f in _eta2_goals(label, rows, caps, wl, fa_best, bias_of)]


def _eta2_goals(label: str, rows: dict[str, list[Result]], caps: dict[int, Result], wl: Workload,
                fa_best: list[Result], bias_of: Callable[[Result], float] | None = None) -> list[Figure]:
    eta2 = [r for r in rows.get(label, []) if r.ran and r.window]
    if not eta2 or not caps:
        return [Figure(section="peer", name=f"steady state: {label} or the capacity run did not run",
                       value=float("nan"), unit="", goal="both run", met=False)]
    ideal = bound_ideals(wl, [2])[2][0].tokens_per_s
    cap_of = {r.repeat: (caps.get(r.repeat) or next(iter(caps.values()))).trained_tokens_per_s for r in eta2}
    tok = statistics.median(r.trained_tokens_per_s for r in eta2)
    figures = []
    for name, refs in (("the bound's ideal (scripts/bench/ideal.py, same eta and B)", [ideal] * len(eta2)),
                       ("the same repeat's measured capacity", [cap_of[r.repeat] for r in eta2])):
        ratios = [r.trained_tokens_per_s / ref for r, ref in zip(eta2, refs, strict=True)]
        figures.append(Figure(
            section="peer", name=f"{label} steady state: trained tokens/s {tok:.0f} (median), {_ratio_cell(ratios)} of "
            f"{name}", value=tok, unit="tok/s", baseline=name.split(" (")[0], baseline_value=statistics.median(refs),
            ratio=statistics.median(ratios), goal=f">= {EFFICIENCY_GOAL:g}x",
            met=statistics.median(ratios) >= EFFICIENCY_GOAL))
    fa = {r.repeat: r for r in fa_best}
    vs = [r.trained_tokens_per_s / fa[r.repeat].trained_tokens_per_s for r in eta2
          if r.repeat in fa and fa[r.repeat].trained_tokens_per_s]
    if vs:
        figures.append(Figure(
            section="peer", name=f"{label} steady state vs the best fully async of the same repeat: "
            f"{_ratio_cell(vs)} (each repeat: {', '.join(f'{x:.2f}x' for x in vs)}); "
            f"{beside(eta2, 'pipeline', bias_of)}; {beside(list(fa.values()), 'fully async', bias_of)}",
            value=tok, unit="tok/s", baseline="best fully async, steady (median)",
            baseline_value=statistics.median(r.trained_tokens_per_s for r in fa.values()),
            ratio=statistics.median(vs), goal=f">= {FA_GOAL:g}x, worst repeat >= {FA_WORST_GOAL:g}x",
            met=statistics.median(vs) >= FA_GOAL and min(vs) >= FA_WORST_GOAL))
    return figures


def window_of(runs: Sequence[Result]) -> str:
    """The window the runs were read over and where each one's stock went flat."""
    spans = sorted({(int(r.window["first"]), int(r.window["last"])) for r in runs if "first" in r.window})
    flat = [int(r.window["flat_from"]) for r in runs if "flat_from" in r.window]
    return (f"steps {', '.join(f'{a}..{b}' for a, b in spans)}" + (
        f", stock flat from step {', '.join('never' if x < 0 else str(x) for x in flat)}" if flat else ""))


def beside(runs: Sequence[Result], name: str, bias_of: Callable[[Result], float] | None) -> str:
    """Lag (mean, max) and length bias of `runs`, and their window: what a ratio is read with."""
    lags = [lag for r in runs for lag in r.lags]
    text = f"{name}: lag mean {np.mean(lags) if lags else float('nan'):.2f} max {max(lags, default=0)}"
    if bias_of is not None:
        text += f", length bias {_cell([bias_of(r) for r in runs], '+.1f')} %"
    return f"{text}, {window_of(runs)}"
