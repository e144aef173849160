"""`rollout bench --sections scale`: what a cluster's size costs Redis (issue 26).

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

Memory: GROUPS groups pushed through the buffer (`GroupBuffer.push`) and taken by the trainer
side (`RedisDataSource.get_samples`, `save` each step: the real data source path), batch 64.
used_memory per 1,000 groups, while running (half-way, a step's groups in the stream) and after
consumption, broken down by key family (MEMORY USAGE over SCAN, by prefix), with each family's
TTL. Next to it, one arq result as the workers now store it and as arq's default would.
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
from types import SimpleNamespace
from typing import Any

import redis as sync_redis

from pipeline.keys import Keys, attempts_field
from pipeline.local_redis import LocalRedis
from pipeline.redis_conn import connect
from scripts.bench.report import Figure

WORKER_COUNTS = (10, 50, 200, 500)
JOBS_PER_WORKER = 32
HEARTBEAT_S = 1.0  # the bench's interval (compressed); shares are quoted at DEFAULT_HEARTBEAT_S
DEFAULT_HEARTBEAT_S = 5.0  # WorkersSection.heartbeat_s
PING_EVERY_S = 0.002
GOAL_EXPONENT, GOAL_CORE_SHARE, GOAL_P99_MS = 1.3, 0.10, 5.0
BATCH = 64


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


# ------------------------------------------------------------------ poll + liveness

POLL_WORKER_COUNTS = (10, 50, 200, 500)
POLL_JOBS_IN_PROGRESS = (0, 1000, 2000)
POLL_GOAL_W, POLL_GOAL_J = 500, 1000
POLL_GOAL_EXPONENT = 1.1  # linear in W (a fixed part, the rechecks of J jobs, makes it less)
POLL_SLOTS = 32  # workers.concurrency's default: every worker has free slots (the costly case)
POLL_DELAY_S = 0.05  # workers.poll_delay_s's default


async def _noop(ctx: Any) -> None:
    return None


def _poller(url: str, keys: Keys, *, arq_poll: bool = False) -> Any:
    """A real `RolloutWorker` (the worker's poll, arq's run_job) on the pipeline's queue, with
    build_worker's poll settings; `arq_poll`: arq 0.28's own poll instead (the 2a5bbd0 baseline)."""
    from arq.worker import Worker, func

    from pipeline.jobqueue import redis_settings
    from workers.settings import RolloutWorker

    class Counted(RolloutWorker):  # counts its loop's iterations: is the one process keeping up?
        iterations = 0

        async def _poll_iteration(self) -> None:
            Counted.iterations += 1
            await super()._poll_iteration()

    class ArqPoll(Counted):
        async def _poll_iteration(self) -> None:
            Counted.iterations += 1
            await Worker._poll_iteration(self)

        async def start_jobs(self, job_ids: list[bytes]) -> None:
            await Worker.start_jobs(self, job_ids)

    cls = ArqPoll if arq_poll else Counted
    return cls(functions=[func(_noop, name="noop")], queue_name=keys.queue, redis_settings=redis_settings(url),
               max_jobs=POLL_SLOTS, poll_delay=POLL_DELAY_S, job_timeout=3600, handle_signals=False,
               allow_abort_jobs=True, health_check_interval=DEFAULT_HEARTBEAT_S, keep_result=60)


class _Fleet:
    """W pollers and W liveness loops (real code; one process, one loop) against one Redis."""

    def __init__(self, url: str, keys: Keys, workers: int, *, arq_poll: bool = False):
        from workers.liveness import Liveness

        self.keys = keys
        self.redis = connect(url)
        self.pollers = [_poller(url, keys, arq_poll=arq_poll) for _ in range(workers)]
        self.liveness = [Liveness(self.redis, keys, f"node{i // 8}:{i}", heartbeat_s=DEFAULT_HEARTBEAT_S,
                                  dead_after_s=4 * DEFAULT_HEARTBEAT_S) for i in range(workers)]
        self.tasks: list[asyncio.Task[Any]] = []
        self.jobs = 0

    async def start(self) -> None:
        async def beat_later(liveness: Any) -> None:  # at its own phase, as a fleet of processes beats
            await asyncio.sleep(random.random() * DEFAULT_HEARTBEAT_S)
            liveness.start()

        for poller in self.pollers:
            self.tasks.append(asyncio.create_task(poller.async_run()))
        self.tasks += [asyncio.create_task(beat_later(lv)) for lv in self.liveness]
        while any(p._pool is None for p in self.pollers):
            await asyncio.sleep(0.05)

    async def hold(self, jobs_in_progress: int) -> None:
        """Up to `jobs_in_progress` jobs in progress, as workers hold them: in arq's queue (due),
        their in-progress keys set, recorded by the workers' liveness (`job_started`)."""
        from arq.constants import in_progress_key_prefix

        now_ms = int(time.time() * 1000)
        new = [self.keys.arq_job_id(f"held{i}:0") for i in range(self.jobs, jobs_in_progress)]
        for k, job in enumerate(new):
            await self.liveness[k % len(self.liveness)].job_started(job)
        for first in range(0, len(new), 500):
            pipe = self.redis.pipeline(transaction=False)
            batch = new[first:first + 500]
            pipe.zadd(self.keys.queue, {job: now_ms - 60_000 + first + k for k, job in enumerate(batch)})
            for job in batch:
                pipe.set(in_progress_key_prefix + job, b"1", px=3_600_000)
            await pipe.execute()
        self.jobs = max(self.jobs, jobs_in_progress)

    async def stop(self) -> None:
        from workers.settings import stop_worker

        for liveness in self.liveness:
            await liveness.stop()
        for poller, task in zip(self.pollers, self.tasks):
            await stop_worker(poller, task)
        for task in self.tasks[len(self.pollers):]:
            task.cancel()
        await self.redis.flushall()
        await self.redis.aclose()


