"""Liveness at cluster scale (issue 26 item 1), counted on a real redis-server: a heartbeat costs
Redis O(the worker's own jobs), the reaper and the orphan check run once per interval for the
whole cluster (one lease holder), and the orphan check still releases what it must."""

from __future__ import annotations

import asyncio
import time

from arq.constants import in_progress_key_prefix

from pipeline.keys import Counter, Keys
from pipeline.state import PipelineState
from pipeline.store.local_redis import LocalRedis
from pipeline.store.redis_conn import connect
from workers import liveness
from workers.liveness import Liveness

W, J = 30, 8
HEARTBEAT_S = 0.05


async def _command_calls(redis) -> dict[str, int]:
    """INFO commandstats as command -> calls (commands run inside scripts count too)."""
    stats = await redis.info("commandstats")
    return {name.removeprefix("cmdstat_"): int(row["calls"]) for name, row in stats.items()}


async def test_a_heartbeat_touches_its_own_jobs_and_the_cluster_sweeps_once_per_interval(namespace):
    """W workers with J jobs each heart-beat for a while on a private redis-server. Per beat, the
    job sets read (SMEMBERS) must be about one (the worker's own), not W (every worker's, as when
    each worker walked every job set); the sweeps (reaper + orphan check, one ZRANGEBYSCORE each)
    are about one per interval for the cluster, not one per worker per interval."""
    server = LocalRedis().start()
    redis = connect(server.url)
    keys = Keys(namespace)
    workers = [Liveness(redis, keys, f"w{i}", heartbeat_s=HEARTBEAT_S, dead_after_s=1.0) for i in range(W)]
    try:
        for i, worker in enumerate(workers):
            for j in range(J):
                await worker.job_started(keys.arq_job_id(f"t{i}-{j}:0"))
        await redis.config_resetstat()
        started = time.monotonic()
        for worker in workers:
            worker.start()
        await asyncio.sleep(0.8)
        calls = await _command_calls(redis)
        elapsed = time.monotonic() - started
        for worker in workers:
            await worker.stop()
    finally:
        await redis.aclose()
        server.close()
    beats = calls.get("zadd", 0)
    intervals = elapsed / HEARTBEAT_S
    assert beats >= W * 3, calls  # every worker beat several times
    assert calls.get("smembers", 0) <= 1.2 * beats, calls  # its own set only (was W+1 sets per beat)
    # one reaper + one orphan sweep per interval, cluster-wide (was 2 per worker per interval)
    assert calls.get("zrangebyscore", 0) <= 2 * (intervals + 2), (calls, intervals)


async def test_one_beat_per_interval_takes_the_sweep_lease(redis, keys):
    a = Liveness(redis, keys, "a", heartbeat_s=0.2, dead_after_s=1.0)
    b = Liveness(redis, keys, "b", heartbeat_s=0.2, dead_after_s=1.0)
    assert [await a.beat(), await b.beat(), await a.beat()] == [True, False, False]
    await asyncio.sleep(0.25)
    assert [await b.beat(), await a.beat()] == [True, False]


async def test_a_dead_lease_holder_is_reaped_by_the_next_one(redis, keys):
    """The worker that swept last dies (no clean leave): its lease expires, another worker takes
    it and reaps the dead one, releasing its jobs."""
    dead = Liveness(redis, keys, "dead", heartbeat_s=0.1, dead_after_s=0.5)
    live = Liveness(redis, keys, "live", heartbeat_s=0.1, dead_after_s=0.5)
    job = keys.arq_job_id("t:0")
    assert await dead.beat() is True
    await dead.job_started(job)
    await redis.set(in_progress_key_prefix + job, b"1")
    live.start()
    try:
        for _ in range(40):
            if await redis.zscore(keys.workers, "dead") is None:
                break
            await asyncio.sleep(0.05)
    finally:
        await live.stop()
    assert await redis.zscore(keys.workers, "dead") is None
    assert await redis.exists(in_progress_key_prefix + job) == 0
    assert await redis.hget(keys.job_owners, job) is None
    assert (await PipelineState(redis, keys).counters()).get(Counter.RUNNING, 0) == 0


