"""Issue 33 item 2: the per-task and per-job fields the key table promises to delete are deleted
on every path that ends a task or a job (a real redis-server; the real data source and jobs)."""

import asyncio

import msgspec
import pytest

from pipeline.keys import Keys
from pipeline.slime.data_source import RedisDataSource, generate_rollout
from pipeline.store.redis_conn import connect
from pipeline.synthetic import make_group
from tests.support.source_helpers import push_groups, source_args


def _hash(redis_url, key):
    async def go():
        client = connect(redis_url)
        try:
            return {k.decode(): v.decode() for k, v in (await client.hgetall(key)).items()}
        finally:
            await client.aclose()
    return asyncio.run(go())


def _hset(redis_url, key, mapping):
    async def go():
        client = connect(redis_url)
        try:
            await client.hset(key, mapping=mapping)
        finally:
            await client.aclose()
    asyncio.run(go())


@pytest.mark.parametrize("ending", ["filtered", "stale_drop", "due_first_dead_letter"])
def test_a_handed_back_task_dropped_untrained_forgets_its_attempts_field(redis_url, namespace, ending):
    """`{ns}:requeue:attempts` held the field of a handed-back task (attempt 1) whose later attempt
    the trainer dropped (zero-variance filter, stale drop, due-first's stale dead letter): it stayed
    forever. A trained group's field goes (the step's record), and so does this one now."""
    keys = Keys(namespace)
    fresh = [make_group(f"f{i}:0", n=4, admission_version=5) for i in range(2)]
    if ending == "filtered":
        dropped = make_group("gone:0r1", n=4, rewards=[1.0] * 4, admission_version=5)
        extra = {"pipeline_filter_zero_variance": True}
    else:
        dropped = make_group("gone:0r1", n=4, admission_version=1)  # 4 versions old at version 5, eta 2
        extra = {"pipeline_stale_policy": "drop", "pipeline_consume_order": "arrival"} if ending == "stale_drop" \
            else {"pipeline_stale_policy": "requeue"}  # due-first dead-letters it
    dropped = msgspec.structs.replace(dropped, attempt=1)
    _hset(redis_url, keys.requeue_attempts, {"gone:0": 1, "kept:0": 2})  # kept: another task, still running
    push_groups(redis_url, namespace, [dropped, *fresh])
    ds = RedisDataSource(source_args(redis_url, namespace, eta=2, **extra))
    try:
        out = generate_rollout(ds.args, 5, ds)
    finally:
        ds.close()
    assert [g[0].metadata["pipeline"]["group_id"] for g in out.samples] == ["f0:0", "f1:0"]
    assert _hash(redis_url, keys.requeue_attempts) == {"kept:0": "2"}


# ------------------------------------------------------------------ {ns}:job_errors


async def _with_context(redis_url, namespace, body):
    from pipeline.config import parse_config
    from tests.workers.test_worker_jobs import config_dict
    from workers.settings import _build_context
    from workers.sim.engine import serve_sim_engine

    async with serve_sim_engine() as sim:
        context = await _build_context(parse_config(config_dict(redis_url, namespace, sim.url)), Keys(namespace), "w1")
        try:
            return await body(context)
        finally:
            await context.aclose()


REAPED = "worker w0 stopped heart-beating"


async def test_a_rerun_that_finds_the_dedup_marker_forgets_the_reapers_note(redis, redis_url, keys, namespace):
    """The reaper notes why it released a job (`{ns}:job_errors`); a re-run that finds the group
    stored already (its dedup marker) ends the job without running it, and left the note forever."""
    from pipeline.schema import encode
    from tests.workers.test_worker_jobs import job
    from workers.jobs import CTX_KEY, run_group

    prompt_job = job(namespace, 1)
    arq_id = keys.arq_job_id(prompt_job.job_id)
    await redis.hset(keys.job_errors, mapping={arq_id: REAPED, "other": "kept"})
    await redis.set(keys.dedup(prompt_job.job_id), b"stored")

    async def rerun(context):
        return await run_group({CTX_KEY: context, "job_id": arq_id, "job_try": 2}, encode(prompt_job))

    assert (await _with_context(redis_url, namespace, rerun))["status"] == "duplicate"
    assert await redis.hgetall(keys.job_errors) == {b"other": b"kept"}


@pytest.mark.parametrize("payload_ok", [True, False], ids=["pushed", "failed"])
async def test_an_eval_job_forgets_the_reapers_note_when_it_ends(redis, redis_url, keys, namespace, payload_ok):
    """Eval jobs never deleted their `{ns}:job_errors` entry (the reaper's, when one was re-run)."""
    from pipeline.schema import encode
    from tests.support.policy_helpers import trainer_started
    from tests.workers.test_worker_jobs import job
    from workers.eval_jobs import run_eval_group
    from workers.jobs import CTX_KEY

    await trainer_started(redis, keys)
    prompt_job = job(namespace, 2)
    arq_id = keys.arq_job_id(prompt_job.job_id)
    await redis.hset(keys.job_errors, mapping={arq_id: REAPED, "other": "kept"})

    async def rerun(context):
        ctx = {CTX_KEY: context, "job_id": arq_id, "job_try": 2}
        return await run_eval_group(ctx, "r1", encode(prompt_job) if payload_ok else b"not a job")

    outcome = await _with_context(redis_url, namespace, rerun)
    assert outcome["status"] == ("pushed" if payload_ok else "failed"), outcome
    assert await redis.hgetall(keys.job_errors) == {b"other": b"kept"}