async def _measure(redis: Any, seconds: float, idle_cpu_per_s: float, workers: int) -> dict[str, float]:
    """Redis CPU (less its idle rate) and commands per second over `seconds`, the fleet running."""
    from workers.settings import RolloutWorker

    await redis.config_resetstat()
    cpu0, started = await _server_cpu_s(redis), time.monotonic()
    iterations0 = _iterations(RolloutWorker)
    await asyncio.sleep(seconds)
    wall = time.monotonic() - started
    cpu = await _server_cpu_s(redis) - cpu0 - idle_cpu_per_s * wall
    calls = {name.removeprefix("cmdstat_"): int(row["calls"]) for name, row in (await redis.info("commandstats")).items()}
    commands = sum(n for name, n in calls.items() if name not in ("info", "config|resetstat"))
    return {"cpu_share": max(cpu, 0.0) / wall, "commands_per_s": commands / wall,
            "commands_per_worker_s": commands / wall / workers,
            "cpu_ms_per_worker_s": 1e3 * max(cpu, 0.0) / wall / workers,
            "loop_iterations_per_worker_s": (_iterations(RolloutWorker) - iterations0) / wall / workers,
            "evalsha_per_s": calls.get("evalsha", 0) / wall, "exists_per_s": calls.get("exists", 0) / wall}


def _iterations(base: Any) -> int:
    return sum(getattr(cls, "iterations", 0) for cls in base.__subclasses__())


async def _idle_cpu(url: str, seconds: float) -> float:
    redis = connect(url)
    try:
        cpu0, started = await _server_cpu_s(redis), time.monotonic()
        await asyncio.sleep(seconds)
        return (await _server_cpu_s(redis) - cpu0) / (time.monotonic() - started)
    finally:
        await redis.aclose()


