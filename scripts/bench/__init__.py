"""`rollout bench`: every benchmark section side by side with its baseline, in one run.

    rollout bench [--quick] [--sections codec,buffer,...] [--json bench.json]
    rollout bench plan --lengths profile.json --engines 4 --slots 64 --step-time 30

Each section prints its figure, the baseline measured in the same run, the ratio
and the goal (the anchor); all figures go to one JSON file. Sections run on a
private redis-server (never a shared one). Speed goals are shown here, not asserted
in tests.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from collections.abc import Callable
from pathlib import Path

from pipeline.store.local_redis import LocalRedis
from scripts.bench.report import Figure, Report, machine, print_figures

SECTIONS = ("codec", "buffer", "handoff", "queue", "worker", "async")
# asked for by name only (minutes each): slime's own rollout functions next to this pipeline
OPT_IN_SECTIONS = ("peer", "scale", "learn")


def _section_runner(name: str, redis_url: str, quick: bool) -> Callable[[], list[Figure]]:
    if name == "codec":
        from scripts.bench.micro import bench_codec
        return lambda: bench_codec(quick=quick)
    if name == "buffer":
        from scripts.bench.micro import bench_buffer
        return lambda: bench_buffer(redis_url, quick=quick)
    if name == "handoff":
        from scripts.bench.micro import bench_handoff
        return lambda: bench_handoff(redis_url, quick=quick)
    if name == "queue":
        from scripts.bench.arq_queue import bench_queue
        return lambda: bench_queue(redis_url, quick=quick)
    if name == "worker":
        return lambda: _worker_section(quick)
    if name == "async":
        from scripts.bench.async_loop import bench_async
        return lambda: bench_async(redis_url, quick=quick)
    if name == "peer":
        return lambda: _peer_section(quick)
    if name == "scale":  # W simulated workers' liveness and 100,000 groups' memory (scripts/bench/scale.py)
        from scripts.bench.scale import bench_scale
        return lambda: bench_scale(redis_url, quick=quick)
    if name == "learn":  # a tiny LM trained through the pipeline by slime's loop (scripts/bench/learn.py)
        from scripts.bench.learn import bench_learn
        return lambda: bench_learn(quick=quick, out_dir=Path("."))
    raise ValueError(f"unknown section {name!r} (known: {', '.join(SECTIONS + OPT_IN_SECTIONS)})")


def _peer_section(quick: bool) -> list[Figure]:
    """The frontier (issues 25, 31): slime's sync and fully-async rollouts next to this pipeline
    at eta 1, 2, 4, 8 and at fully async's max lag, on the default workload (AReaL's published
    7B run, time-scaled; scripts/bench/peer.py prints its tables and writes
    bench-peer-frontier.png and the compact summary to bench-peer.json here; it needs the slime
    snapshot, found by scripts/upstream.py). Its goals come back as figures."""
    from scripts.bench.peer import bench_peer

    return bench_peer(quick=quick, plot_path=Path("bench-peer-frontier.png"), json_path="bench-peer.json")


# The engine answers after a per-token latency (mean 10 ms, ~0.5 s a turn), so the episodes are
# really in flight at once (the engine's max_running shows how many); with a zero-latency engine
# each one finished before the next started.
WORKER_ENGINE_ARGS = ["--token-latency-s", "0.01"]


def _worker_section(quick: bool) -> list[Figure]:
    """One worker process, simulated engine with latency (scripts/bench/worker.py, owned by workers/)."""
    try:
        module = importlib.import_module("scripts.bench.worker")
    except ImportError as exc:
        print(f"[worker] skipped: scripts.bench.worker is not available ({exc})")
        return []
    episodes = 2000 if quick else 8000
    base = module.run_worker_bench(64, episodes // 4, engine_args=WORKER_ENGINE_ARGS)
    high = module.run_worker_bench(1000, episodes, engine_args=WORKER_ENGINE_ARGS)
    lag_ms = float(high["lag_p99_ms"])
    return [
        Figure(section="worker", name="event-loop lag p99 at 1,000 concurrent episodes (one process, engine 10 ms/token, "
               f"{high.get('engine_max_running', '?')} generate calls in flight at once)",
               value=lag_ms, unit="ms", baseline="goal", baseline_value=50.0, ratio=50.0 / max(lag_ms, 1e-3),
               goal="< 50 ms", met=lag_ms < 50.0, details={"at_1000": high, "at_64": base}),
        Figure(section="worker", name="episodes/s at 1,000 concurrent episodes", value=float(high["episodes_per_s"]),
               unit="episodes/s", baseline="same worker at 64 concurrent", baseline_value=float(base["episodes_per_s"]),
               ratio=float(high["episodes_per_s"]) / max(float(base["episodes_per_s"]), 1e-9)),
    ]


def run(sections: list[str], *, quick: bool) -> list[Figure]:
    figures: list[Figure] = []
    with LocalRedis() as server:
        for name in sections:
            started = time.monotonic()
            try:
                produced = _section_runner(name, server.url, quick)()
            except Exception as exc:  # one broken section must not hide the others' figures
                print(f"[{name}] FAILED: {type(exc).__name__}: {exc}", file=sys.stderr)
                produced = [Figure.failed(name, exc)]
            print_figures(produced)
            print(f"[{name}] {time.monotonic() - started:.1f} s", flush=True)
            figures += produced
    return figures


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="rollout bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smaller runs: a few minutes on 2 cores")
    parser.add_argument("--sections", default=",".join(SECTIONS),
                        help=f"comma-separated subset of {SECTIONS}, or the opt-in {OPT_IN_SECTIONS}")
    parser.add_argument("--json", default="bench-results.json", help="where to write all figures")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "plan":
        from scripts.bench.plan import main as plan_main
        return plan_main(argv[1:])
    args = _parse(argv)
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = sorted(set(sections) - set(SECTIONS) - set(OPT_IN_SECTIONS))
    if unknown:
        print(f"rollout bench: unknown sections {unknown} (known: {', '.join(SECTIONS + OPT_IN_SECTIONS)})", file=sys.stderr)
        return 2
    started = time.monotonic()
    figures = run(sections, quick=args.quick)
    report = Report(quick=args.quick, seconds=round(time.monotonic() - started, 1), machine=machine(), figures=figures)
    report.write(args.json)
    print(f"\n{len(figures)} figures in {report.seconds} s -> {args.json}; goals not met: {len(report.missed)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
