"""`rollout bench --sections scale`, its liveness part (issue 26; scripts/bench/scale.py):

Liveness: W simulated workers (the real `workers.liveness.Liveness`, many per process: this
machine has 2 cores) with J = 32 recorded jobs each heart-beat against one private
redis-server. Each W runs a few heartbeat intervals, the workers' beats spread over each
interval as real workers' are; measured: the server's CPU time per interval (INFO cpu, the
server process's own accounting, less its idle rate measured beside the pinger alone), and the
p99 latency of a plain PING issued every 2 ms by a separate process beside them. The interval
is compressed to HEARTBEAT_S (1 s) so the run is short; the share of a Redis core is then
quoted at the default heartbeat (`workers.heartbeat_s` 5 s). Growth exponent: the slope of
log(CPU per interval) against log(W), least squares over the W's medians.
Goal: exponent <= 1.3, and at W = 500 below 10% of one core with PING p99 < 5 ms.
"""

from __future__ import annotations

import asyncio
import math
import multiprocessing as mp
import random
import statistics
import time
import uuid
from collections.abc import Iterable
from typing import Any

import redis as sync_redis

from pipeline.keys import Keys
from pipeline.store.redis_conn import connect
from scripts.bench.report import Figure

WORKER_COUNTS = (10, 50, 200, 500)
JOBS_PER_WORKER = 32
HEARTBEAT_S = 1.0  # the bench's interval (compressed); shares are quoted at DEFAULT_HEARTBEAT_S
DEFAULT_HEARTBEAT_S = 5.0  # WorkersSection.heartbeat_s
PING_EVERY_S = 0.002
GOAL_EXPONENT, GOAL_CORE_SHARE, GOAL_P99_MS = 1.3, 0.10, 5.0


# ------------------------------------------------------------------ liveness


def _pinger(url: str, seconds: float, out: Any) -> None:
    """A plain client beside the workers (own process: the workers' event loop does not delay it)."""
    client = sync_redis.Redis.from_url(url)
    client.ping()
    latencies = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        t0 = time.perf_counter()
        client.ping()
        latencies.append(time.perf_counter() - t0)
        time.sleep(PING_EVERY_S)
    out.send(latencies)
    out.close()


def _p99_ms(latencies: list[float]) -> float:
    ordered = sorted(latencies)
    return 1e3 * ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] if ordered else float("nan")


async def _server_cpu_s(redis: Any) -> float:
    info = await redis.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


async def _with_pinger(url: str, seconds: float, body: Any) -> list[float]:
    """Run `body()` for `seconds` with the pinger beside it; the pinger's latencies."""
    ctx = mp.get_context("fork")  # the child runs sync code only; spawn would re-import the project
    receive, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_pinger, args=(url, seconds, send), daemon=True)
    proc.start()
    await body()
    latencies: list[float] = await asyncio.to_thread(receive.recv)
    proc.join(timeout=10)
    return latencies


async def _idle(url: str, seconds: float) -> tuple[float, float]:
    """(server CPU s per s, PING p99 ms) with the pinger alone."""
    redis = connect(url)
    try:
        cpu0 = await _server_cpu_s(redis)
        started = time.monotonic()
        latencies = await _with_pinger(url, seconds, lambda: asyncio.sleep(seconds))
        cpu = (await _server_cpu_s(redis) - cpu0) / (time.monotonic() - started)
    finally:
        await redis.aclose()
    return cpu, _p99_ms(latencies)


async def _liveness_run(url: str, workers: int, intervals: int, idle_cpu_per_s: float) -> dict[str, float]:
    """One repeat at W = `workers`: CPU per interval, PING p99, commands per heartbeat."""
    from workers.liveness import Liveness

    redis = connect(url)
    keys = Keys(f"scale{uuid.uuid4().hex[:8]}")
    fleet = [Liveness(redis, keys, f"node{i // 8}:{i}", heartbeat_s=HEARTBEAT_S, dead_after_s=4 * HEARTBEAT_S)
             for i in range(workers)]
    try:
        await _record_jobs(redis, keys, fleet)
        for worker in fleet:  # warm: scripts loaded, one lease taken
            await worker.heartbeat()
        await redis.config_resetstat()
        await redis.config_set("slowlog-log-slower-than", 1000)  # us: Redis-side stalls of 1 ms or more
        await redis.slowlog_reset()
        cpu0, started = await _server_cpu_s(redis), time.monotonic()
        seconds = intervals * HEARTBEAT_S
        latencies = await _with_pinger(url, seconds, lambda: _beat_for(fleet, seconds))
        wall = time.monotonic() - started
        cpu = await _server_cpu_s(redis) - cpu0 - idle_cpu_per_s * wall
        stats = await redis.info("commandstats")
        slow = await redis.slowlog_get(1024)
    finally:
        await redis.flushall()
        await redis.aclose()
    calls = {name.removeprefix("cmdstat_"): int(row["calls"]) for name, row in stats.items()}
    beats = max(1, calls.get("zadd", 0))
    commands = sum(v for k, v in calls.items() if k not in ("ping", "info", "config|resetstat"))
    return {"cpu_s_per_interval": max(cpu, 1e-6) * HEARTBEAT_S / wall, "p99_ms": _p99_ms(latencies),
            "commands_per_beat": round(commands / beats, 2), "beats": beats, "pings": len(latencies),
            "longest_script_ms": max((e["duration"] / 1e3 for e in slow if e["command"].startswith(b"EVALSHA")),
                                     default=0.0)}