async def _poll_rows(url: str, workers: int, jobs_list: tuple[int, ...], *, warm_s: float, seconds: float,
                     idle_cpu: float, arq_poll: bool = False) -> dict[int, dict[str, float]]:
    fleet = _Fleet(url, Keys(f"poll{uuid.uuid4().hex[:8]}"), workers, arq_poll=arq_poll)
    rows = {}
    try:
        await fleet.start()
        for jobs in jobs_list:
            await fleet.hold(jobs)
            await asyncio.sleep(warm_s)  # the first looks at the new jobs, every worker beating
            rows[jobs] = await _measure(fleet.redis, seconds, idle_cpu, workers)
            row = rows[jobs]
            print(f"[scale] poll+liveness W={workers:>3} J={jobs:>4}{' (arq 0.28 poll)' if arq_poll else ''}: "
                  f"Redis {100 * row['cpu_share']:.2f}% of a core ({row['cpu_ms_per_worker_s']:.3f} ms/s per worker), "
                  f"{row['commands_per_s']:.0f} commands/s ({row['commands_per_worker_s']:.1f} per worker), "
                  f"poll loop {row['loop_iterations_per_worker_s']:.1f} wakes/s per worker "
                  f"(nominal {1 / POLL_DELAY_S:g})", flush=True)
    finally:
        await fleet.stop()
    return rows


def bench_poll(url: str, *, quick: bool, worker_counts: tuple[int, ...] | None = None,
               jobs_in_progress: tuple[int, ...] | None = None, windows_s: tuple[float, float] | None = None
               ) -> list[Figure]:
    """W real `RolloutWorker` pollers (free slots, nothing to start) and their liveness, beside J
    jobs in progress, on one loop against one redis-server: Redis CPU and commands per second.
    Next to it, arq 0.28's own poll (what 2a5bbd0 ran) at the smallest W."""
    counts = worker_counts or ((10, 50) if quick else POLL_WORKER_COUNTS)
    jobs_list = jobs_in_progress or ((0, 1000) if quick else POLL_JOBS_IN_PROGRESS)
    warm_s, seconds = windows_s or ((3.0, 4.0) if quick else (6.0, 10.0))
    idle_cpu = asyncio.run(_idle_cpu(url, 2.0))
    table = {w: asyncio.run(_poll_rows(url, w, jobs_list, warm_s=warm_s, seconds=seconds, idle_cpu=idle_cpu))
             for w in counts}
    base_j = POLL_GOAL_J if POLL_GOAL_J in jobs_list else max(jobs_list)
    baseline = asyncio.run(_poll_rows(url, min(counts), (base_j,), warm_s=2.0, seconds=seconds / 2,
                                      idle_cpu=idle_cpu, arq_poll=True))[base_j]
    exponent = _exponent((w, max(table[w][base_j]["cpu_share"], 1e-6)) for w in counts) if len(counts) > 1 else 0.0
    top_w = max(counts)
    share = table[top_w][base_j]["cpu_share"]
    at_goal = top_w == POLL_GOAL_W and base_j == POLL_GOAL_J
    met_share = share < GOAL_CORE_SHARE
    met_linear = exponent <= POLL_GOAL_EXPONENT
    print(f"[scale] poll+liveness goal (W={POLL_GOAL_W}, J={POLL_GOAL_J}: < {100 * GOAL_CORE_SHARE:g}% of a Redis "
          f"core, growth in W exponent <= {POLL_GOAL_EXPONENT}): share {100 * share:.2f}% at W={top_w}, J={base_j} "
          f"{'met' if met_share else 'missed'}{'' if at_goal else ' (not the goal point: a quick run)'}; "
          f"exponent {exponent:.2f} {'met' if met_linear else 'missed'}", flush=True)
    details = {"table": {w: {j: {k: round(v, 5) for k, v in row.items()} for j, row in rows.items()}
                         for w, rows in table.items()},
               "arq_0_28_poll": {"workers": min(counts), "jobs_in_progress": base_j,
                                 **{k: round(v, 5) for k, v in baseline.items()}},
               "idle_cpu_s_per_s": round(idle_cpu, 5), "warm_s": warm_s, "seconds": seconds,
               "slots_per_worker": POLL_SLOTS, "poll_delay_s": POLL_DELAY_S, "heartbeat_s": DEFAULT_HEARTBEAT_S}
    small = table[min(counts)][base_j]
    return [
        Figure(section="scale", name=f"poll+liveness: share of one Redis core at W={top_w}, J={base_j} "
               f"(real RolloutWorker pollers, {POLL_SLOTS} free slots each)", value=100 * share, unit="%",
               baseline="goal", baseline_value=100 * GOAL_CORE_SHARE, ratio=GOAL_CORE_SHARE / max(share, 1e-9),
               goal=f"< {100 * GOAL_CORE_SHARE:g} %", met=met_share and at_goal, details=details),
        Figure(section="scale", name=f"poll+liveness: growth exponent of Redis CPU in W ({', '.join(map(str, counts))};"
               f" J={base_j})", value=exponent, unit="", baseline="goal", baseline_value=POLL_GOAL_EXPONENT,
               ratio=POLL_GOAL_EXPONENT / max(exponent, 1e-3), goal=f"<= {POLL_GOAL_EXPONENT:g}", met=met_linear),
        Figure(section="scale", name=f"poll+liveness: Redis commands/s per worker at W={min(counts)}, J={base_j}",
               value=small["commands_per_worker_s"], unit="commands/s", baseline="arq 0.28's poll (2a5bbd0)",
               baseline_value=baseline["commands_per_worker_s"],
               ratio=baseline["commands_per_worker_s"] / max(small["commands_per_worker_s"], 1e-9)),
    ]


