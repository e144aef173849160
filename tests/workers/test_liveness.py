"""The reaper on a real redis-server: a silent worker's jobs are released for re-run, and
`running` (= jobs in all workers' job sets) is given back once per job, whatever is replayed."""

import time

from arq.constants import in_progress_key_prefix

from pipeline.keys import Counter
from pipeline.state import PipelineState
from workers.liveness import Liveness


async def _running(redis, keys) -> int:
    return (await PipelineState(redis, keys).counters()).get(Counter.RUNNING, 0)


async def test_reaper_releases_a_dead_workers_jobs_and_running_once(redis, keys):
    dead = Liveness(redis, keys, "dead-worker", heartbeat_s=0.1, dead_after_s=0.5)
    alive = Liveness(redis, keys, "live-worker", heartbeat_s=0.1, dead_after_s=0.5)
    jobs = [keys.arq_job_id(f"t{i}:0") for i in range(3)]
    await dead.beat()
    for job in jobs:
        await dead.job_started(job)  # running +1 each
        await redis.set(in_progress_key_prefix + job, b"1")
    # t0's group was pushed, then the worker died before forgetting the job: it still holds
    # its `running` count (the push does not give it back; leaving the job set does)
    await redis.set(keys.dedup("t0:0"), b"1")
    await redis.zadd(keys.workers, {"dead-worker": 1.0})  # beat long ago
    await alive.beat()

    assert await alive.reap() == (1, 3)
    assert [await redis.exists(in_progress_key_prefix + j) for j in jobs] == [0, 0, 0]
    assert await _running(redis, keys) == 0
    errors = await redis.hgetall(keys.job_errors)
    assert errors[jobs[1].encode()] == b"worker dead-worker stopped heart-beating"
    assert await redis.zrange(keys.workers, 0, -1) == [b"live-worker"]
    assert await redis.exists(keys.worker_jobs("dead-worker")) == 0
    assert await alive.reap() == (0, 0)  # nothing twice
    # the "dead" worker was a zombie: its late job_ended gives back nothing twice
    assert await dead.job_ended(jobs[1]) is False
    assert await _running(redis, keys) == 0


async def test_job_start_and_end_count_once_when_replayed(redis, keys):
    """A lost reply makes redis-py send the same script again: SADD/SREM find nothing to do."""
    w = Liveness(redis, keys, "w1", heartbeat_s=0.1, dead_after_s=0.5)
    job = keys.arq_job_id("t:0")
    assert await w.job_started(job) is True
    assert await w.job_started(job) is False  # the replay
    assert await _running(redis, keys) == 1
    assert await w.job_ended(job) is True
    assert await w.job_ended(job) is False  # the replay
    assert await _running(redis, keys) == 0


async def test_heartbeats_and_the_cutoff_use_redis_time(redis, keys):
    """Scores are Redis's clock, not the host's: a worker whose host clock is far behind is not
    reaped, and one silent for dead_after_s by Redis's clock is."""
    w = Liveness(redis, keys, "w1", heartbeat_s=0.1, dead_after_s=0.5)
    await w.beat()
    now_s, now_us = await redis.time()
    score = await redis.zscore(keys.workers, "w1")
    assert abs(score - (now_s + now_us / 1e6)) < 1.0
    await w.job_started(keys.arq_job_id("t:0"))
    other = Liveness(redis, keys, "w2", heartbeat_s=0.1, dead_after_s=0.5)
    assert await other.reap() == (0, 0)
    time.sleep(0.7)
    assert await other.reap() == (1, 1)
    assert await _running(redis, keys) == 0


async def test_leaving_gives_back_what_is_still_held(redis, keys):
    w = Liveness(redis, keys, "w1", heartbeat_s=0.1, dead_after_s=0.5)
    await w.beat()
    await w.job_started(keys.arq_job_id("t:0"))
    await w.stop()
    assert await _running(redis, keys) == 0 and await redis.zcard(keys.workers) == 0


async def test_a_live_worker_releases_jobs_redis_says_it_runs_but_it_does_not(redis, keys):
    """Redis restarted from an AOF missing its last second: a job that ended in that second is
    back in our job set (SREM lost) with its in-progress key, so arq and the reaper would never
    re-run it. The heartbeat's reconcile releases it (once), and leaves the jobs we run alone."""
    worker = Liveness(redis, keys, "w1", heartbeat_s=0.1, dead_after_s=0.5)
    running, ghost = keys.arq_job_id("t0:0"), keys.arq_job_id("t1:0")
    await worker.job_started(running)
    await worker.job_started(ghost)
    await worker.job_ended(ghost)
    # the lost second: the SREM and the `running` -1 never happened, the in-progress key is back
    await redis.sadd(keys.worker_jobs("w1"), ghost)
    await redis.hincrby(keys.counters, Counter.RUNNING, 1)
    for job in (running, ghost):
        await redis.set(in_progress_key_prefix + job, b"1")
    assert await _running(redis, keys) == 2

    assert await worker.reconcile() == 1
    assert await redis.smembers(keys.worker_jobs("w1")) == {running.encode()}
    assert await redis.exists(in_progress_key_prefix + ghost) == 0  # arq's next poll re-runs it
    assert await redis.exists(in_progress_key_prefix + running) == 1
    assert await _running(redis, keys) == 1
    assert (await redis.hget(keys.job_errors, ghost)).startswith(b"its worker no longer ran it")
    assert await worker.reconcile() == 0  # nothing twice
