"""Weight pushes that keep the running requests (SGLang's in_place / retract pause) against slime's
abort, side by side: the pipeline alone (contender d of scripts/bench/peer_contenders.py: redis,
`rollout workers`, `rollout enqueue --follow`, RedisDataSource + generate_rollout, train.py's loop
order) on the areal-7b workload, interleaved within a repeat, a fresh simulated engine per run.

Printed per run: trained response tokens/s (per wall second of the scaled run, and per engine-clock
second: / the time scale / the engine clock's measured rate over busy windows, median), its fraction
of the staleness bound's ideal at that eta and B (scripts/bench/ideal.py), tokens re-prefilled per
push (requests resumed after an abort), the engine's prefill share of its busy time, its mean
decode batch, lag max; then, per eta, each mode's trained tokens/s over abort's in the same repeat.

    python -m scripts.bench.push_modes [--etas 1,2] [--modes abort,in_place] [--steps 10] [--repeats 1]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, replace
from pathlib import Path

from scripts.bench.ideal import bound_ideal
from scripts.bench.peer_contenders import WORKLOADS, Result, Workload, finish, run_contender, write_inputs


def run_all(wl: Workload, *, etas: list[int], modes: list[str], repeats: int, workdir: Path) -> list[Result]:
    tasks, prompts = write_inputs(workdir)
    results = []
    for rep in range(repeats):
        for eta in etas:
            for mode in modes:
                t0 = time.monotonic()
                run_wl = replace(wl, eta=eta, push_mode=mode)
                label = f"eta {eta} {mode} r{rep}"
                result = finish(run_contender("d", run_wl, workdir, tasks, prompts, quiet=True, label=label), run_wl)
                result.repeat, result.notes = rep, [*result.notes, f"push mode {mode}"]
                results.append(result)
                done = json.dumps(row(result, run_wl)) if result.ran else "FAILED " + result.reason
                print(f"# {label}: {time.monotonic() - t0:.0f} s {done}", file=sys.stderr, flush=True)
    return results


def mode_of(r: Result) -> str:
    return next(n.removeprefix("push mode ") for n in r.notes if n.startswith("push mode "))


def row(r: Result, wl: Workload) -> dict[str, float | str]:
    s = r.engine_stats
    ideal = bound_ideal(wl, r.eta)[0]
    pushes = max(1, r.steps)
    # the engine's simulated seconds per wall second, over busy windows, as a fraction of the scale: a
    # step loop slowed by a loaded machine slows the trainer (it waits on the engine's clock) alike
    clock = statistics.median(r.clock_rates) / wl.time_scale if r.clock_rates else 1.0
    engine_clock = r.trained_tokens_per_s / wl.time_scale / clock
    return {
        "eta": r.eta, "mode": mode_of(r), "repeat": r.repeat,
        "trained_tok_s": r.trained_tokens_per_s, "engine_clock_tok_s": engine_clock,
        "of_bound_ideal": engine_clock / ideal.tokens_per_s,
        "reprefill_tok_per_push": r.resumed_input_tokens / pushes,
        "prefill_share": s.get("prefill_busy_s", 0.0) / s["busy_s"] if s.get("busy_s") else float("nan"),
        "decode_batch": s.get("output_tokens", 0.0) / s["decode_steps"] if s.get("decode_steps") else float("nan"),
        "lag_max": max(r.lags, default=0), "clock_p50": clock,
        # per busy engine-second (simulated, the load of this machine out of it): what the engine
        # made, and what of it was trained, over its whole run (the drain included, alike for all)
        "generated_per_busy_s": s.get("output_tokens", 0.0) / s["busy_s"] if s.get("busy_s") else float("nan"),
        "trained_per_busy_s": r.trained_tokens / s["busy_s"] if s.get("busy_s") else float("nan"),
    }


def rederive(x: dict, wl: Workload) -> dict:
    """A row read back from --json: the engine-clock rate and the ideal's fraction again, from its wall
    rate and clock (so a summary written by an earlier version of this file reads the same way)."""
    clock = float(x["clock_p50"]) if x["clock_p50"] == x["clock_p50"] else 1.0
    engine_clock = float(x["trained_tok_s"]) / wl.time_scale / clock
    return {**x, "engine_clock_tok_s": engine_clock,
            "of_bound_ideal": engine_clock / bound_ideal(wl, int(x["eta"]))[0].tokens_per_s}


def report(rows: list[dict], wl: Workload, failed: Sequence[Result] = ()) -> str:
    lines = ["| eta | push mode | repeat | trained tok/s (wall) | per engine-clock s | of the bound's ideal | re-prefilled tok / push "
             "| prefill share of busy | mean decode batch | generated / trained tok per busy engine-s | lag max "
             "| engine clock / scale p50 |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for x in rows:
        lines.append(f"| {x['eta']} | {x['mode']} | {x['repeat']} | {x['trained_tok_s']:,.0f} | {x['engine_clock_tok_s']:,.0f} "
                     f"| {x['of_bound_ideal']:.2f} | {x['reprefill_tok_per_push']:,.0f} | {x['prefill_share']:.3f} "
                     f"| {x['decode_batch']:.1f} | {x.get('generated_per_busy_s', float('nan')):,.0f} / "
                     f"{x.get('trained_per_busy_s', float('nan')):,.0f} | {x['lag_max']} | {x['clock_p50']:.2f} |")
    lines.append("")
    for eta in sorted({x["eta"] for x in rows}):
        lines.append(f"- {bound_ideal(wl, int(eta))[0].describe()}")
        base = {x["repeat"]: x for x in rows if x["eta"] == eta and x["mode"] == "abort"}
        for mode in dict.fromkeys(x["mode"] for x in rows if x["eta"] == eta and x["mode"] != "abort"):
            pairs = [(x, base[x["repeat"]]) for x in rows if x["eta"] == eta and x["mode"] == mode and x["repeat"] in base]
            if pairs:
                wall = ", ".join(f"{float(x['trained_tok_s']) / float(b['trained_tok_s']):.2f}x" for x, b in pairs)
                clock = ", ".join(f"{float(x['engine_clock_tok_s']) / float(b['engine_clock_tok_s']):.2f}x" for x, b in pairs)
                busy = ", ".join(f"{float(x.get('generated_per_busy_s', 0)) / float(b.get('generated_per_busy_s', 1)):.3f}x"
                                 for x, b in pairs)
                lines.append(f"- eta {eta}: {mode} / abort trained tokens/s, same repeat: {wall} per wall second, "
                             f"{clock} per engine-clock second; tokens generated per busy engine-second {busy}")
    for r in failed:
        lines.append(f"- {r.label}: could not run: {r.reason}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m scripts.bench.push_modes", description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", default="areal-7b", choices=sorted(WORKLOADS))
    p.add_argument("--etas", default="1,2")
    p.add_argument("--modes", default="abort,in_place")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--time-scale", type=float, default=None)
    p.add_argument("--json", default="")
    p.add_argument("--keep", default="", help="run in this folder and keep the logs")
    p.add_argument("--from-json", default="", help="no run: the report again from --json summaries (a,b)")
    opts = p.parse_args(argv)
    wl = replace(WORKLOADS[opts.workload], steps=opts.steps)
    if opts.time_scale:
        wl = replace(wl, time_scale=opts.time_scale)
    if opts.from_json:
        rows = []
        for i, path in enumerate(opts.from_json.split(",")):  # file i's repeats: 10 i + its own
            data = json.loads(Path(path).read_text())
            wl = Workload(**data["workload"])
            rows += [{**rederive(x, wl), "repeat": 10 * i + int(x["repeat"])} for x in data["rows"]]
        print(report(rows, wl))
        return 0
    etas = [int(e) for e in opts.etas.split(",")]
    modes = [m.strip() for m in opts.modes.split(",")]
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="bench-push-") as tmp:
        workdir = Path(opts.keep or tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        results = run_all(wl, etas=etas, modes=modes, repeats=opts.repeats, workdir=workdir)
    text = report([row(r, wl) for r in results if r.ran], wl, [r for r in results if not r.ran])
    print(f"{wl.describe()}; run took {time.monotonic() - started:.0f} s")
    print(text)
    if opts.json:
        Path(opts.json).write_text(json.dumps({"workload": asdict(wl), "rows": [row(r, wl) for r in results if r.ran],
                                               "report": text}, indent=1))
    return 0 if all(r.ran for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