# ------------------------------------------------------------------ memory


def _family(key: str, ns: str) -> str:
    """The key family: variable parts (ids) replaced by '*'."""
    if key.startswith("arq:"):
        return ":".join(key.split(":")[:2]) + ":*"
    rest = key[len(ns) + 1:]
    head, _, tail = rest.partition(":")
    if head in ("dedup", "op", "consumed", "eval") and tail:
        return f"{{ns}}:{head}:*"
    if head == "worker" and tail:
        return "{ns}:worker:*:jobs"
    return "{ns}:" + rest


async def _families(redis: Any, ns: str) -> dict[str, dict[str, float]]:
    """Per family: keys, bytes (MEMORY USAGE), and the TTL of one of its keys (-1: none)."""
    out: dict[str, dict[str, float]] = {}
    batch: list[str] = []

    async def flush() -> None:
        pipe = redis.pipeline(transaction=False)
        for key in batch:
            pipe.memory_usage(key, samples=0)
            pipe.ttl(key)
        replies = await pipe.execute()
        for key, size, ttl in zip(batch, replies[::2], replies[1::2]):
            if ttl == -2:  # expired between the scan and this read (the sweep lease, a short TTL): gone
                continue
            row = out.setdefault(_family(key, ns), {"keys": 0, "bytes": 0, "ttl_s": ttl})
            row["keys"] += 1
            row["bytes"] += int(size or 0)
        batch.clear()

    for pattern in (f"{ns}:*", f"arq:*{ns}:*"):
        async for raw in redis.scan_iter(match=pattern, count=1000):
            batch.append(raw.decode())
            if len(batch) >= 1000:
                await flush()
    if batch:
        await flush()
    return dict(sorted(out.items(), key=lambda kv: -kv[1]["bytes"]))


def _per_k(families: dict[str, dict[str, float]], groups: int) -> dict[str, dict[str, float]]:
    return {name: {"keys": row["keys"], "bytes_per_1000_groups": round(row["bytes"] * 1000 / groups),
                   "ttl_s": row["ttl_s"]} for name, row in families.items()}


# Per step of BATCH trained groups, the other endings, each through the real code that ends it:
HANDED_BACK_TRAINED = 4  # trained groups that are a handed-back task's attempt 1 (attempts field)
FILTERED = 4  # zero-variance groups the filter drops (half of them attempt 1)
STALE = 4  # past eta: due-first dead-letters them (half of them attempt 1)
WORKER_DEAD = 2  # jobs out of tries on a worker: dead-lettered for good, tombstoned
REAPED_RERUNS = 2  # trained groups whose worker is reaped after the push; the re-run finds the marker
EVALS = 2  # eval jobs (failed ones: no engine here) after a reaper's note
FIRST_ROLLOUT = 10  # rollout ids start here, so a stale group's admission version is >= 0


