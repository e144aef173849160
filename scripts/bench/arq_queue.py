"""Queue section: arq job throughput and pick-up latency, our worker settings vs arq's defaults.

Both run a real arq `Worker` (in-process, same event loop as the enqueuer) on the
given private redis. "Ours" = the pipeline's worker settings (small poll delay,
max_jobs = per-process concurrency) and, once workers/ provides it, the msgspec
job serializer; "defaults" = arq's own (poll_delay 0.5 s, max_jobs 10, pickle).
"""

from __future__ import annotations

import asyncio
import importlib
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from arq import create_pool
from arq.connections import RedisSettings
from arq.worker import Worker

from pipeline.config import WorkersSection
from scripts.bench.report import Figure
from scripts.bench.timing import percentile, ratio

ARQ_DEFAULT_POLL_S = 0.5
ARQ_DEFAULT_MAX_JOBS = 10


async def noop_job(ctx: dict[str, Any], payload: bytes) -> None:
    return None


async def sleep_job(ctx: dict[str, Any], payload: bytes) -> None:
    await asyncio.sleep(0.05)


@dataclass
class Profile:
    name: str
    poll_delay: float
    max_jobs: int
    serializer: Callable[[Any], bytes] | None = None
    deserializer: Callable[[bytes], Any] | None = None
    notes: list[str] = field(default_factory=list)


def _our_serializers() -> tuple[Callable | None, Callable | None, str]:
    """The workers' msgspec job serializer when workers/ has one (looked up lazily: scripts may run without it)."""
    for module_name in ("pipeline.store.jobqueue",):
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        ser, de = getattr(module, "job_serializer", None), getattr(module, "job_deserializer", None)
        if ser and de:
            return ser, de, f"{module_name} msgspec serializer"
    return None, None, "pickle (workers/ has no msgspec serializer yet)"


def profiles() -> tuple[Profile, Profile]:
    settings = WorkersSection()
    ser, de, serializer_note = _our_serializers()
    ours = Profile("ours", settings.poll_delay_s, settings.concurrency, ser, de, [serializer_note])
    defaults = Profile("arq defaults", ARQ_DEFAULT_POLL_S, ARQ_DEFAULT_MAX_JOBS, notes=["pickle"])
    return ours, defaults


def _worker(profile: Profile, settings: RedisSettings, queue: str, *, burst: bool) -> Worker:
    return Worker(
        functions=[noop_job, sleep_job], redis_settings=settings, queue_name=queue, burst=burst,
        handle_signals=False, poll_delay=profile.poll_delay, max_jobs=profile.max_jobs, keep_result=60,
        job_serializer=profile.serializer, job_deserializer=profile.deserializer, log_results=False,
    )


async def _burst_rate(profile: Profile, settings: RedisSettings, function: str, jobs: int) -> float:
    """Jobs/s draining `jobs` queued jobs."""
    queue = f"bq{uuid.uuid4().hex[:8]}"
    pool = await create_pool(settings, job_serializer=profile.serializer, job_deserializer=profile.deserializer)
    payload = b"x" * 512
    for i in range(jobs):
        await pool.enqueue_job(function, payload, _job_id=f"{queue}-{i}", _queue_name=queue)
    worker = _worker(profile, settings, queue, burst=True)
    started = time.perf_counter()
    await worker.async_run()
    elapsed = time.perf_counter() - started
    done = worker.jobs_complete
    await worker.close()
    await pool.aclose()
    if done != jobs:
        raise RuntimeError(f"queue bench: {profile.name} completed {done}/{jobs} {function} jobs")
    return jobs / elapsed


async def _pickup_latency(profile: Profile, settings: RedisSettings, count: int) -> list[float]:
    """Enqueue -> result latency of single no-op jobs sent one at a time to an idle worker."""
    queue = f"bl{uuid.uuid4().hex[:8]}"
    pool = await create_pool(settings, job_serializer=profile.serializer, job_deserializer=profile.deserializer)
    worker = _worker(profile, settings, queue, burst=False)
    task = asyncio.create_task(worker.async_run())
    latencies = []
    try:
        await asyncio.sleep(0.2)
        for i in range(count):
            started = time.perf_counter()
            job = await pool.enqueue_job("noop_job", b"x", _job_id=f"{queue}-{i}", _queue_name=queue)
            assert job is not None  # None: the job id was taken, and each is new
            await job.result(timeout=10, poll_delay=0.002)
            latencies.append(time.perf_counter() - started)
            await asyncio.sleep(0.013 * (i % 7))  # land at different points of the poll cycle
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await worker.close()
        await pool.aclose()
    return latencies


async def _queue_async(redis_url: str, quick: bool) -> list[Figure]:
    settings = RedisSettings.from_dsn(redis_url)
    ours, defaults = profiles()
    figures: list[Figure] = []
    for function, jobs in (("noop_job", 400 if quick else 2000), ("sleep_job", 150 if quick else 600)):
        ours_rate = await _burst_rate(ours, settings, function, jobs)
        base_rate = await _burst_rate(defaults, settings, function, jobs)
        figures.append(Figure(
            section="queue", name=f"arq throughput, {'no-op' if function == 'noop_job' else '50 ms'} jobs, ours",
            value=ours_rate, unit="jobs/s", baseline="arq defaults", baseline_value=base_rate,
            ratio=ratio(ours_rate, base_rate),
            details={"jobs": jobs, "ours": _describe(ours), "defaults": _describe(defaults)},
        ))
    count = 12 if quick else 40
    ours_lat = await _pickup_latency(ours, settings, count)
    base_lat = await _pickup_latency(defaults, settings, count)
    ms = 1e3
    figures.append(Figure(
        section="queue", name="arq enqueue->result latency p50, idle worker, ours", value=percentile(ours_lat, 50) * ms,
        unit="ms", baseline="arq defaults", baseline_value=percentile(base_lat, 50) * ms,
        ratio=ratio(percentile(base_lat, 50), percentile(ours_lat, 50)),
        details={"jobs": count, "ours_p90_ms": percentile(ours_lat, 90) * ms,
                 "defaults_p90_ms": percentile(base_lat, 90) * ms},
    ))
    return figures


def _describe(profile: Profile) -> dict[str, Any]:
    return {"poll_delay_s": profile.poll_delay, "max_jobs": profile.max_jobs, "serializer": profile.notes}


def bench_queue(redis_url: str, *, quick: bool) -> list[Figure]:
    return asyncio.run(_queue_async(redis_url, quick))
