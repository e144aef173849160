"""What the peer benchmark writes: its frontier plot, the compact JSON summary, the printed
report, and the raw dump (every Result) that `--from` reads back."""

from __future__ import annotations

import json
import statistics
import sys
from collections import Counter as Tally
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np

from scripts.bench.peer_capacity import capacity_summary
from scripts.bench.peer_contenders import (
    Result,
    Workload,
)
from scripts.bench.peer_goals import goals
from scripts.bench.peer_steady import (
    ENGINES_LABEL,
    apply_window,
    capacities,
    common_window,
    engines_goals,
    steady_goals,
    stock_line,
    stock_opening,
)
from scripts.bench.peer_tables import (
    FA_BEST,
    FCFS,
    _pct,
    _rows,
    ceiling_tokens_per_s,
    cpu_table,
    frontier_table,
    length_bias,
    max_lag,
    slot_use,
    steady_text,
)
from scripts.bench.report import Figure


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
