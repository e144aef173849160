"""Issue 33 item 1: a worker's poll costs what its free slots need, on a real redis-server with
the real `RolloutWorker` (arq's Worker with this project's poll), running a plain job function.

arq 0.28 read up to max(5 x max_jobs, 100) due entries every poll while a slot was free and
paid WATCH/EXISTS/ZSCORE/UNWATCH for each job in progress at the queue's head: the cost grew as
workers x jobs in progress, and a job behind more jobs in progress than that read limit was
never seen. arq's semantics stay: in-progress keys, tries, Retry(defer), aborts, hand-backs."""

from __future__ import annotations

import asyncio
import time
from datetime import datetime, timedelta, timezone

import pytest
from arq import Retry
from arq.constants import in_progress_key_prefix
from arq.utils import to_unix_ms
from arq.worker import func

from pipeline.eval.evaluation import EVAL_SCORE
from pipeline.keys import Keys
from pipeline.store.jobqueue import redis_settings
from pipeline.store.local_redis import LocalRedis
from pipeline.store.redis_conn import connect
from tests.workers.test_worker_jobs import wait_for
from workers.settings import IN_PROGRESS_RECHECK_S, RolloutWorker, stop_worker

RAN: dict[str, list[float]] = {}


async def note(ctx, tag: str, seconds: float = 0.0) -> str:
    RAN.setdefault(tag, []).append(time.time())
    await asyncio.sleep(seconds)
    return tag


async def hangs_on_its_first_try(ctx, tag: str) -> str:
    RAN.setdefault(tag, []).append(time.time())
    if ctx["job_try"] == 1:
        await asyncio.sleep(60)  # the worker that took it first is reaped (or loses it) meanwhile
    return tag


async def retry_once(ctx, tag: str, defer_s: float) -> str:
    RAN.setdefault(tag, []).append(time.time())
    if ctx["job_try"] == 1:
        raise Retry(defer=defer_s)
    return tag


def _worker(url: str, queue: str, slots: int) -> RolloutWorker:
    return RolloutWorker(functions=[func(note, name="note"), func(retry_once, name="retry_once"),
                                    func(hangs_on_its_first_try, name="hangs")], queue_name=queue,
                         redis_settings=redis_settings(url), max_jobs=slots, poll_delay=0.02, job_timeout=60,
                         handle_signals=False, allow_abort_jobs=True, keep_result=60)


async def _held_elsewhere(redis, queue: str, count: int) -> list[str]:
    """`count` jobs at the head of the queue, in progress on other workers (arq's own marks)."""
    now_ms = int(time.time() * 1000)
    jobs = [f"{queue}:held{i}" for i in range(count)]
    pipe = redis.pipeline(transaction=False)
    pipe.zadd(queue, {job: now_ms - 60_000 + i for i, job in enumerate(jobs)})
    for job in jobs:
        pipe.set(in_progress_key_prefix + job, b"1", px=600_000)
    await pipe.execute()
    return jobs


async def _calls(redis) -> dict[str, int]:
    stats = await redis.info("commandstats")
    return {name.removeprefix("cmdstat_"): int(row["calls"]) for name, row in stats.items()}


async def test_an_idle_worker_pays_for_its_free_slots_not_for_the_jobs_in_progress(namespace):
    """200 jobs in progress elsewhere, one worker with 8 free slots and nothing to start, for 2 s:
    arq's poll made ~4 commands per job in progress, 50 times a second (~40,000 here); now each
    job in progress is looked at once per recheck interval and an empty poll backs off."""
    jobs_in_progress = 200
    with LocalRedis() as server:
        redis = connect(server.url)
        queue = f"{namespace}:queue"
        worker = _worker(server.url, queue, slots=8)
        try:
            await _held_elsewhere(redis, queue, jobs_in_progress)
            await redis.config_resetstat()
            task = asyncio.create_task(worker.async_run())
            await asyncio.sleep(2.0)
            calls = await _calls(redis)
            await stop_worker(worker, task)
        finally:
            await redis.aclose()
    commands = sum(n for name, n in calls.items() if not name.startswith(("info", "config", "client", "hello")))
    assert 2.0 < IN_PROGRESS_RECHECK_S  # so each job in progress is looked at once in the window
    assert calls.get("exists", 0) <= jobs_in_progress, calls
    assert commands < jobs_in_progress * 2 + 200, calls


