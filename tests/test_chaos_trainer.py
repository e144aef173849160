"""Chaos on the trainer side: a crash between get_samples and save, then resume from the
checkpoint (replayed batches identical); Redis restarted (appendonly) mid-run (what was
acknowledged stays acknowledged, what was pushed is not lost, the reader reconnects)."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

from pipeline.buffer import GroupBuffer
from pipeline.keys import Keys
from pipeline.local_redis import LocalRedis
from pipeline.redis_conn import connect
from pipeline.slime import RedisDataSource, generate_rollout
from pipeline.synthetic import make_group

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(120)]
B, N = 4, 2


def _args(url: str, ns: str) -> SimpleNamespace:
    return SimpleNamespace(pipeline_redis_url=url, pipeline_namespace=ns, rollout_batch_size=B,
                           n_samples_per_prompt=N, pipeline_eta=100, pipeline_wait_timeout_s=30.0,
                           pipeline_publish_engine=False)


def _push(url: str, ns: str, first: int, count: int) -> None:
    async def go() -> None:
        client = connect(url)
        buffer = GroupBuffer(client, Keys(ns))
        await buffer.ensure_group()
        for i in range(first, first + count):
            await buffer.push(make_group(f"g{i}:0", n=N, seed=i))
        await client.aclose()

    asyncio.run(go())


def _fingerprint(batch: list[list]) -> list[tuple]:
    """Everything the trainer sees of a batch: ids, indices, tokens, rewards."""
    return [(s.metadata["pipeline"]["group_id"], s.group_index, s.index, tuple(s.tokens), s.reward)
            for group in batch for s in group]


def test_crash_between_get_samples_and_save_replays_identical_batches(redis_url, namespace):
    _push(redis_url, namespace, 0, 6 * B)
    first = RedisDataSource(_args(redis_url, namespace))
    seen = {}
    for rid in range(4):
        seen[rid] = _fingerprint(generate_rollout(first.args, rid, first).samples)
        if rid == 1:
            first.save(1)  # checkpoint after step 1; steps 2 and 3 were trained but never saved
    first.close()  # the crash: no save(2), no save(3)

    resumed = RedisDataSource(_args(redis_url, namespace))
    resumed.load(1)
    replay = {rid: _fingerprint(generate_rollout(resumed.args, rid, resumed).samples) for rid in (2, 3)}
    fresh = _fingerprint(generate_rollout(resumed.args, 4, resumed).samples)
    resumed.close()
    report = {"replayed_steps": 2, "identical": replay == {2: seen[2], 3: seen[3]},
              "fresh_overlaps_old": bool({f[0] for f in fresh} & {f[0] for s in seen.values() for f in s})}
    print("\nCHAOS trainer crash report:", json.dumps(report))
    assert replay[2] == seen[2] and replay[3] == seen[3]
    assert not report["fresh_overlaps_old"]  # step 4 gets new groups, nothing twice


def test_redis_restart_mid_run_keeps_acknowledged_and_pushed(namespace, tmp_path):
    with LocalRedis(appendonly=True, data_dir=str(tmp_path)) as server:
        _push(server.url, namespace, 0, 3 * B)
        source = RedisDataSource(_args(server.url, namespace))
        before = [_fingerprint(generate_rollout(source.args, rid, source).samples) for rid in (0, 1)]
        source.save(1)  # steps 0-1 acknowledged
        server.restart()  # SIGTERM + start on the same port and AOF
        after_restart = _fingerprint(generate_rollout(source.args, 2, source).samples)  # same client reconnects
        _push(server.url, namespace, 3 * B, B)  # workers push again after the restart
        later = _fingerprint(generate_rollout(source.args, 3, source).samples)
        source.save(3)
        ready = len(source)
        source.close()
    trained = [f[0] for batch in (*before, after_restart, later) for f in batch[::N]]
    report = {"groups_trained": len(trained), "distinct": len(set(trained)), "ready_after": ready}
    print("\nCHAOS redis restart report:", json.dumps(report))
    assert sorted(trained) == sorted(f"g{i}:0" for i in range(4 * B))  # nothing lost, nothing twice
    assert ready == 0
