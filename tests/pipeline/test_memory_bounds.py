"""Redis memory and work bounded by configuration (issue 13 item 4): the slime data source
finds its recorded steps through one index key (`{ns}:steps`), never by scanning the
keyspace, on start and on `load`; `save` trims the index with the records."""

from __future__ import annotations

from types import SimpleNamespace

import redis.asyncio as aioredis

from pipeline.keys import Keys
from pipeline.slime.data_source import RedisDataSource, generate_rollout
from tests.chaos.test_chaos_trainer import B, N, _fingerprint, _push


def _args(url: str, ns: str) -> SimpleNamespace:
    return SimpleNamespace(pipeline_redis_url=url, pipeline_namespace=ns, rollout_batch_size=B,
                           n_samples_per_prompt=N, pipeline_eta=100, pipeline_wait_timeout_s=30.0,
                           pipeline_publish_engine=False)


def test_start_and_load_find_recorded_steps_without_scanning(redis_url, namespace, monkeypatch):
    def no_scan(*_a, **_k):
        raise AssertionError("the data source scanned the keyspace")

    monkeypatch.setattr(aioredis.Redis, "scan_iter", no_scan)
    monkeypatch.setattr(aioredis.Redis, "scan", no_scan)
    _push(redis_url, namespace, 0, 4 * B)
    first = RedisDataSource(_args(redis_url, namespace))
    seen = {rid: _fingerprint(generate_rollout(first.args, rid, first).samples) for rid in range(3)}
    first.save(0)
    steps = first._run(first._redis.zrange(Keys(namespace).recorded_steps, 0, -1))
    first.close()
    assert [int(s) for s in steps] == [1, 2]  # step 0 acknowledged: its index entry went with its record

    resumed = RedisDataSource(_args(redis_url, namespace))  # start: reads the index
    assert sorted(resumed._recorded) == [1, 2]
    resumed.load(0)
    replay = {rid: _fingerprint(generate_rollout(resumed.args, rid, resumed).samples) for rid in (1, 2)}
    resumed.save(2)
    left = resumed._run(resumed._redis.zcard(Keys(namespace).recorded_steps))
    resumed.close()
    assert replay == {1: seen[1], 2: seen[2]}
    assert left == 0


async def test_dead_letters_are_bounded_and_their_payloads_capped(redis, keys, monkeypatch):
    import pipeline.store.buffer as buffer_mod
    from pipeline.keys import Counter
    from pipeline.store.buffer import GroupBuffer

    monkeypatch.setattr(buffer_mod, "DEAD_MAXLEN", 100)
    monkeypatch.setattr(buffer_mod, "DEAD_PAYLOAD_MAX", 1000)
    buffer = GroupBuffer(redis, keys)
    for i in range(500):
        await buffer.dead_letter(source="test", reason=f"r{i}", payload=b"x" * 5000, ref=str(i))
    length = await redis.xlen(keys.dead)
    (_, last), = await redis.xrevrange(keys.dead, count=1)
    assert length < 250, length  # MAXLEN ~ 100: trimmed in whole macro-nodes, never unbounded
    assert int(await redis.hget(keys.counters, Counter.DEAD)) == 500  # the counter keeps the total
    assert len(last[b"payload"]) == 1000 and last[b"payload_bytes"] == b"5000" and last[b"ref"] == b"499"
