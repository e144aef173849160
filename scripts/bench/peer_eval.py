"""Background evaluation's cost to training (issue 40): the pipeline contender of the peer
benchmark (scripts/bench/peer_contenders.py, contender d) on the areal-7b workload, run twice
side by side on fresh engines: training alone, then training with a background eval round
(`pipeline_eval_mode: background`) after every `--every` steps, eval jobs held to
`workers.eval_share` of the worker slots, in interleaved pairs. Printed: trained tokens/s of
each, their ratio (per pair, and the median against the stated floor), the eval calls' waits (what the training loop was held), and the rounds
started, skipped (due while one was in flight), reported and still in flight at the end.

    python -m scripts.bench.peer_eval [--steps 12] [--every 4] [--share 0.25] [--tasks 8] [--n 4] [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from scripts.bench.harness import fleet_of
from scripts.bench.peer_contenders import (
    WORKLOADS,
    Result,
    finish,
    run_pipeline_contender,
    slime_path,
    write_inputs,
)

FLOOR = 0.80  # stated goal: training with a background round keeps >= this share of training alone's tokens/s


def _run(wl, workdir: Path, tasks: Path, evaluation: dict | None) -> Result:
    sub = workdir / ("with-eval" if evaluation else "alone")
    sub.mkdir(parents=True, exist_ok=True)
    with fleet_of(wl.engine_args(str(tasks)), 1, sub) as fleet:
        return finish(run_pipeline_contender(wl, fleet, tasks, sub, evaluation=evaluation), wl)


def _eval_waits(result: Result) -> list[float]:
    return [float(m.group(1)) for note in result.notes if (m := re.match(r"eval call at \d+: ([\d.]+) s", note))]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m scripts.bench.peer_eval", description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--every", type=int, default=4, help="a background eval round after every k-th step")
    p.add_argument("--share", type=float, default=0.25, help="workers.eval_share")
    p.add_argument("--tasks", type=int, default=8, help="eval tasks a round (the workload's math tasks)")
    p.add_argument("--n", type=int, default=4, help="answers per eval task")
    p.add_argument("--repeats", type=int, default=2, help="interleaved pairs (alone, with eval)")
    p.add_argument("--json", default="", help="every run's figures")
    opts = p.parse_args(argv)
    wl = replace(WORKLOADS["areal-7b"], steps=opts.steps)
    # slime's trainer has these imported before its first eval call: a first import (torch and
    # friends, tens of seconds here) would be timed as that call's wait
    sys.path.insert(0, str(slime_path()))
    import slime.observability.rollout_metrics  # noqa: F401
    import slime.rollout.base_types  # noqa: F401
    started = time.monotonic()
    print(f"[peer_eval] {wl.describe()}; eval: {opts.tasks} tasks x {opts.n} answers after every {opts.every} "
          f"steps, eval_share {opts.share:g}", flush=True)
    runs: list[tuple[Result, Result]] = []
    with tempfile.TemporaryDirectory(prefix="bench-peer-eval-") as tmp:
        workdir = Path(tmp)
        tasks, _prompts = write_inputs(workdir)
        datasets = workdir / "eval.yaml"
        datasets.write_text(json.dumps([{"env": "math", "tasks": tasks.name, "n_samples": opts.n,
                                         "max_tasks": opts.tasks}]))
        for rep in range(opts.repeats):  # interleaved: a machine's load drifts between runs
            alone = _run(wl, workdir / f"r{rep}", tasks, None)
            evaluated = _run(wl, workdir / f"r{rep}", tasks,
                             {"datasets": datasets, "every": opts.every, "share": opts.share})
            if not (alone.ran and evaluated.ran):
                print(f"missed: a run did not finish (alone: {alone.reason or 'ok'}; "
                      f"with eval: {evaluated.reason or 'ok'})")
                return 1
            runs.append((alone, evaluated))
            print(f"repeat {rep}: " + line(alone, evaluated), flush=True)
    ratios = sorted(e.trained_tokens_per_s / a.trained_tokens_per_s for a, e in runs)
    ratio = statistics.median(ratios)
    verdict = "met" if ratio >= FLOOR else "MISSED"
    print(f"trained tokens/s with background eval / alone: median {ratio:.2f} over {len(runs)} interleaved repeats "
          f"({', '.join(f'{r:.2f}' for r in ratios)}); goal >= {FLOOR:.2f}: {verdict}; "
          f"run took {time.monotonic() - started:.0f} s")
    if opts.json:
        from dataclasses import asdict

        Path(opts.json).write_text(json.dumps({"runs": [{"alone": asdict(a), "with_eval": asdict(e)} for a, e in runs],
                                               "ratios": ratios, "median": ratio}, indent=1))
    return 0


def line(alone: Result, evaluated: Result) -> str:
    waits = _eval_waits(evaluated)
    c = evaluated.counters
    return (f"trained tokens/s alone {alone.trained_tokens_per_s:,.0f}, with background eval "
            f"{evaluated.trained_tokens_per_s:,.0f} (ratio {evaluated.trained_tokens_per_s / alone.trained_tokens_per_s:.2f});"
            f" eval calls waited max {max(waits, default=0.0):.3f} s over {len(waits)} calls; rounds started "
            f"{c.get('eval_started', 0)}, skipped {c.get('eval_skipped', 0)}, reported {c.get('eval_reported', 0)}, "
            f"failed {c.get('eval_failed', 0)}, in flight at the end {c.get('eval_in_flight', 0)}; "
            f"wall {alone.wall_s:.1f} s / {evaluated.wall_s:.1f} s")

if __name__ == "__main__":
    raise SystemExit(main())
