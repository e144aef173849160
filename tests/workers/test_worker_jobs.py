"""arq workers on a real redis-server with the engine path a cluster runs (the session's stack:
smg -> SGLang's own front -> the simulator, tests/support/engine_stack.py): delivery, dead letters, crash
recovery (SIGKILL) and drain (SIGTERM)."""

import asyncio
import contextlib
import signal
import time
from collections.abc import AsyncIterator, Iterator
from types import SimpleNamespace

import msgspec
import pytest
from arq.constants import in_progress_key_prefix

from pipeline.config import parse_config
from pipeline.keys import Counter, Keys
from pipeline.schema import (
    PromptJob,
    Status,
    Task,
    decode_job,
    encode,
    encode_task_json,
)
from pipeline.state import PipelineState
from pipeline.store.buffer import GroupBuffer
from pipeline.store.jobqueue import JOB_FUNCTION, create_arq_pool, enqueue_prompt_job
from producers.enqueue import ProducerOptions, run_producer
from scripts.processes import WorkerProcess, write_config
from tests.support.engine_stack import START_TIMEOUT_S, EngineStack, shared_stack
from tests.support.env_helpers import OneTurnSession
from tests.support.policy_helpers import trainer_started
from workers.envs.base import (
    EnvError,
    Environment,
    EnvSession,
)
from workers.jobs import CTX_KEY, run_group
from workers.settings import _build_context, build_worker, stop_worker

# ~100 tokens at ~20 ms: a group takes about two seconds, long enough to kill a worker mid-group.
SLOW_ENGINE = dict(token_latency_s=0.02, latency_sigma=0.01, length_mu=4.6, length_sigma=0.01)
pytestmark = pytest.mark.timeout(START_TIMEOUT_S + 180)  # a test's timeout includes the session stack's start


@pytest.fixture
def stack() -> EngineStack:
    return shared_stack()


@contextlib.asynccontextmanager
async def stack_engine(stack: EngineStack) -> AsyncIterator[SimpleNamespace]:
    """The session's stack with the simulator's defaults and a clean slate; `.url` is its router."""
    stack.configure()
    yield SimpleNamespace(url=stack.router_url, stack=stack)


@contextlib.contextmanager
def slow_engine(stack: EngineStack) -> Iterator[SimpleNamespace]:
    """The session's stack, ~2 s a group (SLOW_ENGINE); `.url` is its router."""
    stack.configure(**SLOW_ENGINE)
    yield SimpleNamespace(url=stack.router_url)

NO_TRAINER = ProducerOptions(wait_for_trainer=False)  # no trainer in these tests: admit on the config


@pytest.fixture(autouse=True)
async def _policy_published(redis, keys):
    """No trainer here either: publish its first rollout's policy version, or workers wait for it."""
    await trainer_started(redis, keys)


def config_dict(redis_url, namespace, engine_url, **workers):
    return {
        "redis": {"url": redis_url, "namespace": namespace},
        "engine": {"url": engine_url, "max_retries": 1, "retry_backoff_s": 0.01},
        "rollout": {"max_response_tokens": 512, "n_samples_per_prompt": 4},  # as `job()` builds them
        "environments": {
            "calc": {"kind": "calculator"},
            "strict": {"kind": "arithmetic", "on_failure": "drop_group"},
        },
        "workers": {"heartbeat_s": 0.5, "dead_after_s": 2.0, "poll_delay_s": 0.02, "max_tries": 2, **workers},
    }


def job(namespace, i, env="calc", n=4):
    task = Task(id=f"{namespace}-t{i}", env=env, prompt=f"What is {i} * 7?", label=str(7 * i))
    return PromptJob(task=task, epoch=0, n_samples=n, admission_version=1, enqueued_at=time.time())


async def wait_for(predicate, timeout, what):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if await predicate():
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


async def run_worker_until(config, predicate, what, timeout=20):
    """An in-process worker, stopped once `predicate()` holds."""
    worker = build_worker(config, handle_signals=False)
    task = asyncio.create_task(worker.async_run())
    try:
        await wait_for(predicate, timeout, what)
    finally:
        await stop_worker(worker, task)


