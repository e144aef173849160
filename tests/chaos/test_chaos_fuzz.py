"""Chaos fuzz (hypothesis): garbage in the group stream, in arq job payloads and in
tasks.jsonl lines gives clear errors or dead letters, never a crashed reader.

Fast enough for the default run; also selected by `-m chaos`.
"""

from __future__ import annotations

import asyncio
import json
import time
from types import SimpleNamespace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.config import ConfigError
from pipeline.keys import Counter, Keys
from pipeline.schema import SchemaError, decode_group, decode_job, encode
from pipeline.slime.data_source import RedisDataSource
from pipeline.store.buffer import GroupBuffer
from pipeline.store.redis_conn import connect
from pipeline.synthetic import make_group

pytestmark = pytest.mark.chaos

FUZZ = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
VALID = encode(make_group("valid:0", n=2, prompt_len=4, response_len=4))


def _mutations() -> st.SearchStrategy[bytes]:
    """Random bytes, and valid payloads truncated or with bytes flipped (the nastier case)."""
    flipped = st.tuples(st.integers(0, len(VALID) - 1), st.integers(1, 255)).map(
        lambda p: VALID[: p[0]] + bytes([VALID[p[0]] ^ p[1]]) + VALID[p[0] + 1:]
    )
    truncated = st.integers(0, len(VALID) - 1).map(lambda i: VALID[:i])
    return st.one_of(st.binary(max_size=300), flipped, truncated)


@FUZZ
@given(payload=_mutations())
def test_codec_rejects_garbage_with_schema_error_only(payload: bytes):
    for decode in (decode_group, decode_job):
        try:
            decode(payload)
        except SchemaError as exc:
            assert str(exc)  # says what is wrong
        # any other exception type fails the test: readers only catch SchemaError


@FUZZ
@given(garbage=st.lists(_mutations(), min_size=1, max_size=6))
def test_garbage_in_stream_is_dead_lettered_and_reading_goes_on(redis_url, garbage: list[bytes]):
    async def go() -> None:
        keys = Keys(f"fz{abs(hash(tuple(garbage))) % 10**10}")
        client = connect(redis_url)
        buffer = GroupBuffer(client, keys)
        await buffer.ensure_group()
        await client.delete(keys.groups, keys.dead, keys.counters)
        await buffer.ensure_group()
        good = [make_group(f"ok{i}:0", n=2, prompt_len=4, response_len=4, seed=i) for i in range(2)]
        await buffer.push(good[0])
        for payload in garbage:
            await client.xadd(keys.groups, {"g": payload, "id": "garbage"})
        await client.xadd(keys.groups, {"junk": b"no g field"})
        await buffer.push(good[1])
        read = []
        for _ in range(10):
            read += await buffer.read("fuzz", 3)
            await buffer.ack([e.stream_id for e in read])
        undecodable = sum(1 for p in garbage if not _decodes(p)) + 1
        assert sorted(e.group.group_id for e in read if e.group.group_id.startswith("ok")) == ["ok0:0", "ok1:0"]
        assert await client.xlen(keys.dead) == undecodable
        reasons = [fields[b"reason"].decode() for _id, fields in await client.xrange(keys.dead)]
        assert all("SampleGroup" in r for r in reasons), reasons
        assert int(await client.hget(keys.counters, Counter.DEAD) or 0) == undecodable
        await client.delete(keys.groups, keys.dead, keys.counters, *(keys.dedup(g.group_id) for g in good))
        await client.aclose()

    asyncio.run(go())


def _decodes(payload: bytes) -> bool:
    try:
        decode_group(payload)
    except SchemaError:
        return False
    return True


def test_trainer_side_skips_garbage_between_groups(redis_url, keys):
    """RedisDataSource: poison entries between good groups never reach (or crash) the training step."""

    async def fill() -> None:
        client = connect(redis_url)
        buffer = GroupBuffer(client, keys)
        await buffer.ensure_group()
        for i in range(4):
            await buffer.push(make_group(f"g{i}:0", n=2, seed=i))
            await client.xadd(keys.groups, {"g": VALID[: 10 + i]})
        await client.aclose()

    asyncio.run(fill())
    source = RedisDataSource(SimpleNamespace(pipeline_redis_url=redis_url, pipeline_namespace=keys.ns,
                                             rollout_batch_size=4, n_samples_per_prompt=2, pipeline_eta=10))
    try:
        batch = source.get_samples(4)
        assert [g[0].metadata["pipeline"]["group_id"] for g in batch] == [f"g{i}:0" for i in range(4)]
    finally:
        source.close()


