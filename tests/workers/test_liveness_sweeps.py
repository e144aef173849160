"""Issue 33 item 3: the cluster's one sweep per interval costs O(its own work), on a real
redis-server: the orphan cursor neither walks nor skips entries as the queue's head drains, the
rolling-upgrade lookup runs only while some live worker is of the version before, and what an
old version's reaper leaves behind is cleaned."""

from __future__ import annotations

import asyncio

from arq.constants import in_progress_key_prefix

from pipeline.keys import Counter, Keys
from pipeline.store.local_redis import LocalRedis
from pipeline.store.redis_conn import connect
from workers import liveness
from workers.liveness import Liveness


async def _calls(redis) -> dict[str, int]:
    stats = await redis.info("commandstats")
    return {name.removeprefix("cmdstat_"): int(row["calls"]) for name, row in stats.items()}


async def test_an_orphan_is_seen_in_one_pass_while_the_queue_head_drains(redis, keys, monkeypatch):
    """600 jobs in progress, one of them an orphan; between sweeps the 60 oldest owned jobs finish
    (leave the queue). An offset cursor skipped what moved up under it as the head drained: the
    orphan was passed over for the whole pass (cursor from 0 back to 0). A cursor that follows the
    entries sees every entry present for the whole pass within it."""
    monkeypatch.setattr(liveness, "ORPHAN_SCAN", 60)
    sweeper = Liveness(redis, keys, "s", heartbeat_s=10.0, dead_after_s=30.0)  # suspects only, no release
    owner = Liveness(redis, keys, "w", heartbeat_s=10.0, dead_after_s=30.0)
    await owner.beat()
    await sweeper.beat()
    jobs = [keys.arq_job_id(f"t{i:03d}:0") for i in range(600)]
    orphan = jobs[90]
    pipe = redis.pipeline(transaction=False)
    pipe.zadd(keys.queue, {job: 1000 + i for i, job in enumerate(jobs)})
    for job in jobs:
        pipe.set(in_progress_key_prefix + job, b"1")
    await pipe.execute()
    owned = [job for job in jobs if job != orphan]
    for job in owned:
        await owner.job_started(job)
    sweeps = 0
    while True:
        await sweeper.release_orphans()
        sweeps += 1
        if await redis.get(keys.orphan_cursor) in (b"0", None) or sweeps > 100:
            break  # one pass of the queue
        finished, owned = owned[:60], owned[60:]
        for job in finished:
            await owner.job_ended(job)
        await redis.zrem(keys.queue, *finished)
        await redis.delete(*(in_progress_key_prefix + job for job in finished))
    assert await redis.hexists(keys.orphan_suspects, orphan), f"not seen in a pass of {sweeps} sweeps"


async def test_the_rolling_upgrade_lookup_runs_only_while_an_old_worker_lives(namespace):
    """W workers of this version, an unowned job in progress: the sweep read every worker and
    asked the recorders set for each (W SISMEMBERs) although no worker of the version before was
    alive; now it compares two counts. With an old worker beating, its job set is asked."""
    server = LocalRedis().start()
    redis = connect(server.url)
    keys = Keys(namespace)
    try:
        fleet = [Liveness(redis, keys, f"w{i}", heartbeat_s=0.2, dead_after_s=1.0) for i in range(20)]
        for worker in fleet:
            await worker.beat()
        orphan = keys.arq_job_id("orphan:0")
        await redis.zadd(keys.queue, {orphan: 1})
        await redis.set(in_progress_key_prefix + orphan, b"1")
        await redis.config_resetstat()
        await fleet[0].release_orphans()
        calls = await _calls(redis)
        assert calls.get("sismember", 0) == 0 and calls.get("zrange", 0) == 0, calls
        assert await redis.hexists(keys.orphan_suspects, orphan)  # it was looked at

        now_s, now_us = await redis.time()
        await redis.zadd(keys.workers, {"old": now_s + now_us / 1e6})  # the version before: no mark
        await redis.sadd(keys.worker_jobs("old"), orphan)
        await redis.config_resetstat()
        await asyncio.sleep(0.11)
        assert await fleet[0].release_orphans() == 0  # the old worker's job set holds it
        assert (await _calls(redis)).get("sismember", 0) >= 1
    finally:
        await redis.aclose()
        server.close()