async def stream_groups(redis, keys):
    ids = [entry_id.decode() for entry_id, _fields in await redis.xrange(keys.groups)]
    return [entry.group for entry in await GroupBuffer(redis, keys).fetch(ids)]


async def test_group_of_n_lands_once(stack, redis, redis_url, keys, namespace):
    async with stack_engine(stack) as sim:
        config = parse_config(config_dict(redis_url, namespace, sim.url))
        arq = await create_arq_pool(redis_url, keys)
        jobs = [job(namespace, i) for i in range(3)]
        assert all([await enqueue_prompt_job(arq, j, keys) for j in jobs])
        assert not await enqueue_prompt_job(arq, jobs[0], keys)  # arq refuses a live id
        await run_worker_until(config, lambda: _xlen_is(redis, keys, 3), "3 groups")
        groups = await stream_groups(redis, keys)
        assert sorted(g.group_id for g in groups) == sorted(j.job_id for j in jobs)
        for g in groups:
            assert g.n_samples == 4 and len(g.samples) == 4 and g.admission_version == 1
            assert all(s.weight_versions and s.response_length > 0 for s in g.samples)
        counters = await PipelineState(redis, keys).counters()
        assert counters[Counter.RUNNING] == 0 and counters[Counter.EPISODES] == 12
        assert counters[Counter.TOKENS] == sum(int(s.loss_mask_array().sum()) for g in groups for s in g.samples)

        # a re-run of a finished job (e.g. after a crash right after the push) runs nothing, stores nothing;
        # past its last try it is not dead-lettered or handed back either: its group is stored
        context = await _build_context(config, keys, "rerun")
        try:
            results = [await run_group({CTX_KEY: context, "job_id": keys.arq_job_id(jobs[0].job_id), "job_try": t},
                                       encode(jobs[0])) for t in (2, 3)]
        finally:
            await context.aclose()
        assert [r["status"] for r in results] == ["duplicate", "duplicate"]
        assert await redis.xlen(keys.groups) == 3
        assert await redis.xlen(keys.dead) == 0 and await redis.llen(keys.requeue) == 0
        counters = await PipelineState(redis, keys).counters()
        # the re-run saw the dedup marker first: no episode generated, no push attempted
        assert counters[Counter.EPISODES] == 12 and counters.get(Counter.DUPLICATES, 0) == 0
        assert counters[Counter.RUNNING] == 0
        await arq.aclose()


async def test_two_namespaces_with_the_same_task_ids_run_side_by_side(stack, redis, redis_url, namespace, tmp_path):
    """arq's job keys are global (`arq:job:<id>`, `arq:in-progress:<id>`, ...): the arq id carries
    the namespace, so two pipelines on one Redis admit, run and deliver the same task ids."""
    tasks = [Task(id=f"shared-{namespace}-{i}", env="calc", prompt=f"What is {i} * 7?", label=str(7 * i))
             for i in range(4)]
    (tmp_path / "tasks.jsonl").write_bytes(b"".join(encode_task_json(t) + b"\n" for t in tasks))
    pipelines = [Keys(f"{namespace}a"), Keys(f"{namespace}b")]
    async with stack_engine(stack) as sim:
        configs = [parse_config(config_dict(redis_url, k.ns, sim.url)) for k in pipelines]
        for config, k in zip(configs, pipelines):
            await trainer_started(redis, k)
            stats = await run_producer(config, tmp_path / "tasks.jsonl", redis=redis, options=NO_TRAINER)
            assert (stats.admitted, stats.refused) == (len(tasks), 0)
        workers = [build_worker(config, handle_signals=False) for config in configs]
        runs = [asyncio.create_task(w.async_run()) for w in workers]  # the same ids in progress in both

        async def both_done() -> bool:  # all groups pushed, and arq done with every job
            return all([await _xlen_is(redis, k, len(tasks)) and not await redis.zcard(k.queue) for k in pipelines])

        try:
            await wait_for(both_done, 30, "both pipelines' groups")
        finally:
            for worker, run in zip(workers, runs):
                await stop_worker(worker, run)
    for k in pipelines:
        groups = await stream_groups(redis, k)
        assert sorted(g.group_id for g in groups) == sorted(f"{t.id}:0" for t in tasks)
        assert all(len(g.samples) == 4 for g in groups)
        counters = await PipelineState(redis, k).counters()
        assert counters[Counter.BUFFERED] == len(tasks) and counters[Counter.RUNNING] == 0
        assert await redis.xlen(k.dead) == 0 and await redis.zcard(k.queue) == 0