def bench_memory(url: str, *, quick: bool, groups: int | None = None) -> list[Figure]:
    """`groups` trained groups through the buffer and the data source, and beside them every other
    way a task or a job ends (see the constants above); bytes per key family after each half."""
    from pipeline.aio import LoopThread
    from pipeline.buffer import GroupBuffer
    from pipeline.slime import RedisDataSource

    total = groups or (10_000 if quick else 100_000)
    steps = total // BATCH
    keys = Keys(f"mem{uuid.uuid4().hex[:8]}")
    loop = LoopThread()
    redis = connect(url)
    source = None
    try:
        base = loop.run(_used_memory(redis))
        buffer = GroupBuffer(redis, keys)
        loop.run(buffer.ensure_group())
        source = RedisDataSource(SimpleNamespace(
            pipeline_redis_url=url, pipeline_namespace=keys.ns, rollout_batch_size=BATCH, n_samples_per_prompt=4,
            pipeline_eta=2, pipeline_filter_zero_variance=True, pipeline_stale_policy="requeue"))
        endings = loop.run(_Endings.create(url, keys, buffer))
        running: dict[str, Any] = {}
        after: dict[str, Any]
        started = time.monotonic()
        for step in range(steps):
            rid = FIRST_ROLLOUT + step
            loop.run(endings.step(step, rid))
            if step == steps // 2:  # while running: this step's groups wait in the stream
                running = {"used_memory": loop.run(_used_memory(redis)) - base,
                           "families": _per_k(loop.run(_families(redis, keys.ns)), step * BATCH + BATCH)}
                running["groups"] = step * BATCH + BATCH
            source.current_rollout_id = rid
            source.get_samples(BATCH)
            source.save(rid)
        seconds = time.monotonic() - started
        consumed = steps * BATCH
        loop.run(endings.close())
        after = {"used_memory": loop.run(_used_memory(redis)) - base,
                 "families": _per_k(loop.run(_families(redis, keys.ns)), consumed), "groups": consumed,
                 "counters": loop.run(_counters(redis, keys))}
        results = loop.run(_result_sizes(redis, keys))
        loop.run(redis.flushall())  # type: ignore[arg-type]  # redis-py types async replies Awaitable[T] | T
    finally:
        if source is not None:
            source.close()
        loop.run(redis.aclose())
        loop.close()
    per_k_running = running["used_memory"] * 1000 / running["groups"]
    per_k_after = after["used_memory"] * 1000 / consumed
    print(f"[scale] memory: {consumed} trained groups through buffer + RedisDataSource, and per step of {BATCH}: "
          f"{HANDED_BACK_TRAINED} of them a handed-back task's, {FILTERED} filtered, {STALE} stale (dead-lettered), "
          f"{WORKER_DEAD} dead-lettered by a worker, {REAPED_RERUNS} re-run after a reap, {EVALS} eval jobs; "
          f"{seconds:.1f} s; used_memory per 1,000 trained groups {per_k_running / 1024:.1f} KiB while running, "
          f"{per_k_after / 1024:.1f} KiB after consumption; counters {after['counters']}", flush=True)
    for label, snap in (("while running", running), ("after consumption", after)):
        for name, row in snap["families"].items():
            ttl = "no TTL" if row["ttl_s"] < 0 else f"TTL {row['ttl_s']} s"
            print(f"[scale]   {label:>17}: {name:<26} {row['keys']:>7} keys "
                  f"{row['bytes_per_1000_groups'] / 1024:8.1f} KiB per 1,000 groups ({ttl})", flush=True)
    print(f"[scale]   arq result per job: {results['slim']} B as the workers store it, {results['full']} B with "
          f"arq's default (the whole job)", flush=True)
    return [
        Figure(section="scale", name=f"memory: used_memory per 1,000 groups after consumption ({consumed} groups, "
               "every ending path)", value=per_k_after / 1024, unit="KiB", baseline="while running",
               baseline_value=per_k_running / 1024, ratio=per_k_running / max(per_k_after, 1.0),
               details={"while_running": running, "after_consumption": after, "arq_result_bytes": results,
                        "seconds": round(seconds, 1)}),
        Figure(section="scale", name="memory: one arq result as the workers store it", value=results["slim"], unit="B",
               baseline="arq's default (the whole job)", baseline_value=results["full"],
               ratio=results["full"] / max(results["slim"], 1)),
    ]


