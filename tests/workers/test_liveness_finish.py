"""A job stays in its worker's job set until arq has finished it (real redis-server, a real
RolloutWorker, the simulator as its engine).

`run_group` / `run_eval_group` once gave the job up (`Liveness.job_ended`) before arq's
`finish_job` deleted its in-progress key and queue entry: in between, the job was in progress and
owned by nobody, and a worker stalled there (GIL, a loaded host) past half a heartbeat had the
orphan sweep release it, for a twin to run it again (engine work wasted; arq's KeyError when the
twin ran in the same worker). Here the window is held open with arq's `on_job_end` hook (after the
job function ended, before arq's finish) while two sweeps look at the job, for each way a job
ends in arq: done (a training and an eval job), retried (`Retry`) and aborted (`Job.abort`)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import msgspec
import pytest
from arq.constants import abort_jobs_ss, in_progress_key_prefix

from pipeline.config import parse_config
from pipeline.eval.evaluation import EvalDataset, _enqueue
from pipeline.keys import Counter, Keys
from pipeline.schema import Task
from pipeline.state import PipelineState
from pipeline.store.jobqueue import create_arq_pool, enqueue_prompt_job
from tests.support.policy_helpers import trainer_started
from tests.workers.test_worker_jobs import config_dict, job, wait_for
from workers.liveness import Liveness
from workers.settings import build_worker, stop_worker
from workers.sim.engine import SimConfig, serve_sim_engine

WORKER_ID = "held-worker"


async def _enqueue_training(redis: Any, redis_url: str, keys: Keys, namespace: str) -> tuple[str, Callable[[], Awaitable[int]]]:
    arq = await create_arq_pool(redis_url, keys)
    try:
        prompt_job = job(namespace, 1)
        assert await enqueue_prompt_job(arq, prompt_job, keys)
    finally:
        await arq.aclose()
    return keys.arq_job_id(prompt_job.job_id), lambda: redis.xlen(keys.groups)


async def _enqueue_eval(redis: Any, redis_url: str, keys: Keys, namespace: str) -> tuple[str, Callable[[], Awaitable[int]]]:
    task = Task(id="e0", env="calc", prompt="What is 2 * 7?", label="14")
    wanted: dict = {}
    await _enqueue(redis, keys, "r1", [(EvalDataset(env="calc", tasks="-", n_samples=2), [task])], 0, 60.0, wanted)
    [gid] = wanted
    return keys.arq_job_id(gid), lambda: redis.xlen(keys.eval_stream("r1"))


async def _engine_busy(url: str) -> bool:
    """Whether the engine holds a request, read as slime's abort reads it: SGLang's GET /v1/loads."""
    async with aiohttp.ClientSession() as session, session.get(f"{url}/v1/loads") as response:
        response.raise_for_status()
        [load] = (await response.json())["loads"]
    return load["num_running_reqs"] + load["num_waiting_reqs"] > 0


async def _running(redis: Any, keys: Keys) -> int:
    return int((await PipelineState(redis, keys).counters()).get(Counter.RUNNING, 0))


async def _finished(redis: Any, keys: Keys, job_id: str, *, queued: bool = False) -> bool:
    """arq's finish: no in-progress key, and the job's entry gone (or, handed back, queued)."""
    return not await redis.exists(in_progress_key_prefix + job_id) and await redis.zcard(keys.queue) == int(queued)


async def _enqueue_down(redis: Any, redis_url: str, keys: Keys, namespace: str) -> tuple[str, Callable[[], Awaitable[int]]]:
    """A training job whose environment is down for it: every episode fails, a group failure
    (`on_failure: retry_all_failed`) that arq retries (`Retry`)."""
    arq = await create_arq_pool(redis_url, keys)
    try:
        prompt_job = job(namespace, 1, env="outage")
        prompt_job = msgspec.structs.replace(prompt_job, task=msgspec.structs.replace(prompt_job.task, metadata={"down": True}))
        assert await enqueue_prompt_job(arq, prompt_job, keys)
    finally:
        await arq.aclose()
    return keys.arq_job_id(prompt_job.job_id), lambda: redis.xlen(keys.groups)


# each case: how the job is enqueued, the engine's behaviour, how the job ends in arq, and the
# worker's counts (complete, retried, failed) and groups stored once it has
CASES = {
    "training": (_enqueue_training, {}, "done", (1, 0, 0), 1),
    "eval": (_enqueue_eval, {}, "done", (1, 0, 0), 1),
    # every episode fails: run_group raises arq's Retry; the hand-back queues the next try
    "training-retry": (_enqueue_down, {}, "retry", (0, 1, 0), 0),
    # Job.abort while the episodes generate (~50 s each): run_group dead-letters it, arq "aborted"
    "training-abort": (_enqueue_training, {"token_latency_s": 0.5, "length_mu": 4.6, "length_sigma": 0.01,
                                           "tool_use": 0.0}, "abort", (0, 0, 1), 0),
}


@pytest.mark.parametrize("case", list(CASES))
async def test_a_job_between_its_end_and_arqs_finish_is_not_released_as_an_orphan(
        redis, redis_url, keys, namespace, case):
    enqueue, engine, ending, counts, groups = CASES[case]
    await trainer_started(redis, keys)
    job_id, stored = await enqueue(redis, redis_url, keys, namespace)
    held, resume = asyncio.Event(), asyncio.Event()

    async def hold(ctx: dict[str, Any]) -> None:  # arq's on_job_end: the function ended, no finish yet
        if ctx["job_id"] == job_id and not held.is_set():
            held.set()
            await resume.wait()

    async with serve_sim_engine(SimConfig(**engine)) as sim:
        # the worker's own heartbeat sweeps once at its start, then not for 10 s: the test's sweeper
        # is the only one while the job is held
        config = config_dict(redis_url, namespace, sim.url, heartbeat_s=10.0, dead_after_s=30.0)
        config["environments"]["outage"] = {"kind": "tests.workers.test_worker_jobs.OutageEnvironment",
                                            "on_failure": "retry_all_failed"}
        config["rollout"]["max_requeues"] = 0  # an aborted job is dead-lettered, not handed back as a new job
        worker = build_worker(parse_config(config), worker_id=WORKER_ID, handle_signals=False)
        worker.on_job_end = hold
        task = asyncio.create_task(worker.async_run())
        try:
            if ending == "abort":
                await wait_for(lambda: _engine_busy(sim.url), 30, "the episodes' requests")
                await redis.zadd(abort_jobs_ss, {job_id: int(time.time() * 1000)})  # arq's Job.abort
            deadline = time.monotonic() + 30
            while not held.is_set() and time.monotonic() < deadline and not task.done():
                await asyncio.sleep(0.05)
            assert held.is_set(), "the job never ended"
            assert await stored() == groups  # the function ran to its end
            # the stalled worker, seen by two sweeps more than half a heartbeat apart
            sweeper = Liveness(redis, keys, "sweeper", heartbeat_s=0.2, dead_after_s=1.0)
            released = [await sweeper.release_orphans()]
            await asyncio.sleep(0.15)
            released.append(await sweeper.release_orphans())
            assert released == [0, 0]  # was [0, 1]: released for a twin to run
            assert await redis.exists(in_progress_key_prefix + job_id) == 1
            assert await redis.hget(keys.job_owners, job_id) == WORKER_ID.encode()
            assert await _running(redis, keys) == 1  # counted until arq has finished it
            resume.set()
            await wait_for(lambda: _finished(redis, keys, job_id, queued=ending == "retry"), 10, "arq's finish")
            if ending == "retry":
                await redis.zrem(keys.queue, job_id)  # the next try is queued: this test looks at one ending
            # the job left the worker's set with arq's finish: no owner, `running` back to 0
            await wait_for(lambda: _running_is_zero(redis, keys), 10, "the job's end in liveness")
            assert await redis.smembers(keys.worker_jobs(WORKER_ID)) == set()
            assert await redis.hget(keys.job_owners, job_id) is None
        finally:
            resume.set()
            await stop_worker(worker, task)
    assert (worker.jobs_complete, worker.jobs_retried, worker.jobs_failed) == counts  # ran once
    assert await stored() == groups


async def _running_is_zero(redis: Any, keys: Keys) -> bool:
    return await _running(redis, keys) == 0