async def _xlen_is(redis, keys, n):
    return await redis.xlen(keys.groups) >= n


async def test_poison_unknown_env_and_out_of_tries_go_to_dead_letters(stack, redis, redis_url, keys, namespace, tmp_path):
    """Poison and unknown environments are dead-lettered for good; a job out of tries for a
    transient reason is also handed back, re-admitted by the producer as the next attempt, and
    dead-lettered for good past --max-requeues."""
    async with stack_engine(stack) as sim:
        raw_config = config_dict(redis_url, namespace, sim.url)
        raw_config["rollout"]["max_requeues"] = 1
        config = parse_config(raw_config)
        arq = await create_arq_pool(redis_url, keys)
        await arq.enqueue_job(JOB_FUNCTION, b"\xc1not msgpack", _job_id=f"{namespace}-poison:0", _queue_name=keys.queue)
        await enqueue_prompt_job(arq, job(namespace, 1, env="nowhere"), keys)
        strict_job = job(namespace, 2, env="strict")
        await enqueue_prompt_job(arq, strict_job, keys)
        # every episode of `strict` fails -> the group is dropped. A 400, not a 503: through smg a burst
        # of 5xx opens the router's circuit breaker ("All workers are unavailable") for the tests after
        sim.stack.sim("fail_next", {"status": 400, "count": 1000, "message": "refused (injected)"})
        # the strict task: attempt 0 out of tries, handed back in place as attempt 1 (no producer
        # runs here), which fails too and is dead-lettered for good (rollout.max_requeues 1)
        await run_worker_until(config, lambda: _dead_and_finished(redis, keys, 4), "4 dead letters", 40)
        dead = {f[b"ref"].decode(): f for _id, f in await redis.xrange(keys.dead)}
        assert b"undecodable PromptJob" in dead[f"{namespace}-poison:0"][b"reason"]
        assert b"environment 'nowhere' is not configured" in dead[keys.arq_job_id(f"{namespace}-t1:0")][b"reason"]
        strict = dead[keys.arq_job_id(f"{namespace}-t2:0")]
        assert b"try 2" in strict[b"reason"] and b"episodes failed" in strict[b"reason"]
        assert b"handed back as attempt 1" in strict[b"reason"]
        assert decode_job(strict[b"payload"]).task.id == f"{namespace}-t2"  # the job is kept for replay
        retried = dead[keys.arq_job_id(f"{namespace}-t2:0r1")]
        assert decode_job(retried[b"payload"]).attempt == 1
        assert b"dead-lettered for good: 1 re-admissions, rollout.max_requeues 1" in retried[b"reason"]
        counters = await PipelineState(redis, keys).counters()
        assert counters[Counter.FAILED] == 4 and counters[Counter.DISCARDED] == 4 and counters[Counter.RUNNING] == 0
        assert counters[Counter.REQUEUED] == 1 and counters[Counter.ENQUEUED] == 1  # the slot was kept, then freed
        assert await redis.xlen(keys.groups) == 0 and await redis.llen(keys.requeue) == 0
        assert await redis.zcard(keys.queue) == 0 and await redis.zcard(keys.open) == 0
        await arq.aclose()


async def _xlen_is_dead(redis, keys, n):
    return await redis.xlen(keys.dead) >= n


async def _dead_and_finished(redis, keys, n):
    """n dead letters and arq done with every job (stopping a worker before arq's own
    bookkeeping would leave the last job queued)."""
    return await _xlen_is_dead(redis, keys, n) and await redis.zcard(keys.queue) == 0


class OutageEnvironment(Environment):
    """A plugin environment whose server is down for tasks marked `down`, and refuses only
    the very first session of a task marked `flaky` (one episode of its group fails)."""

    starts: dict[str, int] = {}

    async def start(self, task: Task) -> EnvSession:
        seen = self.starts[task.id] = self.starts.get(task.id, 0) + 1
        if task.metadata.get("down") or (task.metadata.get("flaky") and seen == 1):
            raise EnvError("POST /seed_session: connection refused (injected outage)")
        return OneTurnSession(task)


