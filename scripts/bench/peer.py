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

The contenders and how each is run and counted: scripts/bench/peer_contenders.py; the tables
(peer_tables.py), the goals (peer_goals.py), the plot and the JSON (peer_report.py), the steady
window (peer_steady.py). This module runs the frontier and is the command.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np

from scripts.bench.peer_capacity import capacity_run
from scripts.bench.peer_contenders import (
    CONTENDERS,
    WORKLOADS,
    Result,
    Workload,
    finish,
    length_plan,
    run_contender,
    write_inputs,
)
from scripts.bench.peer_goals import goals
from scripts.bench.peer_report import dump_raw, load_raw, plot, report, summary, window_by_stock
from scripts.bench.peer_steady import (
    CAPACITY,
    ENGINES_LABEL,
    apply_window,
    window,
)
from scripts.bench.peer_tables import (
    DEFAULT_WORKLOAD,
    FA_BEST,
    FA_SWEEP,
    FCFS,
    FRONTIER_ETAS,
    QUICK_ETAS,
    QUICK_STEPS,
    QUICK_SWEEP,
    SLIME_DEFAULT_CONCURRENCY,
    _rows,
    ceiling_tokens_per_s,
    clock_cell,
    frontier_table,
    length_bias,
    max_lag,
    per_repeat_ratios,
    push_suffix,
    ratio_text,
    slot_use,
    steady_text,
    sync_label,
    table,
    waste_pct,
)
from scripts.bench.report import Figure

# what the tests and the other benches import from here (the parts live in peer_tables.py,
# peer_goals.py, peer_report.py)
__all__ = ["FA_BEST", "Result", "Workload", "_rows", "bench_peer", "ceiling_tokens_per_s", "frontier_table", "goals",
           "length_bias", "load_raw", "main", "per_repeat_ratios", "plot", "ratio_text", "report", "slot_use",
           "steady_text", "summary", "window_by_stock"]

# ------------------------------------------------------------------ the frontier (issue 25)

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
    router; with `scale_batch`, B x N groups a step (fully async's concurrency is per engine already,
    as slime multiplies --sglang-server-concurrency by the engines)."""
    for n in (n for n in engines if n > 1):
        batch = wl.batch * n if scale_batch else wl.batch
        one("d", f"pipeline eta 2{push_suffix(mode)}, {n}{ENGINES_LABEL}",
            replace(wl, eta=2, engines=n, push_mode=mode, batch=batch), rep)
        one("c", f"slime fully async {k}x, {n}{ENGINES_LABEL}",
            replace(wl, concurrency=k * wl.slots, engines=n, batch=batch), rep)


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