# The reaper of the version before the owners hash (6f296b8^), exactly: it neither deletes the
# reaped worker's owner entries nor its recorders mark, which it did not know.
_OLD_REAP_LUA = """
local t = redis.call('TIME')
local cutoff = tonumber(t[1]) + tonumber(t[2]) / 1e6 - tonumber(ARGV[1])
local dead = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', cutoff)
local released = 0
for _, worker in ipairs(dead) do
  local set_key = ARGV[2] .. worker .. ARGV[3]
  local jobs = redis.call('SMEMBERS', set_key)
  for _, job in ipairs(jobs) do
    redis.call('DEL', ARGV[4] .. job)
    redis.call('HSET', KEYS[3], job, 'worker ' .. worker .. ' stopped heart-beating')
  end
  if #jobs > 0 then redis.call('HINCRBY', KEYS[2], ARGV[5], -#jobs) end
  released = released + #jobs
  redis.call('DEL', set_key)
  redis.call('ZREM', KEYS[1], worker)
end
return {#dead, released}
"""


async def test_what_an_old_versions_reaper_leaves_behind_is_cleaned(redis, keys):
    """A rolling upgrade's old reaper reaps a worker of this version: its owner entries and its
    recorders mark stayed forever (the mark also kept the two counts apart, so every sweep read
    every worker). A job of it that an old worker re-runs (no owner entry written) is not
    mistaken for the dead worker's, nor for an orphan."""
    sweeper = Liveness(redis, keys, "s", heartbeat_s=0.2, dead_after_s=1.0)
    dead = Liveness(redis, keys, "dead", heartbeat_s=0.2, dead_after_s=1.0)
    await dead.beat()
    jobs = [keys.arq_job_id(f"j{i}:0") for i in range(3)]
    await redis.zadd(keys.queue, {job: i + 1 for i, job in enumerate(jobs)})
    for job in jobs:
        await redis.set(in_progress_key_prefix + job, b"1")
        await dead.job_started(job)
    await redis.zadd(keys.workers, {"dead": 1.0})  # its last beat long ago
    await sweeper.beat()
    prefix, _, suffix = keys.worker_jobs("\x00").partition("\x00")
    old_reap = redis.register_script(_OLD_REAP_LUA)
    assert await old_reap(keys=[keys.workers, keys.counters, keys.job_errors],
                          args=[1.0, prefix, suffix, in_progress_key_prefix, Counter.RUNNING]) == [1, 3]
    # an old worker re-runs jobs[0] (its own set, no owner entry); the others wait for a poll
    now_s, now_us = await redis.time()
    await redis.zadd(keys.workers, {"old": now_s + now_us / 1e6})
    await redis.sadd(keys.worker_jobs("old"), jobs[0])
    await redis.set(in_progress_key_prefix + jobs[0], b"1")
    assert await redis.hlen(keys.job_owners) == 3 and await redis.sismember(keys.owner_recorders, "dead")

    released = 0
    for _ in range(3):
        released += await sweeper.release_orphans()
        await asyncio.sleep(0.11)
    assert released == 0  # jobs[0] is the old worker's
    assert await redis.exists(in_progress_key_prefix + jobs[0]) == 1
    assert await redis.smembers(keys.owner_recorders) == {b"s"}
    assert await redis.hkeys(keys.job_owners) == [jobs[0].encode()]  # running: no entry dropped under it

    await redis.delete(in_progress_key_prefix + jobs[0])  # the old worker finished it (and its set)
    await redis.srem(keys.worker_jobs("old"), jobs[0])
    await sweeper.release_orphans()
    assert await redis.hlen(keys.job_owners) == 0