async def test_retry_all_failed_retries_an_outage_group_but_pushes_a_partly_failed_one(stack, redis, redis_url, keys, namespace):
    """`on_failure: retry_all_failed`: a group whose every episode failed is a group failure
    (retried with backoff, then dead-lettered and handed back), not a signal-free group in a
    trainer batch; a group with one failed episode is pushed, that episode marked failed."""
    async with stack_engine(stack) as sim:
        config = config_dict(redis_url, namespace, sim.url)
        config["environments"]["outage"] = {"kind": f"{__name__}.OutageEnvironment", "on_failure": "retry_all_failed"}
        config["rollout"]["max_requeues"] = 0  # no hand-back: count the two tries of one attempt
        config = parse_config(config)
        arq = await create_arq_pool(redis_url, keys)
        down, flaky = (
            msgspec.structs.replace(job(namespace, i, env="outage"),
                                    task=Task(id=f"{namespace}-t{i}", env="outage", prompt="What is 6 * 7?",
                                              label="42", metadata={mark: True}))
            for i, mark in ((1, "down"), (2, "flaky"))
        )
        for j in (down, flaky):
            await enqueue_prompt_job(arq, j, keys)
        await run_worker_until(
            config, lambda: _all(_dead_and_finished(redis, keys, 1), _xlen_is(redis, keys, 1)), "1 dead, 1 pushed", 60
        )
        await arq.aclose()
    [group] = await stream_groups(redis, keys)
    assert group.group_id == flaky.job_id
    assert [s.status for s in group.samples].count(Status.FAILED) == 1 and len(group.samples) == 4
    [(_id, dead)] = await redis.xrange(keys.dead)
    assert dead[b"ref"].decode() == keys.arq_job_id(down.job_id)
    assert b"try 2" in dead[b"reason"] and b"4/4 episodes failed" in dead[b"reason"], dead[b"reason"]
    assert b"dead-lettered for good" in dead[b"reason"] and await redis.llen(keys.requeue) == 0
    assert OutageEnvironment.starts[down.task.id] == 8  # two tries of four episodes


async def _all(*checks) -> bool:
    return all([await check for check in checks])


async def enqueue_pairs(redis_url, keys, namespace, count):
    """`count` jobs of two episodes each, enqueued; returns the arq client and the jobs."""
    arq = await create_arq_pool(redis_url, keys)
    jobs = [job(namespace, i, n=2) for i in range(count)]
    for j in jobs:
        assert await enqueue_prompt_job(arq, j, keys)
    return arq, jobs


async def test_sigkilled_worker_jobs_rerun_by_another_worker_once(stack, redis, redis_url, keys, namespace, tmp_path):
    with slow_engine(stack) as engine:
        path = write_config(config_dict(redis_url, namespace, engine.url, concurrency=4), tmp_path / "cfg.yaml")
        arq, jobs = await enqueue_pairs(redis_url, keys, namespace, 6)
        victim = WorkerProcess(path, log_path=str(tmp_path / "victim.log")).start()
        try:
            await wait_for(lambda: _has_running_jobs(redis, keys), 60, "the first worker to start jobs")
            victim.signal(signal.SIGKILL)
            victim.wait(10)
            killed_at = time.monotonic()
            in_flight = await redis.xlen(keys.groups)
            assert in_flight < len(jobs)  # it died holding jobs
            with WorkerProcess(path, log_path=str(tmp_path / "rescuer.log")):
                await wait_for(lambda: _xlen_is(redis, keys, len(jobs)), 45, "all groups")
                assert time.monotonic() - killed_at < 45
                await asyncio.sleep(1.0)  # anything pushed twice would show up now
        finally:
            victim.stop()
        groups = await stream_groups(redis, keys)
        assert sorted(g.group_id for g in groups) == sorted(j.job_id for j in jobs)  # each exactly once
        assert any(g.timings["job_try"] >= 2 for g in groups)  # the victim's jobs were re-run
        counters = await PipelineState(redis, keys).counters()
        assert counters[Counter.RUNNING] == 0
        await arq.aclose()


