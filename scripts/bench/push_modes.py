"""Weight pushes that keep the running requests (SGLang's in_place / retract pause) against slime's
abort, side by side: the pipeline alone (contender d of scripts/bench/peer_contenders.py: redis,
`rollout workers`, `rollout enqueue --follow`, RedisDataSource + generate_rollout, train.py's loop
order) on the areal-7b workload, interleaved within a repeat, a fresh simulated engine per run.

Printed per run: trained response tokens/s (per wall second of the scaled run, and /time scale:
per engine-clock second where the loop kept its scale), its fraction of the staleness bound's own
ceiling at that eta (scripts/bench/ceiling.py, the tail decoding alone), tokens re-prefilled per
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
from dataclasses import asdict, replace
from pathlib import Path

from scripts.bench.ceiling import bound_ceiling
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
    ceiling = bound_ceiling(wl, r.eta)
    pushes = max(1, r.steps)
    return {
        "eta": r.eta, "mode": mode_of(r), "repeat": r.repeat,
        "trained_tok_s": r.trained_tokens_per_s, "engine_clock_tok_s": r.trained_tokens_per_s / wl.time_scale,
        "of_bound_ceiling": r.trained_tokens_per_s / ceiling.wall_tokens_per_s,
        "reprefill_tok_per_push": r.resumed_input_tokens / pushes,
        "prefill_share": s.get("prefill_busy_s", 0.0) / s["busy_s"] if s.get("busy_s") else float("nan"),
        "decode_batch": s.get("output_tokens", 0.0) / s["decode_steps"] if s.get("decode_steps") else float("nan"),
        "lag_max": max(r.lags, default=0),
        "clock_p50": statistics.median(r.clock_rates) / wl.time_scale if r.clock_rates else float("nan"),
    }


def report(results: list[Result], wl: Workload) -> str:
    lines = ["| eta | push mode | repeat | trained tok/s (wall) | engine clock | of bound ceiling | re-prefilled tok / push "
             "| prefill share of busy | mean decode batch | lag max | engine clock / scale p50 |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    rows = [row(r, wl) for r in results if r.ran]
    for x in rows:
        lines.append(f"| {x['eta']} | {x['mode']} | {x['repeat']} | {x['trained_tok_s']:,.0f} | {x['engine_clock_tok_s']:,.0f} "
                     f"| {x['of_bound_ceiling']:.2f} | {x['reprefill_tok_per_push']:,.0f} | {x['prefill_share']:.3f} "
                     f"| {x['decode_batch']:.1f} | {x['lag_max']} | {x['clock_p50']:.2f} |")
    lines.append("")
    for eta in sorted({x["eta"] for x in rows}):
        c = bound_ceiling(wl, int(eta))
        lines.append(f"- {c.describe()}")
        base = {x["repeat"]: x["trained_tok_s"] for x in rows if x["eta"] == eta and x["mode"] == "abort"}
        for mode in dict.fromkeys(x["mode"] for x in rows if x["eta"] == eta and x["mode"] != "abort"):
            ratios = [float(x["trained_tok_s"]) / float(base[x["repeat"]])
                      for x in rows if x["eta"] == eta and x["mode"] == mode and x["repeat"] in base]
            if ratios:
                lines.append(f"- eta {eta}: {mode} / abort trained tokens/s, same repeat: "
                             + ", ".join(f"{v:.2f}x" for v in ratios))
    for r in results:
        if not r.ran:
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
    opts = p.parse_args(argv)
    wl = replace(WORKLOADS[opts.workload], steps=opts.steps)
    if opts.time_scale:
        wl = replace(wl, time_scale=opts.time_scale)
    etas = [int(e) for e in opts.etas.split(",")]
    modes = [m.strip() for m in opts.modes.split(",")]
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="bench-push-") as tmp:
        workdir = Path(opts.keep or tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        results = run_all(wl, etas=etas, modes=modes, repeats=opts.repeats, workdir=workdir)
    text = report(results, wl)
    print(f"{wl.describe()}; run took {time.monotonic() - started:.0f} s")
    print(text)
    if opts.json:
        Path(opts.json).write_text(json.dumps({"workload": asdict(wl), "rows": [row(r, wl) for r in results if r.ran],
                                               "report": text}, indent=1))
    return 0 if all(r.ran for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