async def _record_jobs(redis: Any, keys: Keys, fleet: list[Any]) -> None:
    """J jobs per worker, recorded by the real `job_started`, each in arq's queue and in progress."""
    from arq.constants import in_progress_key_prefix

    now_ms = int(time.time() * 1000)
    for first in range(0, len(fleet), 32):  # 32 workers' jobs at once
        owned = [(worker, keys.arq_job_id(f"w{first + i}-t{j}:0"))
                 for i, worker in enumerate(fleet[first:first + 32]) for j in range(JOBS_PER_WORKER)]
        await asyncio.gather(*(worker.job_started(job) for worker, job in owned))
        pipe = redis.pipeline(transaction=False)
        pipe.zadd(keys.queue, {job: now_ms - 60_000 + k for k, (_w, job) in enumerate(owned)})
        for _worker, job in owned:
            pipe.set(in_progress_key_prefix + job, b"1")
        await pipe.execute()


async def _beat_for(fleet: list[Any], seconds: float) -> None:
    """Every worker heart-beats once per interval, at its own phase, as a fleet of processes does."""
    phases = [random.random() * HEARTBEAT_S for _ in fleet]
    start = time.monotonic()

    async def run(worker: Any, phase: float) -> None:
        beat_at = start + phase
        while beat_at < start + seconds:
            await asyncio.sleep(max(0.0, beat_at - time.monotonic()))
            await worker.heartbeat()
            beat_at += HEARTBEAT_S

    await asyncio.gather(*(run(w, p) for w, p in zip(fleet, phases)))


def _exponent(points: Iterable[tuple[float, float]]) -> float:
    """Least-squares slope of log(y) against log(x)."""
    xs, ys = zip(*[(math.log(x), math.log(max(y, 1e-9))) for x, y in points])
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def _spread(values: list[float]) -> dict[str, float]:
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def bench_liveness(url: str, *, quick: bool) -> list[Figure]:
    repeats, intervals = (1, 2) if quick else (3, 4)
    runs: dict[int, list[dict[str, float]]] = {w: [] for w in WORKER_COUNTS}
    idles = []
    for _ in range(repeats):
        idles.append(asyncio.run(_idle(url, 1.0 if quick else 2.0)))
        idle_cpu = idles[-1][0]
        for workers in WORKER_COUNTS:
            runs[workers].append(asyncio.run(_liveness_run(url, workers, intervals, idle_cpu)))
    table: dict[int, dict[str, Any]] = {w: {"cpu_s_per_interval": _spread([r["cpu_s_per_interval"] for r in rs]),
                 "p99_ms": _spread([r["p99_ms"] for r in rs]),
                 "commands_per_beat": statistics.median(r["commands_per_beat"] for r in rs),
                 "longest_script_ms": max(r["longest_script_ms"] for r in rs)} for w, rs in runs.items()}
    for w, row in table.items():
        cpu, p99 = row["cpu_s_per_interval"], row["p99_ms"]
        print(f"[scale] W={w:>3} J={JOBS_PER_WORKER}: Redis CPU per interval min/median/max "
              f"{cpu['min'] * 1e3:.2f}/{cpu['median'] * 1e3:.2f}/{cpu['max'] * 1e3:.2f} ms "
              f"({cpu['median'] / DEFAULT_HEARTBEAT_S:.2%} of a core at a {DEFAULT_HEARTBEAT_S:g} s heartbeat), "
              f"PING p99 {p99['min']:.2f}/{p99['median']:.2f}/{p99['max']:.2f} ms, "
              f"{row['commands_per_beat']} commands per heartbeat, longest liveness script "
              f"{row['longest_script_ms']:.1f} ms (Redis's SLOWLOG, 1 ms and up)", flush=True)
    idle_p99 = statistics.median(p99 for _cpu, p99 in idles)
    exponent = _exponent((w, row["cpu_s_per_interval"]["median"]) for w, row in table.items())
    p99_exponent = _exponent((w, row["p99_ms"]["median"]) for w, row in table.items())
    top = table[max(WORKER_COUNTS)]
    share = top["cpu_s_per_interval"]["median"] / DEFAULT_HEARTBEAT_S
    p99 = top["p99_ms"]["median"]
    details = {"table": table, "repeats": repeats, "intervals": intervals, "heartbeat_s": HEARTBEAT_S,
               "idle_cpu_s_per_s": [round(cpu, 5) for cpu, _p99 in idles], "idle_p99_ms": round(idle_p99, 3)}
    top_w = max(WORKER_COUNTS)
    return [
        Figure(section="scale", name=f"liveness: growth exponent of Redis CPU in W ({', '.join(map(str, WORKER_COUNTS))};"
               f" PING p99 exponent {p99_exponent:.2f})", value=exponent, unit="", baseline="goal",
               baseline_value=GOAL_EXPONENT, ratio=GOAL_EXPONENT / max(exponent, 1e-3),
               goal=f"<= {GOAL_EXPONENT:g}", met=exponent <= GOAL_EXPONENT, details=details),
        Figure(section="scale", name=f"liveness: share of one Redis core at W={top_w}, J={JOBS_PER_WORKER}, "
               f"{DEFAULT_HEARTBEAT_S:g} s heartbeat (median of {repeats})", value=100 * share, unit="%",
               baseline="goal", baseline_value=100 * GOAL_CORE_SHARE, ratio=GOAL_CORE_SHARE / max(share, 1e-9),
               goal=f"< {100 * GOAL_CORE_SHARE:g} %", met=share < GOAL_CORE_SHARE),
        Figure(section="scale", name=f"liveness: PING p99 beside W={top_w} workers at a {HEARTBEAT_S:g} s heartbeat"
               f" (median of {repeats})", value=p99, unit="ms", baseline="PING p99 with no workers",
               baseline_value=idle_p99, ratio=idle_p99 / max(p99, 1e-9), goal=f"< {GOAL_P99_MS:g} ms",
               met=p99 < GOAL_P99_MS),
    ]