class _Endings:
    """One step's groups and jobs, each ended by the real code that ends it: the buffer's push, a
    worker's `run_group` / `_out_of_tries` / `run_eval_group` (a WorkerContext with no engine: no
    path here runs an episode), the reaper (`Liveness.reap`)."""

    def __init__(self, keys: Keys, buffer: Any, context: Any, sweeper: Any):
        from pipeline.synthetic import make_group

        self.keys, self.buffer, self.context, self.sweeper = keys, buffer, context, sweeper
        self.template = [make_group(f"tpl{i}:0", n=4, prompt_len=32, response_len=64, seed=i) for i in range(4)]
        self.flat = make_group("flat:0", n=4, prompt_len=32, response_len=64, rewards=[1.0] * 4)

    @classmethod
    async def create(cls, url: str, keys: Keys, buffer: Any) -> _Endings:
        from pipeline.config import parse_config
        from workers.jobs import WorkerContext
        from workers.liveness import Liveness

        config = parse_config({"redis": {"url": url, "namespace": keys.ns}, "rollout": {"max_requeues": 1}})
        sweeper = Liveness(buffer.redis, keys, "sweeper", heartbeat_s=1.0, dead_after_s=3.0)
        context = WorkerContext(config=config, keys=keys, buffer=buffer, engine=None, chat=None,  # type: ignore[arg-type]  # no episode runs here
                                liveness=sweeper, worker_id="sweeper")
        await sweeper.beat()
        return cls(keys, buffer, context, sweeper)

    def _group(self, task_id: str, rid: int, *, attempt: int = 0, flat: bool = False, stale: bool = False) -> Any:
        import msgspec

        from pipeline.schema import job_id_for

        group = self.flat if flat else self.template[len(task_id) % 4]
        return msgspec.structs.replace(group, group_id=job_id_for(task_id, 0, attempt), attempt=attempt, epoch=0,
                                       task=msgspec.structs.replace(group.task, id=task_id),
                                       admission_version=rid - 10 if stale else rid)

    async def step(self, step: int, rid: int) -> None:
        redis, keys = self.buffer.redis, self.keys
        name = f"s{step}"
        trained = [self._group(f"{name}t{i}", rid, attempt=int(i < HANDED_BACK_TRAINED)) for i in range(BATCH)]
        dropped = [self._group(f"{name}f{i}", rid, attempt=i % 2, flat=True) for i in range(FILTERED)]
        dropped += [self._group(f"{name}x{i}", rid, attempt=i % 2, stale=True) for i in range(STALE)]
        handed_back = [g for g in trained + dropped if g.attempt == 1]  # as the worker's hand-back wrote them
        await redis.hset(keys.requeue_attempts, mapping={attempts_field(g.group_id): 1 for g in handed_back})
        await _push_all(self.buffer, dropped + trained)
        await self._reaped_reruns(trained[-REAPED_RERUNS:], name)
        await self._worker_dead_letters(name, rid)
        await self._evals(name)

    def _job(self, group: Any) -> Any:
        from pipeline.schema import PromptJob

        return PromptJob(task=group.task, epoch=group.epoch, attempt=group.attempt, n_samples=4,
                         admission_version=group.admission_version)

    async def _reaped_reruns(self, groups: list[Any], name: str) -> None:
        """Each pushed by a worker that is then reaped (the reaper notes why in job_errors); the
        re-run finds the group's dedup marker and ends."""
        from pipeline.schema import encode
        from workers.jobs import CTX_KEY, run_group
        from workers.liveness import Liveness

        doomed = Liveness(self.buffer.redis, self.keys, f"doomed-{name}", heartbeat_s=1.0, dead_after_s=3.0)
        await doomed.beat()
        jobs = [self._job(g) for g in groups]
        for job in jobs:
            await doomed.job_started(self.keys.arq_job_id(job.job_id))
        await self.buffer.redis.zadd(self.keys.workers, {doomed.worker_id: 1.0})  # silent for long
        await self.sweeper.beat()
        await self.sweeper.reap()
        for job in jobs:
            ctx = {CTX_KEY: self.context, "job_id": self.keys.arq_job_id(job.job_id), "job_try": 2}
            await run_group(ctx, encode(job))

    async def _worker_dead_letters(self, name: str, rid: int) -> None:
        """Attempt 1 of a handed-back task, out of tries: dead-lettered for good (max_requeues 1)."""
        from pipeline.schema import encode
        from workers.jobs import _out_of_tries

        for i in range(WORKER_DEAD):
            job = self._job(self._group(f"{name}d{i}", rid, attempt=1))
            arq_id = self.keys.arq_job_id(job.job_id)
            await self.buffer.redis.hset(self.keys.requeue_attempts, attempts_field(job.job_id), 1)
            await self.buffer.redis.hset(self.keys.job_errors, arq_id, "an earlier try failed")
            await _out_of_tries(self.context, job, arq_id, "out of tries", encode(job))

    async def _evals(self, name: str) -> None:
        from workers.eval_jobs import run_eval_group
        from workers.jobs import CTX_KEY

        for i in range(EVALS):
            arq_id = self.keys.arq_job_id(f"{name}e{i}:0")
            await self.buffer.redis.hset(self.keys.job_errors, arq_id, "its worker stopped heart-beating")
            await run_eval_group({CTX_KEY: self.context, "job_id": arq_id, "job_try": 2}, f"round{name}", b"no job")

    async def close(self) -> None:
        await self.sweeper.stop()