async def test_a_job_behind_more_jobs_in_progress_than_a_poll_reads_is_started(namespace):
    """A worker with one slot read max(5, 100) = 100 entries: with 150 jobs in progress at the
    head, a due job behind them was never seen while they ran."""
    with LocalRedis() as server:
        redis = connect(server.url)
        queue = f"{namespace}:queue"
        worker = _worker(server.url, queue, slots=1)
        pool = None
        try:
            await _held_elsewhere(redis, queue, 150)
            task = asyncio.create_task(worker.async_run())
            await wait_for(lambda: asyncio.sleep(0, worker._pool is not None), 10, "the worker's pool")
            pool = worker.pool
            tag = f"{namespace}-behind"
            await pool.enqueue_job("note", tag, _job_id=f"{queue}:behind", _queue_name=queue)
            await wait_for(lambda: asyncio.sleep(0, tag in RAN), 10, "the job behind the jobs in progress")
            await stop_worker(worker, task)
        finally:
            await redis.aclose()


async def test_arqs_semantics_are_kept(namespace):
    """Jobs start in queue order; a Retry(defer) comes back after its defer (not after the take's
    recheck score); a job handed back by a cancel is due at once at its own place; Job.abort()
    still cancels a running job; a finished job leaves the queue and its in-progress key."""
    with LocalRedis() as server:
        redis = connect(server.url)
        queue = f"{namespace}:queue"
        worker = _worker(server.url, queue, slots=1)
        try:
            task = asyncio.create_task(worker.async_run())
            await wait_for(lambda: asyncio.sleep(0, worker._pool is not None), 10, "the worker's pool")
            pool = worker.pool
            first, second = f"{namespace}-first", f"{namespace}-second"
            await pool.enqueue_job("note", second, _job_id=f"{queue}:2", _queue_name=queue, _defer_by=0.3)
            await pool.enqueue_job("note", first, _job_id=f"{queue}:1", _queue_name=queue)
            await wait_for(lambda: asyncio.sleep(0, second in RAN), 10, "both jobs")
            assert RAN[first][0] < RAN[second][0]
            assert await redis.zcard(queue) == 0 and not await redis.keys(f"{in_progress_key_prefix}{queue}*")

            retried = f"{namespace}-retried"
            await pool.enqueue_job("retry_once", retried, 1.5, _job_id=f"{queue}:r", _queue_name=queue)
            await wait_for(lambda: asyncio.sleep(0, len(RAN.get(retried, [])) == 2), 10, "the retry")
            assert 1.4 < RAN[retried][1] - RAN[retried][0] < IN_PROGRESS_RECHECK_S

            slow = f"{namespace}-slow"
            job = await pool.enqueue_job("note", slow, 30.0, _job_id=f"{queue}:slow", _queue_name=queue)
            await wait_for(lambda: asyncio.sleep(0, slow in RAN), 10, "the slow job")
            score_taken = await redis.zscore(queue, f"{queue}:slow")
            assert score_taken > time.time() * 1000  # out of the due range while it runs
            assert await job.abort(timeout=5)
            assert await redis.zscore(queue, f"{queue}:slow") is None

            handed = f"{namespace}-handed"
            job = await pool.enqueue_job("note", handed, 30.0, _job_id=f"{queue}:h", _queue_name=queue)
            # its place: the score arq enqueued it at (its enqueue time, no defer), read from its job key,
            # which no take moves (its queue entry may be taken, and its score moved, before a ZSCORE here)
            place = to_unix_ms((await job.info()).enqueue_time)
            await wait_for(lambda: asyncio.sleep(0, handed in RAN), 10, "the job to hand back")
            first_take = worker._scores[f"{queue}:h"]
            worker.tasks[f"{queue}:h"].cancel()  # what a drain does to a job past its grace: arq re-runs it
            await wait_for(lambda: asyncio.sleep(0, len(RAN[handed]) == 2), 10, "the re-run of the handed-back job")
            assert RAN[handed][1] - RAN[handed][0] < IN_PROGRESS_RECHECK_S
            assert first_take == place
            assert worker._scores[f"{queue}:h"] == place  # the re-run was taken at its own place
            await stop_worker(worker, task)
        finally:
            await redis.aclose()