# ----------------------------------------------------------------- arq job payloads

async def test_garbage_job_payloads_are_dead_lettered_by_a_real_worker(redis, redis_url, keys, namespace):
    """A real arq worker (our serializer) gets garbage PromptJob bytes and garbage arq envelopes."""
    from hypothesis import find

    from pipeline.config import parse_config
    from pipeline.store.jobqueue import JOB_FUNCTION, create_arq_pool
    from workers.settings import build_worker, stop_worker
    from workers.sim.tokenizer import default_tokenizer_path

    payloads = find(st.lists(_mutations(), min_size=8, max_size=8, unique=True), lambda xs: len(xs) == 8)
    config = parse_config({
        "redis": {"url": redis_url, "namespace": namespace},
        "engine": {"url": "http://127.0.0.1:9", "tokenizer": default_tokenizer_path()},  # never called
        "workers": {"heartbeat_s": 0.5, "dead_after_s": 2.0, "poll_delay_s": 0.02, "max_tries": 1},
    })
    arq = await create_arq_pool(redis_url, keys)
    for i, payload in enumerate(payloads):
        await arq.enqueue_job(JOB_FUNCTION, payload, _job_id=f"poison{i}", _queue_name=keys.queue)
    # an envelope arq itself cannot decode: written raw, as a broken producer would
    await redis.set("arq:job:rawgarbage", b"\xc1\xff not msgpack")
    await redis.zadd(keys.queue, {"rawgarbage": int(time.time() * 1000)})  # arq skips a score of 0
    worker = build_worker(config, handle_signals=False)
    task = asyncio.create_task(worker.async_run())
    try:
        for _ in range(200):
            if await redis.xlen(keys.dead) >= len(payloads) and await redis.zcard(keys.queue) == 0:
                break
            await asyncio.sleep(0.05)
        assert not task.done(), "the worker crashed on garbage"
    finally:
        await stop_worker(worker, task)
        await arq.aclose()
    dead = await redis.xrange(keys.dead)
    refs = sorted(fields[b"ref"].decode() for _id, fields in dead)
    assert refs == sorted(f"poison{i}" for i in range(len(payloads)))
    assert all(b"PromptJob" in fields[b"reason"] for _id, fields in dead)
    assert await redis.zcard(keys.queue) == 0  # the raw garbage envelope was failed by arq, not retried forever


# ----------------------------------------------------------------- tasks.jsonl

GOOD_LINE = json.dumps({"id": "t1", "env": "math", "prompt": "1+1?", "label": "2"})


@FUZZ
@given(line=st.one_of(
    st.text(max_size=80).filter(lambda s: "\n" not in s and "\r" not in s),
    st.binary(max_size=80).filter(lambda b: b"\n" not in b and b"\r" not in b),
    st.dictionaries(st.sampled_from(["id", "env", "prompt", "label", "metadata", "extra"]),
                    st.one_of(st.none(), st.integers(), st.text(max_size=5), st.lists(st.integers(), max_size=2)))
    .map(json.dumps),
))
def test_malformed_task_lines_name_file_and_line(tmp_path_factory, line):
    from producers.task_index import TaskIndex

    path = tmp_path_factory.mktemp("tasks") / "tasks.jsonl"
    raw = line if isinstance(line, bytes) else line.encode("utf-8", "surrogatepass")
    path.write_bytes(GOOD_LINE.encode() + b"\n" + raw + b"\n" + GOOD_LINE.replace("t1", "t3").encode() + b"\n")
    try:
        index = TaskIndex.build(path, {"math": 1.0})
    except ConfigError as exc:
        assert f"{path}:2" in str(exc), str(exc)  # file:line of the bad line
    else:
        assert index.count() in (2, 3)  # the line was blank or a valid task