async def _counters(redis: Any, keys: Keys) -> dict[str, int]:
    return {k.decode(): int(v) for k, v in (await redis.hgetall(keys.counters)).items()}


def _renamed(group: Any, group_id: str) -> Any:
    import msgspec

    return msgspec.structs.replace(group, group_id=group_id, task=msgspec.structs.replace(group.task, id=group_id[:-2]))


async def _push_all(buffer: Any, groups: list[Any]) -> None:
    await asyncio.gather(*(buffer.push(g) for g in groups))


async def _used_memory(redis: Any) -> int:
    return int((await redis.info("memory"))["used_memory"])


async def _result_sizes(redis: Any, keys: Keys) -> dict[str, int]:
    """MEMORY USAGE of one arq result key (a task with a 2,000-character prompt) as the workers
    write it (`workers.settings.result_serializer`) and as arq's default would (the whole job)."""
    from arq.jobs import serialize_result

    from pipeline.jobqueue import JOB_FUNCTION, job_serializer
    from pipeline.schema import PromptJob, Task, encode
    from workers.settings import result_serializer

    job = PromptJob(task=Task(id="t", env="math", prompt="p" * 2000, label="1"), epoch=0, n_samples=8)
    sizes = {}
    for name, serializer in (("slim", result_serializer), ("full", job_serializer)):
        data = serialize_result(JOB_FUNCTION, (encode(job),), {}, 1, 1, True, None, 1, 2, "ref", keys.queue,
                                job_id=keys.arq_job_id(job.job_id), serializer=serializer)
        key = f"arq:result:{keys.ns}:{name}"
        await redis.set(key, data or b"", px=60_000)
        sizes[name] = int(await redis.memory_usage(key, samples=0) or 0)
    return sizes


def bench_scale(url: str, *, quick: bool) -> list[Figure]:
    """The section: liveness, then the poll beside it, each on a private redis-server of its own
    (clean CPU accounting), memory next."""
    with LocalRedis() as server:
        figures = bench_liveness(server.url, quick=quick)
    with LocalRedis() as server:
        figures += bench_poll(server.url, quick=quick)
    with LocalRedis() as server:
        figures += bench_memory(server.url, quick=quick)
    return figures
