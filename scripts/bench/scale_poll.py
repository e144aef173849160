"""`rollout bench --sections scale`, its poll part (scripts/bench/scale.py): what W idle workers' queue
polls cost Redis beside their heartbeats, with J jobs in progress, against arq's own poll."""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from typing import Any

from pipeline.keys import Keys
from pipeline.store.redis_conn import connect
from scripts.bench.report import Figure
from scripts.bench.scale_liveness import DEFAULT_HEARTBEAT_S, GOAL_CORE_SHARE, _exponent, _server_cpu_s

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

    from pipeline.store.jobqueue import redis_settings
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
