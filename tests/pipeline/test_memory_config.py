"""Redis memory bounded by configuration (issue 26 item 3), on a real redis-server: arq results
keep only what refuses a duplicate job id, `{ns}:requeue:attempts` is trimmed where its task
ends, and the TTLs are settings."""

from __future__ import annotations

import os
import subprocess
import sys
from types import SimpleNamespace

from arq.connections import ArqRedis
from arq.constants import result_key_prefix
from arq.jobs import Job, serialize_result

from pipeline.config import parse_config
from pipeline.keys import attempts_field
from pipeline.schema import PromptJob, Task
from pipeline.store.jobqueue import JOB_FUNCTION, job_deserializer, job_envelope
from pipeline.synthetic import make_group
from producers.admission import Admission
from workers.settings import build_worker
from workers.sim.tokenizer import default_tokenizer_path

LONG_PROMPT = "x" * 20_000


async def test_a_kept_arq_result_is_small_and_still_refuses_the_job_id(redis, redis_url, keys, namespace):
    """The result the worker stores (its serializer, as arq's finish_job calls it) is ~100 B, not
    the whole job with its prompt; arq's enqueue_job still refuses the id while it exists, and
    arq still reads it back."""
    config = parse_config({"redis": {"url": redis_url, "namespace": namespace},
                           "engine": {"url": "http://127.0.0.1:9", "tokenizer": default_tokenizer_path()}})
    worker = build_worker(config, handle_signals=False)
    job = PromptJob(task=Task(id="t", env="synthetic", prompt=LONG_PROMPT, label="1"), epoch=0, n_samples=4)
    arq_id = keys.arq_job_id(job.job_id)
    envelope = job_envelope(job, enqueue_time_ms=1)
    assert len(envelope) > len(LONG_PROMPT)
    args = (job_deserializer(envelope)["a"][0],)
    stored = serialize_result(JOB_FUNCTION, args, {}, 1, 1, True, None, 1, 2, "ref", keys.queue,
                              job_id=arq_id, serializer=worker.job_serializer)
    assert stored is not None and len(stored) < 300, len(stored or b"")  # was the whole job (> 20 kB)
    await redis.set(result_key_prefix + arq_id, stored, px=60_000)
    pool = ArqRedis(connection_pool=redis.connection_pool, default_queue_name=keys.queue,
                    job_serializer=worker.job_serializer, job_deserializer=job_deserializer)
    assert await pool.enqueue_job(JOB_FUNCTION, b"again", _job_id=arq_id) is None  # refused: the id is taken
    info = await Job(arq_id, redis, _deserializer=job_deserializer).result_info()
    assert info is not None and info.success and info.job_id == arq_id


async def test_the_attempts_field_goes_when_its_task_is_trained(redis_url, redis, keys):
    from pipeline.slime.data_source import RedisDataSource

    group = make_group("task-a:0r2", n=2, response_len=8)
    await redis.hset(keys.requeue_attempts, mapping={attempts_field(group.group_id): 2, "task-b:0": 1})
    from pipeline.store.buffer import GroupBuffer

    buffer = GroupBuffer(redis, keys)
    await buffer.ensure_group()
    await buffer.push(group)
    source = RedisDataSource(SimpleNamespace(pipeline_redis_url=redis_url, pipeline_namespace=keys.ns,
                                             rollout_batch_size=1, n_samples_per_prompt=2, pipeline_eta=10))
    try:
        assert len(source.get_samples(1)) == 1
    finally:
        source.close()
    assert await redis.hgetall(keys.requeue_attempts) == {b"task-b:0": b"1"}  # task-a is done; task-b is not


async def test_the_attempts_field_goes_when_the_producer_dead_letters_the_task(redis, keys):
    admission = Admission(redis, keys)
    await redis.rpush(keys.requeue, b"head")
    await redis.hset(keys.requeue_attempts, mapping={"task-a:0": 3, "task-b:0": 1})
    assert await admission.drop_requeued(b"head", forget_attempts="task-a:0")
    assert await redis.hgetall(keys.requeue_attempts) == {b"task-b:0": b"1"}


def test_attempts_field_is_the_group_id_without_its_attempt():
    assert [attempts_field(g) for g in ("a:0", "a:0r3", "ns:task:7r12")] == ["a:0", "a:0", "ns:task:7"]


def test_the_ttls_are_settings():
    env = {**os.environ, "ROLLOUT_DEDUP_TTL_S": "120", "ROLLOUT_KEEP_RESULT_S": "30", "ROLLOUT_RECENT_KEEP": "50"}
    code = ("from pipeline.store.buffer import DEDUP_TTL_S, RECENT_KEEP; from workers.settings import KEEP_RESULT_S; "
            "print(DEDUP_TTL_S, KEEP_RESULT_S, RECENT_KEEP)")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.split() == ["120", "30", "50"]
