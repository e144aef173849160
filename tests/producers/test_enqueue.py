"""rollout enqueue: staleness-bounded admission, resume, requeue, mixing (real redis-server)."""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections import Counter as Tally
from pathlib import Path
from types import SimpleNamespace

import msgspec
import pytest
from arq.constants import job_key_prefix
from arq.jobs import deserialize_job

from pipeline.config import ConfigError, parse_config
from pipeline.keys import Counter, Keys
from pipeline.schema import Requeue, RequeueReason, Task, decode_job, encode, encode_task_json
from pipeline.slime.data_source import RedisDataSource, generate_rollout
from pipeline.staleness import admission_headroom
from pipeline.state import PipelineState, TrainerInfo
from pipeline.store.jobqueue import JOB_FUNCTION, job_deserializer
from producers.admission import Admission, Limits
from producers.enqueue import Producer, ProducerOptions, main, run_producer
from producers.task_index import TaskIndex
from tests.support.env_helpers import OneTurnSession
from workers.envs.base import (
    EnvError,
    Environment,
    EnvSession,
)
from workers.settings import build_worker, stop_worker
from workers.sim.engine import serve_sim_engine

NO_TRAINER = ProducerOptions(wait_for_trainer=False)  # no trainer in these tests: admit on the config


def write_tasks(path: Path, prefix: str, sizes: dict[str, int]) -> list[Task]:
    """Task ids carry the test's namespace (unique ids; arq's ids carry the namespace anyway)."""
    tasks = [Task(id=f"{prefix}-{env}-{i}", env=env, prompt=f"{env} question {i}", label=str(i))
             for env, n in sizes.items() for i in range(n)]
    path.write_bytes(b"".join(encode_task_json(t) + b"\n" for t in tasks))
    return tasks


def make_config(redis_url: str, ns: str, weights: dict[str, float], *, batch: int, eta: int, n: int = 2):
    return parse_config({
        "redis": {"url": redis_url, "namespace": ns},
        "rollout": {"rollout_batch_size": batch, "eta": eta, "n_samples_per_prompt": n,
                    "sampling": {"temperature": 0.7, "max_new_tokens": 64}},
        "environments": {env: {"kind": "math", "weight": w} for env, w in weights.items()},
    })


async def queued_jobs(redis, keys):
    """Group ids of the queued jobs (arq's ids are `keys.arq_job_id(group id)`)."""
    return [keys.group_id_of(i.decode()) for i in await redis.zrange(keys.queue, 0, -1)]


async def wait_for(predicate, timeout: float = 60.0):  # generous: CI machines are shared and 2-core
    deadline = asyncio.get_running_loop().time() + timeout
    while not await predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


async def test_plain_run_admits_every_task_once_per_epoch(tmp_path, redis_url, redis, keys, namespace):
    tasks = write_tasks(tmp_path / "tasks.jsonl", namespace, {"a": 20, "b": 10})
    config = make_config(redis_url, namespace, {"a": 1, "b": 1}, batch=1000, eta=0)
    stats = await run_producer(config, tmp_path / "tasks.jsonl", epochs=2, redis=redis, options=NO_TRAINER)
    ids = await queued_jobs(redis, keys)
    assert sorted(ids) == sorted(f"{t.id}:{e}" for t in tasks for e in (0, 1))
    assert stats.admitted == 60 and stats.epochs_done == 2
    assert (await PipelineState(redis, keys).counters())[Counter.ENQUEUED] == 60
    # the stored job is what an arq worker with our deserializer reads: run_group(<msgpack PromptJob>)
    raw = await redis.get(job_key_prefix + keys.arq_job_id(ids[0]))
    job_def = deserialize_job(raw, deserializer=job_deserializer)
    assert job_def.function == JOB_FUNCTION
    job = decode_job(job_def.args[0])
    assert job.job_id == ids[0] and job.n_samples == 2 and job.sampling.max_new_tokens == 64


def test_epoch_order_is_seeded_complete_and_shuffled(tmp_path):
    write_tasks(tmp_path / "t.jsonl", "x", {"a": 50, "b": 30})
    index = TaskIndex.build(tmp_path / "t.jsonl", {"a": 1.0, "b": 1.0})
    weights = {"a": 1.0, "b": 1.0}
    e0 = list(index.epoch_order(0, 7, weights))
    assert e0 == list(index.epoch_order(0, 7, weights))  # deterministic: resume replays it
    assert len(set(e0)) == 80 and e0 != sorted(e0)
    assert e0 != list(index.epoch_order(1, 7, weights)) != list(index.epoch_order(0, 8, weights))