async def _has_running_jobs(redis, keys):
    workers = await redis.zrange(keys.workers, 0, -1)
    for w in workers:
        if await redis.scard(keys.worker_jobs(w.decode())):
            return True
    return False


@pytest.mark.parametrize("grace_s, finished", [(20.0, True), (0.2, False)], ids=["finish", "hand-back"])
async def test_sigterm_drains(stack, redis, redis_url, keys, namespace, tmp_path, grace_s, finished):
    with slow_engine(stack) as engine:
        cfg = config_dict(redis_url, namespace, engine.url, concurrency=2, drain_grace_s=grace_s)
        path = write_config(cfg, tmp_path / "cfg.yaml")
        arq, jobs = await enqueue_pairs(redis_url, keys, namespace, 4)
        worker = WorkerProcess(path, log_path=str(tmp_path / "worker.log")).start()
        try:
            await wait_for(lambda: _has_running_jobs(redis, keys), 60, "the worker to start jobs")
            worker.signal(signal.SIGTERM)
            assert worker.wait(grace_s + 15) == 0
        finally:
            worker.stop()
        pushed = await redis.xlen(keys.groups)
        queued = await redis.zcard(keys.queue)
        assert pushed + queued == len(jobs)  # nothing lost
        if finished:
            assert pushed == 2  # the two running groups finished; no new job was taken
        else:
            assert pushed == 0  # handed back: still queued and runnable at once
            in_progress = [await redis.exists(in_progress_key_prefix + keys.arq_job_id(j.job_id)) for j in jobs]
            assert in_progress == [0] * len(jobs)
        assert await redis.zcard(keys.workers) == 0  # left cleanly: nobody reaps it
        assert (await PipelineState(redis, keys).counters()).get(Counter.RUNNING, 0) == 0
        await arq.aclose()


# ------------------------------------------------------------------ issue 13: deadlines, aborts, bugs

class HangingEnvironment(Environment):
    """A plugin environment whose session start never returns (a hung env server with no timeout)."""

    async def start(self, task: Task) -> EnvSession:
        await asyncio.sleep(3600)
        raise AssertionError("unreachable")


async def _running_jobs(redis, keys) -> int:
    return int((await PipelineState(redis, keys).counters()).get(Counter.RUNNING, 0))


async def test_a_group_past_its_soft_deadline_is_dead_lettered_handed_back_and_tombstoned(stack, redis, redis_url, keys, namespace):
    """Past arq's job_timeout a group vanished (CancelledError passes `except Exception`): no
    group, no dead letter, no hand-back, its admission slot leaked. The soft deadline (here
    job_timeout_s 4 -> 2 s) hands it back first; a zombie's late push of it is refused."""
    from workers.jobs import soft_deadline_s

    async with stack_engine(stack) as sim:
        config = config_dict(redis_url, namespace, sim.url, job_timeout_s=4.0)
        config["environments"]["hang"] = {"kind": f"{__name__}.HangingEnvironment"}
        config["rollout"]["max_requeues"] = 1
        config = parse_config(config)
        assert soft_deadline_s(config.workers) == 2.0
        assert soft_deadline_s(parse_config({}).workers) == 3420.0  # defaults: 180 s before arq's 3600 s
        arq = await create_arq_pool(redis_url, keys)
        stuck = job(namespace, 1, env="hang")
        await enqueue_prompt_job(arq, stuck, keys)
        await run_worker_until(config, lambda: _dead_and_finished(redis, keys, 2), "both attempts' dead letters", 30)
        await arq.aclose()
    dead = await _handed_back_in_place(redis, keys, stuck)
    assert b"soft deadline of 2s" in dead[b"reason"]
    assert await _running_jobs(redis, keys) == 0
    # a zombie worker that still finishes the group later cannot push it: the tombstone refuses it
    from pipeline.synthetic import make_group
    assert await GroupBuffer(redis, keys).push(make_group(stuck.job_id, n=4)) is None
    assert await redis.xlen(keys.groups) == 0