async def test_orphans_are_released_on_the_second_sweep_and_owned_jobs_are_not(redis, keys):
    """A job in progress that no worker recorded (its worker died between arq's start and the
    record) is released when two sweeps half a heartbeat apart see it unowned; a job recorded
    in between (the ms-long start-to-record window) and a recorded one are left alone."""
    sweeper = Liveness(redis, keys, "s", heartbeat_s=0.2, dead_after_s=1.0)
    owner = Liveness(redis, keys, "w", heartbeat_s=0.2, dead_after_s=1.0)
    orphan, late, owned, ready = (keys.arq_job_id(f"{name}:0") for name in ("orphan", "late", "owned", "ready"))
    await owner.beat()
    await redis.zadd(keys.queue, {orphan: 1, late: 2, owned: 3, ready: 4})
    for job in (orphan, late, owned):
        await redis.set(in_progress_key_prefix + job, b"1")
    await owner.job_started(owned)
    assert await sweeper.release_orphans() == 0  # first sight: suspects only
    await owner.job_started(late)
    await asyncio.sleep(0.11)
    assert await sweeper.release_orphans() == 1
    assert [await redis.exists(in_progress_key_prefix + j) for j in (orphan, late, owned)] == [0, 1, 1]
    assert await redis.hget(keys.job_errors, orphan) == b"its worker died before recording it"
    assert await redis.hlen(keys.orphan_suspects) == 0
    assert await sweeper.release_orphans() == 0  # nothing twice


async def test_the_orphan_sweep_covers_a_long_queue_in_turns(redis, keys, monkeypatch):
    """Each sweep looks at ORPHAN_SCAN due entries from a cursor that wraps: an orphan far down
    the queue is found (it was never looked at when every sweep read only the queue's head)."""
    monkeypatch.setattr(liveness, "ORPHAN_SCAN", 2)
    sweeper = Liveness(redis, keys, "s", heartbeat_s=0.02, dead_after_s=1.0)
    owner = Liveness(redis, keys, "w", heartbeat_s=0.02, dead_after_s=1.0)
    await owner.beat()
    jobs = [keys.arq_job_id(f"t{i}:0") for i in range(7)]
    await redis.zadd(keys.queue, {job: i for i, job in enumerate(jobs)})
    for job in jobs:
        await redis.set(in_progress_key_prefix + job, b"1")
        if job != jobs[5]:
            await owner.job_started(job)
    released = 0
    for _ in range(8):
        released += await sweeper.release_orphans()
        await asyncio.sleep(0.02)
    assert released == 1
    assert [await redis.exists(in_progress_key_prefix + j) for j in jobs] == [1, 1, 1, 1, 1, 0, 1]


async def test_a_worker_of_the_version_before_the_owners_hash_keeps_its_jobs_in_a_rolling_upgrade(redis, keys):
    """A rolling upgrade: a worker of the previous version runs a job beside this version's
    workers, with exactly that version's Redis writes (its beat: ZADD at Redis time; its
    job_started: SADD to its own set and `running` +1; no owner entry, no recorders mark). The
    sweeps leave its job alone while it beats (before, they released it as an orphan half a
    heartbeat after it started and another worker ran it again), a true orphan beside it is
    still released, and once it stops beating the reaper releases its job."""
    sweeper = Liveness(redis, keys, "new", heartbeat_s=0.2, dead_after_s=1.0)
    await sweeper.beat()
    assert await redis.smembers(keys.owner_recorders) == {b"new"}  # the first beat marks it
    legacy_job, orphan = keys.arq_job_id("legacy:0"), keys.arq_job_id("orphan:0")
    now_s, now_us = await redis.time()
    await redis.zadd(keys.workers, {"old": now_s + now_us / 1e6})
    await redis.sadd(keys.worker_jobs("old"), legacy_job)
    await redis.hincrby(keys.counters, Counter.RUNNING, 1)
    await redis.zadd(keys.queue, {legacy_job: 1, orphan: 2})
    for job in (legacy_job, orphan):
        await redis.set(in_progress_key_prefix + job, b"1")

    released = 0
    for _ in range(3):
        released += await sweeper.release_orphans()
        await asyncio.sleep(0.11)
    assert released == 1  # the orphan, not the old worker's job
    assert [await redis.exists(in_progress_key_prefix + j) for j in (legacy_job, orphan)] == [1, 0]

    await redis.zadd(keys.workers, {"old": 1.0})  # its last beat long ago
    await sweeper.beat()  # the sweeper itself is alive however slow this machine is
    assert await sweeper.reap() == (1, 1)
    assert await redis.exists(in_progress_key_prefix + legacy_job) == 0  # arq's next poll re-runs it
    assert (await PipelineState(redis, keys).counters()).get(Counter.RUNNING, 0) == 0
    await sweeper.stop()
    assert await redis.scard(keys.owner_recorders) == 0  # a clean leave forgets the mark too