async def test_waits_at_the_bound_and_admits_as_it_moves(tmp_path, redis_url, redis, keys, namespace):
    state, stop, run, count = _producer_at_eta_1(tmp_path, redis_url, redis, keys, namespace, poll_s=0.02)
    await wait_for(lambda: _eq(count, 8))  # (eta + 0 + 1) * 4
    await asyncio.sleep(0.2)
    assert await count() == 8  # blocked, not over the bound
    await state.set_version(1)
    await wait_for(lambda: _eq(count, 12))
    await state.incr(**{Counter.DISCARDED: 3})  # three groups left without training: slots come back
    await wait_for(lambda: _eq(count, 15))
    stop.set()
    stats = await asyncio.wait_for(run, 30)
    assert stats.admitted == 15 and stats.waits > 0


async def _eq(fn, value) -> bool:
    return await fn() == value


def _producer_at_eta_1(tmp_path, redis_url, redis, keys, namespace, *, poll_s: float):
    """A producer of 40 tasks at B 4, eta 1 running in the background (no trainer): its state, stop
    event, task, and a count of the groups it admitted."""
    write_tasks(tmp_path / "tasks.jsonl", namespace, {"a": 40})
    config = make_config(redis_url, namespace, {"a": 1}, batch=4, eta=1)
    state = PipelineState(redis, keys)
    stop = asyncio.Event()
    run = asyncio.create_task(run_producer(config, tmp_path / "tasks.jsonl", redis=redis, stop_event=stop,
                                           options=ProducerOptions(wait_for_trainer=False, poll_s=poll_s)))

    async def count():
        return (await state.counters()).get(Counter.ENQUEUED, 0)

    return state, stop, run, count


async def test_a_published_version_wakes_the_blocked_producer_before_its_poll(tmp_path, redis_url, redis, keys, namespace):
    """The trainer's publish (the call slime's rollout makes) wakes the producer at once: with a 60 s
    poll, the next version's groups can only be admitted within the 20 s below by the wake-up; stop
    ends its wait at once too."""
    state, stop, run, count = _producer_at_eta_1(tmp_path, redis_url, redis, keys, namespace, poll_s=60.0)
    await wait_for(lambda: _eq(count, 8), timeout=20)  # (eta + 0 + 1) * 4, then blocked
    await wait_for(lambda: _subscribed(redis, keys.version_events), timeout=20)
    for version, admitted in ((1, 12), (2, 16)):
        await state.publish_policy(run=1, start=0, engine_version=version, rollout_id=version)
        await wait_for(lambda admitted=admitted: _eq(count, admitted), timeout=20)
    stop.set()
    stats = await asyncio.wait_for(run, 20)
    # v1 is published while the producer listens, so a wait ends on its message; v2's may be seen by
    # the producer's next look at the version before a wait reads it (CI: 1 of 2), and then the stop
    assert stats.admitted == 16 and stats.woken >= 1, stats


async def test_a_lost_wake_up_costs_one_poll_not_the_run(tmp_path, redis_url, redis, keys, namespace):
    """The producer's pub/sub connection killed (as a Redis restart or a proxy would) while it waits:
    it goes on polling, subscribes again, and admits every version that follows."""
    state, stop, run, count = _producer_at_eta_1(tmp_path, redis_url, redis, keys, namespace, poll_s=0.5)
    await wait_for(lambda: _eq(count, 8))
    await wait_for(lambda: _subscribed(redis, keys.version_events))
    assert await redis.execute_command("CLIENT", "KILL", "TYPE", "pubsub") >= 1
    await state.set_version(1)  # likely published while nobody listens (the poll then sees it)
    await wait_for(lambda: _eq(count, 12))
    await wait_for(lambda: _subscribed(redis, keys.version_events))  # and it listens again
    await state.set_version(2)
    await wait_for(lambda: _eq(count, 16))
    stop.set()
    stats = await asyncio.wait_for(run, 20)
    assert stats.admitted == 16, stats