async def test_an_aborted_job_is_dead_lettered_and_handed_back(stack, redis, redis_url, keys, namespace):
    """Job.abort() while the group's episodes generate: each one's request is aborted on the engine
    that runs it (SGLang's /abort_request through the router's list) at once, not at the front's
    disconnect poll or the generation's end (issue 39 item 6)."""
    from arq.jobs import Job

    stack.configure(token_latency_s=0.5, tool_use=0.0, length_mu=4.6, length_sigma=0.01)  # ~100 tokens: ~50 s a request
    config = config_dict(redis_url, namespace, stack.router_url, job_timeout_s=4.0)  # the next attempt ends at 2 s
    config["rollout"]["max_requeues"] = 1
    config = parse_config(config)
    arq = await create_arq_pool(redis_url, keys)
    stuck = job(namespace, 1)
    await enqueue_prompt_job(arq, stuck, keys)
    worker = build_worker(config, handle_signals=False)
    task = asyncio.create_task(worker.async_run())
    try:
        await wait_for(lambda: asyncio.sleep(0, stack.total_stats()["running"] == stuck.n_samples), 20,
                       "the group's requests on the engines")
        from pipeline.store.jobqueue import job_deserializer

        handle = Job(keys.arq_job_id(stuck.job_id), arq, _queue_name=keys.queue, _deserializer=job_deserializer)
        await handle.abort(timeout=10)
        await wait_for(lambda: asyncio.sleep(0, stack.total_stats()["aborted"] == stuck.n_samples), 2,
                       "the engines to abort the group's requests")
        await wait_for(lambda: _dead_and_finished(redis, keys, 2), 20, "both attempts' dead letters")
    finally:
        await stop_worker(worker, task)
    await arq.aclose()
    dead = await _handed_back_in_place(redis, keys, stuck)
    assert b"aborted (Job.abort)" in dead[b"reason"]
    assert await _running_jobs(redis, keys) == 0
    assert stack.total_stats()["running"] == 0  # the next attempt's requests were aborted at its deadline too


async def _handed_back_in_place(redis, keys, failed: PromptJob) -> dict:
    """The next attempt was enqueued by the hand-back itself (no producer runs here), at the
    current clock, ran, and (rollout.max_requeues 1) was dead-lettered for good. Returns the
    first attempt's dead letter."""
    from pipeline.schema import job_id_for

    retry = job_id_for(failed.task.id, failed.epoch, failed.attempt + 1)
    dead = {f[b"ref"].decode(): f for _id, f in await redis.xrange(keys.dead)}
    assert set(dead) == {keys.arq_job_id(failed.job_id), keys.arq_job_id(retry)}, list(dead)
    first, second = dead[keys.arq_job_id(failed.job_id)], dead[keys.arq_job_id(retry)]
    assert b"handed back as attempt 1" in first[b"reason"]
    again = decode_job(second[b"payload"])
    assert again.attempt == 1 and again.admission_version == int(await redis.get(keys.version) or 0)
    assert b"dead-lettered for good" in second[b"reason"]
    # the hand-back wrote attempt 1; dead-lettered for good, the (task, epoch)'s field is trimmed (issue 26)
    assert await redis.hget(keys.requeue_attempts, job_id_for(failed.task.id, failed.epoch)) is None
    assert await redis.llen(keys.requeue) == 0 and await redis.zcard(keys.open) == 0
    counters = await PipelineState(redis, keys).counters()
    assert counters[Counter.FAILED] == 2 and counters[Counter.DISCARDED] == 2 and counters[Counter.REQUEUED] == 1
    return first


async def test_a_bug_fails_once_with_its_traceback(stack, redis, redis_url, keys, namespace, monkeypatch):
    """A TypeError is a bug, not a transient fault: one try, dead-lettered with its traceback,
    not retried and not handed back (it would fail the same way)."""
    import workers.jobs as jobs_module

    calls = []

    async def buggy(w, job, job_try):
        calls.append(job_try)
        return None + 1  # TypeError

    monkeypatch.setattr(jobs_module, "run_episodes", buggy)
    async with stack_engine(stack) as sim:
        config = parse_config(config_dict(redis_url, namespace, sim.url, max_tries=3))
        arq = await create_arq_pool(redis_url, keys)
        await enqueue_prompt_job(arq, job(namespace, 1), keys)
        await run_worker_until(config, lambda: _dead_and_finished(redis, keys, 1), "the bug's dead letter")
        await arq.aclose()
    assert calls == [1]
    [(_id, dead)] = await redis.xrange(keys.dead)
    assert b"a bug, not retried: TypeError" in dead[b"reason"] and b"Traceback" in dead[b"reason"]
    assert b"buggy" in dead[b"reason"]  # the frame that raised
    assert await redis.llen(keys.requeue) == 0
    counters = await PipelineState(redis, keys).counters()
    assert counters[Counter.FAILED] == 1 and counters[Counter.DISCARDED] == 1 and counters.get(Counter.REQUEUED, 0) == 0


