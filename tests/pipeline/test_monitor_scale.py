"""A monitor refresh costs O(workers + a bounded sample), whatever the queue's length (issue 26
item 1): counted on a private redis-server with INFO commandstats."""

from __future__ import annotations

import time

from arq.constants import in_progress_key_prefix

from pipeline.keys import Counter, Keys
from pipeline.ops.monitor import MAX_DUE_JOBS_CHECKED, snapshot
from pipeline.state import PipelineState
from pipeline.store.local_redis import LocalRedis
from pipeline.store.redis_conn import connect

DUE, RUNNING = 5000, 7


async def _probe(queue_len: int, namespace: str) -> tuple[int, int]:
    """(EXISTS calls of one refresh, the queue's running figure) with `queue_len` due jobs, RUNNING
    of them in progress and recorded by workers."""
    server = LocalRedis().start()
    redis = connect(server.url)
    keys = Keys(namespace)
    try:
        now_ms = int(time.time() * 1000)
        jobs = [keys.arq_job_id(f"t{i}:0") for i in range(queue_len)]
        await redis.zadd(keys.queue, {job: now_ms - queue_len + i for i, job in enumerate(jobs)})
        for job in jobs[:RUNNING]:
            await redis.set(in_progress_key_prefix + job, b"1")
        await PipelineState(redis, keys).incr(**{Counter.RUNNING: RUNNING})
        await redis.zadd(keys.workers, {f"w{i}": time.time() for i in range(20)})
        await redis.config_resetstat()
        snap = await snapshot(redis, keys)
        stats = await redis.info("commandstats")
    finally:
        await redis.aclose()
        server.close()
    return int(stats.get("cmdstat_exists", {}).get("calls", 0)), snap.queue.running


async def test_a_refresh_probes_a_bounded_sample_of_a_long_queue(namespace):
    exists_calls, running = await _probe(DUE, namespace)
    assert exists_calls <= MAX_DUE_JOBS_CHECKED <= 1000  # was one EXISTS per due job (up to 50,000)
    assert running == RUNNING  # past the sample: the workers' own count


async def test_a_short_queue_is_still_counted_key_by_key(namespace):
    exists_calls, running = await _probe(50, namespace)
    assert exists_calls == 50 and running == RUNNING