async def _subscribed(redis, channel: str) -> bool:
    counts = await redis.pubsub_numsub(channel)
    return bool(counts and counts[0][1] >= 1)


@pytest.mark.parametrize("eta,version,batch,enqueued,discarded,offered", [
    (0, 0, 4, 0, 0, 10), (2, 3, 5, 17, 2, 10), (1, 0, 3, 6, 0, 5), (0, 5, 2, 20, 9, 1), (1, 2, 8, 0, 0, 64),
])
async def test_script_bound_equals_admission_headroom(redis, keys, namespace, eta, version, batch, enqueued,
                                                      discarded, offered):
    state = PipelineState(redis, keys)
    await state.set_version(version)
    await state.incr(**{Counter.ENQUEUED: enqueued, Counter.DISCARDED: discarded})
    jobs = [(f"{namespace}-j{i}:0", b"x") for i in range(offered)]
    result = await Admission(redis, keys).admit_fresh(
        Limits(batch, eta, 1), jobs, cursor_field="e0", position=0, score_ms=1)
    room = admission_headroom(eta=eta, version=version, batch_size=batch, admitted=enqueued, discarded=discarded)
    assert result.admitted == min(room, offered)
    assert int(await redis.hget(keys.cursor, "e0") or 0) == result.consumed


async def test_fresh_tasks_yield_to_waiting_requeued_tasks(redis, keys, namespace):
    """A hand-back that lands between the producer's look at the requeue list and its fresh
    admission must keep the freed slot: the script refuses fresh tasks while requeues wait
    (once a CI flake: the fresh task took the slot and the requeued one waited forever)."""
    await redis.rpush(keys.requeue, b"entry")
    admission = Admission(redis, keys)
    jobs = [(f"{namespace}-j0:0", b"x")]
    result = await admission.admit_fresh(Limits(4, 0, 1), jobs, cursor_field="e0", position=0, score_ms=1)
    assert result.requeue_first and result.consumed == result.admitted == 0
    assert await redis.zcard(keys.queue) == 0 and await redis.hget(keys.cursor, "e0") is None
    await redis.delete(keys.requeue)
    result = await admission.admit_fresh(Limits(4, 0, 1), jobs, cursor_field="e0", position=0, score_ms=1)
    assert not result.requeue_first and result.consumed == result.admitted == 1