def test_transient_faults_are_not_bugs():
    import aiohttp
    from redis.exceptions import ConnectionError as RedisConnectionError

    from workers.engine import EngineError
    from workers.envs.base import EnvError
    from workers.errors import is_bug

    for exc in (TypeError("x"), KeyError("k"), AttributeError("a"), ValueError("v"), ZeroDivisionError()):
        assert is_bug(exc), exc
    wrapped = EnvError("POST /verify: TypeError: unsupported operand")  # the env call budget's wrapper
    wrapped.__cause__ = TypeError("unsupported operand")
    assert is_bug(wrapped)
    transient = EnvError("POST /verify: failed 3 time(s)")
    transient.__cause__ = aiohttp.ClientConnectionError()
    assert not is_bug(transient)
    for exc in (ConnectionError(), TimeoutError(), asyncio.TimeoutError(), OSError(), RedisConnectionError(),
                aiohttp.ClientConnectionError(), EngineError("HTTP 503"), EnvError("HTTP 500")):
        assert not is_bug(exc), exc


# ------------------------------------------------------------------ the process pool (workers/pool.py)

def _pool(target, *args, **kw):
    from workers.pool import Pool

    cfg = parse_config({})
    return Pool(cfg, kw.pop("processes", 1), None, False, target=target, args=args, tick_s=0.05, **kw)


def _run_pool(pool, *, sigterm_after: float | None = None, timeout: float = 30.0) -> tuple[int, float]:
    """Run the pool in this (main) thread; SIGTERM it after `sigterm_after` s. (status, seconds)."""
    import os
    import threading

    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    timer = threading.Timer(sigterm_after, os.kill, (os.getpid(), signal.SIGTERM)) if sigterm_after else None
    watchdog = threading.Timer(timeout, os.kill, (os.getpid(), signal.SIGINT))
    started = time.monotonic()
    try:
        if timer:
            timer.start()
        watchdog.start()
        status = pool.run()
    finally:
        watchdog.cancel()
        if timer:
            timer.cancel()
        for s, h in saved.items():
            signal.signal(s, h)
    return status, time.monotonic() - started


def test_pool_gives_up_on_a_crash_loop():
    from tests.support.pool_children import child_exit

    pool = _pool(child_exit, 3, backoff_s=0.05, max_restarts=2, window_s=60)
    status, _ = _run_pool(pool)
    assert status == 1 and pool.restarts == 2


def test_pool_told_to_stop_during_a_restart_backoff_starts_nothing():
    from tests.support.pool_children import child_exit

    pool = _pool(child_exit, 1, backoff_s=5.0)
    status, seconds = _run_pool(pool, sigterm_after=1.0)
    assert status == 0 and pool.restarts == 0 and seconds < 4
    assert all(p is None or not p.is_alive() for p in pool.children)


def test_pool_does_not_restart_a_child_that_drained_and_exited_cleanly():
    from tests.support.pool_children import child_exit

    pool = _pool(child_exit, 0, 0.2, processes=2)
    status, seconds = _run_pool(pool)
    assert status == 0 and pool.restarts == 0 and seconds < 10


def test_pool_sigkills_a_child_that_does_not_drain():
    from tests.support.pool_children import child_drains, child_ignores_sigterm

    pool = _pool(child_ignores_sigterm, 0, kill_after_s=0.5)
    status, seconds = _run_pool(pool, sigterm_after=1.5)
    assert status == 0 and seconds < 8
    drained = _pool(child_drains, 0, processes=2, kill_after_s=30)
    status, seconds = _run_pool(drained, sigterm_after=4.0)  # after the children's imports
    assert status == 0 and seconds < 12 and [p.exitcode for p in drained.children] == [0, 0]
