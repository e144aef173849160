"""Issue 47 item 1: a job has its owner from the take that marks it in progress (real
redis-server, two real RolloutWorkers, the simulator as their engine).

The take (workers/settings.py `_CLAIM_LUA`) set arq's in-progress key, and the job function
recorded the owner only later (`Liveness.job_started` in `run_group` / `run_eval_group`). A worker
stalled in between (GIL, a loaded host) past half a heartbeat had the orphan sweep release its
job at its place, the head of the queue; a second worker ran it, and the first then either ran it
too (both ran all n episodes, `running` counted the job twice, an eval job took a second eval slot)
or found its key gone: arq's "job ... expired". Here the first worker is held between its take
and arq's `run_job` (an event, not a sleep) while two sweeps look at the job, and a second worker
polls the queue before the first goes on."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from arq.constants import in_progress_key_prefix

from pipeline.config import parse_config
from pipeline.eval.evaluation import EVAL_SCORE_MAX
from pipeline.keys import Keys
from tests.support.policy_helpers import trainer_started
from tests.workers.test_liveness_finish import _enqueue_eval, _enqueue_training, _finished, _running
from tests.workers.test_worker_jobs import config_dict, wait_for
from workers.liveness import PLACE_PREFIX, Liveness
from workers.settings import _CLAIM_LUA, CLAIM_SCAN, RolloutWorker, build_worker, stop_worker
from workers.sim.engine import serve_sim_engine

STALLED, TWIN = "stalled-worker", "twin-worker"
CASES = {"training": _enqueue_training, "eval": _enqueue_eval}


def _hold_between_take_and_start(worker: RolloutWorker, taken: asyncio.Event, resume: asyncio.Event) -> None:
    """The worker's `run_job` (arq's start of a job it took) waits for `resume`; `taken` is set
    when the take has handed it a job."""
    run_job = worker.run_job

    async def held(job_id: str, score: int) -> None:
        taken.set()
        await resume.wait()
        await run_job(job_id, score)

    worker.run_job = held  # type: ignore[method-assign]


def _count_polls(worker: RolloutWorker) -> list[int]:
    """[takes the worker's poll has run, jobs they took] (its `claim_jobs`, read after each)."""
    counts = [0, 0]
    claim_jobs = worker.claim_jobs

    async def counted(slots: int) -> tuple[int, bool]:
        started, more = await claim_jobs(slots)
        counts[0] += 1
        counts[1] += started
        return started, more

    worker.claim_jobs = counted  # type: ignore[method-assign]
    return counts


class PeakRunning:
    """The highest `running` counter seen, read every few ms while the test runs."""

    def __init__(self, redis: Any, keys: Keys) -> None:
        self.redis, self.keys, self.peak = redis, keys, 0
        self._task = asyncio.create_task(self._watch())

    async def _watch(self) -> None:
        while True:
            self.peak = max(self.peak, await _running(self.redis, self.keys))
            await asyncio.sleep(0.005)

    async def stop(self) -> int:
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        return self.peak


def _idle(*workers: RolloutWorker) -> Callable[[], Awaitable[bool]]:
    async def idle() -> bool:
        return all(w.job_counter == 0 for w in workers)
    return idle


@pytest.mark.parametrize("case", list(CASES))
async def test_a_worker_stalled_between_its_take_and_the_jobs_start_runs_it_alone(
        redis, redis_url, keys, namespace, case, caplog):
    await trainer_started(redis, keys)
    job_id, stored = await CASES[case](redis, redis_url, keys, namespace)
    taken, resume = asyncio.Event(), asyncio.Event()
    async with serve_sim_engine() as sim:
        # each worker's heartbeat sweeps once at its start, then not for 10 s: the test's sweeper
        # is the only one while the first worker is held
        config = parse_config(config_dict(redis_url, namespace, sim.url, heartbeat_s=10.0, dead_after_s=30.0))
        stalled = build_worker(config, concurrency=1, worker_id=STALLED, handle_signals=False)
        twin = build_worker(config, concurrency=1, worker_id=TWIN, handle_signals=False)
        _hold_between_take_and_start(stalled, taken, resume)
        twin_polls = _count_polls(twin)
        peak = PeakRunning(redis, keys)
        tasks = [asyncio.create_task(stalled.async_run())]
        try:
            with caplog.at_level(logging.INFO, logger="arq.worker"):
                await wait_for(lambda: asyncio.sleep(0, taken.is_set()), 30, "the first worker's take")
                await wait_for(lambda: _beats(redis, keys, STALLED), 10, "the first worker's heartbeat")
                owner_while_held = await redis.hget(keys.job_owners, job_id)
                running_while_held = await _running(redis, keys)
                # the stalled worker, seen by two sweeps more than half a heartbeat apart
                sweeper = Liveness(redis, keys, "sweeper", heartbeat_s=0.2, dead_after_s=1.0)
                released = [await sweeper.release_orphans()]
                await asyncio.sleep(0.15)
                released.append(await sweeper.release_orphans())
                # a second worker with a free slot polls the queue (a released job is due at once)
                tasks.append(asyncio.create_task(twin.async_run()))
                await wait_for(lambda: asyncio.sleep(0, twin_polls[0] >= 2), 10, "the second worker's polls")
                resume.set()
                await wait_for(lambda: _ran_out(redis, keys, job_id, stored, stalled, twin), 30, "the job's end")
        finally:
            resume.set()
            peak_running = await peak.stop()
            for worker, task in zip((stalled, twin), tasks):
                await stop_worker(worker, task)
    expired = [r.getMessage() for r in caplog.records if r.name == "arq.worker" and "expired" in r.getMessage()]
    runs = {"stalled": (stalled.jobs_complete, stalled.jobs_failed, stalled.jobs_retried),
            "twin": (twin.jobs_complete, twin.jobs_failed, twin.jobs_retried), "twin takes": twin_polls[1]}
    assert runs == {"stalled": (1, 0, 0), "twin": (0, 0, 0), "twin takes": 0}, runs  # one run, by its taker
    assert expired == []
    assert peak_running == 1  # counted once, from the take
    assert await stored() == 1  # one group (or eval entry) pushed
    assert released == [0, 0]  # the sweeps saw an owner: nothing to release
    assert (owner_while_held, running_while_held) == (STALLED.encode(), 1)  # recorded by the take itself


async def _beats(redis: Any, keys: Keys, worker_id: str) -> bool:
    return await redis.zscore(keys.workers, worker_id) is not None


async def _ran_out(redis: Any, keys: Keys, job_id: str, stored: Callable[[], Awaitable[int]],
                   *workers: RolloutWorker) -> bool:
    """The job's group is stored, arq finished it, no worker runs a job, `running` is back to 0."""
    return (await stored() >= 1 and await _finished(redis, keys, job_id) and await _idle(*workers)()
            and await _running(redis, keys) == 0)


async def _take(redis: Any, keys: Keys, liveness: Liveness) -> list[Any]:
    """One take of the worker's poll (its script, with its liveness's keys), as `RolloutWorker._take`
    sends it: its reply goes nowhere (a reply lost on the way back to the worker)."""
    now = int(time.time() * 1000)
    return await redis.register_script(_CLAIM_LUA)(
        keys=[keys.queue, *liveness.take_keys()],
        args=[now, 1, in_progress_key_prefix, 60_000, now + 5000, PLACE_PREFIX, CLAIM_SCAN, 1, EVAL_SCORE_MAX,
              *liveness.take_args()])


async def test_a_take_whose_reply_is_lost_is_released_by_its_workers_reconcile_not_during_a_take(redis, keys):
    """The take records its jobs as its worker's; one whose reply never reached the worker leaves a
    job owned by a live worker that does not run it: the orphan sweep leaves it (owned), the
    worker's reconcile (its own set against what it runs) releases it at its place. A reconcile
    while a take is recording (`Liveness.taking`) is skipped: it would read jobs recorded and not
    yet noted as run."""
    worker = Liveness(redis, keys, "taker", heartbeat_s=0.2, dead_after_s=1.0)
    sweeper = Liveness(redis, keys, "sweeper", heartbeat_s=0.2, dead_after_s=1.0)
    await worker.beat()
    job_id, place = keys.arq_job_id("lost:0"), int(time.time() * 1000) - 1000
    await redis.zadd(keys.queue, {job_id: place})
    async with worker.taking():
        assert (await _take(redis, keys, worker))[1:] == [job_id.encode(), str(place).encode()]
        assert await worker.reconcile() == 0  # a take in flight: not now
    assert await redis.hget(keys.job_owners, job_id) == b"taker" and await _running(redis, keys) == 1
    released = [await sweeper.release_orphans()]
    await asyncio.sleep(0.15)
    released.append(await sweeper.release_orphans())
    assert released == [0, 0]  # owned by a live worker
    assert await worker.reconcile() == 1  # recorded as ours, not run here
    assert await redis.exists(in_progress_key_prefix + job_id) == 0
    assert await redis.zscore(keys.queue, job_id) == place  # due again at its place
    assert await redis.hget(keys.job_owners, job_id) is None and await _running(redis, keys) == 0
    await redis.delete(keys.queue)