async def test_a_job_released_by_the_reaper_or_the_orphan_sweep_is_due_at_once(redis, keys):
    """The poll scores a job it takes now + the recheck interval; a release (the reaper's, the
    orphan sweep's) makes it due at once, as before the poll moved scores: recovery after a
    SIGKILL does not wait for the next recheck."""
    from workers.liveness import Liveness

    sweeper = Liveness(redis, keys, "s", heartbeat_s=0.2, dead_after_s=1.0)
    dead = Liveness(redis, keys, "dead", heartbeat_s=0.2, dead_after_s=1.0)
    reaped, orphan = keys.arq_job_id("reaped:0"), keys.arq_job_id("orphan:0")
    later = int(time.time() * 1000) + int(IN_PROGRESS_RECHECK_S * 1000)
    await redis.zadd(keys.queue, {reaped: later, orphan: later})  # as the take left them
    for job in (reaped, orphan):
        await redis.set(in_progress_key_prefix + job, b"token")
    await dead.beat()
    await dead.job_started(reaped)
    await redis.zadd(keys.workers, {"dead": 1.0})
    await sweeper.beat()
    assert await sweeper.reap() == (1, 1)
    assert await redis.zscore(keys.queue, reaped) <= time.time() * 1000
    released = 0
    for _ in range(3):
        released += await sweeper.release_orphans()
        await asyncio.sleep(0.11)
    assert released == 1
    assert await redis.zscore(keys.queue, orphan) <= time.time() * 1000