async def test_restart_mid_epoch_admits_each_task_exactly_once(tmp_path, redis_url, redis, keys, namespace):
    """Producers are killed (cancelled) at random points while a consumer pops and forgets
    jobs (no arq result left behind), so only the cursor can prevent repeats."""
    tasks = write_tasks(tmp_path / "tasks.jsonl", namespace, {"a": 150, "b": 90})
    config = make_config(redis_url, namespace, {"a": 2, "b": 1}, batch=7, eta=0)
    state = PipelineState(redis, keys)
    popped: list[str] = []

    async def consume_and_step():  # a stand-in trainer: take jobs, forget them, advance v
        while True:
            ids = [raw_id.decode() for raw_id, _score in await redis.zpopmin(keys.queue, 7)]
            popped.extend(keys.group_id_of(i) for i in ids)
            for arq_id in ids:
                await redis.delete(job_key_prefix + arq_id)
            await state.set_version(len(popped) // 7)
            await asyncio.sleep(0.005)

    consumer = asyncio.create_task(consume_and_step())
    rng = random.Random(3)
    options = ProducerOptions(wait_for_trainer=False, poll_s=0.005, batch=5)
    for _restart in range(60):
        run = asyncio.create_task(run_producer(config, tmp_path / "tasks.jsonl", redis=redis, options=options))
        await asyncio.sleep(rng.uniform(0.0, 0.03))
        if run.done():
            break
        run.cancel()  # a crash at an arbitrary await point
        await asyncio.gather(run, return_exceptions=True)
    else:
        await asyncio.wait_for(run_producer(config, tmp_path / "tasks.jsonl", redis=redis, options=options), 20)
    async def drained() -> bool:  # the consumer holds every admitted job
        enqueued = (await state.counters()).get(Counter.ENQUEUED, 0)
        return await redis.zcard(keys.queue) == 0 and len(popped) == enqueued

    await wait_for(drained)
    consumer.cancel()
    await asyncio.gather(consumer, return_exceptions=True)
    assert Tally(popped) == Tally(f"{t.id}:0" for t in tasks)
    assert (await state.counters())[Counter.ENQUEUED] == len(tasks)


async def test_mixing_follows_weights(tmp_path, redis_url, redis, keys, namespace):
    write_tasks(tmp_path / "tasks.jsonl", namespace, {"a": 2000, "b": 1000, "c": 1000})
    config = make_config(redis_url, namespace, {"a": 3, "b": 2, "c": 1}, batch=3000, eta=0)
    stop = asyncio.Event()
    run = asyncio.create_task(run_producer(config, tmp_path / "tasks.jsonl", redis=redis, stop_event=stop,
                                           options=ProducerOptions(wait_for_trainer=False, poll_s=0.02, batch=256)))
    await wait_for(lambda: _eq(lambda: redis.zcard(keys.queue), 3000))
    stop.set()
    await asyncio.wait_for(run, 30)
    per_env = Tally(i.split("-")[1] for i in await queued_jobs(redis, keys))
    for env, share in {"a": 0.5, "b": 1 / 3, "c": 1 / 6}.items():
        assert abs(per_env[env] / 3000 - share) < 0.01, per_env


def handed_back(task: Task, epoch: int = 0, attempt: int = 0, reason: RequeueReason = RequeueReason.STALE) -> bytes:
    return encode(Requeue(task=task, epoch=epoch, attempt=attempt, reason=reason))


async def test_requeued_tasks_go_first_with_fresh_ids_then_dead_letter(tmp_path, redis_url, redis, keys, namespace):
    write_tasks(tmp_path / "tasks.jsonl", namespace, {"a": 5})
    config = make_config(redis_url, namespace, {"a": 1}, batch=100, eta=0)
    back = Task(id=f"{namespace}-a-3", env="a", prompt="a question 3")
    await redis.rpush(keys.requeue, handed_back(back), b"\x01not msgpack")
    options = ProducerOptions(wait_for_trainer=False, max_requeues=2)
    stats = await run_producer(config, tmp_path / "tasks.jsonl", redis=redis, options=options)
    assert stats.requeued == 1 and stats.dead == 1 and stats.admitted == 5
    assert f"{back.id}:0r1" in await queued_jobs(redis, keys)
    for attempt in (1, 2):  # r1's group fails too -> r2; r2's -> past --max-requeues
        await redis.rpush(keys.requeue, handed_back(back, attempt=attempt, reason=RequeueReason.FAILED))
        await run_producer(config, tmp_path / "tasks.jsonl", redis=redis, options=options)
    ids = await queued_jobs(redis, keys)
    assert f"{back.id}:0r2" in ids and f"{back.id}:0r3" not in ids
    assert await redis.llen(keys.requeue) == 0
    dead = await redis.xrange(keys.dead)
    reasons = [fields[b"reason"].decode() for _id, fields in dead]
    assert any("undecodable requeue entry" in r for r in reasons)
    assert any("epoch 0 was handed back 3 times, last failed (max_requeues 2)" in r for r in reasons)


def _epoch_of(group_id: str) -> int:
    return int(group_id.rsplit(":", 1)[1].split("r")[0])


async def test_requeue_returns_to_its_own_epoch_with_its_own_budget(tmp_path, redis_url, redis, keys, namespace):
    """--follow: an epoch-0 group rejected while the producer admits epoch 2 is re-admitted as
    epoch 0's next attempt (`t:0r1`), never as another epoch's group; the attempt limit counts
    per (task, epoch); a group handed back twice (a replayed discard) is re-admitted once."""
    tasks = write_tasks(tmp_path / "tasks.jsonl", namespace, {"a": 4})
    config = make_config(redis_url, namespace, {"a": 1}, batch=4, eta=0)
    state = PipelineState(redis, keys)
    stop = asyncio.Event()
    run = asyncio.create_task(run_producer(config, tmp_path / "tasks.jsonl", follow=True, redis=redis, stop_event=stop,
                                           options=ProducerOptions(wait_for_trainer=False, poll_s=0.01, max_requeues=2)))

    async def enqueued() -> int:
        return (await state.counters()).get(Counter.ENQUEUED, 0)

    await wait_for(lambda: _eq(enqueued, 4))  # epoch 0, then the bound
    await state.set_version(1)
    await wait_for(lambda: _eq(enqueued, 8))  # epoch 1; the producer now waits in epoch 2
    task = tasks[0]

    async def hand_back(epoch: int, attempt: int, reason: RequeueReason = RequeueReason.STALE) -> None:
        pipe = redis.pipeline(transaction=True)  # as the slime side's discard does
        pipe.rpush(keys.requeue, handed_back(task, epoch, attempt, reason))
        pipe.hincrby(keys.counters, Counter.DISCARDED, 1)
        await pipe.execute()

    async def drained() -> bool:
        return await redis.llen(keys.requeue) == 0

    for epoch, attempt in ((0, 0), (0, 0), (1, 0), (0, 1), (0, 2)):
        await hand_back(epoch, attempt)
        await wait_for(drained)
    stop.set()
    stats = await asyncio.wait_for(run, 30)
    mine = sorted(i for i in await queued_jobs(redis, keys) if i.rsplit(":", 1)[0] == task.id and _epoch_of(i) < 2)
    assert mine == sorted(f"{task.id}:{suffix}" for suffix in ("0", "0r1", "0r2", "1", "1r1"))
    assert stats.requeued == 3 and stats.refused == 1 and stats.dead == 1
    reasons = [fields[b"reason"].decode() for _id, fields in await redis.xrange(keys.dead)]
    assert reasons == [f"task {task.id!r} epoch 0 was handed back 3 times, last stale (max_requeues 2)"]


async def test_trainer_settings_are_checked(tmp_path, redis_url, redis, keys, namespace):
    write_tasks(tmp_path / "tasks.jsonl", namespace, {"a": 30})
    config = make_config(redis_url, namespace, {"a": 1}, batch=4, eta=0, n=2)
    state = PipelineState(redis, keys)
    await state.set_trainer_info(TrainerInfo(rollout_batch_size=4, n_samples_per_prompt=8, eta=0))
    with pytest.raises(ConfigError, match="n_samples_per_prompt is 2 but the trainer runs n_samples_per_prompt=8"):
        await run_producer(config, tmp_path / "tasks.jsonl", redis=redis, options=NO_TRAINER)
    await state.set_trainer_info(TrainerInfo(rollout_batch_size=5, n_samples_per_prompt=2, eta=1))
    stop = asyncio.Event()
    run = asyncio.create_task(run_producer(config, tmp_path / "tasks.jsonl", redis=redis, stop_event=stop,
                                           options=ProducerOptions(wait_for_trainer=False, poll_s=0.02)))
    await wait_for(lambda: _eq(lambda: redis.zcard(keys.queue), 10))  # trainer's B=5, eta=1
    stop.set()
    stats = await run
    assert any("rollout_batch_size is 4 but the trainer runs 5" in w for w in stats.warnings)


async def test_admits_nothing_before_the_trainer_publishes_its_settings(tmp_path, redis_url, redis, keys, namespace, caplog):
    """Issue 10: a producer started before the trainer admitted (eta+1)*B on its own settings at
    once. It now waits for `{ns}:trainer`, saying so, and then admits on the trainer's B and eta."""
    write_tasks(tmp_path / "tasks.jsonl", namespace, {"a": 30})
    config = make_config(redis_url, namespace, {"a": 1}, batch=8, eta=2, n=2)
    stop = asyncio.Event()
    caplog.set_level("INFO", logger="rollout.enqueue")
    run = asyncio.create_task(run_producer(config, tmp_path / "tasks.jsonl", redis=redis, stop_event=stop,
                                           options=ProducerOptions(poll_s=0.02, wait_log_s=0.2)))
    await asyncio.sleep(0.7)
    assert await redis.zcard(keys.queue) == 0
    assert sum("waiting for the trainer to publish" in r.getMessage() for r in caplog.records) >= 2
    await PipelineState(redis, keys).set_trainer_info(TrainerInfo(rollout_batch_size=3, n_samples_per_prompt=2, eta=1))
    await wait_for(lambda: _eq(lambda: redis.zcard(keys.queue), 6))  # the trainer's (1 + 0 + 1) * 3
    await asyncio.sleep(0.2)
    assert await redis.zcard(keys.queue) == 6
    stop.set()
    await run


async def test_changed_tasks_file_refuses_to_resume(tmp_path, redis_url, redis, keys, namespace):
    write_tasks(tmp_path / "tasks.jsonl", namespace, {"a": 10})
    config = make_config(redis_url, namespace, {"a": 1}, batch=100, eta=0)
    await run_producer(config, tmp_path / "tasks.jsonl", redis=redis, options=NO_TRAINER)
    write_tasks(tmp_path / "tasks.jsonl", namespace, {"a": 11})
    with pytest.raises(ConfigError, match="--reset-cursor"):
        await run_producer(config, tmp_path / "tasks.jsonl", redis=redis, options=NO_TRAINER)
    options = ProducerOptions(wait_for_trainer=False, reset_cursor=True)
    stats = await run_producer(config, tmp_path / "tasks.jsonl", redis=redis, options=options)
    assert stats.admitted == 1  # the ten old ids are still queued: arq's id check refuses them
    assert stats.refused == 10


def test_bad_task_lines_are_reported_with_file_and_line(tmp_path):
    path = tmp_path / "tasks.jsonl"
    good = encode_task_json(Task(id="t1", env="a", prompt="p"))
    path.write_bytes(good + b"\n{not json\n" + encode_task_json(Task(id="t2", env="zz", prompt="p")) + b"\n")
    with pytest.raises(ConfigError) as err:
        TaskIndex.build(path, {"a": 1.0})
    assert f"{path}:2:" in str(err.value) and f"{path}:3: task 't2' is for environment 'zz'" in str(err.value)


def test_cli_plain_run_exits_when_all_admitted(tmp_path, redis_url, namespace):
    write_tasks(tmp_path / "tasks.jsonl", namespace, {"a": 12})
    cfg = tmp_path / "pipeline.yaml"
    cfg.write_bytes(msgspec.json.encode({
        "redis": {"url": redis_url, "namespace": namespace},
        "rollout": {"rollout_batch_size": 100, "eta": 0, "n_samples_per_prompt": 2},
        "environments": {"a": {"kind": "math"}},
    }))  # JSON is YAML
    assert main(["--tasks", str(tmp_path / "tasks.jsonl"), "--config", str(cfg), "--epochs", "2", "--without-trainer"]) == 0


# ---------------------------------------------------------------- the bound, end to end

class DownOnFirstAttempt(Environment):
    """A plugin environment (run by the real worker) whose server refuses every session of every
    5th task until its first attempt is spent: the real failure path (the group fails, out of
    tries it is dead-lettered and the task handed back as attempt 1, in place) runs in the test."""

    starts: dict[str, int] = {}
    refused_per_task = 2  # the n = 2 episodes of its one try (workers.max_tries 1)

    async def start(self, task: Task) -> EnvSession:
        seen = self.starts[task.id] = self.starts.get(task.id, 0) + 1
        if int(task.id.rsplit("-", 1)[1]) % 5 == 0 and seen <= self.refused_per_task:
            raise EnvError("POST /seed_session: connection refused (injected outage)")
        return OneTurnSession(task)


async def test_bound_holds_at_every_instant_with_real_worker_and_trainer(tmp_path, redis_url, redis, keys, namespace):
    """Producer restarts in a loop, the real arq worker (`build_worker`, the simulated engine over
    HTTP, a plugin environment that is down for every 5th task's first attempt) runs the jobs, the
    real slime-side data source trains B groups per step and advances v; a sampler reads (v,
    enqueued, discarded) atomically in a loop: admitted beyond the bound must stay 0."""
    batch, eta, n_tasks = 6, 1, 72
    tasks = write_tasks(tmp_path / "tasks.jsonl", namespace, {"a": 48, "b": 24})
    DownOnFirstAttempt.starts.clear()
    env = {"kind": f"{__name__}.DownOnFirstAttempt", "on_failure": "retry_all_failed",
           "timeouts": {"start": {"retries": 0}}}
    async with serve_sim_engine() as sim:
        config = parse_config({
            "redis": {"url": redis_url, "namespace": namespace},
            "engine": {"url": sim.url, "max_retries": 1, "retry_backoff_s": 0.01},
            "rollout": {"rollout_batch_size": batch, "eta": eta, "n_samples_per_prompt": 2,
                        "sampling": {"temperature": 0.7, "max_new_tokens": 64}},
            "environments": {"a": {**env, "weight": 2}, "b": {**env, "weight": 1}},
            "workers": {"max_tries": 1, "poll_delay_s": 0.005, "heartbeat_s": 0.5, "dead_after_s": 2.0},
        })
        async with running_worker(config, concurrency=16):
            await _train_under_restarting_producer(tmp_path, redis, keys, config, tasks, batch=batch, eta=eta,
                                                   n_tasks=n_tasks)


@contextlib.asynccontextmanager
async def running_worker(config, *, concurrency):
    worker = build_worker(config, concurrency=concurrency, handle_signals=False)
    task = asyncio.create_task(worker.async_run())
    try:
        yield worker
    finally:
        await stop_worker(worker, task)


async def _train_under_restarting_producer(tmp_path, redis, keys, config, tasks, *, batch, eta, n_tasks):
    args = SimpleNamespace(pipeline_redis_url=config.redis.url, pipeline_namespace=keys.ns, rollout_batch_size=batch,
                           n_samples_per_prompt=2, pipeline_eta=eta, pipeline_wait_timeout_s=60.0)
    trained: list[str] = []

    def train() -> None:
        source = RedisDataSource(args)
        try:
            for rid in range(n_tasks // batch):
                out = generate_rollout(args, rid, source)
                trained.extend(g[0].metadata["pipeline"]["group_id"] for g in out.samples)
                source.save(rid)
        finally:
            source.close()

    trainer = asyncio.create_task(asyncio.to_thread(train))

    async def produce() -> None:  # a producer that keeps exiting and being restarted
        while not trainer.done():
            await run_producer(config, tmp_path / "tasks.jsonl", redis=redis,
                               options=ProducerOptions(wait_for_trainer=False, poll_s=0.005, batch=4))
            await asyncio.sleep(0.01)

    producer = asyncio.create_task(produce())
    excess = []
    while not trainer.done():
        pipe = redis.pipeline(transaction=True)  # one atomic snapshot
        pipe.get(keys.version)
        pipe.hmget(keys.counters, Counter.ENQUEUED, Counter.DISCARDED)
        raw_v, (enq, disc) = await pipe.execute()
        excess.append(int(enq or 0) - int(disc or 0) - (eta + int(raw_v or 0) + 1) * batch)
        await asyncio.sleep(0)
    await trainer
    await producer
    counters = await PipelineState(redis, keys).counters()
    assert len(excess) > 100 and max(excess) == 0  # never beyond the bound, and it did run at it
    assert sorted(gid.rsplit(":", 1)[0] for gid in trained) == sorted(t.id for t in tasks)  # each task trained once
    down = [t.id for t in tasks if int(t.id.rsplit("-", 1)[1]) % 5 == 0]
    assert all(DownOnFirstAttempt.starts[t] == DownOnFirstAttempt.refused_per_task + 2 for t in down)
    assert sorted(gid for gid in trained if gid.endswith("r1")) == sorted(f"{t}:0r1" for t in down)
    assert counters[Counter.ACCEPTED] == n_tasks


async def test_a_plain_run_stays_while_an_arrival_order_trainer_may_hand_groups_back(
        tmp_path, redis_url, redis, keys, namespace):
    """In arrival order the trainer hands stale groups back to `{ns}:requeue` for the producer to
    re-admit: a plain run (no --follow) that exited once its epoch was admitted left them there
    and the trainer waited for a group nobody would re-admit (issue 17). It now stays while a
    group it admitted is open; with a due-first trainer (nothing handed back) it exits at once."""
    tasks = write_tasks(tmp_path / "tasks.jsonl", namespace, {"a": 3})
    config = make_config(redis_url, namespace, {"a": 1}, batch=100, eta=0)
    state = PipelineState(redis, keys)
    options = ProducerOptions(wait_for_trainer=False, poll_s=0.01)
    await state.set_trainer_info(TrainerInfo(rollout_batch_size=100, n_samples_per_prompt=2, eta=0, hands_back=1))
    run = asyncio.create_task(run_producer(config, tmp_path / "tasks.jsonl", redis=redis, options=options))
    await wait_for(lambda: _eq(lambda: redis.zcard(keys.queue), 3))
    await asyncio.sleep(0.2)
    assert not run.done()  # admitted all, stays: three groups open
    first, second, third = (f"{t.id}:0" for t in tasks)
    pipe = redis.pipeline(transaction=True)  # the trainer trains two and hands the third back (stale)
    pipe.zrem(keys.open, first, second, third)
    pipe.rpush(keys.requeue, handed_back(tasks[2]))
    pipe.hincrby(keys.counters, Counter.DISCARDED, 1)
    await pipe.execute()
    await wait_for(lambda: _eq(lambda: redis.zscore(keys.open, f"{tasks[2].id}:0r1"), 0.0))  # re-admitted
    assert not run.done()
    await redis.zrem(keys.open, f"{tasks[2].id}:0r1")  # trained
    stats = await asyncio.wait_for(run, 10)
    assert stats.admitted == 3 and stats.requeued == 1

    # a due-first trainer hands nothing back: the plain run exits once its epoch is admitted
    other = Keys(f"{namespace}x")
    await PipelineState(redis, other).set_trainer_info(TrainerInfo(rollout_batch_size=100, n_samples_per_prompt=2, eta=0))
    again = make_config(redis_url, other.ns, {"a": 1}, batch=100, eta=0)
    stats = await asyncio.wait_for(run_producer(again, tmp_path / "tasks.jsonl", redis=redis, options=options), 10)
    assert stats.admitted == 3 and await redis.zcard(other.open) == 3


async def test_a_hand_back_between_the_producers_two_reads_is_not_lost(
        tmp_path, redis_url, redis, keys, namespace, monkeypatch):
    """The trainer hands a group back in one transaction (ZREM `{ns}:open`, RPUSH `{ns}:requeue`).
    A plain run read the requeue (empty), then `open` (empty by then) and exited, leaving the task
    in the requeue for nobody: the trainer then waits for a group never re-admitted (seen once in
    CI). The hand-back is made to land exactly between those two reads: the producer stays and
    re-admits it."""
    tasks = write_tasks(tmp_path / "tasks.jsonl", namespace, {"a": 2})
    config = make_config(redis_url, namespace, {"a": 1}, batch=100, eta=0)
    await PipelineState(redis, keys).set_trainer_info(
        TrainerInfo(rollout_batch_size=100, n_samples_per_prompt=2, eta=0, hands_back=1))
    look = Producer._handed_back_work_may_come
    handed = False

    async def trainer_hands_back_first(self):
        nonlocal handed
        if not handed:  # the producer found the requeue empty and is about to look at `open`
            handed = True
            pipe = redis.pipeline(transaction=True)
            pipe.zrem(keys.open, *(f"{t.id}:0" for t in tasks))
            pipe.rpush(keys.requeue, handed_back(tasks[1]))
            pipe.hincrby(keys.counters, Counter.DISCARDED, 1)
            await pipe.execute()
        return await look(self)

    monkeypatch.setattr(Producer, "_handed_back_work_may_come", trainer_hands_back_first)
    options = ProducerOptions(wait_for_trainer=False, poll_s=0.01)
    run = asyncio.create_task(run_producer(config, tmp_path / "tasks.jsonl", redis=redis, options=options))
    await wait_for(lambda: _eq(lambda: redis.zscore(keys.open, f"{tasks[1].id}:0r1"), 0.0), timeout=20)
    await redis.zrem(keys.open, f"{tasks[1].id}:0r1")  # trained
    stats = await asyncio.wait_for(run, 10)
    assert handed and stats.admitted == 2 and stats.requeued == 1


def test_the_data_source_says_whether_it_hands_groups_back(redis_url, namespace):
    import redis as redis_sync

    from pipeline.slime.data_source import RedisDataSource

    def published(order: str, policy: str) -> int:
        ns = f"{namespace}{order[0]}{policy[0]}"
        ds = RedisDataSource(SimpleNamespace(pipeline_redis_url=redis_url, pipeline_namespace=ns, rollout_batch_size=2,
                                             n_samples_per_prompt=2, pipeline_eta=1, pipeline_consume_order=order,
                                             pipeline_stale_policy=policy))
        ds.close()
        client = redis_sync.Redis.from_url(redis_url)
        try:
            return int(client.hget(Keys(ns).trainer, "hands_back"))
        finally:
            client.close()

    assert published("arrival", "requeue") == 1
    assert published("arrival", "drop") == 0
    assert published("due-first", "requeue") == 0
