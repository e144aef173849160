"""The reaper on a real redis-server: a silent worker's jobs are released for re-run, and
`running` is given back only for jobs whose group was not pushed before the worker died."""

import time

from arq.constants import in_progress_key_prefix

from pipeline.keys import Counter
from pipeline.state import PipelineState
from workers.liveness import Liveness


async def test_reaper_releases_a_dead_workers_jobs_and_running_once(redis, keys):
    dead = Liveness(redis, keys, "dead-worker", heartbeat_s=0.1, dead_after_s=0.5)
    alive = Liveness(redis, keys, "live-worker", heartbeat_s=0.1, dead_after_s=0.5)
    jobs = [keys.arq_job_id(f"t{i}:0") for i in range(3)]
    await dead.beat()
    for job in jobs:
        await dead.job_started(job)  # running +1 each
        await redis.set(in_progress_key_prefix + job, b"1")
    # t0's group was pushed (the push gave back its `running`), then the worker died
    # before forgetting the job
    await redis.set(keys.dedup("t0:0"), b"1")
    await PipelineState(redis, keys).incr(**{Counter.RUNNING: -1})
    await redis.zadd(keys.workers, {"dead-worker": time.time() - 5})
    await alive.beat()

    assert await alive.reap() == (1, 3)
    assert [await redis.exists(in_progress_key_prefix + j) for j in jobs] == [0, 0, 0]
    assert (await PipelineState(redis, keys).counters())[Counter.RUNNING] == 0
    errors = await redis.hgetall(keys.job_errors)
    assert errors[jobs[1].encode()] == b"worker dead-worker stopped heart-beating"
    assert await redis.zrange(keys.workers, 0, -1) == [b"live-worker"]
    assert await redis.exists(keys.worker_jobs("dead-worker")) == 0
    assert await alive.reap() == (0, 0)  # nothing twice