@pytest.mark.parametrize("release", ["reaper", "orphan sweep", "reconcile"])
async def test_a_released_job_is_due_at_its_own_place_ahead_of_jobs_enqueued_after_it(namespace, release):
    """Issue 39 item 7: the take moves a job's score to now + recheck; a release (the reaper's, the
    orphan sweep's, a reconcile's) put it back at *now*, so an eval job (score 1) or the oldest
    training group queued behind every job enqueued after it. The take keeps the place in Redis
    (the in-progress key) and every release restores it: the next worker takes them first."""
    from workers.liveness import Liveness

    with LocalRedis() as server:
        redis = connect(server.url)
        keys = Keys(namespace)
        first, second = _worker(server.url, keys.queue, slots=2), _worker(server.url, keys.queue, slots=1)
        tasks = []
        try:
            tasks.append(asyncio.create_task(first.async_run()))
            await wait_for(lambda: asyncio.sleep(0, first._pool is not None), 10, "the first worker's pool")
            pool = first.pool
            eval_job, oldest, later = (keys.arq_job_id(f"{release}-{name}") for name in ("eval", "oldest", "later"))
            await pool.enqueue_job("hangs", eval_job, _job_id=eval_job, _queue_name=keys.queue,
                                   _defer_until=datetime.fromtimestamp(EVAL_SCORE / 1000, tz=timezone.utc),
                                   _expires=timedelta(hours=1))  # as pipeline/eval/evaluation.py enqueues it
            await pool.enqueue_job("hangs", oldest, _job_id=oldest, _queue_name=keys.queue)
            await wait_for(lambda: asyncio.sleep(0, eval_job in RAN and oldest in RAN), 10, "the first takes")
            await asyncio.sleep(0.01)
            await pool.enqueue_job("hangs", later, _job_id=later, _queue_name=keys.queue)  # no free slot takes it

            sweeper = Liveness(redis, keys, "sweeper", heartbeat_s=0.2, dead_after_s=1.0)
            holder = Liveness(redis, keys, "holder", heartbeat_s=0.2, dead_after_s=1.0)
            if release != "orphan sweep":  # the orphan sweep's case: taken, never recorded by its worker
                await holder.beat()
                for job in (eval_job, oldest):
                    await holder.job_started(job)
            if release == "reaper":
                await redis.zadd(keys.workers, {"holder": 1.0})  # silent since 1970
                await sweeper.beat()
                assert await sweeper.reap() == (1, 2)
            elif release == "orphan sweep":
                released = 0
                for _ in range(3):
                    released += await sweeper.release_orphans()
                    await asyncio.sleep(0.11)
                assert released == 2
            else:
                holder._running.clear()  # Redis kept the jobs in its set after the process lost them
                assert await holder.reconcile() == 2

            tasks.append(asyncio.create_task(second.async_run()))  # one slot: takes the due jobs in order
            await wait_for(lambda: asyncio.sleep(0, later in RAN), 10, "the second worker's takes")
            assert len(RAN[eval_job]) == len(RAN[oldest]) == 2
            assert RAN[eval_job][1] < RAN[oldest][1] < RAN[later][0]
        finally:
            for worker, task in zip((first, second), tasks):
                await stop_worker(worker, task)
            await redis.aclose()


async def _idle_worker_with_wake(server: LocalRedis, queue: str) -> tuple[RolloutWorker, asyncio.Task[None]]:
    """A worker woken by `{queue}:queued_events`, idle long enough for its poll to back off to
    IDLE_POLL_MAX_S (0.02 s doubling: past 1 s after about 1.3 s)."""
    worker = _worker(server.url, queue, slots=2)
    worker.wake_channel = f"{queue}:queued_events"
    task = asyncio.create_task(worker.async_run())
    await asyncio.sleep(2.5)
    return worker, task


async def test_an_idle_worker_takes_an_announced_job_at_once(namespace):
    """Issue 46 item 5: before a policy version's publish the queue has been empty for a trainer
    step, so the poll waits a second between looks; the admission's message (Admission._announce)
    starts the job at once. The poll alone started this one about 0.76 s after it was queued."""
    with LocalRedis() as server:
        redis = connect(server.url)
        queue = f"{namespace}:queue"
        worker, task = await _idle_worker_with_wake(server, queue)
        try:
            tag = f"{namespace}-announced"
            queued = time.time()
            await worker.pool.enqueue_job("note", tag, _job_id=f"{queue}:announced", _queue_name=queue)
            await redis.publish(f"{queue}:queued_events", 1)
            await wait_for(lambda: asyncio.sleep(0, tag in RAN), 10, "the announced job")
            await stop_worker(worker, task)
        finally:
            await redis.aclose()
    assert RAN[tag][0] - queued < 0.25, f"started {RAN[tag][0] - queued:.3f} s after it was queued and announced"


async def test_a_job_queued_without_a_message_is_still_found_by_the_poll(namespace):
    """The message is a hint: a job queued without one (a lost message, arq's own enqueue, a
    release by the liveness sweeps) is started by the backed-off poll, within about a second."""
    with LocalRedis() as server:
        queue = f"{namespace}:queue"
        worker, task = await _idle_worker_with_wake(server, queue)
        tag = f"{namespace}-unannounced"
        await worker.pool.enqueue_job("note", tag, _job_id=f"{queue}:unannounced", _queue_name=queue)
        await wait_for(lambda: asyncio.sleep(0, tag in RAN), 5, "the job queued without a message")
        await stop_worker(worker, task)
